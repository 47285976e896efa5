"""Tree sampling (recursive rejection sampling, specdec.algorithm.trees) emits exactly the target's distribution.

Exact: every random decision of verify_tree_sampling enumerated (tests/exact.py), for every tree the
drafter can draw, weighted by its probability; the emitted tokens, continued by the target, must match
the target's chain to 1e-9 — deterministic candidates (q None, any one tree), children drawn i.i.d. from
the parent's draft distribution (one common q row), and drawn without replacement (each child its own
row).  A drafter that drops duplicate siblings but keeps the common row is shown to be wrong, by the
same harness.  Statistical: chi-square of the real verifier with a real generator against the target.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator, Sequence

import pytest
import torch

from specdec.algorithm.draft import Draft
from specdec.algorithm.sampling import SamplingParams, make_generator, warp_probs
from specdec.algorithm.trees import chain_parents, children, verify_tree_sampling
from specdec.algorithm.verify import GreedyVerifier, SamplingVerifier
from tests.algorithm.test_trees import path_to
from tests.algorithm.test_verify_sampling import ONE_HOT_WARPS, clear_argmax_logits
from tests.chisq import chi_square
from tests.exact import Dist, Toy, assert_target_distribution, emitted, make_toy, mix, target_deviation

SHAPES = {
    "2-(2,1)": [-1, -1, 0, 0, 1],  # root: 2 children; the first has 2, the second 1
    "3-(1,0,1)": [-1, -1, -1, 0, 2],  # root: 3 children; a leaf in the middle
    "3": [-1, -1, -1],  # one level, 3 wide
    "chain": [-1, 0],  # a chain given as a tree: token-by-token speculative sampling
    "1-3": [-1, 0, 0, 0],  # one root child, then 3 wide
}


def prefix_of(tokens: Sequence[int], parents: Sequence[int], node: int) -> tuple[int, ...]:
    """The tokens from the root down to node (inclusive); () for -1."""
    return tuple(tokens[j] for j in path_to(parents, node))


def target_rows(toy: Toy, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
    """p [n + 1, V]: row node + 1 is the target's distribution after node's path."""
    return torch.stack([toy.target[prefix_of(tokens, parents, node)] for node in range(-1, len(tokens))])


def tree_dist(toy: Toy, tokens: Sequence[int], parents: Sequence[int], q: torch.Tensor | None) -> Dist:
    """The exact distribution of what verify_tree_sampling emits for one tree."""
    p = target_rows(toy, tokens, parents)
    return emitted(lambda rng: verify_tree_sampling(tokens, parents, q, p, rng),
                   lambda verdict: tuple(tokens[j] for j in verdict.path))


def drawn_trees(toy: Toy, parents: Sequence[int], replacement: bool) -> Iterator[tuple[float, list[int], torch.Tensor]]:
    """Every tree the drafter can draw, (probability, tokens, q [n, V]): each node's token from the draft's
    distribution after its parent's path, i.i.d. among siblings (replacement) or without replacement
    (that distribution without the earlier siblings' tokens, renormalised: each child its own q row)."""
    for tokens in itertools.product(range(toy.vocab), repeat=len(parents)):
        weight, rows = 1.0, []
        for i, parent in enumerate(parents):
            row = toy.draft[prefix_of(tokens, parents, parent)]
            if not replacement:
                row = row.clone()
                row[[tokens[j] for j in range(i) if parents[j] == parent]] = 0.0
                row = row / row.sum() if float(row.sum()) > 0.0 else row
            weight *= float(row[tokens[i]])
            rows.append(row)
            if weight == 0.0:
                break
        if weight > 0.0:
            yield weight, list(tokens), torch.stack(rows)


# --------------------------------------------------------------------------- exact: drawn trees (q given)

DRAWN = [  # seed, vocab, shape, target kind, draft kind
    (1, 4, "2-(2,1)", "dense", "near:dense"),
    (2, 4, "2-(2,1)", "zeros", "dense"),
    (3, 4, "3-(1,0,1)", "dense", "dense"),
    (4, 4, "3-(1,0,1)", "top2", "near:zeros"),
    (5, 5, "3", "dense", "near:dense"),
    (6, 5, "3", "peaked", "dense"),
    (7, 6, "chain", "dense", "near:dense"),
    (8, 4, "1-3", "zeros", "near:zeros"),
    (9, 4, "2-(2,1)", "dense", "same"),
]


# Without replacement only where the draft has no zeros: siblings never run out of tokens.
DRAWN_CASES = [(*case, True) for case in DRAWN] + [(*case, False) for case in DRAWN if "zeros" not in case[4]]


@pytest.mark.parametrize("seed,vocab,shape,target_kind,draft_kind,replacement", DRAWN_CASES,
                         ids=[f"{c[2]}-{c[3]}-{c[4]}-{'iid' if c[5] else 'without-replacement'}" for c in DRAWN_CASES])
def test_drawn_trees_are_lossless_exactly(seed, vocab, shape, target_kind, draft_kind, replacement):
    parents = SHAPES[shape]
    toy = make_toy(seed, vocab, max(len(path_to(parents, i)) for i in range(len(parents))), target_kind, draft_kind)
    trees = list(drawn_trees(toy, parents, replacement))
    assert abs(sum(w for w, _, _ in trees) - 1.0) < 1e-12
    dist = mix((w, tree_dist(toy, tokens, parents, q)) for w, tokens, q in trees)
    assert_target_distribution(toy, dist)
    if draft_kind == "same" and replacement:  # q == p: the first child is always accepted, down to a leaf
        assert all(len(seq) == 3 for seq in dist)


def test_dropping_duplicate_siblings_with_the_common_row_is_not_lossless():
    # The harness can fail: i.i.d. children whose duplicates are dropped, verified with the common row.
    toy = make_toy(11, 4, 1, "dense", "dense")
    toy.target[()] = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    toy.draft[()] = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)  # residuals of 2 tokens, then 1
    parents = SHAPES["3"]
    kept_duplicates, dropped = [], []
    for weight, tokens, q in drawn_trees(toy, parents, replacement=True):
        kept_duplicates.append((weight, tree_dist(toy, tokens, parents, q)))
        keep = [i for i in range(len(tokens)) if tokens[i] not in tokens[:i]]
        dropped.append((weight, tree_dist(toy, [tokens[i] for i in keep], [-1] * len(keep), q[keep])))
    assert_target_distribution(toy, mix(iter(kept_duplicates)))
    assert target_deviation(toy, mix(iter(dropped))) > 1e-3


