"""`kvflow server` / `kvflow status` / `kvflow keygen` command lines: settings, precedence, help,
errors, signals."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvflow.core import CacheEngine, KVFlowClient
from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.errors import KVFlowError
from kvflow.core.server.cli import OPTIONS, UsageError, main, resolve
from kvflow.core.server.server_logging import configure_server_logging
from kvflow.core.tiers.quota import salt_label
from tests.support.ops import ServerProcess, wait_for


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
            *("--switch-interval-ms", "0.5", "--shards", "4"),
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
    assert config.shards == 4
    assert config.switch_interval_ms == 0.5
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


def test_l1_prefault_from_flag_file_and_environment(tmp_path: Path) -> None:
    """--l1-prefault is off by default and turned on by the flag, the file or KVFLOW_L1_PREFAULT."""
    assert ServerConfig().l1_prefault is False
    assert resolve(["--l1-prefault"], {}).l1_prefault is True
    assert resolve(["--config", _toml(tmp_path, "l1-prefault = true\n")], {}).l1_prefault is True
    assert resolve([], {"KVFLOW_L1_PREFAULT": "yes"}).l1_prefault is True
    with pytest.raises(ValueError, match=r"^--l1-prefault must be true or false, got 1$"):
        ServerConfig(l1_prefault=1)  # type: ignore[arg-type]


def test_a_prefaulting_server_faults_l1_in_at_start_and_reports_it() -> None:
    """A real server without CUDA started with --l1-prefault makes all of L1 resident in
    the background, reports it in status (mode "prefault") and logs when it is done. (With
    CUDA the flag does nothing: L1 is pinned, which faults it in too; the test hides the
    GPUs of a GPU machine.)"""
    no_gpus = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with ServerProcess("--l1-size-gb", "0.25", "--l1-prefault", env=no_gpus) as srv:
        client = KVFlowClient(srv.endpoint)
        wait_for(lambda: not client.status()["l1_pinning"]["pinning"], what="L1 faulted in")
        state = client.status()["l1_pinning"]
        assert (state["mode"], state["failed"]) == ("prefault", None)
        assert state["pinned_bytes"] == state["target_bytes"] == 1 << 28
        client.close()
    assert "L1 faulted in: 0.2 GiB in " in srv.log()


def test_the_server_process_takes_the_gil_in_turns_at_its_switch_interval() -> None:
    """`kvflow server` sets its process's switch interval (0.05 ms unless told otherwise, not
    CPython's 5) and reports the one in force; a server built inside another process
    (tests, an embedding) leaves that process's interpreter alone."""
    with ServerProcess("--l1-size-gb", "0.25", "--switch-interval-ms", "0.5") as srv:
        client = KVFlowClient(srv.endpoint)
        assert client.status()["server"]["switch_interval_ms"] == 0.5
        client.close()
    with ServerProcess("--l1-size-gb", "0.25") as srv:
        client = KVFlowClient(srv.endpoint)
        assert client.status()["server"]["switch_interval_ms"] == 0.05
        client.close()
    from kvflow.core.server.server import KVFlowServer

    before = sys.getswitchinterval()
    server = KVFlowServer(ServerConfig(port=0, l1_size_gb=0.01, switch_interval_ms=50))
    try:
        assert sys.getswitchinterval() == before
        assert server.status()["server"]["switch_interval_ms"] == round(before * 1e3, 6)
    finally:
        server.close()


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
    setup = configure_server_logging(ObservabilityConfig(logging_enabled=False))
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
    flags = ["--l1-size-gb", "0.1", "--prometheus-port", str(prom), "--disable-logging"]
    with ServerProcess(*flags, "--l2-disk", str(tmp_path), "--l2-disk-size-gb", "0.5") as srv:
        with KVFlowClient(srv.endpoint, timeout_s=20) as client:
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
        assert srv.stop(signal.SIGINT) == 0
    assert "kvflow server stopped" in srv.log()


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
    assert err.count("\n") == 1
    assert re.fullmatch(
        r"kvflow server: error: cannot listen on no-such-host\.invalid:0: --host"
        r" 'no-such-host\.invalid' cannot be resolved \([^)]+\); give an IP address or a host"
        r" name of this machine\n",
        err,
    ), err


# -- help texts: what each command promises its user ------------------------------------------


