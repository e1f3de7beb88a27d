"""Server behaviours mutation testing left untested: KV-event filters, admin callers, stop lines."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.errors import (
    AlreadyRegisteredError,
    CapacityError,
    DrainingError,
    InvalidRequestError,
    PermissionDeniedError,
    UnknownInstanceError,
    UnknownSubscriptionError,
)
from kvflow.core.server import server as server_module
from kvflow.core.server.kv_streams import KVPoll
from kvflow.core.server.protocol import (
    AdminClear,
    AdminDrain,
    Done,
    Failed,
    KVSubscribed,
    Register,
    Registered,
    ShmMemory,
    Status,
    StatusResult,
    Unregister,
    encode_request,
)
from kvflow.core.server.server import KVFlowServer
from kvflow.core.server.sharing import describe_kv_caches, describe_tensor
from kvflow.core.server.shm import shared_memory_of
from kvflow.events import BlockAllocation
from kvflow.subscribers.kv_events import KVRecord
from tests.support.ops import (
    CHUNK,
    ServerProcess,
    raw_reply,
    serving,
    shared_kv,
    tokens,
    wait_for,
)

STOPPING = "kvflow server stopping: finishing in-flight work"
STOPPED = "kvflow server stopped (event pipeline clean)"


class _Records(logging.Handler):
    """Keeps every record it handles."""

    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, prefix: str = "kvflow server") -> list[str]:
        return [m for r in self.records if (m := r.getMessage()).startswith(prefix)]


@pytest.fixture
def server_log() -> Iterator[logging.Logger]:
    """The "kvflow.server" logger, its level, propagation and handlers restored after."""
    logger = logging.getLogger("kvflow.server")
    level, propagate, handlers = logger.level, logger.propagate, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.propagate = propagate
    logger.handlers[:] = handlers


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess("--disable-metrics", "--l1-size-gb", "0.05")
    yield srv
    assert srv.stop() == 0, srv.log()


def _config() -> ServerConfig:
    return ServerConfig(port=0, l1_size_gb=0.05, observability=ObservabilityConfig(enabled=False))


# -- KV events -------------------------------------------------------------------------------


def _read(client: KVFlowClient, sub: KVSubscribed, count: int) -> list[KVRecord]:
    """The subscription's records from its start, once there are `count` of them."""

    def records() -> list[KVRecord]:
        poll = client.poll_kv_events(sub.subscription, after_seq=0, after_log_seq=sub.log_seq)
        return poll.records if len(poll.records) >= count else []

    found: list[KVRecord] = wait_for(records, timeout_s=20, what=f"{count} KV records")
    return found


def test_each_subscription_filter_field_selects_its_owners(server: ServerProcess) -> None:
    """World size, rank and the salt (matched only with match_salt) each narrow what a
    subscription of one model gets; other models never show."""
    with KVFlowClient(server.endpoint, timeout_s=5) as client:
        every = client.subscribe_kv_events(model_name="filters")
        wide = client.subscribe_kv_events(model_name="filters", world_size=2)
        salted = client.subscribe_kv_events(model_name="filters", cache_salt="s", match_salt=True)
        unsalted = client.subscribe_kv_events(model_name="filters", match_salt=True)
        ranked = client.subscribe_kv_events(model_name="filters", world_size=2, rank=1)
        salt_ignored = client.subscribe_kv_events(model_name="filters", cache_salt="s")
        owners = {"a": (1, 0, None), "b": (2, 1, "s"), "c": (2, 0, None)}
        kvs = {name: shared_kv(seed) for seed, name in enumerate(owners)}
        for seed, (name, (world, rank, salt)) in enumerate(owners.items()):
            iid = f"filters-{name}-{os.getpid()}"
            client.register_kv_caches(
                iid, kvs[name], model_name="filters", world_size=world, rank=rank
            )
            stored = client.store(
                iid, tokens(CHUNK, seed=100 + seed), list(range(16)), request_id=name,
                cache_salt=salt,
            )  # fmt: skip
            assert stored == CHUNK

        def owned(sub: KVSubscribed, count: int) -> list[tuple[int, int, str | None]]:
            return [(r.world_size, r.rank, r.cache_salt) for r in _read(client, sub, count)]

        assert owned(every, 3) == list(owners.values())
        assert owned(wide, 2) == [owners["b"], owners["c"]]
        assert owned(salted, 1) == [owners["b"]]
        assert owned(unsalted, 2) == [owners["a"], owners["c"]]
        assert owned(ranked, 1) == [owners["b"]]
        assert owned(salt_ignored, 3) == list(owners.values())


