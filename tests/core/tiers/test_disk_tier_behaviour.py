"""The disk tier (kvflow.core.tiers.disk) in detail: the lock file and its refusals, the
start-up scan's short files and duplicates, the counts a store and a load report, I/O
errors and interruptions met on the I/O threads, file modes, describe, and close."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow.core.tiers import diskfile
from kvflow.core.tiers.base import StoreOutcome
from kvflow.core.tiers.disk import LOCK_NAME, DiskTier
from tests.core.tiers import test_disk
from tests.core.tiers.test_disk import KIB, answer, key, load_one, open_tier, payload

tiers = test_disk.tiers  # the fixture: tiers a test makes, closed at its end


def exactly(message: str) -> str:
    """A `pytest.raises(match=...)` pattern for this whole message."""
    return f"^{re.escape(message)}$"


def raising(error: BaseException) -> Any:
    """A stand-in for a function that raises `error` whatever it is given."""

    def fail(*args: Any, **kw: Any) -> None:
        raise error

    return fail


def last_error(tier: DiskTier, path: int = 0) -> str | None:
    error: str | None = tier.describe()["paths"][path]["last_error"]
    return error


# -- the lock file -------------------------------------------------------------------


def test_the_lock_file_is_private_and_names_the_holder(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    open_tier(tiers, [tmp_path], 1 << 20)
    lock = tmp_path / LOCK_NAME
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    assert lock.read_text() == f"{os.getpid()}\n"


def test_a_path_whose_lock_file_cannot_be_opened_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).mkdir()
    with pytest.raises(
        ValueError, match=exactly(f"--l2-disk path {tmp_path} cannot be locked: Is a directory")
    ):
        DiskTier([str(tmp_path)], 1 << 20)


@pytest.fixture
def held_lock(tmp_path: Path) -> Iterator[Path]:
    """The lock file of tmp_path, held (flock) by this test as another server would."""
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    yield tmp_path / LOCK_NAME
    os.close(fd)


@pytest.mark.parametrize(
    ("content", "holder"),
    [
        (b"", "unknown"),  # a holder that has not written its pid yet
        (b"\xff" + b"7" * 40, "\ufffd" + "7" * 31),  # not UTF-8, and only 32 bytes of it
    ],
    ids=["empty", "garbage"],
)
def test_a_held_path_is_refused_whatever_its_lock_file_says(
    tmp_path: Path, held_lock: Path, content: bytes, holder: str
) -> None:
    held_lock.write_bytes(content)
    message = (
        f"--l2-disk path {tmp_path} is held by another kvflow server (pid {holder}); "
        "give each server directories of its own"
    )
    with pytest.raises(ValueError, match=exactly(message)):
        DiskTier([str(tmp_path)], 1 << 20)


def test_io_threads_that_cannot_be_reniced_still_do_the_io(
    tmp_path: Path, tiers: list[DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "setpriority", raising(PermissionError(errno.EPERM, "denied")))
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    assert answer(tier.store([(key(1), payload(1))])) == StoreOutcome(stored=1)
    got = load_one(tier, key(1))
    assert got is not None and torch.equal(got, payload(1))


# -- the start-up scan ---------------------------------------------------------------


def age(path: str, rank: int) -> None:
    """Give the file an mtime in the past, older for a lower rank."""
    when = time.time_ns() - 10**12 + rank * 10**9
    os.utime(path, ns=(when, when))


def test_a_restart_deletes_and_counts_each_short_file(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(i), payload(i)) for i in range(3)]))
    tier.close()
    files = [diskfile.object_path(str(tmp_path), key(i), KIB) for i in range(3)]
    os.truncate(files[0], diskfile.BLOCK)  # header only
    os.truncate(files[1], diskfile.BLOCK + KIB - 1)  # one payload byte short
    for rank, path in enumerate(files):  # the whole one is scanned last
        age(path, rank)
    again = open_tier(tiers, [tmp_path], 1 << 20)
    assert answer(again.contains([key(i) for i in range(3)])) == [False, False, True]
    stats = again.stats()
    assert (stats["corrupt_objects"], stats["objects"], stats["usage_bytes"]) == (2, 1, KIB)
    assert [os.path.exists(p) for p in files] == [False, False, True]


def restart_with_two_files_of_one_key(
    tmp_path: Path, tiers: list[DiskTier]
) -> tuple[str, DiskTier]:
    """key(1) stored at 1 KiB, then a newer 2 KiB file of it written beside; the old
    file's path and a tier started on the folder afterwards."""
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1))]))
    tier.close()
    old = diskfile.object_path(str(tmp_path), key(1), KIB)
    new = diskfile.object_path(str(tmp_path), key(1), 2 * KIB)
    diskfile.write_object(new, key(1), payload(2, 2 * KIB).numpy().data, direct=False)
    age(old, 0)
    age(new, 1)
    return old, open_tier(tiers, [tmp_path], 1 << 20)


