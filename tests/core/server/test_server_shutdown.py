"""KVFlowServer in-process: a stop request finishes in-flight transfers, then closes the engine."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.errors import RequestTimeoutError
from kvflow.core.server.server import KVFlowServer

CHUNK = 256


class GatedEngine(CacheEngine):
    """A CacheEngine whose stores wait for `gate`, so a test can hold one in flight."""

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def store(self, *args: Any, **kwargs: Any) -> int:
        self.entered.set()
        assert self.gate.wait(30)
        return super().store(*args, **kwargs)


class StuckCloseEngine(GatedEngine):
    """A GatedEngine whose close also waits, for `close_gate` (say, an L2 tier that hangs)."""

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config)
        self.close_gate = threading.Event()

    def close(self, timeout: float = 5.0) -> bool:
        assert self.close_gate.wait(60)
        return super().close(timeout)


def _serve_gated(
    engine_type: type[GatedEngine] = GatedEngine,
) -> tuple[GatedEngine, KVFlowServer, threading.Thread, list[torch.Tensor]]:
    """A server over a GatedEngine, serving on a thread, and a shared-memory KV cache."""
    config = ServerConfig(port=0, l1_size_gb=0.05, observability=ObservabilityConfig(enabled=False))
    engine = engine_type(config)
    server = KVFlowServer(config, engine=engine)
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    return (
        engine,
        server,
        serving,
        [empty_shared((2, 32, 16, 2, 8), torch.float16) for _ in range(2)],
    )


def test_stop_finishes_in_flight_store_then_closes_the_engine() -> None:
    """request_stop while a store runs: the store still completes and replies; then all stops."""
    engine, server, serving, kv = _serve_gated()
    results: list[object] = []
    with KVFlowClient(server.endpoint, timeout_s=20) as client:
        client.register_kv_caches("inst", kv, model_name="m")
        store = threading.Thread(
            target=lambda: results.append(
                client.store("inst", list(range(CHUNK)), list(range(16)), request_id="r")
            )
        )
        store.start()
        assert engine.entered.wait(20)
        server.request_stop()
        serving.join(0.5)
        assert serving.is_alive()  # still waiting for the store
        with (
            KVFlowClient(server.endpoint, timeout_s=0.3) as late,
            pytest.raises(RequestTimeoutError),
        ):
            late.status()  # a stopping server takes no new requests
        engine.gate.set()
        store.join(20)
        serving.join(20)
    assert results == [CHUNK]
    assert not serving.is_alive()
    assert engine.status()["closed"] is True


@contextlib.contextmanager
def _server_lines(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """caplog sees kvflow.server's lines at INFO, through a handler on that logger itself
    (the stopped line goes to that logger's handlers only)."""
    server_log = logging.getLogger("kvflow.server")
    server_log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="kvflow.server")
    try:
        yield
    finally:
        server_log.removeHandler(caplog.handler)


def _stop_twice_during_a_store(
    engine: GatedEngine, server: KVFlowServer, serving: threading.Thread,
    kv: list[torch.Tensor], *, client_timeout_s: float, loop_s: float,
) -> list[BaseException]:  # fmt: skip
    """Register, start a store the gated engine holds, ask the server to stop twice and
    check its loop ends within `loop_s`; what the store raised."""
    errors: list[BaseException] = []
    with KVFlowClient(server.endpoint, timeout_s=client_timeout_s) as client:
        client.register_kv_caches("stuck", kv, model_name="m")

        def store() -> None:
            try:
                client.store("stuck", list(range(CHUNK)), list(range(16)), request_id="r")
            except BaseException as exc:
                errors.append(exc)

        storing = threading.Thread(target=store, daemon=True)
        storing.start()
        assert engine.entered.wait(20)
        server.request_stop()
        server.request_stop()
        serving.join(loop_s)
        assert not serving.is_alive()
        storing.join(10)
    return errors


def test_second_stop_request_stops_waiting_for_a_stuck_transfer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A second request_stop (a second SIGINT) ends the loop although a store never
    finishes, and logs how many busy workers it does not wait for; the engine (the store
    waits outside it) still closes in time, so the stopped line says clean."""
    engine, server, serving, kv = _serve_gated()
    try:
        with _server_lines(caplog):
            errors = _stop_twice_during_a_store(
                engine, server, serving, kv, client_timeout_s=3, loop_s=10
            )
    finally:
        engine.gate.set()  # let the abandoned worker thread end
    assert len(errors) == 1 and isinstance(errors[0], RequestTimeoutError)
    busy = re.compile(r"kvflow server: not waiting for [1-9]\d* busy instance worker\(s\)")
    assert any(busy.fullmatch(m) for m in caplog.messages), caplog.messages
    assert "kvflow server stopped (event pipeline clean)" in caplog.messages, caplog.messages


def test_an_engine_that_does_not_close_in_time_is_left_behind_not_clean(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After a second stop request (a worker stuck in a store) the engine gets 5 s to
    close, not for ever: the loop ends once they have passed and the stopped line says
    NOT clean."""
    engine, server, serving, kv = _serve_gated(StuckCloseEngine)
    assert isinstance(engine, StuckCloseEngine)
    try:
        with _server_lines(caplog):
            errors = _stop_twice_during_a_store(
                engine, server, serving, kv, client_timeout_s=1, loop_s=20
            )  # the engine's 5 s, and time to spare
    finally:
        engine.close_gate.set()  # the abandoned close and store end
        engine.gate.set()
    assert "kvflow server stopped (event pipeline NOT clean)" in caplog.messages, caplog.messages
    assert len(errors) == 1 and isinstance(errors[0], RequestTimeoutError)
