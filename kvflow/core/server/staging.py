"""A staging ring the engine owns, for layerwise retrieves whose blocks lie anywhere.

A layer whose blocks do not take its bytes in order needs a scatter. Launched by the
server, that kernel waits for a GPU time slice while the engine's process computes (no
MPS), and the layer with it (docs/perf-journal.md, 2026-11-29). With a ring registered
(`register_kv_caches(..., staging_slots=N, staging_slot_bytes=B)`), the server copies such
a layer's runs into the next free slot with the copy engine alone and the engine scatters
them into its blocks in its own process, on a stream of its own, before the layer is read.

Bookkeeping lives after the layer flags in the same shared int64s: `head` (slot uses the
server has written), `tail` (uses the engine has scattered), then one entry per slot:
(retrieve number, first layer, layers, rows, chunk tokens) of the use it holds (rows: the
hit's chunks the retrieve writes, one row each). A use holds a
span of layers next to each other (`stage_span`: the first layers alone, then as many as
a slot takes), scattered by one launch: at 8k tokens of an 8B shape a 128 MiB slot takes
four layers, and the engine's host, which runs the forward pass, launches a quarter of
the scatters. Use k takes slot k % N; the
server writes it once `tail` > k - N (the engine scattered use k - N) and, on CUDA, the
slot's "scattered" event has completed, then records the slot's "copied" event, writes
the entry and only then raises `head`. The engine's `pump()` scatters uses in order from
`tail`, each on its staging stream once the slot's "copied" event has completed, records
"scattered" and raises `tail`. Neither side makes a stream wait on the other's events:
both ask on the host (`query`). A stream of one process blocked on another process's
event holds the GPU's time slice while it spins, and the other process's copies wait for
the slice to end: queued ahead, the engine's waits on "copied" left a 1.9 ms gap after
every copy of the server's (docs/perf-journal.md, 2026-11-30). The engine pumps whenever
it waits for a layer, so a ring shared by several loads of one forward pass never waits
on a layer the engine is not waiting for: the server stays at most N staged layers
ahead of the engine's waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvflow.core.engine.transfers import written_chunks
from kvflow.core.errors import InvalidRequestError, TransferError
from kvflow.core.polling import poll_until
from kvflow.core.server.protocol import CudaIpcMemory, TensorDesc
from kvflow.cuda import DriverEvent
from kvflow.kernels import KVLayout, LayoutKernels, PreparedTransfer

#: most slots a ring may have (each costs five shared int64s and, on CUDA, three events)
MAX_SLOTS = 64
#: the longest the server waits for the engine to free a slot (an engine that stopped
#: waiting for its layers must not hold the instance's worker for ever)
SLOT_TIMEOUT_S = 60.0
#: how often the server looks for a freed slot once the ring is full, without spinning:
#: it is slots ahead of the engine, and a process spinning beside the engine's forward
#: pass slows that pass's host
CLAIM_POLL_S = 200e-6
HEAD, TAIL, ENTRY = 0, 1, 5


def control_words(slots: int) -> int:
    """Shared int64s of a ring of `slots` (head, tail, an entry per slot); 0 without one."""
    return 2 + ENTRY * slots if slots else 0


def check_slots(slots: int, slot_bytes: int) -> None:
    """InvalidRequestError unless a ring of `slots` x `slot_bytes` can be used."""
    if not 1 <= slots <= MAX_SLOTS or slot_bytes < 1:
        raise InvalidRequestError(
            f"a staging ring needs 1..{MAX_SLOTS} slots of at least one byte, got {slots}"
            f" slots of {slot_bytes} bytes"
        )


def _entry(slot: int) -> slice:
    """Where slot `slot`'s entry lies among the control words."""
    return slice(2 + ENTRY * slot, 2 + ENTRY * (slot + 1))


