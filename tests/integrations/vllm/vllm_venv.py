"""Where the vLLM tests find vLLM: the .venv-vllm interpreter `make vllm-venv` builds."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.requirements import PARTS, missing, require_or_skip

ROOT = Path(__file__).resolve().parents[3]


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
