#!/usr/bin/env bash
# The connector's CUDA path on a GPU machine that has PyTorch but neither vLLM nor a network: the
# CUDA tests against a real etcd and real node processes, then `kvring bench gpu`, then `kvring
# bench reads` (a prompt's load over TLS with a reader thread per node or not, on the machine's
# many cores).  From the repository root:
#
#     bash scripts/gpu-check.sh
#
# It needs .whl/ (ignored by git) beside it, for the machine's CPython 3.12 on x86-64: Debian's
# etcd-server package, and wheels of what the worker side, the tests and `kvring node` import
# besides torch, numpy, pytest (with pytest-timeout), xxhash, psutil, prometheus-client and
# matplotlib, which the machine has: pyzmq, msgspec, aetcd and cryptography (with cffi and pycparser),
# which it lacks, and, in the versions
# kvring is tested with here, grpcio and protobuf (aetcd's generated code needs grpcio >= 1.66.2 and
# protobuf >= 5.27.2) and typer (which needs pydantic) with rich and their own dependencies.
# Nothing is installed outside a temporary directory, removed at the end.  Results go to $OUT
# (default out/gpu-check): tests.log, bench.log, gpu.json, gpu.png, reads.log and reads.json.  Every
# step has a time limit; about 4 minutes on an H100 are expected, 10 at most.
#
# WHL and PYTHON name another wheel folder and interpreter (a rehearsal on another machine);
# PROFILE=1 also runs the bench under cProfile (profile.txt: where its host time goes).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

OUT=${OUT:-out/gpu-check}
WHL=${WHL:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
work=$(mktemp -d /tmp/kvring-gpu-check.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "gpu-check: $*" | tee -a "$OUT/tests.log" >&2; exit 1; }

echo "== set-up"
timeout 60 "$PY" -P -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$work/site" "$WHL"/*.whl || fail "installing the wheels in $WHL failed"
debs=("$WHL"/etcd-server_*.deb)
[ -f "${debs[0]}" ] || fail "no etcd-server .deb in $WHL (apt-get download etcd-server)"
if command -v dpkg >/dev/null; then
  timeout 30 dpkg -x "${debs[0]}" "$work/etcd" || fail "dpkg -x ${debs[0]} failed"
else  # a .deb is an ar archive holding data.tar.*
  timeout 30 "$PY" -P - "${debs[0]}" "$work/etcd" <<'EOF' || fail "unpacking ${debs[0]} failed"
import io, sys, tarfile
from pathlib import Path
data = Path(sys.argv[1]).read_bytes()
pos = 8
while pos < len(data):
    name, size = data[pos:pos + 16].decode().strip().rstrip("/"), int(data[pos + 48:pos + 58])
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(data[pos + 60:pos + 60 + size])).extractall(sys.argv[2], filter="tar")
    pos += 60 + size + size % 2
EOF
fi
export PATH="$work/etcd/usr/bin:$PATH"
# kvring as installed: pyproject.toml's package-dir puts kvring.cachenode, kvring.connector and
# kvring.operator in top-level folders, so the sources are assembled into one kvring package.
timeout 30 "$PY" -P - "$work/src" <<'EOF' || fail "assembling the kvring package failed"
import shutil, sys, tomllib
from pathlib import Path
mapping = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
for package, folder in sorted(mapping.items()):
    shutil.copytree(folder, Path(sys.argv[1]).joinpath(*package.split(".")),
                    ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
EOF
export PYTHONPATH="$work/src:$work/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

echo "== machine"
timeout 15 nvidia-smi -L || echo "(no nvidia-smi)"
# -P everywhere (python -m and python - put the current folder first on sys.path): the repository
# root's operator/ would shadow the standard library's operator module.
timeout 60 "$PY" -P - <<'EOF' || fail "kvring's worker side does not import here"
import shutil, sys
import torch
sys.modules["vllm"] = None  # as on a machine without vLLM, even if one is there
import kvring.connector.worker
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else None}; "
      f"kvring's worker side imports without vLLM; etcd at {shutil.which('etcd')}")
EOF

echo "== CUDA tests"
# Only pytest-timeout of the machine's pytest plugins (pyproject.toml sets its per-test limit).
timeout -k 10 180 env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -P -m pytest -q -p no:cacheprovider -p pytest_timeout \
    -rs --durations=10 --continue-on-collection-errors -k cuda \
    tests/connector/test_copies.py tests/connector/test_copies_batched.py tests/connector/test_worker_loads.py \
    tests/connector/test_worker_shards.py \
    tests/test_bench_gpu.py 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
if grep -q "needs CUDA" "$OUT/tests.log"; then
  echo "gpu-check: CUDA tests were skipped: torch sees no CUDA device here" | tee -a "$OUT/tests.log"
  tests=1
fi

echo "== kvring bench gpu"
timeout -k 10 150 "$PY" -P -m kvring.bench.gpu --budget 90 --json-out "$OUT/gpu.json" --plot "$OUT/gpu.png" 2>&1 \
    | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}

if [ -n "${PROFILE:-}" ]; then  # where the copy path's host time goes: the functions that spend the most
  echo "== kvring bench gpu under cProfile"
  timeout -k 10 150 "$PY" -P -c '
import cProfile, pstats, sys
from kvring.bench.gpu import main
sys.argv = ["kvring.bench.gpu", "--repetitions", "2"]
cProfile.run("main()", sys.argv[0] + ".prof")
pstats.Stats(sys.argv[0] + ".prof").sort_stats("tottime").print_stats(30)
' > "$OUT/profile.txt" 2>&1 || echo "gpu-check: the profiled run failed (see profile.txt)"
fi

echo "== kvring bench reads"
timeout -k 10 120 "$PY" -P - "$OUT/reads.json" <<'EOF' 2>&1 | tee "$OUT/reads.log"
import sys
from pathlib import Path
from kvring.bench.reads import ReadsSettings, run_bench_reads
run_bench_reads(ReadsSettings(tokens=8192, repetitions=15), json_out=Path(sys.argv[1]))
EOF
reads=${PIPESTATUS[0]}

echo "== gpu-check: tests exit $tests, bench exit $bench, reads exit $reads"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$reads" -eq 0 ]
