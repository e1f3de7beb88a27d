"""The tiny random Llama the vLLM tests load: built from a config, saved as a model dir."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def tiny_llama_config(heads: int = 1) -> dict[str, Any]:
    """2 layers, `heads` attention (and KV) heads of dim 64 (vLLM's CPU attention has no
    head size 16 kernel), vocabulary 512: the fields of its config.json that differ from
    a Llama's defaults."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64 * heads,
        "intermediate_size": 128 * heads,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": 64,
        "max_position_embeddings": 2048,
    }


def build_tiny_llama(path: Path, heads: int = 1) -> Path:
    """The tiny Llama with weights from seed 0, no tokenizer; returns `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    fields = tiny_llama_config(heads)
    del fields["architectures"], fields["model_type"]  # save_pretrained writes both
    LlamaForCausalLM(LlamaConfig(**fields)).save_pretrained(path)
    return path


def write_tiny_llama_config(path: Path, heads: int = 1) -> Path:
    """Only the tiny Llama's config.json, no weights: enough for vLLM's `ModelConfig` where
    no model runs, without importing transformers (seconds); returns `path`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(tiny_llama_config(heads)))
    return path
