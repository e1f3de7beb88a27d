"""The event log's on-disk format (docs/EVENTS.md, "The event log"): framing and codecs.

A log is a directory of segment files `events-NNNNNNNN.kvlog` (NNNNNNNN = the
segment's sequence number, written in order). Every segment is a run of frames::

    frame   = MAGIC (4 bytes b"KVEv") | length (u32 LE) | xxh3_64(payload) (u64 LE) | payload
    payload = msgpack (msgspec)

The first frame of a segment is its header (`SegmentHeader`); every later frame is
one batch of events as the bus delivered it. Format version 2 (written now)::

    payload = index length (u32 LE) | index (msgpack `BatchIndex`) | events (msgpack array)

The index packs what `kvflow whatif` reads (lookups, stores, retrieves, registers:
fixed-size `OP_RECORD`s, and the chunk keys in one bytes value), so whatif reads a
log with numpy, never building the events; the events array holds every event, its
`chunk_hashes` kept in the index only. Version 1 (still read) was the events array
alone, each `chunk_hashes` kept as a `chunk_keys` attr. The checksum makes a torn or corrupted frame detectable, and the magic lets a reader
skip forward to the next intact frame, so a crash mid-write costs at most the last
batch, never the log.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import xxhash

from kvflow import __version__
from kvflow.events import BlockAllocation, Event, EventType

#: the framing and header layout this kvflow writes
FORMAT_VERSION = 2
#: the versions it reads (1: a batch is the events array alone; 2: index, then events)
READ_FORMAT_VERSIONS = (1, 2)
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
#: a batch's index length, ahead of the index (format 2)
INDEX_HEAD = struct.Struct("<I")
#: one indexed event (format 2): its position in the batch, type, flags (FLAG_*),
#: world_size, rank, instance_id and model_name (indexes into `BatchIndex.names`),
#: chunk keys, requested_tokens, L1 hit tokens (hit_tokens_by_tier["l1"], else
#: hit_tokens), chunk_size, chunk_bytes
OP_RECORD = struct.Struct("<IBBHHIIIqqIq")
OP_DTYPE = np.dtype(
    [("event", "<u4"), ("type", "u1"), ("flags", "u1"), ("world", "<u2"), ("rank", "<u2"),
     ("instance", "<u4"), ("model", "<u4"), ("nkeys", "<u4"), ("requested", "<i8"),
     ("l1_hits", "<i8"), ("chunk_size", "<u4"), ("chunk_bytes", "<i8")]
)  # fmt: skip
FLAG_OK = 1  # attrs "ok" is not False
FLAG_KEYS = 2  # the event carried chunk_hashes (its keys are the op's in `BatchIndex.keys`)
#: event types indexed whether or not they carry chunk hashes
INDEXED_TYPES = frozenset(
    {EventType.LOOKUP_END, EventType.STORE_END, EventType.RETRIEVE_END, EventType.REGISTER}
)


class SegmentHeader(msgspec.Struct, tag="kvflow-event-log", frozen=True):
    """What a segment says about itself: who wrote it and how to read its events.

    `epoch_offset_ns` converts its events' monotonic `ts_ns` to Unix time
    (epoch = ts_ns + offset) for `kvflow replay --from/--to`. The L0 sampling
    settings of the run are kept so a replay can default to them, and the disk L2
    tier's capacity (payload bytes; None: no disk tier, or not known to the writer)
    so `kvflow whatif` can default its L2 size to it. Optional keys: a header
    without them (an older writer's) reads as None, and an older reader skips them.
    """

    format_version: int
    schema_version: int
    kvflow_version: str
    sequence: int
    created_unix_ns: int
    epoch_offset_ns: int
    l0_sample_rate: float | None = None
    sample_seed: int | None = None
    l2_disk_bytes: int | None = None


class BatchIndex(msgspec.Struct, array_like=True):
    """A batch's index (format 2): what whatif reads, packed for numpy."""

    events: int  # events in the batch
    names: list[str]  # instance ids and model names the records point at
    ops: bytes  # OP_RECORDs, one per indexed event, in batch order
    keys: bytes  # the records' chunk keys, 8 bytes each, in record order


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
_index_decoder = msgspec.msgpack.Decoder(BatchIndex)


def encode_header(header: SegmentHeader) -> bytes:
    """A header frame's payload."""
    return _encoder.encode(header)


def decode_header(payload: bytes) -> SegmentHeader:
    """A header frame's payload; msgspec.DecodeError if it is none."""
    return _header_decoder.decode(payload)


def _compact(events: Sequence[Event]) -> Sequence[Event]:
    """Format 1: the batch with every `chunk_hashes` list replaced by `chunk_keys` (8
    bytes a chunk)."""
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


def encode_batch_v1(events: Sequence[Event]) -> bytes:
    """A format-1 batch payload (what kvflow wrote before format 2; for tests)."""
    return _encoder.encode(_compact(events))


def _int(value: Any, default: int, limit: int) -> int:
    """`value` as an int in [0, limit], else `default` (a record field never fails)."""
    try:
        v = int(value)
    except (TypeError, ValueError, OverflowError):
        return default
    return v if 0 <= v <= limit else default


_LOOKUP_END = EventType.LOOKUP_END
_TYPE_CODE = {t: int(t) for t in EventType}
_pack = OP_RECORD.pack


def op_record(
    i: int,
    etype: EventType,
    attrs: Mapping[str, Any],
    names: dict[str, int],
    nkeys: int,
    flags: int,
) -> bytes:
    """The OP_RECORD of event `i`, of type `etype` (names interned into `names`)."""
    get = attrs.get
    inst, model = get("instance_id", ""), get("model_name", "")
    if type(inst) is not str:
        inst = ""
    if type(model) is not str:
        model = ""
    inst_i = names.get(inst)
    if inst_i is None:
        inst_i = names[inst] = len(names)
    model_i = names.get(model)
    if model_i is None:
        model_i = names[model] = len(names)
    if get("ok") is not False:
        flags |= FLAG_OK
    code = _TYPE_CODE.get(etype, 0)
    if etype is _LOOKUP_END:
        by_tier = get("hit_tokens_by_tier")
        l1 = by_tier.get("l1", 0) if by_tier is not None else get("hit_tokens", 0)
        world, requested, chunk_size = (
            get("world_size", 1),
            get("requested_tokens", 0),
            get("chunk_size", 0),
        )
        rank = chunk_bytes = 0
    else:
        l1 = requested = chunk_size = 0
        world, rank, chunk_bytes = get("world_size", 1), get("rank", 0), get("chunk_bytes", 0)
    try:
        return _pack(i, code, flags, world, rank, inst_i, model_i, nkeys, requested, l1,
                     chunk_size, chunk_bytes)  # fmt: skip
    except (struct.error, TypeError):  # an odd value (None, a float, out of range)
        big = (1 << 63) - 1
        return _pack(
            i, code, flags, _int(world, 1, 0xFFFF), _int(rank, 0, 0xFFFF), inst_i, model_i,
            nkeys, _int(requested, 0, big), _int(l1, 0, big), _int(chunk_size, 0, 0xFFFFFFFF),
            _int(chunk_bytes, 0, big),
        )  # fmt: skip


def index_batch(events: Sequence[Event]) -> tuple[BatchIndex, Sequence[Event]]:
    """The batch's index, and its events with `chunk_hashes` taken out (the index keeps
    their first 8 bytes: a simulation needs only to tell chunks apart)."""
    names: dict[str, int] = {}
    ops: list[bytes] = []
    keys: list[bytes] = []
    out: list[Event] | None = None
    for i, ev in enumerate(events):
        attrs = ev.attrs
        hashes = attrs.get(CHUNK_HASHES) if attrs else None
        if hashes is None:
            if ev.type in INDEXED_TYPES:
                ops.append(op_record(i, ev.type, attrs or {}, names, 0, 0))
            if out is not None:
                out.append(ev)
            continue
        blob = b"".join([h[:8] for h in hashes])  # bytes slices: copies of 8
        keys.append(blob)
        ops.append(op_record(i, ev.type, attrs, names, len(blob) // 8, FLAG_KEYS))
        if out is None:
            out = list(events[:i])
        rest = dict(attrs)
        del rest[CHUNK_HASHES]
        out.append(Event(ev.type, ev.ts_ns, ev.session_id, ev.op_id, rest))
    index = BatchIndex(len(events), list(names), b"".join(ops), b"".join(keys))
    return index, (events if out is None else out)


def encode_batch(events: Sequence[Event]) -> bytes:
    """A batch frame's payload (format 2): index length, index, events."""
    index, rest = index_batch(events)
    head = _encoder.encode(index)
    return b"".join((INDEX_HEAD.pack(len(head)), head, _encoder.encode(rest)))


def split_batch(payload: bytes | memoryview) -> tuple[memoryview, memoryview]:
    """A format-2 payload's index and events parts (no copy); DecodeError if it is none."""
    view = memoryview(payload)
    if len(view) < INDEX_HEAD.size:
        raise msgspec.DecodeError("batch shorter than its index length")
    (n,) = INDEX_HEAD.unpack_from(view, 0)
    if INDEX_HEAD.size + n > len(view):
        raise msgspec.DecodeError("batch index longer than the batch")
    return view[INDEX_HEAD.size : INDEX_HEAD.size + n], view[INDEX_HEAD.size + n :]


def decode_index(payload: bytes | memoryview) -> BatchIndex:
    """A format-2 payload's index alone (the events are not decoded)."""
    index = _index_decoder.decode(split_batch(payload)[0])
    check_index(index)
    return index


def check_index(index: BatchIndex) -> None:
    """DecodeError unless the records fit the index: whole records, every name they
    point at present, as many keys as they count."""
    if len(index.ops) % OP_RECORD.size or len(index.keys) % 8:
        raise msgspec.DecodeError("batch index of a wrong size")
    ops = np.frombuffer(index.ops, OP_DTYPE)
    if len(ops) and (
        int(ops["instance"].max()) >= len(index.names)
        or int(ops["model"].max()) >= len(index.names)
        or int(ops["event"].max()) >= index.events
    ):
        raise msgspec.DecodeError("batch index points past its names or events")
    if int(ops["nkeys"].sum(dtype=np.int64)) * 8 != len(index.keys):
        raise msgspec.DecodeError("batch index counts other keys than it holds")


def decode_batch(payload: bytes | memoryview, format_version: int = FORMAT_VERSION) -> list[Event]:
    """A batch frame's payload as events, as published except `chunk_hashes`, given as
    `chunk_keys` (one bytes value: the first 8 bytes of each hash, in order), and
    BLOCK_ALLOCATION records as `BlockAllocation`s again (the L0 subscriber reads them
    as such)."""
    if format_version == 1:
        events = _batch_decoder.decode(payload)
    else:
        head, body = split_batch(payload)
        index = _index_decoder.decode(head)
        check_index(index)
        events = _batch_decoder.decode(body)
        pos = 0
        for event, _, flags, *_, nkeys, _, _, _, _ in OP_RECORD.iter_unpack(index.ops):
            if flags & FLAG_KEYS:
                if event >= len(events):
                    raise msgspec.DecodeError("batch index names an event the batch lacks")
                ev = events[event]
                ev.attrs = {**ev.attrs, CHUNK_KEYS: index.keys[pos : pos + 8 * nkeys]}
                pos += 8 * nkeys
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
    l2_disk_bytes: int | None = None,
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
        l2_disk_bytes=l2_disk_bytes,
    )
