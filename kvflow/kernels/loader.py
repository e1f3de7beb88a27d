"""PyCUDA loader: compile the package's .cu files on first use, in torch's primary context.

Compiled cubins are cached on disk by PyCUDA, in the `kernels` folder of kvflow's build
cache (`kvflow.cuda.cache`: ``$KVFLOW_CACHE_DIR/kernels`` or its default), building
under a file lock so concurrent processes compile once, and in process per (context,
source, kernel, options). pycuda is imported lazily.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvflow.cuda.cache import build_lock, cache_dir
from kvflow.cuda.context import primary_context, pycuda_context

CSRC_DIR = Path(__file__).parent / "csrc"
DEFAULT_OPTIONS: tuple[str, ...] = ("-std=c++17",)

_lock = threading.Lock()
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


def get_function(
    device_index: int, source: str, name: str, options: Sequence[str] = DEFAULT_OPTIONS
) -> Any:
    """The compiled kernel ``name`` from ``csrc/<source>`` (or from ``source`` when it is
    an absolute path, as a benchmark's own kernels are) for this device's architecture."""
    ctx = primary_context(device_index)
    key = (ctx, source, name, tuple(options))
    function = _functions.get(key)
    if function is None:
        with _lock:
            module = _module(device_index, ctx, source, tuple(options))
            function = _functions.setdefault(key, module.get_function(name))
    return function


def _module(device_index: int, ctx_handle: int, source: str, options: tuple[str, ...]) -> Any:
    """Compile (or load from the disk cache) one .cu file once per context and options."""
    key = (ctx_handle, source, options)
    module = _modules.get(key)
    if module is None:
        from pycuda.compiler import SourceModule

        major, minor = torch.cuda.get_device_capability(device_index)
        cache = cache_dir("kernels")
        text = (CSRC_DIR / source).read_text()
        with pycuda_context(device_index), build_lock(cache / "build"):
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
