"""KVFlowClient: CacheEngine's methods, served by a remote kvflow server over ZMQ.

The methods are listed in docs/ARCHITECTURE.md (Public API) and specified in docs/ENGINE.md.

Each calling thread gets its own DEALER socket, so threads never wait on each
other's requests and the client is safe to share. A call that times out throws
its socket away, so a late reply (or a request still queued) cannot leak into a
later call. After the first registration a background thread heartbeats, so the
server keeps this client's instances until it closes or its process dies.
"""

from __future__ import annotations

import itertools
import operator
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import zmq
import zmq.utils.monitor

from kvflow.core.arrays import as_int32_array
from kvflow.core.engine.blend import BlendHit, BlendRetrieved
from kvflow.core.engine.blend_index import BlendSegment
from kvflow.core.engine.chunk_keys import KEY_BYTES, keys_to_wire
from kvflow.core.errors import (
    ERRORS_BY_CODE,
    AuthenticationError,
    InvalidRequestError,
    KVFlowError,
    ProtocolError,
    RequestTimeoutError,
)
from kvflow.core.polling import poll_until
from kvflow.core.server.addresses import endpoint_host
from kvflow.core.server.curve import KeyPair, load_key_pair, load_public_key, secure_client
from kvflow.core.server.kv_streams import KVPoll
from kvflow.core.server.layers import ClientLayers, LayerwiseLoad, LayerwiseSave
from kvflow.core.server.protocol import (
    AdminRequest,
    AllocationRecord,
    Blended,
    BlendFound,
    BlendLookup,
    BlendRetrieve,
    CudaIpcMemory,
    Done,
    EndSession,
    Failed,
    Heartbeat,
    KVCachesDesc,
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
    SegmentRef,
    Status,
    StatusResult,
    Store,
    SubscribeKVEvents,
    Unregister,
    UnsubscribeKVEvents,
    decode_reply,
    encode_request,
    ropes_to_wire,
)
from kvflow.core.server.sharing import describe_kv_caches
from kvflow.kernels.rope_params import LayerRopes, RopeParams

_SCHEMES = ("tcp://", "ipc://", "inproc://")
#: how often a waiting call looks for a failed handshake (so a refusal is reported at once)
_HANDSHAKE_CHECK_S = 0.1
#: seconds between a call's `idle()` runs while it waits for its reply (a layerwise
#: retrieve's: the engine frees staging slots the server may be waiting for)
IDLE_POLL_S = 0.001
#: the handshake events a client watches: refusals, drops (the peer closed the connection
#: mid-handshake, as a server requiring CURVE often does to a plain client) and successes
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)
#: handshakes dropped in a row (none succeeding between) that count as a refusal: one drop may
#: be a server stopping mid-handshake; a peer that drops every one will never take this client
_HANDSHAKE_DROPS = 3


def _int_list(values: Any, where: str) -> list[int]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    try:
        return list(map(operator.index, values))
    except TypeError:
        raise InvalidRequestError(f"{where} must be a sequence of integers") from None


def _retrieve_request(
    instance_id: str,
    token_ids: Any,
    block_ids: Any,
    request_id: str,
    skip_first_n_tokens: int,
    cache_salt: str | None,
    chunk_keys: Sequence[bytes] | None,
) -> tuple[Retrieve, tuple[np.ndarray, np.ndarray]]:
    """A Retrieve request and its payloads (token ids or chunk keys, block ids)."""
    tokens, keyed = _tokens_or_keys(token_ids, chunk_keys)
    blocks = as_int32_array(block_ids, "block_ids")
    request = Retrieve(
        instance_id=instance_id,
        request_id=request_id,
        skip_first_n_tokens=skip_first_n_tokens,
        cache_salt=cache_salt,
        keyed=keyed,
    )
    return request, (tokens, blocks)


def _segment_refs(segments: Any) -> list[SegmentRef]:
    """Blend segments (BlendSegments or (offset, chunk_hash, original_start) triples) as
    BlendRetrieve sends them; their values are checked by the server."""
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence):
        raise InvalidRequestError(
            "segments must be a sequence of BlendSegment or (offset, chunk_hash,"
            f" original_start), got {type(segments).__name__}"
        )
    refs = []
    for i, s in enumerate(segments):
        if isinstance(s, BlendSegment):
            s = (s.offset, s.chunk_hash, s.original_start)
        if not isinstance(s, Sequence) or len(s) != 3:
            raise InvalidRequestError(
                f"segments[{i}] must be a BlendSegment or (offset, chunk_hash, original_start),"
                f" got {s!r}"
            )
        offset, chunk_hash, original = s
        try:
            refs.append(SegmentRef(operator.index(offset), chunk_hash, operator.index(original)))
        except TypeError:
            raise InvalidRequestError(
                f"segments[{i}]: offset and original_start must be integers, got {s!r}"
            ) from None
    return refs


