"""Where the vLLM tests find vLLM: the .venv-vllm interpreter `make vllm-venv` builds,
and the official release it runs scripts under (.venv-vllm-official/site)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from tests.e2e.server_proc import running_server
from tests.integrations.vllm.tiny_model import build_tiny_llama
from tests.support.requirements import PARTS, missing, require_or_skip

ROOT = Path(__file__).resolve().parents[3]
OFFICIAL = ROOT / ".venv-vllm-official" / "site"


def vllm_python() -> str:
    """The vLLM venv's python, checked to import vLLM and kvflow (else fail on CI, skip here)."""
    python = require_or_skip("vllm-venv", "the vLLM end-to-end test runs a real vLLM engine")
    probe = subprocess.run(
        [python, "-c", "import vllm, kvflow.integrations.vllm"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        missing(
            f"vLLM in {python}",
            f"the venv cannot import vllm and kvflow ({probe.stderr.strip().splitlines()[-1:]})",
            PARTS["vllm-venv"].install,
        )
    return python


def run_under_official_vllm(runner: Path, tmp: Path, chunk: int) -> dict[str, Any]:
    """Run `runner MODEL ENDPOINT OUT` with .venv-vllm's python and the official release
    first on its path (VLLM_TARGET_DEVICE=cpu), against a real kvflow server of `chunk`
    tokens, on a tiny Llama built in `tmp`; returns the JSON it wrote to OUT, checked to
    come from vLLM 0.33 with the kvflow connector loaded."""
    python = vllm_python()
    if not (OFFICIAL / "vllm" / "__init__.py").is_file():
        missing(
            f"the official vLLM release in {OFFICIAL.relative_to(ROOT)}",
            "this test runs the connector under the official release's Scheduler",
            "`make vllm-venv` (pip install --no-deps --target .venv-vllm-official/site vllm)",
        )
    model = build_tiny_llama(tmp / "tiny-llama")
    out = tmp / "seen.json"
    env = {
        **os.environ,
        "PYTHONPATH": f"{OFFICIAL}{os.pathsep}{ROOT}",
        "VLLM_TARGET_DEVICE": "cpu",
    }
    with running_server(chunk, tmp / "server.log") as endpoint:
        proc = subprocess.run(
            [python, str(runner), str(model), endpoint, str(out)],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            cwd=tmp,
        )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    seen: dict[str, Any] = json.loads(out.read_text())
    assert seen["vllm_version"].startswith("0.33"), seen["vllm_version"]
    assert seen["is_kvflow"]
    return seen
