"""Fixtures of the end-to-end tests: the tiny model, the two requests, a kvflow server."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest

from kvflow.core import KVFlowClient
from tests.e2e.scenario import CHUNK_SIZE, Requests, make_requests
from tests.e2e.server_proc import running_server
from tests.e2e.tiny_llama import ModelFor, build_model


@pytest.fixture(scope="session")
def model_for() -> ModelFor:
    """The tiny Llama for (dtype, device), built once each; one seed, so the same weights."""
    return functools.cache(lambda dtype, device: build_model(dtype, device=device))


@pytest.fixture(scope="session")
def requests() -> Requests:
    """The prompt and the second request that shares its full chunks."""
    return make_requests()


@pytest.fixture(scope="session")
def kvflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `kvflow server` subprocess with chunk_size CHUNK_SIZE; yields its endpoint."""
    log_path = tmp_path_factory.mktemp("kvflow-server") / "server.log"
    with running_server(CHUNK_SIZE, log_path) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def kvflow_client(kvflow_server: str) -> Iterator[KVFlowClient]:
    """A client of the session's server, as an engine worker holds one."""
    with KVFlowClient(kvflow_server, timeout_s=30.0) as client:
        yield client


@pytest.fixture(scope="session")
def kvflow_sharded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `kvflow server --shards 2` subprocess (rank r on shard r % 2); yields its endpoint."""
    log_path = tmp_path_factory.mktemp("kvflow-sharded") / "server.log"
    with running_server(CHUNK_SIZE, log_path, ["--shards", "2"]) as endpoint:
        yield endpoint
