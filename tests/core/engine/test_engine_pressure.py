"""CacheEngine under memory pressure and concurrency: readers are safe, writers are ordered."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.engine.movers import BlockRows, HostChunks
from kvflow.core.errors import CapacityError, TransferError
from tests.support.engine import CHUNK, block_bytes, caches, events_of, pairs, small_engine

BLOCKS = [0, 1, 2, 3]  # two chunks


def _chunk_bytes() -> int:
    engine, _ = small_engine()
    kv, kw = caches("vllm_flash_attn", seed=0)
    engine.register_kv_caches("probe", kv, model_name="m", **kw)
    n = int(engine.status()["instances"]["probe"]["chunk_nbytes"])
    engine.close()
    return n


def _gate_retrieve(
    engine: CacheEngine, instance_id: str, wave: int
) -> tuple[threading.Event, threading.Event]:
    """Make the instance's retrieve wait, at its `wave`-th enqueue (a retrieve pins and
    enqueues its chunks in waves: 1, 1, 2, ... here, as a CUDA mover's), until released."""
    mover = engine._instance(instance_id).mover
    mover.head_chunks = 1  # a CPU mover's op is one wave; the CUDA mover's first is small
    real = mover.retrieve
    entered, release = threading.Event(), threading.Event()
    calls = [0]

    def gated(srcs: HostChunks, block_ids: BlockRows, skips: Sequence[int]) -> None:
        calls[0] += 1
        if calls[0] == wave:
            entered.set()
            assert release.wait(10)
        real(srcs, block_ids, skips)

    mover.retrieve = gated  # type: ignore[method-assign]
    return entered, release


def _counted_retrieves(mover: Any) -> list[int]:
    """The chunks of each of `mover`'s retrieve calls from now on (it still copies them)."""
    real, calls = mover.retrieve, []

    def recorded(srcs: HostChunks, block_ids: BlockRows, skips: Sequence[int]) -> None:
        calls.append(len(srcs))
        real(srcs, block_ids, skips)

    mover.retrieve = recorded
    return calls


def test_eviction_under_pressure_never_evicts_an_object_being_read() -> None:
    """While a retrieve holds two chunks, stores evict only unpinned objects; data stays intact."""
    engine, recorder = small_engine(l1_bytes=4 * _chunk_bytes())
    src, kw = caches("vllm_flash_attn", seed=1)
    dst, _ = caches("vllm_flash_attn", seed=2)
    engine.register_kv_caches("writer", src, model_name="m", **kw)
    engine.register_kv_caches("reader", dst, model_name="m", **kw)
    x = np.arange(2 * CHUNK, dtype=np.int32)
    engine.store("writer", x, BLOCKS, request_id="x")
    want = block_bytes(src, kw, BLOCKS)
    entered, release = _gate_retrieve(engine, "reader", wave=2)  # both chunks pinned
    result: list[int] = []
    reader = threading.Thread(
        target=lambda: result.append(engine.retrieve("reader", x, [8, 9, 10, 11], request_id="r"))
    )
    reader.start()
    assert entered.wait(10)
    # L1 holds 4 chunks; x's 2 are pinned. Each new request needs 2 more.
    for i in range(1, 4):
        src[0].view(torch.uint8).view(-1)[: 64 * i].fill_(i)  # different bytes per request
        engine.store("writer", x + 1000 * i, BLOCKS, request_id=f"y{i}")
    assert engine.l1_stats()["evicted_chunks"] == 4
    release.set()
    reader.join(10)
    assert result == [2 * CHUNK]
    assert engine.lookup(x, model_name="m") == 2 * CHUNK
    assert engine.lookup(x + 3000, model_name="m") == 2 * CHUNK
    assert torch.equal(block_bytes(dst, kw, [8, 9, 10, 11]), want)
    engine.retrieve("reader", x, [12, 13, 14, 15], request_id="again")
    assert torch.equal(block_bytes(dst, kw, [12, 13, 14, 15]), want)
    list(pairs(events_of(recorder, engine)))
    engine.close()


def test_a_store_finding_every_object_pinned_fails_with_capacity_error() -> None:
    """No evictable object and no free room: CapacityError, a failed END, nothing visible."""
    engine, recorder = small_engine(l1_bytes=2 * _chunk_bytes())
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("writer", kv, model_name="m", **kw)
    engine.register_kv_caches("reader", kv, model_name="m", **kw)
    x = np.arange(2 * CHUNK, dtype=np.int32)
    engine.store("writer", x, BLOCKS, request_id="x")
    entered, release = _gate_retrieve(engine, "reader", wave=2)  # both chunks pinned
    reader = threading.Thread(
        target=engine.retrieve, args=("reader", x, BLOCKS), kwargs={"request_id": "r"}
    )
    reader.start()
    assert entered.wait(10)
    with pytest.raises(CapacityError, match="no room"):
        engine.store("writer", x + 1, BLOCKS, request_id="y")
    release.set()
    reader.join(10)
    assert engine.lookup(x + 1, model_name="m") == 0
    ends = [end.attrs for _, end in pairs(events_of(recorder, engine))]
    assert [e["error"] for e in ends] == [None, None, "resource_exhausted", None]
    engine.close()


