"""Rotary re-rotation of cached K for blend: K stored at position p becomes K at q.

RoPE turns each pair of K's rotary dims by the angle position * inv_freq[i], so
R(q) k = R(q - p) R(p) k: turning cached K by delta = q - p gives the K the model computes
at q. Only K's rotary slice changes; V and every other dim keep their bytes. Parameters
follow the Hugging Face transformers definitions (docs/KERNELS.md, "Rotary re-rotation").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from kvflow.kernels.layout import KVLayout
from kvflow.kernels.rope_params import (
    LayerRopes,
    Pairing,
    RerotateSegment,
    RerotationPlan,
    RopeParams,
    check_index,
    rotation_table,
)

if TYPE_CHECKING:
    from kvflow.kernels.streams import TransferStream

#: cache dtypes re-rotation accepts (a quantised K would need its scales)
ROPE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
#: positions are int32 in every engine; so are deltas
MAX_DELTA = 2**31 - 1

Backend = Literal["auto", "cuda", "cpu"]


def plan_rerotation(
    layout: KVLayout,
    ropes: RopeParams | LayerRopes,
    segments: Sequence[RerotateSegment],
    *,
    layers: Sequence[int] | None = None,
) -> RerotationPlan:
    """Check a re-rotation against the layout and turn it into a plan (ValueError naming
    the layer or segment on bad input). `layers`: the layers to turn (default: all)."""
    if isinstance(ropes, RopeParams):
        ropes = LayerRopes.uniform(ropes, layout.num_layers)
    elif not isinstance(ropes, LayerRopes):
        raise ValueError(f"ropes must be RopeParams or LayerRopes; got {type(ropes).__name__}")
    work = []
    for layer in _layers(layout, layers):
        params = ropes.params(layer)
        if params is not None:
            _check_layer(layout, layer, params)
            work.append((layer, params))
    tokens, deltas = _token_slots(layout, segments)
    return RerotationPlan(tuple(work), tokens, deltas)


def _layers(layout: KVLayout, layers: Sequence[int] | None) -> list[int]:
    """The layers to turn: in range, each once."""
    if layers is None:
        return list(range(layout.num_layers))
    chosen = [check_index(layer, "a layer") for layer in layers]
    for layer in chosen:
        if layer >= layout.num_layers:
            raise ValueError(f"layer {layer} is not within the {layout.num_layers} layers")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"layers repeat a layer: {chosen}")
    return chosen


def _check_layer(layout: KVLayout, layer: int, params: RopeParams) -> None:
    """ValueError unless `params` can turn this layer's K in place."""
    view = layout.block_views[layer][0]
    if view.dtype not in ROPE_DTYPES:
        raise ValueError(
            f"layer {layer}: K is {view.dtype}; re-rotation needs a bfloat16, float16 or "
            "float32 cache (quantised K, fp8 or int8, is not supported)"
        )
    head_size = int(view.shape[3])
    end = params.offset + params.rotary_dim
    if end > head_size:
        raise ValueError(
            f"layer {layer}: rotary dims [{params.offset}, {end}) do not fit in the head "
            f"size {head_size}"
        )
    if len(layout.block_views[layer]) == 1 and params.rotary_dim == head_size:
        raise ValueError(
            f"layer {layer}: {layout.format.value} has no K apart from V (one latent row "
            "serves both), so only its rope slice may turn; give its offset and rotary_dim "
            "(DeepSeek: offset=512, rotary_dim=64)"
        )


def _token_slots(
    layout: KVLayout, segments: Sequence[RerotateSegment]
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [T, 3] int32, distinct nonzero deltas) of the segments; ValueError on a
    slot outside the cache or in two segments."""
    bs = layout.block_size
    slots, deltas = [], []
    for i, seg in enumerate(segments):
        blocks, offsets = _segment_slots(layout, seg, f"segment {i}")
        slots.append(blocks * bs + offsets)
        deltas.append(np.full(len(blocks), _delta(seg.delta, f"segment {i}"), dtype=np.int64))
    slot = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
    values, counts = np.unique(slot, return_counts=True)
    if (counts > 1).any():
        twice = int(values[counts > 1][0])
        raise ValueError(
            f"token slot (block {twice // bs}, offset {twice % bs}) is in more than one segment"
        )
    delta = np.concatenate(deltas) if deltas else np.zeros(0, dtype=np.int64)
    keep = delta != 0
    distinct = np.unique(delta[keep])
    tokens = np.stack(
        [slot[keep] // bs, slot[keep] % bs, np.searchsorted(distinct, delta[keep])], axis=1
    )
    return tokens.astype(np.int32), distinct


def _segment_slots(
    layout: KVLayout, seg: RerotateSegment, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """(block ids, offsets) of each token of one segment, checked against the layout."""
    if not isinstance(seg, RerotateSegment):
        raise ValueError(f"{name} must be a RerotateSegment; got {type(seg).__name__}")
    bs = layout.block_size
    start = check_index(seg.start, f"{name}: start")
    count = check_index(seg.num_tokens, f"{name}: num_tokens")
    if start >= bs:
        raise ValueError(f"{name}: start {start} must lie in [0, block_size {bs})")
    ids = np.asarray(seg.block_ids)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"{name}: block_ids must be a 1-d list of integers")
    need = -(-(start + count) // bs) if count else 0
    if ids.size != need:
        raise ValueError(
            f"{name}: {count} tokens from offset {start} fill {need} blocks of {bs}; "
            f"got {ids.size} block ids"
        )
    ids = ids.astype(np.int64)
    try:
        layout.validate_block_ids(ids)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    positions = start + np.arange(count, dtype=np.int64)
    return ids[positions // bs], positions % bs


def _delta(value: object, name: str) -> int:
    """A segment's delta, checked to be an int32."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name}: delta must be an integer; got {value!r}")
    if abs(int(value)) > MAX_DELTA:
        raise ValueError(f"{name}: delta {value} does not fit int32")
    return int(value)


