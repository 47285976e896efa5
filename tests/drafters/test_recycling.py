"""Token Recycling (specdec.drafters.recycling): the top-k, the matrix's updates, chains and trees over it,
exactness through the loop (chains and trees, γ = 1..8), the engine's shared matrix and a seeded request's
own, and the sampling distribution through the loop (chi-square, seeded)."""

from __future__ import annotations

import random
from collections import Counter
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.algorithm.control import AutoK, Costs
from specdec.algorithm.draft import RECYCLE, SHORT_RECYCLE, TreeShape
from specdec.algorithm.loop import StopCondition, run
from specdec.algorithm.sampling import SamplingParams
from specdec.algorithm.trees import depths
from specdec.algorithm.verify import make_verifier
from specdec.backends.hf import HFRunner
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.lookup import LookupDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.recycling import (
    BLOCK,
    HYBRID_MIN_MARGIN,
    RecycleMatrix,
    RecyclingDrafter,
    margin_grade,
    top_candidates,
)
from specdec.drafters.spec import DrafterSpec, DraftRequest, build_drafter
from specdec.native.lean import LeanRunner
from specdec.native.quant import quantize_model
from specdec.runtime.engine import Engine
from tests.chisq import chi_square, seeded_runs
from tests.tiny import VOCAB, tiny_model, tiny_tokenizer
from tests.toy import ToyRunner, ToyTreeRunner, chain_distribution, random_table


def one_hot_rows(*rows: list[int], vocab: int = 10) -> torch.Tensor:
    """Logits [len(rows), vocab] whose order is each row's token list (best first) and then the rest."""
    out = torch.zeros(len(rows), vocab)
    for i, row in enumerate(rows):
        for rank, token in enumerate(row):
            out[i, token] = 10.0 - rank
    return out


# --------------------------------------------------------------------------- the top-k


@pytest.mark.parametrize("vocab", [5, 96, 8 * BLOCK * 4 - 1, 151_936, 151_936 + 57])
@pytest.mark.parametrize("rows", [1, 9])
def test_top_candidates_are_torch_topks(vocab, rows):
    gen = torch.Generator().manual_seed(vocab + rows)
    logits = torch.randn(rows, vocab, generator=gen) * 4  # [n, V] distinct values: no ties
    logits[0, -3:] += 40.0  # the best in the tail that fills no block
    if rows > 1:
        logits[1, 2 * BLOCK: 2 * BLOCK + 8] += 40.0  # all eight best in one block
    for k in (1, 2, 8):
        assert torch.equal(top_candidates(logits, k), torch.topk(logits, min(k, vocab), dim=-1).indices)


# --------------------------------------------------------------------------- the matrix


def test_an_update_keeps_each_fed_tokens_last_row():
    matrix = RecycleMatrix(width=3)
    assert matrix.candidates(3) == [] and matrix.margin(3) is None and matrix.known == 0
    matrix.update([3, 5, 3], one_hot_rows([1, 2, 4], [6, 7, 8], [9, 0, 1]))
    assert matrix.candidates(3) == [9, 0, 1]  # the later of 3's two rows
    assert matrix.candidates(5) == [6, 7, 8] and matrix.margin(5) == 1.0
    assert matrix.candidates(1) == [] and matrix.candidates(99) == [] and matrix.known == 2
    twin = matrix.copy()
    matrix.update([5], one_hot_rows([2, 6, 7]))  # a later forward replaces the row
    assert matrix.candidates(5) == [2, 6, 7] and twin.candidates(5) == [6, 7, 8]  # the copy kept its own
    assert matrix.updates == 2 and twin.updates == 1
    matrix.update([], torch.zeros(0, 10))
    assert matrix.updates == 2


