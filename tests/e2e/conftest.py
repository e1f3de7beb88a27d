"""Fixtures of the end-to-end tests: the tiny model per dtype and the two requests."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.e2e.scenario import Requests, make_requests
from tests.e2e.tiny_llama import build_model


@pytest.fixture(scope="session")
def models() -> dict[torch.dtype, LlamaForCausalLM]:
    """The tiny Llama in fp32 and bf16 (same seed, so the same weights up to rounding)."""
    return {dtype: build_model(dtype) for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="session")
def requests() -> Requests:
    """The prompt and the second request that shares its full chunks."""
    return make_requests()