def rerotate(
    layout: KVLayout,
    ropes: RopeParams | LayerRopes,
    segments: Sequence[RerotateSegment],
    *,
    layers: Sequence[int] | None = None,
    backend: Backend = "auto",
    stream: TransferStream | None = None,
) -> None:
    """Turn, in place, K's rotary dims of each segment's tokens by the segment's delta.

    `ropes`: one RopeParams for every layer, or LayerRopes. Every argument is checked
    before anything is written. The cuda backend (the default for a CUDA cache) launches
    once per layer, asynchronously on `stream`; with stream=None it is ordered after and
    before torch's current stream. The cpu backend is `rerotate_reference`.
    """
    if backend not in ("auto", "cuda", "cpu"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'cpu'; got {backend!r}")
    apply_rerotation(
        layout, plan_rerotation(layout, ropes, segments, layers=layers), backend=backend,
        stream=stream,
    )  # fmt: skip


def apply_rerotation(
    layout: KVLayout,
    plan: RerotationPlan,
    *,
    backend: Backend = "auto",
    stream: TransferStream | None = None,
) -> None:
    """Carry out a checked plan (`plan_rerotation`) as `rerotate` does: for a caller that
    planned first, to check everything before its own writes, without planning twice."""
    if backend == "cuda" or (backend == "auto" and layout.device.type == "cuda"):
        from kvflow.kernels.rope_cuda import launch_rerotation

        launch_rerotation(layout, plan, stream=stream)
    elif stream is not None and layout.device.type == "cuda":
        with torch.cuda.stream(stream.torch):
            run_reference(layout, plan)
    else:
        run_reference(layout, plan)


def rerotate_reference(
    layout: KVLayout,
    ropes: RopeParams | LayerRopes,
    segments: Sequence[RerotateSegment],
    *,
    layers: Sequence[int] | None = None,
) -> None:
    """The torch re-rotation (CPU path, and the CUDA kernel's oracle), in place.

    For each token, head and rotated pair (x, y) of K: with c, s = cos, sin of delta *
    inv_freq from `rotation_table`, x' = x*c - y*s and y' = y*c + x*s, each product and
    sum rounded to float32, the result rounded once to the cache dtype. Caches of
    bfloat16, float16 or float32 only: fp8 and int8 caches raise ValueError. A NaN stays
    NaN (its bits may change); delta 0 leaves every byte alone.
    """
    run_reference(layout, plan_rerotation(layout, ropes, segments, layers=layers))


def run_reference(layout: KVLayout, plan: RerotationPlan) -> None:
    """Carry out a checked plan with torch ops wherever the cache lives."""
    if plan.tokens.shape[0] == 0 or not plan.layers:
        return
    tokens = torch.from_numpy(plan.tokens.astype(np.int64)).to(layout.device)
    blocks, offsets, rows = tokens.unbind(1)
    tables: dict[RopeParams, torch.Tensor] = {}
    for layer, params in plan.layers:
        table = tables.get(params)
        if table is None:
            table = torch.from_numpy(rotation_table(params, plan.deltas)).to(layout.device)
            tables[params] = table
        _rotate(layout.block_views[layer][0], params, blocks, offsets, table[rows])


def _pairs(x: torch.Tensor, pairing: Pairing) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second members of each rotated pair of the last dim (views)."""
    if pairing is Pairing.NEOX:
        return x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return x[..., 0::2], x[..., 1::2]


def _rotate(
    k: torch.Tensor,
    params: RopeParams,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    cos_sin: torch.Tensor,
) -> None:
    """Turn the rotary slice of K's rows (block, offset) of a [NB, BS, NH, HS] view by
    each token's cos_sin [T, rotary_dim / 2, 2]."""
    rope = k[..., params.offset : params.offset + params.rotary_dim]
    x = rope[blocks, offsets].float()  # [T, NH, rotary_dim]
    cos, sin = cos_sin[:, None, :, 0], cos_sin[:, None, :, 1]
    first, second = _pairs(x, params.pairing)
    out = torch.empty_like(x)
    out_first, out_second = _pairs(out, params.pairing)
    out_first.copy_(first * cos - second * sin)
    out_second.copy_(second * cos + first * sin)
    rope[blocks, offsets] = out.to(k.dtype)
