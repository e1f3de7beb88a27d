"""Blend over the wire: a real `kvflow server` process, CPU caches in shared memory.

Documents stored in one order are found by `blend_lookup` in another (inside blocks),
`blend_retrieve` writes them with K turned to the new positions (checked against K
computed there, tests/support/blend.py) and V bit-exact; bad segments, bad rotary
descriptions and unknown instances get error replies naming them while the server keeps
serving; models and salts stay apart; `--blend-index-chunks` bounds the index.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.errors import InvalidRequestError, PermissionDeniedError, UnknownInstanceError
from kvflow.core.server.protocol import (
    BlendLookup,
    Failed,
    Llama3ScalingDesc,
    Register,
    RopeDesc,
    RopeParamsDesc,
    decode_reply,
    encode_request,
    ropes_from_wire,
    ropes_to_wire,
)
from kvflow.core.server.sharing import describe_kv_caches
from kvflow.kernels.rope_params import LayerRopes, LinearScaling, Llama3Scaling, Pairing, RopeParams
from tests.support.blend import HEAD, ROPE, VOCAB, Model, untouched
from tests.support.engine import BLOCK, CHUNK
from tests.support.ops import ServerProcess

_ids = itertools.count()


def _shared(shape: tuple[int, ...]) -> torch.Tensor:
    return empty_shared(shape, torch.float32)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(
        "--disable-observability", "--chunk-size", str(CHUNK), "--l1-size-gb", "0.25"
    )
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[KVFlowClient]:
    with KVFlowClient(server.endpoint, timeout_s=20) as c:
        yield c


class Docs:
    """A system prompt and two documents stored (in that order) by a `src` instance of
    its own model, and a `dst` instance to blend into; `ropes` for both."""

    def __init__(self, client: KVFlowClient, *, ropes: Any = ROPE, salt: str | None = None) -> None:
        n = next(_ids)
        self.client, self.model_name, self.salt = client, f"blend-{n}", salt
        self.model = Model(alloc=_shared)
        rng = np.random.default_rng(n)
        self.system, self.doc_a, self.doc_b = (
            rng.integers(0, VOCAB, k).astype(np.int32) for k in (CHUNK, 2 * CHUNK, CHUNK)
        )
        stored = np.concatenate([self.system, self.doc_a, self.doc_b])
        self.src, self.dst = self.model.caches(), self.model.caches()
        src_blocks = list(range(len(stored) // BLOCK))
        self.model.write(self.src, stored, src_blocks)
        self.src_id, self.dst_id = f"src-{n}", f"dst-{n}"
        for iid, kv in ((self.src_id, self.src), (self.dst_id, self.dst)):
            client.register_kv_caches(
                iid, kv, model_name=self.model_name, block_size=BLOCK, ropes=ropes
            )
        stored_tokens = client.store(
            self.src_id, stored, src_blocks, request_id=f"s{n}", cache_salt=salt
        )
        assert stored_tokens == len(stored)

    def prompt(self) -> np.ndarray:
        """The system prompt, a 3-token question, then doc_b and doc_a (both off block
        bounds), then the question again."""
        question = np.array([7, 8, 9], dtype=np.int32)
        return np.concatenate([self.system, question, self.doc_b, self.doc_a, question])

    @staticmethod
    def blocks(prompt: np.ndarray) -> list[int]:
        return list(range(10, 10 + -(-len(prompt) // BLOCK)))

    def close(self) -> None:
        self.client.unregister(self.src_id)
        self.client.unregister(self.dst_id)


def test_documents_stored_in_one_order_blend_in_another(client: KVFlowClient) -> None:
    """The lookup finds both documents at their new offsets inside blocks; the retrieve
    writes exactly their slots: V as stored, K as computed at the new positions."""
    docs = Docs(client)
    prompt = docs.prompt()
    hit = client.blend_lookup(prompt, model_name=docs.model_name, request_id="q")
    assert hit.prefix_tokens == CHUNK
    assert client.last_server_time_s > 0  # each reply carries the server's handling time
    b_at, a_at = CHUNK + 3, 2 * CHUNK + 3
    assert [(s.offset, s.length, s.original_start) for s in hit.segments] == [
        (b_at, CHUNK, 3 * CHUNK), (a_at, CHUNK, CHUNK), (a_at + CHUNK, CHUNK, 2 * CHUNK),
    ]  # fmt: skip
    before = [c.clone() for c in docs.dst]
    blocks = docs.blocks(prompt)
    blended = client.blend_retrieve(docs.dst_id, prompt, blocks, hit.segments, request_id="q")
    assert blended.tokens == hit.blended_tokens == 3 * CHUNK and blended.skipped == ()
    assert client.last_server_time_s > 0
    written = docs.model.check_blended(docs.dst, prompt, blocks, hit.segments)
    assert untouched(docs.dst, before, written), "a slot outside the segments was written"
    as_triples = [(s.offset, s.chunk_hash, s.original_start) for s in hit.segments[:1]]
    got = client.blend_retrieve(docs.dst_id, prompt, blocks, as_triples, request_id="t")
    assert got == (CHUNK, ())
    docs.close()


def test_layer_ropes_turn_rope_layers_and_copy_nope_ones(client: KVFlowClient) -> None:
    """LayerRopes over the wire: layer 0 turned, layer 1 (listed without params) copied
    bit-exact."""
    docs = Docs(client, ropes=LayerRopes((((0,), ROPE), ((1,), None))))
    prompt = docs.prompt()
    hit = client.blend_lookup(prompt, model_name=docs.model_name)
    blocks = docs.blocks(prompt)
    assert client.blend_retrieve(docs.dst_id, prompt, blocks, hit.segments, request_id="l").tokens
    docs.model.check_blended(docs.dst, prompt, blocks, hit.segments, turned=(0,))
    docs.close()


def test_bad_segments_and_instances_get_errors_naming_them(
    server: ServerProcess, client: KVFlowClient
) -> None:
    """A lying chunk hash, overlapping segments, too many segments, an unknown or foreign
    instance, an instance without ropes: each refused, nothing written, still serving."""
    docs = Docs(client)
    prompt = docs.prompt()
    hit = client.blend_lookup(prompt, model_name=docs.model_name)
    b, a = hit.segments[0], hit.segments[1]
    blocks = docs.blocks(prompt)
    refused = [
        ([(b.offset, a.chunk_hash, b.original_start)], InvalidRequestError, "not those of stored"),
        ([b, b], InvalidRequestError, "overlap at prompt offset"),
        (
            [b] * 100,
            InvalidRequestError,
            rf"^BlendRetrieve has 100 segments, more than its {len(prompt)} prompt tokens hold"
            rf" \({len(prompt) // CHUNK} chunks of {CHUNK} tokens, none overlapping\)$",
        ),
        # as many segments as whole chunks fit pass the count (then overlap)
        ([b] * (len(prompt) // CHUNK), InvalidRequestError, "overlap at prompt offset"),
        ([(b.offset, b.chunk_hash, -1)], InvalidRequestError, "original_start must be an"),
        ([(b.offset, "text", 0)], InvalidRequestError, "invalid BlendRetrieve argument"),
        ([(b.offset, b.chunk_hash)], InvalidRequestError, r"segments\[0\] must be"),
    ]
    for segments, error, match in refused:
        with pytest.raises(error, match=match):
            client.blend_retrieve(docs.dst_id, prompt, blocks, segments, request_id="bad")
    with pytest.raises(UnknownInstanceError, match="'no-such-instance' is not registered"):
        client.blend_retrieve("no-such-instance", prompt, blocks, hit.segments, request_id="u")
    other = KVFlowClient(server.endpoint)
    with other, pytest.raises(PermissionDeniedError, match="BlendRetrieve refused"):
        other.blend_retrieve(docs.dst_id, prompt, blocks, hit.segments, request_id="o")
    plain = f"plain-{next(_ids)}"
    client.register_kv_caches(plain, docs.model.caches(), model_name=docs.model_name)
    with pytest.raises(InvalidRequestError, match="registered no rotary parameters"):
        client.blend_retrieve(plain, prompt, blocks, hit.segments, request_id="p")
    assert all(torch.count_nonzero(c) == 0 for c in docs.dst), "a refused blend wrote something"
    assert client.blend_retrieve(docs.dst_id, prompt, blocks, hit.segments, request_id="ok").tokens
    client.unregister(plain)
    docs.close()


P = RopeParamsDesc(rotary_dim=HEAD)


@pytest.mark.parametrize(
    "ropes, match",
    [
        ([RopeDesc(params=RopeParamsDesc(rotary_dim=7))], r"ropes\[0\]: rotary_dim must be even"),
        ([RopeDesc(params=RopeParamsDesc(rotary_dim=8, pairing="zigzag"))], r"ropes\[0\]: pairing"),
        (
            [RopeDesc(params=RopeParamsDesc(rotary_dim=8, theta=-1.0))],
            r"ropes\[0\]: theta must be a finite positive number",
        ),
        (
            [RopeDesc(params=RopeParamsDesc(rotary_dim=8, scaling=Llama3ScalingDesc(8, 4, 1, 99)))],
            r"ropes\[0\]: Llama3Scaling.high_freq_factor",
        ),
        ([RopeDesc(layers=[0, 1], params=P), RopeDesc(layers=[1])], "layer 1 is in more than one"),
        ([RopeDesc(params=P), RopeDesc(layers=[1])], r"ropes\[0\]: layers None .* only group"),
        ([RopeDesc()], r"ropes\[0\]: layers None .* give params"),
        ([], "ropes must hold 1..4096 groups"),
        ([RopeDesc(layers=list(range(4097)), params=P)], "listing 4097"),
        ([RopeDesc(params=RopeParamsDesc(rotary_dim=16))], "ropes of instance 'bad-rope'"),
        ([RopeDesc(layers=[0], params=P)], "layer 1 has no rotary parameters"),
    ],
)
def test_bad_rope_descriptions_get_errors_naming_them(
    server: ServerProcess, client: KVFlowClient, ropes: list[RopeDesc], match: str
) -> None:
    """Each bad description is an invalid_argument reply naming it; nothing is registered
    and the same id then registers."""
    kv = Model(alloc=_shared).caches()
    reply = _raw(server, Register(instance_id="bad-rope", kv_caches=describe_kv_caches(kv),
                                  model_name="m", block_size=BLOCK, ropes=ropes))  # fmt: skip
    assert isinstance(reply, Failed) and reply.code == "invalid_argument", reply
    assert re.search(match, reply.message), reply.message
    assert "bad-rope" not in client.status()["server"]["instances"]
    client.register_kv_caches("bad-rope", kv, model_name="m", block_size=BLOCK, ropes=ROPE)
    client.unregister("bad-rope")


def test_an_unknown_scaling_kind_is_a_protocol_error_naming_its_path(
    server: ServerProcess,
) -> None:
    kv = Model(alloc=_shared).caches()
    request = Register(instance_id="yarn", kv_caches=describe_kv_caches(kv), model_name="m",
                       ropes=[RopeDesc(params=P)])  # fmt: skip
    header = msgspec.to_builtins(request)
    header["ropes"][0]["params"]["scaling"] = {"kind": "yarn", "factor": 4.0}
    reply = _raw_frames(server, [msgspec.msgpack.encode(header)])
    assert isinstance(reply, Failed) and reply.code == "protocol", reply
    assert "ropes[0].params.scaling" in reply.message, reply.message


def _raw(server: ServerProcess, request: Register) -> Any:
    return _raw_frames(server, encode_request(request))


def _raw_frames(server: ServerProcess, frames: list[Any]) -> Any:
    """Send frames on a fresh DEALER socket and decode the one reply."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.endpoint)
    try:
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no reply"
        return decode_reply(sock.recv())
    finally:
        sock.close()


