"""Build and load kvflow's C extensions: compiled once with the system C compiler, cached on disk.

The stream-event extension (`STREAM`, module `_kvflow_stream`) is csrc/stream_lanes.c,
the launching thread's side of GPU stream events, linked with csrc/stream_wakers.c, the
native waker ring; other packages name theirs with an `Extension` of their own. Each
needs the Python headers of the running interpreter. The shared object is named by a
hash of its sources, the compiler, the flags and the interpreter's ABI, so an edited
source or another compiler builds a new one and a stale one is never loaded. It lives
in the `native` folder of kvflow's build cache (`kvflow.cuda.cache`), whose file lock
makes concurrent first uses (threads or processes) build it once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

from kvflow.cuda.cache import build_file, cache_dir

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "stream_wakers.c", CSRC / "stream_lanes.c")
HEADERS = (CSRC / "stream_wakers.h",)
MODULE = "_kvflow_stream"


class Extension(NamedTuple):
    """A C extension built at run time: its module name (its init function is
    `PyInit_<module>`), its C sources and the headers they include."""

    module: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()


STREAM = Extension(MODULE, SOURCES, HEADERS)
CFLAGS = ("-O2", "-std=c11", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror")
_load_lock = threading.Lock()


class NativeBuildError(RuntimeError):
    """The C extension could not be built (no compiler or headers, or the compiler failed)."""


def find_compiler() -> str | None:
    """The C compiler to use: $CC if set, else gcc, else cc; None when there is none."""
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and (path := shutil.which(name)):
            return path
    return None


def python_include() -> Path:
    """The running interpreter's C header directory (holding Python.h)."""
    return Path(sysconfig.get_paths()["include"])


def build_library(
    sources: Sequence[Path] | None = None,
    *,
    directory: Path | None = None,
    extension: Extension = STREAM,
) -> Path:
    """Compile `extension` (with `sources` in place of its own, if given) into a cached
    extension module, or find the cached one; return its path."""
    compiler = find_compiler()
    if compiler is None:
        raise NativeBuildError("no C compiler found (set $CC, or install gcc)")
    include = python_include()
    if not (include / "Python.h").exists():
        raise NativeBuildError(
            f"the Python headers are missing ({include}/Python.h): install your "
            "distribution's python3-dev (or python3-devel) package"
        )
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    sources = extension.sources if sources is None else tuple(sources)
    parts = [p.read_bytes() for p in (*sources, *extension.headers)]
    key = hashlib.sha256(
        b"\0".join(
            [*parts, compiler.encode(), str(include).encode(), suffix.encode()]
            + [f.encode() for f in CFLAGS]
        )
    )
    directory = cache_dir("native") if directory is None else directory
    target = directory / f"{extension.module}-{key.hexdigest()[:16]}{suffix}"

    def compile_to(partial: Path) -> None:
        cmd = [compiler, *CFLAGS, f"-I{include}", "-o", str(partial), *map(str, sources)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise NativeBuildError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")

    return build_file(target, compile_to)


@functools.cache
def _import(path: Path, name: str) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load_library(path: Path | None = None, *, extension: Extension = STREAM) -> ModuleType:
    """Build (first use) and import `extension`, or import its build at `path`.

    Raises NativeBuildError when it cannot be built.
    """
    with _load_lock:
        built = build_library(extension=extension) if path is None else path
        return _import(built, extension.module)
