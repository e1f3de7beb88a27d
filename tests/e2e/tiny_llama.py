"""A tiny Llama-architecture model with random weights, and its KV as kvflow moves it.

Nothing is downloaded: the model is built from a config with a fixed seed. KV is
handled as one tensor `[num_layers, 2, num_tokens, num_kv_heads, head_size]`
(token-major, like a vLLM block), converted to and from transformers' cache.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

#: Model shape: a few layers and grouped-query attention (4 query heads share 2 KV heads).
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_SIZE = 16
VOCAB_SIZE = 256

#: Gives the model for (dtype, device), e.g. a cached `build_model`.
ModelFor = Callable[[torch.dtype, str], LlamaForCausalLM]


def build_model(
    dtype: torch.dtype = torch.float32, *, seed: int = 0, device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """The tiny Llama in eval mode; the same seed always gives the same weights."""
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=NUM_HEADS * HEAD_SIZE,
        intermediate_size=2 * NUM_HEADS * HEAD_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_SIZE,
        max_position_embeddings=1024,
        attn_implementation="eager",
    )
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(device=device, dtype=dtype).eval()


@dataclass(frozen=True)
class Prefill:
    """What a prefill leaves behind: the KV of every token and the logits."""

    kv: torch.Tensor  # [num_layers, 2, num_tokens, num_kv_heads, head_size], contiguous
    logits: torch.Tensor  # [num_tokens, vocab]


def _with_past(model: LlamaForCausalLM, past: DynamicCache) -> dict[str, DynamicCache]:
    """The forward keyword for a KV cache: `cache` from transformers 5.24 (which
    deprecates `past_key_values`), `past_key_values` before."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: past}


def _returned_cache(out: Any) -> DynamicCache:
    """The cache a forward returned, under either name (see `_with_past`)."""
    cache: DynamicCache = out["cache"] if "cache" in out else out["past_key_values"]
    return cache


def prefill(model: LlamaForCausalLM, token_ids: torch.Tensor) -> Prefill:
    """Run `token_ids` (1-D) from scratch and collect the per-layer K/V the model cached."""
    with torch.no_grad():
        out = model(token_ids.unsqueeze(0).to(model.device), use_cache=True)
    cache = _returned_cache(out)
    kv = torch.stack(
        [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]
    )  # [NL, 2, NH, T, HS]
    return Prefill(kv=kv.transpose(2, 3).contiguous(), logits=out.logits[0])


def to_past_key_values(model: LlamaForCausalLM, kv: torch.Tensor) -> DynamicCache:
    """A transformers cache holding `kv` ([NL, 2, T, NH, HS]) as the model's past."""
    cache = DynamicCache(config=model.config)
    for layer in range(kv.shape[0]):
        keys = kv[layer, 0].transpose(0, 1).unsqueeze(0).contiguous()  # [1, NH, T, HS]
        values = kv[layer, 1].transpose(0, 1).unsqueeze(0).contiguous()
        cache.update(keys, values, layer)
    return cache


def continue_from(model: LlamaForCausalLM, kv: torch.Tensor, suffix: torch.Tensor) -> torch.Tensor:
    """Logits `[len(suffix), vocab]` of running `suffix` after a past whose KV is `kv`."""
    past = to_past_key_values(model, kv)
    with torch.no_grad():
        out = model(suffix.unsqueeze(0).to(model.device), **_with_past(model, past), use_cache=True)
    return out.logits[0]


def full_logits(model: LlamaForCausalLM, token_ids: torch.Tensor) -> torch.Tensor:
    """Logits `[len(token_ids), vocab]` of a full recompute, no cache involved."""
    with torch.no_grad():
        return model(token_ids.unsqueeze(0).to(model.device)).logits[0]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: a scale-aware error, robust to logits near 0."""
    diff = (actual.double() - expected.double()).abs().max()
    return float(diff / expected.double().abs().max())
