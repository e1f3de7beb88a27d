"""Pages/s and GB/s of KVFlowHiCacheStorage's batch_set_v1 / batch_get_v1 against a plain
copy of the same bytes (issue 36: the cost of kvflow's hop behind SGLang's host pool).

Runs in the SGLang venv (`make sglang-venv`), against SGLang's own MHA host pool (or with
`--mla` its MLA pool: one row of `--kv-lora-rank` + `--rope-dim` bfloat16 values per token
and layer, DeepSeek-V3's 512 + 64 by default) on CPU (its `shm` allocator) and a real
`kvflow server` subprocess with chunk size = page size:

    .venv-sglang/bin/python benchmarks/bench_sglang_storage.py [--layout page_first]
        [--pages 128] [--reps 10] [--layers 8] [--heads 8] [--head-dim 128] [--page-size 16]
        [--mla [--kv-lora-rank 512] [--rope-dim 64]]
        [--warm-l1 | --l1-prefault] [--mover] [--json FILE]

Each round stores a batch of pages (SGLang's STORAGE_BATCH_SIZE, 128, by default) from
the pool under fresh keys, loads it back into other pages of the pool and times the
baselines: `torch.Tensor.copy_` of as many bytes between two contiguous buffers in this
process (torch's threads: every core), and one core's memcpy (`copy1`, numpy); all of
them see the same load. By default L1 holds every batch, so each set writes pages L1
never touched (the first-touch page faults of a server's first L1-full of stores);
`--warm-l1` sizes L1 to a few batches and fills it in untimed rounds, so the timed sets
reuse the memory of the batches they evict (a running server's steady state);
`--l1-prefault` starts the server with `--l1-prefault` and waits until it has faulted
its L1 in, so the timed sets write fresh keys into memory that is already resident
(a server whose L1 was made resident at start-up, before its first L1-full). A batch
moves its bytes once, by the server (pool -> L1 on a set, L1 -> pool on a get), so the
ratio is what the RPC, the lookup of keys and the copies cost on top of the bytes
(docs/SGLANG.md, "Cost of the extra hop").

`--mover` also times the server's CPU mover (`CpuMover.store` / `retrieve`) in this
process on the same pool views, between the pool's pages and one contiguous buffer of
page-sized chunks (what L1 objects are): the copy without the RPC and the server around it.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvflow.core import KVFlowClient  # noqa: E402
from kvflow.core.engine.movers import CpuMover  # noqa: E402
from kvflow.integrations.sglang.layout import (  # noqa: E402
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    host_pool_views,
    page_ids,
)
from kvflow.integrations.sglang.synthetic import (  # noqa: E402
    build_backend,
    fill,
    mha_pool,
    mla_pool,
    page_keys,
)
from kvflow.kernels import KVLayout  # noqa: E402


def timed_rounds(
    steps: dict[str, Callable[[], object]], warm: int, reps: int
) -> dict[str, list[float]]:
    """Seconds of each step per round, over `warm` untimed rounds then `reps` timed ones;
    a round runs every step once, in order, so all of them see the same load."""
    out: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(warm + reps):
        for k, fn in steps.items():
            start = time.perf_counter()
            fn()
            if r >= warm:
                out[k].append(time.perf_counter() - start)
    return out


class Chunks:
    """Page-sized chunks of one contiguous buffer, as a mover's `HostChunks` (L1 objects)."""

    def __init__(self, buffer: torch.Tensor, chunk_nbytes: int) -> None:
        self.rows = buffer.view(-1, chunk_nbytes)
        self.base, self.chunk_nbytes = buffer.data_ptr(), chunk_nbytes

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]

    def address(self, index: int, nbytes: int) -> int:
        """Host address of chunk `index` (`HostChunks`); ValueError unless it holds `nbytes`."""
        if nbytes != self.chunk_nbytes:
            raise ValueError(f"chunks hold {self.chunk_nbytes} bytes, not {nbytes}")
        return self.base + index * nbytes

    def region(self, index: int) -> int:
        """One buffer: one region (`HostChunks`)."""
        return 0


