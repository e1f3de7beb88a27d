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
"""

from __future__ import annotations

import functools
import logging
import math
import re
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import Any

import numpy as np
import redis
import torch
import xxhash
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    ClusterDownError,
    NoPermissionError,
    RedisClusterException,
)
from redis.retry import Retry

from kvflow.core.tiers.base import (
    ObjectKey,
    StoreOutcome,
    check_buffers,
    completed,
    gather,
    release_pins,
)
from kvflow.core.tiers.redis_target import RedisTarget

log = logging.getLogger("kvflow.tiers.redis")

#: value header: magic, format version, key length, payload length, payload xxh3_128
HEADER = struct.Struct("<8sHHQ16s")
MAGIC = b"KVFLREDS"
VERSION = 1
#: the longest Redis key a header can name (a store of a longer one is a ValueError)
MAX_KEY_BYTES = 0xFFFF
#: values per pipeline of a store or load (bytes, at least one value)
BATCH_BYTES = 64 << 20
#: values per load batch: each reply is checked and copied as it is read, so a batch's
#: replies never all sit in fresh memory at once (that page-faulting cost 2x at 1 MiB)
LOAD_BATCH_BYTES = 8 << 20
#: redis-py's own retry of a call whose connection broke (a server restart)
CALL_RETRIES = 1
#: the reconnecting thread's PING backoff: first delay, doubling up to the cap
RECONNECT_FIRST_S = 0.05
RECONNECT_CAP_S = 1.0
#: INFO memory (usage, capacity) is read at most this often, on an I/O thread
INFO_EVERY_S = 1.0

#: errors that mean Redis cannot be reached (the tier goes disconnected)
_LINK_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ClusterDownError,
    RedisClusterException,
    OSError,
)
#: owner characters kept as they are in a key; the rest are %XX of their UTF-8 bytes
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_ESCAPES = re.compile(r"%([0-9A-F]{2})")
_GLOB = re.compile(r"([*?\[\]\\])")


class _Down(Exception):
    """The tier is disconnected: a call fails at once, without network I/O."""


def _escape(text: str) -> str:
    """`text` with every character outside [A-Za-z0-9._-] as %XX of its UTF-8 bytes (no
    `{`, `}`, `:` or `#` is left: no hash tag, and the key parses back)."""
    return "".join(
        ch if ch in _SAFE else "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
        for ch in text
    )


def _unescape(text: str) -> str:
    raw = _ESCAPES.sub(lambda m: chr(int(m.group(1), 16)), text)
    return raw.encode("latin-1").decode("utf-8", "surrogatepass")


def owner_text(key: ObjectKey) -> str:
    """The key's owner (model, world size, rank, salt) as key-safe text."""
    return _owner_text(key.model_name, key.world_size, key.rank, key.cache_salt)


@functools.lru_cache(maxsize=1024)
def _owner_text(model_name: str, world_size: int, rank: int, cache_salt: str | None) -> str:
    """Cached: a lookup names hundreds of keys of one owner (escaping each cost 2 us)."""
    salt = "-" if cache_salt is None else "=" + _escape(cache_salt)
    return f"{_escape(model_name)}#{world_size}#{rank}#{salt}"


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


def _pack(command: bytes, names: Sequence[bytes]) -> bytes:
    """`command name` for each name in the Redis protocol (RESP), as one buffer: a 500-key
    EXISTS packs in ~0.1 ms, a tenth of redis-py's general-purpose packer."""
    head = b"*2\r\n$%d\r\n%s\r\n" % (len(command), command)
    return b"".join([b"%s$%d\r\n%s\r\n" % (head, len(name), name) for name in names])