def test_subscribe_poll_and_unsubscribe_replies(server: ServerProcess) -> None:
    """Subscribe, poll and unsubscribe each answer with the server's handling time; after
    unsubscribing, the subscription is unknown to its own client."""
    with KVFlowClient(server.endpoint, timeout_s=5) as client:
        sub = client.subscribe_kv_events(model_name="replies")
        assert client.last_server_time_s > 0
        poll = client.poll_kv_events(sub.subscription, after_seq=0, after_log_seq=sub.log_seq)
        assert isinstance(poll, KVPoll) and poll.records == []
        assert client.last_server_time_s > 0
        client.unsubscribe_kv_events(sub.subscription)
        assert client.last_server_time_s > 0
        with pytest.raises(UnknownSubscriptionError, match="subscribe again"):
            client.poll_kv_events(sub.subscription, after_seq=0, after_log_seq=sub.log_seq)


def test_a_router_idle_for_less_than_the_heartbeat_timeout_keeps_its_subscription(
    server: ServerProcess,
) -> None:
    """A subscriber that owns no instance (a router) and is quiet for a few of the
    server's reaping ticks, far less than the heartbeat timeout, can still poll."""
    with KVFlowClient(server.endpoint, timeout_s=5) as router:
        sub = router.subscribe_kv_events(model_name="idle-router")
        time.sleep(0.5)  # five reaping ticks, no request
        poll = router.poll_kv_events(sub.subscription, after_seq=0, after_log_seq=sub.log_seq)
        assert isinstance(poll, KVPoll) and poll.records == []
        router.unsubscribe_kv_events(sub.subscription)


def test_kv_events_off_says_so_exactly() -> None:
    """With --kv-events-chunks 0 a subscription is refused with the exact reason."""
    with ServerProcess(
        "--disable-observability", "--l1-size-gb", "0.05", "--kv-events-chunks", "0"
    ) as srv:
        with (
            KVFlowClient(srv.endpoint, timeout_s=5) as client,
            pytest.raises(InvalidRequestError) as refused,
        ):
            client.subscribe_kv_events()
        assert str(refused.value) == "KV events are off on this server (--kv-events-chunks 0)"


def test_a_server_built_without_a_config_takes_the_default_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`KVFlowServer()` serves with `ServerConfig()`. The defaults bind port 5555 and a
    metrics port, which a test cannot count on being free, so here the default is a
    small server on a free port (the class the module builds it from, patched)."""

    def small_default() -> ServerConfig:
        return ServerConfig(
            port=0, l1_size_gb=0.05, observability=ObservabilityConfig(enabled=False)
        )

    monkeypatch.setattr(server_module, "ServerConfig", small_default)
    server = KVFlowServer()
    try:
        assert server.config == small_default()
        assert server.status()["server"]["endpoint"] == server.endpoint
    finally:
        server.close()


# -- admin callers ---------------------------------------------------------------------------


def test_an_admin_client_named_like_none_is_served(server: ServerProcess) -> None:
    """Without CURVE a client id starting "None " is no owner form: the call runs and the
    log names the caller by its whole id."""
    with KVFlowClient(server.endpoint, timeout_s=5, client_id="None of them") as client:
        done = client.admin(AdminClear(model_name="mutants-none"))
    assert isinstance(done, dict)
    wait_for(
        lambda: " by None of them at 127.0.0.1: " in server.log(),
        timeout_s=15, what="the admin line naming the caller",
    )  # fmt: skip


def test_an_admin_call_without_a_client_id_names_the_caller_question_mark(
    server: ServerProcess,
) -> None:
    """A raw admin request with an empty client id is logged as "? at <peer>"."""
    reply = raw_reply(server.endpoint, AdminClear(id=7, model_name="mutants-anon"))
    assert isinstance(reply, StatusResult) and reply.id == 7, reply
    line = re.escape("admin clear {'model_name': 'mutants-anon'} by ? at 127.0.0.1: ")
    assert wait_for(lambda: re.search(line, server.log()), timeout_s=10, what="the admin line")


# -- shutdown lines (in-process: the log records themselves) ---------------------------------


def test_stop_logs_each_line_once_through_the_server_loggers_handlers(
    server_log: logging.Logger,
) -> None:
    """Closing twice logs "stopping" and "stopped" once; the stopped record is the server
    logger's INFO record, reaches a handler at INFO, and stops where propagation does."""
    own, parent = _Records(logging.INFO), _Records()
    server_log.setLevel(logging.INFO)
    server_log.propagate = False
    server_log.addHandler(own)
    kvflow_log = logging.getLogger("kvflow")
    kvflow_log.addHandler(parent)
    try:
        srv = KVFlowServer(_config())
        srv.close()
        srv.close()
    finally:
        kvflow_log.removeHandler(parent)
    assert own.messages() == [STOPPING, STOPPED]
    assert parent.messages() == []
    (stopped,) = [r for r in own.records if r.getMessage() == STOPPED]
    assert (stopped.name, stopped.levelno) == ("kvflow.server", logging.INFO)
    assert (stopped.pathname, stopped.lineno) == (server_module.__file__, 0)


