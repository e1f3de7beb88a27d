"""The storage-tier interface: what L1 implements now and the L2 tiers (disk, Redis) next.

Every call of `StorageTier` returns at once. Questions and transfers hand back a
`concurrent.futures.Future` that completes when the tier has answered, so a caller
bounds each wait with a timeout of its own and a slow tier never blocks the engine's
request path; a memory tier answers before returning (its futures are already done).
A tier keeps its own bookkeeping (which objects exist, pins, LRU eviction at
capacity); bytes come and go as host buffers (1-D uint8 CPU tensors).

`HostTier` adds what the engine's movers need of the tier whose objects live in
page-locked host memory (L1): two-phase writes the movers fill in place (reserve
invisible objects, then commit or abort), and pinned reads of a key prefix.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

import torch

T = TypeVar("T")
R = TypeVar("R")

#: stats() keys every tier reports (bytes, object counts, evictions since start)
STAT_KEYS = ("usage_bytes", "capacity_bytes", "objects", "evicted_chunks", "evicted_bytes")


class ObjectKey(NamedTuple):
    """Identity of one stored object: a chunk of one rank of one model's world."""

    chunk_hash: bytes
    model_name: str
    world_size: int
    rank: int
    cache_salt: str | None


@dataclass(frozen=True)
class StoreOutcome:
    """What one `StorageTier.store` did, key by key summed up.

    `stored` objects were written, `present` were held already, `failed` could not be
    written (no room left once unpinned objects were evicted, an I/O error); writing
    evicted `evicted_chunks` objects of `evicted_bytes` bytes, `evicted_keys` (a tier that
    evicts fills them in, for the KV-event stream).
    """

    stored: int = 0
    present: int = 0
    failed: int = 0
    evicted_chunks: int = 0
    evicted_bytes: int = 0
    evicted_keys: tuple[ObjectKey, ...] = ()


@dataclass
class WritePlan:
    """A `HostTier` write in progress: which keys are covered and which objects to fill.

    `covered` keys (a prefix of `keys`) are present, being written by another writer,
    or newly reserved in `new` as (index in keys, object handle); the handles are
    invisible to readers until `commit`. `evicted_keys` are the objects evicted to make
    room (for the KV-event stream: docs/EVENTS.md, KV events).
    """

    keys: Sequence[Hashable]
    covered: int
    new: list[tuple[int, Any]] = field(default_factory=list)
    evicted_chunks: int = 0
    evicted_bytes: int = 0
    evicted_keys: list[Hashable] = field(default_factory=list)
    #: made visible (`commit` runs once per plan, whoever gets there first)
    committed: bool = False


class HostChunks(Protocol):
    """Objects' bytes as a mover reads them: tensors (CPU movers) or host addresses."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> torch.Tensor:
        """Object `index`'s bytes (uint8, 1-D)."""
        ...

    def address(self, index: int, nbytes: int) -> int:
        """Object `index`'s page-locked host address; ValueError unless it holds `nbytes`."""
        ...

    def region(self, index: int) -> int:
        """Which page-locked region (one registration: an L1 segment) object `index` lies
        in. One copy may span several objects only within one region: the driver refuses
        a copy whose extent crosses from one registration into another."""
        ...


@runtime_checkable
class StorageTier(Protocol):
    """One storage tier. Every method returns without waiting on I/O."""

    #: the tier's label in events, metrics and status ("l1", "disk", "redis")
    name: str

    def contains(self, keys: Sequence[ObjectKey]) -> Future[list[bool]]:
        """Which of `keys` the tier holds, in one batch (one answer per key, in order)."""
        ...

    def store(self, items: Sequence[tuple[ObjectKey, torch.Tensor]]) -> Future[StoreOutcome]:
        """Write each key's bytes unless the tier holds the key already.

        The caller keeps each tensor alive and unchanged until the future completes. A
        key is visible to `contains` and `load` only once its bytes are whole.
        ValueError (raised, not in the future) for items that are not (key, 1-D uint8
        CPU tensor) pairs; then nothing is written.
        """
        ...

    def load(self, keys: Sequence[ObjectKey], dsts: Sequence[torch.Tensor]) -> Future[list[bool]]:
        """Copy each key's bytes into `dsts[i]` (1-D uint8 CPU tensors, kept alive by the
        caller until the future completes); a key is pinned while its load runs.

        One answer per key: False when the tier does not hold it, holds a different size,
        or its bytes fail their check (such an object is dropped and counted).
        """
        ...

    def pin(self, keys: Sequence[ObjectKey]) -> int:
        """Pin the longest prefix of `keys` the tier holds, so eviction leaves them until
        `unpin`; returns how many were pinned."""
        ...

    def unpin(self, keys: Sequence[ObjectKey]) -> None:
        """Undo one `pin` of each key (the first n keys of a `pin` that returned n)."""
        ...

    def stats(self) -> dict[str, int]:
        """At least the `STAT_KEYS`: usage and capacity in bytes, objects held, evictions."""
        ...

    def drop_where(self, predicate: Callable[[Any], bool]) -> int:
        """Remove every unpinned object whose key matches; returns how many."""
        ...

    def close(self) -> None:
        """Finish or cancel pending work, forget every object, release resources."""
        ...


