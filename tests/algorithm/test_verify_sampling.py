"""Speculative-sampling verification is exact: proved by enumerating every branch, not by sampling.

verify_speculative is run with *scripted* uniform draws and with sample_from
replaced by a probe that returns the distribution it was handed.  For each
draft position the set of uniforms u that the code accepts is located (by
bisection, and checked to be an interval [0, t) on a grid), so P(accept) = t
is read off the code itself; the recovered/bonus distributions are read off
the same way.  That gives the exact distribution of the tokens verify_speculative
emits for one draft; summing over every draft sequence the drafter can produce
(weighted by q) gives the exact distribution of one speculative step.

A toy "model" supplies p and q: p_i = target[prefix], q_i = draft[prefix],
seeded random tables over all prefixes of up to γ tokens, the draft sampling
x_{i+1} from q given its own earlier draft tokens and the target's p for
position i conditioned on the actual prefix.  The step is lossless when, for
every m ≤ γ+1, the first m tokens (the step's tokens, continued by the target
itself where the step emitted fewer) are distributed exactly as the target's
chain: that is checked to 1e-6, together with the first token's marginal = p_1.
The same is checked for an independent float64 enumerator written from the
paper's formulas (Leviathan et al. 2023, Alg. 1), which also has to agree with
the code draft by draft.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import specdec.algorithm.verify as verify_module
from specdec.algorithm.draft import Draft
from specdec.algorithm.sampling import SamplingParams, make_generator, warp_probs
from specdec.algorithm.verify import SamplingVerifier, Verdict, verify_greedy, verify_speculative
from specdec.bridge import VocabularyMap

TOL = 1e-6
Dist = dict[tuple[int, ...], float]  # emitted token sequence -> probability


# --------------------------------------------------------------------------- the code path


@dataclass(frozen=True)
class Captured:
    """What verify_speculative handed to sample_from: the normalised distribution."""

    dist: tuple[float, ...]


class CodePath:
    """verify_speculative with scripted uniforms and probed sampling (see the module doc)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.generator = torch.Generator()
        self.script: list[float] = []
        real_rand = torch.rand

        def rand(*size, generator=None, dtype=None, **kwargs):
            if generator is not self.generator:
                return real_rand(*size, generator=generator, dtype=dtype, **kwargs)
            shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)
            n = math.prod(shape)
            assert len(self.script) >= n, "verify_speculative drew more uniforms than it has positions"
            values, self.script = self.script[:n], self.script[n:]
            return torch.tensor(values, dtype=dtype or torch.get_default_dtype()).reshape(shape)

        def sample_from(probs: torch.Tensor, generator: torch.Generator) -> Captured:
            assert generator is self.generator
            probs = probs.double()
            assert bool((probs >= 0).all()) and float(probs.sum()) > 0, probs
            return Captured(tuple((probs / probs.sum()).tolist()))

        monkeypatch.setattr(torch, "rand", rand)
        monkeypatch.setattr(verify_module, "sample_from", sample_from)

    def __call__(self, tokens: list[int], q: torch.Tensor | None, p: torch.Tensor, uniforms: list[float]) -> Verdict:
        self.script = list(uniforms)
        verdict = verify_speculative(tokens, q, p, self.generator)
        assert not tokens or len(self.script) < len(uniforms), "no uniform was drawn through torch.rand: update CodePath"
        return verdict


GRID = [j / 8 for j in range(8)] + [1 - 2**-53]


def acceptance_threshold(accepts: Callable[[float], bool]) -> float:
    """t such that accepts(u) == (u < t) for u in [0, 1), i.e. P(accept) = t."""
    if not accepts(0.0):
        t = 0.0
    elif accepts(1 - 2**-53):
        t = 1.0
    else:
        lo, hi = 0.0, 1 - 2**-53  # accepts(lo), not accepts(hi)
        while hi - lo > 1e-13:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if accepts(mid) else (lo, mid)
        t = hi
    for u in GRID:  # the accepted uniforms really are an interval [0, t)
        if abs(u - t) > 1e-12:
            assert accepts(u) == (u < t), f"acceptance is not a threshold in u: u={u}, t={t}"
    return t