def test_no_stopped_line_when_the_server_logger_is_above_info(server_log: logging.Logger) -> None:
    """With the server's logger at WARNING, neither the stopping nor the stopped line is
    handled, even by a handler that takes every level."""
    own = _Records()
    server_log.setLevel(logging.WARNING)
    server_log.addHandler(own)
    KVFlowServer(_config()).close()
    assert own.messages() == []


def test_a_clean_stop_unmaps_the_instances_shared_memory() -> None:
    """After a stop with no busy worker, the server holds no mapping of a registered
    instance's shared memory that stored and retrieved (only the client's own remains)."""
    kv = shared_kv(7)
    names = {m.name for t in kv if isinstance(m := shared_memory_of(t), ShmMemory)}
    assert len(names) == len(kv)

    def maps() -> int:
        with open("/proc/self/maps") as lines:
            return sum(any(n in line for n in names) for line in lines)

    srv = KVFlowServer(_config())
    with serving(srv), KVFlowClient(srv.endpoint, timeout_s=5) as client:
        client.register_kv_caches("mapped", kv, model_name="m")
        prompt = tokens(CHUNK, seed=7)
        assert client.store("mapped", prompt, list(range(16)), request_id="s") == CHUNK
        assert client.retrieve("mapped", prompt, list(range(16, 32)), request_id="r") == CHUNK
        assert maps() == 2 * len(kv)
    assert maps() == len(kv)


# -- ownership, draining, re-registration -----------------------------------------------------


def test_a_store_on_anothers_instance_and_a_registration_while_draining_say_why_exactly(
    server: ServerProcess,
) -> None:
    """The two refusals name the refused operation and the reason, word for word."""
    kv = shared_kv(11)
    with (
        KVFlowClient(server.endpoint, timeout_s=5, client_id="owner") as owner,
        KVFlowClient(server.endpoint, timeout_s=5, client_id="other") as other,
    ):
        owner.register_kv_caches("owned", kv, model_name="refusals")
        with pytest.raises(PermissionDeniedError) as refused:
            other.store("owned", tokens(CHUNK, 11), list(range(16)), request_id="not-mine")
        assert str(refused.value) == (
            "Store refused: instance 'owned' belongs to another client (only the client that"
            " registered it may store, retrieve, report or unregister)"
        )
        with pytest.raises(PermissionDeniedError) as refused:
            other.retrieve("owned", tokens(CHUNK, 11), list(range(16)), request_id="not-mine")
        assert str(refused.value).startswith("Retrieve refused: instance 'owned' belongs to")
        with pytest.raises(PermissionDeniedError) as refused:
            other.report_block_allocations("owned", [BlockAllocation("q", [0], [1])])
        assert str(refused.value).startswith("ReportAllocations refused: instance 'owned'")
        with pytest.raises(PermissionDeniedError) as refused:
            other.report_layer_waits("owned", "q", [0.0])
        assert str(refused.value).startswith("ReportLayerWaits refused: instance 'owned'")
        with pytest.raises(PermissionDeniedError) as refused:
            other.unregister("owned")
        assert str(refused.value).startswith("Unregister refused: instance 'owned' belongs to")
        owner.admin(AdminDrain())
        try:
            with pytest.raises(DrainingError) as draining:
                other.register_kv_caches("late", kv, model_name="refusals")
            with pytest.raises(DrainingError) as draining_store:
                owner.store("owned", tokens(CHUNK, 12), list(range(16)), request_id="late")
        finally:
            owner.admin(AdminDrain(undrain=True))
        assert str(draining.value) == (
            "register refused: this server is draining for a restart (it finishes the work in"
            " flight and takes no new stores or registrations); use another server or retry"
            " after it is back"
        )
        assert str(draining_store.value).startswith("store refused: this server is draining")
        owner.unregister("owned")


