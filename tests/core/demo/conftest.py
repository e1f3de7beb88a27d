"""The demo keeps its event log in a fresh temporary directory unless told otherwise (its
summary names it); under test those directories go to the test's own tmp_path."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _temporary_files_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
