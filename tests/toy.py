"""A toy ModelRunner with a known next-token distribution, and its exact chain probabilities.

The toy "model" is a second-order Markov chain: the logits after a position
are ``table[previous token, token]`` (the previous token of the first cached
position is a start symbol, row ``V`` of the table).  It has a rollback-able
"cache" (just the token list), costs a tensor index per forward, and its
target distribution over any continuation can be computed exactly — which is
what the statistical tests of speculative sampling compare against.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from specdec.algorithm.control import Controller
from specdec.algorithm.draft import Draft, Drafter
from specdec.algorithm.sampling import SamplingParams
from specdec.backends.base import Capabilities, Footprint, Refusals, cannot_clone


def random_table(vocab: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    """Seeded logits table [V+1, V, V]: row [a, b] is the next-token logits after tokens a, b
    (a = V: no token before b)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(vocab + 1, vocab, vocab, generator=gen, dtype=torch.float32) * scale


class RunnerDefaults(Refusals):
    """What a test's runner answers besides computing (the ModelRunner protocol): no transformers model,
    no end-of-sequence ids of its own, no clones, no identity to cache timings under, no hidden states."""

    capabilities = Capabilities()
    model = None
    eos_token_ids: frozenset[int] = frozenset()

    def clone(self) -> RunnerDefaults:
        raise cannot_clone(self)

    def footprint(self) -> Footprint:
        return Footprint()

    def expect(self, tokens: int) -> None:
        pass

    def trim(self, tokens: int) -> int:
        del self.tokens[tokens:]
        return 0

    def describe(self) -> str:
        return "toy"

    def identity(self) -> dict[str, object]:
        return {"backend": type(self).__name__, "model": "", "threads": 1}


class ToyRunner(RunnerDefaults):
    """A ModelRunner whose logits are a fixed function of the last two tokens."""

    def __init__(self, table: torch.Tensor, max_context: int = 256) -> None:
        self.table = table  # [V+1, V, V]
        self.vocab_size = int(table.shape[-1])
        # rows[a][b]: logits [1, V] after (a, b); python lists index far faster than a tensor
        self.rows = [[table[a, b].unsqueeze(0) for b in range(table.shape[1])] for a in range(table.shape[0])]
        self.max_context = max_context
        self.tokens: list[int] = []
        self.forwards = 0

    def forward(self, new_tokens: Sequence[int], last_n: int | None = None) -> torch.Tensor:
        new_tokens = list(new_tokens)
        if not new_tokens:
            raise ValueError("forward needs at least one token")
        if len(self.tokens) + len(new_tokens) > self.max_context:
            raise ValueError("toy context overflow")
        self.tokens.extend(new_tokens)
        self.forwards += 1
        n = len(new_tokens) if last_n is None else min(last_n, len(new_tokens))
        tokens, rows, start = self.tokens, self.rows, self.vocab_size
        out = [rows[tokens[j - 1] if j >= 1 else start][tokens[j]] for j in range(len(tokens) - n, len(tokens))]
        return out[0].clone() if n == 1 else torch.cat(out)  # [n, V]

    def rollback(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"rollback to a negative length {n}")
        del self.tokens[n:]

    def reset(self) -> None:
        self.tokens = []


