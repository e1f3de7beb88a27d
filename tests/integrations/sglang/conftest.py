"""The SGLang checks' one run for both test files (tests/integrations/sglang/sglang_venv.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.sglang.sglang_venv import run_checks


@pytest.fixture(scope="session")
def sglang_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The results of the checks this session's selected tests report, from one run of
    SGLang's venv (a session fixture: tests/support/parallel.py puts every test using it
    on one worker)."""
    names = [
        str(item.callspec.params["name"])
        for item in request.session.items
        if isinstance(item, pytest.Function) and "sglang_results" in item.fixturenames
    ]
    return run_checks(tmp_path_factory.mktemp("sglang") / "results.json", names)
