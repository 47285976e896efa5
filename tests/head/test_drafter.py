"""The head as a drafter through the decode loop: greedy output is plain greedy's (fp32 up to near-ties, int8
bitwise), the head's cache always holds the target's own features of the context, sampling returns a q that
lives on the draft vocabulary, and the head is accepted on the text it was trained on."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from specdec.algorithm.control import Controller
from specdec.algorithm.draft import Draft, TreeShape
from specdec.algorithm.loop import StopCondition, run
from specdec.algorithm.sampling import SamplingParams
from specdec.algorithm.verify import make_verifier
from specdec.backends.hf import HFRunner
from specdec.errors import SpecdecError
from specdec.head.drafter import CONFIDENCE_GRADES, HeadDrafter, confidence_grade
from specdec.head.model import HeadCache
from specdec.head.store import TrainResult
from specdec.native.lean import LeanRunner
from specdec.native.quant import quantize_model
from tests.head.conftest import target_pass
from tests.tiny import assert_near_tie_parting, tiny_model

STOP = StopCondition(max_new_tokens=40)


def prompts(text: list[list[int]]) -> list[list[int]]:
    """Two prompts from the training text (the head knows what follows) and one it never saw."""
    return [text[1][:5], text[3][:9], [1, 50, 7, 88, 13]]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_is_plain_greedy_fp32(k: int, target: torch.nn.Module, text: list[list[int]],
                                     trained: TrainResult) -> None:
    runner = HFRunner(target)
    accepted = 0
    for prompt in prompts(text):
        reference = run(runner, prompt, STOP).token_ids
        out = run(runner, prompt, STOP, HeadDrafter(trained.head, runner), k)
        assert_near_tie_parting(target, prompt, out.token_ids, reference)
        assert out.stats.drafted > 0
        accepted += out.stats.accepted
    assert accepted > 0


def test_accepted_on_the_text_it_was_trained_on(target: torch.nn.Module, text: list[list[int]],
                                                trained: TrainResult) -> None:
    runner = HFRunner(target)
    out = run(runner, text[2][:4], STOP, HeadDrafter(trained.head, runner), 3)
    assert out.stats.accepted > 0, out.stats


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_is_bitwise_plain_greedy_int8(k: int, text: list[list[int]], trained: TrainResult) -> None:
    runner = LeanRunner(quantize_model(tiny_model("llama", seed=0)))  # the head's target, in int8
    for prompt in prompts(text):
        reference = run(runner, prompt, STOP).token_ids
        out = run(runner, prompt, STOP, HeadDrafter(trained.head, runner), k)
        assert out.token_ids == reference


@pytest.mark.parametrize("width,k", [(2, 3), (3, 4)])
def test_tree_drafts_are_bitwise_plain_greedy_int8(width: int, k: int, text: list[list[int]],
                                                   trained: TrainResult) -> None:
    runner = LeanRunner(quantize_model(tiny_model("llama", seed=0)))
    trees = 0
    for prompt in prompts(text):
        reference = run(runner, prompt, STOP).token_ids
        drafter = HeadDrafter(trained.head, runner)
        out = run(runner, prompt, STOP, drafter, k, tree=TreeShape(width, depth=k))
        assert out.token_ids == reference
        trees += out.stats.tree_steps
    assert trees > 0


class Checked(HeadDrafter):
    """A head drafter that checks, at every proposal, that the pairs it feeds are the target's own features
    (one teacher-forced pass over the context) of the right positions with the tokens after them, and that
    its cache holds exactly the pairs before them."""

    def __init__(self, *args, model: torch.nn.Module) -> None:
        super().__init__(*args)
        self.model, self.synced, self.restarts = model, [], 0

    def sync(self, context: Sequence[int]):
        base = self.base
        pairs = super().sync(context)
        if pairs is not None:
            features, tokens = pairs
            start = len(context) - 1 - len(tokens)  # position of the first new pair
            assert tokens == list(context[start + 1:])
            expected = target_pass(self.model, torch.tensor([list(context[:-1])]))[0][0, start:]  # [n, H]
            assert torch.allclose(features, expected, rtol=1e-4, atol=1e-4)
            assert self.cache.length == start - self.base and self.fed == list(context[self.base + 1: start + 1])
            self.restarts += bool(self.synced) and self.base != base  # the first sync starts the cache anyway
            self.synced.append(len(tokens))
        return pairs


class Pattern(Controller):
    """A controller that drafts k or takes plain steps in a fixed repeating pattern."""

    def __init__(self, pattern: list[int]) -> None:
        self.pattern, self.step = pattern, 0

    def choose(self, limit: int, lag: int = 0, source: str = "model", grade: str | None = None) -> int:
        k = min(self.pattern[self.step % len(self.pattern)], limit)
        self.step += 1
        return k

    def observe(self, *args, **kwargs) -> None:
        pass

    def reset(self) -> None:
        self.step = 0


@pytest.mark.parametrize("pattern", [[3], [3, 0], [2, 0, 0], [4, 0, 1]])
def test_the_heads_cache_follows_the_context(pattern: list[int], target: torch.nn.Module, text: list[list[int]],
                                             trained: TrainResult) -> None:
    """Draft steps with one or two plain steps between them (their rows join the verification's kept rows: the
    head never starts over): the pairs fed are always the target's features and the next tokens."""
    runner = HFRunner(target)
    prompt = text[4][:6]
    drafter = Checked(trained.head, runner, model=target)
    out = run(runner, prompt, STOP, drafter, Pattern(pattern))
    assert_near_tie_parting(target, prompt, out.token_ids, run(runner, prompt, STOP).token_ids)
    assert drafter.synced[0] == len(prompt)  # the prompt's rows (fewer than the window) seed the head
    assert all(1 <= n <= max(pattern) + 1 + pattern.count(0) for n in drafter.synced[1:])
    assert drafter.restarts == 0  # no feature is lost, however many plain steps come in a row


