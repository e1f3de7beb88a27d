"""Chunk keys: chained blake3 from the published seed, cached per session and by prefix."""

from __future__ import annotations

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.core.arrays import as_int32_array
from kvflow.core.engine import keys as keys_module
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


def test_keys_without_a_session_are_the_plain_chain() -> None:
    """hashes() with no session id hashes from the seed and remembers nothing."""
    cache = KeyCache(chunk_size=4)
    tokens = as_int32_array(range(10), "token_ids")
    assert list(cache.hashes(tokens)) == chain_hashes(tokens, 4)
    assert len(cache) == 0


def test_chunk_size_one_is_allowed_and_zero_is_refused() -> None:
    """Every token is its own chunk at chunk_size 1; below 1 is a clear error."""
    tokens = as_int32_array([5, 6, 7], "token_ids")
    assert list(KeyCache(chunk_size=1).hashes(tokens, "s")) == chain_hashes(tokens, 1)
    with pytest.raises(ValueError, match=r"^chunk_size must be >= 1, got 0$"):
        KeyCache(chunk_size=0)


class _CountingChain:
    """Wraps the real chain_hashes and records how many chunk keys each call computed."""

    def __init__(self) -> None:
        self.computed: list[int] = []

    def __call__(self, tokens: np.ndarray, chunk_size: int, prev: bytes = KEY_SEED) -> list[bytes]:
        out = chain_hashes(tokens, chunk_size, prev)
        self.computed.append(len(out))
        return out


def test_a_session_hashes_only_chunks_it_has_not_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Growing, repeating, shrinking and re-growing a request hashes each chunk once."""
    counter = _CountingChain()
    monkeypatch.setattr(keys_module, "chain_hashes", counter)
    cache = KeyCache(chunk_size=4)
    tokens = as_int32_array(range(100, 116), "token_ids")
    for n, new_chunks in ((8, 2), (8, 0), (16, 2), (16, 0), (8, 0), (16, 0)):
        before = sum(counter.computed)
        assert list(cache.hashes(tokens[:n], "req")) == chain_hashes(tokens[:n], 4)
        assert sum(counter.computed) - before == new_chunks, n


def test_a_divergent_session_rehashes_from_the_divergent_chunk_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tokens differing in chunk 2 keep chunks 0 and 1's keys and hash chunks 2 and 3."""
    counter = _CountingChain()
    monkeypatch.setattr(keys_module, "chain_hashes", counter)
    cache = KeyCache(chunk_size=4)
    first = as_int32_array(range(16), "token_ids")
    cache.hashes(first, "req")
    second = first.copy()
    second[9] = 999
    assert list(cache.hashes(second, "req")) == chain_hashes(second, 4)
    assert counter.computed == [4, 2]


def _session(cache: KeyCache, tokens: int, session: str) -> None:
    """Hash tokens 0..tokens-1 as `session`'s prompt."""
    cache.hashes(as_int32_array(range(tokens), "token_ids"), session)


def test_a_session_exactly_at_the_token_budget_is_kept() -> None:
    """A chain of max_tokens tokens fits; one above it is not remembered."""
    cache = KeyCache(chunk_size=4, max_tokens=8)
    _session(cache, 8, "fits")
    assert len(cache) == 1
    _session(cache, 12, "too-long")
    assert len(cache) == 1


def test_a_short_request_counts_no_tokens_against_the_budget() -> None:
    """A session with no full chunk yet holds no tokens, so it evicts nobody."""
    cache = KeyCache(chunk_size=4, max_tokens=8)
    _session(cache, 8, "full")
    cache.hashes(as_int32_array([1, 2], "token_ids"), "short")
    assert len(cache) == 2
    cache = KeyCache(chunk_size=4, max_tokens=0)
    cache.hashes(as_int32_array([1, 2], "token_ids"), "short")
    assert len(cache) == 1


def test_eviction_takes_the_least_recently_used_session() -> None:
    """Touching a session moves it to the back; the budget evicts the oldest untouched one."""
    cache = KeyCache(chunk_size=4, max_tokens=16)
    _session(cache, 8, "a")
    _session(cache, 8, "b")
    _session(cache, 8, "a")
    _session(cache, 8, "c")
    assert len(cache) == 2
    cache.drop("a")  # still cached: "b" was the one evicted
    assert len(cache) == 1
    cache.drop("b")  # already gone
    assert len(cache) == 1


def test_rehashing_a_session_counts_its_tokens_once() -> None:
    """Re-hashing a session replaces its token count rather than adding to it."""
    cache = KeyCache(chunk_size=4, max_tokens=16)
    _session(cache, 4, "a")
    _session(cache, 8, "b")
    _session(cache, 4, "a")
    for _ in range(3):
        _session(cache, 8, "b")
    assert len(cache) == 2  # 4 + 8 tokens
    _session(cache, 4, "c")
    assert len(cache) == 3  # 16 tokens: exactly the budget


def test_dropping_a_session_returns_its_tokens_to_the_budget() -> None:
    """After drop(), the freed tokens make room; dropping an unknown session is a no-op."""
    cache = KeyCache(chunk_size=4, max_tokens=16)
    cache.drop("never-seen")
    _session(cache, 4, "a")
    _session(cache, 8, "b")
    cache.drop("b")
    assert len(cache) == 1
    _session(cache, 12, "c")
    assert len(cache) == 2  # 4 + 12 tokens: exactly the budget


