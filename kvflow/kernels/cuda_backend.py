"""CUDA backend: upload the transfer plan once per layout, launch the kernel on a stream."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.kernels.layout import KVLayout
from kvflow.kernels.loader import DEFAULT_OPTIONS, active_context, cuda_available, get_function
from kvflow.kernels.plan import (
    DEFAULT_ITERS,
    DEFAULT_LANE_BYTES,
    MAX_NUMERATOR,
    THREADS_PER_CTA,
    WARPS_PER_CTA,
    TransferPlan,
    build_plan,
    pow2_alignment,
)
from kvflow.kernels.streams import TransferStream, default_transfer_stream

KERNEL_SOURCE = "block_transfer.cu"
KERNEL_GENERAL = "kvf_block_transfer"
KERNEL_LINEAR = "kvf_block_transfer_linear"  # same template, every group contiguous
_ARG_TYPES = [np.uintp] * 6 + [np.uint32, np.uint32]
_prepared: set[int] = set()


@dataclass(frozen=True)
class KernelTuning:
    """Build-time knobs of the kernel (defaults measured best; benchmarks compare others).

    lane_bytes: bytes per lane per unrolled step; iters: unrolled steps per warp tile;
    stream_loads / stream_stores: .cs (evict-first) loads / stores instead of default caching;
    linear_min_ctas: CTAs per SM the lean kernel's register budget must allow.
    """

    lane_bytes: int = DEFAULT_LANE_BYTES
    iters: int = DEFAULT_ITERS
    stream_loads: bool = True
    stream_stores: bool = True
    linear_min_ctas: int = 1

    def options(self) -> tuple[str, ...]:
        """nvcc options selecting this build."""
        return (
            *DEFAULT_OPTIONS,
            f"-DKVF_LANE_BYTES={self.lane_bytes}",
            f"-DKVF_STREAM_LOADS={int(self.stream_loads)}",
            f"-DKVF_STREAM_STORES={int(self.stream_stores)}",
            f"-DKVF_LINEAR_MIN_CTAS={self.linear_min_ctas}",
        )


DEFAULT_TUNING = KernelTuning()


@dataclass(frozen=True)
class DevicePlan:
    """A TransferPlan with its descriptor table resident on the cache's device."""

    plan: TransferPlan
    table: torch.Tensor


def device_plan(
    layout: KVLayout,
    chunk_tokens: int,
    *,
    gather: bool,
    staging_alignment: int,
    max_vector_bytes: int,
    tuning: KernelTuning,
) -> DevicePlan:
    """The plan for these parameters, built and uploaded on first use, cached on the layout."""
    key = ("cuda", chunk_tokens, gather, staging_alignment, max_vector_bytes, tuning)
    found = layout.plan_cache.get(key)
    if found is None:
        plan = build_plan(
            layout,
            chunk_tokens,
            gather=gather,
            staging_alignment=staging_alignment,
            max_vector_bytes=max_vector_bytes,
            lane_bytes=tuning.lane_bytes,
            iters=tuning.iters,
        )
        table = torch.from_numpy(plan.table).to(layout.device)  # synchronous upload
        found = DevicePlan(plan, table)
        layout.plan_cache[key] = found
    assert isinstance(found, DevicePlan)
    return found


def _check_device(layout: KVLayout, stream: TransferStream | None) -> int:
    """The cache's CUDA device index, after checking the backend can run there."""
    if layout.device.type != "cuda":
        raise ValueError(f"the cuda backend needs a CUDA cache; the layout is on {layout.device}")
    if not cuda_available():
        raise RuntimeError("the cuda backend needs pycuda (pip install 'kvflow[cuda]')")
    if stream is not None and stream.device != layout.device:
        raise ValueError(f"stream is on {stream.device} but the cache is on {layout.device}")
    index = layout.device.index
    assert index is not None
    return index


