"""Layer-by-layer transfers: a prefix copied one layer at a time, each layer signalled.

The engine reads layer i's KV right before layer i's attention, so a retrieve that
lands layer by layer, in order, lets layer i compute while layer i+1 still copies; a
store that takes layer i as soon as the forward pass wrote it overlaps the rest of the
pass (docs/ENGINE.md, "Layerwise retrieves" and "Layerwise stores"). A chunk holds, per
layer group, [kv, layers, tokens, row]: one layer's part of a chunk is `kv_size` runs
(`KVLayout.layer_parts`), and `KVLayout.layer_layout` is the layout whose chunk is
exactly those runs back to back, so each layer moves with the ordinary block kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from kvflow.core.tiers.base import HostChunks
from kvflow.kernels import KVLayout, PreparedTransfer


class LayerSignal(Protocol):
    """Where a layerwise retrieve tells the engine that a layer's KV may be read."""

    def ready(self, layer: int, stream: Any) -> None:
        """Layer `layer`'s copies are queued on `stream` (a TransferStream), or done
        already when `stream` is None (CPU caches)."""
        ...

    def failed(self, first_layer: int) -> None:
        """The retrieve failed after its reply: layers from `first_layer` on never land."""
        ...


class Staging(Protocol):
    """A ring of slots the engine owns, each holding a staged span of layers: the server
    copies the layers' runs there (the copy engine alone, no kernel) and the engine
    scatters them into its blocks in its own process, one launch a span
    (kvflow.core.server.staging). Without MPS a block kernel the server launches waits
    for a GPU time slice while the engine computes."""

    slot_bytes: int

    def claim(self) -> torch.Tensor:
        """The next slot (uint8, `slot_bytes`) once the engine's scatter of what it held
        last has run, so any copy queued into it after this call comes after that
        scatter. Raises when the engine never frees it."""
        ...

    def staged(
        self, first_layer: int, layers: int, rows: int, chunk_tokens: int, stream: Any
    ) -> None:
        """The claimed slot holds layers [first_layer, first_layer + layers) of the
        `rows` chunks the retrieve writes (row c: chunk c's runs of them,
        `KVLayout.span_parts` of `chunk_tokens`), its copies queued on `stream` (done,
        when None)."""
        ...


