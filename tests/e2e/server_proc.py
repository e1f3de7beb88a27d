"""A `kvflow server` process for the end-to-end scenario (tests.support.launcher), started
and stopped cleanly."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvflow.core import KVFlowClient
from tests.support.collectors import free_port
from tests.support.launcher import LaunchedProcess, kvflow_process

START_TIMEOUT_S = 60.0


class ServerFailedError(RuntimeError):
    """The server exited or never answered; the message carries its log."""


@contextlib.contextmanager
def running_server(
    chunk_size: int, log_path: Path, extra_args: Sequence[str] = (), port: int | None = None
) -> Iterator[str]:
    """Run `kvflow server` (metrics endpoint off) until the block exits; yields its endpoint.
    `port` (default: a free one) lets a test restart a server where clients expect it."""
    port = free_port() if port is None else port
    args = [
        "server",
        "--port",
        str(port),
        "--prometheus-port",
        "0",
        "--chunk-size",
        str(chunk_size),
        "--l1-size-gb",
        "0.25",
        "--log-level",
        "warning",
        *extra_args,
    ]
    with log_path.open("wb") as log:
        proc = kvflow_process(args, stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        _wait_until_serving(proc, endpoint, log_path)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_until_serving(
    proc: LaunchedProcess | subprocess.Popen[bytes], endpoint: str, log_path: Path
) -> None:
    """Poll `status` until the server answers; raise with its log if it dies or hangs."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise ServerFailedError(
                f"kvflow server exited with {proc.returncode}:\n{log_path.read_text()}"
            )
        with KVFlowClient(endpoint, timeout_s=1.0) as client:
            try:
                client.status()
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise ServerFailedError(
                        f"kvflow server did not answer in {START_TIMEOUT_S} s ({exc}):\n"
                        f"{log_path.read_text()}"
                    ) from None
        time.sleep(0.2)
