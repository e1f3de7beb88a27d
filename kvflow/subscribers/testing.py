"""Test helpers: in-memory sinks, an event script builder, and real collectors.

Shipped in the package so that tests of other packages (the engine, the server)
can assert on kvflow's metrics and spans the same way this package's tests do:
in memory, through an in-process OTLP receiver, or through a real Prometheus.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvflow.events import START_TO_END, BlockAllocation, Event, EventType, next_op_id
from kvflow.subscribers.providers import kvflow_resource, make_meter_provider

_START = {
    "store": EventType.STORE_START,
    "retrieve": EventType.RETRIEVE_START,
    "lookup": EventType.LOOKUP_START,
}


class MetricsCapture:
    """A MeterProvider with an in-memory reader; read points by metric name and labels.

    Labels given to the accessors select the points whose attributes contain them.
    `kvflow_provider=True` builds the provider as `build_subscribers` does
    (`make_meter_provider`: pre-aggregated L0 histograms); the default is a
    plain SDK MeterProvider, as a caller of kvflow might pass.
    """

    def __init__(self, *, kvflow_provider: bool = False) -> None:
        self.reader = InMemoryMetricReader()
        self.provider: MeterProvider = (
            make_meter_provider([self.reader])
            if kvflow_provider
            else MeterProvider(metric_readers=[self.reader], resource=kvflow_resource())
        )

    def points(self, name: str, **labels: Any) -> list[Any]:
        """Data points of metric `name` (collected now) whose attributes include `labels`."""
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        if data is None:
            return found
        for resource_metrics in data.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name == name:
                        found.extend(
                            p
                            for p in metric.data.data_points
                            if labels.items() <= dict(p.attributes or {}).items()
                        )
        return found

    def names(self) -> set[str]:
        """Names of every metric with at least one data point."""
        data = self.reader.get_metrics_data()
        if data is None:
            return set()
        return {
            m.name
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.data.data_points
        }

    def total(self, name: str, **labels: Any) -> float:
        """Sum of the values of the matching counter/gauge points (0 when none)."""
        return sum(p.value for p in self.points(name, **labels))

    def histogram(self, name: str, **labels: Any) -> HistogramDataPoint:
        """The single histogram point matching `labels` (AssertionError if not exactly one)."""
        points = self.points(name, **labels)
        assert len(points) == 1, f"{name} {labels}: expected one point, got {len(points)}"
        point: HistogramDataPoint = points[0]
        return point

    def observations(self, name: str, **labels: Any) -> int:
        """How many values the matching histogram points counted (0 when none)."""
        return sum(p.count for p in self.points(name, **labels))

    def shutdown(self) -> None:
        self.provider.shutdown()


class SpanCapture:
    """A TracerProvider exporting synchronously into memory."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(resource=kvflow_resource())
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """Finished spans, oldest first, optionally only those called `name`."""
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]

    def shutdown(self) -> None:
        self.provider.shutdown()


