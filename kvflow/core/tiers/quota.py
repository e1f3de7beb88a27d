"""Tenant byte quotas in L1: a tenant is a cache_salt or a model name (docs/OPERATIONS.md).

`TenantQuotas` keeps, for L1 and under L1's lock, the bytes each tenant's objects
take, and for each tenant with a limit its own LRU order: before L1 allocates an
object for a key whose tenant would go over its limit, that tenant's own least
recently used objects are evicted (never one pinned by a reader or being written).
Tenants without a limit share what the limited ones leave. An object belongs to its
salt tenant (when it has a salt) and to its model tenant; both limits apply.

Per-tenant usage, evictions and lookup hits are reported under bounded labels:
models by name, salts by a short hash of the salt (`salt_label`: a salt may be a
secret, so it never appears in metrics, status, events or logs), and once
`max_tracked` names of a kind are known, later ones under "other".
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Literal

TenantKind = Literal["salt", "model"]
TENANT_KINDS: tuple[TenantKind, ...] = ("salt", "model")
#: (kind, name): a cache_salt or a model name
Tenant = tuple[str, str]
#: the label of tenants beyond the bound
OTHER = "other"
GIB = 1 << 30


def tenants_of(key: Hashable) -> tuple[Tenant, ...]:
    """The tenants an L1 key belongs to: (salt, S) when it has salt S, and (model, M).

    Keys are `ObjectKey`s or tuples laid out like them (hash, model, world, rank, salt);
    any other key belongs to no tenant.
    """
    if not isinstance(key, tuple) or len(key) != 5:
        return ()
    model, salt = key[1], key[4]
    if salt is None:
        return (("model", model),)
    return (("salt", salt), ("model", model))


def parse_quota(text: str) -> tuple[Tenant, int]:
    """`salt:NAME=GIB` or `model:NAME=GIB` as ((kind, name), bytes); ValueError otherwise.

    The name is everything between the first ':' and the last '='.
    """
    kind, colon, rest = text.partition(":")
    name, eq, size = rest.rpartition("=")
    if not colon or not eq or kind not in TENANT_KINDS or not name:
        raise ValueError(
            f"--l1-quota entries look like salt:NAME=GIB or model:NAME=GIB, got {text!r}"
        )
    try:
        gib = float(size)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise ValueError(f"--l1-quota {kind}:{name} needs a size in GiB > 0, got {size!r}")
    return (kind, name), int(gib * GIB)


def parse_quotas(entries: Iterable[str]) -> dict[Tenant, int]:
    """Every `parse_quota` entry; a tenant listed twice is a ValueError."""
    limits: dict[Tenant, int] = {}
    for entry in entries:
        tenant, nbytes = parse_quota(entry)
        if tenant in limits:
            raise ValueError(f"--l1-quota lists {tenant[0]}:{tenant[1]} twice")
        limits[tenant] = nbytes
    return limits


def salt_label(salt: str) -> str:
    """A salt's stand-in in labels: never the salt itself."""
    return "salt-" + hashlib.blake2s(salt.encode("utf-8", "surrogatepass")).hexdigest()[:12]


