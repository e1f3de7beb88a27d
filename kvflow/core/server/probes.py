"""Health and readiness over HTTP: `/healthz` and `/readyz` (docs/OPERATIONS.md, Probes).

`/healthz` answers 200 while the server's main loop turns (it stamps every tick), 503
once it has stalled. `/readyz` answers 200 when the server should get traffic: L1
pinned to its floor (pinning ahead finished), every L2 tier reachable, not draining,
not stopping; otherwise 503 with the reasons. Each answer is a short JSON object
computed from in-memory state (no I/O), so a probe costs well under 10 ms.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from kvflow.core.tiers.pinahead import MODE_WORDS

log = logging.getLogger("kvflow.server.probes")

#: a main loop that has not ticked for this long is reported unhealthy (it ticks every 0.1 s)
STALL_S = 10.0

#: (ok, JSON body) of one probe
Verdict = tuple[bool, dict[str, Any]]


def l1_reasons(pin_state: Mapping[str, Any] | None) -> list[str]:
    """Why L1 is not ready: pinning (or faulting in) ahead still runs (None: L1 grows on
    demand)."""
    if pin_state is None or not pin_state.get("pinning"):
        return []
    pinned, target = pin_state.get("pinned_bytes", 0), pin_state.get("target_bytes", 0)
    doing, done = MODE_WORDS[pin_state.get("mode", "pin")]
    return [f"l1 {doing}: {pinned / (1 << 30):.2f} of {target / (1 << 30):.2f} GiB {done}"]


def tier_reasons(tier_stats: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Why the L2 tiers are not ready: a tier that reports itself disconnected."""
    return [
        f"l2 tier {name} unreachable"
        for name, stats in tier_stats.items()
        if stats.get("connected", 1) == 0
    ]


class Probes:
    """The verdicts of both probes, from callables reading the server's state."""

    def __init__(
        self,
        *,
        loop_age_s: Callable[[], float],
        pin_state: Callable[[], Mapping[str, Any] | None],
        tier_stats: Callable[[], Mapping[str, Mapping[str, int]]],
        draining: Callable[[], bool],
        stopping: Callable[[], bool],
    ) -> None:
        self._loop_age_s = loop_age_s
        self._pin_state = pin_state
        self._tier_stats = tier_stats
        self._draining = draining
        self._stopping = stopping
        #: L1 reached its floor once: a later live resize pinning more keeps the server ready
        self._l1_pinned = False

    def health(self) -> Verdict:
        age = self._loop_age_s()
        ok = age < STALL_S
        body: dict[str, Any] = {"status": "ok" if ok else "stalled", "loop_age_s": round(age, 3)}
        return ok, body

    def readiness(self) -> Verdict:
        reasons: list[str] = []
        if self._stopping():
            reasons.append("stopping")
        if self._draining():
            reasons.append("draining")
        age = self._loop_age_s()
        if age >= STALL_S:
            reasons.append(f"main loop stalled for {age:.1f} s")
        if not self._l1_pinned:
            pinning = l1_reasons(self._pin_state())
            self._l1_pinned = not pinning
            reasons += pinning
        reasons += tier_reasons(self._tier_stats())
        if reasons:
            return False, {"status": "not ready", "reasons": reasons}
        return True, {"status": "ready"}


class Verdicts(Protocol):
    """What a probe endpoint serves: a server's `Probes`, or a sharded front's."""

    def health(self) -> Verdict: ...

    def readiness(self) -> Verdict: ...


class ProbeServer:
    """Serves a server's `Verdicts` on host:port on a daemon thread; `close()` frees the
    port. Port 0 binds a free port (read `port` after construction).
    """

    def __init__(self, probes: Verdicts, host: str, port: int) -> None:
        routes: dict[str, Callable[[], Verdict]] = {
            "/healthz": probes.health,
            "/readyz": probes.readiness,
        }

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                if route is None:
                    ok, body = False, {"status": "not found", "paths": sorted(routes)}
                    code = 404
                else:
                    try:
                        ok, body = route()
                    except Exception as exc:  # a probe must answer, never hang or crash
                        log.exception("probe %s failed", self.path)
                        ok, body = False, {"status": "error", "reasons": [str(exc)]}
                    code = 200 if ok else 503
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                """Probes come every few seconds: no access log."""

        try:
            self._httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise OSError(f"the probe endpoint cannot listen on {host}:{port}: {exc}") from None
        self._httpd.daemon_threads = True
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="kvflow-probes", daemon=True
        )
        self._thread.start()
        log.info("probes on http://%s:%d/healthz and /readyz", host, self.port)

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(5.0)
        self._httpd.server_close()


class LoopClock:
    """The main loop's last tick, for /healthz (written by the loop, read by probes)."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def tick(self) -> None:
        self._last = time.monotonic()

    def age_s(self) -> float:
        return time.monotonic() - self._last
