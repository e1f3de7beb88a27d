"""kvflow's one CUDA layer, below both `kvflow.events` and `kvflow.kernels`: the single
ctypes binding of libcuda (`driver`: contexts, streams, events, async copies, error
names), the helper that makes a device's primary context current around CUDA calls
(`context`), the per-op copy and event calls of a transfer pipeline (`enqueue`), and
the one on-disk cache, under `$KVFLOW_CACHE_DIR`, where run-time builds live with their
file lock (`cache`). It exists so that the GPU stream stamps and the transfer kernels
share one set of driver bindings, one way of handling contexts and one cache instead of
keeping their own; it imports nothing else of kvflow, and importing it loads neither
libcuda nor PyCUDA.
"""

from kvflow.cuda.cache import build_file, build_lock, cache_dir
from kvflow.cuda.context import CurrentContext, primary_context, pycuda_context, stream_context
from kvflow.cuda.driver import Driver, cuda_driver, libcuda
from kvflow.cuda.enqueue import MAX_PITCH, DriverEvent, copy_2d_async, copy_async

__all__ = [
    "MAX_PITCH",
    "CurrentContext",
    "Driver",
    "DriverEvent",
    "build_file",
    "build_lock",
    "cache_dir",
    "copy_2d_async",
    "copy_async",
    "cuda_driver",
    "libcuda",
    "primary_context",
    "pycuda_context",
    "stream_context",
]
