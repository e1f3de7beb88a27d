"""The event log's on-disk format (docs/EVENTS.md, "The event log"): framing and codecs.

A log is a directory of segment files `events-NNNNNNNN.kvlog` (NNNNNNNN = the
segment's sequence number, written in order). Every segment is a run of frames::

    frame   = MAGIC (4 bytes b"KVEv") | length (u32 LE) | xxh3_64(payload) (u64 LE) | payload
    payload = msgpack (msgspec)

The first frame of a segment is its header (`SegmentHeader`); every later frame is
one batch of events as the bus delivered it (a msgpack array of `Event` maps). The
checksum makes a torn or corrupted frame detectable, and the magic lets a reader
skip forward to the next intact frame, so a crash mid-write costs at most the last
batch, never the log.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import xxhash

from kvflow import __version__
from kvflow.events import BlockAllocation, Event, EventType

#: the framing and header layout of this file; a reader refuses other versions
FORMAT_VERSION = 1
#: the Event record and the attrs catalogue of docs/EVENTS.md; bump on an incompatible change
EVENT_SCHEMA_VERSION = 1
MAGIC = b"KVEv"
FRAME_HEAD = struct.Struct("<4sIQ")
#: a frame longer than this is corruption, not a batch (a batch of 10k events is ~1 MB)
MAX_FRAME_BYTES = 256 << 20
SEGMENT_PREFIX = "events-"
SEGMENT_SUFFIX = ".kvlog"
#: engine attr holding 32-byte chunk hashes; the log keeps their first 8 bytes instead
CHUNK_HASHES = "chunk_hashes"
CHUNK_KEYS = "chunk_keys"


class SegmentHeader(msgspec.Struct, tag="kvflow-event-log", frozen=True):
    """What a segment says about itself: who wrote it and how to read its events.

    `epoch_offset_ns` converts its events' monotonic `ts_ns` to Unix time
    (epoch = ts_ns + offset) for `kvflow replay --from/--to`. The L0 sampling
    settings of the run are kept so a replay can default to them.
    """

    format_version: int
    schema_version: int
    kvflow_version: str
    sequence: int
    created_unix_ns: int
    epoch_offset_ns: int
    l0_sample_rate: float | None = None
    sample_seed: int | None = None


def segment_name(sequence: int) -> str:
    """The file name of segment number `sequence`."""
    return f"{SEGMENT_PREFIX}{sequence:08d}{SEGMENT_SUFFIX}"


def segment_sequence(name: str) -> int | None:
    """The sequence number in a segment file name, or None for any other name."""
    if not (name.startswith(SEGMENT_PREFIX) and name.endswith(SEGMENT_SUFFIX)):
        return None
    digits = name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)]
    return int(digits) if digits.isdigit() else None


def frame(payload: bytes) -> bytes:
    """One frame around `payload`: magic, length, checksum, payload."""
    return FRAME_HEAD.pack(MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def _enc_hook(obj: Any) -> Any:
    """Values msgspec cannot encode natively: mappings, sequences, numpy values."""
    if isinstance(obj, Mapping):
        return dict(obj)
    tolist = getattr(obj, "tolist", None)  # numpy arrays and scalars, torch tensors
    if callable(tolist):
        return tolist()
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        return list(obj)
    return repr(obj)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_header_decoder = msgspec.msgpack.Decoder(SegmentHeader)
_batch_decoder = msgspec.msgpack.Decoder(list[Event])


def encode_header(header: SegmentHeader) -> bytes:
    """A header frame's payload."""
    return _encoder.encode(header)


def decode_header(payload: bytes) -> SegmentHeader:
    """A header frame's payload; msgspec.DecodeError if it is none."""
    return _header_decoder.decode(payload)


def _compact(events: Sequence[Event]) -> Sequence[Event]:
    """The batch with every `chunk_hashes` list replaced by `chunk_keys` (8 bytes a
    chunk): the first 8 bytes of each hash suffice to tell chunks apart in a cache
    simulation, at a quarter of the size and one bytes object per event on read."""
    out: list[Event] | None = None
    for i, ev in enumerate(events):
        hashes = ev.attrs.get(CHUNK_HASHES) if ev.attrs else None
        if hashes is None:
            if out is not None:
                out.append(ev)
            continue
        if out is None:
            out = list(events[:i])
        attrs = dict(ev.attrs)
        del attrs[CHUNK_HASHES]
        attrs[CHUNK_KEYS] = b"".join([h[:8] for h in hashes])  # bytes slices: copies of 8
        out.append(Event(ev.type, ev.ts_ns, ev.session_id, ev.op_id, attrs))
    return events if out is None else out


def encode_batch(events: Sequence[Event]) -> bytes:
    """A batch frame's payload (chunk hashes compacted to chunk keys)."""
    return _encoder.encode(_compact(events))


def decode_batch(payload: bytes) -> list[Event]:
    """A batch frame's payload as events, BLOCK_ALLOCATION records as `BlockAllocation`s
    again (the L0 subscriber reads them as such)."""
    events = _batch_decoder.decode(payload)
    for ev in events:
        if ev.type is EventType.BLOCK_ALLOCATION:
            records = ev.attrs.get("records")
            if isinstance(records, list):
                ev.attrs = {
                    **ev.attrs,
                    "records": [
                        BlockAllocation(*r) if isinstance(r, list) and len(r) == 3 else r
                        for r in records
                    ],
                }
    return events


def new_header(
    sequence: int,
    epoch_offset_ns: int,
    created_unix_ns: int,
    l0_sample_rate: float | None = None,
    sample_seed: int | None = None,
) -> SegmentHeader:
    """The header of a segment this kvflow writes now."""
    return SegmentHeader(
        format_version=FORMAT_VERSION,
        schema_version=EVENT_SCHEMA_VERSION,
        kvflow_version=__version__,
        sequence=sequence,
        created_unix_ns=created_unix_ns,
        epoch_offset_ns=epoch_offset_ns,
        l0_sample_rate=l0_sample_rate,
        sample_seed=sample_seed,
    )
