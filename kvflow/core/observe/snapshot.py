"""One server status read as numbers, and the rates between two of them.

`Snapshot.of(status)` keeps what the views show (totals, usage, bus, L0 summary);
`Rates.between(a, b)` divides the totals' differences by the seconds between the
two snapshots on the server's monotonic clock, so a slow status reply does not
distort a rate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GB = 1e9
#: the operations whose totals a status carries (`activity.ops`)
OPS = ("store", "retrieve", "lookup", "blend_lookup", "blend_retrieve")
#: the lookup kinds whose hit rates the views show: prefix lookups, blend lookups
LOOKUPS = ("lookup", "blend_lookup")
#: the operations whose END may say how long the host took to queue their copies
QUEUED_OPS = ("store", "retrieve")
#: an operation's totals `Rates` differentiate (those an operation lacks read as 0)
_OP_TOTALS = (
    "requests", "errors", "tokens", "bytes", "requested_tokens", "hit_tokens",
    "queued_ops", "queued_ns",
)  # fmt: skip


def _num(mapping: Any, *path: str) -> float:
    """mapping[path[0]][path[1]]... as a float; 0 when any step is missing or not a number."""
    value: Any = mapping
    for key in path:
        if not isinstance(value, Mapping):
            return 0.0
        value = value.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _added(maps: list[dict[str, float]]) -> dict[str, float]:
    """The maps' values added up key by key."""
    out: dict[str, float] = {}
    for m in maps:
        for key, value in m.items():
            out[key] = out.get(key, 0.0) + value
    return out


def _added_usage(usages: list[TierUsage]) -> TierUsage:
    """One tier's fill over several shards."""
    return TierUsage(
        sum(u.usage_bytes for u in usages),
        sum(u.capacity_bytes for u in usages),
        sum(u.objects for u in usages),
        sum(u.evicted_chunks for u in usages),
    )


