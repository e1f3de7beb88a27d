"""Block-id KV transfer kernels (PyCUDA) with a torch CPU reference.

Knows nothing of servers or events: of kvflow it imports only `kvflow.cuda`. Importing
it never needs pycuda or a GPU: the CUDA backend loads lazily on first use.
"""

from kvflow.kernels.formats import KVFormat, detect_format
from kvflow.kernels.idbuffer import IdBuffer
from kvflow.kernels.layout import SUPPORTED_DTYPES, KVLayout, LayerGroup, StrideDesc
from kvflow.kernels.loader import cuda_available
from kvflow.kernels.rope import rerotate
from kvflow.kernels.rope_params import (
    LayerRopes,
    LinearScaling,
    Llama3Scaling,
    Pairing,
    RerotateSegment,
    RopeParams,
)
from kvflow.kernels.streams import (
    TransferStream,
    current_stream_handle,
    default_transfer_stream,
    new_transfer_stream,
)
from kvflow.kernels.transfer import LayoutKernels, PreparedTransfer, transfer_blocks

__all__ = [
    "SUPPORTED_DTYPES",
    "IdBuffer",
    "KVFormat",
    "KVLayout",
    "LayerGroup",
    "LayerRopes",
    "LayoutKernels",
    "LinearScaling",
    "Llama3Scaling",
    "Pairing",
    "PreparedTransfer",
    "RerotateSegment",
    "RopeParams",
    "StrideDesc",
    "TransferStream",
    "cuda_available",
    "current_stream_handle",
    "default_transfer_stream",
    "detect_format",
    "new_transfer_stream",
    "rerotate",
    "transfer_blocks",
]