def test_a_registration_slower_than_the_heartbeat_timeout_does_not_reap_its_client() -> None:
    """A client waiting for its first registration sends no heartbeats (it learns the
    interval from the reply): the registration, once done, counts as its last word, so a
    slow one (mapping large caches on a busy host, a GPU waiting for L1's pinning) is not
    reaped the moment it is served, and one in progress is never reaped."""
    srv = KVFlowServer(replace(_config(), heartbeat_timeout_s=1.2))  # beats every 0.3 s
    register = srv.engine.register_kv_caches

    def slow_register(*args: Any, **kwargs: Any) -> None:
        time.sleep(3.0)  # 2.5 timeouts, in which the reaper runs 30 times
        register(*args, **kwargs)

    srv.engine.register_kv_caches = slow_register  # type: ignore[method-assign]
    with serving(srv), KVFlowClient(srv.endpoint, timeout_s=10) as client:
        client.register_kv_caches("slow", shared_kv(13), model_name="m")
        time.sleep(0.25)  # the reaper looks twice or more before the client's first beat
        assert client.store("slow", tokens(CHUNK, 13), list(range(16)), request_id="s")
        assert client.status()["server"]["reaped_instances"] == 0


def test_a_registration_in_progress_does_not_shield_other_silent_clients() -> None:
    """While one client's registration is still being served, another client gone silent
    after registering is reaped on time: the reaper passes over the registration in
    progress and looks at every other one."""
    srv = KVFlowServer(replace(_config(), heartbeat_timeout_s=1.2))
    register = srv.engine.register_kv_caches
    started = threading.Event()

    def slow_register(instance_id: str, *args: Any, **kwargs: Any) -> None:
        if instance_id == "slow":
            started.set()
            time.sleep(5.0)
        register(instance_id, *args, **kwargs)

    srv.engine.register_kv_caches = slow_register  # type: ignore[method-assign]
    with serving(srv), KVFlowClient(srv.endpoint, timeout_s=10) as slow:
        waiting = threading.Thread(
            target=lambda: slow.register_kv_caches("slow", shared_kv(14), model_name="m")
        )
        waiting.start()
        assert started.wait(10)
        began = time.monotonic()
        silent = KVFlowClient(srv.endpoint, timeout_s=10)
        silent.register_kv_caches("silent", shared_kv(15), model_name="m")
        silent.close()  # no unregister: its instance stays until reaped
        with KVFlowClient(srv.endpoint, timeout_s=10) as watcher:
            wait_for(
                lambda: watcher.status()["server"]["reaped_instances"] == 1, 10,
                what="the silent client's instance reaped",
            )  # fmt: skip
        assert time.monotonic() - began < 3.5  # before the slow registration is served
        assert started.is_set() and waiting.is_alive()
        waiting.join(10)


def test_a_silent_client_without_instances_is_forgotten() -> None:
    """The server's table of clients drops one that owns no instance once it has been
    silent past the heartbeat timeout; a client holding an instance (and beating) stays."""
    srv = KVFlowServer(replace(_config(), heartbeat_timeout_s=1.0))
    with serving(srv), KVFlowClient(srv.endpoint, timeout_s=10) as owner:
        owner.register_kv_caches("kept", shared_kv(17), model_name="m")
        with KVFlowClient(srv.endpoint, timeout_s=10) as passer:
            passer.status()  # its only request: no instance, so no heartbeats
        assert set(owner.status()["server"]["clients"]) == {owner.client_id, passer.client_id}
        wait_for(
            lambda: set(owner.status()["server"]["clients"]) == {owner.client_id}, 10,
            what="the silent client without instances forgotten",
        )  # fmt: skip
        owner.unregister("kept")


