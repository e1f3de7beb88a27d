"""CUDA backend: upload the transfer plan once per layout, launch the kernel on a stream."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.kernels.layout import KVLayout
from kvflow.kernels.loader import active_context, cuda_available, get_function
from kvflow.kernels.plan import (
    MAX_NUMERATOR,
    THREADS_PER_CTA,
    WARPS_PER_CTA,
    TransferPlan,
    build_plan,
    pow2_alignment,
)
from kvflow.kernels.streams import TransferStream, default_transfer_stream

KERNEL_SOURCE = "block_transfer.cu"
KERNEL_NAME = "kvf_block_transfer"
_ARG_TYPES = [np.uintp] * 6 + [np.uint32, np.uint32]
_prepared: set[int] = set()


@dataclass(frozen=True)
class DevicePlan:
    """A TransferPlan with its descriptor table resident on the cache's device."""

    plan: TransferPlan
    table: torch.Tensor


def device_plan(
    layout: KVLayout, chunk_tokens: int, staging_alignment: int, max_vector_bytes: int
) -> DevicePlan:
    """The plan for these parameters, built and uploaded on first use, cached on the layout."""
    key = ("cuda", chunk_tokens, staging_alignment, max_vector_bytes)
    found = layout.plan_cache.get(key)
    if found is None:
        plan = build_plan(
            layout,
            chunk_tokens,
            staging_alignment=staging_alignment,
            max_vector_bytes=max_vector_bytes,
        )
        table = torch.from_numpy(plan.table).to(layout.device)  # synchronous upload
        found = DevicePlan(plan, table)
        layout.plan_cache[key] = found
    assert isinstance(found, DevicePlan)
    return found


def launch_transfer(
    layout: KVLayout,
    staging: torch.Tensor,
    block_ids: torch.Tensor,
    skip_blocks: torch.Tensor,
    *,
    gather: bool,
    stream: TransferStream | None = None,
    max_vector_bytes: int = 16,
) -> TransferPlan | None:
    """Enqueue one kernel launch for all chunks (arguments already validated).

    block_ids / skip_blocks are CPU int64 ([chunks, per_chunk] / [chunks]). Returns the
    plan used (its per-group vector widths), or None when there was nothing to move.
    ``max_vector_bytes`` caps the vector width (tests and benchmarks force each path).
    """
    if layout.device.type != "cuda":
        raise ValueError(f"the cuda backend needs a CUDA cache; the layout is on {layout.device}")
    if staging.device != layout.device:
        raise ValueError(
            f"staging is on {staging.device} but the cache is on {layout.device}; the cuda "
            "backend needs both on one device"
        )
    if not cuda_available():
        raise RuntimeError("the cuda backend needs pycuda (pip install 'kvflow[cuda]')")
    if stream is not None and stream.device != layout.device:
        raise ValueError(f"stream is on {stream.device} but the cache is on {layout.device}")
    num_chunks, per_chunk = block_ids.shape
    if num_chunks == 0:
        return None
    index = layout.device.index
    assert index is not None
    dplan = device_plan(
        layout,
        per_chunk * layout.block_size,
        pow2_alignment(staging.data_ptr()),
        max_vector_bytes,
    )
    plan = dplan.plan
    num_tiles = num_chunks * plan.tiles_per_chunk
    if num_tiles >= MAX_NUMERATOR:
        raise ValueError(f"{num_chunks} chunks exceed one launch ({num_tiles} warp tiles)")
    function = get_function(index, KERNEL_SOURCE, KERNEL_NAME)
    if id(function) not in _prepared:
        function.prepare(_ARG_TYPES)
        _prepared.add(id(function))
    transfer_stream = stream or default_transfer_stream(index)
    current = torch.cuda.current_stream(layout.device)
    if stream is None:
        transfer_stream.torch.wait_stream(current)
    host_ids = torch.cat([block_ids.reshape(-1), skip_blocks]).to(torch.int32)
    with torch.cuda.stream(transfer_stream.torch):
        ids = host_ids.to(layout.device, non_blocking=True)
    table = dplan.table.data_ptr()
    grid = (num_tiles + WARPS_PER_CTA - 1) // WARPS_PER_CTA
    with active_context(index):
        function.prepared_async_call(
            (grid, 1),
            (THREADS_PER_CTA, 1, 1),
            transfer_stream.pycuda,
            np.uintp(table),
            np.uintp(table + plan.groups_offset),
            np.uintp(table + plan.entries_offset),
            np.uintp(ids.data_ptr()),
            np.uintp(ids.data_ptr() + 4 * num_chunks * per_chunk),
            np.uintp(staging.data_ptr()),
            np.uint32(num_tiles),
            np.uint32(1 if gather else 0),
        )
    if stream is None:
        current.wait_stream(transfer_stream.torch)
    return plan
