"""The operator's dependency rules, checked on its source: it reaches the data plane only
through etcd membership, and the Kubernetes libraries stay inside it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path) -> set[str]:
    """Absolute module names imported by one file (relative imports resolved in its package)."""
    package = {"operator": "kvring.operator", "cachenode": "kvring.cachenode", "connector": "kvring.connector",
               "kvring": "kvring"}[path.relative_to(ROOT).parts[0]]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                out.add(f"{base}.{node.module}" if node.module else base)
            else:
                out.add(node.module or "")
    return out


def test_the_operator_reaches_the_data_plane_only_through_membership():
    for path in sorted((ROOT / "operator").glob("*.py")):
        data_plane = {m for m in imports(path) if m.startswith(("kvring.cachenode", "kvring.connector", "vllm"))}
        assert data_plane <= {"kvring.cachenode.membership"}, f"{path.name} imports {sorted(data_plane)}"


def test_kopf_and_the_kubernetes_client_are_imported_only_by_the_operator():
    for folder in ("cachenode", "connector", "kvring"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            kube = {m for m in imports(path) if m.split(".")[0] in ("kopf", "kubernetes", "kubernetes_asyncio")}
            assert not kube, f"{path.relative_to(ROOT)} imports {sorted(kube)}"