def test_models_and_salts_stay_apart(client: KVFlowClient) -> None:
    """Chunks stored under a salt are found only with it, and only for their model; a
    retrieve naming another salt or model's instance blends nothing from them."""
    docs = Docs(client, salt="tenant-a")
    prompt = docs.prompt()
    for model, salt in ((docs.model_name, None), (docs.model_name, "tenant-b"), ("x", "tenant-a")):
        assert client.blend_lookup(prompt, model_name=model, cache_salt=salt).segments == []
    hit = client.blend_lookup(prompt, model_name=docs.model_name, cache_salt="tenant-a")
    assert len(hit.segments) == 3 and hit.prefix_tokens == CHUNK
    blocks = docs.blocks(prompt)
    # the index knows these chunks only under their salt: every segment is skipped, by offset
    offsets = tuple(s.offset for s in hit.segments)
    got = client.blend_retrieve(docs.dst_id, prompt, blocks, hit.segments, request_id="n")
    assert got == (0, offsets)
    other = f"other-{next(_ids)}"
    kv = docs.model.caches()
    client.register_kv_caches(other, kv, model_name="x", block_size=BLOCK, ropes=ROPE)
    got = client.blend_retrieve(
        other, prompt, blocks, hit.segments, request_id="x", cache_salt="tenant-a"
    )
    assert got == (0, offsets) and all(torch.count_nonzero(c) == 0 for c in docs.dst + kv)
    got = client.blend_retrieve(
        docs.dst_id, prompt, blocks, hit.segments, request_id="y", cache_salt="tenant-a"
    )
    assert got == (3 * CHUNK, ())
    client.unregister(other)
    docs.close()


