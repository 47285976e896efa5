"""Backend contract for the transformers runner.

Random forward/rollback sequences must leave the runner giving the same logits
as a fresh runner fed the same tokens in one go (fp32; batched and incremental
evaluation agree to float rounding, not bitwise).
"""

import random

import pytest
import torch

from specdec.backends.hf import HFRunner
from tests.tiny import VOCAB, tiny_model

ARCHS = ("llama", "qwen2", "gemma3")
MODELS = {arch: tiny_model(arch, 3, layers=3) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", range(8))
def test_random_forward_rollback_matches_fresh_runner(arch, seed):
    rng = random.Random(seed)
    runner = HFRunner(MODELS[arch])
    for _ in range(16):  # long enough to pass gemma3's sliding window of 6
        if runner.tokens and rng.random() < 0.4:
            runner.rollback(rng.randrange(0, len(runner.tokens) + 1))
            continue
        new = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        logits = runner.forward(new)
        assert logits.shape == (len(new), runner.vocab_size)
        assert logits.dtype == torch.float32
        fresh = HFRunner(MODELS[arch]).forward(runner.tokens)[-len(new):]
        torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)
        assert runner.cache.get_seq_length() == len(runner.tokens)


def test_last_n_returns_only_the_last_positions():
    runner = HFRunner(MODELS["llama"])
    full = HFRunner(MODELS["llama"]).forward([5, 6, 7, 8])
    last = runner.forward([5, 6, 7, 8], last_n=1)
    assert last.shape == (1, VOCAB)
    torch.testing.assert_close(last[0], full[-1], rtol=1e-5, atol=1e-5)


def test_rollback_bounds_and_reset():
    runner = HFRunner(MODELS["llama"])
    runner.forward([1, 2, 3])
    runner.rollback(5)  # past the end: nothing to drop
    assert runner.tokens == [1, 2, 3]
    runner.rollback(0)
    assert runner.tokens == [] and runner.cache.get_seq_length() == 0
    with pytest.raises(ValueError):
        runner.rollback(-1)


def test_bf16_runner_returns_fp32_logits():
    model = tiny_model("llama", 3).to(torch.bfloat16)
    logits = HFRunner(model).forward([3, 4, 5])
    assert logits.dtype == torch.float32
