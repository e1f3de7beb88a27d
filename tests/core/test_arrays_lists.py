"""Id arrays from Python lists and tuples (the array module's C loops: unsigned when no
id is negative, signed otherwise): a bad value anywhere in a long list is refused with
numpy's message, and the result is the caller's own writable int32 LE array."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.core.arrays import INT32_LE, as_int32_array
from kvflow.core.errors import InvalidRequestError

LONG = list(range(100_000, 110_000))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (2.5, r"^token_ids must hold integers, got dtype float64$"),
        (np.float64(3.0), r"^token_ids must hold integers, got dtype float64$"),
        ("7", r"^token_ids must hold integers, got dtype <U"),
        (None, r"^token_ids must hold integers, got dtype object$"),
        (2**31, r"^token_ids must fit in int32, got values in \[100000, 2147483648\]$"),
        (2**32 - 1, r"^token_ids must fit in int32, got values in \[100000, 4294967295\]$"),
        (2**32, r"^token_ids must fit in int32, got values in \[100000, 4294967296\]$"),
        (-(2**31) - 1, r"^token_ids must fit in int32, got values in \[-2147483649, 109999\]$"),
    ],
)
@pytest.mark.parametrize("container", [list, tuple])
def test_one_bad_value_at_the_end_of_a_long_sequence_is_named(
    bad: object, message: str, container: type
) -> None:
    """Neither a float nor a string is truncated or parsed, nor is an out-of-range int
    wrapped: the error says which rule the values broke."""
    with pytest.raises(InvalidRequestError, match=message):
        as_int32_array(container([*LONG, bad]), "token_ids")


@pytest.mark.parametrize("container", [list, tuple])
def test_negative_numpy_and_bool_items_convert_like_python_ints(container: type) -> None:
    """Negative ids (the signed path) and items with __index__ (numpy integers, bools)
    are integers; each keeps its value, with or without a negative one among them."""
    values = [np.int64(-(2**31)), np.uint16(7), True, np.int32(2**31 - 1), 0]
    assert as_int32_array(container(values), "token_ids").tolist() == [-(2**31), 7, 1, 2**31 - 1, 0]
    assert as_int32_array(container(values[1:]), "token_ids").tolist() == [7, 1, 2**31 - 1, 0]
    assert as_int32_array(container([*LONG, -1]), "token_ids")[-2:].tolist() == [109_999, -1]


def test_a_long_list_converts_to_a_fresh_writable_little_endian_array() -> None:
    """The values, in order, as a contiguous, writable, owned `<i4` array: a caller may
    change it without touching anything else."""
    got = as_int32_array(LONG, "token_ids")
    assert got.dtype == INT32_LE and got.dtype.str == "<i4"
    assert got.flags.c_contiguous and got.flags.writeable
    assert np.array_equal(got, np.arange(100_000, 110_000))
    got[0] = -1
    assert as_int32_array(LONG, "token_ids")[0] == 100_000
