"""kvflow's one on-disk build cache (native extensions, kernel cubins) and its build lock.

Everything kvflow compiles at run time lives under one directory, named by one
variable: `$KVFLOW_CACHE_DIR`, else `$XDG_CACHE_HOME/kvflow`, else `~/.cache/kvflow`,
one subfolder per kind of build. A file lock makes concurrent first uses, threads or
processes, build each thing once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

ENV = "KVFLOW_CACHE_DIR"


def cache_dir(kind: str) -> Path:
    """The folder for builds of `kind` (`native`, `kernels`); not created here."""
    root = os.environ.get(ENV)
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvflow")
    return Path(root) / kind


def build_lock(target: Path) -> FileLock:
    """The lock (`<target>.lock`, its folder created) held while `target` is built."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{target}.lock")


def build_file(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built first unless it exists: under its lock, `build(partial)` writes a
    temporary file that is renamed into place, so no reader sees a partial one."""
    if target.exists():
        return target
    with build_lock(target):
        if target.exists():
            return target
        partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            build(partial)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, target)
    return target
