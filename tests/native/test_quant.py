"""int8 models (specdec.native.quant) on tiny random models: accurate, batch-invariant bitwise, exact.

- Int8Linear: close to the float linear; each output row bitwise the same for
  any batch it is computed in (rows of any scale, all-zero rows, outliers).
- A quantized tiny llama / qwen2 / gemma3 (sliding window): on random
  forward / rollback sequences (k = 1..16 new tokens per forward), the logits
  of every token are bitwise the ones a one-token-at-a-time runner computes.
- Hence speculative greedy output == plain greedy output of the int8 model,
  for every γ and drafts that are perfect, unrelated, adversarial, or int8.
- Saving and loading give bitwise the same model; load_hf quantizes once and
  then loads from its cache.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from specdec.algorithm.draft import Draft, Drafter
from specdec.algorithm.loop import StopCondition, run
from specdec.backends.hf import HFRunner
from specdec.drafters.model import ModelDrafter
from specdec.native.quant import Int8Linear, is_int8, load_int8, quantize_model, quantize_weight, save_int8
from tests.tiny import VOCAB, tiny_model, tiny_tokenizer

ARCHS = ["llama", "qwen2", "gemma3"]


def int8_tiny(arch: str, seed: int = 0, layers: int | None = None) -> nn.Module:
    return quantize_model(tiny_model(arch, seed, layers=layers or (4 if arch == "gemma3" else 2)))


# --------------------------------------------------------------------------- Int8Linear


def test_int8_linear_is_close_to_the_float_linear():
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 256, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(96, generator=gen))
    q = Int8Linear.from_linear(linear)
    x = torch.randn(5, 7, 256, generator=gen)  # any leading shape
    y, ref = q(x), linear(x).detach()
    assert y.shape == ref.shape == (5, 7, 96) and y.dtype == torch.float32
    assert float((y - ref).norm() / ref.norm()) < 0.02  # 8-bit weights, 7-bit activations
    assert q.in_features == 256 and q.out_features == 96 and q.packed
    values, scale = quantize_weight(linear.weight)
    assert torch.equal(q.int8_weight(), values) and torch.equal(q.scale, scale)  # read back from the kernel's layout
    assert q.int8_weight().dtype == torch.int8 and q.int8_weight().abs().max() == 127


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_rows_do_not_depend_on_the_batch(bias):
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(1536, 256, bias=bias)
    q = Int8Linear.from_linear(linear)
    x = torch.randn(24, 1536, generator=gen)
    x[3] *= 1000.0  # a row with a huge range
    x[5] = 0.0  # an all-zero row
    x[7, 11] = 500.0  # an outlier feature
    x[9] *= 1e-4  # a row with a tiny range
    alone = torch.cat([q(x[i : i + 1]) for i in range(24)])  # [24, 256]
    assert torch.isfinite(alone).all() and (alone[5] == (q.bias if bias else 0)).all()
    for m in range(1, 25):
        assert torch.equal(q(x[:m]), alone[:m]), m
    perm = torch.randperm(24, generator=gen)
    assert torch.equal(q(x[perm]), alone[perm])  # and not on the other rows' order


def test_int8_linear_is_used_for_every_linear():
    model = int8_tiny("qwen2")
    assert is_int8(model) and not is_int8(tiny_model("qwen2"))
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    assert model.config._attn_implementation == "specdec_rowwise"
    assert HFRunner(model).vocab_size == VOCAB and HFRunner(model).capabilities.batch_invariant
    assert not HFRunner(tiny_model("qwen2")).capabilities.batch_invariant


# --------------------------------------------------------------------------- whole models, bitwise


def one_at_a_time(runner: HFRunner, tokens: list[int]) -> torch.Tensor:
    return torch.cat([runner.forward([t]) for t in tokens])  # [n, V]


@pytest.mark.parametrize("arch", ARCHS)
def test_random_forward_rollback_is_bitwise_one_token_at_a_time(arch):
    # `runner` takes forwards of 1..16 tokens and random rollbacks; `mirror` holds the same
    # cache but only ever evaluates one token at a time.  Every logit must be identical.
    model = int8_tiny(arch)
    runner, mirror = HFRunner(model), HFRunner(model)
    rng = random.Random(arch)
    base = [rng.randrange(VOCAB) for _ in range(20)]
    assert torch.equal(runner.forward(base), mirror.forward(base))  # the same call on both
    sizes = set()
    for _ in range(70):
        if rng.random() < 0.3:
            keep = rng.randrange(1, len(runner.tokens) + 1)
            runner.rollback(keep)
            mirror.rollback(keep)
            continue
        k = rng.randint(1, min(16, runner.max_context - len(runner.tokens)))
        new = [rng.randrange(VOCAB) for _ in range(k)]
        assert torch.equal(runner.forward(new), one_at_a_time(mirror, new)), (arch, len(runner.tokens), k)
        sizes.add(k)
        if len(runner.tokens) > 200:
            runner.rollback(len(base))
            mirror.rollback(len(base))
    assert len(sizes) >= 12 and runner.tokens == mirror.tokens


class ConstantDrafter(Drafter):
    """An adversarial draft: always the same (mostly wrong) token."""

    def propose(self, context, k, source=None):
        return Draft([7] * k)

    def observe(self, context, num_accepted):
        pass

    def reset(self):
        pass


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft", ["itself", "unrelated", "unrelated-int8", "constant"])
def test_int8_speculative_equals_int8_plain(arch, draft):
    target = int8_tiny(arch)
    drafts = {
        "itself": lambda: ModelDrafter(HFRunner(target)),
        "unrelated": lambda: ModelDrafter(HFRunner(tiny_model("llama", 5))),
        "unrelated-int8": lambda: ModelDrafter(HFRunner(int8_tiny("qwen2", 6))),
        "constant": ConstantDrafter,
    }
    rng = random.Random(draft)
    for prompt_len in (1, 17):
        prompt = [rng.randrange(3, VOCAB) for _ in range(prompt_len)]
        plain = run(HFRunner(target), prompt, StopCondition(24))
        for gamma in (1, 2, 3, 5, 8):
            spec = run(HFRunner(target), prompt, StopCondition(24), drafter=drafts[draft](), num_speculative_tokens=gamma)
            assert spec.token_ids == plain.token_ids, (prompt_len, gamma)
            assert spec.stats.drafted > 0
            if draft == "itself":
                assert spec.stats.accepted == spec.stats.drafted


# --------------------------------------------------------------------------- saving, loading, caching


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_load_give_the_same_model(arch, tmp_path):
    model = int8_tiny(arch)
    save_int8(model, tiny_tokenizer(0), tmp_path / "m")
    loaded, tokenizer = load_int8(tmp_path / "m")
    # The tokenizer comes back as transformers loads it from any folder of that model type.
    from transformers import AutoTokenizer

    model.config.save_pretrained(tmp_path / "ref")
    tiny_tokenizer(0).save_pretrained(tmp_path / "ref")
    reference = AutoTokenizer.from_pretrained(tmp_path / "ref")
    text = "def fibonacci(n):\n    return n"
    assert is_int8(loaded) and tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    ids = torch.tensor([[3, 5, 7, 11, 13, 17]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    prompt = [4, 8, 15, 16, 23]
    assert run(HFRunner(loaded), prompt, StopCondition(20)).token_ids == run(HFRunner(model), prompt, StopCondition(20)).token_ids


def test_load_int8_refuses_a_folder_without_an_int8_model(tmp_path):
    with pytest.raises(ValueError, match="no int8 model"):
        load_int8(tmp_path)


def test_load_hf_quantizes_once_then_loads_the_cache(tmp_path, monkeypatch):
    from specdec.native import quant
    from specdec.runtime import loading
    from tests.tiny import save_tiny

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    folder = save_tiny(tmp_path / "m", "qwen2", seed=3)
    first, _ = loading.load_hf(folder, dtype="int8")
    assert is_int8(first)
    cached = list((tmp_path / "home" / "int8").iterdir())
    assert len(cached) == 1 and quant.saved_index(cached[0])["dir"].startswith(str((tmp_path / "m").resolve()))

    def boom(model):
        raise AssertionError("quantized again")

    monkeypatch.setattr(quant, "quantize_model", boom)
    second, _ = loading.load_hf(folder, dtype="int8")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)
