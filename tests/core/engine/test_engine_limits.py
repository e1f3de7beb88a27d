"""Request bounds of the engine (docs/ENGINE.md, "Request bounds"; issue 18 items 2 and 3).

world_size, rank and tokens per request are bounded and checked before any work;
a lookup's work follows the ranks that hold chunks, not world_size; allocation
reports name only blocks that exist in the instance's cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from kvflow.core.engine import validation
from kvflow.core.engine.cache_engine import MAX_REQUEST_TOKENS, MAX_WORLD_SIZE, CacheEngine
from kvflow.core.engine.keys import chain_hashes
from kvflow.core.errors import InvalidRequestError
from kvflow.core.tiers.l1 import L1Cache
from kvflow.events import BlockAllocation, EventType
from tests.support.engine import BLOCK, CHUNK, caches, events_of, of_type, small_engine
from tests.support.tiers import memory_tier

N = 6  # chunks of the stored request
T = np.arange(1000, 1000 + N * CHUNK, dtype=np.int32)
SRC = list(range(12))  # two blocks per chunk
LONG = np.arange(50_000, 50_000 + 4000 * CHUNK, dtype=np.int32)  # 4000 chunks, never stored


class Probes:
    """Counts the keys the engine probes: L1 prefix counts and every tier's contains."""

    def __init__(self, engine: CacheEngine, tier: L1Cache) -> None:
        self.keys = 0
        count_prefix, l1_contains = engine.l1.count_prefix, engine.l1.contains
        tier_contains = tier.contains

        def counted_prefix(rows: Iterable[Sequence[Any]]) -> int:
            def counting() -> Iterable[Sequence[Any]]:
                for row in rows:
                    self.keys += len(row)
                    yield row

            return count_prefix(counting())

        def counted(inner: Any) -> Any:
            def contains(keys: Sequence[Any]) -> Future[list[bool]]:
                self.keys += len(keys)
                result: Future[list[bool]] = inner(keys)
                return result

            return contains

        engine.l1.count_prefix = counted_prefix  # type: ignore[method-assign]
        engine.l1.contains = counted(l1_contains)  # type: ignore[method-assign]
        tier.contains = counted(tier_contains)  # type: ignore[method-assign]

    def take(self) -> int:
        n, self.keys = self.keys, 0
        return n


def _engine_with_l2() -> tuple[CacheEngine, L1Cache, Any]:
    tier = memory_tier()
    engine, recorder = small_engine(l1_bytes=64 * 1024, l2_tiers=[tier])
    return engine, tier, recorder


def test_world_size_and_rank_are_bounded_before_any_work() -> None:
    engine, _, _ = _engine_with_l2()
    kv, kw = caches("vllm_flash_attn", seed=1)
    too_big = MAX_WORLD_SIZE + 1
    with pytest.raises(InvalidRequestError, match=rf"world_size .*\[1, {MAX_WORLD_SIZE}\]"):
        engine.register_kv_caches("a", kv, model_name="m", world_size=too_big, **kw)
    with pytest.raises(InvalidRequestError, match=rf"world_size .*\[1, {MAX_WORLD_SIZE}\]"):
        engine.register_kv_caches("a", kv, model_name="m", world_size=10**12, rank=5, **kw)
    with pytest.raises(InvalidRequestError, match="rank must be an integer in"):
        engine.register_kv_caches("a", kv, model_name="m", world_size=4, rank=4, **kw)
    with pytest.raises(InvalidRequestError, match=rf"\[1, {MAX_WORLD_SIZE}\]"):
        engine.lookup(T, model_name="m", world_size=too_big)
    with pytest.raises(InvalidRequestError, match=rf"\[1, {MAX_WORLD_SIZE}\]"):
        engine.prefetch(T, model_name="m", world_size=too_big)
    assert engine.status()["instances"] == {}
    # the largest world is accepted
    engine.register_kv_caches(
        "a", kv, model_name="m", world_size=MAX_WORLD_SIZE, rank=MAX_WORLD_SIZE - 1, **kw
    )
    assert engine.lookup(T, model_name="m", world_size=MAX_WORLD_SIZE) == 0
    engine.close()


