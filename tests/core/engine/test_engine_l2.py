"""The engine's L2 path on a host-memory tier: write-through, lookup over tiers, prefetch,
retrieve's loads, write-back by prefix continuity, and tiers that hang, fail or lie."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.engine.keys import chain_hashes
from kvflow.core.engine.loads import Job, Loader
from kvflow.core.errors import InvalidRequestError, UnknownInstanceError
from kvflow.core.tiers.base import ObjectKey, StorageTier
from kvflow.events import Event, EventType
from kvflow.events.testing import RecordingSubscriber
from kvflow.kernels import cuda_available
from tests.support.engine import (
    CHUNK,
    block_bytes,
    caches,
    events_of,
    of_type,
    pairs,
    register_world,
    small_engine,
)
from tests.support.tiers import FaultyTier, memory_tier

N = 6  # chunks per request
T = np.arange(1000, 1000 + N * CHUNK, dtype=np.int32)
OTHER = np.arange(9000, 9000 + N * CHUNK, dtype=np.int32)
THIRD = np.arange(20000, 20000 + 4 * CHUNK, dtype=np.int32)
SRC = list(range(12))  # two blocks per chunk
DST = [*range(12, 16), *range(8)]
CHUNK_BYTES = 1024  # the default test caches' chunk object
L1_CHUNKS = 12  # L1 holds 12 chunk objects: T and OTHER fill it, THIRD evicts T's last 4


def wait_for(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


class Setup:
    """An engine with a small L1 and one L2 tier; instances src (stores) and dst."""

    def __init__(self, tier: StorageTier | None = None, world: int = 1, **config: Any) -> None:
        self.tier = tier if tier is not None else memory_tier()
        self.engine: CacheEngine
        self.recorder: RecordingSubscriber
        self.engine, self.recorder = small_engine(
            l1_bytes=L1_CHUNKS * CHUNK_BYTES, l2_tiers=[self.tier], **config
        )
        self.src, self.src_kw = caches("vllm_flash_attn", seed=1)
        self.dst, self.dst_kw = caches("vllm_flash_attn", seed=2)
        self.engine.register_kv_caches("src", self.src, model_name="m", **self.src_kw)
        self.engine.register_kv_caches("dst", self.dst, model_name="m", **self.dst_kw)

    def store_then_evict(self) -> None:
        """T goes to L1 and L2; OTHER and THIRD then evict T's last four chunks from L1."""
        assert self.engine.store("src", T, SRC, request_id="w1") == N * CHUNK
        assert self.drain()
        assert self.engine.store("src", OTHER, SRC, request_id="w2") == N * CHUNK
        assert self.drain()
        assert self.engine.store("src", THIRD, SRC, request_id="w3") == 4 * CHUNK
        assert self.drain()
        assert self.in_l1(T) == [True, True, False, False, False, False]

    def drain(self) -> bool:
        tiering = self.engine._tiering
        assert tiering is not None
        return tiering.writes.drain(5.0)

    def keys(self, tokens: np.ndarray) -> list[ObjectKey]:
        return [ObjectKey(h, "m", 1, 0, None) for h in chain_hashes(tokens, CHUNK)]

    def in_l1(self, tokens: np.ndarray) -> list[bool]:
        return self.engine.l1.contains(self.keys(tokens)).result()

    def events(self) -> list[Event]:
        return events_of(self.recorder, self.engine)

    def ends(self, etype: EventType) -> list[dict[str, Any]]:
        return [dict(e.attrs) for e in of_type(self.events(), etype)]

    def exact(self, chunks: int) -> bool:
        """dst's blocks of the first `chunks` chunks hold exactly src's."""
        n = 2 * chunks
        got = block_bytes(self.dst, self.dst_kw, DST[:n])
        return torch.equal(got, block_bytes(self.src, self.src_kw, SRC[:n]))

    def close(self) -> None:
        self.engine.close()
        list(pairs(self.events()))  # every START got exactly one END


