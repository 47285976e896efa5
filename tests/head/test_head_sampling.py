"""Speculative sampling with a draft head through the decode loop: the output distribution is the target's.

A tiny llama target with V = 6 (tests/tiny.py) and a head trained on it for a moment with a draft
vocabulary of 4 (so the head's q is zero on two target tokens, which it can never propose); RUNS seeded
runs of specdec.algorithm.loop.run with MAX_NEW new tokens and γ = 3, temperature 0.8, each run with its own seed;
a chi-square test of the histogram of the new tokens against the exact distribution of plain sampling,
computed from the model's logits by an independent float64 warp (tests/toy.reference_warp).  The runs
are split over two processes (tests/chisq.py), each training the same head (the same seed, one thread).
The test passes when p > 0.001.  With seeds 0..2,999 (torch 2.13 CPU, two processes) p = 0.630 (chi2 26.9,
30 dof, acceptance 0.33).  Power, measured against bugs put in the drafter: a q uniform over the draft
vocabulary while the tokens come from the head gives chi2 = 3,292 (p = 0); q the head's softmax at
temperature 1 while the tokens are sampled at 0.8 gives only p = 0.014 at this size (a subtle mismatch needs
many more runs); a q ignored (q = None) is no error at all: a proposal verified as one-hot is lossless
whatever chose it, it only lowers acceptance (0.31).

The same test runs a fused head (a three-layer target, its layer 1 tapped: DraftHead.fused).  Measured
2026-12-04 on a Zen 4 (two processes): head p = 0.121 (chi2 39.2, 30 dof, acceptance 0.57), fused head
p = 0.023 (chi2 42.2, 26 dof, acceptance 0.03: nearly every drafted token is rejected, so the fused case
tests the rejection and residual path far more than the acceptance path).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from functools import lru_cache

import pytest
import torch

from specdec.algorithm.loop import StopCondition, run
from specdec.algorithm.sampling import SamplingParams
from specdec.algorithm.verify import make_verifier
from specdec.backends.hf import HFRunner
from specdec.head.drafter import HeadDrafter
from specdec.head.model import DraftHead
from specdec.training.train import train
from tests.chisq import chi_square, seeded_runs
from tests.head.conftest import QUICK
from tests.tiny import tiny_model
from tests.toy import reference_warp

VOCAB, DRAFT_VOCAB = 6, 4
PROMPT = [1, 4]
MAX_NEW, GAMMA, RUNS = 4, 3, 3000
T08 = dict(temperature=0.8)


@lru_cache(maxsize=2)
def target_and_head(case: str = "head") -> tuple[torch.nn.Module, DraftHead]:
    """The V = 6 target and a head trained on its own sampled text (one per process); "fused": a three-layer
    target and a head that also reads its layer 1 (fused features, DraftHead.fused)."""
    fused = case == "fused"
    model = tiny_model("llama", seed=0, vocab_size=VOCAB, layers=3 if fused else 2)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        streams = [sample_text(model, [1, s % VOCAB], 60, generator) for s in range(6)]
    config = dataclasses.replace(QUICK, draft_vocab=DRAFT_VOCAB, max_steps=100, taps=(1,) if fused else ())
    return model, train(model, streams, config, heldout=streams[0]).head


def sample_text(model: torch.nn.Module, prompt: list[int], length: int, generator: torch.Generator) -> list[int]:
    """`length` tokens sampled from the model at temperature 0.8 after `prompt` (plain, no cache)."""
    ids = list(prompt)
    for _ in range(length):
        logits = model(torch.tensor([ids])).logits[0, -1]  # [V]
        ids.append(int(torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=generator)))
    return ids


def exact_distribution(model: torch.nn.Module) -> dict[tuple[int, ...], float]:
    """P(new tokens) of plain sampling at T08, every sequence of MAX_NEW tokens (float64)."""
    rows: dict[tuple[int, ...], torch.Tensor] = {}
    for depth in range(MAX_NEW):
        prefixes = list(itertools.product(range(VOCAB), repeat=depth))
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]  # [6^depth, V]
        rows.update({p: reference_warp(row, **T08) for p, row in zip(prefixes, logits)})
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=MAX_NEW):
        prob = 1.0
        for i, token in enumerate(seq):
            prob *= float(rows[seq[:i]][token])
        out[seq] = prob
    return out


def head_runs(case: str, seeds: range) -> dict:
    """Histogram of the new tokens of one seeded run per seed, and the draft totals."""
    model, head = target_and_head(case)
    runner = HFRunner(model)
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in seeds:
        params = SamplingParams(seed=seed, **T08)
        out = run(runner, PROMPT, StopCondition(MAX_NEW), HeadDrafter(head, runner, params), GAMMA,
                  verifier=make_verifier(params))
        counts[tuple(out.token_ids)] += 1
        drafted += out.stats.drafted
        accepted += out.stats.accepted
    return {"counts": counts, "drafted": drafted, "accepted": accepted}


@pytest.mark.parametrize("case", ["head", "fused"])
def test_head_sampling_matches_the_target_distribution(case: str) -> None:
    model, head = target_and_head(case)
    assert len(head.vocab) == DRAFT_VOCAB < VOCAB and head.taps == ((1,) if case == "fused" else ())
    totals = seeded_runs(head_runs, case, RUNS)
    stat, dof, p_value = chi_square(totals["counts"], exact_distribution(model))
    print(f"{case}: chi2={stat:.1f} dof={dof} p={p_value:.4f} acceptance={totals['accepted'] / totals['drafted']:.3f}")
    assert 0 < totals["accepted"] < totals["drafted"]
    assert p_value > 0.001, f"chi2={stat:.1f} with {dof} dof, p={p_value:.2e}"
