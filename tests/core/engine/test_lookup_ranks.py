"""Lookups that count some ranks only (`ranks`): a server holding one rank of a
tensor-parallel engine whose other ranks have servers of their own answers for its rank,
in L1 and in L2, and names what is wrong with a bad list."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.core.errors import InvalidRequestError
from kvflow.events import EventType
from tests.support.engine import CHUNK, caches, events_of, of_type, register_world, small_engine
from tests.support.ops import wait_for
from tests.support.tiers import memory_tier

TOKENS = np.arange(100, 100 + 3 * CHUNK, dtype=np.int32)
BLOCKS = [5, 2, 9, 0, 14, 7]


def test_a_lookup_counts_only_the_ranks_it_names() -> None:
    """Rank 1 alone stored 3 chunks and rank 0 two: the whole world hits 2, rank 1 alone 3,
    rank 0 alone 2; a world of four with only rank 2 registered hits for [2] only."""
    engine, _ = small_engine()
    register_world(engine, 2)
    engine.store("tp1", TOKENS, BLOCKS, request_id="q")
    assert engine.lookup(TOKENS, model_name="m", world_size=2) == 0
    assert engine.lookup(TOKENS, model_name="m", world_size=2, ranks=[1]) == 3 * CHUNK
    assert engine.lookup(TOKENS, model_name="m", world_size=2, ranks=[0]) == 0
    engine.store("tp0", TOKENS[: 2 * CHUNK], BLOCKS, request_id="q")
    assert engine.lookup(TOKENS, model_name="m", world_size=2, ranks=[0]) == 2 * CHUNK
    assert engine.lookup(TOKENS, model_name="m", world_size=2, ranks=[1, 0]) == 2 * CHUNK
    assert engine.lookup(TOKENS, model_name="m", world_size=2) == 2 * CHUNK
    kv, kw = caches("vllm_flash_attn", seed=3)
    engine.register_kv_caches("w4r2", kv, model_name="m", world_size=4, rank=2, **kw)
    engine.store("w4r2", TOKENS, BLOCKS, request_id="q")
    assert engine.lookup(TOKENS, model_name="m", world_size=4, ranks=[2]) == 3 * CHUNK
    assert engine.lookup(TOKENS, model_name="m", world_size=4, ranks=[2, 3]) == 0
    engine.close()


@pytest.mark.parametrize(
    "ranks",
    [[], [2], [-1], [0, 0], [True], "0", [0.0]],
    ids=["empty", "past-the-world", "negative", "repeated", "bool", "text", "float"],
)
def test_a_bad_rank_list_is_refused_naming_it(ranks: object) -> None:
    engine, _ = small_engine()
    with pytest.raises(InvalidRequestError, match=r"^ranks must be a non-empty list of distinct"):
        engine.lookup(TOKENS, model_name="m", world_size=2, ranks=ranks)  # type: ignore[arg-type]
    assert engine.lookup(TOKENS, model_name="m", world_size=2, ranks=[1]) == 0  # still serving
    engine.close()


def test_a_rank_s_lookup_finds_its_chunks_in_l2_and_prefetches_only_them() -> None:
    """Rank 1's chunks only in L2 (rank 0 stored nothing): its own lookup hits them all
    there and prefetches them back into L1; the whole world's lookup still hits nothing."""
    engine, recorder = small_engine(l1_bytes=1 << 20, l2_tiers=[memory_tier()])
    register_world(engine, 2)
    engine.store("tp1", TOKENS, BLOCKS, request_id="w")
    tiering = engine._tiering
    assert tiering is not None and tiering.writes.drain(5.0)
    engine.l1.drop_where(lambda key: key.rank == 1)
    assert engine.lookup(TOKENS, model_name="m", world_size=2) == 0
    assert engine.lookup(TOKENS, model_name="m", world_size=2, ranks=[1]) == 3 * CHUNK
    ends = lambda: of_type(events_of(recorder, engine), EventType.PREFETCH_END)  # noqa: E731
    wait_for(lambda: bool(ends()), what="the prefetch")
    assert ends()[0].attrs["chunks"] == 3
    by_tier = of_type(events_of(recorder, engine), EventType.LOOKUP_END)[-1].attrs
    assert by_tier["hit_tokens_by_tier"] == {"l1": 0, "mem": 3 * CHUNK}
    wait_for(
        lambda: (
            engine.lookup(TOKENS, model_name="m", world_size=2, ranks=[1], prefetch=False)
            == 3 * CHUNK
            and of_type(events_of(recorder, engine), EventType.LOOKUP_END)[-1].attrs[
                "hit_tokens_by_tier"
            ]["l1"]
            == 3 * CHUNK
        ),
        what="rank 1's chunks back in L1",
    )
    engine.close()


def test_a_rank_list_longer_than_the_world_is_refused_in_a_short_line() -> None:
    """A list of 100,000 ranks for a world of two: refused naming the bound, the list
    shown cut short rather than echoed whole."""
    engine, _ = small_engine()
    with pytest.raises(InvalidRequestError) as refused:
        engine.lookup(TOKENS, model_name="m", world_size=2, ranks=list(range(100_000)))
    message = str(refused.value)
    assert message.startswith("ranks must be a non-empty list of distinct ranks in [0, 2)")
    assert len(message) < 200, message
    engine.close()
