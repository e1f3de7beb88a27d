"""Layerwise retrieves through a real `kvflow server` on CPU caches in shared memory."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from kvflow.core import KVFlowClient
from kvflow.core.errors import InvalidRequestError, RequestTimeoutError, TransferError
from kvflow.core.server.layers import (
    ClientLayers,
    LayerwiseLoad,
    ServerLayers,
    open_server_layers,
)
from kvflow.core.server.protocol import Failed, Retrieve, decode_reply, encode_request
from tests.e2e.server_proc import running_server
from tests.support.layer_caches import BS, CHUNK, NB, NL, layer_blocks, shared_caches
from tests.support.ops import ServerProcess

TOKENS = np.arange(1, 4 * CHUNK + 5, dtype=np.int32)  # 4 full chunks and a partial one
SRC = list(range(0, 9))
DST = list(range(20, 29))


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> object:
    log = Path(tmp_path_factory.mktemp("layerwise")) / "server.log"
    with running_server(CHUNK, log) as ep:
        yield ep


def test_every_layer_is_whole_once_its_wait_returns(endpoint: str) -> None:
    """Each layer's blocks hold the stored KV when its wait returns; the rest are untouched."""
    client = KVFlowClient(endpoint)
    src, dst = shared_caches(1), shared_caches(2)
    client.register_kv_caches("lw-src", src, model_name="lw", block_size=BS)
    client.register_kv_caches("lw-dst", dst, model_name="lw", block_size=BS, layerwise=True)
    assert client.store("lw-src", TOKENS, SRC, request_id="w") == 4 * CHUNK
    tail = layer_blocks(dst, 0, DST[8:])
    for attempt in range(2):  # a second retrieve waits on its own (higher) number
        for t in dst:
            t.zero_()
        load = client.retrieve_layerwise("lw-dst", TOKENS, DST, request_id=f"r{attempt}")
        assert load.hit_tokens == 4 * CHUNK
        assert client.last_server_time_s > 0  # the early reply carries its handling time
        for layer in range(NL):
            load.wait_layer(layer)
            assert torch.equal(layer_blocks(dst, layer, DST[:8]), layer_blocks(src, layer, SRC[:8]))
        assert set(load.waited_s) == set(range(NL))
        assert load.host_s > 0 and load.host_s >= sum(load.waited_s.values())  # host time
        assert set(load.host_by_layer) == set(range(NL))
        assert sum(load.host_by_layer.values()) == pytest.approx(load.host_s)
        assert load.ring_scatters == 0  # no ring
        waits = load.layer_waits()
        assert len(waits) == NL and all(w >= 0 for w in waits)
        client.report_layer_waits("lw-dst", f"r{attempt}", waits)
    assert not layer_blocks(dst, 0, DST[8:]).any() and tail.any()  # the partial chunk: not written
    deadline = time.monotonic() + 10  # the server's bus delivers the reports meanwhile
    while client.status()["activity"]["layer_waits"].get("layers") != 2 * NL:
        assert time.monotonic() < deadline, client.status()["activity"]["layer_waits"]
        time.sleep(0.05)
    with pytest.raises(InvalidRequestError, match="entries"):
        client.report_layer_waits("lw-dst", "r9", [0.0] * (NL + 1))
    assert client.retrieve("lw-dst", TOKENS, DST, request_id="after") == 4 * CHUNK
    client.close()


def test_a_miss_and_a_plain_instance(endpoint: str) -> None:
    """A miss signals every layer; an instance registered without layerwise is refused
    with a clear error, and the server keeps serving it."""
    client = KVFlowClient(endpoint)
    dst, plain = shared_caches(3), shared_caches(4)
    client.register_kv_caches("lw-miss", dst, model_name="lw", block_size=BS, layerwise=True)
    client.register_kv_caches("lw-plain", plain, model_name="lw", block_size=BS)
    other = np.arange(9000, 9000 + 2 * CHUNK, dtype=np.int32)
    load = client.retrieve_layerwise("lw-miss", other, DST[:4], request_id="m")
    assert load.hit_tokens == 0
    load.wait()
    plain = "^instance 'lw-plain' was not registered by this client with layerwise=True$"
    with pytest.raises(InvalidRequestError, match=plain):
        client.retrieve_layerwise("lw-plain", other, DST[:4], request_id="p")
    assert client.retrieve("lw-plain", other, DST[:4], request_id="p2") == 0
    client.close()