@pytest.mark.parametrize("hit", ["none", "lookup", "retrieve"])
def test_a_hit_makes_its_chunks_the_most_recent(hit: str) -> None:
    """L1 holds 4 chunks: x (older) and y (newer) fill it, a third request evicts two.
    With no hit in between x goes; a lookup or a retrieve hitting x refreshes it, so y
    goes instead (hot prefixes stay in L1 however long ago they were stored)."""
    engine, _ = small_engine(l1_bytes=4 * _chunk_bytes())
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    x, y, z = (np.arange(2 * CHUNK, dtype=np.int32) + 1000 * i for i in range(3))
    engine.store("a", x, BLOCKS, request_id="x")
    engine.store("a", y, BLOCKS, request_id="y")
    if hit == "lookup":
        assert engine.lookup(x, model_name="m") == 2 * CHUNK
    elif hit == "retrieve":
        assert engine.retrieve("a", x, [4, 5, 6, 7], request_id="r") == 2 * CHUNK
    engine.store("a", z, BLOCKS, request_id="z")
    assert engine.l1_stats()["evicted_chunks"] == 2
    kept = {name: engine.lookup(t, model_name="m") for name, t in (("y", y), ("x", x))}
    if hit == "none":
        assert kept == {"x": 0, "y": 2 * CHUNK}
    else:
        assert kept == {"x": 2 * CHUNK, "y": 0}, f"a {hit} hit did not refresh recency"
    engine.close()


