"""PyCUDA loader: compile the package's .cu files on first use, share torch's primary context.

Compiled cubins are cached on disk by PyCUDA (under ``KVFLOW_KERNEL_CACHE`` or
``~/.cache/kvflow/kernels``, building under a file lock so concurrent processes compile
once) and in process per (context, source, kernel, options). pycuda is imported lazily.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

CSRC_DIR = Path(__file__).parent / "csrc"
DEFAULT_OPTIONS: tuple[str, ...] = ("-std=c++17",)

_lock = threading.RLock()
_contexts: dict[int, Any] = {}
_modules: dict[tuple[int, str, tuple[str, ...]], Any] = {}
_functions: dict[tuple[int, str, str, tuple[str, ...]], Any] = {}


@functools.cache
def pycuda_importable() -> bool:
    """True if ``pycuda.driver`` imports (its absence is never an error at kvflow import)."""
    try:
        import pycuda.driver  # noqa: F401
    except Exception:
        return False
    return True


def cuda_available() -> bool:
    """Torch sees a CUDA device and pycuda imports."""
    return torch.cuda.is_available() and pycuda_importable()


def kernel_cache_dir() -> Path:
    """Directory for PyCUDA's cubin cache and the build lock."""
    env = os.environ.get("KVFLOW_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvflow" / "kernels"


def primary_context(device_index: int) -> Any:
    """The device's primary context (torch's), retained by PyCUDA after torch initialised it."""
    with _lock:
        ctx = _contexts.get(device_index)
        if ctx is None:
            torch.cuda.synchronize(device_index)  # torch creates the primary context first
            import pycuda.driver as drv

            drv.init()
            ctx = drv.Device(device_index).retain_primary_context()
            _contexts[device_index] = ctx
        return ctx


@contextmanager
def active_context(device_index: int) -> Iterator[Any]:
    """Make the device's primary context current in PyCUDA for the duration."""
    import pycuda.driver as drv

    ctx = primary_context(device_index)
    ctx.push()
    try:
        yield ctx
    finally:
        drv.Context.pop()


def get_function(
    device_index: int, source: str, name: str, options: Sequence[str] = DEFAULT_OPTIONS
) -> Any:
    """The compiled kernel ``name`` from ``csrc/<source>`` for this device's architecture."""
    ctx = primary_context(device_index)
    key = (int(ctx.handle), source, name, tuple(options))
    function = _functions.get(key)
    if function is None:
        with _lock:
            module = _module(device_index, int(ctx.handle), source, tuple(options))
            function = _functions.setdefault(key, module.get_function(name))
    return function


def _module(device_index: int, ctx_handle: int, source: str, options: tuple[str, ...]) -> Any:
    """Compile (or load from the disk cache) one .cu file once per context and options."""
    key = (ctx_handle, source, options)
    module = _modules.get(key)
    if module is None:
        from pycuda.compiler import SourceModule

        major, minor = torch.cuda.get_device_capability(device_index)
        cache = kernel_cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        text = (CSRC_DIR / source).read_text()
        with active_context(device_index), FileLock(str(cache / "build.lock")):
            module = SourceModule(
                text,
                arch=f"sm_{major}{minor}",
                no_extern_c=True,
                options=list(options),
                cache_dir=str(cache),
                include_dirs=[str(CSRC_DIR)],
            )
        _modules[key] = module
    return module
