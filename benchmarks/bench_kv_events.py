"""KV-event stream cost (issue 41): the chunk events a server's log and a subscriber sustain
against the store rate that produces them, and what the log costs a store (on/off).

1. `stream`: an in-process KVFlowServer (CPU caches, observability as `kvflow server`
   runs it, metrics endpoint and event logging off) takes stores for `--seconds` from one client, each of
   fresh tokens, so every chunk is written to L1 and, L1 being small, another is evicted:
   two chunk events per stored chunk. A second client follows the stream with
   KVEventStream, polling back to back. Printed: stores/s and chunk events/s produced,
   chunk events/s delivered to the subscriber, records lost (0 when it kept up).
2. `onoff`: two engines with observability on, one also feeding a KVEventLog as the server's
   bus does; rounds of `--ops` stores each, the engines' order alternating per round,
   each round timed until its bus delivered everything (the log's work inside the time).
   Ratio = off time / on time per round, median over `--rounds`; `--control` builds both
   engines without the log (an A/A run: the spread of identical engines).
3. `flood`: the same server and subscriber, the stores replaced by synthetic L1_WRITE
   events of 16 keys published on the server's bus as fast as one thread can: what the
   stream delivers when the producer is not the limit (bus drops and lost records counted).
4. `log`: KVEventLog.on_events alone over synthetic L1_WRITE events of 16 keys: the
   ceiling of chunk events per second one dispatcher thread absorbs.

CPU figures (no pinned memory); small chunks (16 tokens, 64 KiB objects) make the event
work per byte as large as it gets. The log's share of a store is also estimated without
timing noise: a store's chunk events over the log's rate (4), against a store's time (1). Run: python benchmarks/bench_kv_events.py [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from typing import Any

import numpy as np

from kvflow.core import KVFlowClient, KVFlowServer, empty_shared
from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.server.kv_subscriber import KVEventStream
from kvflow.core.tiers.base import ObjectKey
from kvflow.events import Event, EventType
from kvflow.kernels.synthetic import make_kv_caches
from kvflow.subscribers.kv_events import KVEventLog

CHUNK = 16
BLOCK = 16
CHUNKS_PER_STORE = 8
LAYERS, HEADS, HEAD = 4, 4, 64  # 64 KiB per chunk in bf16
#: the subscriber's pause after a poll that found nothing (the connector's is 50 ms)
IDLE_POLL_S = 0.001
NUM_BLOCKS = 4 * CHUNKS_PER_STORE
GIB = 1 << 30


def _config(l1_chunks: int, chunk_bytes: int) -> ServerConfig:
    obs = ObservabilityConfig(prometheus_port=0, logging_enabled=False)
    return ServerConfig(
        port=0, chunk_size=CHUNK, l1_size_gb=l1_chunks * chunk_bytes / GIB, observability=obs
    )


def _caches(shared: bool) -> tuple[Any, dict[str, Any]]:
    kv, kw = make_kv_caches(
        "vllm_flash_attn", num_layers=LAYERS, num_blocks=NUM_BLOCKS, block_size=BLOCK,
        num_heads=HEADS, head_size=HEAD,
    )  # fmt: skip
    if shared:
        kv = [empty_shared(t.shape, t.dtype).copy_(t) for t in kv]
    return kv, kw


def _chunk_bytes() -> int:
    return LAYERS * 2 * CHUNK * HEADS * HEAD * 2


def _tokens(i: int) -> np.ndarray:
    return np.arange(CHUNKS_PER_STORE * CHUNK, dtype=np.int32) + i * 100_000


def stream(seconds: float) -> dict[str, Any]:
    """Stores through a server for `seconds`, a subscriber following the KV events."""
    server = KVFlowServer(_config(2 * CHUNKS_PER_STORE, _chunk_bytes()))
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    delivered = lost = polls = 0
    stop = threading.Event()

    def follow() -> None:
        nonlocal delivered, lost, polls
        with KVFlowClient(server.endpoint, timeout_s=30) as sub:
            events = KVEventStream(sub, max_records=4096)
            while not stop.is_set() or server.engine.bus.stats().queue_depth:
                batch = events.poll()
                polls += 1
                delivered += sum(len(r.chunk_hashes) for r in batch.records)
                lost += batch.lost
                if not batch.records:
                    time.sleep(IDLE_POLL_S)
            while (batch := events.poll()).records or batch.lost:  # the tail
                delivered += sum(len(r.chunk_hashes) for r in batch.records)
                lost += batch.lost

    follower = threading.Thread(target=follow)
    try:
        with KVFlowClient(server.endpoint, timeout_s=30) as client:
            kv, kw = _caches(shared=True)
            client.register_kv_caches("w0", kv, model_name="m", **kw)
            blocks = list(range(CHUNKS_PER_STORE * CHUNK // BLOCK))
            follower.start()
            time.sleep(0.2)  # subscribed
            stores = 0
            t0 = time.perf_counter()
            # at least three stores, however slow the first ones (a GPU machine's L1 still
            # pinning): evictions, and so chunk events to count, start at the third
            while stores < 3 or time.perf_counter() - t0 < seconds:
                client.store("w0", _tokens(stores), blocks, request_id=f"r{stores}")
                stores += 1
            elapsed = time.perf_counter() - t0
            assert server.engine.bus.flush(30.0)
            stop.set()
            follower.join()
            log = server.kv_events.log.stats() if server.kv_events is not None else {}
    finally:
        stop.set()
        server.request_stop()
        serving.join(30)
    produced = stores * CHUNKS_PER_STORE * 2 - CHUNKS_PER_STORE * 2  # first 2 stores evict none
    return {
        "stores": stores,
        "seconds": elapsed,
        "stores_per_s": stores / elapsed,
        "chunk_events_produced": produced,
        "chunk_events_per_s": produced / elapsed,
        "chunk_events_delivered": delivered,
        "delivered_per_s": delivered / elapsed,
        "records_lost": lost,
        "polls": polls,
        "log": log,
    }


def _synthetic_writes(n: int) -> list[Event]:
    keys = [[ObjectKey(os.urandom(32), "m", 1, 0, None) for _ in range(16)] for _ in range(64)]
    return [
        Event(EventType.L1_WRITE, 0, "r", None, {"chunks": 16, "bytes": 0, "keys": keys[i % 64]})
        for i in range(n)
    ]


def flood(seconds: float) -> dict[str, Any]:
    """Synthetic L1_WRITE events on a server's bus as fast as possible, a subscriber reading."""
    server = KVFlowServer(_config(2 * CHUNKS_PER_STORE, _chunk_bytes()))
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    delivered = lost = 0
    stop = threading.Event()
    batch = _synthetic_writes(256)

    def follow() -> None:
        nonlocal delivered, lost
        with KVFlowClient(server.endpoint, timeout_s=30) as sub:
            events = KVEventStream(sub, max_records=4096)
            ready.set()
            while True:
                got = events.poll()
                delivered += sum(len(r.chunk_hashes) for r in got.records)
                lost += got.lost
                if not got.records and not got.lost:
                    if stop.is_set():
                        return
                    time.sleep(IDLE_POLL_S)

    ready = threading.Event()
    follower = threading.Thread(target=follow)
    follower.start()
    try:
        ready.wait(30)
        bus = server.engine.bus
        published = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for ev in batch:
                published += bus.publish(Event(ev.type, 0, ev.session_id, None, ev.attrs))
        assert bus.flush(60.0)
        stop.set()
        follower.join()
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        server.request_stop()
        serving.join(30)
    return {
        "seconds": elapsed,
        "chunk_events_published": published * 16,
        "published_per_s": published * 16 / elapsed,
        "chunk_events_delivered": delivered,
        "delivered_per_s": delivered / elapsed,
        "records_lost": lost,
    }


