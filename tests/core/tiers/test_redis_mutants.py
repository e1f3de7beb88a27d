"""The Redis tier's link, reconnecting, closing, SCAN/DEL, INFO and pin bounds, pinned down."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from redis.exceptions import AuthenticationError, RedisClusterException

from kvflow.core.tiers.base import ObjectKey
from kvflow.core.tiers.redis import RedisTier
from kvflow.core.tiers.redis_target import RedisTarget, resolve_target
from kvflow.core.tiers.redislink import Link, is_auth_error
from kvflow.core.tiers.redisstats import RedisStats
from tests.core.tiers.test_redis import answer, key, payload
from tests.core.tiers.test_redis_faults import messages, wait_for
from tests.support.collectors import free_port
from tests.support.redis_cluster import running_cluster
from tests.support.redis_servers import RedisServer, one_node_cluster, shared_server
from tests.support.tiers import HeldFilter

SECRET = "Mu7-s3cret-Qx!19"


# -- helpers -------------------------------------------------------------------------------


class FakePort:
    """A loopback TCP port a test steers: each accepted connection is, by `mode` when it is
    accepted, closed at once ("refuse"), fed one byte of a never-ending reply every 50 ms
    ("drip"), or forwarded to `upstream` while `open` is set and held (nothing forwarded,
    nothing answered) while it is clear ("proxy"; without upstream it only holds)."""

    def __init__(self, upstream: int | None = None, mode: str = "proxy") -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.upstream = upstream
        self.mode = mode
        self.open = threading.Event()
        self.accepted: list[float] = []  # monotonic time of each accept
        self.dripping = 0
        self._clients: list[socket.socket] = []
        self._gone: set[int] = set()  # accepts whose client closed (as the proxy saw it)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def count(self) -> int:
        with self._lock:
            return len(self.accepted)

    def client_closed(self, index: int) -> bool:
        """Whether the client closed accepted connection `index` (FIN received)."""
        with self._lock:
            if index in self._gone:
                return True
            sock = self._clients[index]
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                index = len(self.accepted)
                self.accepted.append(time.monotonic())
                self._clients.append(conn)
                mode = self.mode
            if mode == "refuse":
                conn.close()
            elif mode == "drip":
                with self._lock:
                    self.dripping += 1
                threading.Thread(target=self._drip, args=(conn,), daemon=True).start()
            else:
                threading.Thread(target=self._proxy, args=(conn, index), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        try:
            conn.sendall(b"+")
            while not self._stopped.wait(0.05):
                conn.sendall(b"x")
        except OSError:
            pass

    def _proxy(self, conn: socket.socket, index: int) -> None:
        up: socket.socket | None = None
        if self.upstream is not None:
            up = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._back, args=(up, conn), daemon=True).start()
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                while not self.open.wait(0.02):
                    if self._stopped.is_set():
                        return
                if up is not None:
                    up.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._gone.add(index)
            if up is not None:  # shutdown first: it wakes _back's recv, and Redis sees the end
                with contextlib.suppress(OSError):
                    up.shutdown(socket.SHUT_RDWR)
                up.close()

    def _back(self, up: socket.socket, conn: socket.socket) -> None:
        try:
            while data := up.recv(65536):
                conn.sendall(data)
        except OSError:
            pass

    def stop(self) -> None:
        self._stopped.set()
        self.open.set()
        self._listener.close()
        with self._lock:
            clients = list(self._clients)
        for sock in clients:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@pytest.fixture
def fake() -> Iterator[FakePort]:
    made = FakePort()
    yield made
    made.stop()


@pytest.fixture(scope="module")
def shared() -> RedisServer:
    return shared_server()


@contextlib.contextmanager
def commands_logged(server: RedisServer) -> Iterator[redis.Redis]:
    """An admin client of `server`, which logs every command (its SLOWLOG) until the block
    ends, then goes back to Redis's defaults."""
    with server.admin() as admin:
        admin.config_set("slowlog-log-slower-than", 0)
        admin.config_set("slowlog-max-len", 100000)
        admin.slowlog_reset()
        try:
            yield admin
        finally:
            admin.config_set("slowlog-log-slower-than", 10000)
            admin.config_set("slowlog-max-len", 128)


