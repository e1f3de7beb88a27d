"""Parallel runs of the suite (`make test`: pytest-xdist, `--dist loadgroup`; docs/TESTING.md).

Tests that share one of the project's fixtures of a wider scope than a test (a
server, a Redis cluster, a model: scope class, module, package or session) are put in
one `xdist_group`, so they run on one worker and that fixture is set up once, not
once per worker; tests linked through such fixtures (one uses A and B, another B
and C) end in the same group. Other tests are spread one by one. A test marked
`xdist_group` by hand keeps its own group.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

#: scopes whose fixture value several tests share: grouped by module or by the fixture
_BY_MODULE = ("class", "module")
_BY_FIXTURE = ("package", "session")


def _defined_in_project(fixture: pytest.FixtureDef[object], root: Path) -> Path | None:
    """Where a fixture of the project's own tests is defined (relative to the root); None
    for pytest's and plugins' fixtures (tmp_path_factory...), which are installed packages."""
    path = Path(inspect.getsourcefile(fixture.func) or "").resolve()
    if "site-packages" in path.parts or not path.is_relative_to(root):
        return None
    return path.relative_to(root)


def shared_fixtures(item: pytest.Item) -> list[str]:
    """The shared fixtures of the project a test uses: its module for class- and
    module-scoped ones, `<file>::<name>` for package- and session-scoped ones."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    root = item.config.rootpath.resolve()
    found = []
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if not defs or defs[-1].scope not in (*_BY_MODULE, *_BY_FIXTURE):
            continue
        where = _defined_in_project(defs[-1], root)
        if where is None:
            continue
        if defs[-1].scope in _BY_MODULE:
            found.append(item.nodeid.split("::", 1)[0])
        else:
            found.append(f"{where.as_posix()}::{name}")
    return found


def group_by_shared_fixtures(items: list[pytest.Item]) -> None:
    """Mark the tests that share fixtures, linked or direct, with one `xdist_group`."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    uses = {}
    for item in items:
        if item.get_closest_marker("xdist_group") is None and (keys := shared_fixtures(item)):
            uses[item] = keys
            for key in keys[1:]:
                parent[root(key)] = root(keys[0])
    for item, keys in uses.items():
        item.add_marker(pytest.mark.xdist_group(root(keys[0])))


#: where the long tests live (engines in their venvs, end-to-end scripts, benchmark runs,
#: `kvflow report`): tens of seconds to minutes each, against well under a second for most
LONG_FIRST = ("tests/integrations/", "tests/e2e/", "tests/benchmarks/", "tests/observe/")


def long_first(items: list[pytest.Item]) -> None:
    """Put the long tests first, keeping the order otherwise (pytest-randomly's shuffle):
    with `--no-loadscope-reorder` xdist hands them out first, so none starts last and keeps
    one worker busy while the others are idle."""
    items.sort(key=lambda item: not item.nodeid.startswith(LONG_FIRST))
