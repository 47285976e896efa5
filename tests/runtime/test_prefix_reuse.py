"""Prefix reuse across requests (specdec.algorithm.loop.decode's reuse_prefix, Engine.prefix_cache): a later turn of a
conversation prefills only what the target's cache does not hold, with the output of a fresh prefill, bit
for bit, on batch-invariant (int8) targets; other targets prefill anew."""

from __future__ import annotations

import random

import pytest

from specdec.algorithm.control import AutoK, Costs
from specdec.algorithm.loop import StopCondition, run
from specdec.algorithm.sampling import SamplingParams
from specdec.algorithm.verify import make_verifier
from specdec.backends.base import common_prefix_length, reusable_prefix
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.model import ModelDrafter
from specdec.native.lean import LeanRunner
from specdec.native.quant import quantize_model
from specdec.runtime.engine import Engine
from tests.tiny import VOCAB, tiny_model, tiny_tokenizer

TARGET = quantize_model(tiny_model("qwen2", 0))
DRAFT = quantize_model(tiny_model("qwen2", 1))


def conversation(seed: int) -> tuple[list[int], list[int]]:
    """A first prompt and the user's next message."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 40))], [rng.randrange(3, VOCAB) for _ in range(7)]


def drafter(kind: str, sampling: SamplingParams, runner: LeanRunner | None = None) -> ModelDrafter | HybridDrafter | None:
    """No drafter (plain), the draft model, or prompt lookup before it; over `runner` (default: a new one)."""
    if kind == "plain":
        return None
    model = ModelDrafter(runner or LeanRunner(DRAFT), sampling)
    return model if kind == "model" else HybridDrafter(model)


def k_for(kind: str, temperature: float) -> int | AutoK:
    """The cost-model controller for the greedy hybrid, else a fixed 3: the controller's k depends on measured
    times, and a sampled output on the k of each step (its distribution does not), so two sampled runs are
    compared at the same k."""
    return AutoK(Costs({1: 10.0, 4: 11.0, 8: 13.0}, 2.0), max_k=6) if kind == "hybrid" and not temperature else 3


@pytest.mark.parametrize("kind", ["plain", "model", "hybrid"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("edited", [False, True])
def test_a_later_turn_reuses_the_cached_prefix_and_decodes_what_a_fresh_prefill_decodes(kind, temperature, seed,
                                                                                      edited):
    """The next turn's prompt holds the first turn's answer (or, edited, only its first half: the cache holds
    more than the prompt shares with it, and must drop the rest)."""
    sampling = SamplingParams(temperature=temperature, seed=seed)
    first, message = conversation(seed)
    target, draft_runner = LeanRunner(TARGET), LeanRunner(DRAFT)  # both keep their caches between the turns
    turn1 = run(target, first, StopCondition(20), drafter=drafter(kind, sampling, draft_runner),
                num_speculative_tokens=k_for(kind, temperature), verifier=make_verifier(sampling), reuse_prefix=True)
    assert turn1.stats.reused_prompt_tokens == 0  # an empty cache
    answer = turn1.token_ids[: len(turn1.token_ids) // 2] if edited else turn1.token_ids
    second = first + answer + message
    cached = list(target.tokens)
    sampling2 = SamplingParams(temperature=temperature, seed=seed + 10)
    turn2 = run(target, second, StopCondition(20), drafter=drafter(kind, sampling2, draft_runner),
                num_speculative_tokens=k_for(kind, temperature),
                verifier=make_verifier(sampling2), reuse_prefix=True)
    fresh = run(LeanRunner(TARGET), second, StopCondition(20), drafter=drafter(kind, sampling2),
                num_speculative_tokens=k_for(kind, temperature), verifier=make_verifier(sampling2))
    assert turn2.token_ids == fresh.token_ids  # bit for bit: int8 rows do not depend on how forwards split
    reused = turn2.stats.reused_prompt_tokens
    assert reused == common_prefix_length(cached, second) >= len(first) + len(answer) - 1
    assert fresh.stats.reused_prompt_tokens == 0


def test_the_draft_model_keeps_its_cached_prompt_across_generations():
    """A ModelDrafter's reset keeps its runner's cache where it follows the context from its start: the next
    generation's first draft feeds only what is new (Draft.synced), and drafts what a fresh draft drafts."""
    first, message = conversation(3)
    target = LeanRunner(TARGET)
    draft = ModelDrafter(LeanRunner(DRAFT))
    out = run(target, first, StopCondition(12), drafter=draft, num_speculative_tokens=3, reuse_prefix=True)
    second = first + out.token_ids + message
    held = common_prefix_length(draft.runner.tokens, second)
    assert held >= len(first)
    draft.reset()
    assert draft.cache.lag(second) == len(second) - held
    proposal = draft.propose(second, 4)
    assert proposal.synced == len(second) - held
    assert proposal.tokens == ModelDrafter(LeanRunner(DRAFT)).propose(second, 4).tokens