def test_index_bound_and_lookups_on_the_query_worker(tmp_path: Path) -> None:
    """--blend-index-chunks 2 keeps the last two chunks stored; with an L2 tier the blend
    lookups run on the query worker and still answer."""
    srv = ServerProcess(
        "--disable-observability", "--chunk-size", str(CHUNK), "--l1-size-gb", "0.25",
        "--blend-index-chunks", "2", "--l2-disk", str(tmp_path), "--l2-disk-size-gb", "0.01",
    )  # fmt: skip
    try:
        with KVFlowClient(srv.endpoint, timeout_s=20) as client:
            assert client.status()["config"]["blend_index_chunks"] == 2
            docs = Docs(client)  # stores system, doc_a (2 chunks), doc_b: 4 chunks
            prompt = docs.prompt()
            hit = client.blend_lookup(prompt, model_name=docs.model_name)
            assert [s.original_start for s in hit.segments] == [3 * CHUNK, 2 * CHUNK]
            blocks = docs.blocks(prompt)
            got = client.blend_retrieve(docs.dst_id, prompt, blocks, hit.segments, request_id="q")
            assert got == (2 * CHUNK, ())
            docs.close()
        # a blend lookup failing on the query worker is answered by its own id
        bad = BlendLookup(id=77, model_name=docs.model_name, world_size=0)
        reply = _raw_frames(srv, encode_request(bad, (np.asarray(prompt, dtype=np.int32),)))
        assert isinstance(reply, Failed) and reply.id == 77, reply
        assert reply.code == "invalid_argument" and "world_size" in reply.message
    finally:
        assert srv.stop() == 0, srv.log()