def staged_rows(slot: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """A staging slot's first `count` rows of `width` bytes: row c is chunk c's runs of a
    span of layers, as the server writes them and the engine reads them (callers check
    the fit)."""
    return slot[: count * width].view(count, width)


def stage_span(
    layout: KVLayout,
    layer: int,
    chunks: int,
    chunk_tokens: int,
    slot_bytes: int,
    staged: Callable[[int], bool],
) -> int:
    """How many layers from `layer` on go into one slot of `slot_bytes` (0: not even
    `layer` fits). At most `layer` of them (at least one), so the first layers, which the
    forward pass reads soonest, go alone and the spans grow as the engine's reads fall
    behind the copies: fewer scatters for the engine to launch, one each a span. A span
    holds only layers next to each other in one group (`KVLayout.span_fits`), every one
    of which `staged(l)` says the ring takes (not copied straight into its blocks)."""
    width = sum(n for _, n in layout.layer_parts(layer, chunk_tokens))
    count = min(slot_bytes // max(1, chunks * width), max(1, layer), layout.num_layers - layer)
    if count < 1:
        return 0
    span = 1
    while span < count and layout.span_fits(layer, span + 1) and staged(layer + span):
        span += 1
    return span


class WrittenSignal(Protocol):
    """Where a layerwise store learns that the engine wrote a layer."""

    def wait_written(self, layer: int, stream: Any) -> None:
        """Return once layer `layer` is written; with a `stream` (a TransferStream), work
        queued on it after this call is also ordered after the engine's writes.
        Raises (a timeout, a failed engine) when the layer never comes."""
        ...


def _layer_buffer(layout: KVLayout, chunk_tokens: int, count: int) -> torch.Tensor:
    """Bytes for any one layer of `count` chunks: the stage a CPU layerwise op reuses."""
    widest = max(
        sum(n for _, n in layout.layer_parts(layer, chunk_tokens))
        for layer in range(layout.num_layers)
    )
    return torch.empty(count * widest, dtype=torch.uint8)


def _layer_rows(
    layout: KVLayout, layer: int, chunk_tokens: int, buffer: torch.Tensor, count: int
) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """(the layer's runs in a chunk, its [count, layer bytes] rows in `buffer`)."""
    parts = layout.layer_parts(layer, chunk_tokens)
    width = sum(n for _, n in parts)
    return parts, buffer[: count * width].view(count, width)


def _copy_runs(
    rows: torch.Tensor, chunks: HostChunks, parts: list[tuple[int, int]], *, to_rows: bool
) -> None:
    """Copy each chunk's layer runs (`parts` of `chunks[c]`) to (or from) row c of `rows`."""
    at = 0
    for offset, n in parts:
        for c in range(len(chunks)):
            run = chunks[c][offset : offset + n]
            if to_rows:
                rows[c, at : at + n].copy_(run)
            else:
                run.copy_(rows[c, at : at + n])
        at += n


def cpu_scatter_layers(
    layout: KVLayout,
    chunk_tokens: int,
    srcs: HostChunks,
    table: np.ndarray,
    skip_blocks: Sequence[int],
    ready: Callable[[int, Any], None],
    staging: Staging | None = None,
) -> None:
    """Write each layer of `srcs` into the CPU cache's blocks (row c of `table`: chunk
    c's blocks, its first skip_blocks[c] untouched), layer 0 first, each followed by
    `ready(layer, None)`. With `staging`, a layer that fits one of its slots goes there
    instead, for the engine to scatter, with the layers after it that share the slot
    (`stage_span`)."""
    if not len(srcs):
        for layer in range(layout.num_layers):
            ready(layer, None)
        return
    buffer = _layer_buffer(layout, chunk_tokens, len(srcs))
    layer = 0
    while layer < layout.num_layers:
        span = 0
        if staging is not None:
            span = stage_span(
                layout, layer, len(srcs), chunk_tokens, staging.slot_bytes, lambda _: True
            )
        if span:
            assert staging is not None
            parts = layout.span_parts(layer, span, chunk_tokens)
            slot = staged_rows(staging.claim(), len(srcs), sum(n for _, n in parts))
            _copy_runs(slot, srcs, parts, to_rows=True)
            staging.staged(layer, span, len(srcs), chunk_tokens, None)
            for each in range(layer, layer + span):
                ready(each, None)
            layer += span
            continue
        parts, rows = _layer_rows(layout, layer, chunk_tokens, buffer, len(srcs))
        _copy_runs(rows, srcs, parts, to_rows=True)
        moves = PreparedTransfer.trusted(
            layout.layer_layout(layer), table, skip_blocks, gather=False, backend="cpu"
        )
        moves.launch_trusted(rows, 0, len(srcs))
        ready(layer, None)
        layer += 1


def cpu_gather_layers(
    layout: KVLayout,
    chunk_tokens: int,
    table: np.ndarray,
    dsts: HostChunks,
    written: WrittenSignal,
) -> None:
    """Copy each layer of the blocks in `table` (row c: chunk c's blocks) into its runs
    of `dsts[c]`, layer 0 first, each once `written` says the engine wrote it."""
    if not len(dsts):
        return
    buffer = _layer_buffer(layout, chunk_tokens, len(dsts))
    for layer in range(layout.num_layers):
        written.wait_written(layer, None)
        parts, rows = _layer_rows(layout, layer, chunk_tokens, buffer, len(dsts))
        moves = PreparedTransfer.trusted(
            layout.layer_layout(layer), table, gather=True, backend="cpu"
        )
        moves.launch_trusted(rows, 0, len(dsts))
        _copy_runs(rows, dsts, parts, to_rows=False)
