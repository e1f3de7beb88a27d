"""L2 on local disk: one file per object, an in-memory index, LRU eviction at capacity.

The index (which objects exist, pins, recency, usage) answers `contains`, `pin` and
`stats` at once; file I/O runs on a thread pool per disk path, so several paths work
in parallel and a slow disk never blocks the caller. The index is rebuilt from the
files at start-up (a restart keeps the cache warm) and each path is locked for the
tier's life, so two servers never share a directory. File format: `diskfile`.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import Any

import torch

from kvflow.core.tiers import diskfile
from kvflow.core.tiers.base import (
    ObjectKey,
    StoreOutcome,
    check_buffers,
    completed,
    gather,
    release_pins,
)
from kvflow.core.tiers.sharding import assign_paths, pick_path

#: the lock file each disk path holds while a tier uses it (it records the holder's pid)
LOCK_NAME = ".kvflow-l2.lock"


class _Entry:
    """One object in the index: its file, payload size and whether its write is done."""

    __slots__ = ("key", "nbytes", "path", "ready", "root")

    def __init__(self, key: ObjectKey, root: int, path: str, nbytes: int, ready: bool) -> None:
        self.key = key
        self.root = root  # index of its disk path
        self.path = path
        self.nbytes = nbytes
        self.ready = ready  # False while its file is being written


#: one planned object write: its entry, its bytes, the entries it evicts
_Write = tuple[_Entry, torch.Tensor, list[_Entry]]


#: how much nicer the I/O threads are than the thread that started them (relative, so a
#: server that is itself niced still has its background writes yield to its request path)
IO_NICENESS = 10
_MAX_NICE = 19


def _lower_priority() -> None:
    """Make the calling I/O thread IO_NICENESS nicer than it started (Linux threads have
    their own nice value, inherited from the thread that created them)."""
    tid = threading.get_native_id()
    with suppress(OSError):
        inherited = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(inherited + IO_NICENESS, _MAX_NICE))


def _lock_path(root: str) -> int:
    """Hold `root`'s lock file (released by close or by the process's death): its fd."""
    lock_file = os.path.join(root, LOCK_NAME)
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ValueError(f"--l2-disk path {root} cannot be locked: {e.strerror}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ValueError(
            f"--l2-disk path {root} is held by another kvflow server (pid {holder}); "
            "give each server directories of its own"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _make_dir(root: str) -> None:
    """Make the disk path and its objects directory (where the O_DIRECT probe runs too, so
    the start-up scan deletes a probe file a killed process left)."""
    try:
        os.makedirs(os.path.join(root, diskfile.OBJECTS_DIR), exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"--l2-disk path {root} is not a directory and cannot be created: {e.strerror}"
        ) from e


#: the failure and eviction counters `stats` reports
_COUNTERS = (
    "evicted_chunks",
    "evicted_bytes",
    "store_failures",
    "load_failures",
    "corrupt_objects",
    "missing_objects",
)


def _checked_roots(
    paths: Sequence[str], capacity_bytes: int, io_threads_per_path: int
) -> list[str]:
    """The tier's arguments checked, and its paths made absolute and created (one
    directory listed twice, under any name, is refused)."""
    if isinstance(paths, str) or not paths:
        raise ValueError(f"--l2-disk needs a list of one or more directories, got {paths!r}")
    if not capacity_bytes > 0:
        raise ValueError(f"--l2-disk-size-gb must be > 0: the disk tier got {capacity_bytes} bytes")
    if io_threads_per_path < 1:
        raise ValueError(f"io_threads_per_path must be >= 1, got {io_threads_per_path}")
    roots = [os.path.abspath(p) for p in paths]
    for root in roots:
        _make_dir(root)
    real = [os.path.realpath(r) for r in roots]
    if len(set(real)) != len(real):
        raise ValueError(f"--l2-disk lists one directory twice: {', '.join(roots)}")
    return roots


class DiskTier:
    """The L2 disk tier (a `StorageTier`) over one or more directories.

    `capacity_bytes` is the total over all paths, counted in payload bytes (headers and
    O_DIRECT padding add up to 8 KiB per file on disk). `usage_bytes` includes objects
    still being written.
    """

    name = "disk"

    def __init__(
        self,
        paths: Sequence[str],
        capacity_bytes: int,
        *,
        num_gpus: int = 1,
        direct_io: bool = False,
        io_threads_per_path: int = 2,
    ) -> None:
        roots = _checked_roots(paths, capacity_bytes, io_threads_per_path)
        self.io_threads_per_path = io_threads_per_path
        self._groups = assign_paths(roots, num_gpus)
        self.roots = roots
        self.capacity_bytes = int(capacity_bytes)
        self.num_gpus = num_gpus
        self._root_index = {root: i for i, root in enumerate(roots)}
        self._placement: dict[tuple[str, int, int], int] = {}
        self._lock = threading.Lock()
        self._deleted = threading.Condition(self._lock)
        self._index: dict[ObjectKey, _Entry] = {}
        self._lru: OrderedDict[ObjectKey, _Entry] = OrderedDict()  # oldest first
        self._pins: Counter[ObjectKey] = Counter()
        self._deleting: set[str] = set()  # files being removed: a writer of one waits
        self._usage = [0] * len(roots)  # payload bytes per path, writes in flight included
        self._objects = [0] * len(roots)
        self._last_error: list[str | None] = [None] * len(roots)
        self._writing = 0
        self._closed = False
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._direct_requested = direct_io
        self._direct = [False] * len(roots)  # O_DIRECT in use, per path
        self._lock_fds: list[int] = []
        self._pools: list[ThreadPoolExecutor] = []
        try:
            self._start()
        except BaseException:
            self._release()
            raise

    # -- start-up ------------------------------------------------------------------

    def _start(self) -> None:
        """Lock every path, probe O_DIRECT where asked, start the I/O threads and index
        the objects on disk."""
        for root in self.roots:
            self._lock_fds.append(_lock_path(root))
        self._direct = [
            self._direct_requested
            and diskfile.probe_direct_io(os.path.join(root, diskfile.OBJECTS_DIR))
            for root in self.roots
        ]
        self._pools = [
            ThreadPoolExecutor(
                self.io_threads_per_path,
                thread_name_prefix=f"kvflow-disk{i}",
                initializer=_lower_priority,
            )
            for i in range(len(self.roots))
        ]
        self._rebuild()

    def _rebuild(self) -> None:
        """Index the objects on disk (scanning the paths in parallel), oldest mtime first;
        drop short files and older duplicates, then evict down to capacity."""
        scans = [
            pool.submit(lambda r: list(diskfile.scan_objects(r)), root)
            for pool, root in zip(self._pools, self.roots, strict=True)
        ]
        found = [(obj, i) for i, scan in enumerate(scans) for obj in scan.result()]
        found.sort(key=lambda item: (item[0].mtime_ns, item[0].path))
        for obj, root in found:
            if obj.file_bytes < diskfile.BLOCK + obj.nbytes:
                self.counters["corrupt_objects"] += 1
                self._unlink(obj.path)
                continue
            older = self._index.get(obj.key)
            if older is not None:
                self._forget(older)
                self._unlink(older.path)
                self._deleting.discard(older.path)
            entry = _Entry(obj.key, root, obj.path, obj.nbytes, ready=True)
            self._index[obj.key] = self._lru[obj.key] = entry
            self._usage[root] += obj.nbytes
            self._objects[root] += 1
        victims = self._make_room(0)
        for victim in victims or ():
            self._unlink(victim.path)
            self._deleting.discard(victim.path)

    # -- index bookkeeping (under self._lock) --------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the disk tier is closed")

    def _root_of(self, key: ObjectKey) -> int:
        owner = (key.model_name, key.world_size, key.rank)
        gpu = self._placement.get(owner, key.rank % self.num_gpus)
        return self._root_index[pick_path(self._groups[gpu], key.chunk_hash)]

    def _forget(self, entry: _Entry) -> None:
        """Drop a ready entry from the index; its file is marked as being deleted."""
        del self._index[entry.key]
        del self._lru[entry.key]
        self._usage[entry.root] -= entry.nbytes
        self._objects[entry.root] -= 1
        self._deleting.add(entry.path)

    def _make_room(self, nbytes: int) -> list[_Entry] | None:
        """Forget least recently used unpinned objects until `nbytes` more fit; the victims,
        or None (nothing forgotten) when pins leave too little room."""
        free = self.capacity_bytes - sum(self._usage)
        victims: list[_Entry] = []
        for key, entry in self._lru.items():
            if free >= nbytes:
                break
            if entry.ready and not self._pins[key]:
                victims.append(entry)
                free += entry.nbytes
        if free < nbytes:
            return None
        for victim in victims:
            self._forget(victim)
        self.counters["evicted_chunks"] += len(victims)
        self.counters["evicted_bytes"] += sum(v.nbytes for v in victims)
        return victims

    def _touch(self, entries: Sequence[_Entry]) -> None:
        """Refresh recency, a prefix's head last (so its tail is evicted first)."""
        for entry in reversed(entries):
            self._lru.move_to_end(entry.key)

    # -- file work (on the I/O threads) ---------------------------------------------

    @staticmethod
    def _unlink(path: str) -> None:
        with suppress(OSError):
            os.unlink(path)

    def _delete(self, entries: Sequence[_Entry]) -> None:
        """Remove forgotten objects' files and wake writers waiting on them."""
        for entry in entries:
            self._unlink(entry.path)
        with self._deleted:
            self._deleting.difference_update(e.path for e in entries)
            self._deleted.notify_all()

    def _write(self, entry: _Entry, buf: torch.Tensor, victims: Sequence[_Entry]) -> bool:
        """Write one planned object (after deleting the files it evicted); False when an
        OSError (disk full, path gone or unwritable) stopped it."""
        self._delete(victims)
        with self._deleted:
            while entry.path in self._deleting:  # an older file of this name is going
                self._deleted.wait()
        error: str | None = "store: interrupted"  # unless the write ends, well or not
        try:
            payload = buf.contiguous().numpy().data
            direct = self._direct[entry.root]
            try:
                diskfile.write_object(entry.path, entry.key, payload, direct=direct)
            except FileNotFoundError:  # the owner's first object here (or its dir was removed)
                os.makedirs(os.path.dirname(entry.path), mode=0o700, exist_ok=True)
                diskfile.write_object(entry.path, entry.key, payload, direct=direct)
            error = None
        except OSError as e:
            error = f"store: {e}"
        finally:
            self._end_write(entry, error)
        return error is None

    def _batches(self, writes: list[_Write]) -> list[tuple[int, list[_Write]]]:
        """A store's writes as one task per I/O thread of each path (at most), so the
        caller submits a few tasks rather than one per object."""
        per_root: dict[int, list[_Write]] = {}
        for write in writes:
            per_root.setdefault(write[0].root, []).append(write)
        out: list[tuple[int, list[_Write]]] = []
        for root, items in per_root.items():
            n = min(self.io_threads_per_path, len(items))
            out.extend((root, items[i::n]) for i in range(n))
        return out

    def _write_batch(self, batch: list[_Write]) -> list[bool]:
        """Write a batch of planned objects in turn (see `_write`)."""
        return [self._write(entry, buf, victims) for entry, buf, victims in batch]

    def _end_write(self, entry: _Entry, error: str | None) -> None:
        """Publish a written object, or forget one whose write failed (and count it)."""
        with self._lock:
            self._writing -= 1
            if error is None:
                entry.ready = True
                self._objects[entry.root] += 1
                return
            self._last_error[entry.root] = error
            self.counters["store_failures"] += 1
            if self._index.get(entry.key) is entry:
                del self._index[entry.key]
                del self._lru[entry.key]
                self._usage[entry.root] -= entry.nbytes

    def _read(self, entry: _Entry, dst: torch.Tensor) -> bool:
        """Read one pinned object into `dst`; on any failure the object is dropped (file
        too), counted, and False returned (then `dst` holds undefined bytes)."""
        failure: str | None = "load_failures"  # unless the read ends, well or not
        reason = "load: interrupted"
        try:
            target = dst if dst.is_contiguous() else torch.empty_like(dst)
            view = target.numpy().data
            diskfile.read_object(entry.path, entry.key, view, direct=self._direct[entry.root])
            if target is not dst:
                dst.copy_(target)
            with suppress(OSError):
                os.utime(entry.path)  # mtime is the recency a restart rebuilds
            failure = None
        except (FileNotFoundError, NotADirectoryError) as e:
            failure, reason = "missing_objects", f"load: {e}"
        except diskfile.CorruptObject as e:
            failure, reason = "corrupt_objects", f"load: {entry.path}: {e}"
        except OSError as e:
            failure, reason = "load_failures", f"load: {e}"
        finally:
            self._end_read(entry, failure, reason)
        return failure is None

    def _end_read(self, entry: _Entry, failure: str | None, reason: str) -> None:
        """Unpin a read object; after a failed read count it and drop the object."""
        with self._lock:
            self._pins[entry.key] -= 1
            if not self._pins[entry.key]:
                del self._pins[entry.key]
            if failure is None:
                return
            self.counters["load_failures"] += 1
            if failure != "load_failures":
                self.counters[failure] += 1
            self._last_error[entry.root] = reason
            dropped = self._index.get(entry.key) is entry
            if dropped:
                self._forget(entry)
        if dropped:
            self._delete([entry])

    # -- placement --------------------------------------------------------------------

    def place(self, model_name: str, world_size: int, rank: int, gpu: int) -> None:
        """Write the objects of this (model, world, rank) to GPU `gpu`'s group of paths
        (owners never placed use GPU rank % num_gpus)."""
        self._check_open()
        if not 0 <= gpu < self.num_gpus:
            raise ValueError(f"GPU {gpu} is out of range for a disk tier of {self.num_gpus} GPUs")
        with self._lock:
            self._placement[(model_name, world_size, rank)] = gpu

    # -- StorageTier -------------------------------------------------------------------

    def contains(self, keys: Sequence[ObjectKey]) -> Future[list[bool]]:
        """Which keys have a whole object on disk (from the index, at once)."""
        with self._lock:
            self._check_open()
            return completed([(e := self._index.get(k)) is not None and e.ready for k in keys])

    def store(self, items: Sequence[tuple[ObjectKey, torch.Tensor]]) -> Future[StoreOutcome]:
        """Write each key not held, its items in parallel, evicting LRU objects for room.

        A key no eviction can make room for, or whose write meets an OSError, counts as
        failed. ValueError (nothing written) for bad buffers or a key no file can be
        named by.
        """
        check_buffers([buf for _, buf in items], "items' bytes")
        paths = [diskfile.object_relpath(key, buf.numel()) for key, buf in items]
        present = failed = evicted_chunks = evicted_bytes = 0
        evicted_keys: list[ObjectKey] = []
        writes: list[_Write] = []
        with self._lock:
            self._check_open()
            for (key, buf), relpath in zip(items, paths, strict=True):
                nbytes = buf.numel()
                if key in self._index:  # held, or being written by another store
                    present += 1
                    continue
                victims = self._make_room(nbytes) if nbytes <= self.capacity_bytes else None
                if victims is None:
                    failed += 1
                    self.counters["store_failures"] += 1
                    continue
                evicted_chunks += len(victims)
                evicted_bytes += sum(v.nbytes for v in victims)
                evicted_keys.extend(v.key for v in victims)
                root = self._root_of(key)
                path = os.path.join(self.roots[root], diskfile.OBJECTS_DIR, relpath)
                entry = _Entry(key, root, path, nbytes, ready=False)
                self._index[key] = self._lru[key] = entry
                self._usage[root] += nbytes
                self._writing += 1
                writes.append((entry, buf, victims))
        futures = [
            self._pools[root].submit(self._write_batch, batch)
            for root, batch in self._batches(writes)
        ]

        def outcome(batches: list[list[bool]]) -> StoreOutcome:
            written = [ok for batch in batches for ok in batch]
            stored = sum(written)
            return StoreOutcome(
                stored, present, failed + len(written) - stored, evicted_chunks, evicted_bytes,
                tuple(evicted_keys),
            )  # fmt: skip

        return gather(futures, outcome)

    def load(self, keys: Sequence[ObjectKey], dsts: Sequence[torch.Tensor]) -> Future[list[bool]]:
        """Read each held key into its destination (pinned while read, checked on the way).

        False for a key not held, a destination of another size (untouched), or a file
        that is missing, short or fails its checksum (dropped and counted; the
        destination's bytes are then undefined and the caller must discard them).
        """
        if len(keys) != len(dsts):
            raise ValueError(f"load needs one destination per key: {len(keys)} keys, {len(dsts)}")
        check_buffers(dsts, "dsts")
        reads: list[_Entry | None] = []
        with self._lock:
            self._check_open()
            for key, dst in zip(keys, dsts, strict=True):
                entry = self._index.get(key)
                if entry is None or not entry.ready or entry.nbytes != dst.numel():
                    reads.append(None)
                    continue
                self._pins[key] += 1
                reads.append(entry)
            self._touch([e for e in reads if e is not None])
        futures = [
            completed(False) if e is None else self._pools[e.root].submit(self._read, e, dst)
            for e, dst in zip(reads, dsts, strict=True)
        ]
        return gather(futures, list)

    def pin(self, keys: Sequence[ObjectKey]) -> int:
        """Pin the longest prefix of keys held whole; returns its length."""
        with self._lock:
            self._check_open()
            pinned: list[_Entry] = []
            for key in keys:
                entry = self._index.get(key)
                if entry is None or not entry.ready:
                    break
                self._pins[key] += 1
                pinned.append(entry)
            self._touch(pinned)
            return len(pinned)

    def unpin(self, keys: Sequence[ObjectKey]) -> None:
        """Undo one `pin` of each key (an object dropped meanwhile as corrupt included)."""
        with self._lock:
            self._check_open()
            release_pins(self._pins, keys)

    def drop_where(self, predicate: Callable[[Any], bool]) -> int:
        """Remove every whole, unpinned object whose key matches (its file is deleted on the
        path's I/O threads); returns how many."""
        with self._lock:
            self._check_open()
            doomed = [
                e for k, e in self._lru.items() if e.ready and not self._pins[k] and predicate(k)
            ]
            for entry in doomed:
                self._forget(entry)
        for root, pool in enumerate(self._pools):
            mine = [e for e in doomed if e.root == root]
            if mine:
                pool.submit(self._delete, mine)
        return len(doomed)

    def stats(self) -> dict[str, int]:
        """The STAT_KEYS, writes in flight, pinned objects, failures, direct-I/O paths."""
        with self._lock:
            return {
                "usage_bytes": sum(self._usage),
                "capacity_bytes": self.capacity_bytes,
                "objects": sum(self._objects),
                "writing": self._writing,
                "pinned": len(self._pins),
                **self.counters,
                "direct_io_paths": sum(self._direct),
                "paths": len(self.roots),
            }

    def describe(self) -> dict[str, Any]:
        """The tier as JSON-ready status: capacity, usage, and per path its GPUs, usage,
        objects, whether O_DIRECT is in use, and the last I/O error met there."""
        with self._lock:
            paths = [
                {
                    "path": root,
                    "gpus": [gpu for gpu, group in enumerate(self._groups) if root in group],
                    "usage_bytes": self._usage[i],
                    "objects": self._objects[i],
                    "direct_io": self._direct[i],
                    "last_error": self._last_error[i],
                }
                for i, root in enumerate(self.roots)
            ]
            return {
                "name": self.name,
                "capacity_bytes": self.capacity_bytes,
                "usage_bytes": sum(self._usage),
                "objects": sum(self._objects),
                "sharding": "by_gpu",
                "num_gpus": self.num_gpus,
                "direct_io_requested": self._direct_requested,
                "paths": paths,
                "placements": [
                    {"model_name": m, "world_size": w, "rank": r, "gpu": g}
                    for (m, w, r), g in self._placement.items()
                ],
                "closed": self._closed,
            }

    def close(self) -> None:
        """Finish pending I/O, stop the I/O threads, release the paths' locks and forget
        the index; the files stay (the next start's warm cache). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._release()
        with self._lock:
            self._index.clear()
            self._lru.clear()
            self._pins.clear()
            self._usage = [0] * len(self.roots)
            self._objects = [0] * len(self.roots)
            self._writing = 0

    def _release(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)
        for fd in self._lock_fds:
            os.close(fd)  # closing the lock's only descriptor releases the lock
        self._lock_fds.clear()
