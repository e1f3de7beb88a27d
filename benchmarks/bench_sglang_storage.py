"""Pages/s and GB/s of KVFlowHiCacheStorage's batch_set_v1 / batch_get_v1 against a plain
copy of the same bytes (issue 36: the cost of kvflow's hop behind SGLang's host pool).

Runs in the SGLang venv (`make sglang-venv`), against SGLang's own MHA host pool on CPU
(its `shm` allocator) and a real `kvflow server` subprocess with chunk size = page size:

    .venv-sglang/bin/python benchmarks/bench_sglang_storage.py [--layout page_first]
        [--pages 128] [--reps 10] [--layers 8] [--heads 8] [--head-dim 128] [--page-size 16]

Each rep stores a batch of pages (SGLang's STORAGE_BATCH_SIZE, 128, by default) from
the pool under fresh keys and loads a stored batch into other pages of the pool; the baseline is
`torch.Tensor.copy_` of as many bytes between two contiguous buffers in this process,
timed in the same run. A batch moves its bytes once, by the server (pool -> L1 on a
set, L1 -> pool on a get), so the ratio is what the RPC, the lookup of keys and the
per-page, per-layer copies cost on top of the bytes (docs/SGLANG.md, "Cost of the extra
hop").
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_ttft import kvflow_server  # this folder is on sys.path when run as a script

from kvflow.integrations.sglang import synthetic

synthetic.allow_torchvision_without_its_operators()  # before SGLang imports torchvision

import torch  # noqa: E402

from kvflow.integrations.sglang.layout import MHA_LAYOUTS  # noqa: E402
from kvflow.integrations.sglang.synthetic import build_backend, fill, mha_pool, page_keys  # noqa: E402


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--layout", default="page_first", choices=MHA_LAYOUTS, help="SGLang's host layout")
    add("--pages", type=int, default=128, help="pages per batch (SGLang's batches: 128)")
    add("--reps", type=int, default=10, help="timed batches of each kind (after one warm-up)")
    add("--layers", type=int, default=8, help="layers of the MHA pool")
    add("--heads", type=int, default=8, help="KV heads")
    add("--head-dim", type=int, default=128, help="values per head")
    add("--page-size", type=int, default=16, help="tokens per page = the server's chunk")
    add("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    if min(args.pages, args.reps, args.layers, args.heads, args.head_dim, args.page_size) < 1:
        raise SystemExit(
            "--pages, --reps, --layers, --heads, --head-dim and --page-size must be >= 1"
        )
    page, n = args.page_size, args.pages
    tokens = n * page  # the host pool holds twice the device's: a batch to set, one to get
    pool = mha_pool(
        args.layout, heads=args.heads, head_dim=args.head_dim, page_size=page,
        device_tokens=tokens, layers=args.layers,
    )  # fmt: skip
    fill(pool, seed=0)
    page_bytes = 2 * args.layers * page * args.heads * args.head_dim * 2
    batch_bytes = n * page_bytes
    l1_gb = max(0.25, 1.5 * (args.reps + 1) * batch_bytes / 2**30)
    with (
        tempfile.TemporaryDirectory() as tmp,
        kvflow_server(
            l1_gb, Path(tmp) / "server.log", "--disable-observability", chunk_size=page
        ) as ep,
    ):
        b = build_backend(pool, ep, timeout_s=60)
        src_host, dst_host = pool.alloc(n * page), pool.alloc(n * page)
        batches = iter([page_keys(n, f"set{r}") for r in range(args.reps + 1)])

        def one_set() -> None:  # fresh keys each time: every page is written
            assert b.batch_set_v1(next(batches), src_host) == [True] * n

        set_s = timed(one_set, args.reps + 1)[1:]  # the first warms up
        names = page_keys(n, "set0")

        def one_get() -> None:
            assert b.batch_get_v1(names, dst_host) == [True] * n

        get_s = timed(one_get, args.reps + 1)[1:]
        b.close()
    src = torch.empty(batch_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), args.reps + 1)[1:]
    med = {k: statistics.median(v) for k, v in (("set", set_s), ("get", get_s), ("copy", copy_s))}
    result = {
        "machine": platform.node(), "cpus": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"), "layout": args.layout, "pages": n,
        "page_bytes": page_bytes, "batch_mib": batch_bytes / 2**20,
        **{f"{k}_pages_per_s": n / s for k, s in med.items()},
        **{f"{k}_gb_per_s": batch_bytes / s / 1e9 for k, s in med.items()},
        "set_over_copy": med["copy"] / med["set"], "get_over_copy": med["copy"] / med["get"],
    }  # fmt: skip
    print(
        f"{args.layout}: {n} pages of {page_bytes / 2**10:.0f} KiB ({batch_bytes / 2**20:.0f} MiB)"
        f" per batch, median of {args.reps}"
    )
    for k in ("set", "get", "copy"):
        print(
            f"  {k:5s} {result[f'{k}_pages_per_s']:9.0f} pages/s  {result[f'{k}_gb_per_s']:6.2f} GB/s"
        )
    print(f"  set / copy {result['set_over_copy']:.2f}   get / copy {result['get_over_copy']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
