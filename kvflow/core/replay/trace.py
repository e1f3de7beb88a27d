"""An event log's L1 accesses as flat arrays: what `kvflow whatif` simulates.

Three kinds of recorded operations matter (docs/EVENTS.md, attrs for whatif):
- a successful LOOKUP_END asks for its `chunk_keys` on every rank of its world
  (a query: the simulation never changes the cache on a lookup, see lru.py);
- a successful STORE_END puts its `chunk_keys` (the prefix now in L1) in L1 for
  the instance's rank, and a successful RETRIEVE_END refreshes its hit prefix:
  both are touches.
Chunk keys are the first 8 bytes of the chained chunk hashes; an object is a key
within a namespace (model, world size, rank), as `ObjectKey` is in the engine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvflow.events import EventType
from kvflow.subscribers.eventlog_read import LogReader

LOOKUP, TOUCH = 0, 1


class _Attrs(msgspec.Struct):
    """The attrs whatif reads; the others are skipped by the decoder, unbuilt."""

    chunk_keys: bytes = b""
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


class _Ev(msgspec.Struct):
    """An event as whatif reads it: its type, and its attrs left encoded until the type
    says they are needed (most events are not lookups, stores or retrieves)."""

    type: int
    attrs: msgspec.Raw = msgspec.Raw(b"\x80")


_decoder = msgspec.msgpack.Decoder(list[_Ev])
_attrs_decoder = msgspec.msgpack.Decoder(_Attrs)
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

    @property
    def ops(self) -> int:
        return len(self.kind)

    def object_bytes(self) -> int:
        """The most common object size (bytes a chunk of one rank takes in L1)."""
        counts = Counter(b for b in self.space_bytes.values() if b > 0)
        return counts.most_common(1)[0][0] if counts else 0


def read_trace(reader: LogReader) -> Trace:
    """Extract the accesses of every intact batch of the log, in order."""
    instances: dict[str, tuple[str, int, int]] = {}
    spaces: dict[tuple[str, int, int], int] = {}
    space_bytes: dict[int, int] = {}
    kinds: list[int] = []
    sp: list[int] = []
    worlds: list[int] = []
    lengths: list[int] = []
    blobs: list[bytes] = []
    requested = live_hits = lookups = unknown = 0
    chunk_size = 0

    def space_of(model: str, world: int, rank: int) -> int:
        """The namespace id; a world's ranks get adjacent ids (rank 0 first)."""
        found = spaces.get((model, world, rank))
        if found is None:
            for r in range(world):
                spaces.setdefault((model, world, r), len(spaces))
            found = spaces.setdefault((model, world, rank), len(spaces))
        return found

    for payload in reader.batch_payloads():
        try:
            events = _decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reader.problems.append(f"a batch did not decode for whatif ({exc}), skipped")
            continue
        reader.events += len(events)
        for ev in events:
            t = ev.type
            if t not in _WANTED:
                continue
            try:
                a = _attrs_decoder.decode(ev.attrs)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                reader.problems.append(f"an event's attrs did not decode for whatif ({exc})")
                continue
            if t == EventType.REGISTER:
                instances[a.instance_id] = (a.model_name, a.world_size, a.rank)
                continue
            if not a.ok:
                continue
            if t == EventType.LOOKUP_END:
                lookups += 1
                requested += a.requested_tokens
                by_tier = a.hit_tokens_by_tier
                live_hits += by_tier.get("l1", 0) if by_tier is not None else a.hit_tokens
                chunk_size = chunk_size or a.chunk_size
                kinds.append(LOOKUP)
                sp.append(space_of(a.model_name, a.world_size, 0))
                worlds.append(a.world_size)
            else:
                inst = instances.get(a.instance_id)
                if inst is None:  # registered before the log's oldest segment
                    unknown += 1
                    inst = (a.model_name, 1, 0)
                s = space_of(*inst)
                if a.chunk_bytes:
                    space_bytes[s] = a.chunk_bytes
                kinds.append(TOUCH)
                sp.append(s)
                worlds.append(1)
            blobs.append(a.chunk_keys)
            lengths.append(len(a.chunk_keys) // 8)
    start = np.zeros(len(kinds) + 1, dtype=np.int64)
    np.cumsum(lengths, out=start[1:])
    blob = b"".join(blobs)
    return Trace(
        kind=np.asarray(kinds, dtype=np.int8),
        space=np.asarray(sp, dtype=np.int32),
        world=np.asarray(worlds, dtype=np.int32),
        start=start,
        keys=np.frombuffer(blob, dtype="<u8", count=len(blob) // 8),
        requested_tokens=requested,
        chunk_size=chunk_size,
        live_l1_hit_tokens=live_hits,
        lookups=lookups,
        space_bytes=space_bytes,
        spaces=spaces,
        unknown_instances=unknown,
    )
