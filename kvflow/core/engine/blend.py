"""Blend (docs/BLEND.md): stored chunks reused anywhere in a prompt, K turned to fit.

`Blender` keeps the blend index (kvflow.core.engine.blend_index) in step with what
stores hold, answers blend lookups (the prefix by a plain lookup, then the stored chunks
found past it that every rank still holds in some tier), and checks a blend retrieve's
segments. `copy_segments` then writes each segment's KV into the prompt's slots (token
by token: a segment may start inside a block, kvflow.kernels.token_copy) and turns K's
rotary dims by the segment's position delta (kvflow.kernels.rope).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from kvflow.core.arrays import as_int32_array
from kvflow.core.engine.blend_index import (
    BlendIndex,
    BlendSegment,
    Owner,
    StoredChunks,
    stored_chunks,
)
from kvflow.core.engine.instances import Instance
from kvflow.core.engine.ops import Op
from kvflow.core.engine.tiering import Tiering
from kvflow.core.engine.validation import check_ranks, check_salt
from kvflow.core.errors import InvalidRequestError
from kvflow.core.tiers.base import HostTier, ObjectKey
from kvflow.events import EventBus, EventType
from kvflow.kernels.rope import apply_rerotation, plan_rerotation
from kvflow.kernels.rope_params import LayerRopes, RerotateSegment, RopeParams
from kvflow.kernels.token_copy import scatter_tokens, token_slots

log = logging.getLogger("kvflow.engine")
T = TypeVar("T")

#: segments copied to the GPU at once by a blend retrieve (their bytes staged together)
STAGE_SEGMENTS = 8
#: stores whose hashing the indexing thread keeps for the other ranks of their engine
HASHED_KEPT = 8


@dataclass(frozen=True)
class BlendHit:
    """A blend lookup's answer: the prefix hit (tokens from 0) and the stored chunks found
    past it, leftmost first, none overlapping."""

    prefix_tokens: int
    segments: list[BlendSegment]

    @property
    def blended_tokens(self) -> int:
        return sum(s.length for s in self.segments)


class BlendRetrieved(NamedTuple):
    """A blend retrieve's answer: the tokens copied, and the prompt offsets (ascending) of
    the segments it skipped because no tier holds them any more or the index forgot them:
    the engine recomputes those segments' tokens."""

    tokens: int
    skipped: tuple[int, ...]


def layer_ropes(ropes: Any, num_layers: int) -> LayerRopes | None:
    """An instance's rotary parameters as LayerRopes (one RopeParams serves every layer)."""
    if ropes is None or isinstance(ropes, LayerRopes):
        return ropes
    if isinstance(ropes, RopeParams):
        return LayerRopes.uniform(ropes, num_layers)
    raise InvalidRequestError(f"ropes must be RopeParams or LayerRopes, got {type(ropes).__name__}")


def _after(
    deferred: Sequence[tuple[Callable[..., None], tuple[Any, ...]]],
    fn: Callable[..., T] | None,
    *args: Any,
) -> T | None:
    """One job of the indexing thread: the deferred changes, each on its own (`_logged`),
    then `fn(*args)` when given."""
    for change, change_args in deferred:
        _logged(change, *change_args)
    return None if fn is None else _logged(fn, *args)


def _logged(fn: Callable[..., T], *args: Any) -> T | None:
    """One indexing job; a failure is logged and gives None, never raised into a later
    lookup (the store itself went through; a chunk listed but gone is skipped by lookups)."""
    try:
        return fn(*args)
    except Exception:
        log.exception(
            "blend_index_failed: an index change was lost (a store's chunks are not"
            " findable by blend, or forgotten chunks stay listed)"
        )
        return None


@dataclass(frozen=True)
class PreparedStore:
    """A store's chunks on their way into the blend index: their owner, rank and keys, and
    their hashing (a job on the indexing thread; None when it failed, logged)."""

    owner: Owner
    rank: int
    hashes: list[bytes]
    chunks: Future[StoredChunks | None]


