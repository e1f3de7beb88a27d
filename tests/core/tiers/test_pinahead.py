"""L1 pinned ahead of demand: stores use what is pinned, evict rather than wait for a
segment, wait only when nothing can be evicted, and growth reports its progress."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
import torch

from kvflow.core.tiers.hostmem import HostPool
from kvflow.core.tiers.l1 import L1Cache
from kvflow.core.tiers.pinahead import PinAhead

SEG = 4096  # bytes per segment: four objects of 1 KiB
OBJ = 1024


class GatedPool(HostPool):
    """An unpinned pool whose segments are 'pinned' only as permits are released, so a
    test decides when each background segment arrives; `fail` makes the next one raise."""

    def __init__(self) -> None:
        super().__init__(pinned=False)
        self.permits = threading.Semaphore(0)
        self.making = threading.Event()  # a thread waits in make_segment
        self.fail = False
        self.started = 0
        self.made = 0

    def make_segment(self, nbytes: int) -> torch.Tensor:
        self.started += 1
        self.making.set()
        assert self.permits.acquire(timeout=30), "a test forgot to release a segment"
        if self.fail:
            raise MemoryError("cudaHostRegister of 4096 bytes failed: 2")
        self.made += 1
        return super().make_segment(nbytes)


def _gated_l1(segments: int = 3) -> tuple[L1Cache, GatedPool]:
    pool = GatedPool()
    l1 = L1Cache(segments * SEG, pool=pool, segment_bytes=SEG, pin_ahead=True, pin_threads=1)
    return l1, pool


def _item(i: int) -> tuple[str, torch.Tensor]:
    return f"k{i}", torch.full((OBJ,), i % 251, dtype=torch.uint8)


def _wait_pinned(l1: L1Cache, nbytes: int) -> None:
    for _ in range(3000):
        state = l1.pin_state()
        assert state is not None
        if state["pinned_bytes"] >= nbytes:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"L1 never pinned {nbytes} bytes: {l1.pin_state()}")


def _wait_done(l1: L1Cache) -> dict[str, Any]:
    """L1's growth-ahead state once no thread grows it any more (finished or failed)."""
    for _ in range(3000):
        state = l1.pin_state()
        assert state is not None
        if not state["pinning"]:
            return state
        threading.Event().wait(0.01)
    raise AssertionError(f"L1 still growing ahead: {l1.pin_state()}")


def test_a_store_evicts_instead_of_waiting_for_the_next_segment() -> None:
    """One segment pinned, the next held back: a fifth object evicts the oldest at once
    (the store does not wait on pinning); once the rest arrive, nothing more is evicted."""
    l1, pool = _gated_l1()
    pool.permits.release()
    _wait_pinned(l1, SEG)
    assert l1.store([_item(i) for i in range(4)]).result().stored == 4
    outcome = l1.store([_item(4)]).result()  # segment 2 is still "being pinned"
    assert outcome.stored == 1 and outcome.evicted_chunks == 1
    state = l1.pin_state()
    assert state is not None and state["pinning"] and 0 <= state["seconds"] < 30  # so far
    assert l1.contains(["k0", "k4"]).result() == [False, True]
    pool.permits.release(2)
    _wait_pinned(l1, 3 * SEG)
    outcome = l1.store([_item(i) for i in range(5, 13)]).result()
    assert (outcome.stored, outcome.evicted_chunks) == (8, 0)
    state = l1.pin_state()
    assert state is not None and state["pinned_bytes"] == 3 * SEG
    assert not state["pinning"] and state["failed"] is None
    assert l1.stats()["reserved_bytes"] == 3 * SEG
    l1.close()


def test_a_store_with_nothing_to_evict_waits_for_the_first_segment() -> None:
    """A store into an L1 that has pinned nothing yet waits for the first segment and then
    succeeds (the one case it waits: there is nothing it could evict)."""
    l1, pool = _gated_l1()
    done: list[int] = []
    writer = threading.Thread(target=lambda: done.append(l1.store([_item(0)]).result().stored))
    writer.start()
    writer.join(0.2)
    assert writer.is_alive() and done == []  # no memory yet, nothing to evict
    pool.permits.release(3)
    writer.join(10)
    assert done == [1]
    l1.close()


def test_a_failed_pin_stops_growth_ahead_and_l1_grows_on_demand() -> None:
    """The first background segment fails (out of pinnable memory): the failure is reported,
    growth ahead stops, and stores grow L1 on demand as before instead of hanging."""
    l1, pool = _gated_l1()
    pool.fail = True
    pool.permits.release()
    state = _wait_done(l1)
    assert state["failed"] is not None and "MemoryError" in state["failed"]
    pool.fail = False
    pool.permits.release(3)  # the on-demand segments
    assert l1.store([_item(i) for i in range(6)]).result().stored == 6
    assert l1.stats()["reserved_bytes"] == 2 * SEG
    l1.close()


