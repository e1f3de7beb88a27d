"""Block-transfer kernel throughput vs a same-run device copy and the torch reference.

For each case (format, dtype, block size, vector width) it times gather (cache ->
staging) and scatter (staging -> cache) of the same chunks, a device-to-device copy of
the same number of bytes, and the torch index_select/index_put reference. GB/s count
bytes read plus bytes written (2 x bytes moved), like the copy ceiling. Needs a CUDA GPU
and pycuda; prints a table, optionally writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.kernels import KVFormat, KVLayout, cuda_available, new_transfer_stream
from kvflow.kernels.cuda_backend import DEFAULT_TUNING, KernelTuning, UploadedTransfer
from kvflow.kernels.plan import build_plan
from kvflow.kernels.reference import transfer_reference
from kvflow.kernels.streams import TransferStream
from kvflow.kernels.synthetic import make_kv_caches

BF16, FP8, INT8, UINT8 = torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.uint8


@dataclass(frozen=True)
class Case:
    """One benchmark configuration: a cache shape, a chunk size and a vector-width cap."""

    name: str
    fmt: KVFormat
    cache: dict[str, Any]
    chunk_tokens: int
    chunks: int
    max_vec: int = 16


def _mha(
    layers: int = 32,
    heads: int = 8,
    size: int = 128,
    dtype: torch.dtype = BF16,
    block: int = 16,
    **kw: Any,
) -> dict[str, Any]:
    return {
        "num_layers": layers,
        "num_heads": heads,
        "head_size": size,
        "dtype": dtype,
        "block_size": block,
        **kw,
    }


CASES = [
    Case("fa-bf16-32K", KVFormat.VLLM_FLASH_ATTN, _mha(), 256, 16),
    Case("fa-bf16-32K-v8", KVFormat.VLLM_FLASH_ATTN, _mha(), 256, 16, max_vec=8),
    Case("fa-bf16-32K-v4", KVFormat.VLLM_FLASH_ATTN, _mha(), 256, 16, max_vec=4),
    Case("fa-bf16-32K-v2", KVFormat.VLLM_FLASH_ATTN, _mha(), 256, 16, max_vec=2),
    Case("fa-bf16-32K-v1", KVFormat.VLLM_FLASH_ATTN, _mha(), 256, 16, max_vec=1),
    Case("fa-fp8-16K", KVFormat.VLLM_FLASH_ATTN, _mha(dtype=FP8), 256, 32),
    Case("fa-bf16-4K", KVFormat.VLLM_FLASH_ATTN, _mha(heads=1), 256, 128),
    Case("fi-bf16-HND-32K", KVFormat.VLLM_FLASHINFER, _mha(noncontiguous=True), 256, 16),
    Case(
        "fi-int8-HND-h132",
        KVFormat.VLLM_FLASHINFER,
        _mha(size=132, dtype=INT8, noncontiguous=True),
        256,
        32,
    ),
    Case(
        "fi-int8-HND-h132-v4",
        KVFormat.VLLM_FLASHINFER,
        _mha(size=132, dtype=INT8, noncontiguous=True),
        256,
        32,
        max_vec=4,
    ),
    Case(
        "fi-u8-HND-h129",
        KVFormat.VLLM_FLASHINFER,
        _mha(size=129, dtype=UINT8, noncontiguous=True),
        256,
        32,
    ),
    Case(
        "fi-u8-HND-h129-v1",
        KVFormat.VLLM_FLASHINFER,
        _mha(size=129, dtype=UINT8, noncontiguous=True),
        256,
        32,
        max_vec=1,
    ),
    Case("fi-bf16-HND-h65", KVFormat.VLLM_FLASHINFER, _mha(size=65, noncontiguous=True), 256, 16),
    Case(
        "fi-bf16-HND-h65-v2",
        KVFormat.VLLM_FLASHINFER,
        _mha(size=65, noncontiguous=True),
        256,
        16,
        max_vec=2,
    ),
    Case("cross-bf16-32K", KVFormat.VLLM_CROSS_LAYER, _mha(), 256, 16),
    Case("sgl-mha-bf16-bs1", KVFormat.SGLANG_MHA, _mha(block=1), 256, 16),
    Case(
        "mla-bf16-1024tok",
        KVFormat.VLLM_MLA,
        _mha(layers=61, heads=1, size=576, block=1024),
        1024,
        4,
    ),
    Case(
        "mla-int8-h132", KVFormat.VLLM_MLA, _mha(layers=61, heads=1, size=132, dtype=INT8), 256, 256
    ),
    # DeepSeek's fp8 MLA rows (512 fp8 + 16 scale bytes + 64 bf16 rope = 656 bytes)
    Case(
        "mla-u8-h656", KVFormat.VLLM_MLA, _mha(layers=61, heads=1, size=656, dtype=UINT8), 256, 50
    ),
    Case(
        "sgl-mla-int8-h132-pad",
        KVFormat.SGLANG_MLA,
        _mha(layers=61, heads=1, size=132, dtype=INT8, noncontiguous=True),
        256,
        256,
    ),
]


VARIANTS = {
    "default": DEFAULT_TUNING,
    "iters1": KernelTuning(iters=1),
    "iters2": KernelTuning(iters=2),
    "witers2": KernelTuning(wide_iters=2),
    "witers4": KernelTuning(wide_iters=4),
    "occ6": KernelTuning(linear_min_ctas=6),
    "lane128": KernelTuning(lane_bytes=128),
    "cs": KernelTuning(stream_loads=True, stream_stores=True),
    "ld-cs": KernelTuning(stream_loads=True),
    "st-cs": KernelTuning(stream_stores=True),
    "untiled": KernelTuning(tiled=False),
    "tiled8": KernelTuning(tiled_min_ctas=8),
}


def same_bytes_copy(moved: int) -> Callable[[], object]:
    """A device-to-device copy of `moved` bytes: the ceiling every kernel is compared with."""
    src = torch.randint(0, 256, (moved,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def reps_for(moved: int) -> int:
    """Calls queued back to back per timed block: ~10 GB of traffic, 3 to 20 calls."""
    return max(3, min(20, int(1e10 // moved)))


def _time_ms(fn: Callable[[], object], stream: TransferStream, reps: int, rounds: int) -> float:
    """Median over rounds of the mean GPU time per call, with reps calls queued back to back."""
    return time_interleaved({"fn": fn}, stream, reps, rounds)["fn"]


def time_interleaved(
    fns: dict[str, Callable[[], object]], stream: TransferStream, reps: int, rounds: int
) -> dict[str, float]:
    """Per function, the median over rounds of its mean time per call (ms).

    Rounds alternate between the functions (rotating which goes first), and before each
    timed block a read of a buffer larger than L2 flushes the dirty lines the previous
    function left, so no function pays for another's write-back and ratios stay fair.
    """
    flush = torch.empty(2**28, dtype=torch.uint8, device=stream.device)
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    with torch.cuda.stream(stream.torch):
        flush.zero_()
        for fn in fns.values():
            for _ in range(reps):
                fn()
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                flush.max()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    fns[name]()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / reps)
    return {name: statistics.median(values) for name, values in samples.items()}


@dataclass(frozen=True)
class CaseData:
    """A case on the GPU: its caches' layout, random block ids and a staging buffer."""

    case: Case
    layout: KVLayout
    ids: torch.Tensor
    skip: torch.Tensor
    staging: torch.Tensor

    @property
    def moved(self) -> int:
        """Bytes one gather or scatter of every chunk moves."""
        return self.staging.numel()

    def kernel(
        self, gather: bool, tuning: KernelTuning, stream: TransferStream
    ) -> Callable[[], object]:
        """The kernel alone: the ids go up once (a request's upload is not the kernel's)."""
        uploaded = UploadedTransfer(
            self.layout,
            self.ids.numpy(),
            self.skip.numpy(),
            gather=gather,
            stream=stream,
            max_vector_bytes=self.case.max_vec,
            tuning=tuning,
        )
        return lambda: uploaded.launch(self.staging, 0, self.case.chunks)


