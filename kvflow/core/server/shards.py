"""A sharded server's shard processes (docs/SERVER.md, Shards).

Each shard is a whole `KVFlowServer` in a process of its own (spawned, never forked:
CUDA), with its share of L1 and of the disk tier, its own event pipeline and Prometheus
port, listening on an ipc:// socket in the front's private directory. It reports its
endpoint, or why it could not start, through a pipe, then serves until its front sends
SIGTERM (a terminal's Ctrl-C reaches the front, which stops the shards in order).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import multiprocessing
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection
from typing import Any

from kvflow.core.config import ServerConfig

#: prctl's option that sets the signal a process gets when its parent dies
_PR_SET_PDEATHSIG = 1
#: how long a shard may take to start (L1 pins in the background, after this)
START_TIMEOUT_S = 120.0
#: how long a stopping shard may take to finish its in-flight work before it is killed
STOP_TIMEOUT_S = 30.0


def divided_quotas(quotas: tuple[str, ...], shards: int) -> tuple[str, ...]:
    """Each shard's part of the tenants' L1 limits (KIND:NAME=GIB entries, checked)."""
    parts = []
    for entry in quotas:
        head, _, gib = entry.rpartition("=")
        parts.append(f"{head}={float(gib) / shards:g}")
    return tuple(parts)


def shard_config(config: ServerConfig, index: int, directory: str) -> ServerConfig:
    """Shard `index`'s settings: the server's, with its share of L1, disk and quotas, its
    own disk directories, event-log directory and metrics port (the front's + index), a
    socket in `directory`, and no public listener, CURVE or probes (the front has them)."""
    n = config.shards
    obs = config.observability
    observability = dataclasses.replace(
        obs,
        prometheus_port=obs.prometheus_port + index if obs.prometheus_port else 0,
        event_log_dir=(
            os.path.join(obs.event_log_dir, f"shard-{index}") if obs.event_log_dir else None
        ),
    )
    return dataclasses.replace(
        config,
        shards=1,
        shard_endpoint=f"ipc://{os.path.join(directory, f'shard-{index}')}",
        shard_keyed_clients=config.curve,
        host="127.0.0.1",
        port=0,
        curve_secret_key=None,
        curve_authorized_keys=None,
        admin_keys=None,
        insecure_listen=False,
        probe_port=0,
        l1_size_gb=config.l1_size_gb / n,
        l2_disk_paths=tuple(os.path.join(p, f"shard-{index}") for p in config.l2_disk_paths),
        l2_disk_size_gb=config.l2_disk_size_gb / n,
        l1_quotas=divided_quotas(config.l1_quotas, n),
        observability=observability,
    )


def shard_resource(environ: dict[str, str], index: int, front_pid: int) -> str:
    """OTEL_RESOURCE_ATTRIBUTES for shard `index`: the operator's, plus `kvflow.shard` and
    (unless given) a `service.instance.id` of its own, so the shards' OTLP streams (same
    metric names, one per process) stay apart at the collector."""
    given = environ.get("OTEL_RESOURCE_ATTRIBUTES", "").strip().strip(",")
    extra = [f"kvflow.shard={index}"]
    if "service.instance.id=" not in given:
        extra.append(f"service.instance.id={socket.gethostname()}:{front_pid}/shard-{index}")
    return ",".join([given, *extra] if given else extra)


def _stop_with(front_pid: int) -> None:
    """Have the kernel send this process SIGTERM when the front dies (Linux's parent-death
    signal): a front killed outright must not leave its shards holding the GPUs' memory.
    Exits at once if the front is already gone."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != front_pid:
        sys.exit(1)


def _run_shard(config: ServerConfig, index: int, front_pid: int, conn: Connection) -> None:
    """A shard process's body: serve `config`, telling the front the endpoint or why not."""
    from kvflow.core.server.server import KVFlowServer
    from kvflow.core.server.server_logging import configure_server_logging

    _stop_with(front_pid)
    os.environ["OTEL_RESOURCE_ATTRIBUTES"] = shard_resource(dict(os.environ), index, front_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when shards stop
    setup = configure_server_logging(config.observability)
    sys.setswitchinterval(config.switch_interval_ms / 1e3)
    try:
        server = KVFlowServer(config)
    except (OSError, ValueError) as exc:
        conn.send(("error", type(exc).__name__, str(exc)))
        sys.exit(1)
    signal.signal(signal.SIGTERM, lambda signum, frame: server.request_stop())
    conn.send(("ready", server.endpoint))
    conn.close()
    try:
        server.serve_forever()
    finally:
        if setup is not None:
            setup.close()


class Shard:
    """One shard process: started by `start`, ready once `wait_ready` returned."""

    def __init__(self, config: ServerConfig, index: int, directory: str) -> None:
        self.index = index
        self.config = shard_config(config, index, directory)
        self.endpoint: str = self.config.shard_endpoint or ""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=_run_shard, args=(self.config, index, os.getpid(), child),
            name=f"kvflow-shard-{index}", daemon=False,
        )  # fmt: skip
        self._terminated = False
        self._process.start()
        child.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the process has ended."""
        return int(self._process.sentinel)

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait for the shard to listen; OSError or ValueError (what the shard's server
        raised, naming the shard) when it could not, RuntimeError when it died or hung."""
        what = f"shard {self.index}"
        if not self._conn.poll(timeout_s):
            self.stop(0.0)
            raise RuntimeError(f"{what} did not start within {timeout_s:g} s")
        try:
            message: Any = self._conn.recv()
        except EOFError:
            self._process.join(5.0)
            raise RuntimeError(
                f"{what} exited while starting (exit code {self._process.exitcode})"
            ) from None
        finally:
            self._conn.close()
        if message[0] == "error":
            _, kind, text = message
            self._process.join(5.0)
            raise (ValueError if kind == "ValueError" else OSError)(f"{what}: {text}")

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the process to end."""
        self._process.join(timeout_s)

    def terminate(self) -> None:
        """Send SIGTERM once: the shard finishes its in-flight work and exits (a second
        one would make it stop waiting for that work)."""
        if not self._terminated and self._process.is_alive():
            self._terminated = True
            self._process.terminate()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """`terminate`, wait up to `timeout_s` for the exit, then SIGKILL."""
        self.terminate()
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)
