"""The in-process cache engine (docs/ENGINE.md): registration, transfers, sessions, status.

`CacheEngine` is the public face; the modules beside this one hold its parts:
`validation` (argument checks, request bounds), `queries` (lookup and prefetch),
`transfers` (a store's or retrieve's state and waves), `tiering` with `loads` and
`writethrough` (the L2 side, its tiers built by `l2_from_config`), `movers` and
`layerwise` (bytes), `observability` and `bus_status` (events, status).

A transfer reads top-down. `store` and `retrieve` call one helper per phase: check the
request (`_begin`); copy its L1 part in doubling waves (`_store_waves`, `_retrieve_l1`);
its L2 part (`_stream_store`, `_retrieve_l2`); end it: END published, copies waited
for, plan committed (`_end_store`, `_end_retrieve`). Every failure takes one path,
`_transfer`: the instance's streams drained once, what the op holds undone, a failed END.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, cast

import numpy as np

from kvflow.core.config import ServerConfig
from kvflow.core.engine.blend import Blender, BlendHit, BlendRetrieved, copy_segments, layer_ropes
from kvflow.core.engine.bus_status import bus_status
from kvflow.core.engine.instances import Instance, LayoutDesc, ModelRank
from kvflow.core.engine.keys import KeyCache
from kvflow.core.engine.l2_from_config import GIB, build_l2
from kvflow.core.engine.layerwise import (
    LayerSignal,
    Staging,
    WrittenSignal,
    cpu_gather_layers,
    cpu_scatter_layers,
)
from kvflow.core.engine.movers import CpuMover, CudaMover, Mover
from kvflow.core.engine.observability import Observability
from kvflow.core.engine.ops import Op
from kvflow.core.engine.queries import Queries
from kvflow.core.engine.request import RequestIds
from kvflow.core.engine.tiering import Tiering
from kvflow.core.engine.transfers import (
    Copied,
    LayerProgress,
    Transfer,
    rows_of,
    run_waves,
    transfer_attrs,
    written_chunks,
    written_tokens,
)
from kvflow.core.engine.validation import (
    MAX_REQUEST_TOKENS,
    MAX_WORLD_SIZE,
    check_allocations,
    check_salt,
    check_skip,
    check_str,
    check_waits,
    check_world,
    keyed,
)
from kvflow.core.engine.writethrough import WriteReceipt
from kvflow.core.errors import (
    AlreadyRegisteredError,
    CapacityError,
    InvalidRequestError,
    KVFlowError,
    TransferError,
    UnknownInstanceError,
)
from kvflow.core.tiers.base import HostTier, ObjectKey, PlacedTier, StorageTier, WritePlan
from kvflow.core.tiers.hostmem import HostPool
from kvflow.core.tiers.l1 import L1Cache
from kvflow.core.tiers.quota import TenantQuotas, parse_quotas
from kvflow.events import BlockAllocation, Event, EventBus, EventType
from kvflow.kernels import KVLayout, cuda_available
from kvflow.kernels.rope import plan_rerotation

__all__ = [
    "GIB",
    "MAX_REQUEST_TOKENS",
    "MAX_WORLD_SIZE",
    "STALL_S",
    "STREAM_SHARE",
    "CacheEngine",
]

#: Share of L1 one window of a store or retrieve streaming through L1 takes (a request
#: larger than L1 with an L2 tier): with the write-through backlog (BACKLOG_SHARE) and a
#: retrieve's next window in flight, the streaming request never needs all of L1.
STREAM_SHARE = 0.25
#: A layer wait longer than this counts as a stall (shorter ones are the cost of looking:
#: a flag read, or two GPU timing events around a wait that did not wait).
STALL_S = 50e-6

#: an ObjectKey's chunk hash, for the chunk_hashes attr (a C call per key, no Python frame)
_HASH_OF: Callable[[Any], bytes] = itemgetter(0)


class CacheEngine:
    """Registration, keys, L1 and transfers behind the public methods (docs/ARCHITECTURE.md).

    Builds its event bus and subscribers from `config.observability` unless `bus`
    is given; a given bus is used as is (the caller starts and stops it). L2 tiers
    come from the config (`l2_disk_paths`) unless `l2_tiers` are given (the engine
    closes them either way).

    Lock rule. `_lock` guards `_instances`, `_layouts` and `_closed`: each is read and
    written only under it (`_open` takes it and refuses a closed engine: the one closed
    check). Each `Instance.lock` orders that instance's transfers, which share its mover
    (streams, staging buffer); a transfer gives it up only while it waits on L2 with its
    mover idle (`_unlocked`). Locks are taken in this order: an instance's lock, then
    `_lock`, then those of L1 and the tiers; `_lock` is never held while an instance's
    lock is taken or while waiting on I/O. Read without a lock: `config`, `chunk_size`,
    `tenants`, `l1`, `bus`, `_keys`, `_obs`, `_tiering` and `_queries`, set in __init__
    and never reassigned, each immutable or thread-safe by its own lock.
    """

    def __init__(
        self,
        config: ServerConfig | None = None,
        *,
        bus: EventBus | None = None,
        l2_tiers: Sequence[StorageTier] | None = None,
    ):
        self.config = config if config is not None else ServerConfig()
        self.chunk_size = self.config.chunk_size
        # the engine reaches every tier only through the tier interface (kvflow.core.tiers.base)
        #: per-tenant L1 usage, limits and lookup hits (docs/OPERATIONS.md, Tenant quotas)
        self.tenants = TenantQuotas(
            parse_quotas(self.config.l1_quotas), self.config.observability.max_label_values
        )
        self._keys = KeyCache(self.chunk_size)
        self._lock = threading.Lock()
        self._instances: dict[str, Instance] = {}
        self._layouts: dict[ModelRank, LayoutDesc] = {}
        self._closed = False
        tiers = list(l2_tiers) if l2_tiers is not None else build_l2(self.config)
        # the pipeline (and the log handler it installs) before L1, whose threads pinning
        # ahead log from start-up; its L1 gauges read L1 only when metrics are collected
        self._obs = Observability(
            self.config.observability,
            bus,
            l1_stats=self.l1_stats,
            tier_stats=(lambda: {t.name: t.stats() for t in tiers}) if tiers else None,
            tenant_stats=self.tenant_stats,
        )
        self.bus = self._obs.bus
        pin_threads = self.config.l1_pin_threads
        try:
            self.l1: HostTier = L1Cache(
                int(self.config.l1_size_gb * GIB),
                pool=HostPool(prefault=self.config.l1_prefault),
                tenants=self.tenants,
                pin_ahead=None if pin_threads else False,  # wherever memory is pinned/faulted in
                pin_threads=max(1, pin_threads),
            )
        except BaseException:
            self._obs.close()
            raise
        self._tiering: Tiering | None = None
        if tiers:
            self._tiering = Tiering(
                self.l1, tiers, self.bus, chunk_size=self.chunk_size,
                write_back=self.config.l2_write_back, timeout_s=self.config.l2_timeout_s,
                backlog_wait_s=self.config.l2_backlog_wait_s,
            )  # fmt: skip
        self._queries = Queries(
            l1=self.l1, keys=self._keys, tiering=self._tiering, tenants=self.tenants,
            bus=self.bus, chunk_size=self.chunk_size, check_open=self._check_open,
            layouts=self._rank_layouts,
        )  # fmt: skip
        self._blend = Blender(
            l1=self.l1, tiering=self._tiering, bus=self.bus, chunk_size=self.chunk_size,
            prefix_lookup=self._queries.lookup, rank_nbytes=self._queries.rank_nbytes,
            capacity_chunks=self.config.blend_index_chunks,
        )  # fmt: skip

    # -- engine state (under `_lock`) ------------------------------------------------------

    @contextlib.contextmanager
    def _open(self) -> Iterator[None]:
        """Hold the engine's lock, refusing a closed engine (KVFlowError)."""
        with self._lock:
            if self._closed:
                raise KVFlowError("the cache engine is closed")
            yield

    def _check_open(self) -> None:
        """KVFlowError when the engine is closed."""
        with self._open():
            pass

    def _instance(self, instance_id: Any) -> Instance:
        """A registered instance (UnknownInstanceError if none; KVFlowError once closed)."""
        with self._open():
            inst = self._instances.get(instance_id)
        if inst is None:
            raise UnknownInstanceError(f"instance {instance_id!r} is not registered")
        return inst

    def _rank_layouts(self, model_name: str, world_size: int) -> list[LayoutDesc | None]:
        """The layout desc recorded for each rank of the model's world (None: never)."""
        with self._lock:
            return [self._layouts.get((model_name, world_size, r)) for r in range(world_size)]

    # -- events ------------------------------------------------------------------------------

    def _publish(self, etype: EventType, session_id: str | None, attrs: dict[str, Any]) -> None:
        self.bus.publish(Event(etype, 0, session_id, None, attrs))

    def _publish_evictions(self, plan: WritePlan, session_id: str | None) -> None:
        """L1_EVICT for the objects a write plan evicted (none: no event)."""
        if plan.evicted_chunks:
            attrs = {
                "chunks": plan.evicted_chunks,
                "bytes": plan.evicted_bytes,
                "keys": plan.evicted_keys,
            }
            self._publish(EventType.L1_EVICT, session_id, attrs)
            if self._tiering is None:  # no other tier holds them: blend forgets them
                self._blend.forget(plan.evicted_keys)

    # -- registration ------------------------------------------------------------------

    def register_kv_caches(
        self,
        instance_id: str,
        kv_caches: Any,
        *,
        model_name: str,
        world_size: int = 1,
        rank: int = 0,
        block_size: int | None = None,
        kv_format: str | None = None,
        ropes: Any = None,
    ) -> None:
        """Register an instance's KV tensors; the layout is detected (or `kv_format`).
        `ropes` (RopeParams for every layer, or LayerRopes): the model's rotary embedding,
        which a blend retrieve turns K with (docs/BLEND.md)."""
        check_str("instance_id", instance_id)
        check_str("model_name", model_name)
        check_world(world_size, rank)
        with self._lock:
            if instance_id in self._instances:
                raise AlreadyRegisteredError(f"instance {instance_id!r} is already registered")
        try:
            layout = KVLayout.from_kv_caches(kv_caches, block_size=block_size, kv_format=kv_format)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"kv_caches of instance {instance_id!r}: {exc}") from None
        if self.chunk_size % layout.block_size:
            raise InvalidRequestError(
                f"chunk_size {self.chunk_size} is not a multiple of the block_size "
                f"{layout.block_size} of instance {instance_id!r}"
            )
        desc: LayoutDesc = tuple(
            (tuple(shape), dtype) for shape, dtype in layout.layout_desc(self.chunk_size)
        )
        nbytes = layout.chunk_nbytes(self.chunk_size)
        if nbytes > self.l1.capacity_bytes:
            raise CapacityError(
                f"one chunk of instance {instance_id!r} takes {nbytes} bytes, more than the whole "
                f"L1 capacity ({self.l1.capacity_bytes} bytes); raise --l1-size-gb"
            )
        turns = self._checked_ropes(instance_id, layout, ropes)
        on_cuda = layout.device.type == "cuda"  # its CUDA calls would queue behind pinning
        with self.l1.pinning_paused() if on_cuda else contextlib.nullcontext():
            mover = self._make_mover(layout, nbytes)
            inst = Instance(
                instance_id, model_name, world_size, rank, layout, self.chunk_size, desc, nbytes,
                mover, ropes=turns,
            )  # fmt: skip
            try:
                self._add_instance(inst)
            except BaseException:
                mover.close()
                raise
        self._publish(EventType.REGISTER, None, inst.event_attrs())

    @staticmethod
    def _checked_ropes(instance_id: str, layout: KVLayout, ropes: Any) -> Any:
        """An instance's rotary parameters as LayerRopes, checked against its layout."""
        turns = layer_ropes(ropes, layout.num_layers)
        if turns is not None:
            try:
                plan_rerotation(layout, turns, [])
            except ValueError as exc:
                raise InvalidRequestError(f"ropes of instance {instance_id!r}: {exc}") from None
        return turns

    def _make_mover(self, layout: KVLayout, chunk_nbytes: int) -> Mover:
        if layout.device.type == "cpu":
            return CpuMover(layout)
        if layout.device.type == "cuda" and cuda_available():
            self._obs.stamp_on_streams()  # a given bus may have come without a stamper
            return CudaMover(layout, chunk_nbytes)
        raise InvalidRequestError(
            f"KV caches on {layout.device} are not supported here (CUDA caches need pycuda "
            "and a visible GPU; otherwise use CPU tensors)"
        )

    def _add_instance(self, inst: Instance) -> None:
        """Record the instance and its (model, world, rank) layout desc, atomically."""
        key = inst.model_rank
        with self._open():
            if inst.instance_id in self._instances:
                raise AlreadyRegisteredError(f"instance {inst.instance_id!r} is already registered")
            known = self._layouts.get(key)
            if known is not None and known != inst.layout_desc:
                users = [i.instance_id for i in self._instances.values() if i.model_rank == key]
                if users:
                    raise InvalidRequestError(
                        f"model {key[0]!r} world_size {key[1]} rank {key[2]} is registered by "
                        f"{users} with chunk layout {known}; instance {inst.instance_id!r} has "
                        f"{inst.layout_desc} (use a different model_name)"
                    )
                # nobody uses the old layout any more: its objects are unreadable, drop them
                self.l1.drop_where(lambda k: (k.model_name, k.world_size, k.rank) == key)
            self._layouts[key] = inst.layout_desc
            self._instances[inst.instance_id] = inst
        device = inst.layout.device
        if self._tiering is not None and device.type == "cuda":
            for tier in self._tiering.tiers:
                if isinstance(tier, PlacedTier):
                    tier.place(*key, device.index or 0)

    def unregister(self, instance_id: str) -> None:
        """Forget an instance after its in-flight transfer; its L1 objects stay cached."""
        with self._lock:
            inst = self._instances.pop(instance_id, None)
        if inst is None:
            raise UnknownInstanceError(f"instance {instance_id!r} is not registered")
        with inst.lock:
            inst.mover.close()
        self._publish(EventType.UNREGISTER, None, inst.event_attrs())

    def num_layers(self, instance_id: str) -> int:
        """Layers of a registered instance's caches (UnknownInstanceError if none)."""
        return self._instance(instance_id).layout.num_layers

    def layout_desc(self, model_name: str, world_size: int = 1, rank: int = 0) -> LayoutDesc | None:
        """The chunk layout recorded for (model, world, rank), or None if never registered."""
        with self._lock:
            return self._layouts.get((model_name, world_size, rank))

    # -- lookup and prefetch (queries.py) ---------------------------------------------------

    def lookup(
        self,
        token_ids: Any,
        *,
        model_name: str,
        world_size: int = 1,
        cache_salt: str | None = None,
        request_id: str | None = None,
        prefetch: bool = True,
        chunk_keys: Sequence[bytes] | None = None,
        ranks: Sequence[int] | None = None,
    ) -> int:
        """Tokens of the longest prefix of full chunks every rank has in some tier; with
        `ranks`, every one of those ranks only (a server that holds one rank of an engine).

        With `chunk_keys` (and no token_ids) the chunks are named by those keys
        (kvflow.core.engine.chunk_keys) instead of by hashes of their tokens.

        When part of that prefix lies in L2, a prefetch of it into L1 starts (unless
        `prefetch` is False or the model's layouts were never registered) and the
        lookup returns at once.
        """
        return self._queries.lookup(
            token_ids, model_name=model_name, world_size=world_size, cache_salt=cache_salt,
            request_id=request_id, prefetch=prefetch, chunk_keys=chunk_keys, ranks=ranks,
        )  # fmt: skip

    def prefetch(
        self,
        token_ids: Any,
        *,
        model_name: str,
        world_size: int = 1,
        cache_salt: str | None = None,
        request_id: str | None = None,
        ranks: Sequence[int] | None = None,
    ) -> str:
        """Start loading the request's L2-resident prefix into L1; returns a prefetch id.

        Non-blocking. L1 objects are allocated from the layout desc registered for each
        rank of (model_name, world_size) (of `ranks` only, when given: a server holding
        some ranks of an engine), so no engine tensor is touched; a model whose ranks were
        never registered is an error. `prefetch_state(id)` reports progress.
        """
        return self._queries.prefetch(
            token_ids, model_name=model_name, world_size=world_size, cache_salt=cache_salt,
            request_id=request_id, ranks=ranks,
        )  # fmt: skip

    def prefetch_state(self, prefetch_id: str) -> dict[str, Any]:
        """A prefetch's progress: state running/done, chunks, tokens landed, kept, discarded."""
        return self._queries.prefetch_state(prefetch_id)

    # -- what every transfer shares ----------------------------------------------------------

    @contextlib.contextmanager
    def _transfer(
        self, inst: Instance, start: EventType, request_id: Any, token_ids: Any, **failed: Any
    ) -> Iterator[Transfer]:
        """Run a store's or retrieve's body under the instance's lock, as one START/END op.

        On any error the instance's streams are drained (the failure path's one wait:
        copies already queued land before their memory is reused), the Transfer's
        holdings are undone (`_undo`), a failed END with the `failed` attrs is published
        (whatever the undoing raised) and the error re-raised; errors that are not
        kvflow's own (a failing copy) become TransferError. On success the objects it read
        are released, still under the lock.
        """
        attrs = transfer_attrs(inst, token_ids)
        with inst.lock:
            tx = Transfer(inst, Op(self.bus, start, request_id, attrs), request_id)
            try:
                yield tx
            except BaseException as exc:
                own = isinstance(exc, KVFlowError) or not isinstance(exc, Exception)
                err = exc
                if not own:
                    err = TransferError(f"transfer for instance {inst.instance_id!r} failed: {exc}")
                try:
                    with contextlib.suppress(Exception):
                        inst.mover.wait()
                    self._undo(tx)
                finally:
                    tx.op.fail(err, **failed)
                if own:
                    raise
                raise err from exc
            self._release_hits(tx)

    def _undo(self, tx: Transfer) -> None:
        """A failed transfer's holdings, once its streams are drained: its failure steps
        run, its uncommitted plan is aborted (nothing it wrote becomes visible), evictions
        not told yet are told, and the objects it read are released (even when a failure
        step raised)."""
        try:
            for step in tx.on_failure:
                step()
        finally:
            if tx.plan is not None:
                self.l1.abort(tx.plan)
                tx.plan = None
            self._tell_evictions(tx)
            self._release_hits(tx)

    @contextlib.contextmanager
    def _unlocked(self, inst: Instance) -> Iterator[None]:
        """Let the instance's other transfers run while this one waits on I/O (an L2 load):
        the caller holds `inst.lock` with its mover idle (every copy it queued landed).
        Once the lock is taken back, an instance unregistered meanwhile fails the op."""
        inst.lock.release()
        try:
            yield
        finally:
            inst.lock.acquire()
        with self._lock:
            gone = self._instances.get(inst.instance_id) is not inst
        if gone:
            raise UnknownInstanceError(
                f"instance {inst.instance_id!r} was unregistered while its transfer waited"
                " for an L2 tier"
            )

    def _begin(
        self, tx: Transfer, token_ids: Any, block_ids: Any, cache_salt: Any,
        named: list[bytes] | None,
    ) -> None:  # fmt: skip
        """A transfer's first phase: its arguments checked (those that need no conversion)
        and its ids made (`RequestIds`, converted chunk range by chunk range later)."""
        inst = tx.inst
        check_str("request_id", tx.request_id)
        tx.cache_salt = check_salt(cache_salt)
        tx.ids = RequestIds(
            token_ids, block_ids, chunk_size=self.chunk_size, layout=inst.layout,
            blocks_per_chunk=inst.blocks_per_chunk,
        )  # fmt: skip
        tx.ids.hashes = named

    def _chunk_keys(self, tx: Transfer, first: int, stop: int) -> list[ObjectKey]:
        """L1 keys of chunks [first, stop), converting their token ids first (chained
        hashes of the whole prefix, computed once per session, then cached), or the
        request's own chunk keys when it came with them."""
        model, world, rank = tx.inst.model_rank
        ids = tx.ids
        hashes: Sequence[bytes]
        if ids.hashes is not None:
            hashes = ids.hashes[:stop]
        else:
            ids.convert_tokens(stop)
            hashes = self._keys.hashes(ids.tokens[: stop * self.chunk_size], tx.request_id)
        return [ObjectKey(h, model, world, rank, tx.cache_salt) for h in hashes[first:]]

    def _stream_chunks(self, nbytes: int) -> int:
        """Chunks of `nbytes` in one window of a request streaming through L1."""
        return max(1, int(self.l1.capacity_bytes * STREAM_SHARE) // max(nbytes, 1))

    def _tell_evictions(self, tx: Transfer) -> None:
        """Publish the evictions of the transfer's plan, once."""
        plan, tx.untold = tx.untold, None
        if plan is not None:
            self._publish_evictions(plan, tx.request_id)

    def _release_hits(self, tx: Transfer) -> None:
        """Unpin the L1 objects the transfer read and free the staged L2 loads it read."""
        pinned, staged = tx.pinned, tx.staged
        tx.pinned, tx.staged = [], []
        if pinned:
            self.l1.release(pinned)
        if staged and self._tiering is not None:
            self._tiering.loader.discard(staged)

    # -- store ------------------------------------------------------------------------------

    def store(
        self,
        instance_id: str,
        token_ids: Any,
        block_ids: Any,
        *,
        request_id: str,
        cache_salt: str | None = None,
        chunk_keys: Sequence[bytes] | None = None,
        layers: WrittenSignal | None = None,
        enqueued: Callable[[Any, int], None] | None = None,
    ) -> int:
        """Copy the full chunks missing from L1 into it; returns tokens of the request held.

        With `chunk_keys` (and token_ids None) the chunks are named by those keys, one per
        chunk, as in `lookup`. With `layers` each layer is copied once it says the engine
        wrote it (`_store_layers`).

        The result counts, from token 0, the chunks now held: in L1 (written by this call,
        already there, or being written by a concurrent store) or, with L2 tiers, in L2 or
        being written to it. Without L2 it stops at the first chunk L1 had no room for;
        with L2 a request larger than (free) L1 streams through it (`_stream_store`).

        `enqueued(stream, held_tokens)`, for a CUDA cache, is called once every copy of a
        store that went to L1 whole (not layerwise, not streamed) is queued on `stream`,
        before the engine waits for them: the server answers then, with an event
        recorded on that stream, and the caller waits for that event. From then on L1
        shows the chunks to every read made after their copies ran, even before the
        engine's own wait returns (`L1Cache.commit_when_done`).
        """
        token_ids, named = keyed(token_ids, chunk_keys, self.chunk_size)
        inst = self._instance(instance_id)
        failed = {"tokens": 0, "bytes": 0}
        with self._transfer(inst, EventType.STORE_START, request_id, token_ids, **failed) as tx:
            self._begin(tx, token_ids, block_ids, cache_salt, named)
            plan = self._store_layers(tx, layers) if layers is not None else None
            if plan is None:  # not layerwise, or more than L1 can hold at once
                plan = self._store_waves(tx)
                if self._tiering is not None and plan.covered < tx.ids.n_chunks:
                    held = self._stream_store(tx, plan)
                    self._blend.record_store(tx.indexing)
                    return held
                inst.mover.flush()
                self._end_store(tx, plan, enqueued)
        # once the lock is free: the write-through may wait for backlog room
        self._publish_written(inst, plan, request_id)
        self._blend.record_store(tx.indexing)
        return plan.covered * self.chunk_size

    def _prepare_index(self, tx: Transfer, hashes: Sequence[bytes]) -> None:
        """Start indexing the chunks a store holds (`hashes`: chunks 0..) for blend lookups,
        before it waits for its copies; a store by chunk keys has no tokens to find them by.
        The store records them (`Blender.record_store`) once it succeeded."""
        if tx.ids.hashes is None:
            tokens = tx.ids.tokens[: len(hashes) * self.chunk_size]
            tx.indexing = self._blend.prepare_store(tx.inst, tokens, hashes, tx.cache_salt)

    def _plan(self, tx: Transfer, keys: Sequence[ObjectKey]) -> WritePlan:
        """Reserve L1 objects for the keys L1 lacks (the transfer's plan, aborted on failure);
        CapacityError when not even the first missing chunk fits and no L2 tier is there."""
        nbytes = tx.inst.chunk_nbytes
        plan = tx.plan = tx.untold = self.l1.prepare_write(keys, nbytes)
        self._check_room(plan, keys, nbytes)
        return plan

    def _check_room(self, plan: WritePlan, keys: Sequence[ObjectKey], nbytes: int) -> None:
        """CapacityError for a plan that found room for none of its (first) keys, without L2."""
        if keys and not plan.covered and self._tiering is None:
            raise CapacityError(
                f"L1 is full of objects being read; no room for a chunk of {nbytes} bytes"
            )

    def _store_waves(self, tx: Transfer) -> WritePlan:
        """The L1 part of a store: its chunks planned in L1 and their copies enqueued in
        waves (`run_waves`), each wave converting and hashing its chunks, extending the
        plan over them and enqueueing its new objects' copies. The plan stops at the first
        chunk L1 had no room for."""
        inst, ids = tx.inst, tx.ids
        plan = self._plan(tx, [])
        queued = 0

        def wave(first: int, stop: int) -> bool:
            nonlocal queued
            ids.convert(stop)
            keys = self._chunk_keys(tx, first, stop)
            self.l1.extend_write(plan, [*plan.keys, *keys], inst.chunk_nbytes)
            self._check_room(plan, keys, inst.chunk_nbytes)
            self._enqueue_store(tx, plan.new[queued:])
            queued = len(plan.new)
            return plan.covered == stop

        run_waves(ids.n_chunks, inst.mover.head_chunks, wave)
        return plan

    def _enqueue_store(self, tx: Transfer, new: Sequence[tuple[int, Any]]) -> None:
        """Enqueue the copies of planned (chunk index, L1 object) pairs into L1."""
        if new:
            rows = [i for i, _ in new]
            tx.inst.mover.store(rows_of(tx.ids.table, rows), self.l1.views([o for _, o in new]))

    def _end_store(
        self, tx: Transfer, plan: WritePlan,
        enqueued: Callable[[Any, int], None] | None = None, **extra: Any,
    ) -> None:  # fmt: skip
        """A store's end once its copies are queued: its evictions and END published and its
        blend indexing begun while they run, `enqueued` told (the server answers; L1 then
        commits the plan at the first read after the copies), then the wait for them, then
        the plan committed (visible at once)."""
        mover = tx.inst.mover
        result = {**self._store_result(tx.inst, plan), **extra}
        self._tell_evictions(tx)
        tx.op.end(mover.store_stream, **result)
        self._prepare_index(tx, result["chunk_hashes"])
        if enqueued is not None and mover.store_stream is not None:
            self.l1.commit_when_done(plan, mover.queued_done())
            enqueued(mover.store_stream, plan.covered * self.chunk_size)
        mover.wait()
        self.l1.commit(plan)
        tx.plan = None

    def _store_result(self, inst: Instance, plan: WritePlan) -> dict[str, Any]:
        """The STORE_END attrs of a store whose chunks all went to L1 in one plan."""
        return {
            "tokens": len(plan.new) * self.chunk_size,
            "bytes": len(plan.new) * inst.chunk_nbytes,
            # the chunks now in L1 and their object size, for kvflow whatif
            "chunk_hashes": list(map(_HASH_OF, plan.keys[: plan.covered])),
            "chunk_bytes": inst.chunk_nbytes,
            "held_tokens": plan.covered * self.chunk_size,
            "tokens_by_tier": {"l1": plan.covered * self.chunk_size},
        }

    def _publish_written(self, inst: Instance, plan: WritePlan, request_id: str) -> None:
        """A committed plan's new chunks: L1_WRITE, then their write-through to L2."""
        if plan.new:
            new_keys = [cast(ObjectKey, plan.keys[i]) for i, _ in plan.new]
            self._publish(
                EventType.L1_WRITE,
                request_id,
                {
                    "chunks": len(plan.new),
                    "bytes": len(plan.new) * inst.chunk_nbytes,
                    "keys": new_keys,
                },
            )
            if self._tiering is not None:  # in the background: the reply never waits for L2
                self._tiering.writes.submit(new_keys, inst.chunk_nbytes, request_id)

    def _store_layers(self, tx: Transfer, written: WrittenSignal) -> WritePlan | None:
        """A store that copies each layer once the engine wrote it (docs/ENGINE.md,
        "Layerwise stores"): the chunks are planned in L1 first, while the forward pass
        runs, then each layer is gathered into their objects as it comes; they become
        visible together once the last layer landed. Returns the committed plan. A request
        L1 cannot hold at once (it would stream through L1 to L2) waits for every layer and
        returns None: the caller stores it the ordinary way."""
        inst, ids, mover = tx.inst, tx.ids, tx.inst.mover
        ids.convert(ids.n_chunks)
        plan = self._plan(tx, self._chunk_keys(tx, 0, ids.n_chunks))
        stream = mover.kernel_stream if isinstance(mover, CudaMover) else None
        if self._tiering is not None and plan.covered < ids.n_chunks:
            self.l1.abort(plan)
            tx.plan = None
            self._tell_evictions(tx)
            for layer in range(inst.layout.num_layers):
                written.wait_written(layer, stream)
            return None
        table = rows_of(ids.table, [i for i, _ in plan.new])
        dsts = self.l1.views([o for _, o in plan.new])
        if isinstance(mover, CudaMover):
            mover.store_layers(table, dsts, self.chunk_size, written.wait_written)
        else:
            cpu_gather_layers(inst.layout, self.chunk_size, table, dsts, written)
        self._end_store(tx, plan, None, layerwise=True)
        return plan

    def _stream_store(self, tx: Transfer, plan: WritePlan) -> int:
        """The L2 part of a store larger than (free) L1: the chunks `plan` covers are
        committed and written through, then the rest goes through L1 in windows of
        STREAM_SHARE of it (`_store_window`), each written through to L2 so that its room
        is reused once L2 has it. Stops when no room comes within the bound or L2 writes
        were dropped (their chunks live in L1 only, and a later window would evict them).
        Publishes END (what each tier holds, `_held`); returns the tokens held."""
        assert self._tiering is not None
        inst, n_chunks = tx.inst, tx.ids.n_chunks
        inst.mover.flush()
        inst.mover.wait()
        self.l1.commit(plan)
        tx.plan = None
        self._tell_evictions(tx)
        receipt = WriteReceipt([t.name for t in self._tiering.tiers])
        done = cast(list[ObjectKey], list(plan.keys[: plan.covered]))
        new = len(plan.new)
        # waits for L2 (backlog room, L1 room its writes hold) go without the instance's
        # lock: the mover is idle between windows
        with self._unlocked(inst):
            dropped = self._write_through(inst, plan, 0, tx.request_id, receipt)
        window = self._stream_chunks(inst.chunk_nbytes)
        head = done[:window]  # kept the most recently used: the streamed middle goes first
        while not dropped and len(done) < n_chunks:
            first = len(done)
            wplan = self._store_window(tx, first, min(n_chunks, first + window), head)
            if wplan is None:
                break
            done.extend(cast(list[ObjectKey], wplan.keys[: wplan.covered]))
            new += len(wplan.new)
            head = head or done[:window]
            with self._unlocked(inst):
                dropped = self._write_through(inst, wplan, first, tx.request_id, receipt)
        self._tiering.count_streamed("stores", len(done))
        result = self._held(inst, done, new, receipt)
        tx.op.end(None, **result)
        self._prepare_index(tx, result["chunk_hashes"])
        return int(result["held_tokens"])

    def _store_window(
        self, tx: Transfer, first: int, stop: int, head: list[ObjectKey]
    ) -> WritePlan | None:
        """One window of a streaming store: chunks [first, stop) planned in L1 (waiting for
        room without the lock), copied and committed; None when no room came in time."""
        inst = tx.inst
        tx.ids.convert(stop)
        keys = self._chunk_keys(tx, first, stop)
        # refresh the head just before the window's room is made: the write-through's
        # pins have made the chunks it took newer than a head L1 held before this store
        self.l1.release(self.l1.pin_prefix(head))
        with self._unlocked(inst):
            plan = tx.plan = self._window_plan(keys, inst.chunk_nbytes, tx.request_id)
        if not plan.covered:
            tx.plan = None  # it reserved nothing
            return None
        self._enqueue_store(tx, [(first + i, o) for i, o in plan.new])
        inst.mover.flush()
        inst.mover.wait()
        self.l1.commit(plan)
        tx.plan = None
        return plan

    def _window_plan(self, keys: Sequence[ObjectKey], nbytes: int, request_id: str) -> WritePlan:
        """Reserve L1 room for a window's keys; while L1 has none (its objects pinned by
        writes to L2, or by reads), wait for the writes, at most --l2-backlog-wait-s.
        The plan covers nothing when the wait ran out."""
        assert self._tiering is not None
        writes = self._tiering.writes
        deadline = time.monotonic() + writes.wait_s
        while True:
            plan = self.l1.prepare_write(keys, nbytes)
            self._publish_evictions(plan, request_id)
            if plan.covered or not writes.wait_progress(deadline):
                return plan

    def _write_through(
        self, inst: Instance, plan: WritePlan, first: int, request_id: str, receipt: WriteReceipt
    ) -> int:
        """A streaming store's committed window (chunks from `first`): L1_WRITE, then its
        write-through, waiting for backlog room within the bound; returns chunks dropped."""
        if not plan.new:
            return 0
        assert self._tiering is not None
        new_keys = [cast(ObjectKey, plan.keys[i]) for i, _ in plan.new]
        attrs = {
            "chunks": len(new_keys), "bytes": len(new_keys) * inst.chunk_nbytes,
            "keys": new_keys, "first_chunk": first,
        }  # fmt: skip
        self._publish(EventType.L1_WRITE, request_id, attrs)
        return self._tiering.writes.submit(new_keys, inst.chunk_nbytes, request_id, receipt)

    def _held(
        self, inst: Instance, keys: list[ObjectKey], new: int, receipt: WriteReceipt
    ) -> dict[str, Any]:
        """A streamed store's END attrs: the chunks held from chunk 0 (in L1, confirmed by an
        L2 tier, or with a write to L2 under way) and what each tier holds of them."""
        assert self._tiering is not None
        confirmed, pending = self._tiering.writes.holding(receipt)
        in_l1 = self.l1.contains(keys).result()
        unknown = [
            k for k, hit in zip(keys, in_l1, strict=True)
            if not hit and k not in pending and not any(k in c for c in confirmed.values())
        ]  # fmt: skip
        if unknown:  # held before this store (not written by it): ask the tiers
            where = self._tiering.loader.residency(unknown)
            for k in unknown:
                if where[k] not in (None, "l1"):
                    confirmed[cast(str, where[k])].add(k)
        held = 0
        for k, hit in zip(keys, in_l1, strict=True):
            if not (hit or k in pending or any(k in c for c in confirmed.values())):
                break
            held += 1
        cs = self.chunk_size
        by_tier = {"l1": sum(in_l1[:held]) * cs}
        for name, got in confirmed.items():
            by_tier[name] = sum(1 for k in keys[:held] if k in got) * cs
        return {
            "tokens": new * cs,
            "bytes": new * inst.chunk_nbytes,
            "chunk_hashes": [k[0] for k in keys[:held]],
            "chunk_bytes": inst.chunk_nbytes,
            "held_tokens": held * cs,
            "tokens_by_tier": by_tier,
            "l2_pending_tokens": sum(1 for k in keys[:held] if k in pending) * cs,
            "l2_dropped_chunks": receipt.dropped,
            "streamed": True,
        }

    # -- retrieve ----------------------------------------------------------------------------

    def retrieve(
        self,
        instance_id: str,
        token_ids: Any,
        block_ids: Any,
        *,
        request_id: str,
        skip_first_n_tokens: int = 0,
        cache_salt: str | None = None,
        enqueued: Callable[[Any, int], None] | None = None,
        chunk_keys: Sequence[bytes] | None = None,
        layers: LayerSignal | None = None,
        staging: Staging | None = None,
    ) -> int:
        """Copy the consecutive L1 hits from chunk 0 into the request's blocks.

        Returns the hit prefix in tokens (the tokens now valid in the blocks from
        token 0); the first `skip_first_n_tokens` (whole blocks) are not written.
        `enqueued(stream, hit_tokens)`, for a CUDA cache, is called once every copy is
        queued on `stream` (a TransferStream), before the engine waits for them: the
        server replies then, with an event recorded on that stream. With `layers`
        the copies go layer by layer, each layer signalled there (`_retrieve_layers`),
        and with `staging` too a layer that fits one of its slots is staged there for the
        engine to scatter itself.
        """
        token_ids, named = keyed(token_ids, chunk_keys, self.chunk_size)
        inst = self._instance(instance_id)
        failed = {"tokens": 0, "bytes": 0, "hit_tokens": 0}
        with self._transfer(inst, EventType.RETRIEVE_START, request_id, token_ids, **failed) as tx:
            skip = check_skip(skip_first_n_tokens, inst.block_size, inst.instance_id)
            self._begin(tx, token_ids, block_ids, cache_salt, named)
            skip_blocks = skip // inst.block_size
            result = None
            if layers is not None:
                result = self._retrieve_layers(tx, skip_blocks, layers, enqueued, staging)
            if result is None:  # not layerwise, or too much of it in L2 for that
                copied = self._retrieve_l1(tx, skip_blocks)
                self._retrieve_l2(tx, skip_blocks, copied)
                result = self._end_retrieve(tx, copied, layers, enqueued)
        self._publish_read(result, request_id)
        return int(result["hit_tokens"])

    def _retrieve_l1(self, tx: Transfer, skip_blocks: int) -> Copied:
        """The L1 part of a retrieve: its hit prefix pinned and its copies enqueued in waves
        (`run_waves`), so the first chunks' copies start before the rest of the request is
        hashed and looked up. The prefix ends at the first chunk L1 misses (a chunk evicted
        while earlier waves were enqueued ends it there)."""
        copied = Copied()
        pinned = tx.pinned

        def wave(first: int, stop: int) -> bool:
            pinned.extend(self.l1.pin_prefix(self._chunk_keys(tx, first, stop)))
            self._scatter(tx, pinned, first, skip_blocks, copied)
            return len(pinned) == stop

        run_waves(tx.ids.n_chunks, tx.inst.mover.head_chunks, wave)
        copied.hashes = [o.key[0] for o in pinned]
        return copied

    def _retrieve_l2(self, tx: Transfer, skip_blocks: int, copied: Copied) -> None:
        """The L2 part of a retrieve: the chunks after L1's hit prefix, loaded from a tier
        (or waited for, when a prefetch is bringing them) without the lock once the L1
        part's copies landed, then copied. A part larger than half of L1 streams through
        it window by window instead (`_stream_retrieve`)."""
        tiering, inst = self._tiering, tx.inst
        first, n_chunks = len(copied.hashes), tx.ids.n_chunks
        if tiering is None or first == n_chunks:
            return
        keys = self._chunk_keys(tx, first, n_chunks)
        inst.mover.flush()
        inst.mover.wait()  # the L1 part landed: the mover is idle while this waits on L2
        if len(keys) > 2 * self._stream_chunks(inst.chunk_nbytes):
            self._release_hits(tx)  # the L1 part's pins go: the prefix need not fit at once
            self._stream_retrieve(tx, keys, skip_blocks, copied)
            return
        with self._unlocked(inst):
            fetched = tx.hold(tiering.fetch(keys, inst.chunk_nbytes, tx.request_id))
        self._scatter(tx, fetched.objs, first, skip_blocks, copied, base=True)
        copied.hashes.extend(k[0] for k in keys[: len(fetched.objs)])
        copied.from_l2 = fetched.from_l2

    def _stream_retrieve(
        self, tx: Transfer, keys: list[ObjectKey], skip_blocks: int, copied: Copied
    ) -> None:
        """Load `keys` (the chunks after `copied`'s) from L2 into L1 a window (STREAM_SHARE
        of L1) at a time and copy each to the blocks, the next window's loads running
        meanwhile; each window's L1 objects are released once copied, so the prefix never
        needs to fit in L1 at once. A window that lands short is retried from its first
        missing chunk (L1 may have lacked room while the previous window was held); the
        prefix ends where a retry lands nothing."""
        tiering = self._tiering
        assert tiering is not None
        inst, request_id = tx.inst, tx.request_id
        nbytes, window = inst.chunk_nbytes, self._stream_chunks(inst.chunk_nbytes)
        first, pos = len(copied.hashes), 0
        span = keys[:window]
        job = tiering.start_fetch(span, nbytes, request_id)
        while True:
            with self._unlocked(inst):  # the mover is idle: the last window's copies landed
                fetched = tx.hold(tiering.finish_fetch(job, span))
            n = len(fetched.objs)
            short = n < len(span)
            span = keys[pos + n : pos + n + window]
            if span and not short:  # the next window loads while this one is copied
                job = tiering.start_fetch(span, nbytes, request_id)
            self._scatter(tx, fetched.objs, first + pos, skip_blocks, copied, base=True)
            inst.mover.flush()
            inst.mover.wait()
            self._release_hits(tx)
            pos, copied.from_l2 = pos + n, copied.from_l2 + fetched.from_l2
            if not span or not n:
                break
            if short:  # once more from the first chunk missing
                job = tiering.start_fetch(span, nbytes, request_id)
        copied.hashes.extend(k[0] for k in keys[:pos])
        tiering.count_streamed("retrieves", pos)

    def _scatter(
        self, tx: Transfer, objs: Sequence[Any], first: int, skip_blocks: int, copied: Copied,
        *, base: bool = False,
    ) -> None:  # fmt: skip
        """Enqueue the copies of hit chunks from `first` on that are not wholly skipped,
        adding them to `copied`: objs[c] is chunk c, or with `base` chunk first + c.

        The block ids are converted and checked, all of them, when the mover first asks
        for them: after its first host copies are queued, before it writes any block.
        """
        inst, ids = tx.inst, tx.ids
        bpc = inst.blocks_per_chunk
        shift = first if base else 0
        rows, skips = written_chunks(first, len(objs) + shift, skip_blocks, bpc)

        def block_rows() -> np.ndarray:
            ids.check_distinct(skip_blocks)  # converts and checks every block id
            return rows_of(ids.table, rows)

        if rows:
            inst.mover.retrieve(self.l1.views([objs[c - shift] for c in rows]), block_rows, skips)
        copied.add(len(rows), written_tokens(skips, bpc, inst.block_size))

    def _end_retrieve(
        self, tx: Transfer, copied: Copied, layers: LayerSignal | None,
        enqueued: Callable[[Any, int], None] | None,
    ) -> dict[str, Any]:  # fmt: skip
        """A retrieve's end once its copies are queued: the block ids checked (even when
        nothing was copied), END, every layer signalled (a layerwise retrieve too large to
        go layer by layer), `enqueued` told (the server replies), the wait for the copies.
        Returns the END attrs."""
        inst, mover = tx.inst, tx.inst.mover
        tx.ids.convert_blocks(tx.ids.n_chunks)
        mover.flush()
        result = copied.attrs(self.chunk_size, inst.chunk_nbytes)
        tx.op.end(mover.retrieve_stream, **result)
        if layers is not None:
            for i in range(inst.layout.num_layers):
                layers.ready(i, mover.retrieve_stream)
        if enqueued is not None and mover.retrieve_stream is not None:
            enqueued(mover.retrieve_stream, int(result["hit_tokens"]))
        mover.wait()
        return result

    def _retrieve_layers(
        self, tx: Transfer, skip_blocks: int, signal: LayerSignal,
        enqueued: Callable[[Any, int], None] | None, staging: Staging | None,
    ) -> dict[str, Any] | None:  # fmt: skip
        """A retrieve that copies layer by layer and signals each layer (docs/ENGINE.md,
        "Layerwise retrieves"). The whole hit must be held at once (layer 0 of the last
        chunk is copied before layer 1 of the first), so the hit is pinned in L1 (L2 hits
        loaded first) and `enqueued` (the server's reply) is called once the block ids are
        checked: on CUDA right after layer 0's copies are queued (the engine needs the
        reply no sooner than layer 0), on CPU before the first layer is copied. Each
        layer's signal tells when it may be read; a failure signals the layers not
        signalled yet as failed. A hit that
        would take more than a streaming window of L1 from L2 goes the ordinary way (None:
        the caller does it, signalling every layer at its end)."""
        inst, ids, tiering, mover = tx.inst, tx.ids, self._tiering, tx.inst.mover
        keys = self._chunk_keys(tx, 0, ids.n_chunks)
        hits = self.l1.pin_prefix(keys)
        tx.pinned.extend(hits)
        first = len(hits)
        too_big = ids.n_chunks - first > 2 * self._stream_chunks(inst.chunk_nbytes)
        if tiering is not None and too_big:
            self._release_hits(tx)
            return None
        on_cuda = isinstance(mover, CudaMover)
        hit_tokens = 0

        def reply() -> None:  # the server's reply, once layer 0 is queued on CUDA
            if enqueued is not None:
                enqueued(mover.retrieve_stream, hit_tokens)

        progress = LayerProgress(signal, after_first=reply if on_cuda else None)
        tx.on_failure.append(progress.failed)
        copied = Copied()
        if tiering is not None and first < ids.n_chunks:
            with self._unlocked(inst):  # nothing queued yet
                fetched = tx.hold(tiering.fetch(keys[first:], inst.chunk_nbytes, tx.request_id))
            hits, copied.from_l2 = [*hits, *fetched.objs], fetched.from_l2
        rows, skips = written_chunks(0, len(hits), skip_blocks, inst.blocks_per_chunk)
        ids.check_distinct(skip_blocks)  # converts and checks every block id
        srcs = self.l1.views([hits[c] for c in rows])
        table = rows_of(ids.table, rows)
        copied.hashes = [k[0] for k in keys[: len(hits)]]
        copied.add(len(rows), written_tokens(skips, inst.blocks_per_chunk, inst.block_size))
        result = {**copied.attrs(self.chunk_size, inst.chunk_nbytes), "layerwise": True}
        hit_tokens = len(hits) * self.chunk_size
        if on_cuda:  # the ids are checked: layer 0's copies queued first, then the reply,
            # which the engine needs no sooner than layer 0 itself
            assert isinstance(mover, CudaMover)
            mover.retrieve_layers(srcs, table, skips, self.chunk_size, progress.ready, staging)
            progress.finish()
            tx.op.end(mover.retrieve_stream, **result)
            mover.wait()
        else:  # the copies run here, on this thread: reply before them
            reply()
            cpu_scatter_layers(
                inst.layout, self.chunk_size, srcs, table, skips, progress.ready, staging
            )
            tx.op.end(None, **result)
        return result

    # -- blend (docs/BLEND.md) ---------------------------------------------------------------

    def blend_lookup(
        self,
        token_ids: Any,
        *,
        model_name: str,
        world_size: int = 1,
        cache_salt: str | None = None,
        request_id: str | None = None,
        prefetch: bool = True,
        ranks: Sequence[int] | None = None,
    ) -> BlendHit:
        """The prefix hit as `lookup` gives it (its LOOKUP pair), plus the stored chunks
        found anywhere past it, at any token offset (one BLEND_LOOKUP pair): those every
        rank (of `ranks`, default all) holds in some tier, none overlapping; L2-held ones
        start loading into L1."""
        return self._blend.lookup(
            token_ids, model_name=model_name, world_size=world_size, cache_salt=cache_salt,
            request_id=request_id, prefetch=prefetch, ranks=ranks,
        )  # fmt: skip

    def blend_retrieve(
        self,
        instance_id: str,
        token_ids: Any,
        block_ids: Any,
        segments: Any,
        *,
        request_id: str,
        cache_salt: str | None = None,
    ) -> BlendRetrieved:
        """Copy blend segments (from `blend_lookup`: (offset, chunk_hash, original_start)
        each) into the prompt's blocks at their offsets, K turned by offset -
        original_start with the instance's registered ropes; returns the tokens blended
        and the offsets of the segments skipped.

        `block_ids` cover the prompt from token 0, as for `retrieve` (which copies the
        prefix). A segment may start inside a block. One no tier holds any more, or that
        the blend index forgot, is skipped (its tokens are to be recomputed); a segment
        whose prompt tokens are not its chunk's is refused before anything is written."""
        inst = self._instance(instance_id)
        failed = {"tokens": 0, "bytes": 0, "blended_tokens": 0}
        start = EventType.BLEND_RETRIEVE_START
        with self._transfer(inst, start, request_id, token_ids, **failed) as tx:
            check_str("request_id", request_id)
            tx.cache_salt = check_salt(cache_salt)
            segments, forgotten, blocks = self._blend.plan_retrieve(
                inst, token_ids, block_ids, segments, tx.cache_salt
            )
            held, objs, from_l2 = self._blend_objects(tx, segments)
            copy_segments(inst, held, objs, blocks, self.chunk_size)
            blended = sum(s.length for s in held)
            gone = [s.offset for s in segments if s not in held]
            result = {
                "tokens": blended, "bytes": len(held) * inst.chunk_nbytes,
                "blended_tokens": blended, "segments": len(held), "l2_chunks": from_l2,
            }  # fmt: skip
            tx.op.end(**result)
        self._publish_read({"chunks": len(held), "bytes": result["bytes"]}, request_id)
        return BlendRetrieved(blended, tuple(sorted(forgotten + gone)))

    def _blend_objects(
        self, tx: Transfer, segments: Sequence[Any]
    ) -> tuple[list[Any], list[Any], int]:
        """(the segments whose objects are readable, their bytes, how many came from L2):
        each pinned in L1, or fetched from L2 without the instance's lock."""
        inst = tx.inst
        held, objs, from_l2 = [], [], 0
        for s in segments:
            key = ObjectKey(
                s.chunk_hash, inst.model_name, inst.world_size, inst.rank, tx.cache_salt
            )
            got = self.l1.pin_prefix([key])
            tx.pinned.extend(got)
            if not got and self._tiering is not None:
                with self._unlocked(inst):
                    fetched = self._tiering.fetch([key], inst.chunk_nbytes, tx.request_id)
                tx.pinned.extend(fetched.pinned)
                tx.staged.extend(fetched.staged)
                got, from_l2 = fetched.objs, from_l2 + fetched.from_l2
            if got:
                held.append(s)
                objs.append(self.l1.views(got[:1])[0])
        return held, objs, from_l2

    def _publish_read(self, result: dict[str, Any], request_id: str) -> None:
        """L1_READ for a retrieve's copied chunks (none: no event)."""
        if result["chunks"]:
            self._publish(
                EventType.L1_READ,
                request_id,
                {"chunks": result["chunks"], "bytes": result["bytes"]},
            )

    # -- sessions and allocations ------------------------------------------------------------

    def report_layer_waits(self, instance_id: str, request_id: str, waits_s: Any) -> None:
        """Publish an engine's per-layer waits of a layerwise retrieve (LAYER_WAIT):
        at most one per layer, each a finite number of seconds >= 0."""
        inst = self._instance(instance_id)
        check_str("request_id", request_id)
        waits = check_waits(waits_s, inst.layout.num_layers)
        self._publish(
            EventType.LAYER_WAIT,
            request_id,
            {
                "instance_id": inst.instance_id,
                "model_name": inst.model_name,
                "waits_s": waits,
                "layers": len(waits),
                "stalled_layers": sum(w > STALL_S for w in waits),
                "total_s": sum(waits),
            },
        )

    def end_session(self, request_id: str) -> None:
        """The request finished: drop its key chain and publish END_SESSION."""
        check_str("request_id", request_id)
        self._check_open()
        self._keys.drop(request_id)
        self._publish(EventType.END_SESSION, request_id, {})

    def report_block_allocations(
        self, instance_id: str, records: Sequence[BlockAllocation]
    ) -> None:
        """Publish the engine's new block allocations (BLOCK_ALLOCATION, docs/EVENTS.md).

        Every record is checked before anything is published: block ids must exist in
        the instance's cache (0 <= id < num_blocks) and the tokens must fit in the
        record's blocks; the first bad record is an InvalidRequestError naming it.
        """
        inst = self._instance(instance_id)
        checked = check_allocations(records, inst.layout.num_blocks, inst.block_size)
        attrs = {
            "instance_id": inst.instance_id,
            "model_name": inst.model_name,
            "block_size": inst.block_size,
            "records": checked,
        }
        self._publish(EventType.BLOCK_ALLOCATION, None, attrs)

    # -- introspection and shutdown ------------------------------------------------------------

    @property
    def l2_tier_names(self) -> list[str]:
        """The L2 tiers behind L1, in order (empty: L1 only)."""
        return [t.name for t in self._tiering.tiers] if self._tiering is not None else []

    @property
    def l2_tiers(self) -> list[StorageTier]:
        """The L2 tiers behind L1, in order (for admin operations: clear, probes)."""
        return list(self._tiering.tiers) if self._tiering is not None else []

    def pending_l2_writes(self) -> int:
        """Write-through calls still waiting on L2 (0 without L2): a drain waits for them."""
        return self._tiering.writes.pending()["calls"] if self._tiering is not None else 0

    def tenant_stats(self) -> list[dict[str, Any]]:
        """Per-tenant L1 usage, limits, evictions and lookup hits (kvflow.tenant.*)."""
        l1 = self.l1
        return l1.tenant_stats() if isinstance(l1, L1Cache) else self.tenants.snapshot()

    def l1_stats(self) -> dict[str, int]:
        """L1 usage, capacity, objects and evictions (what the L1 gauges read)."""
        return self.l1.stats()

    def status(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot: instances, L1, bus accounting, config, and the
        activity totals (operations, bytes, hits, evictions, L0 histograms; see activity.py)."""
        with self._lock:
            instances = {i: inst.describe() for i, inst in self._instances.items()}
            closed = self._closed
        return {
            "closed": closed,
            "chunk_size": self.chunk_size,
            "instances": instances,
            "l1": self.l1.stats(),
            "l1_pinning": self.l1.pin_state(),
            "l2": self._tiering.describe() if self._tiering is not None else None,
            "bus": bus_status(self.bus),
            "config": self.config.public_dict(),
            "activity": self._obs.activity_status(),
        }

    def close(self, timeout: float = 5.0) -> bool:
        """Unregister everything, stop the bus and flush exporters (idempotent).

        Returns True when the event pipeline shut down cleanly.
        """
        with self._lock:
            if self._closed:
                return self._obs.clean
            self._closed = True
            instances = list(self._instances.values())
            self._instances.clear()
        for inst in instances:
            with inst.lock:
                inst.mover.close()
        self._blend.close()
        if self._tiering is not None:  # pending L2 writes read L1: finish them first
            self._tiering.close(timeout)
        ok = self._obs.close(timeout)
        self.l1.close()
        return ok

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
