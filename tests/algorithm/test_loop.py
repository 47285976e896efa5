"""The decode loop: speculative greedy == plain greedy, token for token (fp32 tiny models).

Drafts: the target itself (all accepted), an unrelated random model (mostly
rejected), and a constant-token drafter (adversarial).  γ = 1..8 and k chosen per
step (a random controller, the cost-model controller), llama and qwen2
architectures, hypothesis-generated prompts.  Also the stop rules, and what a drafter hears of each
target forward (Drafter.target_logits, on the toy target).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specdec.algorithm.control import AutoK
from specdec.algorithm.draft import TreeShape
from specdec.algorithm.loop import StopCondition, collect, decode, run
from specdec.backends.hf import HFRunner
from specdec.drafters.model import DEFAULT_WINDOW, ModelDrafter
from specdec.errors import SpecdecError
from specdec.runtime.profile import step_costs
from specdec.text import EMPTY_PROMPT, PromptError
from tests.tiny import VOCAB, assert_near_tie_parting, tiny_model
from tests.toy import ConstantDrafter, FixedDrafter, RandomK, ToyRunner, ToyTreeRunner, random_proposal, random_table

ARCHS = ("llama", "qwen2")
MODELS = {(arch, seed): tiny_model(arch, seed) for arch in ARCHS for seed in (0, 1)}


def make_drafter(kind: str, arch: str, window: int | None = DEFAULT_WINDOW):
    if kind == "self":
        return ModelDrafter(HFRunner(MODELS[(arch, 0)]), window=window)
    if kind == "random":
        return ModelDrafter(HFRunner(MODELS[(arch, 1)]), window=window)
    return ConstantDrafter(7)


def plain(arch: str, prompt: list[int], max_new: int, eos: frozenset[int] = frozenset()):
    return run(HFRunner(MODELS[(arch, 0)]), prompt, StopCondition(max_new, eos_token_ids=eos))


prompts = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=24)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["self", "random", "constant"])
@pytest.mark.parametrize("gamma", range(1, 9))
def test_speculative_greedy_equals_plain_greedy(arch, kind, gamma):
    prompt = [5, 9, 13, 2 + gamma]
    reference = plain(arch, prompt, 48)
    out = run(HFRunner(MODELS[(arch, 0)]), prompt, StopCondition(48), drafter=make_drafter(kind, arch),
              num_speculative_tokens=gamma)
    assert out.token_ids == reference.token_ids
    assert out.stats.new_tokens == 48
    if kind == "self":
        assert out.stats.acceptance_rate == 1.0
        # every step but the last emits gamma + 1 tokens
        assert out.stats.target_forwards <= 1 + -(-47 // (gamma + 1)) + 1



@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["self", "random", "constant"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window", [DEFAULT_WINDOW, 2])
def test_k_chosen_per_step_equals_plain_greedy(arch, kind, seed, window):
    # A controller may switch between plain steps (k = 0) and drafts of any length at any step; with a
    # catch-up window of 2 the draft model starts over from the last two tokens after plain runs.
    prompt = [5, 9, 13, 2 + seed]
    reference = plain(arch, prompt, 48)
    drafter = make_drafter(kind, arch, window)
    offsets = []
    if isinstance(drafter, ModelDrafter):
        propose = drafter.propose
        drafter.propose = lambda context, k, source=None: (propose(context, k, source), offsets.append(drafter.cache.offset))[0]
    out = run(HFRunner(MODELS[(arch, 0)]), prompt, StopCondition(48), drafter=drafter,
              num_speculative_tokens=RandomK(seed))
    assert out.token_ids == reference.token_ids
    assert out.stats.plain_steps > 0 and out.stats.draft_steps > 0
    if offsets and window == 2:
        assert max(offsets) > 0  # the window was used


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["self", "random"])
def test_cost_model_controller_equals_plain_greedy(arch, kind):
    # The controller with costs measured on these runners (specdec.runtime.profile.step_costs).
    target, drafter = HFRunner(MODELS[(arch, 0)]), make_drafter(kind, arch)
    controller = AutoK(step_costs(target, drafter.runner, max_k=8), max_k=8)
    prompt = [5, 9, 13, 2]
    for max_new in (1, 17, 48):
        out = run(target, prompt, StopCondition(max_new), drafter=drafter, num_speculative_tokens=controller)
        assert out.token_ids == plain(arch, prompt, max_new).token_ids


def test_the_loop_tells_the_controller_each_answers_length():
    # what the controller prices a catch-up over (AutoK.span): the lengths of recent answers, told before
    # the last step is yielded (a caller may stop reading there)
    target, drafter = HFRunner(MODELS[("llama", 0)]), make_drafter("self", "llama")
    controller = AutoK(step_costs(target, drafter.runner, max_k=4), max_k=4)
    lengths = []
    for max_new in (5, 9, 1):
        out = run(target, [5, 9, 13, 2], StopCondition(max_new), drafter=drafter, num_speculative_tokens=controller)
        lengths.append(len(out.token_ids))
    assert controller.lengths == lengths == [5, 9, 1]


def assert_equal_up_to_a_near_tie(arch: str, prompt: list[int], out: list[int], reference: list[int]) -> None:
    """fp32 speculative output equals plain but for a parting at a near-tie (tests.tiny.assert_near_tie_parting)."""
    assert_near_tie_parting(MODELS[(arch, 0)], prompt, out, reference)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=prompts, gamma=st.integers(1, 8), arch=st.sampled_from(ARCHS),
       kind=st.sampled_from(["self", "random", "constant"]), max_new=st.integers(1, 40))
@example(prompt=[70, 69, 7], gamma=1, arch="llama", kind="self", max_new=31)  # a near-tie (1.4e-6) at token 29
def test_speculative_equals_plain_hypothesis(prompt, gamma, arch, kind, max_new):
    reference = plain(arch, prompt, max_new)
    out = run(HFRunner(MODELS[(arch, 0)]), prompt, StopCondition(max_new), drafter=make_drafter(kind, arch),
              num_speculative_tokens=gamma)
    assert_equal_up_to_a_near_tie(arch, prompt, out.token_ids, reference.token_ids)
    assert len(out.token_ids) == max_new


def test_a_parting_away_from_a_near_tie_fails():
    prompt = [5, 9, 13, 2]
    reference = plain("llama", prompt, 12).token_ids
    assert_equal_up_to_a_near_tie("llama", prompt, list(reference), reference)
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_equal_up_to_a_near_tie("llama", prompt, reference[:5] + [(reference[5] + 1) % VOCAB] + reference[6:],
                                      reference)


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_equals_transformers_generate(arch):
    model = MODELS[(arch, 0)]
    prompt = [4, 8, 15, 16, 23, 42]
    ours = plain(arch, prompt, 30).token_ids
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs


def test_eos_stops_and_is_kept():
    prompt = [5, 9, 13]
    reference = plain("llama", prompt, 40).token_ids
    eos = reference[10]  # pretend this token is EOS: generation must end at its first occurrence
    first = reference.index(eos)
    for drafter in (None, make_drafter("self", "llama"), make_drafter("random", "llama")):
        out = run(HFRunner(MODELS[("llama", 0)]), prompt, StopCondition(40, eos_token_ids=frozenset({eos})),
                  drafter=drafter, num_speculative_tokens=5)
        assert out.token_ids == reference[: first + 1]
        assert out.finish_reason == "stop"


def test_stop_string_never_emits_past_it():
    prompt = [5, 9, 13]
    reference = plain("llama", prompt, 40).token_ids
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731 - a toy detokenizer
    stop_text = f"<{reference[12]}><{reference[13]}>"
    expected_end = next(i for i in range(1, 41) if stop_text in decode(reference[:i]))
    out = run(HFRunner(MODELS[("llama", 0)]), prompt,
              StopCondition(40, stop_strings=(stop_text,), decode=decode),
              drafter=make_drafter("self", "llama"), num_speculative_tokens=8)
    assert out.token_ids == reference[:expected_end]
    assert out.finish_reason == "stop"


def test_max_new_tokens_exact_with_full_acceptance():
    # All drafts accepted: the last step must still land exactly on max_new_tokens.
    for max_new in range(1, 20):
        out = run(HFRunner(MODELS[("llama", 0)]), [3, 4], StopCondition(max_new),
                  drafter=make_drafter("self", "llama"), num_speculative_tokens=4)
        assert len(out.token_ids) == max_new
        assert out.finish_reason == "length"


def test_context_window_ends_generation():
    target = HFRunner(MODELS[("llama", 0)], max_context=20)
    prompt = [5] * 15
    out = run(target, prompt, StopCondition(100), drafter=ModelDrafter(HFRunner(MODELS[("llama", 0)])),
              num_speculative_tokens=8)
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == 20
    reference = run(HFRunner(MODELS[("llama", 0)], max_context=20), prompt, StopCondition(100))
    assert out.token_ids == reference.token_ids


def test_stats_per_position_acceptance():
    out = run(HFRunner(MODELS[("llama", 0)]), [3, 4], StopCondition(30),
              drafter=ConstantDrafter(7), num_speculative_tokens=3)
    stats = out.stats
    assert stats.drafted == sum(stats.proposed_at)
    assert stats.proposed_at[0] == stats.draft_steps
    assert len(stats.per_position_acceptance) == 3
    # acceptance is a prefix: position i+1 can be accepted only if position i was
    assert stats.accepted_at[0] >= stats.accepted_at[1] >= stats.accepted_at[2]
    d = stats.to_dict()
    for key in ("new_tokens", "target_forwards", "drafted", "accepted", "acceptance_rate",
                "mean_accepted_per_step", "per_position_acceptance", "wall_s", "tokens_per_s", "prefill_s",
                "decode_tokens_per_s"):
        assert key in d
    # the prefill is timed up to the first token; decoding is what follows it
    assert 0 < stats.prefill_s < stats.wall_s
    assert stats.decode_tokens_per_s == pytest.approx((stats.new_tokens - 1) / (stats.wall_s - stats.prefill_s))


@pytest.mark.parametrize("bad", [
    dict(prompt=[], stop=StopCondition(5)),
    dict(prompt=[3] * 300, stop=StopCondition(5)),
])
def test_bad_requests_raise_user_errors(bad):
    with pytest.raises(SpecdecError):
        run(HFRunner(MODELS[("llama", 0)]), bad["prompt"], bad["stop"])


def test_a_bad_prompt_is_refused_by_the_one_check():
    """decode refuses a prompt as every entry point does (specdec.text.check_prompt), in the same words."""
    runner = ToyRunner(random_table(6, seed=0), max_context=8)
    with pytest.raises(PromptError, match=f"^{EMPTY_PROMPT}$"):
        run(runner, [], StopCondition(5))
    with pytest.raises(PromptError, match="the prompt has 8 tokens, which does not fit the model's context window "
                                          "of 8 tokens") as caught:
        run(runner, [1] * 8, StopCondition(5))
    assert caught.value.too_long
    assert run(runner, [1] * 7, StopCondition(5)).finish_reason == "length"  # the window holds it and one token


@pytest.mark.parametrize("tree", [None, TreeShape(2, depth=3)])
def test_each_step_carries_its_own_counts(tree):
    """A Step is a value holding that step's own drafted / accepted / source (never running totals), and a
    generation's Stats are its steps summed."""
    table = random_table(6, seed=0)
    steps = list(decode(ToyTreeRunner(table), [1, 4, 2], StopCondition(40), drafter=FixedDrafter(random_proposal(6, 2)),
                        num_speculative_tokens=RandomK(3, max_k=3), tree=tree))
    stats = collect(steps).stats
    first, rest = steps[0], steps[1:]
    assert first.prefill and first.drafted == first.accepted == 0 and len(first.tokens) == 1
    assert not any(step.prefill for step in rest) and first.reused_prompt_tokens == stats.reused_prompt_tokens == 0
    assert [(step.drafted, len(step.tokens)) for step in rest] == [(k, n) for k, n, _ in stats.steps]
    assert {step.drafted for step in rest} >= {0, 3}  # plain steps and whole drafts, each counted as it is
    for step in rest:
        assert step.accepted <= step.drafted and len(step.tokens) <= step.accepted + 1
        assert (step.source != "") == (step.drafted > 0) and (step.tree_nodes > 0) <= (step.drafted > 0)
    assert sum(step.drafted for step in steps) == stats.drafted > 0
    assert sum(step.accepted for step in steps) == stats.accepted
    assert sum(step.tree_nodes for step in steps) == stats.tree_nodes and (stats.tree_nodes > 0) == (tree is not None)
    assert sum(step.drafted == 0 for step in rest) == stats.plain_steps
    assert sum(step.wall_s for step in steps) == pytest.approx(stats.wall_s) and first.target_s == stats.prefill_s
    (source,) = {step.source for step in rest if step.drafted}  # one drafter: one source
    assert stats.by_source == {source: [stats.draft_steps, stats.drafted, stats.accepted]}
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.drafted = 1  # type: ignore[misc]


