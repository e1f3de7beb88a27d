"""An event log's L1 accesses as flat arrays: what `kvflow whatif` simulates.

Three kinds of recorded operations matter (docs/EVENTS.md, attrs for whatif):
- a successful LOOKUP_END asks for its chunk keys on every rank of its world
  (a query: the simulation never changes the cache on a lookup, see lru.py);
- a successful STORE_END puts its chunk keys (the prefix now in L1) in L1 for
  the instance's rank, and a successful RETRIEVE_END refreshes its hit prefix:
  both are touches.
Chunk keys are the first 8 bytes of the chained chunk hashes; an object is a key
within a namespace (model, world size, rank), as `ObjectKey` is in the engine.

A format-2 log keeps these operations in each batch's index (eventlog_format.py):
fixed-size records and one bytes value of keys, read here with numpy, the events
themselves never decoded. A format-1 log's batches are decoded (only the attrs of
the four event types that matter) into the same records, then read the same way.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvflow.events import EventType
from kvflow.subscribers.eventlog_format import (
    FLAG_KEYS,
    FLAG_OK,
    OP_DTYPE,
    OP_RECORD,
    BatchIndex,
    decode_index,
    op_record,
)
from kvflow.subscribers.eventlog_read import LogReader

LOOKUP, TOUCH = 0, 1


class _Ev(msgspec.Struct):
    """A format-1 event as whatif reads it: its type, and its attrs left encoded until
    the type says they are needed (most events are not lookups, stores or retrieves)."""

    type: int
    attrs: msgspec.Raw = msgspec.Raw(b"\x80")


class _Attrs(msgspec.Struct):
    """The attrs of a format-1 event that whatif reads; the others are skipped by the
    decoder, unbuilt."""

    chunk_keys: bytes | None = None
    ok: bool = True
    instance_id: str = ""
    model_name: str = ""
    world_size: int = 1
    rank: int = 0
    chunk_size: int = 0
    chunk_bytes: int = 0
    requested_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] | None = None


_decoder = msgspec.msgpack.Decoder(list[_Ev])
_attrs_decoder = msgspec.msgpack.Decoder(_Attrs)
_LOOKUP_END = int(EventType.LOOKUP_END)
_WANTED = {
    int(EventType.LOOKUP_END),
    int(EventType.STORE_END),
    int(EventType.RETRIEVE_END),
    int(EventType.REGISTER),
}


@dataclass
class Trace:
    """The accesses in log order. Op i covers keys[start[i]:start[i+1]] (uint64)."""

    kind: np.ndarray  # int8: LOOKUP or TOUCH
    space: np.ndarray  # int32: a touch's namespace id; a lookup's first rank's (rank 0)
    world: np.ndarray  # int32: ranks a lookup needs (namespaces space .. space+world-1)
    start: np.ndarray  # int64, len(ops)+1
    keys: np.ndarray  # uint64
    requested_tokens: int = 0
    chunk_size: int = 0
    #: tokens of L1 hits the live lookups counted (hit_tokens_by_tier["l1"])
    live_l1_hit_tokens: int = 0
    lookups: int = 0
    #: bytes of one object per namespace id, and the namespaces' names
    space_bytes: dict[int, int] = field(default_factory=dict)
    spaces: dict[tuple[str, int, int], int] = field(default_factory=dict)
    unknown_instances: int = 0
    #: bool per op: a RETRIEVE_END touch (False: a STORE_END or a lookup); None when not
    #: read (a trace built by hand): the L2 simulation then takes every touch as a store
    retrieve: np.ndarray | None = None

    @property
    def ops(self) -> int:
        return len(self.kind)

    def object_bytes(self) -> int:
        """The most common object size (bytes a chunk of one rank takes in L1)."""
        counts = Counter(b for b in self.space_bytes.values() if b > 0)
        return counts.most_common(1)[0][0] if counts else 0


def _index_v1(payload: bytes | memoryview, reader: LogReader) -> BatchIndex:
    """A format-1 batch's index, as a format-2 writer would have made it."""
    events = _decoder.decode(payload)
    names: dict[str, int] = {}
    ops: list[bytes] = []
    keys: list[bytes] = []
    for i, ev in enumerate(events):
        if ev.type not in _WANTED:
            continue
        try:
            a = _attrs_decoder.decode(ev.attrs)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reader.problems.append(f"an event's attrs did not decode for whatif ({exc})")
            continue
        blob = a.chunk_keys or b""
        blob = blob[: len(blob) // 8 * 8]
        keys.append(blob)
        flags = (FLAG_KEYS if a.chunk_keys is not None else 0) | (FLAG_OK if a.ok else 0)
        l1 = 0
        if ev.type == _LOOKUP_END:
            by_tier = a.hit_tokens_by_tier
            l1 = by_tier.get("l1", 0) if by_tier is not None else a.hit_tokens
        inst_i = names.setdefault(a.instance_id, len(names))
        model_i = names.setdefault(a.model_name, len(names))
        try:
            ops.append(OP_RECORD.pack(i, ev.type, flags, a.world_size, a.rank, inst_i, model_i,
                                      len(blob) // 8, a.requested_tokens, l1, a.chunk_size,
                                      a.chunk_bytes))  # fmt: skip
        except struct.error:  # a value out of a field's range: the writer's defaults
            attrs = {f: getattr(a, f) for f in a.__struct_fields__ if f != "chunk_keys"}
            ops.append(op_record(i, EventType(ev.type), attrs, names, len(blob) // 8, flags))
    return BatchIndex(len(events), list(names), b"".join(ops), b"".join(keys))


def read_indexes(reader: LogReader) -> list[BatchIndex]:
    """The index of every intact batch of the log, in order (format 1 batches decoded
    into one); a batch that does not decode is reported in `reader.problems`."""
    parts: list[BatchIndex] = []
    for version, payload in reader.batch_frames():
        try:
            index = _index_v1(payload, reader) if version == 1 else decode_index(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reader.problems.append(f"a batch did not decode for whatif ({exc}), skipped")
            continue
        reader.events += index.events
        parts.append(index)
    return parts


def read_trace(reader: LogReader) -> Trace:
    """Extract the accesses of every intact batch of the log, in order."""
    return trace_of(read_indexes(reader))


def trace_of(parts: list[BatchIndex]) -> Trace:
    """The trace of these batch indexes (numpy over the packed records)."""
    ops = np.frombuffer(b"".join([p.ops for p in parts]), OP_DTYPE)
    all_keys = np.frombuffer(b"".join([p.keys for p in parts]), "<u8")
    names, inst, model = _log_names(parts, ops)
    etype = ops["type"]
    ok = (ops["flags"] & FLAG_OK) != 0
    is_lookup = ok & (etype == int(EventType.LOOKUP_END))
    is_touch = ok & ((etype == int(EventType.STORE_END)) | (etype == int(EventType.RETRIEVE_END)))
    # each op's namespace: a lookup's own (rank 0), a touch's from its instance's REGISTER
    touch_at = np.flatnonzero(is_touch)
    t_model, t_world, t_rank, known = _registered(ops, inst, model, touch_at)
    chosen = np.flatnonzero(is_lookup | is_touch)
    op_world = ops["world"].astype(np.int64)[chosen]
    op_model, op_rank = model[chosen], np.zeros(len(chosen), np.int64)
    where = np.searchsorted(chosen, touch_at)
    op_model[where], op_world[where], op_rank[where] = t_model, t_world, t_rank
    lookup_sel = is_lookup[chosen]
    space, spaces = _space_ids(names, op_model, op_world, op_rank)
    chunk_bytes = ops["chunk_bytes"][chosen]
    sized = np.flatnonzero(~lookup_sel & (chunk_bytes > 0))
    nkeys = ops["nkeys"].astype(np.int64)
    dropped = ~(is_lookup | is_touch)
    keys = all_keys[np.repeat(~dropped, nkeys)] if nkeys[dropped].any() else all_keys
    start = np.zeros(len(chosen) + 1, dtype=np.int64)
    np.cumsum(nkeys[chosen], out=start[1:])
    lookup_sizes = ops["chunk_size"][is_lookup]
    sizes = lookup_sizes[lookup_sizes > 0]
    return Trace(
        kind=np.where(lookup_sel, LOOKUP, TOUCH).astype(np.int8),
        space=space.astype(np.int32),
        world=np.where(lookup_sel, op_world, 1).astype(np.int32),
        start=start,
        keys=keys,
        requested_tokens=int(ops["requested"][is_lookup].sum()),
        chunk_size=int(sizes[0]) if len(sizes) else 0,
        live_l1_hit_tokens=int(ops["l1_hits"][is_lookup].sum()),
        lookups=int(is_lookup.sum()),
        space_bytes=_last_per_space(space[sized], chunk_bytes[sized]),
        spaces=spaces,
        unknown_instances=int(len(touch_at) - known.sum()),
        retrieve=etype[chosen] == int(EventType.RETRIEVE_END),
    )


def _log_names(
    parts: list[BatchIndex], ops: np.ndarray
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The log's names, and each record's instance and model as indexes into them (a
    record's are its batch's own indexes; most logs have the same names in every batch)."""
    if all(p.names == parts[0].names for p in parts):
        names = list(dict.fromkeys(parts[0].names)) if parts else []
        return names, ops["instance"].astype(np.int64), ops["model"].astype(np.int64)
    found: dict[str, int] = {}
    maps = [[found.setdefault(n, len(found)) for n in p.names] for p in parts]
    name_base = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(m) for m in maps], out=name_base[1:])
    name_map = np.asarray([i for m in maps for i in m], dtype=np.int64)
    per_batch = [len(p.ops) // OP_DTYPE.itemsize for p in parts]
    base = np.repeat(name_base[:-1], per_batch)
    return list(found), name_map[base + ops["instance"]], name_map[base + ops["model"]]


def _registered(
    ops: np.ndarray, inst: np.ndarray, model: np.ndarray, touch_at: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per touch (record indexes `touch_at`): model, world size and rank from its
    instance's latest REGISTER before it, and whether there was one (else: its own
    model, world 1, rank 0)."""
    world = ops["world"].astype(np.int64)
    rank = ops["rank"].astype(np.int64)
    t_model, t_world, t_rank = model[touch_at], np.ones_like(touch_at), np.zeros_like(touch_at)
    reg_at = np.flatnonzero(ops["type"] == int(EventType.REGISTER))
    known = np.zeros(len(touch_at), dtype=bool)
    if len(reg_at) and len(touch_at):
        n = len(ops) + 1
        order = np.lexsort((reg_at, inst[reg_at]))
        reg_sorted = reg_at[order]
        code = inst[reg_sorted] * n + reg_sorted
        j = np.searchsorted(code, inst[touch_at] * n + touch_at) - 1
        jc = np.maximum(j, 0)
        known = (j >= 0) & (inst[reg_sorted[jc]] == inst[touch_at])
        src = reg_sorted[jc[known]]
        t_model[known], t_world[known], t_rank[known] = model[src], world[src], rank[src]
    return t_model, t_world, t_rank, known


def _space_ids(
    names: list[str], op_model: np.ndarray, op_world: np.ndarray, op_rank: np.ndarray
) -> tuple[np.ndarray, dict[tuple[str, int, int], int]]:
    """Each op's namespace id, and the namespaces by (model, world size, rank): ids in
    order of first appearance, a world's ranks adjacent (rank 0 first)."""
    spaces: dict[tuple[str, int, int], int] = {}

    def space_of(model_name: str, world_size: int, r: int) -> int:
        found = spaces.get((model_name, world_size, r))
        if found is None:
            for q in range(world_size):
                spaces.setdefault((model_name, world_size, q), len(spaces))
            found = spaces.setdefault((model_name, world_size, r), len(spaces))
        return found

    code = (op_model << 32) | (op_world << 16) | op_rank
    if len(code) and code.min() == code.max():  # one namespace (most logs): no sort
        uniq, first = code[:1], np.zeros(1, dtype=np.int64)
        inverse = np.zeros(len(code), dtype=np.int64)
    else:
        uniq, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    ids = np.zeros(len(uniq), dtype=np.int32)
    for u in np.argsort(first, kind="stable").tolist():
        c = int(uniq[u])
        ids[u] = space_of(names[c >> 32], (c >> 16) & 0xFFFF, c & 0xFFFF)
    return ids[inverse.reshape(-1)], spaces


def _last_per_space(space: np.ndarray, nbytes: np.ndarray) -> dict[int, int]:
    """Per namespace id in `space`, the last of its `nbytes` (the object size a store
    recorded last)."""
    return {int(s): int(nbytes[space == s][-1]) for s in np.unique(space).tolist()}
