"""Distil a draft head from its frozen target within a time budget, on features produced while it trains.

Data: ``specdec.training.features`` sources (text run through the target teacher-forced; the target's own
greedy answers to chat prompts, with their features captured while it writes them) fill a
``FeatureBank`` chunk by chunk; training cuts random windows of `window` + 1 positions from the bank.
More data is produced whenever training has seen `replay` times what the bank holds, so a run starts
training at once, spends its time between the target (producing) and the head (learning) in a fixed
proportion, and keeps learning from the bank when the sources run out.  The schedule is counted in
positions, not seconds, so a run is deterministic given the seed, the data and the number of steps
(a time budget only decides where it stops).

Loss on pairs (f_t, x_{t+1}) of a window (EAGLE, Li et al. 2024, arXiv 2401.15077):

- KL(p || q) with p the target's next-token distribution at t+1 restricted and renormalised to the
  draft vocabulary — the head's LM head is the target's own rows, frozen, so p is that LM head applied
  to the true next feature f_{t+1} — and q the head's;
- `feature_weight` × smooth-L1 between the head's predicted feature and f_{t+1} (EAGLE's regression);
- optionally uniform noise of amplitude `noise` on the input features (EAGLE's remedy for drafting on
  its own, imperfect, predictions);
- **training-time test** (`unroll` > 1; EAGLE-3, Li et al. 2025, arXiv 2503.01840, and HASS, Zhang et
  al. 2024, arXiv 2408.15766): at inference the head's d-th draft reads its own predicted feature, not
  the target's, so a head trained on true features only drafts its second token from inputs it never
  saw (measured on qwen2.5-coder-1.5b: second-token agreement 0.01 where the first's was 0.28).  Each
  window is therefore also run as the head drafts: pass d feeds, at every position, the pass before's
  predicted feature with the true next token, attending to the true pairs of its context and to its
  own predicted pairs only (the mask of :func:`unroll_mask`), so pass d's logits at position t are
  exactly the head's d-th draft after the context up to t (tested against ``DraftHead.draft``).  The
  passes' losses add with weights `unroll_decay`^(d-1).

Fused features (``taps``; EAGLE-3): the bank's features then carry the tapped layers' outputs after the
final feature, the head's inputs at the verified pairs read them all (DraftHead.fused), and what is
predicted and distilled stays the final feature alone.

Matrix products run in bfloat16 under autocast where the CPU multiplies bf16 natively (AVX512-BF16 or
AMX; `autocast` "auto"): 1.8x the steps a second of fp32 on a Zen 4 at the same agreement per position
seen; fp32 elsewhere, where bf16 is emulated and slower.

Where the head drafts is the target's own answers, and a run's bank holds far more prompt and text
positions than answer positions; a share `answer_focus` of the windows is drawn around answer positions
(``FeatureBank.windows``), and positions that are not answers weigh `context_weight` in the loss.

AdamW, linear warm-up, cosine decay to a tenth over the run (over max_steps when given, else over the
time budget).  The progress callback sees tokens/s, the loss and the latest held-out agreement: how
often the head's d-th drafted token (d = 1..positions, drafted autoregressively on its own predicted
features, exactly as ``DraftHead.draft`` drafts) equals the target's greedy token, counted where the
earlier drafts and the held-out text both agreed with the target's greedy tokens: the acceptance rate
of greedy verification at that position.  Position 1 is measured at every held-out position in one
batched forward; later positions at every `stride`-th.  On held-out chat answers only the answer's
positions count (``heldout_starts``): drafting happens there, not in the user's prompt.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.nn import functional as F

from specdec.errors import SpecdecError
from specdec.head.model import DraftHead, HeadCache, additive_mask, draft_vocabulary, head_intermediate
from specdec.head.store import TrainResult
from specdec.training.features import FeatureBank, LeanExtractor, Source, TextSource, check_taps, features

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class TrainConfig:
    draft_vocab: int = 16384  # N, the draft vocabulary's size (capped at the target's)
    vocab_from_text: float = 0.25  # its share chosen by frequency in the training text, the rest by id (draft_vocabulary)
    intermediate: int | None = None  # the head's MLP width (None: model.head_intermediate of the target)
    window: int = 64  # T: positions per training window, and what the head attends to when drafting
    batch: int = 8  # windows per step
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    feature_weight: float = 0.1  # w of the smooth-L1 feature regression (0.1: a higher agreement than 1.0, measured)
    noise: float = 0.0  # amplitude of the uniform noise added to input features
    # draft steps trained per window (> 1: training-time test on the head's own features).  3 rather than 2:
    # on qwen2.5-coder-1.5b (Zen 4, 15 minutes each, the same data) the third drafted token agreed 0.75
    # instead of 0.28 where the first two had (first token 0.47 against 0.48), and greedy chains of 4-6
    # tokens accepted 0.96-1.00 tokens a step on held-out answers instead of 0.80.
    unroll: int = 3
    unroll_decay: float = 1.0  # weight of step d's loss: unroll_decay ** (d - 1)
    # share of training windows drawn around the target's answer tokens (FeatureBank.windows), and the loss
    # weight of the positions that are not answers (prompts, teacher-forced text) against the answers' 1.
    # Measured on qwen2.5-coder-1.5b (Zen 4, 7 minutes each on the same 189k produced positions, 31% of them
    # answers): first-token agreement on the target's answers to 55 chat prompts outside the training
    # templates 0.232 unfocused, 0.258 at focus 0.8, 0.248 at focus 0.8 with context weight 0.2.  After 60
    # minutes of train-drafter: held-out agreement 0.52 / 0.56 / 0.59 by draft position against 0.46 / 0.57 /
    # 0.38 unfocused, but on those 55 prompts' answers 0.30 both: the focus learns the templates' answers
    # faster, not answers to other prompts.
    answer_focus: float = 0.8
    context_weight: float = 1.0
    autocast: str = "auto"  # "bf16", "fp32" or "auto" (bf16 where the CPU has AVX512-BF16 or AMX)
    replay: float = 2.0  # training positions per produced position before more data is produced
    # a resumed run's peak learning rate, a share of lr (its schedule as a new run's): the run before ended at a
    # tenth of lr, and going on at the full lr undid it (a 60-minute head resumed for 20 minutes at 1e-3 agreed
    # 0.223 on other prompts' answers where it had agreed 0.242; at 0.2 of it, 0.238)
    resume_lr: float = 0.2
    minutes: float = 60.0  # time budget
    max_steps: int | None = None  # stop after this many steps too (tests, reproducible runs)
    eval_every_s: float = 60.0  # held-out agreement this often (and at the end)
    eval_tokens: int = 256  # held-out positions per evaluation
    eval_stride: int = 4  # positions 2.. are measured at every stride-th held-out position
    positions: int = 3  # draft positions whose agreement is measured
    heldout_fraction: float = 0.1  # of the training tokens, when no held-out stream is given
    seed: int = 0
    taps: tuple[int, ...] = ()  # the target's layers fused into the verified pairs' features (DraftHead.fused)


@dataclass(frozen=True)
class Progress:
    step: int
    tokens: int  # training positions seen
    seconds: float
    tokens_per_s: float
    loss: float
    agreement: tuple[float | None, ...]  # latest held-out agreement by draft position (None: not measured yet)
    produced: int = 0  # positions in the feature bank


def head_loss(head: DraftHead, feats: torch.Tensor, ids: torch.Tensor, feature_weight: float,
              noise: float = 0.0, generator: torch.Generator | None = None, unroll: int = 1,
              decay: float = 1.0, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Distillation loss on windows ids [B, T+1] with the target's features [B, T+1, F] (the final feature
    [.., :H] first, then any tapped layers' outputs: DraftHead.fused; see the module doc):
    `unroll` draft steps, step d's loss weighted by decay ** (d - 1), averaged.  `weights` [B, T+1] weigh
    each position's loss by the position of the feature it predicts (default all 1)."""
    inputs = feats[:, :-1]  # [B, T, F]
    feats = feats[..., : head.config.hidden_size]  # [B, T+1, H]: the final features, what is predicted
    if noise:
        inputs = inputs + (torch.rand(inputs.shape, generator=generator) * 2 - 1) * noise
    if weights is None:
        weights = feats.new_ones(feats.shape[:2])  # [B, T+1]
    with torch.no_grad():  # p on the draft vocabulary at every predicted position, once for all steps
        log_p_all = F.log_softmax(head.lm_head(feats[:, 1:]).float(), dim=-1)  # [B, T, N]
    total, steps = feats.new_zeros(()), 0.0
    for d, predicted, draft_logits in unrolled(head, inputs, ids, unroll):
        n = predicted.shape[1]
        truth = feats[:, d: d + n]  # [B, n, H]: f_{t+d}
        log_p = log_p_all[:, d - 1: d - 1 + n]  # [B, n, N]
        log_q = F.log_softmax(draft_logits.float(), dim=-1)  # [B, n, N]
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [B, n]
        regression = F.smooth_l1_loss(predicted.float(), truth, reduction="none").mean(-1)  # [B, n]
        w = weights[:, d: d + n]  # [B, n]
        mean = ((kl + feature_weight * regression) * w).sum() / w.sum().clamp(min=1e-9)
        step = decay ** (d - 1)
        total = total + step * mean
        steps += step
    return total / steps


