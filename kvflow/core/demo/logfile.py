"""The demo's log lines go to a file, so no warning breaks its progress lines or table.

The engine's logging writes to stderr by default (a root handler on `sys.stderr`); while
the demo runs, every such handler writes to one file instead, which the summary names.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


class LogFile:
    """Captures the root logger's stderr handlers into `path` between `capture()` (once
    the engine built its handler, inside `building()`) and `release()`; `summary()`
    describes what came."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._out: IO[str] | None = None
        self._moved: list[logging.StreamHandler[Any]] = []

    def _file(self) -> IO[str]:
        if self._out is None:
            self._out = self.path.open("a", encoding="utf-8")
        return self._out

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """While the engine is built, stderr is the file: a handler made then writes there
        from its first line (the engine logs before it returns, e.g. L1 pinning ahead on a
        GPU machine); `capture()` afterwards hands it stderr back at `release()`."""
        with contextlib.redirect_stderr(self._file()):
            yield

    def capture(self) -> None:
        """Point every root handler that writes to stderr at the file."""
        out = self._file()
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, out):
                handler.setStream(out)
                self._moved.append(handler)

    def release(self) -> None:
        """Give the handlers stderr back (lines logged after the run still show) and
        close the file (idempotent)."""
        for handler in self._moved:
            handler.flush()
            handler.setStream(sys.stderr)
        self._moved.clear()
        if self._out is not None:
            self._out.close()
            self._out = None

    def summary(self) -> str:
        """The file's path and its lines, the warnings among them counted."""
        text = self.path.read_text(errors="replace") if self.path.exists() else ""
        lines = text.splitlines()
        warnings = sum(1 for line in lines if '"level": "warning"' in line)
        return f"{self.path} ({len(lines)} lines, {warnings} warnings)"