def test_a_reaped_client_without_an_id_is_named_question_mark() -> None:
    """A registration sent with no client id (a bare socket) that never beats is reaped,
    and the warning names its client "?"."""
    with ServerProcess("--disable-observability", "--heartbeat-timeout-s", "1") as srv:
        caches = shared_kv(16)  # held: the server maps them
        kv = describe_kv_caches(caches)
        request = Register(id=5, instance_id="anon-reaped", kv_caches=kv, model_name="m")
        assert isinstance(raw_reply(srv.endpoint, request), Registered)
        line = "] reaping instance 'anon-reaped': client ? silent for over 1.0 s ["
        wait_for(lambda: line in srv.log(), timeout_s=15, what="the reaping line")


def test_a_client_that_never_reads_its_replies_does_not_stall_the_server() -> None:
    """Replies to a client whose queues are full are dropped (a ROUTER socket drops what
    a peer cannot take), never waited for: the loop goes on serving everyone else."""
    srv = KVFlowServer(_config())
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    mute = ctx.socket(zmq.DEALER)
    mute.setsockopt(zmq.RCVHWM, 1)
    mute.setsockopt(zmq.RCVBUF, 4096)
    mute.linger = 0
    try:
        with serving(srv):
            mute.connect(srv.endpoint)
            ask = encode_request(Status(id=1, client="mute"))  # replies of a few KB each
            for _ in range(5_000):  # more reply bytes than the queues between us can hold
                mute.send_multipart(ask)
            with KVFlowClient(srv.endpoint, timeout_s=10) as other:
                wait_for(
                    lambda: other.status()["server"]["requests"] > 5_000, 30,
                    what="every ask served",
                )  # fmt: skip
    finally:
        mute.close()
        ctx.term()