def _answered(hit: int) -> Callable[[], int]:
    """A retrieve's reply already in: `hit` tokens."""
    return lambda: hit


def _came() -> bool:
    """A reply that came already."""
    return True


def test_a_reply_is_read_once_and_its_failure_kept_for_every_ask() -> None:
    """The reply is read once, whoever asks first; its error is raised at every ask after
    (not by the next retrieve's read of it), and an interrupt while reading is never
    swallowed."""
    calls = []

    def refused() -> int:
        calls.append(1)
        raise InvalidRequestError("refused")

    load = LayerwiseLoad(ClientLayers(3, None), 1, 0.05, refused, _came)
    load.settle(raising=False)  # what the next retrieve does
    for ask in (lambda: load.hit_tokens, lambda: load.wait_layer(0), load.settle):
        with pytest.raises(InvalidRequestError, match=r"^refused$"):
            ask()
    assert calls == [1]

    def interrupted() -> int:
        raise KeyboardInterrupt

    stopped = LayerwiseLoad(ClientLayers(3, None), 1, 0.05, interrupted, _came)
    with pytest.raises(KeyboardInterrupt):
        stopped.settle(raising=False)
    with pytest.raises(KeyboardInterrupt):
        _ = stopped.hit_tokens


def test_waits_need_no_reply_until_the_last_layer() -> None:
    """Marked layers are waited for without the reply, which the last layer's wait reads
    (it came long before); a flag marked failed raises the reply's own error when it has
    one, and a reply that came with an error ends a wait for a flag never marked."""
    client_side = ClientLayers(3, None)
    marks = ServerLayers(3, None, client_side.raw).signal(1)
    read: list[int] = []

    def answer() -> int:
        read.append(1)
        return 64

    load = LayerwiseLoad(client_side, 1, 5.0, answer, lambda: False)
    for layer in range(3):
        marks.ready(layer, None)
    load.wait_layer(0)
    load.wait_layer(1)
    assert read == []
    load.wait_layer(2)
    assert read == [1] and load.hit_tokens == 64

    def refused() -> int:
        raise InvalidRequestError("block id 99 is out of range")

    ServerLayers(3, None, client_side.raw).signal(2).failed(0)
    bad_table = LayerwiseLoad(client_side, 2, 5.0, refused, lambda: False)
    with pytest.raises(InvalidRequestError, match="block id 99"):
        bad_table.wait_layer(0)
    unmarked = LayerwiseLoad(client_side, 3, 5.0, refused, _came)
    began = time.monotonic()
    with pytest.raises(InvalidRequestError, match="block id 99"):
        unmarked.wait_layer(0)
    assert time.monotonic() - began < 2.5  # the reply ended it, not the timeout


def test_flags_tell_landed_failed_and_late_apart() -> None:
    """A flag at the retrieve's number (or a later one) means landed, its negative means
    failed from that layer on, and an unset flag times out naming the layer."""
    client_side = ClientLayers(3, None)
    raw = client_side.raw
    marks = ServerLayers(3, None, raw).signal(2)
    marks.ready(0, None)
    marks.failed(1)
    load = LayerwiseLoad(client_side, 2, 0.05, _answered(64), _came)
    load.wait_layer(0)
    with pytest.raises(TransferError, match=r"^the layerwise retrieve failed before layer 1$"):
        load.wait_layer(1)
    earlier = LayerwiseLoad(client_side, 1, 0.05, _answered(64), _came)
    earlier.wait()  # a later retrieve's marks (landed or failed) mean retrieve 1 finished
    ServerLayers(3, None, raw).signal(3).ready(0, None)
    late = LayerwiseLoad(client_side, 4, 0.05, _answered(64), _came)
    with pytest.raises(
        RequestTimeoutError, match=r"^layer 0 of the layerwise retrieve: nothing within 0\.05 s$"
    ):
        late.wait_layer(0)
    with pytest.raises(InvalidRequestError, match="shape"):
        ServerLayers(4, None, raw)
    _, desc = client_side.wire()  # flags for 3 layers offered for 4: refused before mapping
    with pytest.raises(InvalidRequestError, match=r"expected \(64,\) uint8"):
        open_server_layers(None, desc, None, 4)


