"""Layerwise retrieves across processes: one completion point per layer the engine waits on.

Every instance registered with `layerwise=True` has one int64 flag per layer in shared
memory: the server writes a retrieve's sequence number there once that layer's copies
are queued (CUDA) or done (CPU), and its negative when the retrieve failed before that
layer. CUDA caches also have one interprocess CUDA event per layer, which the server
records on its copy stream before writing the flag. The server replies before it queues
the first layer, so its host work overlaps the engine's forward pass; `wait_layer(i)`
polls layer i's flag on the host (the server is queueing ahead of the GPU, so this
rarely waits) and then, on CUDA, makes the engine's stream wait on layer i's event, a
wait on the GPU. Sequence numbers grow per instance and the server serves one
instance's retrieves in order, so a flag at or past a retrieve's number means its layer
was marked.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from kvflow.core.errors import InvalidRequestError, RequestTimeoutError, TransferError
from kvflow.core.server.protocol import CudaIpcMemory, KVCachesDesc, TensorDesc

#: bytes of one layer's flag (an int64)
FLAG_BYTES = 8
#: seconds between polls of a CPU layer flag once spinning found it unset
POLL_S = 50e-6


class ClientLayers:
    """A client's per-layer completion points for one instance, and its retrieve numbers."""

    def __init__(self, num_layers: int, cuda_device: int | None) -> None:
        self.num_layers = num_layers
        self.device = cuda_device
        self.events: list[torch.cuda.Event] = []
        if cuda_device is not None:
            from kvflow.core.server.ipc import make_interprocess_event

            with torch.cuda.device(cuda_device):
                self.events = [make_interprocess_event() for _ in range(num_layers)]
                for event in self.events:  # an event must be recorded once to be shared
                    event.record(torch.cuda.current_stream(cuda_device))
        from kvflow.core.server.shm import empty_shared

        self._raw = empty_shared(num_layers * FLAG_BYTES, torch.uint8)
        self._raw.zero_()
        self.flags = self._raw.view(torch.int64)
        self._seq = 0
        #: held from numbering a retrieve until its reply: numbers reach the server in order
        self.lock = threading.Lock()

    def wire(self) -> tuple[list[bytes] | None, TensorDesc]:
        """(event IPC handles or None, flags description) for the Register request."""
        from kvflow.core.server.sharing import describe_tensor

        handles = [bytes(e.ipc_handle()) for e in self.events] if self.events else None
        return handles, describe_tensor(self._raw, "layer flags")

    def next_seq(self) -> int:
        """The next retrieve's number (call with `lock` held)."""
        self._seq += 1
        return self._seq


class LayerwiseLoad:
    """A layerwise retrieve whose copies are queued: `hit_tokens` are valid in the
    blocks once each layer's `wait_layer` returned (CUDA: once torch's current stream
    reaches the work queued after it)."""

    def __init__(self, hit_tokens: int, layers: ClientLayers | None, seq: int, timeout_s: float):
        self.hit_tokens = hit_tokens
        self._layers = layers
        self._seq = seq
        self._timeout_s = timeout_s
        #: seconds the host spent in each layer's wait (on CUDA only until the layer was
        #: queued: the stream's own wait is timed on the GPU, see `layer_waits`)
        self.waited_s: dict[int, float] = {}
        #: CUDA: timing events around each layer's stream wait, by layer
        self._stalls: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}

    def wait_layer(self, layer: int) -> None:
        """Order layer `layer`'s reads after its copies: on CPU this blocks until the
        layer landed; on CUDA until its copies are queued, then torch's current stream
        waits for them on the GPU. TransferError if the retrieve failed before that
        layer; RequestTimeoutError after the client's timeout."""
        layers = self._layers
        if layers is None or layer in self.waited_s:
            return
        if not 0 <= layer < layers.num_layers:
            raise InvalidRequestError(f"layer {layer} is not within the {layers.num_layers}")
        started = time.perf_counter()
        deadline = time.monotonic() + self._timeout_s
        spins = 0
        while True:
            value = int(layers.flags[layer])
            if value >= self._seq or -value > self._seq:
                break
            if value == -self._seq:
                raise TransferError(f"the layerwise retrieve failed before layer {layer} landed")
            if time.monotonic() > deadline:
                raise RequestTimeoutError(
                    f"layer {layer} did not land within {self._timeout_s:g} s"
                )
            spins += 1
            if spins > 100:
                time.sleep(POLL_S)
        self.waited_s[layer] = time.perf_counter() - started
        if layers.events:
            stream = torch.cuda.current_stream(layers.device)
            before = torch.cuda.Event(enable_timing=True)
            after = torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(layers.events[layer])
            after.record(stream)
            self._stalls[layer] = (before, after)

    def layer_waits(self) -> list[float]:
        """Seconds the engine waited for each layer it waited for, in layer order: the
        host's wait on CPU; on CUDA the host's wait plus how long the stream stalled at
        the layer's event (this synchronizes with those events: call it off the hot
        path, once the forward pass is queued)."""
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
        if self._layers is not None:
            for layer in range(self._layers.num_layers):
                self.wait_layer(layer)


class ServerLayers:
    """The server's side of an instance's completion points (opened from the Register)."""

    def __init__(self, num_layers: int, events: list[Any] | None, flags: torch.Tensor) -> None:
        count = flags.numel() / FLAG_BYTES
        if count != num_layers or flags.dtype != torch.uint8 or flags.dim() != 1:
            raise InvalidRequestError(
                f"layerwise registration gives {count:g} layer flags for {num_layers} layers"
            )
        if events is not None and len(events) != num_layers:
            raise InvalidRequestError(
                f"layerwise registration gives {len(events)} layer events for {num_layers} layers"
            )
        self.events = events
        self.flags = flags.view(torch.int64)

    def signal(self, seq: int) -> LayerMarks:
        """The engine-side signal of retrieve number `seq`."""
        return LayerMarks(self, seq)


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


def open_server_layers(
    event_handles: list[bytes] | None,
    flags: TensorDesc | None,
    cuda_device: int | None,
    num_layers: int,
) -> tuple[ServerLayers | None, Any]:
    """Open a Register's completion points: (ServerLayers or None when it asked for no
    layerwise retrieves, what to `release()` once the instance goes, or None)."""
    if event_handles is None and flags is None:
        return None, None
    if flags is None or isinstance(flags.memory, CudaIpcMemory):
        raise InvalidRequestError("a layerwise registration needs layer_flags in shared memory")
    if (event_handles is not None) != (cuda_device is not None):
        raise InvalidRequestError(
            "layer_event_handles go with GPU caches, and only with them"
            f" (these caches are on {'the GPU' if cuda_device is not None else 'the CPU'})"
        )
    events = None
    if event_handles is not None:
        assert cuda_device is not None
        from kvflow.core.server.ipc import open_interprocess_event

        if len(event_handles) != num_layers:
            raise InvalidRequestError(
                f"layerwise registration gives {len(event_handles)} layer events for"
                f" {num_layers} layers"
            )
        events = [open_interprocess_event(h, cuda_device) for h in event_handles]
    from kvflow.core.server.sharing import open_kv_caches

    opened = open_kv_caches(KVCachesDesc(kind="tensor", tensors=[flags]))
    try:
        return ServerLayers(num_layers, events, opened.kv_caches), opened
    except BaseException:
        opened.release()
        raise
