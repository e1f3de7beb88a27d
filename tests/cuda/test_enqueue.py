"""kvflow.cuda's per-op driver calls: async copies in every direction, events ordering
streams, from any thread and under any current context.

Every check needs CUDA and pycuda (the streams are kvflow transfer streams).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvflow.cuda import CurrentContext, DriverEvent, copy_async, stream_context
from kvflow.kernels import cuda_available, current_stream_handle, new_transfer_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda"),
]


@contextmanager
def _page_locked(nbytes: int) -> Iterator[torch.Tensor]:
    """Host bytes page-locked with cudaHostRegister (as L1's are) for the block."""
    host = torch.zeros(nbytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    assert cudart.cudaHostRegister(host.data_ptr(), nbytes, 0) == cudart.cudaError.success
    try:
        yield host
    finally:
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(host.data_ptr())


def test_copies_round_trip_host_device_host_bit_for_bit(cuda_device: torch.device) -> None:
    stream = new_transfer_stream(cuda_device)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    with _page_locked(src.numel()) as host_in, _page_locked(src.numel()) as host_out:
        host_in.copy_(src)
        dev = torch.empty(src.numel(), dtype=torch.uint8, device=cuda_device)
        dev2 = torch.empty_like(dev)
        n = src.numel()
        copy_async(dev.data_ptr(), host_in.data_ptr(), n, stream.handle)
        copy_async(dev2.data_ptr(), dev.data_ptr(), n, stream.handle)
        copy_async(host_out.data_ptr(), dev2.data_ptr(), n, stream.handle)
        stream.synchronize()
        assert torch.equal(host_out, src)


def test_an_event_orders_one_stream_after_another(cuda_device: torch.device) -> None:
    """The second stream's copy reads what the first stream wrote after a long kernel."""
    first, second = new_transfer_stream(cuda_device), new_transfer_stream(cuda_device)
    done = DriverEvent(first.handle)
    a = torch.zeros(64 << 20, dtype=torch.float32, device=cuda_device)
    out = torch.empty_like(a)
    with torch.cuda.stream(first.torch):
        for _ in range(20):  # keep `first` busy so an unordered copy would see zeros
            a.add_(1.0)
    done.record(first.handle)
    done.wait_on(second.handle)
    copy_async(out.data_ptr(), a.data_ptr(), a.numel() * 4, second.handle)
    second.synchronize()
    assert bool((out == 20.0).all())


def test_an_event_is_asked_on_the_host_from_any_thread(cuda_device: torch.device) -> None:
    """`query` is False while the stream runs ~0.1 s of work before the recorded point
    and True once it passed, also from a thread with no context current."""
    stream = new_transfer_stream(cuda_device)
    done = DriverEvent(stream.handle)
    with torch.cuda.stream(stream.torch):
        torch.cuda._sleep(200_000_000)
    done.record(stream.handle)
    answers: list[bool] = []
    thread = threading.Thread(target=lambda: answers.append(done.query()))
    thread.start()
    thread.join()
    assert answers == [False] and not done.query()
    stream.synchronize()
    thread = threading.Thread(target=lambda: answers.append(done.query()))
    thread.start()
    thread.join()
    assert answers == [False, True] and done.query()


def test_a_fresh_thread_records_on_the_default_stream_and_copies(cuda_device: torch.device) -> None:
    """A thread where torch never ran CUDA work has no current context; the calls make
    the stream's (or event's) context current instead of failing."""
    stream = new_transfer_stream(cuda_device)
    event = DriverEvent(stream.handle)
    a = torch.arange(1 << 16, dtype=torch.int32, device=cuda_device)
    b = torch.empty_like(a)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            event.record(0)
            event.wait_on(stream.handle)
            copy_async(b.data_ptr(), a.data_ptr(), a.numel() * 4, stream.handle)
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    stream.synchronize()
    assert errors == []
    assert torch.equal(a, b)


def test_current_context_runs_a_block_under_the_stream_context_over_another_one(
    cuda_device: torch.device,
) -> None:
    """With another context current (as in a process driving several GPUs), driver calls
    inside CurrentContext run in the stream's context; the other one is current after."""
    import pycuda.driver as drv

    stream = new_transfer_stream(cuda_device)
    a = torch.arange(1 << 16, dtype=torch.int32, device=cuda_device)
    b = torch.empty_like(a)
    event = DriverEvent(stream.handle)
    other = drv.Device(0).make_context()  # a second context (device 0's), now current
    try:
        with CurrentContext(stream_context(stream.handle)):
            event.record(0)  # the stream's context's default stream
            event.wait_on(stream.handle)
            copy_async(b.data_ptr(), a.data_ptr(), a.numel() * 4, stream.handle)
        assert drv.Context.get_current().handle == other.handle
    finally:
        other.pop()
        other.detach()
    stream.synchronize()
    assert torch.equal(a, b)


def test_the_default_stream_waits_in_the_events_context_under_another_one(
    cuda_device: torch.device,
) -> None:
    """`wait_on(0)` with another context current (an engine thread last used another GPU)
    makes torch's default stream of the event's device wait, not the current context's:
    its copy reads what the transfer stream wrote after ~0.1 s of sleep."""
    import pycuda.driver as drv

    stream = new_transfer_stream(cuda_device)
    event = DriverEvent(stream.handle)
    a = torch.zeros(1 << 16, dtype=torch.int32, device=cuda_device)
    b = torch.empty_like(a)
    torch.cuda.synchronize(cuda_device)
    with torch.cuda.stream(stream.torch):
        torch.cuda._sleep(200_000_000)
        a.fill_(7)
    event.record(stream.handle)
    other = drv.Device(0).make_context()
    try:
        event.wait_on(0)
        assert drv.Context.get_current().handle == other.handle
    finally:
        other.pop()
        other.detach()
    with torch.cuda.device(cuda_device):
        assert current_stream_handle(cuda_device.index or 0) == 0  # the default stream
        b.copy_(a)
    torch.cuda.synchronize(cuda_device)
    assert bool((b == 7).all())


def test_current_stream_handle_is_torchs_current_stream() -> None:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream_handle(0) == side.cuda_stream
    assert current_stream_handle(0) == torch.cuda.current_stream(0).cuda_stream


def test_a_copy_past_a_device_allocation_raises_naming_the_call(cuda_device: torch.device) -> None:
    """The driver checks device ranges (host addresses it cannot: they may be pageable)."""
    stream = new_transfer_stream(cuda_device)
    a = torch.empty(1 << 20, dtype=torch.uint8, device=cuda_device)
    b = torch.empty(1 << 20, dtype=torch.uint8, device=cuda_device)
    with pytest.raises(RuntimeError, match=r"cuMemcpyAsync failed: CUDA_ERROR_INVALID_VALUE \(1\)"):
        copy_async(a.data_ptr(), b.data_ptr(), 1 << 40, stream.handle)
    copy_async(a.data_ptr(), b.data_ptr(), 1 << 20, stream.handle)  # the stream still works
    stream.synchronize()
    assert torch.equal(a, b)