def test_max_new_tokens_must_be_positive():
    for n in (0, -3):
        with pytest.raises(SpecdecError):
            StopCondition(n)


@pytest.mark.parametrize("draft_vocab", [VOCAB - 8, VOCAB + 32])
def test_draft_with_padded_vocabulary(draft_vocab):
    # Same tokens, different embedding widths (as 151936 vs 152064 rows).
    draft = ModelDrafter(HFRunner(tiny_model("llama", 2, vocab_size=draft_vocab)), target_vocab_size=VOCAB)
    out = run(HFRunner(MODELS[("llama", 0)]), [5, 6, 7], StopCondition(40), drafter=draft, num_speculative_tokens=4)
    assert out.token_ids == plain("llama", [5, 6, 7], 40).token_ids


def test_stats_record_every_step():
    prompt = [5, 9, 13, 2]
    out = run(HFRunner(MODELS[("llama", 0)]), prompt, StopCondition(30), drafter=make_drafter("random", "llama"),
              num_speculative_tokens=RandomK(1))
    s = out.stats
    assert len(s.steps) == s.draft_steps + s.plain_steps == s.target_forwards - 1  # the prefill is no step
    assert sum(n for _, n, _ in s.steps) == s.new_tokens - 1  # the prefill's token is not a step's
    assert sum(k for k, _, _ in s.steps) == s.drafted and all(sec > 0 for _, _, sec in s.steps)
    assert s.to_dict()["steps"][0][:2] == list(s.steps[0][:2])