@pytest.fixture
def slowlog(shared: RedisServer) -> Iterator[redis.Redis]:
    """The shared server, logging every command until the test ends."""
    with commands_logged(shared) as admin:
        yield admin


def tier_on(server: RedisServer, prefix: str, **kwargs: Any) -> RedisTier:
    return RedisTier(resolve_target(server.url(), environ={}), key_prefix=prefix, **kwargs)


def logged(admin: redis.Redis, verb: bytes) -> list[bytes]:
    """The commands of the tier's connections (named kvflow) starting with `verb`, oldest first."""
    entries = admin.slowlog_get(100000)
    return [
        e["command"]
        for e in reversed(entries)
        if e["client_name"] == b"kvflow" and e["command"].split(b" ")[0] == verb
    ]


def open_ones(fake: FakePort) -> list[int]:
    """The connections accepted by `fake` that their client has not closed."""
    return [i for i in range(fake.count()) if not fake.client_closed(i)]


def run_close(tier: RedisTier) -> threading.Thread:
    thread = threading.Thread(target=tier.close, daemon=True)
    thread.start()
    return thread


# -- is_auth_error ---------------------------------------------------------------------------


def chain(depth: int, innermost: BaseException) -> BaseException:
    """`innermost` wrapped `depth` times (each wrapper's __cause__ the one inside)."""
    exc = innermost
    for i in range(depth):
        wrapper = RedisClusterException(f"wrapper {i}")
        wrapper.__cause__ = exc
        exc = wrapper
    return exc


@pytest.mark.parametrize("word", ["WRONGPASS", "NOAUTH", "NOPERM", "invalid password"])
def test_an_error_whose_text_names_a_refused_login_is_an_auth_error(word: str) -> None:
    """A wrapped refusal that only its text tells (no cause kept) is an auth error."""
    exc = RedisClusterException(
        f"Redis Cluster cannot be connected. Please provide at least one reachable node: {word} x"
    )
    assert is_auth_error(exc) is True
    assert is_auth_error(RedisClusterException(f"{word.swapcase()} is no code")) is False


def test_an_auth_error_is_found_through_at_most_8_links_of_causes() -> None:
    """The refusal is seen 7 wrappers deep (the 8th link) but not 8 wrappers deep, whether
    told by its type or by its text."""
    assert is_auth_error(chain(7, AuthenticationError("invalid username-password pair")))
    assert not is_auth_error(chain(8, AuthenticationError("invalid username-password pair")))
    assert is_auth_error(chain(7, redis.ResponseError("WRONGPASS no")))
    assert not is_auth_error(chain(8, redis.ResponseError("WRONGPASS no")))
    context = RedisClusterException("outer")
    context.__context__ = chain(6, redis.ResponseError("NOAUTH needed"))
    assert is_auth_error(context)


def test_a_refused_login_is_named_an_auth_error_through_a_real_server(
    shared: RedisServer,
) -> None:
    """The error Redis answers an unknown user's login with, wrapped six times, is an auth
    error (and a plain connection error is not)."""
    with shared.admin() as admin, pytest.raises(redis.RedisError) as info:
        admin.execute_command("AUTH", "mut-nobody", "wrong")
    assert is_auth_error(chain(6, info.value))
    assert not is_auth_error(chain(1, redis.ConnectionError("refused")))


# -- Link ------------------------------------------------------------------------------------


def _link(
    target: RedisTarget,
    *,
    timeout_s: float = 1.0,
    backoff_s: tuple[float, float] = (0.05, 1.0),
    rejoined: Callable[[], None] = lambda: None,
) -> Link:
    """A single-server link of one pooled connection to `target`."""
    return Link(
        target, cluster=False, timeout_s=timeout_s, pool_size=1, backoff_s=backoff_s,
        stats=RedisStats(), rejoined=rejoined,
    )  # fmt: skip


def test_scrub_keeps_a_text_as_it_is_but_masks_secrets_and_joins_lines() -> None:
    """A text (not an exception) is scrubbed without a type name: secrets masked, one line."""
    link = _link(RedisTarget(host="127.0.0.1", port=1, password=SECRET))
    assert link.scrub(f"login {SECRET} failed\n  twice") == "login *** failed twice"
    assert link.scrub(ValueError(f"bad {SECRET}")) == "ValueError: bad ***"


