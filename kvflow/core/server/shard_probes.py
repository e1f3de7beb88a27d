"""/healthz and /readyz of a sharded server's front (docs/OPERATIONS.md, Probes).

Healthy while the front's loop turns and every shard answered its status lately; ready
when, besides, no shard has a reason of its own not to be (L1 pinning ahead, an L2 tier
unreachable, draining), read from the statuses the front asks for every second.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.core.server.probes import STALL_S, Verdict, l1_reasons, tier_reasons

#: each shard's last status and when the front asked for it (None: no answer yet)
ShardStatuses = Sequence[tuple[float, dict[str, Any]] | None]


def shard_reasons(index: int, status: dict[str, Any]) -> list[str]:
    """Why shard `index`, by its status, should not get traffic."""
    reasons = l1_reasons(status.get("l1_pinning"))
    reasons += tier_reasons((status.get("l2") or {}).get("tiers") or {})
    if ((status.get("server") or {}).get("drain") or {}).get("draining"):
        reasons.append("draining")
    return [f"shard {index}: {r}" for r in reasons]


class ShardProbes:
    """The verdicts of both probes, from the front's loop clock and the shards' statuses."""

    def __init__(
        self,
        loop_age_s: Callable[[], float],
        statuses: Callable[[], ShardStatuses],
        stopping: Callable[[], bool],
    ) -> None:
        self._loop_age_s = loop_age_s
        self._statuses = statuses
        self._stopping = stopping

    def _silent(self) -> list[str]:
        """Shards whose status is older than STALL_S (or that never answered)."""
        now = time.monotonic()
        out = []
        for index, entry in enumerate(self._statuses()):
            if entry is None:
                out.append(f"shard {index} has not answered yet")
            elif now - entry[0] >= STALL_S:
                out.append(f"shard {index} silent for {now - entry[0]:.1f} s")
        return out

    def health(self) -> Verdict:
        age = self._loop_age_s()
        silent = [r for r in self._silent() if "silent" in r]
        ok = age < STALL_S and not silent
        body: dict[str, Any] = {"status": "ok" if ok else "stalled", "loop_age_s": round(age, 3)}
        if silent:
            body["reasons"] = silent
        return ok, body

    def readiness(self) -> Verdict:
        reasons: list[str] = ["stopping"] if self._stopping() else []
        age = self._loop_age_s()
        if age >= STALL_S:
            reasons.append(f"main loop stalled for {age:.1f} s")
        reasons += self._silent()
        for index, entry in enumerate(self._statuses()):
            if entry is not None:
                reasons += shard_reasons(index, entry[1])
        if reasons:
            return False, {"status": "not ready", "reasons": reasons}
        return True, {"status": "ready"}