def unrolled(head: DraftHead, inputs: torch.Tensor, ids: torch.Tensor,
             steps: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The head's first `steps` drafts at every position of windows of pairs (inputs [B, T, H] = f_t,
    ids [B, T+1] = x_t) -> per step d, (d, predicted features [B, n, H] (f_{t+d}), draft logits [B, n, N]
    (for x_{t+d+1})) for t = 0 .. n-1, n = T - d + 1.  Step 1 is teacher-forced; step d + 1 feeds, at
    position t + d, step d's predicted f_{t+d} with the true x_{t+d+1} (unroll_mask), as DraftHead.draft
    drafts after the context's pairs up to t when its earlier drafts were the true tokens."""
    batch, length = ids.shape[0], ids.shape[1] - 1  # B, T
    cache = HeadCache()  # pass 1's keys and values, then each later pass's: what pass d attends to
    predicted, draft_logits = head(inputs, ids[:, 1:], cache=cache)  # [B, T, H], [B, T, N]
    for d in range(1, steps + 1):
        n = length - d + 1
        yield d, predicted, draft_logits
        if d == steps or n < 2:
            return
        mask = unroll_mask(length, d + 1, predicted.dtype)  # [1, 1, n-1, past + n-1]
        positions = (torch.arange(n - 1) + d).expand(batch, n - 1)  # [B, n-1]
        predicted, draft_logits = head(predicted[:, : n - 1], ids[:, d + 1: d + n], cache=cache,
                                       positions=positions, mask=mask)


