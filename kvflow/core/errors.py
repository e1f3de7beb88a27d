"""kvflow's error hierarchy; each error carries the `code` the server replies with.

Engine and server raise these so a remote client gets the same error class and
message a local caller would.
"""

from __future__ import annotations


class KVFlowError(Exception):
    """Base of every kvflow error."""

    code = "internal"


class InvalidRequestError(KVFlowError, ValueError):
    """The request's arguments are wrong (shapes, ids, alignment, types)."""

    code = "invalid_argument"


class UnknownInstanceError(KVFlowError, LookupError):
    """The instance id was never registered, or was unregistered."""

    code = "not_found"


class AlreadyRegisteredError(KVFlowError, ValueError):
    """The instance id is already registered."""

    code = "already_exists"


class PermissionDeniedError(KVFlowError):
    """The instance belongs to another client (the one that registered it)."""

    code = "permission_denied"


class ProtocolError(KVFlowError):
    """A malformed message, an unknown request type or a wrong protocol version."""

    code = "protocol"


class TransferError(KVFlowError):
    """A copy between the engine's cache and L1 failed; nothing was made visible."""

    code = "transfer_failed"


class CapacityError(KVFlowError):
    """L1 has no room that eviction could free (every object is pinned)."""

    code = "resource_exhausted"


class L2BacklogError(KVFlowError):
    """Write-through refused chunks: too many bytes already wait for L2 writes."""

    code = "l2_backlog"


class AuthenticationError(KVFlowError):
    """The server refused the connection's CURVE handshake (unknown key, or CURVE on one side only)."""

    code = "unauthenticated"


class DrainingError(KVFlowError):
    """The server is draining for a restart: it takes no new stores or registrations."""

    code = "draining"


class RequestTimeoutError(KVFlowError, TimeoutError):
    """The server did not answer in time."""

    code = "timeout"


class UnknownSubscriptionError(KVFlowError, LookupError):
    """A KV-event poll named a subscription the server does not hold (it expired with
    its client, or the server restarted): subscribe again."""

    code = "unknown_subscription"


ERRORS_BY_CODE: dict[str, type[KVFlowError]] = {
    cls.code: cls
    for cls in (
        KVFlowError,
        InvalidRequestError,
        UnknownInstanceError,
        AlreadyRegisteredError,
        PermissionDeniedError,
        ProtocolError,
        TransferError,
        CapacityError,
        L2BacklogError,
        AuthenticationError,
        RequestTimeoutError,
        DrainingError,
        UnknownSubscriptionError,
    )
}
