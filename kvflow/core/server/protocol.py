"""The wire protocol between KVFlowClient and KVFlowServer (msgspec, never pickle).

A message is a ZMQ multipart: one small msgpack header frame (a tagged-union
struct) followed by the raw payload frames its type declares (token ids and block
ids as little-endian int32 arrays). Every request gets exactly one reply: its
result or `Failed(code, message)`. Requests carry the protocol version; new fields
always get defaults so older peers of the same version still decode them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import msgspec
import numpy as np

from kvflow.core.arrays import INT32_LE
from kvflow.core.errors import InvalidRequestError, ProtocolError
from kvflow.core.server.kv_streams import KVPoll
from kvflow.kernels.rope_params import LayerRopes, LinearScaling, Llama3Scaling, RopeParams

PROTOCOL_VERSION = 1

#: dtype of every payload array on the wire (chunk keys hash int32 tokens: docs/ENGINE.md, Keys).
WIRE_DTYPE = INT32_LE


# -- KV cache descriptions (registration) ----------------------------------------


class ShmMemory(msgspec.Struct, tag="shm", frozen=True):
    """A CPU tensor's memory: a POSIX shared-memory segment and a byte offset in it."""

    name: str
    size: int
    offset: int


class FdMemory(msgspec.Struct, tag="fd", frozen=True):
    """A CPU tensor's memory: a memfd another allocator made (SGLang's host pool with
    its shm allocator), which the server opens as /proc/<pid>/fd/<fd>, and a byte offset."""

    pid: int
    fd: int
    size: int
    offset: int


class CudaIpcMemory(msgspec.Struct, tag="cuda_ipc", frozen=True):
    """A GPU tensor's memory: the CUDA IPC handle of its allocation and a byte offset."""

    handle: bytes
    offset: int
    alloc_size: int
    device_uuid: str
    device_index: int


class TensorDesc(msgspec.Struct, frozen=True):
    """Everything needed to view a tensor from another process (strides in elements)."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    memory: ShmMemory | FdMemory | CudaIpcMemory


class KVCachesDesc(msgspec.Struct, frozen=True):
    """The nesting of `kv_caches`: one tensor, a list, or a (K list, V list) pair.

    For "pair", `tensors` holds the K list followed by the V list; `split` is the
    length of the K list.
    """

    kind: Literal["tensor", "list", "pair"]
    tensors: list[TensorDesc]
    split: int = 0


class LinearScalingDesc(msgspec.Struct, tag="linear", tag_field="kind", frozen=True):
    """`kvflow.kernels.rope_params.LinearScaling` on the wire."""

    factor: float


class Llama3ScalingDesc(msgspec.Struct, tag="llama3", tag_field="kind", frozen=True):
    """`kvflow.kernels.rope_params.Llama3Scaling` on the wire."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


class RopeParamsDesc(msgspec.Struct, frozen=True, kw_only=True):
    """`kvflow.kernels.rope_params.RopeParams` on the wire (pairing "neox" or "gptj")."""

    rotary_dim: int
    theta: float = 10000.0
    pairing: str = "neox"
    scaling: LinearScalingDesc | Llama3ScalingDesc | None = None
    offset: int = 0


class RopeDesc(msgspec.Struct, frozen=True, kw_only=True):
    """The rotary embedding of a group of layers (docs/BLEND.md, The rotary registration).

    `layers` None: every layer (then the only group, with params); `params` None: the
    listed layers have no rotary embedding (NoPE), their K is never turned.
    """

    layers: list[int] | None = None
    params: RopeParamsDesc | None = None


#: most layer groups, and most layers listed over all groups, of a Register's ropes
MAX_ROPE_LAYERS = 4096


def ropes_to_wire(ropes: Any) -> list[RopeDesc] | None:
    """RopeParams (every layer), LayerRopes or None as Register.ropes."""
    if ropes is None:
        return None
    if isinstance(ropes, RopeParams):
        return [RopeDesc(params=_params_to_wire(ropes))]
    if isinstance(ropes, LayerRopes):
        return [
            RopeDesc(
                layers=[int(x) for x in layers],
                params=None if params is None else _params_to_wire(params),
            )
            for layers, params in ropes.groups
        ]
    raise InvalidRequestError(
        f"ropes must be RopeParams, LayerRopes or None, got {type(ropes).__name__}"
    )


