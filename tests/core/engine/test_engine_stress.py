"""Many threads against one CacheEngine with an L2 disk tier: nothing hangs, every block a
retrieve writes is byte-exact, and the accounting adds up once everything is freed.

Workers store, retrieve (plain, skipping a prefix, layer by layer), look up, prefetch and
end sessions over a pool of prompts that share prefixes, some larger than L1 (they stream
through it); a churn thread registers and unregisters an instance while a racer thread
transfers on it. L1 holds 32 chunks, so chunks are evicted, written through to disk and
loaded back all the time. The content of a chunk is a function of its tokens (the prefix
up to its end), so any block a retrieve says it wrote can be checked against it.

The run is made twice: with L1 grown on demand (as on a host without CUDA), and with L1
pinned ahead of demand in slow segments (as on a CUDA host, where stores may wait for
a segment being pinned).
"""

from __future__ import annotations

import faulthandler
import random
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core.engine import cache_engine
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.errors import UnknownInstanceError
from kvflow.core.tiers.hostmem import HostPool
from kvflow.core.tiers.l1 import L1Cache
from kvflow.events import END_TO_START, EventType
from tests.support.engine import BLOCK, CHUNK, block_bytes, caches, events_of, pairs, small_engine

RUN_S = 5.0  # how long the threads keep issuing operations
JOIN_S = 60.0  # past this a thread counts as hung
L1_CHUNKS = 32
CHUNK_BYTES = 1024  # one chunk of the default test caches
BPC = CHUNK // BLOCK  # blocks per chunk
LAYERS = 2
LONG_CHUNKS = 40  # a prompt larger than L1: stores and retrieves stream through it
WORKER_BLOCKS = 2 * LONG_CHUNKS + BPC  # a long prompt's blocks, its partial chunk too
SHARED_HALF = 32  # blocks of each of the two workers sharing one instance (>= 25: a prompt's)
CHURN_HALF = 32  # blocks of the churn instance for the churn thread, as many for the racer


def _prompts() -> list[np.ndarray]:
    """Four 2-chunk system prompts, each opening six prompts of 3..10 more chunks (some
    with a partial last chunk), and two prompts larger than L1."""
    rng = random.Random(7)
    systems = [np.arange(1_000 * s, 1_000 * s + 2 * CHUNK, dtype=np.int32) for s in range(1, 5)]
    prompts = []
    for i in range(24):
        own = rng.randint(3, 10) * CHUNK + rng.choice([0, 0, 3])
        tail = np.arange(100_000 + 1_000 * i, 100_000 + 1_000 * i + own, dtype=np.int32)
        prompts.append(np.concatenate([systems[i % 4], tail]))
    for i in range(2):
        start = 900_000 + 10_000 * i
        prompts.append(np.arange(start, start + LONG_CHUNKS * CHUNK + 5, dtype=np.int32))
    return prompts