class ServerStaging:
    """The server's side of an instance's ring: the slots (mapped from the engine's
    memory), the shared bookkeeping and, on CUDA, the slots' opened events."""

    def __init__(self, ring: torch.Tensor, control: torch.Tensor, events: list[Any] | None) -> None:
        """`ring`: [slots, slot bytes] uint8; `control`: its `control_words` int64s;
        `events`: 2 x slots opened events (copied, then scattered) or None (CPU)."""
        self.slots, self.slot_bytes = int(ring.shape[0]), int(ring.shape[1])
        self.ring = ring
        self.control = control.numpy()  # a numpy view: a word's read costs a tenth of torch's
        self.copied = events[: self.slots] if events is not None else None
        self.scattered = events[self.slots :] if events is not None else None
        #: seconds the server waited for free slots, all claims together
        self.waited_s = 0.0
        #: layers staged so far (a slot's use holds one or more)
        self.staged_layers = 0

    def stats(self) -> dict[str, Any]:
        """The ring for `kvflow status`: its size, layers staged so far and the slot uses
        that held them, slot waits."""
        return {
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "staged_layers": self.staged_layers,
            "slot_uses": int(self.control[HEAD]),
            "slot_wait_s": round(self.waited_s, 6),
        }

    def claims(self, seq: int, cancelled: Callable[[], bool]) -> SlotClaims:
        """The `Staging` (kvflow.core.engine.layerwise) of retrieve number `seq`, given up
        once `cancelled()`."""
        return SlotClaims(self, seq, cancelled)


class SlotClaims:
    """One retrieve's use of the ring: claim the next slot, then say what it holds."""

    def __init__(self, staging: ServerStaging, seq: int, cancelled: Callable[[], bool]):
        self._staging = staging
        self._seq = seq
        self._cancelled = cancelled
        self._use = -1
        self.slot_bytes = staging.slot_bytes

    def claim(self) -> torch.Tensor:
        st, control = self._staging, self._staging.control
        use = int(control[HEAD])
        slot = use % st.slots
        scattered = st.scattered[slot] if st.scattered is not None and use >= st.slots else None

        def free() -> bool:  # the engine's last read of the slot queued, then run
            return int(control[TAIL]) > use - st.slots and (scattered is None or scattered.query())

        st.waited_s += poll_until(
            free,
            SLOT_TIMEOUT_S,
            f"staging slot {slot} (the engine scatters only while it waits for layers)",
            self._cancelled,
            spins=0,
            interval_s=CLAIM_POLL_S,
        )
        self._use = use
        return st.ring[slot]

    def staged(
        self, first_layer: int, layers: int, rows: int, chunk_tokens: int, stream: Any
    ) -> None:
        st, use = self._staging, self._use
        slot = use % st.slots
        if st.copied is not None and stream is not None:
            st.copied[slot].record(stream.torch)
        st.control[_entry(slot)] = (self._seq, first_layer, layers, rows, chunk_tokens)
        st.staged_layers += layers
        st.control[HEAD] = use + 1  # after the entry: the engine reads it once it sees this


#: a staged layer's scatter on CUDA: (the slot use that held it, the slot's "landed"
#: event, recorded after that use's scatter and again at the slot's next one: a stream
#: made to wait on it later waits for a later scatter too, never for less). A plain
#: driver event of this process, not the interprocess "scattered" one the server polls:
#: the engine's compute stream waits on it once per span, by its raw handle
Landing = tuple[int, DriverEvent]


