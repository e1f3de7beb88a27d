"""CUDA backend: upload the transfer plan once per layout, launch the kernel on a stream."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvflow.cuda.context import CurrentContext, primary_context
from kvflow.kernels.idbuffer import IdBuffer
from kvflow.kernels.layout import KVLayout
from kvflow.kernels.loader import DEFAULT_OPTIONS, cuda_available, get_function
from kvflow.kernels.plan import (
    DEFAULT_ITERS,
    DEFAULT_LANE_BYTES,
    DEFAULT_WIDE_ITERS,
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
KERNEL_TILED = "kvf_block_transfer_tiled"  # same template, every group tiled
_ARG_TYPES = [np.uintp] * 6 + [np.uint32, np.uint32]


@dataclass(frozen=True)
class KernelTuning:
    """Build-time knobs of the kernel (defaults measured best; benchmarks compare others).

    lane_bytes: bytes per lane per unrolled step; iters / wide_iters: unrolled steps per
    warp tile of narrow or strided groups / of wide ones (`plan.is_wide`; a plan choice);
    stream_loads / stream_stores: .cs (evict-first) loads / stores instead of default caching;
    linear_min_ctas / tiled_min_ctas: CTAs per SM the linear / tiled kernel's register
    budget must allow;
    tiled: plan staged groups through shared memory where they fit (a plan choice, not
    a build option: both settings share one compiled module).
    """

    lane_bytes: int = DEFAULT_LANE_BYTES
    iters: int = DEFAULT_ITERS
    wide_iters: int = DEFAULT_WIDE_ITERS
    stream_loads: bool = False
    stream_stores: bool = False
    linear_min_ctas: int = 1
    tiled_min_ctas: int = 1
    tiled: bool = True

    def options(self) -> tuple[str, ...]:
        """nvcc options selecting this build."""
        return (
            *DEFAULT_OPTIONS,
            f"-DKVF_LANE_BYTES={self.lane_bytes}",
            f"-DKVF_STREAM_LOADS={int(self.stream_loads)}",
            f"-DKVF_STREAM_STORES={int(self.stream_stores)}",
            f"-DKVF_LINEAR_MIN_CTAS={self.linear_min_ctas}",
            f"-DKVF_TILED_MIN_CTAS={self.tiled_min_ctas}",
        )


DEFAULT_TUNING = KernelTuning()


@dataclass(frozen=True)
class DevicePlan:
    """A TransferPlan, its descriptor table resident on the cache's device, and the
    prepared kernel that runs it."""

    plan: TransferPlan
    table: torch.Tensor
    function: Any


_upload_lock = threading.Lock()
_upload_streams: dict[int, torch.cuda.Stream] = {}


def _upload(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """`host` copied to `device` on a stream of its own, waiting for that copy alone. On
    torch's current stream the copy would first wait for every kernel queued there: an
    engine's first scatter through a new span stalled its forward pass for ~100 ms."""
    index = device.index
    assert index is not None
    with _upload_lock:
        stream = _upload_streams.get(index)
        if stream is None:
            stream = _upload_streams[index] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        return torch.from_numpy(host).to(device)  # synchronous: waits for `stream` only


def device_plan(
    layout: KVLayout,
    chunk_tokens: int,
    *,
    gather: bool,
    staging_alignment: int,
    max_vector_bytes: int,
    tuning: KernelTuning,
) -> DevicePlan:
    """The plan and kernel for these parameters, built on first use, cached on the layout."""
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
            wide_iters=tuning.wide_iters,
            tiled=tuning.tiled,
        )
        table = _upload(plan.table, layout.device)
        index = layout.device.index
        assert index is not None
        name = (
            KERNEL_LINEAR if plan.all_linear else KERNEL_TILED if plan.all_tiled else KERNEL_GENERAL
        )
        function = get_function(index, KERNEL_SOURCE, name, tuning.options())
        function.prepare(_ARG_TYPES)  # idempotent; runs once per cached plan
        found = DevicePlan(plan, table, function)
        layout.plan_cache[key] = found
    assert isinstance(found, DevicePlan)
    return found


@dataclass(frozen=True)
class ResolvedKernel:
    """A plan's prepared kernel and its table's device address: what a launch needs
    besides the ids and the staging address."""

    plan: TransferPlan
    function: Any
    table: int


