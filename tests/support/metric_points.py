"""Every point a MetricsCapture holds, flattened for comparing a live run with its replay."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.metrics.export import HistogramDataPoint

from kvflow.subscribers.testing import MetricsCapture


def metric_points(
    capture: MetricsCapture, keep: Callable[[str], bool]
) -> dict[tuple[Any, ...], Any]:
    """The points of the metrics whose name `keep` accepts, keyed by (name, sorted labels):
    a value, or a histogram's (count, sum, bucket counts)."""
    out: dict[tuple[Any, ...], Any] = {}
    data = capture.reader.get_metrics_data()
    assert data is not None
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if not keep(m.name):
                    continue
                for p in m.data.data_points:
                    key = (m.name, tuple(sorted((p.attributes or {}).items())))
                    if isinstance(p, HistogramDataPoint):
                        out[key] = (p.count, p.sum, tuple(p.bucket_counts))
                    else:
                        out[key] = p.value  # type: ignore[union-attr]
    return out
