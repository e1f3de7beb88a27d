"""HostPool on any machine: its segments, and the page-locking it asks of the CUDA runtime.

CPU torch has no CUDA runtime, so `FakeCudaRuntime` stands in for `torch.cuda.cudart()`:
it keeps the set of registered ranges the way the driver does and refuses what the driver
refuses (a range registered twice, an unregister of a pointer never registered). The pool
itself is the real one. tests/core/tiers/test_hostmem_gpu.py checks the same on a GPU.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
from collections.abc import Iterator

import pytest
import torch

from kvflow.core.tiers.hostmem import HostPool

SUCCESS = 0
MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered
REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every GPU's context


class _FakeErrors:
    success = SUCCESS


class FakeCudaRuntime:
    """What HostPool uses of `torch.cuda.cudart()`, with the driver's bookkeeping."""

    cudaError = _FakeErrors

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # start address -> bytes
        self.register_calls: list[tuple[int, int, int]] = []
        self.unregister_errors: list[object] = []
        self.refuse_with: int | None = None

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.register_calls.append((ptr, size, flags))
        if self.refuse_with is not None:
            return self.refuse_with
        if ptr in self.registered:
            return ALREADY_REGISTERED
        self.registered[ptr] = size
        return SUCCESS

    def cudaHostUnregister(self, ptr: int) -> int:
        if ptr not in self.registered:
            self.unregister_errors.append(ptr)
            return NOT_REGISTERED
        del self.registered[ptr]
        return SUCCESS


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudaRuntime]:
    runtime = FakeCudaRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    yield runtime
    gc.collect()  # pools dropped by the test unpin now, while the fake is still in place


def test_each_segment_is_page_locked_whole_and_portable(cudart: FakeCudaRuntime) -> None:
    pool = HostPool(pinned=True)
    assert pool.pinned
    first = pool.add_segment(4096)
    second = pool.add_segment(8192)
    starts = [pool.address(first, 0), pool.address(second, 0)]
    assert cudart.register_calls == [
        (starts[0], 4096, REGISTER_PORTABLE),
        (starts[1], 8192, REGISTER_PORTABLE),
    ]
    assert cudart.registered == {starts[0]: 4096, starts[1]: 8192}
    pool.release()


def test_release_unpins_every_segment_at_once(cudart: FakeCudaRuntime) -> None:
    pool = HostPool(pinned=True)
    pool.add_segment(4096)
    pool.add_segment(4096)
    assert len(cudart.registered) == 2
    pool.release()
    assert cudart.registered == {}
    assert cudart.unregister_errors == []


def test_a_pool_dropped_without_release_unpins_its_segments(cudart: FakeCudaRuntime) -> None:
    pool = HostPool(pinned=True)
    view = pool.view(pool.add_segment(4096), 0, 4096)
    assert cudart.registered == {view.data_ptr(): 4096}
    del pool
    gc.collect()
    assert cudart.registered == {}
    assert cudart.unregister_errors == []
    view.fill_(7)  # the held view keeps its bytes
    assert int(view.sum()) == 7 * 4096


def test_a_refused_page_lock_is_a_memory_error_that_adds_no_segment(
    cudart: FakeCudaRuntime,
) -> None:
    pool = HostPool(pinned=True)
    cudart.refuse_with = MEMORY_ALLOCATION
    with pytest.raises(MemoryError, match=r"^cudaHostRegister of 4096 bytes failed: 2$"):
        pool.add_segment(4096)
    cudart.refuse_with = None
    assert pool.add_segment(4096) == 0  # the refused one took no index
    pool.release()
    assert cudart.registered == {}


def test_unpinned_pool_never_calls_the_cuda_runtime(cudart: FakeCudaRuntime) -> None:
    pool = HostPool(pinned=False)
    assert pool.pinned is False
    pool.add_segment(4096)
    pool.release()
    del pool
    gc.collect()
    assert cudart.register_calls == [] and cudart.unregister_errors == []


