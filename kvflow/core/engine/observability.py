"""The engine's event pipeline: its bus and subscribers, built from ObservabilityConfig.

The one place the engine wires `kvflow.subscribers` and attaches the GPU stream
stamper to its bus; a bus given by the caller is used as is and left for the caller
to stop (it gets a stamper, if it has none, once the engine moves KV on a GPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from kvflow.core.config import ObservabilityConfig
from kvflow.core.engine.activity import ActivityTally, l0_summary
from kvflow.events import EventBus
from kvflow.events.stream import attach_native_stamper
from kvflow.subscribers import L0LifecycleSubscriber, ObservabilityPipeline, build_subscribers
from kvflow.subscribers.tenants import TenantStats, register_tenant_metrics


class Observability:
    """Owns (or borrows) the bus and the subscriber pipeline; `close` is idempotent."""

    def __init__(
        self,
        config: ObservabilityConfig,
        bus: EventBus | None,
        *,
        l1_stats: Callable[[], dict[str, int]],
        tier_stats: Callable[[], Mapping[str, Mapping[str, int]]] | None = None,
        tenant_stats: TenantStats | None = None,
    ) -> None:
        """`l1_stats` feeds the L1 occupancy gauges; `tier_stats` (tier name -> that
        tier's stats(), None when there are no L2 tiers) the per-tier L2 ones;
        `tenant_stats` the per-tenant ones (kvflow.tenant.*)."""
        self.pipeline: ObservabilityPipeline | None = None
        #: totals for status (`kvflow top` / `kvflow report`); only on a bus the engine owns
        self.activity: ActivityTally | None = None
        self.clean = True
        self._closed = False
        if bus is not None:
            self.bus = bus
            return
        self.bus = EventBus(capacity=config.event_bus_capacity, enabled=config.enabled)
        self.pipeline = build_subscribers(
            config, bus=self.bus, l1_stats=l1_stats, tier_stats=tier_stats
        )
        provider = self.pipeline.meter_provider
        if provider is not None and tenant_stats is not None and config.metrics_enabled:
            register_tenant_metrics(provider.get_meter("kvflow"), tenant_stats)
        if config.enabled:
            self.activity = ActivityTally()
            self.bus.register(self.activity)
        self.stamp_on_streams()
        self.bus.start()

    def activity_status(self) -> dict[str, Any] | None:
        """Totals since start and the L0 block-age histograms summarised, for status.

        None when the engine keeps no tally (observability off, or a caller's bus).
        """
        if self.activity is None:
            return None
        l0 = None
        if self.pipeline is not None:
            sub = self.pipeline.subscriber("l0_lifecycle")
            if isinstance(sub, L0LifecycleSubscriber):
                l0 = sub.histogram_store
        return {
            "monotonic_s": time.monotonic(),
            **self.activity.snapshot(),
            "l0_histograms": l0_summary(l0),
        }

    def stamp_on_streams(self) -> None:
        """Attach the native stream stamper to the bus unless it has a stamper, so GPU
        ops' END events carry the GPU's time (docs/STREAM_EVENTS.md); without CUDA, or
        on a disabled bus, nothing is attached and those events are stamped at publish."""
        if self.bus.stamper is None:
            attach_native_stamper(self.bus)

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the owned bus (delivering what it holds), flush and close the exporters."""
        if self._closed:
            return self.clean
        self._closed = True
        if self.pipeline is not None:
            self.clean = self.pipeline.shutdown(timeout)
        return self.clean
