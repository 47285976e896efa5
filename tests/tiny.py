"""Tiny randomly initialised causal LMs built from configs (no download), for exactness tests.

The weights are drawn with a large initializer range so that the logits are
spread out: greedy choices are then far from ties, and fp32 batched vs
one-token evaluation cannot flip them.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

VOCAB = 96


def tiny_model(arch: str = "llama", seed: int = 0, vocab_size: int = VOCAB, layers: int = 2):
    """A small fp32 causal LM of the given architecture ("llama" or "qwen2")."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.4,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()
