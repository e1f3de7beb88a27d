"""What every store and retrieve shares: its state, its waves, its block-table rows.

A transfer (`CacheEngine.store` / `retrieve`) runs under its instance's lock through
`CacheEngine._transfer`, which owns the failure path: the instance's streams drained
once, then what the `Transfer` holds undone. The phases in between work on the
`Transfer` and enqueue copies in doubling waves (`run_waves`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvflow.core.engine.blend import PreparedStore
from kvflow.core.engine.instances import Instance
from kvflow.core.engine.layerwise import LayerSignal
from kvflow.core.engine.loads import Slot
from kvflow.core.engine.ops import Op
from kvflow.core.engine.request import RequestIds
from kvflow.core.engine.tiering import Fetched
from kvflow.core.engine.validation import requested_tokens
from kvflow.core.tiers.base import WritePlan


@dataclass(eq=False)
class Transfer:
    """One store or retrieve in progress: what its phases share and what a failure undoes.

    On failure `CacheEngine._transfer` drains the instance's streams, then runs
    `on_failure`, aborts `plan`, publishes the evictions of `untold`, and releases
    `pinned` and `staged`; on success it releases `pinned` and `staged` (the phases
    commit `plan` and tell `untold` themselves, clearing them).

    Lock rule: none of its own. A Transfer belongs to the thread running the op, which
    holds the instance's lock while it touches the instance (it gives the lock up only
    while it waits on L2, `CacheEngine._unlocked`); no other thread sees it.
    """

    inst: Instance
    op: Op
    request_id: str
    #: set by `CacheEngine._begin` once the arguments are checked
    ids: RequestIds = field(init=False)
    cache_salt: str | None = None
    #: a store's L1 write plan not committed yet (aborted on failure)
    plan: WritePlan | None = None
    #: a plan whose evictions are not published yet (published on failure too)
    untold: WritePlan | None = None
    #: L1 objects pinned for reading, and staged L2 loads being read (freed either way)
    pinned: list[Any] = field(default_factory=list)
    staged: list[Slot] = field(default_factory=list)
    #: further steps of a failure, after the drain (a layerwise retrieve's signal)
    on_failure: list[Callable[[], None]] = field(default_factory=list)
    #: a store's chunks being hashed for the blend index, recorded once it succeeded
    indexing: PreparedStore | None = None

    def hold(self, fetched: Fetched) -> Fetched:
        """Keep a fetch's pinned objects and staged loads until the end of the transfer (or
        `CacheEngine._release_hits`); returns `fetched`."""
        self.pinned.extend(fetched.pinned)
        self.staged.extend(fetched.staged)
        return fetched


@dataclass
class Copied:
    """What a retrieve copied so far: the hit prefix's chunk hashes, the chunks copied (not
    wholly skipped) and the tokens they write, and the hit chunks that came from L2.

    Lock rule: none; it belongs to the thread running the retrieve, like its Transfer.
    """

    hashes: list[bytes] = field(default_factory=list)
    chunks: int = 0
    tokens: int = 0
    from_l2: int = 0

    def add(self, chunks: int, tokens: int) -> None:
        self.chunks += chunks
        self.tokens += tokens

    def attrs(self, chunk_size: int, chunk_nbytes: int) -> dict[str, Any]:
        """RETRIEVE_END's attrs (chunk_hashes: the hit prefix, for kvflow whatif)."""
        return {
            "tokens": self.tokens,
            "bytes": self.chunks * chunk_nbytes,
            "hit_tokens": len(self.hashes) * chunk_size,
            "chunks": self.chunks,
            "l2_chunks": self.from_l2,
            "chunk_hashes": self.hashes,
        }


class LayerProgress:
    """A layerwise retrieve's signal, remembering the first layer not signalled yet so a
    failure tells the engine exactly which layers never land.

    Lock rule: none; the mover calls `ready` on the thread running the retrieve, which
    also calls `failed`.
    """

    def __init__(self, signal: LayerSignal, after_first: Callable[[], None] | None = None):
        """`after_first()` runs once, right after the first layer is signalled (or at
        `finish` if none was)."""
        self.signal = signal
        self.next = 0
        self._after_first = after_first

    def ready(self, layer: int, stream: Any) -> None:
        self.signal.ready(layer, stream)
        self.next = layer + 1
        self.finish()

    def finish(self) -> None:
        """Run `after_first` unless it ran."""
        then, self._after_first = self._after_first, None
        if then is not None:
            then()

    def failed(self) -> None:
        self.signal.failed(self.next)


def run_waves(n_chunks: int, head: int, wave: Callable[[int, int], bool]) -> None:
    """Call `wave(first, stop)` over chunks [0, n_chunks) in doubling waves: the first
    `head` chunks alone, then each wave as many chunks as all before it, so a wave's host
    work (ids, hashes, planning) runs while the copies of the chunks before it drain.
    Stops after a wave that returns False (it came up short) or reached the end; a
    request of no chunks gets one empty wave."""
    first, stop = 0, min(n_chunks, head)
    while wave(first, stop) and stop < n_chunks:
        first, stop = stop, min(n_chunks, 2 * stop)


def rows_of(table: np.ndarray, rows: list[int]) -> np.ndarray:
    """table[rows] for ascending rows: a view when they are one contiguous run."""
    if rows and rows[-1] - rows[0] == len(rows) - 1:
        return table[rows[0] : rows[-1] + 1]
    return table[np.asarray(rows, dtype=np.intp)]


def written_chunks(
    first: int, stop: int, skip_blocks: int, blocks_per_chunk: int
) -> tuple[list[int], list[int]]:
    """Of chunks [first, stop), those a retrieve writes (not wholly within the skipped
    blocks), and how many leading blocks of each it leaves alone."""
    rows: list[int] = []
    skips: list[int] = []
    for c in range(first, stop):
        s = min(max(skip_blocks - c * blocks_per_chunk, 0), blocks_per_chunk)
        if s < blocks_per_chunk:
            rows.append(c)
            skips.append(s)
    return rows, skips


def transfer_attrs(inst: Instance, token_ids: Any) -> dict[str, Any]:
    """A store's or retrieve's START attrs."""
    return {
        "instance_id": inst.instance_id,
        "model_name": inst.model_name,
        "tokens": requested_tokens(token_ids),
    }


def written_tokens(skips: Sequence[int], blocks_per_chunk: int, block_size: int) -> int:
    """Tokens a retrieve writes into chunks that leave `skips` leading blocks alone."""
    return sum(blocks_per_chunk - s for s in skips) * block_size
