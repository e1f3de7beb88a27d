"""Checks of the engine's request arguments, run before any work (docs/ENGINE.md, Request bounds).

Each check raises InvalidRequestError naming the argument, the bound and the value; the
bounds are constants here (`MAX_WORLD_SIZE`, `MAX_REQUEST_TOKENS`), re-exported by
`kvflow.core.engine.cache_engine`.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvflow.core.engine.chunk_keys import check_chunk_keys, placeholder_tokens
from kvflow.core.errors import InvalidRequestError
from kvflow.events import BlockAllocation

#: Largest world_size a register, lookup or prefetch may name (rank < world_size).
MAX_WORLD_SIZE = 1024
#: Most tokens one lookup or prefetch may carry: checked before any hashing.
MAX_REQUEST_TOKENS = 1 << 22


def check_str(name: str, value: Any) -> str:
    """`value` when it is a non-empty string."""
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{name} must be a non-empty string, got {value!r}")
    return value


def check_salt(cache_salt: Any) -> str | None:
    """`cache_salt` when it is a string or None."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidRequestError(f"cache_salt must be a string or None, got {cache_salt!r}")
    return cache_salt


def check_bool(name: str, value: Any) -> bool:
    """`value` when it is a bool (not merely truthy)."""
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a bool, got {value!r}")
    return value


