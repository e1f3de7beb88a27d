"""ShardedServer: one endpoint in front of rank shards (`kvflow server --shards N`).

One interpreter queues two GPUs' copies slower than two do: the ranks' host work takes
turns on one GIL (docs/SERVER.md, Many GPUs). A sharded server is N shard processes
(shards.py), each a whole KVFlowServer holding the ranks r with r % N == its index,
behind this front, which owns the public socket (CURVE and admin rights included) and
routes every request (docs/SERVER.md, Shards):

- a registration goes to its rank's shard, and the instance's later requests follow it;
- a lookup, prefetch or blend lookup goes to every shard holding some of its ranks,
  each asked for its own, and the answer is what all hold (fanout.py);
- heartbeats, session ends, admin operations and status go to every shard;
- a KV-event subscription to one rank lives on that rank's shard; one to every rank
  subscribes on every shard, and the front merges their polls (merged_events.py).

The front only decodes headers and moves frames; the copies' host work runs in the
shards, one interpreter per rank's GPU. A shard that dies stops the whole server: its
ranks' KV is gone, and an operator's restart is the honest repair.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq

from kvflow.core.config import ServerConfig
from kvflow.core.errors import InvalidRequestError, KVFlowError
from kvflow.core.server import fanout
from kvflow.core.server.admin import AdminAuth, AdminCaller
from kvflow.core.server.intake import read_request
from kvflow.core.server.kv_streams import check_poll
from kvflow.core.server.listen import close_listener, listen, received, send_reply
from kvflow.core.server.merged_events import PREFIX, MergedStreams
from kvflow.core.server.probes import LoopClock, ProbeServer
from kvflow.core.server.protocol import (
    PROTOCOL_VERSION,
    AdminQuota,
    AdminRequest,
    BlendLookup,
    BlendRetrieve,
    Done,
    EndSession,
    Failed,
    Heartbeat,
    KVEvents,
    KVSubscribed,
    Lookup,
    PollKVEvents,
    Prefetch,
    PrefetchQuery,
    Register,
    Registered,
    Reply,
    ReportAllocations,
    ReportLayerWaits,
    Request,
    Retrieve,
    Status,
    StatusResult,
    Store,
    SubscribeKVEvents,
    Unregister,
    UnsubscribeKVEvents,
    decode_reply,
    encode_header,
    encode_reply,
    peek_id,
)
from kvflow.core.server.shard_probes import ShardProbes
from kvflow.core.server.shards import STOP_TIMEOUT_S, Shard
from kvflow.core.server.worker import ErrorReplies, since

log = logging.getLogger("kvflow.server.front")

_TICK_S = 0.1
_BATCH = 64
#: how often the front asks every shard for its status, with probes on (they read the
#: last answers; a status takes a shard's loop a few milliseconds)
_STATUS_EVERY_S = 1.0
#: calls the front waits on at once: past it the oldest is forgotten (a shard that hangs
#: must not grow the front without bound; its clients time out either way)
_MAX_CALLS = 1 << 16
#: how long a status waits for the shards before it answers with those that did
STATUS_PATIENCE_S = 5.0
#: instances whose shard the front remembers (an instance reaped by its shard stays
#: routed there until this many newer ones push it out)
_MAX_ROUTES = 1 << 16


@dataclass
class _Call:
    """A client's request in flight on one or more shards: who gets the reply, and how the
    shards' replies (by slot, in shard order) become it."""

    identity: bytes | None  # None: the front's own request (status for the probes)
    request_id: int
    started: int
    join: fanout.Join | None  # None: one shard's reply, passed on
    replies: list[Reply | None]
    after: Callable[[Reply], None] | None = None
    #: how long to wait for shards that have not answered (None: as long as the client
    #: does); the join then gets their places as Failed replies
    patience_s: float | None = None
    deadline: float | None = field(init=False)
    waiting: int = field(init=False)
    #: the front ids its parts went out under, and the shards they went to, by slot
    ids: list[int] = field(init=False)
    shards: list[int] = field(init=False)

    def __post_init__(self) -> None:
        patience = self.patience_s
        self.deadline = None if patience is None else time.monotonic() + patience
        self.waiting = len(self.replies)
        self.ids = [0] * len(self.replies)
        self.shards = [0] * len(self.replies)