def _is_auth_error(exc: BaseException | None) -> bool:
    """Whether Redis refused the credentials (also when wrapped by the cluster client)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(
            exc, (AuthenticationError, AuthenticationWrongNumberOfArgsError, NoPermissionError)
        ):
            return True
        text = str(exc)
        if any(word in text for word in ("WRONGPASS", "NOAUTH", "NOPERM", "invalid password")):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class RedisTier:
    """The L2 Redis tier (a `StorageTier`) on one Redis server or one Redis Cluster."""

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

    def __init__(
        self,
        target: RedisTarget,
        *,
        cluster: bool = False,
        key_prefix: str = "kvflow:",
        timeout_s: float = 1.0,
        pool_size: int = 8,
    ) -> None:
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
        self.target = target
        self.cluster = cluster
        self.key_prefix = key_prefix
        self.timeout_s = float(timeout_s)
        self.pool_size = pool_size
        self._prefix_bytes = key_prefix.encode()
        self._lock = threading.Lock()
        self._pins: Counter[ObjectKey] = Counter()
        self.counters = dict.fromkeys(
            (
                "store_failures",
                "load_failures",
                "lookup_failures",
                "corrupt_objects",
                "missing_objects",
                "reconnects",
            ),
            0,
        )
        self._objects = 0
        self._usage = 0
        self._capacity = 0
        self._info_at = -math.inf
        self._info_pending = False
        self._connected = False
        self._last_error: str | None = None
        self._closed = False
        self._stop = threading.Event()
        self._reconnector: threading.Thread | None = None
        self._client: Any = None  # redis.Redis or RedisCluster (made later if unreachable)
        #: cluster nodes found unreachable: when to try each again, and its current backoff
        self._node_retry: dict[str, float] = {}
        self._node_delay: dict[str, float] = {}
        self._io = ThreadPoolExecutor(pool_size, thread_name_prefix="kvflow-redis")
        try:
            self._start()
        except BaseException:
            self._shutdown()
            raise

    # -- connection ------------------------------------------------------------------

    def _make_client(self) -> Any:
        """A redis-py client (a cluster client connects to learn the slots; others don't)."""
        t = self.target
        common: dict[str, Any] = {
            "username": t.username,
            "password": t.password,
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "retry": Retry(
                ExponentialBackoff(cap=0.1, base=0.01),
                CALL_RETRIES,
                supported_errors=(redis.ConnectionError,),  # a timeout is not retried
            ),
            "client_name": "kvflow",
        }
        tls: dict[str, Any] = {"ssl_ca_certs": t.ca_certs} if t.tls else {}
        if self.cluster:
            return RedisCluster(
                host=t.host,
                port=t.port,
                ssl=t.tls,
                max_connections=self.pool_size + 2,
                **common,
                **tls,
            )
        pool = redis.BlockingConnectionPool(
            max_connections=self.pool_size + 2,  # the I/O threads, the reconnecting thread
            timeout=self.timeout_s,
            connection_class=redis.SSLConnection if t.tls else redis.Connection,
            host=t.host,
            port=t.port,
            db=t.db,
            **common,
            **tls,
        )
        # from_pool: the client owns the pool, so close() closes its connections too
        return redis.Redis.from_pool(pool)

    def _start(self) -> None:
        """One PING: wrong credentials are a ValueError; Redis unreachable is not fatal."""
        try:
            client = self._make_client()
            self._client = client
            client.ping()
        except Exception as e:
            if _is_auth_error(e):
                raise ValueError(self._auth_message(e)) from None
            self._went_down("connect", e)
            return
        with self._lock:
            self._connected = True
        self._request_info()

    def _auth_message(self, exc: BaseException) -> str:
        src = self.target.sources
        given = "" if self.target.password else " (no password was given)"
        return (
            f"Redis at {self.target.safe_url()} refused the credentials{given}: "
            f"{self._scrub(exc)} (username from {src.get('username', 'default')}, password "
            f"from {src.get('password', 'default')}); check --l2-redis-username, "
            "--l2-redis-password, the --l2-redis URL or KVFLOW_REDIS_USERNAME/"
            "KVFLOW_REDIS_PASSWORD (docs/REDIS.md)"
        )

    def _scrub(self, exc: BaseException | str) -> str:
        """An error as one line without any credential value."""
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        for secret in self.target.secrets():
            text = text.replace(secret, "***")
        return " ".join(text.split())[:300]

    def _went_down(self, what: str, exc: BaseException) -> None:
        """Mark the tier disconnected and start the reconnecting thread (once)."""
        reason = f"{what}: {self._scrub(exc)}"
        with self._lock:
            was = self._connected
            self._connected = False
            self._last_error = reason
            start = not self._closed and self._reconnector is None
            if start:
                self._reconnector = threading.Thread(
                    target=self._reconnect, name="kvflow-redis-reconnect", daemon=True
                )
        if was or start:
            log.warning(
                "L2 Redis %s unreachable (%s); calls fail fast until it answers again",
                self.target.safe_url(),
                reason,
            )
        if start:
            assert self._reconnector is not None
            self._reconnector.start()

    def _reconnect(self) -> None:
        """PING with exponential backoff until Redis answers (or the tier closes)."""
        delay = RECONNECT_FIRST_S
        while not self._stop.wait(delay):
            delay = min(delay * 2, RECONNECT_CAP_S)
            try:
                client = self._client if self._client is not None else self._make_client()
                self._client = client
                client.ping()
            except Exception as e:
                with self._lock:
                    self._last_error = f"reconnect: {self._scrub(e)}"
                continue
            # logged before the tier shows as connected: whoever sees it back finds the line
            log.info("L2 Redis %s reachable again", self.target.safe_url())
            with self._lock:
                self._connected = True
                self._reconnector = None
                self.counters["reconnects"] += 1
            self._request_info()
            return
        with self._lock:
            self._reconnector = None

    def _up(self) -> Any:
        """The client, or _Down while disconnected."""
        with self._lock:
            if not self._connected or self._client is None:
                raise _Down
            return self._client

    def _failed(self, what: str, exc: BaseException) -> None:
        """Record a failed call; a link error also marks the tier disconnected."""
        if isinstance(exc, _Down):
            return
        if isinstance(exc, _LINK_ERRORS) and not (self.cluster and self._client is not None):
            # (a cluster's nodes go down one by one: _execute keeps their state apart)
            self._went_down(what, exc)
        else:
            with self._lock:
                self._last_error = f"{what}: {self._scrub(exc)}"

    def _count(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self.counters[counter] += n

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the redis tier is closed")

    def _connected_now(self) -> bool:
        with self._lock:
            return self._connected

    # -- keys and values -------------------------------------------------------------------

    def redis_key(self, key: ObjectKey) -> bytes:
        """The Redis key of an object: prefix, owner, ':', chunk hash hex (no hash tag)."""
        return f"{self.key_prefix}{owner_text(key)}:{key.chunk_hash.hex()}".encode()

    def parse_key(self, name: bytes) -> ObjectKey | None:
        """The ObjectKey a Redis key of this tier names, or None for a foreign key."""
        if not name.startswith(self._prefix_bytes):
            return None
        try:
            owner, colon, hash_hex = name[len(self._prefix_bytes) :].decode().rpartition(":")
            model, world, rank, salt = owner.split("#")
            key = ObjectKey(
                bytes.fromhex(hash_hex),
                _unescape(model),
                int(world),
                int(rank),
                None if salt == "-" else _unescape(salt.removeprefix("=")),
            )
            canonical = colon and self.redis_key(key) == name
        except (ValueError, UnicodeError):
            return None
        return key if canonical else None

    @staticmethod
    def encode_value(name: bytes, payload: memoryview) -> bytes:
        """The stored value: header (naming `name`) then the payload."""
        digest = xxhash.xxh3_128_digest(payload)
        header = HEADER.pack(MAGIC, VERSION, len(name), payload.nbytes, digest)
        return b"".join((header, name, payload))

    @staticmethod
    def check_value(name: bytes, value: bytes, nbytes: int) -> tuple[int, str | None]:
        """(payload offset, None) for a whole value of `name` holding `nbytes` bytes;
        (-1, None) for a whole value of another size; (-1, why) for a corrupt value."""
        if len(value) < HEADER.size:
            return -1, "shorter than its header"
        magic, version, key_len, length, digest = HEADER.unpack_from(value)
        if magic != MAGIC:
            return -1, "not a kvflow value (bad magic)"
        if version != VERSION:
            return -1, f"value format version {version} is not {VERSION}"
        start = HEADER.size + key_len
        if value[HEADER.size : start] != name:
            return -1, "the value was written under another key"
        if len(value) - start != length:
            return -1, f"payload of {len(value) - start} bytes, header says {length}"
        if length != nbytes:
            return -1, None
        if xxhash.xxh3_128_digest(memoryview(value)[start:]) != digest:
            return -1, "payload checksum mismatch"
        return start, None

    # -- I/O (on the pool's threads) ----------------------------------------------------------

    def _pipeline(self, client: Any) -> Any:
        return client.pipeline() if self.cluster else client.pipeline(transaction=False)

    def _execute(
        self, client: Any, names: Sequence[bytes], add: Callable[[Any, int], None]
    ) -> list[Any]:
        """Run one pipelined command per name (`add(pipe, i)` queues name i's); one reply
        per name, an Exception where it failed.

        One server: one pipeline; its errors raise. A cluster: one pipeline per node
        holding some of the names, so a node that is down (or was, less than its backoff
        ago: those names fail at once, without network I/O) costs only its own names.
        """
        if not self.cluster:
            pipe = self._pipeline(client)
            for i in range(len(names)):
                add(pipe, i)
            return list(pipe.execute(raise_on_error=False))
        return self._execute_per_node(client, names, add)

    def _stream(
        self, client: Any, command: bytes, names: Sequence[bytes], each: Callable[[int, Any], Any]
    ) -> list[Any]:
        """`command name` for every name in one write, each reply handed to `each(i, reply)`
        as soon as it is read (an error reply as its ResponseError); their results.

        One server only: redis-py's pipeline costs ~5 us per command and holds every reply
        until the last; a 500-key EXISTS this way is one round trip of ~0.6 ms. A broken
        pooled connection (a server restart since its last use) is retried once.
        """
        pool = client.connection_pool
        for attempt in (0, 1):
            conn = pool.get_connection()
            out: list[Any] = []
            try:
                conn.send_packed_command([_pack(command, names)])
                for i in range(len(names)):
                    try:
                        reply = conn.read_response()
                    except redis.ResponseError as e:
                        reply = e
                    out.append(each(i, reply))
                return out
            except redis.ConnectionError:
                conn.disconnect()
                if attempt or out:  # replies read already: the link broke mid-call
                    raise
            except BaseException:
                conn.disconnect()
                raise
            finally:
                pool.release(conn)
        raise AssertionError("unreachable")

    def _execute_per_node(
        self, client: Any, names: Sequence[bytes], add: Callable[[Any, int], None]
    ) -> list[Any]:
        """A cluster's `_execute`: one pipeline per node (see there)."""
        replies: list[Any] = [None] * len(names)
        for node, idxs in self._by_node(client, names).items():
            if node is None or not self._node_usable(client, node):
                down = _Down(f"cluster node {node or '(no node for the slot)'} is down")
                for i in idxs:
                    replies[i] = down
                continue
            try:
                pipe = client.pipeline()
                for i in idxs:
                    add(pipe, i)
                got = pipe.execute(raise_on_error=False)
            except Exception as e:
                if isinstance(e, _LINK_ERRORS):
                    self._node_failed(node, e)
                got = [e] * len(idxs)
            else:
                self._node_ok(node)
            for i, reply in zip(idxs, got, strict=True):
                replies[i] = reply
        return replies

    def _by_node(self, client: Any, names: Sequence[bytes]) -> dict[str | None, list[int]]:
        """Indexes of `names` by the cluster node serving their slot (None: no node)."""
        groups: dict[str | None, list[int]] = {}
        for i, name in enumerate(names):
            try:
                node: str | None = client.get_node_from_key(name).name
            except Exception:
                node = None
            groups.setdefault(node, []).append(i)
        return groups

    def _node_usable(self, client: Any, node: str) -> bool:
        """Whether to send to `node` now: never marked down, or its backoff is over (then
        the client first re-reads the slot map: a replica may have taken over)."""
        with self._lock:
            retry_at = self._node_retry.get(node)
        if retry_at is None:
            return True
        if time.monotonic() < retry_at:
            return False
        with suppress(Exception):
            client.nodes_manager.initialize()
        return True

    def _node_failed(self, node: str, exc: BaseException) -> None:
        """A cluster node is unreachable: its names fail fast for a backoff that doubles."""
        with self._lock:
            delay = min(2 * self._node_delay.get(node, RECONNECT_FIRST_S / 2), RECONNECT_CAP_S)
            self._node_delay[node] = delay
            first = node not in self._node_retry
            self._node_retry[node] = time.monotonic() + delay
            self._last_error = f"cluster node {node}: {self._scrub(exc)}"
        if first:
            log.warning(
                "L2 Redis cluster node %s unreachable; its keys miss until it answers", node
            )

    def _node_ok(self, node: str) -> None:
        with self._lock:
            if self._node_retry.pop(node, None) is not None:
                self._node_delay.pop(node, None)
                self.counters["reconnects"] += 1

    def _contains(self, names: list[bytes]) -> list[bool]:
        try:
            client = self._up()
            if self.cluster:
                replies = self._execute(client, names, lambda pipe, i: pipe.exists(names[i]))
            else:
                replies = self._stream(client, b"EXISTS", names, lambda i, r: r)
        except Exception as e:
            self._count("lookup_failures")
            self._failed("contains", e)
            return [False] * len(names)
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors:
            self._count("lookup_failures")
            self._failed("contains", errors[0])
        return [not isinstance(r, Exception) and bool(r) for r in replies]

    def _store(self, names: list[bytes], bufs: list[torch.Tensor]) -> StoreOutcome:
        try:
            client = self._up()

            def add(pipe: Any, i: int) -> None:
                payload = bufs[i].contiguous().numpy().data
                pipe.set(names[i], self.encode_value(names[i], payload), nx=True)

            replies = self._execute(client, names, add)
        except Exception as e:
            self._count("store_failures", len(names))
            self._failed("store", e)
            return StoreOutcome(failed=len(names))
        errors = [r for r in replies if isinstance(r, Exception)]
        stored = sum(1 for r in replies if r is True)
        present = sum(1 for r in replies if r is None)
        with self._lock:
            self._objects += stored
            self.counters["store_failures"] += len(errors)
        if errors:  # e.g. OOM command not allowed when used memory > 'maxmemory'
            self._failed("store", errors[0])
        return StoreOutcome(stored=stored, present=present, failed=len(errors))

    def _load(self, names: list[bytes], dsts: list[torch.Tensor]) -> list[bool]:
        corrupt: list[bytes] = []
        tally = {"failures": 0, "missing": 0}
        reason: list[str] = []

        def land(i: int, value: Any) -> bool:
            """Check one reply and copy its payload into dsts[i] (as soon as it is read)."""
            name, dst = names[i], dsts[i]
            if isinstance(value, Exception):
                tally["failures"] += 1
                reason.append(f"load: {self._scrub(value)}")
                return False
            if value is None:
                tally["missing"] += 1
                return False
            start, why = self.check_value(name, value, dst.numel())
            if why is not None:
                corrupt.append(name)
                reason.append(f"load: {name.decode(errors='replace')[:120]}: {why}")
            if start < 0:
                return False
            dst.numpy()[:] = np.frombuffer(value, dtype=np.uint8, offset=start)
            return True

        try:
            client = self._up()
            if self.cluster:
                replies = self._execute(client, names, lambda pipe, i: pipe.get(names[i]))
                out = [land(i, value) for i, value in enumerate(replies)]
            else:
                out = self._stream(client, b"GET", names, land)
        except Exception as e:
            self._count("load_failures", len(names))
            self._failed("load", e)
            return [False] * len(names)
        failures, missing = tally["failures"], tally["missing"]
        with self._lock:
            self.counters["load_failures"] += failures + missing + len(corrupt)
            self.counters["missing_objects"] += missing
            self.counters["corrupt_objects"] += len(corrupt)
            self._objects = max(0, self._objects - len(corrupt))
            if reason:
                self._last_error = reason[-1]
        if corrupt:
            self._delete(client, corrupt)
        return out

    def _delete(self, client: Any, names: Sequence[bytes]) -> int:
        """DEL the keys (pipelined); how many existed. Errors are recorded, not raised."""
        try:
            replies = self._execute(client, names, lambda pipe, i: pipe.delete(names[i]))
        except Exception as e:
            self._failed("delete", e)
            return 0
        return sum(r for r in replies if isinstance(r, int))

    def _drop(self, predicate: Callable[[Any], bool]) -> int:
        dropped = 0
        try:
            client = self._up()
            match = _GLOB.sub(r"\\\1", self.key_prefix) + "*"
            scan_args: dict[str, Any] = {"match": match, "count": 1000}
            if self.cluster:
                scan_args["target_nodes"] = RedisCluster.PRIMARIES
            doomed: list[bytes] = []
            for name in client.scan_iter(**scan_args):
                key = self.parse_key(name)
                if key is None or not predicate(key):
                    continue
                with self._lock:
                    if self._pins[key]:
                        continue
                doomed.append(name)
                if len(doomed) >= 1000:
                    dropped += self._delete(client, doomed)
                    doomed = []
            if doomed:
                dropped += self._delete(client, doomed)
        except Exception as e:
            self._failed("drop_where", e)
        with self._lock:
            self._objects = max(0, self._objects - dropped)
        return dropped

    def _refresh_info(self) -> None:
        """Read used_memory and maxmemory (summed over a cluster's primaries)."""
        try:
            client = self._up()
            if self.cluster:
                got = client.info("memory", target_nodes=RedisCluster.PRIMARIES)
                infos = (
                    list(got.values()) if all(isinstance(v, dict) for v in got.values()) else [got]
                )
            else:
                infos = [client.info("memory")]
            usage = sum(int(i.get("used_memory", 0)) for i in infos)
            limits = [int(i.get("maxmemory", 0)) for i in infos]
            capacity = 0 if 0 in limits else sum(limits)
            with self._lock:
                self._usage, self._capacity = usage, capacity
        except Exception as e:
            self._failed("info", e)
        finally:
            with self._lock:
                self._info_pending = False
                self._info_at = time.monotonic()

    def _request_info(self) -> None:
        """Refresh usage and capacity on an I/O thread unless done in the last second."""
        with self._lock:
            due = time.monotonic() - self._info_at >= INFO_EVERY_S
            if self._closed or self._info_pending or not self._connected or not due:
                return
            self._info_pending = True
        try:
            self._io.submit(self._refresh_info)
        except RuntimeError:  # shut down meanwhile
            with self._lock:
                self._info_pending = False

    # -- StorageTier -------------------------------------------------------------------

    def _names(self, keys: Iterable[ObjectKey]) -> list[bytes]:
        return [self.redis_key(k) for k in keys]

    def contains(self, keys: Sequence[ObjectKey]) -> Future[list[bool]]:
        """Which keys Redis holds: one pipelined EXISTS per key, one round trip. Any error
        (or the tier disconnected) answers all False and counts one lookup failure."""
        self._check_open()
        names = self._names(keys)
        if not names:
            return completed([])
        if not self._connected_now():
            self._count("lookup_failures")
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
        if not self._connected_now():
            self._count("store_failures", len(names))
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
        if not self._connected_now():
            self._count("load_failures", len(names))
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
        try:
            held = self.contains(keys).result(timeout=2 * self.timeout_s + 1)
        except Exception:
            return 0
        n = next((i for i, ok in enumerate(held) if not ok), len(held))
        with self._lock:
            self._pins.update(keys[:n])
        return n

    def unpin(self, keys: Sequence[ObjectKey]) -> None:
        """Undo one `pin` of each key (bookkeeping only)."""
        with self._lock:
            self._check_open()
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
            return {
                "usage_bytes": self._usage,
                "capacity_bytes": self._capacity,
                "objects": self._objects,
                "evicted_chunks": 0,
                "evicted_bytes": 0,
                "pinned": len(self._pins),
                **self.counters,
                "connected": int(self._connected),
            }

    def describe(self) -> dict[str, Any]:
        """The tier as JSON-ready status (credentials masked)."""
        nodes: list[str] = []
        client = self._client  # None before a cluster is first reached, and after close
        if self.cluster and client is not None:
            nodes = sorted(f"{n.host}:{n.port} {n.server_type or '?'}" for n in client.get_nodes())
        with self._lock:
            return {
                "name": self.name,
                "url": self.target.safe_url(),
                "cluster": self.cluster,
                "key_prefix": self.key_prefix,
                "nodes": nodes,
                "connected": self._connected,
                "last_error": self._last_error,
                "timeout_s": self.timeout_s,
                "pool_size": self.pool_size,
                "sources": {k: v for k, v in self.target.sources.items() if k in ("host", "port")},
                "closed": self._closed,
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
            self._connected = False
            self._objects = 0
            self._pins.clear()

    def _shutdown(self) -> None:
        self._stop.set()
        self._io.shutdown(wait=True)
        reconnector = self._reconnector
        if reconnector is not None:
            reconnector.join(timeout=2 * self.timeout_s + 1)
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as e:  # a cluster client closing unreachable nodes
                log.debug("closing the Redis client: %s", self._scrub(e))

    def __repr__(self) -> str:
        return (
            f"RedisTier({self.target.safe_url()}, cluster={self.cluster}, "
            f"key_prefix={self.key_prefix!r})"
        )