def check_world(world_size: Any, rank: Any = 0) -> None:
    """world_size in [1, MAX_WORLD_SIZE] and rank in [0, world_size), both plain ints."""
    if (
        isinstance(world_size, bool)
        or not isinstance(world_size, int)
        or not 1 <= world_size <= MAX_WORLD_SIZE
    ):
        raise InvalidRequestError(
            f"world_size must be an integer in [1, {MAX_WORLD_SIZE}] (MAX_WORLD_SIZE), "
            f"got {world_size!r}"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidRequestError(f"rank must be an integer in [0, {world_size}), got {rank!r}")


def check_owner(world_size: int | None, rank: int | None) -> None:
    """A KV-event subscription's owner filter (None: any): world_size in [1,
    MAX_WORLD_SIZE] and rank in [0, world_size) when given, as an engine's could be."""
    if world_size is not None or rank is not None:
        check_world(
            MAX_WORLD_SIZE if world_size is None else world_size, 0 if rank is None else rank
        )


def check_ranks(ranks: Any, world_size: int) -> Sequence[int]:
    """The ranks a lookup counts: all of the world's (None), or a non-empty list of
    distinct ranks in [0, world_size), in ascending order (a longer list is refused
    before its items are read)."""
    if ranks is None:
        return range(world_size)
    if (
        not isinstance(ranks, (list, tuple))
        or not 0 < len(ranks) <= world_size
        or any(isinstance(r, bool) or not isinstance(r, int) for r in ranks)
        or len(set(ranks)) != len(ranks)
        or not all(0 <= r < world_size for r in ranks)
    ):
        raise InvalidRequestError(
            f"ranks must be a non-empty list of distinct ranks in [0, {world_size})"
            f" (world_size {world_size}), got {reprlib.repr(ranks)}"
        )
    return sorted(ranks)


def requested_tokens(token_ids: Any) -> int:
    """The request's token count for START events (0 when it has no length: refused later)."""
    return len(token_ids) if hasattr(token_ids, "__len__") else 0


def check_tokens(token_ids: Any) -> None:
    """A lookup's or prefetch's token count against MAX_REQUEST_TOKENS, before any work."""
    n = requested_tokens(token_ids)
    if n > MAX_REQUEST_TOKENS:
        raise InvalidRequestError(
            f"token_ids holds {n} tokens, more than the {MAX_REQUEST_TOKENS} "
            "(MAX_REQUEST_TOKENS) a request may carry"
        )


def keyed(token_ids: Any, chunk_keys: Any, chunk_size: int) -> tuple[Any, list[bytes] | None]:
    """(token ids, None) for a request by tokens; for one by `chunk_keys`, placeholder
    token ids (one whole chunk per key) and the checked keys."""
    if chunk_keys is None:
        return token_ids, None
    if token_ids is not None:
        raise InvalidRequestError("give token_ids or chunk_keys, not both")
    keys = check_chunk_keys(chunk_keys, chunk_size, MAX_REQUEST_TOKENS)
    return placeholder_tokens(len(keys), chunk_size), keys


def check_skip(skip: Any, block_size: int, instance_id: str) -> int:
    """A retrieve's skip_first_n_tokens: an int >= 0, a multiple of the block size."""
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise InvalidRequestError(f"skip_first_n_tokens must be an integer >= 0, got {skip!r}")
    if skip % block_size:
        raise InvalidRequestError(
            f"skip_first_n_tokens ({skip}) must be a multiple of the block_size "
            f"({block_size}) of instance {instance_id!r}"
        )
    return skip


def check_ids(values: Any, what: str, limit: int | None = None) -> int:
    """len(values) after checking they are integers (in [0, limit) when given)."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        raise InvalidRequestError(f"{what} must be a flat sequence of integers") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidRequestError(f"{what} must be a flat sequence of integers")
    if limit is not None and arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= limit:
            raise InvalidRequestError(
                f"{what} holds block id {lo if lo < 0 else hi}, which does not exist: the "
                f"instance's cache has {limit} blocks (valid ids 0..{limit - 1})"
            )
    return int(arr.size)


def check_allocations(
    records: Any, num_blocks: int, block_size: int
) -> tuple[BlockAllocation, ...]:
    """An allocation report's records as BlockAllocations, every one checked first: block
    ids in [0, num_blocks), tokens within the record's blocks; the first bad record is
    an InvalidRequestError naming it (`records[i] (req_id 'q')`)."""
    if isinstance(records, (str, bytes)) or not isinstance(records, Sequence):
        raise InvalidRequestError(
            f"records must be a sequence of BlockAllocation, got {type(records).__name__}"
        )
    checked: list[BlockAllocation] = []
    for i, rec in enumerate(records):
        if not isinstance(rec, Sequence) or len(rec) != 3:
            raise InvalidRequestError(
                f"records[{i}] must be BlockAllocation(req_id, new_block_ids, new_token_ids)"
            )
        req_id, block_ids, token_ids = rec
        if not isinstance(req_id, str) or not req_id:
            raise InvalidRequestError(f"records[{i}].req_id must be a non-empty string")
        for name, seq in (("new_block_ids", block_ids), ("new_token_ids", token_ids)):
            if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
                raise InvalidRequestError(f"records[{i}].{name} must be a sequence of ints")
        where = f"records[{i}] (req_id {req_id!r})"
        n_blocks = check_ids(block_ids, f"{where}.new_block_ids", num_blocks)
        n_tokens = check_ids(token_ids, f"{where}.new_token_ids")
        if n_tokens > n_blocks * block_size:
            raise InvalidRequestError(
                f"{where} holds {n_tokens} tokens in {n_blocks} blocks of "
                f"{block_size} tokens (at most {n_blocks * block_size} fit)"
            )
        checked.append(rec if isinstance(rec, BlockAllocation) else BlockAllocation(*rec))
    return tuple(checked)


def check_waits(waits_s: Any, num_layers: int) -> list[float]:
    """A layerwise retrieve's per-layer waits: at most one per layer, each a finite
    number of seconds >= 0."""
    if isinstance(waits_s, (str, bytes)) or not isinstance(waits_s, Sequence):
        raise InvalidRequestError("waits_s must be a sequence of seconds, one per layer")
    if len(waits_s) > num_layers:
        raise InvalidRequestError(f"waits_s has {len(waits_s)} entries for {num_layers} layers")
    waits = []
    for i, w in enumerate(waits_s):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf:
            raise InvalidRequestError(f"waits_s[{i}] must be seconds >= 0, got {w!r}")
        waits.append(float(w))
    return waits
