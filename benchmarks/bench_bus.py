"""Event-bus benchmark: publish throughput, publish latency and delivery to 0, 1, 4 subscribers.

Each row publishes N events from one thread as fast as it can, then waits until
every admitted event reached every subscriber. It reports publishes/s, delivered
events/s (admitted events / time until all were delivered), publish latency
p50/p99, drops, and whether every event is accounted for
(published == delivered + dropped, and each subscriber's received + own
overflow == delivered). "sub drop" is the largest subscriber backlog overflow.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Sequence

import numpy as np

from kvflow.events import Event, EventBus, EventType


class BatchCounter:
    """A subscriber doing a little work per batch: counts and remembers the newest stamp."""

    event_types = None

    def __init__(self, name: str) -> None:
        self.name = name
        self.received = 0
        self.newest_ts = 0

    def on_events(self, events: Sequence[Event]) -> None:
        self.received += len(events)
        self.newest_ts = max(self.newest_ts, events[-1].ts_ns)

    def shutdown(self) -> None:
        pass


def run_row(subscribers: int, capacity: int, n: int) -> dict[str, float]:
    """Publish `n` events through a fresh bus and measure it."""
    bus = EventBus(capacity)
    subs = [BatchCounter(f"sub{i}") for i in range(subscribers)]
    for sub in subs:
        bus.register(sub)
    bus.start()
    event_type = EventType.L1_WRITE
    publish = bus.publish
    clock = time.perf_counter_ns
    lat = np.empty(n, dtype=np.int64)
    start = time.perf_counter()
    for i in range(n):
        t0 = clock()
        publish(Event(event_type))
        lat[i] = clock() - t0
    published_s = time.perf_counter() - start
    bus.flush(60)
    delivered_s = time.perf_counter() - start
    stats = bus.stats()
    bus.stop(10)
    timer = np.median([-(clock() - clock()) for _ in range(1000)])
    accounted = stats.total_published == stats.total_delivered + stats.total_dropped == n
    sub_dropped = {name: sum(d.values()) for name, d in stats.subscriber_dropped.items()}
    received_ok = all(s.received + sub_dropped[s.name] == stats.total_delivered for s in subs)
    return {
        "subs": subscribers,
        "capacity": capacity,
        "publish_per_s": n / published_s,
        "delivered_per_s": stats.total_delivered / delivered_s,
        "p50_us": float(np.percentile(lat, 50) - timer) / 1000,
        "p99_us": float(np.percentile(lat, 99) - timer) / 1000,
        "dropped": stats.total_dropped,
        "sub_dropped": max(sub_dropped.values(), default=0),
        "accounted": accounted and received_ok,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=500_000, help="events per row")
    parser.add_argument(
        "--capacities", type=int, nargs="+", default=[10_000, 65_536], help="bus capacities"
    )
    args = parser.parse_args()
    print(f"kvflow bus benchmark: {args.events} events per row, python {platform.python_version()}")
    rows = [run_row(s, c, args.events) for c in args.capacities for s in (0, 1, 4)]
    header = (
        f"{'subs':>4} {'capacity':>8} {'publish/s':>11} {'delivered/s':>12} "
        f"{'p50 us':>7} {'p99 us':>7} {'dropped':>8} {'sub drop':>8} {'accounted':>9}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['subs']:>4} {r['capacity']:>8} {r['publish_per_s']:>11,.0f} "
            f"{r['delivered_per_s']:>12,.0f} {r['p50_us']:>7.2f} {r['p99_us']:>7.2f} "
            f"{r['dropped']:>8} {r['sub_dropped']:>8} {'yes' if r['accounted'] else 'NO':>9}"
        )


if __name__ == "__main__":
    main()
