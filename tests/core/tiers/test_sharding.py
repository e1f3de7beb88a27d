"""by_gpu path assignment and the stable per-chunk path pick (kvflow.core.tiers.sharding)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest

from kvflow.core.tiers.sharding import assign_paths, pick_path


def test_equal_counts_give_each_gpu_its_own_path() -> None:
    """As many paths as GPUs: GPU i writes to path i alone."""
    assert assign_paths(["a", "b", "c"], 3) == [["a"], ["b"], ["c"]]
    assert assign_paths(["a"], 1) == [["a"]]


def test_fewer_paths_are_shared_by_contiguous_gpus() -> None:
    """Fewer paths than GPUs (dividing their count): neighbouring GPUs share a path."""
    assert assign_paths(["a", "b"], 4) == [["a"], ["a"], ["b"], ["b"]]
    assert assign_paths(["a"], 3) == [["a"], ["a"], ["a"]]


def test_more_paths_give_each_gpu_a_contiguous_group() -> None:
    """More paths than GPUs (a multiple of their count): each GPU owns a run of paths."""
    assert assign_paths(["a", "b", "c", "d", "e", "f"], 2) == [["a", "b", "c"], ["d", "e", "f"]]
    assert assign_paths(["a", "b"], 1) == [["a", "b"]]


@pytest.mark.parametrize(
    ("num_paths", "num_gpus", "works"),
    [(3, 2, "1, 2, 4 or 6"), (2, 3, "1, 3, 6 or 9"), (5, 4, "1, 2, 4, 8 or 12")],
)
def test_other_count_pairs_are_a_configuration_error(
    num_paths: int, num_gpus: int, works: str
) -> None:
    """A pair of counts that splits unevenly is a ValueError naming both flags, the counts
    and the path counts that would work."""
    paths = [f"/p{i}" for i in range(num_paths)]
    with pytest.raises(ValueError) as raised:
        assign_paths(paths, num_gpus)
    message = str(raised.value)
    assert "--l2-disk " in message and "--l2-disk-sharding by_gpu" in message
    assert f"{num_paths} paths for {num_gpus} GPUs" in message
    assert f"e.g. {works} paths" in message


def test_no_paths_or_no_gpus_are_refused() -> None:
    """No paths names --l2-disk; a GPU count below 1 is refused too."""
    with pytest.raises(ValueError, match="--l2-disk needs at least one directory"):
        assign_paths([], 1)
    with pytest.raises(ValueError, match="GPU count >= 1"):
        assign_paths(["a"], 0)


def test_pick_path_spreads_chunks_over_the_group() -> None:
    """Chunks spread over every path of the group, roughly evenly."""
    group = ["a", "b", "c", "d"]
    counts = Counter(pick_path(group, i.to_bytes(32, "little")) for i in range(4000))
    assert set(counts) == set(group)
    assert min(counts.values()) > 800


def test_pick_path_is_stable_across_processes() -> None:
    """The pick does not depend on Python's per-process hash salt: another interpreter
    (with another PYTHONHASHSEED) picks the same paths."""
    group = ["a", "b", "c"]
    hashes = [bytes([i]) * 32 for i in range(30)]
    here = "".join(pick_path(group, h) for h in hashes)
    code = (
        "from kvflow.core.tiers.sharding import pick_path;"
        f"print(''.join(pick_path({group!r}, bytes([i]) * 32) for i in range(30)))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    ).stdout.strip()
    assert there == here
