"""Moving chunk bytes between an instance's KV blocks and L1 objects.

`CpuMover` gathers/scatters straight between CPU caches and L1 bytes.
`CudaMover` pipelines through a ring of GPU staging stages on two streams: the block
kernel runs on `kernel_stream` while earlier groups' host copies run on `copy_stream`.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from kvflow.core.engine.direct import Copy2D, DirectLayers
from kvflow.core.engine.layerwise import Staging, stage_span
from kvflow.core.engine.strided_copy import strided_copyto
from kvflow.core.polling import poll_until
from kvflow.core.tiers.base import HostChunks
from kvflow.cuda import (
    MAX_PITCH,
    CurrentContext,
    DriverEvent,
    copy_2d_async,
    copy_async,
    stream_context,
)
from kvflow.kernels import (
    IdBuffer,
    KVLayout,
    PreparedTransfer,
    TransferStream,
    current_stream_handle,
    new_transfer_stream,
)
from kvflow.kernels.reference import Copy, chunk_copies

#: GPU bytes a CudaMover may use for staging (at least two chunks, whatever their size).
STAGING_BUDGET_BYTES = 256 << 20
#: Most chunks moved by one kernel launch, and most stages in the staging ring.
MAX_GROUP = 8
MAX_STAGES = 4
#: Bytes a store's first wave covers (at most a group): ~1.2 ms of host copy, enough to
#: cover the next wave's host work when another rank's thread holds the GIL meanwhile.
#: 16 MiB (~0.3 ms, one wave's host work on an idle interpreter) made six waves of a
#: 0.5 GiB store, each a point where a second rank stalled the first's copies; more
#: would delay the first copy (docs/perf-journal.md, 2026-11-29, the GIL's hand-overs).
HEAD_BYTES = 64 << 20
#: how often a CUDA mover's `wait` looks at its streams, sleeping in between: a thread
#: spinning on the GPU (what a stream synchronize does) takes a core beside the engine's
#: forward pass for as long as the copies run, and slows that pass's host
QUIET_POLL_S = 50e-6

#: a retrieve's block ids, as a function the mover calls once its first copies are queued
BlockRows = Callable[[], np.ndarray]


def _always_true() -> bool:
    return True


class Mover(Protocol):
    """Copies chunks for one instance; enqueue then `wait()` (CPU movers finish at once).

    An op may enqueue in several calls before its `wait()` (a store enqueues its first
    chunks, then plans the rest while they copy); the calls share one pipeline. Block ids
    arrive checked by the engine's request conversion (`RequestIds`), so movers launch
    through the kernels' trusted path (`PreparedTransfer.trusted`): each id is checked once.
    """

    #: the stream each direction's last step runs on, for END events (None = host)
    store_stream: Any
    retrieve_stream: Any
    #: chunks (>= 1) a store enqueues on their own before the host prepares the rest
    head_chunks: int

    def store(self, block_ids: np.ndarray, dsts: HostChunks) -> None:
        """Enqueue: chunk c's blocks (row c of block_ids) -> dsts[c] (uint8 L1 bytes)."""
        ...

    def retrieve(self, srcs: HostChunks, block_ids: BlockRows, skip_blocks: Sequence[int]) -> None:
        """Enqueue: srcs[c] -> chunk c's blocks, leaving its first skip_blocks[c] untouched.

        `block_ids()` gives the rows (row c: chunk c's blocks); it is called once, after
        the first host copies are queued and before any block is written, so converting
        and checking the ids overlaps those copies and a bad id writes nothing. A CUDA
        mover holds scatters back until their staging is needed again or `flush()`.
        """
        ...

    def flush(self) -> None:
        """Queue every step the op still holds back (a retrieve's later scatters), so the
        op's last step is on its stream; call once its enqueueing is done, before END."""
        ...

    def queued_done(self) -> Callable[[], bool]:
        """A check, true once every step of a store queued so far has run (it never
        blocks): what L1 commits a store's plan by when the store answered early."""
        ...

    def wait(self) -> None:
        """Block until everything queued has finished (raises the transfer's error).

        Steps held back and not flushed are dropped: an op that failed midway writes
        nothing more."""
        ...

    def close(self) -> None: ...