def _joined_summary(summaries: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Distribution summaries (counts, sums, maximum, quantiles "pNN...") of several
    shards as one: counts and sums added, the maximum and quantiles the largest (None
    where no shard has one)."""
    out: dict[str, Any] = {}
    for key in sorted({k for s in summaries for k in s}):
        values = [v for s in summaries if isinstance(v := s.get(key), (int, float))]
        if not values:
            out[key] = None
        elif key.startswith("max") or (key[:1] == "p" and key[1:2].isdigit()):
            out[key] = max(values)
        else:
            out[key] = sum(values)
    return out


@dataclass
class TierUsage:
    """A storage tier's fill: bytes held, capacity, objects, evicted objects so far."""

    usage_bytes: float
    capacity_bytes: float
    objects: float
    evicted_chunks: float

    @property
    def fraction(self) -> float:
        return self.usage_bytes / self.capacity_bytes if self.capacity_bytes > 0 else 0.0


@dataclass
class Snapshot:
    """The numbers of one status reply (totals since the server started)."""

    at_s: float
    uptime_s: float
    endpoint: str
    totals: dict[str, float]
    hit_by_tier: dict[str, float]
    l2_bytes: dict[str, dict[str, float]]
    inflight: dict[str, float]
    tiers: dict[str, TierUsage]
    bus: dict[str, float]
    l0: dict[str, Any]
    l0_sample_rate: float
    instances: int
    observed: bool = True
    models: list[str] = field(default_factory=list)
    #: the L2 write-through's backpressure and drops since start (empty without L2)
    l2_writes: dict[str, float] = field(default_factory=dict)
    #: engines' waits for the layers of layerwise retrieves (empty before the first report)
    layer_waits: dict[str, Any] = field(default_factory=dict)
    #: blend lookups' tokens found past the prefix, by tier (empty before the first one)
    blend_hit_by_tier: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, status: Mapping[str, Any]) -> Snapshot:
        """Read a `KVFlowClient.status()` reply (or `CacheEngine.status()`); a sharded
        server's (its shards' statuses under "shards") reads as their sum (`joined`)."""
        shards = status.get("shards")
        if isinstance(shards, list) and shards:
            return cls.joined([cls.of(s) for s in shards], status.get("server") or {})
        activity = status.get("activity") or {}
        ops = activity.get("ops") or {}
        l2_activity = activity.get("l2") or {}
        l2_bytes = {
            name: {k: _num(t, k) for k in ("stored_bytes", "loaded_bytes", "evicted_chunks")}
            for name, t in l2_activity.items()
        }
        writes = (status.get("l2") or {}).get("write_through") or {}
        l2_writes = {
            k: _num(writes, k) for k in ("waits", "waited_s", "dropped_chunks", "drop_bursts")
        } if writes else {}  # fmt: skip
        tiers = {"l1": _usage(status.get("l1"))}
        for name, tier in ((status.get("l2") or {}).get("tiers") or {}).items():
            tiers[name] = _usage(tier)
        bus = status.get("bus") or {}
        server = status.get("server") or {}
        instances = status.get("instances") or {}
        return cls(
            at_s=_num(activity, "monotonic_s") or _num(server, "uptime_s"),
            uptime_s=_num(server, "uptime_s"),
            endpoint=str(server.get("endpoint", "")),
            totals=_totals(activity),
            hit_by_tier=_by_tier(ops, "lookup"),
            l2_bytes=l2_bytes,
            inflight={
                str(k): _num(activity.get("inflight"), k) for k in (activity.get("inflight") or {})
            },
            tiers=tiers,
            bus={
                "queue_depth": _num(bus, "queue_depth"),
                "capacity": _num(bus, "capacity"),
                "lag_s": _num(bus, "oldest_lag_ns") / 1e9,
                "dropped": _num(bus, "dropped"),
                "published": _num(bus, "published"),
                "subscriber_errors": sum(
                    _num(bus.get("subscriber_errors"), k)
                    for k in bus.get("subscriber_errors") or {}
                ),
            },
            l0=dict(activity.get("l0_histograms") or {}),
            l0_sample_rate=_num(status.get("config"), "observability", "l0_sample_rate"),
            instances=len(instances),
            observed=bool(activity),
            models=sorted(
                {str(i.get("model_name")) for i in instances.values() if isinstance(i, Mapping)}
            ),
            l2_writes=l2_writes,
            layer_waits=dict(activity.get("layer_waits") or {}),
            blend_hit_by_tier=_by_tier(ops, "blend_lookup"),
        )

    @classmethod
    def joined(cls, parts: list[Snapshot], front: Mapping[str, Any]) -> Snapshot:
        """A sharded server's numbers: its shards' added up, on their common clock (the
        host's monotonic one); a distribution's quantiles and maximum are the worst
        shard's, an upper bound of the whole server's."""
        first = parts[0]
        tier_names = sorted({name for p in parts for name in p.tiers})
        l2_names = sorted({name for p in parts for name in p.l2_bytes})
        l0_names = sorted({name for p in parts for name in p.l0})
        empty = TierUsage(0.0, 0.0, 0.0, 0.0)
        return cls(
            at_s=max(p.at_s for p in parts),
            uptime_s=_num(front, "uptime_s") or first.uptime_s,
            endpoint=str(front.get("endpoint", first.endpoint)),
            totals=_added([p.totals for p in parts]),
            hit_by_tier=_added([p.hit_by_tier for p in parts]),
            l2_bytes={n: _added([p.l2_bytes.get(n, {}) for p in parts]) for n in l2_names},
            inflight=_added([p.inflight for p in parts]),
            tiers={n: _added_usage([p.tiers.get(n, empty) for p in parts]) for n in tier_names},
            bus={**_added([p.bus for p in parts]), "lag_s": max(p.bus["lag_s"] for p in parts)},
            l0={n: _joined_summary([p.l0.get(n) or {} for p in parts]) for n in l0_names},
            l0_sample_rate=first.l0_sample_rate,
            instances=sum(p.instances for p in parts),
            observed=any(p.observed for p in parts),
            models=sorted({m for p in parts for m in p.models}),
            l2_writes=_added([p.l2_writes for p in parts]),
            layer_waits=_joined_summary([p.layer_waits for p in parts]),
            blend_hit_by_tier=_added([p.blend_hit_by_tier for p in parts]),
        )

    def hit_rate(self, op: str = "lookup") -> float | None:
        """Hit tokens / requested tokens since start of `op`: `lookup` (the prefix hit rate)
        or `blend_lookup` (the blend hit rate: tokens found past the prefix / the blend
        lookups' prompt tokens); None before any such lookup."""
        asked = self.totals[f"{op}.requested_tokens"]
        return self.totals[f"{op}.hit_tokens"] / asked if asked else None

    def tier_hits(self, op: str = "lookup") -> dict[str, float]:
        """Tokens `op` (`lookup` or `blend_lookup`) found per tier since start."""
        return self.hit_by_tier if op == "lookup" else self.blend_hit_by_tier

    def l0_quantile(self, name: str, q: str) -> float | None:
        """`p50_s`, `p90_s` or `p99_s` of an L0 histogram (lifetime, idle_before_evict,
        reuse_gap); None before its first value or with metrics off."""
        value = (self.l0.get(name) or {}).get(q)
        return float(value) if isinstance(value, (int, float)) else None


