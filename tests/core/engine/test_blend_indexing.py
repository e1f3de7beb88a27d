"""The blend index follows the stores: a store's chunks are hashed while its copies run
and inserted once it succeeded, ahead of any later index change, never on its return path."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvflow.core.engine.blend_index import BlendIndex
from kvflow.core.errors import TransferError
from kvflow.core.tiers.base import ObjectKey
from tests.support.blend import VOCAB, Model
from tests.support.engine import BLOCK, CHUNK, small_engine


def _stored(chunks_in_l1: int) -> tuple[Any, np.random.Generator]:
    """An engine whose L1 holds `chunks_in_l1` chunks, instance "i" of model "m" registered."""
    model = Model()
    caches = model.caches()
    chunk_nbytes = sum(c[:, :1].nbytes for c in caches) * CHUNK // BLOCK
    engine, _ = small_engine(l1_bytes=chunks_in_l1 * chunk_nbytes)
    engine.register_kv_caches("i", caches, model_name="m", block_size=BLOCK)
    return engine, np.random.default_rng(3)


def _tokens(rng: np.random.Generator, chunks: int) -> np.ndarray:
    return rng.integers(0, VOCAB, chunks * CHUNK).astype(np.int32)


def _found(engine: Any, rng: np.random.Generator, stored: np.ndarray) -> list[int]:
    """Original starts of the chunks a blend lookup finds of `stored`, placed after an
    unrelated chunk (so the prefix lookup takes none of them)."""
    prompt = np.concatenate([_tokens(rng, 1), stored])
    return [s.original_start for s in engine.blend_lookup(prompt, model_name="m").segments]


def _blocks(chunks: int, first: int = 0) -> list[int]:
    return list(range(first, first + chunks * CHUNK // BLOCK))


def test_a_stores_chunks_are_inserted_with_the_next_index_use(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After a store returns, nothing of it is left for the indexing thread to insert until
    the index is used next (here a lookup, which then finds the chunks); no index job
    fails on the way (the lookup's own job has nothing to run after the insertion)."""
    caplog.set_level(logging.ERROR, logger="kvflow.engine")
    inserted: list[int] = []
    insert = BlendIndex.insert

    def counted(self: BlendIndex, *args: Any) -> None:
        inserted.append(len(args[2]))
        insert(self, *args)

    monkeypatch.setattr(BlendIndex, "insert", counted)
    engine, rng = _stored(8)
    stored = _tokens(rng, 2)
    assert engine.store("i", stored, _blocks(2), request_id="s") == 2 * CHUNK
    last = engine._blend._last
    assert last is not None
    last.result()  # the store's hashing, begun before it waited for its copies
    assert inserted == []
    assert _found(engine, rng, stored) == [0, CHUNK]
    assert inserted == [2]
    assert not [r.getMessage() for r in caplog.records if "blend_index" in r.getMessage()]
    engine.close()


def test_chunks_evicted_by_the_next_store_leave_the_index() -> None:
    """A store's insertion runs before the forgetting of the chunks a later store evicted."""
    engine, rng = _stored(2)
    first, second = _tokens(rng, 2), _tokens(rng, 2)
    engine.store("i", first, _blocks(2), request_id="a")
    engine.store("i", second, _blocks(2, 4), request_id="b")  # evicts both of `first`
    assert _found(engine, rng, first) == []
    assert _found(engine, rng, second) == [0, CHUNK]
    assert len(engine._blend.index) == 2
    engine.close()


def test_a_failed_store_indexes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, rng = _stored(8)
    mover = engine._instances["i"].mover

    def failing() -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(mover, "wait", failing)
    stored = _tokens(rng, 2)
    with pytest.raises(TransferError, match="copy failed"):
        engine.store("i", stored, _blocks(2), request_id="s")
    monkeypatch.undo()
    assert _found(engine, rng, stored) == []
    assert len(engine._blend.index) == 0
    engine.close()


