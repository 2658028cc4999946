"""A real Prometheus server for tests: Debian's ``prometheus`` binary on a free loopback port,
with a temporary storage directory, scraping the targets a test names.

Targets come from a file (``file_sd_configs``) that Prometheus watches, so a test can add one
while it runs (a node that joins).  Each target carries the labels a test gives it (``job``,
``namespace``, ``pod``, ``cachecluster``: what the chart's PodMonitors give the real ones).

Importable as ``prometheus_server`` from every test folder (like ``polling``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from kvring.common.tls import CERT_NAME
from kvring.local.cluster import free_port, stop_process_group


def find_prometheus() -> str:
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
    if found is None:
        raise FileNotFoundError("the prometheus server is not installed: run scripts/setup.sh (it installs "
                                "Debian's prometheus package, which brings /usr/bin/prometheus)")
    return found


def rate_interval(step_s: float, scrape_s: float) -> str:
    """Grafana's ``$__rate_interval`` for a query at ``step_s`` over series scraped every ``scrape_s``:
    max(``$__interval`` + scrape interval, 4 x scrape interval), ``$__interval`` being the step."""
    return f"{max(step_s + scrape_s, 4 * scrape_s):g}s"


class LocalPrometheus:
    """``prometheus`` scraping ``/metrics`` of the targets in ``targets`` every ``scrape_s`` seconds;
    ``https://`` targets over TLS, checking their certificates against ``ca_file`` (and the name
    every kvring certificate carries, ``CERT_NAME``)."""

    def __init__(self, scrape_s: float = 1.0, ca_file: str | None = None) -> None:
        self.scrape_s = scrape_s
        self.ca_file = ca_file
        self.port = 0
        self.dir = Path(tempfile.mkdtemp(prefix="kvring-prometheus-"))
        self.targets: dict[str, dict[str, str]] = {}  # host:port -> labels
        self.proc: subprocess.Popen | None = None
        self.log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_target(self, address: str, **labels: str) -> None:
        """Scrape ``address`` (host:port, or an http:// or https:// URL) from now on, with ``labels``
        (the scheme as the ``__scheme__`` label, as the chart's PodMonitor relabels it)."""
        scheme = "https" if address.startswith("https://") else "http"
        address = address.removeprefix(f"{scheme}://").rstrip("/")
        self.targets[address] = {**labels, "__scheme__": scheme}
        groups = [{"targets": [addr], "labels": lab} for addr, lab in self.targets.items()]
        tmp = self.dir / "targets.json.tmp"
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, self.dir / "targets.json")  # Prometheus never reads a half-written file

    def start(self, timeout: float = 30.0) -> LocalPrometheus:
        if not (self.dir / "targets.json").exists():
            (self.dir / "targets.json").write_text("[]")
        interval = f"{self.scrape_s:g}s"
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [{
                "job_name": "kvring-test",  # each target's own "job" label takes precedence
                "file_sd_configs": [{"files": [str(self.dir / "targets.json")], "refresh_interval": interval}],
                **({"tls_config": {"ca_file": self.ca_file, "server_name": CERT_NAME}} if self.ca_file else {}),
            }],
        }
        (self.dir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.port = free_port()
        self.log = open(self.dir / "prometheus.log", "wb")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            [find_prometheus(), f"--config.file={self.dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with code {self.proc.returncode} at start:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"prometheus was not ready within {timeout}s:\n{self.log_tail()}")

    def api(self, path: str, **params: str | float) -> dict | list:
        """GET ``/api/v1/<path>``; its ``data``.  A query Prometheus refuses raises with its error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
            raise AssertionError(f"Prometheus refused {params}: {body.get('errorType')}: {body.get('error')}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """The matrix ``expr`` gives over [start, end] every ``step`` seconds: [{metric, values}]."""
        data = self.api("query_range", query=expr, start=start, end=end, step=step)
        assert data["resultType"] == "matrix", data
        return data["result"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """The instant vector ``expr`` gives (now, or at ``at``)."""
        params = {"query": expr} if at is None else {"query": expr, "time": at}
        return self.api("query", **params)["result"]

    def log_tail(self, chars: int = 4000) -> str:
        path = self.dir / "prometheus.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- prometheus log ---\n{text[-chars:]}"

    def close(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
            self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
