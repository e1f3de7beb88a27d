"""A request as it arrives on a server's client socket: checked against the message
limits, decoded, and its client id bound to the CURVE key that sent it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import zmq

from kvflow.core.errors import ProtocolError
from kvflow.core.server.protocol import Request, decode_request

#: most frames a request may have (a header and its payloads)
MAX_FRAMES = 8


def read_request(
    frames: Sequence[zmq.Frame], max_bytes: int, curve: bool
) -> tuple[Request, tuple[np.ndarray, ...]]:
    """The request in `frames` (a ROUTER's message without its identity) and its payload
    arrays; ProtocolError when it has too many frames or bytes or does not decode. With
    `curve`, the client id becomes "KEY CLIENT_ID": ZAP authenticated the key, so no
    other client can claim that id."""
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"message has {len(frames)} frames, at most {MAX_FRAMES}")
    size = sum(len(f) for f in frames)
    if size > max_bytes:
        raise ProtocolError(
            f"message of {size} bytes exceeds the server's limit of {max_bytes}"
            " bytes (--max-message-mb)"
        )
    request, arrays = decode_request([f.buffer for f in frames])
    if curve:
        request.client = f"{frames[0].get('User-Id')} {request.client}"
    return request, arrays
