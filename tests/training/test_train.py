"""Distillation training: the loss falls within seconds, agreement rises above chance, runs are reproducible."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.head.store import TrainResult
from specdec.training.train import Progress, train
from tests.head.conftest import QUICK


def test_loss_falls_and_agreement_beats_chance(trained: TrainResult, target: torch.nn.Module,
                                               text: list[list[int]]) -> None:
    first, last = sum(trained.losses[:10]) / 10, sum(trained.losses[-10:]) / 10
    assert last < 0.5 * first, (first, last)
    assert trained.steps == QUICK.max_steps and trained.tokens == QUICK.max_steps * QUICK.batch * QUICK.window
    first_position = trained.agreement[0]
    assert first_position is not None and first_position > 10 / QUICK.draft_vocab  # chance is 1 / 64
    assert len(trained.agreement) == QUICK.positions
    untrained = train(target, text, dataclasses.replace(QUICK, max_steps=0), heldout=text[0])
    assert untrained.steps == 0 and first_position > untrained.agreement[0] + 0.2


def test_same_seed_same_head(target: torch.nn.Module, text: list[list[int]]) -> None:
    config = dataclasses.replace(QUICK, max_steps=5)
    a, b = (train(target, text[1:], config, heldout=text[0]).head.state_dict() for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_progress_and_checkpoints_are_reported(target: torch.nn.Module, text: list[list[int]]) -> None:
    seen: list[Progress] = []
    saved: list[int] = []
    config = dataclasses.replace(QUICK, max_steps=3, eval_every_s=0.0, eval_tokens=8)
    result = train(target, text, config, progress=seen.append, checkpoint=lambda r: saved.append(r.steps))
    assert [p.step for p in seen] == [1, 2, 3] and all(p.tokens_per_s > 0 and p.loss > 0 for p in seen)
    assert seen[-1].agreement[0] is not None  # measured on the held-out tail of the text
    assert saved == [1, 2, 3, 3] and result.steps == 3  # every evaluation, and at the end


def test_a_time_budget_stops_training(target: torch.nn.Module, text: list[list[int]]) -> None:
    result = train(target, text, dataclasses.replace(QUICK, max_steps=None, minutes=0.5 / 60))
    assert 0 < result.seconds < 5


def test_too_little_text_is_refused(target: torch.nn.Module) -> None:
    with pytest.raises(SpecdecError, match="too little training text"):
        train(target, [[1, 2]], QUICK, heldout=[1, 2, 3, 4, 5, 6])


def test_an_interrupted_run_keeps_its_last_checkpoint(target: torch.nn.Module, text: list[list[int]],
                                                      tmp_path) -> None:
    from specdec.head import store

    def stop_at_four(p: Progress) -> None:
        if p.step == 4:
            raise KeyboardInterrupt

    config = dataclasses.replace(QUICK, max_steps=50, eval_every_s=0.0, eval_tokens=8)
    with pytest.raises(KeyboardInterrupt):
        train(target, text, config, progress=stop_at_four,
              checkpoint=store.checkpointer(tmp_path, store.target_identity(target, "tiny")))
    head, manifest = store.load(tmp_path, target, "tiny")
    assert manifest["steps"] == 4 and len(head.vocab) == QUICK.draft_vocab


@pytest.mark.parametrize("steps", [2, 3])
def test_unrolled_steps_are_the_heads_own_drafts(target: torch.nn.Module, steps: int) -> None:
    """Training-time test: step d's logits at position t are DraftHead's d-th draft after the context's
    pairs 0..t, fed its own predicted features (with the true tokens as the earlier drafts)."""
    from specdec.head.model import DraftHead, HeadCache
    from specdec.training.train import unrolled

    torch.manual_seed(1)
    head = DraftHead(target, torch.arange(target.config.vocab_size)).eval()
    length, hidden = 9, target.config.hidden_size
    ids = torch.randint(0, target.config.vocab_size, (2, length + 1))  # [B, T+1]
    feats = torch.randn(2, length, hidden)  # [B, T, H]
    with torch.no_grad():
        passes = list(unrolled(head, feats, ids, steps))
    assert [d for d, _, _ in passes] == list(range(1, steps + 1))
    for b in range(2):
        for t in range(length - steps + 1):
            cache = HeadCache()
            with torch.no_grad():
                feature, logits = head.extend(cache, feats[b, : t + 1], ids[b, 1: t + 2])
                for d, predicted, draft_logits in passes:
                    assert torch.allclose(logits, draft_logits[b, t], atol=1e-5), (b, t, d)
                    assert torch.allclose(feature, predicted[b, t], atol=1e-5), (b, t, d)
                    if d < steps:
                        feature, logits = head.extend(cache, feature[None], ids[b, t + d + 1: t + d + 2])


def test_bf16_autocast_is_chosen_by_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec import machine
    from specdec.training.train import autocast_dtype

    monkeypatch.setattr(machine, "cpu_info", lambda: {"features": ["AVX2", "AVX-512", "AVX512-BF16"]})
    assert autocast_dtype("auto") is torch.bfloat16
    monkeypatch.setattr(machine, "cpu_info", lambda: {"features": ["AVX2"]})
    assert autocast_dtype("auto") is None and autocast_dtype("bf16") is torch.bfloat16
    assert autocast_dtype("fp32") is None
    with pytest.raises(SpecdecError, match="autocast"):
        autocast_dtype("fp16")


def test_held_out_answers_count_from_their_start(target: torch.nn.Module) -> None:
    """Drafts in a held-out prompt do not count: with start S, position 1 counts the pairs from S - 1 on."""
    from specdec.head.model import DraftHead
    from specdec.training.train import Heldout, agreement

    torch.manual_seed(2)
    head = DraftHead(target, torch.arange(target.config.vocab_size)).eval()
    ids = torch.randint(0, target.config.vocab_size, (30,)).tolist()
    feats = torch.randn(30, target.config.hidden_size)
    with torch.no_grad():
        _, logits = head(feats[None], torch.tensor(ids[1:] + [0])[None])
    drafts = logits[0].argmax(-1).tolist()  # pair t drafts x_{t+2}
    start = 12
    # the target agrees with every draft in the answer and with none in the prompt
    greedy = [0] + [d if t >= start - 1 else (d + 1) % target.config.vocab_size for t, d in enumerate(drafts[:-1])]
    answer_only = agreement(head, [Heldout(ids, feats, greedy, start)], positions=1)
    everything = agreement(head, [Heldout(ids, feats, greedy)], positions=1)
    counted = len(ids) - 2 - (start - 1)  # n = L - positions - 1 pairs, from start - 1 on
    assert answer_only == (1.0,) and everything[0] == counted / (len(ids) - 2)


@pytest.mark.parametrize("unroll", [1, 3])
def test_position_weights_weigh_each_predicted_positions_loss(target: torch.nn.Module, unroll: int) -> None:
    """The loss is a weighted mean over the positions it predicts: weights of one set of positions and of
    another add up as their weighted means do, a uniform weight is no weight, and weight 0 drops a position."""
    from specdec.head.model import DraftHead
    from specdec.training.train import head_loss

    torch.manual_seed(3)
    head = DraftHead(target, torch.arange(target.config.vocab_size)).eval()
    ids = torch.randint(0, target.config.vocab_size, (2, 11))  # [B, T+1]
    feats = torch.randn(2, 11, target.config.hidden_size)  # [B, T+1, H]

    def loss(weights: torch.Tensor | None) -> float:
        with torch.no_grad():
            return float(head_loss(head, feats, ids, 0.1, unroll=unroll, weights=weights))

    assert loss(None) == pytest.approx(loss(torch.full((2, 11), 3.0)), rel=1e-5)
    if unroll == 1:  # step 1 predicts positions 1..T: sets A and B split them
        a = torch.zeros(2, 11)
        a[:, 1:6] = 1.0
        b = 1.0 - a
        b[:, 0] = 0.0  # position 0 is never predicted
        whole = loss(None) * 2 * 10
        assert loss(a) * a.sum() + loss(b) * b.sum() == pytest.approx(whole, rel=1e-4)
        assert loss(a) != pytest.approx(loss(b))


def test_a_resumed_run_goes_on_from_the_given_head(trained: TrainResult, target: torch.nn.Module,
                                                    text: list[list[int]]) -> None:
    import copy

    config = dataclasses.replace(QUICK, max_steps=5)
    before = copy.deepcopy(trained.head)
    fresh = train(target, text, config, heldout=text[0])
    resumed = train(target, text, config, heldout=text[0], head=before)
    assert resumed.head is before and torch.equal(resumed.head.vocab, trained.head.vocab)
    # it starts where the first run ended (a loss near that run's last), not where a new head starts
    assert resumed.losses[0] < 0.5 * fresh.losses[0], (resumed.losses[0], fresh.losses[0])
    assert abs(resumed.losses[0] - sum(trained.losses[-10:]) / 10) < 0.5 * fresh.losses[0]
    with pytest.raises(SpecdecError, match=r"reads layers \[\], not \[0\]"):
        train(target, text, dataclasses.replace(config, taps=(0,)), heldout=text[0], head=before)


def test_a_resumed_run_starts_each_source_where_the_last_run_stopped(target: torch.nn.Module,
                                                                    text: list[list[int]]) -> None:
    from specdec.training.features import TextSource

    class Recorded(TextSource):  # the pieces produced, in order
        def produce(self):
            chunks = super().produce()
            produced.extend(c.ids for c in chunks)
            return chunks

    produced: list[list[int]] = []
    config = dataclasses.replace(QUICK, max_steps=3, window=8, batch=2, replay=1.0)
    first = train(target, [], config, heldout=text[0], sources=[Recorded(target, text[1:], chunk=12)])
    pieces = TextSource(target, text[1:], chunk=12).pieces
    assert first.cursor == [len(produced)] and 0 < len(produced) < len(pieces)  # it stopped part of the way
    assert produced == pieces[: len(produced)]
    done = len(produced)
    produced.clear()
    train(target, [], config, heldout=text[0], sources=[Recorded(target, text[1:], chunk=12)], cursor=first.cursor,
          head=first.head)
    assert produced == pieces[done: done + len(produced)]  # the material the first run did not reach


def test_a_resumed_run_learns_at_a_share_of_the_rate() -> None:
    from specdec.training.train import _lr

    for step, fraction in ((0, 0.0), (100, 0.5), (500, 1.0)):
        assert _lr(QUICK, step, fraction, resumed=True) == pytest.approx(QUICK.resume_lr * _lr(QUICK, step, fraction))
    assert _lr(QUICK, 500, 1.0) == pytest.approx(0.1 * QUICK.lr)  # where a run ends
