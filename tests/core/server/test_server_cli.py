"""`kvflow server` / `kvflow status` command lines: settings, precedence, errors, signals."""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvflow.core import KVFlowClient
from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.server.cli import OPTIONS, UsageError, _configure_logging, main, resolve


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvflow.toml"
    path.write_text(text)
    return str(path)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_no_settings_gives_the_default_config() -> None:
    """With no flags, file or environment, the config is ServerConfig()."""
    assert resolve([], {}) == ServerConfig()


def test_every_flag_reaches_its_field() -> None:
    """Each flag of docs/SERVER.md, Settings, sets its config field."""
    config = resolve(
        [
            *("--host", "0.0.0.0", "--port", "6001", "--chunk-size", "512"),
            *("--l1-size-gb", "1.5", "--heartbeat-timeout-s", "3", "--max-message-mb", "8"),
            *("--disable-metrics", "--disable-logging", "--enable-tracing"),
            *("--otlp-endpoint", "http://collector:4317", "--otlp-protocol", "http"),
            *("--prometheus-host", "0.0.0.0", "--prometheus-port", "0"),
            *("--event-bus-capacity", "50", "--l0-sample-rate", "0.5", "--sample-seed", "9"),
            *("--log-level", "debug", "--log-format", "console"),
            *("--tracing-ttl-s", "60", "--export-interval-s", "1"),
        ],
        {},
    )
    obs = config.observability
    assert (config.host, config.port, config.chunk_size, config.l1_size_gb) == (
        "0.0.0.0",
        6001,
        512,
        1.5,
    )
    assert (config.heartbeat_timeout_s, config.max_message_mb) == (3.0, 8.0)
    assert (obs.enabled, obs.metrics_enabled, obs.logging_enabled, obs.tracing_enabled) == (
        True,
        False,
        False,
        True,
    )
    assert (obs.otlp_endpoint, obs.otlp_protocol) == ("http://collector:4317", "http")
    assert (obs.prometheus_host, obs.prometheus_port, obs.event_bus_capacity) == ("0.0.0.0", 0, 50)
    assert (obs.l0_sample_rate, obs.sample_seed, obs.log_level, obs.log_format) == (
        0.5,
        9,
        "debug",
        "console",
    )
    assert (obs.tracing_ttl_s, obs.export_interval_s) == (60.0, 1.0)
    assert resolve(["--disable-observability"], {}).observability.enabled is False


def test_flags_beat_the_file_and_the_file_beats_the_environment(tmp_path: Path) -> None:
    """Precedence: flag > --config file > KVFLOW_<FLAG> environment variable > default."""
    path = _toml(tmp_path, "port = 7000\nl0-sample-rate = 0.25\ndisable_metrics = true\n")
    env = {"KVFLOW_PORT": "6000", "KVFLOW_CHUNK_SIZE": "128", "KVFLOW_L0_SAMPLE_RATE": "0.75"}
    config = resolve(["--config", path, "--port", "8000"], env)
    assert config.port == 8000  # flag
    assert config.observability.l0_sample_rate == 0.25  # file
    assert config.observability.metrics_enabled is False  # file
    assert config.chunk_size == 128  # environment fills the gap
    assert resolve(["--config", path], env).port == 7000
    assert resolve([], env).port == 6000
    assert resolve([], {"KVFLOW_CONFIG": path}).port == 7000


def test_environment_switches_read_yes_and_no() -> None:
    """KVFLOW_DISABLE_METRICS=1 disables metrics; =0 keeps the default."""
    assert resolve([], {"KVFLOW_DISABLE_METRICS": "1"}).observability.metrics_enabled is False
    assert resolve([], {"KVFLOW_DISABLE_METRICS": "off"}).observability.metrics_enabled is True


