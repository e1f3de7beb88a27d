"""L2 on Redis (or Redis Cluster): one Redis string per object, checked on every load.

Every Redis call runs on a thread pool of `pool_size` threads (one connection each), so
the caller never waits on the network except for the one PING at start-up, `pin` and
`drop_where` (which answer synchronously; the engine calls neither on L2). Batches are
pipelined: `contains` is one round trip whatever its size, `store` and `load` one per
64 MiB of values. A value is a header (magic, version, the Redis key it was written
under, payload length, the payload's xxh3_128) then the payload, so garbage, a
truncated value or one copied under another key is a miss, counted and deleted.

Faults: an error of a call fails that call only (a miss, or `failed` keys), never
raises out of its future. A connection error or a timeout marks the tier
disconnected: calls then fail at once without touching the network while a background
thread PINGs with exponential backoff until Redis answers again. Eviction is Redis's
own (its maxmemory-policy): the tier neither sees nor counts it. Credentials live only
in the redis-py client; no message, log line, stat or repr made here contains one.

This module is the tier's API; the parts it runs on are `redisformat` (keys, values,
raw RESP), `redislink` (the client, reconnecting), `redisnodes` (a cluster's nodes one
at a time) and `redisstats` (counters and the last error).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from redis.cluster import RedisCluster

from kvflow.core.tiers import redisformat
from kvflow.core.tiers.base import (
    ObjectKey,
    StoreOutcome,
    check_buffers,
    completed,
    gather,
    release_pins,
)
from kvflow.core.tiers.redis_target import RedisTarget
from kvflow.core.tiers.redisformat import HEADER as HEADER
from kvflow.core.tiers.redisformat import MAX_KEY_BYTES as MAX_KEY_BYTES
from kvflow.core.tiers.redisformat import KeyNames
from kvflow.core.tiers.redisformat import _owner_text as _owner_text
from kvflow.core.tiers.redisformat import owner_text as owner_text
from kvflow.core.tiers.redislink import Link, pipeline_replies, stream_replies
from kvflow.core.tiers.redisnodes import ClusterNodes
from kvflow.core.tiers.redisstats import FAILURE_COUNTERS, RedisStats

#: values per pipeline of a store or load (bytes, at least one value)
BATCH_BYTES = 64 << 20
#: values per load batch: each reply is checked and copied as it is read, so a batch's
#: replies never all sit in fresh memory at once (that page-faulting cost 2x at 1 MiB)
LOAD_BATCH_BYTES = 8 << 20
#: the reconnecting thread's PING backoff (and a cluster node's): first delay, doubling
#: up to the cap (read when a tier is made)
RECONNECT_FIRST_S = 0.05
RECONNECT_CAP_S = 1.0
#: INFO memory (usage, capacity) is read at most this often, on an I/O thread
INFO_EVERY_S = 1.0


def _batches(sizes: Sequence[int], limit: int) -> list[range]:
    """Consecutive index ranges of at most `limit` bytes each (and at least one item)."""
    out: list[range] = []
    start = total = 0
    for i, nbytes in enumerate(sizes):
        if i > start and total + nbytes > limit:
            out.append(range(start, i))
            start, total = i, 0
        total += nbytes
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def _check_settings(
    target: RedisTarget, cluster: bool, key_prefix: str, timeout_s: float, pool_size: int
) -> None:
    """ValueError naming the flag of the first bad setting."""
    if not isinstance(key_prefix, str) or not key_prefix:
        raise ValueError("--l2-redis-key-prefix must be a non-empty string")
    if cluster and ("{" in key_prefix or "}" in key_prefix):
        raise ValueError(
            "--l2-redis-key-prefix must not contain '{' or '}' with --l2-redis-cluster: a "
            "hash tag would put every object in one slot"
        )
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError("--l2-redis-timeout-s must be a number > 0")
    if not timeout_s > 0 or not math.isfinite(timeout_s):
        raise ValueError("--l2-redis-timeout-s must be a number > 0")
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
        raise ValueError("--l2-redis-pool-size must be an integer >= 1")
    if cluster and target.db != 0:
        raise ValueError("--l2-redis: Redis Cluster has only database 0 (use /0 or no path)")


class _Landing:
    """One load batch's replies, each checked and copied into its destination as soon as
    it is read, and what they add to the counters. Used by one I/O thread only."""

    def __init__(
        self,
        names: Sequence[bytes],
        dsts: Sequence[torch.Tensor],
        scrub: Callable[[BaseException | str], str],
    ) -> None:
        self.names = names
        self.dsts = dsts
        self._scrub = scrub
        self.failures = 0
        self.missing = 0
        self.corrupt: list[bytes] = []
        self.reason: str | None = None  # why the last key failed

    def land(self, i: int, value: Any) -> bool:
        """Check reply `i` and copy its payload into dsts[i]: whether it landed."""
        name, dst = self.names[i], self.dsts[i]
        if isinstance(value, Exception):
            self.failures += 1
            self.reason = f"load: {self._scrub(value)}"
            return False
        if value is None:
            self.missing += 1
            return False
        start, why = redisformat.check_value(name, value, dst.numel())
        if why is not None:
            self.corrupt.append(name)
            self.reason = f"load: {name.decode(errors='replace')[:120]}: {why}"
        if start < 0:
            return False
        dst.numpy()[:] = np.frombuffer(value, dtype=np.uint8, offset=start)
        return True


class RedisTier:
    """The L2 Redis tier (a `StorageTier`) on one Redis server or one Redis Cluster.

    Lock rule: the lock guards `_closed`, `_pins`, `_info_at` and `_info_pending`, each
    read and written under it, and is never held while waiting on the network. The
    counters and last error (`RedisStats`), the client and its state (`Link`) and a
    cluster's node backoff (`ClusterNodes`) each keep a lock of their own; no code
    holds two of these locks at once. The settings are fixed at construction and read
    without a lock.
    """

    name = "redis"

    #: contract behaviours this tier cannot offer, and why (the contract tests skip them)
    cannot = {
        "capacity": (
            "Redis bounds its memory itself (maxmemory, whole-server bytes): the tier "
            "reports that as capacity and holds no object budget of its own"
        ),
        "lru_eviction": (
            "eviction is Redis's maxmemory-policy (approximate LRU over the whole server, or "
            "noeviction); pins cannot hold keys against it"
        ),
    }

    encode_value = staticmethod(redisformat.encode_value)
    check_value = staticmethod(redisformat.check_value)

    def __init__(
        self,
        target: RedisTarget,
        *,
        cluster: bool = False,
        key_prefix: str = "kvflow:",
        timeout_s: float = 1.0,
        pool_size: int = 8,
    ) -> None:
        _check_settings(target, cluster, key_prefix, timeout_s, pool_size)
        self.target = target
        self.cluster = cluster
        self.key_prefix = key_prefix
        self.timeout_s = float(timeout_s)
        self.pool_size = pool_size
        self._keys = KeyNames(key_prefix)
        self._lock = threading.Lock()
        self._closed = False
        self._pins: Counter[ObjectKey] = Counter()
        self._info_at = -math.inf
        self._info_pending = False
        self._stats = RedisStats()
        backoff = (RECONNECT_FIRST_S, RECONNECT_CAP_S)
        self._link = Link(
            target,
            cluster=cluster,
            timeout_s=self.timeout_s,
            pool_size=pool_size,
            backoff_s=backoff,
            stats=self._stats,
            rejoined=self._request_info,
        )
        self._nodes = ClusterNodes(backoff_s=backoff, stats=self._stats, scrub=self._link.scrub)
        self._io = ThreadPoolExecutor(pool_size, thread_name_prefix="kvflow-redis")
        try:
            if self._link.connect():
                self._request_info()
        except BaseException:
            self._shutdown()
            raise

    def _check_open(self) -> None:
        """RuntimeError once the tier is closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the redis tier is closed")

    # -- keys ------------------------------------------------------------------------------

    def redis_key(self, key: ObjectKey) -> bytes:
        """The Redis key of an object: prefix, owner, ':', chunk hash hex (no hash tag)."""
        return self._keys.name(key)

    def parse_key(self, name: bytes) -> ObjectKey | None:
        """The ObjectKey a Redis key of this tier names, or None for a foreign key."""
        return self._keys.parse(name)

    def _names(self, keys: Iterable[ObjectKey]) -> list[bytes]:
        """The Redis keys of `keys`."""
        return [self._keys.name(k) for k in keys]

    # -- I/O (on the pool's threads) -------------------------------------------------------

    def _execute(
        self, client: Any, names: Sequence[bytes], add: Callable[[Any, int], None]
    ) -> list[Any]:
        """Run one pipelined command per name (`add(pipe, i)` queues name i's); one reply
        per name, an Exception where it failed. One server: one pipeline, whose link
        errors raise; a cluster: one pipeline per node (`ClusterNodes.execute`)."""
        if self.cluster:
            return self._nodes.execute(client, names, add)
        return pipeline_replies(client, names, add)

    def _contains(self, names: list[bytes]) -> list[bool]:
        """EXISTS of each name; one lookup failure counted if any of them failed."""
        try:
            client = self._link.client()
            if self.cluster:
                replies = self._execute(client, names, lambda pipe, i: pipe.exists(names[i]))
            else:
                replies = stream_replies(client, b"EXISTS", names, lambda i, r: r)
        except Exception as e:
            self._stats.count("lookup_failures")
            self._link.failed("contains", e)
            return [False] * len(names)
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors:
            self._stats.count("lookup_failures")
            self._link.failed("contains", errors[0])
        return [not isinstance(r, Exception) and bool(r) for r in replies]

    def _store(self, names: list[bytes], bufs: list[torch.Tensor]) -> StoreOutcome:
        """SET NX of each name's value (one pipeline); each failed key counted."""
        try:
            client = self._link.client()

            def add(pipe: Any, i: int) -> None:
                payload = bufs[i].contiguous().numpy().data
                pipe.set(names[i], redisformat.encode_value(names[i], payload), nx=True)

            replies = self._execute(client, names, add)
        except Exception as e:
            self._stats.count("store_failures", len(names))
            self._link.failed("store", e)
            return StoreOutcome(failed=len(names))
        errors = [r for r in replies if isinstance(r, Exception)]
        stored = sum(1 for r in replies if r is True)
        present = sum(1 for r in replies if r is None)
        self._stats.stored(stored, len(errors))
        if errors:  # e.g. OOM command not allowed when used memory > 'maxmemory'
            self._link.failed("store", errors[0])
        return StoreOutcome(stored=stored, present=present, failed=len(errors))

    def _load(self, names: list[bytes], dsts: list[torch.Tensor]) -> list[bool]:
        """GET of each name into its destination (see `_Landing`); each key that did not
        land counted, corrupt values deleted."""
        landing = _Landing(names, dsts, self._link.scrub)
        try:
            client = self._link.client()
            if self.cluster:
                replies = self._execute(client, names, lambda pipe, i: pipe.get(names[i]))
                out = [landing.land(i, value) for i, value in enumerate(replies)]
            else:
                out = stream_replies(client, b"GET", names, landing.land)
        except Exception as e:
            self._stats.count("load_failures", len(names))
            self._link.failed("load", e)
            return [False] * len(names)
        corrupt = landing.corrupt
        self._stats.loaded(landing.failures, landing.missing, len(corrupt), landing.reason)
        if corrupt:
            self._delete(client, corrupt)
        return out

    def _delete(self, client: Any, names: Sequence[bytes]) -> int:
        """DEL the keys (pipelined); how many existed. Errors are recorded, not raised."""
        try:
            replies = self._execute(client, names, lambda pipe, i: pipe.delete(names[i]))
        except Exception as e:
            self._link.failed("delete", e)
            return 0
        return sum(r for r in replies if isinstance(r, int))

    def _pinned(self, key: ObjectKey) -> bool:
        """Whether `key` is pinned now."""
        with self._lock:
            return self._pins[key] > 0

    def _drop(self, predicate: Callable[[Any], bool]) -> int:
        """SCAN the prefix and DEL the unpinned keys `predicate` matches (1000 per
        pipeline); how many were deleted. An error ends the scan, recorded."""
        dropped = 0
        try:
            client = self._link.client()
            scan_args: dict[str, Any] = {"match": self._keys.scan_match(), "count": 1000}
            if self.cluster:
                scan_args["target_nodes"] = RedisCluster.PRIMARIES
            doomed: list[bytes] = []
            for name in client.scan_iter(**scan_args):
                key = self._keys.parse(name)
                if key is None or not predicate(key) or self._pinned(key):
                    continue
                doomed.append(name)
                if len(doomed) >= 1000:
                    dropped += self._delete(client, doomed)
                    doomed = []
            if doomed:
                dropped += self._delete(client, doomed)
        except Exception as e:
            self._link.failed("drop_where", e)
        self._stats.forget(dropped)
        return dropped

    def _refresh_info(self) -> None:
        """Read used_memory and maxmemory (summed over a cluster's primaries)."""
        try:
            client = self._link.client()
            if self.cluster:
                got = client.info("memory", target_nodes=RedisCluster.PRIMARIES)
                infos = (
                    list(got.values()) if all(isinstance(v, dict) for v in got.values()) else [got]
                )
            else:
                infos = [client.info("memory")]
            limits = [int(i.get("maxmemory", 0)) for i in infos]
            capacity = 0 if 0 in limits else sum(limits)
            self._stats.memory(sum(int(i.get("used_memory", 0)) for i in infos), capacity)
        except Exception as e:
            self._link.failed("info", e)
        finally:
            with self._lock:
                self._info_pending = False
                self._info_at = time.monotonic()

    def _request_info(self) -> None:
        """Refresh usage and capacity on an I/O thread unless done in the last second."""
        connected = self._link.connected()
        with self._lock:
            due = time.monotonic() - self._info_at >= INFO_EVERY_S
            if self._closed or self._info_pending or not connected or not due:
                return
            self._info_pending = True
        try:
            self._io.submit(self._refresh_info)
        except RuntimeError:  # shut down meanwhile
            with self._lock:
                self._info_pending = False

    # -- StorageTier -----------------------------------------------------------------------

    def contains(self, keys: Sequence[ObjectKey]) -> Future[list[bool]]:
        """Which keys Redis holds: one pipelined EXISTS per key, one round trip. Any error
        (or the tier disconnected) answers all False and counts one lookup failure."""
        self._check_open()
        names = self._names(keys)
        if not names:
            return completed([])
        if not self._link.connected():
            self._stats.count("lookup_failures")
            return completed([False] * len(names))
        return self._io.submit(self._contains, names)

    def store(self, items: Sequence[tuple[ObjectKey, torch.Tensor]]) -> Future[StoreOutcome]:
        """SET NX each key's value (pipelined): a key held already is `present`; any error
        (out of memory under noeviction, Redis unreachable) fails those keys, counted.
        ValueError (nothing written) for bad buffers or a key too long for the header."""
        check_buffers([buf for _, buf in items], "items' bytes")
        self._check_open()
        names = self._names(k for k, _ in items)
        for name in names:
            if len(name) > MAX_KEY_BYTES:
                raise ValueError(
                    f"the redis tier cannot store a key of {len(name)} bytes (model name and "
                    f"cache salt too long): at most {MAX_KEY_BYTES}"
                )
        bufs = [buf for _, buf in items]
        if not names:
            return completed(StoreOutcome())
        if not self._link.connected():
            self._stats.count("store_failures", len(names))
            return completed(StoreOutcome(failed=len(names)))
        futures = [
            self._io.submit(self._store, names[r.start : r.stop], bufs[r.start : r.stop])
            for r in _batches([b.numel() for b in bufs], BATCH_BYTES)
        ]

        def outcome(parts: list[StoreOutcome]) -> StoreOutcome:
            return StoreOutcome(
                stored=sum(p.stored for p in parts),
                present=sum(p.present for p in parts),
                failed=sum(p.failed for p in parts),
            )

        return gather(futures, outcome)

    def load(self, keys: Sequence[ObjectKey], dsts: Sequence[torch.Tensor]) -> Future[list[bool]]:
        """GET each key (pipelined) and copy its checked payload into `dsts[i]`.

        False for a key Redis does not hold (counted missing), a value of another size
        (the destination untouched), a corrupt value (counted, deleted) or an error.
        """
        if len(keys) != len(dsts):
            raise ValueError(f"load needs one destination per key: {len(keys)} keys, {len(dsts)}")
        check_buffers(dsts, "dsts")
        self._check_open()
        names = self._names(keys)
        if not names:
            return completed([])
        if not self._link.connected():
            self._stats.count("load_failures", len(names))
            return completed([False] * len(names))
        dst_list = list(dsts)
        futures = [
            self._io.submit(self._load, names[r.start : r.stop], dst_list[r.start : r.stop])
            for r in _batches([d.numel() for d in dst_list], LOAD_BATCH_BYTES)
        ]
        return gather(futures, lambda parts: [ok for part in parts for ok in part])

    def pin(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading keys Redis holds (asked on an I/O thread; this call waits for
        the answer, at most about timeout_s). Redis cannot pin: the count is bookkeeping
        for `unpin`, and eviction by Redis may still take the keys."""
        self._check_open()
        if not keys:
            return 0
        held = self._held(keys)
        n = next((i for i, ok in enumerate(held) if not ok), len(held))
        with self._lock:
            self._pins.update(keys[:n])
        return n

    def _held(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """`contains(keys)`, waited for at most 2 * timeout_s + 1. Without an answer by
        then: all False, one lookup failure counted (unless the call, still running,
        counts its own), and the error recorded and logged once."""
        future: Future[list[bool]] | None = None
        try:
            future = self.contains(keys)
            return future.result(timeout=2 * self.timeout_s + 1)
        except Exception as e:  # no answer in time, or the tier closed meanwhile
            if future is None or future.cancel():
                self._stats.count("lookup_failures")
            self._stats.swallowed("pin: no answer", f"pin: {self._link.scrub(e)}")
            return [False] * len(keys)

    def unpin(self, keys: Sequence[ObjectKey]) -> None:
        """Undo one `pin` of each key (bookkeeping only)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the redis tier is closed")
            release_pins(self._pins, keys)

    def drop_where(self, predicate: Callable[[Any], bool]) -> int:
        """DEL every key under the prefix whose parsed ObjectKey matches (SCAN on an I/O
        thread; this call waits for it). Returns how many were deleted."""
        self._check_open()
        return self._io.submit(self._drop, predicate).result()

    def stats(self) -> dict[str, int]:
        """The STAT_KEYS (usage and capacity from INFO memory, at most a second old;
        objects counted by this tier: stored minus deleted as corrupt or by drop_where;
        Redis's own evictions are not seen), failure counters,
        `connected` (0/1) and `reconnects`. Never waits on the network."""
        self._request_info()
        with self._lock:
            pinned = len(self._pins)
        figures = self._stats.snapshot()
        connected, reconnects = self._link.state()
        return {
            "usage_bytes": figures["usage_bytes"],
            "capacity_bytes": figures["capacity_bytes"],
            "objects": figures["objects"],
            "evicted_chunks": 0,
            "evicted_bytes": 0,
            "pinned": pinned,
            **{name: figures[name] for name in FAILURE_COUNTERS},
            "reconnects": reconnects + self._nodes.rejoins(),
            "connected": int(connected),
        }

    def describe(self) -> dict[str, Any]:
        """The tier as JSON-ready status (credentials masked)."""
        nodes = self._link.nodes()
        with self._lock:
            closed = self._closed
        return {
            "name": self.name,
            "url": self.target.safe_url(),
            "cluster": self.cluster,
            "key_prefix": self.key_prefix,
            "nodes": nodes,
            "connected": self._link.connected(),
            "last_error": self._stats.last_error,
            "timeout_s": self.timeout_s,
            "pool_size": self.pool_size,
            "sources": {k: v for k, v in self.target.sources.items() if k in ("host", "port")},
            "closed": closed,
        }

    def close(self) -> None:
        """Finish pending calls, stop the threads, close the connections; the objects stay
        in Redis (a restart finds them). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._shutdown()
        with self._lock:
            self._pins.clear()
        self._stats.forget_all()

    def _shutdown(self) -> None:
        """Stop reconnecting, finish the calls pending on the I/O threads, then close the
        link (waiting out a reconnect attempt in progress)."""
        self._link.stop()
        self._io.shutdown(wait=True)
        self._link.close()

    def __repr__(self) -> str:
        return (
            f"RedisTier({self.target.safe_url()}, cluster={self.cluster}, "
            f"key_prefix={self.key_prefix!r})"
        )
