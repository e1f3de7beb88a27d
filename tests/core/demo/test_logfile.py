"""The demo's log file: every line the engine logs while the demo runs lands in it, from
the first one it logs while it is being built."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvflow.core.demo.logfile import LogFile
from kvflow.subscribers.logs import configure_logging


def test_lines_logged_while_the_engine_is_built_go_to_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine makes its stderr handler and may log at once (L1 pinning ahead on a GPU
    machine) before the demo can capture it: those lines go to the file too, and after the
    run the handler writes to stderr again."""
    log = LogFile(tmp_path / "demo.log")
    demo_log = logging.getLogger("kvflow.test.demo")
    with log.building():
        setup = configure_logging("info", "json")  # as the engine's constructor does
        demo_log.info("logged while built")
    try:
        log.capture()
        demo_log.info("logged while running")
        log.release()
        demo_log.info("logged after the run")
    finally:
        setup.close()
    lines = (tmp_path / "demo.log").read_text().splitlines()
    assert ['"logged while built"' in lines[0], '"logged while running"' in lines[1]] == [True] * 2
    assert len(lines) == 2
    err = capsys.readouterr().err
    assert "logged after the run" in err and "while" not in err
    assert log.summary() == f"{tmp_path / 'demo.log'} (2 lines, 0 warnings)"