def test_redis_unreachable_at_start_up_logs_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A tier whose Redis is not there logs exactly one 'unreachable' warning at start-up."""
    caplog.set_level(logging.WARNING, logger="kvflow.tiers.redis")
    port = free_port()
    tier = RedisTier(resolve_target(f"redis://127.0.0.1:{port}/0", environ={}), timeout_s=0.5)
    try:
        warnings = [m for m in messages(caplog, logging.WARNING) if "unreachable" in m]
        assert len(warnings) == 1
        assert warnings[0].startswith(f"L2 Redis redis://127.0.0.1:{port}/0 unreachable (connect: ")
        assert warnings[0].endswith("; calls fail fast until it answers again")
    finally:
        tier.close()


def test_reconnect_attempts_back_off_doubling(fake: FakePort) -> None:
    """Against a port that never answers, the reconnecting PINGs wait 0.05, 0.1, 0.2, 0.4 s
    (each after the previous one timed out): the delay doubles, no faster, no slower."""
    timeout_s = 0.1
    tier = RedisTier(resolve_target(fake.url(), environ={}), timeout_s=timeout_s)
    try:
        wait_for(lambda: fake.count() >= 5, timeout=10)
        times = fake.accepted[:5]
    finally:
        tier.close()
    gaps = [b - a - timeout_s for a, b in itertools.pairwise(times)]
    for gap, delay in zip(gaps, (0.05, 0.1, 0.2, 0.4), strict=True):
        assert gap >= 0.75 * delay, (gaps, delay)  # never faster
    assert gaps[3] < 0.4 + 0.5, gaps  # nor slower (tripling would wait 1.35 s)


def test_reconnecting_reuses_the_client_and_its_idle_connections(shared: RedisServer) -> None:
    """While Redis does not answer, the reconnecting PINGs go through the tier's own client:
    a pooled connection that no call used meanwhile is kept open, not dropped."""
    fake = FakePort(upstream=shared.port)
    fake.open.set()
    tier = RedisTier(
        resolve_target(fake.url(), environ={}), key_prefix="mut-reuse:", timeout_s=1.0, pool_size=2
    )
    try:
        wait_for(lambda: tier.stats()["usage_bytes"] > 0)  # the start-up INFO is done
        fake.open.clear()  # two calls at once: each on a connection of its own
        calls = [tier.contains([key(i)]) for i in (1, 2)]
        wait_for(lambda: len(open_ones(fake)) >= 2)
        fake.open.set()
        assert [answer(c) for c in calls] == [[False], [False]]
        pooled = open_ones(fake)
        fake.open.clear()  # Redis stops answering: one call times out, the link goes down
        assert answer(tier.contains([key(3)])) == [False]
        assert tier.describe()["connected"] is False
        down = fake.count()
        wait_for(lambda: fake.count() > down)  # a reconnecting PING is on its way
        gc.collect()
        assert len([i for i in pooled if not fake.client_closed(i)]) == len(pooled) - 1
        fake.open.set()
        wait_for(lambda: tier.describe()["connected"] is True)
        assert tier.store([(key(4), payload(4))]).result(timeout=10).stored == 1
    finally:
        tier.close()
        fake.stop()
    with shared.admin() as admin:
        admin.delete(tier.redis_key(key(4)))


def test_close_waits_2_timeouts_plus_1_s_for_a_stuck_reconnect(fake: FakePort) -> None:
    """A reconnecting PING whose reply never ends (a byte every 50 ms): close() waits for
    it 2 * timeout_s + 1 seconds, no more, then closes."""
    timeout_s = 1.0  # the mutants' waits (3 * timeout_s + 1, 2 * timeout_s + 2) are 1 s longer
    fake.mode = "refuse"
    tier = RedisTier(resolve_target(fake.url(), environ={}), timeout_s=timeout_s)
    fake.mode = "drip"
    wait_for(lambda: fake.dripping >= 1)
    start = time.monotonic()
    closing = run_close(tier)
    closing.join(timeout=2 * timeout_s + 3)
    took = time.monotonic() - start
    fake.stop()
    closing.join(timeout=10)
    assert 2 * timeout_s + 1 - 0.05 <= took < 2 * timeout_s + 1 + 0.6, took


@pytest.fixture(scope="module")
def cluster_node() -> Iterator[RedisServer]:
    with one_node_cluster() as node:
        yield node


def test_a_cluster_reached_only_while_closing_is_not_joined(cluster_node: RedisServer) -> None:
    """A cluster first reached by the reconnecting thread after close() began: the new
    client is dropped, the reason recorded, and the tier neither connects nor counts a
    reconnect."""
    fake = FakePort(upstream=cluster_node.port)
    try:
        tier = RedisTier(
            resolve_target(fake.url(), environ={}),
            cluster=True,
            key_prefix="mut-closing:",
            timeout_s=0.5,
        )
        assert tier.describe()["connected"] is False
        made = fake.count()
        wait_for(lambda: fake.count() > made)  # the reconnecting thread's client connects
        closing = run_close(tier)
        wait_for(lambda: tier.describe()["closed"] is True)
        fake.open.set()
        closing.join(timeout=10)
        assert not closing.is_alive()
        assert (
            tier.describe()["last_error"] == "reconnect: _Down: the tier closed while reconnecting"
        )
        stats = tier.stats()
        assert stats["reconnects"] == 0 and stats["connected"] == 0
    finally:
        fake.stop()


# -- RedisTier: SCAN and DEL of drop_where -------------------------------------------------


def test_drop_where_scans_its_prefix_1000_keys_a_call(
    shared: RedisServer, slowlog: redis.Redis
) -> None:
    """drop_where's SCAN names the prefix's pattern and COUNT 1000."""
    tier = tier_on(shared, "mut-scan:")
    try:
        answer(tier.store([(key(i), payload(i, 8)) for i in range(3)]))
        assert tier.drop_where(lambda k: True) == 3
        scans = logged(slowlog, b"SCAN")
    finally:
        tier.close()
    assert scans and scans[0] == b"SCAN 0 MATCH mut-scan:* COUNT 1000"
    assert all(s.endswith(b" MATCH mut-scan:* COUNT 1000") for s in scans)


def test_drop_where_deletes_each_1000_keys_before_it_looks_at_the_next(
    shared: RedisServer,
) -> None:
    """With 1001 keys to drop, the first 1000 are deleted before the filter sees the 1001st."""
    prefix = "mut-batch:"
    tier = tier_on(shared, prefix)
    with shared.admin() as admin:
        try:
            for start in range(0, 1001, 500):
                items = [(key(i), payload(i, 8)) for i in range(start, min(1001, start + 500))]
                answer(tier.store(items))
            calls = 0
            left: list[int] = []

            def predicate(_: object) -> bool:
                nonlocal calls
                calls += 1
                if calls == 1001:  # how many keys are left when the 1001st is looked at
                    left.append(len(admin.keys(prefix + "*")))
                return True

            assert tier.drop_where(predicate) == 1001
        finally:
            tier.close()
    assert left == [1]


def test_a_cluster_drop_where_scans_every_master(tmp_path: Path) -> None:
    """On a three-master cluster, drop_where finds and deletes the keys on every master."""
    with running_cluster(tmp_path) as cluster:
        tier = RedisTier(
            resolve_target(cluster.seed_url, environ={}), cluster=True, key_prefix="mut-cdrop:"
        )
        try:
            answer(tier.store([(key(i), payload(i, 8)) for i in range(60)]))
            held = [len(cluster.keys(m, "mut-cdrop:*")) for m in cluster.masters()]
            assert sum(held) == 60 and all(held)
            assert tier.drop_where(lambda k: True) == 60
            assert [len(cluster.keys(m, "mut-cdrop:*")) for m in cluster.masters()] == [0, 0, 0]
        finally:
            tier.close()


# -- RedisTier: INFO -------------------------------------------------------------------------


@pytest.mark.parametrize(("server_fixture", "cluster"), [("shared", False), ("cluster_node", True)])
def test_info_asks_for_the_memory_section_only(
    request: pytest.FixtureRequest, server_fixture: str, cluster: bool
) -> None:
    """The usage and capacity refresh sends `INFO memory` to a single server and to a
    cluster's primaries."""
    server: RedisServer = request.getfixturevalue(server_fixture)
    with commands_logged(server) as admin:
        tier = tier_on(server, f"mut-info-{server_fixture}:", cluster=cluster)
        try:
            wait_for(lambda: tier.stats()["usage_bytes"] > 0)
        finally:
            tier.close()
        infos = logged(admin, b"INFO")
    assert infos and set(infos) == {b"INFO memory"}


