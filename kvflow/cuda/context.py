"""Making a device's primary context (the one torch uses) current around CUDA calls.

Driver calls need only the driver's current context: `CurrentContext` sets it through
the ctypes binding, and only when the thread has another one (or none) current, for
a few microseconds per block. PyCUDA also keeps a context stack of its own and creates
streams, modules and IPC handles only when that stack holds one: `pycuda_context`
pushes the same primary context through PyCUDA for such calls.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvflow.cuda.driver import libcuda

_lock = threading.Lock()
_primary: dict[int, int] = {}
_pycuda: dict[int, Any] = {}


def primary_context(device_index: int) -> int:
    """The handle of the device's primary context, retained once per process."""
    ctx = _primary.get(device_index)
    if ctx is None:
        with _lock:
            ctx = _primary.get(device_index)
            if ctx is None:
                ctx = _primary[device_index] = libcuda().retain_primary_context(device_index)
    return ctx


def stream_context(stream: int) -> int:
    """The context a (non-default) stream belongs to; 0 when the driver cannot say."""
    return libcuda().stream_context(stream)


class CurrentContext:
    """`with CurrentContext(ctx):` runs a block of driver calls with `ctx` current,
    pushing it only when the thread has another context (or none) current: a process
    driving several GPUs may call in with any device's context current."""

    __slots__ = ("_context", "_pushed")

    def __init__(self, context: int) -> None:
        self._context = context
        self._pushed = False

    def __enter__(self) -> None:
        lib = libcuda()
        if lib.current_context() != self._context:
            lib.push_context(self._context)
            self._pushed = True

    def __exit__(self, *exc: object) -> None:
        if self._pushed:
            self._pushed = False
            libcuda().cuCtxPopCurrent(ctypes.byref(ctypes.c_void_p()))


@contextmanager
def pycuda_context(device_index: int) -> Iterator[Any]:
    """The device's primary context current for PyCUDA (its stack and the driver's) for
    the block; yields PyCUDA's `Context`. PyCUDA is imported here, on first use."""
    import pycuda.driver as drv

    ctx = _pycuda.get(device_index)
    if ctx is None:
        with _lock:
            ctx = _pycuda.get(device_index)
            if ctx is None:
                drv.init()
                ctx = _pycuda[device_index] = drv.Device(device_index).retain_primary_context()
    ctx.push()
    try:
        yield ctx
    finally:
        drv.Context.pop()
