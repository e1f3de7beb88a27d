"""`kvflow report` against a real server with traffic: valid, non-trivial PNGs and a
summary that carries the server's own numbers."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

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


def test_report_writes_plots_and_a_summary_of_measured_numbers(tmp_path: Path) -> None:
    out = tmp_path / "report"
    with observed_server(tmp_path) as server, KVFlowClient(server.endpoint) as client:
        workload = Workload(client)
        workload.drive()
        known = set(client.status()["server"]["clients"])
        report = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvflow.cli",
                "report",
                "--endpoint",
                server.endpoint,
                "--out",
                str(out),
                "--interval-s",
                "8",
                "--sample-s",
                "0.5",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        # the report's first status request is its first sample: traffic starts after it
        # (a slow start-up on a busy machine would otherwise leave the traffic outside)
        deadline = time.monotonic() + 60
        while set(client.status()["server"]["clients"]) <= known:
            assert report.poll() is None, report.communicate()
            assert time.monotonic() < deadline, "the report never asked the server for status"
            time.sleep(0.05)

        # three rounds (a few seconds) end well inside the report's interval
        def three_rounds() -> None:
            for _ in range(3):
                workload.drive()

        thread = threading.Thread(target=three_rounds)
        thread.start()
        _, stderr = report.communicate(timeout=120)
        assert not thread.is_alive(), "the traffic outlasted the recording (machine too busy?)"
        thread.join()
        assert report.returncode == 0, stderr
        final = Snapshot.of(client.status())
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
