"""The server's registered instances: what it holds for each, and the table of them."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvflow.core.server.layers import ServerLayers
from kvflow.core.server.sharing import OpenedKVCaches

if TYPE_CHECKING:
    from kvflow.core.server.worker import Worker


@dataclass
class Registration:
    """What the server holds for one registered instance (opened: None until mapped).

    Threads: the instance's worker writes `opened`, the events and the layers (its
    register job fills them, its retire job releases them), and only jobs on that
    worker read them, in order; `_shutdown` releases them once every worker stopped.
    `retiring` is set by the main loop and polled by a layerwise store on the worker:
    a bool, safe to read racily (the store sees it at its next poll). `served_at` is
    written once by the register job and read racily by the main loop's reaper (None:
    still being registered). The other fields never change.
    """

    instance_id: str
    client: str
    worker: Worker
    opened: OpenedKVCaches | None = None
    event: Any = None
    #: the client's event a retrieve records once its copies are queued (CUDA caches)
    retrieved: Any = None
    #: the client's event a store records once its copies are queued (CUDA caches)
    stored: Any = None
    #: per-layer completion points of layerwise retrieves, and what maps them
    layers: ServerLayers | None = None
    layers_opened: Any = None
    #: set once the instance is being unregistered (read by a layerwise store's waits)
    retiring: bool = False
    registered_at: float = field(default_factory=time.monotonic)
    #: when the registration was done (time.monotonic()); None while it is in progress
    served_at: float | None = None

    def release(self) -> None:
        """Unmap the instance's memory and drop its CUDA events now (idempotent)."""
        opened, self.opened, self.event, self.retrieved = self.opened, None, None, None
        self.stored = None
        layers_opened, self.layers, self.layers_opened = self.layers_opened, None, None
        if opened is not None:
            opened.release()
        if layers_opened is not None:
            layers_opened.release()


class Registry:
    """Registrations by instance id.

    Lock rule: every method holds the lock. The main loop adds and removes
    registrations, a worker removes one whose registration failed, and `status()`
    may read them from any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Registration] = {}

    def get(self, instance_id: str) -> Registration | None:
        with self._lock:
            return self._by_id.get(instance_id)

    def add(self, reg: Registration) -> None:
        """Register `reg` under its id (the caller retired any previous one)."""
        with self._lock:
            self._by_id[reg.instance_id] = reg

    def discard(self, reg: Registration) -> None:
        """Forget `reg` if it is still the one registered under its id."""
        with self._lock:
            if self._by_id.get(reg.instance_id) is reg:
                del self._by_id[reg.instance_id]

    def all(self) -> list[Registration]:
        """Every registration, as of now."""
        with self._lock:
            return list(self._by_id.values())

    def take_all(self) -> list[Registration]:
        """Every registration, forgetting them all (at shutdown)."""
        with self._lock:
            regs = list(self._by_id.values())
            self._by_id.clear()
        return regs

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)
