"""Build and load the stream-waker C helper: compiled once with the system C compiler, cached on disk.

The shared object is named by a hash of its source, compiler and flags, so an
edited source or another compiler builds a new one and a stale one is never
loaded; a file lock makes concurrent first uses (threads or processes) build it once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from filelock import FileLock

SOURCE = Path(__file__).with_name("csrc") / "stream_wakers.c"
CFLAGS = ("-O2", "-std=c11", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror")
_load_lock = threading.Lock()


class NativeBuildError(RuntimeError):
    """The C helper could not be built (no compiler, or the compiler failed)."""


def cache_dir() -> Path:
    """Where built helpers live: $KVFLOW_CACHE_DIR, else $XDG_CACHE_HOME/kvflow, else ~/.cache/kvflow."""
    root = os.environ.get("KVFLOW_CACHE_DIR")
    if root:
        return Path(root) / "native"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kvflow" / "native"


def find_compiler() -> str | None:
    """The C compiler to use: $CC if set, else gcc, else cc; None when there is none."""
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and (path := shutil.which(name)):
            return path
    return None


def build_library(source: Path = SOURCE, *, directory: Path | None = None) -> Path:
    """Compile `source` into a cached shared object (or find the cached one) and return its path."""
    compiler = find_compiler()
    if compiler is None:
        raise NativeBuildError("no C compiler found (set $CC, or install gcc)")
    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, compiler.encode(), *map(str.encode, CFLAGS)]))
    directory = cache_dir() if directory is None else directory
    target = directory / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):
        if target.exists():
            return target
        partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        cmd = [compiler, *CFLAGS, "-o", str(partial), str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise NativeBuildError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(partial, target)
    return target


@functools.cache
def _open(path: Path) -> ctypes.PyDLL:
    # PyDLL keeps the GIL across calls: every entry point is short and never waits on the
    # GPU, and no call hands the GIL to another thread (see docs/STREAM_EVENTS.md).
    lib = ctypes.PyDLL(str(path))
    vp, u32 = ctypes.c_void_p, ctypes.c_uint32
    lib.kvf_ring_create.argtypes = [u32, ctypes.c_int, vp, vp]
    lib.kvf_ring_create.restype = vp
    lib.kvf_ring_arm.argtypes = [vp, u32, vp, vp]
    lib.kvf_ring_arm.restype = ctypes.c_int
    lib.kvf_ring_drain.argtypes = [vp, ctypes.POINTER(u32), u32]
    lib.kvf_ring_drain.restype = u32
    lib.kvf_ring_wake.argtypes = [vp]
    lib.kvf_ring_wake.restype = None
    lib.kvf_ring_release.argtypes = [vp]
    lib.kvf_ring_release.restype = None
    lib.kvf_live_ring_count.argtypes = []
    lib.kvf_live_ring_count.restype = ctypes.c_int64
    return lib


def load_library() -> ctypes.PyDLL:
    """Build (first use) and load the helper, with argument types set. Raises NativeBuildError."""
    with _load_lock:
        return _open(build_library())
