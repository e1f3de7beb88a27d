"""L2 disk tier: store/load GB/s next to a plain-file ceiling, path scaling, store latency
with write-through on vs off, and prefetch time into L1; all in one run, side by side.

Sections (each repeated `--rounds` times, the order of the compared sides alternating per
round so a drift of the machine cancels; figures are medians over rounds):

1. `DiskTier.store` / `load` of objects of 32 MiB (256-token chunks of a 32-layer, 8 KV
   heads x 128 bf16 model) and of 1 MiB (a small model), against a ceiling: a plain
   sequential write, then read, of files of the same size in the same directory. Writes
   are timed to durable on both sides: until every byte is written AND every file is
   fsynced (the tier itself never fsyncs: its store is followed by an fsync of each object
   file, just as the ceiling's writes are). Before any read, every file read (the
   ceiling's and the tier's object files) is fsynced and dropped from the page cache with
   `posix_fadvise(POSIX_FADV_DONTNEED)` (no root needed), so reads come from the disk.
2. Scaling: one tier over two paths vs one over one path, the same volume (two `--dir`
   give two directories; one `--dir` gives two subdirectories of it: one device, so no
   device scaling shows).
3. Request path: `CacheEngine.store` latency on CPU KV caches (1 MiB chunks, fresh tokens
   every store so every chunk is new and written through) with an L2 disk tier vs
   without, alternating per round. "drained": the write-through of the previous store is
   waited for (untimed) before each timed store, so the figure is the store call's own
   added cost; "busy": back-to-back stores with the background writes running.
4. Prefetch: chunks stored through an engine with L2 on, write-through drained, the
   object files fsynced and dropped from the page cache, L1 emptied; then the time from
   `lookup()` (which starts the prefetch) until every chunk is readable in L1, next to a
   plain sequential read of the same object files (dropped from the page cache again).
5. Redis (`--redis URL`, or by default a `redis-server` started on a free loopback port
   for the run with `--save '' --appendonly no` and no maxmemory, stopped at its end;
   `--no-redis` skips it): `RedisTier.store` / `load` of 32 MiB and 1 MiB objects
   (`--redis-gib` each) against plain redis-py SET then GET of the same sizes over as
   many connections as the tier's pool_size (one thread per connection, each its share),
   sides alternating per round, FLUSHDB after each side; and the lookup of a 128k-token
   prompt: `RedisTier.contains` of 500 present chunk keys next to a plain redis-py
   pipeline of 500 EXISTS, with the round trips each took.

6. A request 4x L1 (`--beyond-l1-mib` of L1, 1 MiB chunks) through an engine with a disk
   tier: `store()` until the write-through drained (every chunk on disk) and, from a cold
   L1 with the object files dropped from the page cache, `retrieve()` of the whole prefix
   into the KV caches; next to the tier alone on the same bytes (`DiskTier.store` of the
   same number of 1 MiB objects until written, `load` of them from a cold page cache),
   and next to the same request through an engine whose L1 holds it whole (what the
   streaming itself costs); a fresh directory per side and round, order rotating, after
   one untimed engine round (the first builds the kernels and starts CUDA: seconds). Writes
   are buffered on all sides (no fsync: the engine's store does not wait for one). The
   KV caches are on `--beyond-l1-device` (cpu: the engine's CPU copies, far slower than
   a disk here, bound the engine side; cuda:N measures the L2 path behind a GPU).

`--only disk` / `--only redis` runs one part; `--only beyond_l1` section 6 alone.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import redis
import torch

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.tiers import diskfile
from kvflow.core.tiers.base import ObjectKey
from kvflow.core.tiers.disk import DiskTier
from kvflow.core.tiers.redis import BATCH_BYTES, RedisTier
from kvflow.core.tiers.redis_target import RedisTarget, resolve_target
from kvflow.kernels import KVFormat
from kvflow.kernels.synthetic import make_kv_caches

MIB = 1 << 20
GIB = 1 << 30
CHUNK = 256  # tokens per chunk
BLOCK = 16  # tokens per KV block
#: distinct random source bytes at most (objects cycle over them; larger than any CPU cache)
SOURCE_POOL = 256 * MIB
T = TypeVar("T")
CACHE_DROP = "fsync + posix_fadvise(POSIX_FADV_DONTNEED) of each file read (ceiling and tier)"


@dataclass(frozen=True)
class Model:
    """A synthetic model whose 256-token chunk is one L2 object."""

    name: str
    layers: int
    heads: int
    head_size: int

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * self.heads * self.head_size * CHUNK * 2  # K and V, bf16


BIG = Model("32MiB", 32, 8, 128)  # 2*32*8*128*256*2 = 32 MiB
SMALL = Model("1MiB", 4, 2, 128)  # 2*4*2*128*256*2 = 1 MiB


# -- files ------------------------------------------------------------------------------


def _sync_and_drop(paths: Sequence[str]) -> None:
    """fsync each file and drop its pages from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _fsync_all(paths: Sequence[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def tier_files(tier: DiskTier) -> list[str]:
    """Every object file of the tier (over all its paths)."""
    out: list[str] = []
    for root in tier.roots:
        top = os.path.join(root, diskfile.OBJECTS_DIR)
        for dirpath, _, names in os.walk(top):
            out.extend(os.path.join(dirpath, n) for n in names if n.endswith(diskfile.SUFFIX))
    return sorted(out)


def _read_into(fd: int, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise OSError(f"short read: {got} of {len(view)} bytes")
        got += n


def _each(fn: Callable[[T], None], items: Sequence[T], threads: int) -> None:
    """fn over the items, in order on this thread or spread over `threads` threads."""
    if threads <= 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(fn, items):
            pass


def ceiling_write(
    directory: str, bufs: Sequence[torch.Tensor], threads: int = 1
) -> tuple[list[str], float, float]:
    """Write one plain file per buffer (one after another, or over `threads` threads), then
    fsync each; (paths, seconds until written, seconds until written and fsynced)."""
    paths = [os.path.join(directory, f"ceiling-{i:06d}.bin") for i in range(len(bufs))]

    def write(item: tuple[str, torch.Tensor]) -> None:
        fd = os.open(item[0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            data = item[1].numpy().data
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    _each(write, list(zip(paths, bufs, strict=True)), threads)
    t1 = time.perf_counter()
    _fsync_all(paths)
    return paths, t1 - t0, time.perf_counter() - t0


def ceiling_read(
    paths: Sequence[str], dsts: Sequence[torch.Tensor], offset: int = 0, threads: int = 1
) -> float:
    """Read each file (from byte `offset`) into its buffer, one after another or over
    `threads` threads; seconds."""

    def read(item: tuple[str, torch.Tensor]) -> None:
        fd = os.open(item[0], os.O_RDONLY)
        try:
            if offset:
                os.lseek(fd, offset, os.SEEK_SET)
            _read_into(fd, item[1].numpy().data)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    _each(read, list(zip(paths, dsts, strict=True)), threads)
    return time.perf_counter() - t0


# -- data -------------------------------------------------------------------------------


def source_buffers(nbytes: int, count: int) -> list[torch.Tensor]:
    """`count` object buffers of `nbytes`, views cycling over at most SOURCE_POOL random
    bytes (so consecutive objects differ and no CPU cache holds them)."""
    distinct = max(1, min(count, SOURCE_POOL // nbytes))
    gen = torch.Generator().manual_seed(nbytes)
    pool = torch.randint(0, 256, (distinct * nbytes,), dtype=torch.uint8, generator=gen)
    return [pool[(i % distinct) * nbytes : (i % distinct + 1) * nbytes] for i in range(count)]


def touched_buffers(nbytes: int, count: int) -> list[torch.Tensor]:
    """Destination buffers whose pages are already faulted in (both sides read into them)."""
    return [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(count)]


def object_keys(count: int, tag: str) -> list[ObjectKey]:
    """Distinct keys of model `tag` (16-byte chunk hashes, like the engine's)."""
    return [
        ObjectKey(hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest(), tag, 1, 0, None)
        for i in range(count)
    ]


def _paired_ratio(t: dict[str, list[float]], ceiling: str, tier_side: str) -> float:
    """Median over rounds of the round's ceiling time / tier time (each round's pair was
    timed side by side, so a drift of the machine between rounds cancels)."""
    return _median([c / s for c, s in zip(t[ceiling], t[tier_side], strict=True)])


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


# -- 1 and 2: tier vs ceiling, paths ----------------------------------------------------


def _tier_store(
    tier: DiskTier, keys: list[ObjectKey], bufs: list[torch.Tensor]
) -> tuple[float, float]:
    """Store every object then fsync each object file; (seconds until the store's future
    completed, seconds until also fsynced)."""
    t0 = time.perf_counter()
    outcome = tier.store(list(zip(keys, bufs, strict=True))).result()
    t1 = time.perf_counter()
    _fsync_all(tier_files(tier))
    t2 = time.perf_counter()
    if outcome.stored != len(keys):
        raise RuntimeError(
            f"the disk tier stored {outcome.stored} of {len(keys)} objects: {outcome}"
        )
    return t1 - t0, t2 - t0


def _tier_load(tier: DiskTier, keys: list[ObjectKey], dsts: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    ok = tier.load(keys, dsts).result()
    elapsed = time.perf_counter() - t0
    if not all(ok):
        raise RuntimeError(f"the disk tier loaded {sum(ok)} of {len(keys)} objects")
    return elapsed


def _check(srcs: list[torch.Tensor], dsts: list[torch.Tensor], what: str) -> None:
    for i in sorted({0, len(srcs) // 2, len(srcs) - 1}):
        if not torch.equal(srcs[i], dsts[i]):
            raise AssertionError(f"{what}: object {i} read back differs from what was written")


def _fresh_dir(parent: str, name: str) -> str:
    path = os.path.join(parent, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def run_tier_case(model: Model, volume: int, base: str, rounds: int, args: Any) -> dict[str, Any]:
    """Section 1 for one object size: the ceiling (one thread; and as many threads as the
    tier has) and the tier, write (durable) then read; the sides' order rotates per round."""
    size = model.chunk_bytes
    count = max(1, volume // size)
    total = count * size
    srcs = source_buffers(size, count)
    dsts = touched_buffers(size, count)
    keys = object_keys(count, f"case{model.name}")
    par = args.io_threads
    t: dict[str, list[float]] = {k: [] for k in (
        "ceil_write", "ceil_write_buffered", "ceil_read",
        "ceil_par_write", "ceil_par_write_buffered", "ceil_par_read",
        "tier_store", "tier_store_buffered", "tier_load")}  # fmt: skip
    sides = ("ceil", "tier", "ceil_par")
    counters: dict[str, int] = {}
    for rnd in range(rounds):
        dirs = {side: _fresh_dir(base, f"{side}-{model.name}") for side in sides}
        tier = DiskTier([dirs["tier"]], 2 * total + GIB, direct_io=args.direct_io,
                        io_threads_per_path=par)  # fmt: skip
        try:
            order = sides[rnd % 3 :] + sides[: rnd % 3]
            files: dict[str, list[str]] = {}
            for side in order:
                if side == "tier":
                    buffered, durable = _tier_store(tier, keys, srcs)
                    t["tier_store_buffered"].append(buffered)
                    t["tier_store"].append(durable)
                    continue
                threads = par if side == "ceil_par" else 1
                files[side], buffered, durable = ceiling_write(dirs[side], srcs, threads)
                t[f"{side}_write_buffered"].append(buffered)
                t[f"{side}_write"].append(durable)
            files["tier"] = tier_files(tier)
            for paths in files.values():
                _sync_and_drop(paths)
            for side in order:
                for d in dsts[:: max(1, len(dsts) // 8)]:
                    d.zero_()
                if side == "tier":
                    t["tier_load"].append(_tier_load(tier, keys, dsts))
                else:
                    threads = par if side == "ceil_par" else 1
                    t[f"{side}_read"].append(ceiling_read(files[side], dsts, threads=threads))
                _check(srcs, dsts, side)
            counters = tier.stats()
        finally:
            tier.close()
            for path in dirs.values():
                shutil.rmtree(path, ignore_errors=True)
    gbps = {k: total / _median(v) / 1e9 for k, v in t.items()}

    return {
        "model": model.name,
        "object_bytes": size,
        "objects": count,
        "bytes": total,
        "rounds": rounds,
        "ceiling_threads_par": par,
        "gbps": gbps,
        "seconds": dict(t),
        "store_ratio": _paired_ratio(t, "ceil_write", "tier_store"),
        "load_ratio": _paired_ratio(t, "ceil_read", "tier_load"),
        "store_ratio_par": _paired_ratio(t, "ceil_par_write", "tier_store"),
        "load_ratio_par": _paired_ratio(t, "ceil_par_read", "tier_load"),
        "store_ratio_buffered": _paired_ratio(t, "ceil_write_buffered", "tier_store_buffered"),
        "store_ratio_par_buffered": _paired_ratio(
            t, "ceil_par_write_buffered", "tier_store_buffered"
        ),
        "counts": {"direct_io_paths": counters.get("direct_io_paths", 0)},
    }


def run_scaling(
    model: Model, volume: int, dirs: Sequence[str], rounds: int, args: Any
) -> dict[str, Any]:
    """Section 2: the same volume through a tier over one path and one over two."""
    size = model.chunk_bytes
    count = max(2, volume // size)
    total = count * size
    srcs = source_buffers(size, count)
    dsts = touched_buffers(size, count)
    keys = object_keys(count, "scale")
    if len(dirs) >= 2:
        layout = {"one": [os.path.join(dirs[0], "scale-one")],
                  "two": [os.path.join(dirs[0], "scale-two"), os.path.join(dirs[1], "scale-two")]}  # fmt: skip
        note = "two --dir directories"
    else:
        layout = {"one": [os.path.join(dirs[0], "scale-one")],
                  "two": [os.path.join(dirs[0], "scale-two-a"), os.path.join(dirs[0], "scale-two-b")]}  # fmt: skip
        note = "two subdirectories of one --dir (one device: no device scaling can show)"
    t: dict[str, list[float]] = {k: [] for k in ("one_store", "two_store", "one_load", "two_load")}
    per_path: list[list[int]] = []
    for rnd in range(rounds):
        tiers = {}
        try:
            for name, paths in layout.items():
                for p in paths:
                    _fresh_dir(os.path.dirname(p), os.path.basename(p))
                tiers[name] = DiskTier(paths, 2 * total + GIB, direct_io=args.direct_io,
                                       io_threads_per_path=args.io_threads)  # fmt: skip
            order = ("one", "two") if rnd % 2 == 0 else ("two", "one")
            for name in order:
                t[f"{name}_store"].append(_tier_store(tiers[name], keys, srcs)[1])
            for tier in tiers.values():
                _sync_and_drop(tier_files(tier))
            for name in order:
                t[f"{name}_load"].append(_tier_load(tiers[name], keys, dsts))
                _check(srcs, dsts, f"{name} path(s)")
            per_path = [[p["objects"] for p in tiers["two"].describe()["paths"]]]
        finally:
            for tier in tiers.values():
                tier.close()
            for paths in layout.values():
                for p in paths:
                    shutil.rmtree(p, ignore_errors=True)
    gbps = {k: total / _median(v) / 1e9 for k, v in t.items()}
    return {
        "model": model.name,
        "bytes": total,
        "objects": count,
        "layout": note,
        "counts": {"objects_per_path_two": per_path[0] if per_path else []},
        "gbps": gbps,
        "store_ratio": _median(
            [o / w for o, w in zip(t["one_store"], t["two_store"], strict=True)]
        ),
        "load_ratio": _median([o / w for o, w in zip(t["one_load"], t["two_load"], strict=True)]),
    }


# -- 3: store latency ------------------------------------------------------------------


def _engine(l1_bytes: int, tier: DiskTier | None) -> CacheEngine:
    config = ServerConfig(chunk_size=CHUNK, l1_size_gb=l1_bytes / GIB,
                          observability=ObservabilityConfig(enabled=False))  # fmt: skip
    return CacheEngine(config, l2_tiers=[tier] if tier is not None else None)


def _kv(model: Model, chunks: int) -> tuple[Any, dict[str, Any]]:
    return make_kv_caches(
        KVFormat.VLLM_FLASH_ATTN, num_layers=model.layers, num_blocks=chunks * CHUNK // BLOCK,
        block_size=BLOCK, num_heads=model.heads, head_size=model.head_size,
        dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1),
    )  # fmt: skip


def _drain(engine: CacheEngine, timeout: float = 120.0) -> None:
    """Wait until the engine's write-through has nothing pending."""
    deadline = time.monotonic() + timeout
    while True:
        l2 = engine.status()["l2"]
        if l2 is None or not l2["in_flight"]["write_through"]["calls"]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the write-through did not drain in {timeout} s")
        time.sleep(0.001)


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def run_latency(model: Model, base: str, args: Any) -> dict[str, Any]:
    """Section 3: store() latency, L2 on vs off, fresh chunks every store."""
    chunks = args.lat_chunks
    kv, kw = _kv(model, chunks)
    blocks = list(range(chunks * CHUNK // BLOCK))
    tdir = _fresh_dir(base, "latency")
    op_bytes = chunks * model.chunk_bytes
    l1_bytes = max(256 * MIB, 16 * op_bytes)
    tier = DiskTier([tdir], 4 * GIB, direct_io=args.direct_io, io_threads_per_path=args.io_threads)
    engines = {"off": _engine(l1_bytes, None), "on": _engine(l1_bytes, tier)}
    for mode, engine in engines.items():
        engine.register_kv_caches(mode, kv, model_name=f"lat-{mode}", **kw)
    base_tokens = np.arange(chunks * CHUNK, dtype=np.int32)
    serial = [0]

    def store(mode: str) -> float:
        serial[0] += 1
        tokens = base_tokens + serial[0] * 1_000_000
        t0 = time.perf_counter()
        got = engines[mode].store(mode, tokens, blocks, request_id=f"r{serial[0]}")
        elapsed = time.perf_counter() - t0
        if got != chunks * CHUNK:
            raise RuntimeError(f"store {mode} kept {got} of {chunks * CHUNK} tokens")
        return elapsed

    times: dict[str, list[float]] = {k: [] for k in ("off", "on", "busy_off", "busy_on")}
    try:
        for rnd in range(args.lat_warmup + args.lat_rounds):
            for mode in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
                _drain(engines["on"])  # untimed: nothing of an earlier store still runs
                sample = store(mode)
                if rnd >= args.lat_warmup:
                    times[mode].append(sample)
        _drain(engines["on"])
        # busy: a block of back-to-back stores per engine, the background writes running
        for rnd in range(2):
            for mode in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
                for _ in range(args.lat_rounds // 2):
                    times[f"busy_{mode}"].append(store(mode))
                _drain(engines["on"])
        disk = engines["on"].status()["l2"]["tiers"]["disk"]
        written, refused = disk["stored"], disk["store_failures"]
    finally:
        for engine in engines.values():
            engine.close(timeout=120.0)
        shutil.rmtree(tdir, ignore_errors=True)
    row: dict[str, Any] = {"model": model.name, "chunks_per_store": chunks, "op_bytes": op_bytes,
                           "rounds": args.lat_rounds,
                           "counts": {"written_through_chunks": written,
                                      "write_through_refused_chunks": refused}}  # fmt: skip
    for k, v in times.items():
        row[f"{k}_p50_ms"] = _pct(v, 50) * 1e3
        row[f"{k}_p90_ms"] = _pct(v, 90) * 1e3
    row["added_p50_pct"] = (row["on_p50_ms"] / row["off_p50_ms"] - 1) * 100
    row["added_p90_pct"] = (row["on_p90_ms"] / row["off_p90_ms"] - 1) * 100
    row["busy_added_p50_pct"] = (row["busy_on_p50_ms"] / row["busy_off_p50_ms"] - 1) * 100
    row["busy_added_p90_pct"] = (row["busy_on_p90_ms"] / row["busy_off_p90_ms"] - 1) * 100
    row["paired_on_off"] = _median([a / b for a, b in zip(times["on"], times["off"], strict=True)])
    return row


# -- 4: prefetch -------------------------------------------------------------------------


def _wait_l1(engine: CacheEngine, objects: int, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.l1.stats()["objects"] < objects:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the prefetch did not land {objects} chunks in {timeout} s")
        time.sleep(0.0005)


def run_prefetch(model: Model, volume: int, base: str, rounds: int, args: Any) -> dict[str, Any]:
    """Section 4: lookup -> every chunk in L1, vs a plain read of the same object files."""
    size = model.chunk_bytes
    chunks = max(1, volume // size)
    total = chunks * size
    kv, kw = _kv(model, chunks)
    blocks = list(range(chunks * CHUNK // BLOCK))
    tdir = _fresh_dir(base, f"prefetch-{model.name}")
    tier = DiskTier([tdir], 2 * total + GIB, direct_io=args.direct_io,
                    io_threads_per_path=args.io_threads)  # fmt: skip
    # the write-through pins at most half of L1: room for twice the data (L1 grows lazily)
    engine = _engine(2 * total + 256 * MIB, tier)
    tokens = np.arange(chunks * CHUNK, dtype=np.int32) + 7
    t: dict[str, list[float]] = {"prefetch": [], "ceiling": []}
    dsts = touched_buffers(size, chunks)
    try:
        engine.register_kv_caches("pf", kv, model_name=f"pf-{model.name}", **kw)
        engine.store("pf", tokens, blocks, request_id="fill")
        _drain(engine)
        files = tier_files(tier)
        if len(files) != chunks:
            raise RuntimeError(f"{len(files)} object files on disk, {chunks} chunks stored")
        for rnd in range(rounds):
            for side in ("prefetch", "ceiling") if rnd % 2 == 0 else ("ceiling", "prefetch"):
                engine.l1.drop_where(lambda k: True)
                if engine.l1.stats()["objects"]:
                    raise RuntimeError("L1 still holds objects after drop_where")
                _sync_and_drop(files)
                if side == "ceiling":  # the same bytes: the payloads of the object files
                    t["ceiling"].append(ceiling_read(files, dsts, offset=diskfile.BLOCK))
                    continue
                t0 = time.perf_counter()
                hit = engine.lookup(tokens, model_name=f"pf-{model.name}", request_id=f"q{rnd}")
                _wait_l1(engine, chunks)
                t["prefetch"].append(time.perf_counter() - t0)
                if hit != chunks * CHUNK:
                    raise RuntimeError(f"lookup hit {hit} of {chunks * CHUNK} tokens")
        loaded = engine.status()["l2"]["tiers"]["disk"]["loaded"]
    finally:
        engine.close(timeout=120.0)
        shutil.rmtree(tdir, ignore_errors=True)
    return {
        "model": model.name,
        "chunks": chunks,
        "bytes": total,
        "rounds": rounds,
        "counts": {"loaded_chunks": loaded},
        "prefetch_s": _median(t["prefetch"]),
        "ceiling_s": _median(t["ceiling"]),
        "prefetch_gbps": total / _median(t["prefetch"]) / 1e9,
        "ceiling_gbps": total / _median(t["ceiling"]) / 1e9,
        "ratio": _median([c / p for c, p in zip(t["ceiling"], t["prefetch"], strict=True)]),
        "seconds": t,
    }


# -- 6: a request larger than L1 ------------------------------------------------------------


def _sync_device(caches: list[torch.Tensor]) -> None:
    """Wait for the caches' device (a CUDA retrieve returns before its copies landed)."""
    if caches[0].is_cuda:
        torch.cuda.synchronize(caches[0].device)


def _engine_side(
    model: Model, l1_bytes: int, tdir: str, kv: list[Any], blocks: list[int], args: Any
) -> tuple[float, float]:
    """One request of len(blocks) blocks stored through an engine with L1 `l1_bytes` and a
    disk tier in `tdir`, then retrieved from a cold L1 and page cache; (store s, retrieve s)
    with the bytes checked."""
    (src, src_kw), (dst, dst_kw) = kv
    chunks = len(blocks) * BLOCK // CHUNK
    tier = DiskTier([tdir], 2 * chunks * model.chunk_bytes + GIB, direct_io=args.direct_io,
                    io_threads_per_path=args.io_threads)  # fmt: skip
    engine = _engine(l1_bytes, tier)
    tokens = np.arange(chunks * CHUNK, dtype=np.int32) + int(time.time_ns() % 1_000_000) * 7
    try:
        engine.register_kv_caches("src", src, model_name="big", **src_kw)
        engine.register_kv_caches("dst", dst, model_name="big", **dst_kw)
        t0 = time.perf_counter()
        held = engine.store("src", tokens, blocks, request_id="store")
        _drain(engine)
        _sync_device(src)
        store_s = time.perf_counter() - t0
        if held != chunks * CHUNK or engine.status()["l2"]["write_through"]["dropped_chunks"]:
            raise RuntimeError(f"the engine held {held} of {chunks * CHUNK} tokens or dropped")
        engine.l1.drop_where(lambda k: True)
        _sync_and_drop(tier_files(tier))
        for layer in dst:
            layer.zero_()
        t0 = time.perf_counter()
        got = engine.retrieve("dst", tokens, blocks, request_id="retrieve")
        _sync_device(dst)
        retrieve_s = time.perf_counter() - t0
        if got != chunks * CHUNK:
            raise RuntimeError(f"the retrieve got {got} of {chunks * CHUNK} tokens")
        same = (
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(src, dst, strict=True)
        )
        if not all(same):  # compared as bytes: random bf16 bits hold NaNs
            raise AssertionError("the retrieved KV differs from the stored KV")
    finally:
        engine.close(timeout=120.0)
    return store_s, retrieve_s


def run_beyond_l1(model: Model, l1_bytes: int, base: str, rounds: int, args: Any) -> dict[str, Any]:
    """Section 6: a request 4x L1 through the engine vs the disk tier alone, same bytes;
    and the same request through an engine whose L1 holds it (no streaming), which shows
    what streaming itself costs apart from the engine's copies."""
    chunks = 4 * l1_bytes // model.chunk_bytes
    total = chunks * model.chunk_bytes
    device = torch.device(args.beyond_l1_device)
    kv = [
        make_kv_caches(
            KVFormat.VLLM_FLASH_ATTN,
            num_layers=model.layers,
            num_blocks=chunks * CHUNK // BLOCK,
            block_size=BLOCK,
            num_heads=model.heads,
            head_size=model.head_size,
            dtype=torch.bfloat16,
            device=device,
            generator=torch.Generator().manual_seed(seed),
        )
        for seed in (1, 2)
    ]
    blocks = list(range(chunks * CHUNK // BLOCK))
    srcs = source_buffers(model.chunk_bytes, chunks)
    dsts = touched_buffers(model.chunk_bytes, chunks)
    l1_sizes = {"engine": l1_bytes, "engine_big": 2 * total + 64 * MIB}
    t: dict[str, list[float]] = {
        f"{side}_{op}": []
        for side, ops in (("engine", ("store", "retrieve")), ("engine_big", ("store", "retrieve")),
                          ("tier", ("store", "load")))
        for op in ops
    }  # fmt: skip
    sides = ("engine", "tier", "engine_big")
    # untimed: the first engine of a process builds its kernels and starts CUDA (seconds)
    warm = _fresh_dir(base, "beyond-warmup")
    try:
        _engine_side(model, l1_bytes, warm, kv, blocks, args)
    finally:
        shutil.rmtree(warm, ignore_errors=True)
    for rnd in range(rounds):
        for side in sides[rnd % 3 :] + sides[: rnd % 3]:
            tdir = _fresh_dir(base, f"beyond-{side}")
            try:
                if side != "tier":
                    store_s, retrieve_s = _engine_side(model, l1_sizes[side], tdir, kv, blocks,
                                                       args)  # fmt: skip
                    t[f"{side}_store"].append(store_s)
                    t[f"{side}_retrieve"].append(retrieve_s)
                    continue
                keys = object_keys(chunks, f"beyond-{rnd}")
                tier = DiskTier([tdir], 2 * total + GIB, direct_io=args.direct_io,
                                io_threads_per_path=args.io_threads)  # fmt: skip
                try:
                    t["tier_store"].append(_tier_store(tier, keys, srcs)[0])
                    _sync_and_drop(tier_files(tier))
                    t["tier_load"].append(_tier_load(tier, keys, dsts))
                    _check(srcs, dsts, "tier alone")
                finally:
                    tier.close()
            finally:
                shutil.rmtree(tdir, ignore_errors=True)
    return {
        "model": model.name,
        "device": str(device),
        "l1_bytes": l1_bytes,
        "chunks": chunks,
        "bytes": total,
        "rounds": rounds,
        "gbps": {k: total / _median(v) / 1e9 for k, v in t.items()},
        "store_ratio": _paired_ratio(t, "tier_store", "engine_store"),
        "retrieve_ratio": _paired_ratio(t, "tier_load", "engine_retrieve"),
        "store_ratio_big_l1": _paired_ratio(t, "engine_big_store", "engine_store"),
        "retrieve_ratio_big_l1": _paired_ratio(t, "engine_big_retrieve", "engine_retrieve"),
        "seconds": t,
    }


# -- 5: Redis tier ------------------------------------------------------------------------

#: the model name of the lookup's keys (a realistic one: its escaping is part of the cost)
LOOKUP_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LOOKUP_KEYS = 500  # a 128k-token prompt in 256-token chunks
REDIS_PREFIX = "kvflow-bench:"


class LocalRedis:
    """A redis-server of this run: a free loopback port, no persistence, no memory bound,
    in a temporary directory; stopped (and the directory removed) by `stop`."""

    def __init__(self, binary: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="bench-tiers-redis-")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--maxmemory", "0", "--dir", self.dir,
               "--logfile", os.path.join(self.dir, "redis.log"), "--daemonize", "no"]  # fmt: skip
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5,
                             socket_connect_timeout=0.5)  # fmt: skip
        deadline = time.monotonic() + 10.0
        try:
            while True:
                if self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"redis-server exited ({self.process.returncode})")
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _plain_client(target: RedisTarget, timeout_s: float = 30.0) -> redis.Redis:
    """A plain redis-py client of the target (one connection when used by one thread)."""
    tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": target.ca_certs} if target.tls else {}
    return redis.Redis(host=target.host, port=target.port, db=target.db,
                       username=target.username, password=target.password,
                       socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **tls)  # fmt: skip


def _redis_tier(target: RedisTarget, args: Any) -> RedisTier:
    # a generous timeout: a 64 MiB pipeline on a loaded 2-core machine is not a fault
    tier = RedisTier(target, key_prefix=REDIS_PREFIX, timeout_s=30.0, pool_size=args.redis_pool)
    if not tier.stats()["connected"]:
        tier.close()
        raise RuntimeError(f"the Redis tier could not reach {target.safe_url()}")
    return tier


def _plain_names(count: int, tag: str) -> list[bytes]:
    return [f"bench-plain:{tag}:{i:06d}".encode() for i in range(count)]


def _shares(count: int, n: int) -> list[list[int]]:
    """Object indices dealt round-robin over n threads (empty shares dropped)."""
    return [s for s in (list(range(j, count, n)) for j in range(n)) if s]


def run_redis_case(
    model: Model, volume: int, target: RedisTarget, rounds: int, args: Any
) -> dict[str, Any]:
    """Store then load `volume` bytes of `model`'s chunks through RedisTier, and through
    plain redis-py SET then GET of the same sizes over as many connections as the tier has
    (one thread each, each its round-robin share); sides alternate per round; FLUSHDB
    after each side."""
    size = model.chunk_bytes
    count = max(1, volume // size)
    total = count * size
    srcs = source_buffers(size, count)
    dsts = touched_buffers(size, count)
    keys = object_keys(count, f"redis{model.name}")
    names = _plain_names(count, model.name)
    conns = args.redis_pool
    clients = [_plain_client(target) for _ in range(conns)]
    admin = _plain_client(target)
    tier = _redis_tier(target, args)
    pool = ThreadPoolExecutor(conns, thread_name_prefix="bench-redis-plain")
    shares = _shares(count, conns)
    got: list[int] = [0] * count
    t: dict[str, list[float]] = {k: [] for k in ("ceil_set", "ceil_get", "tier_store", "tier_load")}

    def plain_set(j: int) -> None:
        client = clients[j]
        for i in shares[j]:
            client.set(names[i], srcs[i].numpy().data)

    def plain_get(j: int) -> None:
        client = clients[j]
        for i in shares[j]:
            value = client.get(names[i])
            got[i] = -1 if value is None else len(value)

    def plain(fn: Callable[[int], None]) -> float:
        t0 = time.perf_counter()
        for _ in pool.map(fn, range(len(shares))):
            pass
        return time.perf_counter() - t0

    try:
        for c in (admin, *clients):
            c.ping()
        admin.flushdb()
        for rnd in range(rounds):
            for side in ("ceil", "tier") if rnd % 2 == 0 else ("tier", "ceil"):
                for d in dsts[:: max(1, len(dsts) // 8)]:
                    d.zero_()
                if side == "ceil":
                    got[:] = [0] * count
                    t["ceil_set"].append(plain(plain_set))
                    t["ceil_get"].append(plain(plain_get))
                    if got != [size] * count:
                        raise RuntimeError(f"plain GET: {sum(g == size for g in got)} of {count}")
                else:
                    t0 = time.perf_counter()
                    outcome = tier.store(list(zip(keys, srcs, strict=True))).result()
                    t["tier_store"].append(time.perf_counter() - t0)
                    if outcome.stored != count:
                        raise RuntimeError(f"the Redis tier stored {outcome}, not {count}")
                    t0 = time.perf_counter()
                    ok = tier.load(keys, dsts).result()
                    t["tier_load"].append(time.perf_counter() - t0)
                    if not all(ok):
                        raise RuntimeError(f"the Redis tier loaded {sum(ok)} of {count} objects")
                    _check(srcs, dsts, "redis tier")
                admin.flushdb()
        used = int(admin.info("memory")["used_memory"])
    finally:
        pool.shutdown(wait=True)
        tier.close()
        for c in (admin, *clients):
            c.close()
    gbps = {k: total / _median(v) / 1e9 for k, v in t.items()}

    return {
        "model": model.name,
        "object_bytes": size,
        "objects": count,
        "bytes": total,
        "rounds": rounds,
        "connections": conns,
        "gbps": gbps,
        "seconds": dict(t),
        "store_ratio": _paired_ratio(t, "ceil_set", "tier_store"),
        "load_ratio": _paired_ratio(t, "ceil_get", "tier_load"),
        "counts": {
            "tier_pipelines_per_call": -(-count // max(1, BATCH_BYTES // size)),
            "used_memory_after_flush": used,
        },
    }


class _TripCounter:
    """Counts round trips on redis-py connections: a send followed by a read (as many
    sends as wanted before the first read of their replies count as one trip)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> _TripCounter:
        cls = redis.connection.AbstractConnection
        send, read = cls.send_packed_command, cls.read_response
        events = self.events

        def counting_send(conn: Any, *a: Any, **kw: Any) -> Any:
            events.append("send")
            return send(conn, *a, **kw)

        def counting_read(conn: Any, *a: Any, **kw: Any) -> Any:
            events.append("read")
            return read(conn, *a, **kw)

        self._saved = (send, read)
        setattr(cls, "send_packed_command", counting_send)  # noqa: B010
        setattr(cls, "read_response", counting_read)  # noqa: B010
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._saved is not None
        cls = redis.connection.AbstractConnection
        setattr(cls, "send_packed_command", self._saved[0])  # noqa: B010
        setattr(cls, "read_response", self._saved[1])  # noqa: B010

    @property
    def trips(self) -> int:
        return sum(1 for a, b in itertools.pairwise(self.events) if (a, b) == ("send", "read"))


def _trips(admin: redis.Redis, run: Callable[[], Any]) -> dict[str, int]:
    """Round trips of `run` (client side: send then read on redis-py connections), and
    the EXISTS calls and server read events (socket reads) meanwhile, from INFO deltas
    (the INFO call's own read subtracted)."""
    admin.config_resetstat()
    before = int(admin.info("stats")["total_reads_processed"])
    with _TripCounter() as counter:
        run()
    after = int(admin.info("stats")["total_reads_processed"])
    exists = admin.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)
    return {"round_trips": counter.trips, "exists_calls": int(exists),
            "server_reads": after - before - 1}  # fmt: skip


def run_redis_lookup(target: RedisTarget, reps: int, args: Any) -> dict[str, Any]:
    """`contains` of the chunk keys of a 128k-token prompt (all present), alternating per
    repetition with a plain redis-py pipeline of as many EXISTS (names prepared)."""
    keys = [
        ObjectKey(hashlib.blake2b(f"p-{i}".encode(), digest_size=16).digest(), LOOKUP_MODEL, 1, 0, None)
        for i in range(LOOKUP_KEYS)
    ]  # fmt: skip
    admin = _plain_client(target)
    plain = _plain_client(target)
    tier = _redis_tier(target, args)
    names = [tier.redis_key(k) for k in keys]
    t: dict[str, list[float]] = {"tier": [], "ceiling": [], "key_names": []}

    def ceiling() -> list[Any]:
        pipe = plain.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return list(pipe.execute())

    def lookup() -> list[bool]:
        return tier.contains(keys).result()

    try:
        admin.flushdb()
        payload = torch.zeros(1024, dtype=torch.uint8)
        stored = tier.store([(k, payload) for k in keys]).result()
        if stored.stored != len(keys):
            raise RuntimeError(f"lookup keys: the Redis tier stored {stored}")
        warm = max(3, reps // 10)
        for rep in range(warm + reps):
            for side in ("tier", "ceiling") if rep % 2 == 0 else ("ceiling", "tier"):
                t0 = time.perf_counter()
                answer = lookup() if side == "tier" else ceiling()
                elapsed = time.perf_counter() - t0
                if not all(answer):
                    raise RuntimeError(f"{side}: {sum(map(bool, answer))} of {len(keys)} held")
                if rep >= warm:
                    t[side].append(elapsed)
            t0 = time.perf_counter()
            for k in keys:  # the tier's own first step, timed alone
                tier.redis_key(k)
            if rep >= warm:
                t["key_names"].append(time.perf_counter() - t0)
        trips = {"tier": _trips(admin, lookup), "ceiling": _trips(admin, ceiling)}
        admin.flushdb()
    finally:
        tier.close()
        admin.close()
        plain.close()
    row: dict[str, Any] = {
        "keys": len(keys),
        "reps": reps,
        "model_name": LOOKUP_MODEL,
        "seconds": t,
        "ratio": _median([c / s for c, s in zip(t["ceiling"], t["tier"], strict=True)]),
        "counts": {f"{side}_{k}": v for side, c in trips.items() for k, v in c.items()},
    }
    for side, v in t.items():
        row[f"{side}_p50_ms"] = _pct(v, 50) * 1e3
        row[f"{side}_p90_ms"] = _pct(v, 90) * 1e3
    return row


# -- machine facts -----------------------------------------------------------------------


def _mount_of(path: str) -> dict[str, str]:
    real = os.path.realpath(path)
    best = {"mount": "/", "fstype": "?", "device": "?"}
    with open("/proc/mounts") as fh:
        for line in fh:
            dev, mnt, fstype, opts, *_ = line.split()
            mnt = mnt.replace("\\040", " ")
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best["mount"]):
                best = {"mount": mnt, "fstype": fstype, "device": dev, "options": opts}
    return best


def machine_facts(dirs: Sequence[str]) -> dict[str, Any]:
    cpu = platform.processor() or "?"
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "mem_total_bytes": mem,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "dirs": [{"dir": d, **_mount_of(d), "free_bytes": shutil.disk_usage(d).free} for d in dirs],
    }


# -- output ------------------------------------------------------------------------------


def table_rows(res: dict[str, Any], direct: bool) -> list[tuple[str, str, str, str, str, str]]:
    """(case, value, ceiling, ratio, target, verdict) per line of the final table."""
    rows = []

    def add(
        case: str, value: str, ceil: str, ratio: float | None, target: str, ok: bool | None
    ) -> None:
        verdict = "-" if ok is None else ("pass" if ok else "FAIL")
        rows.append((case, value, ceil, "-" if ratio is None else f"{ratio:.3f}", target, verdict))

    tag = " (O_DIRECT)" if direct else ""
    for case in res.get("tiers", []):
        g = case["gbps"]
        add(f"store {case['model']}{tag} GB/s", f"{g['tier_store']:.3f}", f"{g['ceil_write']:.3f}",
            case["store_ratio"], ">= 0.85", case["store_ratio"] >= 0.85)  # fmt: skip
        add(f"load {case['model']}{tag} GB/s", f"{g['tier_load']:.3f}", f"{g['ceil_read']:.3f}",
            case["load_ratio"], ">= 0.85", case["load_ratio"] >= 0.85)  # fmt: skip
        par = f"{case['ceiling_threads_par']}-thread ceiling"
        add(f"  store {case['model']} vs {par}", f"{g['tier_store']:.3f}",
            f"{g['ceil_par_write']:.3f}", case["store_ratio_par"], "info", None)  # fmt: skip
        add(f"  load {case['model']} vs {par}", f"{g['tier_load']:.3f}",
            f"{g['ceil_par_read']:.3f}", case["load_ratio_par"], "info", None)  # fmt: skip
    if "scaling" in res:
        disk_rows(res, add)
    if "beyond_l1" in res:
        beyond_rows(res, add)
    if "redis" in res:
        redis_rows(res, add)
    return rows


#: add(case, value, ceiling, ratio, target, verdict) appends one line of the final table
Add = Callable[[str, str, str, float | None, str, bool | None], None]


def disk_rows(res: dict[str, Any], add: Add) -> None:
    """Sections 2-4's lines of the final table."""
    s = res["scaling"]
    g = s["gbps"]
    add("store 2 paths vs 1 GB/s", f"{g['two_store']:.3f}", f"{g['one_store']:.3f}",
        s["store_ratio"], ">= 1.00", s["store_ratio"] >= 1.0)  # fmt: skip
    add("load 2 paths vs 1 GB/s", f"{g['two_load']:.3f}", f"{g['one_load']:.3f}",
        s["load_ratio"], ">= 1.00", s["load_ratio"] >= 1.0)  # fmt: skip
    lat = res["latency"]
    for q in ("p50", "p90"):
        pct = lat[f"added_{q}_pct"]
        add(f"store() {q} L2 on/off ms (drained)", f"{lat[f'on_{q}_ms']:.2f}",
            f"{lat[f'off_{q}_ms']:.2f}", 1 + pct / 100, "<= +5%", pct <= 5.0)  # fmt: skip
    for q in ("p50", "p90"):
        pct = lat[f"busy_added_{q}_pct"]
        add(f"store() {q} L2 on/off ms (busy)", f"{lat[f'busy_on_{q}_ms']:.2f}",
            f"{lat[f'busy_off_{q}_ms']:.2f}", 1 + pct / 100, "info", None)  # fmt: skip
    for pf in res["prefetch"]:
        add(f"prefetch {pf['model']} {pf['bytes'] / GIB:.2f} GiB ms", f"{pf['prefetch_s'] * 1e3:.0f}",
            f"{pf['ceiling_s'] * 1e3:.0f}", pf["ratio"], "info", None)  # fmt: skip


def beyond_rows(res: dict[str, Any], add: Add) -> None:
    """Section 6's lines: a request 4x L1 against the tier alone and an L1 holding it."""
    big = res["beyond_l1"]
    g = big["gbps"]
    l1 = f"4x L1 ({big['l1_bytes'] // MIB} MiB)"
    add(f"store() {l1} GB/s vs tier", f"{g['engine_store']:.3f}", f"{g['tier_store']:.3f}",
        big["store_ratio"], ">= 0.80", big["store_ratio"] >= 0.8)  # fmt: skip
    add(f"retrieve() {l1} GB/s vs tier", f"{g['engine_retrieve']:.3f}", f"{g['tier_load']:.3f}",
        big["retrieve_ratio"], ">= 0.80", big["retrieve_ratio"] >= 0.8)  # fmt: skip
    add(f"  store() {l1} vs an L1 holding it", f"{g['engine_store']:.3f}",
        f"{g['engine_big_store']:.3f}", big["store_ratio_big_l1"], "info", None)  # fmt: skip
    add(f"  retrieve() {l1} vs an L1 holding it", f"{g['engine_retrieve']:.3f}",
        f"{g['engine_big_retrieve']:.3f}", big["retrieve_ratio_big_l1"], "info", None)  # fmt: skip


def redis_rows(res: dict[str, Any], add: Add) -> None:
    """Section 5's lines: tier vs plain redis-py, and the 500-key lookup."""
    r = res["redis"]
    for case in r["cases"]:
        g = case["gbps"]
        add(f"redis store {case['model']} GB/s", f"{g['tier_store']:.3f}", f"{g['ceil_set']:.3f}",
            case["store_ratio"], ">= 0.85", case["store_ratio"] >= 0.85)  # fmt: skip
        add(f"redis load {case['model']} GB/s", f"{g['tier_load']:.3f}", f"{g['ceil_get']:.3f}",
            case["load_ratio"], ">= 0.85", case["load_ratio"] >= 0.85)  # fmt: skip
    lk = r["lookup"]
    local = res["machine"]["redis"]["local"]
    n = lk["keys"]
    for q in ("p50", "p90"):
        value = lk[f"tier_{q}_ms"]
        target, ok = ("<= 2 ms", value <= 2.0) if q == "p50" and local else ("info", None)
        add(f"redis contains {n} keys {q} ms", f"{value:.3f}", f"{lk[f'ceiling_{q}_ms']:.3f}",
            lk["ratio"] if q == "p50" else None, target, ok)  # fmt: skip
    c = lk["counts"]
    add(f"redis contains {n} keys round trips", str(c["tier_round_trips"]),
        str(c["ceiling_round_trips"]), None, "1", c["tier_round_trips"] == 1)  # fmt: skip
    add(f"  server reads / EXISTS run (contains {n})",
        f"{c['tier_server_reads']}/{c['tier_exists_calls']}",
        f"{c['ceiling_server_reads']}/{c['ceiling_exists_calls']}", None, "info", None)  # fmt: skip
    add(f"  of which {n} key names p50 ms", f"{lk['key_names_p50_ms']:.3f}", "-", None,
        "info", None)  # fmt: skip


def print_table(rows: list[tuple[str, str, str, str, str, str]]) -> None:
    head = ("case", "value", "ceiling", "ratio", "target", "")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(6)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    print(fmt.format(*head))
    print("-" * (sum(widths) + 10))
    for r in rows:
        print(fmt.format(*r))


@dataclass(frozen=True)
class Plan:
    big_bytes: int
    small_bytes: int
    prefetch_bytes: int
    rounds: int
    redis_big_bytes: int
    redis_small_bytes: int
    lookup_reps: int


def _plan(args: Any) -> Plan:
    if args.quick:
        return Plan(2 * BIG.chunk_bytes, 16 * SMALL.chunk_bytes, 2 * BIG.chunk_bytes, 1,
                    2 * BIG.chunk_bytes, 16 * SMALL.chunk_bytes, 6)  # fmt: skip
    small = args.small_gib if args.small_gib is not None else args.gib / 4
    redis_bytes = int(args.redis_gib * GIB)
    return Plan(int(args.gib * GIB), int(small * GIB), int(args.prefetch_gib * GIB), args.rounds,
                redis_bytes, redis_bytes, args.lookup_reps)  # fmt: skip


def run_redis(args: Any, plan: Plan, res: dict[str, Any]) -> None:
    """Section 5 against `--redis URL`, or a redis-server started for this run (and
    stopped at its end); server facts go to res["machine"]["redis"]."""
    local = None
    url = args.redis
    if url is None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit(
                "bench_tiers: redis-server is not installed (apt-get install redis-server): "
                "give --redis URL, or --no-redis to skip the Redis tier"
            )
        local = LocalRedis(binary)
        url = local.url
        _progress(f"started a local redis-server on 127.0.0.1:{local.port} for this run "
                  f"(--save '' --appendonly no, no maxmemory, in {local.dir}); it is "
                  "stopped at the end")  # fmt: skip
    try:
        target = resolve_target(url)
        admin = _plain_client(target, timeout_s=10.0)
        try:
            info = admin.info("server")
            maxmemory = int(admin.info("memory")["maxmemory"])
            keys = int(admin.dbsize())
            io_threads = admin.config_get("io-threads").get("io-threads", "?")
        finally:
            admin.close()
        if local is None and keys:
            raise SystemExit(
                f"bench_tiers: {target.safe_url()} holds {keys} keys and the benchmark "
                "FLUSHDBs its database: give an empty database (e.g. /15)"
            )
        need = 2 * max(plan.redis_big_bytes, plan.redis_small_bytes) + 64 * MIB
        if maxmemory and maxmemory < need:
            raise SystemExit(
                f"bench_tiers: {target.safe_url()} has maxmemory {maxmemory} bytes; the "
                f"benchmark needs about {need} (lower --redis-gib or raise maxmemory)"
            )
        res["machine"]["redis"] = {
            "url": target.safe_url(),
            "local": local is not None or target.host in ("localhost", "127.0.0.1", "::1"),
            "started_here": local is not None,
            "redis_version": info.get("redis_version", "?"),
            "os": info.get("os", "?"),
            "maxmemory_bytes": maxmemory,
            "io_threads": io_threads,
        }
        res["settings"]["redis"] = {
            "connections": args.redis_pool,
            "tier": f"RedisTier(pool_size={args.redis_pool}, key_prefix={REDIS_PREFIX!r})",
            "ceiling": "plain redis-py SET then GET of the payload, one thread per connection "
            "(as many as the tier's pool_size), each its round-robin share, one command at a "
            "time; the tier's values are the payload plus a header and the key",
            "between_sides": "FLUSHDB (untimed)",
            "lookup": f"{LOOKUP_KEYS} present keys of model {LOOKUP_MODEL!r}: RedisTier.contains "
            "vs a plain redis-py pipeline of as many EXISTS (names prepared), alternating per "
            "repetition; round trips = a send followed by a read on redis-py connections",
        }
        cases = [
            run_redis_case(BIG, plan.redis_big_bytes, target, plan.rounds, args),
            run_redis_case(SMALL, plan.redis_small_bytes, target, plan.rounds, args),
        ]
        res["redis"] = {"cases": cases, "lookup": run_redis_lookup(target, plan.lookup_reps, args)}
    finally:
        if local is not None:
            local.stop()


def _want(args: Any, part: str) -> bool:
    if part == "redis" and args.no_redis:
        return False
    return args.only in (None, part)


def run(args: Any, dirs: Sequence[str]) -> dict[str, Any]:
    plan = _plan(args)
    if args.quick:
        args.lat_rounds, args.lat_warmup, args.lat_chunks = 6, 1, 4
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "machine": machine_facts(dirs),
        "settings": {
            "dirs": list(dirs),
            "direct_io": args.direct_io,
            "io_threads_per_path": args.io_threads,
            "rounds": plan.rounds,
            "quick": args.quick,
            "parts": [p for p in ("disk", "redis") if _want(args, p)],
            "page_cache": CACHE_DROP,
            "writes": "timed until every byte is written and every file fsynced, ceiling "
            "and tier alike (the tier does not fsync: each object file is fsynced after "
            "its store completes); *_buffered figures stop before the fsync",
            "ceiling": "one thread, plain files of the object's payload size, "
            "written then read one after another",
        },
    }
    if args.only == "beyond_l1":
        run_beyond_only(args, plan, dirs, res)
    elif _want(args, "disk"):
        run_disk(args, plan, dirs, res)
    if _want(args, "redis"):
        run_redis(args, plan, res)
    res["elapsed_s"] = time.perf_counter() - t0
    return res


def run_disk(args: Any, plan: Plan, dirs: Sequence[str], res: dict[str, Any]) -> None:
    """Sections 1-4 and 6 into `res`."""
    work = [tempfile.mkdtemp(prefix="bench-tiers-", dir=d) for d in dirs]
    try:
        res["tiers"] = [
            run_tier_case(BIG, plan.big_bytes, work[0], plan.rounds, args),
            run_tier_case(SMALL, plan.small_bytes, work[0], plan.rounds, args),
        ]
        res["scaling"] = run_scaling(BIG, plan.big_bytes, work, plan.rounds, args)
        res["latency"] = run_latency(SMALL, work[0], args)
        res["prefetch"] = [
            run_prefetch(BIG, plan.prefetch_bytes, work[0], plan.rounds, args),
            run_prefetch(SMALL, max(plan.prefetch_bytes // 4, 4 * MIB), work[0], plan.rounds, args),
        ]
        l1_mib = 16 if args.quick else args.beyond_l1_mib
        res["beyond_l1"] = run_beyond_l1(SMALL, l1_mib * MIB, work[0], plan.rounds, args)
    finally:
        for w in work:
            shutil.rmtree(w, ignore_errors=True)


def run_beyond_only(args: Any, plan: Plan, dirs: Sequence[str], res: dict[str, Any]) -> None:
    """Section 6 alone (`--only beyond_l1`), in a fresh directory of the first path."""
    work = tempfile.mkdtemp(prefix="bench-tiers-", dir=dirs[0])
    try:
        l1_mib = 16 if args.quick else args.beyond_l1_mib
        res["beyond_l1"] = run_beyond_l1(SMALL, l1_mib * MIB, work, plan.rounds, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


#: result sections that hold measurements (the rest: machine facts and settings)
SECTIONS = ("tiers", "scaling", "latency", "prefetch", "beyond_l1", "redis")


def figures(obj: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every measured number of a result (or part of one), with its path; counts (which
    may be 0) are left out. Each must be positive but the `_pct` ones (signed)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if (path == "" and k not in SECTIONS) or k == "counts":
                continue
            yield from figures(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from figures(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", action="append", dest="dirs",
                        help="directory to test in (repeat for the two-path case); default: a "
                        "temporary directory under the current directory")  # fmt: skip
    parser.add_argument("--gib", type=float, default=1.0, help="GiB per 32 MiB-object case (1)")
    parser.add_argument("--small-gib", type=float, default=None,
                        help="GiB for the 1 MiB-object case (default: --gib / 4)")  # fmt: skip
    parser.add_argument("--prefetch-gib", type=float, default=1.0,
                        help="GiB prefetched with 32 MiB chunks (1 MiB chunks: a quarter)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per case")
    parser.add_argument("--direct-io", action="store_true", help="run the tier with O_DIRECT")
    parser.add_argument("--io-threads", type=int, default=2, help="tier I/O threads per path")
    parser.add_argument("--lat-rounds", type=int, default=40, help="timed stores per engine")
    parser.add_argument("--lat-warmup", type=int, default=5, help="untimed stores per engine")
    parser.add_argument("--lat-chunks", type=int, default=16, help="1 MiB chunks per store")
    parser.add_argument("--beyond-l1-mib", type=int, default=64,
                        help="L1 MiB of the 4x-L1 request case (64; --quick: 16)")  # fmt: skip
    parser.add_argument("--beyond-l1-device", default="cpu",
                        help="device of the 4x-L1 case's KV caches (cpu; cuda:0 for a GPU)")  # fmt: skip
    parser.add_argument("--redis", metavar="URL",
                        help="benchmark the Redis tier against this server (its database is "
                        "FLUSHDB'd: it must start empty); default: a redis-server started on "
                        "a free loopback port for the run and stopped at its end")  # fmt: skip
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis tier")
    parser.add_argument("--only", choices=("disk", "redis", "beyond_l1"),
                        help="run only this part (beyond_l1: section 6 alone)")  # fmt: skip
    parser.add_argument("--redis-gib", type=float, default=0.25,
                        help="GiB per Redis store/load case, each object size (0.25)")  # fmt: skip
    parser.add_argument("--redis-pool", type=int, default=8,
                        help="the Redis tier's pool_size, and the ceiling's connections (8)")  # fmt: skip
    parser.add_argument("--lookup-reps", type=int, default=50,
                        help="timed 500-key contains per side (50)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny volumes: a smoke run")
    parser.add_argument("--json", help="write every figure and the machine facts here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    own = None
    dirs = args.dirs
    if not dirs:
        own = tempfile.mkdtemp(prefix=".bench-tiers-", dir=os.getcwd())
        dirs = [own]
    try:
        _progress(f"bench_tiers in {', '.join(dirs)} (rounds: {1 if args.quick else args.rounds})")
        res = run(args, dirs)
    finally:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
    m = res["machine"]
    fs = ", ".join(f"{d['dir']}: {d['fstype']} on {d['device']}" for d in m["dirs"])
    print(f"machine: {m['cpu_model']}, {m['cpu_count']} CPUs, python {m['python']}, "
          f"torch {m['torch']}, {m['date']}; {fs}")  # fmt: skip
    if "tiers" in res:
        print_disk_legend(res, args)
    if "redis" in res:
        r, lk = m["redis"], res["redis"]["lookup"]
        where = ("a local redis-server started for this run (no persistence, no maxmemory) "
                 "and stopped at its end" if r["started_here"] else "the given server")  # fmt: skip
        print(f"redis: {r['url']}, redis-server {r['redis_version']}, {where}; "
              f"{res['settings']['redis']['connections']} connections on both sides "
              "(tier pool_size; ceiling: plain redis-py SET/GET, one thread per connection); "
              "FLUSHDB after each side")  # fmt: skip
        print(f"redis lookup: contains of {lk['keys']} present keys ({lk['reps']} reps) vs a "
              "plain redis-py pipeline of as many EXISTS; round trips = a send followed by a "
              "read on redis-py connections, server reads from INFO stats")  # fmt: skip
    print("ratio: speed over the ceiling (prefetch, lookup: ceiling time / tier time), the "
          "median of per-round ratios; store() rows: L2 on time / off time")  # fmt: skip
    print_table(table_rows(res, args.direct_io))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)


def print_disk_legend(res: dict[str, Any], args: Any) -> None:
    print(f"page cache: {CACHE_DROP}; tier O_DIRECT: "
          f"{'yes' if args.direct_io else 'no'} (paths using it: "
          f"{res['tiers'][0]['counts']['direct_io_paths']})")  # fmt: skip
    print("writes: durable on both sides (all bytes written and every file fsynced); "
          "ceiling: one thread, plain files of the same size, same directory")  # fmt: skip
    print(f"scaling: {res['scaling']['layout']}; latency: {res['latency']['chunks_per_store']} "
          f"x 1 MiB chunks per store, fresh tokens, 'drained' waits for the write-through "
          f"before each timed store, 'busy' does not; figures: medians of "
          f"{res['settings']['rounds']} alternating round(s)")  # fmt: skip


if __name__ == "__main__":
    main()
