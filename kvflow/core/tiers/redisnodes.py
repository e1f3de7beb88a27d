"""A Redis Cluster's nodes one at a time: each call sends one pipeline per node holding
some of its keys, so a node that is down costs only its own keys. A node that fails is
skipped (its keys fail at once, without network I/O) for a backoff that doubles up to
a cap, while the other masters keep serving and the tier stays connected; its outage
is logged once, by name, and each of its returns counts one reconnect.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.core.tiers.redislink import LINK_ERRORS, _Down
from kvflow.core.tiers.redisstats import RedisStats

log = logging.getLogger("kvflow.tiers.redis")


class ClusterNodes:
    """Which cluster nodes are down, until when, and how often one came back.

    Lock rule: the lock guards `_retry` (when to try each down node again), `_delay`
    (its current backoff) and `_rejoins`, each read and written under it. It is never
    held while a pipeline runs or the slot map is re-read. The backoff settings and the
    `stats` and `scrub` it reports through are fixed at construction.
    """

    def __init__(
        self,
        *,
        backoff_s: tuple[float, float],
        stats: RedisStats,
        scrub: Callable[[BaseException | str], str],
    ) -> None:
        self._first_s, self._cap_s = backoff_s  # a node's first backoff, and the cap
        self._stats = stats
        self._scrub = scrub
        self._lock = threading.Lock()
        self._retry: dict[str, float] = {}
        self._delay: dict[str, float] = {}
        self._rejoins = 0

    def rejoins(self) -> int:
        """How many times a node that had failed answered again."""
        with self._lock:
            return self._rejoins

    def execute(
        self, client: Any, names: Sequence[bytes], add: Callable[[Any, int], None]
    ) -> list[Any]:
        """Run one pipelined command per name (`add(pipe, i)` queues name i's), one
        pipeline per node; one reply per name, an Exception where it failed (a _Down for
        a node that is down or in its backoff, or for a slot with no node)."""
        replies: list[Any] = [None] * len(names)
        for node, idxs in self._by_node(client, names).items():
            if node is None or not self._usable(client, node):
                down = _Down(f"cluster node {node or '(no node for the slot)'} is down")
                for i in idxs:
                    replies[i] = down
                continue
            try:
                pipe = client.pipeline()
                for i in idxs:
                    add(pipe, i)
                got = pipe.execute(raise_on_error=False)
            except Exception as e:
                if isinstance(e, LINK_ERRORS):
                    self._failed(node, e)
                got = [e] * len(idxs)
            else:
                self._ok(node)
            for i, reply in zip(idxs, got, strict=True):
                replies[i] = reply
        return replies

    def _by_node(self, client: Any, names: Sequence[bytes]) -> dict[str | None, list[int]]:
        """Indexes of `names` by the cluster node serving their slot (None: no node; those
        names fail, counted by their call, and why is recorded and logged once)."""
        groups: dict[str | None, list[int]] = {}
        error: Exception | None = None
        for i, name in enumerate(names):
            try:
                node: str | None = client.get_node_from_key(name).name
            except Exception as e:
                node, error = None, e
            groups.setdefault(node, []).append(i)
        if error is not None:
            self._stats.swallowed(
                "cluster: no node for a key's slot", f"cluster slot lookup: {self._scrub(error)}"
            )
        return groups

    def _usable(self, client: Any, node: str) -> bool:
        """Whether to send to `node` now: never marked down, or its backoff is over (then
        the client first re-reads the slot map: a replica may have taken over; if that
        fails, the node is tried with the map it has, and the error recorded)."""
        with self._lock:
            retry_at = self._retry.get(node)
        if retry_at is None:
            return True
        if time.monotonic() < retry_at:
            return False
        try:
            client.nodes_manager.initialize()
        except Exception as e:
            self._stats.swallowed(
                "cluster: re-reading the slot map failed", f"cluster slot map: {self._scrub(e)}"
            )
        return True

    def _failed(self, node: str, exc: BaseException) -> None:
        """A node is unreachable: its names fail fast for a backoff that doubles."""
        with self._lock:
            delay = min(2 * self._delay.get(node, self._first_s / 2), self._cap_s)
            self._delay[node] = delay
            first = node not in self._retry
            self._retry[node] = time.monotonic() + delay
        self._stats.error(f"cluster node {node}: {self._scrub(exc)}")
        if first:
            log.warning(
                "L2 Redis cluster node %s unreachable; its keys miss until it answers", node
            )

    def _ok(self, node: str) -> None:
        """A node answered: if it was down, it is back (one reconnect)."""
        with self._lock:
            if self._retry.pop(node, None) is not None:
                self._delay.pop(node, None)
                self._rejoins += 1
