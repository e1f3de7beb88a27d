"""CacheBlend's selective recompute on a Llama-family transformers model (docs/E2E.md, "Blend").

After a blend retrieve, a prompt's KV holds three kinds of tokens: the prefix (exact:
the same tokens at the same positions after the same context), blended segments (each
chunk's KV as it was stored, K turned to its new position: exact in layer 0, but deeper
layers reflect the chunk's original context) and tokens nothing covered (the question,
a document's tail shorter than a chunk). `selective_prefill` repairs it as CacheBlend
does, layer by layer:

- layers below `check_layer` are computed for every token past the prefix (the fresh
  K/V of layer `check_layer` needs them);
- at `check_layer` every such token's fresh K/V is computed and compared with the
  blended one; the recompute set is then every token nothing covered, the first
  `first_k` tokens of each blended run (adjacent segments stored adjacently: a
  document) and the `fraction` of the segment tokens whose K/V deviates most;
- from `check_layer` on only the recompute set advances: its queries attend, by
  position, over the prefix, the blended KV of the tokens left alone (at `check_layer`
  itself their fresh K/V, computed anyway) and their own fresh KV, which overwrites
  the blended KV in every layer;
- the last token's logits come out of the same pass (it is always recomputed).

With `fraction` 1.0 every token past the prefix is recomputed in every layer, with the
same operations a prefill continuing the prefix runs: the logits equal a full prefill's.

The model is driven one decoder layer at a time through its own modules (attention,
MLP, norms, rotary embedding); only `_fresh_kv` reads the attention's projections and
assumes Llama's (k_proj, v_proj, RoPE; Llama, Mistral, Qwen2). Attention must be
"eager" or "sdpa" (the others take no custom mask).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvflow.core.engine.blend_index import BlendSegment
from kvflow.kernels.rope_params import LinearScaling, Llama3Scaling, RopeParams


@dataclass(frozen=True)
class Documents:
    """Token ids (int64, 1-D) of a system prompt, two documents and a question."""

    system: torch.Tensor
    doc_a: torch.Tensor
    doc_b: torch.Tensor
    question: torch.Tensor

    @property
    def stored(self) -> torch.Tensor:
        """What the first request prefilled and stored: system, A, B."""
        return torch.cat([self.system, self.doc_a, self.doc_b])

    @property
    def prompt(self) -> torch.Tensor:
        """The new prompt: system, B, A, question."""
        return torch.cat([self.system, self.doc_b, self.doc_a, self.question])


def rope_params(config: PretrainedConfig) -> RopeParams:
    """The model's RoPE as kvflow registers it: transformers rotates the first
    head_dim * partial_rotary_factor dims with rotate_half (neox pairing); "default",
    "linear" and "llama3" rope types (`rope_parameters` from transformers 5, else
    `rope_theta` and `rope_scaling`)."""
    params = getattr(config, "rope_parameters", None) or {
        "rope_theta": config.rope_theta,
        **(getattr(config, "rope_scaling", None) or {}),
    }
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    kind = params.get("rope_type", params.get("type", "default"))
    scaling: LinearScaling | Llama3Scaling | None = None
    if kind == "linear":
        scaling = LinearScaling(params["factor"])
    elif kind == "llama3":
        scaling = Llama3Scaling(
            params["factor"],
            params["low_freq_factor"],
            params["high_freq_factor"],
            params["original_max_position_embeddings"],
        )
    elif kind != "default":
        raise ValueError(f"rope_type {kind!r} is not one kvflow can turn K for (docs/BLEND.md)")
    return RopeParams(rotary_dim, theta=float(params["rope_theta"]), scaling=scaling)


def blended_runs(segments: Sequence[BlendSegment]) -> list[tuple[int, int]]:
    """[start, end) prompt positions of the blended runs: adjacent segments that were
    adjacent where they were stored merge into one run (a document's chunks)."""
    runs: list[tuple[int, int]] = []
    origin = -1  # where the last run's next token was stored
    for s in sorted(segments, key=lambda s: s.offset):
        if runs and runs[-1][1] == s.offset and origin == s.original_start:
            runs[-1] = (runs[-1][0], s.offset + s.length)
        else:
            runs.append((s.offset, s.offset + s.length))
        origin = s.original_start + s.length
    return runs


@dataclass(frozen=True)
class Recomputed:
    """What a selective prefill gives: the last token's logits, the prompt's KV (the
    tensor it was given) with the recomputed tokens' KV written over the blended one, and
    which tokens were recomputed from `check_layer` on (below it every token past the
    prefix is)."""

    logits: torch.Tensor  # [vocab]
    kv: torch.Tensor  # [num_layers, 2, num_tokens, num_kv_heads, head_size]
    recomputed: torch.Tensor  # bool [num_tokens]

    @property
    def num_recomputed(self) -> int:
        return int(self.recomputed.sum())


def forced_tokens(
    num_tokens: int, prefix: int, runs: Sequence[tuple[int, int]], first_k: int
) -> torch.Tensor:
    """bool [num_tokens]: the tokens always recomputed: every token past the prefix that
    no run covers (the question, uncovered tails), the first `first_k` of each run and
    the last token (its logits are the pass's result)."""
    forced = torch.ones(num_tokens, dtype=torch.bool)
    forced[:prefix] = False
    for start, end in runs:
        forced[min(start + first_k, end) : end] = False
    forced[-1] = True
    return forced


def kv_deviation(fresh: torch.Tensor, blended: torch.Tensor) -> torch.Tensor:
    """Per token, the squared distance between two [2, T, NH, HS] K/V tensors (float32)."""
    return (fresh.float() - blended.float()).square().sum(dim=(0, 2, 3))


def choose(
    deviation: torch.Tensor,
    runs: Sequence[tuple[int, int]],
    forced: torch.Tensor,
    fraction: float,
) -> torch.Tensor:
    """bool [T]: the forced tokens plus ceil(fraction x the runs' tokens) others of the
    runs, those with the largest `deviation` ([T]; only run tokens are ranked)."""
    in_runs = torch.zeros_like(forced)
    for start, end in runs:
        in_runs[start:end] = True
    candidates = (in_runs & ~forced).nonzero().flatten()
    wanted = min(math.ceil(fraction * int(in_runs.sum())), len(candidates))
    chosen = forced.clone()
    if wanted:
        top = deviation[candidates].topk(wanted).indices
        chosen[candidates[top]] = True
    return chosen


def selective_prefill(
    model: Any,
    token_ids: torch.Tensor,
    kv: torch.Tensor,
    prefix: int,
    segments: Sequence[BlendSegment],
    *,
    fraction: float,
    first_k: int = 4,
    check_layer: int = 1,
) -> Recomputed:
    """CacheBlend's selective recompute of a blended prompt (module docstring).

    `kv` [NL, 2, T, NH, HS] on the model's device is the prompt's KV as the cache holds
    it after retrieve and blend retrieve: exact below `prefix`, `segments` blended,
    anything elsewhere (NaN after a wipe) is never read. The recomputed tokens' KV is
    written over it in place, as an engine writes it into its blocks.
    """
    if not 0.0 <= fraction <= 1.0 or first_k < 0 or not 0 <= check_layer < kv.shape[0]:
        raise ValueError(f"fraction in [0, 1], first_k >= 0, 0 <= check_layer < {kv.shape[0]}")
    if prefix >= len(token_ids):
        raise ValueError(f"the {prefix}-token prefix leaves nothing of the prompt to prefill")
    runs = blended_runs(segments)
    num_tokens, device = len(token_ids), kv.device
    chosen = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    chosen[prefix:] = True
    with torch.no_grad():
        hidden = model.model.embed_tokens(token_ids[prefix:].to(device).unsqueeze(0))
        step = _Pass.of(model, chosen, hidden)
        for index, layer in enumerate(model.model.layers):
            if index == check_layer:
                fresh = _fresh_kv(layer, hidden, step.rope)
                deviation = torch.zeros(num_tokens, device=device)
                deviation[step.queries] = kv_deviation(fresh, kv[index, :, step.queries])
                forced = forced_tokens(num_tokens, prefix, runs, first_k).to(device)
                chosen = choose(deviation, runs, forced, fraction)
                kv[index, :, step.queries] = fresh  # computed anyway: the left-alone get it too
                hidden = hidden[:, chosen[step.queries]]
                step = _Pass.of(model, chosen, hidden)
            hidden, kv[index, :, step.queries] = step.run(model, index, layer, hidden, kv)
        # the last token's logits alone, as a prefill with logits_to_keep=1 computes them
        logits = model.lm_head(model.model.norm(hidden[:, -1:]))[0, -1]
    return Recomputed(logits=logits, kv=kv, recomputed=chosen.cpu())


def _fresh_kv(
    layer: Any, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """K/V [2, n, NH, HS] that `layer` computes for `hidden` ([1, n, hidden]) with the
    rotary `rope` (cos, sin) of their positions: its input norm, K and V projections and
    RoPE (Llama's attention)."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    keys = attn.k_proj(x).view(shape).transpose(1, 2)
    values = attn.v_proj(x).view(shape).transpose(1, 2)
    _, keys = apply_rotary_pos_emb(keys, keys, *rope)
    return torch.stack([keys[0], values[0]]).transpose(1, 2)


@dataclass(frozen=True)
class _Pass:
    """What a run of layers computing the same tokens shares, made once for all of them
    (no host sync per layer): the positions computed (`queries`), those only attended to
    (`others`: every other token before the last query), the mask and the rotary cos/sin."""

    queries: torch.Tensor
    others: torch.Tensor
    mask: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def of(cls, model: Any, computed: torch.Tensor, hidden: torch.Tensor) -> _Pass:
        """The pass computing the tokens `computed` (bool [T]) marks; `hidden` their input."""
        queries = computed.nonzero().flatten()
        others = (~computed[: int(queries[-1]) + 1]).nonzero().flatten()
        mask = _position_mask(queries, torch.cat([others, queries]), model, hidden.dtype)
        return cls(queries, others, mask, model.model.rotary_emb(hidden, queries.unsqueeze(0)))

    def run(
        self, model: Any, index: int, layer: Any, hidden: torch.Tensor, kv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer `index` for the queries (`hidden` [1, n, hidden] in), attending by
        position over the layer's KV of the others (`kv`) and their own fresh KV. Returns
        their output hidden states and that fresh KV [2, n, NH, HS]."""
        cache = DynamicCache(config=model.config)
        past = kv[index, :, self.others].transpose(1, 2).unsqueeze(1)  # [2, 1, NH, n, HS]
        cache.update(past[0], past[1], index)
        out = layer(
            hidden,
            attention_mask=self.mask,
            position_ids=self.queries.unsqueeze(0),
            position_embeddings=self.rope,
            use_cache=True,
            **{_cache_keyword(type(layer)): cache},
        )
        hidden = out[0] if isinstance(out, tuple) else out
        cached = cache.layers[index]
        fresh = torch.stack([cached.keys[0], cached.values[0]])[:, :, len(self.others) :]
        return hidden, fresh.transpose(1, 2)


def _position_mask(
    queries: torch.Tensor, keys: torch.Tensor, model: Any, dtype: torch.dtype
) -> torch.Tensor:
    """[1, 1, n_queries, n_keys]: a query sees the keys at its position or before, in the
    form the model's attention takes (sdpa: bool; eager: 0 or the dtype's minimum added,
    the values of transformers' own causal mask)."""
    allowed = keys.unsqueeze(0) <= queries.unsqueeze(1)
    kind = model.config._attn_implementation
    if kind == "sdpa":
        return allowed[None, None]
    if kind != "eager":
        raise ValueError(f"attention {kind!r} takes no custom mask: use eager or sdpa")
    zero = torch.tensor(0.0, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


@functools.cache
def _cache_keyword(layer_class: type) -> str:
    """A decoder layer's keyword for its KV cache: `cache` from transformers 5.24,
    `past_key_values` before (looked up once per class: it is inside timed prefills)."""
    params = inspect.signature(layer_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