def _help(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *cmd: str
) -> list[str]:
    """`kvflow CMD --help` (checks exit 0) as entries: the usage, each paragraph, and each
    flag with its help text, whitespace collapsed (argparse wraps at the terminal width)."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit) as info:
        main(cmd[0], [*cmd[1:], "--help"])
    assert info.value.code == 0
    entries: list[str] = []
    for line in capsys.readouterr().out.splitlines():
        text = " ".join(line.split())
        if entries and line.startswith(" " * 8) and not text.startswith("-"):
            entries[-1] += " " + text  # a long flag's help text comes on the next line
        elif text:
            entries.append(text)
    return entries


def test_server_help_states_precedence_value_kinds_and_shutdown(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvflow server --help` names the command, what each flag takes (N, X, TEXT, PATH list),
    each flag's full explanation, the config key spelling, the precedence and the signals."""
    out = _help(monkeypatch, capsys, "server")
    assert out[0].startswith("usage: kvflow server [-h] [--config FILE]")
    assert "Run the kvflow KV-cache server: engines connect with KVFlowClient." in out
    assert "--config FILE TOML file of settings" in out
    assert (
        "Settings also come from a TOML file (--config; keys are the flag names with '_' for"
        " '-', e.g. l1_size_gb = 8, disable_metrics = true) and from environment variables"
        " KVFLOW_<KEY> (e.g. KVFLOW_PORT=6000). Flags win over the file, the file over the"
        " environment. SIGINT/SIGTERM stop the server after in-flight transfers finish; a second"
        " signal stops waiting."
    ) in out
    metavars = {int: " N ", float: " X ", str: " TEXT ", list: " PATH[,PATH...] ", bool: " "}
    for opt in OPTIONS:
        assert f"{opt.flag}{metavars[opt.kind]}{' '.join(opt.help.split())}" in out