def mover_steps(
    pool: object, src_host: torch.Tensor, dst_host: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """`CpuMover.store` (the pages at `src_host` -> chunks) and `retrieve` (chunks -> the
    pages at `dst_host`), in this process, on the pool's views."""
    views = host_pool_views(pool)
    layout = KVLayout.from_kv_caches(views.layers, kv_format=views.kv_format)
    n = src_host.numel() // views.page_size
    src = page_ids(src_host, views.page_size, n).numpy().reshape(n, 1)
    dst = page_ids(dst_host, views.page_size, n).numpy().reshape(n, 1)
    chunk_nbytes = layout.chunk_nbytes(views.page_size)
    chunks = Chunks(torch.empty(n * chunk_nbytes, dtype=torch.uint8), chunk_nbytes)
    mover = CpuMover(layout)
    return {
        "store": lambda: mover.store(src, chunks),
        "retrieve": lambda: mover.retrieve(chunks, lambda: dst, [0] * n),
    }


def wait_resident(endpoint: str, timeout_s: float = 600.0) -> None:
    """Wait until the server at `endpoint` has faulted all of its L1 in (--l1-prefault)."""
    client = KVFlowClient(endpoint)
    deadline = time.monotonic() + timeout_s
    try:
        while (state := client.status()["l1_pinning"]) is None or state["pinning"]:
            if state is None:
                raise SystemExit("the server does not grow L1 ahead (no --l1-prefault?)")
            if time.monotonic() > deadline:
                raise SystemExit(f"L1 not resident after {timeout_s:.0f} s: {state}")
            time.sleep(0.1)
    finally:
        client.close()
    print(f"L1 resident: {state['pinned_bytes'] / 2**30:.2f} GiB in {state['seconds']} s")


def l1_kind(args: argparse.Namespace) -> str:
    """How the timed sets find L1's memory, in the table's words."""
    return "warm" if args.warm_l1 else "prefaulted" if args.l1_prefault else "fresh"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add(
        "--layout", default="page_first", choices=sorted({*MHA_LAYOUTS, *MLA_LAYOUTS}),
        help="SGLang's host layout",
    )  # fmt: skip
    add("--pages", type=int, default=128, help="pages per batch (SGLang's batches: 128)")
    add("--reps", type=int, default=10, help="timed rounds (after the untimed ones)")
    add("--layers", type=int, default=8, help="layers of the MHA pool")
    add("--heads", type=int, default=8, help="KV heads")
    add("--head-dim", type=int, default=128, help="values per head")
    add("--page-size", type=int, default=16, help="tokens per page = the server's chunk")
    add("--mla", action="store_true", help="SGLang's MLA host pool instead of the MHA one")
    add("--kv-lora-rank", type=int, default=512, help="MLA: latent values per token and layer")
    add("--rope-dim", type=int, default=64, help="MLA: rotary values per token and layer")
    add(
        "--warm-l1", action="store_true",
        help="an L1 of a few batches, filled before the timed sets: they reuse the memory of"
        " the batches they evict (a running server) instead of touching fresh pages",
    )  # fmt: skip
    add(
        "--l1-prefault", action="store_true",
        help="start the server with --l1-prefault and wait until its L1 is resident",
    )  # fmt: skip
    add("--mover", action="store_true", help="also time CpuMover in this process")
    add("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    if args.warm_l1 and args.l1_prefault:
        raise SystemExit("--warm-l1 and --l1-prefault are two ways to warm L1: pick one")
    sizes = (args.pages, args.reps, args.layers, args.heads, args.head_dim, args.page_size)
    if min(*sizes, args.kv_lora_rank, args.rope_dim) < 1:
        raise SystemExit(
            "--pages, --reps, --layers, --heads, --head-dim, --page-size, --kv-lora-rank and"
            " --rope-dim must be >= 1"
        )
    if args.mla and args.layout not in MLA_LAYOUTS:
        raise SystemExit(f"--mla: --layout must be one of {', '.join(MLA_LAYOUTS)}")
    if not args.mla and args.layout not in MHA_LAYOUTS:
        raise SystemExit(f"--layout {args.layout} is an MLA layout: add --mla")
    page, n = args.page_size, args.pages
    tokens = n * page  # the host pool holds twice the device's: a batch to set, one to get
    if args.mla:
        pool = mla_pool(
            args.layout, kv_lora_rank=args.kv_lora_rank, rope_dim=args.rope_dim,
            page_size=page, device_tokens=tokens, layers=args.layers,
        )  # fmt: skip
        page_bytes = args.layers * page * (args.kv_lora_rank + args.rope_dim) * 2
    else:
        pool = mha_pool(
            args.layout, heads=args.heads, head_dim=args.head_dim, page_size=page,
            device_tokens=tokens, layers=args.layers,
        )  # fmt: skip
        page_bytes = 2 * args.layers * page * args.heads * args.head_dim * 2
    fill(pool, seed=0)
    batch_bytes = n * page_bytes
    # untimed rounds first: one, or with --warm-l1 an L1 of three batches filled by three
    # rounds and a fourth that evicts (then every set evicts and reuses memory)
    warm = 4 if args.warm_l1 else 1
    l1_batches = 3 if args.warm_l1 else max(0.25 * 2**30 / batch_bytes, 1.5 * (1 + args.reps))
    l1_gb = l1_batches * batch_bytes / 2**30
    src = torch.empty(batch_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    flags = ("--disable-observability", *(("--l1-prefault",) if args.l1_prefault else ()))
    with (
        tempfile.TemporaryDirectory() as tmp,
        kvflow_server(l1_gb, Path(tmp) / "server.log", *flags, chunk_size=page) as ep,
    ):
        if args.l1_prefault:
            wait_resident(ep)
        b = build_backend(pool, ep, timeout_s=60)
        src_host, dst_host = pool.alloc(n * page), pool.alloc(n * page)
        batches = iter([page_keys(n, f"set{r}") for r in range(warm + args.reps)])
        last: list[str] = []

        def one_set() -> None:  # fresh keys each time: every page is written
            last[:] = next(batches)
            assert b.batch_set_v1(last, src_host) == [True] * n

        def one_get() -> None:  # the batch just set: in L1 whatever it evicted
            assert b.batch_get_v1(last, dst_host) == [True] * n

        steps: dict[str, Callable[[], object]] = {
            "set": one_set, "get": one_get,
            "copy": lambda: dst.copy_(src),  # the baseline: torch, every core
            "copy1": lambda: np.copyto(dst.numpy(), src.numpy()),  # one core's memcpy
        }  # fmt: skip
        if args.mover:
            steps.update(mover_steps(pool, src_host, dst_host))
        times = timed_rounds(steps, warm, args.reps)
        b.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    kind = "mla" if args.mla else "mha"
    result = {
        "machine": platform.node(), "cpus": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"), "layout": args.layout, "pool": kind, "pages": n,
        "warm_l1": args.warm_l1, "l1_prefault": args.l1_prefault,
        "page_bytes": page_bytes, "batch_mib": batch_bytes / 2**20,
        **{f"{k}_pages_per_s": n / s for k, s in med.items()},
        **{f"{k}_gb_per_s": batch_bytes / s / 1e9 for k, s in med.items()},
        **{f"{k}_over_copy": med["copy"] / s for k, s in med.items() if not k.startswith("copy")},
    }  # fmt: skip
    print(
        f"{kind} {args.layout}: {n} pages of {page_bytes / 2**10:.0f} KiB ({batch_bytes / 2**20:.0f} MiB)"
        f" per batch, median of {args.reps}, {l1_kind(args)} L1"
    )
    for k in med:
        over = "" if k.startswith("copy") else f"  {result[f'{k}_over_copy']:.2f} of the copy"
        print(
            f"  {k:8s} {result[f'{k}_pages_per_s']:9.0f} pages/s  "
            f"{result[f'{k}_gb_per_s']:6.2f} GB/s{over}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
