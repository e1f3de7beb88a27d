"""The wire protocol: typed headers, raw int32 payload frames, versioning, hostile bytes."""

from __future__ import annotations

import contextlib

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.core.arrays import as_int32_array
from kvflow.core.errors import InvalidRequestError, ProtocolError
from kvflow.core.server.protocol import (
    PROTOCOL_VERSION,
    AllocationRecord,
    Done,
    EndSession,
    Failed,
    Heartbeat,
    KVCachesDesc,
    Lookup,
    Register,
    Registered,
    ReportAllocations,
    Retrieve,
    ShmMemory,
    Status,
    StatusResult,
    Store,
    TensorDesc,
    Unregister,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    peek_id,
)

TAGS = [
    "register",
    "lookup",
    "store",
    "retrieve",
    "end_session",
    "report_allocations",
    "unregister",
    "status",
    "heartbeat",
]


def _desc() -> KVCachesDesc:
    mem = ShmMemory(name="kvflow-1-2-0123abcd", size=4096, offset=64)
    return KVCachesDesc(kind="list", tensors=[TensorDesc("bfloat16", (2, 4, 16), (64, 16, 1), mem)])


def test_every_request_round_trips_with_its_payloads() -> None:
    """Each request type decodes to an equal struct; token and block ids arrive as int32."""
    tokens = np.arange(1000, dtype="<i4")
    blocks = np.array([7, 3, 9], dtype="<i4")
    cases = [
        (Register(instance_id="a", kv_caches=_desc(), model_name="m", rank=1, world_size=2), ()),
        (Lookup(model_name="m", cache_salt="s", request_id="r"), (tokens,)),
        (Store(instance_id="a", request_id="r"), (tokens, blocks)),
        (Retrieve(instance_id="a", request_id="r", skip_first_n_tokens=16), (tokens, blocks)),
        (EndSession(request_id="r"), ()),
        (
            ReportAllocations(instance_id="a", records=[AllocationRecord("r", [1, 2], [5, 6, 7])]),
            (),
        ),
        (Unregister(instance_id="a"), ()),
        (Status(), ()),
        (Heartbeat(), ()),
    ]
    for request, payloads in cases:
        request.id = 42
        frames = encode_request(request, payloads)
        decoded, arrays = decode_request([bytes(f) for f in frames])
        assert decoded == request
        assert decoded.v == PROTOCOL_VERSION
        assert len(arrays) == len(payloads)
        for got, sent in zip(arrays, payloads, strict=True):
            assert got.dtype == np.dtype("<i4")
            np.testing.assert_array_equal(got, sent)


def test_replies_round_trip() -> None:
    """Every reply type decodes back to itself."""
    for reply in (
        Done(id=3, value=256, server_ns=10),
        Done(id=4),
        Registered(id=5, heartbeat_interval_s=7.5),
        StatusResult(id=6, status={"a": {"b": [1, 2]}, "c": None}),
        Failed(id=7, code="not_found", message="instance 'x' is not registered"),
    ):
        assert decode_reply(encode_reply(reply)) == reply


def test_status_values_without_a_msgpack_type_are_sent_as_text() -> None:
    """A status holding e.g. a torch.dtype still encodes (as its text)."""
    reply = decode_reply(encode_reply(StatusResult(status={"dtype": torch.bfloat16})))
    assert isinstance(reply, StatusResult)
    assert reply.status == {"dtype": "torch.bfloat16"}


def test_wrong_protocol_version_is_a_protocol_error() -> None:
    """A header from another protocol version is refused, naming both versions."""
    frames = encode_request(Status())
    header = msgspec.msgpack.encode({"op": "status", "v": PROTOCOL_VERSION + 1, "id": 1})
    with pytest.raises(ProtocolError, match=f"version {PROTOCOL_VERSION + 1}"):
        decode_request([header, *frames[1:]])
    # even when the newer header does not fit this version's schema at all
    alien = msgspec.msgpack.encode({"op": "teleport", "v": 99, "id": 1})
    with pytest.raises(ProtocolError, match="version 99"):
        decode_request([alien])


@pytest.mark.parametrize(
    "frames, match",
    [
        ([], "empty message"),
        ([b"\xc1garbage"], "malformed request header"),
        ([msgspec.msgpack.encode({"op": "nope", "v": 1})], "malformed request header"),
        ([msgspec.msgpack.encode({"op": "lookup", "v": 1})], "malformed request header"),
        ([msgspec.msgpack.encode({"op": "lookup", "v": 1, "model_name": "m"})], "payload frame"),
        (
            [msgspec.msgpack.encode({"op": "lookup", "v": 1, "model_name": "m"}), b"abc"],
            "whole number of int32",
        ),
        ([msgspec.msgpack.encode({"op": "status", "v": 1}), b"\0\0\0\0"], "payload frame"),
    ],
)
def test_malformed_frames_are_protocol_errors(frames: list[bytes], match: str) -> None:
    """Undecodable headers, unknown ops, missing fields or wrong payloads raise ProtocolError."""
    with pytest.raises(ProtocolError, match=match):
        decode_request(frames)


