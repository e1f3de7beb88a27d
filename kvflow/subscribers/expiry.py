"""Bounded, TTL-limited pending state: the one rule every pairing subscriber uses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def drain_expired(
    items: dict[K, V], horizon_ns: int, bound: int, ts_of: Callable[[V], int]
) -> Iterator[tuple[K, V]]:
    """Remove and yield, oldest first, the entries older than `horizon_ns` or beyond `bound`.

    `items` must be in time order (insertion order = oldest first), so the scan
    stops at the first entry that is recent enough while the bound holds.
    """
    while items:
        key, value = next(iter(items.items()))
        if ts_of(value) >= horizon_ns and len(items) <= bound:
            return
        del items[key]
        yield key, value