def test_tokens_per_request_are_bounded_before_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, recorder = _engine_with_l2()
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    hashed: list[int] = []
    real = engine._keys.hashes
    monkeypatch.setattr(engine._keys, "hashes", lambda t, s=None: hashed.append(1) or real(t, s))
    huge = np.zeros(MAX_REQUEST_TOKENS + 1, dtype=np.int32)
    with pytest.raises(InvalidRequestError, match=f"more than the {MAX_REQUEST_TOKENS}"):
        engine.lookup(huge, model_name="m")
    with pytest.raises(InvalidRequestError, match=f"more than the {MAX_REQUEST_TOKENS}"):
        engine.prefetch(huge, model_name="m")
    assert hashed == []
    (end,) = of_type(events_of(recorder, engine), EventType.LOOKUP_END)
    assert end.attrs["error"] == "invalid_argument"
    # exactly the bound is accepted (a smaller bound keeps the test quick)
    monkeypatch.setattr(validation, "MAX_REQUEST_TOKENS", 4 * CHUNK)
    assert engine.lookup(T[: 4 * CHUNK], model_name="m") == 0
    with pytest.raises(InvalidRequestError, match="MAX_REQUEST_TOKENS"):
        engine.lookup(T[: 4 * CHUNK + 1], model_name="m")
    engine.close()


def test_a_huge_world_size_costs_what_the_ranks_that_exist_cost() -> None:
    """A lookup with the largest world_size and a long prompt probes about as many keys
    as a world_size 1 lookup of the same prompt: not world_size keys per chunk."""
    engine, tier, _ = _engine_with_l2()
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", world_size=MAX_WORLD_SIZE, **kw)
    probes = Probes(engine, tier)
    n_chunks = len(LONG) // CHUNK

    assert engine.lookup(LONG, model_name="m", world_size=1) == 0
    normal = probes.take()
    assert engine.lookup(LONG, model_name="m", world_size=MAX_WORLD_SIZE) == 0
    huge = probes.take()
    assert normal >= n_chunks  # the tiers are asked about each chunk of rank 0
    assert huge <= 2 * normal, (huge, normal)
    assert huge < n_chunks * 4  # far from n_chunks * MAX_WORLD_SIZE

    # rank 0 (only) holds the first chunks: the other ranks cost O(those chunks)
    stored = np.concatenate([T, LONG])
    assert engine.store("a", T, SRC, request_id="w") == N * CHUNK
    probes.take()
    assert engine.lookup(stored, model_name="m", world_size=MAX_WORLD_SIZE) == 0
    assert probes.take() <= 2 * normal + 4 * N
    assert engine.lookup(LONG, model_name="m", world_size=MAX_WORLD_SIZE, prefetch=False) == 0
    assert probes.take() <= 2 * normal
    engine.close()