def test_a_layerwise_store_copies_each_layer_once_marked(endpoint: str) -> None:
    """The server holds a layerwise store until the engine marks each layer; a layer
    written after the request went (but before its mark) is stored as written then;
    nothing is visible before the last layer, and everything is after the reply."""
    client = KVFlowClient(endpoint)
    src, dst = shared_caches(5), shared_caches(6)
    client.register_kv_caches("st-src", src, model_name="st", block_size=BS, layerwise=True)
    client.register_kv_caches("st-dst", dst, model_name="st", block_size=BS)
    tokens = np.arange(50_000, 50_000 + 4 * CHUNK, dtype=np.int32)
    for t in src:
        t[:, SRC].zero_()
    save = client.store_layerwise("st-src", tokens, SRC[:8], request_id="ls")
    want = shared_caches(7)  # what the forward pass writes, layer by layer
    for layer in range(NL):
        src[layer][:, SRC[:8]] = want[layer][:, SRC[:8]]
        save.layer_done(layer)
        if layer == NL // 2:  # half the layers marked: the store is still running
            time.sleep(0.2)
            assert client.lookup(tokens, model_name="st") == 0
    assert save.wait(30) == 4 * CHUNK
    assert client.retrieve("st-dst", tokens, DST[:8], request_id="back") == 4 * CHUNK
    for layer in range(NL):
        assert torch.equal(layer_blocks(dst, layer, DST[:8]), layer_blocks(want, layer, SRC[:8]))
    with pytest.raises(InvalidRequestError, match="layerwise=True"):
        client.store_layerwise("st-dst", tokens, DST[:8], request_id="no")
    client.close()


def test_a_store_whose_layers_never_come_ends_with_its_instance(endpoint: str) -> None:
    """An engine that stops marking layers (it died mid-forward) holds its store only
    until its instance goes: the store fails naming the layer, nothing becomes visible,
    and the server serves the instance registered again."""
    client = KVFlowClient(endpoint)
    src = shared_caches(8)
    client.register_kv_caches("st-dead", src, model_name="dead", block_size=BS, layerwise=True)
    tokens = np.arange(60_000, 60_000 + 2 * CHUNK, dtype=np.int32)
    save = client.store_layerwise("st-dead", tokens, SRC[:4], request_id="dead")
    save.layer_done(0)
    time.sleep(0.2)  # the server waits for layer 1
    client.unregister("st-dead")
    with pytest.raises(
        TransferError, match=r"cancelled waiting for layer 1 of the layerwise store$"
    ):
        save.reply.result(30)
    assert client.lookup(tokens, model_name="dead") == 0
    client.register_kv_caches("st-dead", src, model_name="dead", block_size=BS, layerwise=True)
    assert client.store("st-dead", tokens, SRC[:4], request_id="alive") == 2 * CHUNK
    client.close()


def _raw_retrieve(endpoint: str, request: Retrieve) -> object:
    """The server's reply to `request` sent from a bare socket (kvflow's client refuses
    such requests before sending them)."""
    replies = _raw_replies(endpoint, request, more_s=0)
    return replies[0]


