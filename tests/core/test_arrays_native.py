"""Id lists through kvflow's C loop (csrc/int32_ids.c): plain ints convert there, anything
else is handed back by index to the array module's and numpy's paths, and a machine that
cannot build the loop still converts every list the same way."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest

from kvflow.core import arrays
from kvflow.core.arrays import INT32_LE, as_int32_array, ids_extension
from kvflow.events import native

needs_cc = pytest.mark.needs("cc", why="the id-list loop is a C extension built here")
#: int32's ends, and the ends of one-digit ints (read in place) and of two-digit ones
EDGES = [0, 1, -1, 2**31 - 1, -(2**31), 127_999, 2**30 - 1, 2**30, 1 - 2**30, -(2**30)]


@pytest.fixture
def rebuilt_extension() -> Iterator[None]:
    """Forget the loaded extension before and after the test (it is cached per process)."""
    ids_extension.cache_clear()
    yield
    ids_extension.cache_clear()


@needs_cc
@pytest.mark.parametrize("container", [list, tuple])
def test_plain_ints_convert_in_the_c_loop_alone(
    container: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list or tuple of plain ints, int32's edges included, never reaches the array
    module's path: the C loop alone gives the values, as an owned writable `<i4` array."""

    def no_fallback(values: object) -> None:
        raise AssertionError("the array module's path ran for plain ints")

    monkeypatch.setattr(arrays, "_sequence_int32", no_fallback)
    values = [*range(50_000), *EDGES]
    got = as_int32_array(container(values), "token_ids")
    assert got.dtype.str == "<i4" and got.flags.writeable and got.flags.owndata
    assert got.tolist() == values


@needs_cc
@pytest.mark.parametrize(
    ("item", "why"),
    [
        (True, "a bool is an int subclass"),
        (np.int64(5), "a numpy scalar"),
        (2**31, "above int32"),
        (-(2**31) - 1, "below int32"),
        (2**70, "beyond a C long"),
        (2.0, "a float"),
        ("3", "a string"),
    ],
)
def test_the_loop_hands_back_the_first_item_it_cannot_take(item: object, why: str) -> None:
    """The index returned is the first item that is not a plain int within int32 (so the
    caller converts the whole list another way, which accepts or names it)."""
    loop = ids_extension()
    assert loop is not None
    out = np.empty(4, dtype="=i4")
    assert loop.int32_into([7, 8, item, 9], out) == 2, why
    assert loop.int32_into((7, 8, 9, 10), out) == -1 and out.tolist() == [7, 8, 9, 10]


@needs_cc
def test_the_loop_refuses_a_wrong_container_or_buffer() -> None:
    """Only lists and tuples, and an output of exactly four bytes per item, writable."""
    loop = ids_extension()
    assert loop is not None
    with pytest.raises(TypeError, match="needs a list or a tuple, got range"):
        loop.int32_into(range(3), np.empty(3, dtype="=i4"))
    with pytest.raises(ValueError, match="3 items need 12 bytes, out has 8"):
        loop.int32_into([1, 2, 3], np.empty(2, dtype="=i4"))
    with pytest.raises(BufferError):
        loop.int32_into([1, 2, 3], bytes(12))


def test_without_a_compiler_lists_convert_the_same_way(
    rebuilt_extension: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: object,
) -> None:
    """Where the loop cannot be built, a warning says why and every list converts (and
    every bad one is refused) exactly as through the loop."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "find_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger="kvflow.core.arrays"):
        assert ids_extension() is None
        got = as_int32_array([*EDGES, True, np.int16(3)], "token_ids")
    assert got.dtype == INT32_LE and got.tolist() == [*EDGES, 1, 3]
    assert "no C compiler found" in caplog.text
    with pytest.raises(arrays.InvalidRequestError, match="must fit in int32"):
        as_int32_array([1, 2**31], "token_ids")