class StagedLoad:
    """What the engine needs to scatter a load's staged layers: its block ids and skipped
    tokens, known when the retrieve is asked for (each use's entry says how many chunks
    it holds, so no reply is needed), and each staged layer's `Landing` (None on CPU,
    where the pump scattered it already)."""

    def __init__(self, block_ids: np.ndarray, skip_tokens: int) -> None:
        self.block_ids = block_ids
        self.skip_tokens = skip_tokens
        self.landed: dict[int, Landing | None] = {}
        #: staged layers whose slots the server is still copying into (CUDA)
        self.pending: set[int] = set()
        #: scatters launched for it so far (one a slot use: a span of layers each)
        self.scatters = 0
        self.caller: torch.cuda.Event | None = None  # the engine's stream when it retrieved
        #: the scatter of its first staged layer, whose ids (uploaded with it, kept with
        #: the load) every later layer's scatter reuses
        self.moves: PreparedTransfer | None = None
        self._rows: tuple[np.ndarray, list[int]] | None = None  # every layer's: made once
        #: why its uses cannot be scattered (an entry holding more chunks than its blocks
        #: take): they are freed unread, and its waits raise this
        self.error: TransferError | None = None

    def rows(self, chunk_tokens: int, block_size: int, count: int) -> tuple[np.ndarray, list[int]]:
        """(block table of the `count` chunks a use holds, blocks of each left alone), as
        the server chose them (`written_chunks`: the hit's chunks from the first not
        wholly skipped); the same for every layer, so made at the first. TransferError
        when the prompt's blocks cannot hold that many."""
        if self._rows is None:
            per_chunk = chunk_tokens // block_size
            skip_blocks = self.skip_tokens // block_size
            hit_chunks = skip_blocks // per_chunk + count
            if hit_chunks * per_chunk > len(self.block_ids):
                raise TransferError(
                    f"the server staged {count} chunks of {chunk_tokens} tokens after"
                    f" {self.skip_tokens} skipped ones: more than the load's"
                    f" {len(self.block_ids)} blocks of {block_size} hold"
                )
            rows, skips = written_chunks(0, hit_chunks, skip_blocks, per_chunk)
            table = self.block_ids[: hit_chunks * per_chunk].astype(np.int64)
            self._rows = table.reshape(hit_chunks, per_chunk)[rows], skips
        return self._rows


