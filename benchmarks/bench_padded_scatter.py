"""Scatter into padded rows: kvflow's kernel next to hand-written bounds, in one run.

The case is `sgl-mla-int8-h132-pad` of bench_kernels: 132-byte int8 rows at a 148-byte
stride, in 16-row blocks at random block ids. The 16 pad bytes after each row belong to
no row of the tensor, so every 32-byte sector holding pad bytes is written only in part.
Hand-written kernels (benchmarks/csrc/padded_scatter.cu) move the same number of rows
into a cache of the same shape and show what each way of treating the pad reaches:
only the owned bytes (as kvflow must), or whole granules with the pad read back and
rewritten (safe only while nothing else writes the pad), or zeroed (destroys it). Every
kernel's result is checked before it is timed; all are timed interleaved with a
same-bytes device copy. GB/s count bytes read plus bytes written. Needs a CUDA GPU and
pycuda.

    python benchmarks/bench_padded_scatter.py [--chunks 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_kernels import CASES, case_data, reps_for, same_bytes_copy, time_interleaved

from kvflow.kernels import cuda_available, new_transfer_stream
from kvflow.kernels.cuda_backend import DEFAULT_TUNING
from kvflow.kernels.loader import DEFAULT_OPTIONS, get_function
from kvflow.kernels.streams import TransferStream

CASE = "sgl-mla-int8-h132-pad"
ROW_BYTES, ROW_STRIDE, BLOCK_ROWS = 132, 148, 16
SOURCE = Path(__file__).resolve().parent / "csrc" / "padded_scatter.cu"
THREADS, CTAS_PER_SM = 256, 8
# kernel -> what it does to the pad bytes (the table's second column)
PAD = {
    "owned_words": "kept (owned bytes only)",
    "owned_words_prefetched": "kept (owned bytes only)",
    "pad_rewritten": "read back and rewritten",
    "pad_zeroed": "overwritten with zeros",
}


class PaddedCache:
    """A flat cache of padded 16-row blocks, twice the blocks moved, and linear rows."""

    def __init__(self, blocks: int, seed: int = 0) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        span = BLOCK_ROWS * ROW_STRIDE
        self.blocks = blocks
        self.ids = torch.randperm(2 * blocks, device="cuda", generator=gen)[:blocks].int()
        self.cache = torch.randint(
            0, 256, (2 * blocks * span,), dtype=torch.uint8, device="cuda", generator=gen
        )
        self.rows = torch.randint(
            0, 256, (blocks * BLOCK_ROWS * ROW_BYTES,), dtype=torch.uint8, device="cuda",
            generator=gen,
        )  # fmt: skip

    def picked(self) -> torch.Tensor:
        """The moved blocks, [blocks, BLOCK_ROWS, ROW_STRIDE] bytes (a copy)."""
        return self.cache.view(-1, BLOCK_ROWS, ROW_STRIDE)[self.ids.long()]


def compile_kernels(stream: TransferStream) -> dict[str, Any]:
    """The hand-written kernels, built for this GPU with the layout's sizes (through the
    package's loader: compiled once, cached on disk)."""
    index = stream.device.index
    assert index is not None
    sizes = (f"-DROW_BYTES={ROW_BYTES}", f"-DROW_STRIDE={ROW_STRIDE}", f"-DBLOCK_ROWS={BLOCK_ROWS}")
    options = (*DEFAULT_OPTIONS, *sizes)
    return {name: get_function(index, str(SOURCE), name, options) for name in PAD}


def launcher(function: Any, padded: PaddedCache, stream: TransferStream) -> Callable[[], object]:
    """One launch of a hand-written scatter of every row, on the transfer stream."""
    sms = torch.cuda.get_device_properties(stream.device).multi_processor_count
    args = (
        np.uint64(padded.rows.data_ptr()),
        np.uint64(padded.cache.data_ptr()),
        np.uint64(padded.ids.data_ptr()),
        np.int64(padded.blocks),
    )
    grid, block = (sms * CTAS_PER_SM, 1, 1), (THREADS, 1, 1)
    return lambda: function(*args, grid=grid, block=block, stream=stream.pycuda)


def check(
    name: str, scatter: Callable[[], object], padded: PaddedCache, stream: TransferStream
) -> None:
    """Run one scatter; the rows must land and the pad must be kept or zeroed as it says."""
    before = padded.picked()
    scatter()
    stream.synchronize()
    after = padded.picked()
    rows = after[..., :ROW_BYTES].reshape(-1)
    pad, old_pad = after[..., ROW_BYTES:], before[..., ROW_BYTES:]
    expected_pad = torch.zeros_like(pad) if name == "pad_zeroed" else old_pad
    if not torch.equal(rows, padded.rows):
        raise SystemExit(f"{name}: the rows did not land where the block ids say")
    if not torch.equal(pad, expected_pad):
        raise SystemExit(f"{name}: the pad bytes are not {PAD[name]}")


def main() -> None:
    """Check every kernel, time them all interleaved with the copy, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=None, help="chunks of 256 tokens moved")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    if args.chunks is not None and args.chunks < 1:
        parser.error("--chunks must be at least 1")
    if not cuda_available():
        raise SystemExit("bench_padded_scatter needs a CUDA GPU and pycuda")
    case = next(c for c in CASES if c.name == CASE)
    if args.chunks is not None:
        case = replace(case, chunks=args.chunks)
    stream = new_transfer_stream(torch.device("cuda", torch.cuda.current_device()))
    data = case_data(case)
    moved = data.moved
    padded = PaddedCache(moved // (BLOCK_ROWS * ROW_BYTES))
    fns: dict[str, Callable[[], object]] = {
        "copy": same_bytes_copy(moved),
        "kvflow": data.kernel(False, DEFAULT_TUNING, stream),
    }
    for name, function in compile_kernels(stream).items():
        fns[name] = launcher(function, padded, stream)
        check(name, fns[name], padded, stream)
    ms = time_interleaved(fns, stream, reps_for(moved), rounds=9)
    gbps = {name: 2 * moved / (t * 1e-3) / 1e9 for name, t in ms.items()}
    pads = {"copy": "-", "kvflow": "kept (owned bytes only)", **PAD}
    print(f"GPU: {torch.cuda.get_device_name()}  {case.name}, {moved / 2**20:.0f} MiB moved")
    print(f"{'scatter':24s} {'pad bytes':26s} {'GB/s':>6s} {'/copy':>6s}")
    for name in fns:
        ratio = gbps[name] / gbps["copy"]
        print(f"{name:24s} {pads[name]:26s} {gbps[name]:6.0f} {ratio:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "ms": ms, "gbps": gbps}, f, indent=1)


if __name__ == "__main__":
    main()