def test_multi_rank_lookups_still_need_every_rank() -> None:
    """The rank-by-rank narrowing finds the same prefix as checking every rank per chunk,
    in L1 and in L2, whichever rank misses first."""
    world = 4
    engine, tier, _ = _engine_with_l2()
    for r in range(world):
        kv, kw = caches("vllm_flash_attn", seed=r)
        engine.register_kv_caches(f"r{r}", kv, model_name="w", world_size=world, rank=r, **kw)
        assert engine.store(f"r{r}", T, SRC, request_id=f"s{r}") == N * CHUNK
    tiering = engine._tiering
    assert tiering is not None and tiering.writes.drain(5.0)
    hashes = chain_hashes(T, CHUNK)
    assert engine.lookup(T, model_name="w", world_size=world) == N * CHUNK  # L1
    engine.l1.drop_where(lambda k: k.rank == 2 and k.chunk_hash in hashes[5:])
    assert engine.lookup(T, model_name="w", world_size=world, prefetch=False) == N * CHUNK  # L2
    engine.l1.drop_where(lambda k: True)
    assert engine.lookup(T, model_name="w", world_size=world, prefetch=False) == N * CHUNK
    tier.drop_where(lambda k: k.rank == 1 and k.chunk_hash in hashes[4:])
    assert engine.lookup(T, model_name="w", world_size=world, prefetch=False) == 4 * CHUNK
    tier.drop_where(lambda k: k.rank == 3 and k.chunk_hash in hashes[2:])
    assert engine.lookup(T, model_name="w", world_size=world, prefetch=False) == 2 * CHUNK
    tier.drop_where(lambda k: k.rank == 0)
    assert engine.lookup(T, model_name="w", world_size=world, prefetch=False) == 0
    assert engine.lookup(T, model_name="w", world_size=2, prefetch=False) == 0
    engine.close()


# -- allocation reports (item 3) -----------------------------------------------------


def test_allocation_reports_name_only_blocks_of_the_instance_cache() -> None:
    engine, recorder = small_engine()
    kv, kw = caches("vllm_flash_attn", seed=1)  # 16 blocks of BLOCK tokens
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    ok = BlockAllocation("q", [0, 15], list(range(2 * BLOCK)))
    bad: list[tuple[Any, str]] = [
        (BlockAllocation("q2", [3, 16], []), r"records\[1\] \(req_id 'q2'\).new_block_ids .* 16"),
        (BlockAllocation("q2", [-1], []), r"records\[1\] .*block id -1, which does not exist"),
        (BlockAllocation("q2", [10**6], [1]), "16 blocks"),
        (BlockAllocation("q2", [2**70], [1]), r"records\[1\]"),
        (BlockAllocation("q2", [1.5], [1]), r"records\[1\] .* integers"),  # type: ignore[list-item]
        (BlockAllocation("q2", [True], [1]), r"records\[1\] .* integers"),
        (BlockAllocation("q2", [[1, 2]], [1]), r"records\[1\] .* integers"),  # type: ignore[list-item]
        (BlockAllocation("q2", [1], ["x"]), r"records\[1\] .*new_token_ids"),  # type: ignore[list-item]
        (
            BlockAllocation("q2", [1, 2], list(range(2 * BLOCK + 1))),
            rf"records\[1\] \(req_id 'q2'\) holds {2 * BLOCK + 1} tokens in 2 blocks",
        ),
        (BlockAllocation("q2", [], [7]), "holds 1 tokens in 0 blocks"),
    ]
    for record, match in bad:
        with pytest.raises(InvalidRequestError, match=match):
            engine.report_block_allocations("a", [ok, record])
    assert of_type(events_of(recorder, engine), EventType.BLOCK_ALLOCATION) == []
    # partial and empty last blocks are fine; so are empty records
    engine.report_block_allocations(
        "a", [ok, BlockAllocation("q3", [4, 5, 6], [1] * (BLOCK + 1)), BlockAllocation("e", [], [])]
    )
    (event,) = of_type(events_of(recorder, engine), EventType.BLOCK_ALLOCATION)
    assert [r.req_id for r in event.attrs["records"]] == ["q", "q3", "e"]
    engine.close()


def test_a_flood_of_nonexistent_block_ids_never_reaches_the_l0_tracker() -> None:
    """Millions of ids beyond the cache are refused at once, before the bus sees them."""
    engine, recorder = small_engine()
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    flood = BlockAllocation("q", list(range(16, 2_000_016)), [])
    with pytest.raises(InvalidRequestError, match="block id 2000015, which does not exist"):
        engine.report_block_allocations("a", [flood])
    assert of_type(events_of(recorder, engine), EventType.BLOCK_ALLOCATION) == []
    engine.close()
