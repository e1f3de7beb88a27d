"""Id arrays: token and block ids from any user type to one contiguous little-endian int32 array.

Used by the engine (keys are hashed over int32 LE bytes) and by the wire protocol
(ids travel as raw int32 frames), so both accept and reject exactly the same input.
"""

from __future__ import annotations

import array
import functools
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kvflow.core.errors import InvalidRequestError

_log = logging.getLogger(__name__)

INT32_LE = np.dtype("<i4")
_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1
#: the array module's 4-byte type codes. Both refuse non-integers and values out of their
#: range; the unsigned one converts each int with one C call, the signed one parses a
#: format string per item (~3x slower), so it is kept for sequences with negative ids.
_ARRAY_UINT32 = next(code for code in "IL" if array.array(code).itemsize == 4)
_ARRAY_INT32 = next(code for code in "il" if array.array(code).itemsize == 4)
#: the C loop that converts lists and tuples of plain ints, and its module's name
IDS_SOURCE = Path(__file__).with_name("csrc") / "int32_ids.c"
IDS_MODULE = "_kvflow_ids"


def as_int32_array(values: Any, what: str) -> np.ndarray:
    """`values` (list, tuple, numpy array or torch tensor of integers) as 1-D int32 LE.

    Raises InvalidRequestError naming `what` for strings, non-integers, a wrong
    number of dimensions or values outside int32.
    """
    if isinstance(values, (str, bytes)):
        raise InvalidRequestError(f"{what} must be a sequence of integers, got a string")
    if isinstance(values, (list, tuple)) and values:
        fast = _plain_ints_int32(values)
        if fast is None:
            fast = _sequence_int32(values)
        if fast is not None:
            return fast
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor
        values = values.detach().cpu().numpy()
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{what} must be a sequence of integers: {exc}") from None
    if arr.ndim != 1:
        raise InvalidRequestError(f"{what} must be 1-D (one-dimensional), got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=INT32_LE)
    if arr.dtype.kind not in "iu":
        raise InvalidRequestError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.dtype != INT32_LE:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise InvalidRequestError(f"{what} must fit in int32, got values in [{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype=INT32_LE)


@functools.cache
def ids_extension() -> ModuleType | None:
    """The id-list C extension, built on first use; None where it cannot be built (no C
    compiler or Python headers): lists then go through the array module's loops."""
    # imported here: converting ids needs nothing else of the events package (bus, CUDA)
    from kvflow.events.native import Extension, NativeBuildError, load_library

    try:
        return load_library(extension=Extension(IDS_MODULE, (IDS_SOURCE,)))
    except (NativeBuildError, OSError) as exc:
        _log.warning("id lists convert through the array module (slower): %s", exc)
        return None


def _plain_ints_int32(values: list[Any] | tuple[Any, ...]) -> np.ndarray | None:
    """`values` as int32 LE through kvflow's C loop when every item is a plain int within
    int32 (the common case, ~3x faster than the array module); None otherwise."""
    native = ids_extension()
    if native is None:
        return None
    out = np.empty(len(values), dtype="=i4")
    if native.int32_into(values, out) != -1:
        return None
    return out.astype(INT32_LE, copy=False)


def _sequence_int32(values: list[Any] | tuple[Any, ...]) -> np.ndarray | None:
    """`values` as int32 LE through one array-module C loop (docs/PERFORMANCE.md, RPC), or
    None for a value that is no integer or outside int32: numpy's path then names it."""
    try:
        unsigned = np.frombuffer(array.array(_ARRAY_UINT32, values), dtype=f"={_ARRAY_UINT32}")
    except TypeError:
        return None
    except OverflowError:  # a negative value, or one from 2**32 (the signed code refuses it)
        try:
            signed = np.frombuffer(array.array(_ARRAY_INT32, values), dtype=f"={_ARRAY_INT32}")
        except (TypeError, OverflowError):
            return None
        return signed.astype(INT32_LE, copy=False)
    if unsigned.max() > _INT32_MAX:
        return None
    return unsigned.astype("<u4", copy=False).view(INT32_LE)
