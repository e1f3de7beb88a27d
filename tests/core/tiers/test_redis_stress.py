"""Many threads storing, loading and looking up against one Redis tier while its
redis-server is stopped and restarted over and over (every second outage, hung by
SIGSTOP past the tier's timeout instead): nothing hangs, the counters add up, and no
value loads back corrupt. About 12 s.

- Nothing hangs: every call answers within BOUND_S (two of the tier's timeouts plus
  slack), and `stats()`/`describe()`, read all along by an observer thread, answer at
  once whatever the server is doing (no lock of the tier is held across network I/O).
- Counters add up, each key of each call counted exactly once: the store failures are
  the keys the stores answered failed, `objects` grew by the keys they stored, the load
  failures are the keys the loads answered False. Lookups: the server keeps its data
  across restarts (it saves on shutdown), so a SENTINEL key, stored first, is always
  there; a lookup asks for it too, and the lookup failures are exactly the lookups that
  answered it False. Failure counters never go down.
- Never corrupt: each key's value is fixed; a load answering True wrote exactly it,
  one answering False left the destination as it was or (a link broken after some
  replies) wrote exactly it. At the end every key once stored without failure loads
  back exactly (an acknowledged store is never lost or mangled).
"""

from __future__ import annotations

import faulthandler
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
import torch

from kvflow.core.tiers.base import ObjectKey
from kvflow.core.tiers.redis import RedisTier
from kvflow.core.tiers.redis_target import resolve_target
from kvflow.core.tiers.redisstats import FAILURE_COUNTERS
from tests.support.redis_servers import RedisServer, redis_server

T = TypeVar("T")

RUN_S = 10.0  # how long the callers keep calling while the server churns
TIMEOUT_S = 0.4  # the tier's timeout_s
POOL = 8  # the tier's I/O threads: more than CALLERS, so no call queues behind another
CALLERS = 6  # threads calling the tier, one call in flight each
#: the most a call may take: a connect and a read timing out (or redis-py's one retry of
#: a broken connection) plus thread hand-offs on a busy 2-core machine
BOUND_S = 2 * TIMEOUT_S + 1.0
#: the most stats() or describe() may take (they never wait on the network)
QUICK_S = 0.15
HUNG_S = 30.0  # past this a call or a thread counts as hung
KEYS = 1000  # key ids 0..KEYS-1, stored as the run goes; SENTINEL is stored first
SENTINEL = KEYS
NBYTES = 4096
FILL = 0xEE  # what a destination holds before a load (no value is all FILL)


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "little"), "org/stress", 1, 0, None)


def _values() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000)
    return [
        torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=gen) for _ in range(KEYS + 1)
    ]


VALUES = _values()


@dataclass
class Tally:
    """What the callers saw, added up under a lock of its own."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: int = 0
    stored: int = 0
    store_failed: int = 0
    load_false: int = 0
    loaded: int = 0
    lookups: int = 0
    lookups_failed: int = 0
    slowest_s: float = 0.0
    confirmed: set[int] = field(default_factory=set)  # ids once stored without a failure
    errors: list[str] = field(default_factory=list)

    def add(self, took_s: float, **counts: int) -> None:
        with self.lock:
            self.calls += 1
            self.slowest_s = max(self.slowest_s, took_s)
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)
            if took_s > BOUND_S:
                self.errors.append(f"a call took {took_s:.2f} s (bound {BOUND_S:.2f} s)")

    def fail(self, message: str) -> None:
        with self.lock:
            self.errors.append(message)


def timed(future_of: Callable[[], Future[T]]) -> tuple[T, float]:
    """The call's answer and how long it took, from the call to its future's result."""
    start = time.monotonic()
    got = future_of().result(timeout=HUNG_S)
    return got, time.monotonic() - start


class Callers:
    """The threads calling the tier (see the module doc), and an observer of its stats."""

    def __init__(self, tier: RedisTier, tally: Tally) -> None:
        self.tier = tier
        self.tally = tally
        self.stop = threading.Event()

    def store(self, rng: random.Random) -> None:
        ids = rng.sample(range(KEYS), rng.randint(1, 4))
        outcome, took = timed(lambda: self.tier.store([(key(i), VALUES[i]) for i in ids]))
        if outcome.stored + outcome.present + outcome.failed != len(ids):
            self.tally.fail(f"store of {len(ids)} keys answered {outcome}")
        self.tally.add(took, stored=outcome.stored, store_failed=outcome.failed)
        if not outcome.failed:
            with self.tally.lock:
                self.tally.confirmed.update(ids)

    def load(self, rng: random.Random) -> None:
        ids = rng.sample(range(KEYS + 1), rng.randint(1, 4))
        dsts = [torch.full((NBYTES,), FILL, dtype=torch.uint8) for _ in ids]
        got, took = timed(lambda: self.tier.load([key(i) for i in ids], dsts))
        for i, ok, dst in zip(ids, got, dsts, strict=True):
            exact = torch.equal(dst, VALUES[i])
            if not (exact if ok else exact or bool((dst == FILL).all())):
                self.tally.fail(f"key {i} loaded {ok} left its destination corrupt")
        self.tally.add(took, load_false=got.count(False), loaded=got.count(True))

    def lookup(self, rng: random.Random) -> None:
        ids = rng.sample(range(KEYS), rng.randint(0, 7))
        ids.insert(rng.randint(0, len(ids)), SENTINEL)
        got, took = timed(lambda: self.tier.contains([key(i) for i in ids]))
        failed = not got[ids.index(SENTINEL)]
        if len(got) != len(ids) or (failed and any(got)):
            self.tally.fail(f"a lookup of {len(ids)} keys answered {got}")
        self.tally.add(took, lookups=1, lookups_failed=int(failed))

    def caller(self, seed: int) -> None:
        rng = random.Random(seed)
        ops = [self.store, self.store, self.load, self.load, self.lookup]
        while not self.stop.is_set():
            rng.choice(ops)(rng)
            time.sleep(0.005)  # leave the 2 cores some room for the server and I/O threads

    def observer(self) -> None:
        """stats() and describe() answer at once; failure counters never go down."""
        last = dict.fromkeys(FAILURE_COUNTERS, 0)
        while not self.stop.wait(0.02):
            start = time.monotonic()
            stats = self.tier.stats()
            self.tier.describe()
            took = time.monotonic() - start
            if took > QUICK_S:
                self.tally.fail(f"stats() and describe() took {took:.2f} s")
            for name, before in last.items():
                if stats[name] < before:
                    self.tally.fail(f"{name} went down from {before} to {stats[name]}")
                last[name] = stats[name]

    def threads(self) -> list[threading.Thread]:
        targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
            (self.caller, (seed,)) for seed in range(CALLERS)
        ]
        targets.append((self.observer, ()))
        return [
            threading.Thread(target=self._guarded, args=(fn, args), daemon=True)
            for fn, args in targets
        ]

    def _guarded(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except BaseException:
            self.tally.fail(f"{fn.__name__}{args} raised:\n{traceback.format_exc()}")


def churn(server: RedisServer, until: float, rng: random.Random) -> int:
    """Stop and restart the server, or (every second time) hang it past the tier's
    timeout and resume it, until `until`; how many outages there were."""
    outages = 0
    while time.monotonic() < until:
        time.sleep(rng.uniform(0.4, 0.9))
        if outages % 2:
            server.hang()
            time.sleep(rng.uniform(TIMEOUT_S + 0.1, 2 * TIMEOUT_S))
            server.resume()
        else:
            server.stop()
            time.sleep(rng.uniform(0.1, 0.5))
            server.start()
        outages += 1
    return outages


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A server of its own that saves its data when stopped (SENTINEL stays)."""
    with redis_server(extra=["save 3600 1"]) as made:
        yield made


