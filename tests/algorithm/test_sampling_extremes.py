"""The warp at extreme temperatures and logits: every positive temperature gives a distribution.

OpenAI allows temperatures in [0, 2], so 1e-300 is a valid request: dividing float32 logits by it
overflows to inf and softmax then gives NaN.  As T -> 0 the distribution tends to the argmax
(ties sharing its mass), and that limit is what the warp must return, in every path that warps
logits: the target's choice and verification, a draft model, both vocabularies of the universal
drafter.  The exact-distribution tests (test_sampling*.py, test_verify_sampling.py) cover the
usual temperatures, where the warp is bit for bit the plain division it always was.
"""

from __future__ import annotations

import sys

import pytest
import torch

from specdec.algorithm.loop import StopCondition, run
from specdec.algorithm.sampling import SamplingParams, limit_scores, make_generator, sample_from, scaled_logits, warp_probs
from specdec.algorithm.verify import make_verifier
from specdec.backends.hf import HFRunner
from specdec.bridge import TextBridge, VocabularyMap
from specdec.drafters.model import ModelDrafter
from specdec.drafters.universal import UniversalDrafter
from specdec.errors import SpecdecError
from tests.tiny import tiny_model, tiny_tokenizer

SMALLEST_SUBNORMAL = 5e-324  # the smallest positive float64
TINY = [1e-30, 1e-38, 1e-40, 1e-45, 1e-46, 1e-300, sys.float_info.min / 3, SMALLEST_SUBNORMAL]


def one_hot(index: int, size: int) -> torch.Tensor:
    out = torch.zeros(size)
    out[index] = 1.0
    return out


@pytest.mark.parametrize("temperature", TINY)
def test_a_tiny_temperature_is_the_argmax(temperature):
    logits = torch.tensor([1.5, 3.25, -2.0, 3.0, 0.0])
    probs = warp_probs(logits, SamplingParams(temperature=temperature))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, one_hot(1, 5), rtol=0, atol=0)


@pytest.mark.parametrize("temperature", TINY)
def test_ties_at_the_maximum_share_its_mass(temperature):
    logits = torch.tensor([[7.0, -1.0, 7.0, 6.999], [-5.0, -5.0, -5.0, -9.0]])  # all-negative rows too
    probs = warp_probs(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.0, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3, 0.0]]))


@pytest.mark.parametrize("temperature", [1e-300, SMALLEST_SUBNORMAL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_any_logits_dtype(temperature, dtype):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(dtype)  # [3, 50]
    probs = warp_probs(logits, SamplingParams(temperature=temperature))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert torch.equal(probs.argmax(-1), logits.float().argmax(-1))


@pytest.mark.parametrize("temperature", [1e-300, 1e-45])
def test_top_k_and_top_p_at_a_tiny_temperature(temperature):
    logits = torch.tensor([2.0, 9.0, 9.0, 1.0, 8.0])
    for top_k, top_p in ((1, 1.0), (2, 1.0), (3, 0.3), (0, 1e-9)):
        probs = warp_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]))


@pytest.mark.parametrize("top_p", [1e-46, 1e-300, SMALLEST_SUBNORMAL])
def test_a_top_p_below_float32s_range_keeps_the_argmax(top_p):
    logits = torch.tensor([[2.0, 9.0, 8.0], [5.0, 5.0, 1.0]])
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]))


def test_a_tiny_temperature_samples_the_argmax():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    probs = warp_probs(logits, SamplingParams(temperature=1e-300))
    gen = make_generator(0)
    assert {sample_from(probs, gen) for _ in range(50)} == {int(logits.argmax())}


def test_the_usual_temperatures_are_a_plain_division_bit_for_bit():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2)) * 5
    for temperature in (1e-30, 1e-4, 0.3, 1.0, 2.0):
        assert torch.equal(scaled_logits(logits, temperature), logits / temperature)