def test_concurrent_instances_store_and_retrieve_while_lookups_run() -> None:
    """Four instances on four threads, lookups on the main thread; every byte lands right."""
    engine, recorder = small_engine()
    made = [caches("vllm_flashinfer", seed=10 + i) for i in range(4)]
    for i, (kv, kw) in enumerate(made):
        engine.register_kv_caches(f"i{i}", kv, model_name=f"m{i % 2}", **kw)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for n in range(10):
                tokens = np.arange(2 * CHUNK, dtype=np.int32) + 100 * n + 10_000 * i
                engine.store(f"i{i}", tokens, BLOCKS, request_id=f"{i}-{n}")
                assert (
                    engine.retrieve(f"i{i}", tokens, [4, 5, 6, 7], request_id=f"{i}-{n}")
                    == 2 * CHUNK
                )
                engine.end_session(f"{i}-{n}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        engine.lookup(np.arange(2 * CHUNK, dtype=np.int32), model_name="m0")
        engine.status()
        time.sleep(0.001)  # leave the GIL to the workers between calls
    for t in threads:
        t.join()
    assert errors == []
    for kv, kw in made:
        assert torch.equal(block_bytes(kv, kw, [4, 5, 6, 7]), block_bytes(kv, kw, BLOCKS))
    assert len(list(pairs(events_of(recorder, engine)))) > 80
    engine.close()


def test_a_store_keeps_the_chunks_that_fit_when_room_runs_out_in_its_later_chunks() -> None:
    """Room for one more chunk than the first: the store covers two of three and says so."""
    engine, recorder = small_engine(l1_bytes=2 * _chunk_bytes())
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    x = np.arange(3 * CHUNK, dtype=np.int32)
    assert engine.store("a", x, [0, 1, 2, 3, 4, 5], request_id="x") == 2 * CHUNK
    assert engine.lookup(x, model_name="m") == 2 * CHUNK
    ends = [e.attrs for _, e in pairs(events_of(recorder, engine)) if e.type.name == "STORE_END"]
    assert ends[-1]["tokens"] == 2 * CHUNK and ends[-1]["ok"] is True
    engine.close()


def test_a_store_enqueues_waves_that_double_and_a_late_failure_leaves_nothing_visible() -> None:
    """7 chunks go as waves of 1, 1, 2, 3 (chunks done: 1, 2, 4, 7) from a first wave of
    one chunk (as a CUDA mover's can be); when the third wave's enqueue fails, the earlier
    waves' objects vanish too and END says why."""
    engine, recorder = small_engine()
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    mover = engine._instance("a").mover
    mover.head_chunks = 1
    real, calls = mover.store, []
    fail_at = [0]

    def recorded(block_ids: np.ndarray, dsts: HostChunks) -> None:
        calls.append(len(dsts))
        if len(calls) == fail_at[0]:
            raise RuntimeError("copy engine fault")
        real(block_ids, dsts)

    mover.store = recorded  # type: ignore[method-assign]
    x = np.arange(7 * CHUNK, dtype=np.int32)
    blocks = list(range(14))
    assert engine.store("a", x, blocks, request_id="x") == 7 * CHUNK
    assert calls == [1, 1, 2, 3]
    calls.clear()
    fail_at[0] = 3
    with pytest.raises(TransferError, match="copy engine fault"):
        engine.store("a", x + 1, blocks, request_id="y")
    assert calls == [1, 1, 2]
    assert engine.lookup(x + 1, model_name="m") == 0
    assert engine.l1_stats()["writing"] == 0 and engine.l1_stats()["objects"] == 7
    ends = [e.attrs for _, e in pairs(events_of(recorder, engine)) if e.type.name == "STORE_END"]
    assert [e["ok"] for e in ends] == [True, False] and ends[-1]["error"] == "transfer_failed"
    engine.close()


def test_a_cpu_store_and_retrieve_go_as_one_wave() -> None:
    """CPU movers copy inside each call, so nothing overlaps a later wave: a store and a
    retrieve of 7 chunks enqueue them in one call each, and the bytes are right."""
    engine, _ = small_engine(l1_bytes=32 * _chunk_bytes())
    src, kw = caches("vllm_flash_attn", seed=1, num_blocks=28)
    dst, _ = caches("vllm_flash_attn", seed=2, num_blocks=28)
    engine.register_kv_caches("writer", src, model_name="m", **kw)
    engine.register_kv_caches("reader", dst, model_name="m", **kw)
    writer, reader = engine._instance("writer").mover, engine._instance("reader").mover
    stores: list[int] = []
    real_store = writer.store

    def store(block_ids: np.ndarray, dsts: HostChunks) -> None:
        stores.append(len(dsts))
        real_store(block_ids, dsts)

    writer.store = store  # type: ignore[method-assign]
    retrieves = _counted_retrieves(reader)
    x = np.arange(7 * CHUNK, dtype=np.int32)
    assert engine.store("writer", x, list(range(14)), request_id="x") == 7 * CHUNK
    assert engine.retrieve("reader", x, list(range(14, 28)), request_id="r") == 7 * CHUNK
    assert (stores, retrieves) == ([7], [7])
    assert torch.equal(
        block_bytes(dst, kw, list(range(14, 28))), block_bytes(src, kw, list(range(14)))
    )
    engine.close()


def test_a_retrieve_pins_and_enqueues_in_waves_and_stops_at_the_first_miss() -> None:
    """A 7-chunk hit prefix goes as waves of 1, 1, 2, 3 with every byte right; with chunk 3
    missing, the third wave moves chunk 2 alone and the hit is 3 chunks. A skip that covers
    a whole wave's chunks counts them as hits without moving them. Nothing stays pinned."""
    engine, recorder = small_engine(l1_bytes=32 * _chunk_bytes())
    src, kw = caches("vllm_flash_attn", seed=1, num_blocks=28)
    dst, _ = caches("vllm_flash_attn", seed=2, num_blocks=28)
    engine.register_kv_caches("writer", src, model_name="m", **kw)
    engine.register_kv_caches("reader", dst, model_name="m", **kw)
    mover = engine._instance("reader").mover
    mover.head_chunks = 1  # as a CUDA mover's first wave can be
    calls = _counted_retrieves(mover)
    x = np.arange(7 * CHUNK, dtype=np.int32)
    blocks = list(range(14))
    engine.store("writer", x, blocks, request_id="x")
    out = list(range(14, 28))
    assert engine.retrieve("reader", x, out, request_id="r") == 7 * CHUNK
    assert calls == [1, 1, 2, 3]
    assert torch.equal(block_bytes(dst, kw, out), block_bytes(src, kw, blocks))

    calls.clear()
    y = x + 1
    engine.store("writer", y[: 3 * CHUNK], blocks[:6], request_id="y")  # chunks 0-2 of y
    assert engine.retrieve("reader", y, out, request_id="r2") == 3 * CHUNK
    assert calls == [1, 1, 1]

    calls.clear()
    skip = 2 * CHUNK  # waves 1 and 2 are wholly skipped: hits, no copies
    assert engine.retrieve("reader", x, out, request_id="r3", skip_first_n_tokens=skip) == 7 * CHUNK
    assert calls == [2, 3]
    objects = engine.l1_stats()["objects"]
    assert engine.l1.drop_where(lambda key: True) == objects  # none left pinned
    ends = [e.attrs for _, e in pairs(events_of(recorder, engine)) if e.type.name == "RETRIEVE_END"]
    assert [(e["hit_tokens"], e["bytes"]) for e in ends] == [
        (7 * CHUNK, 7 * _chunk_bytes()), (3 * CHUNK, 3 * _chunk_bytes()),
        (7 * CHUNK, 5 * _chunk_bytes()),
    ]  # fmt: skip
    engine.close()
