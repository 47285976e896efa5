"""Stairs verification (specdec.algorithm.stairs): greedy output identical to plain greedy (fp32 tiny models).

The staircase over a ModelRunner (folded into one forward, and row by row),
and over a cache-less black-box model; drafts that are always right (the
target itself), mostly wrong (another random model), always wrong (a constant
token), that contain the end-of-sequence token, and that are longer than what
is left to generate.  Also the staircase's rows and costs, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.algorithm.loop import StopCondition, run
from specdec.algorithm.sampling import SamplingParams
from specdec.algorithm.stairs import BlackBoxNextToken, RunnerNextToken, StairsRunner, is_staircase, stairs_runner
from specdec.backends.hf import HFRunner
from specdec.drafters.model import ModelDrafter
from specdec.errors import SpecdecError
from specdec.runtime.engine import Engine
from tests.tiny import VOCAB, assert_near_tie_parting, tiny_model, tiny_tokenizer
from tests.toy import ConstantDrafter

ARCHS = ("llama", "qwen2")
MODELS = {(arch, seed): tiny_model(arch, seed) for arch in ARCHS for seed in (0, 1)}
ADAPTERS = ("runner", "rows", "blackbox")


def stairs_target(adapter: str, arch: str) -> StairsRunner:
    model = MODELS[(arch, 0)]
    if adapter == "blackbox":
        return StairsRunner(BlackBoxNextToken(model))
    return stairs_runner(HFRunner(model), nested=adapter == "runner")


def drafter(kind: str, arch: str):
    if kind == "constant":
        return ConstantDrafter(7)
    return ModelDrafter(HFRunner(MODELS[(arch, 0 if kind == "self" else 1)]))


def plain(arch: str, prompt: list[int], stop: StopCondition):
    return run(HFRunner(MODELS[(arch, 0)]), prompt, stop)


def test_is_staircase():
    assert is_staircase([[1], [1, 2], [1, 2, 3]])
    assert is_staircase([[4, 5]])
    assert not is_staircase([[1], [1, 2], [1, 2, 3, 4]])  # a step of two
    assert not is_staircase([[1], [2, 2]])  # not a prefix


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_staircase_rows_are_the_causal_logits(adapter):
    # Row i of the staircase is the prediction after the cached tokens plus new[: i + 1]:
    # exactly what a causal forward over the new tokens gives at position i.
    model = MODELS[("llama", 0)]
    prompt, new = [5, 9, 13, 21, 8], [30, 31, 40, 11]
    causal = HFRunner(model)
    causal.forward(prompt)
    expected = causal.forward(new)  # [4, V]
    target = stairs_target(adapter, "llama")
    target.forward(prompt, last_n=1)
    got = target.forward(new)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert target.tokens == prompt + new


@pytest.mark.parametrize("nested, positions, after_rollback", [(True, 5, 2), (False, 1 + 2 + 3 + 4 + 5, 1 + 2)])
def test_staircase_cost_in_token_positions(nested, positions, after_rollback):
    # Folded, a staircase of k + 1 rows costs k + 1 positions (as causal verification); row by row
    # over the shared prefix it costs 1 + 2 + ... + (k + 1).
    next_token = RunnerNextToken(HFRunner(MODELS[("llama", 0)]), nested=nested)
    target = StairsRunner(next_token)
    target.forward([5, 9, 13, 21, 8], last_n=1)
    before = next_token.positions
    target.forward([30, 31, 40, 11, 12])
    assert next_token.positions - before == positions
    # the accepted prefix stays cached: after a rollback only what is new is computed
    target.rollback(7)
    before = next_token.positions
    target.forward([31, 3])
    assert next_token.positions - before == after_rollback


def test_black_box_recomputes_every_row():
    box = BlackBoxNextToken(MODELS[("llama", 0)])
    target = StairsRunner(box)
    target.forward([5, 9, 13], last_n=1)
    assert box.positions == 3
    target.forward([8, 30, 31])  # rows of 4, 5 and 6 tokens, padded to 6
    assert box.positions == 3 + 3 * 6


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("kind", ["self", "random", "constant"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 5, 8])
def test_stairs_greedy_equals_plain_greedy(arch, adapter, kind, gamma):
    prompt = [5, 9, 13, 2 + gamma]
    stop = StopCondition(40)
    reference = plain(arch, prompt, stop)
    out = run(stairs_target(adapter, arch), prompt, stop, drafter=drafter(kind, arch), num_speculative_tokens=gamma)
    assert out.token_ids == reference.token_ids
    if kind == "self":
        assert out.stats.acceptance_rate == 1.0
    if kind == "constant":
        assert out.stats.drafted > 0


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_plain_decoding_through_the_staircase(adapter):
    # One-row staircases: the next-token-only target decodes plainly to the same tokens.
    prompt = [3, 44, 17]
    stop = StopCondition(30)
    assert run(stairs_target(adapter, "qwen2"), prompt, stop).token_ids == plain("qwen2", prompt, stop).token_ids


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("gamma", [2, 6])
def test_eos_inside_the_draft(adapter, gamma):
    # The 6th token of plain decoding is made the end-of-sequence token: the target-as-draft proposes
    # it in the middle of a draft, and generation must end right there, as plain decoding does.
    prompt = [5, 9, 13]
    free = plain("llama", prompt, StopCondition(30)).token_ids
    eos = frozenset({free[5]})
    stop = StopCondition(30, eos_token_ids=eos)
    reference = plain("llama", prompt, stop)
    assert reference.finish_reason == "stop" and reference.token_ids[-1] in eos
    out = run(stairs_target(adapter, "llama"), prompt, stop, drafter=drafter("self", "llama"),
              num_speculative_tokens=gamma)
    assert out.token_ids == reference.token_ids and out.finish_reason == "stop"


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("max_new", [1, 2, 3])
def test_draft_longer_than_what_is_left(adapter, max_new):
    prompt = [5, 9, 13, 40]
    stop = StopCondition(max_new)
    out = run(stairs_target(adapter, "llama"), prompt, stop, drafter=drafter("self", "llama"),
              num_speculative_tokens=8)
    assert out.token_ids == plain("llama", prompt, stop).token_ids
    assert len(out.token_ids) == max_new


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=20), gamma=st.integers(1, 8),
       kind=st.sampled_from(["self", "random", "constant"]))
def test_stairs_on_generated_prompts(prompt, gamma, kind):
    stop = StopCondition(24)
    out = run(stairs_target("runner", "qwen2"), prompt, stop, drafter=drafter(kind, "qwen2"),
              num_speculative_tokens=gamma)
    # fp32: the staircase's rows are computed by other kernels than one-token steps (near-ties may part)
    assert_near_tie_parting(MODELS[("qwen2", 0)], prompt, out.token_ids, plain("qwen2", prompt, stop).token_ids)


@pytest.fixture(scope="module")
def engine():
    tokenizer = tiny_tokenizer()
    target = tiny_model("llama", 0, vocab_size=len(tokenizer))
    draft = tiny_model("llama", 1, vocab_size=len(tokenizer))
    return Engine(target, tokenizer, draft, tokenizer)


def test_engine_stairs_equals_plain(engine):
    prompt = "def fibonacci(n):"
    reference = engine.generate(prompt, max_new_tokens=24, use_draft=False)
    for k in (1, 4, "auto"):
        out = engine.generate(prompt, max_new_tokens=24, num_speculative_tokens=k, verify="stairs")
        assert out.token_ids == reference.token_ids
    # a causal request after a stairs one on the same engine starts from a fresh cache
    assert engine.generate(prompt, max_new_tokens=24, num_speculative_tokens=3).token_ids == reference.token_ids


def test_engine_refuses_stairs_sampling_and_unknown_modes(engine):
    with pytest.raises(SpecdecError, match="greedy only"):
        engine.generate("x = 1", max_new_tokens=4, verify="stairs", sampling=SamplingParams(temperature=0.8))
    with pytest.raises(SpecdecError, match="unknown verification 'tree'"):
        engine.generate("x = 1", max_new_tokens=4, verify="tree")