def unroll_mask(length: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [1, 1, q, past + q] of training-time test pass `step` (>= 2) over a window of
    `length` pairs: query t (t = 0 .. q-1, q = length - step + 1) stands where the head drafts its
    step-th token after the context's pairs 0..t; it sees those true pairs (pass 1's keys, the cache's
    first `length`), its own predicted pair of every earlier pass (each pass's keys follow, one block of
    length - b + 1 per pass b), and itself."""
    queries = length - step + 1
    blocks = [length - b + 1 for b in range(2, step + 1)]  # passes 2 .. step, this one last
    allowed = torch.zeros(queries, length + sum(blocks), dtype=torch.bool)
    rows = torch.arange(queries)
    allowed[:, :length] = torch.arange(length)[None] <= rows[:, None]  # the true context up to t
    start = length
    for size in blocks:
        allowed[rows, start + rows] = True  # the pair this query's draft fed at that pass
        start += size
    return additive_mask(allowed, dtype)


def autocast_dtype(choice: str = "auto") -> torch.dtype | None:
    """The dtype training multiplies in: bfloat16 for "bf16", and for "auto" where the CPU has AVX512-BF16
    or AMX; None (fp32) otherwise."""
    if choice not in ("auto", "bf16", "fp32"):
        raise SpecdecError(f"autocast must be auto, bf16 or fp32, not {choice!r}")
    if choice == "auto":
        from specdec.machine import cpu_info

        native = {"AVX512-BF16", "AMX"} & set(cpu_info()["features"])
        return torch.bfloat16 if native else None
    return torch.bfloat16 if choice == "bf16" else None


@dataclass(frozen=True)
class Heldout:
    """A held-out stream: ids [L], the target's features [L, F] and greedy tokens [L] (greedy[t] follows
    ids[:t+1]); drafts count from token `start` on (a prompt's answer: its first token, the target's,
    is at `start`, so the first draft is x_{start+1}, from the pair (f_{start-1}, x_start))."""

    ids: list[int]
    features: torch.Tensor
    greedy: list[int]
    start: int = 0

    @classmethod
    def of(cls, target: PreTrainedModel, extractor: PreTrainedModel | LeanExtractor, stream: Sequence[int],
           start: int = 0, taps: Sequence[int] = ()) -> Heldout:
        ids = list(stream)
        feats = features(extractor, torch.tensor([ids]), taps)[0]  # [L, F]
        with torch.no_grad():  # the full LM head over the final features
            greedy = target.get_output_embeddings()(feats[:, : target.config.hidden_size]).argmax(-1).tolist()
        return cls(ids, feats, greedy, start)


@torch.no_grad()
def agreement(head: DraftHead, heldout: Sequence[Heldout], positions: int = 3,
              stride: int = 4) -> tuple[float | None, ...]:
    """Held-out agreement of the head's drafts with the target's greedy tokens by draft position over the
    held-out streams (see the module docstring); None for a position never reached."""
    hits, counted = [0] * positions, [0] * positions
    for held in heldout:
        for d, (h, c) in enumerate(zip(*_agreement_counts(head, held, positions, stride))):
            hits[d] += h
            counted[d] += c
    return tuple(h / c if c else None for h, c in zip(hits, counted))


def _agreement_counts(head: DraftHead, heldout: Heldout, positions: int, stride: int) -> tuple[list[int], list[int]]:
    """(hits, counted) by draft position on one held-out stream."""
    ids, feats, greedy = heldout.ids, heldout.features, heldout.greedy
    hits, counted = [0] * positions, [0] * positions
    n = len(ids) - positions - 1
    first_pair = max(heldout.start - 1, 0)  # the pair (f_t, x_{t+1}) that drafts the first counted token
    if n <= first_pair:
        return hits, counted
    # position 1 everywhere, in one forward: pair (f_t, x_{t+1}) drafts x_{t+2}, the target's is greedy[t + 1]
    _, logits = head(feats[None, :n], torch.tensor(ids[1: n + 1])[None])  # [1, n, N]
    first = head.target_ids(logits[0].argmax(-1)).tolist()
    hits[0] = sum(a == b for a, b in zip(first[first_pair:], greedy[first_pair + 1: n + 1]))
    counted[0] = n - first_pair
    cache, fed = HeadCache(), 0
    for t in range(first_pair, n, stride):  # later positions: drafted on the head's own predicted features
        drafts = head.draft(cache, feats[fed: t + 1], torch.tensor(ids[fed + 1: t + 2]), positions)
        cache.crop(t)  # keep the pairs before t (draft() kept pair t): t is fed again next time
        fed = t
        for d in range(1, positions):
            if not (drafts[d - 1] == greedy[t + d] == ids[t + d + 1]):
                break
            counted[d] += 1
            hits[d] += drafts[d] == greedy[t + d + 1]
    return hits, counted


def _lr(config: TrainConfig, step: int, fraction: float, resumed: bool = False) -> float:
    """Linear warm-up over warmup_steps, then cosine decay to a tenth at fraction 1 of the run; a resumed
    run's from resume_lr times lr."""
    warm = min(1.0, (step + 1) / max(config.warmup_steps, 1))
    peak = config.lr * (config.resume_lr if resumed else 1.0)
    return peak * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(fraction, 1.0))))