def test_a_restart_keeps_only_the_newest_file_of_a_key(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    old, again = restart_with_two_files_of_one_key(tmp_path, tiers)
    stats = again.stats()
    assert (stats["objects"], stats["usage_bytes"], stats["corrupt_objects"]) == (1, 2 * KIB, 0)
    assert not os.path.exists(old)
    assert load_one(again, key(1)) is None  # the old size is gone
    got = load_one(again, key(1), 2 * KIB)
    assert got is not None and torch.equal(got, payload(2, 2 * KIB))


# -- what a store reports --------------------------------------------------------------


def test_a_store_counts_each_key_held_already_and_writes_the_rest(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1)), (key(2), payload(2))]))
    items = [(key(i), payload(i)) for i in (1, 2, 3)]
    assert answer(tier.store(items)) == StoreOutcome(stored=1, present=2)
    assert answer(tier.contains([key(3)])) == [True]


def test_a_store_fails_each_key_with_no_room_and_writes_the_rest(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    tier = open_tier(tiers, [tmp_path], 2 * KIB)
    items = [(key(1), payload(1, 3 * KIB)), (key(2), payload(2, 3 * KIB)), (key(3), payload(3))]
    assert answer(tier.store(items)) == StoreOutcome(stored=1, failed=2)
    assert tier.stats()["store_failures"] == 2
    assert answer(tier.contains([key(3)])) == [True]


def test_an_object_of_exactly_the_capacity_fits(tmp_path: Path, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, [tmp_path], 2 * KIB)
    answer(tier.store([(key(1), payload(1))]))
    outcome = answer(tier.store([(key(2), payload(2, 2 * KIB))]))
    assert outcome == StoreOutcome(
        stored=1, evicted_chunks=1, evicted_bytes=KIB, evicted_keys=(key(1),)
    )


def test_a_store_sums_the_evictions_of_all_its_keys(tmp_path: Path, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, [tmp_path], 2 * KIB)
    answer(tier.store([(key(1), payload(1)), (key(2), payload(2))]))
    outcome = answer(tier.store([(key(3), payload(3)), (key(4), payload(4))]))
    assert outcome == StoreOutcome(
        stored=2, evicted_chunks=2, evicted_bytes=2 * KIB, evicted_keys=(key(1), key(2))
    )


def test_no_write_is_in_flight_once_a_store_answered(tmp_path: Path, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20, io_threads_per_path=1)
    answer(tier.store([(key(1), payload(1)), (key(2), payload(2))]))
    stats = tier.stats()
    assert (stats["writing"], stats["objects"], stats["usage_bytes"]) == (0, 2, 2 * KIB)


def test_bad_buffers_are_named_in_the_error(tmp_path: Path, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    bad = torch.zeros(KIB, dtype=torch.float32)
    stored = "items' bytes[1] must be a 1-D uint8 CPU tensor, got torch.float32 (1024,) on cpu"
    with pytest.raises(ValueError, match=exactly(stored)):
        tier.store([(key(1), payload(1)), (key(2), bad)])
    loaded = "dsts[0] must be a 1-D uint8 CPU tensor, got torch.float32 (1024,) on cpu"
    with pytest.raises(ValueError, match=exactly(loaded)):
        tier.load([key(1)], [bad])


def test_an_owners_directory_is_made_private(tmp_path: Path, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1))]))
    owner_dir = os.path.dirname(diskfile.object_path(str(tmp_path), key(1), KIB))
    assert stat.S_IMODE(os.stat(owner_dir).st_mode) == 0o700


# -- writes that fail ----------------------------------------------------------------


def test_a_failed_write_gives_back_its_room_and_says_why(
    tmp_path: Path, tiers: list[DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1)), (key(2), payload(2))]))
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(diskfile, "write_object", raising(full))
    assert answer(tier.store([(key(3), payload(3))])) == StoreOutcome(failed=1)
    stats = tier.stats()
    assert (stats["usage_bytes"], stats["objects"], stats["writing"]) == (2 * KIB, 2, 0)
    assert stats["store_failures"] == 1
    assert last_error(tier) == "store: [Errno 28] No space left on device"
    assert answer(tier.contains([key(3)])) == [False]


