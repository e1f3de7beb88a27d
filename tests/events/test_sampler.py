"""The deterministic sampler: stable decisions across processes, honest rates, validation."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvflow.events import Sampler

_CHILD = """
import json
from kvflow.events import Sampler
s = Sampler(0.1, seed=7)
print(json.dumps([i for i in range(5000) if s.keep("gpu-0", i)]))
"""


def test_decisions_identical_in_another_process() -> None:
    """A fresh interpreter (different hash randomisation) keeps exactly the same keys."""
    env_hash = {"PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, **env_hash},
    ).stdout
    s = Sampler(0.1, seed=7)
    assert json.loads(out) == [i for i in range(5000) if s.keep("gpu-0", i)]


def test_rate_is_respected_and_seed_matters() -> None:
    """About `rate` of keys are kept; another seed keeps a different set."""
    ids = range(200_000)
    kept = [i for i in ids if Sampler(0.01, seed=1).keep("inst", i)]
    assert 1700 < len(kept) < 2300
    other = {i for i in ids if Sampler(0.01, seed=2).keep("inst", i)}
    assert set(kept) != other


def test_keep_mask_matches_keep() -> None:
    """The vectorised decision equals the scalar one for every id, negatives included."""
    s = Sampler(0.05, seed=3)
    ids = np.arange(-100, 20_000, dtype=np.int64)
    mask = s.keep_mask("inst-a", 9, ids=ids)
    assert mask.tolist() == [s.keep("inst-a", 9, int(i)) for i in ids]


@pytest.mark.parametrize(("rate", "expected"), [(0.0, False), (1.0, True)])
def test_extreme_rates(rate: float, expected: bool) -> None:
    """Rate 0 keeps nothing and rate 1 keeps everything, scalar and vectorised."""
    s = Sampler(rate)
    assert all(s.keep("x", i) is expected for i in range(1000))
    assert s.keep_mask("x", ids=np.arange(1000)).all() == expected
    assert s.keep_mask("x", ids=np.arange(1000)).any() == expected


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.5", float("nan")])
def test_rate_outside_unit_interval_rejected(bad: object) -> None:
    """A rate outside [0, 1] raises ValueError naming the allowed range."""
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Sampler(bad)  # type: ignore[arg-type]
