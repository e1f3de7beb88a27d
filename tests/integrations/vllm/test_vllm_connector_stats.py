"""KVFlowConnector's `get_kv_connector_stats` under the official vLLM release's real
`Scheduler`: each step reports that step's lookups and hit tokens (scheduler side),
loads, loaded tokens, failed blocks, stores and stored tokens (worker side), nothing
twice, and nothing on a step that moved nothing.

Like test_vllm_scheduler.py, .venv-vllm's python runs
tests/integrations/vllm/vllm_stats_run.py with the official release's
.venv-vllm-official/site first on its path, against a real kvflow server; see that
script for the steps; here, what each step's stats must be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.vllm_venv import run_under_official_vllm

RUNNER = Path(__file__).with_name("vllm_stats_run.py")
CHUNK = 32
BLOCK = 16
KEYS = (
    "lookups", "hit_tokens", "loads", "loaded_tokens", "load_failed_blocks", "stores",
    "stored_tokens",
)  # fmt: skip

pytestmark = pytest.mark.slow


def _stats(**counts: int) -> dict[str, int]:
    return {key: counts.get(key, 0) for key in KEYS}


#: what each request brings to the step that first schedules it
FIRST_STEP = {
    "a": _stats(lookups=1, stores=1, stored_tokens=2 * CHUNK),  # a miss: its chunks stored
    "b": _stats(lookups=1, hit_tokens=2 * CHUNK, loads=1, loaded_tokens=2 * CHUNK),
    "c": _stats(lookups=1, stores=1, stored_tokens=2 * CHUNK),
    # a hit whose objects were cleared before the load: every block failed
    "d": _stats(lookups=1, hit_tokens=2 * CHUNK, loads=1, load_failed_blocks=2 * CHUNK // BLOCK),
}


def _sum(*parts: dict[str, int]) -> dict[str, int]:
    return {key: sum(p[key] for p in parts) for key in KEYS}


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_under_official_vllm(RUNNER, tmp_path_factory.mktemp("vllm-stats"), CHUNK)


def test_each_step_reports_what_it_did_and_only_that(seen: dict[str, Any]) -> None:
    """A step that first schedules requests reports their lookups, loads and stores; a
    later step reports only what it moved itself (a recompute's store), a decode or idle
    step nothing: the counters start from zero each step."""
    steps = seen["steps"]
    assert {r for s in steps for r in s["new"]} == set(FIRST_STEP)
    recomputed = False
    for i, step in enumerate(steps):
        expected = _sum(_stats(), *(FIRST_STEP[r] for r in step["new"]))
        if step["phase"] == "3" and not step["new"] and "d" in step["scheduled"]:
            assert not recomputed, "d is recomputed once"
            recomputed = True  # vLLM recomputes d: its chunks are stored again
            expected = _stats(stores=1, stored_tokens=2 * CHUNK)
        got = step["stats"]
        if expected == _stats():
            assert got is None, (i, step)
        else:
            assert got == expected, (i, step)
    assert recomputed
    # the worker reported its own counters (the scheduler's are added by vLLM) in its
    # own stats class, and the failed load's blocks to vLLM
    for step in steps:
        if step["worker"] is not None:
            assert step["worker_stats_type"] == "KVFlowConnectorStats"
            assert step["worker"]["lookups"] == step["worker"]["hit_tokens"] == 0
    (failed,) = [s for s in steps if s["invalid"]]
    assert "d" in failed["new"] and len(failed["invalid"]) == 2 * CHUNK // BLOCK
    # the runs went through a decode step (b's and c's second token) and idle steps
    decode = [s for s in steps if s["phase"] == "2" and s["scheduled"] and not s["new"]]
    assert decode and all(s["stats"] is None for s in decode)
    assert [s["stats"] for s in steps if s["phase"].endswith("-idle")] == [None] * 3


def test_vllms_logger_and_aggregator_sum_the_steps(seen: dict[str, Any]) -> None:
    """vLLM's KV-transfer logger rebuilds each payload with build_kv_connector_stats and
    sums them; its worker-output aggregator sums the ranks' stats."""
    total = _sum(*FIRST_STEP.values(), _stats(stores=1, stored_tokens=2 * CHUNK))
    (line,) = seen["logged"]
    assert line == "KV Transfer metrics: " + ", ".join(f"{k}={v}" for k, v in total.items())
    assert seen["two_ranks_type"] == "KVFlowConnectorStats"
    loaded = next(s for s in seen["steps"] if "b" in s["new"])["worker"]
    assert loaded["loads"] == 1 and loaded["loaded_tokens"] == 2 * CHUNK
    assert seen["two_ranks"] == {k: 2 * v for k, v in loaded.items()}