# -- RedisTier: pin's bounded lookup ---------------------------------------------------------


def test_pin_of_a_key_that_cannot_be_named_pins_nothing_and_counts_a_failure(
    shared: RedisServer,
) -> None:
    """pin of a malformed key answers 0, counts one lookup failure and records why."""
    tier = tier_on(shared, "mut-pinbad:")
    try:
        bad = ObjectKey(cast(bytes, None), "org/model", 1, 0, None)
        assert tier.pin([bad]) == 0
        assert tier.stats()["lookup_failures"] == 1
        assert tier.describe()["last_error"] == (
            "pin: AttributeError: 'NoneType' object has no attribute 'hex'"
        )
    finally:
        tier.close()


def test_pin_gives_up_after_2_timeouts_plus_1_s_and_cancels_its_lookup(
    shared: RedisServer,
) -> None:
    """A pin whose lookup waits behind a busy I/O thread answers 0 after 2 * timeout_s + 1
    seconds, counts one lookup failure, and its queued lookup never reaches Redis."""
    timeout_s = 1.0  # the mutants' waits (3 * timeout_s + 1, 2 * timeout_s + 2) are 1 s longer
    tier = tier_on(shared, "mut-pinwait:", timeout_s=timeout_s, pool_size=1)
    try:
        answer(tier.store([(key(1), payload(1, 16))]))
        held = HeldFilter()
        with shared.admin() as admin:
            admin.config_resetstat()
            dropping = threading.Thread(target=tier.drop_where, args=(held,), daemon=True)
            dropping.start()
            assert held.entered.wait(10)
            try:
                start = time.monotonic()
                assert tier.pin([key(1)]) == 0
                took = time.monotonic() - start
            finally:
                held.release.set()
            dropping.join(timeout=10)
            assert answer(tier.contains([key(1)])) == [True]  # runs after any queued call
            exists = admin.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)
        assert tier.stats()["lookup_failures"] == 1
        assert exists == 1
        assert 2 * timeout_s + 1 - 0.05 <= took < 2 * timeout_s + 1 + 0.6, took
    finally:
        tier.close()


