"""The package import rules of docs/ARCHITECTURE.md hold in every module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvflow"

#: package -> the kvflow packages its modules may import (besides itself)
ALLOWED = {
    "events": set(),
    "subscribers": {"events"},
    "kernels": set(),
}


def _kvflow_imports(path: Path) -> set[str]:
    """The kvflow sub-packages a module imports (`kvflow.X...` -> X)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvflow" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_it_may(package: str) -> None:
    """events import nothing of kvflow; subscribers only events; kernels nothing of servers or events."""
    for path in sorted((ROOT / package).rglob("*.py")):
        extra = _kvflow_imports(path) - ALLOWED[package] - {package}
        assert not extra, f"{path.relative_to(ROOT.parent)} imports kvflow.{sorted(extra)}"