#: the end of a blend request's error on a server run with blend off
OFF = r" \(--blend-index-chunks 0\)$"


def test_a_server_with_blend_off_indexes_nothing_and_says_so() -> None:
    """--blend-index-chunks 0: stores and prefix retrieves work as ever, while a blend
    lookup or retrieve is refused naming the switch (the index is nearly half a store's
    host work; a server nobody asks for blends saves it), and the server serves on."""
    srv = ServerProcess(
        "--disable-observability", "--chunk-size", str(CHUNK), "--l1-size-gb", "0.25",
        "--blend-index-chunks", "0",
    )  # fmt: skip
    try:
        with KVFlowClient(srv.endpoint, timeout_s=20) as client:
            assert client.status()["config"]["blend_index_chunks"] == 0
            docs = Docs(client)  # stores its documents: the stores work
            prompt = docs.prompt()
            rule = "needs the blend index, which this server runs without" + OFF
            with pytest.raises(InvalidRequestError, match="a blend lookup " + rule):
                client.blend_lookup(prompt, model_name=docs.model_name)
            segments = [(3 * CHUNK, b"\0" * 32, 2 * CHUNK)]
            with pytest.raises(InvalidRequestError, match="a blend retrieve " + rule):
                client.blend_retrieve(
                    docs.dst_id, prompt, docs.blocks(prompt), segments, request_id="off"
                )
            assert client.lookup(prompt, model_name=docs.model_name) == CHUNK  # the system prompt
            docs.close()
    finally:
        assert srv.stop() == 0, srv.log()


def test_ropes_survive_the_wire() -> None:
    """Every RopeParams field, both scalings and NoPE groups come back equal."""
    llama = RopeParams(
        rotary_dim=64, theta=500000.0, pairing=Pairing.GPTJ,
        scaling=Llama3Scaling(8.0, 1.0, 4.0, 8192), offset=512,
    )  # fmt: skip
    linear = RopeParams(rotary_dim=HEAD, scaling=LinearScaling(2.0))
    for ropes in (llama, LayerRopes((((0, 2), linear), ((1,), None), ((3,), llama)))):
        wire = ropes_to_wire(ropes)
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=list[RopeDesc])
        assert ropes_from_wire(decoded) == ropes
    assert ropes_to_wire(None) is None and ropes_from_wire(None) is None
    with pytest.raises(InvalidRequestError, match="ropes must be RopeParams, LayerRopes or None"):
        ropes_to_wire({"rotary_dim": 8})