def test_every_reaped_instance_is_counted_and_the_latest_remembered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that closes without unregistering loses both its instances after the
    heartbeat timeout: the server counts two reaped instances, without an error, and
    (remembering one reaped id here) says the later one was reaped, the earlier only
    that it is not registered."""
    monkeypatch.setattr(server_module, "_REMEMBER_REAPED", 1)
    srv = KVFlowServer(replace(_config(), heartbeat_timeout_s=0.5))
    with serving(srv):
        with KVFlowClient(srv.endpoint, timeout_s=10) as gone:
            gone.register_kv_caches("left-0", shared_kv(14), model_name="m")
            gone.register_kv_caches("left-1", shared_kv(15), model_name="m")
        with KVFlowClient(srv.endpoint, timeout_s=10) as watcher:
            wait_for(
                lambda: watcher.status()["server"]["reaped_instances"] == 2, 10, what="two reaped"
            )
            status = watcher.status()["server"]
            assert (status["instances"], status["errors"]) == ({}, 0)
            for iid, reaped in (("left-0", False), ("left-1", True)):
                with pytest.raises(UnknownInstanceError) as unknown:
                    watcher.store(iid, tokens(CHUNK, 16), list(range(16)), request_id="x")
                assert ("(reaped: " in str(unknown.value)) is reaped, str(unknown.value)


def test_a_re_registration_is_logged_naming_its_client_and_a_takeover(
    server: ServerProcess,
) -> None:
    """Registering an id again releases the old registration, logged with the client that
    registered it again, and "(takeover)" when that is another client."""
    kv = shared_kv(12)
    with (
        KVFlowClient(server.endpoint, timeout_s=5, client_id="first") as first,
        KVFlowClient(server.endpoint, timeout_s=5, client_id="second") as second,
    ):
        first.register_kv_caches("again", kv, model_name="again")
        first.register_kv_caches("again", kv, model_name="again")
        second.register_kv_caches("again", kv, model_name="again", takeover=True)
        second.unregister("again")
    same = "instance 'again' re-registered by client first: releasing the old registration"
    taken = (
        "instance 'again' re-registered by client second (takeover): releasing the old registration"
    )
    lines = [f"] {same} [kvflow.server]", f"] {taken} [kvflow.server]"]  # whole messages
    wait_for(lambda: all(line in server.log() for line in lines), timeout_s=10)


def test_an_unknown_instance_is_named_and_a_fresh_server_counts_its_first_request() -> None:
    """A store for an id never registered names it (no reaping mentioned); a new server's
    first status counts one request served: that status; each request after it counts."""
    with (
        ServerProcess("--disable-observability", "--l1-size-gb", "0.05") as srv,
        KVFlowClient(srv.endpoint, timeout_s=5) as client,
    ):
        assert client.status()["server"]["requests"] == 1
        with pytest.raises(UnknownInstanceError) as unknown:
            client.store("ghost", tokens(CHUNK, 13), list(range(16)), request_id="g")
        assert str(unknown.value) == "instance 'ghost' is not registered"
        assert client.status()["server"]["requests"] == 3  # the store failed, but was served


@pytest.mark.parametrize("l2", [False, True], ids=["l1_only", "with_disk"])
def test_every_data_reply_carries_the_servers_handling_time(l2: bool, tmp_path: Path) -> None:
    """A store, a lookup (answered on the loop with L1 alone, on the query worker with an L2
    tier), a prefetch and its state, a retrieve, the engine's reports and an end of
    session each tell the client how long the server took (`last_server_time_s`), hit or
    miss."""
    prompt = tokens(2 * CHUNK, 21)
    disk = ("--l2-disk", str(tmp_path / "disk")) if l2 else ()
    with (
        ServerProcess("--disable-observability", "--l1-size-gb", "0.05", *disk) as srv,
        KVFlowClient(srv.endpoint, timeout_s=20) as client,
    ):
        client.register_kv_caches("timed", shared_kv(3), model_name="timed")
        calls: list[Callable[[], object]] = [
            lambda: client.store("timed", prompt, list(range(32)), request_id="s"),
            lambda: client.lookup(prompt, model_name="timed"),
            lambda: client.lookup(tokens(CHUNK, 22), model_name="timed"),
            lambda: client.retrieve("timed", prompt, list(range(32, 64)), request_id="r"),
            lambda: client.report_block_allocations("timed", [BlockAllocation("r", [0], [1])]),
            lambda: client.report_layer_waits("timed", "r", [0.0, 0.001]),
            lambda: client.end_session("r"),
        ]
        if l2:
            calls += [
                lambda: client.prefetch(prompt, model_name="timed"),
                lambda: client.prefetch_state(client.prefetch(prompt, model_name="timed")),
            ]
        for call in calls:
            client.status()  # a reply of its own in between
            began = time.perf_counter()
            call()
            took = time.perf_counter() - began
            assert 0 < client.last_server_time_s <= took, call  # within the round trip
        client.unregister("timed")


def test_a_registration_is_logged_whole_and_its_reply_timed(server: ServerProcess) -> None:
    """The server logs each registration with its instance, model, rank of world and
    client, and the reply carries the server's handling time."""
    with KVFlowClient(server.endpoint, timeout_s=20, client_id="reg-logger") as client:
        client.register_kv_caches(
            "reg-line", shared_kv(4), model_name="logged", world_size=2, rank=1
        )
        assert 0 < client.last_server_time_s < 20  # seconds, not a clock reading
        line = (
            "] registered instance 'reg-line' of model 'logged' (rank 1/2) for client reg-logger ["
        )
        wait_for(lambda: line in server.log(), timeout_s=10, what="the registration line")
        client.unregister("reg-line")
    # without a client id (a bare socket), the line names the client "?"
    caches = shared_kv(6)  # held: the server maps them
    kv = describe_kv_caches(caches)
    reply = raw_reply(
        server.endpoint, Register(id=3, instance_id="anon", kv_caches=kv, model_name="m")
    )
    assert isinstance(reply, Registered) and reply.id == 3, reply
    line = "] registered instance 'anon' of model 'm' (rank 0/1) for client ? ["
    wait_for(lambda: line in server.log(), timeout_s=10, what="the anonymous registration line")
    assert isinstance(raw_reply(server.endpoint, Unregister(id=4, instance_id="anon")), Done)


def test_a_registration_refused_for_its_layer_flags_leaves_no_instance(
    server: ServerProcess,
) -> None:
    """Layer flags of the wrong size are refused after the engine took the caches: the
    engine lets the instance go again, so the same id registers afterwards."""
    kv = shared_kv(5)
    flags = empty_shared((3,), torch.uint8)  # NL layers need 2 x NL int64 flags
    request = Register(
        id=9, instance_id="bad-flags", kv_caches=describe_kv_caches(kv), model_name="m",
        layer_flags=describe_tensor(flags, "layer flags"),
    )  # fmt: skip
    reply = raw_reply(server.endpoint, request)
    assert isinstance(reply, Failed) and reply.id == 9, reply
    assert reply.code == "invalid_argument" and "layer flags of shape (3,)" in reply.message
    with KVFlowClient(server.endpoint, timeout_s=20) as client:
        client.register_kv_caches("bad-flags", kv, model_name="m")
        client.unregister("bad-flags")


