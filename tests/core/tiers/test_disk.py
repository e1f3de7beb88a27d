"""The L2 disk tier (kvflow.core.tiers.disk) beyond the tier contract: its files, restart,
eviction, paths and placement, threads, O_DIRECT and its fallback."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from kvflow.core.tiers import diskfile
from kvflow.core.tiers.base import ObjectKey, StoreOutcome
from kvflow.core.tiers.disk import DiskTier
from kvflow.core.tiers.sharding import pick_path

T = TypeVar("T")
KIB = 1024


def key(i: int, model: str = "m", salt: str | None = None, rank: int = 0) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "little"), model, 1, rank, salt)


def payload(seed: int, nbytes: int = KIB) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def answer(future: Future[T]) -> T:
    return future.result(timeout=10)


def load_one(tier: DiskTier, k: ObjectKey, nbytes: int = KIB) -> torch.Tensor | None:
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    return dst if answer(tier.load([k], [dst])) == [True] else None


@pytest.fixture
def tiers() -> Iterator[list[DiskTier]]:
    """Tiers a test makes, closed at its end."""
    made: list[DiskTier] = []
    yield made
    for tier in made:
        tier.close()


def open_tier(tiers: list[DiskTier], paths: list[Path], capacity: int, **kw: Any) -> DiskTier:
    tier = DiskTier([str(p) for p in paths], capacity, **kw)
    tiers.append(tier)
    return tier


def test_round_trip_is_bit_exact(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """Bytes of many sizes (empty to past the O_DIRECT bounce buffer) come back unchanged."""
    tier = open_tier(tiers, [tmp_path], 64 << 20)
    sizes = [0, 1, 1000, 4096, 4097, diskfile.BOUNCE_BYTES + 3]
    items = [(key(i), payload(i, n)) for i, n in enumerate(sizes)]
    assert answer(tier.store(items)) == StoreOutcome(stored=len(sizes))
    for (k, data), n in zip(items, sizes, strict=True):
        got = load_one(tier, k, n)
        assert got is not None and torch.equal(got, data)


ODD_KEYS = [
    key(1, "meta-llama/Llama-3.1-8B-Instruct"),
    key(2, "模型/名前 ü", salt=""),
    key(3, "..", salt="s/#%.."),
    key(4, "", salt="%2F#"),
    key(5, "a\x00b\nc\x7f", salt="\ud800 lone surrogate"),
    key(6, "長い" * 150, salt="x" * 400),  # owner over 255 bytes: nested directories
    ObjectKey(b"", "m", 8, 7, None),
    ObjectKey(b"\xff" * 96, "m", 2, 1, "salt"),
]


@pytest.fixture
def fresh_names() -> None:
    """Owner directories computed anew: diskfile caches an owner's, so without this a test
    would check names an earlier test in the process computed."""
    diskfile._owner_relpath.cache_clear()


@pytest.mark.usefixtures("fresh_names")
@pytest.mark.parametrize("k", ODD_KEYS, ids=range(len(ODD_KEYS)))
def test_file_names_recover_every_key(k: ObjectKey) -> None:
    """Any model name or salt (unicode, '/', '%', '#', control characters, lone
    surrogates, over 255 bytes) gets a path whose components fit and that parses back."""
    relpath = diskfile.object_relpath(k, 1234)
    assert all(0 < len(part.encode()) < 255 for part in relpath.split(os.sep))
    assert ".." not in relpath.split(os.sep)
    assert diskfile.parse_relpath(relpath) == (k, 1234)


def test_odd_keys_survive_a_restart(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """Objects of odd keys are found again, by their file names, by a new tier."""
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    items = [(k, payload(i)) for i, k in enumerate(ODD_KEYS)]
    assert answer(tier.store(items)).stored == len(items)
    tier.close()
    again = open_tier(tiers, [tmp_path], 1 << 20)
    assert again.stats()["objects"] == len(items)
    for k, data in items:
        got = load_one(again, k)
        assert got is not None and torch.equal(got, data)


@pytest.mark.parametrize(
    ("k", "text"),
    [
        (key(0xAB, "org/m 1", salt="s"), "ab" + "00" * 31 + "#org%2Fm 1#1#0#=s"),
        (key(1, "%#\x7f\x1f\x00 ~", rank=3), "01" + "00" * 31 + "#%25%23%7F%1F%00 ~#1#3#-"),
        (
            key(2, "\ue000\ud7ff", salt="\udfff\ud800"),
            "02" + "00" * 31 + "#\ue000\ud7ff#1#0#=%ED%BF%BF%ED%A0%80",
        ),
        (key(3, "", salt=""), "03" + "00" * 31 + "##1#0#="),
    ],
    ids=["plain", "escapes", "surrogates", "empty"],
)
def test_key_text_spells_hash_then_escaped_owner(k: ObjectKey, text: str) -> None:
    """The header's key text: hash hex, model, world size, rank, then "-" (no salt) or
    "=" and the salt; %, /, #, DEL, control characters and lone surrogates (only they:
    space, other characters and private-use ones stay) as %XX of their UTF-8."""
    assert diskfile.key_text(k) == text


@pytest.mark.usefixtures("fresh_names")
def test_long_owners_nest_in_full_directories_never_cutting_an_escape() -> None:
    """An owner over 200 bytes is cut into "+" directories of exactly 200 bytes and a last
    "o" one; an escape that would straddle a cut moves whole to the next directory."""
    long_owner = diskfile.object_relpath(key(1, "x" * 450), 7).split(os.sep)
    assert long_owner[:-1] == ["+" + "x" * 200, "+" + "x" * 200, "o" + "x" * 50 + "#1#0#-"]
    escape_at_cut = diskfile.object_relpath(key(1, "x" * 199 + "/"), 7).split(os.sep)
    assert escape_at_cut[:-1] == ["+" + "x" * 199, "o%2F#1#0#-"]
    assert escape_at_cut[-1] == "01" + "00" * 31 + ".7.kv"


def test_foreign_names_are_not_taken_for_objects() -> None:
    """Paths kvflow would not have written (bad escapes, wrong shape, or a name that
    parses but is not the one kvflow gives its key) parse to None."""
    good = diskfile.object_relpath(key(1, "a/b"), 10)
    assert diskfile.parse_relpath(good) is not None
    owner, name = os.path.split(diskfile.object_relpath(key(0xAB, "ab"), 10))
    assert diskfile.parse_relpath(os.path.join(owner, name)) == (key(0xAB, "ab"), 10)
    for bad in [
        good.replace("%2F", "%2f"),  # not the canonical escape
        good.replace(".10.kv", ".10.txt"),
        good.replace(".10.kv", ".x.kv"),
        "x" + good,
        os.path.join("sub", good),
        os.path.basename(good),
        os.path.join(owner, name.upper().replace(".KV", ".kv")),  # hash hex in capitals
        os.path.join(owner, name.replace(".10.", ".010.")),  # size with a leading zero
        os.path.join("o%61b#1#0#-", name),  # "a" escaped though it needs not be
        os.path.join("+a", "ob#1#0#-", name),  # a short owner cut in two
    ]:
        assert diskfile.parse_relpath(bad) is None, bad


def test_a_key_no_file_can_name_is_refused(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """A chunk hash over the name limit is a ValueError before anything is written."""
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    long_hash = ObjectKey(b"\x01" * (diskfile.MAX_HASH_BYTES + 1), "m", 1, 0, None)
    with pytest.raises(ValueError, match="chunk hash"):
        tier.store([(key(1), payload(1)), (long_hash, payload(2))])
    assert answer(tier.contains([key(1)])) == [False]


def test_a_restart_finds_objects_in_mtime_lru_order(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """A new tier on the same path finds the objects; their mtimes (a load refreshes
    them) are its LRU order, so it evicts the oldest first."""
    tier = open_tier(tiers, [tmp_path], 4 * KIB)
    answer(tier.store([(key(i), payload(i)) for i in range(4)]))
    base = time.time_ns() - 10**12
    for age_rank, i in enumerate([2, 0, 3, 1]):  # oldest first
        path = diskfile.object_path(str(tmp_path), key(i), KIB)
        os.utime(path, ns=(base + age_rank * 10**9,) * 2)
    assert load_one(tier, key(2)) is not None  # 2 becomes the newest on disk too
    tier.close()
    again = open_tier(tiers, [tmp_path], 4 * KIB)
    assert answer(again.contains([key(i) for i in range(4)])) == [True] * 4
    evicted: list[int] = []
    for i in (10, 11, 12):
        answer(again.store([(key(i), payload(i))]))
        held = answer(again.contains([key(j) for j in range(4)]))
        evicted += [j for j in range(4) if not held[j] and j not in evicted]
    assert evicted == [0, 3, 1]


def test_start_up_deletes_dead_writers_temporary_files(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """Temporary files left by a dead writer are deleted at start; objects and files that
    are not kvflow's stay."""
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1))]))
    tier.close()
    path = diskfile.object_path(str(tmp_path), key(1), KIB)
    leftover = Path(f"{path}.999999-0{diskfile.TMP_SUFFIX}")
    leftover.write_bytes(b"half an object")
    foreign = tmp_path / "notes.txt"
    foreign.write_text("mine")
    again = open_tier(tiers, [tmp_path], 1 << 20)
    assert not leftover.exists() and foreign.exists()
    got = load_one(again, key(1))
    assert got is not None and torch.equal(got, payload(1))