def _totals(activity: Mapping[str, Any]) -> dict[str, float]:
    """The counts `Rates` differentiate: per operation (blend ones 0 before the first),
    L1 traffic and L0 block reports."""
    ops = activity.get("ops") or {}
    totals = {f"{op}.{key}": _num(ops, op, key) for op in OPS for key in _OP_TOTALS}
    for kind in ("written", "read", "evicted"):
        totals[f"l1.{kind}_bytes"] = _num(activity, "l1", f"{kind}_bytes")
        totals[f"l1.{kind}_chunks"] = _num(activity, "l1", f"{kind}_chunks")
    totals["l0.allocation_records"] = _num(activity, "l0", "allocation_records")
    totals["l0.allocated_blocks"] = _num(activity, "l0", "allocated_blocks")
    return totals


def _by_tier(ops: Mapping[str, Any], op: str) -> dict[str, float]:
    """A lookup kind's tokens found per tier since start."""
    tiers = (ops.get(op) or {}).get("hit_tokens_by_tier") or {}
    return {str(k): _num(tiers, k) for k in tiers}


def _usage(stats: Any) -> TierUsage:
    return TierUsage(
        usage_bytes=_num(stats, "usage_bytes"),
        capacity_bytes=_num(stats, "capacity_bytes"),
        objects=_num(stats, "objects"),
        evicted_chunks=_num(stats, "evicted_chunks"),
    )


@dataclass
class Rates:
    """Per-second rates between two snapshots, and the hit rates over that interval."""

    seconds: float
    per_s: dict[str, float]
    tier_gb_s: dict[str, tuple[float, float]]
    tier_evictions_s: dict[str, float]
    #: lookup kind (LOOKUPS) -> its hit rate over the interval, as `Snapshot.hit_rate`
    #: defines it (None: no such lookup in the interval)
    hit_rates: dict[str, float | None]

    @property
    def hit_rate(self) -> float | None:
        """The prefix hit rate over the interval."""
        return self.hit_rates["lookup"]

    @property
    def blend_hit_rate(self) -> float | None:
        """The blend hit rate over the interval."""
        return self.hit_rates["blend_lookup"]

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot) -> Rates:
        """Rates from `a` to the later `b` (all zero when no time passed)."""
        dt = b.at_s - a.at_s
        scale = 1.0 / dt if dt > 0 else 0.0
        per_s = {k: max(b.totals[k] - a.totals.get(k, 0.0), 0.0) * scale for k in b.totals}
        tier_gb_s = {}
        for name, t in b.l2_bytes.items():
            before = a.l2_bytes.get(name, {})
            tier_gb_s[name] = (
                max(t["stored_bytes"] - before.get("stored_bytes", 0.0), 0.0) * scale / GB,
                max(t["loaded_bytes"] - before.get("loaded_bytes", 0.0), 0.0) * scale / GB,
            )
        tier_gb_s["l1"] = (per_s["l1.written_bytes"] / GB, per_s["l1.read_bytes"] / GB)
        evictions = {
            name: max(u.evicted_chunks - a.tiers[name].evicted_chunks, 0.0) * scale
            for name, u in b.tiers.items()
            if name in a.tiers
        }
        return cls(
            seconds=dt,
            per_s=per_s,
            tier_gb_s=tier_gb_s,
            tier_evictions_s=evictions,
            hit_rates={op: _interval_hit_rate(a, b, op) for op in LOOKUPS},
        )

    def gb_s(self, op: str) -> float:
        """GB/s (1e9 bytes/s) moved by `store` (GPU -> L1) or `retrieve` (L1 -> GPU)."""
        return self.per_s[f"{op}.bytes"] / GB

    def queued_s(self, op: str) -> float | None:
        """Mean host time of the interval's `op`s (store, retrieve) from START until their
        copies were queued on a GPU stream; None without such ops (CPU caches)."""
        ops = self.per_s[f"{op}.queued_ops"]
        return self.per_s[f"{op}.queued_ns"] / ops / 1e9 if ops else None


def _interval_hit_rate(a: Snapshot, b: Snapshot, op: str) -> float | None:
    """Hit tokens / requested tokens of `op` (a lookup kind) between two snapshots."""
    asked = b.totals[f"{op}.requested_tokens"] - a.totals.get(f"{op}.requested_tokens", 0.0)
    hits = b.totals[f"{op}.hit_tokens"] - a.totals.get(f"{op}.hit_tokens", 0.0)
    return hits / asked if asked > 0 else None
