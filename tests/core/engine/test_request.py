"""RequestIds: a request's ids converted and checked in chunk ranges, as a store uses them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.engine.request import RequestIds
from kvflow.core.errors import InvalidRequestError
from kvflow.kernels import KVLayout
from tests.support.engine import BLOCK, CHUNK, block_bytes, caches, small_engine

PER_CHUNK = CHUNK // BLOCK


def _layout() -> KVLayout:
    kv, kw = caches("vllm_flash_attn", seed=0)
    return KVLayout.from_kv_caches(kv, **kw)


def _ids(tokens: object, blocks: object) -> RequestIds:
    return RequestIds(tokens, blocks, chunk_size=CHUNK, layout=_layout(),
                      blocks_per_chunk=PER_CHUNK)  # fmt: skip


@pytest.mark.parametrize("kind", ["list", "numpy", "tensor"])
def test_converting_in_steps_gives_the_whole_request(kind: str) -> None:
    tokens = list(range(100, 100 + 3 * CHUNK + 5))
    blocks = [5, 2, 9, 0, 14, 7, 3]
    as_kind = {"list": list, "numpy": np.array, "tensor": torch.tensor}[kind]
    ids = _ids(as_kind(tokens), as_kind(blocks))
    assert ids.n_chunks == 3
    ids.convert(1)
    assert ids.tokens[:CHUNK].tolist() == tokens[:CHUNK] and ids.table[0].tolist() == blocks[:2]
    ids.convert(1)  # already done
    ids.convert_tokens(3)
    assert ids.tokens.tolist() == tokens[: 3 * CHUNK]
    ids.convert_blocks(3)
    assert ids.table.tolist() == [blocks[0:2], blocks[2:4], blocks[4:6]]


def test_bad_ids_are_found_in_the_range_that_holds_them() -> None:
    """A bad id after the first chunk passes convert(1) and fails when its chunk is reached;
    the partial chunk's ids are checked with the last full chunk."""
    ids = _ids(np.arange(2 * CHUNK), [0, 1, 2, 99])
    ids.convert(1)
    with pytest.raises(InvalidRequestError, match="block id 99 out of range"):
        ids.convert(2)
    ids = _ids([*range(2 * CHUNK), "x"], [0, 1, 2, 3])
    ids.convert(1)
    ids.convert_blocks(2)  # the block ids are fine
    with pytest.raises(InvalidRequestError, match="token_ids must hold integers"):
        ids.convert_tokens(2)
    with pytest.raises(InvalidRequestError, match="block_ids must hold integers"):
        _ids(np.arange(CHUNK - 1), [1.5]).convert(0)  # no full chunk: still every id checked


def test_requests_that_are_not_sequences_or_too_short_are_refused_up_front() -> None:
    with pytest.raises(InvalidRequestError, match="token_ids must be a 1-D sequence"):
        _ids(7, [])
    with pytest.raises(
        InvalidRequestError, match="block_ids must be a sequence of integers, got a string"
    ):
        _ids(np.arange(CHUNK), "0123")
    with pytest.raises(InvalidRequestError, match="need 4 blocks"):
        _ids(np.arange(2 * CHUNK), [0, 1, 2])
    with pytest.raises(InvalidRequestError, match="sliceable"):
        _ids(np.arange(CHUNK), {0: 1, 1: 2}).convert(1)


def test_a_store_with_a_bad_id_in_its_later_chunks_leaves_nothing_in_l1() -> None:
    """The first chunk's copy may already have run: the store still fails whole."""
    engine, _ = small_engine()
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    tokens = np.arange(3 * CHUNK, dtype=np.int32)
    with pytest.raises(InvalidRequestError, match="block id 99 out of range"):
        engine.store("a", tokens, [0, 1, 2, 3, 4, 99], request_id="q")
    assert engine.lookup(tokens, model_name="m") == 0
    assert engine.l1_stats()["usage_bytes"] == 0 and engine.l1_stats()["writing"] == 0
    assert engine.store("a", tokens, [0, 1, 2, 3, 4, 5], request_id="q") == 3 * CHUNK
    engine.close()


def _two_chunks_stored() -> tuple[CacheEngine, Any, dict[str, Any], np.ndarray]:
    """An engine with instance "a" whose blocks 0-3 hold two stored chunks of `tokens`."""
    engine, _ = small_engine()
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    tokens = np.arange(2 * CHUNK, dtype=np.int32)
    engine.store("a", tokens, [0, 1, 2, 3], request_id="w")
    return engine, kv, kw, tokens


def test_a_retrieve_with_a_bad_block_id_writes_no_block() -> None:
    """Block ids are checked before the first block is written, with or without hits."""
    engine, kv, kw, tokens = _two_chunks_stored()
    before = block_bytes(kv, kw, [4, 5, 6])
    with pytest.raises(InvalidRequestError, match="block id 99 out of range"):
        engine.retrieve("a", tokens, [4, 5, 6, 99], request_id="r")
    assert torch.equal(block_bytes(kv, kw, [4, 5, 6]), before)
    with pytest.raises(InvalidRequestError, match="block id 99 out of range"):
        engine.retrieve("a", tokens + 1, [4, 5, 6, 99], request_id="miss")  # nothing to copy
    assert engine.retrieve("a", tokens, [4, 5, 6, 7], request_id="r") == 2 * CHUNK
    engine.close()


def test_a_retrieve_repeating_a_block_across_its_waves_writes_no_block() -> None:
    """Chunk 0 (first wave) and chunk 1 (second wave) share block 5: each wave alone is
    fine, so the whole table is checked before any block is written. A repeat inside
    the skipped prefix writes nothing twice and is accepted."""
    engine, kv, kw, tokens = _two_chunks_stored()
    engine._instance("a").mover.head_chunks = 1  # two waves, as a CUDA mover's can be
    before = block_bytes(kv, kw, [4, 5, 6])
    with pytest.raises(InvalidRequestError, match="repeat block 5, which a retrieve"):
        engine.retrieve("a", tokens, [4, 5, 5, 6], request_id="r")
    assert torch.equal(block_bytes(kv, kw, [4, 5, 6]), before)
    skip = BLOCK  # the first 4 is skipped: 4 (once), 6 and 7 are written
    assert (
        engine.retrieve("a", tokens, [4, 4, 6, 7], request_id="s", skip_first_n_tokens=skip)
        == 2 * CHUNK
    )
    assert torch.equal(block_bytes(kv, kw, [6, 7]), block_bytes(kv, kw, [2, 3]))
    engine.close()