def test_start_up_removes_emptied_directories_nested_ones_too(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """Directories whose objects are gone (a long owner's nested ones included) are removed
    at start, in one restart; directories holding foreign files stay, and so does the
    objects directory, even empty."""
    long_key, kept_key = key(1, "x" * 450), key(2, "kept")
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(long_key, payload(1)), (key(3, "short"), payload(3))]))
    answer(tier.store([(kept_key, payload(2))]))
    tier.close()
    objects = tmp_path / diskfile.OBJECTS_DIR
    for k in (long_key, key(3, "short"), kept_key):
        os.unlink(diskfile.object_path(str(tmp_path), k, KIB))
    foreign = Path(diskfile.object_path(str(tmp_path), kept_key, KIB)).parent / "notes.txt"
    foreign.write_text("mine")
    open_tier(tiers, [tmp_path], 1 << 20).close()
    left = sorted(str(p.relative_to(objects)) for p in objects.rglob("*"))
    assert left == [str(foreign.parent.relative_to(objects)), str(foreign.relative_to(objects))]
    foreign.unlink()
    open_tier(tiers, [tmp_path], 1 << 20)
    assert objects.is_dir() and os.listdir(objects) == []


def test_foreign_files_beside_objects_do_not_hide_them(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """Files that are not kvflow's, in an owner's directory between its objects, are left
    alone and every object beside them is found again."""
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    owner_dir = Path(diskfile.object_path(str(tmp_path), key(0), KIB)).parent
    for i in range(8):
        answer(tier.store([(key(i), payload(i))]))
        (owner_dir / f"notes{i}.txt").write_text("mine")
    tier.close()
    again = open_tier(tiers, [tmp_path], 1 << 20)
    assert again.stats()["objects"] == 8
    assert len(list(owner_dir.glob("notes*.txt"))) == 8


def test_a_scan_skips_files_deleted_under_it(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """Files a scan has listed but another process deletes before it gets to them (an
    object, a temporary file) are skipped, not errors."""
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1)), (key(2), payload(2))]))
    tier.close()
    leftover = tmp_path / diskfile.OBJECTS_DIR / f"x.999999-0{diskfile.TMP_SUFFIX}"
    leftover.write_bytes(b"half an object")
    scan = diskfile.scan_objects(str(tmp_path))
    first = next(scan)  # the owner's directory is listed; the objects directory was first
    other = ({key(1), key(2)} - {first.key}).pop()
    os.unlink(diskfile.object_path(str(tmp_path), other, KIB))
    leftover.unlink()
    assert list(scan) == []
    assert first.file_bytes == diskfile.BLOCK + KIB and first.nbytes == KIB


