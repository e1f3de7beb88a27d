"""Per-tenant L1 metrics (kvflow.tenant.*, docs/METRICS.md): observed when a reader
collects, from a callback returning one row per tenant label.

Rows come already bounded (at most `--max-label-values` tenants of each kind, then
"other"; salts only by their hashed label): labels `kind` (salt or model) and `tenant`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

#: Returns one row per tenant: kind, tenant, usage_bytes, objects, limit_bytes (None: no
#: limit), evicted_chunks, requested_tokens, hit_tokens
TenantStats = Callable[[], Sequence[Mapping[str, Any]]]

_GAUGES = (
    ("usage_bytes", "By", "L1 bytes a tenant's objects take"),
    ("objects", "{object}", "L1 objects of a tenant"),
    ("limit_bytes", "By", "A tenant's L1 byte limit (tenants with one)"),
)
_COUNTERS = (
    ("evicted_chunks", "evicted_chunks", "{chunk}", "L1 objects of a tenant evicted for room"),
    ("lookup.requested_tokens", "requested_tokens", "{token}", "Tokens a tenant looked up"),
    ("lookup.hit_tokens", "hit_tokens", "{token}", "Tokens of a tenant's lookups that hit"),
)


def register_tenant_metrics(meter: Meter, tenant_stats: TenantStats) -> None:
    """Create the kvflow.tenant.* instruments on `meter`, each reading `tenant_stats`."""

    def observe(field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            return [
                Observation(row[field], {"kind": row["kind"], "tenant": row["tenant"]})
                for row in tenant_stats()
                if row.get(field) is not None
            ]

        return callback

    for field, unit, text in _GAUGES:
        meter.create_observable_gauge(
            f"kvflow.tenant.{field}", callbacks=[observe(field)], unit=unit, description=text
        )
    for name, field, unit, text in _COUNTERS:
        meter.create_observable_counter(
            f"kvflow.tenant.{name}", callbacks=[observe(field)], unit=unit, description=text
        )