def test_close_waits_for_the_segment_in_flight_and_drops_it() -> None:
    """close() returns only once no thread is pinning (one still inside the driver when
    the process exits aborts it), and the segment finished after close() is given back,
    not adopted."""
    l1, pool = _gated_l1()
    assert pool.making.wait(10), "the pinning thread never started a segment"
    closer = threading.Thread(target=l1.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() returned while a segment was being pinned"
    pool.permits.release(3)
    closer.join(10)
    assert not closer.is_alive(), "close() did not return once the segment was made"
    state = l1.pin_state()
    assert state is not None and not state["pinning"]
    assert l1.stats()["reserved_bytes"] == 0
    assert pool.made == 1  # the thread made the segment it was making, and no other


def test_a_pause_waits_for_the_segment_being_made_and_holds_the_next() -> None:
    """`pinning_paused()` (held by a registration, whose CUDA calls would queue behind a
    pinning in the driver) is entered only once the segment being made is done; no
    segment starts while any pause is held; growth goes on once the last is left."""
    l1, pool = _gated_l1()
    assert pool.making.wait(10), "the pinning thread never started a segment"
    entered, leave = threading.Event(), threading.Event()

    def registration() -> None:
        with l1.pinning_paused():
            entered.set()
            assert leave.wait(30)

    holder = threading.Thread(target=registration)
    holder.start()
    assert not entered.wait(0.3), "paused while a segment was being made"
    pool.permits.release(3)
    assert entered.wait(10), "the pause was not entered once the segment was made"
    with l1.pinning_paused():  # a second pause, held while the first one is left
        leave.set()
        holder.join(10)
        threading.Event().wait(0.3)
        assert (pool.started, pool.made) == (1, 1), "a segment was started during a pause"
    state = _wait_done(l1)
    assert pool.made == 3 and state["pinned_bytes"] == 3 * SEG
    with l1.pinning_paused():  # nothing left to hold: entered at once
        pass
    l1.close()


def test_pin_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="pin threads must be at least 1"):
        L1Cache(SEG, pool=HostPool(pinned=False), segment_bytes=SEG, pin_ahead=True, pin_threads=0)


def test_an_unpinned_pool_grows_on_demand_by_default() -> None:
    l1 = L1Cache(SEG, pool=HostPool(pinned=False), segment_bytes=SEG)
    assert l1.pin_state() is None
    assert l1.store([_item(0)]).result().stored == 1
    l1.close()


