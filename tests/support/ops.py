"""A real `kvflow server` process for the operations tests, an in-process server's loop on
a thread (and an engine served so, with a client), an HTTP probe reader, a bare socket's
request, and CPU KV caches in shared memory whose bytes a test can check after a round
trip.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import torch
import zmq

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.server.protocol import Reply, Request, decode_reply, encode_request
from kvflow.core.server.server import KVFlowServer
from tests.support.launcher import kvflow_process

if TYPE_CHECKING:
    from kvflow.core.engine.cache_engine import CacheEngine

#: vllm_flash_attn caches: NL x [2, NB, BS, NH, HS] bfloat16; a 256-token chunk is 32 KiB
NL, NB, BS, NH, HS = 2, 64, 16, 2, 8
CHUNK = 256
CHUNK_BYTES = 2 * NL * CHUNK * NH * HS * 2
BLOCKS_PER_CHUNK = CHUNK // BS


class ServerProcess:
    """`kvflow server --port 0 ...` (tests.support.launcher); waits until it listens,
    keeps its log (`env`: the process's environment, default this one's). As a context
    manager it is stopped at the end of the block, which checks that it exited 0 (unless
    the block raised)."""

    def __init__(
        self, *flags: str, start_timeout_s: float = 60.0, env: dict[str, str] | None = None
    ) -> None:
        args = ["server", "--port", "0", "--log-format", "console", "--prometheus-port", "0"]
        self.proc = kvflow_process([*args, *flags], stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.endpoint = ""
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        if not self._ready.wait(start_timeout_s) or not self.endpoint:
            self.proc.kill()
            self.stop()  # reaped, its log read to the end and its pipe closed
            raise RuntimeError("server did not start:\n" + "".join(self.lines))

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            # the whole readiness line, as the console log renders it
            match = re.search(
                r"\] kvflow server listening on (tcp://\S+) \(protocol \d+\) \[", line
            )
            if match:
                self.endpoint = match.group(1)
                self._ready.set()
        self._ready.set()

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(30)
        self._reader.join(10)  # the log's last lines, read from the pipe after the exit
        if self.proc.stderr is not None and not self._reader.is_alive():
            self.proc.stderr.close()
        return code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        code = self.stop()
        if exc_type is None:
            assert code == 0, self.log()


def get_json(url: str, timeout_s: float = 5.0) -> tuple[int, dict[str, Any]]:
    """GET `url`: (HTTP status, JSON body), for 200 and error statuses alike."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def wait_for(
    predicate: Any, timeout_s: float = 30.0, interval_s: float = 0.05, what: str = "condition"
) -> Any:
    """Poll `predicate()` until it returns something true (returned); AssertionError on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


@contextlib.contextmanager
def serving(server: KVFlowServer) -> Iterator[KVFlowServer]:
    """Run an in-process server's loop on a thread for the block; then stop it and check
    that the loop ended."""
    loop = threading.Thread(target=server.serve_forever)
    loop.start()
    try:
        yield server
    finally:
        server.request_stop()
        loop.join(20)
    assert not loop.is_alive()


@contextlib.contextmanager
def engine_served(
    engine: CacheEngine, **client_kwargs: Any
) -> Iterator[tuple[KVFlowClient, KVFlowServer]]:
    """`engine` served by an in-process server (`serving`) and a client of it; the
    engine's bus is stopped at the end."""
    try:
        with (
            serving(KVFlowServer(engine.config, engine=engine)) as server,
            KVFlowClient(server.endpoint, timeout_s=20, **client_kwargs) as client,
        ):
            yield client, server
    finally:
        engine.bus.stop(5.0)


def raw_reply(endpoint: str, request: Request, payloads: tuple[Any, ...] = ()) -> Reply:
    """The server's reply to `request` sent from a bare DEALER socket: requests kvflow's
    client would refuse (or build otherwise) before sending."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        sock.send_multipart(encode_request(request, payloads))
        assert sock.poll(10_000), "no reply"
        return decode_reply(sock.recv())
    finally:
        sock.close()
        ctx.term()


def lines_from(caplog: pytest.LogCaptureFixture, module: str) -> list[tuple[int, str]]:
    """(level, message) of the lines `module` logged: loggers such as "kvflow.server" are
    shared, and a server an earlier test stopped may still log to them from its threads."""
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.module == module]


def shared_kv(seed: int) -> list[torch.Tensor]:
    """Random bfloat16 caches in shared memory (a server maps them)."""
    gen = torch.Generator().manual_seed(seed)
    kv = [empty_shared((2, NB, BS, NH, HS), torch.bfloat16) for _ in range(NL)]
    for t in kv:
        t.copy_(torch.randn(t.shape, generator=gen).to(torch.bfloat16))
    return kv


def tokens(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(32000), k=n)


def blocks_equal(kv: list[torch.Tensor], src: range, dst: range) -> bool:
    """Whether blocks `dst` hold what blocks `src` hold, in every layer."""
    return all(torch.equal(t[:, dst.start : dst.stop], t[:, src.start : src.stop]) for t in kv)
