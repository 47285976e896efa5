"""GGUF files for the architecture tests (tests/native/test_gguf_arch.py), written here with the gguf package.

``edited_copy`` copies a file with some metadata keys set or dropped and some tensors added (a zoo file made into
one the gguf target must refuse, or Llama 3's rotary factors added to a llama file).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np


def edited_copy(source: str | Path, path: str | Path, keys: Mapping[str, Any] | None = None,
                drop: tuple[str, ...] = (), tensors: Mapping[str, np.ndarray] | None = None) -> str:
    """Write `source` to `path` with metadata `keys` set (a new key: a float is F32, an int UINT32, a str STRING,
    a bool BOOL; an existing key keeps its type), keys `drop` left out and F32 `tensors` added (in place of the
    source's of the same name); returns the path."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(source))
    keys = dict(keys or {})
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(path), arch)
    writer.kv_data[0].pop("general.architecture", None)  # written again below, in the source's order
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in drop:
            continue
        value = keys.pop(key, field.contents())
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub)
    for key, value in keys.items():
        kind = (GGUFValueType.BOOL if isinstance(value, bool) else GGUFValueType.UINT32 if isinstance(value, int)
                else GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.STRING)
        writer.add_key_value(key, value, kind)
    tensors = dict(tensors or {})
    for t in reader.tensors:
        if t.name not in tensors:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, values in tensors.items():
        writer.add_tensor(name, np.asarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


# The distance between the gguf target's logits and llama.cpp's on the same file and tokens.  Both multiply the
# file's blocks with the same 8-bit block activations (the same quants and scales: gguf_linear.c's block_scale; Q4_1's
# and Q5_1's minimums times Q8_1's fp16 block sums), and the gguf target computes its rotary tables, its rms norms'
# means and Gemma's GELU (fp16 table) as llama.cpp does; what is left are fp32 roundings in other orders (the linears'
# block sums, attention's and SiLU's exp, the softmax's sums), 1e-7 of a value.  A random network amplifies the rare
# one that moves an activation across a quantisation boundary (a "flip": one quant off by one, 1e-3 of a logit to a
# few 1e-2 on the positions after it), and a flip changes an argmax only at a near-tie.  Measured (200 tokens of the
# synthetic files below, seeds 0-4; tests.tiny_gguf's for llama, qwen2 and mistral, mistral's against llama.cpp's
# llama twin): argmax the same on 99.8% / 99.9% / 100% / 99.5% / 100% / 100% / 100% of the positions for llama /
# mistral / qwen2 / qwen3 / phi3 / gemma2 / gemma3, every file >= 99.0% (seed 0: all 100%), rms distance at most
# 9.7e-3 (qwen3; gemma 2.7e-4) -- llama.cpp is as far from itself, its one-batch logits from its one-token-at-a-time
# ones (qwen3 1.0e-2, gemma2 argmax 99.5%).  Before (activation block sums of Q4_1 fp32, rotary tables transformers',
# fp32 GELU and norm sums): 94.5-99.5% per file, rms up to 2.2e-2.  A model computed wrong (a norm, a rotary table or
# base, a scale, a window off) is far outside these (rotary factors left out: test_gguf_arch_real.py).
RMS_TOLERANCE = 0.02  # rms(ours - llama.cpp's) / rms(llama.cpp's), synthetic files
AGREEMENT = 0.99  # positions whose argmax is llama.cpp's, synthetic files
# The zoo's real files on 150 tokens of text: flips at every position (smollm2-135m: 30 layers of 4 quantised
# inputs), real near-ties (llama.cpp's best two logits within 0.01-0.17 where the argmax differed): smollm2-135m
# 98.0% (rms 3.6e-2; llama.cpp's own one-token-at-a-time logits its one-batch ones bit for bit), gemma3-270m 96.8%
# (rms 3.7e-2) where llama.cpp is 95.5% from itself (rms 3.8e-2, one batch against one token at a time).
REAL_RMS_TOLERANCE = 0.06
REAL_AGREEMENT = 0.95


def llama_cpp_logits(path: str | Path, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits [n, V] of every token of `tokens` fed at once (fp32 keys and values)."""
    from tests.conftest import require_llama_cpp

    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=max(64, len(tokens) + 8), n_batch=512,
                          n_threads=2, type_k=0, type_v=0, flash_attn=False, verbose=False)  # type 0: GGML_TYPE_F32
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def assert_close_to_llama_cpp(ours: np.ndarray, theirs: np.ndarray, real: bool = False) -> None:
    """The gguf target's logits [n, V] are llama.cpp's within the tolerances above (real: a zoo file's)."""
    rms = float(np.sqrt(((ours - theirs) ** 2).mean()) / np.sqrt((theirs**2).mean()))
    assert rms <= (REAL_RMS_TOLERANCE if real else RMS_TOLERANCE), rms
    same = ours.argmax(-1) == theirs.argmax(-1)
    assert same.mean() >= (REAL_AGREEMENT if real else AGREEMENT), np.nonzero(~same)[0]


TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "The quick brown fox jumps over the lazy dog. Once upon a time, there was a little girl who lived in a "
        "village near the forest. She loved to walk among the tall trees and listen to the birds singing. One day, "
        "she found a small wooden box hidden under a pile of leaves. Inside the box was a map that showed the way "
        "to a secret garden.\nimport numpy as np\n\ndef mean(values):\n    total = 0\n    for v in values:\n"
        "        total += v\n    return total / len(values)\n")


def text_tokens(path: str | Path, text: str = TEXT) -> list[int]:
    """`text` as llama.cpp's tokenizer of the file splits it, its BOS first where the file asks for one."""
    from tests.conftest import require_llama_cpp

    llama_cpp = require_llama_cpp()
    vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return list(vocab.tokenize(text.encode()))
    finally:
        vocab.close()


# ---------------------------------------------------------------- synthetic models of the other architectures

LAYERS = {"gemma3": 6, "qwen3": 2, "phi3": 2, "gemma2": 4}  # gemma3: its sixth layer the one global one
CAPS = {"attn_logit_softcapping": 20.0, "final_logit_softcapping": 100.0}  # gemma2's: they bite, they do not flatten
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 2, 128  # a head wider than hidden / heads
WINDOW = 8  # gemma3's sliding window: short, so that a test's few dozen tokens reach past it


def save_arch_gguf(path: str | Path, arch: str, seed: int = 0, scale: float = 4.0) -> str:
    """Write a small random GGUF model of `arch` ("gemma3", "gemma2", "qwen3" or "phi3") with the tokenizer of
    tests.tiny_gguf (llama.cpp loads it; transformers builds the same tokenizer from it), its linears in the block types of
    tests.tiny_gguf.TYPES (`scale` times their block scales: logits further from ties), its norms in F32 around
    1 (gemma's are stored as 1 + w, as llama.cpp's converter stores them), head size HEAD_DIM given by
    attention.key_length (phi3: hidden / heads, as llama.cpp's phi3 needs; its q, k and v in one attn_qkv, its
    gate's and up projection's rows in one ffn_up, and a sliding window of WINDOW that llama.cpp does not apply);
    gemma2: gemma3's layers without q / k norms, its scores and logits soft-capped (CAPS); returns the path."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from tests.native.gguf_blocks import random_blocks
    from tests.tiny import tiny_tokenizer
    from tests.tiny_gguf import TYPES, _bpe, _scaled, add_tokenizer

    rng = np.random.default_rng(seed)
    tokenizer = tiny_tokenizer()
    tokens, merges, types = _bpe(tokenizer)
    if arch == "phi3":  # llama.cpp looks these up in a phi3 file's vocabulary (it will not load one without them)
        tokens, types = [*tokens, "<|end|>", "<|endoftext|>"], [*types, 3, 3]
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}-{seed}")
    writer.add_block_count(LAYERS[arch])
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    head_dim = HIDDEN // HEADS if arch == "phi3" else HEAD_DIM
    if arch != "phi3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch in ("gemma3", "gemma2", "phi3"):
        writer.add_sliding_window(WINDOW)
    if arch == "gemma2":
        for key, cap in CAPS.items():
            writer.add_float32(f"gemma2.{key}", cap)
    add_tokenizer(writer, tokenizer, tokens, merges, types)

    def linear(name: str, kind: str, rows: int, columns: int) -> None:
        raw = _scaled(random_blocks(TYPES[kind], rows, columns, rng), TYPES[kind], rows, columns, scale)
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType(TYPES[kind]))

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    linear("token_embd.weight", "token_embd", len(tokens), HIDDEN)
    for i in range(LAYERS[arch]):
        blk = f"blk.{i}."
        norm(blk + "attn_norm.weight", HIDDEN)
        if arch == "phi3":
            linear(blk + "attn_qkv.weight", "attn_q", (HEADS + 2 * KV_HEADS) * head_dim, HIDDEN)
        else:
            linear(blk + "attn_q.weight", "attn_q", HEADS * head_dim, HIDDEN)
            linear(blk + "attn_k.weight", "attn_k", KV_HEADS * head_dim, HIDDEN)
            linear(blk + "attn_v.weight", "attn_v", KV_HEADS * head_dim, HIDDEN)
            if arch != "gemma2":
                norm(blk + "attn_q_norm.weight", head_dim)
                norm(blk + "attn_k_norm.weight", head_dim)
        linear(blk + "attn_output.weight", "attn_output", HIDDEN, HEADS * head_dim)
        if arch in ("gemma3", "gemma2"):
            norm(blk + "post_attention_norm.weight", HIDDEN)
            norm(blk + "post_ffw_norm.weight", HIDDEN)
        norm(blk + "ffn_norm.weight", HIDDEN)
        if arch == "phi3":
            linear(blk + "ffn_up.weight", "ffn_up", 2 * INTERMEDIATE, HIDDEN)
        else:
            linear(blk + "ffn_gate.weight", "ffn_gate", INTERMEDIATE, HIDDEN)
            linear(blk + "ffn_up.weight", "ffn_up", INTERMEDIATE, HIDDEN)
        linear(blk + "ffn_down.weight", "ffn_down", HIDDEN, INTERMEDIATE)
    norm("output_norm.weight", HIDDEN)
    if not arch.startswith("gemma"):  # gemma ties its head to the embedding
        linear("output.weight", "output", len(tokens), HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
