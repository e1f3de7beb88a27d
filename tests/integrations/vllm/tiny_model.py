"""The tiny random Llama the vLLM tests load: built from a config, saved as a model dir."""

from __future__ import annotations

from pathlib import Path


def build_tiny_llama(path: Path, heads: int = 1) -> Path:
    """2 layers, `heads` attention (and KV) heads of dim 64 (vLLM's CPU attention has no
    head size 16 kernel), vocabulary 512, weights from seed 0, no tokenizer; returns `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64 * heads,
        intermediate_size=128 * heads,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=64,
        max_position_embeddings=2048,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path
