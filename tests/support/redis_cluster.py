"""A real Redis Cluster for tests: three masters (and optionally a replica of each) as
`redis-server` processes on free loopback ports, in a directory of their own.

`running_cluster(where)` creates the cluster with `redis-cli --cluster create`, waits
until every node says `cluster_state:ok` and agrees on the slot map, and yields a
`RedisCluster` that can kill (SIGKILL) and restart a node, move a slot from one master
to another while clients are live, wait for a replica's promotion, and read per-node
statistics. Leaving the block kills every process and removes the directory. Without
`redis-server` or `redis-cli` on PATH, `require_redis_binaries()` skips the test.

Nodes run without persistence (`--appendonly no --save ''`), so a restarted node comes
back empty (its `nodes-P.conf` keeps its place in the cluster), and with a short
`cluster-node-timeout` (1 s by default) so a killed master's replica takes over in a
couple of seconds. `cluster-require-full-coverage no` keeps the other masters serving
while one is down, as a cache deployment sets it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tests.support.collectors import free_port
from tests.support.requirements import require_or_skip

START_TIMEOUT_S = 20.0
SLOTS = 16384


def require_redis_binaries() -> None:
    """Fail (CI) or skip (elsewhere) the calling test unless redis-server and redis-cli
    are installed (tests/support/requirements.py)."""
    for binary in ("redis-server", "redis-cli"):
        require_or_skip(binary, "real Redis Cluster tests run a cluster of redis-servers")


@dataclass
class ClusterNode:
    """One redis-server of the cluster: its client port, bus port, directory, process."""

    index: int
    port: int
    bus_port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    node_id: str = ""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log(self) -> Path:
        return self.dir / "redis.log"


@dataclass
class RedisCluster:
    """A running cluster; node 0..2 start as masters, 3..5 (if any) as their replicas."""

    root: Path
    nodes: list[ClusterNode]
    password: str | None = None
    node_timeout_ms: int = 1000
    _clients: dict[int, redis.Redis] = field(default_factory=dict)
    #: CLUSTER NODES right after creation (which slots each node started with)
    _startup_topology: list[dict[str, Any]] = field(default_factory=list)

    # -- addresses ---------------------------------------------------------------------

    @property
    def seed_url(self) -> str:
        """redis://127.0.0.1:P of node 0, with no credential in it."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def url_with_password(self, node: ClusterNode | None = None) -> str:
        """A node's URL carrying the password (redis://:PASSWORD@127.0.0.1:P)."""
        node = node or self.nodes[0]
        return f"redis://:{self.password}@127.0.0.1:{node.port}"

    # -- admin access ------------------------------------------------------------------

    def client(self, node: ClusterNode) -> redis.Redis:
        """A plain (non-cluster) connection to one node, for admin commands."""
        cached = self._clients.get(node.port)
        if cached is None:
            cached = redis.Redis(
                host="127.0.0.1",
                port=node.port,
                password=self.password,
                socket_timeout=5.0,
                socket_connect_timeout=1.0,
            )
            self._clients[node.port] = cached
        return cached

    def cmd(self, node: ClusterNode, *args: Any) -> Any:
        """Run one command on one node and return its decoded-as-returned reply."""
        return self.client(node).execute_command(*args)

    def info(self, node: ClusterNode, section: str) -> dict[str, Any]:
        reply: dict[str, Any] = self.client(node).info(section)
        return reply

    def cluster_info(self, node: ClusterNode) -> dict[str, str]:
        raw = self.cmd(node, "CLUSTER", "INFO")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(
            line.split(":", 1) for line in text.splitlines() if ":" in line
        )  # cluster_state, cluster_slots_ok, ...

    def topology(self, node: ClusterNode | None = None) -> list[dict[str, Any]]:
        """CLUSTER NODES as seen by `node` (a live one by default): id, port, flags,
        master id, slots (list of (start, end))."""
        node = node or next(n for n in self.nodes if n.alive)
        raw = self.cmd(node, "CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        out = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 8:
                continue
            slots = []
            for spec in parts[8:]:
                if spec.startswith("["):
                    continue  # a migrating/importing marker
                start, _, end = spec.partition("-")
                slots.append((int(start), int(end or start)))
            out.append(
                {
                    "id": parts[0],
                    "port": int(parts[1].split("@")[0].rsplit(":", 1)[1]),
                    "flags": set(parts[2].split(",")),
                    "master": parts[3],
                    "slots": slots,
                }
            )
        return out

    def node_by_port(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    def masters(self) -> list[ClusterNode]:
        """The nodes that currently serve slots (not failed), in node order."""
        ports = {
            row["port"]
            for row in self.topology()
            if "master" in row["flags"] and row["slots"] and not row["flags"] & {"fail", "fail?"}
        }
        return [n for n in self.nodes if n.port in ports and n.alive]

    def replicas(self) -> list[ClusterNode]:
        ports = {row["port"] for row in self.topology() if "slave" in row["flags"]}
        return [n for n in self.nodes if n.port in ports]

    def keyslot(self, key: bytes | str) -> int:
        return int(self.cmd(self._any_alive(), "CLUSTER", "KEYSLOT", key))

    def master_of_slot(self, slot: int) -> ClusterNode:
        for row in self.topology():
            if "master" in row["flags"] and any(a <= slot <= b for a, b in row["slots"]):
                return self.node_by_port(row["port"])
        raise LookupError(f"no master serves slot {slot}")

    def dbsize(self, node: ClusterNode) -> int:
        return int(self.cmd(node, "DBSIZE"))

    def keys(self, node: ClusterNode, pattern: str = "*") -> list[bytes]:
        return list(self.client(node).scan_iter(match=pattern, count=1000))

    def _any_alive(self) -> ClusterNode:
        return next(n for n in self.nodes if n.alive)

    # -- waiting -----------------------------------------------------------------------

    def wait_ok(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until every live node says cluster_state:ok, sees every slot served, and all
        agree on who serves which slot."""

        def ok() -> bool:
            maps = []
            for node in self.nodes:
                if not node.alive:
                    continue
                info = self.cluster_info(node)
                if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != str(SLOTS):
                    return False
                maps.append(
                    sorted(
                        (row["port"], tuple(row["slots"]))
                        for row in self.topology(node)
                        if "master" in row["flags"] and row["slots"]
                    )
                )
            return all(m == maps[0] for m in maps)

        _poll(ok, timeout, "cluster_state:ok and one slot map on every live node", self)

    def wait_replicated(self, timeout: float = 10.0) -> None:
        """Until every live master's replicas have acknowledged its whole stream."""

        def done() -> bool:
            for node in self.masters():
                info = self.info(node, "replication")
                offset = int(info.get("master_repl_offset", 0))
                slaves = [v for k, v in info.items() if k.startswith("slave")]
                slaves = [s for s in slaves if isinstance(s, dict)]
                if any(int(s["offset"]) < offset or s["state"] != "online" for s in slaves):
                    return False
            return True

        _poll(done, timeout, "replicas caught up with their masters", self)

    def wait_failover(self, dead: ClusterNode, timeout: float = 15.0) -> ClusterNode:
        """Until a replica of the dead master serves its slots and the cluster is ok;
        returns the promoted node."""
        old_slots = next(r["slots"] for r in self._startup_topology if r["port"] == dead.port)
        probe = old_slots[0][0]

        def promoted() -> bool:
            try:
                return self.master_of_slot(probe).port != dead.port
            except (LookupError, redis.RedisError):
                return False

        _poll(promoted, timeout, f"a replica of {dead.address} promoted", self)
        self.wait_ok(timeout)
        return self.master_of_slot(probe)

    # -- faults and changes ------------------------------------------------------------

    def kill(self, node: ClusterNode) -> None:
        """SIGKILL the node's process (its memory, all of its data, is gone)."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(timeout=10)
        stale = self._clients.pop(node.port, None)
        if stale is not None:
            stale.close()

    def restart(self, node: ClusterNode, timeout: float = START_TIMEOUT_S) -> None:
        """Start a killed node again on the same ports and directory (it rejoins the
        cluster from its nodes-P.conf, empty: there is no persistence)."""
        assert not node.alive, f"{node.address} is still running"
        _start_node(node, self.password, self.node_timeout_ms)
        _wait_answers(node, self.password, timeout)

        def rejoined() -> bool:
            return all(
                not row["flags"] & {"fail", "fail?"}
                for other in self.nodes
                if other.alive
                for row in self.topology(other)
                if row["port"] == node.port
            )

        _poll(rejoined, timeout, f"{node.address} seen back by every live node", self)
        self.wait_ok(timeout)

    def move_slot(
        self, slot: int, dst: ClusterNode, *, during: Callable[[], None] | None = None
    ) -> int:
        """Migrate `slot` and its keys to master `dst` the way `redis-cli --cluster
        reshard` does (IMPORTING/MIGRATING, MIGRATE in batches, SETSLOT NODE on every
        master); returns how many keys moved. Clients with the old slot map get MOVED.

        `during` runs once half the slot's keys have moved while the slot is still
        migrating (the moved keys answer with ASK redirects then)."""
        src = self.master_of_slot(slot)
        assert src.port != dst.port, f"slot {slot} is served by {dst.address} already"
        src_id, dst_id = self.cmd(src, "CLUSTER", "MYID"), self.cmd(dst, "CLUSTER", "MYID")
        src_id, dst_id = _text(src_id), _text(dst_id)
        self.cmd(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        self.cmd(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        auth = ("AUTH", self.password) if self.password else ()
        moved = 0
        total = int(self.cmd(src, "CLUSTER", "COUNTKEYSINSLOT", slot))
        batch = max(1, total // 2) if during is not None else 100
        while True:
            keys = self.cmd(src, "CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            self.cmd(src, "MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, *auth, "KEYS", *keys)
            moved += len(keys)
            if during is not None:
                during()
                during, batch = None, 100
        for node in (dst, src, *(m for m in self.masters() if m not in (src, dst))):
            self.cmd(node, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        self.wait_ok()
        return moved

    def reset_stats(self) -> None:
        """CONFIG RESETSTAT on every live node (commandstats, errorstats, reads)."""
        for node in self.nodes:
            if node.alive:
                self.cmd(node, "CONFIG", "RESETSTAT")

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGKILL)
        for node in self.nodes:
            if node.proc is not None:
                node.proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _poll(check: Callable[[], bool], timeout: float, what: str, cluster: RedisCluster) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass  # a node restarting or refusing while the cluster settles
        if time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {n.address} ({'up' if n.alive else 'down'}):\n"
                + (n.log.read_text()[-1500:] if n.log.exists() else "(no log)")
                for n in cluster.nodes
            )
            raise TimeoutError(f"Redis Cluster: no {what} within {timeout} s\n{logs}")
        time.sleep(0.05)


def _start_node(node: ClusterNode, password: str | None, node_timeout_ms: int) -> None:
    args = [
        "redis-server",
        "--port", str(node.port),
        "--cluster-port", str(node.bus_port),
        "--bind", "127.0.0.1",
        "--dir", str(node.dir),
        "--logfile", "redis.log",
        "--daemonize", "no",
        "--cluster-enabled", "yes",
        "--cluster-config-file", f"nodes-{node.port}.conf",
        "--cluster-node-timeout", str(node_timeout_ms),
        "--cluster-require-full-coverage", "no",
        "--cluster-replica-validity-factor", "0",
        "--repl-diskless-sync-delay", "0",
        "--appendonly", "no",
        "--save", "",
    ]  # fmt: skip
    if password is not None:
        args += ["--requirepass", password, "--masterauth", password]
    node.proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=node.dir,
    )


def _wait_answers(node: ClusterNode, password: str | None, timeout: float) -> None:
    """Until the node's own process answers; RuntimeError with its log if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert node.proc is not None
        if node.proc.poll() is not None:
            log = node.log.read_text() if node.log.exists() else ""
            raise RuntimeError(f"redis-server on {node.address} exited:\n{log[-2000:]}")
        try:
            with redis.Redis(port=node.port, password=password, socket_timeout=1.0) as r:
                if int(r.info("server")["process_id"]) == node.proc.pid:
                    return  # this node answers, not another server that holds its port
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis-server on {node.address} did not answer in {timeout} s")
        time.sleep(0.02)


def _distinct_free_ports(count: int, taken: set[int]) -> list[int]:
    """`count` free loopback ports, none in `taken` nor repeated: the kernel may hand a
    just-closed ephemeral port out twice, and two nodes on one port make one vanish."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in taken and port not in ports:
            ports.append(port)
    return ports


def _start_with_free_ports(
    node: ClusterNode, others: list[ClusterNode], password: str | None, timeout_ms: int
) -> None:
    """Start the node, picking new ports (none of the `others`') when the ones it had
    were taken meanwhile."""
    for _ in range(5):
        _start_node(node, password, timeout_ms)
        try:
            _wait_answers(node, password, START_TIMEOUT_S)
            return
        except RuntimeError:
            if node.proc is not None and node.proc.poll() is None:
                raise
            taken = {p for n in others if n is not node for p in (n.port, n.bus_port)}
            node.port, node.bus_port = _distinct_free_ports(2, taken)
            for stale in node.dir.glob("*"):
                stale.unlink()
    raise RuntimeError("could not start redis-server on free loopback ports")


@contextlib.contextmanager
def running_cluster(
    where: Path | None = None,
    *,
    replicas: bool = False,
    password: str | None = None,
    node_timeout_ms: int = 1000,
) -> Iterator[RedisCluster]:
    """A 3-master Redis Cluster (plus one replica per master when `replicas`) in a new
    directory under `where`; every process killed and the directory removed at exit."""
    require_redis_binaries()
    root = Path(tempfile.mkdtemp(prefix="redis-cluster-", dir=where))
    count = 6 if replicas else 3
    ports = _distinct_free_ports(2 * count, set())
    nodes = []
    for i in range(count):
        node_dir = root / f"node{i}"
        node_dir.mkdir()
        nodes.append(ClusterNode(i, ports[2 * i], ports[2 * i + 1], node_dir))
    cluster = RedisCluster(root, nodes, password=password, node_timeout_ms=node_timeout_ms)
    try:
        for node in nodes:
            _start_with_free_ports(node, nodes, password, node_timeout_ms)
        auth = ["-a", password, "--no-auth-warning"] if password else []
        create = subprocess.run(
            ["redis-cli", *auth, "--cluster", "create", *(n.address for n in nodes),
             "--cluster-replicas", "1" if replicas else "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if create.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}"
            )
        cluster.wait_ok()
        for node in nodes:
            node.node_id = _text(cluster.cmd(node, "CLUSTER", "MYID"))
        if replicas:  # every replica attached and synced before the test starts
            _poll(
                lambda: (
                    len(cluster.replicas()) == 3
                    and all(
                        cluster.info(r, "replication").get("master_link_status") == "up"
                        for r in cluster.replicas()
                    )
                ),
                START_TIMEOUT_S,
                "replicas linked to their masters",
                cluster,
            )
        cluster._startup_topology = cluster.topology()
        yield cluster
    finally:
        cluster.close()


def cluster_env_without_redis_vars() -> dict[str, str]:
    """os.environ minus KVFLOW_REDIS_* (so a developer's settings never leak into a test)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_REDIS_")}
