"""The operator's side of the server (docs/OPERATIONS.md): who is an admin, drain, and
the admin operations (clear, live L1 resize, tenant quotas).

Every admin call, allowed or refused, is an ADMIN event and a log line naming the
caller. An admin is a client whose CURVE key is listed in `--admin-keys` (CURVE on),
or a client connecting from a loopback address (CURVE off).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import zmq

from kvflow.core.config import ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.errors import DrainingError, InvalidRequestError, PermissionDeniedError
from kvflow.core.server.curve import AuthorizedKeys
from kvflow.core.server.protocol import (
    AdminClear,
    AdminDrain,
    AdminQuota,
    AdminRequest,
    AdminResize,
)
from kvflow.core.tiers.l1 import L1Cache
from kvflow.core.tiers.quota import salt_label
from kvflow.events import Event, EventType

log = logging.getLogger("kvflow.server.admin")

GIB = 1 << 30
T = TypeVar("T")

#: the request types' names in events, logs and the CLI
ACTIONS: dict[type[AdminRequest], str] = {
    AdminClear: "clear",
    AdminResize: "resize",
    AdminDrain: "drain",
    AdminQuota: "quota",
}


def describe(request: AdminRequest) -> dict[str, Any]:
    """A request's arguments for events and logs; a cache salt (a tenant's secret) is
    shown only by its metric label, never as is."""
    args: dict[str, Any] = {
        f: getattr(request, f)
        for f in request.__struct_fields__
        if f not in ("v", "id", "client", "denied") and getattr(request, f) not in (None, [], False)
    }
    if isinstance(request, AdminClear) and request.cache_salt is not None:
        args["cache_salt"] = salt_label(request.cache_salt)
    if isinstance(request, AdminQuota) and request.kind == "salt":
        args["name"] = salt_label(request.name)
    return args


def _is_loopback(peer: str | None) -> bool:
    if not peer:
        return False
    try:
        return ipaddress.ip_address(peer.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


class AdminCaller(NamedTuple):
    """Who sent an admin request: its CURVE key (CURVE on), its peer address (None on a
    transport without one), and the text logs and ADMIN events name it by."""

    key: str | None
    peer: str | None
    text: str

    @classmethod
    def of(cls, request: AdminRequest, frame: zmq.Frame, curve: bool) -> AdminCaller:
        """The caller of `request`, read from its first frame's metadata."""
        key = str(frame.get("User-Id")) if curve else None
        try:
            peer: str | None = str(frame.get("Peer-Address"))
        except zmq.ZMQError:  # a transport without peer addresses (inproc): no admin
            peer = None
        name = request.client or "?"
        if key is not None and name.startswith(f"{key} "):  # the owner form "KEY CLIENT_ID"
            name = name[len(key) + 1 :]
        text = f"{name} at {peer or '?'}"
        if key is not None:
            text = f"{text} with CURVE key {key}"
        return cls(key, peer, text)


class AdminAuth:
    """Decides whether a caller is an admin: its CURVE key listed in the admin keys
    directory (CURVE on), or its peer address a loopback one (CURVE off)."""

    def __init__(self, config: ServerConfig) -> None:
        self.curve = config.curve
        self._keys: AuthorizedKeys | None = None
        if config.admin_keys is not None:
            self._keys = AuthorizedKeys(config.admin_keys, flag="--admin-keys")

    def allowed(self, curve_key: str | None, peer: str | None) -> bool:
        """Whether a request from `peer` (its IP), authenticated as `curve_key`, is an admin's."""
        if self.curve:
            return (
                self._keys is not None
                and curve_key is not None
                and self._keys.holds(curve_key.encode())
            )
        return _is_loopback(peer)

    def why_not(self) -> str:
        """The refusal's explanation (what would make a caller an admin)."""
        if self.curve:
            return (
                "admin operations need a CURVE key listed in --admin-keys"
                if self._keys is not None
                else "admin operations are off: this server has CURVE on and no --admin-keys"
            )
        return "admin operations are allowed only from a loopback address when CURVE is off"