def test_store_writes_new_chunks_through_to_every_tier() -> None:
    """A store's new L1 chunks reach the L2 tier in the background, each counted once."""
    s = Setup()
    s.engine.store("src", T, SRC, request_id="w1")
    assert s.drain()
    assert s.tier.contains(s.keys(T)).result() == [True] * N
    s.engine.store("src", T, SRC, request_id="w1")  # nothing new in L1: nothing re-written
    assert s.drain()
    (end,) = s.ends(EventType.L2_STORE_END)
    assert end["tier"] == "mem" and end["stored_chunks"] == N and end["failed_chunks"] == 0
    assert s.engine.status()["l2"]["tiers"]["mem"]["stored"] == N
    s.close()


def test_lookup_counts_l2_hits_by_tier_and_prefetches_them_into_l1() -> None:
    """Evicted chunks still hit (in L2); the lookup's prefetch puts them back in L1, so the
    retrieve then reads only L1."""
    s = Setup()
    s.store_then_evict()
    assert s.engine.lookup(T, model_name="m", request_id="q") == N * CHUNK
    wait_for(lambda: s.in_l1(T) == [True] * N)
    (lookup,) = [e for e in s.ends(EventType.LOOKUP_END) if e["tokens"] and e["hit_tokens"]]
    assert lookup["hit_tokens_by_tier"] == {"l1": 2 * CHUNK, "mem": 4 * CHUNK}
    (prefetch,) = s.ends(EventType.PREFETCH_END)
    assert prefetch["trigger"] == "lookup" and prefetch["written_back_chunks"] == 4
    assert s.engine.retrieve("dst", T, DST, request_id="q") == N * CHUNK
    assert s.exact(N)
    (retrieve,) = s.ends(EventType.RETRIEVE_END)
    assert retrieve["l2_chunks"] == 0
    assert [e["reason"] for e in s.ends(EventType.L2_LOAD_END)] == ["prefetch"]
    s.close()


def test_retrieve_loads_l1_misses_from_l2_and_writes_them_back() -> None:
    """Without a prefetch the retrieve itself loads the L2 part, bit-exact, and keeps it in L1."""
    s = Setup()
    s.store_then_evict()
    assert s.engine.lookup(T, model_name="m", prefetch=False) == N * CHUNK
    assert s.ends(EventType.PREFETCH_END) == []
    assert s.engine.retrieve("dst", T, DST, request_id="q") == N * CHUNK
    assert s.exact(N)
    assert s.ends(EventType.RETRIEVE_END)[0]["l2_chunks"] == 4
    (wb,) = s.ends(EventType.WRITE_BACK)
    assert wb == {
        "kept": 4, "discarded": 0, "bytes": 4 * CHUNK_BYTES, "reason": "retrieve",
        "keys": s.keys(T)[2:],  # the chunks now back in L1, for the KV-event stream
    }  # fmt: skip
    assert s.in_l1(T) == [True] * N
    s.close()


def test_a_gap_gives_the_prefix_before_it_and_writes_back_nothing_after_it() -> None:
    """Chunk 3's load fails: the retrieve returns chunks 0-2; chunks 4-5 loaded fine but are
    discarded and counted; dst's blocks after chunk 2 are untouched."""
    tier = FaultyTier(memory_tier())
    s = Setup(tier)
    s.store_then_evict()
    tier.lie_keys = {s.keys(T)[3]}
    before = block_bytes(s.dst, s.dst_kw, DST)
    assert s.engine.retrieve("dst", T, DST, request_id="q") == 3 * CHUNK
    assert s.exact(3)
    assert torch.equal(block_bytes(s.dst, s.dst_kw, DST[6:]), before[6:])
    (wb,) = s.ends(EventType.WRITE_BACK)
    assert (wb["kept"], wb["discarded"]) == (1, 2)
    assert s.in_l1(T) == [True, True, True, False, False, False]
    assert s.engine.status()["l2"]["tiers"]["mem"]["load_failures"] == 1
    s.close()


