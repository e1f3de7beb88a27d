"""`kvflow server` and `kvflow status`: flags, TOML config file, environment, signals.

Precedence for every setting: command-line flag, then `--config` file, then the
KVFLOW_<FLAG> environment variable, then the default. Any invalid value exits
with status 2 and one line naming the flag.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import tomllib
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn

from kvflow.core.config import SECRET_FIELDS, ObservabilityConfig, ServerConfig
from kvflow.core.server.addresses import bare_host, endpoint_host
from kvflow.core.server.server_logging import configure_server_logging
from kvflow.subscribers import LoggingSetup, configure_logging

ENV_PREFIX = "KVFLOW_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class _Option:
    """One setting: its flag, the config field it fills, and how to read it."""

    flag: str
    field: str
    section: str  # "server" or "observability"
    kind: type
    help: str
    invert: bool = False  # a --disable-X / --no-X switch sets field X to False

    @property
    def key(self) -> str:
        """The name in a TOML config file."""
        return self.flag[2:].replace("-", "_")

    @property
    def secret(self) -> bool:
        """Whether the value may be a credential (never echoed in an error)."""
        return self.field in (*SECRET_FIELDS, "l2_redis_url")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()


_S, _O = "server", "observability"
OPTIONS = (
    _Option("--host", "host", _S, str, "interface to listen on (default 127.0.0.1)"),
    _Option("--port", "port", _S, int, "TCP port for clients (default 5555; 0 picks a free one)"),
    _Option("--chunk-size", "chunk_size", _S, int, "tokens per stored chunk (default 256)"),
    _Option(
        "--l1-size-gb",
        "l1_size_gb",
        _S,
        float,
        "L1 (CPU memory) capacity in GiB, 2**30 bytes (default 4)",
    ),
    _Option(
        "--l1-pin-threads",
        "l1_pin_threads",
        _S,
        int,
        "threads that pin L1's memory in the background from start-up, so no store waits"
        " to pin; 0 pins on demand inside stores (default 4)",
    ),
    _Option(
        "--l1-prefault",
        "l1_prefault",
        _S,
        bool,
        "without CUDA, fault L1's memory in on the --l1-pin-threads threads from start-up,"
        " so no store pays the first touch of fresh memory (L1 is then resident at once)",
    ),
    _Option(
        "--heartbeat-timeout-s",
        "heartbeat_timeout_s",
        _S,
        float,
        "unregister a client's instances after this many seconds without hearing from it,"
        " in 0.5..86400 (default 30)",
    ),
    _Option(
        "--kv-events-chunks",
        "kv_events_chunks",
        _S,
        int,
        "chunk hashes the KV-event replay log keeps for subscribers, 0..2**26"
        " (default 65536; 0 = KV events off)",
    ),
    _Option(
        "--blend-index-chunks",
        "blend_index_chunks",
        _S,
        int,
        "stored chunks the blend index keeps findable anywhere in a prompt, 0..2**26"
        " (default 262144, about 100 MiB; least recently stored or found go first;"
        " 0: blend off, stores index nothing)",
    ),
    _Option(
        "--max-message-mb",
        "max_message_mb",
        _S,
        float,
        "largest request accepted, in MiB, 0.0625..2048 (default 64); twice this drops the"
        " connection",
    ),
    _Option(
        "--max-instances",
        "max_instances",
        _S,
        int,
        "registered instances accepted at once (default 64); more are refused",
    ),
    _Option(
        "--switch-interval-ms",
        "switch_interval_ms",
        _S,
        float,
        "the server process's thread switch interval in ms (default 0.05; CPython's is 5):"
        " how long a thread waiting for the GIL waits before the running one hands it over",
    ),
    _Option(
        "--l2-disk",
        "l2_disk_paths",
        _S,
        list,
        "L2 on local disk: directories, comma-separated (TOML: a list); off when not given",
    ),
    _Option(
        "--l2-disk-size-gb", "l2_disk_size_gb", _S, float, "L2 disk capacity in GiB (default 64)"
    ),
    _Option(
        "--l2-disk-sharding",
        "l2_disk_sharding",
        _S,
        str,
        "how GPUs share the --l2-disk paths: by_gpu (the default and only value)",
    ),
    _Option(
        "--l2-disk-direct-io",
        "l2_disk_direct_io",
        _S,
        bool,
        "read and write disk objects with O_DIRECT where the filesystem allows it",
    ),
    _Option(
        "--no-l2-write-back",
        "l2_write_back",
        _S,
        bool,
        "do not keep chunks loaded from L2 in L1 (L1 only stages them for the retrieve)",
        invert=True,
    ),
    _Option(
        "--l2-timeout-s",
        "l2_timeout_s",
        _S,
        float,
        "longest wait of a request on an L2 tier, in seconds, 0.001..600 (default 2)",
    ),
    _Option(
        "--l2-backlog-wait-s",
        "l2_backlog_wait_s",
        _S,
        float,
        "longest a store waits for slow L2 writes before skipping L2 (counted), in seconds,"
        " 0..600 (default 10)",
    ),
    _Option(
        "--l2-redis",
        "l2_redis_url",
        _S,
        str,
        "L2 on Redis: redis://[user:password@]host:port/db or rediss:// (TLS); off when absent",
    ),
    _Option(
        "--l2-redis-cluster", "l2_redis_cluster", _S, bool, "the URL names a Redis Cluster node"
    ),
    _Option(
        "--l2-redis-key-prefix",
        "l2_redis_key_prefix",
        _S,
        str,
        "prefix of every key kvflow writes to Redis (default kvflow:)",
    ),
    _Option(
        "--l2-redis-username",
        "l2_redis_username",
        _S,
        str,
        "Redis ACL user (else the URL's, else KVFLOW_REDIS_USERNAME)",
    ),
    _Option(
        "--l2-redis-password",
        "l2_redis_password",
        _S,
        str,
        "Redis password (else the URL's, else KVFLOW_REDIS_PASSWORD; prefer the variable)",
    ),
    _Option(
        "--l2-redis-timeout-s",
        "l2_redis_timeout_s",
        _S,
        float,
        "connect and read timeout of each Redis call, in seconds, 0.001..600 (default 1)",
    ),
    _Option(
        "--l2-redis-pool-size",
        "l2_redis_pool_size",
        _S,
        int,
        "Redis connections, each with its I/O thread (default 8)",
    ),
    _Option(
        "--curve-secret-key",
        "curve_secret_key",
        _S,
        str,
        "CURVE: the server's NAME.key_secret file from `kvflow keygen` (with"
        " --curve-authorized-keys); clients then need the server's NAME.key",
    ),
    _Option(
        "--curve-authorized-keys",
        "curve_authorized_keys",
        _S,
        str,
        "CURVE: directory of the client public keys (NAME.key) allowed to connect; re-read"
        " when it changes",
    ),
    _Option(
        "--insecure-listen",
        "insecure_listen",
        _S,
        bool,
        "allow a non-loopback --host without CURVE (anyone who reaches the port is a client)",
    ),
    _Option(
        "--admin-keys",
        "admin_keys",
        _S,
        str,
        "CURVE: directory of the client public keys (NAME.key) allowed admin operations"
        " (`kvflow admin`); without CURVE, clients on a loopback address are admins",
    ),
    _Option(
        "--probe-host",
        "probe_host",
        _S,
        str,
        "interface of the /healthz and /readyz endpoint (default 127.0.0.1)",
    ),
    _Option(
        "--probe-port",
        "probe_port",
        _S,
        int,
        "port of the /healthz and /readyz HTTP endpoint (default 0 = off)",
    ),
    _Option(
        "--l1-quota",
        "l1_quotas",
        _S,
        list,
        "L1 byte limits per tenant, comma-separated salt:NAME=GIB or model:NAME=GIB (TOML:"
        " a list); a tenant over its limit evicts its own objects first",
    ),
    _Option(
        "--shards",
        "shards",
        _S,
        int,
        "processes serving the ranks behind this endpoint, rank r on shard r mod N (default"
        " 1; one per GPU of a tensor-parallel engine: docs/SERVER.md, Shards)",
    ),
    _Option(
        "--disable-observability",
        "enabled",
        _O,
        bool,
        "publish no events at all (no metrics, logs or traces)",
        invert=True,
    ),
    _Option("--disable-metrics", "metrics_enabled", _O, bool, "no metrics", invert=True),
    _Option("--disable-logging", "logging_enabled", _O, bool, "no event logs", invert=True),
    _Option(
        "--enable-tracing", "tracing_enabled", _O, bool, "export spans (needs --otlp-endpoint)"
    ),
    _Option("--otlp-endpoint", "otlp_endpoint", _O, str, "OTLP collector URL for traces"),
    _Option("--otlp-protocol", "otlp_protocol", _O, str, "OTLP transport: grpc or http"),
    _Option(
        "--prometheus-host", "prometheus_host", _O, str, "metrics endpoint host (default 127.0.0.1)"
    ),
    _Option(
        "--prometheus-port", "prometheus_port", _O, int, "metrics endpoint port (9464; 0 = off)"
    ),
    _Option(
        "--event-bus-capacity",
        "event_bus_capacity",
        _O,
        int,
        "events held before new ones are dropped (default 10000)",
    ),
    _Option(
        "--l0-sample-rate",
        "l0_sample_rate",
        _O,
        float,
        "fraction of GPU blocks whose lifecycle is tracked, in [0, 1] (default 0.01)",
    ),
    _Option("--sample-seed", "sample_seed", _O, int, "seed of the block sampler (default 0)"),
    _Option("--log-level", "log_level", _O, str, "debug, info, warning, error or critical"),
    _Option("--log-format", "log_format", _O, str, "json or console (default json)"),
    _Option(
        "--tracing-ttl-s",
        "tracing_ttl_s",
        _O,
        float,
        "drop an unfinished span after this many seconds, 1..86400 (default 300)",
    ),
    _Option(
        "--export-interval-s",
        "export_interval_s",
        _O,
        float,
        "seconds between metric exports, 0.1..86400 (default 5)",
    ),
    _Option(
        "--max-label-values",
        "max_label_values",
        _O,
        int,
        "distinct model names / instance ids per metric label before new ones count as"
        " 'other', 1..65536 (default 256)",
    ),
    _Option(
        "--event-log",
        "event_log_dir",
        _O,
        str,
        "keep every event in segment files in this directory, for kvflow replay and kvflow"
        " whatif (docs/EVENTLOG.md); off when not given",
    ),
    _Option(
        "--event-log-max-mb",
        "event_log_max_mb",
        _O,
        float,
        "total size of the event log in MiB; the oldest segments are deleted first (default 1024)",
    ),
    _Option(
        "--event-log-segment-mb",
        "event_log_segment_mb",
        _O,
        float,
        "size at which the event log starts a new segment, in MiB, 0.0625..4096 (default 64)",
    ),
    _Option(
        "--event-log-fsync",
        "event_log_fsync",
        _O,
        str,
        "when the event log fsyncs: none, segment (when a segment closes; default) or batch",
    ),
)
_BY_KEY = {opt.key: opt for opt in OPTIONS}
#: the longest `kvflow status --timeout-s` waits (a larger value is a typo, not a wish)
STATUS_MAX_TIMEOUT_S = 3600.0


class UsageError(Exception):
    """A bad setting; its message is the one line printed before exiting with status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvflow server",
        description="Run the kvflow KV-cache server: engines connect with KVFlowClient.",
        epilog=(
            "Settings also come from a TOML file (--config; keys are the flag names with"
            " '_' for '-', e.g. l1_size_gb = 8, disable_metrics = true) and from"
            " environment variables KVFLOW_<KEY> (e.g. KVFLOW_PORT=6000). Flags win over"
            " the file, the file over the environment. SIGINT/SIGTERM stop the server"
            " after in-flight transfers finish; a second signal stops waiting."
        ),
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file of settings")
    for opt in OPTIONS:
        if opt.kind is bool:
            parser.add_argument(opt.flag, action="store_true", help=opt.help)
        else:
            metavar = {int: "N", float: "X", str: "TEXT", list: "PATH[,PATH...]"}[opt.kind]
            kind = _split if opt.kind is list else opt.kind
            parser.add_argument(opt.flag, type=kind, metavar=metavar, help=opt.help)
    return parser


