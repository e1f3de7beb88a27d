"""The by_gpu sharding's refusals say exactly what is wrong (mutation testing,
docs/TESTING.md: their messages were unchecked)."""

from __future__ import annotations

import re

import pytest

from kvflow.core.tiers.sharding import assign_paths, pick_path


def test_no_paths_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^--l2-disk needs at least one directory$"):
        assign_paths([], 2)


def test_an_uneven_split_says_which_counts_work() -> None:
    expected = (
        "--l2-disk lists 3 paths for 2 GPUs, which --l2-disk-sharding by_gpu cannot split "
        "evenly: give a number of paths that divides 2 (GPUs share a path) or is a multiple "
        "of it (each GPU gets its own group), e.g. 1, 2, 4 or 6 paths"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        assign_paths(["a", "b", "c"], 2)


def test_an_empty_group_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^pick_path needs a non-empty group of paths$"):
        pick_path([], b"chunk")
