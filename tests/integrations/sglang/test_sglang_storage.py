"""KVFlowHiCacheStorage under SGLang's own classes (sglang 0.5.23 in .venv-sglang).

The checks live in sglang_checks.py and run, with controller_checks.py's, in one process
of the SGLang venv's python (tests/integrations/sglang/sglang_venv.py); each is reported
here as a test of its own, failing with the check's traceback. What each proves is its
docstring there: SGLang's StorageBackendFactory building the backend from the
extra-config JSON, MHA and MLA host pools in every layout round-tripping bit-exact
through a real `kvflow server` into a second engine's pool, prefix semantics with a
missing page, tensor parallel / pipeline stage / model / salt isolation, and the failures
(server down, hung, restarted, killed mid-set, evicted pages, malformed indices) answered
as False or a shorter prefix.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.sglang.sglang_venv import assert_passed, check_names

# the checks of both SGLang test files run in one process: SGLang's import and 16 checks
# with their servers, 60-100 s alone on the 2-core box and longer beside make test's other
# workers, so past the suite's 300 s per-test default; a hang still fails at 900 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("name", check_names("sglang_checks.py"))
def test_sglang_check(sglang_results: dict[str, Any], name: str) -> None:
    assert_passed(sglang_results, name)
