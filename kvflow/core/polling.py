"""Waiting on progress that another process or the GPU makes (a flag in shared memory, an
event): spin a little, then poll, sleeping between polls. The client's layer waits, the
engine's staging ring and the server's movers use it."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvflow.core.errors import RequestTimeoutError, TransferError

#: seconds between polls once spinning found nothing
POLL_S = 50e-6


def poll_until(
    done: Callable[[], bool],
    timeout_s: float,
    waiting_for: str,
    cancelled: Callable[[], bool] | None = None,
    idle: Callable[[], None] | None = None,
    *,
    spins: int = 100,
    interval_s: float = POLL_S,
) -> float:
    """Poll `done()` (`spins` times back to back, then every `interval_s`, calling
    `idle()` between polls) until it is true; returns the seconds waited.
    TransferError once `cancelled()`, RequestTimeoutError after `timeout_s`;
    `waiting_for` names what."""
    started = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    polls = 0
    while not done():
        if cancelled is not None and cancelled():
            raise TransferError(f"cancelled waiting for {waiting_for}")
        if time.monotonic() > deadline:
            raise RequestTimeoutError(f"{waiting_for}: nothing within {timeout_s:g} s")
        if idle is not None:
            idle()
        polls += 1
        if polls > spins:
            time.sleep(interval_s)
    return time.perf_counter() - started