# --------------------------------------------------------------------------- exact: deterministic candidates


def candidate_tree(toy: Toy, parents: Sequence[int], order: str) -> list[int]:
    """Distinct sibling tokens: the draft's most likely ones in order (top-w of a greedy draft), or its
    least likely ones first (tokens the target often excludes)."""
    tokens: list[int] = []
    for i, parent in enumerate(parents):
        ranked = toy.draft[prefix_of(tokens, parents, parent)].argsort(descending=order == "top").tolist()
        taken = {tokens[j] for j in range(i) if parents[j] == parent}
        tokens.append(next(t for t in ranked if t not in taken))
    return tokens


@pytest.mark.parametrize("order", ["top", "bottom"])
@pytest.mark.parametrize("seed,vocab,shape,target_kind,draft_kind", DRAWN, ids=[f"{c[2]}-{c[3]}-{c[4]}" for c in DRAWN])
def test_candidate_trees_are_lossless_exactly(seed, vocab, shape, target_kind, draft_kind, order):
    parents = SHAPES[shape]
    toy = make_toy(seed, vocab, max(len(path_to(parents, i)) for i in range(len(parents))), target_kind, draft_kind)
    tokens = candidate_tree(toy, parents, order)
    assert_target_distribution(toy, tree_dist(toy, tokens, parents, None))


def test_a_rejected_candidate_is_removed_from_the_target():
    # Root candidates 0 then 1 over p = (0.5, 0.3, 0.2): accept 0 w.p. 0.5; else 1 w.p. 0.3 / 0.5; else 2.
    toy = Toy(3, 1, {(): torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64),
                     **{(t,): torch.full((3,), 1 / 3, dtype=torch.float64) for t in range(3)}}, {})
    dist = tree_dist(toy, [0, 1], [-1, -1], None)
    first = [sum(prob for seq, prob in dist.items() if seq[0] == t) for t in range(3)]
    assert max(abs(a - b) for a, b in zip(first, [0.5, 0.3, 0.2])) < 1e-12
    assert abs(sum(prob for seq, prob in dist.items() if len(seq) == 2) - 0.8) < 1e-12  # 0 or 1 accepted
    assert abs(dist[(2,)] - 0.2) < 1e-12  # both rejected: the residual is all on token 2


def test_duplicate_candidates_and_excluded_tokens_are_never_accepted():
    toy = make_toy(12, 4, 1, "zeros", "dense")
    root = toy.target[()]
    excluded = int(root.argmin())
    assert float(root[excluded]) == 0.0
    tokens = [excluded, int(root.argmax()), int(root.argmax())]
    dist = tree_dist(toy, tokens, [-1, -1, -1], None)
    assert_target_distribution(toy, dist)
    assert all(seq[0] != excluded for seq in dist)


# --------------------------------------------------------------------------- the verifiers