class Blender:
    """An engine's blend index, blend lookups and blend retrieve checks.

    Index changes run on a thread of their own, in the order the engine made them, and
    out of the stores' way: a store's chunks are hashed there while its copies run (the
    store waits with the GIL released), and once committed their insertion, like the
    removal of chunks evicted meanwhile, goes with the thread's next job (the next store's
    hashing, again while copies run): one hand-off per store, and no indexing competes
    for the GIL with a store that just returned. A blend lookup first submits what is left
    and waits for it, so it sees every store that returned and every chunk forgotten.

    Lock rule: `_lock` guards `_last` (the newest indexing job), `_deferred` (index
    changes not submitted yet) and `_closed`, and is held while
    submitting, so the thread gets the jobs in the engine's order; the index locks itself;
    L1, the tiering and the bus are thread-safe.
    """

    def __init__(
        self, *, l1: HostTier, tiering: Tiering | None, bus: EventBus, chunk_size: int,
        prefix_lookup: Callable[..., int],
        rank_nbytes: Callable[[str, int, Sequence[int]], tuple[list[int], list[int]]],
        capacity_chunks: int,
    ) -> None:  # fmt: skip
        self.l1 = l1
        self.tiering = tiering
        self.bus = bus
        self.chunk_size = chunk_size
        self.prefix_lookup = prefix_lookup
        self.rank_nbytes = rank_nbytes
        #: whether stores are indexed and blend lookups served (capacity 0: blend off)
        self.enabled = capacity_chunks > 0
        self.index = BlendIndex(max(1, capacity_chunks))
        self._indexer = ThreadPoolExecutor(1, thread_name_prefix="kvflow-blend-index")
        self._lock = threading.Lock()
        self._last: Future[Any] | None = None
        #: index changes that go ahead of the indexing thread's next job (a committed
        #: store's insertion, evicted chunks' removal), in the engine's order
        self._deferred: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._closed = False
        #: the last stores' hashing by (last chunk key, chunks): the ranks of a
        #: tensor-parallel engine store the same tokens at once, and the chunk keys chain
        #: the tokens from the first, so the hashing of one serves them all (the indexing
        #: thread's alone: no lock)
        self._hashed: OrderedDict[tuple[bytes, int], StoredChunks] = OrderedDict()

    # -- the index --------------------------------------------------------------------------

    def prepare_store(
        self, inst: Instance, tokens: np.ndarray, hashes: Sequence[bytes], salt: str | None
    ) -> PreparedStore | None:
        """Hash, on the indexing thread, the chunks a store of `inst` is writing (`hashes`:
        chunks 0.. of `tokens`, copied here); the store calls it before it waits for its
        copies, and `record_store` once they are committed. None: nothing to index."""
        if not hashes or not self.enabled:
            return None
        chunks = self._submit(self._hash_stored, tokens.copy(), hashes[-1], len(hashes))
        if chunks is None:
            return None
        owner = (inst.model_name, inst.world_size, salt)
        return PreparedStore(owner, inst.rank, list(hashes), chunks)

    def _hash_stored(self, tokens: np.ndarray, last_key: bytes, count: int) -> StoredChunks:
        """The hashing of a store's first `count` chunks (`stored_chunks`), or the same
        chunks' hashing another rank's store just did (on the indexing thread)."""
        key = (last_key, count)
        found = self._hashed.get(key)
        if found is None:
            found = self._hashed[key] = stored_chunks(tokens, self.chunk_size, count)
            while len(self._hashed) > HASHED_KEPT:
                self._hashed.popitem(last=False)
        return found

    def record_store(self, prepared: PreparedStore | None) -> None:
        """Make a prepared store's committed chunks findable: inserted on the indexing thread
        ahead of its next job, or of the next lookup's wait (`indexed`)."""
        if prepared is not None:
            self._defer(self._insert, prepared)

    def _defer(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the indexing thread ahead of its next job, in this order."""
        with self._lock:
            if not self._closed:
                self._deferred.append((fn, args))

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T | None] | None:
        """Queue the deferred changes, then `fn(*args)`, on the indexing thread as one job
        (a job's hand-off costs about as much CPU as hashing a few chunks); None once
        closed (the index goes with the engine)."""
        with self._lock:
            if self._closed:
                return None
            job = self._indexer.submit(_after, self._take_deferred(), fn, *args)
            self._last = job
        return job

    def _take_deferred(self) -> list[tuple[Callable[..., None], tuple[Any, ...]]]:
        """The deferred changes, now owned by the caller's job (holds `_lock`)."""
        deferred, self._deferred = self._deferred, []
        return deferred

    def _insert(self, prepared: PreparedStore) -> None:
        """One committed store's insertion, once its hashing is done (its own earlier job)."""
        chunks = prepared.chunks.result()
        if chunks is not None:
            self.index.insert(prepared.owner, prepared.rank, prepared.hashes, chunks)

    def indexed(self) -> None:
        """Wait until the stores recorded and the chunks forgotten so far are in the index."""
        with self._lock:
            if self._deferred and not self._closed:
                self._last = self._indexer.submit(_after, self._take_deferred(), None)
            last = self._last
        if last is not None:
            last.result()

    def close(self) -> None:
        """Finish the indexing submitted and stop its thread; later changes are dropped."""
        with self._lock:
            self._closed = True
            self._deferred.clear()
        self._indexer.shutdown(wait=True)

    def forget(self, keys: Sequence[Any]) -> None:
        """Drop chunks whose objects left every tier from the index (`keys`: ObjectKeys,
        or the plain tuples L1 keeps them as), after the stores recorded before."""
        if not self.enabled:
            return
        by_owner: dict[Owner, list[bytes]] = {}
        for key in keys:
            by_owner.setdefault((key[1], key[2], key[4]), []).append(key[0])
        if by_owner:
            self._defer(self._remove, by_owner)

    def _remove(self, by_owner: dict[Owner, list[bytes]]) -> None:
        """Forget chunks by owner (the indexing thread's side of `forget`)."""
        for owner, hashes in by_owner.items():
            self.index.remove(owner, hashes)

    def _check_on(self, what: str) -> None:
        """InvalidRequestError naming the switch when the server runs with blend off."""
        if not self.enabled:
            raise InvalidRequestError(
                f"a blend {what} needs the blend index, which this server runs without"
                " (--blend-index-chunks 0)"
            )

    # -- lookup -----------------------------------------------------------------------------

    def lookup(
        self, token_ids: Any, *, model_name: str, world_size: int, cache_salt: str | None,
        request_id: str | None, prefetch: bool, ranks: Sequence[int] | None = None,
    ) -> BlendHit:  # fmt: skip
        """The prefix hit (a LOOKUP pair, as `CacheEngine.lookup`), then one
        BLEND_LOOKUP pair for the stored chunks found past it that every rank of `ranks`
        (default all) holds; InvalidRequestError with blend off."""
        self._check_on("lookup")
        prefix = self.prefix_lookup(
            token_ids, model_name=model_name, world_size=world_size, cache_salt=cache_salt,
            request_id=request_id, prefetch=prefetch, chunk_keys=None, ranks=ranks,
        )  # fmt: skip
        counted = check_ranks(ranks, world_size)
        tokens = as_int32_array(token_ids, "token_ids")
        self.indexed()
        attrs = {"model_name": model_name, "tokens": len(tokens), "prefix_tokens": prefix}
        op = Op(self.bus, EventType.BLEND_LOOKUP_START, request_id, attrs)
        try:
            owner = (model_name, world_size, check_salt(cache_salt))
            found = self.index.find(owner, counted, tokens, self.chunk_size, start=prefix)
            held, by_tier = self._held(owner, counted, found, request_id, prefetch)
        except BaseException as exc:
            op.fail(exc, blend_hit_tokens=0, segments=0)
            raise
        hit = BlendHit(prefix, held)
        op.end(
            blend_hit_tokens=hit.blended_tokens, segments=len(held),
            blend_hit_tokens_by_tier=by_tier, prefix_tokens=prefix,
        )  # fmt: skip
        return hit

    def _held(
        self, owner: Owner, ranks: Sequence[int], found: list[BlendSegment],
        session_id: str | None, prefetch: bool,
    ) -> tuple[list[BlendSegment], dict[str, int]]:  # fmt: skip
        """The segments every rank of `ranks` holds in some tier, and their tokens per tier
        (the slowest each needs); chunks none holds leave the index; L2 ones are prefetched."""
        model_name, world_size, salt = owner
        rows = [
            [ObjectKey(s.chunk_hash, model_name, world_size, r, salt) for r in ranks] for s in found
        ]
        keys = [k for row in rows for k in row]
        where = self._residency(keys)
        held, by_tier, gone, fetch = [], dict[str, int](), [], []
        for segment, row in zip(found, rows, strict=True):
            tiers = [where[k] for k in row]
            if all(t is None for t in tiers):
                gone.extend(row)
            elif None not in tiers:
                held.append(segment)
                tier = next((t for t in tiers if t and t != "l1"), "l1")
                by_tier[tier] = by_tier.get(tier, 0) + segment.length
                if tier != "l1":
                    fetch.append(row)
        self.forget(gone)
        if prefetch and fetch and self.tiering is not None:
            nbytes, missing = self.rank_nbytes(model_name, world_size, ranks)
            if not missing:
                self.tiering.prefetch(
                    fetch, nbytes, model_name=model_name, trigger="blend",
                    session_id=session_id, residency=where,
                )  # fmt: skip
        return held, by_tier

    def _residency(self, keys: list[ObjectKey]) -> dict[ObjectKey, str | None]:
        if self.tiering is not None:
            return dict(self.tiering.loader.residency(keys))
        answers = self.l1.contains(keys).result()
        return {k: ("l1" if hit else None) for k, hit in zip(keys, answers, strict=True)}

    # -- retrieve ---------------------------------------------------------------------------

    def plan_retrieve(
        self, inst: Instance, token_ids: Any, block_ids: Any, segments: Any, salt: str | None
    ) -> tuple[list[BlendSegment], list[int], np.ndarray]:
        """A blend retrieve's segments, checked (InvalidRequestError naming the segment):
        inside the prompt and its blocks, none overlapping, each one's tokens those of its
        stored chunk (when the index still knows it; one it forgot is skipped). Returns
        (the segments to copy, the prompt offsets of those skipped, the block ids as int64)."""
        self._check_on("retrieve")
        if inst.ropes is None:
            raise InvalidRequestError(
                f"instance {inst.instance_id!r} registered no rotary parameters (ropes): a blend"
                " retrieve needs them to turn K to the segments' new positions"
            )
        tokens = as_int32_array(token_ids, "token_ids")
        blocks = as_int32_array(block_ids, "block_ids").astype(np.int64)
        inst.layout.validate_block_ids(blocks)
        checked = [_segment(s, i, self.chunk_size) for i, s in enumerate(_listed(segments))]
        reach = len(blocks) * inst.block_size
        end = 0
        for i, s in enumerate(sorted(checked, key=lambda s: s.offset)):
            if s.offset < end:
                raise InvalidRequestError(f"blend segments overlap at prompt offset {s.offset}")
            end = s.offset + s.length
            if end > min(len(tokens), reach):
                raise InvalidRequestError(
                    f"blend segment {i} ends at token {end}, past the prompt ({len(tokens)} tokens)"
                    f" or its blocks ({reach} tokens)"
                )
        owner = (inst.model_name, inst.world_size, salt)
        self.indexed()
        known: list[BlendSegment] = []
        forgotten: list[BlendSegment] = []
        for s in checked:
            same = self.index.matches(owner, s.chunk_hash, tokens[s.offset : s.offset + s.length])
            if same is False:
                raise InvalidRequestError(
                    f"blend segment at prompt offset {s.offset}: the prompt's tokens there are"
                    f" not those of stored chunk {s.chunk_hash.hex()[:16]}"
                )
            (known if same else forgotten).append(s)
        return known, [s.offset for s in forgotten], blocks


def _listed(segments: Any) -> list[Any]:
    if not isinstance(segments, (list, tuple)):
        raise InvalidRequestError(
            f"segments must be a list of (offset, chunk_hash, original_start), got {type(segments).__name__}"
        )
    return list(segments)


def _segment(value: Any, i: int, chunk_size: int) -> BlendSegment:
    """One segment as (offset, chunk_hash, original_start) or a BlendSegment, checked."""
    if isinstance(value, BlendSegment):
        value = (value.offset, value.chunk_hash, value.original_start)
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise InvalidRequestError(
            f"blend segment {i} must be (offset, chunk_hash, original_start), got {value!r}"
        )
    offset, chunk_hash, original = value
    for name, n in (("offset", offset), ("original_start", original)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidRequestError(
                f"blend segment {i}: {name} must be an integer >= 0, got {n!r}"
            )
    if not isinstance(chunk_hash, bytes) or not chunk_hash:
        raise InvalidRequestError(
            f"blend segment {i}: chunk_hash must be bytes, got {chunk_hash!r}"
        )
    return BlendSegment(offset, chunk_size, chunk_hash, original)


def copy_segments(
    inst: Instance, segments: Sequence[BlendSegment], objs: Sequence[torch.Tensor],
    blocks: np.ndarray, chunk_size: int,
) -> None:  # fmt: skip
    """Write each segment's chunk object (`objs[i]`: its bytes in L1) into the prompt's
    slots, then turn K by offset - original_start; on a CUDA cache both run on the
    instance's kernel stream, which this waits for."""
    layout, bs = inst.layout, inst.block_size
    turns = []
    for s in segments:
        first, last = s.offset // bs, -(-(s.offset + s.length) // bs)
        turns.append(
            RerotateSegment(
                blocks[first:last], s.offset % bs, s.length, s.offset - s.original_start
            )
        )
    assert inst.ropes is not None
    plan = plan_rerotation(layout, inst.ropes, turns)  # every check before the first write
    cuda = layout.device.type == "cuda"
    stream = getattr(inst.mover, "kernel_stream", None) if cuda else None
    # CUDA: STAGE_SEGMENTS objects at a time into one staging tensor, written by one
    # batched scatter; CPU: each object in place (staging would only add a copy)
    batch = STAGE_SEGMENTS if cuda else 1
    for start in range(0, len(segments), batch):
        part = range(start, min(start + batch, len(segments)))
        slots = [
            token_slots(np.asarray(turns[i].block_ids), turns[i].start, segments[i].length, bs)
            for i in part
        ]
        blocks_at, offsets = (np.stack([s[k] for s in slots]) for k in (0, 1))
        with torch.cuda.stream(stream.torch) if stream is not None else contextlib.nullcontext():
            if cuda:
                chunks = torch.empty((len(part), objs[start].numel()), dtype=torch.uint8,
                                     device=layout.device)  # fmt: skip
                for row, i in enumerate(part):
                    chunks[row].copy_(objs[i], non_blocking=True)
            else:
                chunks = objs[start][None]
            scatter_tokens(layout, chunks, chunk_size, blocks_at, offsets)
    apply_rerotation(layout, plan, stream=stream)
    if stream is not None:
        stream.synchronize()
