"""The package import rules of docs/ARCHITECTURE.md hold in every module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvflow"

#: package -> the kvflow packages its modules may import (besides itself)
ALLOWED = {
    "cuda": set(),
    "events": {"cuda"},
    "subscribers": {"events"},
    "kernels": {"cuda"},
    # engine adapters (docs/VLLM.md) drive the server through kvflow.core's client
    "integrations": {"core"},
}

#: room of kvflow.core -> the rooms of kvflow.core its modules must not import
CORE_FORBIDDEN = {
    "engine": {"server", "demo", "observe"},
    "tiers": {"engine", "server", "demo", "observe"},
    "server": {"demo", "observe"},
    "observe": {"demo"},
    # replay and whatif read logs through kvflow.events/subscribers and kvflow.core.config only
    "replay": {"engine", "tiers", "server", "demo", "observe"},
}


def _imported_modules(path: Path) -> set[str]:
    """Every absolute module name a module imports (`import a.b`, `from a.b import c`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _kvflow_packages(path: Path) -> set[str]:
    """The kvflow sub-packages a module imports (`kvflow.X...` -> X)."""
    return {
        name.split(".")[1]
        for name in _imported_modules(path)
        if name.startswith("kvflow.") and name.split(".")[1] != "__version__"
    }


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_it_may(package: str) -> None:
    """cuda imports nothing of kvflow; events and kernels only cuda; subscribers only events."""
    for path in _modules(package):
        extra = _kvflow_packages(path) - ALLOWED[package] - {package}
        assert not extra, f"{path.relative_to(ROOT.parent)} imports kvflow.{sorted(extra)}"


@pytest.mark.parametrize("room", sorted(CORE_FORBIDDEN))
def test_core_room_keeps_out_of_the_rooms_above_it(room: str) -> None:
    """The engine never imports the server, the demo or the observer views; tiers none of
    them; the server neither the demo nor the views; the views (top, report) not the demo."""
    assert (ROOT / "core" / room).is_dir(), f"kvflow/core/{room} is missing"
    for path in _modules(f"core/{room}"):
        rooms = {
            name.split(".")[2]
            for name in _imported_modules(path)
            if name.startswith("kvflow.core.") and len(name.split(".")) > 2
        }
        bad = rooms & CORE_FORBIDDEN[room]
        assert not bad, f"{path.relative_to(ROOT.parent)} imports kvflow.core.{sorted(bad)}"


def test_the_bus_never_imports_the_stream_stamper() -> None:
    """kvflow/events/bus.py imports no part of kvflow.events.stream, not even lazily:
    whoever builds a bus attaches the stamper (docs/STREAM_EVENTS.md)."""
    names = _imported_modules(ROOT / "events" / "bus.py")
    bad = {n for n in names if n == "kvflow.events.stream" or n.startswith("kvflow.events.stream.")}
    assert not bad, f"kvflow/events/bus.py imports {sorted(bad)}"


def test_nothing_in_the_package_imports_test_helpers() -> None:
    """No module under kvflow/ imports the project's tests (tests/support and the like)."""
    for path in sorted(ROOT.rglob("*.py")):
        bad = {n for n in _imported_modules(path) if n == "tests" or n.startswith("tests.")}
        assert not bad, f"{path.relative_to(ROOT.parent)} imports {sorted(bad)}"


def test_benchmarks_import_no_test_module() -> None:
    """Benchmarks import nothing from tests/ and no testing utility (`kvflow.*.testing`)."""
    for path in sorted((ROOT.parent / "benchmarks").glob("*.py")):
        bad = {
            n
            for n in _imported_modules(path)
            if n.split(".")[0] == "tests" or (n.startswith("kvflow.") and "testing" in n.split("."))
        }
        assert not bad, f"{path.relative_to(ROOT.parent)} imports {sorted(bad)}"


def test_every_package_explains_itself() -> None:
    """Each folder of the package has an __init__.py whose docstring says what it holds."""
    for init in [ROOT / "__init__.py", *sorted(ROOT.rglob("*/__init__.py"))]:
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(ROOT.parent)} has no docstring"