def _split(text: str) -> list[str]:
    """A comma-separated list flag's items (blanks around commas ignored)."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _from_text(opt: _Option, text: str, source: str) -> Any:
    """Read an environment variable's value for `opt`."""
    if opt.kind is list:
        return _split(text)
    if opt.kind is bool:
        low = text.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise UsageError(f"{source} ({opt.flag}) must be one of {'/'.join(_TRUE + _FALSE)}")
    try:
        return opt.kind(text)
    except ValueError:
        raise UsageError(
            f"{source} ({opt.flag}): invalid {opt.kind.__name__} value {text!r}"
        ) from None


def _from_toml(opt: _Option, value: Any, source: str) -> Any:
    """Check a config file value's type for `opt` (ints are accepted where floats are)."""
    if opt.kind is list and isinstance(value, str):
        value = _split(value)
    if opt.kind is list and isinstance(value, list) and not all(isinstance(v, str) for v in value):
        raise UsageError(f"{source}: {opt.key} ({opt.flag}) must list strings, got {value!r}")
    ok = isinstance(value, opt.kind) and not (opt.kind is int and isinstance(value, bool))
    if opt.kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        shown = "a value not shown (it may hold a secret)" if opt.secret else repr(value)
        raise UsageError(
            f"{source}: {opt.key} ({opt.flag}) must be a {opt.kind.__name__}, got {shown}"
        )
    return value


