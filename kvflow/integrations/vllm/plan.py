"""What the scheduler side tells the workers each step: plain, picklable data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class LoadSpec:
    """Retrieve `token_ids`' chunks into `block_ids`, leaving the first `skip_tokens` alone."""

    req_id: str
    #: the prompt's tokens up to the end of the hit (whole chunks), int32
    token_ids: np.ndarray
    #: the request's blocks covering `token_ids`
    block_ids: list[int]
    #: tokens vLLM computed itself (a multiple of the block size): not loaded
    skip_tokens: int
    cache_salt: str | None = None
    #: vLLM's hashes of the blocks of `token_ids` (KV events on; else empty)
    block_hashes: list[Any] = field(default_factory=list)


@dataclass
class StoreSpec:
    """Store the full chunks of `token_ids` from `block_ids` after this step's forward pass."""

    req_id: str
    #: the prompt's full chunks to store, int32
    token_ids: np.ndarray
    block_ids: list[int]
    cache_salt: str | None = None
    #: vLLM's hashes of the blocks of `token_ids` (KV events on; else empty)
    block_hashes: list[Any] = field(default_factory=list)


@dataclass
class StepPlan:
    """One scheduler step's loads (before the forward pass), stores (after) and the block
    allocations to report (rank 0 reports them)."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    #: (req_id, new block ids, the tokens those blocks hold) per allocation
    allocations: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
