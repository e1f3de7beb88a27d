"""The suite's parallel run (tests/support/parallel.py): tests sharing a fixture share a worker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.parallel import group_by_shared_fixtures

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = """
import pytest
from tests.support.parallel import group_by_shared_fixtures

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    group_by_shared_fixtures(items)

@pytest.fixture(scope="session")
def server():
    return "server"

@pytest.fixture(scope="session")
def client(server):
    return "client of " + server

@pytest.fixture(scope="session")
def model():
    return "model"
"""

TESTS = """
import os
import pytest

@pytest.fixture(scope="module")
def per_module():
    with open(os.environ["SETUPS_FILE"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")
    return 1

@pytest.mark.parametrize("i", range(6))
def test_alone(i): pass

@pytest.mark.parametrize("i", range(6))
def test_module_fixture(per_module, i): assert per_module == 1

def test_client(client): pass

def test_server_and_model(server, model): pass

def test_model(model): pass

@pytest.mark.xdist_group("by-hand")
def test_marked(model): pass
"""


class _Groups:
    """Records each collected test's xdist_group (None when it has none)."""

    def __init__(self) -> None:
        self.groups: dict[str, str | None] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            mark = item.get_closest_marker("xdist_group")
            self.groups[item.name] = mark.args[0] if mark else None


def _suite(tmp_path: Path) -> Path:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_shared.py").write_text(textwrap.dedent(TESTS))
    return tmp_path


def test_tests_linked_by_shared_fixtures_get_one_group(tmp_path: Path) -> None:
    """Session fixtures used together (client->server, server+model, model) make one group;
    a module fixture groups its module; a test without one, or marked by hand, is left."""
    suite = _suite(tmp_path)
    groups = _Groups()
    args = ["--collect-only", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", str(suite)]
    assert pytest.main(args, plugins=[groups]) == 0
    linked = {
        groups.groups[name] for name in ("test_client", "test_server_and_model", "test_model")
    }
    assert len(linked) == 1 and linked <= {
        f"conftest.py::{n}" for n in ("client", "server", "model")
    }
    assert {groups.groups[f"test_module_fixture[{i}]"] for i in range(6)} == {"test_shared.py"}
    assert {groups.groups[f"test_alone[{i}]"] for i in range(6)} == {None}
    assert groups.groups["test_marked"] == "by-hand"


def test_an_unmarked_item_list_without_fixtures_is_left_alone() -> None:
    """No items, no marks: the hook is safe on an empty collection."""
    items: list[pytest.Item] = []
    group_by_shared_fixtures(items)
    assert items == []


def test_a_module_fixture_is_set_up_once_on_two_workers(tmp_path: Path) -> None:
    """Under `-n 2 --dist loadgroup` the six tests of a module fixture run on one worker,
    so it is set up once (spread one by one, both workers would set it up)."""
    suite = _suite(tmp_path / "suite")
    base = tmp_path / "base"
    setups = tmp_path / "setups"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
         "no:randomly", "-p", "no:cacheprovider", "--basetemp", str(base), str(suite)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "SETUPS_FILE": str(setups)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "16 passed" in done.stdout
    workers = setups.read_text().split()
    assert len(workers) == 1 and workers[0] in ("gw0", "gw1"), (
        f"the module fixture was set up on {workers}: xdist did not keep its group together"
        f" (pytest {pytest.__version__}; see the pin in pyproject.toml)"
    )
