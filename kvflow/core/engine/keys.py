"""Chunk keys (docs/ENGINE.md, Keys): chained blake3 over full chunks, cached per session.

H_i = blake3(H_{i-1} || chunk i's tokens as little-endian int32), H_{-1} = KEY_SEED.
A session's chain is kept so a growing request only hashes its new chunks.
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
    """The keys of every full chunk of `tokens` (int32 LE), chained from `prev`."""
    out: list[bytes] = []
    data = tokens.tobytes()
    step = chunk_size * 4
    for start in range(0, (len(tokens) // chunk_size) * step, step):
        h = blake3.blake3(prev)
        h.update(data[start : start + step])
        prev = h.digest()
        out.append(prev)
    return out


class _Chain:
    """One session's hashed prefix: its tokens and their chunk keys."""

    __slots__ = ("hashes", "tokens")

    def __init__(self) -> None:
        self.tokens = np.empty(0, dtype="<i4")
        self.hashes: list[bytes] = []


class KeyCache:
    """Per-session chunk-key chains, bounded by the total tokens they remember (LRU).

    Thread-safe. A session whose tokens diverge from its cached prefix is re-hashed
    from the first differing chunk, so a reused request id never yields stale keys.
    """

    def __init__(self, chunk_size: int, max_tokens: int = 1 << 24) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self.max_tokens = max_tokens
        self._chains: OrderedDict[str, _Chain] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def hashes(self, tokens: np.ndarray, session_id: str | None = None) -> Sequence[bytes]:
        """Keys of every full chunk of `tokens`, reusing the session's cached prefix."""
        if session_id is None:
            return chain_hashes(tokens, self.chunk_size)
        cs = self.chunk_size
        n_full = len(tokens) // cs
        with self._lock:
            chain = self._chains.pop(session_id, None)
            if chain is None:
                chain = _Chain()
            else:
                self._tokens -= len(chain.tokens)
            known = min(len(chain.hashes), n_full)
            if known and not np.array_equal(chain.tokens[: known * cs], tokens[: known * cs]):
                diff = int(np.argmax(chain.tokens[: known * cs] != tokens[: known * cs]))
                known = diff // cs
            if known < n_full:
                prev = chain.hashes[known - 1] if known else KEY_SEED
                fresh = chain_hashes(tokens[known * cs : n_full * cs], cs, prev)
                chain.hashes = chain.hashes[:known] + fresh
                chain.tokens = tokens[: n_full * cs].copy()
            result = chain.hashes[:n_full]
            if len(chain.tokens) <= self.max_tokens:
                self._chains[session_id] = chain
                self._tokens += len(chain.tokens)
                while self._tokens > self.max_tokens:
                    _, old = self._chains.popitem(last=False)
                    self._tokens -= len(old.tokens)
            return result

    def drop(self, session_id: str) -> None:
        """Forget a session's chain (at end_session)."""
        with self._lock:
            chain = self._chains.pop(session_id, None)
            if chain is not None:
                self._tokens -= len(chain.tokens)

    def __len__(self) -> int:
        with self._lock:
            return len(self._chains)
