"""How a server process renders its own log lines (a one-process server, a sharded
server's front and each of its shards alike)."""

from __future__ import annotations

from kvflow.core.config import ObservabilityConfig
from kvflow.subscribers import LoggingSetup, configure_logging


def configure_server_logging(config: ObservabilityConfig) -> LoggingSetup | None:
    """Render the server's own logs like the event logs.

    With event logs on, the engine's pipeline installs that rendering; otherwise
    the server installs it here, so its lines never come out in another format.
    """
    if config.enabled and config.logging_enabled:
        return None
    return configure_logging(config.log_level, config.log_format)
