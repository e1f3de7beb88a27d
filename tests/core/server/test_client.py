"""KVFlowClient argument checks that fail locally, before anything is sent."""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.errors import InvalidRequestError, KVFlowError, ProtocolError, RequestTimeoutError
from kvflow.core.server.protocol import AdminClear, Done, Failed, Registered, Reply, Request
from kvflow.events import BlockAllocation
from tests.support.scripted import scripted_server

# Nothing listens here: a call that reached the network would time out instead.
NOWHERE = "tcp://127.0.0.1:9"


@pytest.fixture
def client() -> Iterator[KVFlowClient]:
    with KVFlowClient(NOWHERE, timeout_s=0.2) as c:
        yield c


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5555", "http://x:1", "", 5555])
def test_endpoint_must_be_a_zmq_address(endpoint: object) -> None:
    """A malformed endpoint is a ValueError naming the expected form."""
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        KVFlowClient(endpoint)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [0, -1.0, True, "5", float("inf"), float("nan"), 1e300])
def test_timeout_must_be_positive(timeout: object) -> None:
    """timeout_s must be a positive, finite number of at most a day (inf would hang a call)."""
    with pytest.raises(ValueError, match="timeout_s"):
        KVFlowClient(NOWHERE, timeout_s=timeout)  # type: ignore[arg-type]


def test_a_timeout_of_a_whole_day_is_the_longest_taken() -> None:
    """The bound is inclusive: a day is taken, a day and a second is not."""
    with KVFlowClient(NOWHERE, timeout_s=86400) as c:
        assert c.timeout_s == 86400
    with pytest.raises(ValueError, match=r"timeout_s must be a number in \(0, 86400\] seconds"):
        KVFlowClient(NOWHERE, timeout_s=86401)


@pytest.mark.parametrize("client_id", ["", 5, b"engine-a"])
def test_a_client_id_must_be_a_non_empty_string(client_id: object) -> None:
    """An empty name, or a name that is no string, is refused before anything is sent."""
    with pytest.raises(ValueError, match=r"^client_id must be a non-empty string, got "):
        KVFlowClient(NOWHERE, client_id=client_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("given", ["curve_server_key", "curve_key"])
def test_the_two_curve_keys_go_together(given: str, tmp_path: Path) -> None:
    """One CURVE key without the other is refused, saying what both are, before anything
    is read or sent."""
    with pytest.raises(ValueError) as refused:
        KVFlowClient(NOWHERE, **{given: str(tmp_path / "absent.key")})  # type: ignore[arg-type]
    assert str(refused.value) == (
        "curve_server_key and curve_key go together: the server's public key and this"
        " client's key pair (NAME.key_secret)"
    )


def test_unshared_cpu_caches_fail_before_sending(client: KVFlowClient) -> None:
    """An ordinary CPU tensor cannot be registered with a remote server."""
    with pytest.raises(InvalidRequestError, match="empty_shared"):
        client.register_kv_caches("a", [torch.zeros(2, 4, 16, 1, 8)], model_name="m")


def test_wrongly_typed_arguments_fail_before_sending(client: KVFlowClient) -> None:
    """Argument types are checked against the wire schema locally, naming the field."""
    kv = [empty_shared((2, 4, 16, 1, 8), torch.float16)]
    with pytest.raises(InvalidRequestError, match="model_name"):
        client.register_kv_caches("a", kv, model_name=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="world_size"):
        client.lookup([1, 2], model_name="m", world_size=1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="skip_first_n_tokens"):
        client.retrieve("a", [1], [0], request_id="r", skip_first_n_tokens="16")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "tokens, match", [([[1, 2]], "one-dimensional"), ([0.5], "integers"), ([2**40], "int32")]
)
def test_bad_token_ids_fail_before_sending(
    client: KVFlowClient, tokens: object, match: str
) -> None:
    """Token ids must be a flat sequence of int32 values."""
    with pytest.raises(InvalidRequestError, match=match):
        client.store("a", tokens, [0], request_id="r")


@pytest.mark.parametrize(
    "records, match",
    [
        ("abc", "sequence of BlockAllocation, got str"),
        ([("r", [1])], r"records\[0\] must be BlockAllocation"),
        ([BlockAllocation("r", [1.5], [1])], r"records\[0\].new_block_ids"),
        ([("r", [1], ["x"])], r"records\[0\].new_token_ids"),
        # a column of ids is not a flat sequence, though each row holds one integer
        ([("r", torch.tensor([[1], [2]]), [1])], r"records\[0\].new_block_ids"),
    ],
)
def test_bad_allocation_records_fail_before_sending(
    client: KVFlowClient, records: object, match: str
) -> None:
    """Allocation records must be (req_id, block ids, token ids) with integer ids."""
    with pytest.raises(InvalidRequestError, match=match):
        client.report_block_allocations("a", records)  # type: ignore[arg-type]


def test_a_closed_client_refuses_calls() -> None:
    """Calls after close() raise instead of hanging."""
    c = KVFlowClient(NOWHERE, timeout_s=0.2)
    c.close()
    c.close()  # idempotent
    with pytest.raises(KVFlowError, match=r"^the client is closed$"):
        c.status()


def test_a_timed_out_call_leaves_the_next_call_working(client: KVFlowClient) -> None:
    """A timed-out call throws its socket away; the thread's next call gets a fresh one
    (and times out the same way, instead of tripping over the discarded socket)."""
    message = (
        f"no reply to Status from the kvflow server at {NOWHERE} within 0.2 s (is it running?)"
    )
    for _ in range(2):
        with pytest.raises(RequestTimeoutError) as raised:
            client.status()
        assert str(raised.value) == message


