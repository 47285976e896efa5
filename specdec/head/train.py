"""Distil a draft head from its frozen target, teacher-forced over token streams, within a time budget.

Each step cuts a batch of windows of `window` + 1 tokens from the training streams, runs the frozen
target over them once (its post-norm final hidden states f [B, T+1, H], taken with a forward hook on
the final norm, and its logits), and trains the head on the pairs (f_t, x_{t+1}) to predict

- the target's next-token distribution p at t+1, restricted and renormalised to the draft
  vocabulary: KL(p || q), q the head's distribution;
- the target's next feature f_{t+1}: smooth-L1, weighted by `feature_weight` (EAGLE's regression).

AdamW; deterministic given the seed and the number of steps (the head's initialisation and the
window order come from the seed; a time budget only decides where training stops).  The progress
callback sees tokens/s, the loss and the latest held-out agreement: how often the head's d-th
drafted token (d = 1..positions, drafted autoregressively on its own predicted features, exactly as
``DraftHead.draft`` drafts) equals the target's greedy token, counted where the earlier drafts and
the held-out text both agreed with the target's greedy tokens (so a single teacher-forced target
pass gives the greedy continuation): the acceptance rate of greedy verification at that position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from specdec.errors import SpecdecError
from specdec.head.model import DraftHead, HeadCache, draft_vocabulary


@dataclass(frozen=True)
class TrainConfig:
    draft_vocab: int = 32768  # N, the draft vocabulary's size (capped at the target's)
    window: int = 64  # T: positions per training window
    batch: int = 8  # windows per step
    lr: float = 1e-3
    weight_decay: float = 0.0
    feature_weight: float = 1.0  # w of the smooth-L1 feature regression
    minutes: float = 60.0  # time budget
    max_steps: int | None = None  # stop after this many steps too (tests, reproducible runs)
    eval_every_s: float = 60.0  # held-out agreement this often (and at the end)
    eval_tokens: int = 256  # held-out drafting starts per evaluation
    positions: int = 3  # draft positions whose agreement is measured
    heldout_fraction: float = 0.1  # of the training tokens, when no held-out streams are given
    seed: int = 0


@dataclass(frozen=True)
class Progress:
    step: int
    tokens: int  # training positions seen
    seconds: float
    tokens_per_s: float
    loss: float
    agreement: tuple[float | None, ...]  # latest held-out agreement by draft position (None: not measured yet)


@dataclass
class TrainResult:
    head: DraftHead
    tokens: int
    seconds: float
    steps: int
    agreement: tuple[float | None, ...]
    losses: list[float] = field(default_factory=list)  # per step


def target_pass(target: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target over ids [B, T] -> (post-norm final hidden states [B, T, H], logits [B, T, V]), fp32."""
    captured: list[torch.Tensor] = []
    hook = target.get_decoder().norm.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        with torch.no_grad():
            logits = target(input_ids=ids).logits
    finally:
        hook.remove()
    return captured[-1].float(), logits.float()


def head_loss(head: DraftHead, features: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor,
              feature_weight: float) -> torch.Tensor:
    """Distillation loss on windows ids [B, T+1] with the target's features [B, T+1, H] and logits [B, T+1, V]."""
    predicted, draft_logits = head(features[:, :-1], ids[:, 1:])  # [B, T, H], [B, T, N]
    log_p = F.log_softmax(logits[:, 1:, head.vocab], dim=-1)  # [B, T, N]: p renormalised on the draft vocab
    log_q = F.log_softmax(draft_logits, dim=-1)  # [B, T, N]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return kl + feature_weight * F.smooth_l1_loss(predicted, features[:, 1:])


