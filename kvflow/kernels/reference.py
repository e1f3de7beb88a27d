"""CPU transfers: the torch reference (the CUDA kernel's oracle) and the fast CPU path.

`transfer_reference` is vectorised index_select / index_put on byte views, the oracle
for the CUDA kernel; it runs wherever the tensors live (CPU, or CUDA when used as the
oracle), staging may be on another device. `chunk_copies` is what the engine's CPU
mover runs: numpy copies of word-wide strided views, straight between a CPU cache and
each chunk's own buffer (L1 objects need no staging), one copy per run of consecutive
blocks of a chunk covering every layer and K/V that one view can span (a chunk of many
short runs: one indexed op). A numpy copy is a single-threaded memcpy loop that
releases the GIL: no OpenMP team to wake per copy, and copies may run at once on
threads of the caller's choosing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from typing import NamedTuple, Protocol

import numpy as np
import torch

from kvflow.kernels.layout import KVLayout, LayerGroup


def transfer_reference(
    layout: KVLayout,
    staging: torch.Tensor,
    block_ids: torch.Tensor,
    skip_blocks: torch.Tensor,
    *,
    gather: bool,
) -> None:
    """Copy blocks between the cache and ``staging`` (arguments already validated).

    block_ids: int64 CPU [chunks, blocks_per_chunk]; skip_blocks: int64 CPU [chunks].
    """
    num_chunks, per_chunk = block_ids.shape
    if num_chunks == 0:
        return
    chunk_tokens = per_chunk * layout.block_size
    cache_dev, stage_dev = layout.device, staging.device
    keep = torch.arange(per_chunk).unsqueeze(0) >= skip_blocks.unsqueeze(1)
    full = bool(keep.all())
    chunk_idx, block_idx = keep.nonzero(as_tuple=True)
    ids = (block_ids.reshape(-1) if full else block_ids[chunk_idx, block_idx]).to(cache_dev)
    chunk_idx, block_idx = chunk_idx.to(stage_dev), block_idx.to(stage_dev)
    count = ids.numel()
    for group, offset in zip(layout.groups, layout.group_offsets(chunk_tokens), strict=True):
        size = group.chunk_nbytes(chunk_tokens)
        parts = staging[:, offset : offset + size].view(
            num_chunks,
            group.kv_size,
            len(group.layers),
            per_chunk,
            layout.block_size,
            group.row_bytes,
        )
        for li, layer in enumerate(group.layers):
            for kv in range(group.kv_size):
                cache = layout.block_views[layer][kv].view(torch.uint8)
                part = parts[:, kv, li]
                if gather:
                    rows = cache[ids].reshape(count, layout.block_size, group.row_bytes)
                    if full:
                        part.copy_(rows.view(part.shape))
                    else:
                        part[chunk_idx, block_idx] = rows.to(stage_dev)
                else:
                    rows = (
                        part.reshape(count, *part.shape[2:]) if full else part[chunk_idx, block_idx]
                    )
                    cache[ids] = rows.to(cache_dev).view(count, *cache.shape[1:])


class ChunkBuffers(Protocol):
    """Chunks' bytes as `chunk_copies` reads them (the engine's `HostChunks`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> torch.Tensor:
        """Chunk `index`'s bytes: a 1-D contiguous uint8 CPU tensor of the chunk's size."""
        ...

    def address(self, index: int, nbytes: int) -> int:
        """Chunk `index`'s address (what `self[index].data_ptr()` gives, made cheaper);
        ValueError unless it holds `nbytes`."""
        ...


