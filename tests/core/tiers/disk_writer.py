"""Disk-tier work for the fault tests to run in a process of its own: a writer that stores
until it is killed, and a fill of a directory until the disk (or the file-size limit)
refuses more.

Run as `python disk_writer.py write DIR NBYTES` or
`python disk_writer.py fill DIR FSIZE_LIMIT` (prints the fill report as JSON).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from typing import Any

import torch

from kvflow.core.tiers import diskfile
from kvflow.core.tiers.base import ObjectKey
from kvflow.core.tiers.disk import DiskTier

#: payload sizes a fill stores, one object each: a 256 KiB tmpfs or a 100 KiB file-size
#: limit takes the first ones and refuses the last
FILL_SIZES = [32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10]


def object_key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "little"), "writer/model", 1, 0, None)


def object_bytes(i: int, nbytes: int) -> torch.Tensor:
    """Object i's payload: pseudo-random bytes any process can make again."""
    gen = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def temporary_files(root: str) -> list[str]:
    """The temporary (half-written) object files under a disk path."""
    return [
        os.path.join(d, name)
        for d, _, names in os.walk(root)
        for name in names
        if name.endswith(diskfile.TMP_SUFFIX)
    ]


def keep_writing(root: str, nbytes: int) -> None:
    """Store objects 0, 1, 2, ... in batches of four, printing how many are whole."""
    tier = DiskTier([root], 1 << 40)
    i = 0
    while True:
        items = [(object_key(j), object_bytes(j, nbytes)) for j in range(i, i + 4)]
        tier.store(items).result()
        i += 4
        print(f"stored {i}", flush=True)


def fill(root: str) -> dict[str, Any]:
    """Store FILL_SIZES objects one by one, then check what a full disk left behind: the
    outcome, the counters, temporary files, the stored objects' bytes, and whether the
    tier stores again once room is made."""
    tier = DiskTier([root], 1 << 30, io_threads_per_path=1)
    try:
        outcomes = [
            tier.store([(object_key(i), object_bytes(i, n))]).result(timeout=10)
            for i, n in enumerate(FILL_SIZES)
        ]
        stored = [i for i, o in enumerate(outcomes) if o.stored]
        loaded_ok = 0
        for i in stored:
            dst = torch.empty(FILL_SIZES[i], dtype=torch.uint8)
            ok = tier.load([object_key(i)], [dst]).result(timeout=10) == [True]
            loaded_ok += ok and torch.equal(dst, object_bytes(i, FILL_SIZES[i]))
        stats = tier.stats()
        tmp_files = temporary_files(root)
        tier.drop_where(lambda key: True)
        again = tier.store([(object_key(99), object_bytes(99, FILL_SIZES[0]))]).result(timeout=10)
        return {
            "stored": len(stored),
            "failed": sum(o.failed for o in outcomes),
            "store_failures": stats["store_failures"],
            "objects": stats["objects"],
            "tmp_files": tmp_files,
            "loaded_ok": loaded_ok,
            "stored_after_drop": again.stored,
            "last_error": tier.describe()["paths"][0]["last_error"],
        }
    finally:
        tier.close()


def main(argv: list[str]) -> None:
    mode, root = argv[0], argv[1]
    if mode == "write":
        keep_writing(root, int(argv[2]))
    elif mode == "fill":
        limit = int(argv[2])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so a write past the limit is EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        print(json.dumps(fill(root)))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
