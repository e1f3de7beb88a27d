"""Run shutdown-style tasks concurrently by one shared deadline, gathering their outcomes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence


def run_by_deadline(
    tasks: Sequence[tuple[str, Callable[[], object]]], deadline: float
) -> dict[str, object]:
    """Each task's outcome by name: its return value, the exception it raised, or a
    TimeoutError when it was still running at `deadline` (a `time.monotonic()` value).

    Tasks run on daemon threads, so one that hangs cannot hold the caller past the deadline.
    """
    results: dict[str, object] = {}

    def run(name: str, task: Callable[[], object]) -> None:
        try:
            results[name] = task()
        except Exception as exc:
            results[name] = exc

    threads = [
        (name, threading.Thread(target=run, args=(name, task), daemon=True)) for name, task in tasks
    ]
    for _, thread in threads:
        thread.start()
    outcomes: dict[str, object] = {}
    for name, thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
        outcomes[name] = (
            TimeoutError("passed the deadline") if thread.is_alive() else results.get(name)
        )
    return outcomes
