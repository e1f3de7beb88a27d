"""Deterministic sampling: the same keep/skip decision for a key in every process.

A key's parts are folded through a seeded splitmix64 mix (strings through blake3
first), so the decision depends only on (seed, key) and never on Python's
per-process hash randomisation. `keep_mask` decides many integer ids at once.
"""

from __future__ import annotations

from functools import lru_cache

import blake3
import numpy as np

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _mix(z: int) -> int:
    z = (z + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _mix_array(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


@lru_cache(maxsize=4096)
def _part_hash(part: str | bytes) -> int:
    data = part.encode() if isinstance(part, str) else part
    return int.from_bytes(blake3.blake3(data).digest(8), "little")


class Sampler:
    """Keeps a key with probability `rate`, decided by a seeded hash of the key."""

    __slots__ = ("_seed_hash", "_threshold", "rate", "seed")

    def __init__(self, rate: float, seed: int = 0) -> None:
        if not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"sample rate must be a number in [0, 1], got {rate!r}")
        if not isinstance(seed, int):
            raise ValueError(f"sample seed must be an integer, got {seed!r}")
        self.rate = float(rate)
        self.seed = seed
        self._seed_hash = _mix(seed & _MASK)
        # keep when hash < threshold; rate 1.0 keeps every key (threshold above any hash)
        self._threshold = min(int(self.rate * 2.0**64), 1 << 64)

    def _fold(self, parts: tuple[int | str | bytes, ...]) -> int:
        h = self._seed_hash
        for part in parts:
            value = part & _MASK if isinstance(part, int) else _part_hash(part)
            h = _mix(h ^ value)
        return h

    def keep(self, *key: int | str | bytes) -> bool:
        """The decision for `key` (identical in every process for the same seed)."""
        return self._fold(key) < self._threshold

    def keep_mask(self, *prefix: int | str | bytes, ids: np.ndarray) -> np.ndarray:
        """Vectorised `keep(*prefix, id)` for every integer in `ids`; a bool array."""
        if self._threshold >= 1 << 64:
            return np.ones(len(ids), dtype=bool)
        if self._threshold == 0:
            return np.zeros(len(ids), dtype=bool)
        h = np.uint64(self._fold(prefix))
        values = np.asarray(ids).astype(np.int64).view(np.uint64)
        return _mix_array(values ^ h) < np.uint64(self._threshold)
