"""Layerwise retrieves and stores across processes: one completion point per layer and way.

Every instance registered with `layerwise=True` has one int64 flag per layer in shared
memory: the server writes a retrieve's sequence number there once that layer's copies
are queued (CUDA) or done (CPU), and its negative when the retrieve failed before that
layer. CUDA caches also have one interprocess CUDA event per layer, which the server
records on its copy stream before writing the flag. The server replies once the first
layer's copies are queued (CPU caches: before they run), so its host work for the later
layers overlaps the engine's forward pass; `wait_layer(i)` needs no reply (a staging
ring's uses say what they hold): it polls layer i's flag on the host (the server is
queueing ahead of the GPU, so only layer 0's wait usually waits, and not for the reply's
trip back) and then, on CUDA, layer i's event, also on the host: the engine's host
runs ahead of its GPU, so by the time the GPU reaches layer i the copies have usually
landed and it does not stall. No stream of the engine's waits on the server's event: a
stream blocked on another process's event holds the GPU's time slice while it spins,
and the server's copies and kernels wait for the slice to end (docs/perf-journal.md,
2026-11-30). Sequence numbers grow per instance and the server serves one
instance's retrieves in order, so a flag at or past a retrieve's number means its layer
was marked.

Stores go the other way with a second flag and (CUDA) a second event per layer: the
engine marks layer i written once its forward pass queued layer i's KV writes
(`LayerwiseSave.layer_done`: the event recorded on its stream, then the flag set to the
store's number), and the server, which has had the store request since the first layer,
gathers layer i once the flag says so and the event has completed. The flags are
one shared array, `num_layers` retrieve flags then `num_layers` store flags, and the
events one list in the same order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from kvflow.core.errors import InvalidRequestError, RequestTimeoutError, TransferError
from kvflow.core.polling import poll_until
from kvflow.core.server.protocol import CudaIpcMemory, KVCachesDesc, Register, TensorDesc
from kvflow.core.server.staging import (
    ClientStaging,
    Landing,
    ServerStaging,
    StagedLoad,
    control_words,
    open_server_staging,
    ring_slots,
)
from kvflow.kernels import KVLayout
from kvflow.kernels.streams import current_stream_handle

#: bytes of one layer's flag (an int64)
FLAG_BYTES = 8
#: the longest a layerwise store waits for the engine to mark one layer written (an engine
#: that died mid-forward must not hold its instance's worker for ever)
STORE_LAYER_TIMEOUT_S = 60.0


def _wait_flag(
    flags: Any,
    layer: int,
    seq: int,
    timeout_s: float,
    what: str,
    cancelled: Callable[[], bool] | None = None,
    idle: Callable[[], None] | None = None,
) -> float:
    """Poll `flags[layer]` (int64s, numpy or torch) until it reaches `seq` (or a later
    one's marks); returns the seconds waited. TransferError at `-seq` or once
    `cancelled()`, RequestTimeoutError after `timeout_s`; `idle()` runs between polls."""

    return poll_until(
        lambda: _flag_marked(flags, layer, seq, what),
        timeout_s, f"layer {layer} of the layerwise {what}", cancelled, idle,
    )  # fmt: skip


def _flag_marked(flags: Any, layer: int, seq: int, what: str) -> bool:
    """Whether `flags[layer]` says number `seq` marked the layer (or a later number did,
    or failed); TransferError when number `seq` failed before it."""
    value = int(flags[layer])
    if value == -seq:
        raise TransferError(f"the layerwise {what} failed before layer {layer}")
    return value >= seq or -value > seq


class ClientLayers:
    """A client's per-layer completion points for one instance, its retrieve numbers and,
    when asked for, its staging ring (kvflow.core.server.staging)."""

    def __init__(
        self,
        num_layers: int,
        cuda_device: int | None,
        layout: KVLayout | None = None,
        staging_slots: int = 0,
        staging_slot_bytes: int = 0,
    ) -> None:
        """`layout` (the caches' KVLayout) is needed only with `staging_slots`."""
        self.num_layers = num_layers
        self.device = cuda_device
        #: retrieve events, then store events (CUDA caches)
        self.events: list[torch.cuda.Event] = []
        if cuda_device is not None:
            from kvflow.core.server.ipc import make_interprocess_event

            with torch.cuda.device(cuda_device):
                self.events = [make_interprocess_event() for _ in range(2 * num_layers)]
                for event in self.events:  # an event must be recorded once to be shared
                    event.record(torch.cuda.current_stream(cuda_device))
        from kvflow.core.server.shm import empty_shared

        words = 2 * num_layers + control_words(staging_slots)
        self.raw = empty_shared(words * FLAG_BYTES, torch.uint8)
        self.raw.zero_()
        int64s = self.raw.view(torch.int64).numpy()  # polled per layer: numpy reads are cheap
        self.flags = int64s[:num_layers]
        self.store_flags = int64s[num_layers : 2 * num_layers]
        self.staging: ClientStaging | None = None
        if staging_slots:
            assert layout is not None
            control = self.raw.view(torch.int64)[2 * num_layers :]
            self.staging = ClientStaging(layout, staging_slots, staging_slot_bytes, control)
        self._seq = self._store_seq = 0
        #: held from numbering a retrieve until it is sent: numbers reach the server in order
        self.lock = threading.Lock()
        #: the last retrieve sent, whose reply the next one reads first (under `lock`)
        self.last: LayerwiseLoad | None = None
        #: held while numbering a store and handing it to the sender, and while marking
        self.store_lock = threading.Lock()

    def wire(self) -> tuple[list[bytes] | None, TensorDesc]:
        """(event IPC handles or None, flags description) for the Register request."""
        from kvflow.core.server.sharing import describe_tensor

        handles = [bytes(e.ipc_handle()) for e in self.events] if self.events else None
        return handles, describe_tensor(self.raw, "layer flags")

    def wire_into(self, request: Register) -> None:
        """Put the completion points (and the staging ring, if any) into a Register."""
        request.layer_event_handles, request.layer_flags = self.wire()
        if self.staging is not None:
            request.layer_staging, request.layer_staging_event_handles = self.staging.wire()

    def settle_last(self) -> None:
        """Read the last retrieve's reply before another is numbered (call with `lock`
        held): a request on another connection might reach the server first. Its errors
        are its caller's (`LayerwiseLoad.hit_tokens`), not the next one's."""
        last, self.last = self.last, None
        if last is not None:
            last.settle(raising=False)

    def next_seq(self) -> int:
        """The next retrieve's number (call with `lock` held)."""
        self._seq += 1
        return self._seq

    def next_store_seq(self) -> int:
        """The next layerwise store's number (call with `store_lock` held)."""
        self._store_seq += 1
        return self._store_seq

    def mark_written(self, layer: int, seq: int) -> None:
        """Layer `layer`'s KV is written (its writes queued on torch's current stream, on
        CUDA) for every store up to number `seq`: record the layer's store event, then
        raise its flag (call with `store_lock` held)."""
        if self.events:
            self.events[self.num_layers + layer].record(torch.cuda.current_stream(self.device))
        if int(self.store_flags[layer]) < seq:
            self.store_flags[layer] = seq


class LayerwiseLoad:
    """A layerwise retrieve on its way: its request sent, its reply (`hit_tokens`) read
    when asked for, by the last layer's wait, or as soon as it came while a wait polls;
    those tokens are valid in the blocks once each layer's `wait_layer` returned (CUDA:
    once torch's current stream reaches the work queued after it)."""

    def __init__(
        self,
        layers: ClientLayers,
        seq: int,
        timeout_s: float,
        answer: Callable[[], int],
        replied: Callable[[], bool],
        staged: StagedLoad | None = None,
    ):
        """`answer()` reads the reply (the hit tokens; it runs once), `replied()` says
        whether it came (answer() would not wait); `staged`: where the engine scatters
        the layers the server stages in its ring, or None without one."""
        self._layers = layers
        self._seq = seq
        self._timeout_s = timeout_s
        self._answer: Callable[[], int] | None = answer
        self._replied = replied
        self._answer_lock = threading.Lock()
        self._hit = 0
        self._staged = staged
        self._error: BaseException | None = None
        self._settled = False  # the reply read (or its error kept): no lock needed then
        #: seconds the host spent in each layer's wait for the layer's flag (on CUDA the
        #: wait for the copies themselves is timed on the GPU, see `layer_waits`)
        self.waited_s: dict[int, float] = {}
        #: seconds the host spent inside `wait_layer` in all (the reply, the flags and,
        #: with a ring, the scatters it launched): what the load costs a host-bound
        #: forward pass, whose GPU waits for every microsecond of it
        self.host_s = 0.0
        #: the same, by layer: where in the forward pass it goes (the reply's read, the
        #: ring's scatter launches land in the waits that make them)
        self.host_by_layer: dict[int, float] = {}
        #: CUDA: timing events around each layer's wait for its copies, by layer
        self._stalls: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
        #: the ring's scatter of the layer `_landed` last found landed (None: not staged)
        self._scattered: Landing | None = None
        #: the last scatter a stream was made to wait for, with that stream's raw handle
        self._ordered: tuple[Landing, int] | None = None

    @property
    def hit_tokens(self) -> int:
        """Tokens of the prompt the retrieve brings (its reply, waited for here); raises
        the retrieve's error if it failed."""
        self.settle()
        return self._hit

    def settle(self, raising: bool = True) -> None:
        """Read the reply unless read already (once, whichever thread comes first);
        re-raise its error unless `raising` is False."""
        with self._answer_lock:
            answer, self._answer = self._answer, None
            if answer is not None:
                try:
                    self._hit = answer()
                except BaseException as exc:  # kept for every later ask
                    self._error = exc
                    if not isinstance(exc, Exception):  # an interrupt is never swallowed
                        raise
                finally:
                    self._settled = True
        if self._error is not None and raising:
            raise self._error

    def wait_layer(self, layer: int) -> None:
        """Order layer `layer`'s reads after its copies: block until the layer landed (on
        CUDA: its copies ran, or its scatter from the engine's staging ring is queued,
        which torch's current stream then waits for).
        With a staging ring, layers staged there meanwhile (this load's or others') are
        scattered into their blocks. The retrieve's error if it failed (TransferError if
        it failed before that layer); RequestTimeoutError after the client's timeout."""
        began = time.perf_counter()
        try:
            self._wait_layer(layer)
        finally:
            spent = time.perf_counter() - began
            self.host_s += spent
            self.host_by_layer[layer] = self.host_by_layer.get(layer, 0.0) + spent

    def _wait_layer(self, layer: int) -> None:
        layers = self._layers
        if layer in self.waited_s:
            return
        if not 0 <= layer < layers.num_layers:
            raise InvalidRequestError(f"layer {layer} is not within the {layers.num_layers}")
        if self._error is not None:
            raise self._error
        staging = layers.staging
        waited = 0.0
        if not self._marked(layer):
            try:
                waited = poll_until(
                    lambda: self._marked(layer), self._timeout_s,
                    f"layer {layer} of the layerwise retrieve", idle=self._meanwhile,
                )  # fmt: skip
            except RequestTimeoutError:
                if not self._settled:  # no reply either: its own timeout says more (it
                    self.settle()  # asks whether the server runs), past its deadline now
                raise
        self.waited_s[layer] = waited
        if layer == layers.num_layers - 1 and not self._settled:
            self.settle()  # it came long ago: its errors raised here, its connection freed
        if not layers.events:  # CPU: the layer landed; a staged one is scattered here
            if staging is not None and self._staged is not None:
                staging.landed(self._staged, layer)  # raises the load's scatter error
            elif staging is not None:
                staging.pump()
            return
        if self._landed(layer):  # the host need not wait: the GPU cannot stall on it
            self._after_scatter(None)
            return
        stream = torch.cuda.current_stream(layers.device)
        before = torch.cuda.Event(enable_timing=True)
        after = torch.cuda.Event(enable_timing=True)
        before.record(stream)  # the GPU idles from here to `after` only while we wait
        poll_until(
            lambda: self._landed(layer), self._timeout_s, f"the copies of layer {layer}",
            idle=self._read_if_replied,
        )  # fmt: skip
        self._after_scatter(stream)
        after.record(stream)
        self._stalls[layer] = (before, after)

    def _marked(self, layer: int) -> bool:
        """Whether the server marked `layer` for this retrieve. Marked failed: the reply's
        error when it has one (a refused block table, say: it names what was wrong),
        else TransferError."""
        try:
            return _flag_marked(self._layers.flags, layer, self._seq, "retrieve")
        except TransferError:
            self.settle()
            raise

    def _meanwhile(self) -> None:
        """Between polls of a flag: pump the ring, and read the reply if it came (an error
        that came before any layer was marked ends the wait)."""
        staging = self._layers.staging
        if staging is not None:
            staging.pump()
        self._read_if_replied()

    def _read_if_replied(self) -> None:
        """Read the reply if it came: while the host waits anyway, not in a later wait
        that would not."""
        if self._settled or not self._answer_lock.acquire(blocking=False):
            return  # read, or being read by another thread
        try:
            came = self._answer is not None and self._replied()
        finally:
            self._answer_lock.release()
        if came:
            self.settle()

    def _landed(self, layer: int) -> bool:
        """Whether layer `layer` (its flag raised) can be read once `_after_scatter` ordered
        the reads: its copies ran or, staged in the ring, its scatter is queued (the pump,
        run here, queues the scatters of staged layers whose copies ran; the scatter's
        event is kept for `_after_scatter`)."""
        staging, load = self._layers.staging, self._staged
        self._scattered = None
        if staging is not None and load is not None:
            landed, self._scattered, copying = staging.landed(load, layer)
            if landed:
                return True
            if copying:  # staged: the server's copies still run
                return False
        return bool(self._layers.events[layer].query())

    def _after_scatter(self, stream: Any) -> None:
        """Order torch's current stream (or `stream`) after the scatter `_landed` found for
        the layer, if it came through the ring: its `Landing` on this process's staging
        stream, one for all layers of a span, which a stream already ordered after it for
        the span's first layer need not wait for again."""
        landing = self._scattered
        if landing is None:
            return
        device = self._layers.device
        assert device is not None
        # the raw handle: building torch's Stream costs more than the rest of a later wait
        handle = stream.cuda_stream if stream is not None else current_stream_handle(device)
        ordered = self._ordered
        if ordered is None or ordered[0] is not landing or ordered[1] != handle:
            landing[1].wait_on(handle)  # 0, the default stream: in the event's context
            self._ordered = (landing, handle)

    @property
    def staged_layers(self) -> list[int]:
        """The layers the server staged in the engine's ring and this process scattered
        (or queued the scatter of, on CUDA) so far; the others came without a ring."""
        return sorted(self._staged.landed) if self._staged is not None else []

    @property
    def ring_scatters(self) -> int:
        """Scatters this process launched for the layers staged in its ring (one per
        slot use, each a span of layers); 0 without a ring."""
        return self._staged.scatters if self._staged is not None else 0

    def layer_waits(self) -> list[float]:
        """Seconds the engine waited for each layer it waited for, in layer order: the
        host's wait on CPU; on CUDA the host's wait for the layer's flag plus how long
        the GPU idled while the host waited for the layer's copies (this synchronizes
        with timing events: call it off the hot path, once the forward pass is queued)."""
        waits = []
        for layer in sorted(self.waited_s):
            wait = self.waited_s[layer]
            marks = self._stalls.get(layer)
            if marks is not None:
                marks[1].synchronize()
                wait += marks[0].elapsed_time(marks[1]) / 1e3
            waits.append(wait)
        return waits

    def wait(self) -> None:
        """Wait for every layer (what a caller that reads them all at once does)."""
        for layer in range(self._layers.num_layers):
            self.wait_layer(layer)


def _check_flags(uint8: bool, shape: tuple[int, ...], num_layers: int, slots: int) -> None:
    """InvalidRequestError unless the flags are 2 x num_layers int64s (then the words of a
    staging ring of `slots`) as 1-D uint8 bytes."""
    words = 2 * num_layers + control_words(slots)
    if not uint8 or len(shape) != 1 or shape[0] != words * FLAG_BYTES:
        ring = f", then {control_words(slots)} for a staging ring of {slots} slots" if slots else ""
        raise InvalidRequestError(
            f"layerwise registration gives layer flags of shape {shape} for {num_layers}"
            f" layers: expected ({words * FLAG_BYTES},) uint8 bytes (one int64 per"
            f" layer for retrieves, one for stores{ring})"
        )


class ServerLayers:
    """The server's side of an instance's completion points (opened from the Register)."""

    def __init__(
        self,
        num_layers: int,
        events: list[Any] | None,
        flags: torch.Tensor,
        staging_slots: int = 0,
    ) -> None:
        """`events`: 2 x num_layers opened events (counted by `open_server_layers`
        before it opened them), or None for CPU caches; `flags`: the shared bytes, with
        the words of a staging ring of `staging_slots` (its `staging` is set once the
        ring is opened)."""
        _check_flags(flags.dtype == torch.uint8, tuple(flags.shape), num_layers, staging_slots)
        self.num_layers = num_layers
        self.events = events[:num_layers] if events is not None else None
        self.store_events = events[num_layers:] if events is not None else None
        words = flags.view(torch.int64)
        self.flags = words[:num_layers]
        self.store_flags = words[num_layers : 2 * num_layers]
        self.staging_words = words[2 * num_layers :]
        self.staging: ServerStaging | None = None

    def signal(self, seq: int) -> LayerMarks:
        """The engine-side signal of retrieve number `seq`."""
        return LayerMarks(self, seq)

    def store_waits(self, seq: int, cancelled: Callable[[], bool]) -> WrittenLayers:
        """What the engine waits on for layerwise store number `seq` (given up once
        `cancelled()`: the instance is going)."""
        return WrittenLayers(self, seq, cancelled)


class LayerMarks:
    """A `LayerSignal` (kvflow.core.engine.layerwise) that marks one retrieve's layers."""

    def __init__(self, layers: ServerLayers, seq: int) -> None:
        self._layers = layers
        self._seq = seq

    def ready(self, layer: int, stream: Any) -> None:
        layers = self._layers
        if layers.events is not None and stream is not None:
            layers.events[layer].record(stream.torch)  # queued before the flag is seen
        layers.flags[layer] = self._seq

    def failed(self, first_layer: int) -> None:
        self._layers.flags[first_layer:] = -self._seq


class WrittenLayers:
    """A `WrittenSignal` (kvflow.core.engine.layerwise) for one layerwise store: waits
    until the engine marked a layer written, then orders the gather after its writes."""

    def __init__(self, layers: ServerLayers, seq: int, cancelled: Callable[[], bool]) -> None:
        self._layers = layers
        self._seq = seq
        self._cancelled = cancelled

    def wait_written(self, layer: int, stream: Any) -> None:
        layers = self._layers
        _wait_flag(
            layers.store_flags, layer, self._seq, STORE_LAYER_TIMEOUT_S, "store", self._cancelled
        )
        if layers.store_events is not None and stream is not None:
            # on the host, not by a stream wait on the engine's event (module docstring)
            poll_until(
                layers.store_events[layer].query, STORE_LAYER_TIMEOUT_S,
                f"the engine's writes of layer {layer}", self._cancelled,
            )  # fmt: skip


def open_server_layers(
    event_handles: list[bytes] | None,
    flags: TensorDesc | None,
    cuda_device: int | None,
    num_layers: int,
    staging: TensorDesc | None = None,
    staging_handles: list[bytes] | None = None,
) -> tuple[ServerLayers | None, Any]:
    """Open a Register's completion points and staging ring (`staging`, with its events'
    `staging_handles` on CUDA): (ServerLayers or None when it asked for no layerwise
    retrieves, what to `release()` once the instance goes, or None)."""
    if event_handles is None and flags is None:
        if staging is not None or staging_handles is not None:
            raise InvalidRequestError("a staging ring goes with a layerwise registration")
        return None, None
    if flags is None or isinstance(flags.memory, CudaIpcMemory):
        raise InvalidRequestError("a layerwise registration needs layer_flags in shared memory")
    slots = ring_slots(staging) if staging is not None else 0
    _check_flags(flags.dtype == "uint8", flags.shape, num_layers, slots)  # before mapping
    if (event_handles is not None) != (cuda_device is not None):
        raise InvalidRequestError(
            "layer_event_handles go with GPU caches, and only with them"
            f" (these caches are on {'the GPU' if cuda_device is not None else 'the CPU'})"
        )
    events = None
    if event_handles is not None:
        assert cuda_device is not None
        from kvflow.core.server.ipc import open_interprocess_events

        events = open_interprocess_events(
            event_handles, cuda_device, 2 * num_layers,
            f"layer events for {num_layers} layers (one per layer for retrieves, one for"
            " stores)",
        )  # fmt: skip
    from kvflow.core.server.sharing import open_kv_caches

    opened = open_kv_caches(KVCachesDesc(kind="tensor", tensors=[flags]))
    try:
        layers = ServerLayers(num_layers, events, opened.kv_caches, slots)
        if staging is None:
            return layers, opened
        layers.staging, ring = open_server_staging(
            staging, staging_handles, cuda_device, layers.staging_words
        )
        return layers, _Both(opened, ring)
    except BaseException:
        opened.release()
        raise


class _Both:
    """The flags' and the staging ring's mappings, released together."""

    def __init__(self, flags: Any, ring: Any) -> None:
        self._parts = (flags, ring)

    def release(self) -> bool:
        return all([part.release() for part in self._parts])


class LayerwiseSave:
    """A layerwise store on its way: the server has (or is being sent) the request and
    gathers each layer once `layer_done` marks it; `wait()` gives the stored tokens."""

    def __init__(self, layers: ClientLayers, seq: int, reply: Future[int]) -> None:
        self._layers = layers
        self._seq = seq
        #: the store's reply: the tokens held, or the error it failed with
        self.reply = reply
        self._marked: set[int] = set()

    def layer_done(self, layer: int) -> None:
        """Layer `layer`'s KV is written (CUDA: its writes are queued on torch's current
        stream, which the server's gather waits for on the GPU)."""
        layers = self._layers
        if not 0 <= layer < layers.num_layers:
            raise InvalidRequestError(f"layer {layer} is not within the {layers.num_layers}")
        if layer in self._marked:
            return
        with layers.store_lock:
            layers.mark_written(layer, self._seq)
        self._marked.add(layer)

    def wait(self, timeout_s: float | None = None) -> int:
        """Mark the layers not marked yet (the forward pass is over), then wait for the
        store's reply: tokens held, as `store` returns; raises what the store raised."""
        for layer in range(self._layers.num_layers):
            self.layer_done(layer)
        return self.reply.result(timeout_s)
