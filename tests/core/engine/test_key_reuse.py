"""Reused key chains (by session and by prompt prefix) never stand for anything but the
chain itself: the same keys as hashing afresh, memory within the prefix budget, and no
hit across models or cache salts however the caches were warmed."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.core.engine.keys import KeyCache, chain_hashes
from tests.support.engine import CHUNK, caches, small_engine

TOKENS = np.arange(100, 100 + 3 * CHUNK + 3, dtype=np.int32)  # 3 full chunks + a partial one
BLOCKS = [5, 2, 9, 0, 14, 7, 3]


def test_a_long_prompt_and_its_variants_get_the_uncached_keys() -> None:
    """500 chunks of 256: a repeat, a cut, a longer turn and prompts differing at the
    first, a middle and the last chunk get the keys of a cache that keeps nothing."""
    rng = np.random.default_rng(1)
    base = rng.integers(0, 150_000, 128_256, dtype=np.int32)
    variants = [base, base, base[:64_000], np.concatenate([base, base[:1000]])]
    for at in (3, 64_001, 127_999):
        changed = base.copy()
        changed[at] += 1
        variants.append(changed)
    cached = KeyCache(chunk_size=256)
    uncached = KeyCache(chunk_size=256, max_tokens=0, max_prefix_tokens=0)
    for i, tokens in enumerate(variants):
        want = chain_hashes(tokens, 256)
        assert list(cached.hashes(tokens)) == want, i
        assert list(cached.hashes(tokens, "session")) == want, i
        assert list(uncached.hashes(tokens)) == want, i


def _held_prefix_tokens(cache: KeyCache) -> tuple[int, int]:
    """(the prefix chains' token count as kept, the tokens they really hold)."""
    prefixes = cache._prefixes  # the bound is on memory: count what is really held
    held = sum(len(c.tokens) for bucket in prefixes._heads.values() for c in bucket)
    return prefixes._tokens, held


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 40), st.sampled_from([None, "s", "t"])),
        min_size=1,
        max_size=30,
    )
)
def test_prefix_chains_never_hold_more_tokens_than_their_budget(
    prompts: list[tuple[int, int, str | None]],
) -> None:
    """Prompts of a few first chunks, growing, cut and repeated: the count kept is the
    tokens really held, and never above max_prefix_tokens."""
    cache = KeyCache(chunk_size=4, max_prefix_tokens=32, chains_per_first_chunk=2)
    for head, length, session in prompts:
        tokens = np.arange(head * 1000, head * 1000 + length, dtype=np.int32)
        cache.hashes(tokens, session)
        counted, held = _held_prefix_tokens(cache)
        assert counted == held <= 32


def test_warm_key_caches_find_objects_only_under_their_model_and_salt() -> None:
    """Lookups of one prompt under other models and salts, with and without the session's
    id and before and after the right one, hit nothing: the caches hold key chains, never
    answers, and every probe carries its own model and salt."""
    engine, _ = small_engine()
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    engine.store("a", TOKENS, BLOCKS, request_id="q", cache_salt="s1")
    others = [("m", None), ("m", "s2"), ("other", "s1"), ("other", None)]
    for rid in (None, "q", "fresh"):
        for model, salt in others:
            assert engine.lookup(TOKENS, model_name=model, cache_salt=salt, request_id=rid) == 0
        assert engine.lookup(TOKENS, model_name="m", cache_salt="s1", request_id=rid) == 3 * CHUNK
        for model, salt in others:
            assert engine.lookup(TOKENS, model_name=model, cache_salt=salt, request_id=rid) == 0
    engine.close()