def _tokens_or_keys(token_ids: Any, chunk_keys: Any) -> tuple[np.ndarray, bool]:
    """A request's first payload: its token ids, or its chunk keys (then True)."""
    if chunk_keys is None:
        return as_int32_array(token_ids, "token_ids"), False
    if token_ids is not None:
        raise InvalidRequestError("give token_ids or chunk_keys, not both")
    if isinstance(chunk_keys, (str, bytes)) or not all(
        isinstance(k, bytes) and len(k) == KEY_BYTES for k in chunk_keys
    ):
        raise InvalidRequestError(f"chunk_keys must be a sequence of {KEY_BYTES}-byte keys")
    return keys_to_wire(chunk_keys), True


#: the requests a sharded server's shard may take straight from the client: an
#: instance's transfers and reports (registration and unregistration go through the
#: front, which routes by them)
_DIRECT = (Store, Retrieve, BlendRetrieve, ReportAllocations, ReportLayerWaits)


def reachable_ipc(endpoint: str) -> bool:
    """Whether this process can connect to ipc:// `endpoint`: its socket file exists here
    and is writable (a client in another container or of another user sees no such file,
    or may not write it, and keeps going through the front)."""
    if not endpoint.startswith("ipc://"):
        return False
    path = endpoint[len("ipc://") :]
    return os.path.exists(path) and os.access(path, os.W_OK)


def _close_pair(sock: zmq.Socket[Any], monitor: zmq.Socket[Any] | None) -> None:
    """Close a socket and its monitor (monitoring stops first, so no event is left queued)."""
    if monitor is not None:
        sock.disable_monitor()
        monitor.close(0)
    sock.close(0)


#: the longest a call may wait for its reply, in seconds (a day)
MAX_TIMEOUT_S = 86400.0


class _Connection:
    """One DEALER socket to the server with its handshake monitor and the handshakes its
    server dropped in a row. A call checks one out and gives it back with its reply, so
    connections are reused by whichever thread calls next: threads that come and go (a
    thread per request) neither open a connection per call nor leak one each."""

    __slots__ = ("drops", "endpoint", "monitor", "sock")

    def __init__(self, sock: zmq.Socket[Any], monitor: zmq.Socket[Any], endpoint: str) -> None:
        self.sock = sock
        self.monitor = monitor
        self.endpoint = endpoint
        self.drops = 0

    def close(self) -> None:
        _close_pair(self.sock, self.monitor)


class _Sent(NamedTuple):
    """A request on its way: the connection its reply comes back on, until `deadline`
    (time.monotonic) at the latest."""

    conn: _Connection
    request_id: int
    op: str
    timeout: float
    deadline: float


def _done_value(reply: Reply, request: Request) -> int | None:
    """A Done reply's value; ProtocolError for any other reply to `request`."""
    if not isinstance(reply, Done):
        raise ProtocolError(
            f"unexpected {type(reply).__name__} reply to a {type(request).__name__}"
        )
    return reply.value


def _count_value(reply: Reply, request: Request) -> int:
    """A Done reply's count; ProtocolError for any other reply, or one without a count."""
    value = _done_value(reply, request)
    if value is None:
        raise ProtocolError(f"the server returned no count for a {type(request).__name__}")
    return value


class _CudaEvents(NamedTuple):
    """The interprocess events of an instance with CUDA caches, and their device."""

    written: Any  # recorded by a store: the engine's KV writes before it are done
    retrieved: Any  # recorded by the server once a retrieve's copies are queued
    stored: Any  # recorded by the server once a store's copies are queued
    device: int
    handles: tuple[bytes, bytes, bytes]  # the three's IPC handles, in that order

    def wire_into(self, request: Register) -> None:
        """Put the events' IPC handles into a Register."""
        request.event_handle, request.retrieve_event_handle, request.store_event_handle = (
            self.handles
        )

    def stream(self) -> Any:
        """torch's current stream on the caches' device."""
        import torch

        return torch.cuda.current_stream(self.device)


def _cuda_events(desc: KVCachesDesc) -> _CudaEvents | None:
    """For caches in CUDA memory: their interprocess events, made on their device (the
    "written" one recorded once now); None for other caches."""
    device = next(
        (t.memory.device_index for t in desc.tensors if isinstance(t.memory, CudaIpcMemory)),
        None,
    )
    if device is None:
        return None
    import torch

    from kvflow.core.server.ipc import make_interprocess_event

    with torch.cuda.device(device):
        written = make_interprocess_event()
        written.record(torch.cuda.current_stream(device))
        retrieved, stored = make_interprocess_event(), make_interprocess_event()
        handles = (
            bytes(written.ipc_handle()),
            bytes(retrieved.ipc_handle()),
            bytes(stored.ipc_handle()),
        )
    return _CudaEvents(written, retrieved, stored, device, handles)