def agreement(head: DraftHead, target: nn.Module, stream: list[int], positions: int = 3,
              starts: int = 256) -> tuple[float | None, ...]:
    """Held-out agreement of the head's drafts with the target's greedy tokens by draft position (see the
    module docstring); None for a position never reached.  Uses stream[:starts + positions + 1]."""
    ids = torch.tensor(stream[: starts + positions + 1])[None]  # [1, L]
    features, logits = target_pass(target, ids)
    greedy = logits[0].argmax(-1).tolist()  # greedy[t]: the target's token after ids[:t+1]
    text = ids[0].tolist()
    hits, counted = [0] * positions, [0] * positions
    cache = HeadCache()
    for n in range(1, len(text) - positions):
        # the head holds pairs t < n-1; feed (f_{n-1}, x_n) and draft x_{n+1..n+positions}
        drafts = head.draft(cache, features[0, n - 1: n], ids[0, n: n + 1], positions)
        for d in range(positions):
            counted[d] += 1
            hits[d] += drafts[d] == greedy[n + d]
            if not (drafts[d] == greedy[n + d] == text[n + d + 1]):
                break
    return tuple(h / c if c else None for h, c in zip(hits, counted))


def windows(stream: torch.Tensor, window: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The stream [L] cut into windows of window + 1 tokens (overlapping by one), in a seeded order."""
    starts = range(0, len(stream) - window, window)
    return [stream[starts[i]: starts[i] + window + 1] for i in torch.randperm(len(starts), generator=generator)]


def train(target: nn.Module, streams: list[list[int]], config: TrainConfig = TrainConfig(),
          heldout: list[int] | None = None, progress: Callable[[Progress], None] | None = None,
          checkpoint: Callable[[TrainResult], None] | None = None) -> TrainResult:
    """Train a head for `target` on token streams (the target's ids) within config.minutes.

    `heldout`: a token stream for the agreement (default: the last heldout_fraction of the training
    tokens, then left out of training).  The target is put in eval mode with its gradients off (it is
    frozen) and shared, not copied: the head uses its embedding table.  `checkpoint` is called with the result so far at every
    evaluation (the store saves it there, so an interrupted run keeps its last checkpoint).
    """
    stream = torch.tensor([t for s in streams for t in s], dtype=torch.long)  # [L]
    if heldout is None:
        cut = len(stream) - max(int(len(stream) * config.heldout_fraction), config.positions + 2)
        stream, heldout = stream[:cut], stream[cut:].tolist()
    window = min(config.window, len(stream) - 1)
    if window < 2:
        raise SpecdecError(f"too little training text: {len(stream)} tokens")
    target.eval().requires_grad_(False)
    vocab = draft_vocabulary([stream.tolist()], config.draft_vocab, target.config.vocab_size)
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        head = DraftHead(target, vocab)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad],
                                  lr=config.lr, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    result = TrainResult(head, 0, 0.0, 0, (None,) * config.positions)
    pending: list[torch.Tensor] = []
    began = last_eval = time.monotonic()

    def evaluate() -> None:
        head.eval()
        result.agreement = agreement(head, target, heldout, config.positions, config.eval_tokens)
        head.train()
        if checkpoint is not None:
            checkpoint(result)

    head.train()
    while time.monotonic() - began < config.minutes * 60 and result.steps != config.max_steps:
        while len(pending) < config.batch:
            pending.extend(windows(stream, window, generator))
        ids = torch.stack(pending[: config.batch])  # [B, T+1]
        del pending[: config.batch]
        features, logits = target_pass(target, ids)
        loss = head_loss(head, features, logits, ids, config.feature_weight)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        value = loss.item()
        result.steps += 1
        result.tokens += ids.shape[0] * window
        result.losses.append(value)
        result.seconds = time.monotonic() - began
        if time.monotonic() - last_eval >= config.eval_every_s:
            evaluate()
            last_eval = time.monotonic()
        if progress is not None:
            progress(Progress(result.steps, result.tokens, result.seconds, result.tokens / max(result.seconds, 1e-9),
                              value, result.agreement))
    head.eval()
    evaluate()
    return result
