"""The tier helpers of kvflow.core.tiers.base: `gather` (one future over many, as the disk
and Redis tiers answer a batch) and `release_pins` (their pin counts)."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Future

import pytest
import torch

from kvflow.core.tiers.base import check_buffers, completed, gather, release_pins

WAIT_S = 30.0  # bound on waits that return at once unless something is broken


def test_gather_answers_when_the_last_input_does_without_holding_earlier_completers() -> None:
    """An I/O thread completing the parts one after another is never held up by the
    gathered future: the answer comes from the last completion, in input order."""
    parts: list[Future[int]] = [Future() for _ in range(3)]
    out = gather(parts, lambda results: list(results))
    assert not out.done()

    def complete_in_order() -> None:
        for i, part in enumerate(parts):
            part.set_result(i)

    io_thread = threading.Thread(target=complete_in_order, daemon=True)
    io_thread.start()
    assert out.result(timeout=WAIT_S) == [0, 1, 2]
    io_thread.join(timeout=WAIT_S)
    assert not io_thread.is_alive()


def test_gather_of_nothing_is_the_combination_of_nothing() -> None:
    assert gather([], lambda results: len(results)).result(timeout=0) == 0


def test_gather_fails_with_the_first_failed_input_in_order() -> None:
    first, second = OSError("disk 0"), OSError("disk 1")
    failed_first: Future[int] = Future()
    failed_first.set_exception(first)
    failed_second: Future[int] = Future()
    failed_second.set_exception(second)
    out = gather([completed(1), failed_first, failed_second], sum)
    assert out.done()
    assert out.exception(timeout=0) is first
    only: Future[int] = Future()
    only.set_exception(second)
    assert gather([completed(1), only], sum).exception(timeout=0) is second


def test_release_pins_keeps_a_key_pinned_until_each_pin_is_undone() -> None:
    pins: Counter[str] = Counter({"a": 2, "b": 1})
    release_pins(pins, ["a", "b"])
    assert dict(pins) == {"a": 1}  # b's last pin gone, a's second one left
    release_pins(pins, ["a"])
    assert dict(pins) == {}
    with pytest.raises(ValueError, match=r"^unpin of key 'a', which is not pinned$"):
        release_pins(pins, ["a"])


def test_a_refused_buffer_is_described_in_the_error() -> None:
    """The error names the argument, the index and what was passed instead: a tensor's
    dtype, shape and device, or a non-tensor's type."""
    good = torch.zeros(4, dtype=torch.uint8)
    check_buffers([good, good], "dsts")
    with pytest.raises(ValueError) as tensor:
        check_buffers([good, torch.zeros((2, 3), dtype=torch.float32)], "dsts")
    assert str(tensor.value) == (
        "dsts[1] must be a 1-D uint8 CPU tensor, got torch.float32 (2, 3) on cpu"
    )
    with pytest.raises(ValueError) as other:
        check_buffers([bytearray(4)], "srcs")
    assert str(other.value) == "srcs[0] must be a 1-D uint8 CPU tensor, got bytearray"