def test_many_threads_while_the_server_churns(server: RedisServer) -> None:
    tier = RedisTier(resolve_target(server.url(), environ={}), timeout_s=TIMEOUT_S, pool_size=POOL)
    try:
        assert tier.store([(key(SENTINEL), VALUES[SENTINEL])]).result(timeout=10).stored == 1
        before = tier.stats()
        tally = Tally()
        callers = Callers(tier, tally)
        threads = callers.threads()
        for thread in threads:
            thread.start()
        outages = churn(server, time.monotonic() + RUN_S, random.Random(1))
        callers.stop.set()
        join_by = time.monotonic() + HUNG_S
        for thread in threads:
            thread.join(timeout=max(0.0, join_by - time.monotonic()))
        if any(t.is_alive() for t in threads):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            pytest.fail("a caller or the observer hung")
        assert not tally.errors, "\n".join(tally.errors[:20])
        assert wait_until(lambda: tier.stats()["connected"] == 1), "the tier did not rejoin"
        _check_counters(tally, before, tier.stats(), outages)
        _check_confirmed_values(tier, tally.confirmed)
    finally:
        tier.close()


def _check_counters(
    tally: Tally, before: dict[str, int], after: dict[str, int], outages: int
) -> None:
    """Each key of each call counted once (see the module doc), and the run did churn."""
    delta = {name: after[name] - before[name] for name in after}
    assert tally.calls > 200 and outages >= 5, (tally.calls, outages)
    assert tally.store_failed > 0 and tally.load_false > 0 and tally.lookups_failed > 0
    assert tally.stored > 0 and tally.loaded > 0 and tally.lookups > tally.lookups_failed
    assert delta["store_failures"] == tally.store_failed
    assert delta["objects"] == tally.stored
    assert delta["load_failures"] == tally.load_false
    assert 0 < delta["missing_objects"] <= delta["load_failures"]
    assert delta["corrupt_objects"] == 0
    assert delta["lookup_failures"] == tally.lookups_failed
    assert 1 <= delta["reconnects"] <= 2 * outages
    print(
        f"\n{tally.calls} calls in {RUN_S:.0f} s over {outages} outages, slowest "
        f"{tally.slowest_s:.2f} s; counter deltas {delta}"
    )


def _check_confirmed_values(tier: RedisTier, confirmed: set[int]) -> None:
    """Every key once stored without a failure is there, exactly (the server saved it)."""
    ids = sorted(confirmed | {SENTINEL})
    dsts = [torch.full((NBYTES,), FILL, dtype=torch.uint8) for _ in ids]
    assert tier.load([key(i) for i in ids], dsts).result(timeout=10) == [True] * len(ids)
    for i, dst in zip(ids, dsts, strict=True):
        assert torch.equal(dst, VALUES[i]), f"key {i} loaded back different bytes"
