"""What a transfer's cache policy costs the engine running beside it (GPU).

The engine keeps a working set in L2 (the weights of a decode step's layer, say); a
store's gather that loads the KV with default caching fills L2 with lines read once
and may push that set out, while streaming (.cs) accesses mark them evict-first. Here
a "victim", a 16-token matmul against a weight of --victim-mib (L2-sized: it runs from
L2 when nothing evicts it), repeats on one stream while the block-transfer kernel
gathers (or scatters) 0.5 GiB on another, for each kernel build; it reports the
victim's time per pass against the victim alone and the transfer's GB/s while
sharing. Needs a CUDA GPU and pycuda.

    python benchmarks/bench_kernel_l2.py [--variants default cs st-cs] [--victim-mib 24]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from bench_kernels import CASES, VARIANTS, case_data  # this folder is on sys.path as a script

from kvflow.kernels import cuda_available, new_transfer_stream

CASE = "fa-bf16-32K"  # bench_kernels' case: 32 layers x 8 heads x 128 bf16, 0.5 GiB per call


def _elapsed_ms(fn: Callable[[], object], stream: torch.cuda.Stream, reps: int) -> float:
    """Mean GPU time per call of `reps` calls queued on `stream` (already running ones
    on other streams overlap it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    """Victim alone, then beside each build's transfer; prints one line per build."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="*", default=["default", "cs", "st-cs"],
                        choices=sorted(VARIANTS))  # fmt: skip
    parser.add_argument("--victim-mib", type=int, default=24, help="L2-resident working set")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not cuda_available():
        raise SystemExit("bench_kernel_l2 needs a CUDA GPU and pycuda")
    device = torch.device("cuda", torch.cuda.current_device())
    data = case_data(next(c for c in CASES if c.name == CASE))
    weight = torch.randn(4096, (args.victim_mib << 20) // (2 * 4096), device=device).bfloat16()
    tokens = torch.randn(16, 4096, device=device).bfloat16()
    out = torch.empty(16, weight.shape[1], dtype=torch.bfloat16, device=device)
    transfer_stream = new_transfer_stream(device)
    victim_stream = torch.cuda.Stream(device)

    def victim_pass() -> None:
        torch.mm(tokens, weight, out=out)

    for _ in range(20):
        victim_pass()
    alone = statistics.median(_elapsed_ms(victim_pass, victim_stream, 200) for _ in range(5))
    print(f"GPU: {torch.cuda.get_device_name()}  victim {args.victim_mib} MiB: "
          f"{alone * 1e3:.1f} us per pass alone")  # fmt: skip
    print(f"{'variant':<9}{'dir':<8}{'victim us':>10}{'x alone':>8}{'transfer GB/s':>14}")
    for variant in args.variants:
        for gather in (True, False):
            transfer = data.kernel(gather, VARIANTS[variant], transfer_stream)
            transfer()
            torch.cuda.synchronize()
            victims, rates = [], []
            for _ in range(args.rounds):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(transfer_stream.torch)
                for _ in range(8):
                    transfer()
                end.record(transfer_stream.torch)
                # the victim runs while the transfers do (it is far shorter than they are)
                victims.append(_elapsed_ms(victim_pass, victim_stream, 100))
                end.synchronize()
                rates.append(8 * 2 * data.moved / (start.elapsed_time(end) * 1e-3) / 1e9)
            shared = statistics.median(victims)
            print(f"{variant:<9}{'gather' if gather else 'scatter':<8}{shared * 1e3:>10.1f}"
                  f"{shared / alone:>8.2f}{statistics.median(rates):>14.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