def _params_to_wire(params: RopeParams) -> RopeParamsDesc:
    """The description of one RopeParams (its scaling by kind)."""
    scaling: LinearScalingDesc | Llama3ScalingDesc | None = None
    if isinstance(params.scaling, LinearScaling):
        scaling = LinearScalingDesc(params.scaling.factor)
    elif isinstance(params.scaling, Llama3Scaling):
        s = params.scaling
        scaling = Llama3ScalingDesc(
            s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings
        )
    return RopeParamsDesc(
        rotary_dim=params.rotary_dim, theta=params.theta, pairing=str(params.pairing),
        scaling=scaling, offset=params.offset,
    )  # fmt: skip


def ropes_from_wire(descs: list[RopeDesc] | None) -> RopeParams | LayerRopes | None:
    """Register.ropes as the engine takes them; InvalidRequestError naming the entry
    (ropes[i]) for a bad value, a whole-model entry beside others, or too many layers."""
    if descs is None:
        return None
    listed = sum(len(d.layers) for d in descs if d.layers is not None)
    if not descs or len(descs) > MAX_ROPE_LAYERS or listed > MAX_ROPE_LAYERS:
        raise InvalidRequestError(
            f"ropes must hold 1..{MAX_ROPE_LAYERS} groups listing at most {MAX_ROPE_LAYERS}"
            f" layers in all, got {len(descs)} groups listing {listed}"
        )
    groups = []
    for i, desc in enumerate(descs):
        try:
            params = None if desc.params is None else _params_from_wire(desc.params)
        except ValueError as exc:
            raise InvalidRequestError(f"ropes[{i}]: {exc}") from None
        if desc.layers is None:
            if len(descs) != 1 or params is None:
                raise InvalidRequestError(
                    f"ropes[{i}]: layers None (every layer) must be the only group and give"
                    " params; list the layers of each group (params None: no RoPE) otherwise"
                )
            return params
        groups.append((tuple(desc.layers), params))
    try:
        return LayerRopes(tuple(groups))
    except ValueError as exc:
        raise InvalidRequestError(f"ropes: {exc}") from None


def _params_from_wire(desc: RopeParamsDesc) -> RopeParams:
    """RopeParams of a description (ValueError naming the field for a bad value)."""
    scaling: LinearScaling | Llama3Scaling | None = None
    if isinstance(desc.scaling, LinearScalingDesc):
        scaling = LinearScaling(desc.scaling.factor)
    elif isinstance(desc.scaling, Llama3ScalingDesc):
        s = desc.scaling
        scaling = Llama3Scaling(
            s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings
        )
    pairing: Any = desc.pairing  # a str: RopeParams checks it and makes it a Pairing
    return RopeParams(
        rotary_dim=desc.rotary_dim, theta=desc.theta, pairing=pairing, scaling=scaling,
        offset=desc.offset,
    )  # fmt: skip


class AllocationRecord(msgspec.Struct, array_like=True, frozen=True):
    """One `kvflow.events.BlockAllocation` on the wire."""

    req_id: str
    block_ids: list[int]
    token_ids: list[int]


# -- requests ----------------------------------------------------------------------


class Request(msgspec.Struct, tag_field="op", kw_only=True):
    """Base of every request: protocol version, correlation id, client id.

    `payloads` names the raw int32 frames that follow the header, in order.
    """

    payloads: ClassVar[tuple[str, ...]] = ()
    v: int = PROTOCOL_VERSION
    id: int = 0
    client: str = ""


class Register(Request, tag="register"):
    instance_id: str
    kv_caches: KVCachesDesc
    model_name: str
    world_size: int = 1
    rank: int = 0
    block_size: int | None = None
    kv_format: str | None = None
    #: IPC handle of the engine's interprocess CUDA event (GPU caches only).
    event_handle: bytes | None = None
    #: IPC handle of a second one the server records when a retrieve's copies are queued,
    #: replying then; the client waits for it on the host (GPU caches; None: reply when
    #: done).
    retrieve_event_handle: bytes | None = None
    #: and a third one a store records once its copies are queued, replying then; the
    #: client waits for it on the host before its store returns (GPU caches; None: reply
    #: once the copies are done)
    store_event_handle: bytes | None = None
    #: take over the instance id even when another (dead) client still holds it
    takeover: bool = False
    #: layerwise retrieves (kvflow.core.server.layers): one interprocess CUDA event per
    #: layer (GPU caches) or a shared int64 flag per layer (CPU caches, as uint8 bytes)
    layer_event_handles: list[bytes] | None = None
    layer_flags: TensorDesc | None = None
    #: a staging ring the engine owns for layerwise retrieves ([slots, slot bytes] uint8,
    #: with the caches: kvflow.core.server.staging) and its 2 x slots events (GPU caches)
    layer_staging: TensorDesc | None = None
    layer_staging_event_handles: list[bytes] | None = None
    #: the model's rotary embedding, which a blend retrieve turns K with (None: no blend)
    ropes: list[RopeDesc] | None = None


