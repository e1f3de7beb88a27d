"""Layerwise retrieves staged in the engine's own ring, through a real `kvflow server` on
CPU caches in shared memory (kvflow.core.server.staging)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.errors import InvalidRequestError, TransferError, UnknownInstanceError
from kvflow.core.server.protocol import Register
from kvflow.core.server.sharing import describe_kv_caches, describe_tensor
from kvflow.core.server.staging import control_words
from tests.e2e.server_proc import running_server
from tests.support.layer_caches import BS, CHUNK, HS, NH, NL, layer_blocks, shared_caches

CHUNKS = 4
#: one layer of the hit: K and V of CHUNK tokens a chunk, fp16
LAYER_BYTES = CHUNKS * 2 * CHUNK * NH * HS * 2
SRC = list(range(0, 2 * CHUNKS))
#: blocks anywhere and out of order: no layer can go straight into them
SHUFFLED = [61, 7, 50, 33, 12, 45, 48, 20]
OTHER = [3, 58, 41, 16, 40, 27, 55, 9]


def _tokens(base: int) -> np.ndarray:
    return np.arange(base, base + CHUNKS * CHUNK, dtype=np.int32)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> object:
    log = Path(tmp_path_factory.mktemp("staging")) / "server.log"
    with running_server(CHUNK, log) as ep:
        yield ep


@pytest.fixture
def client(endpoint: str) -> object:
    c = KVFlowClient(endpoint, timeout_s=30)
    yield c
    c.close()


def _with_ring(
    client: KVFlowClient, name: str, seed: int, slots: int, slot_bytes: int = LAYER_BYTES
) -> list[torch.Tensor]:
    """Destination caches registered as `name`, layerwise with a ring of `slots`."""
    dst = shared_caches(seed)
    client.register_kv_caches(
        name, dst, model_name="stg", block_size=BS, layerwise=True, staging_slots=slots,
        staging_slot_bytes=slot_bytes,
    )  # fmt: skip
    return dst


def _stored(client: KVFlowClient, name: str, seed: int, base: int) -> list[torch.Tensor]:
    """Source caches registered as `name` with CHUNKS chunks of `_tokens(base)` stored."""
    src = shared_caches(seed)
    client.register_kv_caches(name, src, model_name="stg", block_size=BS)
    assert client.store(name, _tokens(base), SRC, request_id=f"{name}-w") == CHUNKS * CHUNK
    return src


def test_staged_layers_land_in_blocks_anywhere(client: KVFlowClient) -> None:
    """Each layer lands whole in shuffled blocks when its wait returns, every one of them
    through the ring (a slot holds a layer), the second retrieve as the first."""
    src = _stored(client, "stg-src", 1, 1000)
    dst = _with_ring(client, "stg-dst", 2, 2)
    for attempt in range(2):
        for t in dst:
            t.zero_()
        load = client.retrieve_layerwise(
            "stg-dst", _tokens(1000), SHUFFLED, request_id=f"r{attempt}"
        )
        assert load.hit_tokens == CHUNKS * CHUNK
        for layer in range(NL):
            load.wait_layer(layer)
            assert torch.equal(layer_blocks(dst, layer, SHUFFLED), layer_blocks(src, layer, SRC))
        assert load.staged_layers == list(range(NL))
    ring = client.status()["server"]["instances"]["stg-dst"]["staging"]
    assert ring["slots"] == 2 and ring["slot_bytes"] == LAYER_BYTES
    assert ring["staged_layers"] == ring["slot_uses"] == 2 * NL and ring["slot_wait_s"] >= 0
    assert client.status()["server"]["instances"]["stg-src"]["staging"] is None


def test_a_slot_of_several_layers_takes_spans_of_them(client: KVFlowClient) -> None:
    """A ring whose slots hold four layers of the hit: layers 0 and 1 come alone, then
    spans of two (2-3, 4-5), each scattered by one launch; every layer lands whole when
    its wait returns, and the status counts six layers in four uses of the ring."""
    src = _stored(client, "stg-span-src", 31, 12_000)
    dst = _with_ring(client, "stg-span", 32, 2, slot_bytes=4 * LAYER_BYTES)
    load = client.retrieve_layerwise("stg-span", _tokens(12_000), SHUFFLED, request_id="sp")
    for layer in range(NL):
        load.wait_layer(layer)
        assert torch.equal(layer_blocks(dst, layer, SHUFFLED), layer_blocks(src, layer, SRC))
    assert load.staged_layers == list(range(NL)) and load.ring_scatters == 4
    ring = client.status()["server"]["instances"]["stg-span"]["staging"]
    assert (ring["staged_layers"], ring["slot_uses"]) == (NL, 4)


def test_loads_waited_layer_by_layer_share_the_ring(client: KVFlowClient) -> None:
    """Two loads asked for before the forward pass and waited layer-major (A0, B0, A1, ...)
    through a ring of one slot: the calls and the waits free the slot for each other, and
    both land whole."""
    src_a = _stored(client, "stg-a", 3, 2000)
    src_b = _stored(client, "stg-b", 4, 3000)
    dst = _with_ring(client, "stg-two", 5, 1)
    blocks_a, blocks_b = SHUFFLED, OTHER
    load_a = client.retrieve_layerwise("stg-two", _tokens(2000), blocks_a, request_id="a")
    load_b = client.retrieve_layerwise("stg-two", _tokens(3000), blocks_b, request_id="b")
    for layer in range(NL):
        load_a.wait_layer(layer)
        load_b.wait_layer(layer)
    for layer in range(NL):
        assert torch.equal(layer_blocks(dst, layer, blocks_a), layer_blocks(src_a, layer, SRC))
        assert torch.equal(layer_blocks(dst, layer, blocks_b), layer_blocks(src_b, layer, SRC))
    assert load_a.staged_layers == load_b.staged_layers == list(range(NL))
    # one slot for twelve layers: the server waited for the engine's pumps
    assert client.status()["server"]["instances"]["stg-two"]["staging"]["slot_wait_s"] > 0


def test_a_layer_larger_than_a_slot_is_scattered_by_the_server(client: KVFlowClient) -> None:
    """A slot one byte short of a layer takes none: the server scatters every layer, and
    they land all the same; skipped blocks stay untouched."""
    src = _stored(client, "stg-big", 6, 4000)
    dst = _with_ring(client, "stg-small", 7, 2, LAYER_BYTES - 1)
    before = layer_blocks(dst, 0, SHUFFLED[:1])
    load = client.retrieve_layerwise(
        "stg-small", _tokens(4000), SHUFFLED, request_id="big", skip_first_n_tokens=BS
    )
    load.wait()
    assert load.staged_layers == []
    for layer in range(NL):
        assert torch.equal(
            layer_blocks(dst, layer, SHUFFLED[1:]), layer_blocks(src, layer, SRC[1:])
        )
    assert torch.equal(layer_blocks(dst, 0, SHUFFLED[:1]), before)


@pytest.mark.parametrize("skipped", [1, 3], ids=["a-block", "a-chunk-and-a-block"])
def test_a_skipped_prefix_is_left_alone_by_the_engines_scatter(
    client: KVFlowClient, skipped: int
) -> None:
    """With the first blocks skipped (part of a chunk, or a whole chunk and more, which
    the server then does not stage at all), the engine's scatter, which finds the staged
    chunks' blocks from the skip and the slot's rows alone, writes every other block of
    the hit and leaves those as they were."""
    src = _stored(client, f"stg-skip{skipped}-src", 8, 5000 + 100 * skipped)
    dst = _with_ring(client, f"stg-skip{skipped}", 9, 2)
    before = [layer_blocks(dst, layer, SHUFFLED[:skipped]) for layer in range(NL)]
    load = client.retrieve_layerwise(
        f"stg-skip{skipped}", _tokens(5000 + 100 * skipped), SHUFFLED,
        request_id=f"skip{skipped}", skip_first_n_tokens=skipped * BS,
    )  # fmt: skip
    load.wait()
    assert load.staged_layers == list(range(NL))
    for layer in range(NL):
        assert torch.equal(
            layer_blocks(dst, layer, SHUFFLED[skipped:]), layer_blocks(src, layer, SRC[skipped:])
        )
        assert torch.equal(layer_blocks(dst, layer, SHUFFLED[:skipped]), before[layer])


def test_a_load_nobody_waits_for_ends_with_its_instance(client: KVFlowClient) -> None:
    """An engine that stops waiting for layers holds the server at a full ring only until
    its instance goes: the retrieve fails from the layer it could not stage, the server
    serves other instances meanwhile and the instance registered again."""
    src = _stored(client, "stg-dead-src", 10, 6000)
    dst = shared_caches(11)
    kwargs = dict(
        model_name="stg", block_size=BS, layerwise=True, staging_slots=1,
        staging_slot_bytes=LAYER_BYTES,
    )  # fmt: skip
    client.register_kv_caches("stg-dead", dst, **kwargs)
    load = client.retrieve_layerwise("stg-dead", _tokens(6000), SHUFFLED, request_id="dead")
    other = client.retrieve("stg-dead-src", _tokens(6000), SRC, request_id="other")
    assert other == CHUNKS * CHUNK  # another instance's worker is free
    client.unregister("stg-dead")
    with pytest.raises(TransferError, match="layer 1"):
        load.wait_layer(1)  # layer 0 took the slot; nothing scattered it before the end
    client.register_kv_caches("stg-dead", dst, **kwargs)
    again = client.retrieve_layerwise("stg-dead", _tokens(6000), SHUFFLED, request_id="again")
    again.wait()
    assert torch.equal(layer_blocks(dst, NL - 1, SHUFFLED), layer_blocks(src, NL - 1, SRC))


def test_waits_from_two_threads_share_one_pump(client: KVFlowClient) -> None:
    """Two threads waiting on two loads (each its own layers) pump the one ring in turn:
    both land whole."""
    src_a = _stored(client, "stg-ta", 12, 7000)
    src_b = _stored(client, "stg-tb", 13, 8000)
    dst = _with_ring(client, "stg-threads", 14, 2)
    load_a = client.retrieve_layerwise("stg-threads", _tokens(7000), SHUFFLED, request_id="ta")
    load_b = client.retrieve_layerwise("stg-threads", _tokens(8000), OTHER, request_id="tb")
    errors: list[BaseException] = []

    def wait_b() -> None:
        try:
            load_b.wait()
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=wait_b)
    thread.start()
    load_a.wait()
    thread.join(30)
    assert not thread.is_alive() and not errors
    for layer in range(NL):
        assert torch.equal(layer_blocks(dst, layer, SHUFFLED), layer_blocks(src_a, layer, SRC))
        assert torch.equal(layer_blocks(dst, layer, OTHER), layer_blocks(src_b, layer, SRC))


def test_the_largest_ring_of_the_smallest_slots_is_taken(client: KVFlowClient) -> None:
    """64 slots of one byte are a ring: no layer fits, so the server scatters them all."""
    src = _stored(client, "stg-tiny-src", 19, 10_000)
    dst = _with_ring(client, "stg-tiny", 20, 64, 1)
    load = client.retrieve_layerwise("stg-tiny", _tokens(10_000), SHUFFLED, request_id="t")
    load.wait()
    assert load.staged_layers == []
    assert torch.equal(layer_blocks(dst, 0, SHUFFLED), layer_blocks(src, 0, SRC))
    ring = client.status()["server"]["instances"]["stg-tiny"]["staging"]
    assert (ring["slots"], ring["slot_bytes"], ring["staged_layers"]) == (64, 1, 0)


@pytest.mark.parametrize(
    ("slots", "slot_bytes", "match"),
    [
        (0, 1024, "1..64 slots"),
        (65, 1024, "1..64 slots"),
        (2, 0, "at least one byte"),
    ],
)
def test_a_ring_that_cannot_be_is_refused_before_sending(
    client: KVFlowClient, slots: int, slot_bytes: int, match: str
) -> None:
    dst = shared_caches(15)
    kwargs = dict(layerwise=True, staging_slots=slots, staging_slot_bytes=slot_bytes)
    if slots == 0:  # no ring asked for with a slot size: nothing to refuse
        client.register_kv_caches("stg-none", dst, model_name="stg", block_size=BS, **kwargs)
        return
    with pytest.raises(InvalidRequestError, match=match):
        client.register_kv_caches("stg-bad", dst, model_name="stg", block_size=BS, **kwargs)


def test_a_ring_without_layerwise_is_refused(client: KVFlowClient) -> None:
    with pytest.raises(InvalidRequestError, match="staging_slots needs layerwise=True"):
        client.register_kv_caches(
            "stg-plain", shared_caches(16), model_name="stg", block_size=BS, staging_slots=2,
            staging_slot_bytes=LAYER_BYTES,
        )  # fmt: skip


def _register(client: KVFlowClient, request: Register) -> None:
    client._call(request)  # a request kvflow's client would not build, as it is sent


def test_staging_events_with_cpu_caches_are_refused(client: KVFlowClient) -> None:
    """A ring in shared memory for CPU caches that comes with CUDA events is refused
    naming the rule; the instance is not registered."""
    dst = shared_caches(21)
    ring = empty_shared((2, 64), torch.uint8)
    flags = empty_shared((2 * NL + control_words(2)) * 8, torch.uint8)
    request = Register(
        instance_id="stg-events", kv_caches=describe_kv_caches(dst), model_name="stg",
        block_size=BS, layer_flags=describe_tensor(flags, "flags"),
        layer_staging=describe_tensor(ring, "ring"),
        layer_staging_event_handles=[bytes(64)] * 4,
    )  # fmt: skip
    rule = (
        r"^a staging ring lives with the caches \(GPU memory and its events for GPU caches,"
        r" shared memory without events for CPU caches\)$"
    )
    with pytest.raises(InvalidRequestError, match=rule):
        _register(client, request)
    with pytest.raises(UnknownInstanceError, match="'stg-events' is not registered"):
        client.retrieve("stg-events", _tokens(1000), SHUFFLED, request_id="x")


@pytest.mark.parametrize(
    ("ring", "words", "match"),
    [
        (torch.uint8, 2, r"\[slots, slot bytes\] uint8"),  # 1-D
        (torch.float16, 2, r"\[slots, slot bytes\] uint8"),
        (  # flags without the ring's words
            torch.uint8,
            3,
            r"\(one int64 per layer for retrieves, one for stores, then 12 for a staging ring"
            r" of 2 slots\)$",
        ),
    ],
)
def test_a_bad_ring_on_the_wire_is_refused_and_the_server_serves_on(
    client: KVFlowClient, ring: torch.dtype, words: int, match: str
) -> None:
    """A Register whose ring is not [slots, bytes] uint8, or whose flags lack the ring's
    words, gets an error naming it; the instance is not registered."""
    dst = shared_caches(17)
    shape = (2 * 64,) if ring is torch.uint8 and words == 2 else (2, 64)
    buffer = empty_shared(shape, ring)
    flag_words = 2 * NL + (control_words(2) if words == 2 else 0)
    flags = empty_shared(flag_words * 8, torch.uint8)
    request = Register(
        instance_id="stg-wire", kv_caches=describe_kv_caches(dst), model_name="stg",
        block_size=BS, layer_flags=describe_tensor(flags, "flags"),
        layer_staging=describe_tensor(buffer, "ring"),
    )  # fmt: skip
    with pytest.raises(InvalidRequestError, match=match):
        _register(client, request)
    with pytest.raises(UnknownInstanceError, match="'stg-wire' is not registered"):
        client.retrieve("stg-wire", _tokens(1000), SHUFFLED, request_id="x")
    _stored(client, f"stg-wire-after-{str(ring)[6:]}-{words}", 18, 9000)  # and the server serves on


def _layerwise_fields(case: str, keep: list[torch.Tensor]) -> dict[str, Any]:
    """A Register's layerwise fields for `case`; the shared tensors they describe go into
    `keep` (freed, their names would no longer open)."""
    flags = empty_shared(2 * NL * 8, torch.int8 if case == "int8-flags" else torch.uint8)
    ring = empty_shared((2, 64), torch.uint8)
    keep += [flags, ring]
    events = [bytes(64)] * (2 * NL)
    return {
        "int8-flags": {"layer_flags": describe_tensor(flags, "flags")},
        "ring-alone": {"layer_staging": describe_tensor(ring, "ring")},
        "events-alone": {"layer_event_handles": events},
        "events-on-cpu": {
            "layer_event_handles": events,
            "layer_flags": describe_tensor(flags, "flags"),
        },
    }[case]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (  # flags as int8 items rather than uint8 bytes
            "int8-flags",
            rf"^layerwise registration gives layer flags of shape \({2 * NL * 8},\) for {NL}"
            rf" layers: expected \({2 * NL * 8},\) uint8 bytes \(one int64 per layer for"
            r" retrieves, one for stores\)$",
        ),
        ("ring-alone", "^a staging ring goes with a layerwise registration$"),
        ("events-alone", "^a layerwise registration needs layer_flags in shared memory$"),
        (
            "events-on-cpu",
            r"^layer_event_handles go with GPU caches, and only with them \(these caches are"
            r" on the CPU\)$",
        ),
    ],
)
def test_a_layerwise_registration_that_cannot_be_is_refused_by_rule(
    client: KVFlowClient, case: str, message: str
) -> None:
    """A Register whose layerwise parts do not go together gets the rule it breaks; the
    instance is not registered and the server serves on."""
    keep = shared_caches(26)
    request = Register(
        instance_id="lw-wire", kv_caches=describe_kv_caches(keep), model_name="stg",
        block_size=BS, **_layerwise_fields(case, keep),
    )  # fmt: skip
    with pytest.raises(InvalidRequestError, match=message):
        _register(client, request)
    with pytest.raises(UnknownInstanceError, match="'lw-wire' is not registered"):
        client.retrieve("lw-wire", _tokens(1000), SHUFFLED, request_id="x")


def test_a_later_layer_waited_first_pumps_the_ring_while_it_waits(client: KVFlowClient) -> None:
    """Waiting for the last layer first, through a ring of one slot: the wait scatters
    the earlier layers as the server stages them, so the last one comes, and every layer
    is whole."""
    src = _stored(client, "stg-late-src", 27, 11_000)
    dst = _with_ring(client, "stg-late", 28, 1)
    load = client.retrieve_layerwise("stg-late", _tokens(11_000), SHUFFLED, request_id="late")
    load.wait_layer(NL - 1)
    for layer in range(NL):
        assert torch.equal(layer_blocks(dst, layer, SHUFFLED), layer_blocks(src, layer, SRC))
    assert load.staged_layers == list(range(NL))
