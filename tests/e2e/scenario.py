"""The end-to-end workload and its checks, shared by the CPU tests and the GPU script.

Request 1 (the prompt) is several chunks plus a partial one; request 2 shares the
prompt's full chunks and adds a suffix of its own. A reused KV passes when it is
bit-identical to the original, gives exactly the logits the original gives, and
matches a full recompute of request 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM

from tests.e2e.tiny_llama import VOCAB_SIZE, continue_from, full_logits, relative_error

#: kvflow's chunk (the server runs with --chunk-size CHUNK_SIZE) and the engine's block.
CHUNK_SIZE = 32
BLOCK_SIZE = 16
#: Blocks in each paged cache: room for both requests with random tables to spare.
NUM_BLOCKS = 40
#: Full chunks in the prompt, and the prompt's extra tokens that never fill a chunk.
PROMPT_CHUNKS = 4
PROMPT_TAIL = 9
SUFFIX_TOKENS = 16

#: How close the continuation from reused KV must be to a full recompute, per model dtype
#: (relative to the largest logit): fp32 1e-5 as specified; bf16 a few units of its epsilon
#: (2**-8), since a recompute may round differently from a cached past.
RECOMPUTE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


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
) -> None:
    """Check KV rebuilt from a paged cache against the prefill's, then as the model's past.

    `reused_kv` and `original_kv` are [NL, 2, shared, NH, HS]: the former read back through
    request 2's block table, the latter the prompt's prefill KV of the shared prefix.
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


def _first_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Where two [NL, 2, T, NH, HS] tensors first differ, for the failure message."""
    differs = actual != expected  # NaN (the wipe's poison) differs from everything
    if not differs.any():
        return "KV equal"
    layer, kv, token, head, _ = (int(i) for i in differs.nonzero()[0])
    which = "K" if kv == 0 else "V"
    return f"KV differ first at layer {layer} {which} token {token} head {head}"
