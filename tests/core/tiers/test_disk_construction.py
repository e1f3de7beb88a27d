"""The disk tier's construction and start-up in detail: the exact refusals of a bad thread
count and of one directory listed twice, how many I/O threads a path runs, where the
O_DIRECT probe leaves its file when the process dies, eviction counts summed over the
tier's life, and files deleted by the start-up scan that a store writes again."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvflow.core.tiers import diskfile
from kvflow.core.tiers.base import StoreOutcome
from kvflow.core.tiers.disk import DiskTier
from tests.core.tiers import test_disk
from tests.core.tiers.test_disk import KIB, answer, key, load_one, open_tier, payload
from tests.core.tiers.test_disk_tier_behaviour import (
    age,
    exactly,
    restart_with_two_files_of_one_key,
)

tiers = test_disk.tiers  # the fixture: tiers a test makes, closed at its end


# -- refusals -------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [0, -1])
def test_a_path_without_io_threads_is_refused_with_the_count(tmp_path: Path, threads: int) -> None:
    with pytest.raises(
        ValueError, match=exactly(f"io_threads_per_path must be >= 1, got {threads}")
    ):
        DiskTier([str(tmp_path)], 1 << 20, io_threads_per_path=threads)


def test_one_directory_listed_twice_is_refused_naming_both_spellings(tmp_path: Path) -> None:
    """A directory and a symlink to it are one directory: refused, both names listed
    as given (made absolute), comma-separated."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    message = f"--l2-disk lists one directory twice: {real}, {link}"
    with pytest.raises(ValueError, match=exactly(message)):
        DiskTier([str(real), str(link)], 1 << 20)


# -- I/O threads ----------------------------------------------------------------------


def test_a_path_runs_io_threads_per_path_threads_two_by_default(
    tmp_path: Path, tiers: list[DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of many objects on one path runs on that path's own I/O threads, two by
    default (kvflow-disk0_0 and _1), however many reads are queued; one when asked."""
    names: set[str] = set()
    read_object = diskfile.read_object

    def slow_read(*args: Any, **kw: Any) -> None:
        names.add(threading.current_thread().name)
        time.sleep(0.02)  # every read is queued while the first ones run
        read_object(*args, **kw)

    for threads, expected in (
        (None, {"kvflow-disk0_0", "kvflow-disk0_1"}),
        (1, {"kvflow-disk0_0"}),
    ):
        where = tmp_path / f"threads-{threads}"
        kw = {} if threads is None else {"io_threads_per_path": threads}
        tier = open_tier(tiers, [where], 1 << 20, **kw)
        keys = [key(i) for i in range(12)]
        answer(tier.store([(k, payload(i)) for i, k in enumerate(keys)]))
        names.clear()
        monkeypatch.setattr(diskfile, "read_object", slow_read)
        dsts = [payload(0) for _ in keys]
        assert answer(tier.load(keys, dsts)) == [True] * len(keys)
        monkeypatch.setattr(diskfile, "read_object", read_object)
        assert names == expected
        tier.close()


# -- the O_DIRECT probe ---------------------------------------------------------------


DIE_IN_THE_PROBE = """
import os, sys
from kvflow.core.tiers.disk import DiskTier
os.preadv = lambda *args: os._exit(7)  # killed between the probe's write and read-back
DiskTier([sys.argv[1]], 1 << 20, direct_io=True)
"""


def test_a_probe_file_left_by_a_killed_process_is_removed_at_the_next_start(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """The O_DIRECT probe writes its file in the objects directory, so the one a process
    killed mid-probe leaves is deleted by the next start's scan: no temporary file stays
    anywhere under the path."""
    assert diskfile.probe_direct_io(str(tmp_path)), "this test needs /tmp to take O_DIRECT"
    root = tmp_path / "disk"
    died = subprocess.run(
        [sys.executable, "-c", DIE_IN_THE_PROBE, str(root)], capture_output=True, timeout=60
    )
    assert died.returncode == 7, died.stderr.decode()

    def leftovers() -> list[str]:
        return [
            os.path.join(d, name)
            for d, _, names in os.walk(root)
            for name in names
            if name.endswith(diskfile.TMP_SUFFIX)
        ]

    [probe] = leftovers()
    assert os.path.basename(probe).startswith(".kvflow-direct-probe.")
    open_tier(tiers, [root], 1 << 20)
    assert leftovers() == []


# -- eviction counts ------------------------------------------------------------------


def test_evicted_bytes_add_up_over_start_up_and_every_store(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """evicted_chunks and evicted_bytes count every eviction since the tier started: the
    start-up scan's, then each store's, summed (not the last one's)."""
    tier = open_tier(tiers, [tmp_path], 8 * KIB)
    for i in range(4):
        answer(tier.store([(key(i), payload(i, 2 * KIB))]))
        age(diskfile.object_path(str(tmp_path), key(i), 2 * KIB), i)
    tier.close()
    small = open_tier(tiers, [tmp_path], 4 * KIB)  # the two oldest go at start-up
    assert (small.stats()["evicted_chunks"], small.stats()["evicted_bytes"]) == (2, 4 * KIB)
    outcome = answer(small.store([(key(10), payload(10, 2 * KIB))]))
    assert outcome == StoreOutcome(
        stored=1, evicted_chunks=1, evicted_bytes=2 * KIB, evicted_keys=(key(2),)
    )
    answer(small.store([(key(11), payload(11, KIB))]))
    stats = small.stats()
    assert (stats["evicted_chunks"], stats["evicted_bytes"]) == (4, 8 * KIB)


# -- files the start-up scan deleted --------------------------------------------------


def test_a_key_evicted_at_start_up_can_be_stored_again(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """An object the start-up scan evicted (its file deleted) is written again by a later
    store of the same key and size, at once (the store does not wait on the old file)."""
    tier = open_tier(tiers, [tmp_path], 4 * KIB)
    for i in range(2):
        answer(tier.store([(key(i), payload(i, 2 * KIB))]))
        age(diskfile.object_path(str(tmp_path), key(i), 2 * KIB), i)
    tier.close()
    small = open_tier(tiers, [tmp_path], 2 * KIB)
    assert answer(small.contains([key(0), key(1)])) == [False, True]
    outcome = small.store([(key(0), payload(0, 2 * KIB))]).result(timeout=10)
    assert outcome == StoreOutcome(
        stored=1, evicted_chunks=1, evicted_bytes=2 * KIB, evicted_keys=(key(1),)
    )
    got = load_one(small, key(0), 2 * KIB)
    assert got is not None and got.equal(payload(0, 2 * KIB))


def test_the_older_file_of_a_key_found_twice_can_be_written_again(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """The start-up scan keeps the newest file of a key and deletes the older; after the
    key is dropped, a store of the older size writes that file again, at once."""
    old, again = restart_with_two_files_of_one_key(tmp_path, tiers)
    assert not os.path.exists(old)
    assert again.drop_where(lambda k: True) == 1
    assert again.store([(key(1), payload(3))]).result(timeout=10) == StoreOutcome(stored=1)
    assert os.path.exists(old)
    got = load_one(again, key(1))
    assert got is not None and got.equal(payload(3))
