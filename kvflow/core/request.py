"""A store/retrieve request's token and block ids, converted and checked in chunk ranges.

Converting ids given as Python lists costs tens of nanoseconds each: milliseconds for
a long prompt with one-token pages. A store converts its first chunks' ids, starts
their copies, and converts the rest while those run (`kvflow.core.engine`).
"""

from __future__ import annotations

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


class RequestIds:
    """Token ids and the block table of a request's full chunks, filled by `convert`.

    `tokens[: n * chunk_size]` and `table[:n]` are valid once `convert(n)` returned.
    The block count is checked at construction; every id (the partial chunk's too)
    has been checked once the last chunk is converted.
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
        self._token_ids = token_ids
        self._block_ids = block_ids
        self._chunk_size = chunk_size
        self._per_chunk = blocks_per_chunk
        self._layout = layout
        self.tokens = np.empty(self.n_chunks * chunk_size, dtype=INT32_LE)
        self.table = np.empty((self.n_chunks, blocks_per_chunk), dtype=INT32_LE)
        self.converted = 0
        self._complete = False

    def convert(self, n_chunks: int) -> None:
        """Convert and check the ids of chunks [converted, n_chunks); reaching the last
        chunk (even of none) also checks the ids after it."""
        if self._complete or (n_chunks <= self.converted and n_chunks < self.n_chunks):
            return
        cs, bpc = self._chunk_size, self._per_chunk
        a, b = self.converted, n_chunks
        last = b >= self.n_chunks
        tokens = as_int32_array(_part(self._token_ids, a * cs, b * cs, last), "token_ids")
        blocks = as_int32_array(_part(self._block_ids, a * bpc, b * bpc, last), "block_ids")
        rows = blocks[: (b - a) * bpc]
        try:
            self._layout.validate_block_ids(rows)
        except ValueError as exc:
            raise InvalidRequestError(f"block_ids: {exc}") from None
        self.tokens[a * cs : b * cs] = tokens[: (b - a) * cs]
        self.table[a:b] = rows.reshape(b - a, bpc)
        self.converted = b
        self._complete = last


def _part(values: Any, start: int, stop: int, to_end: bool) -> Any:
    """values[start:stop] (or values[start:]), for any sliceable sequence."""
    try:
        return values[start : None if to_end else stop]
    except (TypeError, KeyError, IndexError) as exc:
        raise InvalidRequestError(f"ids must be a sliceable sequence of integers: {exc}") from None