def _client_layers(
    kv_caches: Any,
    block_size: int | None,
    kv_format: str | None,
    staging_slots: int,
    staging_slot_bytes: int,
) -> ClientLayers:
    """One completion point per layer of `kv_caches`, and a staging ring of
    `staging_slots` x `staging_slot_bytes` unless 0 (InvalidRequestError for a layout
    `KVLayout` cannot read, or a ring that cannot be: `ClientStaging` checks it)."""
    from kvflow.kernels import KVLayout

    try:
        layout = KVLayout.from_kv_caches(kv_caches, block_size=block_size, kv_format=kv_format)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    cuda = layout.device.index if layout.device.type == "cuda" else None
    return ClientLayers(layout.num_layers, cuda, layout, staging_slots, staging_slot_bytes)


class KVFlowClient:
    """A connection to `kvflow server` at `endpoint` (e.g. "tcp://127.0.0.1:5555").

    Every call waits at most `timeout_s` for its reply, then raises
    RequestTimeoutError; server-side errors are raised as the same kvflow error
    class the engine raised.

    `client_id` is the identity the server ties this client's instances to (a
    random one by default): only this client may store into, retrieve into,
    report on or unregister them. A restarted process that passes the same
    `client_id` re-registers its instance ids at once (the old registrations are
    released); otherwise `register_kv_caches(..., takeover=True)` takes over an
    instance id a dead client still holds.

    For a server that requires CURVE (docs/SERVER.md), pass `curve_server_key`
    (its NAME.key file, or the key's 40 Z85 characters) and `curve_key` (this
    client's NAME.key_secret file from `kvflow keygen`); a refused handshake
    raises AuthenticationError instead of waiting for the timeout.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 30.0,
        client_id: str | None = None,
        curve_server_key: str | bytes | os.PathLike[str] | None = None,
        curve_key: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(endpoint, str) or not endpoint.startswith(_SCHEMES):
            raise ValueError(f"endpoint must look like tcp://HOST:PORT, got {endpoint!r}")
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not 0 < timeout_s <= MAX_TIMEOUT_S
        ):  # inf would hang a call for ever (and overflow ZMQ's millisecond timeouts)
            raise ValueError(
                f"timeout_s must be a number in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s!r}"
            )
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        if client_id is not None and (not isinstance(client_id, str) or not client_id):
            raise ValueError(f"client_id must be a non-empty string, got {client_id!r}")
        self.client_id = client_id if client_id is not None else uuid.uuid4().hex
        if (curve_server_key is None) != (curve_key is None):
            raise ValueError(
                "curve_server_key and curve_key go together: the server's public key and this"
                " client's key pair (NAME.key_secret)"
            )
        self._curve: tuple[bytes, KeyPair] | None = None
        if curve_server_key is not None and curve_key is not None:
            self._curve = (load_public_key(curve_server_key), load_key_pair(curve_key))
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._ids = itertools.count(1)
        self._local = threading.local()
        self._lock = threading.Lock()
        #: every open connection, and those no call is using by endpoint (the lock guards
        #: both): the server's, and a sharded server's shards its instances live on
        self._connections: set[_Connection] = set()
        self._idle: dict[str, list[_Connection]] = {}
        #: instances a sharded server lets this client reach on their shard directly
        self._direct: dict[str, str] = {}
        self._events: dict[str, _CudaEvents] = {}  # per instance with CUDA caches
        self._layers: dict[str, ClientLayers] = {}  # per instance registered layerwise
        self._store_sender: ThreadPoolExecutor | None = None
        self._heartbeat: threading.Thread | None = None
        self._heartbeat_interval = 0.0
        self._stopping = threading.Event()
        self._closing = False  # close() began: no new layerwise store, no heartbeat thread
        self._closed = False  # no call any more

    # -- transport ------------------------------------------------------------------------

    def _checkout(self, endpoint: str) -> _Connection:
        """An idle connection to `endpoint`, or a new one; the caller gives it back
        (`_checkin`) or, if the call failed on it, closes it (`_discard`)."""
        with self._lock:
            if self._closed:
                raise KVFlowError("the client is closed")
            idle = self._idle.get(endpoint)
            if idle:
                return idle.pop()
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        # No ZMQ_IMMEDIATE: with it, a reply that arrives just before the server
        # closes the connection (a graceful stop) is dropped unread. A request
        # queued for a server that is down dies with its socket on timeout.
        sock.sndtimeo = int(self.timeout_s * 1000)
        # a server on an IPv6 address (tcp://[::1]:5555) needs it; only then, for with it
        # on ZMQ resolves a name such as localhost to its first address, maybe ::1, where
        # a server on 127.0.0.1 does not listen
        sock.ipv6 = (endpoint_host(endpoint) or "").startswith("[")
        if self._curve is not None:
            secure_client(sock, *self._curve)
        conn = _Connection(sock, sock.get_monitor_socket(_HANDSHAKE_EVENTS), endpoint)
        sock.connect(endpoint)
        with self._lock:
            closed = self._closed
            if not closed:
                self._connections.add(conn)
        if closed:
            conn.close()
            raise KVFlowError("the client is closed")
        return conn

    def _checkin(self, conn: _Connection) -> None:
        """Give a connection back after a completed call (closed if the client is)."""
        with self._lock:
            if conn in self._connections:
                self._idle.setdefault(conn.endpoint, []).append(conn)
                return
        conn.close()

    def _discard(self, conn: _Connection) -> None:
        with self._lock:
            self._connections.discard(conn)
        conn.close()

    def _check_handshake(self, conn: _Connection) -> None:
        """Raise AuthenticationError if the server refused this connection's handshake."""
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(conn.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                conn.drops = 0
                continue
            if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                conn.drops += 1
                if conn.drops < _HANDSHAKE_DROPS:
                    continue
                detail = f"it closed {conn.drops} handshakes in a row"
            else:
                detail = f"protocol error {event['value']:#x}"
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                why = (
                    f"the kvflow server at {self.endpoint} refused this client's CURVE key"
                    " (its public key is not in the server's --curve-authorized-keys directory)"
                )
            elif self._curve is None:
                why = (
                    f"the kvflow server at {self.endpoint} requires CURVE authentication ({detail}):"
                    " give its public key (NAME.key) and this client's key pair (NAME.key_secret)"
                    " as curve_server_key= and curve_key= (--curve-server-key, --curve-key)"
                )
            else:
                why = (
                    f"CURVE handshake with {self.endpoint} failed ({detail}): the server does"
                    " not use CURVE, or its key differs from curve_server_key"
                )
            raise AuthenticationError(why)

    def _call(
        self,
        request: Request,
        payloads: Sequence[np.ndarray] = (),
        timeout_s: float | None = None,
        idle: Callable[[], None] | None = None,
    ) -> Reply:
        """Send one request and wait for its reply (calling `idle()` every IDLE_POLL_S
        meanwhile); raise the server's error if it failed."""
        return self._reply_to(self._send(request, payloads, timeout_s), idle)

    def _send(
        self, request: Request, payloads: Sequence[np.ndarray] = (), timeout_s: float | None = None
    ) -> _Sent:
        """Send one request on a connection of its own; `_reply_to` reads its reply."""
        if self._closed:
            raise KVFlowError("the client is closed")
        request.id = next(self._ids)
        request.client = self.client_id
        frames = encode_request(request, payloads)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        op = type(request).__name__
        conn = self._checkout(self._endpoint_of(request))
        try:
            conn.sock.send_multipart(frames, copy=False)
        except zmq.Again:
            self._discard(conn)
            raise RequestTimeoutError(
                f"could not send {op} to the kvflow server at {self.endpoint} within"
                f" {timeout:g} s (is it running?)"
            ) from None
        except BaseException:
            self._discard(conn)
            raise
        return _Sent(conn, request.id, op, timeout, time.monotonic() + timeout)

    def _reply_to(self, sent: _Sent, idle: Callable[[], None] | None = None) -> Reply:
        """The reply to a request `_send` sent (its connection given back); raise the
        server's error if it failed."""
        try:
            if self._closed:
                raise KVFlowError("the client is closed")
            reply = self._await_reply(sent, idle)
        except BaseException:  # the connection may still get this call's reply: not reused
            self._discard(sent.conn)
            raise
        self._checkin(sent.conn)
        self._local.server_ns = reply.server_ns
        if isinstance(reply, Failed):
            raise ERRORS_BY_CODE.get(reply.code, KVFlowError)(reply.message)
        return reply

    def _endpoint_of(self, request: Request) -> str:
        """Where `request` goes: an instance's transfers and reports to its shard when a
        sharded server said so, everything else to the server."""
        if isinstance(request, _DIRECT):
            with self._lock:
                return self._direct.get(request.instance_id, self.endpoint)
        return self.endpoint

    def _await_reply(self, sent: _Sent, idle: Callable[[], None] | None) -> Reply:
        """Wait for the reply to `sent` (skipping late replies to earlier calls);
        RequestTimeoutError or AuthenticationError on failure."""
        conn, sock = sent.conn, sent.conn.sock
        while True:
            remaining = sent.deadline - time.monotonic()
            if remaining <= 0:
                self._check_handshake(conn)
                hint = (
                    "is it running, and is curve_server_key its public key?"
                    if self._curve is not None
                    else "is it running?"
                )
                raise RequestTimeoutError(
                    f"no reply to {sent.op} from the kvflow server at {self.endpoint} within"
                    f" {sent.timeout:g} s ({hint})"
                )
            if idle is not None:
                idle()
            slice_s = min(remaining, _HANDSHAKE_CHECK_S, IDLE_POLL_S if idle else remaining)
            if not sock.poll(max(1, int(slice_s * 1000))):
                self._check_handshake(conn)
                continue
            reply = decode_reply(sock.recv())
            if reply.id == sent.request_id:
                return reply

    @property
    def last_server_time_s(self) -> float:
        """Server-side handling time of this thread's last completed call, in seconds."""
        return float(getattr(self._local, "server_ns", 0)) / 1e9

    def _done(
        self,
        request: Request,
        payloads: Sequence[np.ndarray] = (),
        idle: Callable[[], None] | None = None,
    ) -> int | None:
        return _done_value(self._call(request, payloads, idle=idle), request)

    def _count(
        self,
        request: Request,
        payloads: Sequence[np.ndarray],
        idle: Callable[[], None] | None = None,
    ) -> int:
        return _count_value(self._call(request, payloads, idle=idle), request)

    # -- the public methods (docs/ARCHITECTURE.md, Public API) ---------------------------------

    def register_kv_caches(
        self,
        instance_id: str,
        kv_caches: Any,
        *,
        model_name: str,
        world_size: int = 1,
        rank: int = 0,
        block_size: int | None = None,
        kv_format: str | None = None,
        takeover: bool = False,
        layerwise: bool = False,
        ropes: RopeParams | LayerRopes | None = None,
        staging_slots: int = 0,
        staging_slot_bytes: int = 0,
    ) -> None:
        """Share `kv_caches` with the server (shared memory or CUDA IPC) and register them.

        Registering an instance id this client (same `client_id`) already holds
        replaces that registration; one held by another client is refused
        (AlreadyRegisteredError) unless `takeover` is True. `layerwise` makes one
        completion point per layer for `retrieve_layerwise` (kvflow.core.server.layers);
        with `staging_slots` (1..64) too, a ring of that many slots of
        `staging_slot_bytes` on the caches' device, where the server stages a layer
        whose blocks need a scatter and this process scatters it
        (kvflow.core.server.staging; docs/ENGINE.md, "Staging in the engine").
        `ropes` (kvflow.kernels.rope_params.RopeParams for every layer, or LayerRopes): the
        model's rotary embedding, which `blend_retrieve` needs (docs/BLEND.md).
        """
        if staging_slots and not layerwise:
            raise InvalidRequestError("staging_slots needs layerwise=True")
        wire_ropes = ropes_to_wire(ropes)
        desc = describe_kv_caches(kv_caches)
        layers = (
            _client_layers(kv_caches, block_size, kv_format, staging_slots, staging_slot_bytes)
            if layerwise
            else None
        )
        events = _cuda_events(desc)
        request = Register(
            instance_id=instance_id,
            kv_caches=desc,
            model_name=model_name,
            world_size=world_size,
            rank=rank,
            block_size=block_size,
            kv_format=kv_format,
            takeover=takeover,
            ropes=wire_ropes,
        )
        if events is not None:
            events.wire_into(request)
        if layers is not None:
            layers.wire_into(request)
        reply = self._call(request)
        if not isinstance(reply, Registered):
            raise ProtocolError(f"unexpected {type(reply).__name__} reply to a Register")
        self._keep_registered(instance_id, events, layers, reply.endpoint)
        self._start_heartbeat(reply.heartbeat_interval_s)

    def _keep_registered(
        self, instance_id: str, events: Any, layers: ClientLayers | None, shard: str | None
    ) -> None:
        """Hold a registered instance's CUDA events, layer completion points and the shard
        endpoint to send its transfers to (when this process can reach it)."""
        with self._lock:
            if shard is not None and reachable_ipc(shard):
                self._direct[instance_id] = shard
            else:
                self._direct.pop(instance_id, None)
            if events is not None:
                self._events[instance_id] = events
            if layers is not None:
                self._layers[instance_id] = layers
            else:
                self._layers.pop(instance_id, None)

    def lookup(
        self,
        token_ids: Any,
        *,
        model_name: str,
        world_size: int = 1,
        cache_salt: str | None = None,
        request_id: str | None = None,
        prefetch: bool = True,
        chunk_keys: Sequence[bytes] | None = None,
        ranks: Sequence[int] | None = None,
    ) -> int:
        """Tokens of the longest chunk prefix the server holds for every rank (of `ranks`,
        default all), in any tier; hits in L2 start a prefetch into L1 unless `prefetch`
        is False. With `chunk_keys` (token_ids None) the chunks are named by those 32-byte
        keys, one per chunk."""
        tokens, keyed = _tokens_or_keys(token_ids, chunk_keys)
        request = Lookup(
            model_name=model_name,
            world_size=world_size,
            cache_salt=cache_salt,
            request_id=request_id,
            prefetch=prefetch,
            keyed=keyed,
            ranks=None if ranks is None else list(ranks),
        )
        return self._count(request, (tokens,))

    def prefetch(
        self,
        token_ids: Any,
        *,
        model_name: str,
        world_size: int = 1,
        cache_salt: str | None = None,
        request_id: str | None = None,
        ranks: Sequence[int] | None = None,
    ) -> str:
        """Start loading the request's L2-resident prefix of every rank (of `ranks`,
        default all) into the server's L1; returns the prefetch id `prefetch_state` takes."""
        tokens = as_int32_array(token_ids, "token_ids")
        request = Prefetch(
            model_name=model_name,
            world_size=world_size,
            cache_salt=cache_salt,
            request_id=request_id,
            ranks=None if ranks is None else list(ranks),
        )
        reply = self._call(request, (tokens,))
        if not isinstance(reply, PrefetchStarted):
            raise ProtocolError(f"unexpected {type(reply).__name__} reply to a Prefetch")
        return reply.prefetch_id

    def prefetch_state(self, prefetch_id: str) -> dict[str, Any]:
        """A prefetch's progress (state running/done, tokens landed, chunks kept/discarded)."""
        reply = self._call(PrefetchQuery(prefetch_id=prefetch_id))
        if not isinstance(reply, StatusResult):
            raise ProtocolError(f"unexpected {type(reply).__name__} reply to a PrefetchQuery")
        return reply.status

    def store(
        self,
        instance_id: str,
        token_ids: Any,
        block_ids: Any,
        *,
        request_id: str,
        cache_salt: str | None = None,
        chunk_keys: Sequence[bytes] | None = None,
    ) -> int:
        """Store the request's full chunks from its blocks; returns the tokens now stored.
        With `chunk_keys` (token_ids None) the chunks are named by those keys, as in lookup."""
        tokens, keyed = _tokens_or_keys(token_ids, chunk_keys)
        blocks = as_int32_array(block_ids, "block_ids")
        events = self._cuda_events(instance_id)
        if events is not None:  # mark "KV written up to here" on the engine's stream
            events.written.record(events.stream())
        request = Store(
            instance_id=instance_id, request_id=request_id, cache_salt=cache_salt, keyed=keyed
        )
        held = self._count(request, (tokens, blocks))
        if events is not None:  # the server may reply once the copies are queued, after
            # recording this event: the blocks are free once it completed. Polled, not
            # synchronized: a server that died meanwhile leaves a timeout, not a hang
            poll_until(events.stored.query, self.timeout_s, f"the copies of store {request_id!r}")
        return held

    def store_layerwise(
        self,
        instance_id: str,
        token_ids: Any,
        block_ids: Any,
        *,
        request_id: str,
        cache_salt: str | None = None,
        chunk_keys: Sequence[bytes] | None = None,
    ) -> LayerwiseSave:
        """A store that takes each layer as soon as the engine wrote it (instance
        registered with layerwise=True): returns at once; call `layer_done(i)` once the
        forward pass queued layer i's writes and `wait()` for the tokens stored
        (docs/ENGINE.md, "Layerwise stores"). The request goes from this client's one
        sender thread, so its layerwise stores reach the server in the order made."""
        layers = self._layers_of(instance_id)
        tokens, keyed = _tokens_or_keys(token_ids, chunk_keys)
        blocks = as_int32_array(block_ids, "block_ids")
        with layers.store_lock:
            seq = layers.next_store_seq()
            request = Store(
                instance_id=instance_id, request_id=request_id, cache_salt=cache_salt,
                keyed=keyed, layer_seq=seq,
            )  # fmt: skip
            reply = self._sender().submit(self._count, request, (tokens, blocks))
        return LayerwiseSave(layers, seq, reply)

    def _sender(self) -> ThreadPoolExecutor:
        """The thread layerwise stores are sent from (made on first use)."""
        with self._lock:
            if self._closing:
                raise ProtocolError("the client is closed")
            if self._store_sender is None:
                self._store_sender = ThreadPoolExecutor(1, thread_name_prefix="kvflow-store")
            return self._store_sender

    def retrieve(
        self,
        instance_id: str,
        token_ids: Any,
        block_ids: Any,
        *,
        request_id: str,
        skip_first_n_tokens: int = 0,
        cache_salt: str | None = None,
        chunk_keys: Sequence[bytes] | None = None,
    ) -> int:
        """Copy stored chunks into the request's blocks; returns the hit prefix in tokens,
        valid in the blocks once this returns. With `chunk_keys` (token_ids None) the
        chunks are named by those keys, as in lookup.

        For CUDA caches the server replies once the copies are queued, after recording
        the instance's retrieve event, and this polls the event on the host within the
        client's timeout (a stream made to wait on another process's event would hold
        back that process's copies, and wait for ever if the server died meanwhile).
        """
        request, arrays = _retrieve_request(
            instance_id, token_ids, block_ids, request_id, skip_first_n_tokens, cache_salt,
            chunk_keys,
        )  # fmt: skip
        hit = self._count(request, arrays)
        events = self._cuda_events(instance_id)
        if events is not None:  # the server recorded it after queueing the copies
            poll_until(
                events.retrieved.query, self.timeout_s, f"the copies of retrieve {request_id!r}"
            )
        return hit

    def retrieve_layerwise(
        self,
        instance_id: str,
        token_ids: Any,
        block_ids: Any,
        *,
        request_id: str,
        skip_first_n_tokens: int = 0,
        cache_salt: str | None = None,
        chunk_keys: Sequence[bytes] | None = None,
    ) -> LayerwiseLoad:
        """A retrieve that lands layer by layer (instance registered with layerwise=True).

        Returns once the request is sent: the reply (the hit prefix, `hit_tokens`) is read
        when first asked for, or by `wait_layer` (which needs no reply), so the server's
        work and the trip overlap what the engine does meanwhile (its forward pass). Call
        `wait_layer(i)` right before layer i reads its KV (docs/ENGINE.md, "Layerwise
        retrieves"): the server marks each layer as it goes. The server's errors come
        from `hit_tokens` and `wait_layer`.
        """
        layers = self._layers_of(instance_id)
        request, arrays = _retrieve_request(
            instance_id, token_ids, block_ids, request_id, skip_first_n_tokens, cache_salt,
            chunk_keys,
        )  # fmt: skip
        staging = layers.staging
        with layers.lock:  # numbers reach the server in order: the last one's reply first
            layers.settle_last()
            seq = request.layer_seq = layers.next_seq()
            try:
                sent = self._send(request, arrays)
            except BaseException:
                if staging is not None:
                    staging.drop(seq)
                raise
            # while the request travels; no wait needs the reply (a use of a number not
            # known yet waits in the ring)
            staged = staging.add_load(seq, arrays[1], skip_first_n_tokens) if staging else None

            def answer() -> int:
                idle = staging.pump if staging is not None else None
                try:  # earlier loads' staged layers free the ring the server may wait on
                    hit = _count_value(self._reply_to(sent, idle), request)
                except BaseException:
                    if staging is not None:
                        staging.drop(seq)
                    raise
                if staging is not None:
                    staging.answered(seq)
                return hit

            def replied() -> bool:  # a closed client's answer() raises at once
                return self._closed or bool(sent.conn.sock.poll(0))

            load = layers.last = LayerwiseLoad(layers, seq, self.timeout_s, answer, replied, staged)
        return load

    def blend_lookup(
        self,
        token_ids: Any,
        *,
        model_name: str,
        world_size: int = 1,
        cache_salt: str | None = None,
        request_id: str | None = None,
        prefetch: bool = True,
        ranks: Sequence[int] | None = None,
    ) -> BlendHit:
        """The prefix hit as `lookup` gives it, plus the stored chunks found anywhere past
        it, at any token offset, that every rank (of `ranks`, default all) holds in some
        tier (docs/BLEND.md); L2-held ones start loading into L1 unless `prefetch` is False."""
        tokens = as_int32_array(token_ids, "token_ids")
        request = BlendLookup(
            model_name=model_name, world_size=world_size, cache_salt=cache_salt,
            request_id=request_id, prefetch=prefetch,
            ranks=None if ranks is None else list(ranks),
        )  # fmt: skip
        reply = self._call(request, (tokens,))
        if not isinstance(reply, BlendFound):
            raise ProtocolError(f"unexpected {type(reply).__name__} reply to a BlendLookup")
        segments = [
            BlendSegment(s.offset, s.length, s.chunk_hash, s.original_start) for s in reply.segments
        ]
        return BlendHit(reply.prefix_tokens, segments)

    def blend_retrieve(
        self,
        instance_id: str,
        token_ids: Any,
        block_ids: Any,
        segments: Any,
        *,
        request_id: str,
        cache_salt: str | None = None,
    ) -> BlendRetrieved:
        """Copy blend segments (`blend_lookup`'s BlendSegments, or (offset, chunk_hash,
        original_start) triples) into the prompt's blocks, K turned to their new positions
        with the instance's registered ropes; returns the tokens blended and the offsets
        of the segments skipped (no tier held them any more: recompute those). `block_ids`
        cover the prompt from token 0, as for `retrieve`. The server replies once the
        copies landed, CUDA caches too: the blocks are ready when this returns."""
        refs = _segment_refs(segments)
        tokens = as_int32_array(token_ids, "token_ids")
        blocks = as_int32_array(block_ids, "block_ids")
        request = BlendRetrieve(
            instance_id=instance_id, request_id=request_id, segments=refs, cache_salt=cache_salt
        )
        reply = self._call(request, (tokens, blocks))
        if not isinstance(reply, Blended):
            raise ProtocolError(f"unexpected {type(reply).__name__} reply to a BlendRetrieve")
        return BlendRetrieved(reply.tokens, tuple(reply.skipped))

    def _layers_of(self, instance_id: str) -> ClientLayers:
        """The completion points of an instance this client registered layerwise."""
        with self._lock:
            layers = self._layers.get(instance_id)
        if layers is None:
            raise InvalidRequestError(
                f"instance {instance_id!r} was not registered by this client with layerwise=True"
            )
        return layers

    def _cuda_events(self, instance_id: str) -> _CudaEvents | None:
        with self._lock:
            return self._events.get(instance_id)

    def end_session(self, request_id: str) -> None:
        """The request finished."""
        self._done(EndSession(request_id=request_id))

    def report_block_allocations(self, instance_id: str, records: Sequence[Any]) -> None:
        """Report the engine's new block allocations (`kvflow.events.BlockAllocation`s)."""
        if isinstance(records, (str, bytes)) or not isinstance(records, Sequence):
            raise InvalidRequestError(
                f"records must be a sequence of BlockAllocation, got {type(records).__name__}"
            )
        wire = []
        for i, rec in enumerate(records):
            if not isinstance(rec, Sequence) or len(rec) != 3:
                raise InvalidRequestError(
                    f"records[{i}] must be BlockAllocation(req_id, new_block_ids, new_token_ids)"
                )
            req_id, block_ids, token_ids = rec
            wire.append(
                AllocationRecord(
                    req_id,
                    _int_list(block_ids, f"records[{i}].new_block_ids"),
                    _int_list(token_ids, f"records[{i}].new_token_ids"),
                )
            )
        self._done(ReportAllocations(instance_id=instance_id, records=wire))

    def report_layer_waits(
        self, instance_id: str, request_id: str, waits_s: Sequence[float]
    ) -> None:
        """Report how long the engine waited for each layer of a layerwise retrieve
        (`LayerwiseLoad.layer_waits()`): the server's LAYER_WAIT event and metrics."""
        self._done(
            ReportLayerWaits(
                instance_id=instance_id, request_id=request_id, waits_s=[float(w) for w in waits_s]
            )
        )

    def unregister(self, instance_id: str) -> None:
        """Unregister an instance (after its queued transfers finish on the server)."""
        self._done(Unregister(instance_id=instance_id))
        with self._lock:
            self._direct.pop(instance_id, None)
            self._events.pop(instance_id, None)
            self._layers.pop(instance_id, None)

    def status(self) -> dict[str, Any]:
        """The server's status: engine (instances, L1, bus) and server (clients, counters)."""
        reply = self._call(Status())
        if not isinstance(reply, StatusResult):
            raise ProtocolError(f"unexpected {type(reply).__name__} reply to a Status")
        return reply.status

    def admin(self, request: AdminRequest) -> dict[str, Any]:
        """Run an admin operation (AdminClear, AdminResize, AdminDrain, AdminQuota from
        kvflow.core.server.protocol); returns what it did. Non-admins get
        PermissionDeniedError (docs/OPERATIONS.md)."""
        reply = self._call(request)
        if not isinstance(reply, StatusResult):
            raise ProtocolError(f"unexpected {type(reply).__name__} reply to {request!r}")
        return reply.status

    # -- KV events (docs/EVENTS.md, KV events; kv_subscriber.KVEventStream keeps the position) --

    def subscribe_kv_events(
        self,
        *,
        model_name: str | None = None,
        world_size: int | None = None,
        cache_salt: str | None = None,
        match_salt: bool = False,
        rank: int | None = None,
    ) -> KVSubscribed:
        """Subscribe to the server's KV-event log (None fields match every owner; the salt
        is matched only with `match_salt`); the reply names the subscription, the
        server's epoch and the log position the subscription starts at."""
        reply = self._call(
            SubscribeKVEvents(
                model_name=model_name, world_size=world_size, cache_salt=cache_salt,
                match_salt=match_salt, rank=rank,
            )
        )  # fmt: skip
        if not isinstance(reply, KVSubscribed):
            raise ProtocolError(f"unexpected {type(reply).__name__} reply to a SubscribeKVEvents")
        return reply

    def poll_kv_events(
        self, subscription: str, *, after_seq: int, after_log_seq: int, max_records: int = 1024
    ) -> KVPoll:
        """The subscription's records after the position (its seq, the log's), at once."""
        reply = self._call(
            PollKVEvents(
                subscription=subscription, after_seq=after_seq, after_log_seq=after_log_seq,
                max_records=max_records,
            )
        )  # fmt: skip
        if not isinstance(reply, KVEvents):
            raise ProtocolError(f"unexpected {type(reply).__name__} reply to a PollKVEvents")
        return reply.poll

    def unsubscribe_kv_events(self, subscription: str) -> None:
        """End a subscription now (else it expires with this client)."""
        self._done(UnsubscribeKVEvents(subscription=subscription))

    # -- heartbeat and shutdown ------------------------------------------------------------------

    def _start_heartbeat(self, interval_s: float) -> None:
        with self._lock:
            self._heartbeat_interval = (
                min(self._heartbeat_interval, interval_s)
                if self._heartbeat_interval
                else interval_s
            )
            if self._heartbeat is not None or self._closing:
                return
            self._heartbeat = threading.Thread(
                target=self._heartbeat_loop, name="kvflow-client-heartbeat", daemon=True
            )
        self._heartbeat.start()

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self._heartbeat_interval):
            try:
                self._call(Heartbeat(), timeout_s=max(self._heartbeat_interval, 0.5))
            except KVFlowError:
                continue  # the server is busy or restarting: keep trying

    def close(self) -> None:
        """Stop heartbeating, send the layerwise stores made before (each answered or
        timed out), then close every socket (call once other threads' calls returned).

        The server reaps this client's still-registered instances after its
        heartbeat timeout; unregister them first to release them at once.
        """
        with self._lock:
            if self._closing:
                return
            self._closing = True
            heartbeat, sender = self._heartbeat, self._store_sender
        self._stopping.set()
        if heartbeat is not None:
            heartbeat.join()
        if sender is not None:
            sender.shutdown(wait=True)
        with self._lock:
            self._closed = True
            connections, self._connections, self._idle = self._connections, set(), {}
        for conn in connections:
            conn.close()
        self._ctx.term()

    def __enter__(self) -> KVFlowClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
