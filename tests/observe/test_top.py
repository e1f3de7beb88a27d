"""`kvflow top` under a real terminal (tmux) against a real server with traffic.

The view runs in a detached tmux session of its own socket; the test reads the
screen with `tmux capture-pane -p` until the rows carry real numbers (request
rates above zero while traffic runs, the server's own hit rate and L0 counts),
then presses q and checks the command exited 0.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvflow.core import KVFlowClient
from kvflow.core.observe.snapshot import Snapshot
from kvflow.core.observe.units import percent
from tests.observe.traffic import Workload, observed_server

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class Tmux:
    """A tmux server on a private socket running one command in a 140x60 window."""

    def __init__(self, command: str) -> None:
        self.socket = f"kvflow-top-{os.getpid()}"
        self.run("new-session", "-d", "-s", "top", "-x", "140", "-y", "60", command)

    def run(self, *args: str) -> str:
        # rich obeys COLUMNS/LINES over the terminal's size: the pane's size must win
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        out = subprocess.run(
            ["tmux", "-L", self.socket, *args],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
            cwd=ROOT,
            env=env,
        )
        return out.stdout

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "top")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


def _until(
    check: Callable[[], bool], what: str, screen: Callable[[], str], timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen in {timeout} s; screen:\n{screen()}")
        time.sleep(0.3)


def _row_rate(screen: str, op: str) -> float:
    """The req/s column of an op's row in the Requests table (0 when absent)."""
    match = re.search(rf"^\s*{op}\s+([0-9.e+]+)\s", screen, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.fixture
def busy_server(tmp_path: Path) -> Iterator[tuple[str, KVFlowClient, threading.Event]]:
    """A server whose client drives traffic in rounds until the event is set."""
    with observed_server(tmp_path) as server, KVFlowClient(server.endpoint) as client:
        workload = Workload(client)
        workload.drive()
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                workload.drive()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield server.endpoint, client, stop
        finally:
            stop.set()
            thread.join(timeout=30)


def test_top_shows_live_numbers_and_quits_on_q(
    busy_server: tuple[str, KVFlowClient, threading.Event], tmp_path: Path
) -> None:
    endpoint, client, stop = busy_server
    exit_file = tmp_path / "exit"
    command = f"{sys.executable} -m kvflow.cli top --endpoint {endpoint}; echo $? > {exit_file}"
    tmux = Tmux(command)
    try:
        # a cold start of `kvflow top` (torch's import) beside the suite's heavy tests
        _until(lambda: "kvflow top" in tmux.screen(), "the header", tmux.screen, timeout=90.0)
        # traffic runs: after a refresh or two, store and retrieve rates are above zero
        _until(
            lambda: (
                _row_rate(tmux.screen(), "store") > 0 and _row_rate(tmux.screen(), "retrieve") > 0
            ),
            "request rates",
            tmux.screen,
        )
        screen = tmux.screen()
        assert re.search(r"store\s+\S+\s+\S+\s+\S+\s+[0-9.e-]+ GB/s", screen), screen
        for text in (
            "dash-model",
            "Token hit rate",
            "l1",
            "disk",
            "In flight",
            "Event bus",
            "block lifetime",
            "idle before evict",
            "reuse gap",
            "█",
        ):
            assert text in screen, f"{text!r} missing:\n{screen}"
        # once traffic stops, the since-start hit rate and L0 counts are the server's own
        stop.set()
        time.sleep(2.0)  # the round in progress finishes
        snap = Snapshot.of(client.status())
        want_hit = percent(snap.hit_rate())
        want_count = str(snap.l0["lifetime"]["count"])
        _until(
            lambda: (
                want_hit in tmux.screen()
                and re.search(rf"block lifetime .* {want_count}\s*$", tmux.screen(), re.MULTILINE)
                is not None
            ),
            f"hit rate {want_hit} and {want_count} lifetimes",
            tmux.screen,
        )
        assert re.search(r"block lifetime\s+[0-9.]+ (us|ms|s)\s", tmux.screen()), tmux.screen()
        tmux.run("send-keys", "-t", "top", "q")
        _until(exit_file.exists, "the exit status", tmux.screen, timeout=10.0)
        assert exit_file.read_text().strip() == "0"
    finally:
        tmux.close()


def test_top_names_a_server_that_does_not_answer() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvflow.cli",
            "top",
            "--endpoint",
            "tcp://127.0.0.1:9",
            "--timeout-s",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 1
    assert "tcp://127.0.0.1:9 does not answer" in out.stderr
