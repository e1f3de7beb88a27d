"""The few CUDA driver calls a transfer pipeline makes per op, through ctypes.

Measured on the GPU machine (docs/perf-journal.md), torch's way to queue a host copy on
a side stream costs ~26 us (a stream context then `copy_`) and `current_stream(device)`
~10 us; the driver calls behind them cost 1-5 us. A pipeline issues dozens per op
before and between its copies, so it calls the driver directly with raw handles.
Addresses are unified (UVA): host memory must be page-locked for a copy to overlap.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable

_CU_EVENT_DISABLE_TIMING = 2
_CUDA_ERROR_INVALID_CONTEXT = 201


class _Lib:
    """libcuda's entry points, typed once. PyDLL keeps the GIL: every call here only
    enqueues work and returns, so releasing the GIL around it would cost more."""

    def __init__(self) -> None:
        lib = ctypes.PyDLL("libcuda.so.1")
        vp, u64 = ctypes.c_void_p, ctypes.c_uint64
        vpp = ctypes.POINTER(ctypes.c_void_p)
        self.copy = lib.cuMemcpyAsync
        self.record = lib.cuEventRecord
        self.wait = lib.cuStreamWaitEvent
        self.event_create = lib.cuEventCreate
        self.event_destroy = lib.cuEventDestroy_v2
        self.stream_ctx = lib.cuStreamGetCtx
        self.get_ctx = lib.cuCtxGetCurrent
        self.set_ctx = lib.cuCtxSetCurrent
        self.push_ctx = lib.cuCtxPushCurrent_v2
        self.pop_ctx = lib.cuCtxPopCurrent_v2
        self.error_name = lib.cuGetErrorName
        typed: list[tuple[Callable[..., int], list[type]]] = [
            (self.copy, [u64, u64, ctypes.c_size_t, vp]),
            (self.record, [vp, vp]),
            (self.wait, [vp, vp, ctypes.c_uint]),
            (self.event_create, [vpp, ctypes.c_uint]),
            (self.event_destroy, [vp]),
            (self.stream_ctx, [vp, vpp]),
            (self.get_ctx, [vpp]),
            (self.set_ctx, [vp]),
            (self.push_ctx, [vp]),
            (self.pop_ctx, [vpp]),
            (self.error_name, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
        ]
        for fn, args in typed:
            fn.argtypes = args  # type: ignore[attr-defined]
            fn.restype = ctypes.c_int  # type: ignore[attr-defined]

    def fail(self, rc: int, what: str) -> RuntimeError:
        name = ctypes.c_char_p()
        self.error_name(rc, ctypes.byref(name))
        label = name.value.decode() if name.value else f"error {rc}"
        return RuntimeError(f"{what} failed: {label}")


_lib: _Lib | None = None
_lib_lock = threading.Lock()


def _driver() -> _Lib:
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                _lib = _Lib()
    return _lib


def _call(what: str, context: int, fn: Callable[..., int], *args: object) -> None:
    """fn(*args); in a thread with no current context (torch makes one current only
    where it ran CUDA work) `context` is made current and fn tried once more."""
    rc = fn(*args)
    if rc == _CUDA_ERROR_INVALID_CONTEXT and context and _driver().set_ctx(context) == 0:
        rc = fn(*args)
    if rc:
        raise _driver().fail(rc, what)


def stream_context(stream: int) -> int:
    """The context a (non-default) stream belongs to; 0 when the driver cannot say."""
    ctx = ctypes.c_void_p()
    return 0 if _driver().stream_ctx(stream, ctypes.byref(ctx)) else ctx.value or 0


class CurrentContext:
    """`with CurrentContext(ctx):` runs a block of driver calls with `ctx` current,
    pushing it only when the thread has another context (or none) current: a process
    driving several GPUs may call in with any device's context current."""

    __slots__ = ("_context", "_pushed")

    def __init__(self, context: int) -> None:
        self._context = context
        self._pushed = False

    def __enter__(self) -> None:
        lib = _driver()
        current = ctypes.c_void_p()
        lib.get_ctx(ctypes.byref(current))
        if current.value != self._context:
            _call("cuCtxPushCurrent", 0, lib.push_ctx, self._context)
            self._pushed = True

    def __exit__(self, *exc: object) -> None:
        if self._pushed:
            self._pushed = False
            _driver().pop_ctx(ctypes.byref(ctypes.c_void_p()))


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Queue a copy of `nbytes` from address `src` to `dst` (host or device) on `stream`
    (a created stream, not the legacy default one)."""
    lib = _driver()
    rc = lib.copy(dst, src, nbytes, stream)
    if rc == _CUDA_ERROR_INVALID_CONTEXT:
        _call("cuMemcpyAsync", stream_context(stream), lib.copy, dst, src, nbytes, stream)
    elif rc:
        raise lib.fail(rc, "cuMemcpyAsync")


class DriverEvent:
    """A CUDA event without timing, recorded and waited on through raw stream handles
    (any stream of its context, the default stream of a thread included)."""

    def __init__(self, stream: int) -> None:
        """Create the event in the context of `stream` (a created stream)."""
        lib = _driver()
        self.context = stream_context(stream)
        if not self.context:
            raise RuntimeError(f"CUDA stream {stream:#x} has no context")
        handle = ctypes.c_void_p()
        _call("cuEventCreate", self.context, lib.event_create, ctypes.byref(handle),
              _CU_EVENT_DISABLE_TIMING)  # fmt: skip
        self.handle = handle.value or 0
        weakref.finalize(self, lib.event_destroy, self.handle)

    def record(self, stream: int) -> None:
        """Mark the point `stream` has reached; stream 0 is the event's context's default
        stream, whichever context the thread has current."""
        if stream:
            _call("cuEventRecord", self.context, _driver().record, self.handle, stream)
            return
        with CurrentContext(self.context):
            _call("cuEventRecord", 0, _driver().record, self.handle, 0)

    def wait_on(self, stream: int) -> None:
        """Make `stream` wait (on the GPU) until the recorded point has passed."""
        _call("cuStreamWaitEvent", self.context, _driver().wait, stream, self.handle, 0)
