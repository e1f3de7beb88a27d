"""The SGLang checks seen from the main suite: their names, and one run of them in the
SGLang venv (`make sglang-venv`) for both test files.

test_sglang_storage.py and test_sglang_controller.py report the checks of
sglang_checks.py and controller_checks.py, which tests/integrations/sglang/checks.py runs
in one process of the venv's python: SGLang's import alone takes 10 s of CPU on the
2-core box, so the checks of both files share one import (conftest.py's `sglang_results`,
set up once on the one worker that runs both files), and the venv is checked to import
SGLang only when that run wrote no results.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.requirements import require_or_skip, venv_run_failed

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).parent
RUNNER = HERE / "checks.py"
#: every check of both files, the server-down and killed-server ones included
RUN_TIMEOUT_S = 600
PROBE = (
    "from kvflow.integrations.sglang import synthetic; "
    "synthetic.allow_torchvision_without_its_operators(); "
    "import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler, kvflow.integrations.sglang"
)


def check_names(checks_file: str) -> list[str]:
    """The @check functions of `checks_file` (here), read from its source (no SGLang import)."""
    tree = ast.parse((HERE / checks_file).read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "check" for d in node.decorator_list)
    ]


def run_checks(out: Path, names: Sequence[str]) -> dict[str, Any]:
    """Run the checks `names` in one process of the SGLang venv's python; {name: None |
    failure text}, and `_log`, the run's output's tail. A run that wrote no results fails
    the test, or reports the venv missing (a failure under CI, a skip elsewhere) when it
    cannot import SGLang and kvflow."""
    python = require_or_skip("sglang-venv", "the SGLang integration runs SGLang's own classes")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [python, str(RUNNER), str(out), *names],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=ROOT,
    )  # fmt: skip
    log = (proc.stdout + proc.stderr)[-6000:]
    if not out.exists():
        venv_run_failed(python, "sglang-venv", PROBE, f"{RUNNER.name} (no results)", log, env)
    return dict(json.loads(out.read_text()), _log=log[-4000:])


def assert_passed(results: dict[str, Any], name: str) -> None:
    """The check `name` ran and passed (else its traceback from inside SGLang's venv)."""
    assert name in results, f"{name} did not run (the run stopped early):\n{results['_log']}"
    failure = results[name]
    assert failure is None, f"{name} failed inside SGLang's venv:\n{failure}"