@runtime_checkable
class HostTier(StorageTier, Protocol):
    """A tier in page-locked host memory that movers copy to and from directly (L1)."""

    capacity_bytes: int

    def count_prefix(self, chunk_keys: Iterable[Sequence[Hashable]]) -> int:
        """Consecutive chunks from 0 whose every key (one per rank) is readable."""
        ...

    def prepare_write(self, keys: Sequence[Hashable], nbytes: int) -> WritePlan:
        """Reserve invisible objects of `nbytes` for the keys not present, in order,
        evicting as needed; stops at the first key no eviction can make room for."""
        ...

    def extend_write(self, plan: WritePlan, keys: Sequence[Hashable], nbytes: int) -> None:
        """Continue `plan` over `keys`, which start with the keys it has planned."""
        ...

    def commit(self, plan: WritePlan) -> None:
        """Make the plan's new objects visible (their bytes are written)."""
        ...

    def commit_when_done(self, plan: WritePlan, done: Callable[[], bool]) -> None:
        """Commit `plan` at the first read that finds `done()` true (its copies ran), if
        `commit` has not come first."""
        ...

    def abort(self, plan: WritePlan) -> None:
        """Free the plan's new objects; none of them was ever visible."""
        ...

    def pin_prefix(self, keys: Sequence[Hashable]) -> list[Any]:
        """Pin and return the objects of the longest readable prefix of `keys`."""
        ...

    def release(self, objs: Sequence[Any]) -> None:
        """Undo `pin_prefix` for these objects."""
        ...

    def pin_state(self) -> dict[str, Any] | None:
        """How far the host memory is pinned ahead of demand; None if it grows on demand."""
        ...

    def pinning_paused(self) -> AbstractContextManager[None]:
        """A block during which nothing is pinned ahead (the caller's CUDA calls would
        queue behind a pinning in the driver)."""
        ...

    def views(self, objs: Sequence[Any]) -> HostChunks:
        """The objects' bytes, for a mover (valid while pinned or being written)."""
        ...


@runtime_checkable
class PlacedTier(Protocol):
    """A tier that spreads objects by the GPU of their owner (the disk tier's by_gpu paths)."""

    def place(self, model_name: str, world_size: int, rank: int, gpu: int) -> None:
        """Objects of this (model, world, rank) owner go where GPU `gpu`'s objects go."""
        ...


@runtime_checkable
class DescribedTier(Protocol):
    """A tier with more to show in `status()` than its stats (the disk tier's paths)."""

    def describe(self) -> dict[str, Any]:
        """A JSON-serialisable account of the tier's configuration and parts."""
        ...


def completed(value: T) -> Future[T]:
    """A future that already holds `value` (a memory tier's answer)."""
    future: Future[T] = Future()
    future.set_result(value)
    return future


def gather(futures: Sequence[Future[T]], combine: Callable[[list[T]], R]) -> Future[R]:
    """A future of `combine` over the futures' results, done when all of them are."""
    out: Future[R] = Future()
    pending = len(futures)
    lock = threading.Lock()

    def finish(_: Future[T]) -> None:
        nonlocal pending
        with lock:
            pending -= 1
            if pending > 0:
                return
        errors = [e for f in futures if (e := f.exception()) is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result(combine([f.result() for f in futures]))

    if not futures:
        out.set_result(combine([]))
    for future in futures:
        future.add_done_callback(finish)
    return out


def release_pins(pins: Counter[Any], keys: Sequence[Any]) -> None:
    """Undo one pin of each key in a tier's pin counts (a key listed twice, twice);
    ValueError, with nothing changed, when a key is not pinned that often."""
    wanted = Counter(keys)
    for key in keys:
        if pins[key] < wanted[key]:
            raise ValueError(f"unpin of key {key!r}, which is not pinned")
    pins.subtract(wanted)
    for key in wanted:
        if not pins[key]:
            del pins[key]


def check_buffers(buffers: Sequence[Any], what: str) -> None:
    """ValueError naming `what` unless every buffer is a 1-D uint8 CPU tensor."""
    for i, buf in enumerate(buffers):
        ok = (
            isinstance(buf, torch.Tensor)
            and buf.dtype == torch.uint8
            and buf.dim() == 1
            and buf.device.type == "cpu"
        )
        if not ok:
            got = (
                f"{buf.dtype} {tuple(buf.shape)} on {buf.device}"
                if isinstance(buf, torch.Tensor)
                else type(buf).__name__
            )
            raise ValueError(f"{what}[{i}] must be a 1-D uint8 CPU tensor, got {got}")