class Lookup(Request, tag="lookup"):
    payloads: ClassVar[tuple[str, ...]] = ("token_ids",)
    model_name: str
    world_size: int = 1
    cache_salt: str | None = None
    request_id: str | None = None
    #: start a prefetch of the hits that lie in L2
    prefetch: bool = True
    #: the token_ids payload holds chunk keys (32 bytes each, kvflow.core.engine.chunk_keys)
    keyed: bool = False
    #: count only these ranks of the world (None: all): a server that holds one rank
    ranks: list[int] | None = None


class Prefetch(Request, tag="prefetch"):
    payloads: ClassVar[tuple[str, ...]] = ("token_ids",)
    model_name: str
    world_size: int = 1
    cache_salt: str | None = None
    request_id: str | None = None
    #: load only these ranks' chunks (None: all): a server that holds some ranks
    ranks: list[int] | None = None


class PrefetchQuery(Request, tag="prefetch_state"):
    prefetch_id: str


class Store(Request, tag="store"):
    payloads: ClassVar[tuple[str, ...]] = ("token_ids", "block_ids")
    instance_id: str
    request_id: str
    cache_salt: str | None = None
    #: > 0: a layerwise store with this number (kvflow.core.server.layers): each layer is
    #: copied once the engine marks it written; the reply comes when all are stored
    layer_seq: int = 0
    #: the token_ids payload holds chunk keys (32 bytes each, kvflow.core.engine.chunk_keys)
    keyed: bool = False


class Retrieve(Request, tag="retrieve"):
    payloads: ClassVar[tuple[str, ...]] = ("token_ids", "block_ids")
    instance_id: str
    request_id: str
    skip_first_n_tokens: int = 0
    cache_salt: str | None = None
    #: the token_ids payload holds chunk keys (32 bytes each, kvflow.core.engine.chunk_keys)
    keyed: bool = False
    #: > 0: a layerwise retrieve with this number (kvflow.core.server.layers); the reply
    #: comes once the block ids are checked, before the first layer's copies
    layer_seq: int = 0


class SegmentRef(msgspec.Struct, array_like=True, frozen=True):
    """A blend segment to copy, as BlendRetrieve sends it: the stored chunk `chunk_hash`
    (its KV computed at `original_start`) goes to prompt tokens from `offset` on."""

    offset: int
    chunk_hash: bytes
    original_start: int


class BlendLookup(Request, tag="blend_lookup"):
    """The prefix hit and the stored chunks found anywhere past it (docs/BLEND.md)."""

    payloads: ClassVar[tuple[str, ...]] = ("token_ids",)
    model_name: str
    world_size: int = 1
    cache_salt: str | None = None
    request_id: str | None = None
    #: start loading the segments that lie in L2 into L1
    prefetch: bool = True
    #: find only chunks these ranks of the world hold (None: all): a server that holds some
    ranks: list[int] | None = None


class BlendRetrieve(Request, tag="blend_retrieve"):
    """Copy blend segments into the prompt's blocks, K turned to their new positions;
    replied once the copies landed (`done`: the tokens blended)."""

    payloads: ClassVar[tuple[str, ...]] = ("token_ids", "block_ids")
    instance_id: str
    request_id: str
    segments: list[SegmentRef]
    cache_salt: str | None = None


class EndSession(Request, tag="end_session"):
    request_id: str


class ReportAllocations(Request, tag="report_allocations"):
    instance_id: str
    records: list[AllocationRecord]


class ReportLayerWaits(Request, tag="report_layer_waits"):
    """How long the engine waited for each layer of a layerwise retrieve (seconds, by layer)."""

    instance_id: str
    request_id: str
    waits_s: list[float]


class Unregister(Request, tag="unregister"):
    instance_id: str


class Status(Request, tag="status"):
    pass


class Heartbeat(Request, tag="heartbeat"):
    pass