def test_start_up_evicts_the_oldest_past_capacity(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """Restarted with a smaller capacity, the tier deletes the oldest objects until it fits."""
    tier = open_tier(tiers, [tmp_path], 8 * KIB)
    for i in range(4):
        answer(tier.store([(key(i), payload(i))]))
        os.utime(diskfile.object_path(str(tmp_path), key(i), KIB), ns=(10**18 + i,) * 2)
    tier.close()
    small = open_tier(tiers, [tmp_path], 2 * KIB)
    assert answer(small.contains([key(i) for i in range(4)])) == [False, False, True, True]
    assert small.stats()["evicted_chunks"] == 2
    assert not os.path.exists(diskfile.object_path(str(tmp_path), key(0), KIB))


def test_eviction_follows_lru_and_spares_pinned(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """At capacity the least recently used unpinned object goes (its file too); a pinned
    one stays even when it is the oldest."""
    tier = open_tier(tiers, [tmp_path], 3 * KIB)
    answer(tier.store([(key(i), payload(i)) for i in range(3)]))
    assert tier.pin([key(0)]) == 1
    outcome = answer(tier.store([(key(3), payload(3))]))
    assert (outcome.stored, outcome.evicted_chunks, outcome.evicted_bytes) == (1, 1, KIB)
    assert answer(tier.contains([key(i) for i in range(4)])) == [True, False, True, True]
    assert not os.path.exists(diskfile.object_path(str(tmp_path), key(1), KIB))
    assert load_one(tier, key(2)) is not None  # 2 is now more recent than 3
    answer(tier.store([(key(4), payload(4))]))
    assert answer(tier.contains([key(i) for i in range(5)])) == [True, False, True, False, True]
    stats = tier.stats()
    assert (stats["evicted_chunks"], stats["pinned"], stats["usage_bytes"]) == (2, 1, 3 * KIB)


def test_an_object_larger_than_the_tier_fails_without_evicting(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """An object over the whole capacity fails at once and evicts nothing."""
    tier = open_tier(tiers, [tmp_path], 2 * KIB)
    answer(tier.store([(key(1), payload(1))]))
    assert answer(tier.store([(key(2), payload(2, 3 * KIB))])) == StoreOutcome(failed=1)
    assert answer(tier.contains([key(1)])) == [True]
    assert tier.stats()["store_failures"] == 1


def test_objects_spread_over_a_gpus_paths_by_hash(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """With several paths for one GPU, each object lies on the path its hash picks, and
    every path gets some."""
    paths = [tmp_path / f"d{i}" for i in range(4)]
    tier = open_tier(tiers, paths, 1 << 20)
    answer(tier.store([(key(i), payload(i, 16)) for i in range(64)]))
    group = [str(p) for p in paths]
    for i in range(64):
        root = pick_path(group, key(i).chunk_hash)
        assert os.path.exists(diskfile.object_path(root, key(i), 16))
    per_path = [p["objects"] for p in tier.describe()["paths"]]
    assert sum(per_path) == 64 and min(per_path) > 0


def test_place_routes_an_owner_to_its_gpus_paths(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """Owners go to GPU rank % num_gpus's path unless placed on another GPU."""
    paths = [tmp_path / "gpu0", tmp_path / "gpu1"]
    tier = open_tier(tiers, paths, 1 << 20, num_gpus=2)
    tier.place("placed", 1, 0, gpu=1)
    items = [(key(1, "plain"), payload(1)), (key(2, "placed"), payload(2))]
    items.append((key(3, "plain", rank=1), payload(3)))
    answer(tier.store(items))
    assert os.path.exists(diskfile.object_path(str(paths[0]), key(1, "plain"), KIB))
    assert os.path.exists(diskfile.object_path(str(paths[1]), key(2, "placed"), KIB))
    assert os.path.exists(diskfile.object_path(str(paths[1]), key(3, "plain", rank=1), KIB))
    described = tier.describe()
    assert [p["gpus"] for p in described["paths"]] == [[0], [1]]
    assert described["placements"] == [
        {"model_name": "placed", "world_size": 1, "rank": 0, "gpu": 1}
    ]
    with pytest.raises(ValueError, match="GPU 2 is out of range"):
        tier.place("m", 1, 0, gpu=2)


def test_parallel_stores_and_loads_are_correct(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """Many threads storing and loading at once over two paths get their own bytes back."""
    tier = open_tier(tiers, [tmp_path / "a", tmp_path / "b"], 1 << 20, io_threads_per_path=3)
    errors: list[str] = []

    def work(thread: int) -> None:
        items = [(key(thread * 100 + i), payload(thread * 100 + i, 2 * KIB)) for i in range(16)]
        if answer(tier.store(items)).stored != 16:
            errors.append(f"thread {thread}: not all stored")
        dsts = [torch.zeros(2 * KIB, dtype=torch.uint8) for _ in items]
        if answer(tier.load([k for k, _ in items], dsts)) != [True] * 16:
            errors.append(f"thread {thread}: not all loaded")
        for (k, data), dst in zip(items, dsts, strict=True):
            if not torch.equal(data, dst):
                errors.append(f"thread {thread}: wrong bytes for {k.chunk_hash[:2].hex()}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert tier.stats()["objects"] == 128


def test_calls_answer_at_once_while_a_write_is_slow(
    tmp_path: Path, tiers: list[DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store stuck in I/O does not block contains, pin or stats; its key is invisible
    until its file is whole."""
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    release = threading.Event()
    real_write = diskfile.write_object

    def slow_write(*args: Any, **kw: Any) -> None:
        release.wait(10)
        real_write(*args, **kw)

    monkeypatch.setattr(diskfile, "write_object", slow_write)
    pending = tier.store([(key(1), payload(1))])
    assert tier.contains([key(1)]).done() and answer(tier.contains([key(1)])) == [False]
    assert tier.pin([key(1)]) == 0
    assert tier.stats()["writing"] == 1 and not pending.done()
    release.set()
    assert answer(pending) == StoreOutcome(stored=1)
    assert answer(tier.contains([key(1)])) == [True]


def test_a_strided_buffer_round_trips(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """Non-contiguous 1-D source and destination tensors store and load correctly."""
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    source = payload(7, 2 * KIB)[::2]
    answer(tier.store([(key(1), source)]))
    dst = torch.zeros(2 * KIB, dtype=torch.uint8)[::2]
    assert answer(tier.load([key(1)], [dst])) == [True]
    assert torch.equal(dst, source)


def test_drop_where_deletes_the_files(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """drop_where forgets matching unpinned objects and deletes their files; pinned stay."""
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1, "a"), payload(1)), (key(2, "a"), payload(2))]))
    answer(tier.store([(key(3, "b"), payload(3))]))
    tier.pin([key(2, "a")])
    assert tier.drop_where(lambda k: k.model_name == "a") == 1
    tier.close()  # finishes the deletions
    assert not os.path.exists(diskfile.object_path(str(tmp_path), key(1, "a"), KIB))
    assert os.path.exists(diskfile.object_path(str(tmp_path), key(2, "a"), KIB))
    assert os.path.exists(diskfile.object_path(str(tmp_path), key(3, "b"), KIB))


def test_close_keeps_files_and_later_calls_fail_clearly(
    tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """close keeps the files, is idempotent, leaves stats at zero, and the tier's other
    calls then raise a clear error."""
    tier = open_tier(tiers, [tmp_path], 1 << 20)
    answer(tier.store([(key(1), payload(1))]))
    tier.close()
    tier.close()
    assert os.path.exists(diskfile.object_path(str(tmp_path), key(1), KIB))
    assert tier.stats()["objects"] == 0 and tier.describe()["closed"]
    for call in (
        lambda: tier.contains([key(1)]),
        lambda: tier.store([(key(2), payload(2))]),
        lambda: tier.load([key(1)], [torch.zeros(KIB, dtype=torch.uint8)]),
        lambda: tier.pin([key(1)]),
        lambda: tier.drop_where(lambda k: True),
    ):
        with pytest.raises(RuntimeError, match="disk tier is closed"):
            call()


def test_bad_arguments_name_their_flag(tmp_path: Path) -> None:
    """No paths, a capacity <= 0, a path that cannot be a directory, a path listed twice
    and an uneven path/GPU split are ValueErrors naming the flag."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases: list[tuple[Any, int, int, str]] = [
        ([], 1, 1, "--l2-disk needs a list"),
        ([str(tmp_path)], 0, 1, "--l2-disk-size-gb must be > 0"),
        ([str(a_file)], 1, 1, f"--l2-disk path {a_file} is not a directory"),
        ([str(a_file / "sub")], 1, 1, "cannot be created"),
        ([str(tmp_path), str(tmp_path) + "/"], 1, 1, "lists one directory twice"),
        ([str(tmp_path / "x"), str(tmp_path / "y"), str(tmp_path / "z")], 1, 2, "by_gpu"),
    ]
    for paths, capacity, gpus, message in cases:
        with pytest.raises(ValueError, match=message):
            DiskTier(paths, capacity, num_gpus=gpus)


def test_describe_is_json_ready(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """describe() serialises to JSON and reports per-path usage, objects and capacity."""
    tier = open_tier(tiers, [tmp_path / "a", tmp_path / "b"], 1 << 20)
    answer(tier.store([(key(i), payload(i)) for i in range(6)]))
    described = json.loads(json.dumps(tier.describe()))
    assert described["capacity_bytes"] == 1 << 20 and described["objects"] == 6
    assert sum(p["usage_bytes"] for p in described["paths"]) == 6 * KIB
    assert {p["path"] for p in described["paths"]} == {str(tmp_path / "a"), str(tmp_path / "b")}
    assert all(p["direct_io"] is False for p in described["paths"])


# -- O_DIRECT ---------------------------------------------------------------------


def test_direct_io_writes_aligned_padded_files(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """On a filesystem that takes O_DIRECT (ext4 under /tmp here) the tier uses it: files
    are padded to 4096 bytes, round trips are bit-exact, and buffered tiers read them."""
    assert diskfile.probe_direct_io(str(tmp_path)), "this test needs /tmp to take O_DIRECT"
    tier = open_tier(tiers, [tmp_path], 64 << 20, direct_io=True)
    assert tier.describe()["paths"][0]["direct_io"] is True
    assert tier.stats()["direct_io_paths"] == 1
    sizes = [1, 1000, 8192, diskfile.BOUNCE_BYTES + 5000]
    items = [(key(i), payload(i, n)) for i, n in enumerate(sizes)]
    answer(tier.store(items))
    for (k, data), n in zip(items, sizes, strict=True):
        file_size = os.path.getsize(diskfile.object_path(str(tmp_path), k, n))
        assert file_size == 4096 + -(-n // 4096) * 4096  # the payload padded to whole blocks
        got = load_one(tier, k, n)
        assert got is not None and torch.equal(got, data)
    tier.close()
    buffered = open_tier(tiers, [tmp_path], 64 << 20)
    answer(buffered.store([(key(9), payload(9, 5000))]))  # unpadded
    for (k, data), n in zip(items, sizes, strict=True):
        got = load_one(buffered, k, n)
        assert got is not None and torch.equal(got, data)
    buffered.close()
    direct = open_tier(tiers, [tmp_path], 64 << 20, direct_io=True)
    got = load_one(direct, key(9), 5000)  # an unpadded file read with O_DIRECT
    assert got is not None and torch.equal(got, payload(9, 5000))


@pytest.fixture
def no_direct_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory whose filesystem refuses O_DIRECT: a ramfs mount where we may mount
    (tmpfs takes O_DIRECT on recent kernels: /dev/shm does here), else O_DIRECT opens made to fail as such a
    filesystem's do (EINVAL)."""
    where = tmp_path / "ramfs"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        real_open = os.open

        def refusing_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument", path)
            return real_open(path, flags, *args, **kw)

        monkeypatch.setattr(diskfile.os, "open", refusing_open)
    yield where
    if mounted.returncode == 0:
        subprocess.run(["umount", "-l", str(where)], check=True)


def test_direct_io_falls_back_to_buffered_where_refused(
    no_direct_dir: Path, tmp_path: Path, tiers: list[DiskTier]
) -> None:
    """A path whose filesystem refuses O_DIRECT is used buffered, and describe and stats
    say so, while another path of the same tier keeps O_DIRECT."""
    ok_dir = tmp_path / "direct"
    tier = open_tier(tiers, [no_direct_dir, ok_dir], 1 << 20, direct_io=True)
    in_use = {p["path"]: p["direct_io"] for p in tier.describe()["paths"]}
    assert in_use[str(no_direct_dir)] is False
    assert tier.stats()["direct_io_paths"] == int(in_use[str(ok_dir)])
    items = [(key(i), payload(i, 3000)) for i in range(16)]
    assert answer(tier.store(items)).stored == 16
    for k, data in items:
        got = load_one(tier, k, 3000)
        assert got is not None and torch.equal(got, data)
    assert [p["objects"] > 0 for p in tier.describe()["paths"]] == [True, True]
    assert not any(name.endswith(diskfile.TMP_SUFFIX) for name in os.listdir(no_direct_dir))


def test_io_threads_run_nicer_than_the_caller(
    tmp_path: Path, tiers: list[DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Object writes run on threads of lower CPU priority than the request path, so
    background writes yield the CPU to it."""
    seen: list[int] = []
    write_object = diskfile.write_object

    def spy(*args: Any, **kw: Any) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        write_object(*args, **kw)

    monkeypatch.setattr(diskfile, "write_object", spy)
    tier = open_tier(tiers, [tmp_path], 16 * KIB)
    assert answer(tier.store([(key(1), payload(1))])).stored == 1
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen and all(nice >= min(caller + 10, 19) for nice in seen)
