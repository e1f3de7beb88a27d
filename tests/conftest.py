"""Suite-wide: the `needs` mark (a real part the test exercises; tests/support/requirements.py)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.gpus import DEVICE_PARAMS, device_under_test
from tests.support.parallel import group_by_shared_fixtures, long_first
from tests.support.requirements import PARTS, require_or_skip

#: the `gate` fixture (L1's segments made only as a test allows)
pytest_plugins = ["tests.support.segment_gate"]


def _share_the_cores() -> None:
    """On a parallel worker, torch (and the processes a test starts, through
    OMP_NUM_THREADS) use this worker's share of the machine's cores, not all of them: with
    24 workers on a 32-core GPU machine, each torch using 32 threads, CPU-bound toy runs
    took over a minute and the suite did not end in four."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = max(1, len(os.sched_getaffinity(0)) // workers)
    if workers > 1 and share < torch.get_num_threads():
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


def pytest_configure(config: pytest.Config) -> None:
    _share_the_cores()
    config.addinivalue_line(
        "markers",
        "needs(part, why): the test exercises a real part (one of "
        f"{', '.join(PARTS)}); missing, it fails under CI and skips elsewhere",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (tests/support/parallel.py)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # pytest-randomly shuffles in a wrapper, before this runs
    if config.pluginmanager.hasplugin("xdist"):  # its mark is unknown without it
        group_by_shared_fixtures(items)
        long_first(items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        (part,) = mark.args
        require_or_skip(part, mark.kwargs.get("why", "this test exercises it"))


@pytest.fixture(params=DEVICE_PARAMS)
def cuda_device(request: pytest.FixtureRequest) -> torch.device:
    """The CUDA device a GPU test works on: cuda:0, then (gpu2) cuda:1 with cuda:0's
    context current on the test thread (tests/support/gpus.py)."""
    return device_under_test(request.param)