def _read_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path}: not valid TOML: {exc}") from None
    values = {}
    for key, value in data.items():
        opt = _BY_KEY.get(key.replace("-", "_"))
        if opt is None:
            raise UsageError(f"--config {path}: unknown setting {key!r}")
        values[opt.key] = _from_toml(opt, value, f"--config {path}")
    return values


def resolve(argv: list[str], environ: dict[str, str] | None = None) -> ServerConfig:
    """The ServerConfig `argv` and the environment describe; UsageError if anything is bad."""
    args = vars(build_parser().parse_args(argv))
    env = os.environ if environ is None else environ
    path = args.pop("config", None) or env.get(ENV_PREFIX + "CONFIG")
    from_file = _read_config_file(path) if path else {}
    fields: dict[str, dict[str, Any]] = {_S: {}, _O: {}}
    for opt in OPTIONS:
        if opt.key in args:
            value = args[opt.key]
        elif opt.key in from_file:
            value = from_file[opt.key]
        elif opt.env in env:
            value = _from_text(opt, env[opt.env], opt.env)
        else:
            continue
        if opt.invert:
            if not value:
                continue  # `disable_x = false` means: keep the default
            value = False
        fields[opt.section][opt.field] = tuple(value) if opt.kind is list else value
    try:
        observability = ObservabilityConfig(**fields[_O])
        return ServerConfig(**fields[_S], observability=observability)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _serve(config: ServerConfig) -> int:
    from kvflow.core.server.front import ShardedServer
    from kvflow.core.server.server import KVFlowServer

    server: KVFlowServer | ShardedServer
    if config.shards > 1:  # the front has no event pipeline to render its lines
        obs = config.observability
        logging_setup: LoggingSetup | None = configure_logging(obs.log_level, obs.log_format)
    else:
        logging_setup = configure_server_logging(config.observability)
    # the process is the server's own: its ranks' threads take the GIL in turns this often
    sys.setswitchinterval(config.switch_interval_ms / 1e3)
    try:
        server = ShardedServer(config) if config.shards > 1 else KVFlowServer(config)
    except (OSError, ValueError, RuntimeError) as exc:  # a port in use; an L2 path refused
        print(f"kvflow server: error: {exc}", file=sys.stderr)
        if logging_setup is not None:
            logging_setup.close()
        return 2 if isinstance(exc, ValueError) else 1

    def on_signal(signum: int, frame: FrameType | None) -> None:
        server.request_stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        server.serve_forever()
    finally:
        if logging_setup is not None:
            logging_setup.close()
    failed = server.failed if isinstance(server, ShardedServer) else None
    if failed:
        print(f"kvflow server: error: {failed}", file=sys.stderr)
        return 1
    return 0


