"""The Redis tier when Redis fails: stopped mid-run and restarted on the same port,
unreachable at start-up, out of memory under noeviction, hung (SIGSTOP) and resumed.
Each fault is produced on a real redis-server process; nothing may hang or raise out
of a future, every failure is counted, and the tier reconnects by itself."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import pytest
import torch

from kvflow.core.tiers.base import ObjectKey
from kvflow.core.tiers.redis import RedisTier
from kvflow.core.tiers.redis_target import resolve_target
from tests.support.collectors import free_port
from tests.support.redis_servers import RedisServer, redis_server
from tests.support.tiers import HeldFilter

T = TypeVar("T")
TIMEOUT_S = 0.5
#: how late past the tier's timeout a failing call may answer (thread hand-offs, a retry)
SLACK_S = 0.6


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "little"), "org/model", 1, 0, None)


def payload(i: int, nbytes: int = 1024) -> torch.Tensor:
    return torch.full((nbytes,), i % 251, dtype=torch.uint8)


def timed(future: Future[T]) -> tuple[T, float]:
    """The future's result and how long it took to come (never more than 10 s)."""
    start = time.monotonic()
    result = future.result(timeout=10)
    return result, time.monotonic() - start


def wait_for(condition: Callable[[], bool], timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def works(tier: RedisTier, i: int) -> bool:
    """Whether a store and load of key i round-trip now."""
    if tier.store([(key(i), payload(i))]).result(timeout=10).stored != 1:
        return False
    dst = torch.zeros(1024, dtype=torch.uint8)
    return tier.load([key(i)], [dst]).result(timeout=10) == [True] and torch.equal(dst, payload(i))


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as made:
        yield made


def make_tier(server: RedisServer) -> RedisTier:
    return RedisTier(resolve_target(server.url(), environ={}), timeout_s=TIMEOUT_S, pool_size=4)


def test_a_stopped_server_fails_calls_fast_and_a_restart_is_rejoined(server: RedisServer) -> None:
    """With redis-server stopped, contains answers all False within the timeout, stores
    fail and loads miss, all counted; restarted on the same port, the tier reconnects by
    itself (counted) and stores and loads work again."""
    tier = make_tier(server)
    try:
        assert works(tier, 1)
        server.stop()
        keys = [key(i) for i in range(50)]
        got, took = timed(tier.contains(keys))
        assert got == [False] * 50 and took < TIMEOUT_S + SLACK_S
        outcome, took = timed(tier.store([(key(2), payload(2)), (key(3), payload(3))]))
        assert outcome.failed == 2 and took < TIMEOUT_S + SLACK_S
        dst = torch.zeros(1024, dtype=torch.uint8)
        got, took = timed(tier.load([key(1)], [dst]))
        assert got == [False] and took < TIMEOUT_S + SLACK_S
        got, took = timed(tier.contains(keys))  # disconnected now: no network at all
        assert got == [False] * 50 and took < 0.1
        stats = tier.stats()
        assert stats["connected"] == 0 and stats["lookup_failures"] >= 2
        assert stats["store_failures"] == 2 and stats["load_failures"] >= 1
        assert tier.describe()["last_error"]
        time.sleep(0.8)  # down long enough for several reconnect attempts to fail
        assert str(tier.describe()["last_error"]).startswith("reconnect:")
        got, took = timed(tier.contains(keys))
        assert got == [False] * 50 and took < 0.1
        server.start()
        wait_for(lambda: tier.stats()["connected"] == 1)
        assert tier.stats()["reconnects"] == 1
        assert works(tier, 4)
    finally:
        tier.close()


def test_redis_unreachable_at_start_up_is_not_fatal() -> None:
    """A tier whose Redis is not there yet starts disconnected, misses at once, and
    connects when a server appears on its port."""
    port = free_port()
    start = time.monotonic()
    tier = RedisTier(resolve_target(f"redis://127.0.0.1:{port}/0", environ={}), timeout_s=TIMEOUT_S)
    try:
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
        assert tier.stats()["connected"] == 0
        got, took = timed(tier.contains([key(1)]))
        assert got == [False] and took < 0.1
        assert tier.store([(key(1), payload(1))]).result(timeout=1).failed == 1
        with redis_server(port=port):
            wait_for(lambda: tier.stats()["connected"] == 1)
            assert tier.stats()["reconnects"] == 1
            assert works(tier, 2)
    finally:
        tier.close()


def test_maxmemory_noeviction_fails_stores_and_keeps_earlier_keys() -> None:
    """Under maxmemory 2mb with noeviction, stores past the limit fail (OOM), counted,
    while keys stored earlier still load."""
    with redis_server(maxmemory="2mb", policy="noeviction") as server:
        tier = make_tier(server)
        try:
            nbytes = 64 << 10
            items = [(key(i), payload(i, nbytes)) for i in range(40)]  # 2.5 MiB in all
            outcome = tier.store(items).result(timeout=10)
            assert outcome.stored >= 1 and outcome.failed >= 1
            assert outcome.stored + outcome.failed == 40
            assert tier.stats()["store_failures"] == outcome.failed
            assert "OutOfMemoryError" in str(tier.describe()["last_error"])
            held = tier.contains([k for k, _ in items]).result(timeout=10)
            assert sum(held) == outcome.stored
            stored = [k for k, ok in zip([k for k, _ in items], held, strict=True) if ok]
            dsts = [torch.zeros(nbytes, dtype=torch.uint8) for _ in stored]
            assert tier.load(stored, dsts).result(timeout=10) == [True] * len(stored)
            for k, dst in zip(stored, dsts, strict=True):
                assert torch.equal(dst, payload(int.from_bytes(k.chunk_hash, "little"), nbytes))
            assert tier.stats()["connected"] == 1  # OOM is no link failure
            assert tier.store([(key(99), payload(99, nbytes))]).result(timeout=10).failed == 1
        finally:
            tier.close()


def test_a_hung_server_times_out_within_the_timeout_and_recovers(server: RedisServer) -> None:
    """With redis-server stopped by SIGSTOP (connections open, no answers), contains and
    load complete False within about timeout_s and stores fail; after SIGCONT the tier
    reconnects and works again."""
    tier = make_tier(server)
    try:
        assert works(tier, 1)
        server.hang()
        try:
            keys = [key(i) for i in range(20)]
            got, took = timed(tier.contains(keys))
            assert got == [False] * 20 and took < TIMEOUT_S + SLACK_S
            dst = torch.zeros(1024, dtype=torch.uint8)
            got, took = timed(tier.load([key(1)], [dst]))
            assert got == [False] and took < TIMEOUT_S + SLACK_S
            outcome, took = timed(tier.store([(key(5), payload(5))]))
            assert outcome.failed == 1 and took < TIMEOUT_S + SLACK_S
            start = time.monotonic()
            stats = tier.stats()  # never waits on the hung server
            assert time.monotonic() - start < 0.05
            assert stats["connected"] == 0 and stats["lookup_failures"] >= 1
            assert "Timeout" in str(tier.describe()["last_error"])
        finally:
            server.resume()
        wait_for(lambda: tier.stats()["connected"] == 1)
        assert tier.stats()["reconnects"] == 1
        assert works(tier, 6)
        dst = torch.zeros(1024, dtype=torch.uint8)
        assert tier.load([key(1)], [dst]).result(timeout=10) == [True]  # data kept
    finally:
        tier.close()


def test_close_while_hung_is_bounded(server: RedisServer) -> None:
    """close() with calls in flight to a hung server returns within a few timeouts."""
    tier = make_tier(server)
    futures = []
    try:
        server.hang()
        futures = [tier.contains([key(i)]) for i in range(8)]
    finally:
        start = time.monotonic()
        tier.close()
        took = time.monotonic() - start
        server.resume()
    assert took < 3 * TIMEOUT_S + SLACK_S
    assert all(f.result(timeout=0) == [False] for f in futures)


RECONNECTOR = "kvflow-redis-reconnect"


def reconnectors() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == RECONNECTOR]


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    """The Redis tier's own log lines at `level`: a server an earlier test in this process
    stopped may still log from its worker threads, and those lines are not the tier's."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == level and r.name == "kvflow.tiers.redis"
    ]


def test_each_outage_is_logged_named_and_its_rejoin_counted(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An outage logs one warning naming the URL and the failed call, starts one daemon
    reconnecting thread, records why each reconnect attempt failed, counts one lookup
    failure per fast-failed contains, and logs the rejoin; a second outage's rejoin
    makes reconnects 2."""
    caplog.set_level(logging.INFO, logger="kvflow.tiers.redis")
    tier = make_tier(server)
    url = re.escape(server.url())
    try:
        assert works(tier, 1)
        for outage in (1, 2):
            caplog.clear()
            server.stop()
            assert tier.contains([key(1)]).result(timeout=10) == [False]
            assert tier.stats()["connected"] == 0
            [warning] = messages(caplog, logging.WARNING)
            assert re.fullmatch(
                rf"L2 Redis {url} unreachable \((?:contains|info): \w*Error: .+\); "
                "calls fail fast until it answers again",
                warning,
            )
            [thread] = reconnectors()
            assert thread.daemon
            wait_for(lambda: str(tier.describe()["last_error"]).startswith("reconnect: "))
            assert re.match(r"reconnect: \w*Error: \S", str(tier.describe()["last_error"]))
            before = tier.stats()["lookup_failures"]
            assert tier.contains([key(1), key(2)]).result(timeout=10) == [False, False]
            assert tier.stats()["lookup_failures"] == before + 1
            server.start()
            wait_for(lambda: tier.stats()["connected"] == 1)
            assert tier.stats()["reconnects"] == outage
            assert messages(caplog, logging.INFO) == [f"L2 Redis {server.url()} reachable again"]
            assert works(tier, 2)
    finally:
        tier.close()