class TenantQuotas:
    """Usage, limits and own-LRU order per tenant. Every method but `record_lookup` and
    `snapshot` runs under the L1 lock (L1 calls them); those two take their own lock."""

    def __init__(self, limits: Mapping[Tenant, int] | None = None, max_tracked: int = 256):
        self.limits: dict[Tenant, int] = {}
        self._usage: dict[Tenant, int] = {}
        self._objects: dict[Tenant, int] = {}
        self._evicted: dict[Tenant, int] = {}
        #: each limited tenant's objects, least recently used first
        self._order: dict[Tenant, OrderedDict[Hashable, Any]] = {}
        self._max_tracked = max_tracked
        self._labels: dict[Tenant, str] = {}
        self._label_counts: dict[str, int] = dict.fromkeys(TENANT_KINDS, 0)
        self._hits: dict[str, list[int]] = {}  # label -> [requested, hit] tokens
        self._hits_lock = threading.Lock()
        for tenant, nbytes in (limits or {}).items():
            self.set_limit(tenant, nbytes, ())

    @property
    def limited(self) -> bool:
        """Whether any tenant has a limit (L1 skips the quota path otherwise)."""
        return bool(self.limits)

    # -- bookkeeping, under L1's lock -----------------------------------------------------

    def added(self, obj: Any) -> None:
        """A new object (being written or ready) takes `obj.size` bytes."""
        for tenant in tenants_of(obj.key):
            self._usage[tenant] = self._usage.get(tenant, 0) + obj.size
            self._objects[tenant] = self._objects.get(tenant, 0) + 1
            order = self._order.get(tenant)
            if order is not None:
                order[obj.key] = obj

    def removed(self, obj: Any, *, evicted: bool) -> None:
        """`obj` left L1 (evicted for room when `evicted`, else dropped or aborted)."""
        for tenant in tenants_of(obj.key):
            left = self._usage.get(tenant, 0) - obj.size
            if left > 0:
                self._usage[tenant] = left
                self._objects[tenant] -= 1
            else:
                self._usage.pop(tenant, None)
                self._objects.pop(tenant, None)
            if evicted:
                self._evicted[tenant] = self._evicted.get(tenant, 0) + 1
            order = self._order.get(tenant)
            if order is not None:
                order.pop(obj.key, None)

    def touched(self, obj: Any) -> None:
        """`obj` was read: it becomes its limited tenants' most recently used."""
        for tenant in tenants_of(obj.key):
            order = self._order.get(tenant)
            if order is not None and obj.key in order:
                order.move_to_end(obj.key)

    def make_room(self, key: Hashable, size: int, evict: Callable[[Any], None]) -> bool:
        """Evict the LRU objects of `key`'s limited tenants until `size` more bytes fit in
        each limit, calling `evict(obj)` for each; False when pinned or in-flight objects
        (or a limit below `size`) leave no room."""
        return all(self.shed(tenant, evict, size) for tenant in tenants_of(key))

    def shed(self, tenant: Tenant, evict: Callable[[Any], None], size: int = 0) -> bool:
        """Evict `tenant`'s own LRU objects (readable, unpinned) until `size` more bytes
        fit in its limit; False when no such object is left first (True: no limit)."""
        limit = self.limits.get(tenant)
        if limit is None:
            return True
        order = self._order[tenant]
        while self._usage.get(tenant, 0) + size > limit:
            victim = next((o for o in order.values() if o.ready and o.pins == 0), None)
            if victim is None:
                return False
            evict(victim)
        return True

    def usage(self, tenant: Tenant) -> int:
        """Bytes `tenant`'s objects take in L1."""
        return self._usage.get(tenant, 0)

    def set_limit(self, tenant: Tenant, nbytes: int | None, objects: Iterable[Any]) -> None:
        """Give `tenant` a limit of `nbytes` (None: no limit). `objects` are L1's objects,
        least recently used first, to build the tenant's own order from."""
        if tenant[0] not in TENANT_KINDS or not isinstance(tenant[1], str) or not tenant[1]:
            raise ValueError(f"a tenant is ('salt' or 'model', non-empty name), got {tenant!r}")
        if nbytes is None:
            self.limits.pop(tenant, None)
            self._order.pop(tenant, None)
            return
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"a tenant limit is a number of bytes > 0, got {nbytes!r}")
        if tenant not in self._order:
            self._order[tenant] = OrderedDict(
                (o.key, o) for o in objects if tenant in tenants_of(o.key)
            )
        self.limits[tenant] = nbytes

    # -- reporting ---------------------------------------------------------------------------

    def label(self, tenant: Tenant) -> str:
        """The tenant's bounded label: see the module docstring."""
        known = self._labels.get(tenant)
        if known is not None:
            return known
        kind, name = tenant
        text = salt_label(name) if kind == "salt" else name
        if self._label_counts[kind] >= self._max_tracked:
            return OTHER
        self._label_counts[kind] += 1
        self._labels[tenant] = text
        return text

    def record_lookup(self, model: str, salt: str | None, requested: int, hit: int) -> None:
        """Count one lookup's requested and hit tokens for its tenants (any thread)."""
        tenants: list[Tenant] = [("model", model)]
        if salt is not None:
            tenants.append(("salt", salt))
        with self._hits_lock:
            for tenant in tenants:
                counts = self._hits.setdefault(f"{tenant[0]}:{self.label(tenant)}", [0, 0])
                counts[0] += requested
                counts[1] += hit

    def snapshot(self) -> list[dict[str, Any]]:
        """One row per tenant label: kind, tenant, usage_bytes, objects, limit_bytes,
        evicted_chunks, lookup requested/hit tokens (labels already bounded)."""
        rows: dict[tuple[str, str], dict[str, Any]] = {}

        def row(kind: str, label: str) -> dict[str, Any]:
            return rows.setdefault(
                (kind, label),
                {"kind": kind, "tenant": label, "usage_bytes": 0, "objects": 0,
                 "limit_bytes": None, "evicted_chunks": 0, "requested_tokens": 0,
                 "hit_tokens": 0},
            )  # fmt: skip

        with self._hits_lock:
            tenants = set(self._usage) | set(self.limits) | set(self._evicted)
            for tenant in tenants:
                r = row(tenant[0], self.label(tenant))
                r["usage_bytes"] += self._usage.get(tenant, 0)
                r["objects"] += self._objects.get(tenant, 0)
                r["evicted_chunks"] += self._evicted.get(tenant, 0)
                if tenant in self.limits:
                    r["limit_bytes"] = self.limits[tenant]
            for key, (requested, hit) in self._hits.items():
                kind, _, label = key.partition(":")
                r = row(kind, label)
                r["requested_tokens"] += requested
                r["hit_tokens"] += hit
        return sorted(rows.values(), key=lambda r: (r["kind"], r["tenant"]))
