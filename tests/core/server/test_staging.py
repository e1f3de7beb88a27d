"""The staging ring's bookkeeping between its two sides, in one process on CPU caches
(kvflow.core.server.staging): uses in order, loads whose calls failed, loads not
answered yet."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvflow.core import empty_shared
from kvflow.core.errors import RequestTimeoutError, TransferError
from kvflow.core.server.layers import ClientLayers, ServerLayers
from kvflow.core.server.staging import HEAD, TAIL, ServerStaging
from kvflow.kernels import KVLayout

NL, NB, BS, NH, HS = 2, 16, 4, 1, 4  # vllm_flash_attn: NL x [2, NB, BS, NH, HS], fp16
CHUNK = 8  # two blocks a chunk
LAYER_BYTES = 2 * CHUNK * NH * HS * 2  # one chunk's K and V of one layer


def _sides(slots: int) -> tuple[list[torch.Tensor], ClientLayers, ServerStaging]:
    caches = [empty_shared((2, NB, BS, NH, HS), torch.float16).zero_() for _ in range(NL)]
    layout = KVLayout.from_kv_caches(caches, block_size=BS)
    client = ClientLayers(NL, None, layout, slots, LAYER_BYTES)
    assert client.staging is not None
    server = ServerLayers(NL, None, client.raw, slots)
    ring = ServerStaging(client.staging.ring, server.staging_words, None)
    return caches, client, ring


def _stage(ring: ServerStaging, seq: int, layer: int, value: float) -> None:
    """The server's part: claim the next slot and fill it with one chunk of `value`."""
    claims = ring.claims(seq, lambda: False)
    slot = claims.claim()
    slot[:LAYER_BYTES].view(torch.float16).fill_(value)
    claims.staged(layer, 1, 1, CHUNK, None)


def test_a_load_that_never_came_back_frees_its_slots_unread() -> None:
    """Every use of a retrieve whose call failed (dropped) is skipped, the next load's use
    is scattered into its blocks; a use of a number this side never asked for waits."""
    caches, client, ring = _sides(2)
    staging = client.staging
    assert staging is not None
    _stage(ring, 1, 0, 5.0)  # retrieve 1: not this side's, until dropped below
    _stage(ring, 1, 1, 5.0)
    staging.pump()
    assert int(staging.control[TAIL]) == 0  # not asked for, not dropped: the uses wait
    staging.add_load(1, np.array([0, 1], dtype=np.int32), 0)
    staging.drop(1)  # asked for, then its call failed: forgotten with its uses
    staging.pump()
    assert int(staging.control[TAIL]) == 2 and not any(c.any() for c in caches)
    staging.drop(2)  # another call that failed
    _stage(ring, 2, 0, 6.0)
    load = staging.add_load(3, np.array([6, 3], dtype=np.int32), 0)
    _stage(ring, 3, 1, 7.0)
    staging.pump()
    assert int(staging.control[HEAD]) == int(staging.control[TAIL]) == 4
    assert staging.landed(load, 1) == (True, None, False)
    assert staging.landed(load, 0) == (False, None, False)
    assert bool((caches[1][:, [6, 3]] == 7.0).all()) and not caches[0].any()


def test_slot_waits_add_up_across_claims() -> None:
    """The ring's stats count its uses and the seconds the server waited for free slots,
    every claim's wait added (none while slots are free)."""
    _, client, ring = _sides(1)
    staging = client.staging
    assert staging is not None
    staging.add_load(1, np.array([0, 1], dtype=np.int32), 0)
    _stage(ring, 1, 0, 1.0)  # a free slot: no wait
    assert ring.stats() == {
        "slots": 1, "slot_bytes": LAYER_BYTES, "staged_layers": 1, "slot_uses": 1,
        "slot_wait_s": pytest.approx(0.0, abs=0.05),
    }  # fmt: skip
    for seq, layer in ((2, 1), (3, 0)):  # each claim waits ~0.2 s for the engine's pump
        timer = threading.Timer(0.2, staging.pump)
        timer.start()
        _stage(ring, seq, layer, 2.0)
        timer.join()
        # its load known only now, so a pump still running when the use was written
        # cannot scatter it early and spare the next claim its wait
        staging.add_load(seq, np.array([0, 1], dtype=np.int32), 0)
    stats = ring.stats()
    assert stats["staged_layers"] == stats["slot_uses"] == 3
    assert 0.38 <= stats["slot_wait_s"] < 30


