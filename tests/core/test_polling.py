"""kvflow.core.polling.poll_until: the wait every layer flag, ring slot and mover uses."""

from __future__ import annotations

import itertools
import math
import time

import pytest

from kvflow.core.errors import RequestTimeoutError, TransferError
from kvflow.core.polling import poll_until


def test_returns_once_done_with_the_seconds_waited_and_idles_between_polls() -> None:
    polls, idles = [], []

    def done() -> bool:
        polls.append(time.perf_counter())
        return len(polls) == 4

    waited = poll_until(done, 5.0, "four polls", idle=lambda: idles.append(1))
    assert len(polls) == 4 and len(idles) == 3  # idle runs between polls, not after the last
    assert 0 <= waited < 5.0


def test_done_at_once_waits_for_nothing() -> None:
    assert poll_until(lambda: True, 0.0, "nothing", idle=pytest.fail) < 0.01


def test_sleeps_between_polls_once_the_spins_are_spent() -> None:
    """With spins=0 every poll after the first comes interval_s later or more: a waiter
    that never spins (the mover's wait beside the engine's forward pass)."""
    polls: list[float] = []

    def done() -> bool:
        polls.append(time.perf_counter())
        return len(polls) == 6

    poll_until(done, 5.0, "six polls", spins=0, interval_s=0.01)
    gaps = [b - a for a, b in itertools.pairwise(polls)]
    assert len(gaps) == 5 and min(gaps) >= 0.009


def test_times_out_naming_what_it_waited_for() -> None:
    with pytest.raises(RequestTimeoutError, match=r"layer 3 of the load: nothing within 0.05 s"):
        poll_until(lambda: False, 0.05, "layer 3 of the load", interval_s=0.001)


def test_without_a_deadline_it_waits_until_done() -> None:
    """math.inf: no timeout (a mover waiting for its own GPU work)."""
    ends = time.perf_counter() + 0.05
    assert poll_until(lambda: time.perf_counter() >= ends, math.inf, "GPU work") >= 0.04


def test_cancelled_raises_transfer_error_before_the_deadline() -> None:
    calls: list[int] = []

    def cancelled() -> bool:
        calls.append(1)
        return len(calls) >= 3

    with pytest.raises(TransferError, match="cancelled waiting for a free slot"):
        poll_until(lambda: False, 60.0, "a free slot", cancelled)
    assert len(calls) == 3
