"""A store/retrieve request's token and block ids, converted and checked in chunk ranges.

Converting ids given as Python lists costs tens of nanoseconds each: milliseconds for
a long prompt with one-token pages. A store converts its first chunks' ids, starts
their copies, and converts the rest while those run (`kvflow.core.engine.cache_engine`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvflow.core.arrays import INT32_LE, as_int32_array
from kvflow.core.errors import InvalidRequestError
from kvflow.kernels import KVLayout


def _length(values: Any, what: str) -> int:
    """len(values), or InvalidRequestError naming `what` when it has none."""
    if isinstance(values, (str, bytes)):
        raise InvalidRequestError(f"{what} must be a sequence of integers, got a string")
    try:
        return len(values)
    except TypeError:
        raise InvalidRequestError(
            f"{what} must be a 1-D sequence of integers, got {type(values).__name__}"
        ) from None


class _Ids:
    """One id array of a request, converted into `out` a range of chunks at a time."""

    def __init__(
        self, values: Any, what: str, per_chunk: int, n_chunks: int,
        check: Callable[[np.ndarray], None] | None = None,
    ) -> None:  # fmt: skip
        self.values = values
        self.what = what
        self.per_chunk = per_chunk
        self.n_chunks = n_chunks
        self.check = check
        self.out = np.empty(n_chunks * per_chunk, dtype=INT32_LE)
        self.done = 0  # chunks converted
        self.complete = False  # every id, the partial chunk's too, converted and checked

    def upto(self, n_chunks: int) -> None:
        if self.complete or (n_chunks <= self.done and n_chunks < self.n_chunks):
            return
        pc = self.per_chunk
        a, b = self.done, min(n_chunks, self.n_chunks)
        last = b == self.n_chunks
        ids = as_int32_array(_part(self.values, a * pc, b * pc, last), self.what)
        ids = ids[: (b - a) * pc]
        if self.check is not None:
            self.check(ids)
        self.out[a * pc : b * pc] = ids
        self.done = b
        self.complete = last


class RequestIds:
    """Token ids and the block table of a request's full chunks, converted on demand.

    `tokens[: n * chunk_size]` is valid once `convert_tokens(n)` (or `convert(n)`)
    returned, `table[:n]` once `convert_blocks(n)` did. The block count is checked at
    construction; reaching the last chunk (even of none) also checks the ids after it.
    """

    def __init__(
        self, token_ids: Any, block_ids: Any, *, chunk_size: int, layout: KVLayout,
        blocks_per_chunk: int,
    ) -> None:  # fmt: skip
        n_tokens = _length(token_ids, "token_ids")
        n_blocks = _length(block_ids, "block_ids")
        self.n_chunks = n_tokens // chunk_size
        bs = layout.block_size
        need = self.n_chunks * blocks_per_chunk
        if n_blocks < need:
            raise InvalidRequestError(
                f"block_ids has {n_blocks} blocks ({n_blocks * bs} tokens) but the "
                f"{self.n_chunks} full chunk(s) of token_ids need {need} blocks of {bs}"
            )
        self._layout = layout
        self._tokens = _Ids(token_ids, "token_ids", chunk_size, self.n_chunks)
        self._blocks = _Ids(block_ids, "block_ids", blocks_per_chunk, self.n_chunks,
                            self._check_blocks)  # fmt: skip
        self.tokens = self._tokens.out
        self.table = self._blocks.out.reshape(self.n_chunks, blocks_per_chunk)
        self._distinct = False  # check_distinct passed
        #: the chunk keys of a request addressed by keys (chunk_keys.py), not by its tokens
        self.hashes: Sequence[bytes] | None = None

    def _check_blocks(self, ids: np.ndarray) -> None:
        try:
            self._layout.validate_block_ids(ids)
        except ValueError as exc:
            raise InvalidRequestError(f"block_ids: {exc}") from None

    def convert_tokens(self, n_chunks: int) -> None:
        """Convert and check the token ids of the first n_chunks chunks."""
        self._tokens.upto(n_chunks)

    def convert_blocks(self, n_chunks: int) -> None:
        """Convert and check the block ids of the first n_chunks chunks."""
        self._blocks.upto(n_chunks)

    def convert(self, n_chunks: int) -> None:
        """Both, tokens first."""
        self._tokens.upto(n_chunks)
        self._blocks.upto(n_chunks)

    def check_distinct(self, skip_blocks: int) -> None:
        """InvalidRequestError if the full chunks' blocks after the first `skip_blocks`
        repeat an id: a retrieve writing them would write one block twice. Checked over
        the whole table at once (the first call), since a retrieve writes it in waves."""
        if self._distinct:
            return
        self._blocks.upto(self.n_chunks)
        repeated = self._layout.repeated_block(self._blocks.out[skip_blocks:])
        if repeated is not None:
            raise InvalidRequestError(
                f"block_ids repeat block {repeated}, which a retrieve would write twice"
            )
        self._distinct = True


def _part(values: Any, start: int, stop: int, to_end: bool) -> Any:
    """values[start:stop] (or values[start:]), for any sliceable sequence."""
    try:
        return values[start : None if to_end else stop]
    except (TypeError, KeyError, IndexError) as exc:
        raise InvalidRequestError(f"ids must be a sliceable sequence of integers: {exc}") from None
