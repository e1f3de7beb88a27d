"""The in-process cache engine (docs/ENGINE.md): registration, keys, L1, transfers, events.

Thread-safe: lookup/status may run while stores and retrieves of different
instances run on other threads; one instance's transfers are serialised by its
lock, which an op gives up while it waits on an L2 tier (`_unlocked`). Every
operation is observed through START/END event pairs on the bus.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, cast

import numpy as np
import torch

from kvflow.core.arrays import as_int32_array
from kvflow.core.config import ServerConfig
from kvflow.core.engine.chunk_keys import check_chunk_keys, placeholder_tokens
from kvflow.core.engine.instances import Instance, LayoutDesc, ModelRank
from kvflow.core.engine.keys import KeyCache
from kvflow.core.engine.layerwise import (
    LayerSignal,
    WrittenSignal,
    cpu_gather_layers,
    cpu_scatter_layers,
)
from kvflow.core.engine.loads import Slot
from kvflow.core.engine.movers import CpuMover, CudaMover, Mover
from kvflow.core.engine.observability import Observability
from kvflow.core.engine.ops import Op
from kvflow.core.engine.request import RequestIds
from kvflow.core.engine.tiering import Tiering
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
from kvflow.core.tiers.l1 import L1Cache
from kvflow.core.tiers.quota import TenantQuotas, parse_quotas
from kvflow.events import BlockAllocation, Event, EventBus, EventType
from kvflow.kernels import KVLayout, cuda_available

GIB = 1 << 30
#: Largest world_size a register, lookup or prefetch may name (rank < world_size).
MAX_WORLD_SIZE = 1024
#: Most tokens one lookup or prefetch may carry: checked before any hashing.
MAX_REQUEST_TOKENS = 1 << 22
#: Share of L1 one window of a store or retrieve streaming through L1 takes (a request
#: larger than L1 with an L2 tier): with the write-through backlog (BACKLOG_SHARE) and a
#: retrieve's next window in flight, the streaming request never needs all of L1.
STREAM_SHARE = 0.25
#: A layer wait longer than this counts as a stall (shorter ones are the cost of looking:
#: a flag read, or two GPU timing events around a wait that did not wait).
STALL_S = 50e-6


def _check_str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _check_salt(cache_salt: Any) -> str | None:
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidRequestError(f"cache_salt must be a string or None, got {cache_salt!r}")
    return cache_salt


def _rows_of(table: np.ndarray, rows: list[int]) -> np.ndarray:
    """table[rows] for ascending rows: a view when they are one contiguous run."""
    if rows and rows[-1] - rows[0] == len(rows) - 1:
        return table[rows[0] : rows[-1] + 1]
    return table[np.asarray(rows, dtype=np.intp)]


def _written_chunks(
    first: int, stop: int, skip_blocks: int, blocks_per_chunk: int
) -> tuple[list[int], list[int]]:
    """Of chunks [first, stop), those a retrieve writes (not wholly within the skipped
    blocks), and how many leading blocks of each it leaves alone."""
    rows: list[int] = []
    skips: list[int] = []
    for c in range(first, stop):
        s = min(max(skip_blocks - c * blocks_per_chunk, 0), blocks_per_chunk)
        if s < blocks_per_chunk:
            rows.append(c)
            skips.append(s)
    return rows, skips


def _requested_tokens(token_ids: Any) -> int:
    """The request's token count for START events (0 when it has no length: refused later)."""
    return len(token_ids) if hasattr(token_ids, "__len__") else 0


#: an ObjectKey's chunk hash, for the chunk_hashes attr (a C call per key, no Python frame)
_HASH_OF: Callable[[Any], bytes] = itemgetter(0)


def _transfer_attrs(inst: Instance, token_ids: Any) -> dict[str, Any]:
    """A store's or retrieve's START attrs."""
    return {
        "instance_id": inst.instance_id,
        "model_name": inst.model_name,
        "tokens": _requested_tokens(token_ids),
    }


def _desc_nbytes(desc: LayoutDesc) -> int:
    """Bytes of one chunk object laid out as `desc` (its layer groups back to back)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in desc)


def _gpu_count() -> int:
    """GPUs the disk tier's by_gpu sharding spreads over (a GPU-less host counts one)."""
    return max(1, torch.cuda.device_count()) if cuda_available() else 1


