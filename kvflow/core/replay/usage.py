"""The bad-argument error and parser `kvflow replay` and `kvflow whatif` share."""

from __future__ import annotations

import argparse
from typing import NoReturn


class UsageError(Exception):
    """A bad argument: one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)
