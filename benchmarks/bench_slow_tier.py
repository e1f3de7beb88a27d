"""What a slow L2 disk does to store latency: a burst of stores against a disk tier slowed
by a fixed delay per chunk, with the write-through's backpressure (--l2-backlog-wait-s).

An in-process `CacheEngine` on CPU KV caches (1 MiB chunks: 256 tokens of a 4-layer,
2 KV heads x 128 bf16 model) with a small L1 (`--l1-mib`, default 16) and one L2 tier: a
real `DiskTier` in a fresh directory behind `SlowDisk`, which runs the tier's stores one
at a time on one thread, each `delay` per chunk longer than the disk takes (a disk that
writes `1 / delay` chunks a second). A burst of `--burst-x` x L1 in all, in stores of
`--store-mib` each (fresh tokens every store, so every chunk is new and written
through), is timed store by store, for each delay of `--delays-ms` and two backlog waits:
`--backlog-wait-s` (the server's default, 10 s: stores wait for the tier) and
`--short-wait-s` (stores wait that long at most, then their chunks skip L2: dropped).
Each (delay, wait) runs `--rounds` times, each burst on a fresh engine and directory, every
case once per round with the order rotating (a drift of a shared machine spreads over the
rows); latencies are pooled over rounds, counts summed. Torch runs `--torch-threads`
intra-op threads (default 1: on a busy 2-core box two threads spinning in the CPU copies
make store latency vary tenfold).

Per row: store p50 / p99 / max in ms, the burst's wall time, how often and how long in
all stores waited for backlog room (status `write_through.waits` / `waited_s`), chunks
dropped, chunks the tier stored, and the time the write-through took to drain after the
burst's last store returned. `--json PATH` writes everything, with the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.tiers.base import ObjectKey, StoreOutcome
from kvflow.core.tiers.disk import DiskTier
from kvflow.kernels import KVFormat
from kvflow.kernels.synthetic import make_kv_caches

MIB = 1 << 20
GIB = 1 << 30
CHUNK = 256  # tokens per chunk
BLOCK = 16  # tokens per KV block
LAYERS, HEADS, HEAD_SIZE = 4, 2, 128
CHUNK_BYTES = 2 * LAYERS * HEADS * HEAD_SIZE * CHUNK * 2  # K and V, bf16: 1 MiB


class SlowDisk:
    """A DiskTier whose stores run one at a time on one thread, each `delay_s` per chunk
    longer than the disk takes (a slow disk); every other call goes straight to it."""

    def __init__(self, inner: DiskTier, delay_s: float) -> None:
        self.inner = inner
        self.name = inner.name
        self.delay_s = delay_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slow-disk")

    def _store(self, items: Sequence[tuple[ObjectKey, torch.Tensor]]) -> StoreOutcome:
        time.sleep(self.delay_s * len(items))
        return self.inner.store(items).result()

    def store(self, items: Sequence[tuple[ObjectKey, torch.Tensor]]) -> Future[StoreOutcome]:
        return self._pool.submit(self._store, list(items))

    def contains(self, keys: Sequence[ObjectKey]) -> Future[list[bool]]:
        return self.inner.contains(keys)

    def load(self, keys: Sequence[ObjectKey], dsts: Sequence[torch.Tensor]) -> Future[list[bool]]:
        return self.inner.load(keys, dsts)

    def pin(self, keys: Sequence[ObjectKey]) -> int:
        return self.inner.pin(keys)

    def unpin(self, keys: Sequence[ObjectKey]) -> None:
        self.inner.unpin(keys)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def drop_where(self, predicate: Callable[[Any], bool]) -> int:
        return self.inner.drop_where(predicate)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.inner.close()


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def _write_through(engine: CacheEngine) -> dict[str, Any]:
    l2 = engine.status()["l2"]
    assert l2 is not None
    return {**l2["write_through"], "calls": l2["in_flight"]["write_through"]["calls"]}


def _drain(engine: CacheEngine, timeout: float = 300.0) -> float:
    """Wait until the write-through has nothing pending; returns the seconds it took."""
    started = time.perf_counter()
    while _write_through(engine)["calls"]:
        if time.perf_counter() - started > timeout:
            raise TimeoutError(f"the write-through did not drain in {timeout} s")
        time.sleep(0.001)
    return time.perf_counter() - started


def one_burst(delay_s: float, wait_s: float, args: argparse.Namespace, seq: int) -> dict[str, Any]:
    """One burst on a fresh engine and disk directory: per-store seconds and the counts."""
    l1_bytes = args.l1_mib * MIB
    store_chunks = max(1, args.store_mib * MIB // CHUNK_BYTES)
    n_stores = max(1, int(args.burst_x * l1_bytes) // (store_chunks * CHUNK_BYTES))
    tdir = tempfile.mkdtemp(prefix="slow-tier-", dir=args.dir)
    disk = DiskTier([tdir], 2 * (n_stores + 1) * store_chunks * CHUNK_BYTES + GIB)
    tier = SlowDisk(disk, delay_s)
    config = ServerConfig(
        chunk_size=CHUNK, l1_size_gb=l1_bytes / GIB, l2_backlog_wait_s=wait_s,
        observability=ObservabilityConfig(enabled=False),
    )  # fmt: skip
    engine = CacheEngine(config, l2_tiers=[tier])
    try:
        kv, kw = make_kv_caches(
            KVFormat.VLLM_FLASH_ATTN, num_layers=LAYERS, num_blocks=store_chunks * CHUNK // BLOCK,
            block_size=BLOCK, num_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16,
            generator=torch.Generator().manual_seed(seq),
        )  # fmt: skip
        engine.register_kv_caches("src", kv, model_name="slow", **kw)
        blocks = list(range(store_chunks * CHUNK // BLOCK))

        def tokens(i: int) -> np.ndarray:  # fresh ones per store (a fresh tier per burst)
            start = (i + 2) * store_chunks * CHUNK
            return np.arange(start, start + store_chunks * CHUNK, dtype=np.int32)

        # one untimed store (the copy paths warm up), drained: the burst starts idle
        engine.store("src", tokens(-1), blocks, request_id="warm")
        _drain(engine)
        before = _write_through(engine)
        stored_before = engine.status()["l2"]["tiers"]["disk"]["stored"]
        seconds: list[float] = []
        held = 0
        burst_start = time.perf_counter()
        for i in range(n_stores):
            t0 = time.perf_counter()
            held += engine.store("src", tokens(i), blocks, request_id=f"s{i}")
            seconds.append(time.perf_counter() - t0)
        burst_s = time.perf_counter() - burst_start
        drain_s = _drain(engine)
        after = _write_through(engine)
        stored = engine.status()["l2"]["tiers"]["disk"]["stored"] - stored_before
    finally:
        engine.close(timeout=300.0)
        shutil.rmtree(tdir, ignore_errors=True)
    if held != n_stores * store_chunks * CHUNK:
        raise RuntimeError(f"the stores held {held} of {n_stores * store_chunks * CHUNK} tokens")
    return {
        "seconds": seconds,
        "burst_s": burst_s,
        "drain_s": drain_s,
        "waits": after["waits"] - before["waits"],
        "waited_s": after["waited_s"] - before["waited_s"],
        "dropped_chunks": after["dropped_chunks"] - before["dropped_chunks"],
        "drop_bursts": after["drop_bursts"] - before["drop_bursts"],
        "stored_chunks": stored,
        "stores": n_stores,
        "store_chunks": store_chunks,
        "bound_bytes": after["bound_bytes"],
    }


def summarize(delay_ms: float, wait_s: float, bursts: list[dict[str, Any]]) -> dict[str, Any]:
    """One row: the bursts' latencies pooled, counts summed, times averaged."""
    seconds = [s for b in bursts for s in b["seconds"]]
    return {
        "delay_ms": delay_ms,
        "wait_s": wait_s,
        "rounds": len(bursts),
        "stores": sum(b["stores"] for b in bursts),
        "store_chunks": bursts[0]["store_chunks"],
        "chunks": sum(b["stores"] * b["store_chunks"] for b in bursts),
        "p50_ms": _pct(seconds, 50) * 1000,
        "p99_ms": _pct(seconds, 99) * 1000,
        "max_ms": max(seconds) * 1000,
        "burst_s": sum(b["burst_s"] for b in bursts) / len(bursts),
        "drain_s": sum(b["drain_s"] for b in bursts) / len(bursts),
        "waits": sum(b["waits"] for b in bursts),
        "waited_s": sum(b["waited_s"] for b in bursts),
        "dropped_chunks": sum(b["dropped_chunks"] for b in bursts),
        "drop_bursts": sum(b["drop_bursts"] for b in bursts),
        "stored_chunks": sum(b["stored_chunks"] for b in bursts),
        "bound_bytes": bursts[0]["bound_bytes"],
        "store_ms": [s * 1000 for s in seconds],
    }


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?"
            )
    except OSError:
        pass
    return {
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _delays(text: str) -> list[float]:
    try:
        delays = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not delays or any(d < 0 for d in delays):
        raise argparse.ArgumentTypeError(f"need delays >= 0, got {text!r}")
    return delays


def _wait(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 600:
        raise argparse.ArgumentTypeError(f"must be 0..600 seconds, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--l1-mib", type=_positive(int), default=16, help="L1 size (default 16)")
    p.add_argument("--store-mib", type=_positive(int), default=2,
                   help="one store's size, whole 1 MiB chunks (default 2)")  # fmt: skip
    p.add_argument("--burst-x", type=_positive(float), default=4.0,
                   help="the burst's total, in multiples of L1 (default 4)")  # fmt: skip
    p.add_argument("--delays-ms", type=_delays, default=[0.0, 1.0, 5.0, 20.0],
                   help="the tier's added delay per chunk, comma-separated (default 0,1,5,20)")  # fmt: skip
    p.add_argument("--backlog-wait-s", type=_wait, default=10.0,
                   help="--l2-backlog-wait-s of the long-wait rows (default 10)")  # fmt: skip
    p.add_argument("--short-wait-s", type=_wait, default=0.01,
                   help="--l2-backlog-wait-s of the short-wait rows (default 0.01)")  # fmt: skip
    p.add_argument("--rounds", type=_positive(int), default=3, help="bursts per row (default 3)")
    p.add_argument("--torch-threads", type=_positive(int), default=1,
                   help="torch intra-op threads (default 1: the engine's CPU copies spin less "
                        "on a shared box)")  # fmt: skip
    p.add_argument("--dir", default=None, help="where the disk tier's directories go")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.store_mib > args.l1_mib // 2:
        p.error(f"--store-mib ({args.store_mib}) must be at most half of --l1-mib")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # the drop bursts' warnings (kvflow.l2) would interleave the run: status counts them
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(args.torch_threads)
    m = {**machine(), "torch_threads": args.torch_threads}
    cases = [(d, w) for w in (args.backlog_wait_s, args.short_wait_s) for d in args.delays_ms]
    bursts: dict[tuple[float, float], list[dict[str, Any]]] = {c: [] for c in cases}
    for rnd in range(args.rounds):  # every case once per round, the order rotating
        shift = rnd * len(cases) // args.rounds
        for i, (delay, wait_s) in enumerate(cases[shift:] + cases[:shift]):
            burst = one_burst(delay / 1000, wait_s, args, rnd * len(cases) + i + 1)
            bursts[(delay, wait_s)].append(burst)
    rows = [summarize(delay, wait_s, bursts[(delay, wait_s)]) for delay, wait_s in cases]
    first = rows[0]
    print(f"machine: {m['cpu_model']}, {m['cpu_count']} CPUs, python {m['python']}, "
          f"torch {m['torch']} ({args.torch_threads} threads), {m['date']}")  # fmt: skip
    print(
        f"L1 {args.l1_mib} MiB, 1 MiB chunks, backlog bound {first['bound_bytes'] // MIB} MiB; "
        f"a burst of {args.burst_x:g}x L1 in stores of {first['store_chunks']} chunks "
        f"({first['stores'] // args.rounds} stores), {args.rounds} round(s) per row"
    )
    header = (
        f"{'delay ms/chunk':>14} {'wait s':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'burst s':>8} {'waits':>6} {'waited s':>9} {'dropped':>8} {'on disk':>8} "
        f"{'drain s':>8}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['delay_ms']:>14g} {r['wait_s']:>7g} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
            f"{r['max_ms']:>8.2f} {r['burst_s']:>8.3f} {r['waits']:>6d} {r['waited_s']:>9.3f} "
            f"{r['dropped_chunks']:>8d} {r['stored_chunks']:>8d} {r['drain_s']:>8.3f}"
        )
    print("waits / waited s / dropped / on disk: summed over rounds; burst s, drain s: means")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": m, "args": {k: v for k, v in vars(args).items()},
                       "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
