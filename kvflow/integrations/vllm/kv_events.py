"""The connector's KV events: what the kvflow server holds, told in vLLM's block terms.

A worker remembers, for every chunk it stores or loads, which of vLLM's blocks it covers
(their block hashes, the parent block's hash, the tokens). A background thread follows
the server's KV-event stream for this worker's rank (`KVEventStream`) and turns each
record about a remembered chunk into `BlocksStored` / `BlocksRemoved` with the record's
medium (CPU for L1, STORAGE for disk and Redis); `take` hands them to vLLM each step.
When the server restarted or the stream lost records, every block this worker reported
as held is reported removed: a router then underestimates, never routes to KV that is
gone. Needs no vLLM: connector.py turns these into vLLM's `BlockStored`/`BlockRemoved`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvflow.core import KVFlowClient
from kvflow.core.engine.keys import chain_hashes
from kvflow.core.server.kv_subscriber import KVEventStream, KVRecord

log = logging.getLogger("kvflow.integrations.vllm")

#: seconds between two polls of the server's KV-event stream when it had nothing new
POLL_INTERVAL_S = 0.05
#: chunks whose blocks a worker remembers (least recently stored or loaded forgotten first)
MAX_CHUNKS = 1 << 14


class BlocksStored(NamedTuple):
    """Consecutive blocks of one prompt now held in `medium` (vLLM's BlockStored)."""

    block_hashes: tuple[Any, ...]
    parent_block_hash: Any
    token_ids: tuple[int, ...]
    medium: str


class BlocksRemoved(NamedTuple):
    """Blocks no longer held in `medium` (vLLM's BlockRemoved)."""

    block_hashes: tuple[Any, ...]
    medium: str


BlockEvent = BlocksStored | BlocksRemoved


@dataclass
class _Chunk:
    """One chunk's blocks, and the media this worker has reported it held in."""

    block_hashes: tuple[Any, ...]
    parent: Any
    tokens: tuple[int, ...]
    media: set[str] = field(default_factory=set)


@dataclass
class _Pending:
    token_ids: np.ndarray
    block_hashes: Sequence[Any]
    cache_salt: str | None


class ChunkBlocks:
    """kvflow chunk key (hash, salt) -> the vLLM blocks it holds; bounded, LRU."""

    def __init__(self, chunk_size: int, block_size: int, max_chunks: int = MAX_CHUNKS) -> None:
        if chunk_size % block_size:
            raise ValueError(f"chunk size {chunk_size} is not a multiple of block {block_size}")
        self.chunk_size = chunk_size
        self.block_size = block_size
        self._max = max_chunks
        self._chunks: OrderedDict[tuple[bytes, str | None], _Chunk] = OrderedDict()

    def remember(
        self, token_ids: np.ndarray, block_hashes: Sequence[Any], cache_salt: str | None
    ) -> None:
        """Map the whole chunks of `token_ids` (whose blocks `block_hashes` name) to blocks."""
        per = self.chunk_size // self.block_size
        n = min(len(token_ids) // self.chunk_size, len(block_hashes) // per)
        hashes = chain_hashes(np.asarray(token_ids[: n * self.chunk_size], "<i4"), self.chunk_size)
        for i, h in enumerate(hashes):
            key = (h, cache_salt)
            known = self._chunks.get(key)
            if known is not None:
                self._chunks.move_to_end(key)
                continue
            blocks = tuple(block_hashes[i * per : (i + 1) * per])
            parent = block_hashes[i * per - 1] if i else None
            tokens = tuple(
                int(t) for t in token_ids[i * self.chunk_size : (i + 1) * self.chunk_size]
            )
            self._chunks[key] = _Chunk(blocks, parent, tokens)
            if len(self._chunks) > self._max:
                self._chunks.popitem(last=False)

    def translate(self, record: KVRecord) -> list[BlockEvent]:
        """A record's chunks this worker knows, as block events (consecutive chunks of one
        prompt merged into one event, as vLLM reports a request's new blocks)."""
        out: list[BlockEvent] = []
        medium = record.medium
        for h in record.chunk_hashes:
            chunk = self._chunks.get((h, record.cache_salt))
            if chunk is None:
                continue
            if record.kind == "stored":
                chunk.media.add(medium)
                last = out[-1] if out else None
                if isinstance(last, BlocksStored) and last.block_hashes[-1] == chunk.parent:
                    out[-1] = BlocksStored(
                        last.block_hashes + chunk.block_hashes, last.parent_block_hash,
                        last.token_ids + chunk.tokens, medium,
                    )  # fmt: skip
                else:
                    out.append(BlocksStored(chunk.block_hashes, chunk.parent, chunk.tokens, medium))
            else:
                chunk.media.discard(medium)
                last = out[-1] if out else None
                if isinstance(last, BlocksRemoved):
                    out[-1] = BlocksRemoved(last.block_hashes + chunk.block_hashes, medium)
                else:
                    out.append(BlocksRemoved(chunk.block_hashes, medium))
        return out

    def forget_held(self) -> list[BlockEvent]:
        """Every block reported held, as removed (the server restarted or records were lost)."""
        by_medium: dict[str, list[Any]] = {}
        for chunk in self._chunks.values():
            for medium in chunk.media:
                by_medium.setdefault(medium, []).extend(chunk.block_hashes)
            chunk.media.clear()
        return [BlocksRemoved(tuple(hashes), medium) for medium, hashes in by_medium.items()]


class WorkerKVEvents:
    """Follows the server's KV-event stream for one rank on a background thread.

    `remember` (on vLLM's step thread) queues a store's or load's block mapping and
    returns at once; the thread applies it before translating the records of any poll
    answered after it, so a chunk's record never arrives before its mapping.
    """

    def __init__(
        self,
        client_factory: Callable[[], KVFlowClient],
        *,
        model_name: str,
        world_size: int,
        rank: int,
        block_size: int,
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self._factory = client_factory
        self._filter = {"model_name": model_name, "world_size": world_size, "rank": rank}
        self._block_size = block_size
        self._interval = poll_interval_s
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._events: list[BlockEvent] = []
        self._stop = threading.Event()
        #: set once the stream is subscribed: records from then on are followed
        self.subscribed = threading.Event()
        #: records of chunks this worker never stored or loaded (other engines' chunks)
        self.unknown_records = 0
        self._thread = threading.Thread(target=self._run, name="kvflow-kv-events", daemon=True)
        self._thread.start()

    def remember(
        self, token_ids: np.ndarray, block_hashes: Sequence[Any], cache_salt: str | None
    ) -> None:
        with self._lock:
            self._pending.append(_Pending(token_ids, block_hashes, cache_salt))

    def take(self) -> list[BlockEvent]:
        """The block events gathered since the last call."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def _run(self) -> None:
        client: KVFlowClient | None = None
        stream: KVEventStream | None = None
        blocks: ChunkBlocks | None = None
        while not self._stop.is_set():
            try:
                if client is None:
                    client = self._factory()
                if blocks is None:
                    blocks = ChunkBlocks(int(client.status()["chunk_size"]), self._block_size)
                if stream is None:
                    stream = KVEventStream(client, **self._filter)  # type: ignore[arg-type]
                    self.subscribed.set()
                batch = stream.poll()
            except Exception as exc:
                log.warning("kvflow: KV-event stream unavailable, retrying: %s", exc)
                self._stop.wait(1.0)
                continue
            with self._lock:
                pending, self._pending = self._pending, []
            for item in pending:
                blocks.remember(item.token_ids, item.block_hashes, item.cache_salt)
            events: list[BlockEvent] = []
            if batch.reset is not None or batch.lost:
                events.extend(withdrawn := blocks.forget_held())
                log.warning(
                    "kvflow: %s: reporting the %d block(s) announced as held in kvflow removed",
                    "the server restarted"
                    if batch.reset
                    else f"{batch.lost} KV-event records lost",
                    sum(len(e.block_hashes) for e in withdrawn),
                )
            for record in batch.records:
                translated = blocks.translate(record)
                self.unknown_records += not translated
                events.extend(translated)
            if events:
                with self._lock:
                    self._events.extend(events)
            if not batch.records:
                self._stop.wait(self._interval)
        if stream is not None:
            stream.close()
        if client is not None:
            client.close()

    def close(self) -> None:
        """Stop following the stream (unsubscribes)."""
        self._stop.set()
        self._thread.join(5.0)


class RankVotes:
    """Block events every rank reported: a shard of a chunk is one object per rank, and a
    router may count on a block only once all of them are held (or one is gone).

    vLLM hands the scheduler each step's events of all workers together; a rank's
    events may come a step after another's, so votes are kept across steps (bounded:
    the oldest undecided event is dropped first).
    """

    def __init__(self, world_size: int, max_pending: int = 1 << 16) -> None:
        self._world = world_size
        self._max = max_pending
        self._votes: OrderedDict[Any, int] = OrderedDict()

    def add(self, events: Sequence[Any]) -> list[Any]:
        """Count these reports; return the events now reported by every rank, in order."""
        if self._world == 1:
            return list(events)
        ready: list[Any] = []
        for event in events:
            votes = self._votes.get(event, 0) + 1
            if votes >= self._world:
                self._votes.pop(event, None)
                ready.append(event)
            else:
                self._votes[event] = votes
                if len(self._votes) > self._max:
                    self._votes.popitem(last=False)
        return ready
