"""Block transfers: argument validation, then the CUDA kernel or the torch reference.

`PreparedTransfer` checks (and, on CUDA, uploads) a request's ids once for launches in
pieces; `transfer_blocks` is the one-shot form.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from kvflow.kernels.layout import KVLayout
from kvflow.kernels.plan import pow2_alignment
from kvflow.kernels.reference import transfer_reference

if TYPE_CHECKING:
    from kvflow.kernels.cuda_backend import ResolvedKernel, UploadedTransfer
    from kvflow.kernels.idbuffer import IdBuffer
    from kvflow.kernels.streams import TransferStream

Direction = Literal["gather", "scatter"]
Backend = Literal["auto", "cuda", "cpu"]


def check_transfer_ids(
    layout: KVLayout,
    block_ids: torch.Tensor | np.ndarray,
    skip_blocks: torch.Tensor | Sequence[int] | None,
    direction: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Validate the ids side of a transfer; return (block ids, skip counts) as numpy int64.

    Raises ValueError naming the bad argument: direction, shapes, dtypes, ids out of
    range, skip counts out of range, or ids repeated among the blocks a scatter would write.
    """
    if direction not in ("gather", "scatter"):
        raise ValueError(f"direction must be 'gather' or 'scatter'; got {direction!r}")
    layout.validate_block_ids(block_ids)
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.detach().cpu().numpy()
    if block_ids.ndim != 2 or block_ids.shape[1] < 1:
        raise ValueError(
            f"block_ids must be [num_chunks, blocks_per_chunk>=1]; got {tuple(block_ids.shape)}"
        )
    ids = block_ids.astype(np.int64, copy=False)
    num_chunks, per_chunk = ids.shape
    skip = _skip_counts(skip_blocks, num_chunks, per_chunk)
    if direction == "scatter":
        written = ids[np.arange(per_chunk)[None, :] >= skip[:, None]]
        if layout.repeated_block(written) is not None:
            raise ValueError("block_ids repeat a block that scatter would write twice")
    return ids, skip


def check_staging(staging: torch.Tensor, rows: int, chunk_bytes: int, chunk_desc: str) -> None:
    """ValueError unless staging is a contiguous uint8 [rows, chunk_bytes] tensor."""
    if not isinstance(staging, torch.Tensor) or staging.dtype != torch.uint8:
        got = staging.dtype if isinstance(staging, torch.Tensor) else type(staging).__name__
        raise ValueError(f"staging must be a uint8 tensor; got {got}")
    if tuple(staging.shape) != (rows, chunk_bytes):
        raise ValueError(
            f"staging must be [num_chunks={rows}, chunk_nbytes={chunk_bytes}] for "
            f"{chunk_desc}; got {tuple(staging.shape)}"
        )
    if not staging.is_contiguous():
        raise ValueError(f"staging must be contiguous; strides are {tuple(staging.stride())}")


def _skip_counts(
    skip_blocks: torch.Tensor | Sequence[int] | None, num_chunks: int, per_chunk: int
) -> np.ndarray:
    if skip_blocks is None:
        return np.zeros(num_chunks, dtype=np.int64)
    if isinstance(skip_blocks, torch.Tensor):
        if skip_blocks.dtype.is_floating_point or skip_blocks.dtype == torch.bool:
            raise ValueError(f"skip_blocks must hold integers; got {skip_blocks.dtype}")
        skip = skip_blocks.detach().cpu().numpy().astype(np.int64).reshape(-1)
    else:
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in skip_blocks):
            raise ValueError("skip_blocks must hold integers")
        skip = np.array(list(skip_blocks), dtype=np.int64)
    if skip.size != num_chunks:
        raise ValueError(f"skip_blocks needs one count per chunk ({num_chunks}); got {skip.size}")
    if skip.size and (int(skip.min()) < 0 or int(skip.max()) > per_chunk):
        raise ValueError(f"skip_blocks counts must lie in [0, {per_chunk}]; got {skip.tolist()}")
    return skip


