"""KVFlowHiCacheStorage under SGLang's own classes (sglang 0.5.23 in .venv-sglang).

The checks live in sglang_checks.py and run in one process of the SGLang venv's python
(SGLang's import alone takes seconds); each is reported here as a test of its own,
failing with the check's traceback. What each proves is its docstring there:
SGLang's StorageBackendFactory building the backend from the extra-config JSON, MHA
and MLA host pools in every layout round-tripping bit-exact through a real `kvflow
server` into a second engine's pool, prefix semantics with a missing page, tensor
parallel / pipeline stage / model / salt isolation, and the failures (server down, hung,
restarted, killed mid-set, evicted pages, malformed indices) answered as False or a
shorter prefix.
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
CHECKS_FILE = Path(__file__).with_name("sglang_checks.py")
RUN_TIMEOUT_S = 600
PROBE = (
    "from kvflow.integrations.sglang import synthetic; "
    "synthetic.allow_torchvision_without_its_operators(); "
    "import sglang, kvflow.integrations.sglang"
)

# whole engines (vLLM's start-up and model load, or SGLang's import and 13 checks) on the
# 2-core box beside make test's other workers: 190-295 s measured, so past the suite's
# 300 s per-test default; a hang still fails at 900 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _check_names() -> list[str]:
    """The @check functions of sglang_checks.py, read from its source (no SGLang import)."""
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
    # the import the checks make: torchvision's operators declared first, as they do
    probe = subprocess.run(
        [python, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    if probe.returncode != 0:
        missing(
            f"SGLang in {python}",
            f"the venv cannot import sglang and kvflow ({probe.stderr.strip().splitlines()[-1:]})",
            PARTS["sglang-venv"].install,
        )
    out = tmp_path_factory.mktemp("sglang") / "results.json"
    proc = subprocess.run(
        [python, str(CHECKS_FILE), str(out)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=ROOT,
    )  # fmt: skip
    if not out.exists():
        pytest.fail(f"sglang_checks.py wrote no results:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return dict(json.loads(out.read_text()), _log=(proc.stdout + proc.stderr)[-4000:])


@pytest.mark.parametrize("name", _check_names())
def test_sglang_check(results: dict[str, Any], name: str) -> None:
    assert name in results, f"{name} did not run (the run stopped early):\n{results['_log']}"
    failure = results[name]
    assert failure is None, f"{name} failed inside SGLang's venv:\n{failure}"