class EventScript:
    """Builds an event sequence with explicit times, given in seconds after `base_ns`."""

    def __init__(self, base_ns: int = 1_000_000_000_000) -> None:
        self.base_ns = base_ns
        self.events: list[Event] = []

    def ts(self, at_s: float) -> int:
        return self.base_ns + round(at_s * 1e9)

    def add(
        self,
        etype: EventType,
        at_s: float,
        session_id: str | None = None,
        op_id: int | None = None,
        **attrs: Any,
    ) -> Event:
        """Append one event and return it."""
        event = Event(etype, self.ts(at_s), session_id, op_id, attrs)
        self.events.append(event)
        return event

    def start(
        self, operation: str, at_s: float, session_id: str | None = None, **attrs: Any
    ) -> int:
        """Append the START of `operation` (store, retrieve, lookup); returns its op_id."""
        op_id = next_op_id()
        self.add(_START[operation], at_s, session_id, op_id, **attrs)
        return op_id

    def end(
        self, operation: str, op_id: int, at_s: float, session_id: str | None = None, **attrs: Any
    ) -> Event:
        """Append the END of `operation` for `op_id` (attrs default to ok=True, error=None)."""
        attrs.setdefault("ok", attrs.get("error") is None)
        attrs.setdefault("error", None)
        return self.add(START_TO_END[_START[operation]], at_s, session_id, op_id, **attrs)

    def op(
        self,
        operation: str,
        start_s: float,
        end_s: float,
        session_id: str | None = None,
        start_attrs: dict[str, Any] | None = None,
        **end_attrs: Any,
    ) -> int:
        """Append a START/END pair; returns the op_id."""
        op_id = self.start(operation, start_s, session_id, **(start_attrs or {}))
        self.end(operation, op_id, end_s, session_id, **end_attrs)
        return op_id

    def allocate(
        self,
        at_s: float,
        *records: tuple[str, Sequence[int], Sequence[int]],
        instance_id: str = "inst0",
        model_name: str = "model",
        block_size: int = 16,
    ) -> Event:
        """Append a BLOCK_ALLOCATION of `records` (req_id, block_ids, token_ids)."""
        return self.add(
            EventType.BLOCK_ALLOCATION,
            at_s,
            instance_id=instance_id,
            model_name=model_name,
            block_size=block_size,
            records=[BlockAllocation(*r) for r in records],
        )

    def end_session(self, at_s: float, session_id: str) -> Event:
        return self.add(EventType.END_SESSION, at_s, session_id)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class OTLPReceiver:
    """An in-process OTLP collector (gRPC or HTTP/protobuf) keeping every request it gets.

    `endpoint` is what to give kvflow's --otlp-endpoint; `metrics()` and `spans()`
    return the received protobuf messages, flattened.
    """

    def __init__(self, protocol: str = "grpc") -> None:
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as mpb
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb

        self.protocol = protocol
        self.metric_requests: list[Any] = []
        self.trace_requests: list[Any] = []
        self._lock = threading.Lock()
        self._mpb, self._tpb = mpb, tpb
        if protocol == "grpc":
            self._start_grpc()
        elif protocol == "http":
            self._start_http()
        else:
            raise ValueError(f"protocol must be grpc or http, got {protocol!r}")

    def _keep(self, requests: list[Any], request: Any) -> None:
        with self._lock:
            requests.append(request)

    def _start_grpc(self) -> None:
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as mgrpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc

        receiver = self

        class Metrics(mgrpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                receiver._keep(receiver.metric_requests, request)
                return receiver._mpb.ExportMetricsServiceResponse()

        class Traces(tgrpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                receiver._keep(receiver.trace_requests, request)
                return receiver._tpb.ExportTraceServiceResponse()

        self._grpc = grpc.server(ThreadPoolExecutor(max_workers=2))
        mgrpc.add_MetricsServiceServicer_to_server(Metrics(), self._grpc)
        tgrpc.add_TraceServiceServicer_to_server(Traces(), self._grpc)
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def _start_http(self) -> None:
        receiver = self
        routes: dict[str, tuple[Any, list[Any], Any]] = {
            "/v1/metrics": (self._mpb.ExportMetricsServiceRequest, self.metric_requests,
                            self._mpb.ExportMetricsServiceResponse),
            "/v1/traces": (self._tpb.ExportTraceServiceRequest, self.trace_requests,
                           self._tpb.ExportTraceServiceResponse),
        }  # fmt: skip

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                route = routes.get(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if route is None:
                    self.send_error(404)
                    return
                request_type, requests, response_type = route
                receiver._keep(requests, request_type.FromString(body))
                payload = response_type().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http_thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._http_thread.start()
        self.endpoint = f"http://127.0.0.1:{self._http.server_address[1]}"

    def metrics(self) -> list[Any]:
        """Every received Metric message (name, unit, data), in arrival order."""
        with self._lock:
            return [m for req in self.metric_requests for rm in req.resource_metrics
                    for sm in rm.scope_metrics for m in sm.metrics]  # fmt: skip

    def spans(self) -> list[Any]:
        """Every received Span message, in arrival order."""
        with self._lock:
            return [sp for req in self.trace_requests for rs in req.resource_spans
                    for ss in rs.scope_spans for sp in ss.spans]  # fmt: skip

    def resources(self) -> list[dict[str, Any]]:
        """The resource attributes of every received metrics request."""
        with self._lock:
            return [{kv.key: kv.value.string_value for kv in rm.resource.attributes}
                    for req in self.metric_requests for rm in req.resource_metrics]  # fmt: skip

    def close(self) -> None:
        if self.protocol == "grpc":
            self._grpc.stop(grace=None)
        else:
            self._http.shutdown()
            self._http.server_close()


class PrometheusServer:
    """A real Prometheus (the `prometheus` binary) on loopback scraping `targets` every second.

    Runs with a temporary config and data directory; `query` uses the HTTP API.
    """

    def __init__(self, targets: Sequence[str], *, binary: str = "prometheus") -> None:
        path = shutil.which(binary)
        if path is None:
            raise FileNotFoundError(f"{binary!r} is not installed (Debian package prometheus)")
        self._dir = tempfile.TemporaryDirectory(prefix="kvflow-prometheus-")
        root = Path(self._dir.name)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "kvflow",
                                "static_configs": [{"targets": list(targets)}]}],
        }  # fmt: skip
        (root / "prometheus.yml").write_text(json.dumps(config))  # JSON is valid YAML
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = (root / "prometheus.log").open("w")
        self._proc = subprocess.Popen(
            [path, f"--config.file={root / 'prometheus.yml'}",
             f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Block until /-/ready answers (RuntimeError with the log tail if it never does)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready after {timeout}s: {self.log_tail()}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The result vector of an instant query."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5.0) as reply:
            body = json.load(reply)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus query {promql!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, promql: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll `promql` until it returns a non-empty vector (TimeoutError otherwise)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"{promql!r} stayed empty for {timeout}s: {self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, n: int = 2000) -> str:
        self._log.flush()
        return Path(self._log.name).read_text()[-n:]

    def close(self) -> None:
        """Stop the server and remove its files."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        self._dir.cleanup()