def _status(argv: list[str]) -> int:
    parser = _Parser(prog="kvflow status", description="Print a running kvflow server's status.")
    parser.add_argument(
        "--endpoint", default="tcp://127.0.0.1:5555", help="the server (tcp://HOST:PORT)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=5.0, metavar="X", help="seconds to wait (default 5)"
    )
    parser.add_argument(
        "--curve-server-key", metavar="FILE", help="the server's CURVE public key (NAME.key)"
    )
    parser.add_argument(
        "--curve-key", metavar="FILE", help="this client's CURVE key pair (NAME.key_secret)"
    )
    args = parser.parse_args(argv)
    from kvflow.core.errors import KVFlowError
    from kvflow.core.server.client import KVFlowClient

    if not (math.isfinite(args.timeout_s) and 0 < args.timeout_s <= STATUS_MAX_TIMEOUT_S):
        raise UsageError(
            f"--timeout-s must be a finite number in (0, {STATUS_MAX_TIMEOUT_S:g}] seconds,"
            f" got {args.timeout_s!r}"
        )
    unresolved = _unresolvable_host(args.endpoint)
    if unresolved is not None:
        print(f"kvflow status: error: {unresolved}", file=sys.stderr)
        return 1
    curve = {"curve_server_key": args.curve_server_key, "curve_key": args.curve_key}
    if (args.curve_server_key is None) != (args.curve_key is None):
        raise UsageError("--curve-server-key and --curve-key go together")
    try:
        client = KVFlowClient(args.endpoint, timeout_s=args.timeout_s, **curve)
    except ValueError as exc:
        message = str(exc)
        flagged = message.startswith(("endpoint", "timeout_s"))  # name the flag, not the kwarg
        raise UsageError(f"--{message}" if flagged else message) from None
    try:
        status = client.status()
    except KVFlowError as exc:
        print(f"kvflow status: error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(status, indent=2, sort_keys=True, default=str))
    return 0


def _unresolvable_host(endpoint: str) -> str | None:
    """Why the host of a tcp:// `endpoint` cannot be resolved, or None if it can (or is not tcp).

    ZeroMQ resolves a connect's host in the background and retries for ever, so a
    typo in the host would otherwise only show as a timeout ("is it running?").
    """
    written = endpoint_host(endpoint)
    if written is None:
        return None  # not tcp, or malformed: the client reports it
    host = bare_host(written)
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve host {host!r} of --endpoint {endpoint}: {exc.strerror}"
    except (UnicodeError, ValueError):
        return f"--endpoint {endpoint}: {host!r} is not a valid host name"
    return None


def _keygen(argv: list[str]) -> int:
    parser = _Parser(
        prog="kvflow keygen",
        description="Write a CURVE key pair: NAME.key (public: give it to the other side) and"
        " NAME.key_secret (private, mode 0600). Put clients' NAME.key files in the server's"
        " --curve-authorized-keys directory; clients take the server's NAME.key.",
    )
    parser.add_argument("name", help="the pair's file name, e.g. server or client-a")
    parser.add_argument(
        "--dir", default=".", metavar="DIR", help="where to write the files (default: here)"
    )
    args = parser.parse_args(argv)
    from kvflow.core.server.curve import generate

    try:
        public, secret = generate(args.dir, args.name)
    except (OSError, ValueError) as exc:
        print(f"kvflow keygen: error: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def main(command: str, argv: list[str]) -> int:
    """Run `kvflow server`, `kvflow status` or `kvflow keygen`; returns the exit status."""
    try:
        if command == "status":
            return _status(argv)
        if command == "keygen":
            return _keygen(argv)
        return _serve(resolve(argv))
    except UsageError as exc:
        print(f"kvflow {command}: error: {exc}", file=sys.stderr)
        return 2
