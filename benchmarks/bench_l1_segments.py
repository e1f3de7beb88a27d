"""L1 planning against its segment count: a store's `prepare_write` + `commit` into a full
L1, which evicts as many chunks as it writes, for L1s of 16 to 512 segments.

    python benchmarks/bench_l1_segments.py [--segments 16 64 512] [--chunks 128] [--rounds 50]

Each segment holds 16 chunks of 64 KiB and a 4 KiB leftover no chunk fits in (as a real
1 GiB segment keeps one below its chunk size), in ordinary host memory. Planning should
not grow with the segment count: a 512 GiB L1 of 1 GiB segments is 512 segments
(docs/ENGINE.md, L1). Prints the median time per store over `--rounds` timed stores
after L1 was filled.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from kvflow.core.tiers.l1 import L1Cache

CHUNK = 64 << 10
PER_SEGMENT = 16
LEFTOVER = 4 << 10


def plan_ms(segments: int, chunks: int, rounds: int) -> float:
    """Median ms of one store of `chunks` new chunks into a full L1 of `segments`."""
    segment_bytes = PER_SEGMENT * CHUNK + LEFTOVER
    l1 = L1Cache(segments * segment_bytes, segment_bytes=segment_bytes, pin_ahead=False)
    stores = iter(range(1 << 30))

    def store() -> float:
        keys = [f"{next(stores)}-{i}".encode() for i in range(chunks)]
        start = time.perf_counter()
        plan = l1.prepare_write(keys, CHUNK)
        l1.commit(plan)
        return time.perf_counter() - start

    try:
        for _ in range(segments * PER_SEGMENT // chunks + 2):  # full, and evicting
            store()
        return statistics.median(store() for _ in range(rounds)) * 1e3
    finally:
        l1.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--segments", type=int, nargs="+", default=[16, 64, 512])
    parser.add_argument("--chunks", type=int, default=128, help="chunks per store")
    parser.add_argument("--rounds", type=int, default=50, help="timed stores per L1")
    args = parser.parse_args()
    if min([*args.segments, args.chunks, args.rounds]) < 1:
        raise SystemExit("--segments, --chunks and --rounds must be >= 1")
    print(f"{platform.node()}, {time.strftime('%Y-%m-%d')}: {args.chunks} chunks per store")
    print(f"{'segments':>8}  {'ms per store':>12}")
    for segments in args.segments:
        print(f"{segments:8d}  {plan_ms(segments, args.chunks, args.rounds):12.3f}")


if __name__ == "__main__":
    main()