def test_without_write_back_l1_only_stages_the_loads() -> None:
    """--no-l2-write-back: retrieves still get every chunk, L1 keeps none of the loaded ones,
    and a prefetch's staged chunks are read by the retrieve instead of being loaded again."""
    tier = FaultyTier(memory_tier())
    s = Setup(tier, l2_write_back=False)
    s.store_then_evict()
    assert s.engine.retrieve("dst", T, DST, request_id="q1") == N * CHUNK
    assert s.exact(N)
    assert s.in_l1(T) == [True, True, False, False, False, False]
    assert s.ends(EventType.WRITE_BACK) == []
    loads = tier.calls["load"]
    assert s.engine.lookup(T, model_name="m", request_id="q2") == N * CHUNK
    wait_for(lambda: bool(s.ends(EventType.PREFETCH_END)))
    assert s.engine.retrieve("dst", T, DST, request_id="q2") == N * CHUNK
    assert tier.calls["load"] == loads + 1  # the prefetch's load only
    assert s.engine.status()["l2"]["in_flight"]["staged"] == 0  # claimed and freed
    assert s.in_l1(T) == [True, True, False, False, False, False]
    s.close()


def test_retrieve_waits_for_an_in_flight_prefetch_instead_of_loading_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retrieve of chunks a prefetch is loading waits for that load."""
    tier = FaultyTier(memory_tier())
    s = Setup(tier)
    s.store_then_evict()
    tier.gate = threading.Event()
    waiting = threading.Event()
    wait_prefix = Loader.wait_prefix

    def spy(self: Loader, job: Job, timeout: float) -> int:
        waiting.set()
        return wait_prefix(self, job, timeout)

    monkeypatch.setattr(Loader, "wait_prefix", spy)
    assert s.engine.lookup(T, model_name="m", request_id="q") == N * CHUNK
    got: list[int] = []
    reader = threading.Thread(
        target=lambda: got.append(s.engine.retrieve("dst", T, DST, request_id="q"))
    )
    reader.start()
    assert waiting.wait(5.0)
    assert not got  # waiting on the prefetch's load
    tier.gate.set()
    reader.join(5.0)
    assert got == [N * CHUNK] and s.exact(N)
    assert tier.calls["load"] == 1
    assert s.ends(EventType.RETRIEVE_END)[0]["l2_chunks"] == 4
    s.close()


def test_a_hung_tier_costs_a_request_at_most_the_timeout() -> None:
    """A tier that never answers: lookups and retrieves fall back to L1 within the timeout,
    stores return at once, and the server keeps serving."""
    tier = FaultyTier(memory_tier())
    s = Setup(tier, l2_timeout_s=0.2)
    s.store_then_evict()
    tier.hang = {"contains", "load", "store"}
    t0 = time.monotonic()
    assert s.engine.lookup(T, model_name="m") == 2 * CHUNK
    assert s.engine.retrieve("dst", T, DST, request_id="q") == 2 * CHUNK
    assert s.engine.store("src", T, SRC, request_id="w3") == N * CHUNK
    assert time.monotonic() - t0 < 2.0
    assert s.exact(2)
    tiering = s.engine._tiering
    assert tiering is not None
    assert not tiering.writes.drain(0.1)  # the hung store is still pending...
    s.engine.close(timeout=0.2)  # ...and close gives up on it after its timeout


def test_a_failing_tier_is_counted_and_l1_keeps_serving() -> None:
    """Store and load failures are counted in events and status; L1 hits still come back."""
    tier = FaultyTier(memory_tier())
    tier.fail = {"store", "load"}
    s = Setup(tier)
    assert s.engine.store("src", T, SRC, request_id="w1") == N * CHUNK
    assert s.drain()
    (end,) = s.ends(EventType.L2_STORE_END)
    assert end["ok"] is False and end["failed_chunks"] == N and end["error"] == "internal"
    assert s.engine.status()["l2"]["tiers"]["mem"]["store_failures"] == N
    assert s.engine.retrieve("dst", T, DST, request_id="q") == N * CHUNK
    assert s.exact(N)
    s.close()


def test_prefetch_needs_an_l2_tier_and_a_registered_model() -> None:
    """prefetch() without L2, or for a model whose ranks never registered, is a clear error."""
    engine, _ = small_engine()
    with pytest.raises(InvalidRequestError, match="--l2-disk"):
        engine.prefetch(T, model_name="m")
    engine.close()
    s = Setup()
    with pytest.raises(UnknownInstanceError, match=r"'nobody'.*never registered"):
        s.engine.prefetch(T, model_name="nobody")
    with pytest.raises(UnknownInstanceError, match=r"rank\(s\) \[0, 1\]"):
        s.engine.prefetch(T, model_name="m", world_size=2)
    with pytest.raises(UnknownInstanceError, match="unknown"):
        s.engine.prefetch_state("pf-999")
    s.close()


def test_prefetch_allocates_from_the_layout_desc_of_several_layer_groups() -> None:
    """With every instance unregistered, prefetch still sizes L1 objects from the recorded
    layout desc (two groups of different shapes and dtypes); a new instance then reads
    them from L1 bit-exact."""
    specs = [(2, 8, torch.bfloat16), (1, 12, torch.float32)]
    engine, recorder = small_engine(l1_bytes=1 << 20, l2_tiers=[memory_tier()])
    src, src_kw = caches("vllm_flash_attn", seed=1, layer_specs=specs)
    engine.register_kv_caches("src", src, model_name="g", **src_kw)
    engine.store("src", T, SRC, request_id="w")
    tiering = engine._tiering
    assert tiering is not None and tiering.writes.drain(5.0)
    engine.unregister("src")
    engine.l1.drop_where(lambda key: True)
    prefetch_id = engine.prefetch(T, model_name="g")
    wait_for(lambda: engine.prefetch_state(prefetch_id)["state"] == "done")
    state = engine.prefetch_state(prefetch_id)
    assert state["written_back_chunks"] == N and state["landed_tokens"] == N * CHUNK
    dst, dst_kw = caches("vllm_flash_attn", seed=2, layer_specs=specs)
    engine.register_kv_caches("dst", dst, model_name="g", **dst_kw)
    assert engine.retrieve("dst", T, DST, request_id="r") == N * CHUNK
    assert torch.equal(block_bytes(dst, dst_kw, DST), block_bytes(src, src_kw, SRC))
    events = events_of(recorder, engine)
    assert of_type(events, EventType.RETRIEVE_END)[0].attrs["l2_chunks"] == 0
    engine.close()


def test_world_of_two_hits_only_when_every_rank_is_in_some_tier() -> None:
    """Rank 0 in L1 and rank 1 only in L2 still hits; the prefetch loads just rank 1."""
    engine, recorder = small_engine(l1_bytes=1 << 20, l2_tiers=[memory_tier()])
    register_world(engine, 2)
    engine.store("tp0", T, SRC, request_id="w")
    assert engine.lookup(T, model_name="m", world_size=2) == 0
    engine.store("tp1", T, SRC, request_id="w")
    tiering = engine._tiering
    assert tiering is not None and tiering.writes.drain(5.0)
    engine.l1.drop_where(lambda key: key.rank == 1)
    assert engine.lookup(T, model_name="m", world_size=2, request_id="q") == N * CHUNK
    events = events_of(recorder, engine)
    wait_for(lambda: bool(of_type(events_of(recorder, engine), EventType.PREFETCH_END)))
    (end,) = of_type(events_of(recorder, engine), EventType.PREFETCH_END)
    assert end.attrs["chunks"] == N and end.attrs["written_back_chunks"] == N
    by_tier = of_type(events, EventType.LOOKUP_END)[-1].attrs["hit_tokens_by_tier"]
    assert by_tier == {"l1": 0, "mem": N * CHUNK}
    engine.close()


def test_a_slow_tier_pins_at_most_half_of_l1_and_never_fails_a_store() -> None:
    """Writes that never finish pin at most half of L1: later stores still succeed in
    full once they waited --l2-backlog-wait-s, and their chunks past the bound skip L2,
    counted as backlog failures."""
    tier = FaultyTier(memory_tier())
    tier.hang = {"store"}
    s = Setup(tier, l2_backlog_wait_s=0.2)
    assert s.engine.store("src", T, SRC, request_id="w1") == N * CHUNK  # pins 6 of 12
    assert s.engine.store("src", OTHER, SRC, request_id="w2") == N * CHUNK
    assert s.engine.store("src", THIRD, SRC, request_id="w3") == 4 * CHUNK
    assert s.in_l1(THIRD) == [True] * 4
    refused = [e for e in s.ends(EventType.L2_STORE_END) if e["error"] == "l2_backlog"]
    assert [e["failed_chunks"] for e in refused] == [N, 4]
    assert s.engine.status()["l2"]["tiers"]["mem"]["store_failures"] == N + 4
    s.engine.close(timeout=0.2)


def test_a_disk_tier_from_the_config_serves_every_visible_gpu(tmp_path: Path) -> None:
    """--l2-disk builds a disk tier sharded over the visible CUDA devices, or one GPU without CUDA."""
    engine, _ = small_engine(l2_disk_paths=(str(tmp_path / "disk"),), l2_disk_size_gb=0.01)
    try:
        detail = engine.status()["l2"]["tiers"]["disk"]["detail"]
    finally:
        engine.close()
    assert detail["num_gpus"] == (torch.cuda.device_count() if cuda_available() else 1)


def test_a_retrieve_waiting_on_l2_holds_no_lock_the_instance_needs() -> None:
    """While dst's retrieve of T waits for a stalled tier (T's last four chunks are only in
    L2), a retrieve of L1-resident chunks into dst's other blocks, a store from dst and a
    lookup all finish; once the tier answers, T's retrieve lands whole."""
    tier = FaultyTier(memory_tier())
    s = Setup(tier, l2_timeout_s=30.0)
    s.store_then_evict()
    tier.gate = threading.Event()
    got: dict[str, int] = {}
    slow = threading.Thread(
        target=lambda: got.setdefault("T", s.engine.retrieve("dst", T, DST, request_id="slow"))
    )
    slow.start()
    wait_for(lambda: tier.calls["load"] >= 1)  # the retrieve now waits on the tier
    others_done = threading.Event()
    fourth = np.arange(40000, 40000 + 2 * CHUNK, dtype=np.int32)

    def others() -> None:
        got["OTHER"] = s.engine.retrieve("dst", OTHER[: 2 * CHUNK], [8, 9, 10, 11], request_id="f")
        got["stored"] = s.engine.store("dst", fourth, [8, 9, 10, 11], request_id="s")
        got["lookup"] = s.engine.lookup(OTHER, model_name="m")
        others_done.set()

    threading.Thread(target=others, daemon=True).start()
    try:
        assert others_done.wait(10), "the instance's other work waited for the stalled tier"
        assert slow.is_alive(), "the slow retrieve did not wait for the tier"
    finally:
        tier.gate.set()
        slow.join(10)
    assert got == {"OTHER": 2 * CHUNK, "stored": 2 * CHUNK, "lookup": N * CHUNK, "T": N * CHUNK}
    want = block_bytes(s.src, s.src_kw, SRC)
    assert torch.equal(block_bytes(s.dst, s.dst_kw, DST), want)
    s.engine.close()
