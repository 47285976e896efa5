"""The lean int8 runner (specdec.native.lean): bitwise the quantized transformers model, with less overhead.

On tiny llama / qwen2 / mistral (sliding window) models: random forward /
rollback sequences give the same logits, bit for bit, as an HFRunner over the
same int8 model; the KV cache grows past its first capacity without changing
a number; fusing linears changes no number; and the Engine picks the lean
runner for int8 llama-family models only.  A head trimmed to some vocabulary ids
(a draft's, FR-Spec) gives the full head's logits at those ids, bitwise for int8 and int4.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from specdec.algorithm.loop import StopCondition, run
from specdec.backends.hf import HFRunner
from specdec.errors import SpecdecError
from specdec.native import lean
from specdec.native.lean import LeanRunner, fuse
from specdec.native.quant import Int8Linear, quantize_model
from specdec.runtime.engine import Engine
from tests.tiny import VOCAB, tiny_model, tiny_tokenizer


def tiny_mistral(seed: int = 0):
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           initializer_range=0.4, sliding_window=5, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def int8(arch: str):
    return quantize_model(tiny_mistral() if arch == "mistral" else tiny_model(arch, 0))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_lean_logits_are_bitwise_the_int8_models(arch, monkeypatch):
    monkeypatch.setattr(lean, "_INITIAL_CAPACITY", 8)  # grow the cache many times
    model = int8(arch)
    runner, reference = LeanRunner(model), HFRunner(model)
    rng = random.Random(arch)
    checked = 0
    for _ in range(80):
        if runner.tokens and rng.random() < 0.3:
            keep = rng.randrange(0, len(runner.tokens) + 1)
            runner.rollback(keep)
            reference.rollback(keep)
            continue
        room = runner.max_context - len(runner.tokens)
        if room < 20:
            runner.reset()
            reference.reset()
            continue
        new = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 19))]
        last_n = rng.choice([None, 1, len(new)])
        assert torch.equal(runner.forward(new, last_n=last_n), reference.forward(new, last_n=last_n))
        assert runner.tokens == reference.tokens
        checked += 1
    assert checked > 40 and runner.capacity > 8


def test_fused_linear_is_bitwise_the_separate_ones():
    gen = torch.Generator().manual_seed(0)
    parts = [Int8Linear.from_linear(torch.nn.Linear(48, n, bias=True)) for n in (32, 8, 8)]
    fused = fuse(parts)
    x = torch.randn(7, 48, generator=gen)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    with pytest.raises(ValueError, match="bias"):
        fuse([parts[0], Int8Linear.from_linear(torch.nn.Linear(48, 8, bias=False))])


def test_lean_runner_is_chosen_for_int8_llama_family_only():
    tok = tiny_tokenizer(0)
    assert isinstance(Engine(quantize_model(tiny_model("qwen2", 0, vocab_size=len(tok))), tok).target_runner, LeanRunner)
    assert isinstance(Engine(quantize_model(tiny_model("gemma3", 0, vocab_size=len(tok))), tok).target_runner, HFRunner)
    assert isinstance(Engine(tiny_model("llama", 0, vocab_size=len(tok)), tok).target_runner, HFRunner)  # fp32
    assert not lean.supports(tiny_model("llama", 0))
    with pytest.raises(SpecdecError, match="lean runner"):
        LeanRunner(tiny_model("llama", 0))


def test_lean_speculative_equals_plain_and_the_hf_runner():
    model = int8("qwen2")
    draft = quantize_model(tiny_model("llama", 3))
    from specdec.drafters.model import ModelDrafter

    prompt = [5, 9, 13, 21, 34]
    plain = run(LeanRunner(model), prompt, StopCondition(30))
    assert plain.token_ids == run(HFRunner(model), prompt, StopCondition(30)).token_ids
    for gamma in (1, 4, 7):
        spec = run(LeanRunner(model), prompt, StopCondition(30), drafter=ModelDrafter(LeanRunner(draft)),
                   num_speculative_tokens=gamma)
        assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0


def test_lean_refuses_what_it_cannot_do():
    runner = LeanRunner(int8("llama"))
    with pytest.raises(ValueError):
        runner.forward([])
    with pytest.raises(ValueError):
        runner.forward([VOCAB])
    with pytest.raises(SpecdecError, match="window"):
        runner.forward([1] * (runner.max_context + 1))
    with pytest.raises(ValueError):
        runner.rollback(-1)


def test_runners_over_one_model_share_weights_not_caches():
    model = int8("qwen2")
    a, b = LeanRunner(model), LeanRunner(model)
    assert a.layer_set is b.layer_set  # fused and packed once per model
    first = a.forward([3, 4, 5])
    b.forward([9, 9])
    assert a.tokens == [3, 4, 5] and b.tokens == [9, 9]
    a.reset()
    assert torch.equal(a.forward([3, 4, 5]), first)


@pytest.mark.parametrize("kind", ["int8", "fp32", "int4"])
def test_a_trimmed_head_gives_the_full_heads_logits_at_its_ids_bitwise(kind):
    # A draft's trimmed vocabulary (specdec.drafters.draft_vocab): logits [n, N], column j the full head's ids[j].
    model = tiny_model("qwen2", 0) if kind == "fp32" else int8("qwen2")
    runner = LeanRunner(model, fp32=kind == "fp32", int4=kind == "int4", int8_catch_up=False)
    ids = torch.tensor([2, 90, 5, 17, 40, 41, 3])
    prompt, steps = [3, 4, 5, 6, 7, 8], [9, 10, 11]
    full = [runner.forward(prompt, last_n=2)] + [runner.forward([t]) for t in steps]  # [2, V], then [1, V] each
    identity = runner.identity()
    runner.reset()
    runner.trim_head(ids)
    assert runner.head.out_features == len(ids) and torch.equal(runner.head_ids, ids)
    assert runner.vocab_size == VOCAB and runner.identity() != identity and "7 tokens" in runner.describe()
    trimmed = [runner.forward(prompt, last_n=2)] + [runner.forward([t]) for t in steps]
    for f, t in zip(full, trimmed):  # fp32: BLAS rounds a narrower product otherwise
        assert torch.equal(t, f[:, ids]) if kind != "fp32" else torch.allclose(t, f[:, ids], atol=1e-5, rtol=0)
    twin = runner.clone()  # a batch slot's draft runner: the same trimmed head
    assert twin.head is runner.head and torch.equal(twin.forward(prompt, last_n=2), trimmed[0])
    runner.trim_head(None)
    runner.reset()
    assert runner.head_ids is None and runner.identity() == identity
    assert torch.equal(runner.forward(prompt, last_n=2), full[0])
    with pytest.raises(ValueError):  # out of the vocabulary
        runner.trim_head(torch.tensor([VOCAB]))
    with pytest.raises(ValueError):
        runner.trim_head(torch.tensor([3, 3]))


def test_a_trimmed_head_extended_by_a_requests_ids_gives_the_full_heads_logits_at_all_of_them():
    runner = LeanRunner(int8("qwen2"), int4=True, int8_catch_up=False)
    full = runner.forward([3, 4, 5, 6])  # [4, V]
    kept = torch.tensor([2, 90, 5, 17])
    runner.trim_head(kept)
    fixed = runner.head
    runner.extend_head([5, 60, 33, 60, VOCAB + 7, -1])  # 5 is in the set; ids outside the vocabulary are dropped
    assert runner.head_ids.tolist() == [2, 90, 5, 17, 33, 60] and runner.head.nbytes() > fixed.nbytes()
    runner.reset()
    assert torch.equal(runner.forward([3, 4, 5, 6]), full[:, runner.head_ids])  # both products, bitwise
    extended = runner.head
    runner.extend_head([33, 60])  # the same extra ids: the same head
    assert runner.head is extended
    runner.extend_head([])  # another request's: none
    assert runner.head is fixed and torch.equal(runner.head_ids, kept)
    assert runner.clone().head is fixed  # a clone keeps the set, not a request's extra ids
