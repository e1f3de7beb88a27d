"""tests.support.launcher: a forked `kvflow` process behaves as the command would for the
parts tests read (exit codes, signals, streams, environment, working directory)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from kvflow.core import KVFlowClient
from tests.support import launcher
from tests.support.launcher import LaunchedProcess, kvflow_process


def test_exit_codes_and_streams_come_back_as_the_command_gives_them() -> None:
    """An unknown subcommand exits 2 with its message on stderr; `--help` exits 0 with the
    usage on stdout."""
    bad = LaunchedProcess(["nosuch"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert bad.wait(60) == 2
    assert bad.stderr is not None and "unknown command 'nosuch'" in bad.stderr.read()
    usage = LaunchedProcess(["--help"], stdout=subprocess.PIPE, text=True)
    assert usage.wait(60) == 0
    assert usage.stdout is not None and "usage: kvflow <command>" in usage.stdout.read()


def test_an_argparse_error_exits_2_through_systemexit(tmp_path: Path) -> None:
    """A refused flag ends the process with argparse's exit code, output to a file."""
    log = tmp_path / "out.txt"
    with log.open("wb") as out:
        proc = LaunchedProcess(
            ["server", "--l1-size-gb", "nan"], stdout=out, stderr=subprocess.STDOUT
        )
    assert proc.wait(60) == 2
    assert "--l1-size-gb" in log.read_text()


def test_a_server_is_signalled_and_its_environment_and_directory_are_the_callers(
    tmp_path: Path,
) -> None:
    """A running server sees the environment and working directory it was given; SIGTERM
    stops it cleanly (0, "stopped" logged), SIGKILL shows as -9; poll and wait agree."""
    env = {**os.environ, "KVFLOW_CHUNK_SIZE": "128"}  # KVFLOW_<FLAG>: the server's config
    args = ["server", "--port", "0", "--prometheus-port", "0", "--log-format", "console"]
    proc = LaunchedProcess(
        [*args, "--event-log", "relative-log"], stderr=subprocess.PIPE, text=True, env=env,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                break
        assert proc.poll() is None
        assert (tmp_path / "relative-log").is_dir(), "".join(lines)
        assert os.readlink(f"/proc/{proc.pid}/cwd") == str(tmp_path)
        endpoint = re.search(r"listening on (tcp://\S+)", lines[-1])
        assert endpoint, lines[-1]
        with KVFlowClient(endpoint.group(1), timeout_s=20) as client:
            assert client.status()["config"]["chunk_size"] == 128
    finally:  # a failed check must not leave the server running
        proc.terminate()
    assert proc.wait(60) == 0
    assert "kvflow server stopped" in proc.stderr.read()
    killed = LaunchedProcess(args, stderr=subprocess.DEVNULL)
    with pytest.raises(subprocess.TimeoutExpired):
        killed.wait(0.2)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(60) == -signal.SIGKILL
    assert killed.poll() == -signal.SIGKILL
    killed.kill()  # a no-op once it has exited


def test_kvflow_test_exec_runs_the_real_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVFLOW_TEST_EXEC=1 gives a real `python -m kvflow.cli` process instead."""
    monkeypatch.setenv("KVFLOW_TEST_EXEC", "1")
    proc = kvflow_process(["--help"], stdout=subprocess.PIPE, text=True)
    assert isinstance(proc, subprocess.Popen)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "usage: kvflow" in out


def test_the_launcher_starts_from_any_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test that changed directory before its first server still gets one: the launcher
    runs from the checkout's root, its children from the directory asked for."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launcher, "_instance", None)  # a fresh launcher, started from here
    proc = LaunchedProcess(["--help"], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "usage: kvflow" in out
