"""The jobs the server's workers run, one small class per request kind.

The main loop turns each register, store, retrieve, blend retrieve, unregister and
admin request (and, with L2 tiers, each lookup, blend lookup and prefetch) into a `Job`
and submits it to a `Worker` (kvflow.core.server.worker), which runs its jobs in order
on one thread. A job's `run` returns its reply, or sends it early itself
(`Job.answered`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.engine.chunk_keys import keys_from_wire
from kvflow.core.errors import InvalidRequestError
from kvflow.core.server.admin import AdminOps
from kvflow.core.server.layers import ServerLayers, open_server_layers
from kvflow.core.server.protocol import (
    AdminRequest,
    Blended,
    BlendFound,
    BlendLookup,
    BlendRetrieve,
    CudaIpcMemory,
    Done,
    Lookup,
    Prefetch,
    PrefetchStarted,
    Register,
    Registered,
    Reply,
    Request,
    Retrieve,
    SegmentFound,
    StatusResult,
    Store,
)
from kvflow.core.server.registry import Registration, Registry
from kvflow.core.server.sharing import OpenedKVCaches, open_kv_caches
from kvflow.core.server.worker import Job, since
from kvflow.kernels.rope_params import LayerRopes, RopeParams

#: the server's logger: these lines are the server's
log = logging.getLogger("kvflow.server")

_Transferred = TypeVar("_Transferred", bound=Store | Retrieve)
_OnInstance = TypeVar("_OnInstance", bound=Request)


def _layers_of(reg: Registration, request: Store | Retrieve) -> ServerLayers | None:
    """The instance's completion points when `request` is layerwise (layer_seq > 0), else
    None; InvalidRequestError for a bad number or an instance registered without them."""
    seq = request.layer_seq
    if seq == 0:
        return None
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise InvalidRequestError(f"layer_seq must be an integer >= 0, got {seq!r}")
    if reg.layers is None:
        raise InvalidRequestError(
            f"instance {reg.instance_id!r} was registered without layerwise=True: it has no"
            f" per-layer completion points for a layerwise {type(request).__name__.lower()}"
        )
    return reg.layers


class QueryJob(Job):
    """A lookup's hit tokens or a prefetch's id. Run on the query worker when L2 tiers
    may make it wait, else at once on the main loop."""

    def __init__(
        self, engine: CacheEngine, request: Lookup | Prefetch, tokens: np.ndarray, started: int
    ) -> None:
        super().__init__(request.id, started)
        self._engine = engine
        self._request = request
        self._tokens = tokens

    def run(self) -> Reply:
        request, tokens = self._request, self._tokens
        model, world, salt, rid = (
            request.model_name, request.world_size, request.cache_salt, request.request_id
        )  # fmt: skip
        if isinstance(request, Lookup):
            keys = keys_from_wire(tokens) if request.keyed else None
            hit = self._engine.lookup(
                None if request.keyed else tokens, model_name=model, world_size=world,
                cache_salt=salt, request_id=rid, prefetch=request.prefetch, chunk_keys=keys,
                ranks=request.ranks,
            )  # fmt: skip
            return Done(id=request.id, value=hit, server_ns=since(self.started))
        prefetch_id = self._engine.prefetch(
            tokens, model_name=model, world_size=world, cache_salt=salt, request_id=rid,
            ranks=request.ranks,
        )  # fmt: skip
        return PrefetchStarted(
            id=request.id, prefetch_id=prefetch_id, server_ns=since(self.started)
        )


class BlendLookupJob(Job):
    """A blend lookup's prefix hit and segments (docs/BLEND.md). Run where a lookup runs:
    on the query worker when L2 tiers may make it wait, else at once on the main loop."""

    def __init__(
        self, engine: CacheEngine, request: BlendLookup, tokens: np.ndarray, started: int
    ) -> None:
        super().__init__(request.id, started)
        self._engine = engine
        self._request = request
        self._tokens = tokens

    def run(self) -> Reply:
        request = self._request
        hit = self._engine.blend_lookup(
            self._tokens, model_name=request.model_name, world_size=request.world_size,
            cache_salt=request.cache_salt, request_id=request.request_id,
            prefetch=request.prefetch, ranks=request.ranks,
        )  # fmt: skip
        segments = [
            SegmentFound(s.offset, s.length, s.chunk_hash, s.original_start) for s in hit.segments
        ]
        return BlendFound(
            id=request.id, prefix_tokens=hit.prefix_tokens, segments=segments,
            server_ns=since(self.started),
        )  # fmt: skip


class _InstanceJob(Job, Generic[_OnInstance]):
    """A request that moves KV of one registered instance: the engine, the registration
    and the request (its arrays decoded on the main loop when the job is made)."""

    def __init__(
        self, engine: CacheEngine, reg: Registration, request: _OnInstance, started: int
    ) -> None:
        super().__init__(request.id, started)
        self._engine = engine
        self._reg = reg
        self._request: _OnInstance = request


class BlendRetrieveJob(_InstanceJob[BlendRetrieve]):
    """Copy blend segments into an instance's blocks, K turned, on the instance's worker.
    The engine returns once the copies landed (CUDA too), so the reply comes after them."""

    def __init__(
        self,
        engine: CacheEngine,
        reg: Registration,
        request: BlendRetrieve,
        arrays: tuple[np.ndarray, ...],
        started: int,
    ) -> None:
        super().__init__(engine, reg, request, started)
        self._tokens, self._blocks = arrays
        # non-overlapping whole chunks inside the prompt: more cannot be valid, and the
        # bound keeps a huge list from reaching the worker
        fit = len(self._tokens) // engine.chunk_size
        if len(request.segments) > fit:
            raise InvalidRequestError(
                f"BlendRetrieve has {len(request.segments)} segments, more than its"
                f" {len(self._tokens)} prompt tokens hold ({fit} chunks of {engine.chunk_size}"
                " tokens, none overlapping)"
            )

    def __str__(self) -> str:
        return f"blend retrieve {self._request.request_id!r}"

    def run(self) -> Reply:
        request = self._request
        done = self._engine.blend_retrieve(
            self._reg.instance_id,
            self._tokens,
            self._blocks,
            [(s.offset, s.chunk_hash, s.original_start) for s in request.segments],
            request_id=request.request_id,
            cache_salt=request.cache_salt,
        )
        return Blended(
            id=request.id, tokens=done.tokens, skipped=list(done.skipped),
            server_ns=since(self.started),
        )  # fmt: skip


class _Transfer(_InstanceJob[_Transferred]):
    """What a store and a retrieve share: the tokens (or chunk keys, chunk_keys.py) and
    blocks, and the reply sent before the job ends, once its copies are queued."""

    #: what the job is called in the log
    kind = "transfer"

    def __init__(
        self,
        engine: CacheEngine,
        reg: Registration,
        request: _Transferred,
        arrays: tuple[np.ndarray, ...],
        started: int,
        identity: bytes,
    ) -> None:
        super().__init__(engine, reg, request, started)
        tokens, self._blocks = arrays
        self._keys = keys_from_wire(tokens) if request.keyed else None
        self._tokens = None if self._keys is not None else tokens
        self._identity = identity

    def __str__(self) -> str:
        return f"{self.kind} {self._request.request_id!r}"

    def _reply_now(self, event: Any, stream: Any, value: int) -> None:
        """Record the client's `event` on `stream` (when both are given), then send the
        reply while the job goes on: the client waits for the event, not for the job."""
        if stream is not None and event is not None:
            event.record(stream.torch)
        done = Done(id=self.request_id, value=value, server_ns=since(self.started))
        self._reg.worker.answer(self._identity, done)
        self.answered = True


class StoreJob(_Transfer[Store]):
    """Copy blocks into the cache, after the engine's writes to them (its IPC event) or,
    layerwise, each layer once the engine marks it written. With the client's store
    event (CUDA caches) it replies once the copies are queued (`_answer_early`), so a
    later error can only be logged; the client waits for the event."""

    kind = "store"

    def run(self) -> Reply | None:
        reg, request = self._reg, self._request
        layers = _layers_of(reg, request)
        if reg.event is not None and layers is None:  # the engine's writes first
            reg.event.synchronize()
        early = reg.stored is not None and layers is None
        value = self._engine.store(
            reg.instance_id,
            self._tokens,
            self._blocks,
            request_id=request.request_id,
            cache_salt=request.cache_salt,
            chunk_keys=self._keys,
            layers=(
                layers.store_waits(request.layer_seq, lambda: reg.retiring) if layers else None
            ),
            enqueued=self._answer_early if early else None,
        )
        if self.answered:
            return None
        return Done(id=request.id, value=value, server_ns=since(self.started))

    def _answer_early(self, stream: Any, held_tokens: int) -> None:
        """The copies are queued: mark their end with the client's store event and reply
        now; the client waits on the host for the event, so the reply's trip and this
        store's end (the wait, L1's commit, its events) overlap the copies."""
        self._reply_now(self._reg.stored, stream, held_tokens)


class RetrieveJob(_Transfer[Retrieve]):
    """Copy cached chunks into blocks. With CUDA caches it replies as soon as the copies
    are queued (`_answer_early`), layerwise once the first layer is (`_answer_layerwise`),
    so a later error can only be logged (layerwise: flagged in the layers not marked)."""

    kind = "retrieve"

    def run(self) -> Reply | None:
        reg, request = self._reg, self._request
        layers = _layers_of(reg, request)
        if layers is not None:  # the engine waits on each layer's own event and flag
            enqueued: Callable[[Any, int], None] | None = self._answer_layerwise
        else:
            enqueued = self._answer_early if reg.retrieved is not None else None
        value = self._engine.retrieve(
            reg.instance_id,
            self._tokens,
            self._blocks,
            request_id=request.request_id,
            skip_first_n_tokens=request.skip_first_n_tokens,
            cache_salt=request.cache_salt,
            enqueued=enqueued,
            chunk_keys=self._keys,
            layers=layers.signal(request.layer_seq) if layers else None,
            staging=(
                layers.staging.claims(request.layer_seq, lambda: reg.retiring)
                if layers is not None and layers.staging is not None
                else None
            ),
        )
        if self.answered:
            return None
        return Done(id=request.id, value=value, server_ns=since(self.started))

    def _answer_early(self, stream: Any, hit_tokens: int) -> None:
        """The copies are queued: mark their end with the client's event on the copy
        stream and reply now; the client polls the event on the host, and the reply's
        trip overlaps the copy."""
        self._reply_now(self._reg.retrieved, stream, hit_tokens)
        _let_the_loop_send()

    def _answer_layerwise(self, stream: Any, hit_tokens: int) -> None:
        """A layerwise retrieve's first layer is queued (CUDA) or about to be copied (CPU
        caches): reply now. The client polls each layer's flag and event, so no event
        of the whole retrieve is recorded."""
        self._reply_now(None, stream, hit_tokens)
        _let_the_loop_send()


def _let_the_loop_send() -> None:
    """A reply was handed to the loop and this thread goes on queueing copies holding
    the GIL: hand it over, so the loop sends the reply now, not a switch interval later."""
    time.sleep(0)


class RegisterJob(Job):
    """Map the client's KV caches, open its CUDA events and layer points and register
    the instance with the engine (with `ropes`, its rotary embedding decoded from the
    request); on failure, forget the registration and unmap."""

    def __init__(
        self,
        engine: CacheEngine,
        registry: Registry,
        reg: Registration,
        request: Register,
        started: int,
        heartbeat_interval_s: float,
        ropes: RopeParams | LayerRopes | None,
    ) -> None:
        super().__init__(request.id, started)
        self._engine = engine
        self._registry = registry
        self._reg = reg
        self._request = request
        self._heartbeat_interval_s = heartbeat_interval_s
        self._ropes = ropes

    def run(self) -> Reply:
        request = self._request
        opened: OpenedKVCaches | None = None
        try:
            # opening the client's CUDA memory and events, like the engine's registration,
            # would queue behind L1's pinning in the driver (shared memory needs no CUDA)
            on_cuda = any(isinstance(t.memory, CudaIpcMemory) for t in request.kv_caches.tensors)
            with self._engine.l1.pinning_paused() if on_cuda else contextlib.nullcontext():
                opened = open_kv_caches(request.kv_caches)
                self._serve(opened)
        except BaseException:
            self._registry.discard(self._reg)
            if opened is not None:
                opened.release()
            raise
        log.info(
            "registered instance %r of model %r (rank %d/%d) for client %s",
            request.instance_id,
            request.model_name,
            request.rank,
            request.world_size,
            request.client or "?",
        )
        return Registered(
            id=request.id,
            heartbeat_interval_s=self._heartbeat_interval_s,
            server_ns=since(self.started),
        )

    def _serve(self, opened: OpenedKVCaches) -> None:
        """Register the mapped caches with the engine and fill in the registration."""
        request, engine, reg = self._request, self._engine, self._reg
        event = retrieved = stored = None
        if opened.cuda_device is not None:
            from kvflow.core.server.ipc import open_interprocess_event

            device = opened.cuda_device
            if request.event_handle is not None:
                event = open_interprocess_event(request.event_handle, device)
            if request.retrieve_event_handle is not None:
                retrieved = open_interprocess_event(request.retrieve_event_handle, device)
            if request.store_event_handle is not None:
                stored = open_interprocess_event(request.store_event_handle, device)
        engine.register_kv_caches(
            request.instance_id,
            opened.kv_caches,
            model_name=request.model_name,
            world_size=request.world_size,
            rank=request.rank,
            block_size=request.block_size,
            kv_format=request.kv_format,
            ropes=self._ropes,
        )
        try:
            layers, layers_opened = open_server_layers(
                request.layer_event_handles,
                request.layer_flags,
                opened.cuda_device,
                engine.num_layers(request.instance_id),
                request.layer_staging,
                request.layer_staging_event_handles,
            )
        except BaseException:
            engine.unregister(request.instance_id)
            raise
        reg.opened, reg.event, reg.retrieved, reg.stored = opened, event, retrieved, stored
        reg.layers, reg.layers_opened = layers, layers_opened
        reg.served_at = time.monotonic()


class RetireJob(Job):
    """Unregister an instance from the engine after its queued jobs, and release its
    memory (also when the engine's unregister fails)."""

    def __init__(self, engine: CacheEngine, reg: Registration, request_id: int, started: int):
        super().__init__(request_id, started)
        self._engine = engine
        self._reg = reg

    def run(self) -> Reply:
        reg = self._reg
        try:
            if reg.opened is not None:  # else its registration failed: nothing to unregister
                self._engine.unregister(reg.instance_id)
        finally:
            reg.release()
        return Done(id=self.request_id, server_ns=since(self.started))


class AdminJob(Job):
    """An admin's request (clear, resize, drain, quota), on the admin worker."""

    def __init__(self, admin: AdminOps, request: AdminRequest, caller: str, started: int):
        super().__init__(request.id, started)
        self._admin = admin
        self._request = request
        self._caller = caller

    def run(self) -> Reply:
        result = self._admin.run(self._request, self._caller)
        return StatusResult(id=self.request_id, status=result, server_ns=since(self.started))
