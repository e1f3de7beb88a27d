"""The storage-tier contract (kvflow.core.tiers.base), checked through the interface alone.

Every tier is listed in TIERS; the disk and Redis tiers join it with a factory of their
own. Each factory makes a tier that holds exactly four 1 KiB objects, except where a
tier declares in its `cannot` mapping (behaviour -> reason) that it cannot by nature:
the Redis tier's capacity and eviction are Redis's own (maxmemory), so the tests of
the four-object capacity skip for it, saying why.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import pytest
import torch

from kvflow.core.tiers.base import HostTier, ObjectKey, StorageTier, StoreOutcome
from kvflow.core.tiers.disk import DiskTier
from kvflow.core.tiers.hostmem import HostPool
from kvflow.core.tiers.l1 import L1Cache

NBYTES = 1024
CAPACITY_OBJECTS = 4
T = TypeVar("T")


def _l1() -> StorageTier:
    return L1Cache(CAPACITY_OBJECTS * NBYTES, pool=HostPool(pinned=False))


def _disk() -> StorageTier:
    root = tempfile.mkdtemp(prefix="kvflow-contract-disk-")
    made = DiskTier([root], CAPACITY_OBJECTS * NBYTES)
    weakref.finalize(made, shutil.rmtree, root, ignore_errors=True)
    return made


def _redis() -> StorageTier:
    """A Redis tier on this test process's shared redis-server, flushed for each test."""
    from kvflow.core.tiers.redis import RedisTier
    from kvflow.core.tiers.redis_target import resolve_target
    from tests.support.redis_servers import shared_server

    server = shared_server()
    server.flush()
    return RedisTier(resolve_target(server.url(), environ={}), timeout_s=2.0, pool_size=2)


TIERS: dict[str, Callable[[], StorageTier]] = {"l1": _l1, "disk": _disk, "redis": _redis}


@pytest.fixture(params=sorted(TIERS))
def tier(request: pytest.FixtureRequest) -> StorageTier:
    made = TIERS[request.param]()
    request.addfinalizer(made.close)
    return made


def able(tier: StorageTier, behaviour: str) -> bool:
    """Whether the tier offers `behaviour` (it lists those it cannot in `cannot`)."""
    return behaviour not in getattr(tier, "cannot", {})


def require(tier: StorageTier, behaviour: str) -> None:
    """Skip the test, with the tier's reason, when the tier cannot offer `behaviour`."""
    reason = getattr(tier, "cannot", {}).get(behaviour)
    if reason:
        pytest.skip(f"the {tier.name} tier cannot: {reason}")


def key(i: int, model: str = "m") -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "little"), model, 1, 0, None)


def payload(i: int, nbytes: int = NBYTES) -> torch.Tensor:
    return torch.full((nbytes,), i % 251, dtype=torch.uint8)


def answer(future: Future[T], timeout: float = 10.0) -> T:
    """The future's result within a bound: the contract says calls never block."""
    assert isinstance(future, Future)
    return future.result(timeout=timeout)


def test_every_tier_implements_the_interface(tier: StorageTier) -> None:
    """A tier is a StorageTier; L1 is also the HostTier movers copy into."""
    assert isinstance(tier, StorageTier)
    assert tier.name in TIERS
    if tier.name == "l1":
        assert isinstance(tier, HostTier)


def test_stored_bytes_come_back_and_are_counted(tier: StorageTier) -> None:
    """store -> contains -> load returns the same bytes; stats count them."""
    outcome = answer(tier.store([(key(1), payload(1)), (key(2), payload(2))]))
    assert outcome == StoreOutcome(stored=2)
    assert answer(tier.contains([key(2), key(3), key(1)])) == [True, False, True]
    dsts = [torch.zeros(NBYTES, dtype=torch.uint8) for _ in range(3)]
    assert answer(tier.load([key(1), key(3), key(2)], dsts)) == [True, False, True]
    assert torch.equal(dsts[0], payload(1)) and torch.equal(dsts[2], payload(2))
    assert not dsts[1].any()  # a miss writes nothing
    stats = tier.stats()
    assert stats["objects"] == 2 and stats["usage_bytes"] >= 2 * NBYTES
    if able(tier, "capacity"):
        assert stats["capacity_bytes"] == CAPACITY_OBJECTS * NBYTES


