"""`kvflow demo`: runs a shared-prefix workload to completion and reports what it saw."""

from __future__ import annotations

import socket

import pytest

from kvflow.core.demo import app as demo

SMALL = ["--chats", "2", "--turns", "3", "--docs", "1", "--questions", "3", "--quiet"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_demo_runs_to_completion_with_the_metrics_endpoint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The demo serves every request, verifies retrieved blocks and reads its own endpoint."""
    port = _free_port()
    assert demo.main("demo", [*SMALL, "--prometheus-port", str(port)]) == 0
    out = capsys.readouterr().out
    assert f"metrics: http://127.0.0.1:{port}/metrics" in out
    summary = out[out.index("kvflow demo summary") :]
    assert "9 (chat 6, doc_qa 3)" in summary
    assert "0 failed" in summary and "bit-exact" in summary
    assert "event drops          0" in summary
    assert "stores 0, retrieves 0" in summary
    assert "L0 block lifetime" in summary


@pytest.mark.parametrize("fmt", ["sglang_mla", "vllm_cross_layer"])
def test_demo_runs_other_formats_without_the_endpoint(
    fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--format picks the engine's KV layout; --prometheus-port 0 turns the endpoint off."""
    assert demo.main("demo", [*SMALL, "--format", fmt, "--prometheus-port", "0"]) == 0
    out = capsys.readouterr().out
    assert f"{fmt} on cpu" in out and "retrieved blocks bit-exact" in out
    assert "the Prometheus endpoint is off" in out


def test_demo_refuses_a_busy_metrics_port(capsys: pytest.CaptureFixture[str]) -> None:
    """A port already in use is a clear error (exit 2), not a traceback."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert demo.main("demo", [*SMALL, "--prometheus-port", str(port)]) == 2
    assert f"--prometheus-port {port} on 127.0.0.1 is in use" in capsys.readouterr().err


def test_demo_rejects_invalid_settings(capsys: pytest.CaptureFixture[str]) -> None:
    """Invalid config values exit with status 2 and name the flag."""
    assert demo.main("demo", [*SMALL, "--chunk-size", "0"]) == 2
    assert "--chunk-size" in capsys.readouterr().err


def test_demo_reports_a_chunk_size_the_blocks_do_not_divide(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A chunk size that is not a multiple of the engine's block size is a clear error."""
    assert demo.main("demo", [*SMALL, "--chunk-size", "24", "--prometheus-port", "0"]) == 2
    assert "not a multiple of the block_size 16" in capsys.readouterr().err
