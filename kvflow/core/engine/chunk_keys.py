"""Requests addressed by chunk keys the engine hashed itself, instead of by token ids.

SGLang's hierarchical cache names each page by its own hash chain and hands its storage
tier only those names, never the tokens. Such a request carries one 32-byte key per
chunk; kvflow uses them where it would have hashed the tokens (docs/ENGINE.md, Keys) and
keeps the rest of the object key (model, world size, rank, salt) as for any request. The
keys are opaque here: the client must separate them from token-chain keys (it hashes
its names with a label of its own, as `kvflow.integrations.sglang` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvflow.core.arrays import INT32_LE
from kvflow.core.errors import InvalidRequestError

#: bytes of one chunk key (a blake3 digest, like the token-chain keys)
KEY_BYTES = 32


def check_chunk_keys(chunk_keys: Any, chunk_size: int, max_tokens: int) -> list[bytes]:
    """The keys as a list, each 32 bytes, their chunks within `max_tokens`; else
    InvalidRequestError naming what was wrong. Nothing is allocated before the count
    is checked."""
    if isinstance(chunk_keys, (str, bytes)) or not isinstance(chunk_keys, Sequence):
        raise InvalidRequestError(
            f"chunk_keys must be a sequence of {KEY_BYTES}-byte keys, got {type(chunk_keys).__name__}"
        )
    if len(chunk_keys) * chunk_size > max_tokens:
        raise InvalidRequestError(
            f"chunk_keys holds {len(chunk_keys)} keys of {chunk_size} tokens each, more than the "
            f"{max_tokens} tokens (MAX_REQUEST_TOKENS) a request may carry"
        )
    keys = list(chunk_keys)
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidRequestError(
                f"chunk_keys[{i}] must be {KEY_BYTES} bytes, got "
                + (f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__)
            )
    return keys


def placeholder_tokens(n_keys: int, chunk_size: int) -> np.ndarray:
    """Token ids standing in for `n_keys` whole chunks (zeros, one read-only zero-stride
    array: no memory per token), so request checks and block tables work unchanged."""
    return np.broadcast_to(np.zeros(1, dtype=INT32_LE), (n_keys * chunk_size,))


def keys_to_wire(chunk_keys: Sequence[bytes]) -> np.ndarray:
    """The keys as one int32 payload array (KEY_BYTES // 4 values per key)."""
    return np.frombuffer(b"".join(chunk_keys), dtype=INT32_LE)


def keys_from_wire(payload: np.ndarray) -> list[bytes]:
    """The keys of a payload made by `keys_to_wire`; InvalidRequestError if it is not a
    whole number of keys."""
    raw = payload.astype(INT32_LE, copy=False).tobytes()
    if len(raw) % KEY_BYTES:
        raise InvalidRequestError(
            f"chunk_keys payload has {len(raw)} bytes, not a whole number of {KEY_BYTES}-byte keys"
        )
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]