def test_the_worked_example_from_the_docstring():
    ids = {w: i for i, w in enumerate("the cat sat on mat floor . and it".split())}
    the, mat, floor, dot, and_, it = (ids[w] for w in ("the", "mat", "floor", ".", "and", "it"))
    drafter = RecyclingDrafter(RecycleMatrix(width=2))
    context = [ids[w] for w in "the cat sat on the".split()]
    drafter.target_logits(context[-1:], one_hot_rows([mat, floor]))  # the prefill's last row
    context.append(mat)
    assert drafter.propose(context, 3).tokens == []  # "mat" was never fed: a plain step
    drafter.target_logits([mat], one_hot_rows([dot, and_]))
    context.append(dot)
    drafter.target_logits([dot], one_hot_rows([the, it]))  # a plain step again
    context.append(the)
    assert drafter.propose(context, 3).tokens == [mat, dot, the]
    tree = drafter.propose_tree(context, 3, 2, 5)
    assert tree.tokens == [mat, dot, the, floor, and_] and tree.parents == [-1, 0, 1, -1, 0]


def test_chains_follow_the_first_candidates_and_stop_at_an_unknown_token():
    drafter = RecyclingDrafter(RecycleMatrix(width=2))
    drafter.target_logits([1, 2, 3], one_hot_rows([2, 5], [3, 6], [1, 4]))
    assert drafter.propose([7, 1], 7).tokens == [2, 3, 1, 2, 3, 1, 2]  # a cycle, cut at k
    assert drafter.propose([7, 1], 0).tokens == [] and drafter.propose([], 3).tokens == []
    drafter.target_logits([3], one_hot_rows([9, 4]))
    assert drafter.propose([1], 5).tokens == [2, 3, 9]  # 9 was never fed
    assert drafter.propose([4], 5).tokens == []


def test_margins_grade_and_gate_the_proposals():
    matrix = RecycleMatrix(width=2)
    logits = torch.zeros(3, 10)
    logits[0, 4], logits[0, 5] = 9.0, 3.5  # 5.5 ahead
    logits[1, 6], logits[1, 7] = 1.5, 0.0
    logits[2, 8] = 0.5
    matrix.update([1, 2, 3], logits)
    assert [margin_grade(m) for m in (0.0, 0.99, 1.0, 2.5, 4.0, float("inf"))] == [
        "margin 0-1", "margin 0-1", "margin 1-2", "margin 2-4", "margin 4+", "margin 4+"]
    alone, first = RecyclingDrafter(matrix), RecyclingDrafter(matrix, min_margin=HYBRID_MIN_MARGIN)
    assert alone.grade([1]) == "margin 4+" and alone.grade([2]) == "margin 1-2" and alone.grade([3]) == "margin 0-1"
    assert alone.grade([5]) is None and alone.shorter() is None
    assert first.matches([1]) and not first.matches([2]) and first.propose([2], 3).tokens == []
    assert first.propose([1], 1).tokens == [4] and first.grade([2]) is None
    source, short = first.shorter()
    assert source == SHORT_RECYCLE and short.matrix is matrix and short.propose([2], 1).tokens == [6]


def random_matrix(seed: int, vocab: int = 12, width: int = 4) -> RecycleMatrix:
    """A matrix whose every token has a row of `width` distinct candidates, in a seeded order."""
    gen = torch.Generator().manual_seed(seed)
    matrix = RecycleMatrix(width)
    matrix.update(list(range(vocab)), torch.randn(vocab, vocab, generator=gen))
    return matrix


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 6), st.integers(1, 4), st.integers(1, 30))
def test_trees_keep_to_their_shape_and_start_with_the_chain(seed, k, width, nodes):
    drafter = RecyclingDrafter(random_matrix(seed))
    context = [seed % 12]
    chain = drafter.propose(context, k).tokens
    tree = drafter.propose_tree(context, k, width, nodes)
    assert len(chain) == k  # every token has a row
    if tree.parents is None:  # a chain: nothing but the chain fitted
        assert tree.tokens == chain[:nodes]
        return
    assert len(tree.tokens) <= nodes and max(depths(tree.parents)) + 1 <= k
    assert tree.parents[: len(chain)] == list(range(-1, len(chain) - 1)) and tree.tokens[: len(chain)] == chain
    children = Counter(tree.parents)
    assert max(children.values()) <= width
    paths = set()
    for i, parent in enumerate(tree.parents):
        before = context[-1] if parent < 0 else tree.tokens[parent]
        assert tree.tokens[i] in drafter.matrix.candidates(before)[:width]  # a node is a candidate of its parent
        paths.add((parent, tree.tokens[i]))
    assert len(paths) == len(tree.tokens)  # no two siblings alike


