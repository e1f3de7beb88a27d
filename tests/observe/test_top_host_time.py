"""`kvflow top` and `kvflow report` show the host's part of stores and retrieves of GPU
caches: the mean time from START until their copies were queued (END `queued_ns`), over
the refresh interval or the report's."""

from __future__ import annotations

import re
import time

from rich.console import Console

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.observe.report import summary
from kvflow.core.observe.snapshot import Rates, Snapshot
from kvflow.core.observe.top import render
from tests.support.engine import CHUNK
from tests.support.event_script import EventScript


def _row(screen: str, op: str) -> list[str]:
    line = next(ln for ln in screen.splitlines() if ln.split()[:1] == [op])
    return line.split()[1:]


def test_the_host_time_per_op_is_the_intervals_mean_queued_time() -> None:
    """Two GPU stores (queued after 1 and 3 ms) and one retrieve of CPU caches (no
    `queued_ns`) between two snapshots: the store row shows 2 ms a store, the retrieve
    row `-`; the engine's status totals the queued time and the ops that had it."""
    engine = CacheEngine(
        ServerConfig(
            chunk_size=CHUNK, l1_size_gb=(1 << 20) / (1 << 30),
            observability=ObservabilityConfig(prometheus_port=0),
        )
    )  # fmt: skip
    try:
        before = Snapshot.of(engine.status())
        s = EventScript(base_ns=time.monotonic_ns())
        gpu = {"instance_id": "gpu0", "model_name": "m"}
        s.op("store", 0.0, 0.01, "r1", start_attrs=gpu, **gpu, tokens=CHUNK, bytes=1 << 20,
             queued_ns=1_000_000)  # fmt: skip
        s.op("store", 0.0, 0.01, "r2", start_attrs=gpu, **gpu, tokens=CHUNK, bytes=1 << 20,
             queued_ns=3_000_000)  # fmt: skip
        s.op("retrieve", 0.0, 0.01, "r3", start_attrs=gpu, **gpu, tokens=CHUNK, bytes=1 << 20)
        for ev in s.events:
            assert engine.bus.publish(ev)
        assert engine.bus.flush(5.0)
        time.sleep(0.01)
        status = engine.status()
        store = status["activity"]["ops"]["store"]
        assert (store["queued_ops"], store["queued_ns"]) == (2, 4_000_000)
        assert "queued_ops" not in status["activity"]["ops"]["retrieve"]
        after = Snapshot.of(status)
        console = Console(record=True, width=140)
        console.print(render(after, Rates.between(before, after)))
        screen = console.export_text()
        assert "host/op" in screen
        assert _row(screen, "store")[-2:] == ["2", "ms"], screen
        assert _row(screen, "retrieve")[-1] == "-", screen
        assert _row(screen, "lookup")[-1] != "-", screen  # a lookup has no such column
        table = summary([before, after])
        assert re.search(r"^\| store \| 2 \| 0 \|.* \| 2 ms \|$", table, re.M), table
        assert re.search(r"^\| retrieve \| 1 \| 0 \|.* \| - \|$", table, re.M), table
        assert re.search(r"^\| lookup \| 0 \| 0 \|.* \|  \|$", table, re.M), table
    finally:
        engine.close()