def _build_l2(config: ServerConfig) -> list[StorageTier]:
    """The L2 tiers the config names, in order: disk, then Redis (none: L1 only).

    The modules are imported only when configured; a tier that fails to start closes
    the ones built before it (a disk tier holds its directories' locks).
    """
    tiers: list[StorageTier] = []
    try:
        if config.l2_disk_paths:
            from kvflow.core.tiers.disk import DiskTier

            tiers.append(
                DiskTier(
                    config.l2_disk_paths,
                    int(config.l2_disk_size_gb * GIB),
                    num_gpus=_gpu_count(),
                    direct_io=config.l2_disk_direct_io,
                )
            )
        if config.l2_redis_url is not None:
            from kvflow.core.tiers.redis import RedisTier
            from kvflow.core.tiers.redis_target import resolve_target

            target = resolve_target(
                config.l2_redis_url,
                username=config.l2_redis_username,
                password=config.l2_redis_password,
            )
            tiers.append(
                RedisTier(
                    target,
                    cluster=config.l2_redis_cluster,
                    key_prefix=config.l2_redis_key_prefix,
                    timeout_s=config.l2_redis_timeout_s,
                    pool_size=config.l2_redis_pool_size,
                )
            )
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def _check_world(world_size: Any, rank: Any = 0) -> None:
    if (
        isinstance(world_size, bool)
        or not isinstance(world_size, int)
        or not 1 <= world_size <= MAX_WORLD_SIZE
    ):
        raise InvalidRequestError(
            f"world_size must be an integer in [1, {MAX_WORLD_SIZE}] (MAX_WORLD_SIZE), "
            f"got {world_size!r}"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidRequestError(f"rank must be an integer in [0, {world_size}), got {rank!r}")


def _check_tokens(token_ids: Any) -> None:
    """A lookup's or prefetch's token count against MAX_REQUEST_TOKENS, before any work."""
    n = _requested_tokens(token_ids)
    if n > MAX_REQUEST_TOKENS:
        raise InvalidRequestError(
            f"token_ids holds {n} tokens, more than the {MAX_REQUEST_TOKENS} "
            "(MAX_REQUEST_TOKENS) a request may carry"
        )


def _rank_groups(world_size: int) -> Iterator[range]:
    """Ranks in groups of doubling size: [0], [1], [2, 3], [4..7], ...

    A prefix is narrowed group by group, so ranks that hold nothing cost at most
    about as much as the ranks before them that do, whatever the world_size.
    """
    start = 0
    while start < world_size:
        stop = min(world_size, max(start + 1, 2 * start))
        yield range(start, stop)
        start = stop


def _check_ids(values: Any, what: str, limit: int | None = None) -> int:
    """len(values) after checking they are integers (in [0, limit) when given)."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        raise InvalidRequestError(f"{what} must be a flat sequence of integers") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidRequestError(f"{what} must be a flat sequence of integers")
    if limit is not None and arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= limit:
            raise InvalidRequestError(
                f"{what} holds block id {lo if lo < 0 else hi}, which does not exist: the "
                f"instance's cache has {limit} blocks (valid ids 0..{limit - 1})"
            )
    return int(arr.size)


class CacheEngine:
    """Registration, keys, L1 and transfers behind the public methods (docs/ARCHITECTURE.md).

    Builds its event bus and subscribers from `config.observability` unless `bus`
    is given; a given bus is used as is (the caller starts and stops it). L2 tiers
    come from the config (`l2_disk_paths`) unless `l2_tiers` are given (the engine
    closes them either way).
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
        pin_threads = self.config.l1_pin_threads
        self.l1: HostTier = L1Cache(
            int(self.config.l1_size_gb * GIB),
            tenants=self.tenants,
            pin_ahead=None if pin_threads else False,  # pin ahead wherever memory is pinned
            pin_threads=max(1, pin_threads),
        )
        self._keys = KeyCache(self.chunk_size)
        self._lock = threading.Lock()
        self._instances: dict[str, Instance] = {}
        self._layouts: dict[ModelRank, LayoutDesc] = {}
        self._closed = False
        tiers = list(l2_tiers) if l2_tiers is not None else _build_l2(self.config)
        self._obs = Observability(
            self.config.observability,
            bus,
            l1_stats=self.l1_stats,
            tier_stats=(lambda: {t.name: t.stats() for t in tiers}) if tiers else None,
            tenant_stats=self.tenant_stats,
        )
        self.bus = self._obs.bus
        self._tiering: Tiering | None = None
        if tiers:
            self._tiering = Tiering(
                self.l1, tiers, self.bus, chunk_size=self.chunk_size,
                write_back=self.config.l2_write_back, timeout_s=self.config.l2_timeout_s,
                backlog_wait_s=self.config.l2_backlog_wait_s,
            )  # fmt: skip

    # -- helpers ---------------------------------------------------------------------

    def _instance(self, instance_id: Any) -> Instance:
        with self._lock:
            if self._closed:
                raise KVFlowError("the cache engine is closed")
            inst = self._instances.get(instance_id)
        if inst is None:
            raise UnknownInstanceError(f"instance {instance_id!r} is not registered")
        return inst

    def _request_ids(
        self, inst: Instance, token_ids: Any, block_ids: Any, request_id: Any, cache_salt: Any
    ) -> RequestIds:
        """A store/retrieve request's ids, after the checks that need no conversion."""
        _check_str("request_id", request_id)
        _check_salt(cache_salt)
        return RequestIds(
            token_ids, block_ids, chunk_size=self.chunk_size, layout=inst.layout,
            blocks_per_chunk=inst.blocks_per_chunk,
        )  # fmt: skip

    def _chunk_keys(
        self, inst: Instance, ids: RequestIds, first: int, stop: int, request_id: str,
        cache_salt: str | None,
    ) -> list[ObjectKey]:  # fmt: skip
        """L1 keys of chunks [first, stop), converting their token ids first (chained
        hashes of the whole prefix, computed once per session, then cached), or the
        request's own chunk keys when it came with them."""
        model, world, rank = inst.model_rank
        hashes: Sequence[bytes]
        if ids.hashes is not None:
            hashes = ids.hashes[:stop]
        else:
            ids.convert_tokens(stop)
            hashes = self._keys.hashes(ids.tokens[: stop * self.chunk_size], request_id)
        return [ObjectKey(h, model, world, rank, cache_salt) for h in hashes[first:]]

    def _keyed(self, token_ids: Any, chunk_keys: Any) -> tuple[Any, list[bytes] | None]:
        """(token ids, None) for a request by tokens; for one by `chunk_keys`, placeholder
        token ids (one whole chunk per key) and the checked keys."""
        if chunk_keys is None:
            return token_ids, None
        if token_ids is not None:
            raise InvalidRequestError("give token_ids or chunk_keys, not both")
        keys = check_chunk_keys(chunk_keys, self.chunk_size, MAX_REQUEST_TOKENS)
        return placeholder_tokens(len(keys), self.chunk_size), keys

    def _publish(self, etype: EventType, session_id: str | None, attrs: dict[str, Any]) -> None:
        self.bus.publish(Event(etype, 0, session_id, None, attrs))

    def _publish_evictions(self, plan: WritePlan, session_id: str | None) -> None:
        if plan.evicted_chunks:
            self._publish(
                EventType.L1_EVICT,
                session_id,
                {
                    "chunks": plan.evicted_chunks,
                    "bytes": plan.evicted_bytes,
                    "keys": plan.evicted_keys,
                },
            )

    @staticmethod
    def _quiesce(inst: Instance) -> None:
        """After a failure: let enqueued copies finish before their memory is reused."""
        with contextlib.suppress(Exception):
            inst.mover.wait()

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

    @contextlib.contextmanager
    def _transfer(self, inst: Instance, op: Op, **failed: Any) -> Iterator[None]:
        """Run an op's body; on any error wait for its streams, publish a failed END, re-raise.

        `failed` are the END attrs of a failure. Errors that are not kvflow's own
        (a failing copy) become TransferError.
        """
        try:
            yield
        except BaseException as exc:
            self._quiesce(inst)
            if isinstance(exc, KVFlowError) or not isinstance(exc, Exception):
                op.fail(exc, **failed)
                raise
            err = TransferError(f"transfer for instance {inst.instance_id!r} failed: {exc}")
            op.fail(err, **failed)
            raise err from exc

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
    ) -> None:
        """Register an instance's KV tensors; the layout is detected (or `kv_format`)."""
        _check_str("instance_id", instance_id)
        _check_str("model_name", model_name)
        _check_world(world_size, rank)
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
        mover = self._make_mover(layout, nbytes)
        inst = Instance(
            instance_id, model_name, world_size, rank, layout, self.chunk_size, desc, nbytes, mover
        )
        try:
            self._add_instance(inst)
        except BaseException:
            mover.close()
            raise
        self._publish(EventType.REGISTER, None, inst.event_attrs())

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
        with self._lock:
            if self._closed:
                raise KVFlowError("the cache engine is closed")
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

    # -- lookup ---------------------------------------------------------------------------

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
    ) -> int:
        """Tokens of the longest prefix of full chunks every rank has in some tier.

        With `chunk_keys` (and no token_ids) the chunks are named by those keys
        (kvflow.core.engine.chunk_keys) instead of by hashes of their tokens.

        When part of that prefix lies in L2, a prefetch of it into L1 starts (unless
        `prefetch` is False or the model's layouts were never registered) and the
        lookup returns at once.
        """
        token_ids, named = self._keyed(token_ids, chunk_keys)
        n_req = _requested_tokens(token_ids)
        attrs = {"model_name": model_name, "tokens": n_req}
        op = Op(self.bus, EventType.LOOKUP_START, request_id, attrs)
        result: dict[str, Any] = {"requested_tokens": n_req, "hit_tokens": 0}
        try:
            salt = self._check_query(token_ids, model_name, world_size, cache_salt, request_id)
            if not isinstance(prefetch, bool):
                raise InvalidRequestError(f"prefetch must be a bool, got {prefetch!r}")
            tokens = as_int32_array(token_ids, "token_ids")
            hashes = named if named is not None else self._keys.hashes(tokens, request_id)
            in_l1 = len(hashes)
            for ranks in _rank_groups(world_size):  # rank 0 first: see _rank_groups
                if not in_l1:
                    break
                # plain tuples hash and compare equal to ObjectKey, at a fraction of the cost
                in_l1 = self.l1.count_prefix(
                    [(h, model_name, world_size, r, salt) for r in ranks] for h in hashes[:in_l1]
                )
            by_tier = {"l1": in_l1 * self.chunk_size}
            hit = in_l1
            if self._tiering is not None and in_l1 < len(hashes):
                rows = self._tier_rows(hashes[in_l1:], model_name, world_size, salt)
                more, tiers, where = self._tiering.hit_rows(rows)
                hit += more
                for name, n in tiers.items():
                    by_tier[name] = by_tier.get(name, 0) + n * self.chunk_size
                nbytes = self._rank_nbytes(model_name, world_size) if prefetch else None
                if more and nbytes is not None and len(tiers) > ("l1" in tiers):
                    self._tiering.prefetch(
                        rows[:more], nbytes, model_name=model_name, trigger="lookup",
                        session_id=request_id, residency=where,
                    )  # fmt: skip
        except BaseException as exc:
            op.fail(exc, **result)
            raise
        hit_tokens = hit * self.chunk_size
        self.tenants.record_lookup(model_name, salt, n_req, hit_tokens)
        # chunk_hashes: the list the key cache returned (no copy), for kvflow whatif
        op.end(
            requested_tokens=n_req, hit_tokens=hit_tokens, hit_tokens_by_tier=by_tier,
            chunk_hashes=hashes, chunk_size=self.chunk_size, world_size=world_size,
        )  # fmt: skip
        return hit_tokens

    def _check_query(
        self, token_ids: Any, model_name: Any, world_size: Any, cache_salt: Any, request_id: Any
    ) -> str | None:
        """A lookup's or prefetch's arguments, checked before any work; returns the salt."""
        if self._closed:
            raise KVFlowError("the cache engine is closed")
        _check_str("model_name", model_name)
        _check_world(world_size)
        salt = _check_salt(cache_salt)
        if request_id is not None:
            _check_str("request_id", request_id)
        _check_tokens(token_ids)
        return salt

    def _tier_rows(
        self, hashes: Sequence[bytes], model_name: str, world_size: int, salt: str | None
    ) -> list[list[ObjectKey]]:
        """Key rows (one key per rank) of the chunks some tier may hold for every rank.

        The chunks are narrowed rank group by rank group (`_rank_groups`) on the keys'
        residency before the last group, so that the rows handed to `hit_rows` never
        reach far beyond the chunks that ranks really hold: the work follows the ranks
        that exist, not world_size. The rows returned may still miss (the last group).
        """
        assert self._tiering is not None
        residency = self._tiering.loader.residency
        n = len(hashes)
        groups = list(_rank_groups(world_size))
        for ranks in groups[:-1]:
            if not n:
                break
            keys = [
                ObjectKey(h, model_name, world_size, r, salt) for h in hashes[:n] for r in ranks
            ]
            where = residency(keys)
            width = len(ranks)
            n = next(
                (
                    i
                    for i in range(n)
                    if any(where[k] is None for k in keys[i * width : (i + 1) * width])
                ),
                n,
            )
        ranks = range(world_size)
        return [[ObjectKey(h, model_name, world_size, r, salt) for r in ranks] for h in hashes[:n]]

    def _rank_nbytes(self, model_name: str, world_size: int) -> list[int] | None:
        """Chunk bytes of each rank of the model's world, from the layout descs recorded
        at registration; None when some rank was never registered."""
        with self._lock:
            descs = [self._layouts.get((model_name, world_size, r)) for r in range(world_size)]
        if any(d is None for d in descs):
            return None
        return [_desc_nbytes(d) for d in descs if d is not None]

    # -- prefetch ---------------------------------------------------------------------------

    def prefetch(
        self,
        token_ids: Any,
        *,
        model_name: str,
        world_size: int = 1,
        cache_salt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Start loading the request's L2-resident prefix into L1; returns a prefetch id.

        Non-blocking. L1 objects are allocated from the layout desc registered for each
        rank of (model_name, world_size), so no engine tensor is touched; a model whose
        ranks were never registered is an error. `prefetch_state(id)` reports progress.
        """
        salt = self._check_query(token_ids, model_name, world_size, cache_salt, request_id)
        tiering = self._tiering
        if tiering is None:
            raise InvalidRequestError(
                "prefetch needs an L2 tier; none is configured (start the server with --l2-disk)"
            )
        nbytes = self._rank_nbytes(model_name, world_size)
        if nbytes is None:
            with self._lock:
                missing = [
                    r for r in range(world_size) if (model_name, world_size, r) not in self._layouts
                ]
            raise UnknownInstanceError(
                f"model {model_name!r} world_size {world_size} rank(s) {missing} never registered "
                "KV caches: prefetch needs their layout"
            )
        tokens = as_int32_array(token_ids, "token_ids")
        hashes = self._keys.hashes(tokens, request_id)
        rows = self._tier_rows(hashes, model_name, world_size, salt)
        hit, _, where = tiering.hit_rows(rows)
        return tiering.prefetch(
            rows[:hit], nbytes, model_name=model_name, trigger="api", session_id=request_id,
            residency=where,
        )  # fmt: skip

    def prefetch_state(self, prefetch_id: str) -> dict[str, Any]:
        """A prefetch's progress: state running/done, chunks, tokens landed, kept, discarded."""
        _check_str("prefetch_id", prefetch_id)
        state = self._tiering.prefetch_state(prefetch_id) if self._tiering is not None else None
        if state is None:
            raise UnknownInstanceError(f"prefetch {prefetch_id!r} is unknown (or long finished)")
        return state

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
    ) -> int:
        """Copy the full chunks missing from L1 into it; returns tokens of the request held.

        With `chunk_keys` (and token_ids None) the chunks are named by those keys, one per
        chunk, as in `lookup`. With `layers` each layer is copied once it says the engine
        wrote it (`_store_layers`).

        The result counts, from token 0, the chunks now held: in L1 (written by this call,
        already there, or being written by a concurrent store) or, with L2 tiers, in L2 or
        being written to it. Without L2 it stops at the first chunk L1 had no room for;
        with L2 a request larger than (free) L1 streams through it (`_stream_store`).
        """
        token_ids, named = self._keyed(token_ids, chunk_keys)
        inst = self._instance(instance_id)
        attrs = _transfer_attrs(inst, token_ids)
        result: dict[str, Any] = {}
        with inst.lock:
            op = Op(self.bus, EventType.STORE_START, request_id, attrs)
            with self._transfer(inst, op, tokens=0, bytes=0):
                ids = self._request_ids(inst, token_ids, block_ids, request_id, cache_salt)
                ids.hashes = named
                if layers is not None:
                    held = self._store_layers(inst, op, ids, request_id, cache_salt, layers)
                    if held is not None:
                        return held
                # chunks go in waves: the first group is converted, hashed, planned and
                # enqueued alone, then each wave doubles the chunks done, so a wave's host
                # work runs while the copies of the (as many) chunks before it drain
                n_chunks = ids.n_chunks
                stop = min(n_chunks, inst.mover.head_chunks)
                ids.convert(stop)
                keys = self._chunk_keys(inst, ids, 0, stop, request_id, cache_salt)
                plan = self.l1.prepare_write(keys, inst.chunk_nbytes)
                evictions_told = streaming = False
                try:
                    if keys and not plan.covered and self._tiering is None:
                        raise CapacityError(
                            f"L1 is full of objects being read; no room for a chunk of "
                            f"{inst.chunk_nbytes} bytes"
                        )
                    queued = 0
                    while True:
                        self._enqueue_store(inst, ids.table, plan.new[queued:])
                        queued = len(plan.new)
                        if stop == n_chunks or plan.covered < stop:
                            break
                        first, stop = stop, min(n_chunks, 2 * stop)
                        ids.convert(stop)
                        keys = self._chunk_keys(inst, ids, first, stop, request_id, cache_salt)
                        self.l1.extend_write(plan, [*plan.keys, *keys], inst.chunk_nbytes)
                    streaming = self._tiering is not None and plan.covered < n_chunks
                    if streaming:  # the rest goes through L1 window by window
                        inst.mover.flush()
                        inst.mover.wait()
                        self.l1.commit(plan)
                        self._publish_evictions(plan, request_id)
                        evictions_told = True
                        result = self._stream_store(inst, ids, plan, request_id, cache_salt)
                        op.end(None, **result)
                        return int(result["held_tokens"])
                    result = self._store_result(inst, plan)
                    inst.mover.flush()
                    self._publish_evictions(plan, request_id)  # events once the GPU is busy
                    evictions_told = True
                    op.end(inst.mover.store_stream, **result)
                    inst.mover.wait()
                except BaseException:
                    self._quiesce(inst)
                    self.l1.abort(plan)  # committed already when streaming: a no-op then
                    if not evictions_told:
                        self._publish_evictions(plan, request_id)
                    raise
                self.l1.commit(plan)
        self._publish_written(inst, plan, request_id)
        return plan.covered * self.chunk_size

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

    def _store_layers(
        self, inst: Instance, op: Op, ids: RequestIds, request_id: str, cache_salt: str | None,
        written: WrittenSignal,
    ) -> int | None:  # fmt: skip
        """A store that copies each layer once the engine wrote it (docs/ENGINE.md,
        "Layerwise stores"): the chunks are planned in L1 first, while the forward pass
        runs, then each layer is gathered into their objects as it comes; they become
        visible together once the last layer landed. A request L1 cannot hold at once
        (it would stream through L1 to L2) waits for every layer and returns None: the
        caller stores it the ordinary way."""
        n_chunks = ids.n_chunks
        ids.convert(n_chunks)
        keys = self._chunk_keys(inst, ids, 0, n_chunks, request_id, cache_salt)
        plan = self.l1.prepare_write(keys, inst.chunk_nbytes)
        mover = inst.mover
        stream = mover.kernel_stream if isinstance(mover, CudaMover) else None
        told = False
        try:
            if keys and not plan.covered and self._tiering is None:
                raise CapacityError(
                    f"L1 is full of objects being read; no room for a chunk of "
                    f"{inst.chunk_nbytes} bytes"
                )
            if self._tiering is not None and plan.covered < n_chunks:
                self.l1.abort(plan)
                self._publish_evictions(plan, request_id)
                told = True
                for layer in range(inst.layout.num_layers):
                    written.wait_written(layer, stream)
                return None
            table = _rows_of(ids.table, [i for i, _ in plan.new])
            dsts = self.l1.views([o for _, o in plan.new])
            if isinstance(mover, CudaMover):
                mover.store_layers(table, dsts, self.chunk_size, written.wait_written)
            else:
                cpu_gather_layers(inst.layout, self.chunk_size, table, dsts, written)
            result = {**self._store_result(inst, plan), "layerwise": True}
            self._publish_evictions(plan, request_id)
            told = True
            op.end(mover.store_stream, **result)
            mover.wait()
        except BaseException:
            self._quiesce(inst)
            self.l1.abort(plan)
            if not told:
                self._publish_evictions(plan, request_id)
            raise
        self.l1.commit(plan)
        self._publish_written(inst, plan, request_id)
        return plan.covered * self.chunk_size

    def _stream_chunks(self, nbytes: int) -> int:
        """Chunks of `nbytes` in one window of a request streaming through L1."""
        return max(1, int(self.l1.capacity_bytes * STREAM_SHARE) // max(nbytes, 1))

    def _written(
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

    def _stream_store(
        self, inst: Instance, ids: RequestIds, plan: WritePlan, request_id: str,
        cache_salt: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        """Store the chunks after `plan` (committed, covering what L1 took at once) through
        L1 in windows of STREAM_SHARE of it: each window is copied into L1, committed and
        written through to L2; its L1 room is reused once L2 has it. Stops when no room
        comes within the bound or L2 writes were dropped (their chunks live in L1 only,
        and a later window would evict them). Returns the STORE_END attrs."""
        assert self._tiering is not None
        nbytes = inst.chunk_nbytes
        receipt = WriteReceipt([t.name for t in self._tiering.tiers])
        done: list[ObjectKey] = [cast(ObjectKey, k) for k in plan.keys[: plan.covered]]
        new = len(plan.new)
        # waits for L2 (backlog room, L1 room its writes hold) go without the instance's
        # lock: the mover is idle between windows
        with self._unlocked(inst):
            dropped = self._written(inst, plan, 0, request_id, receipt)
        window = self._stream_chunks(nbytes)
        head = done[:window]  # kept the most recently used: the streamed middle goes first
        n_chunks = ids.n_chunks
        while not dropped and len(done) < n_chunks:
            first = len(done)
            stop = min(n_chunks, first + window)
            ids.convert(stop)
            keys = self._chunk_keys(inst, ids, first, stop, request_id, cache_salt)
            # refresh the head just before the window's room is made: the write-through's
            # pins have made the chunks it took newer than a head L1 held before this store
            self.l1.release(self.l1.pin_prefix(head))
            with self._unlocked(inst):
                wplan = self._window_plan(keys, nbytes, request_id)
            if not wplan.covered:
                break
            try:
                self._enqueue_store(inst, ids.table, [(first + i, o) for i, o in wplan.new])
                inst.mover.flush()
                inst.mover.wait()
            except BaseException:
                self._quiesce(inst)
                self.l1.abort(wplan)
                raise
            self.l1.commit(wplan)
            done.extend(keys[: wplan.covered])
            new += len(wplan.new)
            head = head or done[:window]
            with self._unlocked(inst):
                dropped = self._written(inst, wplan, first, request_id, receipt)
        self._tiering.count_streamed("stores", len(done))
        return self._held(inst, done, new, receipt)

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

    def _enqueue_store(
        self, inst: Instance, table: np.ndarray, new: Sequence[tuple[int, Any]]
    ) -> None:
        """Enqueue the copies of planned (chunk index, L1 object) pairs into L1."""
        if new:
            rows = [i for i, _ in new]
            inst.mover.store(_rows_of(table, rows), self.l1.views([o for _, o in new]))

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
    ) -> int:
        """Copy the consecutive L1 hits from chunk 0 into the request's blocks.

        Returns the hit prefix in tokens (the tokens now valid in the blocks from
        token 0); the first `skip_first_n_tokens` (whole blocks) are not written.
        `enqueued(stream, hit_tokens)`, for a CUDA cache, is called once every copy is
        queued on `stream` (a TransferStream), before the engine waits for them: the
        server replies then, with an event recorded on that stream. With `layers`
        the copies go layer by layer, each layer signalled there (`_retrieve_layers`).
        """
        token_ids, named = self._keyed(token_ids, chunk_keys)
        inst = self._instance(instance_id)
        attrs = _transfer_attrs(inst, token_ids)
        result: dict[str, Any] = {}
        with inst.lock:
            op = Op(self.bus, EventType.RETRIEVE_START, request_id, attrs)
            with self._transfer(inst, op, tokens=0, bytes=0, hit_tokens=0):
                skip = skip_first_n_tokens
                if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
                    raise InvalidRequestError(
                        f"skip_first_n_tokens must be an integer >= 0, got {skip!r}"
                    )
                if skip % inst.block_size:
                    raise InvalidRequestError(
                        f"skip_first_n_tokens ({skip}) must be a multiple of the block_size "
                        f"({inst.block_size}) of instance {inst.instance_id!r}"
                    )
                ids = self._request_ids(inst, token_ids, block_ids, request_id, cache_salt)
                ids.hashes = named
                if layers is not None:
                    done = self._retrieve_layers(
                        inst, op, ids, skip, request_id, cache_salt, layers, enqueued
                    )
                    if done is not None:
                        return int(done["hit_tokens"])
                # in waves like a store: the first group's keys are hashed and its copies
                # started before the rest of the request is hashed and looked up
                n_chunks = ids.n_chunks
                stop = min(n_chunks, inst.mover.head_chunks)
                objs = self.l1.pin_prefix(
                    self._chunk_keys(inst, ids, 0, stop, request_id, cache_salt)
                )
                tiering = self._tiering
                staged: list[Slot] = []
                try:
                    chunks, tokens = self._scatter(inst, objs, 0, ids, skip // inst.block_size)
                    while len(objs) == stop < n_chunks:
                        first, stop = stop, min(n_chunks, 2 * stop)
                        keys = self._chunk_keys(inst, ids, first, stop, request_id, cache_salt)
                        objs.extend(self.l1.pin_prefix(keys))
                        more = self._scatter(inst, objs, first, ids, skip // inst.block_size)
                        chunks, tokens = chunks + more[0], tokens + more[1]
                    hit_chunks, from_l2 = len(objs), 0
                    hit_hashes = [o.key[0] for o in objs]
                    first = len(objs)
                    keys = []
                    if tiering is not None and first < n_chunks:
                        keys = self._chunk_keys(inst, ids, first, n_chunks, request_id, cache_salt)
                    if len(keys) > 2 * self._stream_chunks(inst.chunk_nbytes):
                        # more than half of L1 misses it: the L1 part's copies land and its
                        # pins go, then L2 streams through L1 window by window
                        inst.mover.flush()
                        inst.mover.wait()
                        self.l1.release(objs)
                        objs = []
                        got = self._stream_retrieve(inst, ids, keys, first, skip, request_id)
                        hit_chunks, from_l2 = first + got[0], got[1]
                        chunks, tokens = chunks + got[2], tokens + got[3]
                        hit_hashes.extend(k[0] for k in keys[: got[0]])
                    elif keys:
                        # L1 misses some tier may hold: load them (or wait for their
                        # prefetch) without the lock, once the L1 part's copies landed
                        assert tiering is not None
                        inst.mover.flush()
                        inst.mover.wait()
                        with self._unlocked(inst):
                            fetched = tiering.fetch(keys, inst.chunk_nbytes, request_id)
                        objs.extend(fetched.pinned)
                        staged = fetched.staged
                        hit_chunks, from_l2 = first + len(fetched.objs), fetched.from_l2
                        hit_hashes.extend(o.key[0] for o in fetched.objs)
                        more = self._scatter(
                            inst, [*objs[:first], *fetched.objs], first, ids,
                            skip // inst.block_size,
                        )  # fmt: skip
                        chunks, tokens = chunks + more[0], tokens + more[1]
                    ids.convert_blocks(n_chunks)  # checked even when nothing was copied
                    inst.mover.flush()
                    result = {
                        "tokens": tokens,
                        "bytes": chunks * inst.chunk_nbytes,
                        "hit_tokens": hit_chunks * self.chunk_size,
                        "chunks": chunks,
                        "l2_chunks": from_l2,
                        # the hit prefix (L1 refreshes its recency), for kvflow whatif
                        "chunk_hashes": hit_hashes[:hit_chunks],
                    }
                    op.end(inst.mover.retrieve_stream, **result)
                    if layers is not None:  # too big to go layer by layer: all at once
                        for i in range(inst.layout.num_layers):
                            layers.ready(i, inst.mover.retrieve_stream)
                    if enqueued is not None and inst.mover.retrieve_stream is not None:
                        enqueued(inst.mover.retrieve_stream, int(result["hit_tokens"]))
                    inst.mover.wait()
                except BaseException:
                    self._quiesce(inst)
                    raise
                finally:
                    self._release_hits(objs, staged)
        self._publish_read(result, request_id)
        return int(result["hit_tokens"])

    def _release_hits(self, pinned: Sequence[Any], staged: Sequence[Slot]) -> None:
        """A retrieve's end: unpin its L1 hits and free the staged L2 objects it read."""
        self.l1.release(pinned)
        if self._tiering is not None and staged:
            self._tiering.loader.discard(staged)

    def _publish_read(self, result: dict[str, Any], request_id: str) -> None:
        """L1_READ for a retrieve's copied chunks (none: no event)."""
        if result["chunks"]:
            self._publish(
                EventType.L1_READ,
                request_id,
                {"chunks": result["chunks"], "bytes": result["bytes"]},
            )

    def _retrieve_layers(
        self, inst: Instance, op: Op, ids: RequestIds, skip: int, request_id: str,
        cache_salt: str | None, signal: LayerSignal, enqueued: Callable[[Any, int], None] | None,
    ) -> dict[str, Any] | None:  # fmt: skip
        """A retrieve that copies layer by layer and signals each layer (docs/ENGINE.md,
        "Layerwise retrieves"). The whole hit must be held at once (layer 0 of the last
        chunk is copied before layer 1 of the first), so the hit is pinned in L1 (L2 hits
        loaded first) and `enqueued` (the server's reply) is called once the block ids are
        checked, before the first layer is queued: each layer's signal tells when it may
        be read. A hit that would take more than a streaming window
        of L1 from L2 goes the ordinary way (None: the caller does it, signalling every
        layer at its end)."""
        n_chunks = ids.n_chunks
        keys = self._chunk_keys(inst, ids, 0, n_chunks, request_id, cache_salt)
        tiering = self._tiering
        objs = self.l1.pin_prefix(keys)
        first = len(objs)
        if tiering is not None and n_chunks - first > 2 * self._stream_chunks(inst.chunk_nbytes):
            self.l1.release(objs)
            return None
        staged: list[Slot] = []
        from_l2 = 0
        layer = 0
        try:
            hits = list(objs)
            if tiering is not None and first < n_chunks:
                with self._unlocked(inst):  # nothing queued yet
                    fetched = tiering.fetch(keys[first:], inst.chunk_nbytes, request_id)
                objs.extend(fetched.pinned)
                staged, from_l2 = fetched.staged, fetched.from_l2
                hits.extend(fetched.objs)
            bpc = inst.blocks_per_chunk
            skip_blocks = skip // inst.block_size
            rows, skips = _written_chunks(0, len(hits), skip_blocks, bpc)
            ids.check_distinct(skip_blocks)  # converts and checks every block id
            srcs = self.l1.views([hits[c] for c in rows])
            table = _rows_of(ids.table, rows)
            hit_tokens = len(hits) * self.chunk_size
            result: dict[str, Any] = {
                "tokens": sum(bpc - s for s in skips) * inst.block_size,
                "bytes": len(rows) * inst.chunk_nbytes,
                "hit_tokens": hit_tokens,
                "chunks": len(rows),
                "l2_chunks": from_l2,
                "chunk_hashes": [k[0] for k in keys[: len(hits)]],
                "layerwise": True,
            }

            def ready(i: int, stream: Any) -> None:
                nonlocal layer
                signal.ready(i, stream)
                layer = i + 1

            mover = inst.mover
            if enqueued is not None:  # the ids are checked: reply, the copies follow
                enqueued(mover.retrieve_stream, hit_tokens)
            if isinstance(mover, CudaMover):
                mover.retrieve_layers(srcs, table, skips, self.chunk_size, ready)
                op.end(mover.retrieve_stream, **result)
                mover.wait()
            else:
                cpu_scatter_layers(inst.layout, self.chunk_size, srcs, table, skips, ready)
                op.end(None, **result)
        except BaseException:
            self._quiesce(inst)
            signal.failed(layer)
            raise
        finally:
            self._release_hits(objs, staged)
        self._publish_read(result, request_id)
        return result

    def _stream_retrieve(
        self, inst: Instance, ids: RequestIds, keys: list[ObjectKey], first: int, skip: int,
        request_id: str,
    ) -> tuple[int, int, int, int]:  # fmt: skip
        """Load `keys` (chunks `first`...) from L2 into L1 a window (STREAM_SHARE of L1) at
        a time and copy each to the blocks, the next window's loads running meanwhile;
        each window's L1 objects are released once copied, so the prefix never needs to
        fit in L1 at once. Returns (chunks landed, of them from L2, chunks copied, tokens).
        A window that lands short is retried once from its first missing chunk (L1 may
        have lacked room while the previous window was held); the prefix ends where a
        retry lands nothing."""
        tiering = self._tiering
        assert tiering is not None
        nbytes, window = inst.chunk_nbytes, self._stream_chunks(inst.chunk_nbytes)
        skip_blocks = skip // inst.block_size
        pos = landed_l2 = chunks = tokens = 0
        span = keys[:window]
        job = tiering.start_fetch(span, nbytes, request_id)
        while True:
            with self._unlocked(inst):  # the mover is idle: the last window's copies landed
                fetched = tiering.finish_fetch(job, span)
            n = len(fetched.objs)
            span = keys[pos + n : pos + n + window] if n == len(span) else []
            if span:  # the next window loads while this one is copied
                job = tiering.start_fetch(span, nbytes, request_id)
            try:
                more = self._scatter(inst, fetched.objs, first + pos, ids, skip_blocks, base=True)
                inst.mover.flush()
                inst.mover.wait()
            finally:
                self._release_hits(fetched.pinned, fetched.staged)
            chunks, tokens = chunks + more[0], tokens + more[1]
            pos, landed_l2 = pos + n, landed_l2 + fetched.from_l2
            if pos == len(keys) or not n:
                break
            if not span:  # landed short: once more from the first chunk missing
                span = keys[pos : pos + window]
                job = tiering.start_fetch(span, nbytes, request_id)
        tiering.count_streamed("retrieves", pos)
        return pos, landed_l2, chunks, tokens

    def _scatter(
        self, inst: Instance, objs: Sequence[Any], first: int, ids: RequestIds, skip_blocks: int,
        *, base: bool = False,
    ) -> tuple[int, int]:  # fmt: skip
        """Enqueue the copies of hit chunks [first, len(objs)) not wholly skipped; returns
        (chunks enqueued, tokens they write). With `base`, objs[i] is chunk first + i.

        The block ids are converted and checked, all of them, when the mover first asks
        for them: after its first host copies are queued, before it writes any block.
        """
        bpc = inst.blocks_per_chunk
        shift = first if base else 0
        rows, skips = _written_chunks(first, len(objs) + shift, skip_blocks, bpc)

        def block_rows() -> np.ndarray:
            ids.check_distinct(skip_blocks)  # converts and checks every block id
            return _rows_of(ids.table, rows)

        if rows:
            inst.mover.retrieve(self.l1.views([objs[c - shift] for c in rows]), block_rows, skips)
        return len(rows), sum(bpc - s for s in skips) * inst.block_size

    # -- sessions and allocations ------------------------------------------------------------

    def report_layer_waits(self, instance_id: str, request_id: str, waits_s: Any) -> None:
        """Publish an engine's per-layer waits of a layerwise retrieve (LAYER_WAIT):
        at most one per layer, each a finite number of seconds >= 0."""
        inst = self._instance(instance_id)
        _check_str("request_id", request_id)
        if isinstance(waits_s, (str, bytes)) or not isinstance(waits_s, Sequence):
            raise InvalidRequestError("waits_s must be a sequence of seconds, one per layer")
        if len(waits_s) > inst.layout.num_layers:
            raise InvalidRequestError(
                f"waits_s has {len(waits_s)} entries for {inst.layout.num_layers} layers"
            )
        waits = []
        for i, w in enumerate(waits_s):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf:
                raise InvalidRequestError(f"waits_s[{i}] must be seconds >= 0, got {w!r}")
            waits.append(float(w))
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
        _check_str("request_id", request_id)
        if self._closed:
            raise KVFlowError("the cache engine is closed")
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
        if isinstance(records, (str, bytes)) or not isinstance(records, Sequence):
            raise InvalidRequestError(
                f"records must be a sequence of BlockAllocation, got {type(records).__name__}"
            )
        checked: list[BlockAllocation] = []
        num_blocks = inst.layout.num_blocks
        for i, rec in enumerate(records):
            if not isinstance(rec, Sequence) or len(rec) != 3:
                raise InvalidRequestError(
                    f"records[{i}] must be BlockAllocation(req_id, new_block_ids, new_token_ids)"
                )
            req_id, block_ids, token_ids = rec
            if not isinstance(req_id, str) or not req_id:
                raise InvalidRequestError(f"records[{i}].req_id must be a non-empty string")
            for name, seq in (("new_block_ids", block_ids), ("new_token_ids", token_ids)):
                if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
                    raise InvalidRequestError(f"records[{i}].{name} must be a sequence of ints")
            where = f"records[{i}] (req_id {req_id!r})"
            n_blocks = _check_ids(block_ids, f"{where}.new_block_ids", num_blocks)
            n_tokens = _check_ids(token_ids, f"{where}.new_token_ids")
            if n_tokens > n_blocks * inst.block_size:
                raise InvalidRequestError(
                    f"{where} holds {n_tokens} tokens in {n_blocks} blocks of "
                    f"{inst.block_size} tokens (at most {n_blocks * inst.block_size} fit)"
                )
            checked.append(rec if isinstance(rec, BlockAllocation) else BlockAllocation(*rec))
        attrs = {
            "instance_id": inst.instance_id,
            "model_name": inst.model_name,
            "block_size": inst.block_size,
            "records": tuple(checked),
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
        stats = self.bus.stats()
        return {
            "closed": closed,
            "chunk_size": self.chunk_size,
            "instances": instances,
            "l1": self.l1.stats(),
            "l1_pinning": self.l1.pin_state(),
            "l2": self._tiering.describe() if self._tiering is not None else None,
            "bus": {
                "published": stats.total_published,
                "delivered": stats.total_delivered,
                "dropped": stats.total_dropped,
                "dropped_by_type": {t.label: n for t, n in stats.dropped.items() if n},
                "queue_depth": stats.queue_depth,
                "oldest_lag_ns": stats.oldest_lag_ns,
                "capacity": stats.capacity,
                "subscriber_errors": dict(stats.subscriber_errors),
            },
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
        if self._tiering is not None:  # pending L2 writes read L1: finish them first
            self._tiering.close(timeout)
        ok = self._obs.close(timeout)
        self.l1.close()
        return ok

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
