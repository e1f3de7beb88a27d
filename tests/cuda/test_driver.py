"""The one libcuda binding and what is built on it, against a fake libcuda compiled from
fake_libcuda.c: argument types, error names, context push/pop and the retry of a call
made on a thread with no current context. Runs without a GPU (needs a C compiler)."""

from __future__ import annotations

import ctypes
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvflow.cuda import context, driver
from kvflow.cuda.context import CurrentContext, primary_context, stream_context
from kvflow.cuda.driver import CU_EVENT_DISABLE_TIMING, Driver
from kvflow.cuda.enqueue import DriverEvent, copy_2d_async, copy_async
from tests.support.requirements import find

CC = find("cc")
pytestmark = pytest.mark.needs("cc", why="the fake libcuda these tests bind to is built from C")
CTX0, CTX1 = 0xC0000, 0xC1000


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ctypes.CDLL]:
    """kvflow.cuda bound to a freshly built fake libcuda; yields the fake's own handle."""
    assert CC is not None
    so = tmp_path / "libfakecuda.so"
    source = Path(__file__).with_name("fake_libcuda.c")
    subprocess.run(
        [CC, "-O1", "-shared", "-fPIC", "-Wall", "-Werror", "-o", so, source], check=True
    )
    monkeypatch.setattr(driver, "_driver", Driver(str(so)))
    monkeypatch.setattr(context, "_primary", {})
    yield ctypes.CDLL(str(so))


def _current() -> int:
    return driver.libcuda().current_context()


def test_error_names_and_failures_name_the_call(fake: ctypes.CDLL) -> None:
    lib = driver.libcuda()
    assert lib.error_name(1) == "CUDA_ERROR_INVALID_VALUE (1)"
    assert lib.error_name(999) == "CUresult 999"
    assert str(lib.fail(201, "cuEventRecord")) == (
        "cuEventRecord failed: CUDA_ERROR_INVALID_CONTEXT (201)"
    )


def test_addresses_for_the_c_extension_are_the_entry_points(fake: ctypes.CDLL) -> None:
    lib = driver.libcuda()

    def address(name: str) -> int:
        return ctypes.cast(getattr(fake, name), ctypes.c_void_p).value or 0

    assert lib.launch_ptr == address("cuLaunchHostFunc")
    assert lib.wait_ptr == address("cuStreamWaitEvent")
    assert lib.record_ptr == address("cuEventRecord")
    assert lib.push_ptr == address("cuCtxPushCurrent_v2")
    assert lib.pop_ptr == address("cuCtxPopCurrent_v2")


def test_primary_context_is_retained_once_per_device(fake: ctypes.CDLL) -> None:
    assert primary_context(0) == CTX0 and primary_context(1) == CTX1
    assert context._primary == {0: CTX0, 1: CTX1}


def test_current_context_pushes_only_when_another_or_none_is_current(fake: ctypes.CDLL) -> None:
    assert _current() == 0
    with CurrentContext(CTX0):  # none current: pushed
        assert _current() == CTX0 and fake.fake_depth() == 1
    assert _current() == 0 and fake.fake_depth() == 0
    lib = driver.libcuda()
    lib.push_context(CTX0)
    with CurrentContext(CTX0):  # already current: nothing pushed
        assert fake.fake_depth() == 1
    with CurrentContext(CTX1):  # another one current: pushed over it
        assert _current() == CTX1 and fake.fake_depth() == 2
    assert _current() == CTX0
    lib.pop_context()
    assert _current() == 0


def test_stamper_calls_create_query_and_time(fake: ctypes.CDLL) -> None:
    """The calls the stream stamper makes, with their CUDA error outcomes."""
    lib = driver.libcuda()
    with pytest.raises(RuntimeError, match=r"cuStreamCreate failed: CUDA_ERROR_INVALID_CONTEXT"):
        lib.create_stream()
    with CurrentContext(CTX1):
        stream = lib.create_stream()
        event = lib.create_event()
        assert fake.fake_last_event_flags() == 0  # a timing event
        assert lib.record(event, stream) == 0
    assert lib.stream_context(stream) == CTX1 == stream_context(stream)
    assert lib.stream_context(0xBAD) == 0
    assert lib.query(0xE000) and not lib.query(0xE001)
    assert lib.elapsed_ns(0xE000, 0xE002) == 1_500_000
    assert lib.elapsed_ns(0xE000, 0xE001) is None
    with pytest.raises(RuntimeError, match=r"cuCtxPopCurrent failed"):
        lib.pop_context()