class _Producer:
    """Picks the next source to produce from: the one furthest below its share of the produced positions."""

    def __init__(self, sources: Sequence[Source], shares: Sequence[float]) -> None:
        self.sources, self.shares = list(sources), list(shares)
        self.produced = [0] * len(self.sources)
        self.done = [False] * len(self.sources)

    def produce(self, bank: FeatureBank) -> bool:
        """Produce one chunk into the bank; False when every source is exhausted."""
        while not all(self.done):
            i = min((i for i in range(len(self.sources)) if not self.done[i]),
                    key=lambda i: self.produced[i] / self.shares[i])
            chunks = self.sources[i].produce()
            if not chunks:
                self.done[i] = True
                continue
            for chunk in chunks:
                bank.add(chunk.ids, chunk.features, chunk.start)
                self.produced[i] += len(chunk.ids)
            return True
        return False


def _heldout(target: PreTrainedModel, extractor: PreTrainedModel | LeanExtractor,
             heldout: Sequence[int] | Sequence[Sequence[int]], config: TrainConfig,
             starts: Sequence[int] | None = None) -> list[Heldout]:
    """The held-out streams' features, eval_tokens counted positions in all at most (a stream's from its start)."""
    # one stream or several, told apart by the first item (mypy narrows an item, not the sequence: the casts)
    if heldout and isinstance(heldout[0], int):
        streams = [list(cast(Sequence[int], heldout))]
    else:
        streams = [list(s) for s in cast(Sequence[Sequence[int]], heldout)]
    starts = list(starts) if starts is not None else [0] * len(streams)
    out: list[Heldout] = []
    room = config.eval_tokens
    for stream, start in zip(streams, starts):
        if room <= 0:
            break
        first = max(start - 1, 0)
        stream = stream[: first + room + config.positions + 1]
        room -= len(stream) - config.positions - 1 - first
        out.append(Heldout.of(target, extractor, stream, start, config.taps))
    return out


