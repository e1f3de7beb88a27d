"""KVFlowServer: a CacheEngine behind a ZMQ ROUTER socket (docs/SERVER.md).

The main loop owns the socket: it decodes every request, answers cheap ones
(lookup and blend lookup without L2 tiers, status, heartbeat, sessions, allocations)
itself, and hands register/store/retrieve/blend retrieve/unregister to one of a fixed
pool of worker threads as a job (jobs.py): an instance gets the worker serving the
fewest instances when it registers and keeps it, so one instance's work runs in order
while different instances (the ranks of a tensor-parallel engine, one per GPU) run in
parallel on workers of their own, and no number of instances adds threads or sockets. An
instance belongs to the client that registered it. Workers send replies back
through an inproc socket the main loop forwards. Clients that stop heartbeating
have their instances reaped; `request_stop` finishes in-flight work, then closes
the engine (bus and exporters).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from kvflow.core.config import ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.engine.validation import check_owner
from kvflow.core.errors import (
    AlreadyRegisteredError,
    CapacityError,
    InvalidRequestError,
    PermissionDeniedError,
    ProtocolError,
    UnknownInstanceError,
)
from kvflow.core.server.admin import AdminAuth, AdminCaller, AdminOps, DrainState
from kvflow.core.server.intake import read_request
from kvflow.core.server.jobs import (
    AdminJob,
    BlendLookupJob,
    BlendRetrieveJob,
    QueryJob,
    RegisterJob,
    RetireJob,
    RetrieveJob,
    StoreJob,
)
from kvflow.core.server.kv_streams import KVSubscriptions
from kvflow.core.server.listen import close_listener, listen, received, send_reply
from kvflow.core.server.probes import LoopClock, Probes, ProbeServer
from kvflow.core.server.protocol import (
    PROTOCOL_VERSION,
    AdminRequest,
    BlendLookup,
    BlendRetrieve,
    Done,
    EndSession,
    Heartbeat,
    KVEvents,
    KVSubscribed,
    Lookup,
    PollKVEvents,
    Prefetch,
    PrefetchQuery,
    Register,
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
    encode_reply,
    peek_id,
    ropes_from_wire,
)
from kvflow.core.server.registry import Registration, Registry
from kvflow.core.server.worker import ErrorReplies, Job, Worker, since
from kvflow.events import BlockAllocation
from kvflow.subscribers.kv_events import KVEventLog, RecordFilter

log = logging.getLogger("kvflow.server")

_TICK_S = 0.1
_BATCH = 64
_REMEMBER_REAPED = 1024
_FORCED_CLOSE_S = 5.0
#: most instance worker threads, whatever --max-instances is
_MAX_WORKERS = 8


def _handlers_of(logger: logging.Logger) -> list[logging.Handler]:
    """The handlers a record of `logger` reaches now: its own and its ancestors', as far
    as `propagate` lets it go."""
    handlers: list[logging.Handler] = []
    current: logging.Logger | None = logger
    while current is not None:
        handlers += current.handlers
        current = current.parent if current.propagate else None
    return handlers


def _log_through(handlers: Sequence[logging.Handler], msg: str, *args: Any) -> None:
    """Log an INFO line of the server's logger through `handlers`, taken before closing the
    engine removed the one its event pipeline installed (event logs on)."""
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, msg, args, None)
    for handler in handlers:
        if record.levelno >= handler.level:
            handler.handle(record)


def _cuda_ipc_mappings() -> int:
    """CUDA IPC handles this process holds open (0 until a GPU client registers)."""
    ipc = sys.modules.get("kvflow.core.server.ipc")
    return int(ipc.open_mappings()) if ipc is not None else 0


def _key_of(owner: str) -> str:
    """The CURVE key part of an owner "KEY CLIENT_ID" (Z85 has no space)."""
    return owner.partition(" ")[0]


class KVFlowServer:
    """Serves a CacheEngine over ZMQ; see the module docstring for the threading model.

    Binds at construction (port 0 picks a free port; `endpoint` tells which).
    `serve_forever` blocks until `request_stop` (thread- and signal-safe), then
    closes the engine, also one passed in as `engine`.

    Lock rule: the main loop's thread owns the sockets and every field not named
    here. The registrations (`Registry`) and the error count (`ErrorReplies`) hold
    locks of their own, and a registration's fields follow `Registration`'s rule.
    `status()` may run on any thread (tests call it beside the loop): it copies
    `_last_seen` in one step (atomic under the GIL) and reads the loop's int counters
    without a lock, which at worst shows a count one request old.
    """

    def __init__(self, config: ServerConfig | None = None, *, engine: CacheEngine | None = None):
        self.config = config if config is not None else ServerConfig()
        self._max_bytes = int(self.config.max_message_mb * (1 << 20))
        self._heartbeat_timeout = float(self.config.heartbeat_timeout_s)
        self._max_instances = int(self.config.max_instances)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._listen()
        self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._results_addr = f"inproc://kvflow-results-{id(self):x}"
        self._results = self._ctx.socket(zmq.PULL)
        self._results.bind(self._results_addr)
        try:
            self.engine = engine if engine is not None else CacheEngine(self.config)
        except BaseException:
            self._results.close(0)
            self._close_sockets()
            raise
        #: the KV-event log routers subscribe to (None: --kv-events-chunks 0)
        self.kv_events: KVSubscriptions | None = None
        if self.config.kv_events_chunks:
            self.kv_events = KVSubscriptions(KVEventLog(self.config.kv_events_chunks))
            self.engine.bus.register(self.kv_events.log)
        self._registry = Registry()
        self._errors = ErrorReplies()
        #: drain state and admin operations (on the admin worker)
        self._drain = DrainState()
        self._admin = AdminOps(self.engine, self._drain, self.engine.pending_l2_writes)
        self._start_workers()
        self._last_seen: dict[str, float] = {}
        self._reaped_ids: OrderedDict[str, None] = OrderedDict()
        self._next_reap = 0.0
        self._stop = threading.Event()
        self._force = threading.Event()
        self._started = time.monotonic()
        self._served = 0
        self._reaped = 0
        self._closed = False
        self._clock = LoopClock()
        self._probes: ProbeServer | None = None
        if self.config.probe_port:
            self._probes = self._start_probes()

    def _listen(self) -> None:
        """Make the client socket (`listen.listen`): the public one, or a shard's private
        socket behind its front (ShardedServer)."""
        try:
            self._router, self._curve = listen(self._ctx, self.config, self._max_bytes)
        except BaseException:
            self._ctx.term()
            raise
        try:
            #: who may call admin operations (docs/OPERATIONS.md)
            self._admin_auth = AdminAuth(self.config)
        except BaseException:
            self._close_sockets()
            raise

    def _start_workers(self) -> None:
        """Start the instance worker pool, the query worker (L2 tiers only) and the admin one."""

        def worker(name: str) -> Worker:
            return Worker(self._ctx, self._results_addr, name, self._errors)

        #: the fixed pool: an instance's jobs all go to the worker it got at registration
        self._pool = [
            worker(f"worker-{i}") for i in range(max(1, min(self._max_instances, _MAX_WORKERS)))
        ]
        self._next_worker = 0  # where the search for the least-loaded worker starts
        self._workers: list[Worker] = list(self._pool)
        #: lookups and prefetches, when L2 tiers may make them wait (L1 only: none)
        self._queries: Worker | None = None
        if self.engine.l2_tier_names:
            self._queries = worker("queries")
            self._workers.append(self._queries)
        self._admin_worker = worker("admin")
        self._workers.append(self._admin_worker)

    def _start_probes(self) -> ProbeServer:
        """Serve /healthz and /readyz (an unusable port closes the server: OSError)."""
        probes = Probes(
            loop_age_s=self._clock.age_s,
            pin_state=self.engine.l1.pin_state,
            tier_stats=lambda: {t.name: t.stats() for t in self.engine.l2_tiers},
            draining=lambda: self._drain.draining,
            stopping=self._stop.is_set,
        )
        try:
            return ProbeServer(probes, self.config.probe_host, self.config.probe_port)
        except OSError:
            self.close()
            raise

    @property
    def probe_port(self) -> int | None:
        """The port /healthz and /readyz answer on (None: probes off)."""
        return self._probes.port if self._probes is not None else None

    # -- lifecycle ----------------------------------------------------------------------

    def _close_sockets(self) -> None:
        """Close the client socket, stop the authenticator and end the context (no waiting)."""
        close_listener(self._router, self._curve)
        self._ctx.term()

    def request_stop(self) -> None:
        """Ask the loop to finish in-flight work and stop; a second call stops waiting for it."""
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    def serve_forever(self) -> None:
        """Run the main loop until `request_stop`, then shut down gracefully."""
        log.info("kvflow server listening on %s (protocol %d)", self.endpoint, PROTOCOL_VERSION)
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._results, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self._clock.tick()
                ready = dict(poller.poll(int(_TICK_S * 1000)))
                if self._results in ready:
                    self._forward_results()
                if self._router in ready:
                    self._serve_batch()
                if time.monotonic() >= self._next_reap:
                    self._next_reap = time.monotonic() + _TICK_S
                    self._reap()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """Finish queued worker jobs (forwarding their replies), then close the engine."""
        if self._closed:
            return
        self._closed = True
        if self._probes is not None:
            self._probes.close()
        log.info("kvflow server stopping: finishing in-flight work")
        busy = self._finish_workers()
        # closing the engine removes the log handler its pipeline installed (event logs
        # on): the stopped line goes to the handlers the server's lines reach now
        handlers = _handlers_of(log) if log.isEnabledFor(logging.INFO) else []
        clean = self._close_engine(busy)
        regs = self._registry.take_all()
        if not busy:  # a busy worker may still be copying through these mappings
            for reg in regs:
                reg.release()
        del regs
        self._results.close(0)
        self._router.close()
        if self._curve is not None:
            self._curve.stop()
        if not busy:  # busy workers still hold sockets; the process is exiting anyway
            self._ctx.term()
        _log_through(
            handlers,
            "kvflow server stopped (event pipeline %s)",
            "NOT clean" if not clean else "clean",
        )

    def _finish_workers(self) -> int:
        """Let every worker run its queued jobs, forwarding their replies, until all are
        done or a second stop request; returns how many are still busy."""
        workers = self._workers
        for worker in workers:
            worker.finish()
        while any(w.alive for w in workers) and not self._force.is_set():
            if self._results.poll(int(_TICK_S * 1000)):
                self._forward_results()
        self._forward_results()
        return sum(w.alive for w in workers)

    def _close_engine(self, busy: int) -> bool:
        """Close the engine; with `busy` workers (a second stop request), give it at most
        _FORCED_CLOSE_S instead of waiting for stuck transfers. True if it closed clean."""
        if not busy:
            return self.engine.close()
        log.warning("kvflow server: not waiting for %d busy instance worker(s)", busy)
        closed: list[bool] = []
        closer = threading.Thread(target=lambda: closed.append(self.engine.close()), daemon=True)
        closer.start()
        closer.join(_FORCED_CLOSE_S)
        return bool(closed and closed[0])

    def close(self) -> None:
        """Release everything without serving (for a server that never ran)."""
        self._stop.set()
        self._shutdown()

    # -- request handling ------------------------------------------------------------------

    def _forward_results(self) -> None:
        while True:
            try:
                frames = self._results.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._send(frames)

    def _send(self, frames: Sequence[Any]) -> None:
        send_reply(self._router, frames)

    def _serve_batch(self) -> None:
        for identity, frames in received(self._router, _BATCH):
            reply = self._serve(identity, frames)
            if reply is not None:
                self._send([identity, encode_reply(reply)])

    def _serve(self, identity: bytes, frames: Sequence[zmq.Frame]) -> Reply | None:
        """Handle one request; returns its reply, or None when a worker will send it."""
        started = time.perf_counter_ns()
        self._served += 1
        header = frames[0].buffer if frames else b""
        request_id = peek_id(header)
        try:
            request, arrays = read_request(frames, self._max_bytes, self._curve is not None)
            self._last_seen[request.client] = time.monotonic()
            if isinstance(request, AdminRequest):
                self._admin_call(identity, request, frames[0], started)
                return None
            return self._dispatch(identity, request, arrays, started)
        except Exception as exc:
            return self._errors.failed(request_id, exc, started)

    def _dispatch(
        self, identity: bytes, request: Request, arrays: tuple[np.ndarray, ...], started: int
    ) -> Reply | None:
        engine = self.engine
        rid = request.id
        match request:
            case Lookup() | Prefetch():
                return self._query(identity, QueryJob(engine, request, arrays[0], started))
            case BlendLookup():
                return self._query(identity, BlendLookupJob(engine, request, arrays[0], started))
            case PrefetchQuery():
                state = engine.prefetch_state(request.prefetch_id)
                return StatusResult(id=rid, status=state, server_ns=since(started))
            case Store():
                reg = self._owned(request.instance_id, request.client, "Store")
                store = StoreJob(engine, reg, request, arrays, started, identity)
                self._drain.check("store")  # a drain refuses new ones, waits for these
                reg.worker.submit(identity, store, self._drain)
                return None
            case Retrieve():
                reg = self._owned(request.instance_id, request.client, "Retrieve")
                retrieve = RetrieveJob(engine, reg, request, arrays, started, identity)
                reg.worker.submit(identity, retrieve)
                return None
            case BlendRetrieve():
                reg = self._owned(request.instance_id, request.client, "BlendRetrieve")
                reg.worker.submit(identity, BlendRetrieveJob(engine, reg, request, arrays, started))
                return None
            case Heartbeat():
                return Done(id=rid, server_ns=since(started))
            case SubscribeKVEvents() | PollKVEvents() | UnsubscribeKVEvents():
                return self._kv_events(request, started)
            case Status():
                return StatusResult(id=rid, status=self.status(), server_ns=since(started))
            case Register():
                self._register(identity, request, started)
                return None
            case Unregister():
                reg = self._owned(request.instance_id, request.client, "Unregister")
                self._retire(reg, identity, rid, started)
                return None
            case EndSession():
                engine.end_session(request.request_id)
                return Done(id=rid, server_ns=since(started))
            case ReportAllocations():
                self._owned(request.instance_id, request.client, "ReportAllocations")
                records = [
                    BlockAllocation(r.req_id, r.block_ids, r.token_ids) for r in request.records
                ]
                engine.report_block_allocations(request.instance_id, records)
                return Done(id=rid, server_ns=since(started))
            case ReportLayerWaits():
                self._owned(request.instance_id, request.client, "ReportLayerWaits")
                engine.report_layer_waits(request.instance_id, request.request_id, request.waits_s)
                return Done(id=rid, server_ns=since(started))
        raise ProtocolError(f"unsupported request {type(request).__name__}")

    def _query(self, identity: bytes, job: Job) -> Reply | None:
        """Answer a lookup, blend lookup or prefetch at once on this thread (L1 only), or
        queue it on the query worker: L2 tiers may take up to their timeout, and other
        clients' requests (and heartbeats) must keep flowing meanwhile."""
        if self._queries is None:
            return job.run()
        self._queries.submit(identity, job)
        return None

    def _kv_events(
        self, request: SubscribeKVEvents | PollKVEvents | UnsubscribeKVEvents, started: int
    ) -> Reply:
        """Subscribe to, poll or leave the KV-event log (answered on the loop: a poll
        copies at most MAX_POLL_RECORDS records)."""
        streams = self.kv_events
        if streams is None:
            raise InvalidRequestError("KV events are off on this server (--kv-events-chunks 0)")
        rid, client = request.id, request.client
        if isinstance(request, SubscribeKVEvents):
            check_owner(request.world_size, request.rank)
            wanted = RecordFilter(
                request.model_name, request.world_size, request.cache_salt, request.match_salt,
                request.rank,
            )  # fmt: skip
            sub_id, log_seq = streams.subscribe(client, wanted)
            return KVSubscribed(
                id=rid, subscription=sub_id, epoch=streams.epoch, log_seq=log_seq,
                server_ns=since(started),
            )  # fmt: skip
        if isinstance(request, PollKVEvents):
            poll = streams.poll(
                client, request.subscription, request.after_seq, request.after_log_seq,
                request.max_records,
            )  # fmt: skip
            return KVEvents(id=rid, poll=poll, server_ns=since(started))
        streams.unsubscribe(client, request.subscription)
        return Done(id=rid, server_ns=since(started))

    def _admin_call(
        self, identity: bytes, request: AdminRequest, frame: zmq.Frame, started: int
    ) -> None:
        """Refuse a caller who is no admin; run an admin's request on the admin worker. A
        shard runs what its front let through, for the caller the front names."""
        if self.config.shard_endpoint is not None:
            text = request.client
            if request.denied is not None:  # its front refused the caller: record it here
                raise self._admin.refuse(request, text, request.denied)
        else:
            caller = AdminCaller.of(request, frame, self._curve is not None)
            if not self._admin_auth.allowed(caller.key, caller.peer):
                raise self._admin.refuse(request, caller.text, self._admin_auth.why_not())
            text = caller.text
        self._admin_worker.submit(identity, AdminJob(self._admin, request, text, started))

    def _registration(self, instance_id: str) -> Registration:
        reg = self._registry.get(instance_id)
        if reg is None:
            why = (
                f" (reaped: its client was silent for over {self._heartbeat_timeout:g} s)"
                if instance_id in self._reaped_ids
                else ""
            )
            raise UnknownInstanceError(f"instance {instance_id!r} is not registered{why}")
        return reg

    def _owned(self, instance_id: str, client: str, op: str) -> Registration:
        """The registration of `instance_id`, if `client` registered it; else PermissionDenied."""
        reg = self._registration(instance_id)
        if reg.client != client:
            raise PermissionDeniedError(
                f"{op} refused: instance {instance_id!r} belongs to another client (only the"
                " client that registered it may store, retrieve, report or unregister)"
            )
        return reg

    # -- registration and reaping -------------------------------------------------------------

    def _register(self, identity: bytes, request: Register, started: int) -> None:
        """Check ownership and --max-instances, then map and register on the instance's worker.

        The reply (Registered or Failed) comes from that worker once the instance is
        really served. Re-registering one's own instance id (same client), or another
        client's with `takeover`, first retires the old registration on the same worker.
        """
        self._drain.check("register")
        ropes = ropes_from_wire(request.ropes)  # a bad one is refused before any work
        iid = request.instance_id
        old = self._registry.get(iid)
        self._check_may_register(old, request)
        worker = old.worker if old is not None else self._least_loaded_worker()
        if old is not None:
            log.info(
                "instance %r re-registered by client %s%s: releasing the old registration",
                iid,
                request.client or "?",
                " (takeover)" if old.client != request.client else "",
            )
            self._retire(old, None, 0, started)
        reg = Registration(iid, request.client, worker)
        self._registry.add(reg)
        self._reaped_ids.pop(iid, None)
        interval = self._heartbeat_timeout / 4
        job = RegisterJob(self.engine, self._registry, reg, request, started, interval, ropes)
        worker.submit(identity, job, self._drain)

    def _check_may_register(self, old: Registration | None, request: Register) -> None:
        """Refuse a registration of an id another client holds (unless `takeover`, and then
        only with the same CURVE key) or one past --max-instances."""
        iid = request.instance_id
        if old is not None and old.client != request.client and not request.takeover:
            raise AlreadyRegisteredError(
                f"instance {iid!r} is already registered by another client; if that client"
                f" is gone, the server reaps the instance after --heartbeat-timeout-s"
                f" ({self._heartbeat_timeout:g} s) of its silence, or register with"
                " takeover=True to take it over now"
            )
        if (
            old is not None
            and (self._curve is not None or self.config.shard_keyed_clients)
            and _key_of(old.client) != _key_of(request.client)
        ):
            raise PermissionDeniedError(
                f"instance {iid!r} is registered with another CURVE key: only a client holding"
                " that key may re-register or take it over"
            )
        if old is None and (served := len(self._registry)) >= self._max_instances:
            raise CapacityError(
                f"the server already serves {served} instances, its limit"
                " (--max-instances): unregister one or raise the limit"
            )

    def _least_loaded_worker(self) -> Worker:
        """The pool's worker serving the fewest instances, equals taken in turn after the
        last one picked: two ranks never share a worker while another one idles."""
        load = dict.fromkeys(map(id, self._pool), 0)
        for reg in self._registry.all():
            load[id(reg.worker)] = load.get(id(reg.worker), 0) + 1
        n = len(self._pool)
        turn = [self._pool[(self._next_worker + i) % n] for i in range(n)]
        worker = min(turn, key=lambda w: load[id(w)])
        self._next_worker = (self._pool.index(worker) + 1) % n
        return worker

    def _retire(
        self, reg: Registration, identity: bytes | None, request_id: int, started: int
    ) -> None:
        """Unregister `reg` on its worker after its queued jobs, releasing its memory there
        (a layerwise store waiting for the engine's layers gives up at once)."""
        reg.retiring = True
        self._registry.discard(reg)
        reg.worker.submit(identity, RetireJob(self.engine, reg, request_id, started))

    def _reap(self) -> None:
        """Unregister the instances of clients silent for longer than the heartbeat timeout.
        A registration counts as its client's last word when it was done: a client that
        waited longer than the timeout for it has sent nothing since, not even a beat."""
        now = time.monotonic()
        limit = now - self._heartbeat_timeout
        for reg in self._registry.all():
            if reg.served_at is None:  # being registered: its client waits for the reply
                continue
            if max(self._last_seen.get(reg.client, now), reg.served_at) < limit:
                log.warning(
                    "reaping instance %r: client %s silent for over %.1f s",
                    reg.instance_id,
                    reg.client or "?",
                    self._heartbeat_timeout,
                )
                self._reaped += 1
                self._reaped_ids[reg.instance_id] = None
                while len(self._reaped_ids) > _REMEMBER_REAPED:
                    self._reaped_ids.popitem(last=False)
                self._retire(reg, None, 0, time.perf_counter_ns())
        if self.kv_events is not None:
            self.kv_events.expire(self._last_seen, limit)
        owners = {reg.client for reg in self._registry.all()}
        for client, seen in list(self._last_seen.items()):
            if seen < limit and client not in owners:
                del self._last_seen[client]

    # -- introspection ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The engine's status plus the server's own: endpoint, clients, instances, counters."""
        status = self.engine.status()
        now = time.monotonic()
        last_seen = dict(self._last_seen)  # one C-level copy: the loop may add clients meanwhile
        status["server"] = {
            "endpoint": self.endpoint,
            "pid": os.getpid(),
            "protocol_version": PROTOCOL_VERSION,
            "uptime_s": round(now - self._started, 3),
            "heartbeat_timeout_s": self._heartbeat_timeout,
            "max_message_bytes": self._max_bytes,
            "requests": self._served,
            "errors": self._errors.count,
            "reaped_instances": self._reaped,
            "max_instances": self._max_instances,
            "workers": len(self._pool),
            # the process's, as `kvflow server --switch-interval-ms` set it (or its host's)
            "switch_interval_ms": round(sys.getswitchinterval() * 1e3, 6),
            "cuda_ipc_mappings": _cuda_ipc_mappings(),
            "authentication": "curve" if self._curve is not None else "none",
            "authorized_keys": len(self._curve.authorized) if self._curve is not None else None,
            "instances": {
                reg.instance_id: {
                    "client": reg.client,
                    "worker": reg.worker.name,
                    "registered_s_ago": round(now - reg.registered_at, 3),
                    "staging": _staging_stats(reg),
                }
                for reg in self._registry.all()
            },
            "clients": {c: round(now - seen, 3) for c, seen in last_seen.items()},
            "drain": self._admin.drain_status(),
            "tenants": self.engine.tenant_stats(),
            "probe_port": self.probe_port,
            "kv_events": self.kv_events.status() if self.kv_events is not None else None,
        }
        return status


def _staging_stats(reg: Registration) -> dict[str, Any] | None:
    """An instance's staging ring (kvflow.core.server.staging), or None without one."""
    layers = reg.layers
    staging = layers.staging if layers is not None else None
    return staging.stats() if staging is not None else None
