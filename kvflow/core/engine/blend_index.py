"""The blend index: stored chunks found by their own tokens, at any offset of a new prompt.

A chunk's prefix key (docs/ENGINE.md, Keys) depends on every token before it, so a
document that moved in a prompt has new keys. The blend index also names each stored
chunk by a fingerprint of its own tokens: a 64-bit polynomial hash, which a prompt's
every window of one chunk's length gets in one vectorised pass (so a match is found at
any token offset, not only at chunk boundaries), checked against a 16-byte blake3
digest of the chunk's tokens before it counts (a fingerprint collision is never a hit).
Entries are kept per owner (model, world size, salt) and rank: an owner's chunk is
found only once every rank of its world stored it, as prefix keys are.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np

#: the hash's base (odd, so it has an inverse modulo 2^64) and that inverse
_BASE = 0x9E3779B97F4A7C15
_BASE_INV = pow(_BASE, -1, 1 << 64)
#: chunks an index holds by default; the least recently stored or found go first
DEFAULT_CAPACITY_CHUNKS = 1 << 18
#: bytes of the blake3 digest that confirms a fingerprint match
DIGEST_BYTES = 16
#: buckets of the counting filter that screens a prompt's windows before any dict
#: lookup: 2^24 one-byte counts (16 MiB, made on the first add); at the default
#: capacity about 1.5% of windows pass it by chance
FILTER_BITS = 24
_SATURATED = 255  # a bucket counted this high is never decremented again

#: (model_name, world_size, cache_salt): engines that may share KV
Owner = tuple[str, int, "str | None"]


@dataclass(frozen=True)
class BlendSegment:
    """A stored chunk found in a prompt: its tokens are prompt[offset:offset + length],
    its KV is the object `chunk_hash` (per rank), computed at `original_start`."""

    offset: int
    length: int
    chunk_hash: bytes
    original_start: int


@dataclass(slots=True)
class _Entry:
    """One stored chunk: its digest, key, original start and the ranks holding it."""

    digest: bytes
    chunk_hash: bytes
    original_start: int
    ranks: int  # bit r set: rank r stored it


class _Powers:
    """B^j and B^-j modulo 2^64 for j below a length, grown on demand."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.up = self.down = np.ones(1, dtype=np.uint64)

    def upto(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        with self.lock:
            if len(self.up) < n:
                size = max(n, 2 * len(self.up))
                self.up = _geometric(_BASE, size)
                self.down = _geometric(_BASE_INV, size)
            return self.up, self.down


def _geometric(ratio: int, size: int) -> np.ndarray:
    """1, r, r^2, ... r^(size-1) modulo 2^64."""
    out = np.ones(size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        np.cumprod(np.full(size - 1, ratio, dtype=np.uint64), out=out[1:])
    return out


_powers = _Powers()


def window_fingerprints(tokens: np.ndarray, length: int) -> np.ndarray:
    """The fingerprint of every window of `length` tokens (uint64, one per start offset
    0..len - length): sum_k t_{i+k} B^(length-1-k) mod 2^64, from prefix sums of
    t_k B^-k, so the whole prompt costs a few vector passes, however long."""
    n = len(tokens)
    if length <= 0 or n < length:
        return np.empty(0, dtype=np.uint64)
    up, down = _powers.upto(n + 1)
    values = tokens.astype(np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        sums = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum(values * down[:n], out=sums[1:])
        return (sums[length:] - sums[: n - length + 1]) * up[length - 1 : n]


def chunk_fingerprints(tokens: np.ndarray, chunk_size: int) -> np.ndarray:
    """The fingerprint of each full chunk of `tokens` (what `window_fingerprints` gives
    at offsets 0, chunk_size, ...), computed for those windows only."""
    count = len(tokens) // chunk_size
    if count == 0:
        return np.empty(0, dtype=np.uint64)
    up, _ = _powers.upto(chunk_size)
    rows = tokens[: count * chunk_size].astype(np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        return (rows.reshape(count, chunk_size) * up[chunk_size - 1 :: -1]).sum(
            axis=1, dtype=np.uint64
        )


def chunk_fingerprint(tokens: np.ndarray) -> int:
    """A chunk's fingerprint: that of its one window of its own length."""
    return int(chunk_fingerprints(tokens, len(tokens))[0])


@functools.lru_cache(maxsize=1024)
def _mix(owner: Owner) -> int:
    """The owner's 64-bit filter salt, so owners' chunks spread over the buckets apart."""
    return int.from_bytes(blake3.blake3(repr(owner).encode()).digest(8), "little")


def _digest(tokens: np.ndarray) -> bytes:
    return blake3.blake3(np.ascontiguousarray(tokens, dtype="<i4").data.cast("B")).digest(
        DIGEST_BYTES
    )


@dataclass(frozen=True)
class StoredChunks:
    """Stored chunks' hashing, done apart from `BlendIndex.insert` (on the indexing thread
    while the store's copies run): each chunk's fingerprint, digest and first token."""

    prints: list[int]
    digests: list[bytes]
    starts: list[int]


def stored_chunks(
    tokens: np.ndarray, chunk_size: int, count: int, first_chunk: int = 0
) -> StoredChunks:
    """The hashing of `count` chunks of a stored sequence (`tokens`, int32 from token 0)
    from chunk `first_chunk` on."""
    first = first_chunk * chunk_size
    prints = chunk_fingerprints(tokens[first : first + count * chunk_size], chunk_size)
    starts = list(range(first, first + count * chunk_size, chunk_size))
    digests = [_digest(tokens[s : s + chunk_size]) for s in starts]
    return StoredChunks(prints.tolist(), digests, starts)


class BlendIndex:
    """Stored chunks by fingerprint, per owner, bounded to `capacity_chunks` entries.

    Lock rule: `_lock` guards `_by_owner`, `_order` and `_size`; every method takes it
    for its whole body (no I/O happens under it: hashing and digests are CPU work).
    """

    def __init__(self, capacity_chunks: int = DEFAULT_CAPACITY_CHUNKS) -> None:
        if capacity_chunks < 1:
            raise ValueError(f"capacity_chunks must be >= 1, got {capacity_chunks}")
        self.capacity_chunks = capacity_chunks
        self._lock = threading.Lock()
        # owner -> fingerprint -> entries with that fingerprint (collisions kept apart)
        self._by_owner: dict[Owner, dict[int, list[_Entry]]] = {}
        # (owner, chunk_hash) -> fingerprint, oldest first: what to drop when full
        self._order: OrderedDict[tuple[Owner, bytes], int] = OrderedDict()
        self._counts: np.ndarray | None = None  # the filter: entries per bucket

    def __len__(self) -> int:
        with self._lock:
            return len(self._order)

    def add(
        self, owner: Owner, rank: int, tokens: np.ndarray, chunk_size: int,
        chunk_hashes: list[bytes], first_chunk: int = 0,
    ) -> None:  # fmt: skip
        """Index chunks first_chunk.. of a stored sequence (`tokens`, int32 from token 0;
        `chunk_hashes[i]` the key of chunk first_chunk + i) as stored by `rank`."""
        chunks = stored_chunks(tokens, chunk_size, len(chunk_hashes), first_chunk)
        self.insert(owner, rank, chunk_hashes, chunks)

    def insert(
        self, owner: Owner, rank: int, chunk_hashes: Sequence[bytes], chunks: StoredChunks
    ) -> None:
        """Index hashed stored chunks (`chunk_hashes[i]` the key of the chunk `chunks`
        describes i-th) as stored by `rank`: `add` with its hashing done beforehand."""
        with self._lock:
            table = self._by_owner.setdefault(owner, {})
            for chunk_hash, fp, digest, start in zip(
                chunk_hashes, chunks.prints, chunks.digests, chunks.starts, strict=True
            ):
                entry = self._entry(table, fp, chunk_hash)
                if entry is None:
                    entry = _Entry(digest, chunk_hash, start, 0)
                    table.setdefault(fp, []).append(entry)
                    self._count(owner, fp, +1)
                entry.ranks |= 1 << rank
                self._order[(owner, chunk_hash)] = fp
                self._order.move_to_end((owner, chunk_hash))
            while len(self._order) > self.capacity_chunks:
                (old_owner, old_hash), old_fp = self._order.popitem(last=False)
                self._unlink(old_owner, old_fp, old_hash)

    def remove(self, owner: Owner, chunk_hashes: list[bytes]) -> int:
        """Forget chunks whose objects left every tier; returns how many were indexed."""
        removed = 0
        with self._lock:
            for chunk_hash in chunk_hashes:
                fp = self._order.pop((owner, chunk_hash), None)
                if fp is not None:
                    self._unlink(owner, fp, chunk_hash)
                    removed += 1
        return removed

    def find(
        self, owner: Owner, ranks: Sequence[int], tokens: np.ndarray, chunk_size: int,
        start: int = 0,
    ) -> list[BlendSegment]:  # fmt: skip
        """Non-overlapping stored chunks in tokens[start:], leftmost first: each window
        whose fingerprint is indexed, whose digest matches and that every rank of `ranks`
        stored; a window overlapping a taken one is skipped."""
        prints = window_fingerprints(tokens[start:], chunk_size)
        everyone = sum(1 << r for r in ranks)
        with self._lock:
            table = self._by_owner.get(owner)
            if not table or not len(prints) or self._counts is None:
                return []
            buckets = (prints ^ np.uint64(_mix(owner))) & np.uint64((1 << FILTER_BITS) - 1)
            offsets = np.flatnonzero(self._counts[buckets])
            found: list[BlendSegment] = []
            free_from = 0
            for offset in offsets.tolist():
                if offset < free_from:
                    continue
                at = start + offset
                entries = table.get(int(prints[offset]))
                entry = entries and self._match(entries, tokens[at : at + chunk_size])
                if not entry or entry.ranks & everyone != everyone:
                    continue
                found.append(BlendSegment(at, chunk_size, entry.chunk_hash, entry.original_start))
                self._order.move_to_end((owner, entry.chunk_hash))
                free_from = offset + chunk_size
            return found

    def matches(self, owner: Owner, chunk_hash: bytes, window: np.ndarray) -> bool | None:
        """Whether `window` holds the tokens of indexed chunk `chunk_hash` (its digest);
        None when the index does not know the chunk."""
        with self._lock:
            fp = self._order.get((owner, chunk_hash))
            entry = None if fp is None else self._entry(self._by_owner[owner], fp, chunk_hash)
        if entry is None:
            return None
        return _digest(window) == entry.digest

    @staticmethod
    def _entry(table: dict[int, list[_Entry]], fp: int, chunk_hash: bytes) -> _Entry | None:
        return next((e for e in table.get(fp, ()) if e.chunk_hash == chunk_hash), None)

    @staticmethod
    def _match(entries: list[_Entry], window: np.ndarray) -> _Entry | None:
        """The entry whose chunk's tokens are `window` (digest equal), if any."""
        digest = _digest(window)
        return next((e for e in entries if e.digest == digest), None)

    def _count(self, owner: Owner, fp: int, step: int) -> None:
        """Count an entry in (or out of) its filter bucket; saturated buckets stay."""
        if self._counts is None:
            self._counts = np.zeros(1 << FILTER_BITS, dtype=np.uint8)
        bucket = (fp ^ _mix(owner)) & ((1 << FILTER_BITS) - 1)
        count = int(self._counts[bucket])
        if count != _SATURATED:
            self._counts[bucket] = count + step

    def _unlink(self, owner: Owner, fp: int, chunk_hash: bytes) -> None:
        self._count(owner, fp, -1)
        table = self._by_owner[owner]
        kept = [e for e in table[fp] if e.chunk_hash != chunk_hash]
        if kept:
            table[fp] = kept
        else:
            del table[fp]
        if not table:
            del self._by_owner[owner]