class SubscribeKVEvents(Request, tag="kv_subscribe"):
    """Subscribe to the KV-event log; None fields match every owner (docs/EVENTS.md)."""

    model_name: str | None = None
    world_size: int | None = None
    cache_salt: str | None = None
    #: match the salt exactly (None included) instead of every salt
    match_salt: bool = False
    rank: int | None = None


class PollKVEvents(Request, tag="kv_poll"):
    subscription: str
    after_seq: int = 0
    after_log_seq: int = 0
    max_records: int = 1024


class UnsubscribeKVEvents(Request, tag="kv_unsubscribe"):
    subscription: str


class AdminRequest(Request, kw_only=True):
    """Base of the operator's requests (docs/OPERATIONS.md): only an admin may send them
    (a listed CURVE key, or a loopback peer when CURVE is off); the reply is a
    StatusResult describing what was done."""

    #: set by a sharded server's front for a caller it refused (why): its shards record
    #: the refusal and run nothing (any other server ignores it)
    denied: str | None = None


class AdminClear(AdminRequest, tag="admin_clear"):
    """Drop the objects of a model and/or a salt (None: any) from the named tiers
    (empty: every tier); `everything` must be set to clear without a filter."""

    model_name: str | None = None
    cache_salt: str | None = None
    tiers: list[str] = []
    everything: bool = False


class AdminResize(AdminRequest, tag="admin_resize"):
    """Set L1's capacity live, in GiB."""

    l1_size_gb: float


class AdminDrain(AdminRequest, tag="admin_drain"):
    """Start draining (refuse new stores and registrations), or stop with `undrain`;
    the reply tells what is still in flight and whether the server is drained."""

    undrain: bool = False


class AdminQuota(AdminRequest, tag="admin_quota"):
    """Set (or with None remove) the L1 byte limit of a salt or model tenant, in GiB."""

    kind: Literal["salt", "model"]
    name: str
    limit_gb: float | None


AnyRequest = (
    Register
    | Lookup
    | Prefetch
    | PrefetchQuery
    | Store
    | Retrieve
    | BlendLookup
    | BlendRetrieve
    | EndSession
    | ReportAllocations
    | ReportLayerWaits
    | Unregister
    | Status
    | Heartbeat
    | SubscribeKVEvents
    | PollKVEvents
    | UnsubscribeKVEvents
    | AdminClear
    | AdminResize
    | AdminDrain
    | AdminQuota
)


# -- replies -----------------------------------------------------------------------


class Reply(msgspec.Struct, tag_field="r", kw_only=True):
    """Base of every reply: the request's correlation id and the server's handling time."""

    v: int = PROTOCOL_VERSION
    id: int = 0
    server_ns: int = 0


class Done(Reply, tag="done"):
    """Success; `value` is the method's integer result (None for methods returning None)."""

    value: int | None = None


class Registered(Reply, tag="registered"):
    """Registration accepted; the client must heartbeat at least this often."""

    heartbeat_interval_s: float
    #: a sharded server's shard serving the instance (ipc://, this host): the client may
    #: send the instance's stores and retrieves there directly, one hop fewer (None: here)
    endpoint: str | None = None


class StatusResult(Reply, tag="status"):
    """A JSON-like snapshot: the server's status, or one prefetch's state."""

    status: dict[str, Any]


class PrefetchStarted(Reply, tag="prefetch"):
    """A prefetch began; ask for its state with this id."""

    prefetch_id: str


class SegmentFound(msgspec.Struct, array_like=True, frozen=True):
    """A blend segment a lookup found (kvflow.core.engine.blend_index.BlendSegment):
    prompt tokens offset..offset+length are stored chunk `chunk_hash`, computed at
    `original_start`."""

    offset: int
    length: int
    chunk_hash: bytes
    original_start: int


class BlendFound(Reply, tag="blend"):
    """A blend lookup's answer: the prefix hit in tokens, then the segments found past
    it, leftmost first, none overlapping."""

    prefix_tokens: int
    segments: list[SegmentFound]


class Blended(Reply, tag="blended"):
    """A blend retrieve's answer: the tokens copied, and the prompt offsets of the segments
    it skipped (no tier holds them any more): the engine recomputes those."""

    tokens: int
    skipped: list[int]


class Failed(Reply, tag="failed"):
    """The request failed; `code` is a kvflow error code (kvflow.core.errors)."""

    code: str
    message: str