def test_a_tree_ranks_second_choices_near_the_root_first():
    drafter = RecyclingDrafter(RecycleMatrix(width=3))
    drafter.target_logits([0, 1, 2, 3, 4, 5], one_hot_rows([1, 4, 5], [2, 6, 7], [3, 8, 9], [1, 2, 3], [5, 6, 7],
                                                           [6, 7, 8]))
    tree = drafter.propose_tree([0], 3, 3, 5)
    # the chain 1 2 3, then the context's second and third candidates (RANK_PRIOR: .07 and .045 beat
    # the chain's first token's second one, .32 x .07)
    assert tree.tokens == [1, 2, 3, 4, 5] and tree.parents == [-1, 0, 1, -1, -1]
    assert drafter.propose_tree([0], 3, 1, 5).tokens == [1, 2, 3]  # width 1: the chain


# --------------------------------------------------------------------------- exactness through the loop

PROMPT = [5, 9, 13, 21, 34, 55, 89 % VOCAB, 5, 9, 13, 21, 34, 7, 8, 5, 9]


@cache
def model():
    """The tiny fp32 target, and its plain greedy output after PROMPT (made once, not at import: the
    chi-square's worker processes import this module)."""
    target = tiny_model("llama", 0)
    return target, run(HFRunner(target), PROMPT, StopCondition(48)).token_ids


@cache
def int8_model():
    """A tiny int8 target, whose tree forward is bitwise its chain's (specdec.native.lean), and its plain
    greedy output after PROMPT."""
    target = quantize_model(tiny_model("qwen2", 0))
    return target, run(LeanRunner(target), PROMPT, StopCondition(48)).token_ids


@pytest.mark.parametrize("gamma", range(1, 9))
def test_recycled_chains_equal_plain_greedy(gamma):
    target, plain = model()
    matrix = RecycleMatrix()
    outs = [run(HFRunner(target), PROMPT, StopCondition(48), drafter=RecyclingDrafter(matrix), num_speculative_tokens=gamma)
            for _ in range(2)]  # the second generation drafts from the first's matrix (the hot start)
    assert all(out.token_ids == plain for out in outs)
    assert outs[1].stats.accepted > 0 and outs[1].stats.accepted < outs[1].stats.drafted
    assert outs[1].stats.by_source[RECYCLE][1] == outs[1].stats.drafted


@pytest.mark.parametrize("gamma", range(1, 9))
@pytest.mark.parametrize("width", [2, 4])
def test_recycled_trees_equal_plain_greedy(gamma, width):
    target, plain = int8_model()
    matrix = RecycleMatrix()
    shape = TreeShape(width, depth=gamma)
    for _ in range(2):
        out = run(LeanRunner(target), PROMPT, StopCondition(48), drafter=RecyclingDrafter(matrix),
                  num_speculative_tokens=gamma, tree=shape)
        assert out.token_ids == plain
    assert out.stats.tree_steps > 0 and out.stats.accepted > 0


def test_the_cost_model_controller_keeps_acceptance_per_margin_and_equals_plain_greedy():
    target, plain = model()
    matrix = RecycleMatrix()
    for _ in range(2):
        controller = AutoK(Costs({1: 70.0, 2: 74.0, 9: 115.0}, draft_ms=10.0), max_k=8, cost_ewma=0.0)
        assert controller.source_prior(RECYCLE) == 0.2
        out = run(HFRunner(target), PROMPT, StopCondition(48), drafter=RecyclingDrafter(matrix),
                  num_speculative_tokens=controller)
        assert out.token_ids == plain
    assert out.stats.drafted > 0 and any(key.startswith("recycle margin ") for key in controller.hits)