class PreparedTransfer:
    """One request's block ids, checked once and (CUDA) uploaded once, then launched
    in pieces: `launch(staging, first, count)` moves chunks [first, first + count) with no
    further checks on the ids or uploads, so a pipeline of chunk groups pays the set-up once.
    `trusted` and `launch_trusted` skip the checks for callers that made them already.

    The cuda backend is asynchronous on ``stream``; with stream=None it is ordered after,
    and before, work on torch's current stream. It uploads the ids through ``id_buffer``
    when given (see `IdBuffer`; the cpu backend has nothing to upload).
    """

    def __init__(
        self,
        layout: KVLayout,
        block_ids: torch.Tensor | np.ndarray,
        *,
        direction: Direction,
        skip_blocks: torch.Tensor | Sequence[int] | None = None,
        backend: Backend = "auto",
        stream: TransferStream | None = None,
        id_buffer: IdBuffer | None = None,
    ) -> None:
        if backend not in ("auto", "cuda", "cpu"):
            raise ValueError(f"backend must be 'auto', 'cuda' or 'cpu'; got {backend!r}")
        ids, skip = check_transfer_ids(layout, block_ids, skip_blocks, direction)
        self._setup(layout, ids, skip, direction == "gather", backend, stream, id_buffer)

    @classmethod
    def trusted(
        cls,
        layout: KVLayout,
        block_ids: np.ndarray,
        skip_blocks: np.ndarray | Sequence[int] | None = None,
        *,
        gather: bool,
        backend: Literal["cuda", "cpu"],
        stream: TransferStream | None = None,
        id_buffer: IdBuffer | None = None,
    ) -> PreparedTransfer:
        """A transfer of ids its caller has already checked, with no check here.

        For callers that validate at their own boundary (the cache engine's request
        conversion checks every id once): `block_ids` is an integer numpy array
        [chunks, blocks_per_chunk] of in-range ids, with no id repeated among the blocks
        a scatter writes; `skip_blocks` counts lie in [0, blocks_per_chunk]. Launch it
        with `launch_trusted`. Anything else is undefined behaviour on the GPU.
        """
        if skip_blocks is None:
            skip = np.zeros(block_ids.shape[0], dtype=np.int64)
        else:
            skip = np.asarray(skip_blocks, dtype=np.int64)
        self = cls.__new__(cls)
        self._setup(layout, block_ids, skip, gather, backend, stream, id_buffer)
        return self

    def _setup(
        self,
        layout: KVLayout,
        ids: np.ndarray,
        skip: np.ndarray,
        gather: bool,
        backend: Backend,
        stream: TransferStream | None,
        id_buffer: IdBuffer | None,
    ) -> None:
        self.layout = layout
        self.gather = gather
        self.stream = stream
        self.num_chunks, self.per_chunk = (int(n) for n in ids.shape)
        self.chunk_nbytes = layout.chunk_nbytes(self.per_chunk * layout.block_size)
        self._ids, self._skip = ids, skip
        self._device: UploadedTransfer | None = None
        if backend == "cuda" or (backend == "auto" and layout.device.type == "cuda"):
            from kvflow.kernels.cuda_backend import UploadedTransfer

            self._device = UploadedTransfer(
                layout, ids, skip, gather=gather, stream=stream, id_buffer=id_buffer
            )

    def for_layout(self, layout: KVLayout) -> PreparedTransfer:
        """The same chunks' ids, uploaded once, moved through another layout of the same
        block size on the same device: a layerwise transfer launches each layer through
        that layer's own layout, and its ids need not go up once per layer."""
        if layout.block_size != self.layout.block_size or layout.device != self.layout.device:
            raise ValueError(
                f"a transfer prepared for blocks of {self.layout.block_size} tokens on "
                f"{self.layout.device} cannot move blocks of {layout.block_size} on {layout.device}"
            )
        other = copy.copy(self)
        other.layout = layout
        other.chunk_nbytes = layout.chunk_nbytes(self.per_chunk * layout.block_size)
        if self._device is not None:
            other._device = self._device.for_layout(layout)
        return other

    def launch(self, staging: torch.Tensor, first: int = 0, count: int | None = None) -> None:
        """Move chunks [first, first + count) (default: from `first` to the end) to/from
        `staging`, whose row i is chunk first + i."""
        count = self.num_chunks - first if count is None else count
        if first < 0 or count < 0 or first + count > self.num_chunks:
            raise ValueError(
                f"chunks [{first}, {first + count}) are not within the {self.num_chunks} prepared"
            )
        check_staging(
            staging, count, self.chunk_nbytes,
            f"{self.per_chunk} blocks of {self.layout.block_size} tokens",
        )  # fmt: skip
        self.launch_trusted(staging, first, count)

    def launch_trusted(self, staging: torch.Tensor, first: int, count: int) -> None:
        """`launch` without its checks: for callers that size `staging` themselves (a
        contiguous uint8 [count, chunk_nbytes] tensor) and stay within the chunks."""
        if self._device is not None:
            self._device.launch(staging, first, count)
            return
        ids = torch.from_numpy(self._ids[first : first + count]).long()
        skip = torch.from_numpy(self._skip[first : first + count])
        if self.stream is not None and self.layout.device.type == "cuda":
            with torch.cuda.stream(self.stream.torch):
                transfer_reference(self.layout, staging, ids, skip, gather=self.gather)
            return
        transfer_reference(self.layout, staging, ids, skip, gather=self.gather)


