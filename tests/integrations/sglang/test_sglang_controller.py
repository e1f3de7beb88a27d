"""SGLang's own HiCache controller driving KVFlowHiCacheStorage (sglang 0.5.23 in .venv-sglang).

The checks live in controller_checks.py and run, with sglang_checks.py's, in one process
of the SGLang venv's python (tests/integrations/sglang/sglang_venv.py); each is reported
here as a test of its own, failing with the check's traceback. They build the HiCache
stack SGLang's scheduler builds (published ServerArgs, a CPU device pool,
`build_kv_only_stack`: host pool, `HybridCacheController`, kvflow attached through
`StorageBackendFactory`) and prove that one controller's backup reaches a second
controller's prefetch bit for bit (MHA and MLA, two storage batches), and that with the
server down the controller's operations report failure (0 tokens) without an exception
in its threads.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.sglang.sglang_venv import assert_passed, check_names

# the one run of both SGLang test files' checks (test_sglang_storage.py says why 900 s)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("name", check_names("controller_checks.py"))
def test_sglang_controller_check(sglang_results: dict[str, Any], name: str) -> None:
    assert_passed(sglang_results, name)