def test_a_held_key_is_not_written_again(tier: StorageTier) -> None:
    """Storing a key the tier holds leaves its first bytes and counts it present."""
    answer(tier.store([(key(1), payload(1))]))
    assert answer(tier.store([(key(1), payload(9))])) == StoreOutcome(present=1)
    dst = torch.zeros(NBYTES, dtype=torch.uint8)
    assert answer(tier.load([key(1)], [dst])) == [True]
    assert torch.equal(dst, payload(1))


def test_capacity_evicts_least_recently_used_and_reports_it(tier: StorageTier) -> None:
    """Past capacity the least recently used object goes; the store outcome says so."""
    require(tier, "lru_eviction")
    answer(tier.store([(key(i), payload(i)) for i in range(4)]))
    answer(tier.load([key(0)], [torch.empty(NBYTES, dtype=torch.uint8)]))  # 0 is now recent
    outcome = answer(tier.store([(key(4), payload(4))]))
    assert isinstance(outcome, StoreOutcome)
    assert (outcome.stored, outcome.evicted_chunks, outcome.evicted_bytes) == (1, 1, NBYTES)
    assert answer(tier.contains([key(i) for i in range(5)])) == [True, False, True, True, True]
    assert tier.stats()["evicted_chunks"] == 1


def test_pinned_objects_survive_eviction_until_unpinned(tier: StorageTier) -> None:
    """pin holds the held prefix against eviction; a store with no room left fails whole
    for that key and is counted; after unpin the objects can go."""
    require(tier, "lru_eviction")
    answer(tier.store([(key(i), payload(i)) for i in range(4)]))
    assert tier.pin([key(0), key(1), key(2), key(3), key(7)]) == 4  # stops at the miss
    outcome = answer(tier.store([(key(5), payload(5))]))
    assert outcome == StoreOutcome(failed=1)
    assert answer(tier.contains([key(5)])) == [False]  # nothing half-written is visible
    tier.unpin([key(0), key(1), key(2), key(3)])
    assert answer(tier.store([(key(5), payload(5))])).stored == 1
    with pytest.raises(ValueError, match="not pinned"):
        tier.unpin([key(5)])


def test_pin_counts_the_held_prefix_and_unpin_undoes_it(tier: StorageTier) -> None:
    """pin answers the length of the held prefix of keys; unpin undoes exactly that and
    refuses a key not pinned."""
    answer(tier.store([(key(i), payload(i)) for i in range(3)]))
    assert tier.pin([key(0), key(1), key(7), key(2)]) == 2
    assert tier.pin([key(7), key(0)]) == 0
    tier.unpin([key(0), key(1)])
    with pytest.raises(ValueError, match="not pinned"):
        tier.unpin([key(0)])
    with pytest.raises(ValueError, match="not pinned"):
        tier.unpin([key(2)])


def test_a_key_pinned_twice_stays_pinned_until_unpinned_twice(tier: StorageTier) -> None:
    """Pins count: after one of two unpins the key is still pinned, after both it is not."""
    answer(tier.store([(key(1), payload(1))]))
    assert tier.pin([key(1)]) == 1
    assert tier.pin([key(1)]) == 1
    tier.unpin([key(1)])
    tier.unpin([key(1)])  # the second pin is still there to undo
    with pytest.raises(ValueError, match="not pinned"):
        tier.unpin([key(1)])


def test_bad_buffers_are_refused_before_anything_is_written(tier: StorageTier) -> None:
    """A store with one bad buffer raises ValueError naming it and writes none of them."""
    bad = torch.zeros(NBYTES, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"\[1\] must be a 1-D uint8 CPU tensor"):
        tier.store([(key(1), payload(1)), (key(2), bad)])
    assert answer(tier.contains([key(1), key(2)])) == [False, False]
    with pytest.raises(ValueError, match="one destination per key"):
        tier.load([key(1)], [])


def test_a_destination_of_another_size_is_a_miss(tier: StorageTier) -> None:
    """Loading into a buffer of the wrong size answers False and leaves it untouched."""
    answer(tier.store([(key(1), payload(1))]))
    small = torch.zeros(NBYTES // 2, dtype=torch.uint8)
    assert answer(tier.load([key(1)], [small])) == [False]
    assert not small.any()


def test_drop_where_and_close_forget_objects(tier: StorageTier) -> None:
    """drop_where removes the matching unpinned objects; close forgets the rest."""
    answer(tier.store([(key(1, "a"), payload(1)), (key(2, "b"), payload(2))]))
    assert tier.drop_where(lambda k: k.model_name == "a") == 1
    assert answer(tier.contains([key(1, "a"), key(2, "b")])) == [False, True]
    tier.close()
    assert tier.stats()["objects"] == 0
