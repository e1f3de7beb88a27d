"""The disk tier under faults: a full disk, damaged or vanished files, a path that
becomes unwritable, a writer killed mid-write, two tiers on one directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any, TypeVar

import pytest
import torch

from kvflow.core.tiers import diskfile
from kvflow.core.tiers.base import ObjectKey
from kvflow.core.tiers.disk import DiskTier
from kvflow.core.tiers.sharding import pick_path
from tests.core.tiers import disk_writer

T = TypeVar("T")
KIB = 1024
NBYTES = 6 * KIB  # payload bytes of the objects damaged
WRITER = Path(disk_writer.__file__)


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "little"), "org/model", 1, 0, "salt")


def payload(i: int, nbytes: int = NBYTES) -> torch.Tensor:
    return disk_writer.object_bytes(i, nbytes)


def answer(future: Future[T]) -> T:
    return future.result(timeout=10)


@pytest.fixture
def tiers() -> Iterator[list[DiskTier]]:
    """Tiers a test makes, closed at its end."""
    made: list[DiskTier] = []
    yield made
    for tier in made:
        tier.close()


# -- disk full -------------------------------------------------------------------------


def _fill_small_tmpfs(where: Path) -> dict[str, Any]:
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"mount is not permitted here ({mounted.stderr.decode().strip()}): "
            "the file-size-limit case covers a full disk"
        )
    try:
        return disk_writer.fill(str(where))
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def _fill_under_a_file_size_limit(where: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(WRITER), "fill", str(where), str(100 * KIB)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


@pytest.mark.parametrize("fill", [_fill_small_tmpfs, _fill_under_a_file_size_limit])
def test_a_full_disk_is_a_counted_store_failure(
    tmp_path: Path, fill: Callable[[Path], dict[str, Any]]
) -> None:
    """Writes the disk refuses (ENOSPC on a 256 KiB tmpfs, EFBIG past RLIMIT_FSIZE) are
    failed stores, counted, with no temporary file left; what was stored still loads
    bit-exact and the tier stores again once room is made."""
    where = tmp_path / "small"
    where.mkdir()
    report = fill(where)
    assert report["stored"] >= 1 and report["failed"] >= 1
    assert report["stored"] + report["failed"] == len(disk_writer.FILL_SIZES)
    assert report["store_failures"] == report["failed"]
    assert report["objects"] == report["stored"] == report["loaded_ok"]
    assert report["tmp_files"] == []
    assert report["stored_after_drop"] == 1
    assert "space" in report["last_error"] or "too large" in report["last_error"]


# -- damaged and vanished files --------------------------------------------------------


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


DAMAGE: dict[str, tuple[Callable[[str, str], None], str, str]] = {
    # name: (damage the object of key 1, given its file and key 2's file; counter it hits;
    # the path's last_error after the load, {p1} standing for key 1's file)
    "truncated payload": (
        lambda p1, p2: os.truncate(p1, diskfile.BLOCK + NBYTES - 100),
        "corrupt",
        "load: {p1}: truncated payload",
    ),
    "payload cut off at the header's end": (
        lambda p1, p2: os.truncate(p1, diskfile.BLOCK),
        "corrupt",
        "load: {p1}: truncated payload",
    ),
    "truncated header": (
        lambda p1, p2: os.truncate(p1, 100),
        "corrupt",
        "load: {p1}: truncated header",
    ),
    "payload byte flipped": (
        lambda p1, p2: _flip(p1, diskfile.BLOCK + 3000),
        "corrupt",
        "load: {p1}: payload checksum mismatch",
    ),
    "header byte flipped": (
        lambda p1, p2: _flip(p1, 17),
        "corrupt",
        "load: {p1}: header checksum mismatch",
    ),
    "another key's file renamed over it": (
        lambda p1, p2: shutil.copy(p2, p1),
        "corrupt",
        "load: {p1}: the header names another key than the file name",
    ),
    "deleted behind the tier's back": (
        lambda p1, p2: os.unlink(p1),
        "missing",
        "load: [Errno 2] No such file or directory: '{p1}'",
    ),
}


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_or_missing_file_is_a_counted_dropped_miss(
    tmp_path: Path, tiers: list[DiskTier], damage: str, direct: bool
) -> None:
    """Loading an object whose file was damaged or removed answers False, counts it
    (corrupt or missing, and a load failure), says why in the path's last_error, drops
    the entry and the file; other objects still load. (On False the destination's bytes
    are undefined.)"""
    tier = DiskTier([str(tmp_path)], 1 << 20, direct_io=direct)
    tiers.append(tier)
    answer(tier.store([(key(1), payload(1)), (key(2), payload(2))]))
    p1, p2 = (diskfile.object_path(str(tmp_path), key(i), NBYTES) for i in (1, 2))
    hurt, counter, error = DAMAGE[damage]
    hurt(p1, p2)
    dsts = [torch.zeros(NBYTES, dtype=torch.uint8) for _ in range(2)]
    assert answer(tier.load([key(1), key(2)], dsts)) == [False, True]
    assert torch.equal(dsts[1], payload(2))
    assert tier.describe()["paths"][0]["last_error"] == error.format(p1=p1)
    stats = tier.stats()
    assert stats[f"{counter}_objects"] == 1 and stats["load_failures"] == 1
    other = "missing" if counter == "corrupt" else "corrupt"
    assert stats[f"{other}_objects"] == 0
    assert (stats["objects"], stats["usage_bytes"], stats["pinned"]) == (1, NBYTES, 0)
    assert answer(tier.contains([key(1), key(2)])) == [False, True]
    assert not os.path.exists(p1)
    assert answer(tier.store([(key(1), payload(1))])).stored == 1  # it can be written again
    dst = torch.zeros(NBYTES, dtype=torch.uint8)
    assert answer(tier.load([key(1)], [dst])) == [True] and torch.equal(dst, payload(1))


def test_a_dropped_pinned_object_can_still_be_unpinned(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """A pin taken before the object was found corrupt is undone by unpin without error."""
    tier = DiskTier([str(tmp_path)], 1 << 20)
    tiers.append(tier)
    answer(tier.store([(key(1), payload(1))]))
    assert tier.pin([key(1)]) == 1
    _flip(diskfile.object_path(str(tmp_path), key(1), NBYTES), diskfile.BLOCK)
    assert answer(tier.load([key(1)], [torch.zeros(NBYTES, dtype=torch.uint8)])) == [False]
    tier.unpin([key(1)])
    assert tier.stats()["pinned"] == 0


# -- a path that stops being writable -----------------------------------------------------


def test_an_unwritable_path_fails_its_stores_and_the_rest_serve(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """When a path's directory is replaced by a regular file, stores routed there are
    counted failures and its objects are missing, while the other path keeps storing and
    loading; once the directory is back, stores there succeed again."""
    broken, fine = tmp_path / "broken", tmp_path / "fine"
    tier = DiskTier([str(broken), str(fine)], 1 << 20)
    tiers.append(tier)
    group = [str(broken), str(fine)]
    on: dict[str, list[int]] = {str(broken): [], str(fine): []}
    for i in range(100):
        on[pick_path(group, key(i).chunk_hash)].append(i)
    to_broken, to_fine = on[str(broken)][:4], on[str(fine)][:4]
    answer(tier.store([(key(i), payload(i)) for i in (to_broken[0], to_fine[0])]))
    shutil.rmtree(broken)
    broken.write_text("not a directory any more")

    outcome = answer(tier.store([(key(i), payload(i)) for i in to_broken[1:] + to_fine[1:]]))
    assert (outcome.stored, outcome.failed) == (3, 3)
    stats = tier.stats()
    assert stats["store_failures"] == 3 and stats["objects"] == 5
    dsts = [torch.zeros(NBYTES, dtype=torch.uint8) for _ in range(2)]
    assert answer(tier.load([key(to_broken[0]), key(to_fine[0])], dsts)) == [False, True]
    assert tier.stats()["missing_objects"] == 1
    described = {p["path"]: p for p in tier.describe()["paths"]}
    assert "Not a directory" in described[str(broken)]["last_error"]
    assert described[str(fine)]["last_error"] is None

    broken.unlink()
    broken.mkdir()
    assert answer(tier.store([(key(to_broken[1]), payload(to_broken[1]))])).stored == 1


# -- a writer killed mid-write ----------------------------------------------------------


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGSTOP `proc` and wait until the kernel has stopped it (state T)."""
    proc.send_signal(signal.SIGSTOP)
    stat = Path(f"/proc/{proc.pid}/stat")
    while stat.read_text().rpartition(")")[2].split()[0] != "T":
        time.sleep(0.001)