class Content:
    """The bytes each chunk holds, a function of its tokens: chunk k of the reference
    caches (its blocks 2k, 2k+1) for the k-th distinct prefix of the prompts."""

    def __init__(self, prompts: list[np.ndarray]) -> None:
        self.ids: dict[bytes, int] = {}
        for tokens in prompts:
            for c in range(len(tokens) // CHUNK):
                self.ids.setdefault(tokens[: (c + 1) * CHUNK].tobytes(), len(self.ids))
        self.ref, self.kw = caches("vllm_flash_attn", seed=99, num_blocks=BPC * len(self.ids))
        self.bytes = block_bytes(self.ref, self.kw, range(BPC * len(self.ids)))

    def chunk(self, tokens: np.ndarray, c: int) -> int:
        return self.ids[tokens[: (c + 1) * CHUNK].tobytes()]

    def fill(self, kv: Any, blocks: list[int], tokens: np.ndarray) -> None:
        """Write the prompt's full chunks into `blocks` of `kv` (chunk c: blocks[2c:2c+2])."""
        n = len(tokens) // CHUNK
        src = [BPC * self.chunk(tokens, c) + j for c in range(n) for j in range(BPC)]
        dst = torch.tensor(blocks[: BPC * n], dtype=torch.long)
        for layer, ref in zip(kv, self.ref, strict=True):
            layer[:, dst] = ref[:, torch.tensor(src, dtype=torch.long)]

    def expected(self, tokens: np.ndarray, block: int) -> torch.Tensor:
        """The bytes block `block` of the request holds once retrieved."""
        c, j = divmod(block, BPC)
        return self.bytes[BPC * self.chunk(tokens, c) + j]


def _zero(kv: Any, blocks: list[int]) -> None:
    idx = torch.tensor(blocks, dtype=torch.long)
    for layer in kv:
        layer[:, idx] = 0


class Layers:
    """A LayerSignal that records what it was told."""

    def __init__(self) -> None:
        self.signalled: list[int] = []
        self.failed_from: int | None = None

    def ready(self, layer: int, stream: Any) -> None:
        self.signalled.append(layer)

    def failed(self, first_layer: int) -> None:
        self.failed_from = first_layer


class Written:
    """A WrittenSignal whose layers are all written already."""

    def wait_written(self, layer: int, stream: Any) -> None:
        return None


@dataclass
class Tally:
    """What the threads did, to check the events against: per op, calls that reached the
    engine's op (START published), those that succeeded, and the sum of their results."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    started: Counter[str] = field(default_factory=Counter)
    ok: Counter[str] = field(default_factory=Counter)
    total: Counter[str] = field(default_factory=Counter)
    sessions_ended: int = 0
    errors: list[str] = field(default_factory=list)

    def count(self, op: str, result: int | None) -> None:
        with self.lock:
            self.started[op] += 1
            if result is not None:
                self.ok[op] += 1
                self.total[op] += result

    def fail(self, message: str) -> None:
        with self.lock:
            self.errors.append(message)


class Stress:
    """The engine, the prompts and their content, what the threads did; the threads' work."""

    def __init__(self, tmp_path: Path, **config: Any) -> None:
        self.engine, self.recorder = small_engine(
            l1_bytes=L1_CHUNKS * CHUNK_BYTES,
            l2_disk_paths=(str(tmp_path / "disk"),),
            l2_disk_size_gb=0.05,
            l2_backlog_wait_s=2.0,
            l2_timeout_s=20.0,  # so that no tier answer is late however busy the machine
            **config,
        )
        self.prompts = _prompts()
        self.content = Content(self.prompts)
        self.tally = Tally()
        self.deadline = 0.0

    def run(self, op: str, *args: Any, racing: bool = False, **kwargs: Any) -> int | None:
        """engine.<op>(...), counted. While `racing` (the instance may be unregistered at any
        time) an UnknownInstanceError gives None; any other error is re-raised."""
        try:
            result: int = getattr(self.engine, op)(*args, **kwargs)
        except UnknownInstanceError as exc:
            if not racing:
                raise
            if "was unregistered while" in str(exc):  # failed inside the op: END published
                self.tally.count(op, None)
            return None
        self.tally.count(op, result)
        return result

    # -- a worker's operations ---------------------------------------------------------------

    def store(self, inst: str, kv: Any, blocks: list[int], p: int, rng: random.Random) -> None:
        tokens = self.prompts[p]
        self.content.fill(kv, blocks, tokens)
        layers = Written() if rng.random() < 0.2 else None
        need = blocks[: -(-len(tokens) // BLOCK)]
        held = self.run("store", inst, tokens, need, request_id=f"p{p}", layers=layers)
        full = len(tokens) // CHUNK * CHUNK
        if held is None or held % CHUNK or not 0 <= held <= full:
            self.tally.fail(f"store of prompt {p} held {held} of {full} tokens")

    def retrieve(self, inst: str, kv: Any, blocks: list[int], p: int, rng: random.Random) -> None:
        tokens = self.prompts[p]
        need = blocks[: -(-len(tokens) // BLOCK)]
        _zero(kv, need)
        skip = rng.choice([0, 0, 0, BLOCK, CHUNK, 3 * BLOCK])
        signal = Layers() if rng.random() < 0.2 else None
        session = rng.choice([f"p{p}", f"p{p}-b"])
        hit = self.run(
            "retrieve", inst, tokens, need, request_id=session, skip_first_n_tokens=skip,
            layers=signal,
        )  # fmt: skip
        full = len(tokens) // CHUNK * CHUNK
        if hit is None or hit % CHUNK or not 0 <= hit <= full:
            self.tally.fail(f"retrieve of prompt {p} hit {hit} of {full} tokens")
            return
        told = None if signal is None else (signal.signalled, signal.failed_from)
        if told not in (None, (list(range(LAYERS)), None)):
            self.tally.fail(f"layerwise retrieve: {signal.signalled}, {signal.failed_from}")
        got = block_bytes(kv, self.content.kw, need)
        for b in range(len(need)):
            written = skip // BLOCK <= b < hit // BLOCK
            want = self.content.expected(tokens, b) if written else torch.zeros_like(got[b])
            if not torch.equal(got[b], want):
                what = "wrong bytes" if written else "a block it must not touch written"
                self.tally.fail(f"retrieve of prompt {p} (hit {hit}, skip {skip}): {what} in "
                                f"block {b}")  # fmt: skip
                return

    def lookup(self, p: int, rng: random.Random) -> None:
        tokens = self.prompts[p]
        prefetch = rng.random() < 0.5
        hit = self.run("lookup", tokens, model_name="m", request_id=f"p{p}", prefetch=prefetch)
        if hit is None or hit % CHUNK or not 0 <= hit <= len(tokens):
            self.tally.fail(f"lookup of prompt {p} hit {hit}")

    def worker(self, inst: str, kv: Any, blocks: list[int], seed: int, long_ok: bool) -> None:
        rng = random.Random(seed)
        short = len(self.prompts) - 2
        while time.monotonic() < self.deadline and not self.tally.errors:
            p = rng.randrange(len(self.prompts) if long_ok else short)
            if p >= short and rng.random() < 0.7:
                p = rng.randrange(short)  # long prompts stay a few percent of the ops
            action = rng.random()
            if action < 0.35:
                self.store(inst, kv, blocks, p, rng)
            elif action < 0.75:
                self.retrieve(inst, kv, blocks, p, rng)
            elif action < 0.9:
                self.lookup(p, rng)
            elif action < 0.95:
                self.engine.prefetch(self.prompts[p], model_name="m", request_id=f"p{p}")
            else:
                self.engine.end_session(f"p{p}")
                with self.tally.lock:
                    self.tally.sessions_ended += 1

    # -- registration churn -------------------------------------------------------------------

    def churn(self) -> None:
        """Register an instance, store and retrieve one prompt through it (salted apart),
        check the bytes, unregister it; again and again."""
        rng = random.Random(3)
        n = 0
        while time.monotonic() < self.deadline and not self.tally.errors:
            kv, kw = caches("vllm_flash_attn", seed=n, num_blocks=2 * CHURN_HALF)
            self.engine.register_kv_caches("churn", kv, model_name="m", **kw)
            tokens = self.prompts[rng.randrange(len(self.prompts) - 2)]
            blocks = rng.sample(range(CHURN_HALF), -(-len(tokens) // BLOCK))
            self.content.fill(kv, blocks, tokens)
            self.run("store", "churn", tokens, blocks, request_id="churn", cache_salt="churn")
            _zero(kv, blocks)
            hit = self.run("retrieve", "churn", tokens, blocks, request_id="c", cache_salt="churn")
            got = block_bytes(kv, kw, blocks)
            for b in range(len(blocks)):
                want = self.content.expected(tokens, b) if b < (hit or 0) // BLOCK else None
                if want is not None and not torch.equal(got[b], want):
                    self.tally.fail(f"churn retrieve: wrong bytes in block {b}")
            self.engine.unregister("churn")
            n += 1

    def racer(self) -> None:
        """Store and retrieve on the churn thread's instance, in the other half of its
        blocks, whether or not it is registered at the time (salted apart: the bytes it
        stores are arbitrary)."""
        rng = random.Random(4)
        while time.monotonic() < self.deadline and not self.tally.errors:
            tokens = self.prompts[rng.randrange(len(self.prompts) - 2)]
            blocks = rng.sample(range(CHURN_HALF, 2 * CHURN_HALF), -(-len(tokens) // BLOCK))
            op = rng.choice(["store", "retrieve"])
            self.run(op, "churn", tokens, blocks, request_id="r", cache_salt="racer", racing=True)
            time.sleep(0.001)

    # -- the run ------------------------------------------------------------------------------

    def threads(self) -> list[threading.Thread]:
        targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        for w in range(4):  # workers with an instance each
            kv, kw = caches("vllm_flash_attn", seed=10 + w, num_blocks=WORKER_BLOCKS)
            self.engine.register_kv_caches(f"w{w}", kv, model_name="m", **kw)
            blocks = random.Random(w).sample(range(WORKER_BLOCKS), WORKER_BLOCKS)
            targets.append((self.worker, (f"w{w}", kv, blocks, w, True)))
        kv, kw = caches("vllm_flash_attn", seed=20, num_blocks=2 * SHARED_HALF)
        self.engine.register_kv_caches("shared", kv, model_name="m", **kw)
        for h in range(2):  # two workers on one instance, in disjoint halves of its blocks
            blocks = list(range(h * SHARED_HALF, (h + 1) * SHARED_HALF))
            random.Random(h).shuffle(blocks)
            targets.append((self.worker, ("shared", kv, blocks, 100 + h, False)))
        targets += [(self.churn, ()), (self.racer, ())]
        return [self._thread(fn, args) for fn, args in targets]

    def _thread(self, fn: Callable[..., None], args: tuple[Any, ...]) -> threading.Thread:
        def guarded() -> None:
            try:
                fn(*args)
            except BaseException:  # recorded, with its causes: the test fails with it
                self.tally.fail(f"{fn.__name__}{args[:1]} raised:\n{traceback.format_exc()}")

        return threading.Thread(target=guarded, daemon=True)


def _wait(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class SlowPool(HostPool):
    """Host memory whose segments take 0.3 s to make, as pinning does on a CUDA host."""

    def make_segment(self, nbytes: int) -> torch.Tensor:
        time.sleep(0.3)
        return super().make_segment(nbytes)


class PinnedAheadL1(L1Cache):
    """L1 grown ahead of demand in the background from slow segments (a CUDA host's L1)."""

    def __init__(self, capacity_bytes: int, **kwargs: Any) -> None:
        kwargs.update(pool=SlowPool(pinned=False), pin_ahead=True)
        super().__init__(capacity_bytes, **kwargs)


@pytest.mark.parametrize(
    "l1_growth",
    ["on_demand", "pinned_ahead"],
)
def test_many_threads_against_one_engine_with_l2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, l1_growth: str
) -> None:
    if l1_growth == "pinned_ahead":
        monkeypatch.setattr(cache_engine, "L1Cache", PinnedAheadL1)
    # on demand: whether or not this host pins L1 (CUDA), it is grown inside the stores
    s = Stress(tmp_path, l1_pin_threads=0 if l1_growth == "on_demand" else 2)
    engine = s.engine
    threads = s.threads()
    s.deadline = time.monotonic() + RUN_S
    for t in threads:
        t.start()
    join_by = time.monotonic() + JOIN_S
    try:
        for t in threads:
            t.join(max(0.0, join_by - time.monotonic()))
        if any(t.is_alive() for t in threads):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            raise AssertionError("a thread hung (stacks on stderr)")
        assert not s.tally.errors, "\n".join(s.tally.errors[:5])
        assert s.tally.ok["store"] > 20 and s.tally.ok["retrieve"] > 20, s.tally
        _check_accounting_returns_to_baseline(s.tally, engine)
        _check_events_add_up(s.tally, engine, s.recorder)
    finally:
        if not any(t.is_alive() for t in threads):  # a hung thread may hold a lock close needs
            engine.close(timeout=1.0)


def _check_accounting_returns_to_baseline(tally: Tally, engine: CacheEngine) -> None:
    """Once the background L2 work is done, nothing is being written or loaded, no pin is
    left (every object can be dropped: L1 and every tenant's usage are empty again), the
    tiers always answered, and the model's lookup hits are the lookups' results."""
    assert _wait(lambda: engine.pending_l2_writes() == 0), "L2 writes never finished"
    l2 = lambda: engine.status()["l2"]  # noqa: E731
    assert _wait(lambda: l2()["in_flight"]["loading"] == 0), l2()["in_flight"]
    assert l2()["in_flight"]["staged"] == 0
    assert l2()["in_flight"]["write_through"] == {"bytes": 0, "calls": 0}
    stats = engine.l1_stats()
    assert stats["writing"] == 0, stats
    assert stats["usage_bytes"] <= stats["capacity_bytes"], stats
    (model,) = [t for t in engine.tenant_stats() if t["tenant"] == "m"]
    assert model["hit_tokens"] == tally.total["lookup"], model
    engine.l1.drop_where(lambda key: True)
    stats = engine.l1_stats()
    assert (stats["usage_bytes"], stats["objects"]) == (0, 0), f"objects left pinned: {stats}"
    assert all(t["usage_bytes"] == 0 for t in engine.tenant_stats()), engine.tenant_stats()
    assert l2()["tiers"]["disk"]["contains_failures"] == 0


def _prefetches_done(engine: CacheEngine) -> bool:
    """Whether every prefetch made so far is done (one forgotten long ago counts as done)."""
    for n in range(1, engine.status()["l2"]["prefetch"]["requests"] + 1):
        try:
            if engine.prefetch_state(f"pf-{n}")["state"] != "done":
                return False
        except UnknownInstanceError:
            continue
    return True


def _check_events_add_up(tally: Tally, engine: CacheEngine, recorder: Any) -> None:
    """Every START has exactly one END; the ops' STARTs, successful ENDs and their results
    are the calls' (stores held, retrieves and lookups hit); the disk tier's load
    counters and the prefetch totals are the sums of their ENDs; nothing was dropped.
    A prefetch counts its totals once its loads ended, so the totals are read once
    every prefetch is done (no load in flight is not enough: seen 699 against 705)."""
    assert _wait(lambda: _prefetches_done(engine)), "a prefetch never finished"
    status = engine.status()
    assert status["bus"]["dropped"] == 0, status["bus"]
    l2 = status["l2"]
    engine.close()
    events = events_of(recorder, engine)
    assert list(pairs(events))  # each START has exactly one END, and each END its START
    ends: dict[EventType, list[dict[str, Any]]] = {}
    for e in events:
        if e.type in END_TO_START:
            ends.setdefault(e.type, []).append(dict(e.attrs))
    for op, etype, result in (
        ("store", EventType.STORE_END, "held_tokens"),
        ("retrieve", EventType.RETRIEVE_END, "hit_tokens"),
        ("lookup", EventType.LOOKUP_END, "hit_tokens"),
    ):
        got = ends.get(etype, [])
        ok = [a for a in got if a["ok"]]
        assert (len(got), len(ok)) == (tally.started[op], tally.ok[op]), (op, tally)
        assert sum(a.get(result, 0) for a in ok) == tally.total[op], op
    loads = ends.get(EventType.L2_LOAD_END, [])
    disk = l2["tiers"]["disk"]
    assert disk["loaded"] == sum(a["loaded_chunks"] for a in loads)
    assert disk["load_failures"] == sum(a["failed_chunks"] for a in loads)
    prefetches = ends.get(EventType.PREFETCH_END, [])
    assert l2["prefetch"]["requests"] == len(prefetches)
    assert l2["prefetch"]["loaded"] == sum(a["loaded_chunks"] for a in prefetches)
    sessions = sum(1 for e in events if e.type is EventType.END_SESSION)
    assert sessions == tally.sessions_ended