class DrainState:
    """Whether the server drains, and how many stores and registrations are in flight.

    `check(op)` raises DrainingError while draining; `track(job)` counts a job in flight
    until it has run (thread-safe).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.draining = False
        self._in_flight = 0

    def check(self, op: str) -> None:
        """Refuse a new operation `op` while draining."""
        if self.draining:
            raise DrainingError(
                f"{op} refused: this server is draining for a restart (it finishes the"
                " work in flight and takes no new stores or registrations); use another"
                " server or retry after it is back"
            )

    def track(self, job: Callable[[], T]) -> Callable[[], T]:
        """`job`, counted in flight from now until it has run."""
        with self._lock:
            self._in_flight += 1

        def run() -> T:
            try:
                return job()
            finally:
                with self._lock:
                    self._in_flight -= 1

        return run

    def set(self, draining: bool) -> None:
        self.draining = draining

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight


class AdminOps:
    """Runs admin requests against the engine; each returns a JSON-ready result."""

    def __init__(
        self, engine: CacheEngine, drain: DrainState, pending_l2_writes: Callable[[], int]
    ) -> None:
        self.engine = engine
        self.drain = drain
        self._pending_l2_writes = pending_l2_writes

    @property
    def l1(self) -> L1Cache:
        l1 = self.engine.l1
        if not isinstance(l1, L1Cache):  # pragma: no cover - the engine always builds one
            raise InvalidRequestError("this engine's L1 supports no admin operations")
        return l1

    def run(self, request: AdminRequest, caller: str) -> dict[str, Any]:
        """Do `request` for `caller`, publishing the ADMIN event and logging it."""
        action, args = ACTIONS[type(request)], describe(request)
        try:
            result = self._run(request)
        except Exception as exc:
            self.publish(action, caller, "error", args=args, error=str(exc))
            log.warning("admin %s %s by %s failed: %s", action, args, caller, exc)
            raise
        self.publish(action, caller, "ok", args=args, result=result)
        log.info("admin %s %s by %s: %s", action, args, caller, result)
        return result

    def refuse(self, request: AdminRequest, caller: str, why: str) -> PermissionDeniedError:
        """The error for a caller who is no admin (published and logged as denied)."""
        action, args = ACTIONS[type(request)], describe(request)
        self.publish(action, caller, "denied", args=args, error=why)
        log.warning("admin %s %s refused for %s: %s", action, args, caller, why)
        return PermissionDeniedError(f"admin {action} refused: {why}")

    def publish(self, action: str, caller: str, outcome: str, **attrs: Any) -> None:
        self.engine.bus.publish(
            Event(EventType.ADMIN, attrs={"action": action, "caller": caller,
                                          "outcome": outcome, **attrs})
        )  # fmt: skip

    def drain_status(self) -> dict[str, Any]:
        """draining, stores/registrations in flight, L2 writes pending, and drained."""
        in_flight, pending = self.drain.in_flight, self._pending_l2_writes()
        draining = self.drain.draining
        return {
            "draining": draining,
            "in_flight": in_flight,
            "pending_l2_writes": pending,
            "drained": draining and in_flight == 0 and pending == 0,
        }

    def _run(self, request: AdminRequest) -> dict[str, Any]:
        match request:
            case AdminClear():
                return self._clear(request)
            case AdminResize():
                return self._resize(request.l1_size_gb)
            case AdminDrain():
                self.drain.set(not request.undrain)
                return self.drain_status()
            case AdminQuota():
                return self._quota(request)
        raise InvalidRequestError(f"unknown admin request {type(request).__name__}")

    def _clear(self, request: AdminClear) -> dict[str, Any]:
        model, salt = request.model_name, request.cache_salt
        if model is None and salt is None and not request.everything:
            raise InvalidRequestError(
                "clear needs a model name, a cache salt, or everything=True (--all)"
            )
        tiers = {"l1": self.engine.l1, **{t.name: t for t in self.engine.l2_tiers}}
        unknown = [name for name in request.tiers if name not in tiers]
        if unknown:
            raise InvalidRequestError(
                f"clear names unknown tier(s) {unknown}; this server has {list(tiers)}"
            )

        def matches(key: Any) -> bool:
            return (model is None or key[1] == model) and (salt is None or key[4] == salt)

        dropped: dict[str, int | str] = {}
        for name in request.tiers or list(tiers):
            try:
                dropped[name] = tiers[name].drop_where(matches)
            except Exception as exc:  # one unreachable tier must not hide the others' result
                dropped[name] = f"failed: {exc}"
        return {"dropped": dropped}

    def _resize(self, size_gb: float) -> dict[str, Any]:
        if isinstance(size_gb, bool) or not isinstance(size_gb, (int, float)) or not size_gb > 0:
            raise InvalidRequestError(f"l1_size_gb must be a number > 0, got {size_gb!r}")
        try:
            return self.l1.resize(int(size_gb * GIB))
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None

    def _quota(self, request: AdminQuota) -> dict[str, Any]:
        limit = request.limit_gb
        if limit is not None and not (
            isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0
        ):
            raise InvalidRequestError(f"limit_gb must be a number > 0 or None, got {limit!r}")
        nbytes = None if limit is None else int(limit * GIB)
        try:
            result = self.l1.set_quota((request.kind, request.name), nbytes)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        return {"limit_bytes": nbytes, **result}