class ClientStaging:
    """The engine's side: the ring on the caches' device (shared memory for CPU caches),
    its events, and `pump()`, which scatters staged layers into their loads' blocks."""

    def __init__(
        self, layout: KVLayout, slots: int, slot_bytes: int, control: torch.Tensor
    ) -> None:
        check_slots(slots, slot_bytes)
        self.layout = layout
        self.slots, self.slot_bytes = slots, slot_bytes
        self.control = control.numpy()  # polled on every spin of a wait: numpy's reads
        self.events: list[torch.cuda.Event] = []  # copied, then scattered (CUDA)
        #: per slot, its use's span landed (CUDA; see `Landing`)
        self._landed_marks: list[DriverEvent] = []
        self.stream: Any = None  # the TransferStream staged layers are scattered on
        if layout.device.type == "cuda":
            from kvflow.core.server.ipc import make_interprocess_event
            from kvflow.kernels.streams import new_transfer_stream

            with torch.cuda.device(layout.device):
                self.ring = torch.empty(
                    (slots, slot_bytes), dtype=torch.uint8, device=layout.device
                )
                self.events = [make_interprocess_event() for _ in range(2 * slots)]
                for event in self.events:  # an event must be recorded once to be shared
                    event.record(torch.cuda.current_stream(layout.device))
            # high priority: a scatter the next layer waits on starts as SMs free up
            self.stream = new_transfer_stream(layout.device, high_priority=True)
            # raw events: a wait on one takes a stream handle, not torch's Stream
            self._landed_marks = [DriverEvent(self.stream.handle) for _ in range(slots)]
        else:
            from kvflow.core.server.shm import empty_shared

            self.ring = empty_shared((slots, slot_bytes), torch.uint8)
        self._slot_views = list(self.ring)  # a slot's bytes, its rows' staging
        #: the scatter kernels of a span of layers (first, layers, chunk tokens)
        self._kernels: dict[tuple[int, int, int], LayoutKernels] = {}
        self._loads: dict[int, StagedLoad] = {}
        self._dropped: set[int] = set()
        #: the latest retrieve whose reply came: the server finished every earlier one
        self._answered = 0
        #: slot uses before this one have had their layers marked pending
        self._noted = 0
        self._lock = threading.Lock()  # one pump at a time, and the loads with it

    def wire(self) -> tuple[TensorDesc, list[bytes] | None]:
        """(the ring's description, its events' IPC handles or None) for the Register."""
        from kvflow.core.server.sharing import describe_tensor

        handles = [bytes(e.ipc_handle()) for e in self.events] if self.events else None
        return describe_tensor(self.ring, "staging ring"), handles

    def add_load(self, seq: int, block_ids: np.ndarray, skip_tokens: int) -> StagedLoad:
        """Retrieve number `seq` is asked for (call once it is sent, before anything is
        queued on torch's current stream): its staged layers go into `block_ids`, after
        the work queued so far on that stream."""
        load = StagedLoad(block_ids, skip_tokens)
        if self.stream is not None:
            load.caller = torch.cuda.Event()
            load.caller.record(torch.cuda.current_stream(self.layout.device))
        with self._lock:
            self._loads[seq] = load
        return load

    def answered(self, seq: int) -> None:
        """Retrieve number `seq`'s reply came: the server finished every earlier one."""
        with self._lock:
            self._answered = max(self._answered, seq)

    def drop(self, seq: int) -> None:
        """Retrieve number `seq` failed (its call or its reply): free its slots unread."""
        with self._lock:
            self._drop(seq)

    def _drop(self, seq: int) -> None:
        """`drop()`'s work (call with the lock held)."""
        self._loads.pop(seq, None)
        self._dropped.add(seq)

    def landed(self, load: StagedLoad, layer: int) -> tuple[bool, Landing | None, bool]:
        """`pump()`, then (whether `layer` of `load` was staged and is scattered, or queued
        to be on the staging stream, its `Landing` then, whether it is staged in a slot
        the server is still copying into): one lock for a layer's wait."""
        with self._lock:
            self._pump()
            if load.error is not None:
                raise load.error
            if layer in load.landed:
                return True, load.landed[layer], False
            return False, None, layer in load.pending

    def pump(self) -> None:
        """Scatter every staged use from `tail` on whose load is known, in order."""
        with self._lock:
            self._pump()

    def _pump(self) -> None:
        """`pump()`'s work (call with the lock held)."""
        control = self.control
        while (use := int(control[TAIL])) < int(control[HEAD]):
            slot = use % self.slots
            seq, first, layers, rows, chunk_tokens = (int(w) for w in control[_entry(slot)])
            load = self._loads.get(seq)
            if load is None and seq not in self._dropped:
                return  # a number this side does not know (yet): left until it does
            try:
                if load is not None and self.events and not self.events[slot].query():
                    self._note_pending(use, int(control[HEAD]))
                    # the server's copies into the slot are still running, and the
                    # engine's host waits for them: send the load's block ids up now
                    self._ids_up(load, first, layers, rows, chunk_tokens)
                    return
                if load is not None:
                    self._scatter(load, use, range(first, first + layers), rows, chunk_tokens)
            except TransferError as exc:  # that load alone fails: its uses go unread
                assert load is not None
                load.error = exc
                self._drop(seq)
                continue
            self._forget_before(seq)
            control[TAIL] = use + 1
        if self._answered and (len(self._loads) > 1 or self._dropped):  # every use
            # written is scattered: forget loads that had none (all their layers went
            # straight into blocks) and numbers dropped before the latest answered
            # load: the server replied to it after it finished every earlier retrieve
            self._forget_before(self._answered)

    @property
    def loads_held(self) -> int:
        """Loads whose staged layers may still come (the latest answered one, and those
        whose uses are not all scattered yet)."""
        with self._lock:
            return len(self._loads)

    def _note_pending(self, tail: int, head: int) -> None:
        """Mark the layers of the uses written but not scattered yet as pending (the pump
        stopped at `tail`, whose copies still run), each use once: every wait pumps
        while the server's copies run behind its staging."""
        use = max(tail, self._noted)
        while use < head:
            seq, first, layers = (int(w) for w in self.control[_entry(use % self.slots)][:3])
            load = self._loads.get(seq)
            if load is not None:
                load.pending.update(range(first, first + layers))
            elif seq not in self._dropped:
                break  # its load is not known yet: noted once it is
            use += 1
        self._noted = use

    def _forget_before(self, seq: int) -> None:
        """Uses come in retrieve order: loads before `seq` have no more of them."""
        for old in [s for s in self._loads if s < seq]:
            del self._loads[old]
        self._dropped = {s for s in self._dropped if s >= seq}

    def _scatter(
        self, load: StagedLoad, use: int, span: range, rows: int, chunk_tokens: int
    ) -> None:
        """Scatter slot use `use`'s span of layers into `load`'s blocks: one launch (CPU:
        the copy done here), its end the slot's "scattered" event (for the server) and
        its "landed" one, with which every layer of the span lands (as a `Landing`: the
        event is recorded again at the slot's next use)."""
        slot = use % self.slots
        load.pending.difference_update(span)
        load.scatters += 1
        moves = self._ids_up(load, span.start, len(span), rows, chunk_tokens)
        key = (span.start, len(span), chunk_tokens)
        kernels = self._kernels.get(key)
        if kernels is None:
            layout = self.layout.span_layout(span.start, len(span))
            kernels = self._kernels[key] = LayoutKernels(layout, chunk_tokens, gather=False)
        if self.stream is None:
            kernels.launch(moves, self._slot_views[slot], 0, moves.num_chunks)
            load.landed.update(dict.fromkeys(span))
            return
        torch_stream = self.stream.torch
        if load.caller is not None:
            torch_stream.wait_event(load.caller)
            load.caller = None
        kernels.launch(moves, self._slot_views[slot], 0, moves.num_chunks)  # copies done (pump)
        self.events[self.slots + slot].record(torch_stream)  # the slot is free again
        landed = self._landed_marks[slot]
        landed.record(self.stream.handle)  # and the span landed
        load.landed.update(dict.fromkeys(span, (use, landed)))

    def _ids_up(
        self, load: StagedLoad, first: int, layers: int, rows: int, chunk_tokens: int
    ) -> PreparedTransfer:
        """`load`'s scatter, its block ids uploaded once for all its layers: at its first
        staged span, while that span's copies still run if the engine waits for them
        (`pump`), else when the span is scattered."""
        if load.moves is None:
            table, skips = load.rows(chunk_tokens, self.layout.block_size, rows)
            load.moves = PreparedTransfer.trusted(
                self.layout.span_layout(first, layers), table, skips, gather=False,
                backend="cpu" if self.stream is None else "cuda", stream=self.stream,
            )  # fmt: skip
        return load.moves