def test_the_server_threads_are_named_for_their_work(tmp_path: Path) -> None:
    """With --max-instances 1 one instance worker, and beside it the admin worker and (an
    L2 tier: lookups may wait on it) the query worker, each named for what it runs."""
    config = ServerConfig(
        port=0, l1_size_gb=0.05, max_instances=1, l2_disk_paths=(str(tmp_path),),
        l2_disk_size_gb=0.01, observability=ObservabilityConfig(enabled=False),
    )  # fmt: skip
    before = set(threading.enumerate())
    server = KVFlowServer(config)
    try:
        names = {t.name for t in threading.enumerate() if t not in before}
    finally:
        server.close()
    kvflow = {name for name in names if name.startswith("kvflow-") and "worker" in name}
    assert kvflow == {"kvflow-worker-0"}, names
    assert {"kvflow-queries", "kvflow-admin"} <= names, names


def test_each_registration_goes_to_the_least_loaded_worker_ties_taken_in_turn() -> None:
    """Eight workers (--max-instances 11): instances go one per worker in turn, then to the
    least loaded, equals taken in turn after the last one picked; a worker freed by an
    unregister is picked only as the least loaded."""
    with (
        ServerProcess(
            "--disable-observability", "--l1-size-gb", "0.05", "--max-instances", "11"
        ) as srv,
        KVFlowClient(srv.endpoint, timeout_s=5) as client,
    ):

        def worker_of(name: str) -> str:
            client.register_kv_caches(name, shared_kv(20), model_name="spread")
            worker: str = client.status()["server"]["instances"][name]["worker"]
            return worker

        assert [worker_of(f"i{k}") for k in range(1, 9)] == [f"worker-{k}" for k in range(8)]
        assert [worker_of("i9"), worker_of("i10")] == ["worker-0", "worker-1"]
        client.unregister("i8")  # worker-7 holds nothing now
        assert worker_of("i11") == "worker-7"
        # worker-0 and worker-1 hold two each, the rest one: the turn starts at
        # worker-0 again, and the first with one is worker-2
        assert worker_of("i12") == "worker-2"


def test_a_taken_id_and_a_full_server_refuse_a_registration_saying_what_to_do() -> None:
    """Another client's id is refused with how to get it (wait for the reap, or take it
    over), and a registration past --max-instances with how to make room."""
    with (
        ServerProcess(
            "--disable-observability", "--l1-size-gb", "0.05", "--max-instances", "1",
            "--heartbeat-timeout-s", "7",
        ) as srv,
        KVFlowClient(srv.endpoint, timeout_s=5, client_id="holder") as holder,
        KVFlowClient(srv.endpoint, timeout_s=5, client_id="late") as late,
    ):  # fmt: skip
        holder.register_kv_caches("taken", shared_kv(21), model_name="full")
        with pytest.raises(AlreadyRegisteredError) as taken:
            late.register_kv_caches("taken", shared_kv(21), model_name="full")
        assert str(taken.value) == (
            "instance 'taken' is already registered by another client; if that client is"
            " gone, the server reaps the instance after --heartbeat-timeout-s (7 s) of its"
            " silence, or register with takeover=True to take it over now"
        )
        with pytest.raises(CapacityError) as full:
            late.register_kv_caches("second", shared_kv(22), model_name="full")
        assert str(full.value) == (
            "the server already serves 1 instances, its limit (--max-instances): unregister"
            " one or raise the limit"
        )


def test_only_port_zero_means_any_port() -> None:
    """A server asked for port 1 listens on port 1 (run as root) or fails naming it (a
    privileged port), never on a port of ZMQ's choosing: only 0 asks for that."""
    try:
        srv = KVFlowServer(replace(_config(), port=1))
    except OSError as exc:
        assert "cannot listen on 127.0.0.1:1: " in str(exc), exc
        return
    try:
        assert srv.endpoint == "tcp://127.0.0.1:1", srv.endpoint
    finally:
        srv.close()
