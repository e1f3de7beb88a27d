"""Real collectors for exporter tests: an in-process OTLP receiver and a Prometheus server.

The receiver needs opentelemetry-proto, and grpcio for gRPC (dev dependencies); the
Prometheus server needs the `prometheus` binary (its tests skip without one).
"""

from __future__ import annotations

import json
import random
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

#: the lowest port `free_port` hands out (above the well-known services tests run)
FIRST_FREE_PORT = 15000
_ports = random.SystemRandom()  # not the `random` module's state, which tests seed


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections' ports)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, from below the kernel's
    ephemeral range: a port from that range may be taken meanwhile by any outgoing
    connection's own end (in CI a vLLM started seconds later lost such a race)."""
    low = max(_ephemeral_low(), FIRST_FREE_PORT + 1000)
    for _ in range(200):
        port = _ports.randrange(FIRST_FREE_PORT, low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {FIRST_FREE_PORT}..{low - 1} after 200 tries")


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