def ring_slots(ring: TensorDesc) -> int:
    """The slots of a described ring; InvalidRequestError unless it is [slots, slot
    bytes] uint8 within `check_slots`."""
    if ring.dtype != "uint8" or len(ring.shape) != 2:
        raise InvalidRequestError(
            f"a staging ring is [slots, slot bytes] uint8, got {ring.dtype} of shape {ring.shape}"
        )
    slots, slot_bytes = ring.shape
    check_slots(slots, slot_bytes)
    return slots


def open_server_staging(
    ring: TensorDesc, event_handles: list[bytes] | None, cuda_device: int | None,
    control: torch.Tensor,
) -> tuple[ServerStaging, Any]:  # fmt: skip
    """Open a Register's staging ring: (ServerStaging, what to `release()` once the
    instance goes). `control`: its words in the opened layer flags (sized for the ring
    by `open_server_layers`)."""
    slots = ring_slots(ring)
    on_cuda = isinstance(ring.memory, CudaIpcMemory)
    if on_cuda != (cuda_device is not None) or (event_handles is not None) != on_cuda:
        raise InvalidRequestError(
            "a staging ring lives with the caches (GPU memory and its events for GPU caches,"
            " shared memory without events for CPU caches)"
        )
    events = None
    if event_handles is not None:
        assert cuda_device is not None
        from kvflow.core.server.ipc import open_interprocess_events

        events = open_interprocess_events(
            event_handles, cuda_device, 2 * slots,
            f"staging events for {slots} slots (copied, then scattered, per slot)",
        )  # fmt: skip
    from kvflow.core.server.protocol import KVCachesDesc
    from kvflow.core.server.sharing import open_kv_caches

    opened = open_kv_caches(KVCachesDesc(kind="tensor", tensors=[ring]))
    if opened.cuda_device is not None and opened.cuda_device != cuda_device:
        opened.release()
        raise InvalidRequestError(
            f"the staging ring is on cuda:{opened.cuda_device}, the caches on cuda:{cuda_device}"
        )
    return ServerStaging(opened.kv_caches, control, events), opened
