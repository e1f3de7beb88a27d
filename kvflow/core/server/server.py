"""KVFlowServer: a CacheEngine behind a ZMQ ROUTER socket (docs/SERVER.md).

The main loop owns the socket: it decodes every request, answers cheap ones
(lookup, status, heartbeat, sessions, allocations) itself, and hands
register/store/retrieve/unregister to one of a fixed pool of worker threads:
an instance gets the worker serving the fewest instances when it registers and
keeps it, so one instance's work runs in order while different instances (the
ranks of a tensor-parallel engine, one per GPU) run in parallel on workers of
their own, and no number of instances adds threads or sockets. An instance belongs to the client that registered it.
Workers send replies back through an inproc socket the main loop forwards.
Clients that stop heartbeating have their instances reaped; `request_stop`
finishes in-flight work, then closes the engine (bus and exporters).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from kvflow.core.config import ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.engine.chunk_keys import keys_from_wire
from kvflow.core.errors import (
    AlreadyRegisteredError,
    CapacityError,
    InvalidRequestError,
    KVFlowError,
    PermissionDeniedError,
    ProtocolError,
    UnknownInstanceError,
)
from kvflow.core.server.admin import AdminAuth, AdminOps, DrainState
from kvflow.core.server.curve import CurveServer
from kvflow.core.server.kv_streams import KVSubscriptions
from kvflow.core.server.layers import ServerLayers, open_server_layers
from kvflow.core.server.probes import LoopClock, Probes, ProbeServer
from kvflow.core.server.protocol import (
    PROTOCOL_VERSION,
    AdminRequest,
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
    PrefetchStarted,
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
    decode_request,
    encode_reply,
    peek_id,
)
from kvflow.core.server.sharing import OpenedKVCaches, open_kv_caches
from kvflow.events import BlockAllocation
from kvflow.subscribers.kv_events import KVEventLog, RecordFilter

log = logging.getLogger("kvflow.server")

_TICK_S = 0.1
_MAX_FRAMES = 8
_BATCH = 64
_REMEMBER_REAPED = 1024
_FORCED_CLOSE_S = 5.0
#: most instance worker threads, whatever --max-instances is
_MAX_WORKERS = 8

#: A worker job: computes the reply for one queued request (None: it already sent it,
#: through `_Worker.answer`, before finishing).
Job = Callable[[], Reply | None]


def _failed(request_id: int, exc: BaseException, started_ns: int) -> Failed:
    if isinstance(exc, KVFlowError):
        code, message = exc.code, str(exc)
    else:
        log.exception("internal error while serving a request")
        code, message = KVFlowError.code, f"internal server error: {type(exc).__name__}: {exc}"
    return Failed(id=request_id, code=code, message=message, server_ns=_since(started_ns))


def _log_with_handlers(handlers: list[logging.Handler], level: int, msg: str, *args: Any) -> None:
    """Log at INFO through the root handlers `handlers` (and root `level`), even removed ones."""
    root = logging.getLogger()
    missing = [h for h in handlers if h not in root.handlers]
    previous = root.level
    for handler in missing:
        root.addHandler(handler)
    root.setLevel(level)
    try:
        log.info(msg, *args)
    finally:
        for handler in missing:
            root.removeHandler(handler)
        root.setLevel(previous)


def _check_host(host: str) -> None:
    """OSError naming --host unless it resolves (ZMQ would take an unknown name for a
    network interface and answer "No such device")."""
    if host == "*":
        return
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as exc:
        raise OSError(
            f"--host {host!r} cannot be resolved ({exc.strerror}); give an IP address or a "
            "host name of this machine"
        ) from None


def _loopback_only(host: str) -> bool:
    """Whether every address `host` names is a loopback one ("*" is every interface)."""
    if host == "*":
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None)
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def _check_exposure(config: ServerConfig) -> None:
    """ValueError unless the server listens on loopback only, uses CURVE, or is told not to care."""
    if config.curve or config.insecure_listen or _loopback_only(config.host):
        return
    raise ValueError(
        f"--host {config.host} accepts connections from other machines, and without"
        " authentication any of them could store, retrieve and read KV: give"
        " --curve-secret-key and --curve-authorized-keys (make keys with `kvflow keygen`),"
        " or --insecure-listen to accept every client that reaches the port"
    )


def _layers_of(reg: _Registration, request: Store | Retrieve) -> ServerLayers | None:
    """The instance's completion points when `request` is layerwise (layer_seq > 0), else
    None; InvalidRequestError for a bad number or an instance registered without them."""
    seq = request.layer_seq
    if seq == 0:
        return None
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise InvalidRequestError(f"layer_seq must be an integer >= 0, got {seq!r}")
    if reg.layers is None:
        raise InvalidRequestError(
            f"instance {reg.instance_id!r} was registered without layerwise=True: it has no"
            f" per-layer completion points for a layerwise {type(request).__name__.lower()}"
        )
    return reg.layers


def _cuda_ipc_mappings() -> int:
    """CUDA IPC handles this process holds open (0 until a GPU client registers)."""
    ipc = sys.modules.get("kvflow.core.server.ipc")
    return int(ipc.open_mappings()) if ipc is not None else 0


def _key_of(owner: str) -> str:
    """The CURVE key part of an owner "KEY CLIENT_ID" (Z85 has no space)."""
    return owner.partition(" ")[0]


def _since(started_ns: int) -> int:
    return time.perf_counter_ns() - started_ns


class _Worker:
    """An ordered job queue and the thread that drains it."""

    def __init__(self, ctx: zmq.Context[Any], results: str, name: str) -> None:
        self._ctx = ctx
        self._results = results
        self._jobs: queue.SimpleQueue[tuple[bytes | None, Job] | None] = queue.SimpleQueue()
        self._push: zmq.Socket[Any]  # made by the worker thread, used only there
        self.name = name
        self._thread = threading.Thread(target=self._run, name=f"kvflow-{name}", daemon=True)
        self._thread.start()

    def submit(self, identity: bytes | None, job: Job) -> None:
        """Queue `job`; its reply goes to `identity` (None: nobody waits for it)."""
        self._jobs.put((identity, job))

    def answer(self, identity: bytes, reply: Reply) -> None:
        """Send a job's reply now, from the job itself (on this worker's thread), so the
        client goes on while the job finishes; the job then returns None."""
        try:
            self._push.send_multipart([identity, encode_reply(reply)])
        except zmq.Again:
            log.warning("reply dropped: the server stopped without waiting for it")

    def finish(self) -> None:
        """Stop after the jobs already queued."""
        self._jobs.put(None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.linger = 1000
        push.sndtimeo = 1000  # only blocks once the main loop is gone (a forced stop)
        push.connect(self._results)
        self._push = push
        try:
            while (item := self._jobs.get()) is not None:
                identity, job = item
                del item  # hold no finished job (and what it references) while idle
                try:
                    reply = job()
                except Exception as exc:  # jobs answer their own errors; never lose the thread
                    reply = _failed(0, exc, time.perf_counter_ns())
                del job
                if identity is not None and reply is not None:
                    self.answer(identity, reply)
                del reply
        finally:
            push.close()


@dataclass
class _Registration:
    """What the server holds for one registered instance (opened: None until mapped)."""

    instance_id: str
    client: str
    worker: _Worker
    opened: OpenedKVCaches | None = None
    event: Any = None
    #: the client's event a retrieve records once its copies are queued (CUDA caches)
    retrieved: Any = None
    #: per-layer completion points of layerwise retrieves, and what maps them
    layers: ServerLayers | None = None
    layers_opened: Any = None
    #: set once the instance is being unregistered (read by a layerwise store's waits)
    retiring: bool = False
    registered_at: float = field(default_factory=time.monotonic)

    def release(self) -> None:
        """Unmap the instance's memory and drop its CUDA events now (idempotent)."""
        opened, self.opened, self.event, self.retrieved = self.opened, None, None, None
        layers_opened, self.layers, self.layers_opened = self.layers_opened, None, None
        if opened is not None:
            opened.release()
        if layers_opened is not None:
            layers_opened.release()


