"""Token trees through the decode loop (issue 39): speculative greedy with tree drafts == plain greedy.

Targets: the toy second-order chain with tree verification (tests/toy.ToyTreeRunner) and tiny int8 llama /
qwen2 models on the lean runner, whose tree forward is bitwise the chain's (specdec.native.lean), so the
output is plain greedy's token for token.  Drafters: fixed proposals with second choices, prompt lookup
over several matches, suffix drafts (the context and a store of earlier answers: their most frequent
continuations), a draft model's chain with its runner-ups, and the hybrids; fixed γ and the
cost-model controller; widths 2 and 3.  Sampling through trees is the chi-square of
tests/algorithm/test_sampling_loop.py (the tree-* cases).
"""

from __future__ import annotations

import pytest

from specdec.algorithm.control import AutoK
from specdec.algorithm.draft import TreeShape
from specdec.algorithm.loop import StopCondition, run
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.lookup import LookupDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.suffix import HYBRID_MIN_SCORE, SuffixDrafter, SuffixStore
from specdec.native.lean import LeanRunner
from specdec.native.quant import quantize_model
from specdec.runtime.profile import step_costs
from tests.tiny import tiny_model
from tests.toy import FixedDrafter, ToyRunner, ToyTreeRunner, random_proposal, random_table

TABLE = random_table(6, seed=0)


@pytest.mark.parametrize("width", [2, 3])
@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_toy_tree_greedy_equals_plain(width, gamma):
    drafter = FixedDrafter(random_proposal(6, seed=2))
    for prompt in ([1, 4], [0], [5, 5, 2, 3]):
        reference = run(ToyRunner(TABLE), prompt, StopCondition(20)).token_ids
        out = run(ToyTreeRunner(TABLE), prompt, StopCondition(20), drafter=drafter, num_speculative_tokens=gamma,
                  tree=TreeShape(width, depth=gamma))
        assert out.token_ids == reference
        assert out.stats.tree_steps > 0 and out.stats.tree_nodes > out.stats.drafted


def test_trees_fall_back_to_chains_on_a_chain_target():
    drafter = FixedDrafter(random_proposal(6, seed=2))
    out = run(ToyRunner(TABLE), [1, 4], StopCondition(12), drafter=drafter, num_speculative_tokens=3,
              tree=TreeShape(2, depth=3))
    assert out.token_ids == run(ToyRunner(TABLE), [1, 4], StopCondition(12)).token_ids
    assert out.stats.tree_steps == 0 and out.stats.draft_steps > 0


INT8 = {arch: quantize_model(tiny_model(arch, 0)) for arch in ("llama", "qwen2")}
DRAFT = {arch: tiny_model(arch, 1) for arch in ("llama", "qwen2")}
REPEATING = [5, 9, 13, 21, 8, 5, 9, 13, 30, 8, 5, 9, 13, 21, 44, 5, 9]  # lookup matches with several continuations


EARLIER = ([13, 21, 8, 5, 9, 13, 30], [5, 9, 13, 44, 2], [3, 17, 40, 41, 3, 17, 42])  # earlier answers: branches


def suffix_drafter(**options) -> SuffixDrafter:
    store = SuffixStore(1000)
    for output in EARLIER:
        store.add(output)
    return SuffixDrafter(store, **options)


def drafter_of(kind: str, arch: str):
    from specdec.backends.hf import HFRunner

    if kind == "lookup":
        return LookupDrafter()
    if kind == "suffix":
        return suffix_drafter()
    model = ModelDrafter(HFRunner(DRAFT[arch]))
    if kind == "suffix-hybrid":
        return HybridDrafter(model, suffix_drafter(min_ngram=2, min_score=HYBRID_MIN_SCORE))
    return model if kind == "model" else HybridDrafter(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["lookup", "suffix", "model", "hybrid", "suffix-hybrid"])
@pytest.mark.parametrize("width,gamma", [(2, 3), (3, 5)])
def test_int8_tree_greedy_equals_plain(arch, kind, width, gamma):
    target = LeanRunner(INT8[arch])
    assert target.capabilities.tree
    trees = 0
    for prompt in (REPEATING, [3, 17, 40]):
        reference = run(LeanRunner(INT8[arch]), prompt, StopCondition(24)).token_ids
        out = run(target, prompt, StopCondition(24), drafter=drafter_of(kind, arch), num_speculative_tokens=gamma,
                  tree=TreeShape(width, depth=gamma))
        assert out.token_ids == reference
        trees += out.stats.tree_steps
    if kind == "suffix":
        assert trees > 0  # the matches' several continuations were verified as trees


@pytest.mark.parametrize("kind", ["model", "hybrid", "suffix-hybrid"])
def test_int8_tree_with_the_controller_equals_plain(kind):
    target = LeanRunner(INT8["qwen2"])
    drafter = drafter_of(kind, "qwen2")
    model = drafter if isinstance(drafter, ModelDrafter) else drafter.model
    controller = AutoK(step_costs(target, model.runner, max_k=6), max_k=6)
    reference = run(LeanRunner(INT8["qwen2"]), REPEATING, StopCondition(32)).token_ids
    out = run(target, REPEATING, StopCondition(32), drafter=drafter, num_speculative_tokens=controller,
              tree=TreeShape(2))
    assert out.token_ids == reference