class Graded(Pattern):
    """A Pattern controller that keeps the grade it is told at each step."""

    def __init__(self, pattern: list[int]) -> None:
        super().__init__(pattern)
        self.grades: list[str | None] = []

    def choose(self, limit: int, lag: int = 0, source: str = "model", grade: str | None = None) -> int:
        self.grades.append(grade)
        return super().choose(limit, lag, source, grade)


def test_confidence_grades() -> None:
    assert [confidence_grade(p) for p in (1.0, 0.8, 0.79, 0.5, 0.2, 0.19, 0.0)] == [
        "q>=0.8", "q>=0.8", "q>=0.5", "q>=0.5", "q>=0.2", "q>=0", "q>=0"]
    assert confidence_grade(float("nan")) == "q>=0"


@pytest.mark.parametrize("pattern", [[3], [2, 0], [1, 0, 0]])
def test_the_head_grades_each_step_by_its_confidence_and_feeds_once(pattern: list[int], target: torch.nn.Module,
                                                                     text: list[list[int]],
                                                                     trained: TrainResult) -> None:
    """The controller is told the head's confidence in its first token at every step; grading runs the draft's
    first head forward, which the proposal reuses: one feed a step, drafting or not, and the output is plain's."""
    runner = HFRunner(target)
    prompt = text[4][:6]
    drafter, controller = Checked(trained.head, runner, model=target), Graded(pattern)
    out = run(runner, prompt, STOP, drafter, controller)
    assert_near_tie_parting(target, prompt, out.token_ids, run(runner, prompt, STOP).token_ids)
    assert controller.grades and set(controller.grades) <= {confidence_grade(b) for b in CONFIDENCE_GRADES}
    assert len(drafter.synced) == len(controller.grades) and drafter.restarts == 0


def test_a_graded_proposal_is_the_ungraded_one(target: torch.nn.Module, text: list[list[int]],
                                               trained: TrainResult) -> None:
    runner = HFRunner(target)
    for prompt in prompts(text):
        runner.reset()
        runner.forward(prompt[:-1], last_n=1)
        ungraded = HeadDrafter(trained.head, runner).propose(prompt, 4)
        drafter = HeadDrafter(trained.head, runner)
        grade = drafter.grade(prompt, "model")
        graded = drafter.propose(prompt, 4)
        assert graded.tokens == ungraded.tokens and graded.synced == ungraded.synced
        _, logits = trained.head.extend(HeadCache(), runner.hidden()[-1:], torch.tensor(prompt[-1:]))
        assert grade == confidence_grade(float(torch.softmax(logits, -1).max()))
        assert drafter.propose(prompt, 4).tokens == ungraded.tokens  # drafted again from the same context


