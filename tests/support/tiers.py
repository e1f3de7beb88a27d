"""L2 tiers for engine tests: a host-memory tier, and a wrapper that hangs, fails or lies.

`memory_tier` is a real tier (L1's implementation on unpinned memory, renamed) so the
engine's L2 path runs without a disk; `FaultyTier` wraps any tier and, per call kind,
holds answers back until released, raises, or answers a key's load False; `SlowTier`
wraps any tier and answers its stores late, one at a time (a slow disk).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvflow.core.tiers.base import ObjectKey, StorageTier, StoreOutcome
from kvflow.core.tiers.hostmem import HostPool
from kvflow.core.tiers.l1 import L1Cache


def memory_tier(capacity_bytes: int = 1 << 20, name: str = "mem") -> L1Cache:
    """A host-memory StorageTier named `name` (L1's code, unpinned)."""
    tier = L1Cache(capacity_bytes, pool=HostPool(pinned=False))
    tier.name = name
    return tier


class FaultyTier:
    """A StorageTier that forwards to `inner` unless told to misbehave.

    `gate` (when set) holds every load's answer until `release()`; `hang` names calls
    ("contains", "load", "store") whose futures never complete; `fail` names calls that
    raise OSError in their future; `lie_keys` are keys whose loads answer False.
    """

    def __init__(self, inner: StorageTier) -> None:
        self.inner = inner
        self.name = inner.name
        self.hang: set[str] = set()
        self.fail: set[str] = set()
        self.lie_keys: set[ObjectKey] = set()
        self.gate: threading.Event | None = None
        self.calls: dict[str, int] = {"contains": 0, "store": 0, "load": 0}
        self._held: list[Callable[[], None]] = []

    def _fault(self, call: str) -> Future[Any] | None:
        self.calls[call] += 1
        if call in self.hang:
            return Future()
        if call in self.fail:
            future: Future[Any] = Future()
            future.set_exception(OSError(f"injected {call} failure"))
            return future
        return None

    def contains(self, keys: Sequence[ObjectKey]) -> Future[list[bool]]:
        return self._fault("contains") or self.inner.contains(keys)

    def store(self, items: Sequence[tuple[ObjectKey, torch.Tensor]]) -> Future[StoreOutcome]:
        return self._fault("store") or self.inner.store(items)

    def load(self, keys: Sequence[ObjectKey], dsts: Sequence[torch.Tensor]) -> Future[list[bool]]:
        faulty = self._fault("load")
        if faulty is not None:
            return faulty
        answer = self.inner.load(keys, dsts).result()
        answer = [ok and key not in self.lie_keys for key, ok in zip(keys, answer, strict=True)]
        future: Future[list[bool]] = Future()
        if self.gate is None:
            future.set_result(answer)
        else:
            gate = self.gate
            threading.Thread(target=lambda: (gate.wait(), future.set_result(answer))).start()
        return future

    def pin(self, keys: Sequence[ObjectKey]) -> int:
        return self.inner.pin(keys)

    def unpin(self, keys: Sequence[ObjectKey]) -> None:
        self.inner.unpin(keys)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def drop_where(self, predicate: Callable[[Any], bool]) -> int:
        return self.inner.drop_where(predicate)

    def close(self) -> None:
        if self.gate is not None:
            self.gate.set()
        self.inner.close()


class HeldFilter:
    """A drop_where filter that keeps the I/O thread running it busy: it sets `entered`
    on its first key, then waits (at most 30 s) for `release`, keeping nothing."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, _: ObjectKey) -> bool:
        self.entered.set()
        self.release.wait(30)
        return False


class SlowTier:
    """A StorageTier whose stores run one at a time on one thread, each `delay_s` per
    chunk longer than `inner` takes: a tier slower than the engine's stores (a slow
    disk), so write bursts build a backlog. Every other call goes straight to `inner`."""

    def __init__(self, inner: StorageTier, delay_s: float) -> None:
        self.inner = inner
        self.name = inner.name
        self.delay_s = delay_s
        #: when set, stores wait (at most 30 s) for it before they start: a stalled tier
        self.gate: threading.Event | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slow-tier")

    def _store(self, items: Sequence[tuple[ObjectKey, torch.Tensor]]) -> StoreOutcome:
        if self.gate is not None:
            self.gate.wait(30)
        time.sleep(self.delay_s * len(items))
        return self.inner.store(items).result()

    def store(self, items: Sequence[tuple[ObjectKey, torch.Tensor]]) -> Future[StoreOutcome]:
        return self._pool.submit(self._store, list(items))

    def contains(self, keys: Sequence[ObjectKey]) -> Future[list[bool]]:
        return self.inner.contains(keys)

    def load(self, keys: Sequence[ObjectKey], dsts: Sequence[torch.Tensor]) -> Future[list[bool]]:
        return self.inner.load(keys, dsts)

    def pin(self, keys: Sequence[ObjectKey]) -> int:
        return self.inner.pin(keys)

    def unpin(self, keys: Sequence[ObjectKey]) -> None:
        self.inner.unpin(keys)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def drop_where(self, predicate: Callable[[Any], bool]) -> int:
        return self.inner.drop_where(predicate)

    def close(self) -> None:
        if self.gate is not None:
            self.gate.set()
        self._pool.shutdown(wait=True)
        self.inner.close()
