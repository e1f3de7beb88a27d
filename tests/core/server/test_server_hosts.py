"""Where `kvflow server --host` listens: an IPv6 address, bare or in brackets, serves
clients; a host name whose addresses are all loopback needs no CURVE; every interface
("*", or IPv6's "::") is refused without CURVE or --insecure-listen, as 0.0.0.0 is
(test_curve.py); a client reaches a server on 127.0.0.1 through the name localhost."""

from __future__ import annotations

import socket

import pytest

from kvflow.core import KVFlowClient
from tests.support.launcher import kvflow_run
from tests.support.ops import ServerProcess


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def _serves(host: str) -> str:
    """Start a server on `host`, check a client gets its status, stop it; its endpoint."""
    with (
        ServerProcess("--host", host, "--disable-observability", "--l1-size-gb", "0.05") as srv,
        KVFlowClient(srv.endpoint, timeout_s=5) as client,
    ):
        assert client.status()["server"]["endpoint"] == srv.endpoint
    return srv.endpoint


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_loopback_address_serves_clients(host: str) -> None:
    assert _serves(host).startswith("tcp://[::1]:")


def test_a_host_name_of_loopback_addresses_needs_no_curve() -> None:
    assert _serves("localhost").startswith(("tcp://127.0.0.1:", "tcp://[::1]:"))


@pytest.mark.parametrize("host", ["*", "::"])
def test_every_interface_is_refused_without_curve_or_insecure_listen(host: str) -> None:
    refused = kvflow_run(["server", "--port", "0", "--host", host, "--disable-observability"])
    assert refused.returncode == 2, refused.stderr
    assert f"--host {host} accepts connections from other machines" in refused.stderr


def test_a_client_reaches_a_server_on_127_0_0_1_through_localhost() -> None:
    """A client names the server's machine rather than its address: wherever localhost
    also resolves to ::1 (first), the client must still reach the IPv4 listener."""
    with ServerProcess("--disable-observability", "--l1-size-gb", "0.05") as srv:
        port = srv.endpoint.rpartition(":")[2]
        with KVFlowClient(f"tcp://localhost:{port}", timeout_s=5) as client:
            assert client.status()["server"]["endpoint"] == srv.endpoint
