"""A new user's first contact with the command line, through the real CLI (subprocesses, real etcd,
real nodes): the admin's ``/docs`` needs no CDN.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from kvring.local.cluster import free_port

KVRING = [sys.executable, "-P", "-m", "kvring.cli"]  # -P: see scripts/setup.sh


def test_admin_docs_load_nothing_from_another_host(etcd_server):
    """A real `kvring admin`: /docs and /redoc reference scripts and styles the admin serves itself."""
    port = free_port()
    proc = subprocess.Popen([*KVRING, "admin", "--etcd", etcd_server.endpoint, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                with urllib.request.urlopen(f"{base}/healthz", timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        for page in ("/docs", "/redoc"):
            with urllib.request.urlopen(base + page, timeout=10) as r:
                html = r.read().decode()
            assert r.status == 200
            assets = re.findall(r"""<(?:script|link)\b[^>]*?\b(?:src|href)\s*=\s*["']([^"']+)["']""", html)
            assert len(assets) >= (3 if page == "/docs" else 2), html  # the script, the stylesheet, the icon
            for url in assets:
                assert not re.match(r"(?i)(https?:)?//", url), f"{page} loads {url} from another host"
                with urllib.request.urlopen(base + url, timeout=10) as r:
                    assert r.status == 200 and len(r.read()) > 1000, url
            hosts = set(re.findall(r"(?i)\b(?:https?:)?//([a-z0-9.-]+\.[a-z]{2,})", html))
            assert hosts == set(), f"{page} names other hosts: {hosts}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
