"""CUDA re-rotation: a plan's token slots and cos/sin tables go up in one copy, then one
kernel launch per layer (`csrc/rope_rerotate.cu`) turns that layer's K in place."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvflow.cuda.context import CurrentContext, primary_context
from kvflow.kernels.cuda_backend import check_device
from kvflow.kernels.layout import KVLayout
from kvflow.kernels.loader import get_function
from kvflow.kernels.rope_params import RerotationPlan, RopeParams, rotation_table
from kvflow.kernels.streams import TransferStream, default_transfer_stream

KERNEL_SOURCE = "rope_rerotate.cu"
THREADS_PER_CTA = 256  # the kernel's launch bound
#: the kernel indexes (token, head, pair) items in 32 bits
MAX_ITEMS = 2**31 - 1
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_ARG_TYPES = [np.uintp, np.int64, np.int64, np.int64, np.uintp, np.uintp] + [np.uint32] * 3
_prepared: dict[tuple[int, str], Any] = {}


def kernel_name(dtype: torch.dtype, params: RopeParams) -> str:
    """The kernel instantiation for a cache dtype and a pairing."""
    return f"kvf_rope_rerotate_{_DTYPE_NAMES[dtype]}_{params.pairing.value}"


def _function(device_index: int, name: str) -> Any:
    """The compiled kernel, prepared for its argument types once per process."""
    function = _prepared.get((device_index, name))
    if function is None:
        function = get_function(device_index, KERNEL_SOURCE, name)
        function.prepare(_ARG_TYPES)
        _prepared[(device_index, name)] = function
    return function


def _host_buffer(plan: RerotationPlan) -> tuple[np.ndarray, dict[RopeParams, int], int]:
    """One byte buffer holding each distinct params' cos/sin table (8-byte aligned, for
    float2 loads) then the tokens; returns it, each table's offset and the tokens' offset."""
    parts, offsets, at = [], {}, 0
    for _, params in plan.layers:
        if params not in offsets:
            table = rotation_table(params, plan.deltas).view(np.uint8).reshape(-1)
            offsets[params] = at
            parts.append(table)
            at += table.size
    parts.append(plan.tokens.view(np.uint8).reshape(-1))
    return np.concatenate(parts), offsets, at


def launch_rerotation(
    layout: KVLayout, plan: RerotationPlan, *, stream: TransferStream | None = None
) -> None:
    """Enqueue a checked plan (`rope.plan_rerotation`) on the cache's GPU.

    Asynchronous on `stream`; with stream=None, on the device's transfer stream ordered
    after and before torch's current stream. The device copy of the tables and tokens is
    allocated on the launch stream, so the caching allocator reuses it only for work
    queued after these launches.
    """
    index = check_device(layout, stream)
    num_tokens = int(plan.tokens.shape[0])
    if num_tokens == 0 or not plan.layers:
        return
    for layer, params in plan.layers:
        items = num_tokens * int(layout.block_views[layer][0].shape[2]) * params.half
        if items > MAX_ITEMS:
            raise ValueError(
                f"layer {layer}: {items} (token, head, pair) items exceed one launch ({MAX_ITEMS})"
            )
    ordered = stream is None
    launch = stream or default_transfer_stream(index)
    if ordered:
        launch.torch.wait_stream(torch.cuda.current_stream(layout.device))
    host, table_offsets, tokens_offset = _host_buffer(plan)
    pinned = torch.from_numpy(host).pin_memory()
    with torch.cuda.stream(launch.torch):
        device = pinned.to(layout.device, non_blocking=True)
    base = device.data_ptr()
    with CurrentContext(primary_context(index)):
        for layer, params in plan.layers:
            _launch_layer(
                layout.block_views[layer][0], params, index, launch,
                base + tokens_offset, base + table_offsets[params], num_tokens,
            )  # fmt: skip
    if ordered:
        torch.cuda.current_stream(layout.device).wait_stream(launch.torch)


def _launch_layer(
    k: torch.Tensor,
    params: RopeParams,
    index: int,
    stream: TransferStream,
    tokens: int,
    table: int,
    num_tokens: int,
) -> None:
    """One launch over every (token, head, pair) of one layer's K view [NB, BS, NH, HS]."""
    heads = int(k.shape[2])
    items = num_tokens * heads * params.half
    size = k.element_size()
    _function(index, kernel_name(k.dtype, params)).prepared_async_call(
        ((items + THREADS_PER_CTA - 1) // THREADS_PER_CTA, 1),
        (THREADS_PER_CTA, 1, 1),
        stream.pycuda,
        k.data_ptr() + params.offset * size,
        k.stride(0) * size,
        k.stride(1) * size,
        k.stride(2) * size,
        tokens,
        table,
        num_tokens,
        heads,
        params.half,
    )
