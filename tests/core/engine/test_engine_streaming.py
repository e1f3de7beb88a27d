"""Requests larger than L1 with an L2 tier: stores stream through L1 into L2 and are held
whole, retrieves stream back window by window, write bursts against a slow tier wait
within --l2-backlog-wait-s instead of losing writes, and drops past it are counted and
logged once per burst."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.tiers.base import StorageTier
from kvflow.events import EventType
from kvflow.events.testing import RecordingSubscriber
from kvflow.subscribers import LoggingSubscriber
from tests.support.engine import CHUNK, block_bytes, caches, events_of, of_type, pairs, small_engine
from tests.support.tiers import SlowTier, memory_tier

L1_CHUNKS = 16
CHUNK_BYTES = 1024  # the default test caches' chunk object


class Big:
    """An engine with an L1 of L1_CHUNKS chunk objects, one L2 tier, and caches of
    `chunks` chunks: src (stores) and dst (retrieves)."""

    def __init__(self, chunks: int, tier: StorageTier | None = None, **config: Any) -> None:
        self.n = chunks
        self.tier = tier if tier is not None else memory_tier(chunks * CHUNK_BYTES * 2)
        self.engine: CacheEngine
        self.recorder: RecordingSubscriber
        self.engine, self.recorder = small_engine(
            l1_bytes=L1_CHUNKS * CHUNK_BYTES, l2_tiers=[self.tier], **config
        )
        self.src, self.src_kw = caches("vllm_flash_attn", seed=1, num_blocks=2 * chunks)
        self.dst, self.dst_kw = caches("vllm_flash_attn", seed=2, num_blocks=2 * chunks)
        self.engine.register_kv_caches("src", self.src, model_name="m", **self.src_kw)
        self.engine.register_kv_caches("dst", self.dst, model_name="m", **self.dst_kw)
        self.blocks = list(range(2 * chunks))

    def tokens(self, start: int = 0) -> np.ndarray:
        return np.arange(start, start + self.n * CHUNK, dtype=np.int32)

    def store(self, tokens: np.ndarray, request_id: str = "s") -> int:
        return self.engine.store("src", tokens, self.blocks, request_id=request_id)

    def retrieve(self, tokens: np.ndarray, request_id: str = "r") -> int:
        return self.engine.retrieve("dst", tokens, self.blocks, request_id=request_id)

    def exact(self) -> bool:
        got = block_bytes(self.dst, self.dst_kw, self.blocks)
        return torch.equal(got, block_bytes(self.src, self.src_kw, self.blocks))

    def drain(self) -> bool:
        tiering = self.engine._tiering
        assert tiering is not None
        return tiering.writes.drain(10.0)

    def l2(self) -> dict[str, Any]:
        status: dict[str, Any] = self.engine.status()["l2"]
        return status

    def ends(self, etype: EventType) -> list[dict[str, Any]]:
        return [dict(e.attrs) for e in of_type(events_of(self.recorder, self.engine), etype)]

    def close(self, timeout: float = 5.0) -> None:
        self.engine.close(timeout)
        list(pairs(events_of(self.recorder, self.engine)))  # every START got exactly one END


@pytest.mark.parametrize("times_l1", [1.5, 4, 20])
def test_a_store_larger_than_l1_is_held_whole_and_read_back_bit_exact(times_l1: float) -> None:
    """1.5x, 4x and 20x L1: the store returns every token (L1 plus L2), says per tier what
    it holds, and a retrieve streams the prefix back from L2 bit-exact."""
    s = Big(int(L1_CHUNKS * times_l1))
    t = s.tokens()
    assert s.store(t) == s.n * CHUNK
    assert s.drain()
    (end,) = s.ends(EventType.STORE_END)
    assert end["streamed"] and end["held_tokens"] == s.n * CHUNK
    assert end["tokens"] == s.n * CHUNK and end["l2_dropped_chunks"] == 0
    # L1 keeps what fits, L2 has every chunk (its writes answered, or were pending at END)
    assert end["tokens_by_tier"]["l1"] <= L1_CHUNKS * CHUNK
    assert end["tokens_by_tier"]["mem"] + end["l2_pending_tokens"] >= s.n * CHUNK
    assert s.l2()["tiers"]["mem"]["stored"] == s.n
    assert s.engine.lookup(t, model_name="m", prefetch=False) == s.n * CHUNK
    assert s.retrieve(t) == s.n * CHUNK
    assert s.exact()
    (got,) = s.ends(EventType.RETRIEVE_END)
    assert got["hit_tokens"] == s.n * CHUNK and got["l2_chunks"] >= s.n - L1_CHUNKS
    assert s.l2()["streamed"]["stores"] == 1
    assert s.l2()["write_through"]["dropped_chunks"] == 0
    assert s.engine.l1_stats()["writing"] == 0  # no window's reservation left behind
    s.close()


def test_the_head_of_a_streamed_store_stays_in_l1() -> None:
    """L1 keeps the request's first window (a retrieve starts copying from L1 at once)
    and evicts the streamed middle instead."""
    s = Big(4 * L1_CHUNKS)
    t = s.tokens()
    assert s.store(t) == s.n * CHUNK
    assert s.drain()
    assert s.retrieve(t) == s.n * CHUNK and s.exact()
    (got,) = s.ends(EventType.RETRIEVE_END)
    assert got["l2_chunks"] == s.n - L1_CHUNKS // 4  # the first quarter of L1 came from L1
    s.close()


def test_a_head_l1_held_before_the_streamed_store_stays_in_l1() -> None:
    """The same when L1 held the head before the store (a shorter request's): the store
    does not write it through again, so no write-through pin refreshes it, and the
    chunks it does write through are newer; the head is refreshed before each window
    makes its room, so the streamed middle still goes first."""
    s = Big(4 * L1_CHUNKS)
    t = s.tokens()
    head = L1_CHUNKS // 4
    assert s.engine.store("src", t[: head * CHUNK], s.blocks, request_id="short") == head * CHUNK
    assert s.drain()
    assert s.store(t) == s.n * CHUNK
    assert s.drain()
    assert s.retrieve(t) == s.n * CHUNK and s.exact()
    (got,) = s.ends(EventType.RETRIEVE_END)
    assert got["l2_chunks"] == s.n - head  # the head came from L1
    s.close()


def test_streamed_retrieve_without_write_back_frees_every_staged_object() -> None:
    """--no-l2-write-back: the windows are staged, copied and freed; L1 keeps none."""
    s = Big(4 * L1_CHUNKS, l2_write_back=False)
    t = s.tokens()
    assert s.store(t) == s.n * CHUNK
    assert s.drain()
    assert s.retrieve(t) == s.n * CHUNK and s.exact()
    assert s.l2()["in_flight"]["staged"] == 0
    assert s.engine.l1_stats()["writing"] == 0
    s.close()


def test_without_l2_a_store_still_stops_where_l1_is_full() -> None:
    """L1 only: the store returns the chunks L1 took, as before (nothing to stream to)."""
    engine, recorder = small_engine(l1_bytes=L1_CHUNKS * CHUNK_BYTES)
    src, kw = caches("vllm_flash_attn", seed=1, num_blocks=48)
    engine.register_kv_caches("src", src, model_name="m", **kw)
    t = np.arange(24 * CHUNK, dtype=np.int32)
    assert engine.store("src", t, list(range(48)), request_id="s") == L1_CHUNKS * CHUNK
    engine.close()
    list(pairs(events_of(recorder, engine)))


def test_a_write_burst_against_a_slow_tier_loses_nothing_within_the_bound() -> None:
    """A tier 2 ms per chunk slower than the store: a 4x-L1 burst waits for it (the wait
    is counted) and every chunk reaches L2; the store takes about the tier's time for
    what does not fit in the backlog."""
    s = Big(4 * L1_CHUNKS, tier=SlowTier(memory_tier(1 << 20), delay_s=0.002))
    t = s.tokens()
    started = time.monotonic()
    assert s.store(t) == s.n * CHUNK
    took = time.monotonic() - started
    assert s.drain()
    wt = s.l2()["write_through"]
    assert wt["dropped_chunks"] == 0 and wt["waits"] > 0 and wt["waited_s"] > 0
    assert s.l2()["tiers"]["mem"]["stored"] == s.n
    # all but the backlog's 8 chunks were written before the store could go on
    assert took >= (s.n - L1_CHUNKS // 2) * 0.002
    assert s.retrieve(t) == s.n * CHUNK and s.exact()
    s.close()


def test_drops_past_the_bound_are_counted_and_logged_once_per_burst(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stalled tier: each store waits --l2-backlog-wait-s, then its chunks past the
    backlog skip L2 (counted); the burst is one warning when it starts (its first
    dropped END) and one when a store goes through whole again, not one per store."""
    tier = SlowTier(memory_tier(1 << 20), delay_s=0.0)
    tier.gate = threading.Event()
    s = Big(L1_CHUNKS // 4, tier=tier, l2_backlog_wait_s=0.05)
    caplog.set_level(logging.WARNING)
    for i in range(4):  # 4 chunks each: the first two fill the 8-chunk backlog
        assert s.store(s.tokens(1000 * i), request_id=f"s{i}") == s.n * CHUNK
    wt = s.l2()["write_through"]
    assert wt["dropped_chunks"] == 2 * s.n and wt["drop_bursts"] == 1 and wt["dropping"]
    assert s.l2()["tiers"]["mem"]["store_failures"] == 2 * s.n
    refused = [e for e in s.ends(EventType.L2_STORE_END) if e["error"] == "l2_backlog"]
    assert [e["failed_chunks"] for e in refused] == [s.n, s.n]
    tier.gate.set()  # the tier comes back: the next store's writes go through whole
    assert s.drain()
    assert s.store(s.tokens(9000), request_id="after") == s.n * CHUNK
    assert s.drain()
    (ended,) = [r.getMessage() for r in caplog.records if r.name == "kvflow.l2"]
    assert ended.startswith(f"l2_write_drop_burst_ended: {2 * s.n} chunks dropped in ")
    assert not s.l2()["write_through"]["dropping"]
    # the logging subscriber warns about the burst's first dropped END only
    LoggingSubscriber(logger=logging.getLogger("burst")).on_events(events_of(s.recorder, s.engine))
    warned = [r.msg for r in caplog.records if r.name == "burst"]
    assert [w["event"] for w in warned] == ["l2_store_end"]
    s.close()


def test_a_streamed_store_stops_at_a_dropped_window_and_returns_what_is_held() -> None:
    """L2 stalls mid-stream: the store waits the bound, drops the window past the backlog
    and stops there; what it returns is held (L1 has it) and a retrieve gets exactly that."""
    tier = SlowTier(memory_tier(1 << 20), delay_s=0.0)
    tier.gate = threading.Event()
    s = Big(4 * L1_CHUNKS, tier=tier, l2_backlog_wait_s=0.05)
    t = s.tokens()
    held = s.store(t)
    assert 0 < held < s.n * CHUNK and held % CHUNK == 0
    (end,) = s.ends(EventType.STORE_END)
    assert end["held_tokens"] == held and end["l2_dropped_chunks"] > 0
    assert s.engine.lookup(t, model_name="m", prefetch=False) >= held
    assert s.retrieve(t) >= held
    tier.gate.set()
    s.close()


def test_a_prefetch_larger_than_l1_fills_half_of_it_and_says_so() -> None:
    """A lookup whose L2 prefix is 4x L1 prefetches half of L1 and reports the rest as
    skipped; the retrieve after it still gets the whole prefix."""
    s = Big(4 * L1_CHUNKS)
    t = s.tokens()
    assert s.store(t) == s.n * CHUNK
    assert s.drain()
    s.engine.l1.drop_where(lambda key: True)  # a cold L1: everything is on L2
    assert s.engine.lookup(t, model_name="m", request_id="q") == s.n * CHUNK
    deadline = time.monotonic() + 5
    while not s.ends(EventType.PREFETCH_END):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (pf,) = s.ends(EventType.PREFETCH_END)
    assert pf["loaded_chunks"] == L1_CHUNKS // 2
    assert pf["skipped_chunks"] == s.n - L1_CHUNKS // 2
    assert s.l2()["prefetch"]["skipped"] == s.n - L1_CHUNKS // 2
    assert s.retrieve(t) == s.n * CHUNK and s.exact()
    s.close()
