"""The end-to-end scenario, shared by the CPU tests and the GPU script.

Request 1 (the prompt) is several chunks plus a partial one; request 2 shares the
prompt's full chunks and adds a suffix of its own. An engine worker stores
request 1's KV through kvflow, loses its blocks, and retrieves the prefix for
request 2 into other blocks. The reused KV passes when it is bit-identical to the
original, gives exactly the logits the original gives, and matches a full
recompute of request 2.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM

from kvflow.core import KVFlowClient, empty_shared
from tests.e2e import paged_kv
from tests.e2e.tiny_llama import (
    HEAD_SIZE,
    NUM_KV_HEADS,
    NUM_LAYERS,
    VOCAB_SIZE,
    continue_from,
    full_logits,
    prefill,
    relative_error,
)

#: kvflow's chunk (the server runs with --chunk-size CHUNK_SIZE) and the engine's block.
CHUNK_SIZE = 32
BLOCK_SIZE = 16
#: Blocks in each paged cache: room for both requests with random tables to spare.
NUM_BLOCKS = 40
#: Full chunks in the prompt, and the prompt's extra tokens that never fill a chunk.
PROMPT_CHUNKS = 4
PROMPT_TAIL = 9
SUFFIX_TOKENS = 16
#: What the engine's own prefix cache is marked with in blocks retrieve must skip.
SENTINEL = -7.0

#: How close the continuation from reused KV must be to a full recompute, per model dtype
#: (relative to the largest logit): fp32 1e-5 as specified; bf16 a few units of its epsilon
#: (2**-8), since a recompute may round differently from a cached past.
RECOMPUTE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}

_worker_numbers = itertools.count()


@dataclass(frozen=True)
class Requests:
    """Token ids (int64, 1-D) of the two requests and the length of their shared prefix."""

    prompt: torch.Tensor
    second: torch.Tensor
    shared: int


def make_requests(seed: int = 1) -> Requests:
    """The prompt and a second request sharing its full chunks; the same seed, the same ids."""
    gen = torch.Generator().manual_seed(seed)
    shared = PROMPT_CHUNKS * CHUNK_SIZE
    prompt = torch.randint(0, VOCAB_SIZE, (shared + PROMPT_TAIL,), generator=gen)
    suffix = torch.randint(0, VOCAB_SIZE, (SUFFIX_TOKENS,), generator=gen)
    # The suffix must differ from the prompt's tail at once, or more than the prefix is shared.
    suffix[0] = (prompt[shared] + 1) % VOCAB_SIZE
    return Requests(prompt=prompt, second=torch.cat([prompt[:shared], suffix]), shared=shared)


def assert_reuse_matches(
    model: LlamaForCausalLM,
    reused_kv: torch.Tensor,
    original_kv: torch.Tensor,
    requests: Requests,
) -> float:
    """Check KV rebuilt from a paged cache against the prefill's, then as the model's past.

    `reused_kv` and `original_kv` are [NL, 2, shared, NH, HS]: the former read back through
    request 2's block table, the latter the prompt's prefill KV of the shared prefix.
    Returns the continuation's error relative to a full recompute.
    """
    # Bytes first: a block copied to the wrong place, or a token moved inside its block, is
    # invisible to attention (K and V move together), so only this check sees it.
    assert reused_kv.dtype == original_kv.dtype
    assert torch.equal(reused_kv, original_kv), _first_mismatch(reused_kv, original_kv)

    # The model continues request 2 from each past: identical bytes give identical logits.
    suffix = requests.second[requests.shared :]
    reused_logits = continue_from(model, reused_kv, suffix)
    original_logits = continue_from(model, original_kv, suffix)
    assert torch.equal(reused_logits, original_logits)
    assert not torch.isnan(reused_logits).any()

    # And the continuation is the one a full recompute of request 2 gives.
    recomputed = full_logits(model, requests.second)[requests.shared :]
    err = relative_error(reused_logits, recomputed)
    rtol = RECOMPUTE_RTOL[model.dtype]
    assert err <= rtol, f"continuation differs from a full recompute: {err:.3g} > {rtol:g}"
    return err


def _first_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Where two [NL, 2, T, NH, HS] tensors first differ, for the failure message."""
    differs = actual != expected  # NaN (the wipe's poison) differs from everything
    if not differs.any():
        return "KV equal"
    layer, kv, token, head, _ = (int(i) for i in differs.nonzero()[0])
    which = "K" if kv == 0 else "V"
    return f"KV differ first at layer {layer} {which} token {token} head {head}"