def test_pinning_follows_cuda_unless_asked(
    cudart: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert HostPool().pinned is False
    assert HostPool(pinned=True).pinned is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    by_default = HostPool()
    assert by_default.pinned is True
    assert HostPool(pinned=False).pinned is False
    by_default.add_segment(4096)
    assert len(cudart.registered) == 1  # CUDA present: pinned without being asked
    by_default.release()


def test_a_segment_index_names_that_segment_for_the_pool_s_life() -> None:
    pool = HostPool(pinned=False)
    first = pool.add_segment(64)
    first_view = pool.view(first, 0, 64)
    second = pool.add_segment(128)
    assert (first, second) == (0, 1)
    assert pool.view(first, 0, 64).data_ptr() == first_view.data_ptr()
    assert pool.address(first, 8) == first_view.data_ptr() + 8
    assert pool.address(second, 0) == pool.view(second, 0, 128).data_ptr()
    assert pool.address(second, 0) != first_view.data_ptr()
    pool.view(first, 0, 64).fill_(1)
    pool.view(second, 0, 128).fill_(2)
    assert int(first_view.sum()) == 64
    pool.release()


def _resident_pages(view: torch.Tensor) -> tuple[int, int]:
    """(resident, total) pages of the whole pages inside `view`'s bytes, as the kernel's
    mincore(2) reports them: what a first touch would not have to fault in."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = -(-view.data_ptr() // page) * page
    pages = (view.data_ptr() + view.numel() - start) // page
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(start, pages * page, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec), pages


def test_a_prefaulting_pool_makes_segments_resident_and_a_plain_one_does_not(
    cudart: FakeCudaRuntime,
) -> None:
    """Without CUDA a prefaulting pool's segment is in memory before anything touches it
    (so a store copying into it pays no page faults); a plain pool's is not. (The plain
    one is 128 MiB: glibc may serve 32 MiB from a free heap region an earlier test
    touched, but maps anything larger than its heaps can hold afresh.)"""
    nbytes, plain_nbytes = 32 << 20, 128 << 20
    plain = HostPool(pinned=False)
    cold = plain.view(plain.add_segment(plain_nbytes), 0, plain_nbytes)
    resident, pages = _resident_pages(cold)
    assert resident < pages // 10
    prefaulting = HostPool(pinned=False, prefault=True)
    assert prefaulting.prefault and prefaulting.slow_to_make and not plain.slow_to_make
    warm = prefaulting.view(prefaulting.add_segment(nbytes), 0, nbytes)
    resident, pages = _resident_pages(warm)
    assert resident == pages > 0
    warm.fill_(5)  # the memory is ordinary, writable host memory
    assert int(warm[-1]) == 5
    assert cudart.register_calls == []
    prefaulting.release()
    plain.release()


def test_a_pinned_pool_faults_a_segment_in_before_registering_it(
    cudart: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every page is resident when cudaHostRegister is called: left to fault them in, the
    registration held the process's memory-map lock for the whole segment (~0.5 s a
    GiB), and every CUDA call of the process's other threads waited for it."""
    resident_at_register: list[tuple[int, int]] = []
    register = cudart.cudaHostRegister

    def registering(ptr: int, size: int, flags: int) -> int:
        as_bytes = (ctypes.c_ubyte * size).from_address(ptr)
        resident_at_register.append(_resident_pages(torch.frombuffer(as_bytes, dtype=torch.uint8)))
        return register(ptr, size, flags)

    monkeypatch.setattr(cudart, "cudaHostRegister", registering)
    pool = HostPool(pinned=True)
    pool.add_segment(128 << 20)  # more than glibc's heaps hold: mapped afresh, untouched
    [(resident, pages)] = resident_at_register
    assert resident == pages > 0
    pool.release()


def test_a_pinned_pool_ignores_prefault(cudart: FakeCudaRuntime) -> None:
    """Pinning faults memory in already: a pinned pool pins, and says it does not prefault."""
    pool = HostPool(pinned=True, prefault=True)
    assert (pool.pinned, pool.prefault, pool.slow_to_make) == (True, False, True)
    pool.add_segment(4096)
    assert len(cudart.registered) == 1
    pool.release()