def test_garbage_in_the_matrix_changes_nothing():
    target, plain = model()
    matrix = RecycleMatrix()
    matrix.update(list(range(VOCAB)), torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3)))
    out = run(HFRunner(target), PROMPT, StopCondition(48), drafter=RecyclingDrafter(matrix), num_speculative_tokens=6)
    assert out.token_ids == plain and out.stats.drafted > 0


def test_a_target_that_reads_only_the_last_token_is_drafted_whole():
    # Logits that depend on the last token alone: once each token of the greedy cycle was fed, the matrix
    # holds the target's own next tokens, and every recycled draft is accepted (rows paired with the
    # wrong tokens would not be).
    table = random_table(6, seed=5)[0].expand(7, 6, 6).clone()  # [a, b] -> the row after b, whatever a
    matrix = RecycleMatrix()
    for tree in (None, TreeShape(2, depth=4)):
        for _ in range(2):
            out = run(ToyTreeRunner(table), [0, 3], StopCondition(40), drafter=RecyclingDrafter(matrix),
                      num_speculative_tokens=4, tree=tree)
            assert out.token_ids == run(ToyRunner(table), [0, 3], StopCondition(40)).token_ids
        assert out.stats.accepted == out.stats.drafted > 30 and out.stats.target_forwards <= 9


def test_a_recycle_hybrid_hears_the_target_and_equals_plain_greedy():
    target, plain = model()
    matrix = RecycleMatrix()
    forwards = 0
    for _ in range(2):
        hybrid = HybridDrafter(ModelDrafter(HFRunner(tiny_model("llama", 1))), RecyclingDrafter(matrix, min_margin=1.0))
        out = run(HFRunner(target), PROMPT, StopCondition(48), drafter=hybrid, num_speculative_tokens=4)
        assert out.token_ids == plain
        forwards += out.stats.target_forwards
    assert matrix.updates == forwards  # each forward once: the short fallback shares the first's matrix
    assert hybrid.proposals[RECYCLE] > 0 and hybrid.proposals["model"] > 0


# --------------------------------------------------------------------------- the engine and the registry


def test_the_engine_shares_its_matrix_but_not_with_a_seeded_request():
    tok = tiny_tokenizer(0)
    engine = Engine(tiny_model("qwen2", 0, vocab_size=len(tok)), tok, copier=RECYCLE)
    assert engine.recycle_matrix is not None and engine.recycle_matrix.known == 0
    first = engine.generate("def fibonacci(n):", max_new_tokens=24, k=4)
    second = engine.generate("def fibonacci(n):", max_new_tokens=24, k=4)
    assert first.token_ids == second.token_ids == engine.generate("def fibonacci(n):", max_new_tokens=24,
                                                                  use_draft=False).token_ids
    assert engine.recycle_matrix.known > 0 and second.stats.accepted > first.stats.accepted
    shared = engine.recycle_matrix
    assert engine.make_drafter(SamplingParams()).matrix is shared
    assert engine.make_drafter(SamplingParams(temperature=0.7)).matrix is shared
    assert engine.make_drafter(SamplingParams(temperature=0.7, seed=3)).matrix is not shared  # its own
    twin = engine.fork()
    assert twin.recycle_matrix is not shared and twin.recycle_matrix.known == 0 and engine.recycle_matrix is shared
    engine.forget()
    assert engine.recycle_matrix is not shared and engine.recycle_matrix.known == 0


class Parts:
    """What an engine has loaded, as the factories read it (DraftingParts)."""

    def __init__(self) -> None:
        self.target_runner, self.draft_runner, self.head, self.suffix_store = object(), object(), None, None
        self.recycle_matrix = RecycleMatrix()

    def model_drafter(self, sampling, mode, confidence, runner):
        return LookupDrafter(max_ngram=7)  # a stand-in for a draft model's drafter


