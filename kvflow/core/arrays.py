"""Id arrays: token and block ids from any user type to one contiguous little-endian int32 array.

Used by the engine (keys are hashed over int32 LE bytes) and by the wire protocol
(ids travel as raw int32 frames), so both accept and reject exactly the same input.
"""

from __future__ import annotations

import array
from typing import Any

import numpy as np

from kvflow.core.errors import InvalidRequestError

INT32_LE = np.dtype("<i4")
_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1
#: the array module's 4-byte signed type code: lists convert in one C loop that refuses
#: non-integers and values outside int32 (numpy's conversion of a list is ~1.5x slower)
_ARRAY_INT32 = next(code for code in "ilh" if array.array(code).itemsize == 4)


def as_int32_array(values: Any, what: str) -> np.ndarray:
    """`values` (list, tuple, numpy array or torch tensor of integers) as 1-D int32 LE.

    Raises InvalidRequestError naming `what` for strings, non-integers, a wrong
    number of dimensions or values outside int32.
    """
    if isinstance(values, (str, bytes)):
        raise InvalidRequestError(f"{what} must be a sequence of integers, got a string")
    if isinstance(values, (list, tuple)) and values:
        try:
            fast = np.frombuffer(array.array(_ARRAY_INT32, values), dtype=f"={_ARRAY_INT32}")
        except (TypeError, OverflowError):
            pass  # a bad value: numpy's path below names what was wrong
        else:
            return fast.astype(INT32_LE, copy=False)
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
