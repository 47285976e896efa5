"""Distillation training: the loss falls within seconds, agreement rises above chance, runs are reproducible."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.head.train import Progress, TrainResult, train
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
