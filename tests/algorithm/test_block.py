"""Block verification (specdec.algorithm.block; Sun et al. 2024) is lossless and accepts at least as much as token by token.

Exact: every random decision of verify_block enumerated (tests/exact.py), for every draft block the
drafter can draw, weighted by its probability: the emitted tokens, continued by the target, match the
target's chain to 1e-9.  The expected accepted length, computed the same way, is compared with that of
the real token-by-token verifier (verify_speculative, enumerated by test_verify_sampling's harness).
Statistical: chi-square of SamplingVerifier(block=True) with a real generator against the target.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from specdec.algorithm.block import verify_block
from specdec.algorithm.draft import Draft
from specdec.algorithm.sampling import SamplingParams, make_generator, warp_probs
from specdec.algorithm.trees import verify_tree_sampling
from specdec.algorithm.verify import SamplingVerifier, Verdict
from tests.algorithm.test_verify_sampling import CodePath, code_verdict
from tests.chisq import chi_square
from tests.exact import Dist, Toy, assert_target_distribution, emitted, make_toy, mix, outcomes


def drafts(toy: Toy, k: int) -> Iterator[tuple[float, list[int], torch.Tensor, torch.Tensor]]:
    """Every block of k tokens the drafter can draw: (probability, tokens, q [k, V], p [k+1, V])."""
    for tokens in itertools.product(range(toy.vocab), repeat=k):
        q = torch.stack([toy.draft[tokens[:i]] for i in range(k)]) if k else torch.zeros(0, toy.vocab)
        weight = 1.0
        for i, token in enumerate(tokens):
            weight *= float(q[i, token])
        if weight > 0.0:
            yield weight, list(tokens), q, torch.stack([toy.target[tokens[:i]] for i in range(k + 1)])


def block_dist(tokens: list[int], q: torch.Tensor | None, p: torch.Tensor) -> Dist:
    """The exact distribution of what verify_block emits for one block."""
    return emitted(lambda rng: verify_block(tokens, q, p, rng), lambda verdict: tuple(tokens[: verdict.num_accepted]))


def mean_accepted(dist: Dist) -> float:
    return sum(prob * (len(seq) - 1) for seq, prob in dist.items())


CASES = [  # seed, vocab, k, target kind, draft kind
    (1, 4, 3, "dense", "near:dense"),
    (2, 4, 3, "dense", "dense"),
    (3, 4, 3, "zeros", "near:zeros"),
    (4, 5, 2, "top2", "dense"),
    (5, 4, 3, "peaked", "near:dense"),
    (6, 6, 2, "dense", "near:dense"),
    (7, 3, 4, "dense", "dense"),
    (8, 4, 3, "dense", "same"),
    (9, 4, 1, "dense", "dense"),
]


@pytest.mark.parametrize("seed,vocab,k,target_kind,draft_kind", CASES, ids=[f"{c[3]}-{c[4]}-V{c[1]}-k{c[2]}" for c in CASES])
def test_block_verification_is_lossless_exactly(seed, vocab, k, target_kind, draft_kind):
    toy = make_toy(seed, vocab, k, target_kind, draft_kind)
    parts = [(w, block_dist(tokens, q, p)) for w, tokens, q, p in drafts(toy, k)]
    dist = mix(iter(parts))
    assert_target_distribution(toy, dist)
    if draft_kind == "same":  # q == p: the whole block is always kept
        assert all(len(seq) == k + 1 for seq in dist)


@pytest.mark.parametrize("proposal", ["argmax", "second", "random"])
def test_deterministic_blocks_are_lossless_and_accept_as_token_by_token(proposal):
    # q None: one-hot rows.  Lossless for any fixed block, and the accepted length is distributed
    # exactly as token by token's (the tree verifier on a chain: Leviathan et al.'s rule).
    toy = make_toy(10, 4, 3, "dense", "dense")
    gen = torch.Generator().manual_seed(0)
    tokens: list[int] = []
    for _ in range(3):
        ranked = toy.target[tuple(tokens)].argsort(descending=True).tolist()
        tokens.append({"argmax": ranked[0], "second": ranked[1], "random": int(torch.randint(0, 4, (), generator=gen))}[proposal])
    p = torch.stack([toy.target[tuple(tokens[:i])] for i in range(4)])
    dist = block_dist(tokens, None, p)
    assert_target_distribution(toy, dist)
    chain = emitted(lambda rng: verify_tree_sampling(tokens, None, None, p, rng),
                    lambda verdict: tuple(tokens[: verdict.num_accepted]))
    for n in range(4):
        block_n = sum(prob for seq, prob in dist.items() if len(seq) == n + 1)
        chain_n = sum(prob for seq, prob in chain.items() if len(seq) == n + 1)
        assert abs(block_n - chain_n) < 1e-12


@pytest.mark.parametrize("seed,vocab,k,target_kind,draft_kind", CASES, ids=[f"{c[3]}-{c[4]}-V{c[1]}-k{c[2]}" for c in CASES])
def test_block_accepts_at_least_as_many_tokens_as_token_by_token(monkeypatch, seed, vocab, k, target_kind, draft_kind):
    toy = make_toy(seed, vocab, k, target_kind, draft_kind)
    path = CodePath(monkeypatch)  # verify_speculative, every branch enumerated
    block = token = 0.0
    for weight, tokens, q, p in drafts(toy, k):
        block += weight * mean_accepted(block_dist(tokens, q, p))
        token += weight * mean_accepted(code_verdict(path, tokens, q, p))
    print(f"expected accepted: block {block:.6f}, token by token {token:.6f}")
    assert block >= token - 1e-12
    if k == 1 or draft_kind == "same":
        assert abs(block - token) < 1e-9  # one token, or everything accepted: the same rule
    elif target_kind == "dense":
        assert block > token + 1e-4  # a real gain


def test_the_papers_example():
    # Sun et al. 2024, the introduction's example: context-free models over {a, b}, the target
    # (1/3, 2/3), the draft (2/3, 1/3), two draft tokens: token by token accepts 10/9 tokens on
    # average, block verification 11/9.
    target, draft = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    toy = Toy(2, 2, {pre: target for n in range(3) for pre in itertools.product(range(2), repeat=n)},
              {pre: draft for n in range(2) for pre in itertools.product(range(2), repeat=n)})
    block = mix((w, block_dist(tokens, q, p)) for w, tokens, q, p in drafts(toy, 2))
    assert_target_distribution(toy, block)
    assert abs(mean_accepted(block) - 11 / 9) < 1e-12
    chain = mix((w, emitted(lambda rng, t=tokens, q=q, p=p: verify_tree_sampling(t, None, q, p, rng),
                            lambda verdict, t=tokens: tuple(t[: verdict.num_accepted])))
                for w, tokens, q, p in drafts(toy, 2))
    assert abs(mean_accepted(chain) - 10 / 9) < 1e-12


def test_block_coins_are_tossed_from_the_end():
    # q == p: the last coin (probability w_k = 1) decides at once; nothing else is tossed.
    p = torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.9, 0.1]], dtype=torch.float64)
    found = outcomes(lambda rng: verify_block([0, 1], p[:2], p, rng))
    assert [(w, v.num_accepted) for w, v, _ in found] == [(1.0, 2)]
    assert torch.equal(found[0][2], p[2])


def test_empty_block_is_a_plain_step():
    p = torch.tensor([[0.0, 0.0, 1.0]])
    assert verify_block([], None, p, make_generator(0)) == Verdict(0, 2)
    assert verify_block([], torch.zeros(0, 3), p, make_generator(0)) == Verdict(0, 2)


def test_block_verifier_is_reproducible_and_is_not_the_default():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 8, generator=gen)
    q = warp_probs(torch.randn(3, 8, generator=gen), SamplingParams(temperature=1.0))
    assert SamplingVerifier(SamplingParams(temperature=1.0)).block is False
    runs = [[SamplingVerifier(SamplingParams(temperature=1.0, seed=s), block=True).verify(Draft([1, 2, 3], q), logits)
             for s in range(40)] for _ in range(2)]
    assert runs[0] == runs[1] and len(set(runs[0])) >= 3


# --------------------------------------------------------------------------- chi-square: the real thing

VOCAB, K = 4, 3
CHI_PARAMS = SamplingParams(temperature=0.8, top_p=0.95)
CHI_RUNS = 20_000


def test_block_verifier_matches_the_target_chi_square():
    gen = torch.Generator().manual_seed(31)
    prefixes = [pre for n in range(K + 1) for pre in itertools.product(range(VOCAB), repeat=n)]
    logits = {pre: torch.randn(VOCAB, generator=gen) * 1.5 for pre in prefixes}
    p = {pre: warp_probs(row, CHI_PARAMS) for pre, row in logits.items()}
    q = {pre: warp_probs(logits[pre] + torch.randn(VOCAB, generator=gen) * 0.7, CHI_PARAMS)
         for pre in prefixes if len(pre) < K}
    verifier = SamplingVerifier(SamplingParams(CHI_PARAMS.temperature, top_p=CHI_PARAMS.top_p, seed=2), block=True)
    draft_gen = make_generator(2, stream=1)
    counts: Counter = Counter()
    accepted: Counter = Counter()
    for _ in range(CHI_RUNS):
        tokens: list[int] = []
        for _ in range(K):
            tokens.append(int(torch.multinomial(q[tuple(tokens)], 1, generator=draft_gen)))
        draft = Draft(tokens, torch.stack([q[tuple(tokens[:i])] for i in range(K)]))
        verdict = verifier.verify(draft, torch.stack([logits[tuple(tokens[:i])] for i in range(K + 1)]))
        seq = tuple(tokens[: verdict.num_accepted]) + (verdict.next_token,)
        while len(seq) < K + 1:  # the target continues
            seq += (int(torch.multinomial(p[seq], 1, generator=draft_gen)),)
        counts[seq] += 1
        accepted[verdict.num_accepted] += 1
    exact = {}
    for seq in itertools.product(range(VOCAB), repeat=K + 1):
        prob = 1.0
        for i, token in enumerate(seq):
            prob *= float(p[seq[:i]][token])
        exact[seq] = prob
    stat, dof, p_value = chi_square(counts, exact)
    print(f"block: chi2={stat:.1f} dof={dof} p={p_value:.4f} accepted={dict(accepted)}")
    assert min(accepted[n] for n in range(K + 1)) > CHI_RUNS // 50  # every accepted length happens
    assert p_value > 0.001, f"chi2={stat:.1f} with {dof} dof, p={p_value:.2e}"
