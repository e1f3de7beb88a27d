"""Copies that put a layer of L1 objects straight into an engine's KV blocks (no kernel).

A layerwise retrieve overlaps its copies with the engine's forward pass, which runs in
another process. Without MPS the GPU time-slices between the two processes' contexts, so
a block kernel launched by the server waits for the engine's time slice to end: measured
on the H200, a 0.4 ms scatter took 2.6 ms to finish while another process ran attention
kernels, while host-to-device copies ran at full speed (docs/perf-journal.md,
2026-11-29). Where a layer's blocks are laid out so that its bytes in an L1 object are
whole blocks in block order (heads contiguous in a token, tokens in a block), the copy
engine alone can place them: one 2-D copy per run of evenly spaced, block-contiguous
pieces. Blocks the engine allocated in order (a fresh request) make one copy per K and
V per layer; a fragmented block table makes more, and past `MAX_DIRECT_COPIES` per layer
the caller stages and scatters instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvflow.cuda import MAX_PITCH
from kvflow.kernels import KVLayout

#: most driver copies a layer may take straight into its blocks (~5-10 us of host time
#: each); a more fragmented table goes through the staging ring and a scatter kernel
MAX_DIRECT_COPIES = 64


class Copy2D(NamedTuple):
    """One 2-D copy: `height` rows of `width` bytes, each row `*_pitch` after the last."""

    dst: int
    dst_pitch: int
    src: int
    src_pitch: int
    width: int
    height: int


class DirectLayers:
    """Per layer, the 2-D copies from L1 objects (host addresses `hosts`, chunk c's at
    `hosts[c]`, in region `regions[c]`: `HostChunks.region`, all in one when not given)
    into the blocks of `table` (row c: chunk c's blocks), leaving each chunk's first
    `skip_blocks[c]` blocks untouched; None for a layer that must be staged. No copy
    spans two regions (the driver refuses a copy across two registrations)."""

    def __init__(
        self,
        layout: KVLayout,
        table: np.ndarray,
        skip_blocks: Sequence[int],
        hosts: Sequence[int],
        chunk_tokens: int,
        max_copies: int = MAX_DIRECT_COPIES,
        *,
        regions: Sequence[int] | None = None,
    ) -> None:
        self.layout, self.chunk_tokens, self.max_copies = layout, chunk_tokens, max_copies
        self._table = np.asarray(table, dtype=np.int64)
        self._skip = np.asarray(skip_blocks, dtype=np.int64)
        self._hosts = np.asarray(hosts, dtype=np.int64)
        self._regions = np.asarray(
            regions if regions is not None else [0] * len(hosts), dtype=np.int64
        )
        #: (block stride, block bytes) -> runs relative to the host addresses and block 0
        self._runs: dict[tuple[int, int], list[Copy2D] | None] = {}

    def copies(self, layer: int) -> list[Copy2D] | None:
        """The layer's copies (every K/V part), or None when its blocks do not hold the
        object's bytes in order or it would take more than `max_copies` copies."""
        group = next(g for g in self.layout.groups if layer in g.layers)
        block_bytes = self.layout.block_size * group.row_bytes
        out: list[Copy2D] = []
        for kv, (offset, _) in enumerate(self.layout.layer_parts(layer, self.chunk_tokens)):
            desc = self.layout.stride_desc(layer, kv)
            heads_in_order = group.num_heads == 1 or desc.head == group.head_bytes
            tokens_in_order = self.layout.block_size == 1 or desc.token == group.row_bytes
            in_order = heads_in_order and tokens_in_order
            if not in_order or desc.block < block_bytes:
                return None
            runs = self._relative_runs(desc.block, block_bytes)
            if runs is None or len(out) + len(runs) > self.max_copies:
                return None
            out += [run._replace(dst=desc.base_ptr + run.dst, src=offset + run.src) for run in runs]
        return out

    def _relative_runs(self, block_stride: int, block_bytes: int) -> list[Copy2D] | None:
        """The copies of one part at offset 0 into a cache based at 0 (cached: every
        layer with the same block stride shares them); None past `max_copies`."""
        key = (block_stride, block_bytes)
        if key not in self._runs:
            self._runs[key] = self._plan(block_stride, block_bytes)
        return self._runs[key]

    def _plan(self, block_stride: int, block_bytes: int) -> list[Copy2D] | None:
        per_chunk = self._table.shape[1]
        index = np.arange(per_chunk, dtype=np.int64)
        keep = index[None, :] >= self._skip[:, None]
        src = (self._hosts[:, None] + index[None, :] * block_bytes)[keep]
        dst = (self._table * block_stride)[keep]
        region = np.broadcast_to(self._regions[:, None], keep.shape)[keep]
        if not src.size:
            return []
        # pieces: maximal stretches of blocks contiguous on both sides, in one region
        apart = (np.diff(src) != block_bytes) | (np.diff(dst) != block_bytes)
        cut = np.flatnonzero(apart | (np.diff(region) != 0)) + 1
        starts = np.concatenate(([0], cut))
        if _fewest_copies(dst[starts]) > self.max_copies:  # shuffled blocks: said cheaply
            return None
        widths = np.diff(np.concatenate((starts, [src.size]))) * block_bytes
        return _rows(
            src[starts].tolist(), dst[starts].tolist(), widths.tolist(),
            region[starts].tolist(), self.max_copies,
        )  # fmt: skip


def _fewest_copies(dsts: np.ndarray) -> int:
    """A lower bound on the 2-D copies `_rows` makes of pieces at destinations `dsts`:
    a copy's pieces step by one pitch, so the steps between pieces change value only
    at the two sides of a step from one copy to the next (c copies: at most 2(c - 1)
    changes)."""
    changes = int(np.count_nonzero(np.diff(np.diff(dsts)))) if dsts.size > 2 else 0
    return changes // 2 + 1 if changes else min(dsts.size, 1)


def _rows(
    srcs: list[int], dsts: list[int], widths: list[int], regions: list[int], most: int
) -> list[Copy2D] | None:
    """Group pieces (source, destination, width, source region) into 2-D copies:
    consecutive pieces of one width and region whose sources and destinations each step
    by one pitch (at least the width, so rows never overlap, at most MAX_PITCH) share a
    copy. None past `most` copies."""
    copies: list[Copy2D] = []
    i, n = 0, len(srcs)
    while i < n:
        width, stop = widths[i], i + 1
        if stop < n and widths[stop] == width and regions[stop] == regions[i]:
            src_pitch, dst_pitch = srcs[stop] - srcs[i], dsts[stop] - dsts[i]
            if width <= src_pitch <= MAX_PITCH and width <= dst_pitch <= MAX_PITCH:
                while (
                    stop < n
                    and widths[stop] == width
                    and regions[stop] == regions[i]
                    and srcs[stop] - srcs[stop - 1] == src_pitch
                    and dsts[stop] - dsts[stop - 1] == dst_pitch
                ):
                    stop += 1
        height = stop - i
        pitches = (dsts[i + 1] - dsts[i], srcs[i + 1] - srcs[i]) if height > 1 else (width, width)
        copies.append(Copy2D(dsts[i], pitches[0], srcs[i], pitches[1], width, height))
        if len(copies) > most:
            return None
        i = stop
    return copies
