"""SGLang's own HiCache controller driving KVFlowHiCacheStorage (sglang 0.5.23 in .venv-sglang).

The checks live in controller_checks.py and run in one process of the SGLang venv's
python, as test_sglang_storage.py runs sglang_checks.py; each is reported here as a test
of its own, failing with the check's traceback. They build the HiCache stack SGLang's
scheduler builds (published ServerArgs, a CPU device pool, `build_kv_only_stack`: host
pool, `HybridCacheController`, kvflow attached through `StorageBackendFactory`) and prove
that one controller's backup reaches a second controller's prefetch bit for bit (MHA and
MLA, two storage batches), and that with the server down the controller's operations
report failure (0 tokens) without an exception in its threads.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.requirements import PARTS, missing, require_or_skip

ROOT = Path(__file__).resolve().parents[3]
CHECKS_FILE = Path(__file__).with_name("controller_checks.py")
RUN_TIMEOUT_S = 600
PROBE = (
    "from kvflow.integrations.sglang import synthetic; "
    "synthetic.allow_torchvision_without_its_operators(); "
    "import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler, kvflow.integrations.sglang"
)

# SGLang's import (10-15 s) and three checks with their servers: about a minute alone on
# the 2-core box, several beside make test's other workers
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _check_names() -> list[str]:
    """The @check functions of controller_checks.py, read from its source (no SGLang import)."""
    tree = ast.parse(CHECKS_FILE.read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "check" for d in node.decorator_list)
    ]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = require_or_skip("sglang-venv", "the SGLang integration runs SGLang's own classes")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    probe = subprocess.run(
        [python, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    if probe.returncode != 0:
        missing(
            f"SGLang in {python}",
            f"the venv cannot import sglang and kvflow ({probe.stderr.strip().splitlines()[-1:]})",
            PARTS["sglang-venv"].install,
        )
    out = tmp_path_factory.mktemp("sglang-controller") / "results.json"
    proc = subprocess.run(
        [python, str(CHECKS_FILE), str(out)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=ROOT,
    )  # fmt: skip
    if not out.exists():
        pytest.fail(
            f"controller_checks.py wrote no results:\n{(proc.stdout + proc.stderr)[-6000:]}"
        )
    return dict(json.loads(out.read_text()), _log=(proc.stdout + proc.stderr)[-4000:])


@pytest.mark.parametrize("name", _check_names())
def test_sglang_controller_check(results: dict[str, Any], name: str) -> None:
    assert name in results, f"{name} did not run (the run stopped early):\n{results['_log']}"
    failure = results[name]
    assert failure is None, f"{name} failed inside SGLang's venv:\n{failure}"
