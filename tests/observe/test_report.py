"""`kvflow report` against a real server with traffic: valid, non-trivial PNGs and a
summary that carries the server's own numbers."""

from __future__ import annotations

import contextlib
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
from matplotlib import image

from kvflow.core import KVFlowClient
from kvflow.core.observe.snapshot import Snapshot
from kvflow.core.observe.units import percent
from tests.observe.traffic import Workload, observed_server

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _check_png(path: Path) -> None:
    """PNG signature, an IHDR of a real figure's size with a valid CRC, and an image of
    several distinct colours (bars, lines, text), not a blank canvas."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 600, (path.name, width, height)
    (crc,) = struct.unpack(">I", data[29:33])
    assert crc == zlib.crc32(data[12:29]), f"{path.name}: IHDR CRC mismatch"
    pixels = image.imread(path)
    assert pixels.shape[:2] == (height, width)
    colours = np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) >= 8, f"{path.name} has {len(colours)} colours"
    not_white = (pixels[..., :3] < 0.95).any(axis=-1).mean()
    assert not_white > 0.02, f"{path.name}: {not_white:.3%} of pixels drawn"


class _Stderr:
    """A child's stderr, read as it comes on a thread (the report's progress line)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._chunks: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while chunk := self._stream.read(1):
            self._chunks.append(chunk)

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def samples(self) -> int:
        """The latest sample count the report printed (it prints from the second on)."""
        counts = re.findall(r"(\d+) samples", self.text)
        return int(counts[-1]) if counts else 0

    def close(self) -> str:
        self._thread.join(timeout=30)
        return self.text


def _received(client: KVFlowClient, caller: str) -> tuple[float, float]:
    """Bounds, on this machine's monotonic clock (the server's too), of when the server
    last received a request from `caller`."""
    before = time.monotonic()
    age = client.status()["server"]["clients"][caller]
    after = time.monotonic()
    return before - age - 0.001, after - age + 0.001  # ages are rounded to 1 ms


def _wait_for(what: str, check: Callable[[], Any], report: subprocess.Popen[str]) -> Any:
    """Poll `check` until it returns something true (returned); the report must run on."""
    deadline = time.monotonic() + 120
    while not (got := check()):
        assert report.poll() is None, f"the report exited waiting for {what}"
        assert time.monotonic() < deadline, f"waited 120 s for {what}"
        time.sleep(0.05)
    return got


@contextlib.contextmanager
def _recording(
    endpoint: str, out: Path, sample_s: float, *, sigint_ignored: bool = False
) -> Iterator[tuple[subprocess.Popen[str], _Stderr]]:
    """`kvflow report` recording `endpoint` into `out` until Ctrl-C (a bound of an hour),
    with its stderr read as it comes; killed at the end of the block if still running.
    `sigint_ignored`: started with SIGINT ignored, as a script's background job is."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if sigint_ignored else None
    try:
        report = subprocess.Popen(
            [sys.executable, *("-X", "faulthandler"),  # a report stuck after Ctrl-C: its stacks
             "-m", "kvflow.cli", "report", "--endpoint", endpoint, "--out", str(out),
             "--interval-s", "3600", "--sample-s", str(sample_s)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
    finally:
        if sigint_ignored:
            signal.signal(signal.SIGINT, previous)
    assert report.stderr is not None
    try:
        yield report, _Stderr(report.stderr)
    finally:
        if report.poll() is None:
            report.kill()
            report.wait()


def _interrupt(report: subprocess.Popen[str], progress: _Stderr, timeout_s: float) -> int:
    """Ctrl-C the report; its exit status. One still running `timeout_s` later fails the
    test with its threads' stacks (faulthandler on SIGABRT)."""
    report.send_signal(signal.SIGINT)
    try:
        return report.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        report.send_signal(signal.SIGABRT)
        report.wait(30)
        raise AssertionError(
            f"kvflow report did not end within {timeout_s:g} s of Ctrl-C:\n" + progress.close()
        ) from None