@dataclass(frozen=True)
class _Family:
    """(kv, layer) views of one group that one strided numpy array covers, and where
    they lie in a chunk.

    `cache` is `[num_blocks, kv, layers, block_size, num_heads, words]` over the cache's
    own memory (its strides are the views' real ones) for the group's K/V rows `kv` and
    layers `layers`; it starts at byte `cache_at` of `storage`, all of its storage's
    bytes. The chunk side of a run of blocks from position p is the array of shape
    `(blocks, *tail)` and byte `strides` at byte `offset + p * strides[0]`.
    """

    group: int
    kv: slice
    layers: slice
    cache: np.ndarray
    storage: np.ndarray
    cache_at: int
    offset: int
    strides: tuple[int, ...]
    tail: tuple[int, ...]

    @property
    def word(self) -> np.dtype:
        """The unit both sides are read in (8, 4, 2 or 1 bytes)."""
        return self.cache.dtype

    def chunk_side(self, buffer: np.ndarray, span: _Span) -> np.ndarray:
        """The chunk side of `span`, `(chunks, length, *tail)`: blocks [pos, pos + length)
        of each of its chunks (bounds-checked against the whole buffer)."""
        return np.ndarray(
            (span.chunks, span.length, *self.tail), self.word, buffer=buffer,
            offset=span.base + self.offset + span.pos * self.strides[0],
            strides=(span.step, *self.strides),
        )  # fmt: skip

    def cache_side(self, span: _Span) -> np.ndarray:
        """The cache side of `span`, `(chunks, length, *tail)`: blocks [b, b + length) for
        b = block + j * block_step, j < chunks; IndexError for a block outside the cache."""
        first, last = span.block, span.block + (span.chunks - 1) * span.block_step
        if min(first, last) < 0 or max(first, last) + span.length > len(self.cache):
            raise IndexError(
                f"blocks {first}..{last} + {span.length} outside a cache of {len(self.cache)}"
            )
        stride = self.cache.strides[0]
        return np.ndarray(
            (span.chunks, span.length, *self.tail), self.word, buffer=self.storage,
            offset=self.cache_at + first * stride,
            strides=(span.block_step * stride, *self.cache.strides),
        )  # fmt: skip


class _Span(NamedTuple):
    """Blocks [pos, pos + length) of `chunks` chunks, the first at byte `base` of its
    storage and each next `step` bytes on, moved to or from cache blocks starting at
    `block`, each next chunk's `block_step` blocks on (steps 0 for one chunk)."""

    base: int
    step: int
    chunks: int
    pos: int
    length: int
    block: int
    block_step: int


#: a chunk whose blocks not skipped form more runs of consecutive ids than this is moved
#: by one indexed numpy op per family instead of a copy per run: with small blocks
#: (SGLang's device pools, 1-token blocks) a copy per run costs ~1.5 us of Python for
#: 2 KiB, an indexed op over 16 blocks 5x less (a gather's through a temporary)
MAX_RUNS = 2


#: consecutive whole chunks one address step apart in one storage, whose blocks are one
#: block step apart, are moved by one copy per family of up to this many bytes: a copy's
#: Python (its views, its call) costs ~2.5 us, the bytes of a small chunk (a 512-byte page)
#: far less; larger copies would leave a big move's helper threads too few to share
MERGE_BYTES = 1 << 20


class Copy(NamedTuple):
    """One copy of `chunk_copies`: `run()` moves `nbytes` bytes (releasing the GIL)."""

    nbytes: int
    run: Callable[[], object]