def upload_ids(
    layout: KVLayout,
    block_ids: torch.Tensor,
    skip_blocks: torch.Tensor,
    stream: TransferStream | None = None,
) -> torch.Tensor:
    """Copy block ids [chunks, per_chunk] and skip counts [chunks] (CPU int64) to the device.

    One pinned, asynchronous copy on the launch stream: int32 ids, then the skip counts.
    With stream=None it runs on the device's transfer stream after torch's current stream.
    """
    index = _check_device(layout, stream)
    transfer_stream = stream or default_transfer_stream(index)
    if stream is None:
        transfer_stream.torch.wait_stream(torch.cuda.current_stream(layout.device))
    host_ids = torch.cat([block_ids.reshape(-1), skip_blocks]).to(torch.int32).pin_memory()
    with torch.cuda.stream(transfer_stream.torch):
        return host_ids.to(layout.device, non_blocking=True)


def launch_uploaded(
    layout: KVLayout,
    staging: torch.Tensor,
    device_ids: torch.Tensor,
    shape: tuple[int, int],
    first: int,
    count: int,
    *,
    gather: bool,
    stream: TransferStream | None = None,
    max_vector_bytes: int = 16,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> TransferPlan | None:
    """Enqueue one launch for chunks [first, first + count) of ids from `upload_ids`.

    `shape` is the uploaded (chunks, per_chunk); staging holds `count` rows (arguments
    already validated). Returns the plan used, or None when there was nothing to move.
    """
    index = _check_device(layout, stream)
    if staging.device != layout.device:
        raise ValueError(
            f"staging is on {staging.device} but the cache is on {layout.device}; the cuda "
            "backend needs both on one device"
        )
    num_chunks, per_chunk = shape
    if count == 0:
        return None
    dplan = device_plan(
        layout,
        per_chunk * layout.block_size,
        gather=gather,
        staging_alignment=pow2_alignment(staging.data_ptr()),
        max_vector_bytes=max_vector_bytes,
        tuning=tuning,
    )
    plan = dplan.plan
    num_tiles = count * plan.tiles_per_chunk
    if num_tiles >= MAX_NUMERATOR:
        raise ValueError(f"{count} chunks exceed one launch ({num_tiles} warp tiles)")
    name = KERNEL_LINEAR if plan.all_linear else KERNEL_GENERAL
    function = get_function(index, KERNEL_SOURCE, name, tuning.options())
    if id(function) not in _prepared:
        function.prepare(_ARG_TYPES)
        _prepared.add(id(function))
    transfer_stream = stream or default_transfer_stream(index)
    current = torch.cuda.current_stream(layout.device)
    if stream is None:
        transfer_stream.torch.wait_stream(current)
    ids = device_ids.data_ptr()
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
            np.uintp(ids + 4 * first * per_chunk),
            np.uintp(ids + 4 * (num_chunks * per_chunk + first)),
            np.uintp(staging.data_ptr()),
            np.uint32(num_tiles),
            np.uint32(1 if gather else 0),
        )
    if stream is None:
        current.wait_stream(transfer_stream.torch)
    return plan


def launch_transfer(
    layout: KVLayout,
    staging: torch.Tensor,
    block_ids: torch.Tensor,
    skip_blocks: torch.Tensor,
    *,
    gather: bool,
    stream: TransferStream | None = None,
    max_vector_bytes: int = 16,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> TransferPlan | None:
    """Upload the ids and enqueue one kernel launch for all chunks (arguments validated).

    block_ids / skip_blocks are CPU int64 ([chunks, per_chunk] / [chunks]). Returns the
    plan used (its per-group vector widths), or None when there was nothing to move.
    ``max_vector_bytes`` caps the vector width (tests and benchmarks force each path);
    ``tuning`` selects a kernel build (benchmarks).
    """
    shape = (int(block_ids.shape[0]), int(block_ids.shape[1]))
    if shape[0] == 0:
        _check_device(layout, stream)
        return None
    device_ids = upload_ids(layout, block_ids, skip_blocks, stream)
    return launch_uploaded(
        layout, staging, device_ids, shape, 0, shape[0], gather=gather, stream=stream,
        max_vector_bytes=max_vector_bytes, tuning=tuning,
    )  # fmt: skip
