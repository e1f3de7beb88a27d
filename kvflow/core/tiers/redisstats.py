"""The Redis tier's counts and last error: what `stats()` and `describe()` report of
failed calls, objects stored and Redis's memory. Every thread of the tier adds to them
(the I/O pool's, the reconnecting thread, the caller's), so they sit behind one lock.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("kvflow.tiers.redis")

#: the failure counters of `stats()`, in their order there
FAILURE_COUNTERS = (
    "store_failures",
    "load_failures",
    "lookup_failures",
    "corrupt_objects",
    "missing_objects",
)


class RedisStats:
    """Failure counters, the object count, INFO memory figures and the last error.

    Lock rule: the lock guards every field (counters, objects, usage, capacity, last
    error, the kinds of error logged already); every method takes it for its whole
    update or read, and none logs or calls out while holding it, so it may be taken
    from any thread, holding any other lock of the tier or none.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(FAILURE_COUNTERS, 0)
        self._objects = 0
        self._usage = 0
        self._capacity = 0
        self._last_error: str | None = None
        self._logged: set[str] = set()

    def count(self, counter: str, n: int = 1) -> None:
        """Add `n` to one failure counter."""
        with self._lock:
            self._counters[counter] += n

    def stored(self, stored: int, failed: int) -> None:
        """A store batch's outcome: new objects, and keys that failed."""
        with self._lock:
            self._objects += stored
            self._counters["store_failures"] += failed

    def loaded(self, failures: int, missing: int, corrupt: int, reason: str | None) -> None:
        """A load batch's failures: errors, missing keys and corrupt values (deleted, so
        they leave the object count), and why the last one failed."""
        with self._lock:
            self._counters["load_failures"] += failures + missing + corrupt
            self._counters["missing_objects"] += missing
            self._counters["corrupt_objects"] += corrupt
            self._objects = max(0, self._objects - corrupt)
            if reason is not None:
                self._last_error = reason

    def forget(self, n: int) -> None:
        """`n` objects were deleted (never below 0: Redis's own evictions are not seen)."""
        with self._lock:
            self._objects = max(0, self._objects - n)

    def forget_all(self) -> None:
        """The tier closed: it counts no object any more."""
        with self._lock:
            self._objects = 0

    def memory(self, usage: int, capacity: int) -> None:
        """Redis's used_memory and maxmemory, as INFO memory last read them."""
        with self._lock:
            self._usage, self._capacity = usage, capacity

    def error(self, text: str) -> None:
        """Record the last error met (text already free of credentials)."""
        with self._lock:
            self._last_error = text

    def swallowed(self, kind: str, text: str) -> None:
        """Record an error that a call got past (it failed nothing by itself, or its call
        counts the failure) as the last error, and log it: as a warning the first time
        of its `kind`, at debug level after that (no flood when it repeats)."""
        with self._lock:
            self._last_error = text
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log.warning("L2 Redis %s (%s); later ones are logged at debug level", kind, text)
        else:
            log.debug("L2 Redis %s (%s)", kind, text)

    @property
    def last_error(self) -> str | None:
        """The last error met, None before any."""
        with self._lock:
            return self._last_error

    def snapshot(self) -> dict[str, int]:
        """usage_bytes, capacity_bytes, objects, then the failure counters."""
        with self._lock:
            return {
                "usage_bytes": self._usage,
                "capacity_bytes": self._capacity,
                "objects": self._objects,
                **self._counters,
            }