#: batches of four objects the writer may store before the test gives up catching it
#: mid-write (a stop catches one in a few on a quiet machine)
MAX_WRITER_BATCHES = 500


def _count_lines(stream: IO[str]) -> Callable[[], int]:
    """Read `stream` on a thread; returns a function giving the lines read so far."""
    lines = [0]

    def read() -> None:
        for _ in stream:
            lines[0] += 1

    threading.Thread(target=read, daemon=True).start()
    return lambda: lines[0]


def _stopped_mid_write(writer: subprocess.Popen[str], root: Path) -> bool:
    """Stop the writer; True if a temporary file is there while it is stopped, else it
    is continued (False)."""
    _stop(writer)
    if disk_writer.temporary_files(str(root)):
        return True
    writer.send_signal(signal.SIGCONT)
    return False


def test_a_writer_killed_mid_write_leaves_only_whole_objects(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """SIGKILL a process writing big objects: its lock dies with it, and a new tier finds
    only whole objects (each loads bit-exact) and deletes the half-written files."""
    nbytes = 4 << 20
    writer = subprocess.Popen(
        [sys.executable, str(WRITER), "write", str(tmp_path), str(nbytes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        line = writer.stdout.readline()
        assert line.startswith("stored"), line
        with pytest.raises(
            ValueError, match=f"held by another kvflow server \\(pid {writer.pid}\\)"
        ):
            DiskTier([str(tmp_path)], 1 << 30)
        batches = _count_lines(writer.stdout)  # the writer's progress: batches stored
        # Stop it while a file is half written: stop it whenever a temporary file is seen
        # (a stopped writer cannot finish and rename that file before the kill lands, as
        # a running one could on a loaded machine) and let it go on when the file was
        # renamed before the stop landed. Bounded by the writer's progress, not the clock:
        # a busy machine slows the writer and this loop alike.
        while True:
            if disk_writer.temporary_files(str(tmp_path)) and _stopped_mid_write(writer, tmp_path):
                break
            assert writer.poll() is None, "the writer exited"
            assert batches() < MAX_WRITER_BATCHES, (
                f"no temporary file survived a stop in {MAX_WRITER_BATCHES} batches"
            )
            time.sleep(0.0005)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
    left = disk_writer.temporary_files(str(tmp_path))

    tier = DiskTier([str(tmp_path)], 1 << 30)
    tiers.append(tier)
    assert disk_writer.temporary_files(str(tmp_path)) == []
    held = answer(tier.contains([disk_writer.object_key(i) for i in range(1000)]))
    assert held[:4] == [True] * 4  # the batch it reported stored
    assert sum(held) == tier.stats()["objects"]
    for i in (i for i, whole in enumerate(held) if whole):
        dst = torch.empty(nbytes, dtype=torch.uint8)
        assert answer(tier.load([disk_writer.object_key(i)], [dst])) == [True]
        assert torch.equal(dst, disk_writer.object_bytes(i, nbytes)), i
    assert left, "the writer was not caught mid-write (no temporary file at the kill)"


# -- two tiers on one directory ---------------------------------------------------------


def test_a_second_tier_on_a_held_directory_is_refused(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """A second tier on a directory a live tier holds is refused, naming --l2-disk, the
    path and the holder's pid; once the first closes, the directory can be taken."""
    first = DiskTier([str(tmp_path / "a"), str(tmp_path / "b")], 1 << 20)
    with pytest.raises(ValueError) as refused:
        DiskTier([str(tmp_path / "c"), str(tmp_path / "b")], 1 << 20)
    message = str(refused.value)
    assert f"--l2-disk path {tmp_path / 'b'}" in message
    assert f"another kvflow server (pid {os.getpid()})" in message
    first.close()
    second = DiskTier([str(tmp_path / "c"), str(tmp_path / "b")], 1 << 20)
    tiers.append(second)
    assert second.stats()["paths"] == 2
