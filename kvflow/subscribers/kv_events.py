"""KV events for cache-aware routers: which chunks enter and leave each tier (docs/EVENTS.md).

`KVEventLog` is a bus subscriber that turns the tier events the engine publishes
(L1_WRITE, WRITE_BACK, L1_EVICT, L2_STORE_END, L2_EVICT, each with the `keys` it
touched) into `KVRecord`s: one per event and owner (model, world size, rank, salt),
naming the tier, its medium (CPU for L1, STORAGE for disk and Redis) and the chained
chunk hashes. Records get consecutive log sequence numbers and are kept in a bounded
replay log (oldest dropped first), from which readers take what follows their
position, or learn how many records they lost.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec

from kvflow.events import Event, EventType

#: the medium of each record's tier, in vLLM's words (its BlockStored `medium`)
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

#: chunk hashes the log keeps by default (about 100 bytes each with their record)
DEFAULT_CAPACITY_CHUNKS = 1 << 16

#: (chunk_hash, model_name, world_size, rank, cache_salt): an ObjectKey's fields
Key = tuple[bytes, str, int, int, "str | None"]
Owner = tuple[str, int, int, "str | None"]
Kind = Literal["stored", "removed"]


class KVRecord(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Chunks of one owner that entered (`stored`) or left (`removed`) one tier.

    `log_seq` numbers the log's records from 1 in the server's lifetime; a reader
    with a subscription sees its own `seq` as well (kvflow.core.server.kv_streams).
    `chunk_hashes` are the chained chunk keys (docs/ENGINE.md, Keys), chunk order kept.
    """

    log_seq: int
    ts_ns: int
    kind: Kind
    tier: str
    medium: str
    model_name: str
    world_size: int
    rank: int
    cache_salt: str | None
    chunk_hashes: list[bytes]
    seq: int = 0


class RecordFilter(msgspec.Struct, frozen=True):
    """Which owners a reader wants: None fields match everything."""

    model_name: str | None = None
    world_size: int | None = None
    cache_salt: str | None = None
    #: match only records whose salt is `cache_salt`, None included
    match_salt: bool = False
    rank: int | None = None

    def matches(self, record: KVRecord) -> bool:
        return (
            (self.model_name is None or record.model_name == self.model_name)
            and (self.world_size is None or record.world_size == self.world_size)
            and (self.rank is None or record.rank == self.rank)
            and (not self.match_salt or record.cache_salt == self.cache_salt)
        )


class ReadResult(msgspec.Struct, frozen=True):
    """What `KVEventLog.read` found after a position.

    `lost` log records between the position and the oldest record still kept were
    dropped before this read (0: nothing missed); `next_log_seq` is the position to
    read from next; `more` says records remain past `limit`.
    """

    records: list[KVRecord]
    lost: int
    next_log_seq: int
    more: bool


def _by_owner(keys: Iterable[Any]) -> dict[Owner, list[bytes]]:
    """Chunk hashes grouped by owner, each group in the keys' order."""
    groups: dict[Owner, list[bytes]] = {}
    for key in keys:
        h, model, world, rank, salt = key
        groups.setdefault((model, world, rank, salt), []).append(h)
    return groups


def _tier_change(event: Event) -> tuple[Kind, str, Any] | None:
    """(kind, tier, keys) of an event that moved chunks in or out of a tier, else None."""
    attrs = event.attrs
    etype = event.type
    if etype is EventType.L1_WRITE or etype is EventType.WRITE_BACK:
        return "stored", "l1", attrs.get("keys")
    if etype is EventType.L1_EVICT:
        return "removed", "l1", attrs.get("keys")
    if etype is EventType.L2_STORE_END:
        return "stored", str(attrs.get("tier")), attrs.get("keys")
    if etype is EventType.L2_EVICT:
        return "removed", str(attrs.get("tier")), attrs.get("keys")
    return None


class KVEventLog:
    """A bus subscriber keeping the last `capacity_chunks` chunk hashes' records.

    Runs on the bus's dispatcher thread (`blocking = False`): `on_events` only groups
    keys and appends under a lock that readers hold just long enough to copy a slice.
    """

    name = "kv_events"
    blocking = False
    event_types: frozenset[EventType] | None = frozenset(
        {
            EventType.L1_WRITE,
            EventType.WRITE_BACK,
            EventType.L1_EVICT,
            EventType.L2_STORE_END,
            EventType.L2_EVICT,
        }
    )

    def __init__(self, capacity_chunks: int = DEFAULT_CAPACITY_CHUNKS) -> None:
        if isinstance(capacity_chunks, bool) or not isinstance(capacity_chunks, int):
            raise ValueError(f"capacity_chunks must be an integer >= 1, got {capacity_chunks!r}")
        if capacity_chunks < 1:
            raise ValueError(f"capacity_chunks must be an integer >= 1, got {capacity_chunks}")
        self.capacity_chunks = capacity_chunks
        self._lock = threading.Lock()
        self._records: deque[KVRecord] = deque()
        self._chunks = 0
        self._next = 1  # the next record's log_seq
        #: events whose keys were not known (an L2 store that failed in part): not logged
        self.unknown_keys = 0

    def on_events(self, events: Sequence[Event]) -> None:
        for event in events:
            change = _tier_change(event)
            if change is None:
                continue
            kind, tier, keys = change
            if keys is None:
                self.unknown_keys += 1
                continue
            if not keys:
                continue
            medium = MEDIUM_CPU if tier == "l1" else MEDIUM_STORAGE
            with self._lock:
                for (model, world, rank, salt), hashes in _by_owner(keys).items():
                    record = KVRecord(
                        self._next, event.ts_ns, kind, tier, medium, model, world, rank,
                        salt, hashes,
                    )  # fmt: skip
                    self._next += 1
                    self._records.append(record)
                    self._chunks += len(hashes)
                while self._chunks > self.capacity_chunks and len(self._records) > 1:
                    self._chunks -= len(self._records.popleft().chunk_hashes)

    def read(self, after_log_seq: int, wanted: RecordFilter, limit: int) -> ReadResult:
        """Records with log_seq > `after_log_seq` that `wanted` matches, at most `limit`."""
        with self._lock:
            first = self._records[0].log_seq if self._records else self._next
            after_log_seq = min(after_log_seq, self._next - 1)  # never past the log's end
            lost = max(0, first - after_log_seq - 1)
            start = max(0, after_log_seq + 1 - first)
            tail = [self._records[i] for i in range(start, len(self._records))]
            end = self._next
        out: list[KVRecord] = []
        position = max(after_log_seq, first - 1)
        for record in tail:
            if len(out) == limit:
                return ReadResult(out, lost, position, True)
            position = record.log_seq
            if wanted.matches(record):
                out.append(record)
        return ReadResult(out, lost, max(position, end - 1), False)

    def stats(self) -> dict[str, int]:
        """Records and chunk hashes kept, the next log_seq, events without keys."""
        with self._lock:
            return {
                "records": len(self._records),
                "chunks": self._chunks,
                "capacity_chunks": self.capacity_chunks,
                "next_log_seq": self._next,
                "unknown_keys": self.unknown_keys,
            }

    def shutdown(self) -> None:
        """Nothing to flush: the log lives in memory and dies with the server."""