def test_copies_carry_addresses_and_sizes_unchanged(fake: ctypes.CDLL) -> None:
    """A copy moves the bytes between the two addresses given; a refused one raises
    naming the call and the error."""
    with CurrentContext(CTX0):
        stream = driver.libcuda().create_stream()
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    with CurrentContext(CTX0):
        copy_async(dst.ctypes.data, src.ctypes.data, src.nbytes, stream)
        with pytest.raises(
            RuntimeError, match=r"cuMemcpyAsync failed: CUDA_ERROR_INVALID_VALUE \(1\)"
        ):
            copy_async(dst.ctypes.data, src.ctypes.data, 1 << 40, stream)
    assert np.array_equal(dst, src)


def test_a_2d_copy_moves_rows_at_their_pitches(fake: ctypes.CDLL) -> None:
    """copy_2d_async hands both addresses, both pitches, the width and the row count to
    the driver unchanged: rows land at the destination pitch, the gaps stay untouched."""
    with CurrentContext(CTX0):
        stream = driver.libcuda().create_stream()
    src = np.arange(4 * 48, dtype=np.uint8)  # 4 rows at a pitch of 48
    dst = np.full(4 * 20, 255, dtype=np.uint8)  # 16 bytes of each row at a pitch of 20
    with CurrentContext(CTX0):
        copy_2d_async(dst.ctypes.data, 20, src.ctypes.data + 8, 48, 16, 4, stream)
        refused = r"cuMemcpy2DAsync failed: CUDA_ERROR_INVALID_VALUE \(1\): 4 rows of 16 bytes"
        with pytest.raises(RuntimeError, match=refused + r" from 0x[0-9a-f]+ \(pitch 48\)"):
            copy_2d_async(dst.ctypes.data, 8, src.ctypes.data, 48, 16, 4, stream)  # pitch < width
    rows = dst.reshape(4, 20)
    assert np.array_equal(rows[:, :16], src.reshape(4, 48)[:, 8:24])
    assert (rows[:, 16:] == 255).all()


def test_raise_priority_gives_the_greatest_the_context_allows(fake: ctypes.CDLL) -> None:
    with CurrentContext(CTX0):
        lib = driver.libcuda()
        stream = lib.create_stream()
        assert lib.raise_priority(stream) == -5


def test_a_thread_without_a_context_gets_the_streams(fake: ctypes.CDLL) -> None:
    """On a thread with no current context, copies and events make the stream's (or the
    event's) context current and retry instead of failing."""
    with CurrentContext(CTX1):
        stream = driver.libcuda().create_stream()
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros_like(src)
    seen: list[int] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            event = DriverEvent(stream)
            seen.append(event.context)
            seen.append(fake.fake_last_event_flags())
            event.record(stream)
            event.wait_on(stream)
            copy_async(dst.ctypes.data, src.ctypes.data, src.nbytes, stream)
            seen.append(_current())
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert errors == []
    assert seen == [CTX1, CU_EVENT_DISABLE_TIMING, CTX1]
    assert np.array_equal(dst, src)
    assert fake.fake_records() == 1 and fake.fake_waits() == 1


def test_recording_on_the_default_stream_runs_under_the_events_context(
    fake: ctypes.CDLL,
) -> None:
    """record(0) pushes the event's context around the record and pops it after."""
    with CurrentContext(CTX0):
        event = DriverEvent(driver.libcuda().create_stream())
    with CurrentContext(CTX1):
        event.record(0)
        assert _current() == CTX1 and fake.fake_depth() == 1
    assert fake.fake_records() == 1 and _current() == 0