class KVSubscribed(Reply, tag="kv_subscribed"):
    """A KV-event subscription: its id, the server's epoch, the log position it starts at."""

    subscription: str
    epoch: str
    log_seq: int


class KVEvents(Reply, tag="kv_events"):
    """One poll's records (kvflow.core.server.kv_streams.KVPoll)."""

    poll: KVPoll


AnyReply = (
    Done
    | Registered
    | StatusResult
    | PrefetchStarted
    | BlendFound
    | Blended
    | Failed
    | KVSubscribed
    | KVEvents
)


class _Versioned(msgspec.Struct):
    """Just enough of a header to read its version and id when the full decode fails."""

    v: int = 0
    id: int = 0


# -- encoding and decoding ------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
# Status replies may hold values msgpack has no type for (paths, enums): send their text.
_reply_encoder = msgspec.msgpack.Encoder(enc_hook=str)
_request_decoder = msgspec.msgpack.Decoder(AnyRequest)
_reply_decoder = msgspec.msgpack.Decoder(AnyReply)
_versioned_decoder = msgspec.msgpack.Decoder(_Versioned)


def encode_request(request: Request, payloads: Sequence[np.ndarray] = ()) -> list[Any]:
    """The frames of `request`: its header, then its payload arrays' raw bytes.

    The header is checked against its schema first (a few microseconds), so a
    wrongly typed argument fails here with InvalidRequestError, not on the server.
    """
    if len(payloads) != len(request.payloads):
        raise ValueError(
            f"{type(request).__name__} takes payloads {request.payloads}, got {len(payloads)}"
        )
    try:
        header = _encoder.encode(request)
        _request_decoder.decode(header)
    except (TypeError, msgspec.EncodeError, msgspec.ValidationError) as exc:
        raise InvalidRequestError(f"invalid {type(request).__name__} argument: {exc}") from None
    return [header, *(p.data for p in payloads)]


def encode_header(request: Request) -> bytes:
    """A decoded request's header again (a sharded server's front forwarding it under
    its own id): no schema check, the request already passed one."""
    return _encoder.encode(request)


def decode_request(frames: Sequence[Any]) -> tuple[Request, tuple[np.ndarray, ...]]:
    """Decode a request's frames into its typed header and its payload arrays.

    Raises ProtocolError for anything malformed: no frames, an undecodable header,
    a wrong protocol version, a wrong number of payload frames, or a payload whose
    size is not a whole number of int32 values.
    """
    if not frames:
        raise ProtocolError("empty message: expected a header frame")
    header = frames[0]
    try:
        request = _request_decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        version = peek_version(header)
        if version not in (None, PROTOCOL_VERSION):
            raise _version_error(version) from None
        raise ProtocolError(f"malformed request header: {exc}") from None
    if request.v != PROTOCOL_VERSION:
        raise _version_error(request.v)
    names = request.payloads
    if len(frames) - 1 != len(names):
        raise ProtocolError(
            f"{type(request).__name__} takes {len(names)} payload frame(s)"
            f" ({', '.join(names) or 'none'}), got {len(frames) - 1}"
        )
    arrays = []
    for name, frame in zip(names, frames[1:], strict=True):
        buf = memoryview(frame)
        if buf.nbytes % WIRE_DTYPE.itemsize:
            raise ProtocolError(
                f"payload {name} has {buf.nbytes} bytes, not a whole number of int32 values"
            )
        arrays.append(np.frombuffer(buf, dtype=WIRE_DTYPE))
    return request, tuple(arrays)


def peek_version(header: Any) -> int | None:
    """The protocol version a header claims, or None when even that cannot be read."""
    try:
        return _versioned_decoder.decode(header).v
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        return None


def peek_id(header: Any) -> int:
    """The correlation id a header claims (0 when unreadable), to address an error reply."""
    try:
        return _versioned_decoder.decode(header).id
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        return 0


def _version_error(version: int) -> ProtocolError:
    return ProtocolError(
        f"protocol version {version} is not supported (this server speaks {PROTOCOL_VERSION})"
    )


def encode_reply(reply: Reply) -> bytes:
    return _reply_encoder.encode(reply)


def decode_reply(frame: Any) -> Reply:
    """Decode a reply header; raises ProtocolError when it is malformed."""
    try:
        reply = _reply_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed reply from server: {exc}") from None
    if reply.v != PROTOCOL_VERSION:
        raise _version_error(reply.v)
    return reply