def code_verdict(path: CodePath, tokens: list[int], q: torch.Tensor | None, p: torch.Tensor) -> Dist:
    """The exact distribution of the tokens verify_speculative emits for this draft."""
    k = len(tokens)
    out: Dist = defaultdict(float)
    reach = 1.0  # probability that positions < i were all accepted

    def uniforms(i: int, u: float) -> list[float]:
        return [0.0] * i + [u] + [0.0] * (k - i - 1)  # 0.0 is inside every reachable [0, t)

    def add(prefix: tuple[int, ...], weight: float, verdict: Verdict) -> None:
        assert isinstance(verdict.next_token, Captured), "the next token must be sampled"
        for token, w in enumerate(verdict.next_token.dist):
            if w > 0.0:
                out[prefix + (token,)] += weight * w

    for i in range(k):
        t = acceptance_threshold(lambda u, i=i: path(tokens, q, p, uniforms(i, u)).num_accepted > i)
        if t < 1.0:
            verdict = path(tokens, q, p, uniforms(i, (1.0 + t) / 2))
            assert verdict.num_accepted == i
            add(tuple(tokens[:i]), reach * (1.0 - t), verdict)
        reach *= t
        if reach == 0.0:
            return dict(out)
    verdict = path(tokens, q, p, [0.0] * k)
    assert verdict.num_accepted == k
    add(tuple(tokens), reach, verdict)
    return dict(out)


# --------------------------------------------------------------------------- the paper's formulas


def spec_verdict(tokens: list[int], q: torch.Tensor | None, p: torch.Tensor) -> Dist:
    """Independent float64 enumerator of Leviathan et al. Alg. 1 for one draft.

    Accept x_i with probability min(1, p_i(x_i)/q_i(x_i)) (a token the target gives
    probability 0 is never accepted); first rejection: norm(max(0, p_i - q_i)), with
    q_i one-hot on x_i when q is None; all accepted: the bonus from p_{k+1}."""
    p = p.double()
    q = q.double() if q is not None else None
    out: Dist = defaultdict(float)
    reach = 1.0
    for i, x in enumerate(tokens):
        q_row = torch.nn.functional.one_hot(torch.tensor(x), p.shape[-1]).double() if q is None else q[i]
        p_x, q_x = float(p[i, x]), float(q_row[x])
        accept = 0.0 if p_x == 0.0 else (1.0 if q_x <= p_x else p_x / q_x)
        if accept < 1.0:
            residual = torch.clamp(p[i] - q_row, min=0.0)
            assert float(residual.sum()) > 0.0
            for token, w in enumerate((residual / residual.sum()).tolist()):
                if w > 0.0:
                    out[tuple(tokens[:i]) + (token,)] += reach * (1.0 - accept) * w
        reach *= accept
        if reach == 0.0:
            return dict(out)
    for token, w in enumerate(p[len(tokens)].tolist()):
        if w > 0.0:
            out[tuple(tokens) + (token,)] += reach * w
    return dict(out)


# --------------------------------------------------------------------------- the toy chain


