"""Property-based fuzzing of the request decoder and the server's dispatcher.

Hypothesis builds request headers of every op with fields of arbitrary types and
values (and arbitrary payload frames), plus raw garbage frames; each goes to an
in-process server over a real DEALER socket. Every message must get exactly one
reply that decodes, errors must carry a known code, and the server must keep
serving an honest client afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.core import KVFlowClient, KVFlowServer
from kvflow.core.errors import ERRORS_BY_CODE
from kvflow.core.server.protocol import PROTOCOL_VERSION, Failed, decode_reply
from tests.support.engine import small_engine

OPS = [
    "register", "lookup", "prefetch", "prefetch_state", "store", "retrieve", "end_session",
    "report_allocations", "unregister", "status", "heartbeat", "blend_lookup", "blend_retrieve",
]  # fmt: skip
FIELDS = [
    "instance_id", "model_name", "world_size", "rank", "block_size", "kv_format",
    "request_id", "cache_salt", "skip_first_n_tokens", "records", "kv_caches", "prefetch",
    "prefetch_id", "event_handle", "ropes", "segments",
]  # fmt: skip

#: a msgpack str whose bytes need not be UTF-8 (no honest client's encoder makes one)
raw_strs = st.binary(min_size=1, max_size=20).map(lambda b: msgspec.Raw(bytes([0xA0 | len(b)]) + b))
strings = st.one_of(st.text(max_size=40), raw_strs)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True),
    strings,
    st.binary(max_size=40),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=12,
)


@st.composite
def headers(draw: st.DrawFn) -> dict[str, Any]:
    """A request header: a known op (mostly) with some known fields of any type."""
    header: dict[str, Any] = {
        "op": draw(st.sampled_from(OPS) | strings),
        "v": draw(st.just(PROTOCOL_VERSION) | st.integers(-5, 5)),
        "id": draw(st.integers(min_value=0, max_value=2**31)),
        "client": draw(strings),
    }
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        header[name] = draw(values)
    return header


payload_frames = st.lists(
    st.one_of(
        st.binary(max_size=64),
        st.lists(st.integers(-(2**31), 2**31 - 1), max_size=64).map(
            lambda xs: np.asarray(xs, dtype="<i4").tobytes()
        ),
    ),
    max_size=3,
)


@pytest.fixture(scope="module")
def server() -> Iterator[KVFlowServer]:
    engine, _ = small_engine(port=0)
    served = KVFlowServer(engine.config, engine=engine)
    serving = threading.Thread(target=served.serve_forever)
    serving.start()
    yield served
    served.request_stop()
    serving.join(20)
    engine.bus.stop(5.0)


@pytest.fixture(scope="module")
def dealer(server: KVFlowServer) -> Iterator[zmq.Socket[bytes]]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 10_000
    sock.connect(server.endpoint)
    yield sock
    sock.close()


def _one_reply(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
    """Send `frames`; exactly one reply must come back, decodable; a failure names a known
    error code other than `internal` (bad input is the client's error, not a server bug)."""
    sock.send_multipart(frames)
    reply = decode_reply(sock.recv())
    if isinstance(reply, Failed):
        assert reply.code in ERRORS_BY_CODE and reply.code != "internal", reply
        assert reply.message
    assert not sock.poll(20), "a second reply to one request"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=headers(), payloads=payload_frames)
def test_every_fuzzed_request_gets_one_clear_reply(
    dealer: zmq.Socket[bytes], header: dict[str, Any], payloads: list[bytes]
) -> None:
    """A header of any op with fields of any type, and any payload frames: one reply."""
    try:
        encoded = msgspec.msgpack.encode(header)
    except (TypeError, OverflowError):  # not representable in msgpack at all
        return
    _one_reply(dealer, [encoded, *payloads])


@settings(max_examples=200, deadline=None)
@given(frames=st.lists(st.binary(max_size=200), min_size=1, max_size=4))
def test_raw_garbage_frames_get_one_protocol_reply(
    dealer: zmq.Socket[bytes], frames: list[bytes]
) -> None:
    """Bytes that are not a header at all: one protocol error reply each."""
    _one_reply(dealer, frames)


def test_the_server_still_serves_after_the_fuzzing(server: KVFlowServer) -> None:
    """After everything above, an honest client's calls work as usual."""
    with KVFlowClient(server.endpoint, timeout_s=10) as client:
        assert client.lookup(list(range(64)), model_name="m") == 0
        assert client.status()["server"]["requests"] > 0
