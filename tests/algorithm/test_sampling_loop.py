"""Speculative sampling through the whole decode loop: the output distribution is the target's.

Statistical part: a toy target whose next-token logits are a fixed seeded
function of the last two tokens (tests/toy.py), V = 6.  20,000 seeded runs of
specdec.algorithm.loop.run with max_new_tokens = 5 and γ = 3 per case, each run with its
own seed (SamplingParams(seed=i) -> make_verifier and the drafter), and a
chi-square test of the histogram of the five new tokens against the exact
target distribution, computed by an independent float64 warp
(tests/toy.reference_warp, not the sampler's own).  Five tokens because the
loop samples the first token from the prefill alone: after it a full γ = 3
draft is verified and, when all three are accepted, followed by its bonus
token; after a rejection shorter drafts follow.  Drafts: the target itself, an
unrelated toy model, and deterministic proposals (q = None); temperature 0.8,
with top-k and top-p, and on a table of tied logits where ties fall at the
top-k / top-p cut; and with the cost-model controller choosing k from the
acceptance history (specdec.algorithm.control: k = 3, then plain steps and probes); with
the hybrid drafter (prompt lookup's q = None proposals and a draft model's q
proposals in the same runs); with suffix drafts (q = None proposals that follow the context: the most
frequent continuation of its longest match in the run's own context or in a fixed store of earlier
outputs); and with an int4 draft model (a tiny qwen2 model
with V = 6 on specdec's int4 kernel and C layers, specdec.native.lean), also with its head trimmed to
two of the six tokens and the run's context (FR-Spec: q is zero at the tokens outside them); and a draft
model proposing its argmax chain under sampling (q = None, as a GGUF draft's native chain does).  Seeds are
fixed, so every p-value is a fixed number (recorded below); the test passes when p > 0.001.  The runs are split over two
processes (tests/chisq.py); the histogram does not depend on the split.

Exact part (tiny transformers models, tests/tiny.py): top_k = 1 and a
temperature of 1e-4 give exactly the greedy tokens; a draft equal to the target
is always accepted and still stops exactly at max_new_tokens; seeded runs are
reproducible and different seeds give different outputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from specdec.algorithm.control import AutoK, Controller, Costs
from specdec.algorithm.draft import Draft, Drafter, TreeShape
from specdec.algorithm.loop import StopCondition, run
from specdec.algorithm.sampling import SamplingParams
from specdec.algorithm.verify import make_verifier
from specdec.backends.hf import HFRunner
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.lookup import LookupDrafter
from specdec.drafters.model import DEFAULT_WINDOW, ModelDrafter
from specdec.drafters.suffix import SuffixDrafter, SuffixStore
from specdec.native.lean import LeanRunner
from specdec.native.quant import quantize_model
from tests.chisq import chi_square, chi_square_sf, seeded_runs
from tests.tiny import tiny_model
from tests.toy import FixedDrafter, ToyRunner, ToyTreeRunner, chain_distribution, random_proposal, random_table, reference_warp

VOCAB = 6
PROMPT = [1, 4]
MAX_NEW = 5
GAMMA = 3
RUNS = 20_000
TARGET = random_table(VOCAB, seed=0)
OTHER = random_table(VOCAB, seed=1)
TIED = random_table(VOCAB, seed=3).round()  # integer logits: many exact ties
NEAR_TIED = TIED + random_table(VOCAB, seed=4) / 3  # a draft close to TIED: long drafts accepted
PROPOSAL = random_proposal(VOCAB, seed=2)


def test_chi_square_helper():
    assert chi_square_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi_square_sf(124.342, 100) == pytest.approx(0.05, rel=1e-4)
    probs = {(0,): 0.5, (1,): 0.5 - 1e-6, (2,): 1e-6}
    stat, dof, p = chi_square(Counter({(0,): 500, (1,): 500}), probs)
    assert (stat, dof) == (pytest.approx(0.0, abs=1e-3), 1) and p > 0.9
    with pytest.raises(AssertionError):
        chi_square(Counter({(3,): 1}), probs)


T08 = dict(temperature=0.8)
TOPK_TOPP = dict(temperature=0.8, top_k=4, top_p=0.9)
TIED_CUT = dict(temperature=0.8, top_k=3, top_p=0.7)


def model_drafter(table: torch.Tensor, confidence: float | None = None, window: int | None = DEFAULT_WINDOW,
                  draft_sampling: str = "auto") -> Callable[[SamplingParams], ModelDrafter]:
    runner = ToyRunner(table.clone())  # its own "model" and cache; the drafter resets it every run
    return lambda params: ModelDrafter(runner, params, confidence=confidence, window=window,
                                       draft_sampling=draft_sampling)


def int4_drafter() -> Callable[[SamplingParams], ModelDrafter]:
    """A tiny int8 qwen2 model (V = 6, unrelated to the toy target) run as an int4 draft: its q comes from
    specdec's int4 kernel and C layers (LeanRunner(int4=True)), as a real int4 draft's does."""
    runner = LeanRunner(quantize_model(tiny_model("qwen2", 0, vocab_size=VOCAB)), int4=True, int8_catch_up=False)
    assert runner.layer_set.native
    return lambda params: ModelDrafter(runner, params)


def trimmed_int4_drafter() -> Callable[[SamplingParams], ModelDrafter]:
    """The int4 draft above with its head trimmed to tokens 0 and 2 (FR-Spec), and the run's context: the
    prompt's 1 and 4 from the start, 3 and 5 once the run has emitted them (the head grows within a run).
    Until then q is 0 at 3 and 5, which the target samples too: they come from the residual alone."""
    runner = LeanRunner(quantize_model(tiny_model("qwen2", 0, vocab_size=VOCAB)), int4=True, int8_catch_up=False)
    runner.trim_head(torch.tensor([0, 2]))
    return lambda params: ModelDrafter(runner, params)


def hybrid_drafter(table: torch.Tensor) -> Callable[[SamplingParams], HybridDrafter]:
    """Prompt lookup (one-token matches allowed, so both sources propose in a 7-token context:
    q = None proposals and the draft model's q proposals in one run) in front of a draft model."""
    make_model = model_drafter(table)
    return lambda params: HybridDrafter(make_model(params), LookupDrafter(max_ngram=2, min_ngram=1))


def suffix_drafter() -> Callable[[SamplingParams], SuffixDrafter]:
    """Suffix drafts from a store of four earlier "answers" (the target's own samples after PROMPT, seeded:
    every two-token window occurred, with several continuations) and from the run's own context; the
    store is filled once and never written to, so each run's drafts depend on its own tokens only.  Up
    to 4 tokens per matched token and no probability cut: most drafts are a whole γ = 3."""
    store = SuffixStore(1000)
    for seed in range(4):
        params = SamplingParams(seed=10_000 + seed, **T08)
        store.add(run(ToyRunner(TARGET), PROMPT, StopCondition(100), verifier=make_verifier(params)).token_ids)
    return lambda params: SuffixDrafter(store, spec_factor=4.0, min_prob=0.0)


def fixed_drafter() -> Callable[[SamplingParams], FixedDrafter]:
    drafter = FixedDrafter(PROPOSAL)  # stateless
    return lambda params: drafter


# case -> (target table, sampling params, a factory of drafter factories: params -> drafter).
# With seeds 0..19,999 (torch 2.13 CPU) the p-values are 0.237 (draft=target), 0.185
# (unrelated-draft), 0.687 (q=None-draft), 0.544 (unrelated-draft-top-k-top-p), 0.313
# (ties-at-the-top-k-top-p-cut), 0.606 (auto-k-controller), 0.327 (hybrid-lookup-then-draft), 0.297
# (suffix-drafts), 0.742 (draft-confidence-stop), 0.822 (draft-window-1) and 0.183 (int4-draft; on an
# AVX2 CPU, whose int4 kernel paths give the same bits; 0.559 on an AMD EPYC Zen 4), 0.595 (trimmed-int4-draft,
# that Zen 4), 0.359 (greedy-chain-draft) and 0.257 (greedy-chain-draft-top-k-top-p).  The bugs tried against this
# test (residual = p, bonus from the wrong row, q ignored, target rolled back one token short,
# q = None residual keeping x, the drafter's q not warped like its samples) gave p < 1e-30
# with 50,000 runs in the cases they affect; at 20,000, residual = p still gives chi2 > 7,600
# with 353 dof (p = 0 in float64) in the three cases with an unrelated draft.
CASES = {
    "draft=target": (TARGET, T08, lambda: model_drafter(TARGET)),
    "unrelated-draft": (TARGET, T08, lambda: model_drafter(OTHER)),
    "q=None-draft": (TARGET, T08, fixed_drafter),
    "unrelated-draft-top-k-top-p": (TARGET, TOPK_TOPP, lambda: model_drafter(OTHER)),
    "ties-at-the-top-k-top-p-cut": (TIED, TIED_CUT, lambda: model_drafter(NEAR_TIED)),
    "auto-k-controller": (TARGET, T08, lambda: model_drafter(OTHER)),
    "hybrid-lookup-then-draft": (TARGET, T08, lambda: hybrid_drafter(OTHER)),
    "suffix-drafts": (TARGET, T08, suffix_drafter),
    # the draft stops after a token its own softmax gave < 0.3: draft lengths vary with the draft's samples
    "draft-confidence-stop": (TARGET, T08, lambda: model_drafter(OTHER, confidence=0.3)),
    # a catch-up window of 1: the draft model starts over from the last token whenever it is further behind
    "draft-window-1": (TARGET, T08, lambda: model_drafter(OTHER, window=1)),
    # a sampled request's draft proposing its argmax chain (q = None, as a GGUF draft's native chain does)
    "greedy-chain-draft": (TARGET, T08, lambda: model_drafter(OTHER, draft_sampling="greedy")),
    "greedy-chain-draft-top-k-top-p": (TARGET, TOPK_TOPP, lambda: model_drafter(OTHER, draft_sampling="greedy")),
    "int4-draft": (TARGET, T08, int4_drafter),
    "trimmed-int4-draft": (TARGET, T08, trimmed_int4_drafter),
    # token trees (the chain and a second token at each of its positions) verified in one forward
    "tree-of-fixed-proposals": (TARGET, T08, fixed_drafter),
    "tree-top-k-top-p": (TARGET, TOPK_TOPP, fixed_drafter),
}
TREES = {"tree-of-fixed-proposals": TreeShape(width=2, depth=GAMMA), "tree-top-k-top-p": TreeShape(width=3, depth=GAMMA)}


def history_controller() -> AutoK:
    """The cost-model controller with fixed synthetic costs (no online timing: the choices, and so
    the p-value, depend on the acceptance history alone): it starts at k = γ, drops to plain steps
    after a rejection and probes back with k = 1, so k varies with the tokens sampled so far."""
    return AutoK(Costs({1: 10.0, 4: 10.5}, draft_ms=0.5), max_k=GAMMA, weight=0.5, cost_ewma=0.0, probe_every=1)


CONTROLLERS = {"auto-k-controller": history_controller}


class Recorded(Controller):
    """A controller, and the k it chose whenever the loop allowed a draft (limit > 0)."""

    def __init__(self, inner) -> None:
        self.inner, self.chosen = inner, Counter()

    def choose(self, limit: int, lag: int = 0, source: str = "model", grade: str | None = None) -> int:
        k = self.inner.choose(limit, lag, source)
        if limit > 0:
            self.chosen[k] += 1
        return k

    def observe(self, *args, **kwargs) -> None:
        self.inner.observe(*args, **kwargs)

    def reset(self) -> None:
        self.inner.reset()


def sample_runs(case: str, seeds: range) -> dict:
    """Histogram of the new tokens of one seeded run per seed, and draft totals: drafted,
    accepted, and `full` = steps whose whole γ-token draft was accepted (then a bonus token)."""
    table, params_kwargs, factory = CASES[case]
    make_drafter = factory()
    target = ToyTreeRunner(table) if case in TREES else ToyRunner(table)
    stop = StopCondition(MAX_NEW)
    counts: Counter = Counter()
    drafted = accepted = full = 0
    chosen: Counter = Counter()  # k chosen by the controller where a draft was allowed
    sources: Counter = Counter()  # proposals of the hybrid drafter per source
    short = [0]  # drafts a confidence threshold stopped before the k asked for
    restarted = 0  # runs whose draft model started over from a window
    trees = 0  # steps that verified a tree
    for seed in seeds:
        params = SamplingParams(seed=seed, **params_kwargs)
        k = Recorded(CONTROLLERS[case]()) if case in CONTROLLERS else GAMMA
        drafter = make_drafter(params)
        if getattr(drafter, "confidence", None) is not None:  # count the drafts it cut short
            propose = drafter.propose
            def counted(context, want, source=None, propose=propose):
                draft = propose(context, want, source)
                short[0] += 0 < len(draft.tokens) < want
                return draft
            drafter.propose = counted
        out = run(target, PROMPT, stop, drafter=drafter, num_speculative_tokens=k, verifier=make_verifier(params),
                  tree=TREES.get(case))
        trees += out.stats.tree_steps
        if isinstance(k, Recorded):
            chosen.update(k.chosen)
        if isinstance(drafter, HybridDrafter):
            sources.update(drafter.proposals)
        if isinstance(drafter, SuffixDrafter):
            sources.update(drafter.drafted_from)
        assert len(out.token_ids) == MAX_NEW and out.finish_reason == "length"
        counts[tuple(out.token_ids)] += 1
        restarted += isinstance(drafter, ModelDrafter) and drafter.cache.offset > 0  # the window was used
        drafted += out.stats.drafted
        accepted += out.stats.accepted
        full += out.stats.accepted_at[GAMMA - 1] if len(out.stats.accepted_at) >= GAMMA else 0
    return {"counts": counts, "drafted": drafted, "accepted": accepted, "full": full, "chosen": chosen,
            "sources": sources, "short": short[0], "restarted": restarted, "trees": trees}


def test_tied_case_has_ties_at_the_cut_and_no_rounding_decisions():
    # The TIED table really puts exact ties at the top-k / top-p cut, and no row's top-p
    # decision is close enough to the boundary for float32 rounding to decide it.
    ties = 0
    for a in range(VOCAB + 1):
        for b in range(VOCAB):
            logits = TIED[a, b]
            kept = logits[reference_warp(logits, **TIED_CUT) > 0]
            ties += int((logits == kept.min()).sum() > 1)
            masses = reference_warp(logits, TIED_CUT["temperature"], TIED_CUT["top_k"]).sort(descending=True).values
            assert ((masses.cumsum(0) - TIED_CUT["top_p"]).abs() > 1e-6).all()
    assert ties >= 5


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_the_target_distribution(case):
    table, params_kwargs, _ = CASES[case]
    totals = seeded_runs(sample_runs, case, RUNS)
    drafted, accepted = totals["drafted"], totals["accepted"]
    exact = chain_distribution(table, SamplingParams(**params_kwargs), PROMPT, MAX_NEW)
    stat, dof, p_value = chi_square(totals["counts"], exact)
    print(f"{case}: chi2={stat:.1f} dof={dof} p={p_value:.4f} acceptance={accepted / drafted:.3f} "
          f"full drafts={totals['full']} chosen k={dict(totals['chosen'])}")
    if case == "draft-confidence-stop":
        assert totals["short"] > RUNS // 4  # the threshold cut many drafts short
    else:
        assert drafted >= RUNS * GAMMA  # every run verified at least one full γ-token draft
    if case != "tree-top-k-top-p":  # its fixed proposals fall outside the top-k / top-p cut too often
        assert totals["full"] > 0  # ... and some were accepted whole, with their bonus token
    if case == "draft-window-1":
        assert totals["restarted"] > RUNS // 4
    if case in TREES:
        assert totals["trees"] >= RUNS  # every run verified trees
    if case == "hybrid-lookup-then-draft":
        assert totals["sources"]["lookup"] > 0 and totals["sources"]["model"] > 0
    if case == "suffix-drafts":
        assert totals["sources"]["context"] > 0 and totals["sources"]["store"] > 0
    if case in CONTROLLERS:
        assert {0, 1, GAMMA} <= set(totals["chosen"])  # k followed the history: plain steps, probes, full drafts
    if case == "draft=target":
        assert accepted == drafted  # q == p exactly: always accepted
    else:
        assert 0 < accepted < drafted
    assert p_value > 0.001, f"{case}: chi2={stat:.1f} with {dof} dof, p={p_value:.2e}"


def test_draft_equal_to_target_fills_max_new_tokens_exactly_toy():
    # p == q exactly (u * q < p always holds as u < 1): everything accepted, and the
    # last step still lands on max_new_tokens.
    make_drafter = model_drafter(TARGET)
    for max_new in range(1, 16):
        for seed in range(20):
            params = SamplingParams(temperature=1.0, seed=seed)
            out = run(ToyRunner(TARGET), PROMPT, StopCondition(max_new), drafter=make_drafter(params),
                      num_speculative_tokens=4, verifier=make_verifier(params))
            assert len(out.token_ids) == max_new and out.finish_reason == "length"
            assert out.stats.accepted == out.stats.drafted  # acceptance 1.0
            assert (out.stats.drafted > 0) == (max_new > 2)  # max_new 2: the second token is a plain step


# --------------------------------------------------------------------------- tiny transformers models

TARGET_MODEL = tiny_model("llama", 0)
DRAFT_MODEL = tiny_model("llama", 1)
HF_PROMPT = [5, 9, 13, 21]


class ConstantDrafter(Drafter):
    """Deterministic proposals (q = None) that are usually wrong."""

    def propose(self, context, k, source=None):
        return Draft([7] * k)

    def observe(self, context, num_accepted):
        pass

    def reset(self):
        pass


def hf_drafter(kind: str, params: SamplingParams):
    if kind == "self":
        return ModelDrafter(HFRunner(TARGET_MODEL), params)
    if kind == "unrelated":
        return ModelDrafter(HFRunner(DRAFT_MODEL), params)
    if kind == "constant":
        return ConstantDrafter()
    return None  # plain sampling


def hf_run(params: SamplingParams, kind: str, max_new: int = 24, gamma: int = 4):
    return run(HFRunner(TARGET_MODEL), HF_PROMPT, StopCondition(max_new), drafter=hf_drafter(kind, params),
               num_speculative_tokens=gamma, verifier=make_verifier(params))


GREEDY = run(HFRunner(TARGET_MODEL), HF_PROMPT, StopCondition(24)).token_ids


@pytest.mark.parametrize("kind", ["plain", "self", "unrelated", "constant"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1e-4),
                                    SamplingParams(temperature=0.7, top_k=1, top_p=0.5)],
                         ids=["top_k=1", "temperature=1e-4", "top_k=1,top_p"])