def chunk_copies(
    layout: KVLayout,
    chunks: ChunkBuffers,
    block_ids: np.ndarray,
    skip_blocks: np.ndarray | None,
    *,
    gather: bool,
    copyto: Callable[[np.ndarray, np.ndarray], object] = np.copyto,
) -> list[Copy]:
    """The copies that move blocks between a CPU cache and separate chunk buffers;
    no two touch the same bytes, so they may run in any order or at once on several
    threads.

    Chunk c is `chunks[c]` in the L1 chunk layout and `block_ids[c]` (integers, in range;
    no block written twice by a scatter) lists its blocks; on a scatter the first
    `skip_blocks[c]` blocks of chunk c are neither read nor written (None: none skipped).
    The copies move the same bytes as `transfer_reference` with `chunks[c]` as staging
    row c, one per family of (kv, layer) views one strided array spans (one family for
    all layers of a one-buffer cache) and per run of consecutive block ids of a chunk
    (whole chunks evenly spaced both in their storage and in the cache: one copy of up
    to `MERGE_BYTES` for several), or, for a chunk of more than `MAX_RUNS` runs, per
    family over its blocks by index. A run's copy is `copyto(dst, src)` (`np.copyto`'s
    contract for arrays of one shape).
    """
    num_chunks, per_chunk = (int(n) for n in block_ids.shape)
    if num_chunks == 0:
        return []
    plan = _chunk_plan(layout, per_chunk)
    memory = _ChunkMemory(chunks, layout.chunk_nbytes(per_chunk * layout.block_size))
    copies = []
    runs, scattered = _block_runs(block_ids, skip_blocks)
    most = max(1, MERGE_BYTES // memory.nbytes)
    for buffer, span in _spans(runs, memory, per_chunk, most):
        for fam in plan:
            side, cache = fam.chunk_side(buffer, span), fam.cache_side(span)
            dst, src = (side, cache) if gather else (cache, side)
            copies.append(Copy(side.nbytes, partial(copyto, dst, src)))
    for c, skip in scattered:
        buffer, base = memory.locate(c)
        index = block_ids[c, skip:]
        kept = _Span(base, 0, 1, skip, per_chunk - skip, 0, 0)  # its blocks not skipped
        for fam in plan:
            side = fam.chunk_side(buffer, kept)[0]
            run = (
                partial(_gather_into, side, fam.cache, index)
                if gather
                else partial(fam.cache.__setitem__, index, side)
            )
            copies.append(Copy(side.nbytes, run))
    return copies


def _spans(
    runs: Iterable[tuple[int, int, int, int]], memory: _ChunkMemory, per_chunk: int, most: int
) -> Iterator[tuple[np.ndarray, _Span]]:
    """The runs (chunk, position, blocks, first block) as spans, each with its chunks'
    storage. A whole chunk joins the span of whole chunks before it, up to `most` chunks,
    when it lies in the same storage one address step and one block step on from the
    span's last chunk: the span's steps once it has two chunks, else any steps at which
    neither chunks nor blocks overlap. Any other run is a span of its own. (Plain locals,
    not a span per run: this loop is most of the cost of a copy list of small chunks.)"""
    nbytes, current, base = memory.nbytes, -1, 0
    buffer = held = np.empty(0, dtype=np.uint8)
    chunks = step = block_step = 0  # the span being grown: chunks 0 while there is none
    first = _Span(0, 0, 1, 0, 0, 0, 0)  # its first run
    whole, last_base, last_block = False, 0, 0  # whether its runs are whole; its last chunk
    for c, pos, count, block in runs:
        if c != current:
            current = c
            buffer, base = memory.locate(c)
        if whole and chunks < most and buffer is held and pos == 0 and count == per_chunk:
            next_step, next_block_step = base - last_base, block - last_block
            if chunks == 1:
                joins = abs(next_step) >= nbytes and abs(next_block_step) >= per_chunk
            else:
                joins = next_step == step and next_block_step == block_step
            if joins:
                chunks, step, block_step = chunks + 1, next_step, next_block_step
                last_base, last_block = base, block
                continue
        if chunks:
            yield held, first._replace(step=step, chunks=chunks, block_step=block_step)
        first, held = _Span(base, 0, 1, pos, count, block, 0), buffer  # a new span
        chunks, step, block_step = 1, 0, 0
        whole, last_base, last_block = pos == 0 and count == per_chunk, base, block
    if chunks:
        yield held, first._replace(step=step, chunks=chunks, block_step=block_step)


def _gather_into(dst: np.ndarray, cache: np.ndarray, index: np.ndarray) -> None:
    """Copy the blocks `index` of `cache` into `dst` (numpy gathers into a temporary)."""
    np.copyto(dst, cache[index])


def _block_runs(
    block_ids: np.ndarray, skip_blocks: np.ndarray | None
) -> tuple[Iterable[tuple[int, int, int, int]], list[tuple[int, int]]]:
    """(chunk, first position, blocks, first block id) of each run of consecutive block
    ids among the blocks not skipped of each chunk of at most `MAX_RUNS` runs, chunk by
    chunk in order; and (chunk, skipped blocks) of each chunk of more runs."""
    num_chunks, per_chunk = block_ids.shape
    if (skip_blocks is None or not skip_blocks.any()) and (
        per_chunk == 1 or bool((block_ids[:, 1:] == block_ids[:, :-1] + 1).all())
    ):  # the common case, a few microseconds: every chunk whole and one run
        firsts = block_ids[:, 0].tolist()
        return zip(range(num_chunks), repeat(0), repeat(per_chunk), firsts, strict=False), []
    pos = np.arange(per_chunk)
    skip = np.zeros(num_chunks, dtype=np.int64) if skip_blocks is None else skip_blocks
    keep = pos[None, :] >= skip[:, None]
    starts = keep.copy()  # a kept block starts a run unless it follows its predecessor's id
    starts[:, 1:] &= (block_ids[:, 1:] != block_ids[:, :-1] + 1) | ~keep[:, :-1]
    many = np.flatnonzero(starts.sum(axis=1) > MAX_RUNS)
    starts[many] = False
    ends = keep.copy()  # kept positions are a suffix: a run ends before the next start
    ends[:, :-1] &= starts[:, 1:]
    ends[many] = False
    first, last = np.flatnonzero(starts), np.flatnonzero(ends)
    runs = zip(
        (first // per_chunk).tolist(),
        (first % per_chunk).tolist(),
        (last - first + 1).tolist(),
        block_ids.reshape(-1)[first].tolist(),
        strict=True,
    )
    return runs, list(zip(many.tolist(), skip[many].tolist(), strict=True))


def _chunk_plan(layout: KVLayout, per_chunk: int) -> list[_Family]:
    """Every group's families, in chunk order, for chunks of `per_chunk` blocks (cached
    on the layout)."""
    key = ("chunk_copies", per_chunk)
    cached: list[_Family] | None = layout.plan_cache.get(key)
    if cached is None:
        if layout.device.type != "cpu":
            raise ValueError(f"chunk_copies moves CPU caches; this one is on {layout.device}")
        tokens = per_chunk * layout.block_size
        offsets = layout.group_offsets(tokens)
        cached = [
            fam
            for i, (g, off) in enumerate(zip(layout.groups, offsets, strict=True))
            for fam in _group_families(layout, i, g, off, tokens)
        ]
        layout.plan_cache[key] = cached
    return cached


class _ChunkMemory:
    """Finds chunks by address in the storages seen so far (L1 objects share a few big
    segments): a tensor view per chunk would cost more than the rest of its copies."""

    def __init__(self, chunks: ChunkBuffers, nbytes: int) -> None:
        self.chunks, self.nbytes = chunks, nbytes
        self.storages: list[tuple[int, np.ndarray]] = []  # (address, all its bytes)

    def locate(self, index: int) -> tuple[np.ndarray, int]:
        """The bytes of the storage holding chunk `index`, and the chunk's offset there."""
        address = self.chunks.address(index, self.nbytes)
        for start, buffer in self.storages:
            if start <= address and address + self.nbytes <= start + buffer.size:
                return buffer, address - start
        start, buffer = _storage_bytes(self.chunks[index].untyped_storage())
        self.storages.append((start, buffer))
        return buffer, address - start


def _storage_bytes(storage: torch.UntypedStorage) -> tuple[int, np.ndarray]:
    """A CPU storage's address and all its bytes as a numpy uint8 array (sharing them):
    arrays made over it are bounds-checked against the whole storage."""
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return storage.data_ptr(), raw.numpy()


@dataclass(frozen=True)
class _View:
    """One (layer, kv) block view's memory: its storage, address and byte strides
    (block, token, head; 0 on an axis of one, whose stride never moves)."""

    storage: torch.UntypedStorage
    ptr: int
    strides: tuple[int, int, int]

    @classmethod
    def of(cls, view: torch.Tensor) -> _View:
        def stride(dim: int) -> int:
            return 0 if view.shape[dim] == 1 else view.stride(dim) * view.element_size()

        return cls(view.untyped_storage(), view.data_ptr(), (stride(0), stride(1), stride(2)))

    def same_memory(self, other: _View) -> bool:
        """Whether `other` lies in the same storage with the same strides."""
        mine, theirs = self.storage, other.storage
        return (mine.data_ptr(), mine.nbytes(), self.strides) == (
            theirs.data_ptr(),
            theirs.nbytes(),
            other.strides,
        )


def _group_families(
    layout: KVLayout, index: int, group: LayerGroup, offset: int, tokens: int
) -> list[_Family]:
    """Split group `index`'s (kv, layer) views into as few affine families as their
    addresses allow, read in the widest word (8, 4, 2 or 1 bytes) every address and
    stride of the group allows; `offset`: the group's byte offset in a chunk."""
    views = [
        [_View.of(layout.block_views[layer][kv]) for kv in range(group.kv_size)]
        for layer in group.layers
    ]
    spans = _families(views, group.kv_size)
    row, nb, bs, nh = group.row_bytes, layout.num_blocks, layout.block_size, group.num_heads
    # chunk side: [blocks, kv, layers, block_size] byte strides of [kv, layers, tokens, row]
    block, kv_part, layer_part = bs * row, len(group.layers) * tokens * row, tokens * row
    sizes = [group.head_bytes, offset, block, kv_part, layer_part, row]
    for kv, layers, kv_stride, layer_stride in spans:
        first = views[layers.start][kv.start]
        sizes += [first.ptr, kv_stride, layer_stride, *first.strides]
    align = math.gcd(*sizes)
    word = np.dtype(f"<u{min(8, align & -align)}")
    inner = (nh, group.head_bytes // word.itemsize)
    out = []
    for kv, layers, kv_stride, layer_stride in spans:
        first = views[layers.start][kv.start]
        start, raw = _storage_bytes(first.storage)
        tail = (kv.stop - kv.start, layers.stop - layers.start, bs, *inner)
        cache = np.ndarray(
            (nb, *tail), word, buffer=raw, offset=first.ptr - start,
            strides=(first.strides[0], kv_stride, layer_stride, *first.strides[1:], word.itemsize),
        )  # fmt: skip
        strides = (block, kv_part, layer_part, row, group.head_bytes, word.itemsize)
        at = offset + kv.start * kv_part + layers.start * layer_part
        out.append(_Family(index, kv, layers, cache, raw, first.ptr - start, at, strides, tail))
    return out


def _families(views: list[list[_View]], kv_size: int) -> list[tuple[slice, slice, int, int]]:
    """(kv slice, layer slice, kv stride, layer stride) of each family: every K/V of a
    layer together when each layer's K and V lie in one storage at a positive distance,
    else each K/V alone; then runs of layers at one positive distance in one storage."""

    def kv_stride(layer: list[_View]) -> int:
        return layer[1].ptr - layer[0].ptr if kv_size == 2 else 0

    together = kv_size == 1 or all(
        layer[0].same_memory(layer[1]) and kv_stride(layer) > 0 for layer in views
    )
    spans = [slice(0, kv_size)] if together else [slice(kv, kv + 1) for kv in range(kv_size)]
    out = []
    for span in spans:
        start = 0
        while start < len(views):
            first = views[start][span.start]
            step = kv_stride(views[start]) if together else 0
            end, distance = start + 1, 0
            while end < len(views):
                here = views[end][span.start]
                gap = here.ptr - views[end - 1][span.start].ptr
                same = here.same_memory(first) and (not together or kv_stride(views[end]) == step)
                if not same or gap <= 0 or (distance and gap != distance):
                    break
                distance, end = gap, end + 1
            out.append((span, slice(start, end), step, distance))
            start = end
    return out