class EngineWorker:
    """One engine worker registered with a kvflow server: its paged caches and its names.

    CPU caches live in POSIX shared memory, CUDA caches are shared by CUDA IPC. A model
    name per worker (unique in a server's life) keeps each scenario's chunks to itself:
    nothing stored by an earlier scenario can stand in for this one's store. A rank of a
    tensor-parallel engine (`world_size` > 1) holds its share of the KV heads and is
    given the model name its world shares.
    """

    def __init__(
        self,
        client: KVFlowClient,
        layout: str,
        dtype: torch.dtype,
        device: torch.device,
        *,
        model_name: str | None = None,
        world_size: int = 1,
        rank: int = 0,
    ) -> None:
        if NUM_KV_HEADS % world_size or not 0 <= rank < world_size:
            raise ValueError(
                f"rank {rank} of world_size {world_size}: the world size must divide "
                f"the model's {NUM_KV_HEADS} KV heads and the rank be below it"
            )
        number = next(_worker_numbers)
        tag = f"{layout}-{str(dtype).removeprefix('torch.')}-{device.type}-{os.getpid()}-{number}"
        self.client = client
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.instance_id = f"e2e-{tag}" if world_size == 1 else f"e2e-{tag}-rank{rank}"
        self.model_name = model_name or f"tiny-llama-{tag}"
        self.num_heads = NUM_KV_HEADS // world_size

        def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if device.type == "cpu":
                return empty_shared(shape, dtype)
            return torch.empty(shape, dtype=dtype, device=device)

        self.caches = paged_kv.allocate(
            layout,
            num_layers=NUM_LAYERS,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            num_heads=self.num_heads,
            head_size=HEAD_SIZE,
            dtype=dtype,
            empty=empty,
        )
        paged_kv.fill(self.caches, float("nan"))
        client.register_kv_caches(
            self.instance_id,
            self.caches,
            model_name=self.model_name,
            world_size=world_size,
            rank=rank,
        )

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk of this worker's KV (its heads only)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return NUM_LAYERS * 2 * CHUNK_SIZE * self.num_heads * HEAD_SIZE * element

    def close(self) -> None:
        """Unregister from the server."""
        self.client.unregister(self.instance_id)

    def __enter__(self) -> EngineWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ReuseResult:
    """What one run of the scenario measured (the checks themselves assert)."""

    recompute_error: float  # continuation vs full recompute, relative to the largest logit
    store_s: float  # wall time of the store call (client side)
    retrieve_s: float  # wall time of the retrieve call (client side; CUDA: until queued)
    chunk_bytes: int  # bytes of one chunk of this worker's KV


def run_reuse(
    worker: EngineWorker,
    model: LlamaForCausalLM,
    requests: Requests,
    *,
    seed: int,
    skip_blocks: int = 0,
) -> ReuseResult:
    """Store request 1, wipe, retrieve request 2's prefix into other blocks, continue; check all.

    With `skip_blocks`, request 2's first blocks stand for the engine's own prefix cache:
    retrieve is told to skip them and must leave them as they were.
    """
    client, layout, caches = worker.client, worker.layout, worker.caches
    gen = torch.Generator().manual_seed(seed)

    # Request 1: prefill a prompt of full chunks and a tail; write its KV at a random table.
    first = prefill(model, requests.prompt)
    table1 = paged_kv.random_block_table(NUM_BLOCKS, len(requests.prompt), BLOCK_SIZE, gen)
    paged_kv.write_kv(caches, layout, first.kv, table1)

    # Store it: only full chunks are kept, the tail stays with the engine.
    started = time.perf_counter()
    stored = client.store(worker.instance_id, requests.prompt, table1, request_id="req-1")
    store_s = time.perf_counter() - started
    assert stored == PROMPT_CHUNKS * CHUNK_SIZE
    client.end_session("req-1")

    # The engine loses every block: poison the whole cache.
    paged_kv.fill(caches, float("nan"))

    # Lookup reports request 2's shared chunks; a request diverging inside chunk 3 gets its
    # first three chunks only, and another model gets nothing.
    assert client.lookup(requests.second, model_name=worker.model_name) == requests.shared
    diverging = requests.prompt.clone()
    diverging[3 * CHUNK_SIZE + 5] += 1
    assert client.lookup(diverging, model_name=worker.model_name) == 3 * CHUNK_SIZE
    assert client.lookup(requests.second, model_name=f"{worker.model_name}-other") == 0

    # Request 2 gets a different random block table; its first `skip_blocks` blocks hold the
    # engine's own copy of those tokens, marked with a sentinel retrieve must not overwrite.
    table2 = paged_kv.random_block_table(NUM_BLOCKS, len(requests.second), BLOCK_SIZE, gen)
    assert not torch.equal(table2[: len(table1)], table1)
    skipped = table2[:skip_blocks].tolist()
    if skipped:
        for layer in range(NUM_LAYERS):
            paged_kv.layer_view(caches, layout, layer)[:, skipped] = SENTINEL
    # The engine's own writes to its blocks are done before kvflow writes into them.
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)

    started = time.perf_counter()
    hit = client.retrieve(
        worker.instance_id,
        requests.second,
        table2,
        request_id="req-2",
        skip_first_n_tokens=skip_blocks * BLOCK_SIZE,
    )
    retrieve_s = time.perf_counter() - started
    # The result is the whole hit prefix, skipped tokens included (they are valid too).
    assert hit == requests.shared

    # Retrieve wrote the prefix's blocks past the skipped ones and nothing else.
    prefix_blocks = table2[: requests.shared // BLOCK_SIZE].tolist()
    untouched = [b for b in range(NUM_BLOCKS) if b not in prefix_blocks]
    assert paged_kv.read_blocks(caches, layout, untouched).isnan().all()
    if skipped:
        assert (paged_kv.read_blocks(caches, layout, skipped) == SENTINEL).all()

    # Put the engine's own copy in the skipped blocks, then rebuild the model's past from
    # table2 and continue request 2.
    original = first.kv[:, :, : requests.shared].contiguous()
    skip_tokens = skip_blocks * BLOCK_SIZE
    paged_kv.write_kv(caches, layout, original[:, :, :skip_tokens], table2)
    reused = paged_kv.read_kv(caches, layout, requests.shared, table2)
    err = assert_reuse_matches(model, reused, original, requests)
    client.end_session("req-2")

    return ReuseResult(err, store_s, retrieve_s, worker.chunk_bytes)
