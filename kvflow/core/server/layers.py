"""Layerwise retrieves across processes: one completion point per layer the engine waits on.

CUDA caches: one interprocess CUDA event per layer, made by the client when it registers
with `layerwise=True` and recorded by the server on its copy stream once that layer's
copies are queued; the engine's stream waits on layer i's event right before layer i
reads its KV, a wait on the GPU that costs the host nothing. CPU caches: one int64 per
layer in shared memory; the server writes the retrieve's sequence number there once the
layer is copied (its negative when the retrieve failed before that layer), and the engine
polls it. Sequence numbers grow per instance and a server serves one instance's
retrieves in order, so a layer's flag at or past a retrieve's number means it landed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from kvflow.core.errors import InvalidRequestError, RequestTimeoutError, TransferError
from kvflow.core.server.protocol import CudaIpcMemory, KVCachesDesc, TensorDesc

log = logging.getLogger("kvflow.server")

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
        self.flags: torch.Tensor | None = None
        self._raw: torch.Tensor | None = None
        if cuda_device is not None:
            from kvflow.core.server.ipc import make_interprocess_event

            with torch.cuda.device(cuda_device):
                self.events = [make_interprocess_event() for _ in range(num_layers)]
                for event in self.events:  # an event must be recorded once to be shared
                    event.record(torch.cuda.current_stream(cuda_device))
        else:
            from kvflow.core.server.shm import empty_shared

            self._raw = empty_shared(num_layers * FLAG_BYTES, torch.uint8)
            self._raw.zero_()
            self.flags = self._raw.view(torch.int64)
        self._seq = 0
        #: held from numbering a retrieve until its reply: numbers reach the server in order
        self.lock = threading.Lock()

    def wire(self) -> tuple[list[bytes] | None, TensorDesc | None]:
        """(event IPC handles, flags description) for the Register request."""
        if self._raw is not None:
            from kvflow.core.server.sharing import describe_tensor

            return None, describe_tensor(self._raw, "layer flags")
        return [bytes(e.ipc_handle()) for e in self.events], None

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
        #: seconds the host spent in each layer's wait (CPU caches; 0 on CUDA, whose wait is
        #: on the GPU)
        self.waited_s: dict[int, float] = {}

    def wait_layer(self, layer: int) -> None:
        """Order layer `layer`'s reads after its copies: on CUDA, torch's current stream
        waits on the GPU; on CPU, this blocks until the layer landed. TransferError if
        the retrieve failed before that layer; RequestTimeoutError after the timeout."""
        layers = self._layers
        if layers is None or layer in self.waited_s:
            return
        if not 0 <= layer < layers.num_layers:
            raise InvalidRequestError(f"layer {layer} is not within the {layers.num_layers}")
        if layers.flags is None:
            torch.cuda.current_stream(layers.device).wait_event(layers.events[layer])
            self.waited_s[layer] = 0.0
            return
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

    def wait(self) -> None:
        """Wait for every layer (what a caller that reads them all at once does)."""
        if self._layers is not None:
            for layer in range(self._layers.num_layers):
                self.wait_layer(layer)


class ServerLayers:
    """The server's side of an instance's completion points (opened from the Register)."""

    def __init__(
        self, num_layers: int, events: list[Any] | None, flags: torch.Tensor | None
    ) -> None:
        count: float | None = len(events) if events is not None else None
        if flags is not None:
            count = flags.numel() / FLAG_BYTES
        if count != num_layers or (flags is not None and flags.dtype != torch.uint8):
            raise InvalidRequestError(
                f"layerwise registration gives {count} layer completion points for"
                f" {num_layers} layers"
            )
        self.events = events
        self.flags = flags.view(torch.int64) if flags is not None else None

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
        if layers.flags is not None:
            layers.flags[layer] = self._seq
        elif layers.events is not None and stream is not None:
            layers.events[layer].record(stream.torch)

    def failed(self, first_layer: int) -> None:
        layers = self._layers
        if layers.flags is not None:
            layers.flags[first_layer:] = -self._seq
        elif first_layer < len(layers.events or ()):
            # nothing to tell a GPU stream: its waits return at the layer's last record
            log.error("a layerwise retrieve failed at layer %d after its reply", first_layer)


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
    if (event_handles is not None) != (cuda_device is not None):
        where = "GPU" if cuda_device is not None else "CPU"
        raise InvalidRequestError(
            f"layerwise registration of {where} caches needs "
            + ("layer_event_handles" if cuda_device is not None else "layer_flags")
        )
    if event_handles is not None:
        assert cuda_device is not None
        from kvflow.core.server.ipc import open_interprocess_event

        if len(event_handles) != num_layers:
            raise InvalidRequestError(
                f"layerwise registration gives {len(event_handles)} layer events for"
                f" {num_layers} layers"
            )
        events = [open_interprocess_event(h, cuda_device) for h in event_handles]
        return ServerLayers(num_layers, events, None), None
    assert flags is not None
    from kvflow.core.server.sharing import open_kv_caches

    if isinstance(flags.memory, CudaIpcMemory):
        raise InvalidRequestError("layer_flags must be shared CPU memory")
    opened = open_kv_caches(KVCachesDesc(kind="tensor", tensors=[flags]))
    try:
        return ServerLayers(num_layers, None, opened.kv_caches), opened
    except BaseException:
        opened.release()
        raise
