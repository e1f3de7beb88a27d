"""Pinning L1's host memory ahead of demand, on background threads.

Page-locking costs about 0.16 s per GiB (page faults, then the driver's registration;
0.27-0.5 s when the registration faulted the pages in itself). An L1 that pinned a
segment inside the store that needed it stalled that store for as long, once per
segment: 100 times for a 100 GB L1. `PinAhead` instead makes every segment up to L1's
capacity in the background from start-up, on several threads, and hands each to L1 as
soon as it is pinned; a store meanwhile uses what is pinned (evicting if it must) and
waits only when L1 holds nothing it may evict. Progress is logged and reported by
`state()`. Without CUDA the same growth can fault segments in instead (mode
"prefault"): a first touch of fresh memory runs at 0.2-2.3 GB/s on a VM, far below a
copy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: threads that pin at once: page faulting parallelises; more than a few gains little
DEFAULT_THREADS = 4
#: what making a segment does, by mode, in words (log lines, readiness reasons):
#: "pin" (page-lock) or "prefault"
MODE_WORDS = {"pin": ("pinning", "pinned"), "prefault": ("faulting in", "faulted in")}


class PinAhead:
    """Background growth of a pool to `target` bytes in segments of `segment_bytes`.

    `claim()` reserves the next segment's bytes in L1 and says how many (0: nothing left
    to grow); `make(size)` pins (or, in mode "prefault", faults in) a segment with no
    lock held; `settle(size, segment)` hands it to L1, or with None gives the claimed
    bytes back (False: L1 closed meanwhile and the segment was not taken). A failed
    `make` stops the growth; L1 then grows on demand as before (`failed` says why).

    `paused()` holds the growth while another thread makes CUDA calls. `_lock` guards
    the counters (`_quiet`, its condition, signals `_holds` and `_making` changing);
    `failed` is written once under it and read racily by the threads' loop.
    """

    def __init__(
        self,
        target: int,
        segment_bytes: int,
        *,
        claim: Callable[[], int],
        make: Callable[[int], torch.Tensor],
        settle: Callable[[int, torch.Tensor | None], bool],
        threads: int = DEFAULT_THREADS,
        mode: str,
    ) -> None:
        if threads < 1:
            raise ValueError(f"pin threads must be at least 1, got {threads}")
        if mode not in MODE_WORDS:
            raise ValueError(f"mode must be one of {sorted(MODE_WORDS)}, got {mode!r}")
        self.mode = mode
        self._doing, self._done_word = MODE_WORDS[mode]
        self.target = target
        self._claim, self._make, self._settle = claim, make, settle
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)  # _holds or _making changed
        self._holds = 0  # paused() blocks entered and not left
        self._making = 0  # segments being made now
        self._pinned = 0
        self._started = time.monotonic()
        self._took: float | None = None
        self.failed: str | None = None
        n = max(1, min(threads, -(-target // max(segment_bytes, 1))))
        self._running = n
        self._threads = [
            threading.Thread(target=self._run, name=f"kvflow-l1-pin-{i}", daemon=True)
            for i in range(n)
        ]
        log.info(
            "%s L1 ahead of demand: %.1f GiB in %d-MiB segments on %d threads",
            self._doing, target / (1 << 30), segment_bytes >> 20, n,
        )  # fmt: skip
        for thread in self._threads:
            thread.start()

    @property
    def done(self) -> bool:
        """True once no thread pins any more (finished, failed or stopped)."""
        with self._lock:
            return self._running == 0

    def state(self) -> dict[str, Any]:
        """bytes made so far (pinned or faulted in, as `mode` says), the target, whether
        growth runs, seconds taken, failure."""
        with self._lock:
            took = self._took if self._took is not None else time.monotonic() - self._started
            return {
                "pinned_bytes": self._pinned,
                "target_bytes": self.target,
                "pinning": self._running > 0,
                "seconds": round(took, 3),
                "failed": self.failed,
                "mode": self.mode,
            }

    def join(self, timeout: float | None = None) -> None:
        """Wait for the pinning threads (after L1 stopped claiming, they end soon)."""
        for thread in self._threads:
            thread.join(timeout)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the growth while the caller makes CUDA calls: entering waits for the
        segments being made to be done, and no thread starts another until every
        `paused()` block has been left. A registration's CUDA calls (streams, events,
        memory, modules, IPC handles) wait behind segments being made: one made while a
        32 GiB L1 pinned took 7-9 s (0.1-0.3 s paused, with pages faulted in before they
        are registered; docs/SERVER.md)."""
        with self._quiet:
            self._holds += 1
            self._quiet.wait_for(lambda: self._making == 0)
        try:
            yield
        finally:
            with self._quiet:
                self._holds -= 1
                self._quiet.notify_all()

    def _run(self) -> None:
        try:
            while self.failed is None:
                with self._quiet:
                    self._quiet.wait_for(lambda: self._holds == 0)
                    self._making += 1
                try:
                    if not self._make_one():
                        return
                finally:
                    with self._quiet:
                        self._making -= 1
                        self._quiet.notify_all()
        finally:
            self._finish()

    def _make_one(self) -> bool:
        """Claim, make and hand over one segment; False when growth is over."""
        size = self._claim()
        if not size:
            return False
        try:
            segment = self._make(size)
        except Exception as exc:  # out of pinnable memory: stop growing ahead
            with self._lock:
                self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("%s L1 ahead stopped: %s; L1 grows on demand", self._doing, exc)
            self._settle(size, None)
            return False
        if not self._settle(size, segment):
            return False
        with self._lock:
            self._pinned += size
        return True

    def _finish(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
            if last:
                self._took = time.monotonic() - self._started
            pinned, took = self._pinned, self._took
        if last and self.failed is None and pinned:
            log.info("L1 %s: %.1f GiB in %.1f s", self._done_word, pinned / (1 << 30), took)
