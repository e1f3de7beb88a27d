"""The Redis tier's link: its one redis-py client, whether Redis answers, and getting it
back. A connection error or a timeout marks the link down: calls then fail at once
without touching the network while one background thread PINGs with exponential
backoff until Redis answers again. Also the raw calls over the client: a pipeline, and
the single-server fast path that streams replies as they are read. Credentials live
only in the redis-py client; no message, log line or error text made here holds one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
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

from kvflow.core.tiers.redis_target import RedisTarget
from kvflow.core.tiers.redisformat import pack_commands
from kvflow.core.tiers.redisstats import RedisStats

log = logging.getLogger("kvflow.tiers.redis")

#: redis-py's own retry of a call whose connection broke (a server restart)
CALL_RETRIES = 1

#: errors that mean Redis cannot be reached (the link goes down)
LINK_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ClusterDownError,
    RedisClusterException,
    OSError,
)

_AUTH_ERRORS = (AuthenticationError, AuthenticationWrongNumberOfArgsError, NoPermissionError)


class _Down(Exception):
    """The link (or a cluster node) is down: a call fails at once, without network I/O.
    (Its name shows in last_error, as in "load: _Down: cluster node ... is down".)"""


def is_auth_error(exc: BaseException | None) -> bool:
    """Whether Redis refused the credentials (also when wrapped by the cluster client)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, _AUTH_ERRORS):
            return True
        text = str(exc)
        if any(word in text for word in ("WRONGPASS", "NOAUTH", "NOPERM", "invalid password")):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class Link:
    """The client of one Redis server or cluster, and whether Redis answers now.

    Lock rule: the lock guards `_client`, `_connected`, `_closed`, `_reconnector` and
    `_reconnects`, each read and written under it. It is never held while waiting on
    the network or on a thread: clients are made, PINGed and closed, and the
    reconnecting thread started and joined, outside it. A client handed out by
    `client()` is used without it (redis-py's clients and pools are thread-safe). The
    settings (`target`, `cluster`, `timeout_s`, `pool_size`, the backoff) are fixed at
    construction and read without it; `_stop` is an Event, safe from any thread.
    """

    def __init__(
        self,
        target: RedisTarget,
        *,
        cluster: bool,
        timeout_s: float,
        pool_size: int,
        backoff_s: tuple[float, float],
        stats: RedisStats,
        rejoined: Callable[[], None],
    ) -> None:
        self.target = target
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.pool_size = pool_size
        self._first_s, self._cap_s = backoff_s  # the reconnecting PING's first delay, cap
        self._stats = stats
        self._rejoined = rejoined  # called (no lock held) each time Redis answers again
        self._lock = threading.Lock()
        self._client: Any = None  # redis.Redis or RedisCluster (made later if unreachable)
        self._connected = False
        self._closed = False
        self._reconnector: threading.Thread | None = None
        self._reconnects = 0
        self._stop = threading.Event()

    # -- text without credentials --------------------------------------------------------

    def scrub(self, exc: BaseException | str) -> str:
        """An error as one line of at most 300 characters without any credential value."""
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        for secret in self.target.secrets():
            text = text.replace(secret, "***")
        return " ".join(text.split())[:300]

    def _auth_message(self, exc: BaseException) -> str:
        """Why the server does not start when Redis refuses the credentials: their
        sources and Redis's answer, never a value."""
        src = self.target.sources
        given = "" if self.target.password else " (no password was given)"
        return (
            f"Redis at {self.target.safe_url()} refused the credentials{given}: "
            f"{self.scrub(exc)} (username from {src.get('username', 'default')}, password "
            f"from {src.get('password', 'default')}); check --l2-redis-username, "
            "--l2-redis-password, the --l2-redis URL or KVFLOW_REDIS_USERNAME/"
            "KVFLOW_REDIS_PASSWORD (docs/REDIS.md)"
        )

    # -- the client ----------------------------------------------------------------------

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

    def connect(self) -> bool:
        """The start-up PING: True when Redis answered. Refused credentials are a
        ValueError; Redis unreachable is not fatal (the link goes down and reconnects)."""
        try:
            client = self._make_client()
            with self._lock:
                self._client = client
            client.ping()
        except Exception as e:
            if is_auth_error(e):
                raise ValueError(self._auth_message(e)) from None
            self.went_down("connect", e)
            return False
        with self._lock:
            self._connected = True
        return True

    def client(self) -> Any:
        """The client, or _Down while the link is down."""
        with self._lock:
            if not self._connected or self._client is None:
                raise _Down
            return self._client

    def connected(self) -> bool:
        """Whether Redis answers now (as far as the last call or PING knows)."""
        with self._lock:
            return self._connected

    def state(self) -> tuple[bool, int]:
        """Whether Redis answers now, and how many times it came back (read together)."""
        with self._lock:
            return self._connected, self._reconnects

    def nodes(self) -> list[str]:
        """A cluster's nodes as `host:port role` (none before it is first reached)."""
        with self._lock:
            client = self._client
        if not self.cluster or client is None:
            return []
        return sorted(f"{n.host}:{n.port} {n.server_type or '?'}" for n in client.get_nodes())

    # -- failures and reconnecting -------------------------------------------------------

    def failed(self, what: str, exc: BaseException) -> None:
        """Record a failed call; a link error also marks the link down (on a cluster,
        once reached, nodes fail one by one: `ClusterNodes` keeps their state apart)."""
        if isinstance(exc, _Down):  # failed fast: counted by the call, nothing new to say
            return
        with self._lock:
            per_node = self.cluster and self._client is not None
        if isinstance(exc, LINK_ERRORS) and not per_node:
            self.went_down(what, exc)
        else:
            self._stats.error(f"{what}: {self.scrub(exc)}")

    def went_down(self, what: str, exc: BaseException) -> None:
        """Mark the link down and start the reconnecting thread (once, unless stopped)."""
        reason = f"{what}: {self.scrub(exc)}"
        self._stats.error(reason)
        thread: threading.Thread | None = None
        with self._lock:
            was = self._connected
            self._connected = False
            if not self._closed and self._reconnector is None:
                thread = threading.Thread(
                    target=self._reconnect, name="kvflow-redis-reconnect", daemon=True
                )
                self._reconnector = thread
        if was or thread is not None:
            log.warning(
                "L2 Redis %s unreachable (%s); calls fail fast until it answers again",
                self.target.safe_url(),
                reason,
            )
        if thread is not None:
            thread.start()

    def _reconnect(self) -> None:
        """PING with exponential backoff until Redis answers (or the link stops)."""
        delay = self._first_s
        while not self._stop.wait(delay):
            delay = min(delay * 2, self._cap_s)
            if not self._ping():
                continue
            # logged before the link shows as up: whoever sees it back finds the line
            log.info("L2 Redis %s reachable again", self.target.safe_url())
            with self._lock:
                self._reconnector = None
                back = not self._closed  # (a stopped link stays down)
                if back:
                    self._connected = True
                    self._reconnects += 1
            if back:
                self._rejoined()
            return
        with self._lock:
            self._reconnector = None

    def _ping(self) -> bool:
        """One reconnect attempt (the client made first if Redis was never reached); why
        it failed is the last error."""
        try:
            self._client_or_new().ping()
        except Exception as e:
            self._stats.error(f"reconnect: {self.scrub(e)}")
            return False
        return True

    def _client_or_new(self) -> Any:
        """The client; made (no lock held: a cluster client connects) if there is none."""
        with self._lock:
            client = self._client
        if client is not None:
            return client
        made = self._make_client()
        with self._lock:
            keep = not self._closed
            if keep:
                self._client = made
        if not keep:  # closed meanwhile: the new client is nobody's
            made.close()
            raise _Down("the tier closed while reconnecting")
        return made

    # -- closing -------------------------------------------------------------------------

    def stop(self) -> None:
        """No reconnecting thread starts from now on, and a running one ends at its next
        wait (calls in flight may still finish and report)."""
        with self._lock:
            self._closed = True
        self._stop.set()

    def close(self) -> None:
        """After `stop`, once no call uses the client: wait for the reconnecting thread
        (at most about one PING's timeout), then close the connections."""
        with self._lock:
            reconnector = self._reconnector
        if reconnector is not None:
            reconnector.join(timeout=2 * self.timeout_s + 1)
        with self._lock:
            client, self._client = self._client, None
            self._connected = False
        if client is not None:
            try:
                client.close()
            except Exception as e:  # a cluster client closing unreachable nodes
                log.debug("closing the Redis client: %s", self.scrub(e))


def pipeline_replies(
    client: Any, names: Sequence[bytes], add: Callable[[Any, int], None]
) -> list[Any]:
    """One server: one pipeline (no transaction) of `add(pipe, i)` for each name; one
    reply per name, an Exception where Redis answered an error; a link error raises."""
    pipe = client.pipeline(transaction=False)
    for i in range(len(names)):
        add(pipe, i)
    return list(pipe.execute(raise_on_error=False))


def stream_replies(
    client: Any, command: bytes, names: Sequence[bytes], each: Callable[[int, Any], Any]
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
            conn.send_packed_command([pack_commands(command, names)])
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
