"""Tenant quotas in L1: a tenant over its limit evicts its own objects first, never a
pinned or in-flight one; limits change live; labels stay bounded and hide salts."""

from __future__ import annotations

import pytest
import torch

from kvflow.core.tiers.base import ObjectKey
from kvflow.core.tiers.hostmem import HostPool
from kvflow.core.tiers.l1 import L1Cache
from kvflow.core.tiers.quota import OTHER, TenantQuotas, parse_quota, parse_quotas, salt_label

KIB = 1024


def _key(i: int, salt: str | None, model: str = "m") -> ObjectKey:
    return ObjectKey(i.to_bytes(8, "little"), model, 1, 0, salt)


def _l1(capacity_kib: int, limits: dict[tuple[str, str], int] | None = None) -> L1Cache:
    return L1Cache(
        capacity_kib * KIB, segment_bytes=16 * KIB, pool=HostPool(pinned=False),
        pin_ahead=False, tenants=TenantQuotas(limits),
    )  # fmt: skip


def _put(l1: L1Cache, key: ObjectKey, fill: int) -> bool:
    outcome = l1.store([(key, torch.full((KIB,), fill, dtype=torch.uint8))]).result()
    return outcome.stored == 1


def _held(l1: L1Cache, keys: list[ObjectKey]) -> int:
    return sum(l1.contains(keys).result())


def test_a_tenant_over_its_limit_evicts_its_own_objects_first() -> None:
    """L1 has room for 64 objects; the noisy salt may hold 8. It stores 100: it keeps
    its 8 newest, and none of the 20 objects of the other tenant is touched."""
    l1 = _l1(64, {("salt", "noisy"): 8 * KIB})
    hot = [_key(i, "hot") for i in range(20)]
    for i, key in enumerate(hot):
        assert _put(l1, key, i)
    noisy = [_key(1000 + i, "noisy") for i in range(100)]
    for key in noisy:
        assert _put(l1, key, 7)
    assert _held(l1, hot) == 20
    assert _held(l1, noisy[-8:]) == 8 and _held(l1, noisy[:-8]) == 0
    rows = {r["tenant"]: r for r in l1.tenant_stats()}
    assert rows[salt_label("noisy")]["usage_bytes"] == 8 * KIB
    assert rows[salt_label("noisy")]["evicted_chunks"] == 92
    assert rows[salt_label("hot")]["evicted_chunks"] == 0


def test_a_tenant_evicts_its_least_recently_read_object() -> None:
    """Reading a limited tenant's oldest object makes it the last of its own to go."""
    l1 = _l1(64, {("model", "small"): 4 * KIB})
    keys = [_key(i, None, "small") for i in range(5)]
    for key in keys[:4]:
        assert _put(l1, key, 1)
    l1.release(l1.pin_prefix([keys[0]]))  # a read refreshes keys[0]
    assert _put(l1, keys[4], 1)
    assert l1.contains(keys).result() == [True, False, True, True, True]


def test_pinned_and_in_flight_objects_are_never_evicted_for_a_quota() -> None:
    """With all of its objects pinned by readers, or one still being written, a tenant at
    its limit gets no room: the new object is refused, nothing held is dropped."""
    l1 = _l1(64, {("salt", "s"): 2 * KIB})
    keys = [_key(i, "s") for i in range(3)]
    assert _put(l1, keys[0], 1) and _put(l1, keys[1], 2)
    pinned = l1.pin_prefix(keys[:2])
    assert not _put(l1, keys[2], 3)
    assert l1.contains(keys).result() == [True, True, False]
    l1.release(pinned)
    # the read refreshed the prefix tail first, so keys[1] is the tenant's LRU object
    plan = l1.prepare_write([keys[2]], KIB)
    assert plan.covered == 1 and l1.contains(keys[:2]).result() == [True, False]
    assert _put(l1, _key(9, "s"), 4)  # evicts keys[0]: keys[2], being written, stays
    l1.commit(plan)
    assert l1.contains([keys[0], keys[2], _key(9, "s")]).result() == [False, True, True]


def test_an_object_counts_against_its_salt_and_its_model() -> None:
    """The model limit binds a salted object too: salts of one model share it."""
    l1 = _l1(64, {("model", "m"): 3 * KIB})
    for i, salt in enumerate(("a", "b", "a", "b", "a")):
        assert _put(l1, _key(i, salt), i)
    assert _held(l1, [_key(i, s) for i, s in enumerate(("a", "b", "a", "b", "a"))]) == 3


def test_a_lowered_limit_evicts_now_and_a_removed_one_frees_the_tenant() -> None:
    """set_quota evicts the tenant's LRU objects at once down to the new limit; with the
    limit removed the tenant shares L1 like any other."""
    l1 = _l1(64)
    keys = [_key(i, "t") for i in range(10)]
    for key in keys:
        assert _put(l1, key, 1)
    outcome = l1.set_quota(("salt", "t"), 4 * KIB)
    assert outcome == {"usage_bytes": 4 * KIB, "evicted_chunks": 6}
    assert l1.contains(keys).result() == [False] * 6 + [True] * 4
    l1.set_quota(("salt", "t"), None)
    for key in keys[:6]:
        assert _put(l1, key, 1)
    assert _held(l1, keys) == 10


def test_labels_hide_salts_and_stay_bounded() -> None:
    """A salt appears only as its hash label; past max_tracked names of a kind, new
    tenants are counted under 'other'."""
    quotas = TenantQuotas(max_tracked=2)
    for model in ("m1", "m2", "m3", "m4"):
        quotas.record_lookup(model, "secret-salt", 512, 256)
    rows = {(r["kind"], r["tenant"]): r for r in quotas.snapshot()}
    assert set(rows) == {
        ("model", "m1"), ("model", "m2"), ("model", OTHER), ("salt", salt_label("secret-salt"))
    }  # fmt: skip
    assert rows[("model", OTHER)]["requested_tokens"] == 1024
    assert rows[("salt", salt_label("secret-salt"))]["hit_tokens"] == 1024
    assert "secret-salt" not in repr(quotas.snapshot())


def test_quota_entries_are_checked() -> None:
    assert parse_quota("salt:team=a=1.5") == (("salt", "team=a"), int(1.5 * (1 << 30)))
    assert parse_quotas(["model:llama=2"]) == {("model", "llama"): 2 << 30}
    for bad in ("team=1", "user:x=1", "salt:=1", "salt:x=0", "salt:x=big", "model:y=inf"):
        with pytest.raises(ValueError, match="--l1-quota"):
            parse_quota(bad)
    with pytest.raises(ValueError, match="twice"):
        parse_quotas(["salt:x=1", "salt:x=2"])
