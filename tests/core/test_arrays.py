"""Id arrays: lists and tuples take the one-C-loop path and give what numpy's path gives."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.core.arrays import INT32_LE, as_int32_array
from kvflow.core.errors import InvalidRequestError

EDGES = [-(2**31), -1, 0, 1, 2**31 - 1]


@pytest.mark.parametrize("values", [EDGES, tuple(EDGES), [np.int64(v) for v in EDGES]])
def test_a_list_or_tuple_converts_to_the_same_int32_array_as_numpy(values: object) -> None:
    got = as_int32_array(values, "token_ids")
    assert got.dtype == INT32_LE and got.flags.c_contiguous
    assert got.tolist() == EDGES
    assert np.array_equal(got, np.asarray(EDGES, dtype=INT32_LE))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([1, 2**31], r"^token_ids must fit in int32, got values in \[1, 2147483648\]$"),
        ((-(2**31) - 1, 0), r"^token_ids must fit in int32"),
        ([1, 2.5], r"^token_ids must hold integers, got dtype float64$"),
        ([1, None], r"^token_ids must hold integers, got dtype object$"),
        ([[1], [2]], r"^token_ids must be 1-D"),
    ],
)
def test_a_bad_list_is_refused_with_the_error_numpy_would_name(bad: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        as_int32_array(bad, "token_ids")


def test_an_empty_list_is_an_empty_int32_array() -> None:
    got = as_int32_array([], "token_ids")
    assert got.dtype == INT32_LE and len(got) == 0