@pytest.mark.parametrize(
    "argv, env, flag",
    [
        (["--l0-sample-rate", "1.5"], {}, "--l0-sample-rate"),
        (["--enable-tracing"], {}, "--enable-tracing"),
        (["--event-bus-capacity", "0"], {}, "--event-bus-capacity"),
        (["--port", "abc"], {}, "--port"),
        (["--port", "70000"], {}, "--port"),
        (["--prometheus-port", "-1"], {}, "--prometheus-port"),
        (["--log-format", "xml"], {}, "--log-format"),
        (["--log-level", "loud"], {}, "--log-level"),
        (["--chunk-size", "0"], {}, "--chunk-size"),
        (["--l1-size-gb", "0"], {}, "--l1-size-gb"),
        (["--heartbeat-timeout-s", "0"], {}, "--heartbeat-timeout-s"),
        (["--max-message-mb", "-1"], {}, "--max-message-mb"),
        (["--l1-size-gb", "inf"], {}, "--l1-size-gb must be a finite number in (0, 1048576] GiB"),
        (["--l1-size-gb", "nan"], {}, "--l1-size-gb"),
        (["--l2-disk-size-gb", "1e300"], {}, "--l2-disk-size-gb"),
        (["--max-message-mb", "inf"], {}, "--max-message-mb"),
        (["--l2-timeout-s", "inf"], {}, "--l2-timeout-s"),
        (["--l2-redis-timeout-s", "1e300"], {}, "--l2-redis-timeout-s"),
        (["--tracing-ttl-s", "inf"], {}, "--tracing-ttl-s"),
        (["--export-interval-s", "1e-9"], {}, "--export-interval-s"),
        ([], {"KVFLOW_L1_SIZE_GB": "inf"}, "--l1-size-gb"),
        ([], {"KVFLOW_HEARTBEAT_TIMEOUT_S": "1e300"}, "--heartbeat-timeout-s"),
        (["--bogus"], {}, "--bogus"),
        ([], {"KVFLOW_L0_SAMPLE_RATE": "lots"}, "KVFLOW_L0_SAMPLE_RATE (--l0-sample-rate)"),
        ([], {"KVFLOW_DISABLE_LOGGING": "maybe"}, "KVFLOW_DISABLE_LOGGING (--disable-logging)"),
        (["--config", "/nonexistent/kvflow.toml"], {}, "--config"),
    ],
)
def test_invalid_settings_exit_2_with_one_line_naming_the_flag(
    argv: list[str],
    env: dict[str, str],
    flag: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every bad value exits with status 2 and a single stderr line naming its flag."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main("server", argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvflow server: error:")
    assert flag in err