def test_a_link_is_up_only_once_its_start_up_ping_was_answered(shared: RedisServer) -> None:
    """Before `connect` a link is down; `connect` says whether Redis answered, and the link
    is up (its client handed out) only then."""
    for port, answered in ((shared.port, True), (free_port(), False)):
        link = _link(RedisTarget(host="127.0.0.1", port=port))
        try:
            assert link.connected() is False
            assert link.connect() is answered
            assert link.connected() is answered
            if answered:
                assert link.client() is not None
        finally:
            link.stop()
            link.close()


def test_a_link_that_comes_back_tells_its_owner_once(shared: RedisServer) -> None:
    """A link whose start-up PING went unanswered reconnects in the background and, once
    Redis answers, calls its `rejoined` callback (the tier re-reads INFO there) once."""
    fake = FakePort(upstream=shared.port)  # holds every connection until `open` is set
    calls: list[float] = []
    link = _link(
        RedisTarget(host="127.0.0.1", port=fake.port),
        timeout_s=0.3,
        backoff_s=(0.05, 0.2),
        rejoined=lambda: calls.append(time.monotonic()),
    )
    try:
        assert link.connect() is False
        fake.open.set()
        wait_for(link.connected)
        wait_for(lambda: calls)
    finally:
        link.stop()
        link.close()  # joins the reconnecting thread: no call can follow
        fake.stop()
    assert len(calls) == 1
