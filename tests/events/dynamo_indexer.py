"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer`` from the PyPI wheel
``ai-dynamo-runtime``), run by tests as a real process.

It lives in a virtual environment of its own, ``.venv/dynamo`` (its pins are not the project's),
which ``scripts/setup.sh`` creates.  The indexer runs with a working directory outside the
checkout (the top-level ``operator/`` folder would shadow the standard library's module).

``DynamoIndexer(block_size)`` starts it on a free loopback port; ``register`` adds a worker by
its ZMQ event endpoint and replay endpoint; ``credited(tokens)`` is what its ``/query`` answers for
a prompt: the tokens of the longest cached prefix it credits to each worker.  A ``BlockStored``
that says ``medium: "CPU"`` is credited in its ``cpu`` tier.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from kvring.local.cluster import free_port, stop_process_group

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv" / "dynamo"
PYTHON = VENV / "bin" / "python"
VERSION = "1.6.1"
MODEL = "kvring-test"


def require_installed() -> Path:
    if not PYTHON.exists():
        raise AssertionError(f"Dynamo's indexer is not installed in {VENV}: run scripts/setup.sh (it installs "
                             f"ai-dynamo-runtime=={VERSION} there)")
    return PYTHON


class DynamoIndexer:
    def __init__(self, block_size: int, directory: Path, port: int | None = None) -> None:
        """``directory``: where the indexer runs and logs (a test's temporary directory)."""
        self.block_size = block_size
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = directory
        self._log = directory / "indexer.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> DynamoIndexer:
        python = require_installed()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env["RUST_LOG"] = env.get("RUST_LOG", "info")
        with open(self._log, "ab") as log:
            self.proc = subprocess.Popen([str(python), "-m", "dynamo.indexer", "--block-size", str(self.block_size),
                                          "--port", str(self.port)], cwd=self._dir, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/workers", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"dynamo.indexer did not answer within {timeout}s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def register(self, instance_id: int, endpoint: str, replay_endpoint: str | None = None) -> None:
        body = {"instance_id": instance_id, "endpoint": endpoint, "model_name": MODEL, "block_size": self.block_size}
        if replay_endpoint:
            body["replay_endpoint"] = replay_endpoint
        r = httpx.post(f"{self.url}/register", json=body, timeout=10)
        assert r.status_code < 300, r.text

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.url}/workers", timeout=10).json()

    def query(self, tokens: list[int]) -> dict:
        r = httpx.post(f"{self.url}/query", json={"token_ids": list(tokens), "model_name": MODEL}, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def credited(self, tokens: list[int], tier: str = "longest_matched") -> dict[int, int]:
        """Tokens of ``tokens``' longest cached prefix the indexer credits to each worker: in any
        tier (``longest_matched``), or in one (``gpu``, ``cpu``, ``disk``).  Its answer has the
        per-worker, per-tier counts under ``instances`` (``scores`` counts the device tier only)."""
        return {int(worker): counts.get(tier, 0) for worker, counts in self.query(tokens)["instances"].items()}

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
            self.proc = None