@dataclass
class Chain:
    """Target p and draft q for every prefix (within one step) of up to γ tokens."""

    vocab: int
    gamma: int
    target: dict[tuple[int, ...], torch.Tensor]  # prefix -> p [V] (float32, as the target warps)
    draft: dict[tuple[int, ...], torch.Tensor] | None  # prefix -> q [V]; None: deterministic proposals
    proposal: dict[tuple[int, ...], int] | None = None  # prefix -> the proposed token when q is None

    def drafts(self):
        """Every draft sequence x_1..x_γ the drafter can produce, with its probability."""

        def extend(prefix: tuple[int, ...], weight: float):
            if len(prefix) == self.gamma:
                yield list(prefix), weight
                return
            if self.draft is None:
                yield from extend(prefix + (self.proposal[prefix],), weight)
                return
            for token, q_x in enumerate(self.draft[prefix].double().tolist()):
                if q_x > 0.0:
                    yield from extend(prefix + (token,), weight * q_x)

        yield from extend((), 1.0)

    def rows(self, tokens: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """q [k, V] (or None) and p [k+1, V] for a draft, each conditioned on its actual prefix."""
        p = torch.stack([self.target[tuple(tokens[:i])] for i in range(len(tokens) + 1)])
        q = None if self.draft is None else torch.stack([self.draft[tuple(tokens[:i])] for i in range(len(tokens))])
        return q, p

    def target_prob(self, prefix: tuple[int, ...], continuation: tuple[int, ...]) -> float:
        """P_target(continuation | prefix) along the chain."""
        prob = 1.0
        for j, token in enumerate(continuation):
            prob *= float(self.target[prefix + continuation[:j]][token])
        return prob


def step_distribution(chain: Chain, verdict: Callable[[list[int], torch.Tensor | None, torch.Tensor], Dist]) -> Dist:
    """The exact distribution of the tokens one speculative step emits."""
    out: Dist = defaultdict(float)
    for tokens, weight in chain.drafts():
        q, p = chain.rows(tokens)
        for emitted, prob in verdict(tokens, q, p).items():
            out[emitted] += weight * prob
    return dict(out)


def assert_lossless(chain: Chain, emitted: Dist) -> None:
    """Every m ≤ γ+1: the first m tokens (the step's, continued by the target) ~ the target's chain."""
    assert abs(sum(emitted.values()) - 1.0) < TOL
    first = [0.0] * chain.vocab
    for seq, prob in emitted.items():
        first[seq[0]] += prob
    p1 = chain.target[()].double().tolist()
    assert max(abs(a - b) for a, b in zip(first, p1)) < TOL, (first, p1)
    for m in range(1, chain.gamma + 2):
        completed: dict[tuple[int, ...], float] = defaultdict(float)
        for seq, prob in emitted.items():
            if len(seq) >= m:
                completed[seq[:m]] += prob
            else:
                for rest in itertools.product(range(chain.vocab), repeat=m - len(seq)):
                    completed[seq + rest] += prob * chain.target_prob(seq, rest)
        worst = max(
            abs(completed.get(s, 0.0) - chain.target_prob((), s))
            for s in itertools.product(range(chain.vocab), repeat=m)
        )
        assert worst < TOL, f"first {m} tokens differ from the target's chain by {worst}"


def make_rows(kind: str, logits: torch.Tensor, gen: torch.Generator) -> list[torch.Tensor]:
    """Probability rows [V] (float32) of the given kind from logits [count, V]."""
    count, vocab = logits.shape
    if kind == "dense":
        probs = warp_probs(logits, SamplingParams(temperature=1.0))
    elif kind == "zeros":  # random exact zeros, at least one token left
        probs = warp_probs(logits, SamplingParams(temperature=1.0))
        zero = torch.rand(count, vocab, generator=gen) < 0.4
        zero[torch.arange(count), torch.randint(0, vocab, (count,), generator=gen)] = False
        probs = probs.masked_fill(zero, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    elif kind == "peaked":  # nearly one-hot
        probs = warp_probs(logits, SamplingParams(temperature=0.1))
    elif kind.startswith("warp:"):  # "warp:temperature,top_k,top_p"
        temperature, top_k, top_p = kind[5:].split(",")
        probs = warp_probs(logits, SamplingParams(float(temperature), int(top_k), float(top_p)))
    else:
        raise ValueError(kind)
    return list(probs)


def make_chain(seed: int, vocab: int, gamma: int, target_kind: str, draft_kind: str) -> Chain:
    """draft_kind: a row kind (independent logits), "near:<kind>" (the target's logits plus
    noise, like a real draft model), "same" (q = p), "none" (random deterministic
    proposals), "none:argmax" / "none:second" (the target's most / second most likely token,
    proposed deterministically)."""
    gen = torch.Generator().manual_seed(seed)
    prefixes = [pre for n in range(gamma + 1) for pre in itertools.product(range(vocab), repeat=n)]
    logits = torch.randn(len(prefixes), vocab, generator=gen) * 1.5  # [prefixes, V]
    target = dict(zip(prefixes, make_rows(target_kind, logits, gen)))
    draft_prefixes = [pre for pre in prefixes if len(pre) < gamma]  # prefixes is ordered by length
    if draft_kind == "none":
        proposal = torch.randint(0, vocab, (len(draft_prefixes),), generator=gen).tolist()
        return Chain(vocab, gamma, target, None, dict(zip(draft_prefixes, proposal)))
    if draft_kind in ("none:argmax", "none:second"):
        rank = 0 if draft_kind == "none:argmax" else 1
        proposal = {pre: int(target[pre].argsort(descending=True)[rank]) for pre in draft_prefixes}
        return Chain(vocab, gamma, target, None, proposal)
    if draft_kind == "same":
        return Chain(vocab, gamma, target, {pre: target[pre] for pre in draft_prefixes})
    if draft_kind.startswith("shared:"):  # universal drafting over the shared vocabulary
        rows = shared_rows(draft_kind[7:], vocab, len(draft_prefixes), gen)
        return Chain(vocab, gamma, target, dict(zip(draft_prefixes, rows)))
    if draft_kind.startswith("near:"):
        draft_logits = logits[: len(draft_prefixes)] + torch.randn(len(draft_prefixes), vocab, generator=gen)
        draft_kind = draft_kind[5:]
    else:
        draft_logits = torch.randn(len(draft_prefixes), vocab, generator=gen) * 1.5
    return Chain(vocab, gamma, target, dict(zip(draft_prefixes, make_rows(draft_kind, draft_logits, gen))))


def shared_rows(kind: str, vocab: int, count: int, gen: torch.Generator) -> list[torch.Tensor]:
    """q rows as the intersection drafter builds them: a draft with a larger vocabulary
    (V + 3 ids, in another order) of which V - 2 tokens exist in the target's; its logits are
    restricted to those, warped, and mapped onto the target's ids (zero elsewhere)."""
    draft_vocab = vocab + 3
    shared_target = torch.randperm(vocab, generator=gen)[: vocab - 2].tolist()
    shared_draft = torch.randperm(draft_vocab, generator=gen)[: vocab - 2].tolist()
    vocab_map = VocabularyMap(dict(zip(shared_draft, shared_target)), vocab)
    logits = torch.randn(count, draft_vocab, generator=gen) * 1.5  # [count, V_draft]
    shared = make_rows(kind, torch.stack([vocab_map.restrict(row) for row in logits]), gen)  # [S] each
    return [vocab_map.to_target(row) for row in shared]  # [V] each


TOPK_TOPP = "warp:0.8,3,0.85"
CASES = [
    # seed, V, γ, target p, draft q
    (0, 5, 3, "dense", "dense"),
    (1, 8, 1, "dense", "dense"),
    (2, 8, 2, "dense", "dense"),
    (3, 2, 3, "dense", "dense"),
    (4, 6, 3, "dense", "zeros"),  # q with zeros
    (5, 6, 3, "zeros", "dense"),  # p with zeros
    (6, 8, 2, "zeros", "zeros"),
    (7, 6, 3, "peaked", "dense"),
    (8, 6, 3, "dense", "peaked"),
    (9, 8, 2, TOPK_TOPP, "near:" + TOPK_TOPP),  # p and q through warp_probs with top-k and top-p
    (10, 6, 3, TOPK_TOPP, TOPK_TOPP),  # ... with unrelated logits (supports often disjoint)
    (11, 6, 3, "warp:1.3,2,1.0", "near:warp:1.3,2,1.0"),  # top-k only
    (12, 6, 3, "warp:0.7,0,0.6", "near:warp:0.7,0,0.6"),  # top-p only
    (20, 6, 3, TOPK_TOPP, "dense"),
    (21, 6, 3, "dense", "near:dense"),
    (22, 8, 3, "zeros", "near:zeros"),
    (13, 6, 3, "dense", "same"),  # q == p: everything accepted
    (14, 6, 3, TOPK_TOPP, "same"),
    (15, 6, 3, "dense", "none"),  # q = None: deterministic proposals
    (16, 8, 3, TOPK_TOPP, "none"),  # proposals the target often gives p = 0
    (17, 8, 1, "zeros", "none"),
    (18, 6, 3, "dense", "none:argmax"),
    (19, 6, 3, "peaked", "none:argmax"),
    (23, 8, 3, TOPK_TOPP, "none:second"),
    (24, 6, 3, "dense", "shared:dense"),  # universal drafting, intersection mode
    (25, 8, 2, TOPK_TOPP, "shared:" + TOPK_TOPP),
    (26, 5, 3, "zeros", "shared:warp:0.9,3,1.0"),
]


@pytest.mark.parametrize("seed,vocab,gamma,target_kind,draft_kind", CASES, ids=[f"{c[3]}-{c[4]}-V{c[1]}-g{c[2]}" for c in CASES])
def test_one_step_is_lossless_exactly(monkeypatch, seed, vocab, gamma, target_kind, draft_kind):
    chain = make_chain(seed, vocab, gamma, target_kind, draft_kind)
    path = CodePath(monkeypatch)
    by_code = {}

    def code(tokens, q, p):
        by_code[tuple(tokens)] = code_verdict(path, tokens, q, p)
        return by_code[tuple(tokens)]

    assert_lossless(chain, step_distribution(chain, code))  # the implementation
    assert_lossless(chain, step_distribution(chain, spec_verdict))  # the formulas (and this harness)
    for tokens, _ in chain.drafts():  # and the two agree draft by draft
        q, p = chain.rows(tokens)
        ours, theirs = by_code[tuple(tokens)], spec_verdict(tokens, q, p)
        assert max(abs(ours.get(s, 0.0) - theirs.get(s, 0.0)) for s in set(ours) | set(theirs)) < TOL
    if draft_kind == "same":  # q == p exactly: always accepted, γ + 1 tokens
        assert all(len(s) == gamma + 1 for emitted in by_code.values() for s in emitted)


# --------------------------------------------------------------------------- edge cases


def rows(*probs: list[float]) -> torch.Tensor:
    t = torch.tensor(probs, dtype=torch.float32)
    return t / t.sum(-1, keepdim=True)


def test_target_zero_is_never_accepted(monkeypatch):
    # p(x) = 0 with q(x) > 0, and with q = None: never accepted, and x is never the recovered token.
    p = rows([0.5, 0.0, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25])
    q = rows([0.1, 0.6, 0.1, 0.2])
    for seed in range(300):
        for draft_q in (q, None):
            verdict = verify_speculative([1], draft_q, p, make_generator(seed))
            assert verdict.num_accepted == 0 and verdict.next_token != 1
    path = CodePath(monkeypatch)
    for draft_q in (q, None):
        emitted = code_verdict(path, [1], draft_q, p)
        assert all(len(s) == 1 for s in emitted)  # never accepted, exactly
        assert emitted.get((1,), 0.0) == 0.0


def test_draft_zero_is_always_accepted(monkeypatch):
    # q(x) = 0 but p(x) > 0 (a token the draft could not have sampled): min(1, p/0) = 1.
    p = rows([0.5, 0.1, 0.3, 0.1], [0.1, 0.2, 0.3, 0.4])
    q = rows([0.5, 0.0, 0.3, 0.2])
    for seed in range(300):
        assert verify_speculative([1], q, p, make_generator(seed)).num_accepted == 1
    assert all(len(s) == 2 for s in code_verdict(CodePath(monkeypatch), [1], q, p))


def test_disjoint_supports_always_reject():
    # The draft only proposes tokens the target excludes: everything comes from the residual = p.
    p = rows([0.0, 0.0, 0.6, 0.4], [0.0, 0.0, 0.5, 0.5])
    q = rows([0.7, 0.3, 0.0, 0.0])
    counts = [0, 0, 0, 0]
    for seed in range(400):
        verdict = verify_speculative([0], q, p, make_generator(seed))
        assert verdict.num_accepted == 0
        counts[verdict.next_token] += 1
    assert counts[0] == counts[1] == 0 and counts[2] > counts[3] > 0


def test_all_accepted_emits_the_bonus_from_the_last_row():
    p = torch.cat([rows([0.2, 0.3, 0.5, 0.0], [0.1, 0.1, 0.1, 0.7]), rows([0.0, 0.0, 0.0, 1.0])])  # [3, V]
    for seed in range(100):
        verdict = verify_speculative([2, 3], p[:2], p, make_generator(seed))  # q == p: always accepted
        assert verdict == Verdict(2, 3)


def test_certain_target_accepts_a_deterministic_draft():
    p = rows([0.0, 1.0, 0.0], [0.0, 0.0, 1.0])
    for seed in range(100):
        assert verify_speculative([1], None, p, make_generator(seed)) == Verdict(1, 2)


def test_empty_draft_samples_from_the_first_row():
    p = rows([0.0, 0.0, 1.0, 0.0])
    assert verify_speculative([], None, p, make_generator(0)) == Verdict(0, 2)


def test_seeded_verification_is_reproducible():
    gen = torch.Generator().manual_seed(3)
    p = warp_probs(torch.randn(4, 8, generator=gen), SamplingParams(temperature=1.0))
    q = warp_probs(torch.randn(3, 8, generator=gen), SamplingParams(temperature=1.0))
    runs = [[verify_speculative([1, 2, 3], q, p, make_generator(seed)) for seed in range(50)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) >= 3  # and the seed matters


# Sampling parameters whose warp is one-hot: sampling verification must then be greedy verification.
ONE_HOT_WARPS = pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1e-4)],
                                        ids=["top_k=1", "temperature=1e-4"])


def clear_argmax_logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Random logits [rows, V] with a clear argmax in each row: no near-ties."""
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[torch.arange(rows), logits.argmax(-1)] += 1.0
    return logits


@ONE_HOT_WARPS
def test_sampling_verifier_degenerates_to_greedy(params):
    # With a one-hot warp, speculative sampling is greedy verification, whatever the draft's q.
    gen = torch.Generator().manual_seed(11)
    for trial in range(200):
        k = 1 + trial % 4
        logits = clear_argmax_logits(k + 1, 12, gen)  # [k+1, V]
        # Drafts that follow the target's argmax for a while, then maybe deviate.
        tokens = logits[:k].argmax(-1).tolist()
        if trial % 3:
            tokens[trial % k] = (tokens[trial % k] + 1 + trial % 5) % 12
        draft_logits = torch.randn(k, 12, generator=gen) * 3
        for q in (warp_probs(draft_logits, SamplingParams(temperature=1.0)), None):
            verifier = SamplingVerifier(SamplingParams(params.temperature, params.top_k, params.top_p, seed=trial))
            assert verifier.verify(Draft(tokens, q), logits) == verify_greedy(tokens, logits)
            assert verifier.choose(logits[0]) == int(logits[0].argmax())
