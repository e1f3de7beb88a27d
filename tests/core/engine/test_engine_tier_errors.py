"""A tier that cannot say which keys it holds: each failed `contains` call is counted in
status, the first of a run of them is logged, and so is the tier answering again."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tests.support.engine import CHUNK, caches, small_engine
from tests.support.tiers import FaultyTier, memory_tier

T = np.arange(4 * CHUNK, dtype=np.int32)


def test_failed_contains_calls_are_counted_and_logged_once_per_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tier = FaultyTier(memory_tier())
    engine, _ = small_engine(l2_tiers=[tier])
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)

    def failures() -> int:
        count: int = engine.status()["l2"]["tiers"]["mem"]["contains_failures"]
        return count

    def logged(event: str) -> int:
        return sum(event in r.getMessage() for r in caplog.records)

    caplog.set_level(logging.WARNING, logger="kvflow.l2")
    assert engine.lookup(T, model_name="m") == 0
    assert failures() == 0 and logged("l2_contains_failed") == 0

    tier.fail = {"contains"}
    for _ in range(3):
        assert engine.lookup(T, model_name="m") == 0  # its keys count as misses
    assert failures() == 3
    assert logged("l2_contains_failed") == 1  # one line for the run, not one per call
    (line,) = [r.getMessage() for r in caplog.records if "l2_contains_failed" in r.getMessage()]
    assert "'mem'" in line and "injected contains failure" in line

    tier.fail = set()
    assert engine.lookup(T, model_name="m") == 0
    assert engine.lookup(T, model_name="m") == 0
    assert failures() == 3
    assert logged("l2_contains_recovered") == 1
    assert "after 3 failed calls" in caplog.records[-1].getMessage()
    engine.close()
