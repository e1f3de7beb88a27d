"""The end-to-end scenario for a tensor-parallel engine: the KV heads split over ranks.

A world of ranks (rank r on `devices[r]`, each its own instance with its own client, as
each rank is its own process) registers with one kvflow server under one model name.
The prompt's prefill KV (the whole model, on one device) is split by heads; each rank
writes its share into its own paged cache and stores it, and the prefix is a hit only
once every rank stored it. Then a fresh world (new instances, caches and block table;
the first world gone) retrieves it, the shares are merged back into the model's
full-head KV, and `assert_reuse_matches` checks bytes, logits and a recompute.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM

from kvflow.core import KVFlowClient
from tests.e2e import paged_kv
from tests.e2e.scenario import (
    BLOCK_SIZE,
    CHUNK_SIZE,
    NUM_BLOCKS,
    PROMPT_CHUNKS,
    EngineWorker,
    Requests,
    ReuseResult,
    assert_reuse_matches,
)
from tests.e2e.tiny_llama import prefill
from tests.e2e.tp_heads import merge_heads, split_heads

_world_numbers = itertools.count()


def tp_model_name(layout: str, dtype: torch.dtype, world_size: int) -> str:
    """A model name for one world's scenario, unique in a server's life (like EngineWorker's)."""
    dtype_name = str(dtype).removeprefix("torch.")
    number = next(_world_numbers)
    return f"tiny-llama-tp{world_size}-{layout}-{dtype_name}-{os.getpid()}-{number}"


@contextlib.contextmanager
def open_ranks(
    endpoint: str,
    layout: str,
    dtype: torch.dtype,
    devices: Sequence[torch.device],
    model_name: str,
) -> Iterator[list[EngineWorker]]:
    """One registered EngineWorker per rank (rank r on devices[r], its own client);
    every rank unregisters and closes its client when the block exits."""
    with contextlib.ExitStack() as stack:
        ranks = []
        for rank, device in enumerate(devices):
            client = stack.enter_context(KVFlowClient(endpoint, timeout_s=60.0))
            worker = EngineWorker(
                client,
                layout,
                dtype,
                device,
                model_name=model_name,
                world_size=len(devices),
                rank=rank,
            )
            ranks.append(stack.enter_context(worker))
        yield ranks


def _wait_for_engine_writes(device: torch.device) -> None:
    """Block until the engine's queued writes on `device` are done (nothing to wait for on
    CPU): the server's copies into a cache are not ordered after them otherwise."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass(frozen=True)
class StoredPrefix:
    """What the first world left in the server, and what the checks compare with."""

    original: torch.Tensor  # the prompt's prefill KV of the shared prefix, all heads
    block_table: torch.Tensor  # the blocks every rank wrote the prompt to
    store_s: float  # wall time of the ranks' store calls, one after the other


def store_split(
    ranks: Sequence[EngineWorker], model: LlamaForCausalLM, requests: Requests, *, seed: int
) -> StoredPrefix:
    """Prefill the prompt, give each rank its heads at one block table, store rank by rank.

    A lookup between the stores finds nothing (not every rank has the prefix yet); after
    the last store it finds the shared chunks of request 2.
    """
    world_size = len(ranks)
    model_name = ranks[0].model_name
    scheduler = ranks[0].client  # lookups are the scheduler's, not a rank's
    first = prefill(model, requests.prompt)
    # One block table for all ranks, as a tensor-parallel engine's scheduler gives them.
    gen = torch.Generator().manual_seed(seed)
    table = paged_kv.random_block_table(NUM_BLOCKS, len(requests.prompt), BLOCK_SIZE, gen)
    for worker, share in zip(ranks, split_heads(first.kv, world_size), strict=True):
        paged_kv.write_kv(worker.caches, worker.layout, share, table)

    store_s = 0.0
    for rank, worker in enumerate(ranks):
        started = time.perf_counter()
        stored = worker.client.store(worker.instance_id, requests.prompt, table, request_id="req-1")
        store_s += time.perf_counter() - started
        assert stored == PROMPT_CHUNKS * CHUNK_SIZE, f"rank {rank} stored {stored} tokens"
        if rank < world_size - 1:
            hit = scheduler.lookup(requests.second, model_name=model_name, world_size=world_size)
            assert hit == 0, f"lookup hit {hit} tokens with ranks 0..{rank} of {world_size} stored"
    scheduler.end_session("req-1")

    # Every rank has the prefix now: request 2 hits its shared chunks, a request diverging
    # inside chunk 3 its first three, and neither another model nor another world size
    # (chunks are keyed by world size and rank) hits at all.
    hit = scheduler.lookup(requests.second, model_name=model_name, world_size=world_size)
    assert hit == requests.shared, f"lookup after every rank stored: {hit} tokens"
    diverging = requests.prompt.clone()
    diverging[3 * CHUNK_SIZE + 5] += 1
    hit = scheduler.lookup(diverging, model_name=model_name, world_size=world_size)
    assert hit == 3 * CHUNK_SIZE
    assert (
        scheduler.lookup(requests.second, model_name=f"{model_name}-other", world_size=world_size)
        == 0
    )
    assert scheduler.lookup(requests.second, model_name=model_name, world_size=1) == 0
    original = first.kv[:, :, : requests.shared].contiguous()
    return StoredPrefix(original, table, store_s)


def retrieve_merged(
    ranks: Sequence[EngineWorker],
    model: LlamaForCausalLM,
    requests: Requests,
    stored: StoredPrefix,
    *,
    seed: int,
) -> ReuseResult:
    """Retrieve request 2's prefix into every rank's blocks (a fresh world), merge the
    ranks' heads into the model's past, continue request 2 and check it all."""
    gen = torch.Generator().manual_seed(seed + 1)
    table = paged_kv.random_block_table(NUM_BLOCKS, len(requests.second), BLOCK_SIZE, gen)
    assert not torch.equal(table[: len(stored.block_table)], stored.block_table)
    # The ranks' caches were wiped with NaN at registration; that is done before kvflow writes.
    for worker in ranks:
        _wait_for_engine_writes(worker.device)

    retrieve_s = 0.0
    for rank, worker in enumerate(ranks):
        started = time.perf_counter()
        hit = worker.client.retrieve(worker.instance_id, requests.second, table, request_id="req-2")
        retrieve_s += time.perf_counter() - started
        assert hit == requests.shared, f"rank {rank} retrieved {hit} tokens"

    # Each rank's retrieve wrote the prefix's blocks and nothing else.
    prefix_blocks = table[: requests.shared // BLOCK_SIZE].tolist()
    untouched = [b for b in range(NUM_BLOCKS) if b not in prefix_blocks]
    for rank, worker in enumerate(ranks):
        outside = paged_kv.read_blocks(worker.caches, worker.layout, untouched)
        assert outside.isnan().all(), f"rank {rank}'s retrieve wrote outside the prefix"

    shares = [paged_kv.read_kv(w.caches, w.layout, requests.shared, table) for w in ranks]
    reused = merge_heads(shares, model.device)
    err = assert_reuse_matches(model, reused, stored.original, requests)
    ranks[0].client.end_session("req-2")
    return ReuseResult(err, stored.store_s, retrieve_s, ranks[0].chunk_bytes)