def test_targets_that_are_not_batch_invariant_prefill_anew():
    fp32 = LeanRunner(tiny_model("qwen2", 0), fp32=True)
    assert not fp32.capabilities.batch_invariant
    first, message = conversation(4)
    out = run(fp32, first, StopCondition(8), reuse_prefix=True)
    second = first + out.token_ids + message
    assert reusable_prefix(fp32, second) == 0
    again = run(fp32, second, StopCondition(8), reuse_prefix=True)
    assert again.stats.reused_prompt_tokens == 0 and fp32.tokens[: len(second)] == second
    int8 = LeanRunner(TARGET)
    int8.forward(first)
    assert reusable_prefix(int8, first) == len(first) - 1  # the last token is fed again, for its logits
    assert reusable_prefix(int8, first[:1] + [0]) == 1


def _engine() -> Engine:
    tok = tiny_tokenizer(0)
    target = quantize_model(tiny_model("qwen2", 0, vocab_size=len(tok)))
    draft = quantize_model(tiny_model("llama", 3, vocab_size=len(tok)))
    return Engine(target, tok, draft, tok, lookup=True)


def test_engine_turns_reuse_their_prefix_forks_keep_their_own_and_forget_drops_it():
    engine = _engine()
    reference = _engine()
    reference.prefix_cache = False
    history = "def fibonacci(n):"
    for turn in range(3):
        got = engine.generate(history, max_new_tokens=12, k="auto")
        want = reference.generate(history, max_new_tokens=12, k="auto")
        assert got.token_ids == want.token_ids and want.stats.reused_prompt_tokens == 0
        assert (got.stats.reused_prompt_tokens > 0) is (turn > 0)
        history += got.text + f" # turn {turn}\n"
    twin = engine.fork()
    assert twin.target_runner is not engine.target_runner and twin.draft_runner is not engine.draft_runner
    assert twin.target_runner.model is engine.target_runner.model and twin.prefix_cache
    assert twin.generate(history, max_new_tokens=4).stats.reused_prompt_tokens == 0  # its own, empty cache
    assert engine.generate(history, max_new_tokens=4).stats.reused_prompt_tokens > 0
    engine.forget()
    assert engine.generate(history, max_new_tokens=4).stats.reused_prompt_tokens == 0


def test_a_request_that_fails_inside_a_step_leaves_nothing_for_the_next_to_reuse(monkeypatch):
    """A forward that raises half way (here: the target's third forward) may leave a cache that does not hold
    its tokens; the engine empties the caches, and the next request prefills anew and decodes what a fresh
    engine decodes."""
    engine, reference = _engine(), _engine()
    prompt = "def fibonacci(n):"
    engine.generate(prompt, max_new_tokens=8)
    runner = engine.target_runner
    forward, calls = runner.forward, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            runner.tokens.append(0)  # as a forward that failed after appending would leave it
            raise RuntimeError("a forward failed")
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", failing)
    with pytest.raises(RuntimeError, match="failed"):
        engine.generate(prompt + " return", max_new_tokens=8)
    assert runner.tokens == []
    monkeypatch.setattr(runner, "forward", forward)
    again = engine.generate(prompt + " return", max_new_tokens=8)
    assert again.stats.reused_prompt_tokens == 0
    assert again.token_ids == reference.generate(prompt + " return", max_new_tokens=8).token_ids


@pytest.mark.parametrize("length", [1, 5, 12, 13, 40])
def test_a_prompt_prefilled_in_chunks_is_bitwise_one_forward(length):
    import torch

    from specdec.backends.base import forward_chunked
    from specdec.backends.hf import HFRunner

    prompt = [random.Random(length).randrange(3, VOCAB) for _ in range(length)]
    whole, chunked = LeanRunner(TARGET), LeanRunner(TARGET)
    one = whole.forward(prompt, last_n=2)
    sizes = []
    feed = chunked.forward
    chunked.forward = lambda tokens, last_n=None: (sizes.append(len(tokens)), feed(tokens, last_n))[1]
    split = forward_chunked(chunked, prompt, last_n=2, chunk=4)  # 40 tokens: ten forwards
    assert torch.equal(one, split) and chunked.tokens == whole.tokens == prompt
    assert sum(sizes) == length and sizes[-1] == min(4, length) and max(sizes) <= 4 and len(sizes) == -(-length // 4)
    step = [7]  # and the next step's logits, over caches written in chunks or at once
    assert torch.equal(whole.forward(step), chunked.forward(step))
    fp32 = HFRunner(tiny_model("qwen2", 0))  # not batch-invariant: one forward, as before
    calls = []
    forward = fp32.forward
    fp32.forward = lambda tokens, last_n=None: (calls.append(len(tokens)), forward(tokens, last_n))[1]
    forward_chunked(fp32, prompt, chunk=4)
    assert calls == [length]


def test_a_generation_with_its_prompt_in_chunks_is_the_same(monkeypatch):
    import functools

    from specdec.algorithm import loop
    from specdec.backends.base import forward_chunked

    prompt, _ = conversation(7)
    expected = run(LeanRunner(TARGET), prompt, StopCondition(24), drafter=drafter("hybrid", SamplingParams()),
                   num_speculative_tokens=k_for("hybrid", 0.0)).token_ids
    monkeypatch.setattr(loop, "forward_chunked", functools.partial(forward_chunked, chunk=3))
    chunked = run(LeanRunner(TARGET), prompt, StopCondition(24), drafter=drafter("hybrid", SamplingParams()),
                  num_speculative_tokens=k_for("hybrid", 0.0)).token_ids
    assert chunked == expected and len(prompt) > 3
