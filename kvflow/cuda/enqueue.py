"""The driver calls a transfer pipeline makes per op: async copies and timing-free events.

Measured on the GPU machine (docs/perf-journal.md), torch's way to queue a host copy on
a side stream costs ~26 us (a stream context then `copy_`) and `current_stream(device)`
~10 us; the driver calls behind them cost 1-5 us. A pipeline issues dozens per op
before and between its copies, so it calls the driver directly with raw handles.
Addresses are unified (UVA): host memory must be page-locked for a copy to overlap.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable

from kvflow.cuda.context import CurrentContext, stream_context
from kvflow.cuda.driver import (
    CU_EVENT_DISABLE_TIMING,
    CU_MEMORYTYPE_UNIFIED,
    CUDA_ERROR_INVALID_CONTEXT,
    Memcpy2D,
    libcuda,
)

#: the largest pitch a 2-D copy takes (CU_DEVICE_ATTRIBUTE_MAX_PITCH on every GPU kvflow
#: targets); rows further apart are copied one by one
MAX_PITCH = 2**31 - 1


def _call(what: str, context: int, fn: Callable[..., int], *args: object) -> None:
    """fn(*args); in a thread with no current context (torch makes one current only
    where it ran CUDA work) `context` is made current and fn tried once more."""
    rc = fn(*args)
    if rc == CUDA_ERROR_INVALID_CONTEXT and context and libcuda().cuCtxSetCurrent(context) == 0:
        rc = fn(*args)
    if rc:
        raise libcuda().fail(rc, what)


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Queue a copy of `nbytes` from address `src` to `dst` (host or device) on `stream`
    (a created stream, not the legacy default one)."""
    lib = libcuda()
    rc = lib.cuMemcpyAsync(dst, src, nbytes, stream)
    if rc == CUDA_ERROR_INVALID_CONTEXT:
        _call("cuMemcpyAsync", stream_context(stream), lib.cuMemcpyAsync, dst, src, nbytes, stream)
    elif rc:
        raise lib.fail(rc, "cuMemcpyAsync")


def copy_2d_async(
    dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int
) -> None:
    """Queue one copy of `height` rows of `width` bytes from `src` to `dst` (each row
    `src_pitch` / `dst_pitch` bytes after the last, both at most MAX_PITCH) on `stream`
    (a created stream): one driver call for what would be `height` plain copies."""
    lib = libcuda()
    desc = Memcpy2D(
        srcMemoryType=CU_MEMORYTYPE_UNIFIED, srcDevice=src, srcPitch=src_pitch,
        dstMemoryType=CU_MEMORYTYPE_UNIFIED, dstDevice=dst, dstPitch=dst_pitch,
        WidthInBytes=width, Height=height,
    )  # fmt: skip
    rc = lib.cuMemcpy2DAsync(ctypes.byref(desc), stream)
    if rc == CUDA_ERROR_INVALID_CONTEXT:
        _call(
            "cuMemcpy2DAsync",
            stream_context(stream),
            lib.cuMemcpy2DAsync,
            ctypes.byref(desc),
            stream,
        )
    elif rc:  # the copy's shape in the message: a refused copy is otherwise hard to place
        raise RuntimeError(
            f"{lib.fail(rc, 'cuMemcpy2DAsync')}: {height} rows of {width} bytes from"
            f" {src:#x} (pitch {src_pitch}) to {dst:#x} (pitch {dst_pitch})"
        )


class DriverEvent:
    """A CUDA event without timing, recorded and waited on through raw stream handles
    (any stream of its context, the default stream of a thread included)."""

    def __init__(self, stream: int) -> None:
        """Create the event in the context of `stream` (a created stream)."""
        lib = libcuda()
        self.context = stream_context(stream)
        if not self.context:
            raise RuntimeError(f"CUDA stream {stream:#x} has no context")
        handle = ctypes.c_void_p()
        # an event belongs to the context current when it is made: the thread may have
        # another device's context current, and recording that event on this stream fails
        with CurrentContext(self.context):
            rc = lib.cuEventCreate(ctypes.byref(handle), CU_EVENT_DISABLE_TIMING)
        if rc:
            raise lib.fail(rc, "cuEventCreate")
        self.handle = handle.value or 0
        weakref.finalize(self, lib.cuEventDestroy, self.handle)

    def record(self, stream: int) -> None:
        """Mark the point `stream` has reached; stream 0 is the event's context's default
        stream, whichever context the thread has current."""
        if stream:
            _call("cuEventRecord", self.context, libcuda().cuEventRecord, self.handle, stream)
            return
        with CurrentContext(self.context):
            _call("cuEventRecord", 0, libcuda().cuEventRecord, self.handle, 0)

    def query(self) -> bool:
        """Whether the recorded point has passed (a host check that never blocks), from
        any thread: the event's context is made current for the call when it is not."""
        with CurrentContext(self.context):
            return libcuda().query(self.handle)

    def wait_on(self, stream: int) -> None:
        """Make `stream` wait (on the GPU) until the recorded point has passed; stream 0
        is the event's context's default stream, whichever context the thread has current."""
        if stream:
            _call(
                "cuStreamWaitEvent", self.context, libcuda().cuStreamWaitEvent, stream,
                self.handle, 0,
            )  # fmt: skip
            return
        with CurrentContext(self.context):
            _call("cuStreamWaitEvent", 0, libcuda().cuStreamWaitEvent, 0, self.handle, 0)