def test_the_registry_builds_recycling_alone_and_before_a_model():
    parts = Parts()
    alone = build_drafter(DrafterSpec(RECYCLE), parts, DraftRequest(SamplingParams(), "auto", None, object(), None))
    assert isinstance(alone, RecyclingDrafter) and alone.matrix is parts.recycle_matrix and alone.min_margin == 0
    hybrid = build_drafter(DrafterSpec(RECYCLE, "m"), parts, DraftRequest(SamplingParams(), "auto", None, object(), None))
    assert isinstance(hybrid, HybridDrafter) and hybrid.first == RECYCLE and hybrid.short_source == SHORT_RECYCLE
    assert hybrid.lookup.matrix is hybrid.short.matrix is parts.recycle_matrix
    assert hybrid.lookup.min_margin == HYBRID_MIN_MARGIN


# --------------------------------------------------------------------------- sampling through the loop

VOCAB_TOY = 6
TARGET = random_table(VOCAB_TOY, seed=0)
TOY_PROMPT = [1, 4]
MAX_NEW = 5
RUNS = 20_000
T08 = dict(temperature=0.8)


def warm_matrix() -> RecycleMatrix:
    """A matrix that heard the toy target after every pair (a, b) once, the pairs in a seeded order: every
    token has a row, a second-order target's row after one of its contexts."""
    matrix = RecycleMatrix(width=3)
    pairs = [(a, b) for a in range(VOCAB_TOY + 1) for b in range(VOCAB_TOY)]
    random.Random(7).shuffle(pairs)
    for a, b in pairs:
        matrix.update([b], TARGET[a, b].unsqueeze(0))
    return matrix


def sample_runs(case: str, seeds: range) -> dict:
    """The histogram of one seeded run's five new tokens per seed, with a copy of the warm matrix each
    (the run's drafts then depend on its own forwards only); draft totals."""
    warm = warm_matrix()
    tree = TreeShape(2, depth=3) if case == "tree" else None
    counts: Counter = Counter()
    drafted = accepted = trees = 0
    for seed in seeds:
        params = SamplingParams(seed=seed, **T08)
        out = run(ToyTreeRunner(TARGET), TOY_PROMPT, StopCondition(MAX_NEW), drafter=RecyclingDrafter(warm.copy()),
                  num_speculative_tokens=3, verifier=make_verifier(params), tree=tree)
        counts[tuple(out.token_ids)] += 1
        drafted, accepted, trees = drafted + out.stats.drafted, accepted + out.stats.accepted, trees + out.stats.tree_steps
    return {"counts": counts, "drafted": drafted, "accepted": accepted, "trees": trees}


# With seeds 0..19,999 (torch 2.13 CPU): p = 0.697 (chain), 0.425 (tree); acceptance 0.098 and 0.153.  A hook
# that changed the rows it heard (logits[:, 0] += 0.5 after the update) gave chi2 = 2,676 with 146 dof at 5,000 runs.
@pytest.mark.parametrize("case", ["chain", "tree"])
def test_recycled_drafts_keep_the_target_distribution(case):
    totals = seeded_runs(sample_runs, case, RUNS)
    stat, dof, p_value = chi_square(totals["counts"], chain_distribution(TARGET, SamplingParams(**T08), TOY_PROMPT, MAX_NEW))
    print(f"{case}: chi2={stat:.1f} dof={dof} p={p_value:.4f} acceptance={totals['accepted'] / totals['drafted']:.3f}")
    assert 0 < totals["accepted"] < totals["drafted"] and totals["drafted"] >= RUNS * 3
    assert (totals["trees"] >= RUNS) == (case == "tree")
    assert p_value > 0.001, f"{case}: chi2={stat:.1f} with {dof} dof, p={p_value:.2e}"