class Listener(FixedDrafter):
    """Fixed proposals (chains, or trees with second choices), and every target forward the loop reports
    (Drafter.target_logits): the tokens fed, the runner's cache then, the last draft's parents, the rows."""

    def __init__(self, runner: ToyRunner) -> None:
        super().__init__(random_proposal(6, seed=2))
        self.runner, self.heard, self.parents = runner, [], None

    def propose_tree(self, context, k, width, nodes, source=None):
        draft = super().propose_tree(context, k, width, nodes, source)
        self.parents = draft.parents
        return draft

    def propose(self, context, k, source=None):
        self.parents = None
        return super().propose(context, k, source)

    def target_logits(self, fed, logits):
        self.heard.append((list(fed), list(self.runner.tokens), self.parents, logits.clone()))
        self.parents = None  # a plain step may come next


@pytest.mark.parametrize("tree", [None, TreeShape(2, depth=3)])
def test_the_drafter_hears_every_target_forward_row_by_row(tree):
    # A second-order toy target: row i must be the table's row after (the token before fed[i], fed[i]):
    # the prefill's last token, plain steps (k from RandomK, 0 some steps), every row of a verification.
    table = random_table(6, seed=0)
    runner = ToyTreeRunner(table)
    listener = Listener(runner)
    prompt = [1, 4, 2]
    out = run(runner, prompt, StopCondition(24), drafter=listener, num_speculative_tokens=RandomK(1, max_k=3), tree=tree)
    assert out.token_ids == run(ToyRunner(table), prompt, StopCondition(24)).token_ids
    assert len(listener.heard) == out.stats.target_forwards  # the prefill, plain steps and verifications
    assert listener.heard[0][0] == [2] and torch.equal(listener.heard[0][3], table[4, 2].unsqueeze(0))
    sizes = {len(fed) for fed, *_ in listener.heard[1:]}
    assert min(sizes) == 1 and max(sizes) > 2  # plain steps and drafts
    assert (out.stats.tree_steps > 0) == (tree is not None)
    for fed, cached, parents, logits in listener.heard[1:]:
        assert cached[-len(fed):] == fed and logits.shape == (len(fed), 6)  # heard before any rollback
        before = [cached[-len(fed) - 1]] + (fed[:-1] if parents is None else [fed[p + 1] for p in parents])
        for i, token in enumerate(fed):
            assert torch.equal(logits[i], table[before[i], token])