def test_a_prefaulting_pool_grows_ahead_by_default_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without CUDA, a pool that faults its memory in is grown to capacity in the
    background like a pinned one; its state and log lines say "prefault", not pinning."""
    caplog.set_level("INFO", logger="kvflow.core.tiers.pinahead")
    l1 = L1Cache(3 * SEG, pool=HostPool(pinned=False, prefault=True), segment_bytes=SEG)
    _wait_pinned(l1, 3 * SEG)
    state = _wait_done(l1)
    assert (state["mode"], state["failed"], state["pinning"]) == ("prefault", None, False)
    assert l1.stats()["reserved_bytes"] == 3 * SEG
    for _ in range(3000):  # the last line is logged just after the state says done
        lines = [r.getMessage() for r in caplog.records if r.name == "kvflow.core.tiers.pinahead"]
        if len(lines) > 1:
            break
        threading.Event().wait(0.01)
    assert len(lines) == 2
    assert lines[0] == "faulting in L1 ahead of demand: 0.0 GiB in 0-MiB segments on 3 threads"
    assert lines[-1].startswith("L1 faulted in: 0.0 GiB in ")
    assert l1.store([_item(0)]).result().stored == 1
    l1.close()


def test_a_pinned_pool_s_growth_reports_mode_pin() -> None:
    l1, pool = _gated_l1(segments=1)
    state = l1.pin_state()
    assert state is not None and state["mode"] == "pin"
    pool.permits.release()
    _wait_pinned(l1, SEG)
    l1.close()


def test_growth_ahead_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match=r"^mode must be one of \['pin', 'prefault'\], got 'x'$"):
        PinAhead(SEG, SEG, claim=lambda: 0, make=torch.empty, settle=lambda *_: True, mode="x")


class _Claims:
    """Hands out `count` claims of `size` bytes, then 0; made segments are empty tensors
    (nothing is allocated: the test is about the bookkeeping and the lines)."""

    def __init__(self, count: int, size: int) -> None:
        self._left, self._size, self._lock = count, size, threading.Lock()
        self.settled: list[int] = []

    def claim(self) -> int:
        with self._lock:
            if not self._left:
                return 0
            self._left -= 1
            return self._size

    def settle(self, size: int, segment: torch.Tensor | None) -> bool:
        with self._lock:
            self.settled.append(size)
        return True


@pytest.mark.parametrize("threads", [1, 3])
def test_growth_logs_its_size_segments_threads_and_end_and_freezes_its_time(
    caplog: pytest.LogCaptureFixture, threads: int
) -> None:
    """3 GiB in 1 GiB segments on named threads: the start and end lines give the sizes
    in GiB and MiB; once done, the seconds taken stop growing."""
    caplog.set_level("INFO", logger="kvflow.core.tiers.pinahead")
    claims = _Claims(3, 1 << 30)
    seen_names: list[str] = []

    def make(size: int) -> torch.Tensor:
        seen_names.append(threading.current_thread().name)
        return torch.empty(0, dtype=torch.uint8)

    growth = PinAhead(
        3 << 30, 1 << 30, claim=claims.claim, make=make, settle=claims.settle,
        threads=threads, mode="prefault",
    )  # fmt: skip
    growth.join(30)
    assert growth.done and claims.settled == [1 << 30] * 3
    assert set(seen_names) <= {"kvflow-l1-pin-0", "kvflow-l1-pin-1", "kvflow-l1-pin-2"}
    state = growth.state()
    assert state["pinned_bytes"] == state["target_bytes"] == 3 << 30
    assert isinstance(state["seconds"], float) and 0 <= state["seconds"] < 30
    threading.Event().wait(0.05)
    assert growth.state()["seconds"] == state["seconds"]  # frozen at the end
    lines = [r.getMessage() for r in caplog.records if r.name == "kvflow.core.tiers.pinahead"]
    assert lines[0] == (
        f"faulting in L1 ahead of demand: 3.0 GiB in 1024-MiB segments on {threads} threads"
    )
    assert re.fullmatch(r"L1 faulted in: 3\.0 GiB in \d+\.\d s", lines[-1]), lines


def test_a_failed_segment_says_what_failed_and_that_l1_grows_on_demand(
    caplog: pytest.LogCaptureFixture,
) -> None:
    claims = _Claims(1, 1 << 20)

    def make(size: int) -> torch.Tensor:
        raise MemoryError("cudaHostRegister of 1048576 bytes failed: 2")

    growth = PinAhead(1 << 20, 1 << 20, claim=claims.claim, make=make,
                      settle=claims.settle, mode="pin")  # fmt: skip
    growth.join(30)
    assert growth.failed == "MemoryError: cudaHostRegister of 1048576 bytes failed: 2"
    assert claims.settled == [1 << 20]  # the claim was given back
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "pinning L1 ahead stopped: cudaHostRegister of 1048576 bytes failed: 2; L1 grows on demand"
    ]


class _Gate:
    """Segments made only as permits are released; counts the threads inside `make`."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.inside = threading.Semaphore(0)  # one release per thread that entered make

    def make(self, size: int) -> torch.Tensor:
        self.inside.release()
        assert self.permits.acquire(timeout=30), "a test forgot to release a segment"
        return torch.empty(0, dtype=torch.uint8)


def test_a_pause_waits_for_every_segment_being_made() -> None:
    """With two threads each making a segment, a pause is entered only once both are
    done: one finished is not enough."""
    claims, gate = _Claims(2, 1 << 20), _Gate()
    growth = PinAhead(
        2 << 20, 1 << 20, claim=claims.claim, make=gate.make, settle=claims.settle,
        threads=2, mode="prefault",
    )  # fmt: skip
    assert gate.inside.acquire(timeout=10) and gate.inside.acquire(timeout=10)
    entered = threading.Event()

    def registration() -> None:
        with growth.paused():
            entered.set()

    holder = threading.Thread(target=registration)
    holder.start()
    gate.permits.release()  # one of the two segments is done
    assert not entered.wait(0.3), "paused while the other segment was being made"
    gate.permits.release()
    assert entered.wait(10), "the pause was not entered once both segments were made"
    holder.join(10)
    growth.join(10)
    assert growth.done


def test_join_gives_up_after_its_timeout() -> None:
    """`join(timeout)` returns after about that long even while a segment is being made
    (L1's close bounds its wait so), and growth ends once the segment is released."""
    claims, gate = _Claims(1, 1 << 20), _Gate()
    growth = PinAhead(
        1 << 20, 1 << 20, claim=claims.claim, make=gate.make, settle=claims.settle,
        threads=1, mode="prefault",
    )  # fmt: skip
    assert gate.inside.acquire(timeout=10)
    began = time.monotonic()
    growth.join(0.2)
    assert time.monotonic() - began < 5 and not growth.done
    gate.permits.release()
    growth.join(10)
    assert growth.done and growth.state()["seconds"] == round(growth.state()["seconds"], 3)