class KVFlowServer:
    """Serves a CacheEngine over ZMQ; see the module docstring for the threading model.

    Binds at construction (port 0 picks a free port; `endpoint` tells which).
    `serve_forever` blocks until `request_stop` (thread- and signal-safe), then
    closes the engine, also one passed in as `engine`.
    """

    def __init__(self, config: ServerConfig | None = None, *, engine: CacheEngine | None = None):
        self.config = config if config is not None else ServerConfig()
        self._max_bytes = int(self.config.max_message_mb * (1 << 20))
        self._heartbeat_timeout = float(self.config.heartbeat_timeout_s)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.linger = 1000
        # Frames up to twice the limit get an error reply; ZMQ drops larger ones (and the peer).
        self._router.setsockopt(zmq.MAXMSGSIZE, 2 * self._max_bytes)
        port = "*" if self.config.port == 0 else str(self.config.port)
        #: CURVE keys and the authenticator, when clients must authenticate
        self._curve: CurveServer | None = None
        try:
            _check_host(self.config.host)
            _check_exposure(self.config)
            if self.config.curve_secret_key and self.config.curve_authorized_keys:
                self._curve = CurveServer(
                    self._ctx, self.config.curve_secret_key, self.config.curve_authorized_keys
                )
                self._curve.secure(self._router)
            #: who may call admin operations (docs/OPERATIONS.md)
            self._admin_auth = AdminAuth(self.config)
            self._router.bind(f"tcp://{self.config.host}:{port}")
        except BaseException as exc:
            self._close_sockets()
            if isinstance(exc, (zmq.ZMQError, OSError)):
                raise OSError(
                    f"cannot listen on {self.config.host}:{self.config.port}: {exc}"
                ) from None
            raise
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
        self._max_instances = int(self.config.max_instances)
        #: instance id -> registration; workers remove failed registrations (under the lock)
        self._registrations: dict[str, _Registration] = {}
        self._registrations_lock = threading.Lock()
        #: the fixed pool: an instance's jobs all go to the worker it got at registration
        self._pool = [
            _Worker(self._ctx, self._results_addr, f"worker-{i}")
            for i in range(max(1, min(self._max_instances, _MAX_WORKERS)))
        ]
        self._next_worker = 0  # where the search for the least-loaded worker starts
        self._workers: list[_Worker] = list(self._pool)
        #: lookups and prefetches, when L2 tiers may make them wait (L1 only: none)
        self._queries: _Worker | None = None
        if self.engine.l2_tier_names:
            self._queries = _Worker(self._ctx, self._results_addr, "queries")
            self._workers.append(self._queries)
        self._last_seen: dict[str, float] = {}
        self._reaped_ids: OrderedDict[str, None] = OrderedDict()
        self._next_reap = 0.0
        self._stop = threading.Event()
        self._force = threading.Event()
        self._started = time.monotonic()
        self._served = 0
        self._errors = 0
        self._errors_lock = threading.Lock()
        self._reaped = 0
        self._closed = False
        #: drain state, admin operations (on their own worker) and the probes
        self._drain = DrainState()
        self._admin = AdminOps(self.engine, self._drain, self.engine.pending_l2_writes)
        self._admin_worker = _Worker(self._ctx, self._results_addr, "admin")
        self._workers.append(self._admin_worker)
        self._clock = LoopClock()
        self._probes: ProbeServer | None = None
        if self.config.probe_port:
            self._probes = self._start_probes()

    def _start_probes(self) -> ProbeServer:
        """Serve /healthz and /readyz (an unusable port closes the server: OSError)."""
        l1 = self.engine.l1
        probes = Probes(
            loop_age_s=self._clock.age_s,
            pin_state=getattr(l1, "pin_state", lambda: None),
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
        self._router.close(0)
        if self._curve is not None:
            self._curve.stop()
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
        workers = self._workers
        for worker in workers:
            worker.finish()
        while any(w.alive for w in workers) and not self._force.is_set():
            if self._results.poll(int(_TICK_S * 1000)):
                self._forward_results()
        self._forward_results()
        busy = sum(w.alive for w in workers)
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        if busy:  # a second stop request: do not wait for stuck transfers any longer
            log.warning("kvflow server: not waiting for %d busy instance worker(s)", busy)
            closed: list[bool] = []
            closer = threading.Thread(
                target=lambda: closed.append(self.engine.close()), daemon=True
            )
            closer.start()
            closer.join(_FORCED_CLOSE_S)
            clean = bool(closed and closed[0])
        else:
            clean = self.engine.close()
        with self._registrations_lock:
            regs, self._registrations = list(self._registrations.values()), {}
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
        # closing the engine removed the log handler its pipeline installed (event logs on)
        _log_with_handlers(
            handlers,
            level,
            "kvflow server stopped (event pipeline %s)",
            "NOT clean" if not clean else "clean",
        )

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
        try:
            self._router.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:  # the peer is gone or its queue is full: the reply is dropped
            log.debug("reply to a gone client dropped")

    def _serve_batch(self) -> None:
        for _ in range(_BATCH):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            reply = self._serve(identity, frames[1:])
            if reply is not None:
                self._send([identity, encode_reply(reply)])

    def _serve(self, identity: bytes, frames: Sequence[zmq.Frame]) -> Reply | None:
        """Handle one request; returns its reply, or None when a worker will send it."""
        started = time.perf_counter_ns()
        self._served += 1
        header = frames[0].buffer if frames else b""
        request_id = peek_id(header)
        try:
            if len(frames) > _MAX_FRAMES:
                raise ProtocolError(f"message has {len(frames)} frames, at most {_MAX_FRAMES}")
            size = sum(len(f) for f in frames)
            if size > self._max_bytes:
                raise ProtocolError(
                    f"message of {size} bytes exceeds the server's limit of {self._max_bytes}"
                    " bytes (--max-message-mb)"
                )
            request, arrays = decode_request([f.buffer for f in frames])
            if self._curve is not None:  # the key ZAP authenticated: no other client has it
                request.client = f"{frames[0].get('User-Id')} {request.client}"
            self._last_seen[request.client] = time.monotonic()
            if isinstance(request, AdminRequest):
                return self._admin_call(identity, request, frames[0], started)
            return self._dispatch(identity, request, arrays, started)
        except Exception as exc:
            self._count_error()
            return _failed(request_id, exc, started)

    def _dispatch(
        self, identity: bytes, request: Request, arrays: tuple[np.ndarray, ...], started: int
    ) -> Reply | None:
        engine = self.engine
        rid = request.id
        match request:
            case Lookup() | Prefetch():
                if self._queries is None:  # L1 only: answered at once, on this thread
                    return self._query(request, arrays[0], started)
                # L2 tiers may take up to their timeout: off the loop, so other clients'
                # requests (and heartbeats) keep flowing meanwhile
                self._queries.submit(identity, self._query_job(request, arrays[0], started))
                return None
            case PrefetchQuery():
                state = engine.prefetch_state(request.prefetch_id)
                return StatusResult(id=rid, status=state, server_ns=_since(started))
            case Store() | Retrieve():
                reg = self._owned(request.instance_id, request.client, type(request).__name__)
                job = self._transfer_job(reg, request, arrays, started, identity)
                if isinstance(request, Store):  # a drain refuses new ones, waits for these
                    self._drain.check("store")
                    job = self._drain.track(job)
                reg.worker.submit(identity, job)
                return None
            case Heartbeat():
                return Done(id=rid, server_ns=_since(started))
            case SubscribeKVEvents() | PollKVEvents() | UnsubscribeKVEvents():
                return self._kv_events(request, started)
            case Status():
                return StatusResult(id=rid, status=self.status(), server_ns=_since(started))
            case Register():
                self._register(identity, request, started)
                return None
            case Unregister():
                reg = self._owned(request.instance_id, request.client, "Unregister")
                self._retire(reg, identity, rid, started)
                return None
            case EndSession():
                engine.end_session(request.request_id)
                return Done(id=rid, server_ns=_since(started))
            case ReportAllocations():
                self._owned(request.instance_id, request.client, "ReportAllocations")
                records = [
                    BlockAllocation(r.req_id, r.block_ids, r.token_ids) for r in request.records
                ]
                engine.report_block_allocations(request.instance_id, records)
                return Done(id=rid, server_ns=_since(started))
            case ReportLayerWaits():
                self._owned(request.instance_id, request.client, "ReportLayerWaits")
                engine.report_layer_waits(request.instance_id, request.request_id, request.waits_s)
                return Done(id=rid, server_ns=_since(started))
        raise ProtocolError(f"unsupported request {type(request).__name__}")

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
            wanted = RecordFilter(
                request.model_name, request.world_size, request.cache_salt, request.match_salt,
                request.rank,
            )  # fmt: skip
            sub_id, log_seq = streams.subscribe(client, wanted)
            return KVSubscribed(
                id=rid, subscription=sub_id, epoch=streams.epoch, log_seq=log_seq,
                server_ns=_since(started),
            )  # fmt: skip
        if isinstance(request, PollKVEvents):
            poll = streams.poll(
                client, request.subscription, request.after_seq, request.after_log_seq,
                request.max_records,
            )  # fmt: skip
            return KVEvents(id=rid, poll=poll, server_ns=_since(started))
        streams.unsubscribe(client, request.subscription)
        return Done(id=rid, server_ns=_since(started))

    def _admin_call(
        self, identity: bytes, request: AdminRequest, frame: zmq.Frame, started: int
    ) -> Reply | None:
        """Refuse a caller who is no admin; run an admin's request on the admin worker."""
        key = str(frame.get("User-Id")) if self._curve is not None else None
        try:
            peer: str | None = str(frame.get("Peer-Address"))
        except zmq.ZMQError:  # a transport without peer addresses (inproc): no admin
            peer = None
        name = request.client or "?"
        if key is not None and name.startswith(f"{key} "):  # the owner form "KEY CLIENT_ID"
            name = name[len(key) + 1 :]
        caller = f"{name} at {peer or '?'}"
        if key is not None:
            caller = f"{caller} with CURVE key {key}"
        if not self._admin_auth.allowed(key, peer):
            raise self._admin.refuse(request, caller, self._admin_auth.why_not())

        def run() -> Reply:
            try:
                result = self._admin.run(request, caller)
            except Exception as exc:
                self._count_error()
                return _failed(request.id, exc, started)
            return StatusResult(id=request.id, status=result, server_ns=_since(started))

        self._admin_worker.submit(identity, run)
        return None

    def _query(self, request: Lookup | Prefetch, tokens: np.ndarray, started: int) -> Reply:
        """A lookup's hit tokens or a prefetch's id (errors raise to the caller)."""
        model, world, salt, rid = (
            request.model_name, request.world_size, request.cache_salt, request.request_id
        )  # fmt: skip
        if isinstance(request, Lookup):
            keys = keys_from_wire(tokens) if request.keyed else None
            hit = self.engine.lookup(
                None if request.keyed else tokens, model_name=model, world_size=world,
                cache_salt=salt, request_id=rid, prefetch=request.prefetch, chunk_keys=keys,
            )  # fmt: skip
            return Done(id=request.id, value=hit, server_ns=_since(started))
        prefetch_id = self.engine.prefetch(
            tokens, model_name=model, world_size=world, cache_salt=salt, request_id=rid
        )
        return PrefetchStarted(id=request.id, prefetch_id=prefetch_id, server_ns=_since(started))

    def _query_job(self, request: Lookup | Prefetch, tokens: np.ndarray, started: int) -> Job:
        def run() -> Reply:
            try:
                return self._query(request, tokens, started)
            except Exception as exc:
                self._count_error()
                return _failed(request.id, exc, started)

        return run

    def _count_error(self) -> None:
        with self._errors_lock:
            self._errors += 1

    def _registration(self, instance_id: str) -> _Registration:
        reg = self._registrations.get(instance_id)
        if reg is None:
            why = (
                f" (reaped: its client was silent for over {self._heartbeat_timeout:g} s)"
                if instance_id in self._reaped_ids
                else ""
            )
            raise UnknownInstanceError(f"instance {instance_id!r} is not registered{why}")
        return reg

    def _owned(self, instance_id: str, client: str, op: str) -> _Registration:
        """The registration of `instance_id`, if `client` registered it; else PermissionDenied."""
        reg = self._registration(instance_id)
        if reg.client != client:
            raise PermissionDeniedError(
                f"{op} refused: instance {instance_id!r} belongs to another client (only the"
                " client that registered it may store, retrieve, report or unregister)"
            )
        return reg

    def _transfer_job(
        self,
        reg: _Registration,
        request: Store | Retrieve,
        arrays: tuple[np.ndarray, ...],
        started: int,
        identity: bytes,
    ) -> Job:
        tokens, blocks = arrays
        keys = keys_from_wire(tokens) if request.keyed else None  # chunk_keys.py
        answered = False

        def answer_early(stream: Any, hit_tokens: int) -> None:
            """A retrieve's copies are queued: mark their end with the client's event on
            the copy stream and reply now; the client's stream waits on the event, and
            the reply's trip overlaps the copy. A layerwise retrieve of CPU caches
            (stream None) replies before its copies; the client polls its layer flags."""
            nonlocal answered
            if stream is not None and reg.retrieved is not None:
                reg.retrieved.record(stream.torch)
            done = Done(id=request.id, value=hit_tokens, server_ns=_since(started))
            reg.worker.answer(identity, done)
            answered = True
            # this thread goes on queueing copies holding the GIL: hand it over so the
            # loop sends the reply now, not a switch interval later
            time.sleep(0)

        def run() -> Reply | None:
            try:
                layers = _layers_of(reg, request)
                if isinstance(request, Store):
                    if reg.event is not None and layers is None:  # the engine's writes first
                        reg.event.synchronize()
                    value = self.engine.store(
                        reg.instance_id,
                        None if keys is not None else tokens,
                        blocks,
                        request_id=request.request_id,
                        cache_salt=request.cache_salt,
                        chunk_keys=keys,
                        layers=(
                            layers.store_waits(request.layer_seq, lambda: reg.retiring)
                            if layers
                            else None
                        ),
                    )
                else:
                    early = reg.retrieved is not None or layers is not None
                    value = self.engine.retrieve(
                        reg.instance_id,
                        None if keys is not None else tokens,
                        blocks,
                        request_id=request.request_id,
                        skip_first_n_tokens=request.skip_first_n_tokens,
                        cache_salt=request.cache_salt,
                        enqueued=answer_early if early else None,
                        chunk_keys=keys,
                        layers=layers.signal(request.layer_seq) if layers else None,
                    )
            except Exception as exc:
                self._count_error()
                if answered:  # too late to tell the client: its blocks may be partly written
                    log.error("retrieve %r failed after its reply: %s", request.request_id, exc)
                    return None
                return _failed(request.id, exc, started)
            if answered:
                return None
            return Done(id=request.id, value=value, server_ns=_since(started))

        return run

    # -- registration and reaping -------------------------------------------------------------

    def _register(self, identity: bytes, request: Register, started: int) -> None:
        """Check ownership and --max-instances, then map and register on the instance's worker.

        The reply (Registered or Failed) comes from that worker once the instance is
        really served. Re-registering one's own instance id (same client), or another
        client's with `takeover`, first retires the old registration on the same worker.
        """
        self._drain.check("register")
        iid = request.instance_id
        old = self._registrations.get(iid)
        if old is not None and old.client != request.client and not request.takeover:
            raise AlreadyRegisteredError(
                f"instance {iid!r} is already registered by another client; if that client"
                f" is gone, the server reaps the instance after --heartbeat-timeout-s"
                f" ({self._heartbeat_timeout:g} s) of its silence, or register with"
                " takeover=True to take it over now"
            )
        if (
            old is not None
            and self._curve is not None
            and _key_of(old.client) != _key_of(request.client)
        ):
            raise PermissionDeniedError(
                f"instance {iid!r} is registered with another CURVE key: only a client holding"
                " that key may re-register or take it over"
            )
        if old is None and len(self._registrations) >= self._max_instances:
            raise CapacityError(
                f"the server already serves {len(self._registrations)} instances, its limit"
                " (--max-instances): unregister one or raise the limit"
            )
        worker = old.worker if old is not None else self._least_loaded_worker()
        if old is not None:
            log.info(
                "instance %r re-registered by client %s%s: releasing the old registration",
                iid,
                request.client or "?",
                " (takeover)" if old.client != request.client else "",
            )
            self._retire(old, None, 0, started)
        reg = _Registration(iid, request.client, worker)
        with self._registrations_lock:
            self._registrations[iid] = reg
        self._reaped_ids.pop(iid, None)
        worker.submit(identity, self._drain.track(self._register_job(reg, request, started)))

    def _least_loaded_worker(self) -> _Worker:
        """The pool's worker serving the fewest instances, equals taken in turn after the
        last one picked: two ranks never share a worker while another one idles."""
        with self._registrations_lock:
            load = dict.fromkeys(map(id, self._pool), 0)
            for reg in self._registrations.values():
                load[id(reg.worker)] = load.get(id(reg.worker), 0) + 1
        n = len(self._pool)
        turn = [self._pool[(self._next_worker + i) % n] for i in range(n)]
        worker = min(turn, key=lambda w: load[id(w)])
        self._next_worker = (self._pool.index(worker) + 1) % n
        return worker

    def _register_job(self, reg: _Registration, request: Register, started: int) -> Job:
        interval = self._heartbeat_timeout / 4

        def run() -> Reply:
            opened: OpenedKVCaches | None = None
            layers: ServerLayers | None = None
            layers_opened: Any = None
            try:
                opened = open_kv_caches(request.kv_caches)
                event = retrieved = None
                if opened.cuda_device is not None:
                    from kvflow.core.server.ipc import open_interprocess_event

                    device = opened.cuda_device
                    if request.event_handle is not None:
                        event = open_interprocess_event(request.event_handle, device)
                    if request.retrieve_event_handle is not None:
                        retrieved = open_interprocess_event(request.retrieve_event_handle, device)
                self.engine.register_kv_caches(
                    request.instance_id,
                    opened.kv_caches,
                    model_name=request.model_name,
                    world_size=request.world_size,
                    rank=request.rank,
                    block_size=request.block_size,
                    kv_format=request.kv_format,
                )
                try:
                    layers, layers_opened = open_server_layers(
                        request.layer_event_handles,
                        request.layer_flags,
                        opened.cuda_device,
                        self.engine.num_layers(request.instance_id),
                    )
                except BaseException:
                    self.engine.unregister(request.instance_id)
                    raise
            except Exception as exc:
                with self._registrations_lock:
                    if self._registrations.get(reg.instance_id) is reg:
                        del self._registrations[reg.instance_id]
                if opened is not None:
                    opened.release()
                    del opened
                self._count_error()
                return _failed(request.id, exc, started)
            reg.opened, reg.event, reg.retrieved = opened, event, retrieved
            reg.layers, reg.layers_opened = layers, layers_opened
            del opened, event, retrieved, layers, layers_opened
            log.info(
                "registered instance %r of model %r (rank %d/%d) for client %s",
                request.instance_id,
                request.model_name,
                request.rank,
                request.world_size,
                request.client or "?",
            )
            return Registered(
                id=request.id, heartbeat_interval_s=interval, server_ns=_since(started)
            )

        return run

    def _retire(
        self, reg: _Registration, identity: bytes | None, request_id: int, started: int
    ) -> None:
        """Unregister `reg` on its worker after its queued jobs, releasing its memory there
        (a layerwise store waiting for the engine's layers gives up at once)."""
        reg.retiring = True
        with self._registrations_lock:
            if self._registrations.get(reg.instance_id) is reg:
                del self._registrations[reg.instance_id]

        def run() -> Reply:
            try:
                if reg.opened is None:  # its registration failed: nothing to unregister
                    return Done(id=request_id, server_ns=_since(started))
                self.engine.unregister(reg.instance_id)
            except Exception as exc:
                self._count_error()
                return _failed(request_id, exc, started)
            finally:
                reg.release()
            return Done(id=request_id, server_ns=_since(started))

        reg.worker.submit(identity, run)

    def _reap(self) -> None:
        """Unregister the instances of clients silent for longer than the heartbeat timeout."""
        now = time.monotonic()
        limit = now - self._heartbeat_timeout
        with self._registrations_lock:
            regs = list(self._registrations.values())
        for reg in regs:
            if self._last_seen.get(reg.client, now) < limit:
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
        with self._registrations_lock:
            owners = {reg.client for reg in self._registrations.values()}
        for client, seen in list(self._last_seen.items()):
            if seen < limit and client not in owners:
                del self._last_seen[client]

    # -- introspection ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The engine's status plus the server's own: endpoint, clients, instances, counters."""
        status = self.engine.status()
        now = time.monotonic()
        with self._registrations_lock:
            registrations = list(self._registrations.items())
        status["server"] = {
            "endpoint": self.endpoint,
            "pid": os.getpid(),
            "protocol_version": PROTOCOL_VERSION,
            "uptime_s": round(now - self._started, 3),
            "heartbeat_timeout_s": self._heartbeat_timeout,
            "max_message_bytes": self._max_bytes,
            "requests": self._served,
            "errors": self._errors,
            "reaped_instances": self._reaped,
            "max_instances": self._max_instances,
            "workers": len(self._pool),
            "cuda_ipc_mappings": _cuda_ipc_mappings(),
            "authentication": "curve" if self._curve is not None else "none",
            "authorized_keys": len(self._curve.authorized) if self._curve is not None else None,
            "instances": {
                iid: {
                    "client": reg.client,
                    "worker": reg.worker.name,
                    "registered_s_ago": round(now - reg.registered_at, 3),
                }
                for iid, reg in registrations
            },
            "clients": {c: round(now - seen, 3) for c, seen in self._last_seen.items()},
            "drain": self._admin.drain_status(),
            "tenants": self.engine.tenant_stats(),
            "probe_port": self.probe_port,
            "kv_events": self.kv_events.status() if self.kv_events is not None else None,
        }
        return status