def test_the_shifted_scores_give_the_same_distribution():
    """Where both work, the overflow-free path and the plain division agree."""
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3)) * 5
    for temperature in (1e-3, 0.3, 1.0, 2.0):
        torch.testing.assert_close(torch.softmax(limit_scores(logits, temperature), -1),
                                   torch.softmax(logits / temperature, -1), rtol=1e-5, atol=1e-7)


def test_the_limit_is_continuous_across_the_switch():
    """The temperatures just above and below where the division overflows give the same one-hot."""
    logits = torch.tensor([30.0, 29.9, -4.0])
    for temperature in (1e-36, 1e-37, 1e-38, 1e-39):  # 30 / 1e-37 overflows float32
        torch.testing.assert_close(warp_probs(logits, SamplingParams(temperature=temperature)), one_hot(0, 3))


def test_infinite_and_nan_logits():
    params = SamplingParams(temperature=0.7)
    inf, nan = float("inf"), float("nan")
    torch.testing.assert_close(warp_probs(torch.tensor([1.0, inf, 3.0, inf]), params),
                               torch.tensor([0.0, 0.5, 0.0, 0.5]))
    probs = warp_probs(torch.tensor([1.0, nan, 1.0, -inf]), params)  # NaN and -inf: never chosen
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match="no finite value"):
        warp_probs(torch.tensor([-inf, nan]), params)


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -SMALLEST_SUBNORMAL])
def test_temperatures_that_are_not_finite_and_positive_are_refused(temperature):
    with pytest.raises(SpecdecError, match="temperature"):
        SamplingParams(temperature=temperature)


# --------------------------------------------------------------------------- through the decode loop

TARGET_MODEL = tiny_model("llama", 0)
DRAFT_MODEL = tiny_model("llama", 1)
PROMPT = [5, 9, 13, 21, 40]


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, SMALLEST_SUBNORMAL])
@pytest.mark.parametrize("drafter", ["plain", "self", "other"])
def test_a_tiny_temperature_decodes_the_greedy_tokens(temperature, drafter):
    greedy = run(HFRunner(TARGET_MODEL), PROMPT, StopCondition(16)).token_ids
    params = SamplingParams(temperature=temperature, seed=0)
    draft = {"plain": None, "self": ModelDrafter(HFRunner(TARGET_MODEL), params),
             "other": ModelDrafter(HFRunner(DRAFT_MODEL), params)}[drafter]
    out = run(HFRunner(TARGET_MODEL), PROMPT, StopCondition(16), drafter=draft, num_speculative_tokens=3,
              verifier=make_verifier(params))
    assert out.token_ids == greedy
    if drafter == "self":
        assert out.stats.accepted == out.stats.drafted > 0


@pytest.mark.parametrize("mode", ["text", "intersection"])
def test_a_tiny_temperature_through_the_universal_drafter(mode):
    """Both vocabularies: the draft's (text mode samples over all of it) and the shared one."""
    target_tok, draft_tok = tiny_tokenizer(0), tiny_tokenizer(1)
    target = tiny_model("llama", 0, vocab_size=len(target_tok))
    draft = tiny_model("qwen2", 1, vocab_size=len(draft_tok))
    vocab_map = VocabularyMap.from_tokenizers(target_tok, draft_tok, len(target_tok), len(draft_tok)) \
        if mode == "intersection" else None
    prompt = target_tok("def fibonacci(n):")["input_ids"]
    greedy = run(HFRunner(target), prompt, StopCondition(20)).token_ids
    params = SamplingParams(temperature=1e-300, seed=0)
    drafter = UniversalDrafter(HFRunner(draft), TextBridge(target_tok, draft_tok), params, vocab_map)
    out = run(HFRunner(target), prompt, StopCondition(20), drafter=drafter, num_speculative_tokens=3,
              verifier=make_verifier(params))
    assert out.token_ids == greedy and out.stats.drafted > 0
