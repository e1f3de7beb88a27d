"""/healthz and /readyz read with a real HTTP client (docs/OPERATIONS.md, Probes; issue 42).

A real `kvflow server` with a real redis-server behind it: the probes answer as soon
as the server is up, readiness goes away while Redis is down (naming the tier) and
while the server drains, and comes back after. In-process, a server whose L1 is still
being pinned ahead (pinning held back by the test) is live but not ready until it is.
"""

from __future__ import annotations

import threading
import urllib.error
from collections.abc import Iterator

import pytest
import torch

from kvflow.core import KVFlowClient
from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.server.protocol import AdminDrain, AdminResize
from kvflow.core.server.server import KVFlowServer
from kvflow.core.tiers.hostmem import HostPool
from kvflow.core.tiers.l1 import L1Cache
from tests.support.collectors import free_port
from tests.support.ops import ServerProcess, get_json, wait_for
from tests.support.redis_servers import redis_server


def _probe(port: int, path: str) -> tuple[int, dict[str, object]] | None:
    """The probe's answer, or None while nothing listens on the port."""
    try:
        return get_json(f"http://127.0.0.1:{port}{path}", timeout_s=2.0)
    except (urllib.error.URLError, ConnectionError):
        return None


def test_probes_follow_redis_and_drain() -> None:
    """Up: live and ready. Redis stopped: still live, not ready because the redis tier is
    unreachable; Redis back: ready. Draining: not ready (draining); undrained: ready."""
    port = free_port()
    with redis_server() as redis:
        srv = ServerProcess(
            "--disable-metrics", "--l1-size-gb", "0.05", "--l2-redis", redis.url(),
            "--l2-redis-timeout-s", "0.2", "--probe-port", str(port),
        )  # fmt: skip
        try:
            assert _probe(port, "/healthz") == (200, {"status": "ok", "loop_age_s": _any()})
            assert _probe(port, "/readyz") == (200, {"status": "ready"})
            redis.stop()
            down = wait_for(
                lambda: (r := _probe(port, "/readyz")) is not None and r[0] == 503 and r,
                what="not ready with Redis down",
            )
            assert down[1] == {"status": "not ready", "reasons": ["l2 tier redis unreachable"]}
            assert _probe(port, "/healthz") is not None and _probe(port, "/healthz")[0] == 200
            redis.start()
            wait_for(lambda: _probe(port, "/readyz") == (200, {"status": "ready"}),
                     what="ready again with Redis back")  # fmt: skip
            with KVFlowClient(srv.endpoint, timeout_s=20) as admin:
                admin.admin(AdminDrain())
                assert _probe(port, "/readyz") == (
                    503, {"status": "not ready", "reasons": ["draining"]}
                )  # fmt: skip
                admin.admin(AdminDrain(undrain=True))
                assert _probe(port, "/readyz") == (200, {"status": "ready"})
            code, body = get_json(f"http://127.0.0.1:{port}/metrics")
            assert code == 404 and body["paths"] == ["/healthz", "/readyz"]
        finally:
            assert srv.stop() == 0, srv.log()
    assert _probe(port, "/healthz") is None  # the port is released with the server


class _Any:
    """Equal to any value (a probe's loop age varies)."""

    def __eq__(self, other: object) -> bool:
        return True


def _any() -> object:
    return _Any()


class _HeldBackPool(HostPool):
    """Host memory whose pinning-ahead step waits until the test lets it go."""

    def __init__(self, release: threading.Event, *, prefault: bool) -> None:
        super().__init__(pinned=False, prefault=prefault)
        self._release = release

    def make_segment(self, nbytes: int) -> torch.Tensor:
        self._release.wait(60)
        return super().make_segment(nbytes)


@pytest.fixture(params=["pin", "prefault"])
def held_back_server(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[KVFlowServer, threading.Event]]:
    release = threading.Event()
    config = ServerConfig(
        port=0, l1_size_gb=0.01, probe_port=free_port(),
        observability=ObservabilityConfig(enabled=False),
    )  # fmt: skip
    engine = CacheEngine(config)
    engine.l1.close()
    engine.l1 = L1Cache(
        int(0.01 * (1 << 30)), pool=_HeldBackPool(release, prefault=request.param == "prefault"), pin_ahead=True,
        tenants=engine.tenants,
    )  # fmt: skip
    server = KVFlowServer(config, engine=engine)
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    yield server, release
    release.set()
    server.request_stop()
    loop.join(30)


def test_not_ready_until_l1_is_pinned(
    held_back_server: tuple[KVFlowServer, threading.Event],
) -> None:
    """While L1's memory is still being pinned ahead the server is live but not ready
    (the reason says how far pinning, or faulting in without CUDA, got); once done, ready, and a later live grow
    that pins more does not take readiness away."""
    server, release = held_back_server
    port = server.probe_port
    assert port is not None and server.status()["server"]["probe_port"] == port
    wait_for(lambda: _probe(port, "/healthz") is not None, what="the probe endpoint")
    code, body = _probe(port, "/readyz") or (0, {})
    state = server.engine.l1.pin_state()
    assert state is not None
    reason = {
        "pin": "l1 pinning: 0.00 of 0.01 GiB pinned",
        "prefault": "l1 faulting in: 0.00 of 0.01 GiB faulted in",
    }[state["mode"]]
    assert code == 503 and body["reasons"] == [reason]
    release.set()
    wait_for(lambda: _probe(port, "/readyz") == (200, {"status": "ready"}), what="L1 pinned")
    with KVFlowClient(server.endpoint, timeout_s=20) as client:
        client.admin(AdminResize(l1_size_gb=0.02))
    assert _probe(port, "/readyz") == (200, {"status": "ready"})
