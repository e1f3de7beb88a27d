"""Chunk keys: chained blake3 from the published seed, cached per session."""

from __future__ import annotations

import blake3
import numpy as np
import pytest

from kvflow.core.arrays import as_int32_array
from kvflow.core.engine.keys import KEY_SEED, KEY_SEED_LABEL, KeyCache, chain_hashes
from kvflow.core.errors import InvalidRequestError


def test_seed_is_the_blake3_of_its_published_label() -> None:
    """H_{-1} is blake3(b"kvflow/chunk-key/v1"), so anyone can recompute it."""
    assert blake3.blake3(KEY_SEED_LABEL).digest() == KEY_SEED


def test_keys_chain_over_little_endian_int32_chunks() -> None:
    """H_i = blake3(H_{i-1} || chunk i as int32 LE); a partial tail chunk has no key."""
    tokens = list(range(10))
    expected = []
    prev = KEY_SEED
    for start in (0, 4):
        chunk = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[start : start + 4])
        prev = blake3.blake3(prev + chunk).digest()
        expected.append(prev)
    assert chain_hashes(as_int32_array(tokens, "token_ids"), 4) == expected


def test_known_vector_is_stable_across_processes() -> None:
    """A fixed input's first key never changes (it is not salted per process)."""
    (h,) = chain_hashes(as_int32_array([1, 2, 3, -1], "token_ids"), 4)
    data = KEY_SEED + np.array([1, 2, 3, -1], dtype="<i4").tobytes()
    assert h == blake3.blake3(data).digest()


def test_a_chunk_key_depends_on_the_whole_prefix() -> None:
    """Equal chunks after different prefixes get different keys."""
    a = chain_hashes(as_int32_array([1, 1, 7, 7], "token_ids"), 2)
    b = chain_hashes(as_int32_array([2, 2, 7, 7], "token_ids"), 2)
    assert a[1] != b[1]


def test_session_cache_matches_fresh_hashing_as_a_request_grows() -> None:
    """A growing session yields the same keys as hashing from scratch."""
    cache = KeyCache(chunk_size=4)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50000, size=40).astype("<i4")
    for n in (3, 8, 9, 20, 40, 12):
        assert list(cache.hashes(tokens[:n], "req")) == chain_hashes(tokens[:n], 4)


def test_session_cache_rehashes_from_the_first_divergent_chunk() -> None:
    """A reused request id with different tokens never returns stale keys."""
    cache = KeyCache(chunk_size=4)
    first = as_int32_array(range(16), "token_ids")
    cache.hashes(first, "req")
    second = first.copy()
    second[9] = 999
    assert list(cache.hashes(second, "req")) == chain_hashes(second, 4)


def test_session_cache_is_bounded_and_dropped_at_end_of_session() -> None:
    """The cache forgets least-recent sessions past its token budget, and on drop()."""
    cache = KeyCache(chunk_size=4, max_tokens=16)
    for i in range(5):
        cache.hashes(as_int32_array(range(i, i + 8), "token_ids"), f"r{i}")
    assert len(cache) == 2
    cache.drop("r4")
    assert len(cache) == 1


@pytest.mark.parametrize(
    ("bad", "message"),
    [([[1, 2]], "1-D"), ([1.5, 2.0], "integers"), ([2**31], "int32"), ("abc", "integers")],
)
def test_bad_token_ids_are_rejected_with_a_clear_error(bad: object, message: str) -> None:
    """Token ids must be 1-D integers that fit int32."""
    with pytest.raises(InvalidRequestError, match=message):
        as_int32_array(bad, "token_ids")
