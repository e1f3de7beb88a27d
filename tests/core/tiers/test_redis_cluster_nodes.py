"""The Redis tier's bookkeeping of one cluster node at a time, on a real three-master
Redis Cluster: a node that fails is skipped (its keys fail without network I/O) for its
backoff, even once it answers again, while the other masters serve and the tier stays
connected; its outage is logged once, by name; each return of a node counts one
reconnect; an error reply fails only its own key; describe lists the nodes."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from kvflow.core.tiers import redis as redis_tier
from kvflow.core.tiers.base import StoreOutcome
from kvflow.core.tiers.redis import RedisTier
from tests.core.tiers import test_redis_cluster
from tests.core.tiers.test_redis_cluster import (
    NBYTES,
    _split_by_node,
    answer,
    key,
    make_tier,
    payload,
    store_all,
)
from tests.core.tiers.test_redis_faults import messages
from tests.support.redis_cluster import ClusterNode, RedisCluster, running_cluster

N = 60  # objects per test: some on every master


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A cluster of its own (its masters are killed and restarted)."""
    with running_cluster(tmp_path_factory.mktemp("cluster")) as made:
        yield made


tiers = test_redis_cluster.tiers  # each test's tiers, closed after it


def set_backoff(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """A failed node's backoff: `seconds` every time (0: every call tries it again)."""
    monkeypatch.setattr(redis_tier, "RECONNECT_FIRST_S", 2 * seconds)
    monkeypatch.setattr(redis_tier, "RECONNECT_CAP_S", seconds)


def outage_warning(node: ClusterNode) -> str:
    return f"L2 Redis cluster node {node.address} unreachable; its keys miss until it answers"


def held_mask(tier: RedisTier, ids: Sequence[int]) -> list[bool]:
    got: list[bool] = answer(tier.contains([key(i) for i in ids]))
    return got


def answered_without_failure(tier: RedisTier, ids: Sequence[int]) -> list[bool]:
    """contains(ids), asked until it counts no lookup failure (a restarted node is
    reached again), for at most 15 s."""
    deadline = time.monotonic() + 15
    while True:
        before = tier.stats()["lookup_failures"]
        held = held_mask(tier, ids)
        if tier.stats()["lookup_failures"] == before:
            return held
        assert time.monotonic() < deadline, "the restarted node was not reached again"
        time.sleep(0.05)


def test_a_failed_node_is_skipped_for_its_backoff_even_once_it_answers_again(
    cluster: RedisCluster,
    tiers: list[RedisTier],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    set_backoff(monkeypatch, 60.0)
    caplog.set_level(logging.WARNING, logger="kvflow.tiers.redis")
    tier = make_tier(tiers, cluster.seed_url)
    ids = list(range(N))
    store_all(tier, ids)
    victim = cluster.masters()[1]
    on_victim, elsewhere = _split_by_node(cluster, tier, victim, ids)
    assert on_victim and elsewhere

    cluster.kill(victim)
    assert held_mask(tier, ids) == [i in elsewhere for i in ids]
    assert messages(caplog, logging.WARNING) == [outage_warning(victim)]
    dsts = [torch.zeros(NBYTES, dtype=torch.uint8) for _ in on_victim]
    assert answer(tier.load([key(i) for i in on_victim], dsts)) == [False] * len(on_victim)
    assert tier.describe()["last_error"] == f"load: _Down: cluster node {victim.address} is down"

    cluster.restart(victim)
    outcome = answer(tier.store([(key(i), payload(i)) for i in on_victim]))
    assert outcome == StoreOutcome(failed=len(on_victim))
    assert cluster.dbsize(victim) == 0  # nothing was sent to it
    assert held_mask(tier, ids) == [i in elsewhere for i in ids]
    stats = tier.stats()
    assert (stats["connected"], stats["reconnects"], stats["lookup_failures"]) == (1, 0, 2)
    assert messages(caplog, logging.WARNING) == [outage_warning(victim)]


def test_each_return_of_a_failed_node_counts_one_reconnect(
    cluster: RedisCluster,
    tiers: list[RedisTier],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    set_backoff(monkeypatch, 0.0)
    caplog.set_level(logging.WARNING, logger="kvflow.tiers.redis")
    tier = make_tier(tiers, cluster.seed_url)
    assert tier.describe()["nodes"] == sorted(f"{m.address} primary" for m in cluster.masters())
    ids = list(range(N))
    store_all(tier, ids)
    victim = cluster.masters()[2]
    on_victim, elsewhere = _split_by_node(cluster, tier, victim, ids)
    assert len(on_victim) >= 2 and elsewhere

    wrong = tier.redis_key(key(on_victim[0]))  # another client's list under one key
    cluster.cmd(victim, "DEL", wrong)
    cluster.cmd(victim, "RPUSH", wrong, b"x")
    dsts = [torch.zeros(NBYTES, dtype=torch.uint8) for _ in on_victim]
    got = answer(tier.load([key(i) for i in on_victim], dsts))
    assert got == [False] + [True] * (len(on_victim) - 1)

    for outage in (1, 2):
        caplog.clear()
        cluster.kill(victim)
        for _ in range(2):  # no backoff: each call tries the node again, and fails it
            assert held_mask(tier, ids) == [i in elsewhere for i in ids]
        assert messages(caplog, logging.WARNING) == [outage_warning(victim)]
        cluster.restart(victim)
        assert answered_without_failure(tier, ids) == [i in elsewhere for i in ids]
        assert tier.stats()["reconnects"] == outage
        store_all(tier, on_victim)
        assert tier.stats()["reconnects"] == outage
    assert tier.stats()["connected"] == 1