def test_degenerate_sampling_is_greedy(kind, params):
    for seed in range(3):
        seeded = SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed)
        out = hf_run(seeded, kind)
        assert out.token_ids == GREEDY
        if kind == "self":
            assert out.stats.acceptance_rate == 1.0


def test_draft_equal_to_target_fills_max_new_tokens_exactly_tiny():
    for max_new in range(1, 14):
        params = SamplingParams(temperature=1.0, seed=max_new)
        out = hf_run(params, "self", max_new=max_new)
        assert len(out.token_ids) == max_new and out.finish_reason == "length"
        assert out.stats.accepted == out.stats.drafted  # acceptance 1.0
        assert (out.stats.drafted > 0) == (max_new > 2)


@pytest.mark.parametrize("kind", ["plain", "self", "unrelated", "constant"])
def test_seeded_runs_are_reproducible(kind):
    for params in (SamplingParams(temperature=1.0, seed=123), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)):
        first, second = hf_run(params, kind), hf_run(params, kind)
        assert first.token_ids == second.token_ids
        assert first.stats.accepted == second.stats.accepted


@pytest.mark.parametrize("kind", ["plain", "unrelated"])
def test_different_seeds_give_different_outputs(kind):
    outputs = {tuple(hf_run(SamplingParams(temperature=1.0, seed=seed), kind).token_ids) for seed in range(6)}
    assert len(outputs) >= 5
