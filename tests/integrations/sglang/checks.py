"""What the SGLang check files share, run inside .venv-sglang: the check registry, a
`kvflow server` for a check, and the run of the checks in one process.

    python tests/integrations/sglang/checks.py OUT.json [NAME ...]

imports the check files (`CHECK_FILES`: sglang_checks.py, controller_checks.py), runs
every check (or the named ones) in this one process (SGLang's import alone takes 10 s of
CPU on the 2-core box) and writes {name: null | failure text} to OUT.json;
tests/integrations/sglang/sglang_venv.py runs it once for both test files. Each check
file declares torchvision's operators before it imports SGLang
(`synthetic.allow_torchvision_without_its_operators`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.e2e.server_proc import running_server  # noqa: E402

#: the modules whose checks a run imports, in the order they run
CHECK_FILES = ("sglang_checks", "controller_checks")

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    """Register `fn` as a check (run by `main`, named in the pytest report)."""
    assert fn.__name__ not in CHECKS, f"two checks named {fn.__name__}"
    CHECKS[fn.__name__] = fn
    return fn


@contextlib.contextmanager
def kvflow_server(chunk_size: int, *args: str) -> Iterator[str]:
    """A real `kvflow server` of `chunk_size`-token chunks (and `args`), its log in a
    temporary folder, for the block; yields its endpoint."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_server(chunk_size, Path(tmp) / "server.log", args) as endpoint,
    ):
        yield endpoint


def main() -> None:
    """`checks.py OUT.json [NAME ...]`: see the module's docstring."""
    out = Path(sys.argv[1])
    for name in CHECK_FILES:
        importlib.import_module(f"tests.integrations.sglang.{name}")
    wanted = sys.argv[2:]
    # in the check files' order whatever the order asked (the controller's checks publish
    # SGLang's ServerArgs and install CPU stand-ins: the storage checks come first); an
    # unknown name is reported as a failure (a KeyError)
    names = [name for name in CHECKS if not wanted or name in wanted]
    names += [name for name in wanted if name not in CHECKS]
    results: dict[str, str | None] = {}
    for name in names:
        try:
            CHECKS[name]()
            results[name] = None
        except BaseException:
            results[name] = traceback.format_exc()
        out.write_text(json.dumps(results))
    os._exit(0)  # SGLang's import leaves threads behind


if __name__ == "__main__":
    # run as a script this file is `__main__`; the check files register into the module
    # they import, so run that module's main
    importlib.import_module("tests.integrations.sglang.checks").main()
