"""kvring's layering holds: the import-linter contracts in ``pyproject.toml``, checked on the
source, and what a process actually loads when it imports the operator or the admin API."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _assemble_package(dest: Path) -> Path:
    """The ``kvring`` package as an installed tree (``package-dir`` puts its components in
    top-level folders, which import-linter cannot follow): copies of the sources, nothing else."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(mapping.items()):
        shutil.copytree(ROOT / folder, dest.joinpath(*package.split(".")),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
    return dest


def test_import_contracts_hold(tmp_path):
    src = _assemble_package(tmp_path / "src")
    proc = subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=tmp_path, env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 7 kept, 0 broken" in proc.stdout, proc.stdout  # every contract was checked


def test_a_contract_that_breaks_is_reported(tmp_path):
    """The check is live: a vocabulary module importing the transport fails it."""
    src = _assemble_package(tmp_path / "src")
    (src / "kvring" / "common" / "units.py").write_text("import zmq\n")
    proc = subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=tmp_path, env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "the shared vocabulary loads no transport BROKEN" in proc.stdout, proc.stdout


def _loaded_by(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_importing_the_operator_loads_no_transport():
    loaded = _loaded_by("kvring.operator.main")
    assert not {m for m in loaded if m == "zmq" or m.startswith(("zmq.", "kvring.cachenode", "vllm", "torch"))}


def test_importing_the_admin_api_loads_no_transport():
    loaded = _loaded_by("kvring.admin")
    assert not {m for m in loaded if m == "zmq" or m.startswith(("zmq.", "kvring.cachenode", "vllm", "torch",
                                                                  "kopf"))}