def resolve_kernel(
    layout: KVLayout,
    chunk_tokens: int,
    *,
    gather: bool,
    staging_alignment: int,
    max_vector_bytes: int = 16,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> ResolvedKernel:
    """The kernel moving chunks of `chunk_tokens` through `layout` to/from staging of
    this alignment (its plan built and uploaded on first use, `device_plan`)."""
    dplan = device_plan(
        layout, chunk_tokens, gather=gather, staging_alignment=staging_alignment,
        max_vector_bytes=max_vector_bytes, tuning=tuning,
    )  # fmt: skip
    return ResolvedKernel(dplan.plan, dplan.function, dplan.table.data_ptr())


def check_device(layout: KVLayout, stream: TransferStream | None) -> int:
    """The cache's CUDA device index, after checking a kernel can run there (a CUDA
    cache, pycuda importable, `stream` on the cache's device); the rotary kernel's too."""
    if layout.device.type != "cuda":
        raise ValueError(f"the cuda backend needs a CUDA cache; the layout is on {layout.device}")
    if not cuda_available():
        raise RuntimeError("the cuda backend needs pycuda (pip install 'kvflow[cuda]')")
    if stream is not None and stream.device != layout.device:
        raise ValueError(f"stream is on {stream.device} but the cache is on {layout.device}")
    index = layout.device.index
    assert index is not None
    return index


class UploadedTransfer:
    """A request's block ids resident on the device, launched in chunk ranges.

    The ids (int32) and skip counts go up in one pinned, asynchronous copy on the
    launch stream when it is made, through `id_buffer` when given (its owner resets it
    only after this transfer's launches have run) or else a fresh pinned tensor; the
    kernel and plan are looked up once per staging alignment, so each `launch` costs
    pointer arithmetic and one driver call. With stream=None the work runs on the
    device's transfer stream, ordered after and before torch's current stream.
    """

    def __init__(
        self,
        layout: KVLayout,
        block_ids: np.ndarray,
        skip_blocks: np.ndarray,
        *,
        gather: bool,
        stream: TransferStream | None = None,
        id_buffer: IdBuffer | None = None,
        max_vector_bytes: int = 16,
        tuning: KernelTuning = DEFAULT_TUNING,
    ) -> None:
        self._index = check_device(layout, stream)
        self._context = primary_context(self._index)
        self.layout = layout
        self.num_chunks, self.per_chunk = (int(n) for n in block_ids.shape)
        self.gather = gather
        self.max_vector_bytes = max_vector_bytes
        self.tuning = tuning
        self._ordered = stream is None
        self._stream = stream or default_transfer_stream(self._index)
        if self._ordered:
            self._stream.torch.wait_stream(torch.cuda.current_stream(layout.device))
        if id_buffer is not None:
            if id_buffer.device != layout.device:
                raise ValueError(
                    f"id_buffer is on {id_buffer.device} but the cache is on {layout.device}"
                )
            with CurrentContext(self._context):  # the copy runs on this device's stream
                self._ids_ptr = id_buffer.upload((block_ids, skip_blocks), self._stream)
        else:
            host = np.concatenate([block_ids.reshape(-1), skip_blocks]).astype(np.int32)
            pinned = torch.from_numpy(host).pin_memory()
            with torch.cuda.stream(self._stream.torch):
                self._ids = pinned.to(layout.device, non_blocking=True)  # kept while we live
            self._ids_ptr = self._ids.data_ptr()
        self._kernels: dict[int, ResolvedKernel] = {}

    def for_layout(self, layout: KVLayout) -> UploadedTransfer:
        """These ids (shared, not uploaded again) for another layout on the same device
        (the caller checked the block size): its own plans and kernels."""
        other = copy.copy(self)
        other.layout = layout
        other._kernels = {}
        return other

    def _kernel(self, alignment: int) -> ResolvedKernel:
        """This layout's kernel for staging of this alignment."""
        found = self._kernels.get(alignment)
        if found is None:
            found = self._kernels[alignment] = resolve_kernel(
                self.layout, self.per_chunk * self.layout.block_size, gather=self.gather,
                staging_alignment=alignment, max_vector_bytes=self.max_vector_bytes,
                tuning=self.tuning,
            )  # fmt: skip
        return found

    def launch(self, staging: torch.Tensor, first: int, count: int) -> TransferPlan | None:
        """Enqueue chunks [first, first + count) to/from `staging` (validated by the caller).

        Returns the plan used, or None when there was nothing to move.
        """
        if staging.device != self.layout.device:
            raise ValueError(
                f"staging is on {staging.device} but the cache is on {self.layout.device}; "
                "the cuda backend needs both on one device"
            )
        if count == 0:
            return None
        address = staging.data_ptr()
        kernel = self._kernel(pow2_alignment(address))
        self.launch_kernel(kernel, address, first, count)
        return kernel.plan

    def launch_kernel(
        self, kernel: ResolvedKernel, staging_ptr: int, first: int, count: int
    ) -> None:
        """Enqueue chunks [first, first + count) of these ids to/from the device memory at
        `staging_ptr` with `kernel`, resolved by the caller for the layout the staging
        rows follow (same block size and blocks per chunk as these ids) and the address's
        alignment (`resolve_kernel`): no lookup, no check."""
        plan = kernel.plan
        num_tiles = count * plan.tiles_per_chunk
        if num_tiles >= MAX_NUMERATOR:
            raise ValueError(f"{count} chunks exceed one launch ({num_tiles} warp tiles)")
        stream = self._stream
        if self._ordered:
            current = torch.cuda.current_stream(self.layout.device)
            stream.torch.wait_stream(current)
        ids = self._ids_ptr
        per_chunk = self.per_chunk
        table = kernel.table
        # plain ints: the prepared launch packs them by its argument format; the
        # primary context is pushed only when the thread has another (or none) current
        with CurrentContext(self._context):
            kernel.function.prepared_async_call(
                ((num_tiles + WARPS_PER_CTA - 1) // WARPS_PER_CTA, 1),
                (THREADS_PER_CTA, 1, 1),
                stream.pycuda,
                table,
                table + plan.groups_offset,
                table + plan.entries_offset,
                ids + 4 * first * per_chunk,
                ids + 4 * (self.num_chunks * per_chunk + first),
                staging_ptr,
                num_tiles,
                1 if self.gather else 0,
                shared_size=plan.shared_bytes,
            )
        if self._ordered:
            current.wait_stream(stream.torch)


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
    return UploadedTransfer(
        layout, np.asarray(block_ids, dtype=np.int64), np.asarray(skip_blocks, dtype=np.int64),
        gather=gather, stream=stream, max_vector_bytes=max_vector_bytes, tuning=tuning,
    ).launch(staging, 0, int(block_ids.shape[0]))  # fmt: skip
