"""The CPU mover's copy: `np.copyto` for arrays of one shape and item size, each contiguous
run copied in vector blocks by kvflow's C loop (csrc/strided_copy.c), without the GIL; a
copy of 128 KiB or more with streaming stores, which skip reading the destination first.

numpy's strided loop (and glibc's memcpy of each run) moved the short runs of a layout
change (an SGLang `page_first` page into a layer-major chunk: 2 KiB rows at 16-64 KiB
strides) at 5.5-6.2 GB/s on one core of one host; the C loop at 9.7-10, streamed 10-10.5
(docs/SGLANG.md, Cost of the extra hop).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

_log = logging.getLogger(__name__)

#: the C source and its module's name
SOURCE = Path(__file__).parents[1] / "csrc" / "strided_copy.c"
MODULE = "_kvflow_copy"

CopyTo = Callable[[np.ndarray, np.ndarray], object]


@functools.cache
def strided_copyto() -> CopyTo:
    """`copyto(dst, src)` of the C extension, built on first use; `np.copyto` where it
    cannot be built (no C compiler or Python headers), with a warning."""
    # imported here: building needs nothing else of the events package (bus, CUDA)
    from kvflow.events.native import Extension, NativeBuildError, load_library

    try:
        copyto: CopyTo = load_library(extension=Extension(MODULE, (SOURCE,))).copyto
    except (NativeBuildError, OSError) as exc:
        _log.warning("CPU caches copy through numpy's strided loop (slower): %s", exc)
        return np.copyto
    return copyto