def test_status_help_names_its_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvflow status --help`: the endpoint form, the timeout's default and the CURVE files."""
    out = _help(monkeypatch, capsys, "status")
    assert out[0].startswith("usage: kvflow status [-h]")
    assert "Print a running kvflow server's status." in out
    assert "--endpoint ENDPOINT the server (tcp://HOST:PORT)" in out
    assert "--timeout-s X seconds to wait (default 5)" in out
    assert "--curve-server-key FILE the server's CURVE public key (NAME.key)" in out
    assert "--curve-key FILE this client's CURVE key pair (NAME.key_secret)" in out


def test_keygen_help_says_which_file_goes_where(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvflow keygen --help`: NAME, --dir and which of the two files is secret."""
    out = _help(monkeypatch, capsys, "keygen")
    assert out[0] == "usage: kvflow keygen [-h] [--dir DIR] name"
    assert (
        "Write a CURVE key pair: NAME.key (public: give it to the other side) and"
        " NAME.key_secret (private, mode 0600). Put clients' NAME.key files in the server's"
        " --curve-authorized-keys directory; clients take the server's NAME.key."
    ) in out
    assert "name the pair's file name, e.g. server or client-a" in out
    assert "--dir DIR where to write the files (default: here)" in out


# -- kvflow keygen ------------------------------------------------------------------------------


def test_keygen_writes_the_pair_here_by_default_and_never_overwrites(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvflow keygen NAME` writes NAME.key and NAME.key_secret in the current directory and
    prints both; a second run with the same name exits 1 with one line, keeping the keys."""
    monkeypatch.chdir(tmp_path)
    assert main("keygen", ["server"]) == 0
    public, secret = tmp_path / "server.key", tmp_path / "server.key_secret"
    assert capsys.readouterr().out == (
        f"public key: {public.name}\nsecret key: {secret.name} (keep it private)\n"
    )
    assert secret.stat().st_mode & 0o777 == 0o600
    before = secret.read_bytes()
    assert main("keygen", ["server"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("kvflow keygen: error: ") and "already exists" in captured.err
    assert secret.read_bytes() == before


def test_keygen_dir_and_a_bad_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--dir puts the pair there (made if missing); a name with a slash exits 1 with one line."""
    folder = tmp_path / "keys" / "clients"
    assert main("keygen", ["client-a", "--dir", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["client-a.key", "client-a.key_secret"]
    assert f"public key: {folder / 'client-a.key'}\n" in capsys.readouterr().out
    assert main("keygen", ["a/b", "--dir", str(folder)]) == 1
    err = capsys.readouterr().err
    assert err == "kvflow keygen: error: key name must be a plain file name, got 'a/b'\n"
    assert main("keygen", []) == 2  # NAME is required: a usage error
    assert capsys.readouterr().err.startswith("kvflow keygen: error: ")


# -- kvflow status ------------------------------------------------------------------------------


def test_status_defaults_to_the_local_server_and_five_seconds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With no flags, `kvflow status` asks tcp://127.0.0.1:5555 and waits 5 s."""
    code = main("status", [])
    captured = capsys.readouterr()
    if code == 0:  # a server really listens on the default port
        assert json.loads(captured.out)["server"]["endpoint"].endswith(":5555")
    else:
        assert code == 1
        assert "the kvflow server at tcp://127.0.0.1:5555 within 5 s" in captured.err


def test_status_accepts_the_longest_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    """--timeout-s 3600 (the documented bound) is accepted; 3600.5 is a usage error."""
    endpoint = "tcp://no-such-host.invalid:5555"  # fails at once, after the flags are checked
    assert main("status", ["--endpoint", endpoint, "--timeout-s", "3600"]) == 1
    assert "cannot resolve host" in capsys.readouterr().err
    assert main("status", ["--endpoint", endpoint, "--timeout-s", "3600.5"]) == 2
    assert "--timeout-s must be a finite number in (0, 3600] seconds" in capsys.readouterr().err


def test_status_curve_flags_go_together_and_bad_key_files_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One CURVE flag without the other, or a key file that cannot be read: exit 2, one line."""
    assert main("status", ["--curve-key", str(tmp_path / "a.key_secret")]) == 2
    err = capsys.readouterr().err
    assert err == "kvflow status: error: --curve-server-key and --curve-key go together\n"
    missing = str(tmp_path / "missing.key")
    assert main("status", ["--curve-server-key", missing, "--curve-key", missing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"kvflow status: error: cannot read the public key file {missing}")


def test_status_reaches_a_curve_server_and_prints_sorted_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvflow status` with the CURVE flags talks to a CURVE server and prints its status as
    JSON, keys sorted, indented by 2."""
    from kvflow.core.server.server import KVFlowServer

    assert main("keygen", ["server", "--dir", str(tmp_path)]) == 0
    assert main("keygen", ["alice", "--dir", str(tmp_path / "clients")]) == 0
    capsys.readouterr()
    config = resolve(
        [
            *("--port", "0", "--l1-size-gb", "0.01", "--disable-observability"),
            *("--curve-secret-key", str(tmp_path / "server.key_secret")),
            *("--curve-authorized-keys", str(tmp_path / "clients")),
        ],
        {},
    )
    server = KVFlowServer(config)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        argv = ["--endpoint", server.endpoint, "--timeout-s", "30"]
        argv += ["--curve-server-key", str(tmp_path / "server.key")]
        argv += ["--curve-key", str(tmp_path / "clients" / "alice.key_secret")]
        assert main("status", argv) == 0
    finally:
        server.request_stop()
        thread.join()
    out = capsys.readouterr().out
    status = json.loads(out)
    assert status["server"]["authentication"] == "curve"
    assert out == json.dumps(status, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize(
    "host",
    ["[::1]", "[0:0:0:0:0:0:0:1]", ""],
)
def test_status_takes_ipv6_and_empty_hosts_to_the_server(
    host: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bracketed IPv6 address (or no host) is not a name lookup failure: the status call
    is made and reports that no server answered."""
    endpoint = f"tcp://{host}:{_free_port()}"
    assert main("status", ["--endpoint", endpoint, "--timeout-s", "0.3"]) == 1
    err = capsys.readouterr().err
    assert f"the kvflow server at {endpoint} within 0.3 s (is it running?)" in err


@pytest.mark.parametrize(
    "endpoint, host",
    [
        ("tcp://127.0.0.1;no-such-host.invalid:5555", "no-such-host.invalid"),
        ("tcp://[127.0.0.1x:5555", "[127.0.0.1x"),
        ("tcp://[no-such-host.invalid]:5555", "no-such-host.invalid"),
    ],
)
def test_status_names_the_host_that_does_not_resolve(
    endpoint: str, host: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The host named is the one after a `SOURCE;`, without IPv6 brackets; a half-bracketed
    host is taken as written."""
    assert main("status", ["--endpoint", endpoint, "--timeout-s", "30"]) == 1
    err = capsys.readouterr().err
    assert f"cannot resolve host {host!r} of --endpoint {endpoint}:" in err


# -- settings from the environment and the config file ------------------------------------------


def test_list_and_switch_settings_from_the_environment() -> None:
    """KVFLOW_L2_DISK is a comma list; a switch variable must be one of the yes/no words."""
    assert resolve([], {"KVFLOW_L2_DISK": "/a, /b,"}).l2_disk_paths == ("/a", "/b")
    with pytest.raises(UsageError) as info:
        resolve([], {"KVFLOW_L2_DISK_DIRECT_IO": "sure"})
    assert str(info.value) == (
        "KVFLOW_L2_DISK_DIRECT_IO (--l2-disk-direct-io) must be one of 1/true/yes/on/0/false/no/off"
    )


def test_config_file_values_are_converted_or_refused_by_type(tmp_path: Path) -> None:
    """In the file a list may be a comma string, an int is a fine float, and a wrong type is
    refused naming the file, key and flag, showing the value unless it may be a secret."""
    path = _toml(tmp_path, 'l2_disk = "/a, /b"\nl1_size_gb = 2\nl2_timeout_s = 1\n')
    config = resolve(["--config", path], {})
    assert config.l2_disk_paths == ("/a", "/b")
    assert config.l1_size_gb == 2.0 and isinstance(config.l1_size_gb, float)
    assert config.l2_timeout_s == 1.0
    cases = [
        ("l2_disk = [1]\n", "l2_disk (--l2-disk) must list strings, got [1]"),
        ("port = [1]\n", "port (--port) must be a int, got [1]"),
        ("port = 'high'\n", "port (--port) must be a int, got 'high'"),
        ("port = true\n", "port (--port) must be a int, got True"),
        ("l1_size_gb = true\n", "l1_size_gb (--l1-size-gb) must be a float, got True"),
        (
            "l2_redis = 5\n",
            "l2_redis (--l2-redis) must be a str, got a value not shown (it may hold a secret)",
        ),
    ]
    for text, message in cases:
        path = _toml(tmp_path, text)
        with pytest.raises(UsageError) as info:
            resolve(["--config", path], {})
        assert str(info.value) == f"--config {path}: {message}"


def test_a_false_switch_in_the_file_keeps_the_default_and_the_rest(tmp_path: Path) -> None:
    """`no_l2_write_back = false` leaves write-back on and every later setting still applies."""
    text = "no_l2_write_back = false\ndisable_observability = false\nlog_level = 'debug'\n"
    config = resolve(["--config", _toml(tmp_path, text)], {"KVFLOW_SAMPLE_SEED": "7"})
    assert config.l2_write_back is True and config.observability.enabled is True
    assert config.observability.log_level == "debug"
    assert config.observability.sample_seed == 7


# -- kvflow server in this process --------------------------------------------------------------


def test_server_logs_in_its_format_and_stops_on_sigterm(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`kvflow server` (in this process) logs its own lines in --log-format, stops on SIGTERM
    with status 0 and removes its log handler."""
    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    done = threading.Event()
    sent: list[bool] = []

    def stop_when_serving() -> None:
        with KVFlowClient(endpoint, timeout_s=1) as client:
            while not done.is_set():
                try:
                    client.status()
                except KVFlowError:
                    continue
                sent.append(True)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    root_handlers = list(logging.getLogger().handlers)
    stopper = threading.Thread(target=stop_when_serving)
    stopper.start()
    try:
        argv = ["--port", str(port), "--l1-size-gb", "0.01", "--disable-observability"]
        assert main("server", [*argv, "--log-format", "console"]) == 0
    finally:
        done.set()
        stopper.join()
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert sent == [True]
    assert logging.getLogger().handlers == root_handlers
    lines = capsys.readouterr().err.splitlines()
    listening = [line for line in lines if f"kvflow server listening on {endpoint}" in line]
    assert listening and not listening[0].startswith("{")  # console, not JSON
    assert any("kvflow server stopped" in line for line in lines)


def test_l1_quotas_from_a_config_file(tmp_path: Path) -> None:
    """`l1_quota` in the TOML file (a list, or one comma-separated string) sets the tenant
    limits: an engine built from that config reports each limit under the tenant's label,
    a salt only by its hash (also in the status' config); the flag wins over the file, and
    a malformed entry or a tenant listed twice is a usage error naming --l1-quota."""
    settings = "l1_size_gb = 0.01\ndisable_observability = true\n"
    listed = _toml(tmp_path, settings + 'l1_quota = ["salt:tenant-a=0.5", "model:llama-8b=2"]\n')
    config = resolve(["--config", listed], {})
    assert config.l1_quotas == ("salt:tenant-a=0.5", "model:llama-8b=2")
    engine = CacheEngine(config)
    try:
        limits = {(t["kind"], t["tenant"]): t["limit_bytes"] for t in engine.tenant_stats()}
        status = engine.status()
    finally:
        engine.close()
    assert limits == {("salt", salt_label("tenant-a")): 1 << 29, ("model", "llama-8b"): 2 << 30}
    assert status["config"]["l1_quotas"] == [
        f"salt:{salt_label('tenant-a')}=0.5",
        "model:llama-8b=2",
    ]
    assert "tenant-a" not in json.dumps(status, default=str)
    flagged = resolve(["--config", listed, "--l1-quota", "model:other=1"], {})
    assert flagged.l1_quotas == ("model:other=1",)
    one_string = _toml(tmp_path, 'l1_quota = "salt:tenant-a=0.5, model:llama-8b=2"\n')
    assert resolve(["--config", one_string], {}).l1_quotas == config.l1_quotas
    for text in (
        'l1_quota = ["tenant-a=0.5"]\n',
        'l1_quota = ["salt:a=1", "salt:a=2"]\n',
        'l1_quota = ["model:m=0"]\n',
        "l1_quota = [1]\n",
    ):
        with pytest.raises(UsageError, match="--l1-quota"):
            resolve(["--config", _toml(tmp_path, text)], {})