def test_a_write_interrupted_by_another_error_is_forgotten_and_counted(
    tmp_path: Path, tiers: list[DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    monkeypatch.setattr(diskfile, "write_object", raising(MemoryError()))
    with pytest.raises(MemoryError):
        answer(tier.store([(key(1), payload(1))]))
    assert answer(tier.contains([key(1)])) == [False]
    stats = tier.stats()
    assert (stats["store_failures"], stats["usage_bytes"], stats["writing"]) == (1, 0, 0)
    assert last_error(tier) == "store: interrupted"


def test_a_key_stored_again_while_its_old_file_is_deleted_keeps_its_new_file(
    tmp_path: Path, tiers: list[DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write of a key whose dropped file is still being deleted waits for the
    deletion, so the new file is not deleted in its stead."""
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1))]))
    path = diskfile.object_path(str(tmp_path), key(1), KIB)
    may_delete, gated, gating = threading.Event(), [path], set[int]()
    real_unlink, real_write, real_wait = os.unlink, diskfile.write_object, threading.Condition.wait

    def gated_unlink(target: Any, *args: Any, **kw: Any) -> None:
        if target in gated:  # the drop's deletion waits until the new write waits or is done
            gated.remove(target)
            gating.add(threading.get_ident())
            assert may_delete.wait(10)
        real_unlink(target, *args, **kw)

    def spied_write(*args: Any, **kw: Any) -> None:
        real_write(*args, **kw)
        may_delete.set()

    def spied_wait(self: threading.Condition, timeout: float | None = None) -> bool:
        thread = threading.current_thread()
        if thread.name.startswith("kvflow-disk") and thread.ident not in gating:
            may_delete.set()  # a writer waits for the deletion
        return real_wait(self, timeout)

    monkeypatch.setattr(os, "unlink", gated_unlink)
    monkeypatch.setattr(diskfile, "write_object", spied_write)
    monkeypatch.setattr(threading.Condition, "wait", spied_wait)
    assert tier.drop_where(lambda k: True) == 1
    assert answer(tier.store([(key(1), payload(2))])) == StoreOutcome(stored=1)
    tier.close()  # the deletion is done
    again = open_tier(tiers, [tmp_path], 1 << 20)
    got = load_one(again, key(1))
    assert got is not None and torch.equal(got, payload(2))


# -- loads ---------------------------------------------------------------------------


def test_a_destination_of_another_size_leaves_the_object_held(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1))]))
    assert load_one(tier, key(1), KIB // 2) is None
    assert tier.stats()["load_failures"] == 0
    got = load_one(tier, key(1))
    assert got is not None and torch.equal(got, payload(1))


def test_a_read_lands_in_a_contiguous_destination_with_the_paths_io_mode(
    tmp_path: Path, tiers: list[DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No bounce copy for a contiguous destination, and O_DIRECT reads where it is used."""
    assert diskfile.probe_direct_io(str(tmp_path)), "this test needs /tmp to take O_DIRECT"
    tier = open_tier(tiers, [tmp_path], 1 << 20, direct_io=True)
    answer(tier.store([(key(1), payload(1))]))
    seen: list[tuple[int, Any]] = []
    real_read = diskfile.read_object

    def spy(path: str, k: Any, dst: memoryview, *, direct: bool) -> None:
        seen.append((torch.frombuffer(dst, dtype=torch.uint8).data_ptr(), direct))
        real_read(path, k, dst, direct=direct)

    monkeypatch.setattr(diskfile, "read_object", spy)
    dst = torch.zeros(KIB, dtype=torch.uint8)
    assert answer(tier.load([key(1)], [dst])) == [True]
    assert seen == [(dst.data_ptr(), True)]
    assert torch.equal(dst, payload(1))


def test_every_failed_load_is_counted(tmp_path: Path, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1)), (key(2), payload(2))]))
    for i in (1, 2):
        os.unlink(diskfile.object_path(str(tmp_path), key(i), KIB))
    dsts = [torch.zeros(KIB, dtype=torch.uint8) for _ in range(2)]
    assert answer(tier.load([key(1), key(2)], dsts)) == [False, False]
    stats = tier.stats()
    assert (stats["missing_objects"], stats["load_failures"], stats["objects"]) == (2, 2, 0)


