"""Server and observability configuration, validated at construction.

Every invalid value raises ValueError naming the field (as its CLI flag) and the
allowed values, so the CLI can print one line and exit with status 2.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from kvflow.core.tiers.quota import parse_quotas, salt_label

LOG_FORMATS = ("json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
OTLP_PROTOCOLS = ("grpc", "http")
EVENT_LOG_FSYNC = ("none", "segment", "batch")
EVENT_LOG_MAX_MB_RANGE = (1.0, float(1 << 30))  # 1 MiB .. 1 PiB
EVENT_LOG_SEGMENT_MB_RANGE = (0.0625, 4096.0)  # 64 KiB .. 4 GiB
L2_DISK_SHARDINGS = ("by_gpu",)
REDIS_SCHEMES = ("redis://", "rediss://")
#: fields whose values are credentials: never printed, logged or shown by status
SECRET_FIELDS = ("l2_redis_username", "l2_redis_password")
#: most rank shards of one server (processes; one per GPU is the point)
MAX_SHARDS = 64
#: bounds of the float settings (inclusive); sizes are in GiB (2**30 bytes) and are > 0
MAX_SIZE_GIB = 1 << 20  # 1 PiB: above any machine's memory or disk, far below an overflow
HEARTBEAT_TIMEOUT_S_RANGE = (0.5, 86400.0)  # the client beats every quarter of it
MAX_MESSAGE_MB_RANGE = (0.0625, 2048.0)  # 64 KiB .. 2 GiB
SWITCH_INTERVAL_MS_RANGE = (0.05, 100.0)  # --switch-interval-ms (CPython's default is 5)
L2_TIMEOUT_S_RANGE = (0.001, 600.0)  # --l2-timeout-s and --l2-redis-timeout-s
L2_BACKLOG_WAIT_S_RANGE = (0.0, 600.0)  # --l2-backlog-wait-s (0: drop at once, as before)
TRACING_TTL_S_RANGE = (1.0, 86400.0)
EXPORT_INTERVAL_S_RANGE = (0.1, 86400.0)
#: share of L1 that pending L2 write-throughs may pin: the rest stays evictable for stores
#: (the engine's write-through enforces it; the demo's sizing and whatif model it)
BACKLOG_SHARE = 0.5
#: share of L1 one prefetch may fill: a prefix larger than that is prefetched up to it and
#: the rest loads at retrieve (the engine's tiering enforces it; whatif models it)
PREFETCH_SHARE = 0.5
MAX_LABEL_VALUES = 65536  # per label: far above real model counts, small enough for /metrics


def _check_range(
    flag: str, value: float, low: float, high: float, unit: str, *, low_open: bool = False
) -> None:
    """Refuse anything but a finite number in [low, high] ((low, high] with `low_open`).

    Non-finite and absurd values are refused here, before they can overflow an
    integer conversion or stall a timer (e.g. a heartbeat timeout of inf or 1e-6).
    """
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and value <= high
    )
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:.10g}, {high:.10g}]"
        raise ValueError(f"{flag} must be a finite number in {bounds} {unit}, got {value!r}")


def _check_port(flag: str, value: int) -> None:
    if not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"{flag} must be an integer in 0..65535, got {value!r}")


@dataclass(frozen=True)
class ObservabilityConfig:
    """What the event pipeline publishes and where its output goes (docs/SERVER.md, Settings)."""

    enabled: bool = True
    metrics_enabled: bool = True
    logging_enabled: bool = True
    tracing_enabled: bool = False
    otlp_endpoint: str | None = None
    otlp_protocol: str = "grpc"
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int = 9464
    event_bus_capacity: int = 10000
    l0_sample_rate: float = 0.01
    sample_seed: int = 0
    log_level: str = "info"
    log_format: str = "json"
    tracing_ttl_s: float = 300.0
    export_interval_s: float = 5.0
    #: distinct client-chosen values (model names, instance ids) per metric label;
    #: later new ones are counted under "other" (bounds /metrics against hostile clients)
    max_label_values: int = 256
    #: the durable event log (docs/EVENTLOG.md): its directory (None = off), total size
    #: (oldest segments deleted first), segment size and fsync policy
    event_log_dir: str | None = None
    event_log_max_mb: float = 1024.0
    event_log_segment_mb: float = 64.0
    event_log_fsync: str = "segment"

    def __post_init__(self) -> None:
        self._check_event_log()
        if self.tracing_enabled and not self.otlp_endpoint:
            raise ValueError("--enable-tracing requires --otlp-endpoint (an OTLP collector URL)")
        if not isinstance(self.l0_sample_rate, (int, float)) or not (
            0.0 <= self.l0_sample_rate <= 1.0
        ):
            raise ValueError(
                f"--l0-sample-rate must be a number in [0, 1], got {self.l0_sample_rate!r}"
            )
        if not isinstance(self.event_bus_capacity, int) or self.event_bus_capacity < 1:
            raise ValueError(
                f"--event-bus-capacity must be an integer >= 1, got {self.event_bus_capacity!r}"
            )
        _check_port("--prometheus-port", self.prometheus_port)
        mlv = self.max_label_values
        if isinstance(mlv, bool) or not isinstance(mlv, int) or not 1 <= mlv <= MAX_LABEL_VALUES:
            raise ValueError(
                f"--max-label-values must be an integer in 1..{MAX_LABEL_VALUES}, got {mlv!r}"
            )
        if not isinstance(self.sample_seed, int):
            raise ValueError(f"--sample-seed must be an integer, got {self.sample_seed!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.log_format not in LOG_FORMATS:
            raise ValueError(
                f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}"
            )
        if self.otlp_protocol not in OTLP_PROTOCOLS:
            allowed = ", ".join(OTLP_PROTOCOLS)
            raise ValueError(
                f"--otlp-protocol must be one of {allowed}, got {self.otlp_protocol!r}"
            )
        _check_range("--tracing-ttl-s", self.tracing_ttl_s, *TRACING_TTL_S_RANGE, "seconds")
        _check_range(
            "--export-interval-s", self.export_interval_s, *EXPORT_INTERVAL_S_RANGE, "seconds"
        )

    def _check_event_log(self) -> None:
        if self.event_log_dir is not None and not (
            isinstance(self.event_log_dir, str) and self.event_log_dir
        ):
            raise ValueError(f"--event-log must be a directory path, got {self.event_log_dir!r}")
        _check_range("--event-log-max-mb", self.event_log_max_mb, *EVENT_LOG_MAX_MB_RANGE, "MiB")
        _check_range(
            "--event-log-segment-mb", self.event_log_segment_mb, *EVENT_LOG_SEGMENT_MB_RANGE, "MiB"
        )
        if self.event_log_fsync not in EVENT_LOG_FSYNC:
            allowed = ", ".join(EVENT_LOG_FSYNC)
            raise ValueError(
                f"--event-log-fsync must be one of {allowed}, got {self.event_log_fsync!r}"
            )


@dataclass(frozen=True)
class ServerConfig:
    """The whole server's settings; `observability` configures the event pipeline."""

    host: str = "127.0.0.1"
    port: int = 5555
    chunk_size: int = 256
    l1_size_gb: float = 4.0
    #: threads that pin L1 in the background from start-up (0 = pin on demand, in the
    #: store that needs more memory), or fault it in with l1_prefault; 4 pinned 32 GiB on
    #: an H200 in 2.3 s (2: 2.5-7.4 s, 1: 4.4-5.5 s) and slowed the stores made meanwhile least
    l1_pin_threads: int = 4
    #: on a host without CUDA, fault L1's memory in ahead of demand on those threads (a
    #: store that first touches fresh memory runs at 0.2-2 GB/s on a VM); CUDA pins ahead
    l1_prefault: bool = False
    heartbeat_timeout_s: float = 30.0
    max_message_mb: float = 64.0
    #: registered instances the server accepts at once (each holds mapped KV memory)
    max_instances: int = 64
    #: the `kvflow server` process's thread switch interval (sys.setswitchinterval): how
    #: long a thread waiting for the GIL waits before the running one must hand it over.
    #: A rank's thread that released it for a moment (a lock, a short numpy call) waits up
    #: to this long to take it back while another rank's thread runs Python: two ranks'
    #: stores scaled 1.54x at CPython's 5 ms, 1.69-1.71x at 0.2, 1.74-1.79x at 0.05 and no
    #: better at 0.02 or 0.01 (docs/SERVER.md, Many GPUs)
    switch_interval_ms: float = 0.05
    #: chunk hashes the KV-event replay log keeps for subscribers (0 = KV events off)
    kv_events_chunks: int = 1 << 16
    #: stored chunks the blend index keeps findable by their own tokens (docs/BLEND.md;
    #: about 400 bytes each, plus a fixed 16 MiB filter once the first chunk is indexed);
    #: 0 = blend off: stores index nothing (the index is nearly half a store's host work)
    blend_index_chunks: int = 1 << 18
    #: L2 on local disk: directories (one or more; empty = no disk tier) and their total size
    l2_disk_paths: tuple[str, ...] = ()
    l2_disk_size_gb: float = 64.0
    l2_disk_sharding: str = "by_gpu"
    #: open disk objects with O_DIRECT where the filesystem allows it (else buffered I/O)
    l2_disk_direct_io: bool = False
    #: keep chunks loaded from L2 in L1 (prefix-continuous ones only); off = L1 only stages them
    l2_write_back: bool = True
    #: the longest the request path waits on an L2 tier (a lookup's question, a retrieve's load)
    l2_timeout_s: float = 2.0
    #: the longest a store waits for L2 writes to catch up (backlog full, or L1 full of
    #: chunks still being written) before the chunks past that point skip L2, counted
    l2_backlog_wait_s: float = 10.0
    #: L2 on Redis: redis:// or rediss:// URL (None = no Redis tier); credentials may come
    #: from it, from the two fields below or from KVFLOW_REDIS_* variables (docs/REDIS.md)
    l2_redis_url: str | None = field(default=None, repr=False)
    l2_redis_cluster: bool = False
    l2_redis_key_prefix: str = "kvflow:"
    l2_redis_username: str | None = field(default=None, repr=False)
    l2_redis_password: str | None = field(default=None, repr=False)
    #: socket connect/read timeout of each Redis call, and connections (= I/O threads)
    l2_redis_timeout_s: float = 1.0
    l2_redis_pool_size: int = 8
    #: CURVE: the server's NAME.key_secret file and the directory of authorised client
    #: NAME.key files (both or neither); off, a non-loopback --host needs insecure_listen
    curve_secret_key: str | None = None
    curve_authorized_keys: str | None = None
    insecure_listen: bool = False
    #: CURVE: directory of the NAME.key files of clients allowed admin operations (CURVE
    #: off: loopback clients are admins); re-read when it changes
    admin_keys: str | None = None
    #: the /healthz and /readyz HTTP endpoint (port 0 = off)
    probe_host: str = "127.0.0.1"
    probe_port: int = 0
    #: L1 byte limits per tenant: entries salt:NAME=GIB or model:NAME=GIB
    l1_quotas: tuple[str, ...] = ()
    #: processes serving the ranks behind this one endpoint: shard i holds every rank r
    #: with r % shards == i (1 = one process; docs/SERVER.md, Shards)
    shards: int = 1
    #: a shard's own socket, set by its front: an ipc:// path in the front's private
    #: directory (None: listen on --host/--port)
    shard_endpoint: str | None = None
    #: a shard's front authenticates clients with CURVE: client ids start with their key
    shard_keyed_clients: bool = False
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    def __post_init__(self) -> None:
        _check_port("--port", self.port)
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"--chunk-size must be a positive integer, got {self.chunk_size!r}")
        _check_range("--l1-size-gb", self.l1_size_gb, 0, MAX_SIZE_GIB, "GiB", low_open=True)
        pt = self.l1_pin_threads
        if isinstance(pt, bool) or not isinstance(pt, int) or not 0 <= pt <= 64:
            raise ValueError(f"--l1-pin-threads must be an integer in [0, 64], got {pt!r}")
        if not isinstance(self.l1_prefault, bool):
            raise ValueError(f"--l1-prefault must be true or false, got {self.l1_prefault!r}")
        _check_range(
            "--heartbeat-timeout-s", self.heartbeat_timeout_s, *HEARTBEAT_TIMEOUT_S_RANGE, "seconds"
        )
        _check_range("--max-message-mb", self.max_message_mb, *MAX_MESSAGE_MB_RANGE, "MiB")
        _check_range(
            "--switch-interval-ms", self.switch_interval_ms, *SWITCH_INTERVAL_MS_RANGE, "ms"
        )
        kc = self.kv_events_chunks
        if isinstance(kc, bool) or not isinstance(kc, int) or not 0 <= kc <= 1 << 26:
            raise ValueError(f"--kv-events-chunks must be an integer in [0, {1 << 26}], got {kc!r}")
        bc = self.blend_index_chunks
        if isinstance(bc, bool) or not isinstance(bc, int) or not 0 <= bc <= 1 << 26:
            raise ValueError(
                f"--blend-index-chunks must be an integer in [0, {1 << 26}], got {bc!r}"
            )
        mi = self.max_instances
        if isinstance(mi, bool) or not isinstance(mi, int) or not 1 <= mi <= 4096:
            raise ValueError(f"--max-instances must be an integer in 1..4096, got {mi!r}")
        self._check_l2()
        self._check_operations()
        self._check_shards()
        if (self.curve_secret_key is None) != (self.curve_authorized_keys is None):
            raise ValueError(
                "--curve-secret-key and --curve-authorized-keys go together: give both"
                " (the server's key pair and the directory of authorised client keys) or neither"
            )

    def _check_shards(self) -> None:
        """The shard count, and a shard's socket."""
        n = self.shards
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SHARDS:
            raise ValueError(f"--shards must be an integer in 1..{MAX_SHARDS}, got {n!r}")
        where = self.shard_endpoint
        if where is not None and (not isinstance(where, str) or not where.startswith("ipc://")):
            raise ValueError(f"a shard listens on an ipc:// endpoint, got {where!r}")

    def _check_operations(self) -> None:
        """The probe endpoint, the admin keys and the tenant quotas."""
        _check_port("--probe-port", self.probe_port)
        if not isinstance(self.probe_host, str) or not self.probe_host:
            raise ValueError(
                f"--probe-host must be a host name or address, got {self.probe_host!r}"
            )
        if self.admin_keys is not None:
            if not isinstance(self.admin_keys, str) or not self.admin_keys:
                raise ValueError(f"--admin-keys must be a directory, got {self.admin_keys!r}")
            if self.curve_secret_key is None:
                raise ValueError(
                    "--admin-keys lists CURVE keys: it needs --curve-secret-key and"
                    " --curve-authorized-keys (without CURVE, loopback clients are admins)"
                )
        quotas = self.l1_quotas
        if isinstance(quotas, str) or not all(isinstance(q, str) for q in quotas):
            raise ValueError("--l1-quota must be a list of salt:NAME=GIB or model:NAME=GIB")
        parse_quotas(quotas)

    @property
    def curve(self) -> bool:
        """Whether clients must authenticate with CURVE."""
        return self.curve_secret_key is not None

    def _check_l2(self) -> None:
        paths = self.l2_disk_paths
        if isinstance(paths, str) or not all(isinstance(p, str) and p for p in paths):
            raise ValueError(f"--l2-disk must be a list of directory paths, got {paths!r}")
        if len(set(paths)) != len(paths):
            raise ValueError(f"--l2-disk lists a path twice: {', '.join(paths)}")
        _check_range(
            "--l2-disk-size-gb", self.l2_disk_size_gb, 0, MAX_SIZE_GIB, "GiB", low_open=True
        )
        if self.l2_disk_sharding not in L2_DISK_SHARDINGS:
            allowed = ", ".join(L2_DISK_SHARDINGS)
            raise ValueError(
                f"--l2-disk-sharding must be one of {allowed}, got {self.l2_disk_sharding!r}"
            )
        _check_range("--l2-timeout-s", self.l2_timeout_s, *L2_TIMEOUT_S_RANGE, "seconds")
        _check_range(
            "--l2-backlog-wait-s", self.l2_backlog_wait_s, *L2_BACKLOG_WAIT_S_RANGE, "seconds"
        )
        url = self.l2_redis_url
        if url is not None and not (isinstance(url, str) and url.startswith(REDIS_SCHEMES)):
            # the value may hold a password: name the flag and the schemes, never the value
            raise ValueError("--l2-redis must be a redis:// or rediss:// URL")
        if not isinstance(self.l2_redis_key_prefix, str) or not self.l2_redis_key_prefix:
            raise ValueError(
                f"--l2-redis-key-prefix must be a non-empty string, got {self.l2_redis_key_prefix!r}"
            )
        _check_range(
            "--l2-redis-timeout-s", self.l2_redis_timeout_s, *L2_TIMEOUT_S_RANGE, "seconds"
        )
        pool = self.l2_redis_pool_size
        if isinstance(pool, bool) or not isinstance(pool, int) or not 1 <= pool <= 256:
            raise ValueError(f"--l2-redis-pool-size must be an integer in 1..256, got {pool!r}")
        for flag, value in (("--l2-redis-username", self.l2_redis_username),
                            ("--l2-redis-password", self.l2_redis_password)):  # fmt: skip
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{flag} must be a string")

    def public_dict(self) -> dict[str, Any]:
        """The settings as a dict with every credential replaced by "***" (for status)."""
        out = dataclasses.asdict(self)
        for name in SECRET_FIELDS:
            if out[name] is not None:
                out[name] = "***"
        if self.l2_redis_url is not None:
            out["l2_redis_url"] = redact_url(self.l2_redis_url)
        out["l1_quotas"] = [
            f"{kind}:{salt_label(name) if kind == 'salt' else name}={nbytes / (1 << 30):g}"
            for (kind, name), nbytes in parse_quotas(self.l1_quotas).items()
        ]
        return out


def redact_url(url: str) -> str:
    """The URL with any user and password replaced by "***"."""
    scheme, sep, rest = url.partition("://")
    _, at, hostpart = rest.rpartition("@")
    return f"{scheme}{sep}***@{hostpart}" if at else url