def _plain_python_chain(tokens: list[int], chunk_size: int) -> list[bytes]:
    """The published definition, written out with nothing shared with the module."""
    keys, prev = [], blake3.blake3(b"kvflow/chunk-key/v1").digest()
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        chunk = tokens[start : start + chunk_size]
        prev = blake3.blake3(prev + b"".join(t.to_bytes(4, "little", signed=True) for t in chunk))
        prev = prev.digest()
        keys.append(prev)
    return keys


_TOKEN = st.integers(-(2**31), 2**31 - 1)


@settings(max_examples=60, deadline=None)
@given(
    base=st.lists(_TOKEN, max_size=40),
    turns=st.lists(
        st.tuples(st.integers(0, 40), st.lists(_TOKEN, max_size=12), st.sampled_from([None, "s"])),
        min_size=1,
        max_size=8,
    ),
)
def test_cached_keys_equal_the_plain_python_chain(
    base: list[int], turns: list[tuple[int, list[int], str | None]]
) -> None:
    """Prompts that share, extend, cut and diverge from earlier ones, with or without a
    session, get exactly the keys of the plain chain: no cached prefix ever leaks."""
    cache = KeyCache(chunk_size=3, max_prefix_tokens=24, chains_per_first_chunk=2)
    for keep, tail, session in turns:
        prompt = base[:keep] + tail
        got = cache.hashes(as_int32_array(prompt, "token_ids"), session)
        assert list(got) == _plain_python_chain(prompt, 3)


def test_a_repeated_prompt_without_a_session_is_hashed_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lookups of the same prompt with no request id hash its chunks only the first time."""
    counter = _CountingChain()
    monkeypatch.setattr(keys_module, "chain_hashes", counter)
    cache = KeyCache(chunk_size=4)
    tokens = as_int32_array(range(40), "token_ids")
    for _ in range(3):
        assert list(cache.hashes(tokens)) == chain_hashes(tokens, 4)
    assert counter.computed == [10]


def test_a_prompt_sharing_a_cached_prefix_hashes_only_what_follows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A longer turn, a shorter cut and a divergent prompt reuse the longest cached prefix,
    and a new session starts from it too."""
    counter = _CountingChain()
    monkeypatch.setattr(keys_module, "chain_hashes", counter)
    cache = KeyCache(chunk_size=4)
    turn = as_int32_array(range(16), "token_ids")
    longer = as_int32_array(range(24), "token_ids")
    other = as_int32_array([*range(10), *range(500, 514)], "token_ids")  # differs in chunk 2
    for tokens, session in ((turn, None), (longer, None), (turn[:8], None), (other, None)):
        assert list(cache.hashes(tokens, session)) == chain_hashes(tokens, 4)
    assert list(cache.hashes(longer, "new")) == chain_hashes(longer, 4)
    assert counter.computed == [4, 2, 4]


def test_prefix_chains_are_bounded_by_tokens_and_per_first_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the token budget the least recent first chunk is forgotten, and a first chunk
    keeps only its most recent chains: a forgotten prompt is hashed again."""
    counter = _CountingChain()
    monkeypatch.setattr(keys_module, "chain_hashes", counter)
    cache = KeyCache(chunk_size=4, max_prefix_tokens=16, chains_per_first_chunk=2)
    a, b, c = (as_int32_array(range(s, s + 8), "token_ids") for s in (0, 100, 200))
    for tokens in (a, b, c, a):  # c evicts a (16 tokens held at most)
        cache.hashes(tokens)
    assert counter.computed == [2, 2, 2, 2]
    counter.computed.clear()
    x, y, z = (as_int32_array([1, 2, 3, 4, k, 0, 0, 0], "token_ids") for k in (7, 8, 9))
    for tokens in (x, y, z, x):  # z pushes x out of its first chunk's two chains
        cache.hashes(tokens)
    assert counter.computed == [2, 1, 1, 1]
    counter.computed.clear()
    grown = as_int32_array(range(300, 308), "token_ids")
    for tokens in (grown[:4], grown, a, grown):  # grown replaced its first turn: 8 + 8 tokens
        cache.hashes(tokens)
    assert counter.computed == [1, 1, 2]
    with pytest.raises(ValueError, match=r"^max_prefix_tokens must be >= 0, got -1$"):
        KeyCache(chunk_size=4, max_prefix_tokens=-1)
    with pytest.raises(ValueError, match=r"^chains_per_first_chunk must be >= 1, got 0$"):
        KeyCache(chunk_size=4, chains_per_first_chunk=0)


def test_a_prompt_array_changed_in_place_after_hashing_gets_fresh_keys() -> None:
    """The cache keeps its own copy of the tokens: a caller reusing its buffer is safe."""
    cache = KeyCache(chunk_size=4)
    tokens = as_int32_array(range(16), "token_ids")
    cache.hashes(tokens)
    tokens[13] = 999
    assert list(cache.hashes(tokens)) == _plain_python_chain(tokens.tolist(), 4)
