"""KVFlowClient's blend, layerwise, layout and KV-event edges against a real `kvflow server`."""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.engine.blend_index import BlendSegment
from kvflow.core.errors import (
    InvalidRequestError,
    ProtocolError,
    RequestTimeoutError,
    UnknownSubscriptionError,
)
from kvflow.core.server.protocol import (
    AdminClear,
    Done,
    Heartbeat,
    Register,
    Registered,
    Reply,
    Request,
)
from kvflow.events import EventType
from kvflow.kernels.rope_params import RopeParams
from kvflow.subscribers.eventlog_read import LogReader
from tests.support.engine import BLOCK, CHUNK
from tests.support.ops import ServerProcess, wait_for
from tests.support.scripted import scripted_server

_ids = itertools.count()
#: vllm_flash_attn caches: LAYERS x [2, NUM_BLOCKS, BLOCK, HEADS, HEAD] float32
LAYERS, NUM_BLOCKS, HEADS, HEAD = 2, 40, 2, 8
ROPE = RopeParams(rotary_dim=HEAD, theta=10000.0)
#: what as_int32_array says of a string given for ids, after the argument's name
STRING = " must be a sequence of integers, got a string"
TOKENS = np.arange(100, 100 + 3 * CHUNK, dtype=np.int32)  # three full chunks
BLOCKS = list(range(3 * CHUNK // BLOCK))


def _shared(shape: tuple[int, ...]) -> torch.Tensor:
    return empty_shared(shape, torch.float32)


def _caches(seed: int) -> list[torch.Tensor]:
    """Random caches in shared memory (a server maps them)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BLOCK, HEADS, HEAD)
    return [_shared(shape).copy_(torch.randn(shape, generator=gen)) for _ in range(LAYERS)]


def _name(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """One server with an L2 disk tier and an event log (its directory), for every test."""
    root = tmp_path_factory.mktemp("client-mutants")
    events = root / "events"
    srv = ServerProcess(
        "--disable-metrics", "--chunk-size", str(CHUNK), "--l1-size-gb", "0.25",
        "--event-log", str(events), "--l2-disk", str(root / "l2"), "--l2-disk-size-gb", "0.01",
    )  # fmt: skip
    yield srv, events
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def client(served: tuple[ServerProcess, Path]) -> Iterator[KVFlowClient]:
    with KVFlowClient(served[0].endpoint, timeout_s=20) as c:
        yield c


def _stored_docs(
    client: KVFlowClient, model_name: str
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Store three chunks of `model_name` from a `src` instance with ropes; returns a
    prompt holding the last two behind a 3-token question, and the segments expected."""
    seed = next(_ids)
    stored = np.random.default_rng(seed).integers(0, 1000, 3 * CHUNK).astype(np.int32)
    src = _caches(seed)
    src_id = _name("src")
    client.register_kv_caches(src_id, src, model_name=model_name, block_size=BLOCK, ropes=ROPE)
    assert client.store(src_id, stored, BLOCKS, request_id=_name("s")) == 3 * CHUNK
    prompt = np.concatenate([np.array([1, 2, 3], dtype=np.int32), stored[CHUNK:]])
    return prompt, [(3, CHUNK, CHUNK), (3 + CHUNK, CHUNK, 2 * CHUNK)]


def _triples(segments: list[BlendSegment]) -> list[tuple[int, int, int]]:
    return [(s.offset, s.length, s.original_start) for s in segments]


def _layerwise(client: KVFlowClient, model_name: str) -> str:
    """A layerwise instance of `model_name` (CPU caches in shared memory); its id."""
    iid = _name("lw")
    client.register_kv_caches(
        iid, _caches(0), model_name=model_name, block_size=BLOCK, layerwise=True
    )
    return iid


def _full(message: str) -> str:
    """A pattern matching exactly `message`."""
    return "^" + re.escape(message) + "$"


# -- blend ------------------------------------------------------------------------------------


@pytest.mark.parametrize("segments, kind", [(5, "int"), ("abc", "str"), (b"ab", "bytes")])
def test_blend_segments_that_are_no_sequence_are_refused_naming_their_type(
    client: KVFlowClient, segments: Any, kind: str
) -> None:
    """A non-sequence, a string or bytes as `segments` is an InvalidRequestError naming
    what segments must be and the type given."""
    want = (
        "segments must be a sequence of BlendSegment or (offset, chunk_hash, original_start),"
        f" got {kind}"
    )
    with pytest.raises(InvalidRequestError, match=_full(want)):
        client.blend_retrieve("nobody", [1, 2], [0], segments, request_id="r")


def test_a_blend_segment_with_a_non_integer_offset_is_refused_naming_it(
    client: KVFlowClient,
) -> None:
    """A triple whose offset is a float is refused by index, showing the triple."""
    bad = (1.5, b"h" * 32, 0)
    good = (0, b"g" * 32, 0)
    want = f"segments[1]: offset and original_start must be integers, got {bad!r}"
    with pytest.raises(InvalidRequestError, match=_full(want)):
        client.blend_retrieve("nobody", [1, 2], [0], [good, bad], request_id="r")


def test_blend_calls_refuse_string_ids_naming_the_argument(client: KVFlowClient) -> None:
    """token_ids or block_ids given as a string: an InvalidRequestError naming which."""
    with pytest.raises(InvalidRequestError, match=_full("token_ids" + STRING)):
        client.blend_lookup("1 2 3", model_name="m")
    with pytest.raises(InvalidRequestError, match=_full("token_ids" + STRING)):
        client.blend_retrieve("nobody", "1 2 3", [0], [], request_id="r")
    with pytest.raises(InvalidRequestError, match=_full("block_ids" + STRING)):
        client.blend_retrieve("nobody", [1, 2, 3], "0", [], request_id="r")


def test_blend_lookup_asks_for_its_world_size(client: KVFlowClient) -> None:
    """Chunks stored by a world of one are found for world_size=1 and not for 2."""
    model_name = _name("ws")
    prompt, want = _stored_docs(client, model_name)
    hit = client.blend_lookup(prompt, model_name=model_name, world_size=1)
    assert (hit.prefix_tokens, _triples(hit.segments)) == (0, want)
    two = client.blend_lookup(prompt, model_name=model_name, world_size=2)
    assert (two.prefix_tokens, two.segments) == (0, [])


def _disk_stored(client: KVFlowClient) -> int:
    return int(client.status()["l2"]["tiers"]["disk"]["stored"])


def _prefetches(client: KVFlowClient) -> int:
    return int(client.status()["l2"]["prefetch"]["requests"])


def _only_in_l2(client: KVFlowClient, model_name: str, on_disk: int) -> None:
    """Wait until the model's three stored chunks reached the disk tier (it held
    `on_disk` before), then drop them from L1."""

    def written_through() -> bool:
        l2 = client.status()["l2"]
        idle = l2["in_flight"]["write_through"]["calls"] == 0
        return bool(idle and l2["tiers"]["disk"]["stored"] >= on_disk + 3)

    wait_for(written_through, what="the store's L2 writes")
    assert client.admin(AdminClear(model_name=model_name, tiers=["l1"])) == {"dropped": {"l1": 3}}


def test_blend_lookup_prefetches_l2_segments_unless_told_not_to(client: KVFlowClient) -> None:
    """With the chunks only in L2, blend_lookup(prefetch=False) starts no prefetch and
    a default blend_lookup starts one."""
    model_name = _name("pf")
    on_disk = _disk_stored(client)
    prompt, want = _stored_docs(client, model_name)
    _only_in_l2(client, model_name, on_disk)
    before = _prefetches(client)
    hit = client.blend_lookup(prompt, model_name=model_name, prefetch=False)
    assert _triples(hit.segments) == want
    assert _prefetches(client) == before
    hit = client.blend_lookup(prompt, model_name=model_name)
    assert _triples(hit.segments) == want
    assert _prefetches(client) == before + 1


def test_blend_lookup_events_carry_its_request_id(
    served: tuple[ServerProcess, Path], client: KVFlowClient
) -> None:
    """The BLEND_LOOKUP event the server logs for a blend_lookup has its request_id as
    the session."""
    model_name = _name("rid")
    client.blend_lookup(TOKENS, model_name=model_name, request_id="blend-rid-7")

    def logged() -> list[Any]:
        return [
            ev
            for ev in LogReader.open(served[1])
            if ev.type == EventType.BLEND_LOOKUP_END and ev.attrs["model_name"] == model_name
        ]

    (event,) = wait_for(logged, what="the BLEND_LOOKUP_END event")
    assert event.session_id == "blend-rid-7"


def test_layerwise_stores_and_retrieves_keep_salt_and_chunk_keys(client: KVFlowClient) -> None:
    """A layerwise store under a salt is found only with it, and a layerwise retrieve
    with it hits; one named by chunk keys is found and retrieved by those keys."""
    model_name = _name("lws")
    iid = _layerwise(client, model_name)
    save = client.store_layerwise(iid, TOKENS, BLOCKS, request_id="a", cache_salt="salt-a")
    assert save.wait(30) == 3 * CHUNK
    assert client.lookup(TOKENS, model_name=model_name, cache_salt="salt-a") == 3 * CHUNK
    assert client.lookup(TOKENS, model_name=model_name) == 0
    load = client.retrieve_layerwise(iid, TOKENS, BLOCKS, request_id="b", cache_salt="salt-a")
    load.wait()
    assert load.hit_tokens == 3 * CHUNK
    keys = [bytes([k]) * 32 for k in (7, 8)]
    save = client.store_layerwise(iid, None, BLOCKS[:4], request_id="c", chunk_keys=keys)
    assert save.wait(30) == 2 * CHUNK
    assert client.lookup(None, model_name=model_name, chunk_keys=keys) == 2 * CHUNK
    load = client.retrieve_layerwise(iid, None, BLOCKS[:4], request_id="d", chunk_keys=keys)
    load.wait()
    assert load.hit_tokens == 2 * CHUNK
    client.unregister(iid)


def test_store_layerwise_refuses_string_block_ids_naming_them(client: KVFlowClient) -> None:
    """block_ids given as a string: an InvalidRequestError naming block_ids."""
    iid = _layerwise(client, _name("lwb"))
    with pytest.raises(InvalidRequestError, match=_full("block_ids" + STRING)):
        client.store_layerwise(iid, TOKENS, "0 1", request_id="x")
    client.unregister(iid)


def test_layerwise_stores_go_one_at_a_time_from_one_named_thread(client: KVFlowClient) -> None:
    """Two layerwise stores in flight share the client's one sender thread,
    `kvflow-store_0`: the second waits for the first's reply."""
    iid = _layerwise(client, _name("lwt"))
    before = set(threading.enumerate())
    first = client.store_layerwise(iid, TOKENS, BLOCKS, request_id="1")
    second = client.store_layerwise(iid, TOKENS + 1000, BLOCKS, request_id="2")
    started = [t.name for t in threading.enumerate() if t not in before]
    assert started == ["kvflow-store_0"]
    assert first.wait(30) == 3 * CHUNK and second.wait(30) == 3 * CHUNK
    client.unregister(iid)


def test_close_waits_for_the_layerwise_stores_already_made(
    served: tuple[ServerProcess, Path],
) -> None:
    """Layerwise stores made (and their layers marked) just before close() are sent and
    answered before it returns (it waits for the sender thread): each has its result at
    once after."""
    c = KVFlowClient(served[0].endpoint, timeout_s=20)
    iid = _layerwise(c, _name("lwq"))
    saves = [
        c.store_layerwise(iid, TOKENS + 1000 * i, BLOCKS, request_id=f"q{i}") for i in range(3)
    ]
    for save in saves:  # the forward pass wrote every layer
        for layer in range(LAYERS):
            save.layer_done(layer)
    c.close()
    assert [save.wait(0) for save in saves] == [3 * CHUNK] * 3


def test_token_ids_and_chunk_keys_are_refused_by_name(client: KVFlowClient) -> None:
    """token_ids that are no integers name token_ids; both token_ids and chunk_keys given
    is refused as such, before anything is sent."""
    with pytest.raises(InvalidRequestError, match=_full("token_ids" + STRING)):
        client.lookup("1 2 3", model_name="m")
    with pytest.raises(InvalidRequestError, match=_full("give token_ids or chunk_keys, not both")):
        client.lookup([1, 2], model_name="m", chunk_keys=[bytes(32)])


def test_a_closed_client_refuses_a_layerwise_store(served: tuple[ServerProcess, Path]) -> None:
    """store_layerwise on a closed client is a ProtocolError saying it is closed."""
    c = KVFlowClient(served[0].endpoint, timeout_s=20)
    iid = _layerwise(c, _name("lwc"))
    c.close()
    with pytest.raises(ProtocolError, match=r"^the client is closed$"):
        c.store_layerwise(iid, TOKENS, BLOCKS, request_id="late")


def test_layerwise_registration_reads_the_layout_with_block_size_and_format(
    client: KVFlowClient,
) -> None:
    """layerwise=True reads the caches with the given block_size (sglang_mha needs it)
    and kv_format (two-block flash-attn caches need it); a layout that disagrees is an
    InvalidRequestError with the layout's message."""
    sglang_id, two_id = _name("sg"), _name("two")
    k = [_shared((8 * BLOCK, HEADS, HEAD)) for _ in range(LAYERS)]
    v = [_shared((8 * BLOCK, HEADS, HEAD)) for _ in range(LAYERS)]
    client.register_kv_caches(sglang_id, (k, v), model_name="sg", block_size=BLOCK, layerwise=True)
    two = [_shared((2, 2, BLOCK, HEADS, HEAD)) for _ in range(LAYERS)]
    client.register_kv_caches(
        two_id, two, model_name="two", kv_format="vllm_flash_attn", layerwise=True
    )
    instances = client.status()["instances"]
    assert (instances[sglang_id]["kv_format"], instances[sglang_id]["num_layers"]) == (
        "sglang_mha", LAYERS,
    )  # fmt: skip
    assert (instances[two_id]["kv_format"], instances[two_id]["num_blocks"]) == (
        "vllm_flash_attn", 2,
    )  # fmt: skip
    load = client.retrieve_layerwise(sglang_id, TOKENS, BLOCKS, request_id="sg")
    load.wait()
    assert load.hit_tokens == 0
    want = f"vllm_flash_attn: block_size=3 disagrees with the tensors' {BLOCK}"
    with pytest.raises(InvalidRequestError, match=_full(want)):
        client.register_kv_caches(
            _name("bad"), _caches(1), model_name="m", block_size=3,
            layerwise=True,
        )  # fmt: skip
    client.unregister(sglang_id)
    client.unregister(two_id)


# -- KV events --------------------------------------------------------------------------------


def test_an_unsubscribed_kv_event_subscription_is_gone(client: KVFlowClient) -> None:
    """After unsubscribe_kv_events, polling the subscription is UnknownSubscriptionError."""
    sub = client.subscribe_kv_events()
    client.poll_kv_events(sub.subscription, after_seq=0, after_log_seq=sub.log_seq)
    client.unsubscribe_kv_events(sub.subscription)
    with pytest.raises(UnknownSubscriptionError, match=re.escape(f"{sub.subscription!r} is not")):
        client.poll_kv_events(sub.subscription, after_seq=0, after_log_seq=sub.log_seq)


def _owners(records: list[Any]) -> set[tuple[str, int, int, str | None]]:
    return {(r.model_name, r.world_size, r.rank, r.cache_salt) for r in records}


def test_a_kv_event_subscription_sees_the_owners_it_names(client: KVFlowClient) -> None:
    """Each filter of `subscribe_kv_events` reaches the server: model, world size, rank and
    (with match_salt) the salt; without match_salt the salt is not matched; a poll's
    max_records caps what it returns."""
    model = _name("kvo")
    owners = [(2, 0, "s1"), (2, 1, "s1"), (2, 1, "s2"), (2, 1, None), (1, 0, "s1"), (3, 1, "s1")]
    exact = client.subscribe_kv_events(
        model_name=model, world_size=2, cache_salt="s1", match_salt=True, rank=1
    )
    any_salt = client.subscribe_kv_events(model_name=model, world_size=2, cache_salt="s1", rank=1)
    everyone = client.subscribe_kv_events(model_name=model)
    for world, rank, salt in owners:
        iid = _name("kvo")
        client.register_kv_caches(
            iid, _caches(rank), model_name=model, world_size=world, rank=rank, block_size=BLOCK
        )
        client.store(iid, TOKENS, BLOCKS, request_id=_name("s"), cache_salt=salt)

    def polled(sub: Any, **kw: int) -> list[Any]:
        return client.poll_kv_events(
            sub.subscription, after_seq=0, after_log_seq=sub.log_seq, **kw
        ).records

    want = {(model, world, rank, salt) for world, rank, salt in owners}
    wait_for(lambda: _owners(polled(everyone)) == want, what="every owner's KV events")
    assert _owners(polled(exact)) == {(model, 2, 1, "s1")}
    assert _owners(polled(any_salt)) == {(model, 2, 1, s) for s in ("s1", "s2", None)}
    assert len(polled(everyone, max_records=1)) == 1


def test_a_salted_retrieve_finds_only_its_salt(client: KVFlowClient) -> None:
    """retrieve and retrieve_layerwise send their cache_salt: chunks stored under a salt
    come back with it, not without it."""
    iid = _name("salted")
    client.register_kv_caches(iid, _caches(3), model_name=_name("salt"), block_size=BLOCK)
    assert client.store(iid, TOKENS, BLOCKS, request_id=_name("s"), cache_salt="t") == 3 * CHUNK
    out = list(range(20, 20 + len(BLOCKS)))
    assert client.retrieve(iid, TOKENS, out, request_id=_name("r")) == 0
    assert client.retrieve(iid, TOKENS, out, request_id=_name("r"), cache_salt="t") == 3 * CHUNK


@pytest.mark.parametrize("call", ["store", "retrieve", "retrieve_layerwise"])
def test_stores_and_retrieves_refuse_string_block_ids_naming_them(
    client: KVFlowClient, call: str
) -> None:
    """A string for block_ids is refused before sending, naming block_ids."""
    model = _name("ids")
    iid = _layerwise(client, model) if call == "retrieve_layerwise" else _name("plain")
    if call != "retrieve_layerwise":
        client.register_kv_caches(iid, _caches(4), model_name=model, block_size=BLOCK)
    with pytest.raises(InvalidRequestError, match=_full("block_ids" + STRING)):
        getattr(client, call)(iid, TOKENS, "abc", request_id=_name("r"))


def test_lookup_prefetches_l2_chunks_unless_told_not_to(client: KVFlowClient) -> None:
    """With the chunks only in L2, lookup(prefetch=False) finds them and starts no
    prefetch; a default lookup starts one."""
    model_name = _name("lpf")
    on_disk = _disk_stored(client)
    iid = _name("lpf")
    client.register_kv_caches(iid, _caches(5), model_name=model_name, block_size=BLOCK)
    assert client.store(iid, TOKENS, BLOCKS, request_id=_name("s")) == 3 * CHUNK
    _only_in_l2(client, model_name, on_disk)
    before = _prefetches(client)
    assert client.lookup(TOKENS, model_name=model_name, prefetch=False) == 3 * CHUNK
    assert _prefetches(client) == before
    assert client.lookup(TOKENS, model_name=model_name) == 3 * CHUNK
    assert _prefetches(client) == before + 1


def test_an_unregistered_instance_keeps_no_layerwise_state(client: KVFlowClient) -> None:
    """After unregister, the id registered again without layerwise has no layer flags in
    this client: a layerwise store of it is refused here, as for any plain instance."""
    model = _name("relw")
    iid = _layerwise(client, model)
    client.unregister(iid)
    client.register_kv_caches(iid, _caches(6), model_name=model, block_size=BLOCK)
    message = f"instance {iid!r} was not registered by this client with layerwise=True"
    with pytest.raises(InvalidRequestError, match=_full(message)):
        client.store_layerwise(iid, TOKENS, BLOCKS, request_id=_name("s"))


def test_a_client_beats_on_one_daemon_thread_at_its_servers_pace(
    served: tuple[ServerProcess, Path],
) -> None:
    """Registrations start one heartbeat thread per client, a daemon (it never keeps a
    process alive), beating every quarter of the server's 30 s timeout: none in half a
    second."""

    def beating() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "kvflow-client-heartbeat"}

    before = beating()
    with KVFlowClient(served[0].endpoint, timeout_s=20) as fresh:
        for _ in range(2):
            iid = _name("hb")
            fresh.register_kv_caches(iid, _caches(7), model_name=_name("hb"), block_size=BLOCK)
        started = beating() - before
        assert len(started) == 1 and all(t.daemon for t in started)
        first = fresh.status()["server"]["requests"]
        time.sleep(0.5)
        assert fresh.status()["server"]["requests"] - first <= 2  # the two status calls


def test_a_heartbeat_that_times_out_is_retried_at_the_shortest_pace_asked() -> None:
    """A scripted server asks for a heartbeat every 0.1 s at the first registration and
    every 30 s at the second (the client keeps the shorter), and leaves the first
    heartbeat unanswered: that call gives up after 0.5 s (the interval, at least 0.5 s;
    not the client's 20 s timeout) and the next one follows at the 0.1 s pace."""
    intervals, beats = [0.1, 30.0], []

    def answer(_peer: bytes, request: Request) -> Reply | None:
        if isinstance(request, Register):
            return Registered(id=request.id, heartbeat_interval_s=intervals.pop(0))
        if not isinstance(request, Heartbeat):
            return None
        beats.append(time.monotonic())
        return Done(id=request.id) if len(beats) > 1 else None  # the first left unanswered

    with scripted_server(answer) as endpoint, KVFlowClient(endpoint, timeout_s=20) as c:
        for _ in range(2):
            c.register_kv_caches(_name("hb"), _caches(8), model_name="m", block_size=BLOCK)
        wait_for(lambda: len(beats) >= 4, timeout_s=5, what="four heartbeats")
        # 0.5 s for the unanswered call and 0.1 s of wait; a 1.5 s timeout gives >= 1.6
        assert 0.45 < beats[1] - beats[0] < 1.55, beats


def test_the_first_registration_sets_the_heartbeat_pace() -> None:
    """A client beats at the pace its first registration's reply asks (here every 1.6 s),
    not faster: one beat in the 2.3 s after registering."""
    beats: list[float] = []

    def answer(_peer: bytes, request: Request) -> Reply | None:
        if isinstance(request, Register):
            return Registered(id=request.id, heartbeat_interval_s=1.6)
        if isinstance(request, Heartbeat):
            beats.append(time.monotonic())
            return Done(id=request.id)
        return None

    with scripted_server(answer) as endpoint, KVFlowClient(endpoint, timeout_s=20) as c:
        c.register_kv_caches(_name("pace"), _caches(8), model_name="m", block_size=BLOCK)
        registered = time.monotonic()
        time.sleep(2.3)
        assert len(beats) == 1 and beats[0] - registered > 1.4, (registered, beats)


def test_a_call_waiting_for_its_reply_sleeps_between_checks() -> None:
    """A call waits for its reply in polls of up to 0.1 s (checking the handshake between
    them), not in a spin: two seconds of waiting on a port nobody answers cost the calling
    thread a few milliseconds of CPU (polls of 1 ms cost it about ten times as much)."""
    with KVFlowClient("tcp://127.0.0.1:9", timeout_s=2.0) as client:
        started = time.thread_time()
        with pytest.raises(RequestTimeoutError):
            client.status()
        assert time.thread_time() - started < 0.02
