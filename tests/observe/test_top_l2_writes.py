"""`kvflow top` shows how often stores waited for L2 writes and what was dropped."""

from __future__ import annotations

import threading

import numpy as np
from rich.console import Console

from kvflow.core.observe.snapshot import Snapshot
from kvflow.core.observe.top import render
from tests.support.engine import CHUNK, caches, small_engine
from tests.support.tiers import SlowTier, memory_tier


def _screen(status: dict[str, object]) -> str:
    console = Console(record=True, width=140)
    console.print(render(Snapshot.of(status), None))
    return console.export_text()


def test_top_shows_l2_write_waits_and_drops() -> None:
    """A stalled tier: after two stores past the backlog, top's L2 line counts the waits
    and the dropped chunks in one burst; an engine without L2 shows no such line."""
    tier = SlowTier(memory_tier(1 << 20), delay_s=0.0)
    tier.gate = threading.Event()
    engine, _ = small_engine(l1_bytes=16 * 1024, l2_tiers=[tier], l2_backlog_wait_s=0.02)
    src, kw = caches("vllm_flash_attn", seed=1, num_blocks=16)
    engine.register_kv_caches("src", src, model_name="m", **kw)
    for i in range(3):  # 8 chunks each; the backlog takes 8: two stores drop theirs
        tokens = np.arange(1000 * i, 1000 * i + 8 * CHUNK, dtype=np.int32)
        engine.store("src", tokens, list(range(16)), request_id=f"s{i}")
    screen = _screen(engine.status())
    tier.gate.set()
    engine.close()
    assert "L2 writes" in screen and "dropped 16 chunks in 1 bursts" in screen
    assert "waited 2 times" in screen
    plain, _ = small_engine()
    try:
        assert "L2 writes" not in _screen(plain.status())
    finally:
        plain.close()
