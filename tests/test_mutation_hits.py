"""tests.support.mutation_hits: a mutant's run ends with its verdict even when pytest's
cleanup would wait forever on what the mutant left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]

#: a test that fails the way a mutant of `KVFlowServer.__init__` made the server tests
#: fail: a ZMQ context and its open socket left in a reference cycle, whose collection
#: (pytest's cleanup collects) waits in the context's term() for the socket forever
HALF_BUILT_SERVER = """
import gc

import zmq


class HalfBuilt:
    pass


def test_fails_leaving_a_context_in_a_cycle():
    gc.disable()  # only pytest's own cleanup collects it
    built = HalfBuilt()
    built.ctx = zmq.Context()
    built.socket = built.ctx.socket(zmq.ROUTER)
    built.self = built
    del built  # garbage now, but only a collection finds it
    raise AssertionError("the mutant's test fails")
"""


def _run_as(mutant: str, folder: Path) -> subprocess.CompletedProcess[str]:
    (folder / "test_half_built.py").write_text(HALF_BUILT_SERVER)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "MUTANT_UNDER_TEST": mutant, "PYTHONPATH": path}
    return subprocess.run(
        [*PYTEST, "-p", "tests.support.mutation_hits", "test_half_built.py"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_mutants_run_leaves_with_its_exit_status_before_pytest_collects(
    tmp_path: Path,
) -> None:
    """The run ends (exit 1: a test failed, so the mutant is killed) instead of hanging in
    pytest's final collection until mutmut's wall-clock limit."""
    done = _run_as("kvflow.core.server.server.xǁKVFlowServerǁ__init____mutmut_5", tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "F" in done.stdout