def test_calls_timing_out_together_start_one_reconnecting_thread(server: RedisServer) -> None:
    """Several calls timing out on a hung server mark the tier down once: one reconnecting
    thread, and the rejoin after the resume counts one reconnect."""
    tier = make_tier(server)
    try:
        assert works(tier, 1)
        server.hang()
        try:
            futures = [tier.contains([key(i)]) for i in range(4)]
            assert all(f.result(timeout=10) == [False] for f in futures)
            assert len(reconnectors()) == 1
        finally:
            server.resume()
        wait_for(lambda: tier.stats()["connected"] == 1 and not reconnectors())
        assert tier.stats()["reconnects"] == 1
    finally:
        tier.close()


def test_an_outage_met_while_closing_is_still_logged(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A call in flight to a hung server when close() starts still reports the outage
    (one warning) when it times out, and no reconnecting thread outlives the close."""
    caplog.set_level(logging.WARNING, logger="kvflow.tiers.redis")
    tier = make_tier(server)
    assert works(tier, 1)
    server.hang()
    try:
        future = tier.contains([key(1)])
        tier.close()
    finally:
        server.resume()
    assert future.result(timeout=0) == [False]
    assert len(messages(caplog, logging.WARNING)) == 1
    assert not reconnectors()


def test_closing_a_disconnected_tier_stops_its_reconnecting_thread() -> None:
    """A tier that never reached Redis has a reconnecting thread; close() ends it."""
    port = free_port()
    tier = RedisTier(resolve_target(f"redis://127.0.0.1:{port}/0", environ={}), timeout_s=TIMEOUT_S)
    assert tier.stats()["connected"] == 0
    assert len(reconnectors()) == 1
    tier.close()
    assert not reconnectors()
    assert tier.stats()["connected"] == 0


def test_close_during_an_outage_with_a_call_in_flight_returns_cleanly(
    server: RedisServer,
) -> None:
    """close() while disconnected (its reconnecting thread running) and with a drop_where
    still busy on an I/O thread: the reconnecting thread stops at once, and close returns
    without error once the busy call ends."""
    tier = make_tier(server)
    held = HeldFilter()
    with ThreadPoolExecutor(2) as outside:
        try:
            assert works(tier, 1)
            dropping = outside.submit(tier.drop_where, held)
            assert held.entered.wait(10)
            server.stop()
            assert tier.contains([key(2)]).result(timeout=10) == [False]
            assert len(reconnectors()) == 1
            closing = outside.submit(tier.close)
            wait_for(lambda: not reconnectors())
        finally:
            held.release.set()
        closing.result(timeout=10)
        assert dropping.result(timeout=10) == 0
    assert tier.stats()["connected"] == 0


def test_a_rejoined_server_is_measured_again_without_a_caller(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Once Redis answers again, the tier reads its memory figures by itself: the first
    stats after the rejoin already give the restarted server's capacity (only a lookup,
    which reads no figures, met the outage)."""
    server.maxmemory = "32mb"
    server.restart()
    tier = make_tier(server)
    try:
        wait_for(lambda: tier.stats()["capacity_bytes"] == 32 << 20)
        server.stop()
        server.maxmemory = "48mb"
        assert tier.contains([key(1)]).result(timeout=10) == [False]  # the outage, noticed
        time.sleep(1.2)  # the figures read last are older than the tier's refresh period
        with caplog.at_level(logging.INFO, logger="kvflow"):
            server.start()
            wait_for(lambda: "reachable again" in caplog.text)
        time.sleep(1.5)  # the refresh the rejoin started has landed (one INFO)
        assert tier.stats()["capacity_bytes"] == 48 << 20
    finally:
        tier.close()