def _raw_replies(endpoint: str, request: Retrieve, more_s: float) -> list[object]:
    """Every reply to `request` sent from a bare socket: the first, and any that follow
    within `more_s` seconds of it (kvflow's client would drop a second one by its id)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        sock.send_multipart(encode_request(request, (TOKENS, np.asarray(DST, dtype=np.int32))))
        assert sock.poll(10_000), "no reply"
        replies = [decode_reply(sock.recv())]
        while sock.poll(int(more_s * 1000)):
            replies.append(decode_reply(sock.recv()))
        return replies
    finally:
        sock.close()
        ctx.term()


def test_a_layerwise_retrieve_is_answered_once(endpoint: str) -> None:
    """A layerwise retrieve replies early (before its copies end) and only then: the job
    that sent the early reply sends no second one when its copies are done."""
    client = KVFlowClient(endpoint, client_id="lw-once-owner")
    client.register_kv_caches("lw-once-src", shared_caches(7), model_name="lw-once", block_size=BS)
    client.register_kv_caches(
        "lw-once", shared_caches(8), model_name="lw-once", block_size=BS, layerwise=True
    )
    assert client.store("lw-once-src", TOKENS, SRC, request_id="w") == 4 * CHUNK
    request = Retrieve(
        id=11, client="lw-once-owner", instance_id="lw-once", request_id="once", layer_seq=1
    )
    replies = _raw_replies(endpoint, request, more_s=0.5)
    assert [(type(r).__name__, getattr(r, "id", None), getattr(r, "value", None))
            for r in replies] == [("Done", 11, 4 * CHUNK)]  # fmt: skip
    client.close()


def test_the_server_refuses_a_bad_layer_number_or_a_plain_instance_naming_it(
    endpoint: str,
) -> None:
    """Raw layerwise retrieves: a negative layer number, and a layer number for an instance
    registered without layerwise=True, each refused with what was wrong; both instances
    are served as before."""
    client = KVFlowClient(endpoint, client_id="lw-raw-owner")
    client.register_kv_caches(
        "lw-raw", shared_caches(5), model_name="lw", block_size=BS, layerwise=True
    )
    client.register_kv_caches("lw-raw-plain", shared_caches(6), model_name="lw", block_size=BS)
    refusals = [
        ("lw-raw", -1, "layer_seq must be an integer >= 0, got -1"),
        (
            "lw-raw-plain",
            1,
            "instance 'lw-raw-plain' was registered without layerwise=True: it has no"
            " per-layer completion points for a layerwise retrieve",
        ),
    ]
    for instance, seq, message in refusals:
        request = Retrieve(
            id=9, client="lw-raw-owner", instance_id=instance, request_id="raw", layer_seq=seq
        )
        reply = _raw_retrieve(endpoint, request)
        assert isinstance(reply, Failed) and reply.id == 9, reply
        assert (reply.code, reply.message) == ("invalid_argument", message)
        fresh = np.arange(9100, 9100 + 2 * CHUNK, dtype=np.int32)  # nothing stored
        assert client.retrieve(instance, fresh, DST[:4], request_id=f"after-{seq}") == 0
    client.close()


def test_a_second_layerwise_store_waits_for_its_own_marks(endpoint: str) -> None:
    """Each layerwise store has its own number: the marks of the first one do not let the
    second gather its layers before the engine writes them."""
    client = KVFlowClient(endpoint)
    src, dst = shared_caches(22), shared_caches(23)
    client.register_kv_caches("st2-src", src, model_name="st2", block_size=BS, layerwise=True)
    client.register_kv_caches("st2-dst", dst, model_name="st2", block_size=BS)
    first = np.arange(70_000, 70_000 + 2 * CHUNK, dtype=np.int32)
    assert client.store_layerwise("st2-src", first, SRC[:4], request_id="a").wait(30) == 2 * CHUNK
    second = np.arange(80_000, 80_000 + 2 * CHUNK, dtype=np.int32)
    save = client.store_layerwise("st2-src", second, SRC[:4], request_id="b")
    time.sleep(0.3)  # the server has the request: it must wait for the marks
    want = shared_caches(24)
    for layer in range(NL):
        src[layer][:, SRC[:4]] = want[layer][:, SRC[:4]]
        save.layer_done(layer)
    assert save.wait(30) == 2 * CHUNK
    assert client.retrieve("st2-dst", second, DST[:4], request_id="back") == 2 * CHUNK
    for layer in range(NL):
        assert torch.equal(layer_blocks(dst, layer, DST[:4]), layer_blocks(want, layer, SRC[:4]))
    client.close()


def test_a_layer_past_the_last_is_refused_by_name(endpoint: str) -> None:
    """Waiting for, or marking, a layer the instance does not have raises naming it."""
    client = KVFlowClient(endpoint)
    dst = shared_caches(25)
    client.register_kv_caches("lw-past", dst, model_name="past", block_size=BS, layerwise=True)
    past = f"^layer {NL} is not within the {NL}$"
    load = client.retrieve_layerwise("lw-past", TOKENS, DST, request_id="p")
    with pytest.raises(InvalidRequestError, match=past):
        load.wait_layer(NL)
    load.wait()
    save = client.store_layerwise("lw-past", TOKENS, DST, request_id="s")
    with pytest.raises(InvalidRequestError, match=past):
        save.layer_done(NL)
    save.wait(30)
    client.close()


def test_a_save_waits_no_longer_than_asked() -> None:
    """`LayerwiseSave.wait(timeout)` gives up after its timeout when no reply comes."""
    from concurrent.futures import Future
    from concurrent.futures import TimeoutError as FutureTimeout

    from kvflow.core.server.layers import LayerwiseSave

    save = LayerwiseSave(ClientLayers(2, None), 1, Future())
    with pytest.raises(FutureTimeout):
        save.wait(0.05)


def _same(dst: list[torch.Tensor], src: list[torch.Tensor], layer: int) -> bool:
    """Whether `layer`'s retrieved blocks hold what was stored from `src`."""
    return torch.equal(layer_blocks(dst, layer, DST[:8]), layer_blocks(src, layer, SRC[:8]))