def test_an_io_error_on_read_is_a_counted_dropped_miss(
    tmp_path: Path, tiers: list[DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1))]))
    monkeypatch.setattr(diskfile, "read_object", raising(OSError(errno.EIO, "Input/output error")))
    assert load_one(tier, key(1)) is None
    stats = tier.stats()
    assert (stats["load_failures"], stats["corrupt_objects"], stats["missing_objects"]) == (1, 0, 0)
    assert (stats["objects"], stats["pinned"]) == (0, 0)
    assert last_error(tier) == "load: [Errno 5] Input/output error"
    assert not os.path.exists(diskfile.object_path(str(tmp_path), key(1), KIB))


def test_a_read_interrupted_by_another_error_drops_the_object(
    tmp_path: Path, tiers: list[DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1))]))
    monkeypatch.setattr(diskfile, "read_object", raising(MemoryError()))
    with pytest.raises(MemoryError):
        answer(tier.load([key(1)], [torch.zeros(KIB, dtype=torch.uint8)]))
    stats = tier.stats()
    assert (stats["load_failures"], stats["objects"], stats["pinned"]) == (1, 0, 0)
    assert last_error(tier) == "load: interrupted"
    assert answer(tier.contains([key(1)])) == [False]


def test_a_load_succeeds_where_its_recency_cannot_be_saved(
    tmp_path: Path, tiers: list[DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1))]))
    monkeypatch.setattr(os, "utime", raising(OSError(errno.EROFS, "Read-only file system")))
    got = load_one(tier, key(1))
    assert got is not None and torch.equal(got, payload(1))
    assert tier.stats()["load_failures"] == 0 and last_error(tier) is None


# -- placement, describe, drop_where, close ---------------------------------------------


def test_an_owner_can_be_placed_on_gpu_0(tmp_path: Path, tiers: list[DiskTier]) -> None:
    paths = [tmp_path / "gpu0", tmp_path / "gpu1"]
    tier = open_tier(tiers, paths, 1 << 20, num_gpus=2)
    tier.place("m", 1, 1, gpu=0)  # rank 1 would go to GPU 1
    answer(tier.store([(key(1, rank=1), payload(1))]))
    assert os.path.exists(diskfile.object_path(str(paths[0]), key(1, rank=1), KIB))


def test_describe_reports_the_whole_tier(tmp_path: Path, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1))]))
    described = tier.describe()
    del described["paths"]
    assert described == {
        "name": "disk",
        "capacity_bytes": 1 << 20,
        "usage_bytes": KIB,
        "objects": 1,
        "sharding": "by_gpu",
        "num_gpus": 1,
        "direct_io_requested": False,
        "placements": [],
        "closed": False,
    }


def test_drop_where_keeps_the_count_of_the_rest(tmp_path: Path, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(i), payload(i)) for i in range(3)]))
    assert tier.drop_where(lambda k: k == key(0)) == 1
    assert (tier.stats()["objects"], tier.describe()["paths"][0]["objects"]) == (2, 2)


def test_close_zeroes_the_counts_and_later_calls_say_it_is_closed(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1))]))
    assert tier.pin([key(1)]) == 1
    tier.close()
    stats = tier.stats()
    counts = {name: stats[name] for name in ("usage_bytes", "objects", "writing", "pinned")}
    assert counts == dict.fromkeys(counts, 0)
    assert [p["usage_bytes"] for p in tier.describe()["paths"]] == [0]
    with pytest.raises(RuntimeError, match=exactly("the disk tier is closed")):
        tier.contains([key(1)])


def test_close_finishes_pending_writes_first(
    tmp_path: Path, tiers: list[DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write still pending when close begins is whole once close returns."""
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    closing = threading.Event()  # close waits for the I/O threads to end
    real_write, real_join = diskfile.write_object, threading.Thread.join

    def spied_join(self: threading.Thread, timeout: float | None = None) -> None:
        closing.set()
        real_join(self, timeout)

    def write_once_closing(*args: Any, **kw: Any) -> None:
        assert closing.wait(10)
        real_write(*args, **kw)

    monkeypatch.setattr(threading.Thread, "join", spied_join)
    monkeypatch.setattr(diskfile, "write_object", write_once_closing)
    pending = tier.store([(key(1), payload(1))])
    tier.close()
    assert pending.done() and pending.result() == StoreOutcome(stored=1)
    assert os.path.exists(diskfile.object_path(str(tmp_path), key(1), KIB))