def _hold_out(streams: list[list[int]], config: TrainConfig) -> tuple[list[list[int]], list[int]]:
    """(the streams less their last heldout_fraction of tokens, those tokens)."""
    total = sum(map(len, streams))
    cut = total - max(int(total * config.heldout_fraction), config.positions + 2)
    kept, seen = [], 0
    for s in streams:
        if seen + len(s) > cut:
            kept.append(s[: cut - seen])
            return [k for k in kept if len(k) > 1], [t for s in streams for t in s][cut:]
        kept.append(s)
        seen += len(s)
    return kept, []


def train(target: PreTrainedModel, streams: list[list[int]], config: TrainConfig = TrainConfig(),
          heldout: Sequence[int] | Sequence[Sequence[int]] | None = None, progress: Callable[[Progress], None] | None = None,
          checkpoint: Callable[[TrainResult], None] | None = None, sources: Sequence[Source] = (),
          shares: Sequence[float] | None = None, extractor: PreTrainedModel | LeanExtractor | None = None,
          heldout_starts: Sequence[int] | None = None, head: DraftHead | None = None,
          cursor: Sequence[int] = ()) -> TrainResult:
    """Train a head for `target` within config.minutes on token `streams` (the target's ids, run through
    the extractor teacher-forced) and any other `sources` (their `shares` of the produced positions:
    default equal, the streams' source first).

    `heldout`: a token stream or several for the agreement (default: the last heldout_fraction of the streams'
    tokens, then left out of training); `heldout_starts`: where each one's counted drafts begin (its answer's
    first token, after the prompt; default 0).  `extractor`: the model whose features are learnt (default the
    target; a cheaper copy of it: an int8 transformers model, or the int8 target's lean runner).  The target is put
    in eval mode with its gradients off (it
    is frozen) and shared, not copied: the head uses its embedding table.  `checkpoint` is called with
    the result so far at every evaluation (the store saves it there, so an interrupted run keeps its
    last checkpoint) and at the end.

    `head`: go on training this head (a saved one: its draft vocabulary, width and taps stay; config.taps
    must be its taps) instead of a new one; `cursor`: where each source starts (the run before's
    TrainResult.cursor, the streams' source first), so that it learns from material that run did not reach.
    The optimizer starts afresh, warm-up and schedule included, at config.resume_lr times the learning rate.
    """
    extractor = extractor if extractor is not None else target
    try:
        check_taps(config.taps, target.config.num_hidden_layers)
    except ValueError as e:
        raise SpecdecError(str(e)) from None
    all_sources, heldout, known = _sources(extractor, streams, heldout, sources, config)
    target.eval().requires_grad_(False)
    if isinstance(extractor, nn.Module):
        extractor.eval().requires_grad_(False)
    resumed = head is not None
    head = _the_head(target, config, known, head)
    for source, count in zip(all_sources, cursor):
        if count:
            source.skip(count)
    head.lm_head.requires_grad_(False)  # the target's own rows: p is read off them
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad],
                                  lr=config.lr, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    held = _heldout(target, extractor, heldout, config, heldout_starts)
    bank = FeatureBank(head.width)
    producer = _Producer(all_sources, shares or [1.0] * len(all_sources))
    result = TrainResult(head, 0, 0.0, 0, (None,) * config.positions)
    began = last_eval = time.monotonic()
    budget = config.minutes * 60

    precision = autocast_dtype(config.autocast)
    head.train()
    while time.monotonic() - began < budget and result.steps != config.max_steps:
        while (bank.length <= config.window + 1 or result.tokens >= config.replay * bank.length) \
                and producer.produce(bank):
            pass
        fraction = result.steps / config.max_steps if config.max_steps else (time.monotonic() - began) / budget
        value, tokens = _step(head, optimizer, bank, generator, config, precision,
                              _lr(config, result.steps, fraction, resumed))
        result.steps += 1
        result.tokens += tokens
        result.losses.append(value)
        result.produced = bank.length
        result.seconds = time.monotonic() - began
        if time.monotonic() - last_eval >= config.eval_every_s:
            _evaluate(head, held, config, all_sources, result, checkpoint)
            last_eval = time.monotonic()
        if progress is not None:
            progress(Progress(result.steps, result.tokens, result.seconds, result.tokens / max(result.seconds, 1e-9),
                              value, result.agreement, bank.length))
    head.eval()
    _evaluate(head, held, config, all_sources, result, checkpoint)
    return result


