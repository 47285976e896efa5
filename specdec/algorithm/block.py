"""Block verification of a chain draft: lossless, and never fewer accepted tokens than token by token.

Sun et al. 2024, "Block Verification Accelerates Speculative Decoding", arXiv 2403.10444;
its algorithm is below, with a proof that it is exact (the weights w_i are the paper's p_i).
Token-by-token verification (Leviathan et al. 2023) decides each draft token on its own; block
verification decides how much of the block to keep from the whole block at once, which is optimal in the
expected number of accepted tokens among verifiers that see only the per-position distributions.

Draft X_1..X_k, X_{i+1} drawn from Q_i = q[i]; the target's P_i = p[i] after X_1..X_i (rows 0..k).
    w_0 = 1,  w_i = min(1, w_{i-1} P_{i-1}(X_i) / Q_{i-1}(X_i))
    R_i = sum_x max(0, w_i P_i(x) - Q_i(x))                                    (i < k)
    h_i = R_i / (R_i + 1 - w_i) for i < k,  h_k = w_k
Keep tau = the largest i in 1..k whose coin eta_i <= h_i comes up (0 if none): the coins are independent,
so they are tossed from i = k down and the first success stops them.  The next token is drawn from
P_k when tau = k, else from norm(max(0, w_tau P_tau - Q_tau)).  (k = 1 is Leviathan et al.'s rule.)

Why it is exact.  Let S_i = P(no coin above i succeeds | X_1..X_i).  E[w_{i+1} | X^i] = w_i - R_i, so by
induction from S_{k-1} = 1 - E[w_k] = 1 - w_{k-1} + R_{k-1}: S_i = 1 - w_i + R_i, h_i S_i = R_i and
(1 - h_i) S_i = 1 - w_i.  Hence P(tau >= i, X^i = x^i) = Q(x^i) w_i =: m_i(x^i), and
P(tau = i, X^i = x^i, next = y) = Q(x^i) max(0, w_i P_i(y) - Q_i(y)).  Since m_{i+1} = min(Q(x^{i+1}),
m_i P_i(x_{i+1})), the mass that leaves x^i through the token y is min(a, b) + max(0, b - a) = b =
m_i(x^i) P_i(y), which with the target's own continuation of shorter outputs gives
P(first i + 1 tokens = x^{i+1}) = P(first i = x^i) P_i(x_{i+1}): the target's chain.
The expected accepted length is sum_i E[w_i] >= sum_i E[prod_j min(1, P_j / Q_j)], token by token's.

A deterministic draft (q None) is verified with one-hot Q_i; there w_i is the target's probability of the
block's first i tokens and block verification accepts exactly as token by token does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.algorithm.sampling import Randomness, as_randomness
from specdec.algorithm.verdict import Verdict


def block_weights(p_x: Sequence[float], q_x: Sequence[float]) -> list[float]:
    """w_0..w_k from the target's and the draft's probabilities of the draft tokens (p_x[i], q_x[i]:
    of token i); 0 from the first token the target excludes on."""
    w = [1.0]
    for p_i, q_i in zip(p_x, q_x):
        prev = w[-1]
        if prev <= 0.0 or p_i <= 0.0:
            w.append(0.0)
        else:
            w.append(1.0 if q_i <= prev * p_i else prev * p_i / q_i)
    return w


def verify_block(
    draft_tokens: Sequence[int],
    q: torch.Tensor | None,
    p: torch.Tensor,
    rng: torch.Generator | Randomness,
) -> Verdict:
    """Block verification (see the module doc): lossless for the target p.

    draft_tokens: k ids.
    q: [k, V] draft probabilities each token was drawn from, or None (one-hot).
    p: [k+1, V] target probabilities (already warped).
    rng: a generator, or Randomness (tests script it).
    """
    rng = as_randomness(rng)
    k = len(draft_tokens)
    if p.shape[0] < k + 1:
        raise ValueError(f"p has {p.shape[0]} rows for a block of {k} tokens (needs {k + 1})")
    target = p[: k + 1].double()  # [k+1, V]
    draft = None if q is None else q[:k].double()  # [k, V]
    positions = torch.arange(k)
    tokens = torch.tensor(list(draft_tokens), dtype=torch.long)  # [k]
    p_x = target[positions, tokens].tolist()  # [k]
    q_x = [1.0] * k if draft is None else draft[positions, tokens].tolist()  # [k]
    w = block_weights(p_x, q_x)  # k + 1 weights

    # excess[i] = w_i P_i - Q_i, rows i < k: [k, V]
    excess = torch.tensor(w[:k], dtype=torch.float64).unsqueeze(-1) * target[:k]
    if draft is None:
        excess[positions, tokens] -= 1.0  # Q_i one-hot on token i (X_{i+1})
    else:
        excess = excess - draft
    residual_mass = torch.clamp(excess, min=0.0).sum(dim=-1).tolist()  # [k]: R_0..R_{k-1}

    tau = 0
    for i in range(k, 0, -1):
        if i == k:
            h = w[k]
        else:
            denominator = residual_mass[i] + 1.0 - w[i]
            h = residual_mass[i] / denominator if denominator > 0.0 else 0.0  # 0/0: never reached (S_i = 0)
        if rng.bernoulli(min(1.0, h)):
            tau = i
            break
    if tau == k:
        return Verdict(k, rng.sample(target[k]))
    residual = torch.clamp(excess[tau], min=0.0)  # [V]
    if float(residual.sum()) <= 0.0:  # only where reaching tau had probability 0 up to rounding
        residual = target[tau]
    return Verdict(tau, rng.sample(residual / residual.sum()))
