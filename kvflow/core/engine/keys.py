"""Chunk keys (docs/ENGINE.md, Keys): chained blake3 over full chunks, cached per session and by prefix.

H_i = blake3(H_{i-1} || chunk i's tokens as little-endian int32), H_{-1} = KEY_SEED.
A session's chain is kept so a growing request only hashes its new chunks, and
recently hashed prompts' chains are kept by their first chunk, so a prompt that
shares a prefix with one of them (a repeated lookup, a longer turn of the same
conversation, a common system prompt) only hashes the chunks after that prefix.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import blake3
import numpy as np

#: H_{-1}: blake3(b"kvflow/chunk-key/v1"). Published and fixed: changing it invalidates every key.
KEY_SEED = bytes.fromhex("ab2d09b437b3cabb2a4488c0207473a2d34a4b4c3817dac1a48bf20163f85396")
KEY_SEED_LABEL = b"kvflow/chunk-key/v1"


def chain_hashes(tokens: np.ndarray, chunk_size: int, prev: bytes = KEY_SEED) -> list[bytes]:
    """The keys of every full chunk of `tokens` (int32 LE), chained from `prev`.

    The chain is sequential by definition, so this is one blake3 call per chunk, each
    over a view of the tokens' buffer (no copy of a contiguous array); as many bare
    blake3 calls are its floor (docs/PERFORMANCE.md, RPC)."""
    out: list[bytes] = []
    step = chunk_size * 4
    data = np.ascontiguousarray(tokens).data.cast("B")
    new_hash, append = blake3.blake3, out.append
    for start in range(0, (len(tokens) // chunk_size) * step, step):
        h = new_hash(prev)
        h.update(data[start : start + step])
        prev = h.digest()
        append(prev)
    return out


class _Chain:
    """A hashed prefix: the tokens of its full chunks and their keys (never changed once made)."""

    __slots__ = ("hashes", "tokens")

    def __init__(self, tokens: np.ndarray, hashes: list[bytes]) -> None:
        self.tokens = tokens
        self.hashes = hashes


_EMPTY = _Chain(np.empty(0, dtype="<i4"), [])


def _common_chunks(a: np.ndarray, b: np.ndarray, chunk_size: int) -> int:
    """How many full chunks `a` and `b` share from their start."""
    n = min(len(a), len(b)) // chunk_size * chunk_size
    differ = a[:n] != b[:n]
    return int(differ.argmax()) // chunk_size if differ.any() else n // chunk_size


class _PrefixChains:
    """Recently hashed chains, found by their first chunk's tokens (LRU, bounded by tokens).

    A first chunk keeps at most `per_head` chains (the most recent); a chain that an
    extension of it replaces is dropped. Not thread-safe: KeyCache holds its lock.
    """

    def __init__(self, chunk_size: int, max_tokens: int, per_head: int) -> None:
        self.chunk_size = chunk_size
        self.max_tokens = max_tokens
        self.per_head = per_head
        self._heads: OrderedDict[bytes, list[_Chain]] = OrderedDict()
        self._tokens = 0

    def longest(self, full: np.ndarray) -> tuple[_Chain, int]:
        """The chain sharing the most full chunks with `full` (tokens of full chunks), and
        that count; (an empty chain, 0) when none shares the first chunk."""
        bucket = self._heads.get(full[: self.chunk_size].tobytes()) if len(full) else None
        best, best_known = _EMPTY, 0
        for chain in bucket or ():
            known = _common_chunks(chain.tokens, full, self.chunk_size)
            if known > best_known:
                best, best_known = chain, known
        if best_known:
            self._heads.move_to_end(full[: self.chunk_size].tobytes())
        return best, best_known

    def remember(self, chain: _Chain, replaces: _Chain) -> None:
        """Keep `chain` as its first chunk's most recent, dropping `replaces` (the chain it
        extends) from that first chunk's list."""
        if not chain.hashes or len(chain.tokens) > self.max_tokens:
            return
        head = chain.tokens[: self.chunk_size].tobytes()
        old = self._heads.pop(head, [])
        bucket = [*(c for c in old if c is not replaces), chain][-self.per_head :]
        self._heads[head] = bucket
        self._tokens += sum(len(c.tokens) for c in bucket) - sum(len(c.tokens) for c in old)
        while self._tokens > self.max_tokens:
            _, evicted = self._heads.popitem(last=False)
            self._tokens -= sum(len(c.tokens) for c in evicted)


class KeyCache:
    """Chunk-key chains: per session (by request id) and by prefix, each bounded by the
    tokens it remembers (least recently used first).

    Thread-safe. Cached tokens are always compared with the request's, so a session or
    prefix whose tokens diverge is re-hashed from the first differing chunk, and a
    reused request id never yields stale keys.
    """

    def __init__(
        self,
        chunk_size: int,
        max_tokens: int = 1 << 24,
        max_prefix_tokens: int = 1 << 22,
        chains_per_first_chunk: int = 8,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if max_prefix_tokens < 0:
            raise ValueError(f"max_prefix_tokens must be >= 0, got {max_prefix_tokens}")
        if chains_per_first_chunk < 1:
            raise ValueError(f"chains_per_first_chunk must be >= 1, got {chains_per_first_chunk}")
        self.chunk_size = chunk_size
        self.max_tokens = max_tokens
        self._chains: OrderedDict[str, _Chain] = OrderedDict()
        self._prefixes = _PrefixChains(chunk_size, max_prefix_tokens, chains_per_first_chunk)
        self._tokens = 0
        self._lock = threading.Lock()

    def hashes(self, tokens: np.ndarray, session_id: str | None = None) -> Sequence[bytes]:
        """Keys of every full chunk of `tokens`, reusing the longest cached prefix (the
        session's chain, else a recent prompt's)."""
        cs = self.chunk_size
        n_full = len(tokens) // cs
        full = tokens[: n_full * cs]
        with self._lock:
            chain = _EMPTY if session_id is None else self._chains.pop(session_id, _EMPTY)
            self._tokens -= len(chain.tokens)
            known = _common_chunks(chain.tokens, full, cs)
            if known < n_full:
                found, found_known = self._prefixes.longest(full)
                if found_known > known:
                    chain, known = found, found_known
                    if len(found.hashes) > n_full:  # a session counts only its own tokens
                        chain = _Chain(found.tokens[: n_full * cs], found.hashes[:n_full])
            if known < n_full:
                prev = chain.hashes[known - 1] if known else KEY_SEED
                fresh = chain_hashes(full[known * cs :], cs, prev)
                extended = _Chain(full.copy(), chain.hashes[:known] + fresh)
                self._prefixes.remember(extended, chain if known == len(chain.hashes) else _EMPTY)
                chain = extended
            if session_id is not None:
                self._keep(session_id, chain)
            return chain.hashes if len(chain.hashes) == n_full else chain.hashes[:n_full]

    def _keep(self, session_id: str, chain: _Chain) -> None:
        """Remember `session_id`'s chain unless it alone is over budget; evict past it."""
        if len(chain.tokens) > self.max_tokens:
            return
        self._chains[session_id] = chain
        self._tokens += len(chain.tokens)
        while self._tokens > self.max_tokens:
            _, old = self._chains.popitem(last=False)
            self._tokens -= len(old.tokens)

    def drop(self, session_id: str) -> None:
        """Forget a session's chain (at end_session)."""
        with self._lock:
            chain = self._chains.pop(session_id, None)
            if chain is not None:
                self._tokens -= len(chain.tokens)

    def __len__(self) -> int:
        with self._lock:
            return len(self._chains)