def _sources(extractor: PreTrainedModel | LeanExtractor, streams: list[list[int]],
             heldout: Sequence[int] | Sequence[Sequence[int]] | None, sources: Sequence[Source],
             config: TrainConfig) -> tuple[list[Source], Sequence[int] | Sequence[Sequence[int]], list[int]]:
    """train's sources (the streams' first, where any are left) and held-out text (given, or the streams'
    last heldout_fraction), and the tokens the sources know; a SpecdecError for too little text."""
    streams = [list(s) for s in streams if len(s) > 1]
    if heldout is None:
        streams, heldout = _hold_out(streams, config)
    all_sources = ([TextSource(extractor, streams, taps=config.taps)] if streams else []) + list(sources)
    known = [t for source in all_sources for t in source.tokens()]
    if len(known) < 3 and not sources:
        raise SpecdecError(f"too little training text: {len(known)} tokens")
    return all_sources, heldout, known


def _the_head(target: PreTrainedModel, config: TrainConfig, known: list[int], head: DraftHead | None) -> DraftHead:
    """The head to train: a new one (its draft vocabulary from the `known` tokens, seeded weights), or
    `head` to go on training, which must read config.taps."""
    if head is None:
        vocab = draft_vocabulary([known], config.draft_vocab, target.config.vocab_size, config.vocab_from_text)
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            head = DraftHead(target, vocab, config.intermediate or head_intermediate(target.config), config.window,
                             config.taps)
    elif head.taps != tuple(config.taps):
        raise SpecdecError(f"the head to go on training reads layers {list(head.taps)}, not {list(config.taps)}")
    return head


def _step(head: DraftHead, optimizer: torch.optim.Optimizer, bank: FeatureBank, generator: torch.Generator,
          config: TrainConfig, precision: torch.dtype | None, lr: float) -> tuple[float, int]:
    """One optimizer step at learning rate `lr` on a batch of the bank's windows: (its loss, the positions
    it trained on)."""
    window = min(config.window, bank.length - 1)
    if window < 2:
        raise SpecdecError(f"too little training text: {bank.length} tokens")
    ids, feats, answer = bank.windows(config.batch, window, generator, config.answer_focus)  # [B, T+1], [B, T+1, H], [B, T+1]
    weights = torch.where(answer, 1.0, config.context_weight)  # [B, T+1]
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=precision, enabled=precision is not None):
        loss = head_loss(head, feats, ids, config.feature_weight, config.noise, generator, config.unroll,
                         config.unroll_decay, weights)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item(), ids.shape[0] * window


def _evaluate(head: DraftHead, held: list[Heldout], config: TrainConfig, sources: list[Source], result: TrainResult,
              checkpoint: Callable[[TrainResult], None] | None) -> None:
    """The agreement on the held-out streams and the sources' cursor into `result`, then its checkpoint."""
    head.eval()
    result.agreement = agreement(head, held, config.positions, config.eval_stride)
    result.cursor = [int(source.consumed) for source in sources]
    head.train()
    if checkpoint is not None:
        checkpoint(result)
