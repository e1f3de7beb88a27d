"""`EventLogSubscriber`: keeps every event, in order, in a directory of segment files.

The durable record behind `kvflow replay` and `kvflow whatif` (docs/EVENTLOG.md).
Each batch the bus delivers becomes one checksummed frame written with one
`os.write` (eventlog_format.py); segments rotate by size and the oldest are deleted
once the directory passes its budget. It runs on its own bus delivery thread
(`blocking` stays True: it does file I/O), so a slow disk costs only its own
overflow, counted by the bus, never the request path.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kvflow.events import Event, EventType
from kvflow.subscribers.eventlog_format import (
    encode_batch,
    encode_header,
    frame,
    new_header,
    segment_name,
    segment_sequence,
)

FSYNC_POLICIES = ("none", "segment", "batch")
MIB = 1 << 20


class EventLogSubscriber:
    """Appends each delivered batch to the current segment; rotates and prunes by size.

    `fsync`: `none` leaves flushing to the OS (a machine crash may lose the last
    seconds; a process crash loses nothing written), `segment` fsyncs a segment
    when it is closed, `batch` after every batch (durable, slowest). Whatever the
    policy, a torn last frame is detected and skipped on read. `l0_sample_rate`
    and `sample_seed` (the run's L0 sampling) and `l2_disk_bytes` (its disk tier's
    capacity) are recorded in segment headers.
    """

    name = "event_log"
    event_types: frozenset[EventType] | None = None

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_mb: float = 1024.0,
        segment_mb: float = 64.0,
        fsync: str = "segment",
        l0_sample_rate: float | None = None,
        sample_seed: int | None = None,
        l2_disk_bytes: int | None = None,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"--event-log-fsync must be one of {', '.join(FSYNC_POLICIES)}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_mb * MIB)
        self.segment_bytes = max(int(min(segment_mb * MIB, self.max_bytes)), 4096)
        self.fsync = fsync
        self._sampling = (l0_sample_rate, sample_seed)  # recorded in each header for replay
        self._l2_disk_bytes = l2_disk_bytes  # and this, for whatif
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self._sequence = max(self._sequences(), default=0)
        self.events_written = 0
        self.bytes_written = 0
        self.segments_deleted = 0
        self._open_segment()
        self._prune()

    def _sequences(self) -> list[int]:
        """Sequence numbers of the segments in the directory (a restart appends after them)."""
        found = (segment_sequence(p.name) for p in self.directory.iterdir())
        return sorted(s for s in found if s is not None)

    def _open_segment(self) -> None:
        self._sequence += 1
        path = self.directory / segment_name(self._sequence)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        offset = time.time_ns() - time.monotonic_ns()
        header = new_header(
            self._sequence, offset, time.time_ns(), *self._sampling, self._l2_disk_bytes
        )
        data = frame(encode_header(header))
        os.write(fd, data)
        self._fd, self._size = fd, len(data)
        self.bytes_written += len(data)

    def _close_segment(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            if self.fsync != "none":
                os.fsync(fd)
            os.close(fd)

    def _prune(self) -> None:
        """Delete the oldest closed segments while the directory holds more than max_bytes."""
        sizes = []
        for seq in self._sequences():
            path = self.directory / segment_name(seq)
            try:
                sizes.append((seq, path, path.stat().st_size))
            except FileNotFoundError:
                continue
        total = sum(size for _, _, size in sizes)
        for seq, path, size in sizes:
            if total <= self.max_bytes or seq >= self._sequence:
                break
            path.unlink(missing_ok=True)
            total -= size
            self.segments_deleted += 1

    def on_events(self, events: Sequence[Event]) -> None:
        """Write the batch as one frame; rotate first when it would overflow the segment."""
        if not events:
            return
        data = frame(encode_batch(events))
        with self._lock:
            if self._fd is None:
                return  # shut down
            if self._size + len(data) > self.segment_bytes and self._size > 0:
                self._close_segment()
                self._open_segment()
                self._prune()
            assert self._fd is not None
            os.write(self._fd, data)
            if self.fsync == "batch":
                os.fsync(self._fd)
            self._size += len(data)
            self.bytes_written += len(data)
            self.events_written += len(events)

    def summary(self) -> dict[str, object]:
        """Where the log is and what it holds so far (for the demo's summary and status)."""
        return {
            "directory": str(self.directory),
            "events": self.events_written,
            "bytes": self.bytes_written,
            "segment": self._sequence,
            "segments_deleted": self.segments_deleted,
        }

    def shutdown(self) -> None:
        """Close the current segment (fsynced unless the policy is `none`)."""
        with self._lock:
            self._close_segment()
