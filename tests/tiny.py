"""Tiny randomly initialised causal LMs built from configs (no download), for exactness tests.

The weights are drawn with a large initializer range so that the logits are
spread out: greedy choices are then far from ties, and fp32 batched vs
one-token evaluation cannot flip them.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

VOCAB = 96


def tiny_model(arch: str = "llama", seed: int = 0, vocab_size: int = VOCAB, layers: int = 2, positions: int = 256):
    """A small fp32 causal LM of the given architecture ("llama", "qwen2" or "gemma3"), a context
    window of `positions` tokens."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        initializer_range=0.4,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "gemma3":  # sliding-window layers (window 6) between full-attention ones
        kinds = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)
        config = Gemma3TextConfig(**common, head_dim=8, sliding_window=6, layer_types=kinds)
    else:
        config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens cheaply.",
    "for i in range(10):\n    print(i * i)\n",
    "Once upon a time, a small model helped a large one write faster.",
]


def tiny_tokenizer(variant: int = 0, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained here on a few lines (no download).

    Different variants train on a differently ordered corpus with another
    size, giving different vocabularies.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size + 40 * variant,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = CORPUS if variant == 0 else list(reversed(CORPUS)) * 2
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def save_tiny(directory, arch: str = "llama", seed: int = 0, variant: int = 0, positions: int = 256) -> str:
    """Save a tiny model with a tiny tokenizer as a transformers directory; returns its path."""
    tokenizer = tiny_tokenizer(variant)
    model = tiny_model(arch, seed, vocab_size=len(tokenizer), positions=positions)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


# fp32's guarantee (docs/guarantees.md): a batched verification forward computes a token's logits with
# other kernels than a one-token step, so they differ by rounding (~1e-6 on the tiny models), and the
# output can differ only where the two best tokens are closer than that.
NEAR_TIE = 1e-4


def assert_near_tie_parting(model, prompt: list[int], out: list[int], reference: list[int]) -> None:
    """out == reference, or they part at a token where `model`'s two best logits are within NEAR_TIE."""
    from specdec.backends.hf import HFRunner

    if out == reference:
        return
    i = next((i for i, (a, b) in enumerate(zip(out, reference)) if a != b), min(len(out), len(reference)))
    assert i < min(len(out), len(reference)), "one output is a prefix of the other"
    logits = HFRunner(model).forward(prompt + reference[:i])[-1].double()  # [V]
    (first, second), best = torch.topk(logits, 2)
    gap = float(first - second)
    assert gap < NEAR_TIE and {out[i], reference[i]} <= set(best.tolist()), (
        f"speculative output parts from plain at token {i} ({out[i]} vs {reference[i]}), "
        f"where the best logit leads by {gap:.3g}: not a near-tie")
