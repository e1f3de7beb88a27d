"""Pinned host memory by how it was pinned: copies on every GPU at once, GB/s.

L1 pins ordinary host allocations with cudaHostRegister (portable); torch's pinned
tensors come from cudaHostAlloc. This times plain copies of --mb MiB per GPU, one
thread and stream each, from and to both kinds, each GPU alone and all at once, so a
gap between the kinds (page size, registration flags) shows next to the same-run
ceiling. Prints one row per kind and direction.

    python benchmarks/bench_host_alloc.py [--mb 512] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

from kvflow.core.tiers.hostmem import HostPool


def _together(jobs: list) -> float:  # type: ignore[type-arg]
    start = threading.Barrier(len(jobs) + 1)
    threads = [threading.Thread(target=lambda j=j: (start.wait(), j())) for j in jobs]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    n = torch.cuda.device_count()
    if n < 1:
        print("bench_host_alloc: needs a GPU")
        return 1
    nbytes = args.mb << 20
    devices = [torch.device("cuda", i) for i in range(n)]
    gpus = [torch.empty(nbytes, dtype=torch.uint8, device=d) for d in devices]
    streams = [torch.cuda.Stream(device=d) for d in devices]
    pool = HostPool(pinned=True)
    kinds = {
        "cudaHostAlloc": [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in devices],
        "registered": [pool.view(pool.add_segment(nbytes), 0, nbytes) for _ in devices],
    }
    print(f"{'kind':<14} {'dir':<4} " + " ".join(f"{'gpu' + str(i):>8}" for i in range(n))
          + f" {'all':>8} {'all/gpu0':>9}")  # fmt: skip
    for kind, hosts in kinds.items():
        for direction in ("d2h", "h2d"):

            def copy(i: int, direction: str = direction, hosts: list = hosts) -> None:  # type: ignore[type-arg]
                with torch.cuda.stream(streams[i]):
                    if direction == "d2h":
                        hosts[i].copy_(gpus[i], non_blocking=True)
                    else:
                        gpus[i].copy_(hosts[i], non_blocking=True)
                streams[i].synchronize()

            alone = []
            for i in range(n):
                copy(i)
                took = [_together([lambda i=i: copy(i)]) for _ in range(args.reps)]
                alone.append(nbytes / statistics.median(took) / 1e9)
            took = [_together([lambda i=i: copy(i) for i in range(n)]) for _ in range(args.reps)]
            every = n * nbytes / statistics.median(took) / 1e9
            print(f"{kind:<14} {direction:<4} " + " ".join(f"{g:>8.2f}" for g in alone)
                  + f" {every:>8.2f} {every / alone[0]:>9.2f}")  # fmt: skip
    pool.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
