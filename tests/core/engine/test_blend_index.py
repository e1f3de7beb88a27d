"""The blend index finds stored chunks at any offset of a new prompt, and only real ones."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvflow.core.engine import blend_index
from kvflow.core.engine.blend_index import (
    BlendIndex,
    chunk_fingerprint,
    chunk_fingerprints,
    window_fingerprints,
)

CHUNK = 16
OWNER = ("m", 1, None)


def _tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n).astype("<i4")


def _hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(32, b".") for i in range(n)]


def test_window_fingerprints_equal_each_windows_own_fingerprint() -> None:
    tokens = _tokens(0, 300)
    prints = window_fingerprints(tokens, CHUNK)
    assert len(prints) == 300 - CHUNK + 1
    for i in (0, 1, 17, 150, 300 - CHUNK):
        assert int(prints[i]) == chunk_fingerprint(tokens[i : i + CHUNK])
    direct = sum(
        int(t) * pow(blend_index._BASE, CHUNK - 1 - k, 1 << 64)
        for k, t in enumerate(tokens[5 : 5 + CHUNK])
    )
    assert int(prints[5]) == direct % (1 << 64)
    assert len(window_fingerprints(tokens[:5], CHUNK)) == 0
    assert [int(p) for p in chunk_fingerprints(tokens, CHUNK)] == [
        int(prints[i]) for i in range(0, 300 - CHUNK + 1, CHUNK)
    ]


def test_a_document_is_found_wherever_it_moved() -> None:
    """Two documents stored after a system prompt, then used in the other order, at
    offsets that are no multiple of a chunk or a block."""
    system, doc_a, doc_b = _tokens(1, 2 * CHUNK), _tokens(2, 3 * CHUNK), _tokens(3, 2 * CHUNK)
    stored = np.concatenate([system, doc_a, doc_b])
    index = BlendIndex()
    index.add(OWNER, 0, stored, CHUNK, _hashes("s", len(stored) // CHUNK))
    question = _tokens(4, 7)
    prompt = np.concatenate([system, question, doc_b, doc_a, question])
    found = index.find(OWNER, [0], prompt, CHUNK, start=2 * CHUNK)
    b_at, a_at = 2 * CHUNK + 7, 2 * CHUNK + 7 + 2 * CHUNK
    assert [(s.offset, s.original_start) for s in found] == [
        (b_at, 5 * CHUNK), (b_at + CHUNK, 6 * CHUNK),
        (a_at, 2 * CHUNK), (a_at + CHUNK, 3 * CHUNK), (a_at + 2 * CHUNK, 4 * CHUNK),
    ]  # fmt: skip
    hashes = _hashes("s", 7)
    assert [s.chunk_hash for s in found] == [hashes[5], hashes[6], hashes[2], hashes[3], hashes[4]]
    for s in found:
        assert np.array_equal(
            prompt[s.offset : s.offset + CHUNK], stored[s.original_start : s.original_start + CHUNK]
        )


def test_segments_never_overlap_and_start_after_the_prefix() -> None:
    repeated = np.tile(_tokens(5, 4), 3 * CHUNK // 4)  # every window of it looks alike
    index = BlendIndex()
    index.add(OWNER, 0, repeated, CHUNK, _hashes("r", 3))
    found = index.find(OWNER, [0], repeated, CHUNK, start=3)
    starts = [s.offset for s in found]
    assert starts[0] >= 3
    assert all(b - a >= CHUNK for a, b in itertools.pairwise(starts))


def test_a_fingerprint_collision_is_rejected_by_the_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every window gets one fingerprint: only the digest tells chunks apart."""
    monkeypatch.setattr(
        blend_index,
        "window_fingerprints",
        lambda tokens, n: np.zeros(max(0, len(tokens) - n + 1), np.uint64),
    )
    monkeypatch.setattr(
        blend_index, "chunk_fingerprints", lambda tokens, n: np.zeros(len(tokens) // n, np.uint64)
    )
    stored, other = _tokens(6, CHUNK), _tokens(7, 3 * CHUNK)
    index = BlendIndex()
    index.add(OWNER, 0, stored, CHUNK, _hashes("c", 1))
    assert index.find(OWNER, [0], other, CHUNK) == []
    hit = index.find(OWNER, [0], np.concatenate([other[:5], stored]), CHUNK)
    assert [(s.offset, s.original_start) for s in hit] == [(5, 0)]


def test_owners_are_apart_and_every_rank_must_hold_the_chunk() -> None:
    tokens = _tokens(8, 2 * CHUNK)
    index = BlendIndex()
    tp = ("m", 2, "salt")
    index.add(tp, 0, tokens, CHUNK, _hashes("t", 2))
    assert index.find(tp, [0, 1], tokens, CHUNK) == [], "rank 1 has not stored it yet"
    assert len(index.find(tp, [0], tokens, CHUNK)) == 2, "a server asked for rank 0 only"
    assert index.find(tp, [1], tokens, CHUNK) == []
    index.add(tp, 1, tokens, CHUNK, _hashes("t", 2))
    assert len(index.find(tp, [0, 1], tokens, CHUNK)) == 2
    assert index.find(("m", 2, "other salt"), [0, 1], tokens, CHUNK) == []
    assert index.find(("other model", 2, "salt"), [0, 1], tokens, CHUNK) == []


def test_removed_and_overflowing_chunks_are_forgotten() -> None:
    tokens = _tokens(9, 4 * CHUNK)
    index = BlendIndex(capacity_chunks=3)
    index.add(OWNER, 0, tokens, CHUNK, _hashes("o", 4))
    assert len(index) == 3
    assert [s.original_start for s in index.find(OWNER, [0], tokens, CHUNK)] == [
        CHUNK,
        2 * CHUNK,
        3 * CHUNK,
    ]
    assert index.remove(OWNER, _hashes("o", 4)[2:3]) == 1
    assert index.remove(OWNER, _hashes("o", 4)[2:3]) == 0
    assert [s.original_start for s in index.find(OWNER, [0], tokens, CHUNK)] == [CHUNK, 3 * CHUNK]
    index.remove(OWNER, _hashes("o", 4))
    assert len(index) == 0 and index.find(OWNER, [0], tokens, CHUNK) == []


def test_a_chunk_found_is_kept_over_one_never_found() -> None:
    tokens = _tokens(10, 3 * CHUNK)
    index = BlendIndex(capacity_chunks=3)
    index.add(OWNER, 0, tokens, CHUNK, _hashes("k", 3))
    index.find(OWNER, [0], tokens[:CHUNK], CHUNK)  # chunk 0 used: now the newest
    index.add(OWNER, 0, _tokens(11, CHUNK), CHUNK, _hashes("n", 1))
    assert [s.original_start for s in index.find(OWNER, [0], tokens, CHUNK)] == [0, 2 * CHUNK]


def test_a_bad_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity_chunks"):
        BlendIndex(capacity_chunks=0)