def test_the_server_waits_for_a_slot_until_the_engine_scatters_or_it_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full ring holds the server's next claim: cancelled, it raises TransferError; with
    nobody scattering, RequestTimeoutError after SLOT_TIMEOUT_S."""
    _, client, ring = _sides(1)
    _stage(ring, 1, 0, 1.0)
    with pytest.raises(TransferError, match="staging slot 0"):
        ring.claims(1, lambda: True).claim()
    monkeypatch.setattr("kvflow.core.server.staging.SLOT_TIMEOUT_S", 0.05)
    with pytest.raises(RequestTimeoutError, match="staging slot 0"):
        ring.claims(1, lambda: False).claim()
    assert client.staging is not None
    client.staging.add_load(1, np.array([0, 1], dtype=np.int32), 0)
    client.staging.pump()
    assert ring.claims(1, lambda: False).claim().numel() == LAYER_BYTES


def test_loads_without_staged_layers_are_not_held() -> None:
    """Loads none of whose layers came through the ring (all straight into blocks, or
    too large for a slot) are forgotten once a later one is answered and the ring is
    drained: an engine whose blocks are in order holds one at most."""
    caches, client, ring = _sides(1)
    staging = client.staging
    assert staging is not None
    for seq in range(1, 6):
        staging.add_load(seq, np.array([0, 1], dtype=np.int32), 0)
        staging.answered(seq)
        staging.pump()
        assert staging.loads_held == 1
    staging.drop(6)  # a call that failed: its uses, if any, may still come
    _stage(ring, 6, 0, 3.0)
    staging.add_load(7, np.array([2, 3], dtype=np.int32), 0)
    staging.answered(7)
    staging.pump()  # the dropped use freed unread, load 5 forgotten
    assert staging.loads_held == 1 and int(staging.control[TAIL]) == 1
    assert not any(c.any() for c in caches)


def test_an_answered_load_is_held_while_the_next_one_is_not_answered() -> None:
    """Loads are known from their calls on: one answered (its layer 0 queued) may still
    stage later layers after the next load was asked for, so it is held, and its uses
    scattered into its own blocks, until a use of the next one or the next one's reply
    says the server finished it."""
    caches, client, ring = _sides(2)
    staging = client.staging
    assert staging is not None
    first = staging.add_load(1, np.array([4, 5], dtype=np.int32), 0)
    _stage(ring, 1, 0, 2.0)
    staging.answered(1)
    second = staging.add_load(2, np.array([8, 9], dtype=np.int32), 0)
    staging.pump()
    assert staging.loads_held == 2
    _stage(ring, 1, 1, 3.0)  # retrieve 1's last layer, staged after retrieve 2 was sent
    staging.pump()
    assert staging.landed(first, 1) == (True, None, False)
    assert bool((caches[1][:, [4, 5]] == 3.0).all())
    _stage(ring, 2, 0, 4.0)
    staging.pump()
    assert staging.loads_held == 1 and staging.landed(second, 0) == (True, None, False)
    assert bool((caches[0][:, [8, 9]] == 4.0).all()) and bool((caches[0][:, [4, 5]] == 2.0).all())


def test_a_use_holding_more_chunks_than_the_load_has_blocks_fails_that_load_alone() -> None:
    """A use whose entry says it holds more chunks than its load's blocks take is freed
    unread: that load's waits raise TransferError naming both counts, nothing is written
    for it, and the next load's use lands as usual."""
    caches, client, ring = _sides(2)
    staging = client.staging
    assert staging is not None
    lied = staging.add_load(1, np.array([4, 5], dtype=np.int32), 0)
    claims = ring.claims(1, lambda: False)
    claims.claim()[: 3 * LAYER_BYTES].view(torch.float16).fill_(9.0)
    claims.staged(0, 1, 3, CHUNK, None)
    fine = staging.add_load(2, np.array([8, 9], dtype=np.int32), 0)
    _stage(ring, 2, 0, 4.0)
    staging.pump()  # no error here: the pump may run in another load's wait
    assert int(staging.control[TAIL]) == 2
    with pytest.raises(TransferError, match=r"staged 3 chunks of 8 tokens .* 2 blocks of 4"):
        staging.landed(lied, 0)
    assert staging.landed(fine, 0) == (True, None, False)
    assert bool((caches[0][:, [8, 9]] == 4.0).all()) and not (caches[0] == 9.0).any()