@ONE_HOT_WARPS
def test_sampling_tree_verifier_degenerates_to_greedy(params):
    # Tree sampling (and block verification, for chains) with a one-hot warp: greedy, whatever q is.
    gen = torch.Generator().manual_seed(13)
    for trial in range(150):
        n = 1 + trial % 7
        parents = [int(torch.randint(-1, i, (), generator=gen)) for i in range(n)]
        logits = clear_argmax_logits(n + 1, 10, gen)  # [n+1, V]
        want = logits.argmax(-1).tolist()
        tokens = [want[p + 1] if (trial + i) % 3 else (want[p + 1] + 1 + i) % 10 for i, p in enumerate(parents)]
        greedy = GreedyVerifier().verify_tree(Draft(tokens, parents=parents), logits)
        q = warp_probs(torch.randn(n, 10, generator=gen) * 3, SamplingParams(temperature=1.0))  # [n, V]
        for draft_q in (q, None):
            for block in (False, True):
                verifier = SamplingVerifier(SamplingParams(params.temperature, params.top_k, seed=trial), block=block)
                assert verifier.verify_tree(Draft(tokens, draft_q, parents=parents), logits) == greedy


def test_a_chain_tree_goes_through_verify():
    # SamplingVerifier.verify_tree on a chain: verify's verdict (token by token, or block), path filled.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 8, generator=gen)  # [k+1, V]
    q = warp_probs(torch.randn(3, 8, generator=gen), SamplingParams(temperature=1.0))  # [k, V]
    for block in (False, True):
        for seed in range(30):
            params = SamplingParams(temperature=1.0, seed=seed)
            chain = SamplingVerifier(params, block=block).verify(Draft([1, 2, 3], q), logits)
            for parents in (None, chain_parents(3)):
                tree = SamplingVerifier(params, block=block).verify_tree(Draft([1, 2, 3], q, parents=parents), logits)
                assert tree.path == tuple(range(chain.num_accepted))
                assert (tree.num_accepted, tree.next_token) == (chain.num_accepted, chain.next_token)


# --------------------------------------------------------------------------- chi-square: the real thing

VOCAB = 4
CHI_SHAPE = SHAPES["2-(2,1)"]
CHI_PARAMS = SamplingParams(temperature=0.9, top_k=3)
CHI_RUNS = 20_000


def chi_tables() -> tuple[dict, dict, dict]:
    """Target logits [V] (float32) and its warped p for every prefix of up to 2 tokens; the draft's q up to 1."""
    gen = torch.Generator().manual_seed(21)
    prefixes = [pre for n in range(3) for pre in itertools.product(range(VOCAB), repeat=n)]
    logits = {pre: torch.randn(VOCAB, generator=gen) * 1.5 for pre in prefixes}
    p = {pre: warp_probs(row, CHI_PARAMS) for pre, row in logits.items()}
    q = {pre: warp_probs(logits[pre] + torch.randn(VOCAB, generator=gen), CHI_PARAMS) for pre in prefixes if len(pre) < 2}
    return logits, p, q


@pytest.mark.parametrize("mode", ["iid", "candidates"])
def test_tree_sampling_matches_the_target_chi_square(mode):
    logits, p, q = chi_tables()
    kids = children(CHI_SHAPE)
    verifier = SamplingVerifier(SamplingParams(CHI_PARAMS.temperature, CHI_PARAMS.top_k, seed=1))
    draft_gen, rest_gen = make_generator(1, stream=1), make_generator(1, stream=2)
    counts: Counter = Counter()
    accepted = Counter()
    for _ in range(CHI_RUNS):
        tokens: list[int] = []
        rows = []
        for i, parent in enumerate(CHI_SHAPE):
            row = q[prefix_of(tokens, CHI_SHAPE, parent)]
            if mode == "iid":
                tokens.append(int(torch.multinomial(row, 1, generator=draft_gen)))
            else:  # the draft's top-w: siblings in order of draft probability
                tokens.append(int(row.argsort(descending=True)[kids[parent + 1].index(i)]))
            rows.append(row)
        draft = Draft(tokens, torch.stack(rows) if mode == "iid" else None, parents=CHI_SHAPE)
        target_logits = torch.stack([logits[prefix_of(tokens, CHI_SHAPE, node)] for node in range(-1, len(tokens))])
        verdict = verifier.verify_tree(draft, target_logits)
        seq = tuple(tokens[j] for j in verdict.path) + (verdict.next_token,)
        while len(seq) < 3:  # the target continues
            seq += (int(torch.multinomial(p[seq], 1, generator=rest_gen)),)
        counts[seq] += 1
        accepted[verdict.num_accepted] += 1
    exact = {seq: float(p[()][seq[0]]) * float(p[seq[:1]][seq[1]]) * float(p[seq[:2]][seq[2]])
             for seq in itertools.product(range(VOCAB), repeat=3)}
    stat, dof, p_value = chi_square(counts, exact)
    print(f"{mode}: chi2={stat:.1f} dof={dof} p={p_value:.4f} accepted={dict(accepted)}")
    assert accepted[2] > CHI_RUNS // 10 and accepted[0] > 0  # deep accepts and full rejections both happen
    assert p_value > 0.001, f"chi2={stat:.1f} with {dof} dof, p={p_value:.2e}"
