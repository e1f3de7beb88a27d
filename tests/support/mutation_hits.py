"""The pytest plugin of mutation runs: mutmut sees the functions a test reaches inside the
subprocesses it starts, and a mutant's run ends without a final garbage collection.

mutmut's first pass records which test reaches which mutated function, and a mutant
then runs only against those tests. It records in the test process alone, so code that
runs only in a `kvflow server` subprocess counted as reached by no test ("no tests"),
however thoroughly the tests drive it through the socket. With this module:

- every Python subprocess started during that pass (`MUTANT_UNDER_TEST=stats`) imports
  `record_subprocess_hits` through a `sitecustomize.py` that `make mutation` puts first
  on PYTHONPATH; it appends each function's first hit since the current test began to
  `$KVFLOW_MUTATION_HITS/<pid>.hits`;
- this file, loaded into the test process as a pytest plugin (`-p`), starts a new epoch
  at each test's setup (so a server that outlives one test records again for the next)
  and, after each test's teardown, adds the functions logged meanwhile to that test in
  mutmut's record.

Mutant runs need nothing of this: the subprocesses inherit `MUTANT_UNDER_TEST` and
import the mutated copy from PYTHONPATH, so a mutant acts in them as it does in-process.

What a mutant run does need: a mutant that makes `KVFlowServer.__init__` raise before its
cleanup leaves a ZMQ context with an open socket in a reference cycle. When pytest's
session end collected it, the context's `term()` waited for that socket forever, and each
such mutant sat out mutmut's wall-clock limit (~8 minutes for `server.py`'s) instead of
the seconds its test took to fail. The verdict is decided by then and mutmut's child
leaves with `os._exit(exit status)` anyway, so the plugin does that itself once the
session has finished, before pytest's cleanup collects.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

HITS_ENV = "KVFLOW_MUTATION_HITS"
EPOCH = "epoch"
SITECUSTOMIZE = (
    "import os\n"
    f"if os.environ.get('MUTANT_UNDER_TEST') == 'stats' and os.environ.get({HITS_ENV!r}):\n"
    "    from tests.support.mutation_hits import record_subprocess_hits\n"
    "    record_subprocess_hits()\n"
)


def _running_a_mutant() -> bool:
    """True in mutmut's child that runs one mutant's tests (not its recording or forced-fail runs)."""
    return "__mutmut_" in os.environ.get("MUTANT_UNDER_TEST", "")


def _recording() -> Path | None:
    """The hits folder while mutmut's recording pass runs, else None."""
    folder = os.environ.get(HITS_ENV)
    if folder and os.environ.get("MUTANT_UNDER_TEST") == "stats":
        return Path(folder)
    return None


def _epoch_of(epoch: Path) -> tuple[int, int]:
    """Which test epoch is current: the epoch file is replaced (a new inode) per test."""
    try:
        st = epoch.stat()
    except FileNotFoundError:
        return (0, 0)
    return (st.st_ino, st.st_mtime_ns)


def _hit_logger(folder: Path) -> Callable[..., None]:
    """A stand-in for mutmut's hit recorder that appends first hits per epoch to a file."""
    fd = os.open(folder / f"{os.getpid()}.hits", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    epoch_file = folder / EPOCH
    seen: set[str] = set()
    current = _epoch_of(epoch_file)

    def record(name: str, caller: str | None = None) -> None:
        nonlocal current
        epoch = _epoch_of(epoch_file)
        if epoch != current:
            current = epoch
            seen.clear()
        if name not in seen:
            seen.add(name)
            os.write(fd, f"{name}\n".encode())

    return record


def record_subprocess_hits() -> None:
    """In a subprocess of the recording pass: log the mutated functions it runs."""
    folder = _recording()
    if folder is None:
        return
    import mutmut.mutation.trampoline as trampoline

    trampoline.record_trampoline_hit = _hit_logger(folder)  # type: ignore[assignment]


def install_sitecustomize(hook_dir: Path) -> None:
    """Write the sitecustomize.py that makes subprocesses log their hits."""
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)


#: how far into each subprocess's hits file the test process has read
_read_to: dict[Path, int] = {}


def _new_hits(folder: Path) -> set[str]:
    """The function names the subprocesses logged since the last call."""
    names: set[str] = set()
    for path in folder.glob("*.hits"):
        start = _read_to.get(path, 0)
        with path.open("rb") as f:
            f.seek(start)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits
        _read_to[path] = start + len(complete)
        names.update(line.decode() for line in complete.splitlines() if line)
    return names


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    folder = _recording()
    if folder is None:
        return
    tmp = folder / f"{EPOCH}.{os.getpid()}.tmp"
    tmp.write_text(item.nodeid)
    os.replace(tmp, folder / EPOCH)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, None]:
    yield
    folder = _recording()
    if folder is None:
        return
    from mutmut.state import state

    test = item.nodeid.removeprefix("mutants/")
    for name in _new_hits(folder):
        state().tests_by_mangled_function_name[name].add(test)


@pytest.hookimpl(hookwrapper=True)
def pytest_sessionfinish(exitstatus: int) -> Generator[None, Any, None]:
    """A mutant's run leaves as soon as its session has finished (module docstring: why)."""
    yield
    if _running_a_mutant():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(exitstatus))