class ToyTreeRunner(ToyRunner):
    """A ToyRunner that verifies token trees (specdec.backends.base.TreeRunner): node i's logits are the
    table's row after (its parent's token, its token), the root's parent being the last cached token."""

    capabilities = Capabilities(tree=True)

    def forward_tree(self, new_tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        new_tokens, parents = list(new_tokens), list(parents)
        if len(self.tokens) + len(new_tokens) > self.max_context:
            raise ValueError("toy context overflow")
        before = self.tokens[-1] if self.tokens else self.vocab_size
        out = [self.rows[new_tokens[p] if p >= 0 else before][t] for t, p in zip(new_tokens, parents)]
        self.tokens.extend(new_tokens)
        self.forwards += 1
        return torch.cat(out)  # [n, V]

    def keep_rows(self, cached: int, rows: Sequence[int]) -> None:
        new = self.tokens[cached:]
        self.tokens = self.tokens[:cached] + [new[r] for r in rows]


class FixedDrafter(Drafter):
    """Deterministic proposals (Draft with q=None): token after (a, b) is proposal[a, b]."""

    def __init__(self, proposal: torch.Tensor) -> None:
        self.proposal = proposal.tolist()  # [V+1][V] ints
        self.vocab_size = len(self.proposal[0])

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Draft:
        seq = list(context[-2:]) if len(context) >= 2 else [self.vocab_size, *context]
        for _ in range(k):
            seq.append(self.proposal[seq[-2]][seq[-1]])
        return Draft(seq[-k:] if k else [])

    def propose_tree(self, context: Sequence[int], k: int, width: int, nodes: int,
                     source: str | None = None) -> Draft:
        """The chain of propose() and, at each of its positions, the next `width` - 1 tokens after the
        proposed one (mod V) as leaves: a deterministic tree (q None) of at most `nodes` tokens."""
        from specdec.drafters.tree import tree_draft

        chain = self.propose(context, k).tokens
        leaves = [chain[:i] + [(chain[i] + j) % self.vocab_size] for i in range(len(chain)) for j in range(1, width)]
        return tree_draft([chain, *leaves], width, nodes)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        pass

    def reset(self) -> None:
        pass


class ConstantDrafter(Drafter):
    """Always proposes the same token (q = None): the adversarial draft."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Draft:
        return Draft([self.token] * k)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        pass

    def reset(self) -> None:
        pass


def random_proposal(vocab: int, seed: int) -> torch.Tensor:
    """Seeded deterministic proposal table [V+1, V] of token ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (vocab + 1, vocab), generator=gen)


def reference_warp(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution of one row of logits [V], written from the definitions in
    float64 with Python floats, independently of specdec.algorithm.sampling.warp_probs: [V] float64.

    Temperature divides the logits (in float32, as the logits are float32); top-k keeps the
    k most likely tokens and every token tied with the k-th; top-p keeps the smallest set of
    most likely tokens whose mass reaches top_p, and every token tied with the least likely
    of them.
    """
    scores = [float(x) for x in (logits.float() / temperature).tolist()]
    kept = list(range(len(scores)))
    if 0 < top_k < len(scores):
        kth = sorted(scores, reverse=True)[top_k - 1]
        kept = [i for i in kept if scores[i] >= kth]
    top = max(scores[i] for i in kept)
    weights = {i: math.exp(scores[i] - top) for i in kept}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    if top_p < 1.0:
        mass, threshold = 0.0, 0.0
        for i in sorted(probs, key=lambda i: -probs[i]):
            mass += probs[i]
            threshold = probs[i]
            if mass >= top_p:
                break
        probs = {i: pr for i, pr in probs.items() if pr >= threshold}
        total = sum(probs.values())
        probs = {i: pr / total for i, pr in probs.items()}
    out = torch.zeros(len(scores), dtype=torch.float64)
    for i, pr in probs.items():
        out[i] = pr
    return out


def chain_distribution(
    table: torch.Tensor, params: SamplingParams, prompt: Sequence[int], length: int
) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of `prompt` of `length` tokens under
    plain sampling with `params` from the toy model `table` (float64, through
    :func:`reference_warp`, not the sampler's own warp)."""
    vocab = int(table.shape[-1])
    probs = torch.stack([
        torch.stack([reference_warp(table[a, b], params.temperature, params.top_k, params.top_p) for b in range(vocab)])
        for a in range(vocab + 1)
    ])  # [V+1, V, V]
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(vocab), repeat=length):
        full = [vocab, *prompt, *seq] if len(prompt) < 2 else list(prompt) + list(seq)
        offset = len(full) - length
        prob = 1.0
        for j in range(offset, len(full)):
            prob *= float(probs[full[j - 2], full[j - 1], full[j]])
            if prob == 0.0:
                break
        out[seq] = prob
    return out


class RandomK(Controller):
    """A controller (specdec.algorithm.control.Controller) that picks k in 0..limit at random, so a generation
    switches between plain and drafted steps of every length: drafters must follow the context
    through steps they did not draft."""

    def __init__(self, seed: int, max_k: int = 8) -> None:
        import random

        self.rng = random.Random(seed)
        self.max_k = max_k

    def choose(self, limit: int, lag: int = 0, source: str = "model", grade: str | None = None) -> int:
        return self.rng.randint(0, min(limit, self.max_k))

    def observe(self, drafted: int, accepted: int, draft_s: float, target_s: float, synced: int = 0,
                source: str = "model") -> None:
        pass

    def reset(self) -> None:
        pass