class LayoutKernels:
    """Launches of any prepared transfer's ids through one layout (same block size and
    device as the transfers'): `moves.for_layout(layout).launch_trusted(rows, ...)` for a
    caller that moves many transfers through the same few layouts and buffers, without
    a copy of the transfer or a view of the rows per launch. On CUDA its kernels are
    resolved once per staging alignment and kept, so a launch is one driver call."""

    def __init__(self, layout: KVLayout, chunk_tokens: int, *, gather: bool) -> None:
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.gather = gather
        self.chunk_nbytes = layout.chunk_nbytes(chunk_tokens)
        self._kernels: dict[int, ResolvedKernel] = {}  # CUDA: by staging alignment

    def launch(
        self, moves: PreparedTransfer, staging: torch.Tensor, first: int, count: int
    ) -> None:
        """Move chunks [first, first + count) of `moves` (prepared for chunks of
        `chunk_tokens` in this direction) to/from the flat uint8 `staging`, whose first
        count x `chunk_nbytes` bytes are their rows in this layout (the caller checked)."""
        device = moves._device
        if device is None:
            rows = staging[: count * self.chunk_nbytes].view(count, self.chunk_nbytes)
            moves.for_layout(self.layout).launch_trusted(rows, first, count)
            return
        address = staging.data_ptr()
        alignment = pow2_alignment(address)
        kernel = self._kernels.get(alignment)
        if kernel is None:
            from kvflow.kernels.cuda_backend import resolve_kernel

            kernel = self._kernels[alignment] = resolve_kernel(
                self.layout, self.chunk_tokens, gather=self.gather, staging_alignment=alignment
            )
        device.launch_kernel(kernel, address, first, count)


def transfer_blocks(
    layout: KVLayout,
    staging: torch.Tensor,
    block_ids: torch.Tensor | np.ndarray,
    *,
    direction: Direction,
    skip_blocks: torch.Tensor | Sequence[int] | None = None,
    backend: Backend = "auto",
    stream: TransferStream | None = None,
) -> None:
    """Move whole blocks: "gather" cache -> staging (store), "scatter" staging -> cache.

    Row c of ``staging`` is chunk c in the L1 chunk layout (docs/ENGINE.md); block_ids[c] lists its
    blocks. The first skip_blocks[c] blocks of chunk c are neither read nor written.
    The cuda backend is asynchronous on ``stream``; with stream=None it is ordered after,
    and before, work on torch's current stream.
    """
    PreparedTransfer(
        layout, block_ids, direction=direction, skip_blocks=skip_blocks, backend=backend,
        stream=stream,
    ).launch(staging)  # fmt: skip