def test_ctrl_c_ends_a_report_started_with_sigint_ignored(tmp_path: Path) -> None:
    """A report started as a script's background job inherits SIGINT ignored (and so did
    every report of a test suite run in the background, which then never ended): SIGINT
    still ends its recording, and it writes what it sampled."""
    out = tmp_path / "report"
    with (
        observed_server(tmp_path) as server,
        _recording(server.endpoint, out, 0.1, sigint_ignored=True) as (report, progress),
    ):
        _wait_for("two samples", lambda: progress.samples() >= 2, report)
        returncode = _interrupt(report, progress, timeout_s=60)
    assert returncode == 0, progress.close()
    assert sorted(p.name for p in out.iterdir()) == [
        "l0_lifecycle.png", "summary.md", "timeline.png"
    ]  # fmt: skip


def test_report_writes_plots_and_a_summary_of_measured_numbers(tmp_path: Path) -> None:
    """The recording spans the traffic: it starts before the traffic and is ended (Ctrl-C)
    once the server counted all of it and the report sampled that, so the summary's
    since-start numbers are the server's final ones whatever the machine's speed."""
    out = tmp_path / "report"
    with observed_server(tmp_path) as server, KVFlowClient(server.endpoint) as client:
        workload = Workload(client)
        workload.drive()
        known = set(client.status()["server"]["clients"])
        with _recording(server.endpoint, out, 0.5) as (report, progress):
            # the report's first status request is its first sample: traffic starts after it
            new = lambda: set(client.status()["server"]["clients"]) - known  # noqa: E731
            (caller,) = _wait_for("the report's first status request", new, report)
            for _ in range(3):
                workload.drive()

            # the server's event pipeline runs behind its requests: wait until its totals
            # hold every block report of the traffic and every lifetime those ended
            def counted() -> bool:
                snap = Snapshot.of(client.status())
                lifetimes = (snap.l0.get("lifetime") or {}).get("count", 0)
                return (
                    snap.totals["l0.allocation_records"] == workload.allocation_records
                    and lifetimes == workload.block_lifetimes
                )

            _wait_for("the server to count the traffic's events", counted, report)
            settled = time.monotonic()

            def received_after(t: float) -> float | None:
                """When the report's latest request came (an upper bound), if surely after t."""
                earliest, latest = _received(client, caller)
                return latest if earliest > t else None

            # a request received after that, then a later one: the first is a whole
            # sample of the settled server (a sample under way at Ctrl-C is dropped)
            first = _wait_for("a sample after the traffic", lambda: received_after(settled), report)
            _wait_for("the next sample", lambda: received_after(first), report)
            _wait_for("six samples", lambda: progress.samples() >= 6, report)
            returncode = _interrupt(report, progress, timeout_s=120)
        stderr = progress.close()
        assert returncode == 0, stderr
        final = Snapshot.of(client.status())
    assert final.l0["lifetime"]["count"] == workload.block_lifetimes
    files = sorted(p.name for p in out.iterdir())
    assert files == ["l0_lifecycle.png", "summary.md", "timeline.png"]
    _check_png(out / "l0_lifecycle.png")
    _check_png(out / "timeline.png")

    summary = (out / "summary.md").read_text()
    assert f"`{server.endpoint}`" in summary
    samples = int(re.search(r"(\d+) samples over", summary).group(1))  # type: ignore[union-attr]
    assert samples >= 6
    stores = re.search(r"^\| store \| (\d+) \| (\d+) \|", summary, re.MULTILINE)
    assert stores is not None, summary
    assert 0 < int(stores.group(1)) <= final.totals["store.requests"]
    # the traffic round ended inside the interval: totals since start are the server's own
    assert f"since start: {percent(final.hit_rate())}" in summary, summary
    lifetime = final.l0["lifetime"]["count"]
    assert re.search(
        rf"^\| block lifetime \| {lifetime} \| [0-9.]+ (us|ms|s) \|", summary, re.MULTILINE
    ), summary
    assert "![L0 lifecycle](l0_lifecycle.png)" in summary


def test_report_names_a_server_that_does_not_answer(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvflow.cli",
            "report",
            "--endpoint",
            "tcp://127.0.0.1:9",
            "--out",
            str(tmp_path),
            "--timeout-s",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 1
    assert "does not answer" in result.stderr
    assert not list(tmp_path.iterdir())