class CpuMover:
    """Synchronous moves for CPU-resident caches, straight between the cache and the L1
    objects (no staging): `chunk_copies` gives one copy per run of consecutive blocks of
    a chunk, every layer and K/V its strides allow at once, on word-wide views.

    Each copy is kvflow's C loop (`strided_copyto`: each contiguous run in vector
    blocks, streamed from 128 KiB: up to 1.6x numpy's strided loop on 2 KiB rows, host
    by host; numpy's where no C compiler is found), single-threaded and without the
    GIL, so no OpenMP team wakes for a small copy. A move of `PARALLEL_BYTES` or more
    also hands its copies to up to `MAX_THREADS - 1` threads shared by every CpuMover,
    which pull copies from the same queue as the calling thread: one core's memcpy
    reaches about half of a host's copy bandwidth, and a helper that runs late (a busy
    host) only takes fewer.
    """

    store_stream: Any = None
    retrieve_stream: Any = None
    #: every chunk in the first wave: the copies run inside each call, so a later wave
    #: overlaps nothing, and each wave costs its own L1 planning, views and copy lists
    #: (~0.3 ms): 128 pages of 512 KiB moved at 5.0 GB/s in waves of 1, 1, 2, ... 64 and
    #: at 7.1 in one (docs/perf-journal.md, 2026-11-29, seventh session)
    head_chunks = sys.maxsize

    #: bytes from which a move is worth splitting: a hand-off to a helper costs tens of
    #: microseconds, 4 MiB half a millisecond of one core's copy
    PARALLEL_BYTES = 4 << 20
    #: most threads, the caller's included, that copy one move (memory bandwidth stops
    #: growing after a few, and the server has other work)
    MAX_THREADS = 4
    _helpers: ClassVar[ThreadPoolExecutor | None] = None
    _helpers_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.threads = min(self.MAX_THREADS, len(os.sched_getaffinity(0)))
        self._copyto = strided_copyto()

    def store(self, block_ids: np.ndarray, dsts: HostChunks) -> None:
        copies = chunk_copies(self.layout, dsts, block_ids, None, gather=True, copyto=self._copyto)
        self._copy(copies)

    def retrieve(self, srcs: HostChunks, block_ids: BlockRows, skip_blocks: Sequence[int]) -> None:
        skip = np.asarray(skip_blocks, dtype=np.int64)
        copies = chunk_copies(
            self.layout, srcs, block_ids(), skip, gather=False, copyto=self._copyto
        )
        self._copy(copies)

    def _copy(self, copies: list[Copy]) -> None:
        """Run every copy, on this thread and (a big move) the helpers; returns once all
        are done, so no helper writes after the move returns or raises."""
        queue = deque(copies)
        helpers: list[Future[None]] = []
        if self.threads > 1 and sum(copy.nbytes for copy in copies) >= self.PARALLEL_BYTES:
            pool = self._helper_pool()
            count = min(self.threads - 1, len(copies) - 1)
            helpers = [pool.submit(self._drain, queue) for _ in range(count)]
        try:
            self._drain(queue)
        finally:
            queue.clear()  # after a failure: helpers stop at their current copy
            for helper in helpers:
                helper.cancel()  # still waiting for a thread (another move's): not needed
            wait(helpers)
        for helper in helpers:
            if not helper.cancelled():
                helper.result()  # raises a helper's error

    @staticmethod
    def _drain(queue: deque[Copy]) -> None:
        """Run the copies off `queue` until it is empty."""
        while True:
            try:
                copy = queue.popleft()
            except IndexError:
                return
            copy.run()

    @classmethod
    def _helper_pool(cls) -> ThreadPoolExecutor:
        """The helper threads every CpuMover shares, made on first use."""
        with cls._helpers_lock:
            if cls._helpers is None:
                cls._helpers = ThreadPoolExecutor(
                    cls.MAX_THREADS - 1, thread_name_prefix="kvflow-cpu-copy"
                )
            return cls._helpers

    def flush(self) -> None:
        return None

    def queued_done(self) -> Callable[[], bool]:
        """Every copy ran inside its call."""
        return _always_true

    def wait(self) -> None:
        return None

    def close(self) -> None:
        return None


