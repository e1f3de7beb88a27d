"""Reading an event log back: every intact batch, in order, and a note for each problem.

Reading never fails on damage it can step over: a torn or corrupted frame is
skipped (the reader scans for the next frame's magic), a segment of an unknown
format or schema version is skipped whole, and each such problem becomes one
line in `LogReader.problems`. Only a directory with nothing readable at all is an
`EventLogError` (not a directory, no segments, no segment kvflow can read).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import xxhash

from kvflow.events import Event
from kvflow.subscribers.eventlog_format import (
    EVENT_SCHEMA_VERSION,
    FRAME_HEAD,
    MAGIC,
    MAX_FRAME_BYTES,
    READ_FORMAT_VERSIONS,
    SegmentHeader,
    decode_batch,
    decode_header,
    segment_sequence,
)


class EventLogError(Exception):
    """The directory holds no readable event log; the message says why, in one line."""


@dataclass
class Segment:
    """One segment file and, once read, its header."""

    sequence: int
    path: Path
    header: SegmentHeader | None = None


@dataclass
class LogReader:
    """Iterates a log directory's batches in order; `problems` collects what was skipped."""

    directory: Path
    segments: list[Segment] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    batches: int = 0
    events: int = 0
    #: the first readable header (its epoch offset converts event times to wall time)
    first_header: SegmentHeader | None = None

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> LogReader:
        """A reader over `directory`; EventLogError if it is no event log."""
        path = Path(directory)
        if not path.is_dir():
            raise EventLogError(f"{path}: not a directory (give the --event-log DIR of a run)")
        segments = []
        for entry in path.iterdir():
            seq = segment_sequence(entry.name)
            if seq is not None and entry.is_file():
                segments.append(Segment(seq, entry))
        if not segments:
            raise EventLogError(
                f"{path}: not an event log (no events-NNNNNNNN.kvlog segment files in it)"
            )
        segments.sort(key=lambda s: s.sequence)
        reader = cls(path, segments)
        for seg in segments:
            reader._read_header(seg)
        if not any(seg.header is not None for seg in segments):
            raise EventLogError(
                f"{path}: no segment kvflow can read: " + "; ".join(reader.problems)
            )
        return reader

    def _read_header(self, seg: Segment) -> None:
        """Read and check a segment's header frame; a problem line if it is unusable."""
        try:
            with open(seg.path, "rb") as f:
                head = f.read(FRAME_HEAD.size)
                if len(head) < FRAME_HEAD.size:
                    self.problems.append(f"{seg.path.name}: empty or truncated header, skipped")
                    return
                magic, length, checksum = FRAME_HEAD.unpack(head)
                payload = f.read(length) if magic == MAGIC and length <= MAX_FRAME_BYTES else b""
        except OSError as exc:
            self.problems.append(f"{seg.path.name}: cannot read ({exc.strerror}), skipped")
            return
        if (
            magic != MAGIC
            or len(payload) != length
            or xxhash.xxh3_64_intdigest(payload) != checksum
        ):
            self.problems.append(f"{seg.path.name}: not a kvflow event log segment, skipped")
            return
        try:
            header = decode_header(payload)
        except msgspec.DecodeError:
            self.problems.append(f"{seg.path.name}: unreadable segment header, skipped")
            return
        if header.format_version not in READ_FORMAT_VERSIONS:
            versions = " and ".join(str(v) for v in READ_FORMAT_VERSIONS)
            self.problems.append(
                f"{seg.path.name}: log format version {header.format_version} (written by kvflow "
                f"{header.kvflow_version}); this kvflow reads versions {versions}, skipped"
            )
            return
        if header.schema_version != EVENT_SCHEMA_VERSION:
            self.problems.append(
                f"{seg.path.name}: event schema version {header.schema_version} (written by "
                f"kvflow {header.kvflow_version}); this kvflow reads schema "
                f"{EVENT_SCHEMA_VERSION}, skipped"
            )
            return
        seg.header = header
        if self.first_header is None:
            self.first_header = header

    def batch_payloads(self) -> Iterator[memoryview]:
        """The checked payloads of every batch frame, segment by segment, in order."""
        for _, payload in self.batch_frames():
            yield payload

    def batch_frames(self) -> Iterator[tuple[int, memoryview]]:
        """(format version of its segment, checked payload) of every batch frame, in order.
        A payload is a view into the segment (mapped, not copied): decode it before the
        next one is asked for."""
        for seg in self.segments:
            if seg.header is None:
                continue
            try:
                with open(seg.path, "rb") as f:
                    data: bytes | mmap.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:  # mmap unsupported here: read it whole
                try:
                    data = seg.path.read_bytes()
                except OSError:
                    self.problems.append(f"{seg.path.name}: cannot read ({exc}), skipped")
                    continue
            version = seg.header.format_version
            for payload in self._frames(seg.path.name, data):
                yield version, payload
            if isinstance(data, mmap.mmap):
                with contextlib.suppress(BufferError):  # a caller kept a view: it lives on
                    data.close()

    def _frames(self, name: str, data: bytes | mmap.mmap) -> Iterator[memoryview]:
        """Intact frames' payloads after the header (views into `data`, valid while the
        caller's loop step runs); damaged ones reported and stepped over."""
        view = memoryview(data)
        head = FRAME_HEAD.size
        pos = head + FRAME_HEAD.unpack_from(data, 0)[1]  # past the checked header
        skipped_from: int | None = None
        while pos < len(data):
            ok = False
            if len(data) - pos >= head:
                magic, length, checksum = FRAME_HEAD.unpack_from(data, pos)
                end = pos + head + length
                if magic == MAGIC and length <= MAX_FRAME_BYTES and end <= len(data):
                    payload = view[pos + head : end]
                    ok = xxhash.xxh3_64_intdigest(payload) == checksum
            if not ok:
                payload = view[0:0]
                if skipped_from is None:
                    skipped_from = pos
                nxt = data.find(MAGIC, pos + 1)
                if nxt < 0:
                    self._skipped(name, skipped_from, len(data), tail=True)
                    break
                pos = nxt
                continue
            if skipped_from is not None:
                self._skipped(name, skipped_from, pos, tail=False)
                skipped_from = None
            self.batches += 1
            yield payload
            pos = end
        payload = view[0:0]
        with contextlib.suppress(BufferError):  # a caller kept a payload view
            view.release()

    def _skipped(self, name: str, start: int, stop: int, *, tail: bool) -> None:
        what = "torn last record (a write cut short)" if tail else "corrupted record(s)"
        self.problems.append(f"{name}: {what} at byte {start}, {stop - start} bytes skipped")

    def batches_of_events(self) -> Iterator[list[Event]]:
        """Every intact batch decoded; a frame whose checksum holds but whose events do
        not decode (written by a buggy or foreign writer) is reported and skipped."""
        for version, payload in self.batch_frames():
            try:
                events = decode_batch(payload, version)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.problems.append(f"a batch of events did not decode ({exc}), skipped")
                continue
            self.events += len(events)
            yield events

    def __iter__(self) -> Iterator[Event]:
        for batch in self.batches_of_events():
            yield from batch