class ShardedServer:
    """The front of `config.shards` shard processes; see the module docstring.

    Binds and starts the shards at construction (OSError or ValueError naming what
    failed, nothing left running); `serve_forever` routes until `request_stop`, then
    stops the shards (each finishes its in-flight work). `failed` says why it stopped on
    its own (a shard died). Lock rule: the loop's thread owns everything but `_stop`,
    `_force` and `_shard_status` (replaced whole, read by the probes' thread).
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._n = config.shards
        self._max_bytes = int(config.max_message_mb * (1 << 20))
        self._ctx: zmq.Context[Any] = zmq.Context()
        try:
            self._router, self._curve = listen(self._ctx, config, self._max_bytes)
        except BaseException:
            self._ctx.term()
            raise
        self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dir = tempfile.mkdtemp(prefix="kvflow-shards-")  # mode 0700: ours alone
        self._shards: list[Shard] = []
        self._sockets: list[zmq.Socket[Any]] = []
        try:
            self._admin_auth = AdminAuth(config)
            self._start_shards()
        except BaseException:
            self._release()
            raise
        self._errors = ErrorReplies()
        self._calls: dict[int, tuple[_Call, int]] = {}
        self._impatient: list[_Call] = []  # calls with a deadline, until answered
        self._next_id = 1
        self._routes: OrderedDict[str, int] = OrderedDict()
        self._streams = MergedStreams()  # KV-event subscriptions to every rank
        self._stop = threading.Event()
        self._force = threading.Event()
        self._started = time.monotonic()
        self._served = 0
        self._clock = LoopClock()
        self._shard_status: list[tuple[float, dict[str, Any]] | None] = [None] * self._n
        self._next_status = 0.0
        #: why the server stopped on its own (a shard died); None while it serves
        self.failed: str | None = None
        self._probes: ProbeServer | None = None
        if config.probe_port:
            probes = ShardProbes(self._clock.age_s, lambda: list(self._shard_status),
                                 self._stop.is_set)  # fmt: skip
            try:
                self._probes = ProbeServer(probes, config.probe_host, config.probe_port)
            except OSError:
                self._release()
                raise

    def _start_shards(self) -> None:
        """Spawn every shard, then wait for each to listen and connect to it."""
        self._shards = [Shard(self.config, i, self._dir) for i in range(self._n)]
        for shard in self._shards:
            shard.wait_ready()
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(shard.endpoint)
            self._sockets.append(sock)
        log.info(
            "kvflow shards ready: %s",
            ", ".join(f"shard {s.index} pid {s.pid}" for s in self._shards),
        )

    @property
    def probe_port(self) -> int | None:
        """The port /healthz and /readyz answer on (None: probes off)."""
        return self._probes.port if self._probes is not None else None

    @property
    def shard_pids(self) -> list[int | None]:
        """The shard processes' ids, in shard order."""
        return [s.pid for s in self._shards]

    # -- lifecycle -----------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask the loop to stop; a second call stops waiting for the shards' work."""
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    def serve_forever(self) -> None:
        """Route requests until `request_stop` or a shard's death, then stop the shards."""
        log.info("kvflow server listening on %s (protocol %d)", self.endpoint, PROTOCOL_VERSION)
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        for shard in self._shards:
            poller.register(shard.sentinel, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self._clock.tick()
                ready = dict(poller.poll(int(_TICK_S * 1000)))
                for index, sock in enumerate(self._sockets):
                    if sock in ready:
                        self._shard_replies(index)
                if self._router in ready:
                    self._serve_batch()
                for shard in self._shards:
                    if shard.sentinel in ready:
                        self._shard_died(shard)
                        break
                if self._impatient:
                    self._expire()
                if self._probes is not None and time.monotonic() >= self._next_status:
                    self._next_status = time.monotonic() + _STATUS_EVERY_S
                    self._ask_status()
        finally:
            self.close()

    def _shard_died(self, dead: Shard) -> None:
        """Fail every call in flight and stop: a dead shard's ranks are gone."""
        dead.join(5.0)  # its sentinel fires as it exits, a moment before it can be reaped
        self.failed = f"shard {dead.index} (pid {dead.pid}) exited with code {dead.exitcode}"
        log.error("kvflow server stopping: %s", self.failed)
        reason = KVFlowError(f"the kvflow server is stopping: {self.failed}")
        for call, _ in list(self._calls.values()):
            if call.identity is not None and call.waiting:
                call.waiting = 0
                self._reply(call, self._errors.failed(call.request_id, reason, call.started))
        self._calls.clear()
        self._stop.set()

    def close(self) -> None:
        """Stop the shards (their in-flight work first, unless stopped twice) and release
        the socket, the probes and the private directory (idempotent)."""
        if self._probes is not None:
            self._probes.close()
            self._probes = None
        log.info("kvflow server stopping: stopping %d shards", len(self._shards))
        self._release()

    def _release(self) -> None:
        for shard in self._shards:
            shard.terminate()
        force = getattr(self, "_force", None)
        for shard in self._shards:
            shard.stop(0.0 if force is not None and force.is_set() else STOP_TIMEOUT_S)
        self._shards = []
        for sock in self._sockets:
            sock.close(0)
        self._sockets = []
        if not self._router.closed:
            close_listener(self._router, self._curve)
            self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- requests ------------------------------------------------------------------------

    def _serve_batch(self) -> None:
        for identity, frames in received(self._router, _BATCH):
            self._serve(identity, frames)

    def _serve(self, identity: bytes, frames: Sequence[zmq.Frame]) -> None:
        started = time.perf_counter_ns()
        self._served += 1
        request_id = peek_id(frames[0].buffer if frames else b"")
        try:
            request, arrays = read_request(frames, self._max_bytes, self._curve is not None)
            if isinstance(request, AdminRequest):
                self._admin(identity, request, frames[0], started)
            else:
                self._route(identity, request, arrays, started)
        except Exception as exc:
            self._send(identity, self._errors.failed(request_id, exc, started))

    def _route(
        self, identity: bytes, request: Request, arrays: tuple[np.ndarray, ...], started: int
    ) -> None:
        call = self._call_maker(identity, request, started)
        match request:
            case Register():
                self._register(call, request, arrays)
            case Store() | Retrieve() | BlendRetrieve() | ReportAllocations() | ReportLayerWaits():
                call([(self._routes.get(request.instance_id, 0), request)], arrays)
            case Unregister():
                shard = self._routes.get(request.instance_id, 0)
                call([(shard, request)], arrays, after=self._unrouted(request.instance_id, shard))
            case Lookup() | BlendLookup() | Prefetch():
                self._query(call, request, arrays)
            case PrefetchQuery():
                self._prefetch_state(call, request)
            case Heartbeat() | EndSession():
                call(self._everywhere(request), arrays, join=fanout.join_done)
            case Status():
                call(self._everywhere(request), arrays, join=self._join_status,
                     patience_s=STATUS_PATIENCE_S)  # fmt: skip
            case SubscribeKVEvents():
                self._subscribe(call, request)
            case PollKVEvents() | UnsubscribeKVEvents():
                self._kv_events(call, request)
            case _:
                raise InvalidRequestError(f"unsupported request {type(request).__name__}")

    def _call_maker(self, identity: bytes | None, request: Request, started: int) -> Any:
        """A function sending `request`'s parts to shards as one call of this client."""

        def send(
            parts: list[tuple[int, Request]],
            arrays: tuple[np.ndarray, ...],
            *,
            join: fanout.Join | None = None,
            after: Callable[[Reply], None] | None = None,
            patience_s: float | None = None,
        ) -> None:
            call = _Call(
                identity, request.id, started, join, [None] * len(parts), after, patience_s
            )
            if patience_s is not None:
                self._impatient.append(call)
            for slot, (shard, part) in enumerate(parts):
                self._forward(call, slot, shard, part, arrays)

        return send

    def _forward(
        self, call: _Call, slot: int, shard: int, part: Request, arrays: tuple[np.ndarray, ...]
    ) -> None:
        """Send one part to `shard` under a front-wide id (clients' ids may collide)."""
        front_id = self._next_id
        self._next_id += 1
        header = encode_header(msgspec.structs.replace(part, id=front_id))
        if len(self._calls) >= _MAX_CALLS:
            oldest = next(iter(self._calls))
            log.warning("%d calls in flight: forgetting the oldest (a shard hangs?)", _MAX_CALLS)
            del self._calls[oldest]
        self._calls[front_id] = (call, slot)
        call.ids[slot] = front_id
        call.shards[slot] = shard
        self._sockets[shard].send_multipart([header, *(a.data for a in arrays)], copy=False)

    def _everywhere(self, request: Request) -> list[tuple[int, Request]]:
        return [(shard, request) for shard in range(self._n)]

    def _register(self, call: Any, request: Register, arrays: tuple[np.ndarray, ...]) -> None:
        """Route a registration to its rank's shard; an instance id moving to another
        shard (a new rank) leaves the old one first, as a re-registration would."""
        rank = request.rank
        shard = 0 if isinstance(rank, bool) or not isinstance(rank, int) else rank % self._n
        iid = request.instance_id
        old = self._routes.get(iid)
        if old is not None and old != shard:
            leave = Unregister(instance_id=iid, client=request.client)
            self._call_maker(None, leave, time.perf_counter_ns())([(old, leave)], ())
        self._routes[iid] = shard
        self._routes.move_to_end(iid)
        while len(self._routes) > _MAX_ROUTES:
            self._routes.popitem(last=False)
        call([(shard, request)], arrays, after=self._direct(shard))

    def _direct(self, shard: int) -> Callable[[Reply], None]:
        """Tell a registered client its instance's shard, which it may then send the
        instance's transfers to itself: no CURVE here, so the shard's socket, reachable by
        this user's processes only, exposes nothing the front does not."""

        def tell(reply: Reply) -> None:
            if isinstance(reply, Registered) and self._curve is None:
                reply.endpoint = self._shards[shard].endpoint

        return tell

    def _unrouted(self, instance_id: str, shard: int) -> Callable[[Reply], None]:
        def forget(reply: Reply) -> None:
            if isinstance(reply, Done) and self._routes.get(instance_id) == shard:
                del self._routes[instance_id]

        return forget

    def _query(
        self, call: Any, request: Lookup | BlendLookup | Prefetch, arrays: tuple[np.ndarray, ...]
    ) -> None:
        """Ask each shard holding some of the ranks for its own; malformed ranks go to
        shard 0 as they are, which refuses them with the reason."""
        split = fanout.rank_split(request.world_size, request.ranks, self._n)
        if split is None:
            call([(0, request)], arrays)
            return
        parts: list[tuple[int, Request]] = [
            (shard, msgspec.structs.replace(request, ranks=ranks)) for shard, ranks in split.items()
        ]
        join: fanout.Join
        if isinstance(request, Lookup):
            join = fanout.join_lookup
        elif isinstance(request, BlendLookup):
            join = fanout.join_blend
        else:
            join = fanout.join_prefetch(list(split))
        call(parts, arrays, join=join)

    def _prefetch_state(self, call: Any, request: PrefetchQuery) -> None:
        parts = fanout.prefetch_parts(request.prefetch_id, self._n)
        if parts is None:  # not a sharded id: shard 0 says it is unknown
            call([(0, request)], ())
            return
        queries: list[tuple[int, Request]] = [
            (shard, PrefetchQuery(prefetch_id=pid, client=request.client))
            for shard, pid in parts.items()
        ]
        call(queries, (), join=fanout.join_prefetch_state(request.prefetch_id))

    def _subscribe(self, call: Any, request: SubscribeKVEvents) -> None:
        """A subscription to one rank lives on its shard; one to every rank subscribes on
        every shard, merged here (merged_events.py)."""
        rank = request.rank
        if rank is None:
            parts = self._everywhere(request)
            call(parts, (), join=self._join_subscriptions([shard for shard, _ in parts]))
            return
        shard = 0 if isinstance(rank, bool) or not isinstance(rank, int) else rank % self._n

        def tagged(reply: Reply) -> None:
            if isinstance(reply, KVSubscribed):
                reply.subscription = f"{shard}:{reply.subscription}"

        call([(shard, request)], (), after=tagged)

    def _join_subscriptions(self, shards: list[int]) -> fanout.Join:
        def join(replies: Sequence[Reply]) -> Reply:
            subs = [r for r in replies if isinstance(r, KVSubscribed)]
            if len(subs) != len(replies):
                raise TypeError("a shard answered a KV-event subscription out of turn")
            sub_id, position = self._streams.add(
                {s: r.subscription for s, r in zip(shards, subs, strict=True)},
                {s: r.log_seq for s, r in zip(shards, subs, strict=True)},
            )
            return KVSubscribed(subscription=sub_id, epoch=self._streams.epoch, log_seq=position)

        return join

    def _kv_events(self, call: Any, request: PollKVEvents | UnsubscribeKVEvents) -> None:
        """A poll or an unsubscription: a rank's goes to its shard, a merged one to every
        shard, each with its own subscription (and position)."""
        if not request.subscription.startswith(PREFIX):
            shard, sub = _subscription_parts(request.subscription, self._n)
            request.subscription = sub
            call([(shard, request)], ())
            return
        merged = self._streams.get(request.subscription)
        if isinstance(request, PollKVEvents):  # checked here: the shards see other numbers
            check_poll(request.after_seq, request.after_log_seq, request.max_records)
        if isinstance(request, UnsubscribeKVEvents):
            self._streams.remove(request.subscription)
            parts: list[tuple[int, Request]] = [
                (shard, UnsubscribeKVEvents(subscription=sub, client=request.client))
                for shard, sub in merged.parts.items()
            ]
            call(parts, (), join=fanout.join_done)
            return
        starts = self._streams.starts(merged, request.after_log_seq)
        share = max(1, request.max_records // len(merged.parts))
        parts = [
            (shard, PollKVEvents(subscription=sub, after_seq=0, after_log_seq=starts[shard],
                                 max_records=share, client=request.client))
            for shard, sub in merged.parts.items()
        ]  # fmt: skip
        shards, after = list(merged.parts), request.after_seq

        def join(replies: Sequence[Reply]) -> Reply:
            polls = [r.poll for r in replies if isinstance(r, KVEvents)]
            if len(polls) != len(replies):
                raise TypeError("a shard answered a KV-event poll out of turn")
            poll = self._streams.joined(merged, after, dict(zip(shards, polls, strict=True)))
            return KVEvents(poll=poll)

        call(parts, (), join=join)

    def _admin(
        self, identity: bytes, request: AdminRequest, frame: zmq.Frame, started: int
    ) -> None:
        """Send an admin request to every shard, named for the caller: an admin's to run
        (a quota is split between the shards, like L1), another's marked refused, which
        each shard records and answers with the refusal."""
        caller = AdminCaller.of(request, frame, self._curve is not None)
        request.client = caller.text
        if not self._admin_auth.allowed(caller.key, caller.peer):
            # the shards record the refusal (their ADMIN events and logs) and run nothing
            request.denied = self._admin_auth.why_not()
        if isinstance(request, AdminQuota) and request.limit_gb is not None:
            request.limit_gb = request.limit_gb / self._n
        call = self._call_maker(identity, request, started)
        call(self._everywhere(request), (), join=fanout.join_admin)

    # -- replies -------------------------------------------------------------------------

    def _shard_replies(self, index: int) -> None:
        sock = self._sockets[index]
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = decode_reply(frame)
            except KVFlowError as exc:
                log.error("shard %d sent an unreadable reply: %s", index, exc)
                continue
            entry = self._calls.pop(reply.id, None)
            if entry is not None:
                self._landed(*entry, reply)

    def _landed(self, call: _Call, slot: int, reply: Reply) -> None:
        """Keep one shard's reply; once all are in, answer the call."""
        call.replies[slot] = reply
        call.waiting -= 1
        if call.waiting:
            return
        replies = [r for r in call.replies if r is not None]
        failure = fanout.first_failure(replies) if call.deadline is None else None
        answer: Reply
        if failure is not None:
            answer = failure
        elif call.join is None:
            answer = replies[0]
        else:
            try:
                answer = call.join(replies)
            except Exception as exc:  # a shard answered out of turn
                answer = self._errors.failed(call.request_id, exc, call.started)
        if call.after is not None:
            call.after(answer)
        self._reply(call, answer)

    def _expire(self) -> None:
        """Answer the calls whose patience ran out with what came: each shard still
        silent becomes a Failed reply naming it (a status shows the others)."""
        now = time.monotonic()
        waiting = [c for c in self._impatient if c.waiting]
        due = [c for c in waiting if c.deadline is not None and now >= c.deadline]
        self._impatient = [c for c in waiting if c.deadline is not None and now < c.deadline]
        for call in due:
            for slot, reply in enumerate(call.replies):
                if reply is None and self._calls.pop(call.ids[slot], None) is not None:
                    message = (
                        f"shard {call.shards[slot]} did not answer within {call.patience_s:g} s"
                    )
                    self._landed(call, slot, Failed(code="timeout", message=message))

    def _reply(self, call: _Call, reply: Reply) -> None:
        if call.identity is None:
            return
        reply.id = call.request_id
        if call.join is not None or isinstance(reply, Failed):
            reply.server_ns = since(call.started)
        self._send(call.identity, reply)

    def _send(self, identity: bytes, reply: Reply) -> None:
        send_reply(self._router, [identity, encode_reply(reply)])

    # -- status --------------------------------------------------------------------------

    def _ask_status(self) -> None:
        """Ask every shard for its status (the probes read the answers)."""
        asked = time.monotonic()
        for shard in range(self._n):

            def keep(reply: Reply, shard: int = shard) -> None:
                if isinstance(reply, StatusResult):
                    statuses = list(self._shard_status)
                    statuses[shard] = (asked, reply.status)
                    self._shard_status = statuses

            request = Status()
            self._call_maker(None, request, time.perf_counter_ns())(
                [(shard, request)], (), after=keep
            )

    def _join_status(self, replies: Sequence[Reply]) -> Reply:
        """The front's own status, and every shard's in shard order."""
        shards = []
        for reply in replies:
            if isinstance(reply, Failed):  # a shard that failed or did not answer in time
                shards.append({"error": reply.message})
            elif isinstance(reply, StatusResult):
                shards.append(reply.status)
            else:
                raise TypeError(f"a shard answered {type(reply).__name__} to a status")
        return StatusResult(status={"server": self.front_status(), "shards": shards})

    def front_status(self) -> dict[str, Any]:
        """The front's part of the status: endpoint, shards, counters."""
        return {
            "endpoint": self.endpoint,
            "pid": os.getpid(),
            "protocol_version": PROTOCOL_VERSION,
            "uptime_s": round(time.monotonic() - self._started, 3),
            "shards": self._n,
            "shard_pids": self.shard_pids,
            "requests": self._served,
            "errors": self._errors.count,
            "routed_instances": len(self._routes),
            "authentication": "curve" if self._curve is not None else "none",
            "probe_port": self.probe_port,
        }


def _subscription_parts(subscription: str, shards: int) -> tuple[int, str]:
    """(shard, the shard's subscription id) of a sharded subscription id; an id that is
    not one goes to shard 0 whole, which does not know it."""
    shard, sep, sub = subscription.partition(":")
    if sep and shard.isdigit() and int(shard) < shards:
        return int(shard), sub
    return 0, subscription