class CudaMover:
    """Pipelined GPU moves through a ring of staging stages, on two streams.

    Chunks go in groups of `group` (one kernel launch each); group j uses stage
    j % stages, so kernels for later groups run while earlier groups' host copies
    drain. Events order each stage's reuse on the GPU: the host only enqueues,
    then waits once. A retrieve's scatters are held back until their stage is needed
    again (or `flush()`), so a ring of host copies is queued before the host spends
    time on the block ids; its last group is scattered chunk by chunk as each lands.
    Groups are counted across an op's enqueue calls until `wait()`, so a second call
    continues the ring where the first left it. Copies and events go straight to the
    driver (`kvflow.cuda`), under the device's context whichever one the
    calling thread has current: torch's stream contexts cost more host time per op
    than the rest of the enqueueing.
    """

    def __init__(self, layout: KVLayout, chunk_nbytes: int) -> None:
        self.layout = layout
        self.device = layout.device
        assert self.device.index is not None
        self._index = self.device.index
        self.chunk_nbytes = chunk_nbytes
        self.group, self.stages = pipeline_shape(chunk_nbytes)
        self.head_chunks = min(self.group, max(1, -(-HEAD_BYTES // max(chunk_nbytes, 1))))
        # the block kernels gate what the engine waits on (a layer's load) and when a
        # stage is free for the next copy: at high priority they start as soon as SMs
        # free up, rather than queueing behind the engine's own kernels
        self.kernel_stream: TransferStream = new_transfer_stream(self.device, high_priority=True)
        self.copy_stream: TransferStream = new_transfer_stream(self.device)
        self.store_stream = self.copy_stream
        self.retrieve_stream = self.kernel_stream
        self._stage_views: list[torch.Tensor] = []  # the staging ring, one view per stage
        ks = self.kernel_stream.handle
        self._context = stream_context(ks)  # made current around each enqueueing call
        self._gathered = [DriverEvent(ks) for _ in range(self.stages)]  # a store's gather
        # a retrieve's host copy of chunk i into stage s has landed
        self._landed = [[DriverEvent(ks) for _ in range(self.group)] for _ in range(self.stages)]
        self._drained = [DriverEvent(ks) for _ in range(self.stages)]
        self._caller_ready = DriverEvent(ks)
        self._direct_done = DriverEvent(ks)  # a layerwise retrieve's copies, kernel-free
        #: each stream's last work when `wait` was called
        self._finished = [(DriverEvent(ks), ks), (DriverEvent(ks), self.copy_stream.handle)]
        self._groups = 0  # groups enqueued since the last wait(): the next one's ring slot
        # retrieve groups whose scatter is held back: (group, call, stage, start, stop)
        self._held: deque[tuple[int, _RetrieveCall, int, int, int]] = deque()
        self._ids = IdBuffer(self.device)  # every op's block ids; reset once it has finished
        self._copy_handle = self.copy_stream.handle

    def _stage(self, s: int, n: int) -> torch.Tensor:
        """The first n chunk rows of stage s (views made once: indexing costs ~5 us)."""
        if not self._stage_views:
            ring = (self.stages, self.group, self.chunk_nbytes)
            self._stage_views = list(torch.empty(ring, dtype=torch.uint8, device=self.device))
        stage = self._stage_views[s]
        return stage if n == self.group else stage[:n]

    def _after_caller(self, stream: TransferStream) -> None:
        """Order an op's first step after the caller's pending work on its current stream."""
        if self._groups:
            return
        self._caller_ready.record(current_stream_handle(self._index))
        self._caller_ready.wait_on(stream.handle)

    def _next_stage(self, stream: TransferStream) -> int:
        """The ring slot for the op's next group, once `stream` waits for its last reader."""
        j = self._groups
        self._groups += 1
        s = j % self.stages
        if j >= self.stages:
            self._scatter_through(j - self.stages)  # a held retrieve scatter drains it
            self._drained[s].wait_on(stream.handle)
        return s

    def store(self, block_ids: np.ndarray, dsts: HostChunks) -> None:
        with CurrentContext(self._context):
            self._store(block_ids, dsts)

    def _store(self, block_ids: np.ndarray, dsts: HostChunks) -> None:
        ks, cs = self.kernel_stream, self.copy_stream
        cb = self.chunk_nbytes
        moves = PreparedTransfer.trusted(
            self.layout, block_ids, gather=True, backend="cuda", stream=ks, id_buffer=self._ids
        )
        self._after_caller(ks)
        for start in range(0, len(dsts), self.group):
            s = self._next_stage(ks)
            stop = min(start + self.group, len(dsts))
            stage = self._stage(s, stop - start)
            moves.launch_trusted(stage, start, stop - start)
            self._gathered[s].record(ks.handle)
            self._gathered[s].wait_on(cs.handle)
            base = stage.data_ptr()
            for i in range(stop - start):
                copy_async(dsts.address(start + i, cb), base + i * cb, cb, cs.handle)
            self._drained[s].record(cs.handle)

    def retrieve(self, srcs: HostChunks, block_ids: BlockRows, skip_blocks: Sequence[int]) -> None:
        with CurrentContext(self._context):
            self._retrieve(srcs, block_ids, skip_blocks)

    def _retrieve(self, srcs: HostChunks, block_ids: BlockRows, skip_blocks: Sequence[int]) -> None:
        """Queue the host copies now, holding each group's scatter back until its stage is
        needed again or `flush()`: the block ids are asked for at the first scatter, so
        their conversion runs while up to a full ring of copies is in flight."""
        cs = self.copy_stream
        cb = self.chunk_nbytes
        self._after_caller(cs)
        call = _RetrieveCall(block_ids, skip_blocks)
        for start in range(0, len(srcs), self.group):
            s = self._next_stage(cs)
            stop = min(start + self.group, len(srcs))
            base = self._stage(s, stop - start).data_ptr()
            for i in range(stop - start):
                copy_async(base + i * cb, srcs.address(start + i, cb), cb, cs.handle)
                # each chunk's landing is marked, so the op's last group can be
                # scattered chunk by chunk (see flush)
                self._landed[s][i].record(cs.handle)
            self._held.append((self._groups - 1, call, s, start, stop))

    def store_layers(
        self,
        table: np.ndarray,
        dsts: HostChunks,
        chunk_tokens: int,
        written: Callable[[int, TransferStream], None],
    ) -> None:
        """Enqueue a store layer by layer: per layer, `written(layer, kernel_stream)`
        returns once the engine wrote it (ordering the kernel stream after its writes),
        then one launch per stage of chunks gathers the layer and the copy stream puts
        its runs into each chunk's L1 object; a layer whose blocks hold its bytes in
        order goes straight from them into L1 by a few 2-D copies instead, after
        `written(layer, copy_stream)` (`kvflow.core.engine.direct`). `table`: checked ids
        (row c: chunk c's)."""
        with CurrentContext(self._context):
            self._store_layers(table, dsts, chunk_tokens, written)

    def _store_layers(
        self,
        table: np.ndarray,
        dsts: HostChunks,
        chunk_tokens: int,
        written: Callable[[int, TransferStream], None],
    ) -> None:
        cs, ks = self.copy_stream, self.kernel_stream
        addresses, regions = self._objects(dsts)
        direct = DirectLayers(
            self.layout, table, [0] * len(dsts), addresses, chunk_tokens, regions=regions
        )
        gathers: PreparedTransfer | None = None
        for layer in range(self.layout.num_layers):
            copies = direct.copies(layer)
            if copies is not None:  # straight from the blocks: no kernel to wait for a slice
                written(layer, cs)
                self._copy_direct(copies, to_blocks=False)
                continue
            written(layer, ks)
            layer_layout = self.layout.layer_layout(layer)
            if gathers is None:  # the ids go up once, for every layer gathered here
                gathers = PreparedTransfer.trusted(
                    layer_layout, table, gather=True, backend="cuda", stream=ks,
                    id_buffer=self._ids,
                )  # fmt: skip
            moves = gathers.for_layout(layer_layout)
            for parts, start, stop, s, rows in self._layer_pieces(
                layer, len(dsts), chunk_tokens, ks
            ):
                moves.launch_trusted(rows, start, stop - start)
                self._gathered[s].record(ks.handle)
                self._gathered[s].wait_on(cs.handle)
                self._copy_runs(
                    rows.data_ptr(), addresses[start:stop], regions[start:stop], parts,
                    to_stage=False,
                )  # fmt: skip
                self._drained[s].record(cs.handle)

    def retrieve_layers(
        self,
        srcs: HostChunks,
        table: np.ndarray,
        skip_blocks: Sequence[int],
        chunk_tokens: int,
        ready: Callable[[int, TransferStream], None],
        staging: Staging | None = None,
    ) -> None:
        """Enqueue a retrieve layer by layer: per layer, its runs of every chunk are
        copied into a stage and scattered by one launch (or one per stage-full of
        chunks), then `ready(layer, kernel_stream)` marks the layer's end on the stream;
        a layer whose blocks take its bytes in order goes straight into them by a few
        2-D copies instead (`kvflow.core.engine.direct`), and with `staging` one that fits
        a slot of the engine's ring goes there for the engine to scatter, both marked with
        `ready(layer, copy_stream)`: no kernel, so no wait for a time slice of the
        engine's GPU. `table` holds checked block ids (row c: chunk c's blocks)."""
        with CurrentContext(self._context):
            self._retrieve_layers(srcs, table, skip_blocks, chunk_tokens, ready, staging)

    def _retrieve_layers(
        self,
        srcs: HostChunks,
        table: np.ndarray,
        skip_blocks: Sequence[int],
        chunk_tokens: int,
        ready: Callable[[int, TransferStream], None],
        staging: Staging | None,
    ) -> None:
        cs, ks = self.copy_stream, self.kernel_stream
        addresses, regions = self._objects(srcs)
        self._after_caller(cs)
        direct = DirectLayers(
            self.layout, table, skip_blocks, addresses, chunk_tokens, regions=regions
        )
        on_copy_stream = False  # the op ends on the kernel stream: after these copies too
        scatters: PreparedTransfer | None = None
        layer = 0
        while layer < self.layout.num_layers:
            copies = direct.copies(layer)
            if copies is not None:  # the copy engine alone: no kernel to wait for a slice
                self._copy_direct(copies, to_blocks=True)
                ready(layer, cs)
                on_copy_stream = True
                layer += 1
                continue
            span = 0
            if staging is not None:
                span = self._stage_in(staging, layer, direct, addresses, regions, chunk_tokens)
            if span:
                for each in range(layer, layer + span):
                    ready(each, cs)
                on_copy_stream = True
                layer += span
                continue
            layer_layout = self.layout.layer_layout(layer)
            if scatters is None:  # the ids go up once, for every layer scattered here
                scatters = PreparedTransfer.trusted(
                    layer_layout, table, skip_blocks, gather=False, backend="cuda",
                    stream=ks, id_buffer=self._ids,
                )  # fmt: skip
            moves = scatters.for_layout(layer_layout)
            for parts, start, stop, s, rows in self._layer_pieces(
                layer, len(srcs), chunk_tokens, cs
            ):
                self._copy_runs(
                    rows.data_ptr(), addresses[start:stop], regions[start:stop], parts,
                    to_stage=True,
                )  # fmt: skip
                self._landed[s][0].record(cs.handle)
                self._landed[s][0].wait_on(ks.handle)
                moves.launch_trusted(rows, start, stop - start)
                self._drained[s].record(ks.handle)
            ready(layer, ks)
            layer += 1
        if on_copy_stream:
            self._direct_done.record(cs.handle)
            self._direct_done.wait_on(ks.handle)

    def _stage_in(
        self,
        staging: Staging,
        layer: int,
        direct: DirectLayers,
        hosts: Sequence[int],
        regions: Sequence[int],
        chunk_tokens: int,
    ) -> int:
        """Copy the runs of every chunk of a span of layers from `layer` on (`stage_span`:
        those that fit one slot and do not go straight into their blocks) into the next
        slot of the engine's ring (the engine scatters it: no kernel here either); returns
        the span's layers, 0 when `layer` does not fit a slot."""
        span = stage_span(
            self.layout, layer, len(hosts), chunk_tokens, staging.slot_bytes,
            lambda later: direct.copies(later) is None,
        )  # fmt: skip
        if span:
            parts = self.layout.span_parts(layer, span, chunk_tokens)
            slot = staging.claim()
            self._copy_runs(slot.data_ptr(), hosts, regions, parts, to_stage=True)
            staging.staged(layer, span, len(hosts), chunk_tokens, self.copy_stream)
        return span

    def _objects(self, chunks: HostChunks) -> tuple[list[int], list[int]]:
        """The objects' host addresses and their regions (no copy may span two)."""
        count = range(len(chunks))
        return [chunks.address(c, self.chunk_nbytes) for c in count], [
            chunks.region(c) for c in count
        ]

    def _layer_pieces(
        self, layer: int, count: int, chunk_tokens: int, reuse: TransferStream
    ) -> Iterator[tuple[list[tuple[int, int]], int, int, int, torch.Tensor]]:
        """A layerwise op's pieces of one layer: (the layer's runs in a chunk, first
        chunk, stop chunk, ring slot, the slot's [chunks, layer bytes] rows), as many
        chunks a piece as a stage holds; `reuse` waits for a slot's last reader first."""
        parts = self.layout.layer_parts(layer, chunk_tokens)
        width = sum(n for _, n in parts)
        per_stage = max(1, self.group * self.chunk_nbytes // width)
        for start in range(0, count, per_stage):
            stop = min(start + per_stage, count)
            s = self._groups % self.stages
            if self._groups >= self.stages:
                self._drained[s].wait_on(reuse.handle)
            self._groups += 1
            rows = self._stage(s, self.group).view(-1)[: (stop - start) * width]
            yield parts, start, stop, s, rows.view(stop - start, width)

    def _copy_runs(
        self,
        stage: int,
        hosts: Sequence[int],
        regions: Sequence[int],
        parts: list[tuple[int, int]],
        *,
        to_stage: bool,
    ) -> None:
        """Queue on the copy stream, for each chunk (its L1 object's host address), the
        copies of its layer runs to (or from) its row of a stage starting at `stage`.
        A layer's copies are the most numerous of any op, so they go as 2-D copies: per
        run of evenly spaced objects (L1 lays a request's objects out one after another),
        one per part across the objects; per lone object, one across its parts."""
        width = sum(n for _, n in parts)
        part_pitch = even_pitch(parts)
        for first, count, pitch in even_runs(hosts, width, regions):
            row, host = stage + first * width, hosts[first]
            if count > 1:
                at = 0
                for offset, n in parts:
                    self._copy_2d(row + at, width, host + offset, pitch, n, count, to_stage)
                    at += n
            elif part_pitch:
                n = parts[0][1]
                self._copy_2d(row, n, host + parts[0][0], part_pitch, n, len(parts), to_stage)
            else:
                for offset, n in parts:
                    self._copy_2d(row, n, host + offset, n, n, 1, to_stage)
                    row += n

    def _copy_2d(
        self, device: int, device_pitch: int, host: int, host_pitch: int, width: int,
        rows: int, to_device: bool,
    ) -> None:  # fmt: skip
        """One 2-D copy between device memory (`device`: a stage, or blocks) and L1
        (`host`), into the device when `to_device`."""
        if to_device:
            copy_2d_async(device, device_pitch, host, host_pitch, width, rows, self._copy_handle)
        else:
            copy_2d_async(host, host_pitch, device, device_pitch, width, rows, self._copy_handle)

    def _copy_direct(self, copies: list[Copy2D], *, to_blocks: bool) -> None:
        """Queue a layer's copies between L1 and its blocks (`DirectLayers`: device side
        `dst`, host side `src`), into the blocks or out of them, on the copy stream."""
        for c in copies:
            self._copy_2d(c.dst, c.dst_pitch, c.src, c.src_pitch, c.width, c.height, to_blocks)

    def _scatter_through(self, group: int, *, by_chunk: bool = False) -> None:
        """Queue the held-back scatters of groups up to `group`, oldest first: one launch
        per group once all its chunks landed, or (by_chunk) one per chunk as it lands."""
        ks = self.kernel_stream
        while self._held and self._held[0][0] <= group:
            _, call, s, start, stop = self._held[0]
            moves = call.moves(self.layout, ks, self._ids)
            self._held.popleft()
            stage = self._stage(s, stop - start)
            if by_chunk:
                for i in range(stop - start):
                    self._landed[s][i].wait_on(ks.handle)
                    moves.launch_trusted(stage[i : i + 1], start + i, 1)
            else:
                self._landed[s][stop - start - 1].wait_on(ks.handle)
                moves.launch_trusted(stage, start, stop - start)
            self._drained[s].record(ks.handle)

    def queued_done(self) -> Callable[[], bool]:
        """A driver event recorded where a store ends (the copy stream), asked on the host."""
        done = DriverEvent(self.copy_stream.handle)
        done.record(self.store_stream.handle)
        return done.query

    def flush(self) -> None:
        """Queue the held scatters; the op's last group goes chunk by chunk, so after its
        last host copy only one chunk's scatter remains (not a whole group's)."""
        with CurrentContext(self._context):
            self._scatter_through(self._groups - 2)
            self._scatter_through(self._groups - 1, by_chunk=True)

    def wait(self) -> None:
        """Polls both streams' last work every QUIET_POLL_S, sleeping in between (never
        spinning); raises the GPU's error if that work failed."""
        self._held.clear()  # not flushed: the op failed, its blocks stay untouched
        self._groups = 0
        for event, stream in self._finished:
            event.record(stream)
        for event, _ in self._finished:
            poll_until(
                event.query, math.inf, "the mover's copies", spins=0, interval_s=QUIET_POLL_S
            )
        self._ids.reset()  # every launch that read the ids has run

    def close(self) -> None:
        self.wait()
        self._stage_views = []


class _RetrieveCall:
    """One retrieve call's scatter side: its block ids, converted and uploaded when its
    first held-back scatter is queued."""

    def __init__(self, block_ids: BlockRows, skip_blocks: Sequence[int]) -> None:
        self._block_ids = block_ids
        self._skip_blocks = skip_blocks
        self._moves: PreparedTransfer | None = None

    def moves(self, layout: KVLayout, stream: TransferStream, ids: IdBuffer) -> PreparedTransfer:
        if self._moves is None:
            self._moves = PreparedTransfer.trusted(
                layout, self._block_ids(), self._skip_blocks, gather=False, backend="cuda",
                stream=stream, id_buffer=ids,
            )  # fmt: skip
        return self._moves


def even_runs(
    hosts: Sequence[int], width: int, regions: Sequence[int]
) -> list[tuple[int, int, int]]:
    """Split objects' addresses into runs one 2-D copy can cover: (first object, count,
    pitch), each run's addresses ascending by one pitch of at least `width` bytes (so
    rows never overlap) and at most MAX_PITCH, all in one region (`HostChunks.region`:
    a copy across two registrations is refused); an object that starts no run is alone
    (count 1, pitch 0)."""
    runs: list[tuple[int, int, int]] = []
    first, n = 0, len(hosts)
    while first < n:
        last, pitch = first, hosts[first + 1] - hosts[first] if first + 1 < n else 0
        region = regions[first]
        if width <= pitch <= MAX_PITCH and regions[first + 1] == region:
            last += 1
            while (
                last + 1 < n
                and hosts[last + 1] - hosts[last] == pitch
                and regions[last + 1] == region
            ):
                last += 1
        else:
            pitch = 0
        runs.append((first, last - first + 1, pitch))
        first = last + 1
    return runs


def even_pitch(parts: Sequence[tuple[int, int]]) -> int:
    """The pitch of parts (offset, size) of one size at evenly spaced ascending offsets
    (a chunk's K and V runs of a layer): one 2-D copy covers them; 0 if they are not so."""
    if len(parts) < 2 or any(n != parts[0][1] for _, n in parts):
        return 0
    pitch = parts[1][0] - parts[0][0]
    steps = all(b[0] - a[0] == pitch for a, b in itertools.pairwise(parts))
    return pitch if steps and parts[0][1] <= pitch <= MAX_PITCH else 0


def pipeline_shape(chunk_nbytes: int) -> tuple[int, int]:
    """(chunks per launch, stages) for the staging ring within STAGING_BUDGET_BYTES.

    Prefers MAX_STAGES stages (slack against stalls, a short pipeline fill) of as
    many chunks as fit, up to MAX_GROUP; big chunks get one chunk per stage and at
    least two stages, whatever the budget.
    """
    per_chunk = max(chunk_nbytes, 1)
    group = max(1, min(MAX_GROUP, STAGING_BUDGET_BYTES // (MAX_STAGES * per_chunk)))
    stages = max(2, min(MAX_STAGES, STAGING_BUDGET_BYTES // (group * per_chunk)))
    return group, stages