def case_data(case: Case) -> CaseData:
    """Build a case's caches (twice the blocks it moves) and pick its blocks at random."""
    per_chunk = case.chunk_tokens // case.cache["block_size"]
    blocks = case.chunks * per_chunk
    caches, kw = make_kv_caches(case.fmt, num_blocks=2 * blocks, device="cuda", **case.cache)
    layout = KVLayout.from_kv_caches(caches, **kw)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(layout.num_blocks, generator=gen)[:blocks].view(case.chunks, per_chunk)
    skip = torch.zeros(case.chunks, dtype=torch.int64)
    nbytes = layout.chunk_nbytes(case.chunk_tokens)
    staging = torch.randint(0, 256, (case.chunks, nbytes), dtype=torch.uint8, device="cuda")
    return CaseData(case, layout, ids, skip, staging)


def run_case(
    case: Case, stream: TransferStream, torch_reps: int, variants: list[str]
) -> list[dict[str, Any]]:
    """Time one case: the copy and torch once, the kernel per tuning variant (one row each)."""
    data = case_data(case)
    layout, ids, skip, staging = data.layout, data.ids, data.skip, data.staging
    moved = data.moved
    reps = reps_for(moved)

    def reference(gather: bool) -> Callable[[], object]:
        return lambda: transfer_reference(layout, staging, ids, skip, gather=gather)

    torch_ms = {
        "torch_gather": _time_ms(reference(True), stream, torch_reps, rounds=3),
        "torch_scatter": _time_ms(reference(False), stream, torch_reps, rounds=3),
    }

    fns: dict[str, Callable[[], object]] = {"copy": same_bytes_copy(moved)}
    for variant in variants:
        fns[f"{variant}:gather"] = data.kernel(True, VARIANTS[variant], stream)
        fns[f"{variant}:scatter"] = data.kernel(False, VARIANTS[variant], stream)
    timed = time_interleaved(fns, stream, reps, rounds=9)
    rows = []
    for variant in variants:
        ms = {
            "gather": timed[f"{variant}:gather"],
            "scatter": timed[f"{variant}:scatter"],
            "copy": timed["copy"],
            **torch_ms,
        }
        gbps = {k: 2 * moved / (v * 1e-3) / 1e9 for k, v in ms.items()}
        plans = [
            build_plan(layout, case.chunk_tokens, gather=g, max_vector_bytes=case.max_vec)
            for g in (True, False)
        ]
        rows.append(
            {
                "case": case.name,
                "variant": variant,
                "format": case.fmt.value,
                "dtype": str(case.cache["dtype"]).removeprefix("torch."),
                "block_bytes": plans[0].groups[0].seg_bytes,
                "vec": plans[0].groups[0].vec_bytes,
                "order": [p.groups[0].linear for p in plans],
                "staged": [p.groups[0].staged for p in plans],
                "mb_moved": moved / 2**20,
                "ms": ms,
                "gbps": gbps,
                "gather_vs_copy": gbps["gather"] / gbps["copy"],
                "scatter_vs_copy": gbps["scatter"] / gbps["copy"],
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per case: kernel, copy and torch GB/s and the kernel/copy ratios.

    stg: whether gather and scatter run staged (s) or with their plain vectors (-).
    """
    head = (
        f"{'case':<22}{'variant':<9}{'block':>8}{'vec':>4}{'stg':>4}{'MB':>6}"
        f"{'gather':>8}{'scatter':>8}{'copy':>7}"
        f"{'g/copy':>7}{'s/copy':>7}{'torch g':>8}{'torch s':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        g = r["gbps"]
        print(
            f"{r['case']:<22}{r['variant']:<9}{r['block_bytes']:>8}{r['vec']:>4}"
            f"{''.join('s' if x else '-' for x in r['staged']):>4}{r['mb_moved']:>6.0f}"
            f"{g['gather']:>8.0f}{g['scatter']:>8.0f}{g['copy']:>7.0f}"
            f"{r['gather_vs_copy']:>7.2f}{r['scatter_vs_copy']:>7.2f}"
            f"{g['torch_gather']:>8.0f}{g['torch_scatter']:>8.0f}"
        )


def main() -> None:
    """Run every case (or those named) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="case names to run (default: all)")
    parser.add_argument("--torch-reps", type=int, default=3)
    parser.add_argument(
        "--variants",
        nargs="*",
        default=["default"],
        choices=sorted(VARIANTS),
        help="kernel tuning variants to compare (default: the shipped tuning)",
    )
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    if not cuda_available():
        raise SystemExit("bench_kernels needs a CUDA GPU and pycuda")
    stream = new_transfer_stream(torch.device("cuda", torch.cuda.current_device()))
    rows = []
    for case in CASES:
        if args.cases and case.name not in args.cases:
            continue
        rows += run_case(case, stream, args.torch_reps, args.variants)
        torch.cuda.empty_cache()
    print(f"GPU: {torch.cuda.get_device_name()}  (GB/s = (read + write) / time)")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