def test_close_finishes_the_indexing_submitted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing the engine waits for the index jobs already queued (a store's hashing that
    is still running) before it returns."""
    import kvflow.core.engine.blend as blend

    finished = threading.Event()
    stored_chunks = blend.stored_chunks

    def slow(tokens: np.ndarray, chunk_size: int, count: int) -> Any:
        time.sleep(0.3)
        hashing = stored_chunks(tokens, chunk_size, count)
        finished.set()
        return hashing

    monkeypatch.setattr(blend, "stored_chunks", slow)
    engine, rng = _stored(8)
    assert engine.store("i", _tokens(rng, 1), _blocks(1), request_id="s") == CHUNK
    engine.close()
    assert finished.is_set()


def test_index_changes_after_close_are_dropped() -> None:
    engine, rng = _stored(8)
    engine.store("i", _tokens(rng, 1), _blocks(1), request_id="s")
    engine.close()
    engine._blend.forget([ObjectKey(b"k" * 32, "m", 1, 0, None)])  # a lookup racing close
    engine._blend.indexed()


def test_the_ranks_of_one_engine_hash_a_prompt_they_store_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two ranks of a world of two store the same prompt: its chunks are hashed for the
    blend index once, and a blend lookup for the world finds them; a second prompt of the
    same length, stored by both, is hashed anew and found at its own tokens."""
    import kvflow.core.engine.blend as blend

    hashed: list[int] = []
    stored_chunks = blend.stored_chunks

    def counted(tokens: np.ndarray, chunk_size: int, count: int) -> Any:
        hashed.append(count)
        return stored_chunks(tokens, chunk_size, count)

    monkeypatch.setattr(blend, "stored_chunks", counted)
    model = Model()
    chunk_nbytes = sum(c[:, :1].nbytes for c in model.caches()) * CHUNK // BLOCK
    engine, _ = small_engine(l1_bytes=16 * chunk_nbytes)
    for rank in range(2):
        engine.register_kv_caches(
            f"r{rank}", model.caches(), model_name="m", world_size=2, rank=rank, block_size=BLOCK
        )
    rng = np.random.default_rng(5)
    for n, prompt in enumerate((_tokens(rng, 2), _tokens(rng, 2))):
        for rank in range(2):
            stored = engine.store(f"r{rank}", prompt, _blocks(2), request_id=f"s{n}{rank}")
            assert stored == 2 * CHUNK
        found = engine.blend_lookup(
            np.concatenate([_tokens(rng, 1), prompt]), model_name="m", world_size=2
        )
        assert [s.original_start for s in found.segments] == [0, CHUNK], n
    assert hashed == [2, 2]
    engine.close()


def test_the_hashing_of_the_last_stores_is_kept_oldest_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The indexing thread keeps the hashing of the last HASHED_KEPT stores: after rank 0
    stored one more prompt than that, rank 1 storing the newest HASHED_KEPT of them hashes
    none anew (the oldest went, not the newest), and storing the oldest hashes it again."""
    import kvflow.core.engine.blend as blend

    hashed: list[int] = []
    stored_chunks = blend.stored_chunks

    def counted(tokens: np.ndarray, chunk_size: int, count: int) -> Any:
        hashed.append(int(tokens[0]))
        return stored_chunks(tokens, chunk_size, count)

    monkeypatch.setattr(blend, "stored_chunks", counted)
    model = Model()
    chunk_nbytes = sum(c[:, :1].nbytes for c in model.caches()) * CHUNK // BLOCK
    engine, _ = small_engine(l1_bytes=4 * blend.HASHED_KEPT * chunk_nbytes)
    for rank in range(2):
        engine.register_kv_caches(
            f"r{rank}", model.caches(), model_name="m", world_size=2, rank=rank, block_size=BLOCK
        )
    prompts = [np.full(CHUNK, n, dtype=np.int32) for n in range(blend.HASHED_KEPT + 1)]
    for n, prompt in enumerate(prompts):
        assert engine.store("r0", prompt, _blocks(1), request_id=f"a{n}") == CHUNK
    for n, prompt in enumerate(prompts[1:], start=1):
        assert engine.store("r1", prompt, _blocks(1), request_id=f"b{n}") == CHUNK
    engine._blend.indexed()
    assert hashed == list(range(len(prompts)))  # rank 1's stores reused every hashing
    assert engine.store("r1", prompts[0], _blocks(1), request_id="b0") == CHUNK
    engine._blend.indexed()
    assert hashed == [*range(len(prompts)), 0]  # the oldest had gone
    engine.close()