def test_a_timed_out_call_closes_its_sockets(client: KVFlowClient) -> None:
    """The discarded socket and its handshake monitor are closed, not left to the garbage
    collector (which warns about each unclosed socket)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RequestTimeoutError):
            client.status()
        gc.collect()
    assert [w.message for w in caught if issubclass(w.category, ResourceWarning)] == []


def _answering_done(
    n: int, reply: Callable[[int], Reply] = lambda request_id: Done(id=request_id)
) -> contextlib.AbstractContextManager[str]:
    """The endpoint of a server that lies: it answers each of the next `n` requests with
    `reply(request id)` (a plain Done), whatever was asked."""
    return scripted_server(lambda _peer, request: reply(request.id), requests=n)


def test_a_failure_of_a_code_this_client_does_not_know_is_a_kvflow_error() -> None:
    """A newer server's error code this client has no class for: a plain KVFlowError with
    the server's message, not a crash of the client's own."""

    def failed(request_id: int) -> Reply:
        return Failed(id=request_id, code="from_a_newer_server", message="it went wrong")

    with (
        _answering_done(1, failed) as endpoint,
        KVFlowClient(endpoint, timeout_s=20) as c,
        pytest.raises(KVFlowError) as raised,
    ):
        c.status()
    assert type(raised.value) is KVFlowError and str(raised.value) == "it went wrong"


def test_a_client_waits_30_s_for_a_reply_unless_told_otherwise() -> None:
    """The documented default: each call waits up to 30 s for its reply."""
    with KVFlowClient(NOWHERE) as c:
        assert c.timeout_s == 30.0


@pytest.mark.parametrize(
    ("calls", "requests"),
    [
        ((lambda c: c.prefetch([1, 2], model_name="m"), lambda c: c.prefetch_state("pf-1")),
         ("Prefetch", "PrefetchQuery")),
        ((lambda c: c.blend_lookup([1, 2], model_name="m"),
          lambda c: c.blend_retrieve("i", [1, 2], [0], [], request_id="r")),
         ("BlendLookup", "BlendRetrieve")),
        ((lambda c: c.subscribe_kv_events(),
          lambda c: c.poll_kv_events("sub", after_seq=0, after_log_seq=0),
          lambda c: c.status()),
         ("SubscribeKVEvents", "PollKVEvents", "Status")),
    ],
    ids=["prefetch", "blend", "kv-events-and-status"],
)  # fmt: skip
def test_a_reply_of_the_wrong_type_is_a_protocol_error(
    calls: tuple[Callable[[KVFlowClient], object], ...], requests: tuple[str, ...]
) -> None:
    """A server that answers with the wrong reply type (a plain Done) gets a ProtocolError
    naming the reply and the request, not a wrong value."""
    with _answering_done(len(calls)) as endpoint, KVFlowClient(endpoint, timeout_s=20) as c:
        for call, request in zip(calls, requests, strict=True):
            with pytest.raises(ProtocolError, match=rf"^unexpected Done reply to a {request}$"):
                call(c)


def test_a_data_call_answered_with_another_reply_names_both() -> None:
    """A lookup, store or unregister answered with a Registered (not the Done they
    expect): a ProtocolError naming the reply and the request, whole."""
    calls = [
        (lambda c: c.lookup([1, 2, 3], model_name="m"), "Lookup"),
        (lambda c: c.end_session("r"), "EndSession"),
        (lambda c: c.unregister("i"), "Unregister"),
    ]
    registered = lambda request_id: Registered(id=request_id, heartbeat_interval_s=1.0)  # noqa: E731
    with (
        _answering_done(len(calls), registered) as endpoint,
        KVFlowClient(endpoint, timeout_s=20) as c,
    ):
        for call, request in calls:
            with pytest.raises(
                ProtocolError, match=rf"^unexpected Registered reply to a {request}$"
            ):
                call(c)


def test_an_admin_call_answered_with_the_wrong_type_names_the_request_as_sent() -> None:
    """An admin call's ProtocolError names the reply and the request whole, with the id and
    client the call gave it."""
    request = AdminClear(model_name="m")
    with (
        _answering_done(1) as endpoint,
        KVFlowClient(endpoint, timeout_s=20) as c,
        pytest.raises(ProtocolError) as refused,
    ):
        c.admin(request)
    assert str(refused.value) == f"unexpected Done reply to {request!r}"
    assert request.id > 0 and "AdminClear(" in str(refused.value)


def test_threads_that_come_and_go_reuse_the_clients_connections() -> None:
    """Calls from 60 short-lived threads, one after another, all arrive over one connection
    (a thread per request neither pays a connect per call nor leaks a socket each); calls
    from 4 threads at once use at most 4."""
    peers: set[bytes] = set()

    def answer(peer: bytes, request: Request) -> Reply:
        peers.add(peer)
        return Done(id=request.id, value=1)

    with scripted_server(answer) as endpoint, KVFlowClient(endpoint, timeout_s=20) as c:
        for _ in range(60):
            caller = threading.Thread(target=c.end_session, args=("r",))
            caller.start()
            caller.join()
        assert len(peers) == 1
        start = threading.Barrier(4)

        def burst() -> None:
            start.wait()
            for _ in range(20):
                c.end_session("r")

        callers = [threading.Thread(target=burst) for _ in range(4)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
        assert 1 <= len(peers) <= 4