@pytest.mark.parametrize(
    "frames, message",
    [
        ([], "empty message: expected a header frame"),
        (
            [msgspec.msgpack.encode({"op": "lookup", "v": 1, "model_name": "m"})],
            "Lookup takes 1 payload frame(s) (token_ids), got 0",
        ),
        (
            [msgspec.msgpack.encode({"op": "status", "v": 1}), b"", b""],
            "Status takes 0 payload frame(s) (none), got 2",
        ),
        (
            [
                msgspec.msgpack.encode(
                    {"op": "store", "v": 1, "instance_id": "a", "request_id": "r"}
                ),
                b"\0\0\0\0",
            ],
            "Store takes 2 payload frame(s) (token_ids, block_ids), got 1",
        ),
    ],
)
def test_frame_count_errors_name_the_request_and_its_payloads(
    frames: list[bytes], message: str
) -> None:
    """A wrong frame count is reported word for word: request type, expected payloads, count."""
    with pytest.raises(ProtocolError) as info:
        decode_request(frames)
    assert str(info.value) == message


def test_encoding_with_the_wrong_payload_count_names_the_request() -> None:
    """encode_request refuses a payload count its request type does not take, saying which."""
    with pytest.raises(ValueError) as info:
        encode_request(Store(instance_id="a", request_id="r"), (np.zeros(1, dtype="<i4"),))
    assert str(info.value) == "Store takes payloads ('token_ids', 'block_ids'), got 1"


def test_error_replies_to_unreadable_headers_are_addressed_to_id_zero() -> None:
    """peek_id reads a header's correlation id, and gives 0 when the header is unreadable."""
    assert peek_id(msgspec.msgpack.encode({"op": "teleport", "v": 99, "id": 17})) == 17
    assert peek_id(b"\xc1garbage") == 0
    assert peek_id(b"") == 0


def test_malformed_or_foreign_replies_are_protocol_errors() -> None:
    """A reply that does not decode, or speaks another version, is refused with the reason."""
    with pytest.raises(ProtocolError) as malformed:
        decode_reply(b"\xc1garbage")
    assert str(malformed.value).startswith("malformed reply from server: ")
    foreign = msgspec.msgpack.encode({"r": "done", "v": PROTOCOL_VERSION + 1, "id": 1})
    with pytest.raises(ProtocolError) as info:
        decode_reply(foreign)
    assert str(info.value) == (
        f"protocol version {PROTOCOL_VERSION + 1} is not supported"
        f" (this server speaks {PROTOCOL_VERSION})"
    )


def test_wrongly_typed_arguments_fail_before_sending() -> None:
    """encode_request checks the header's schema and names the wrong field."""
    with pytest.raises(InvalidRequestError, match="model_name"):
        encode_request(Lookup(model_name=5), (np.zeros(1, dtype="<i4"),))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="Lookup"):
        encode_request(Lookup(model_name="m", world_size=np.int64(2)), (np.zeros(1, "<i4"),))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "values",
    [[1, 2, 3], np.array([1, 2, 3], dtype=np.int64), torch.tensor([1, 2, 3]), (1, 2, 3)],
)
def test_ids_become_int32_arrays(values: object) -> None:
    """Lists, tuples, numpy arrays and torch tensors of ids travel as int32."""
    arr = as_int32_array(values, "token_ids")
    assert arr.dtype == np.dtype("<i4")
    assert arr.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "values, match",
    [
        ([[1, 2], [3, 4]], "one-dimensional"),
        ([1.5, 2.0], "integers"),
        ([2**31], "fit in int32"),
        (["a"], "integers"),
    ],
)
def test_bad_ids_name_the_argument(values: object, match: str) -> None:
    """Ids that are not a flat sequence of int32 values raise InvalidRequestError."""
    with pytest.raises(InvalidRequestError, match=match) as info:
        as_int32_array(values, "block_ids")
    assert "block_ids" in str(info.value)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_fuzzed_frames_decode_or_raise_protocol_error(frames: list[bytes]) -> None:
    """Arbitrary bytes never escape the decoder as anything but ProtocolError."""
    with contextlib.suppress(ProtocolError):
        decode_request(frames)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats()
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(TAGS),
    st.dictionaries(
        st.sampled_from(
            ["v", "id", "instance_id", "model_name", "kv_caches", "records", "world_size"]
        ),
        _json_values,
    ),
    st.lists(st.binary(max_size=16), max_size=3),
)
def test_fuzzed_headers_decode_or_raise_protocol_error(
    op: str, fields: dict[str, object], payloads: list[bytes]
) -> None:
    """Well-formed msgpack with wrong field types or counts is a ProtocolError, never a crash."""
    header = msgspec.msgpack.encode({"op": op, **fields})
    try:
        request, arrays = decode_request([header, *payloads])
    except ProtocolError:
        return
    assert request.v == PROTOCOL_VERSION
    assert len(arrays) == len(request.payloads)