def test_a_head_that_drafts_nothing_for_more_than_its_window_starts_over(target: torch.nn.Module,
                                                                         text: list[list[int]],
                                                                         trained: TrainResult) -> None:
    """It keeps the features of the last `window` positions only: three plain steps after a draft of two, with a
    window of 2, lose the first ones, and the head starts over from the kept ones; the output is plain's."""
    runner = HFRunner(target)
    prompt = text[4][:6]
    drafter = Checked(trained.head, runner, None, 2, model=target)
    out = run(runner, prompt, STOP, drafter, Pattern([2, 0, 0, 0]))
    assert_near_tie_parting(target, prompt, out.token_ids, run(runner, prompt, STOP).token_ids)
    assert drafter.restarts > 0 and all(n <= 2 for n in drafter.synced)


def test_sampling_q_lives_on_the_draft_vocabulary(target: torch.nn.Module, text: list[list[int]],
                                                  trained: TrainResult) -> None:
    runner = HFRunner(target)
    vocab = trained.head.vocab
    outside = torch.ones(runner.vocab_size, dtype=torch.bool).index_fill(0, vocab, False)  # [V]
    drafts: list[Draft] = []
    for seed in range(4):
        params = SamplingParams(temperature=0.8, top_k=20, seed=seed)
        drafter = HeadDrafter(trained.head, runner, params)
        propose = drafter.propose
        drafter.propose = lambda context, k, source=None, propose=propose: (drafts.append(propose(context, k, source))
                                                                             or drafts[-1])
        out = run(runner, text[1][:5], STOP, drafter, 3, verifier=make_verifier(params))
        assert len(out.token_ids) == STOP.max_new_tokens
    assert drafts and all(d.q is not None and d.q.shape == (len(d.tokens), runner.vocab_size) for d in drafts)
    for d in drafts:
        assert torch.allclose(d.q.sum(-1), torch.ones(len(d.tokens)), atol=1e-5)
        assert (d.q[:, outside] == 0).all()
        assert all(d.q[i, t] > 0 and t in vocab for i, t in enumerate(d.tokens))


def test_a_target_without_hidden_states_or_of_another_vocabulary_is_refused(trained: TrainResult) -> None:
    from specdec.algorithm.stairs import stairs_runner

    with pytest.raises(SpecdecError, match="hidden states"):
        HeadDrafter(trained.head, stairs_runner(HFRunner(tiny_model("llama", 0))))
    with pytest.raises(SpecdecError, match="trained for another target"):
        HeadDrafter(trained.head, HFRunner(tiny_model("llama", 0, vocab_size=32)))


def test_behind_prompt_lookup_in_a_hybrid(target: torch.nn.Module, text: list[list[int]],
                                          trained: TrainResult) -> None:
    """The hybrid reports its lookups' verifications to the head (observe), whose accepted rows it keeps: the head
    drafts right after one and never starts over, and what it feeds is the target's own features; the output
    is plain greedy's."""
    from specdec.drafters.hybrid import HybridDrafter
    from specdec.drafters.lookup import LookupDrafter

    runner = HFRunner(target)
    model = lookup = restarts = 0
    for prompt in prompts(text):
        head = Checked(trained.head, runner, model=target)
        drafter = HybridDrafter(head, LookupDrafter(max_ngram=3, min_ngram=2), short_matches=False)
        out = run(runner, prompt, STOP, drafter, 3)
        assert_near_tie_parting(target, prompt, out.token_ids, run(runner, prompt, STOP).token_ids)
        model, lookup = model + drafter.proposals["model"], lookup + drafter.proposals["lookup"]
        restarts += head.restarts
    assert model > 0 and lookup > 0 and restarts == 0
