"""The one ctypes binding of libcuda: every driver entry point kvflow calls, typed once.

Calls keep the GIL (`ctypes.PyDLL`): each only enqueues work or reads driver state and
returns within microseconds, so releasing and retaking the GIL around it would cost
more than the call (docs/KERNELS.md, "Driver calls"). Handles are plain ints.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any

LIBCUDA = "libcuda.so.1"
CU_EVENT_DEFAULT = 0
CU_EVENT_DISABLE_TIMING = 2
CU_STREAM_NON_BLOCKING = 1  # no implicit synchronisation with the legacy default stream
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_NOT_READY = 600
CU_LAUNCH_ATTRIBUTE_PRIORITY = 8  # a stream attribute too (CU_STREAM_ATTRIBUTE_PRIORITY)
CU_MEMORYTYPE_UNIFIED = 4  # an address the driver resolves itself (UVA: host or device)

_vp = ctypes.c_void_p
_vpp = ctypes.POINTER(ctypes.c_void_p)


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D (v2): a copy of `Height` rows of `WidthInBytes`, each side with its
    own pitch (bytes from one row's start to the next)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


def _address(fn: Any) -> int:
    return ctypes.cast(fn, _vp).value or 0


class Driver:
    """libcuda's entry points as typed ctypes functions (`cu*` attributes, returning a
    CUresult), the addresses the stream-stamp C extension calls through, and the
    checked calls built on them (RuntimeError naming the call and the CUDA error)."""

    def __init__(self, path: str = LIBCUDA) -> None:
        lib = ctypes.PyDLL(path)

        def typed(name: str, *argtypes: Any) -> Callable[..., int]:
            fn = getattr(lib, name)
            fn.argtypes = list(argtypes)
            fn.restype = ctypes.c_int
            return fn

        u64, uint, cint = ctypes.c_uint64, ctypes.c_uint, ctypes.c_int
        self.cuInit = typed("cuInit", uint)
        self.cuDeviceGet = typed("cuDeviceGet", ctypes.POINTER(cint), cint)
        self.cuDevicePrimaryCtxRetain = typed("cuDevicePrimaryCtxRetain", _vpp, cint)
        self.cuCtxGetCurrent = typed("cuCtxGetCurrent", _vpp)
        self.cuCtxSetCurrent = typed("cuCtxSetCurrent", _vp)
        self.cuCtxPushCurrent = typed("cuCtxPushCurrent_v2", _vp)
        self.cuCtxPopCurrent = typed("cuCtxPopCurrent_v2", _vpp)
        self.cuStreamCreate = typed("cuStreamCreate", _vpp, uint)
        self.cuStreamDestroy = typed("cuStreamDestroy_v2", _vp)
        self.cuStreamGetCtx = typed("cuStreamGetCtx", _vp, _vpp)
        self.cuStreamWaitEvent = typed("cuStreamWaitEvent", _vp, _vp, uint)
        self.cuEventCreate = typed("cuEventCreate", _vpp, uint)
        self.cuEventDestroy = typed("cuEventDestroy_v2", _vp)
        self.cuEventRecord = typed("cuEventRecord", _vp, _vp)
        self.cuEventQuery = typed("cuEventQuery", _vp)
        self.cuEventElapsedTime = typed(
            "cuEventElapsedTime", ctypes.POINTER(ctypes.c_float), _vp, _vp
        )
        self.cuMemcpyAsync = typed("cuMemcpyAsync", u64, u64, ctypes.c_size_t, _vp)
        self.cuMemcpy2DAsync = typed("cuMemcpy2DAsync_v2", ctypes.POINTER(Memcpy2D), _vp)
        self.cuCtxGetStreamPriorityRange = typed(
            "cuCtxGetStreamPriorityRange", ctypes.POINTER(cint), ctypes.POINTER(cint)
        )
        self.cuStreamSetAttribute = typed("cuStreamSetAttribute", _vp, cint, _vp)
        self.cuStreamGetPriority = typed("cuStreamGetPriority", _vp, ctypes.POINTER(cint))
        self.cuGetErrorName = typed("cuGetErrorName", cint, ctypes.POINTER(ctypes.c_char_p))
        #: cuEventRecord(event, stream) -> CUresult (the stream stamper's name for it)
        self.record = self.cuEventRecord
        #: what the stream-stamp C extension calls directly, by address
        self.launch_ptr = _address(lib.cuLaunchHostFunc)
        self.wait_ptr = _address(self.cuStreamWaitEvent)
        self.record_ptr = _address(self.cuEventRecord)
        self.push_ptr = _address(self.cuCtxPushCurrent)
        self.pop_ptr = _address(self.cuCtxPopCurrent)

    def error_name(self, code: int) -> str:
        """`CUDA_ERROR_INVALID_VALUE (1)` for a CUresult, or `CUresult <code>` if unknown."""
        name = ctypes.c_char_p()
        if self.cuGetErrorName(code, ctypes.byref(name)) or not name.value:
            return f"CUresult {code}"
        return f"{name.value.decode()} ({code})"

    def fail(self, code: int, what: str) -> RuntimeError:
        """The error to raise when call `what` returned `code`."""
        return RuntimeError(f"{what} failed: {self.error_name(code)}")

    def _check(self, code: int, what: str) -> None:
        if code:
            raise self.fail(code, what)

    def retain_primary_context(self, device_index: int) -> int:
        """Retain device `device_index`'s primary context (torch's); return its handle."""
        self._check(self.cuInit(0), "cuInit")
        device, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._check(self.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
        self._check(
            self.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device.value),
            "cuDevicePrimaryCtxRetain",
        )
        return ctx.value or 0

    def stream_context(self, stream: int) -> int:
        """The context `stream` belongs to; 0 if it is no live stream."""
        ctx = ctypes.c_void_p()
        return 0 if self.cuStreamGetCtx(stream, ctypes.byref(ctx)) else ctx.value or 0

    def current_context(self) -> int:
        """This thread's current context; 0 if none."""
        ctx = ctypes.c_void_p()
        return 0 if self.cuCtxGetCurrent(ctypes.byref(ctx)) else ctx.value or 0

    def push_context(self, ctx: int) -> None:
        self._check(self.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")

    def pop_context(self) -> None:
        self._check(self.cuCtxPopCurrent(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")

    def create_event(self, flags: int = CU_EVENT_DEFAULT) -> int:
        """An event in the current context (timing unless `flags` disable it)."""
        event = ctypes.c_void_p()
        self._check(self.cuEventCreate(ctypes.byref(event), flags), "cuEventCreate")
        return event.value or 0

    def create_stream(self, flags: int = CU_STREAM_NON_BLOCKING) -> int:
        """A stream in the current context (non-blocking unless `flags` say otherwise)."""
        stream = ctypes.c_void_p()
        self._check(self.cuStreamCreate(ctypes.byref(stream), flags), "cuStreamCreate")
        return stream.value or 0

    def raise_priority(self, stream: int) -> int:
        """Give `stream` the greatest priority its context allows (that context current):
        the GPU then starts its kernels' blocks before those of streams of normal priority
        as multiprocessors free up. Returns the priority the stream now has."""
        least, greatest = ctypes.c_int(), ctypes.c_int()
        self._check(
            self.cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
            "cuCtxGetStreamPriorityRange",
        )
        value = ctypes.create_string_buffer(64)  # CUlaunchAttributeValue: a 64-byte union
        ctypes.c_int.from_buffer(value).value = greatest.value
        self._check(
            self.cuStreamSetAttribute(stream, CU_LAUNCH_ATTRIBUTE_PRIORITY, value),
            "cuStreamSetAttribute",
        )
        got = ctypes.c_int()
        self._check(self.cuStreamGetPriority(stream, ctypes.byref(got)), "cuStreamGetPriority")
        return got.value

    def query(self, event: int) -> bool:
        """True when `event`'s last record has completed."""
        code = self.cuEventQuery(event)
        if code == CUDA_ERROR_NOT_READY:
            return False
        self._check(code, "cuEventQuery")
        return True

    def elapsed_ns(self, start: int, end: int) -> int | None:
        """GPU time from completed timing event `start` to `end` (may be negative); None
        while `end` has not completed."""
        ms = ctypes.c_float()
        code = self.cuEventElapsedTime(ctypes.byref(ms), start, end)
        if code == CUDA_ERROR_NOT_READY:
            return None
        self._check(code, "cuEventElapsedTime")
        return round(ms.value * 1e6)

    def destroy_event(self, event: int) -> None:
        self.cuEventDestroy(event)

    def destroy_stream(self, stream: int) -> None:
        self.cuStreamDestroy(stream)


_driver: Driver | None = None
_driver_lock = threading.Lock()


def libcuda() -> Driver:
    """The binding, loaded on first use; OSError when libcuda is not installed."""
    global _driver
    if _driver is None:
        with _driver_lock:
            if _driver is None:
                _driver = Driver()
    return _driver


@functools.cache
def cuda_driver() -> Driver | None:
    """The binding when libcuda loads and sees at least one device; None otherwise (cached).

    The probe goes through a plain CDLL so that a first cuInit, which may take long,
    releases the GIL.
    """
    try:
        probe = ctypes.CDLL(LIBCUDA)
    except OSError:
        return None
    count = ctypes.c_int(0)
    if probe.cuInit(0) != 0 or probe.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None
    return libcuda()
