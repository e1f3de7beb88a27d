"""The errors the Redis tier gets past without failing a call of its own: a `pin` whose
lookup has no answer in time (on a real redis-server), a key whose slot has no cluster
node and a slot map that cannot be re-read (on `ClusterNodes` with a scripted client).
Each is counted where the tier counts such a failure, becomes `last_error`, and is
logged once as a warning (later ones of its kind at debug level)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from kvflow.core.tiers import redisnodes
from kvflow.core.tiers.redis import RedisTier
from kvflow.core.tiers.redis_target import resolve_target
from kvflow.core.tiers.redislink import _Down
from kvflow.core.tiers.redisnodes import ClusterNodes
from kvflow.core.tiers.redisstats import RedisStats
from tests.core.tiers import test_redis
from tests.core.tiers.test_redis import PREFIX, answer, key, payload
from tests.core.tiers.test_redis_faults import messages
from tests.support.redis_servers import RedisServer
from tests.support.tiers import HeldFilter

server = test_redis.server  # the fixture: the shared server, emptied

LATER = "; later ones are logged at debug level"


def test_a_pin_without_an_answer_in_time_counts_one_lookup_failure_and_logs_once(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """With the tier's one I/O thread kept busy, a pin's lookup waits in the queue: after
    2 * timeout_s + 1 the pin answers 0, the lookup (cancelled, so never run) counts one
    lookup failure, last_error says why, and only the first such pin logs a warning."""
    caplog.set_level(logging.DEBUG, logger="kvflow.tiers.redis")
    target = resolve_target(server.url(), environ={})
    tier = RedisTier(target, key_prefix=PREFIX, timeout_s=0.1, pool_size=1)
    held = HeldFilter()
    try:
        assert answer(tier.store([(key(1), payload(1, 64))])).stored == 1
        busy = threading.Thread(target=tier.drop_where, args=(held,), daemon=True)
        busy.start()
        assert held.entered.wait(10)
        before = tier.stats()["lookup_failures"]
        for n in (1, 2):
            assert tier.pin([key(1)]) == 0
            assert tier.stats()["lookup_failures"] == before + n
            assert tier.describe()["last_error"] == "pin: TimeoutError:"
        assert messages(caplog, logging.WARNING) == [
            f"L2 Redis pin: no answer (pin: TimeoutError:){LATER}"
        ]
        assert "L2 Redis pin: no answer (pin: TimeoutError:)" in messages(caplog, logging.DEBUG)
        held.release.set()
        busy.join(10)
        assert tier.pin([key(1)]) == 1
        assert tier.stats()["lookup_failures"] == before + 2
    finally:
        held.release.set()
        tier.close()


class _Node:
    def __init__(self, name: str) -> None:
        self.name = name


class _Pipe:
    """Queues commands; `execute` answers each with True, or raises `fail` if set."""

    def __init__(self, fail: BaseException | None) -> None:
        self.queued = 0
        self.fail = fail

    def exists(self, _: bytes) -> None:
        self.queued += 1

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        if self.fail is not None:
            raise self.fail
        return [True] * self.queued


class _NodesManager:
    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.reads = 0

    def initialize(self) -> None:
        self.reads += 1
        if self.error is not None:
            raise self.error


class _Cluster:
    """A scripted cluster client: every key on node "n1" except those in `no_node`; its
    pipelines raise `fail` while set."""

    def __init__(self) -> None:
        self.no_node: set[bytes] = set()
        self.fail: BaseException | None = None
        self.nodes_manager = _NodesManager()

    def get_node_from_key(self, name: bytes) -> _Node:
        if name in self.no_node:
            raise redis.exceptions.SlotNotCoveredError(f"slot of {name!r} is not covered")
        return _Node("n1")

    def pipeline(self) -> _Pipe:
        return _Pipe(self.fail)


def _nodes(stats: RedisStats) -> ClusterNodes:
    """ClusterNodes without backoff: a failed node is tried again on the next call."""

    def scrub(exc: BaseException | str) -> str:
        return exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"

    return ClusterNodes(backoff_s=(0.0, 0.0), stats=stats, scrub=scrub)


def _exists(names: Sequence[bytes]) -> Callable[[Any, int], None]:
    return lambda pipe, i: pipe.exists(names[i])


def test_a_key_whose_slot_has_no_node_fails_fast_and_its_error_is_recorded_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvflow.tiers.redis")
    stats, client = RedisStats(), _Cluster()
    nodes = _nodes(stats)
    names = [b"a", b"b", b"c"]
    client.no_node = {b"b"}
    for _ in range(2):
        replies = nodes.execute(client, names, _exists(names))
        assert replies[0] is True and replies[2] is True
        assert isinstance(replies[1], _Down)
        assert str(replies[1]) == "cluster node (no node for the slot) is down"
    error = "SlotNotCoveredError: slot of b'b' is not covered"
    assert stats.last_error == f"cluster slot lookup: {error}"
    assert messages(caplog, logging.WARNING) == [
        f"L2 Redis cluster: no node for a key's slot (cluster slot lookup: {error}){LATER}"
    ]


def test_a_slot_map_not_re_read_is_recorded_and_logged_once_and_the_node_still_tried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvflow.tiers.redis")
    stats, client = RedisStats(), _Cluster()
    nodes = _nodes(stats)
    names = [b"a"]
    client.fail = redis.ConnectionError("n1 is gone")
    assert isinstance(nodes.execute(client, names, _exists(names))[0], redis.ConnectionError)
    assert stats.last_error == "cluster node n1: ConnectionError: n1 is gone"
    client.nodes_manager.error = redis.exceptions.RedisClusterException("no seed answers")
    for _ in range(2):  # the node's backoff (0) is over: the map is re-read, and fails
        assert isinstance(nodes.execute(client, names, _exists(names))[0], redis.ConnectionError)
    assert client.nodes_manager.reads == 2
    assert stats.last_error == "cluster node n1: ConnectionError: n1 is gone"
    client.fail = None
    assert nodes.execute(client, names, _exists(names)) == [True]  # tried with the old map
    assert stats.last_error == "cluster slot map: RedisClusterException: no seed answers"
    assert nodes.rejoins() == 1
    assert messages(caplog, logging.WARNING) == [
        "L2 Redis cluster node n1 unreachable; its keys miss until it answers",
        "L2 Redis cluster: re-reading the slot map failed (cluster slot map: "
        f"RedisClusterException: no seed answers){LATER}",
    ]


def test_a_down_nodes_backoff_doubles_to_its_cap_and_starts_over_once_it_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node that fails is skipped (its keys fail fast, no pipeline) until exactly its
    backoff has passed: 1, 2, 4 s, then the 5 s cap; once it answers, the next outage
    backs off from 1 s again."""
    now = [100.0]
    monkeypatch.setattr(redisnodes, "time", SimpleNamespace(monotonic=lambda: now[0]))
    client = _Cluster()
    nodes = ClusterNodes(backoff_s=(1.0, 5.0), stats=RedisStats(), scrub=str)
    names = [b"a"]

    def tried() -> bool:
        """Whether a call reached the node (rather than failing fast in its backoff)."""
        return not isinstance(nodes.execute(client, names, _exists(names))[0], _Down)

    client.fail = redis.ConnectionError("n1 is gone")
    assert tried()
    for delay in (1.0, 2.0, 4.0, 5.0, 5.0):
        failed_at = now[0]
        now[0] = failed_at + delay - 0.001
        assert not tried(), delay
        now[0] = failed_at + delay
        assert tried(), delay  # and fails again: the next delay
    client.fail = None
    now[0] += 5.0
    assert tried() and nodes.rejoins() == 1
    client.fail = redis.ConnectionError("n1 is gone again")
    failed_at = now[0]
    assert tried()
    now[0] = failed_at + 0.999
    assert not tried()
    now[0] = failed_at + 1.0
    assert tried()
