"""Real redis-server processes for tests: on free ports, in temporary directories.

`RedisServer` writes a redis.conf (no persistence, loopback only) and runs
`redis-server` with it: plain, with `requirepass`, with ACL users (`default` off or
given another password), with TLS (certificates made by `openssl` in its directory),
with `maxmemory` and a policy. It starts, stops (SIGTERM), restarts on the same port,
and hangs (SIGSTOP) and resumes (SIGCONT). `shared_server()` is one plain server per
test process (the tier contract's); callers flush it.

Everything needing `redis-server` (or `openssl`, for TLS) that is not installed fails
the calling test under CI and skips it elsewhere (tests/support/requirements.py);
`require_tls()` does the same when TLS cannot be tested, `tls_unsupported()` says why.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tests.support.collectors import free_port
from tests.support.requirements import find, missing, require_or_skip

REDIS_SERVER = find("redis-server") or "/usr/bin/redis-server"
OPENSSL = find("openssl")


def require_redis_server() -> str:
    """The redis-server binary; missing, the test fails under CI and skips elsewhere."""
    return require_or_skip("redis-server", "the test runs a real redis-server")


@dataclass
class AclUser:
    """An ACL user of the server: `user NAME on >PASSWORD ~* +@all`."""

    name: str
    password: str


@dataclass
class RedisServer:
    """One redis-server process and its configuration (see the module doc)."""

    directory: Path
    port: int = 0
    password: str | None = None  # requirepass (the default user's password)
    users: Sequence[AclUser] = ()
    default_off: bool = False  # with users: `user default off`
    tls: bool = False  # listen with TLS only (tls-port), certs in `directory`
    maxmemory: str | None = None  # e.g. "2mb"
    policy: str | None = None  # maxmemory-policy, e.g. "noeviction"
    extra: Sequence[str] = ()  # more redis.conf lines
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        if self.tls:
            make_certs(self.directory)

    # -- configuration -------------------------------------------------------------

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def log_file(self) -> Path:
        return self.directory / "redis.log"

    def conf_lines(self) -> list[str]:
        lines = [
            "bind 127.0.0.1",
            f"dir {self.directory}",
            f"logfile {self.log_file}",
            'save ""',
            "appendonly no",
            "daemonize no",
            "protected-mode no",
            "loglevel notice",
        ]
        if self.tls:
            d = self.directory
            lines += [
                "port 0",
                f"tls-port {self.port}",
                f"tls-cert-file {d / 'server.crt'}",
                f"tls-key-file {d / 'server.key'}",
                f"tls-ca-cert-file {self.ca_file}",
                "tls-auth-clients no",
            ]
        else:
            lines.append(f"port {self.port}")
        if self.password is not None:
            lines.append(f"requirepass {self.password}")
        for user in self.users:
            lines.append(f"user {user.name} on >{user.password} ~* &* +@all")
        if self.default_off:
            lines.append("user default off")
        if self.maxmemory is not None:
            lines.append(f"maxmemory {self.maxmemory}")
        if self.policy is not None:
            lines.append(f"maxmemory-policy {self.policy}")
        return lines + list(self.extra)

    def url(self, username: str | None = None, password: str | None = None, db: int = 0) -> str:
        """The server's URL, with the given credentials in it (only when given)."""
        creds = ""
        if username or password:
            creds = f"{username or ''}:{password or ''}@" if password else f"{username}@"
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{creds}127.0.0.1:{self.port}/{db}"

    def admin(self, **kwargs: Any) -> redis.Redis:
        """A plain redis-py client with working credentials (the first ACL user's when
        the default user is off), for a test to look behind the tier."""
        args: dict[str, Any] = {"host": "127.0.0.1", "port": self.port, "socket_timeout": 5}
        if self.default_off and self.users:
            args.update(username=self.users[0].name, password=self.users[0].password)
        elif self.password is not None:
            args["password"] = self.password
        if self.tls:
            args.update(ssl=True, ssl_ca_certs=str(self.ca_file))
        args.update(kwargs)
        return redis.Redis(**args)

    # -- process ------------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start redis-server on `port` and wait until it (not another server) answers."""
        binary = require_redis_server()
        if self.process is not None and self.process.poll() is None:
            return self
        conf = self.directory / "redis.conf"
        conf.write_text("\n".join(self.conf_lines()) + "\n")
        self.process = subprocess.Popen(
            [binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout_s
        client = self.admin(socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    err = self.process.stderr.read().decode() if self.process.stderr else ""
                    log = self.log_file.read_text() if self.log_file.exists() else ""
                    raise RuntimeError(
                        f"redis-server exited ({self.process.returncode}): {err}{log[-2000:]}"
                    )
                try:
                    if int(client.info("server")["process_id"]) == self.process.pid:
                        return self  # this server answers, not another one on its port
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 5 s) and wait for it; idempotent."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGCONT)  # a hung server must run to exit
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()

    def restart(self) -> RedisServer:
        """Stop, then start again on the same port (an empty dataset: nothing is saved)."""
        self.stop()
        return self.start()

    def hang(self) -> None:
        """SIGSTOP the server: connections stay open, nothing answers."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a hung server."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def flush(self) -> None:
        with self.admin() as client:
            client.flushall()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def redis_server(**kwargs: Any) -> Iterator[RedisServer]:
    """A started RedisServer in a fresh temporary directory, stopped and removed after."""
    require_redis_server()
    with tempfile.TemporaryDirectory(prefix="kvflow-redis-") as tmp, RedisServer(
        Path(tmp), **kwargs
    ) as server:  # fmt: skip
        yield server


@contextmanager
def one_node_cluster(tls: bool = False, **kwargs: Any) -> Iterator[RedisServer]:
    """A Redis Cluster of one node serving all 16384 slots (TLS only when `tls`; `kwargs`
    as for RedisServer). Its bus gets a free port of its own (the default, port + 10000,
    may lie past 65535); a port taken meanwhile makes the node exit, and a fresh pair of
    ports is tried, up to five times."""
    extra = ["cluster-enabled yes", "cluster-config-file nodes.conf"]
    if tls:
        extra.append("tls-cluster yes")
    with contextlib.ExitStack() as stack:
        for attempt in range(5):
            bus = f"cluster-port {free_port()}"
            try:
                node = stack.enter_context(redis_server(tls=tls, extra=[*extra, bus], **kwargs))
                break
            except RuntimeError:  # it exited: a port was taken meanwhile
                if attempt == 4:
                    raise
        admin = stack.enter_context(node.admin())
        admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 10
        while "cluster_state:ok" not in str(admin.execute_command("CLUSTER", "INFO")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the one-node cluster on port {node.port} is not ok after 10 s")
            time.sleep(0.05)
        yield node


# -- TLS ----------------------------------------------------------------------------------


def make_certs(directory: Path) -> None:
    """A throw-away CA (ca.crt) and a server certificate for 127.0.0.1/localhost
    (server.crt, server.key) signed by it, made with openssl (EC P-256, one day)."""
    openssl = require_or_skip("openssl", "it makes the certificates of the TLS test")
    d = str(directory)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=kvflow test CA")  # fmt: skip
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "san.ext")  # fmt: skip


@functools.cache
def tls_unsupported() -> str | None:
    """Why a TLS server cannot be run here (None when it can): no openssl, or a
    redis-server built without TLS (probed by starting one)."""
    if not os.access(REDIS_SERVER, os.X_OK):
        return "redis-server is not installed"
    if OPENSSL is None:
        return "openssl is not installed"
    with tempfile.TemporaryDirectory(prefix="kvflow-redis-tls-probe-") as tmp:
        try:
            with RedisServer(Path(tmp), tls=True):
                return None
        except RuntimeError as e:
            return f"this redis-server cannot serve TLS: {str(e)[-300:]}"


def require_tls() -> None:
    """Fail (CI) or skip (elsewhere) the calling test unless a TLS redis-server can run."""
    require_redis_server()
    require_or_skip("openssl", "it makes the certificates of the TLS test")
    reason = tls_unsupported()
    if reason is not None:
        missing("a redis-server built with TLS", reason, "the Debian package redis-server")


# -- one server per test process ----------------------------------------------------------

_shared: RedisServer | None = None


def shared_server() -> RedisServer:
    """A plain server for the whole test process (started on first use, stopped at exit);
    callers flush it before use."""
    global _shared
    if _shared is None or _shared.process is None or _shared.process.poll() is not None:
        require_redis_server()
        tmp = tempfile.mkdtemp(prefix="kvflow-redis-shared-")
        server = RedisServer(Path(tmp)).start()
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        atexit.register(server.stop)
        _shared = server
    return _shared