@pytest.mark.parametrize("value", ["inf", "1e300", "1e-6", "nan", "0.4", "86401"])
def test_heartbeat_timeout_outside_its_range_names_the_range(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A heartbeat timeout of inf/1e300 (kills the clients' heartbeat thread) or 1e-6
    (reaps every instance as it registers) is refused with the range, exit 2."""
    assert main("server", ["--heartbeat-timeout-s", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--heartbeat-timeout-s must be a finite number in [0.5, 86400] seconds" in err


def test_non_finite_values_in_a_config_file_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TOML can spell inf and nan: they are refused like the flag's value."""
    path = _toml(tmp_path, "l1_size_gb = inf\n")
    assert main("server", ["--config", path]) == 2
    assert "--l1-size-gb must be a finite number" in capsys.readouterr().err
    path = _toml(tmp_path, "heartbeat_timeout_s = nan\n")
    assert main("server", ["--config", path]) == 2
    assert "--heartbeat-timeout-s must be a finite number" in capsys.readouterr().err


def test_an_infinite_l1_size_exits_2_without_a_traceback() -> None:
    """`kvflow server --l1-size-gb inf` (a real process) prints one line, exit 2: it used
    to end in an OverflowError traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "server", "--port", "0", "--l1-size-gb", "inf"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "kvflow server: error: --l1-size-gb must be a finite number in (0, 1048576] GiB, got inf\n"
    )


@pytest.mark.parametrize(
    "text, match",
    [
        ("colour = 'blue'\n", "unknown setting 'colour'"),
        ("port = 'high'\n", r"port \(--port\) must be a int"),
        ("disable_metrics = 1\n", r"disable_metrics \(--disable-metrics\) must be a bool"),
        ("port = [\n", "not valid TOML"),
    ],
)
def test_bad_config_files_name_the_setting(tmp_path: Path, text: str, match: str) -> None:
    """Unknown keys, wrong types and broken TOML are usage errors naming the key."""
    with pytest.raises(UsageError, match=match):
        resolve(["--config", _toml(tmp_path, text)], {})


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvflow server --help` lists each flag with its explanation and exits 0."""
    with pytest.raises(SystemExit) as info:
        main("server", ["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for opt in OPTIONS:
        assert opt.flag in out
        assert opt.help.split()[0] in out
    assert "KVFLOW_" in out and "--config" in out


def test_a_busy_port_exits_1_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A port another program listens on is reported in one line, exit status 1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main("server", ["--port", str(port), "--disable-observability"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"127.0.0.1:{port}" in err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--endpoint", "localhost:5555"], "--endpoint"),
        (["--timeout-s", "0"], "--timeout-s"),
        (["--timeout-s", "inf"], "--timeout-s must be a finite number in (0, 3600] seconds"),
        (["--timeout-s", "nan"], "--timeout-s"),
    ],
)
def test_status_usage_errors(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvflow status` with a malformed endpoint or timeout exits 2 naming the flag."""
    assert main("status", argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err


def test_status_of_no_server_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvflow status` against a dead endpoint exits 1 with one line."""
    port = _free_port()
    assert main("status", ["--endpoint", f"tcp://127.0.0.1:{port}", "--timeout-s", "0.3"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"kvflow server at tcp://127.0.0.1:{port}" in err


def test_status_of_an_unresolvable_host_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvflow status` against a host name that does not resolve says that, at once,
    instead of waiting out the timeout and asking whether the server is running."""
    endpoint = "tcp://no-such-host.invalid:5555"
    started = time.monotonic()
    assert main("status", ["--endpoint", endpoint, "--timeout-s", "30"]) == 1
    assert time.monotonic() - started < 20
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"cannot resolve host 'no-such-host.invalid' of --endpoint {endpoint}" in err
    assert "is it running" not in err


def test_a_busy_prometheus_port_exits_1_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A second server on the metrics port of a first gets one line naming
    --prometheus-port and 0 to turn it off, without the errno twice, exit 1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        argv = ["--port", "0", "--l1-size-gb", "0.01", "--prometheus-port", str(busy)]
        assert main("server", [*argv, "--disable-logging"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvflow server: error:")
    assert f"the metrics endpoint cannot listen on 127.0.0.1:{busy} (Address already in use)" in err
    assert "--prometheus-port with a free port, or 0 to turn it off" in err
    assert "Errno" not in err


def test_server_log_lines_in_json_carry_tracebacks(capsys: pytest.CaptureFixture[str]) -> None:
    """With event logs off, the server's own JSON log lines (set up by the CLI) render an
    exception as its traceback text (issue 18, item 5)."""
    setup = _configure_logging(ObservabilityConfig(logging_enabled=False))
    assert setup is not None
    try:
        try:
            {}["missing"]
        except KeyError:
            logging.getLogger("kvflow.server").exception("internal error while serving a request")
    finally:
        setup.close()
    (line,) = [json.loads(text) for text in capsys.readouterr().err.splitlines()]
    assert line["event"] == "internal error while serving a request"
    assert line["exception"].startswith("Traceback (most recent call last):")
    assert "KeyError: 'missing'" in line["exception"] and "exc_info" not in line


def test_observed_server_serves_prometheus_and_stops_on_sigint(tmp_path: Path) -> None:
    """With observability on, the Prometheus endpoint answers with L1 and L2 (disk) gauges;
    SIGINT stops the server cleanly."""
    prom = _free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvflow.cli", "server", "--port", "0", "--l1-size-gb", "0.1"),
            *("--prometheus-port", str(prom), "--log-format", "console", "--disable-logging"),
            *("--l2-disk", str(tmp_path), "--l2-disk-size-gb", "0.5"),
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"listening on (tcp://\S+)", line)
        assert match, line
        with KVFlowClient(match.group(1), timeout_s=20) as client:
            assert client.lookup(list(range(600)), model_name="prom") == 0
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{prom}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, "no Prometheus endpoint"
                time.sleep(0.2)
        assert "kvflow_l1_capacity_bytes" in text
        assert 'kvflow_l2_capacity_bytes{tier="disk"} 5.36870912e+08' in text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert "kvflow server stopped" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_l2_settings_from_flags_file_and_environment(tmp_path: Path) -> None:
    """--l2-disk takes a comma list (TOML: a list), --no-l2-write-back switches write-back
    off, and a wrongly typed secret in the file is refused without echoing it."""
    config = resolve(["--l2-disk", "/a, /b", "--no-l2-write-back", "--l2-timeout-s", "0.5"], {})
    assert config.l2_disk_paths == ("/a", "/b") and config.l2_write_back is False
    assert config.l2_timeout_s == 0.5
    path = _toml(tmp_path, 'l2_disk = ["/x", "/y"]\nl2_redis = "redis://h:7000"\n')
    config = resolve(["--config", path], {"KVFLOW_NO_L2_WRITE_BACK": "1"})
    assert config.l2_disk_paths == ("/x", "/y") and config.l2_redis_url == "redis://h:7000"
    assert config.l2_write_back is False
    secret = "Zq9-not-for-errors"
    bad = _toml(tmp_path, f'l2_redis_password = ["{secret}"]\n')
    with pytest.raises(UsageError, match="--l2-redis-password") as exc:
        resolve(["--config", bad], {})
    assert secret not in str(exc.value)


def test_a_refused_disk_path_exits_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A disk path that is a regular file: one line naming --l2-disk, exit status 2."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = ["--port", "0", "--prometheus-port", "0", "--l2-disk", str(blocker)]
    assert main("server", argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--l2-disk" in err


def test_an_unresolvable_host_is_named_not_taken_for_an_interface(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--host that does not resolve: one line saying so (ZMQ alone says "No such device")."""
    argv = ["--host", "no-such-host.invalid", "--port", "0", "--prometheus-port", "0"]
    assert main("server", argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--host 'no-such-host.invalid' cannot be resolved" in err
