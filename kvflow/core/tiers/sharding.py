"""Which disk paths an L2 object goes to (`--l2-disk-sharding by_gpu`).

Each GPU owns a contiguous group of the configured paths (several GPUs may share one
path); within its group a chunk's path is picked by a stable hash of the chunk, so a
key lands on the same path in every process and after every restart.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def assign_paths(paths: Sequence[str], num_gpus: int) -> list[list[str]]:
    """Each GPU's group of paths (index = GPU): one path per GPU when the counts are
    equal, contiguous GPUs sharing a path when there are fewer paths, a contiguous group
    per GPU when there are more; ValueError for any other pair of counts."""
    if not paths:
        raise ValueError("--l2-disk needs at least one directory")
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"the disk tier needs a GPU count >= 1, got {num_gpus!r}")
    num_paths = len(paths)
    if num_paths <= num_gpus and num_gpus % num_paths == 0:
        share = num_gpus // num_paths
        return [[paths[gpu // share]] for gpu in range(num_gpus)]
    if num_paths > num_gpus and num_paths % num_gpus == 0:
        per_gpu = num_paths // num_gpus
        return [list(paths[gpu * per_gpu : (gpu + 1) * per_gpu]) for gpu in range(num_gpus)]
    raise ValueError(
        f"--l2-disk lists {num_paths} paths for {num_gpus} GPUs, which "
        "--l2-disk-sharding by_gpu cannot split evenly: give a number of paths that "
        f"divides {num_gpus} (GPUs share a path) or is a multiple of it (each GPU gets "
        f"its own group), e.g. {_counts_that_work(num_gpus)} paths"
    )


def pick_path(group: Sequence[str], chunk_hash: bytes) -> str:
    """The path of `group` that holds a chunk: a stable hash of the chunk, not Python's
    per-process salted hash()."""
    if not group:
        raise ValueError("pick_path needs a non-empty group of paths")
    return group[xxhash.xxh3_64_intdigest(chunk_hash) % len(group)]


def _counts_that_work(num_gpus: int) -> str:
    divisors = [n for n in range(1, num_gpus + 1) if num_gpus % n == 0]
    counts = [*divisors, 2 * num_gpus, 3 * num_gpus]
    return ", ".join(str(n) for n in counts[:-1]) + f" or {counts[-1]}"
