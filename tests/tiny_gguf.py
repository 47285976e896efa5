"""Tiny GGUF files built here (no download): random blocks of every type the gguf target multiplies.

A llama or qwen2 model of 2 layers, hidden 256 (the K types' block), its linears in Q4_K, Q6_K, Q5_0, Q8_0 and
Q4_1 (a mix as Q4_K_M files have, and more), biases on qwen2's q / k / v, and the byte-level BPE tokenizer of
tests.tiny in the file's tokenizer metadata, so that transformers builds the same tokenizer from it and loads
the model (de-quantised to fp32) as a reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.native.gguf_blocks import Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, dequantize, random_blocks
from tests.tiny import tiny_tokenizer

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 256, 512, 4, 2
# each linear's type: every type the kernel takes, mixed in one layer as quantised files mix them
TYPES = {"attn_q": Q4_K, "attn_k": Q5_0, "attn_v": Q6_K, "attn_output": Q8_0, "ffn_gate": Q4_1,
         "ffn_up": Q4_K, "ffn_down": Q6_K, "output": Q6_K, "token_embd": Q4_K}


def _bpe(tokenizer) -> tuple[list[str], list[str], list[int]]:
    """The tokenizer's tokens (by id), merges and token types (1 normal, 3 control) as GGUF's gpt2 model lists."""
    import json

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    special = {t["content"] for t in state.get("added_tokens", [])}
    return tokens, merges, [3 if t in special else 1 for t in tokens]


def add_tokenizer(writer: Any, tokenizer: Any, tokens: list, merges: list[str], types: list[int]) -> None:
    """The tokenizer's gpt2-model metadata (tokens, merges, types, its bos / eos / pad ids; no bos added) on `writer`
    (a gguf.GGUFWriter), as llama.cpp and transformers read a GGUF's tokenizer."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)


def save_tiny_gguf(path: str | Path, arch: str = "qwen2", seed: int = 0, layers: int = 2, positions: int = 512,
                   scale: float = 1.0, requantized: bool = False) -> str:
    """Write a tiny random GGUF model (see the module doc) to `path`; returns the path.  `scale` multiplies
    every block's scale (larger weights: logits further from ties).  requantized: every linear and the output
    head (not the embedding) written as the Q4_1 blocks of its de-quantised values (specdec.native.int4.q4_1_blocks):
    the file a model of the same seed requantised at load should be."""
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(seed)
    tokenizer = tiny_tokenizer()
    tokens, merges, types = _bpe(tokenizer)
    vocab = len(tokens)
    head_dim = HIDDEN // HEADS
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}-{seed}")
    writer.add_block_count(layers)
    writer.add_context_length(positions)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    add_tokenizer(writer, tokenizer, tokens, merges, types)

    def quantised(name: str, kind: str, rows: int, columns: int) -> None:
        type_id = TYPES[kind]
        raw = random_blocks(type_id, rows, columns, rng)
        if scale != 1.0:
            raw = _scaled(raw, type_id, rows, columns, scale)
        if requantized and kind != "token_embd":
            import torch

            from specdec.native.int4 import q4_1_blocks

            raw = q4_1_blocks(torch.from_numpy(dequantize(type_id, raw, rows, columns))).numpy()
            type_id = Q4_1
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType(type_id))

    def floats(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, values.astype(np.float32))

    quantised("token_embd.weight", "token_embd", vocab, HIDDEN)
    for i in range(layers):
        blk = f"blk.{i}."
        floats(blk + "attn_norm.weight", 1.0 + 0.1 * rng.standard_normal(HIDDEN))
        quantised(blk + "attn_q.weight", "attn_q", HEADS * head_dim, HIDDEN)
        quantised(blk + "attn_k.weight", "attn_k", KV_HEADS * head_dim, HIDDEN)
        quantised(blk + "attn_v.weight", "attn_v", KV_HEADS * head_dim, HIDDEN)
        if arch == "qwen2":
            floats(blk + "attn_q.bias", 0.5 * rng.standard_normal(HEADS * head_dim))
            floats(blk + "attn_k.bias", 0.5 * rng.standard_normal(KV_HEADS * head_dim))
            floats(blk + "attn_v.bias", 0.5 * rng.standard_normal(KV_HEADS * head_dim))
        quantised(blk + "attn_output.weight", "attn_output", HIDDEN, HEADS * head_dim)
        floats(blk + "ffn_norm.weight", 1.0 + 0.1 * rng.standard_normal(HIDDEN))
        quantised(blk + "ffn_gate.weight", "ffn_gate", INTERMEDIATE, HIDDEN)
        quantised(blk + "ffn_up.weight", "ffn_up", INTERMEDIATE, HIDDEN)
        quantised(blk + "ffn_down.weight", "ffn_down", HIDDEN, INTERMEDIATE)
    floats("output_norm.weight", 1.0 + 0.1 * rng.standard_normal(HIDDEN))
    quantised("output.weight", "output", vocab, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _scaled(raw: np.ndarray, type_id: int, rows: int, columns: int, scale: float) -> np.ndarray:
    """The blocks with their fp16 scales (and minimums) multiplied by `scale`."""
    from specdec.native.kernels.gguf import BLOCK, FILE_BYTES

    blocks = raw.reshape(rows, columns // BLOCK[type_id], FILE_BYTES[type_id]).copy()
    offsets = {Q4_K: (0, 2), Q6_K: (208,), Q5_0: (0,), Q8_0: (0,), Q4_1: (0, 2)}[type_id]
    for at in offsets:
        half = blocks[..., at : at + 2].copy().view(np.float16)
        blocks[..., at : at + 2] = (half.astype(np.float32) * scale).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)