Stored = tuple[KVFlowClient, list[torch.Tensor], list[torch.Tensor]]


@contextlib.contextmanager
def _stored_prefix(timeout_s: float) -> Iterator[tuple[ServerProcess, Stored]]:
    """A server of its own holding TOKENS' first four chunks from `src`, and a client
    (`timeout_s`) with `dst` registered layerwise as "lw": (server, (client, src, dst))."""
    with (
        ServerProcess("--chunk-size", str(CHUNK), "--l1-size-gb", "0.25") as server,
        KVFlowClient(server.endpoint, timeout_s=timeout_s) as client,
    ):
        src, dst = shared_caches(31), shared_caches(32)
        client.register_kv_caches("lw-src", src, model_name="own", block_size=BS)
        client.register_kv_caches("lw", dst, model_name="own", block_size=BS, layerwise=True)
        assert client.store("lw-src", TOKENS, SRC, request_id="w") == 4 * CHUNK
        yield server, (client, src, dst)


@contextlib.contextmanager
def _stopped(server: ServerProcess) -> Iterator[None]:
    """The server stopped (SIGSTOP: its sockets open, nothing answered) for the block."""
    server.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.proc.send_signal(signal.SIGCONT)


def test_a_layerwise_retrieve_returns_once_sent_and_raises_its_errors_when_read() -> None:
    """`retrieve_layerwise` returns once its request is sent, even to a server that does
    not answer (stopped); its waits need no reply, and `hit_tokens` and the first
    `wait_layer` raise the server's error for a bad request."""
    with _stored_prefix(timeout_s=10) as (server, (client, src, dst)):
        with _stopped(server):
            load = client.retrieve_layerwise("lw", TOKENS, DST, request_id="r")
        load.wait_layer(0)
        assert load.hit_tokens == 4 * CHUNK
        load.wait()
        assert all(_same(dst, src, layer) for layer in range(NL))
        bad = client.retrieve_layerwise("lw", TOKENS, [NB + 5] * len(DST), request_id="bad")
        for ask in (lambda: bad.hit_tokens, lambda: bad.wait_layer(0)):
            with pytest.raises(InvalidRequestError, match=f"block id {NB + 5} out of range"):
                ask()
        again = client.retrieve_layerwise("lw", TOKENS, DST, request_id="again")
        again.wait()
        assert again.hit_tokens == 4 * CHUNK


def test_a_wait_on_a_server_that_never_answers_says_no_reply_came() -> None:
    """A wait for layer 0 of a retrieve the server never answered (stopped: nothing
    marked, no reply) times out with the reply's own error, which asks whether the server
    runs, not only that the layer never came; the server serves on once it runs again."""
    with _stored_prefix(timeout_s=1) as (server, (client, src, dst)):
        with _stopped(server):
            load = client.retrieve_layerwise("lw", TOKENS, DST, request_id="lost")
            with pytest.raises(RequestTimeoutError, match=r"no reply to Retrieve .*is it running"):
                load.wait_layer(0)
        again = client.retrieve_layerwise("lw", TOKENS, DST, request_id="again")
        again.wait()
        assert again.hit_tokens == 4 * CHUNK
        assert all(_same(dst, src, layer) for layer in range(NL))


def test_a_retrieve_waits_for_the_last_ones_reply_whose_failure_stays_its_own() -> None:
    """Numbers must reach the server in order, and two requests on two connections need
    not: a retrieve reads the last one's reply before it is sent. When that reply does
    not come in time (a stopped server), the last retrieve fails with RequestTimeoutError
    and the next one goes on."""
    with _stored_prefix(timeout_s=3) as (server, (client, src, dst)):
        with _stopped(server):
            first = client.retrieve_layerwise("lw", TOKENS, list(range(40, 49)), request_id="a")
            second = client.retrieve_layerwise("lw", TOKENS, DST, request_id="b")
        with pytest.raises(RequestTimeoutError, match="no reply to Retrieve"):
            first.wait_layer(0)
        assert second.hit_tokens == 4 * CHUNK
        second.wait()
        assert all(_same(dst, src, layer) for layer in range(NL))