def onoff(ops: int, rounds: int, control: bool) -> dict[str, Any]:
    """Sustained store time with the KV-event log on vs off, engines alternating."""
    engines: dict[str, CacheEngine] = {}
    kv, kw = _caches(shared=False)
    blocks = list(range(CHUNKS_PER_STORE * CHUNK // BLOCK))
    for mode in ("off", "on"):
        engine = CacheEngine(_config(2 * CHUNKS_PER_STORE, _chunk_bytes()))
        if mode == "on" and not control:
            engine.bus.register(KVEventLog())
        engine.register_kv_caches("w0", kv, model_name="m", **kw)
        engines[mode] = engine
    counter = [0]

    def block(engine: CacheEngine) -> float:
        t0 = time.perf_counter()
        for _ in range(ops):
            counter[0] += 1
            engine.store("w0", _tokens(counter[0]), blocks, request_id=f"r{counter[0]}")
        assert engine.bus.flush(30.0)
        return time.perf_counter() - t0

    for engine in engines.values():  # warm up
        block(engine)
    ratios = []
    for rnd in range(rounds):
        order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
        times = {mode: block(engines[mode]) for mode in order}
        ratios.append(times["off"] / times["on"])
    for engine in engines.values():
        engine.close()
    quartiles = statistics.quantiles(ratios, n=4)
    return {
        "ops_per_round": ops,
        "rounds": rounds,
        "control": control,
        "on_off_median": statistics.median(ratios),
        "on_off_iqr": [quartiles[0], quartiles[2]],
    }


def log_ceiling(events: int) -> dict[str, Any]:
    """KVEventLog.on_events alone: chunk events absorbed per second."""
    log = KVEventLog()
    batch = _synthetic_writes(256)
    t0 = time.perf_counter()
    for _ in range(events // len(batch)):
        log.on_events(batch)
    elapsed = time.perf_counter() - t0
    chunks = events // len(batch) * len(batch) * 16
    return {"chunk_events": chunks, "seconds": elapsed, "chunk_events_per_s": chunks / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the stream run")
    parser.add_argument("--ops", type=int, default=50, help="stores per on/off round")
    parser.add_argument("--rounds", type=int, default=21, help="on/off rounds (median)")
    parser.add_argument("--control", action="store_true", help="on/off with the log off in both")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    figures = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "stream": stream(args.seconds),
        "flood": flood(args.seconds),
        "onoff": onoff(args.ops, args.rounds, args.control),
        "log": log_ceiling(200_000),
    }
    s, o, g, f = figures["stream"], figures["onoff"], figures["log"], figures["flood"]
    print(f"machine: {figures['machine']}; chunk {CHUNK} tokens, {_chunk_bytes()} B per chunk")
    print(
        f"stream: {s['stores_per_s']:.0f} stores/s of {CHUNKS_PER_STORE} chunks -> "
        f"{s['chunk_events_per_s']:.0f} chunk events/s produced, {s['delivered_per_s']:.0f}/s "
        f"delivered to a subscriber ({s['chunk_events_delivered']} of "
        f"{s['chunk_events_produced']}), {s['records_lost']} records lost, {s['polls']} polls"
    )
    print(
        f"flood: {f['published_per_s']:.3g} chunk events/s published, "
        f"{f['delivered_per_s']:.3g}/s delivered ({f['chunk_events_delivered']} of "
        f"{f['chunk_events_published']}), {f['records_lost']} records lost to the log's bound"
    )
    print(
        f"on/off ({'control: log off in both' if o['control'] else 'KV-event log on'}): "
        f"median {o['on_off_median']:.3f} over {o['rounds']} rounds of {o['ops_per_round']} "
        f"stores, IQR {o['on_off_iqr'][0]:.3f}-{o['on_off_iqr'][1]:.3f}"
    )
    print(f"log alone: {g['chunk_events_per_s']:.3g} chunk events/s on one thread")
    per_store_us = 2 * CHUNKS_PER_STORE / g["chunk_events_per_s"] * 1e6
    store_us = 1e6 / s["stores_per_s"]
    figures["log_share_of_store"] = per_store_us / store_us
    print(
        f"log work per store: {per_store_us:.1f} us (its {2 * CHUNKS_PER_STORE} chunk events) "
        f"against {store_us:.0f} us per store through the server: "
        f"{100 * per_store_us / store_us:.3f}% (on/off {1 / (1 + per_store_us / store_us):.4f})"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
