"""A head on fused features (the target's final feature and tapped intermediate layers, EAGLE-3's fusion):
the runners keep the tapped rows the head was trained on, drafting stays plain greedy (int8 bitwise, fp32 up to
near-ties, chains and trees), the fast form computes the same, and a runner that cannot tap is refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from specdec.algorithm.draft import TreeShape
from specdec.algorithm.loop import StopCondition, run
from specdec.backends.hf import HFRunner
from specdec.errors import SpecdecError
from specdec.head.drafter import HeadDrafter
from specdec.head.fast import FastHead
from specdec.head.model import HeadCache
from specdec.head.store import TrainResult
from specdec.native.lean import LeanRunner
from specdec.native.quant import quantize_model
from specdec.training.features import features
from specdec.training.train import train
from tests.head.conftest import QUICK, own_text
from tests.tiny import assert_near_tie_parting, tiny_model

STOP = StopCondition(max_new_tokens=40)
TAPS = (0, 1)


@pytest.fixture(scope="module")
def fused_target() -> torch.nn.Module:
    return tiny_model("llama", seed=0, layers=3)


@pytest.fixture(scope="module")
def fused_text(fused_target: torch.nn.Module) -> list[list[int]]:
    return own_text(fused_target)


@pytest.fixture(scope="module")
def fused(fused_target: torch.nn.Module, fused_text: list[list[int]]) -> TrainResult:
    return train(fused_target, fused_text, dataclasses.replace(QUICK, taps=TAPS), heldout=fused_text[0])


def prompts(text: list[list[int]]) -> list[list[int]]:
    return [text[1][:5], text[3][:9], [1, 50, 7, 88, 13]]


class Watched(HeadDrafter):
    """A head drafter that checks the pairs it feeds: the target's features of those positions with the tapped
    layers' outputs after them (one teacher-forced pass over the context), F columns wide."""

    def __init__(self, *args, model: torch.nn.Module) -> None:
        super().__init__(*args)
        self.model, self.checked = model, 0

    def sync(self, context: Sequence[int]):
        pairs = super().sync(context)
        if pairs is not None:
            feats, tokens = pairs
            start = len(context) - 1 - len(tokens)
            expected = features(self.model, torch.tensor([list(context[:-1])]), TAPS)[0, start:]  # [n, F]
            assert feats.shape[1] == self.head.width and torch.allclose(feats, expected, rtol=1e-4, atol=1e-4)
            self.checked += 1
        return pairs


def test_the_fused_head_learns_its_taps(fused: TrainResult, fused_text: list[list[int]]) -> None:
    assert fused.losses[-1] < fused.losses[0] and fused.head.fuse.weight.abs().sum() > 0
    assert fused.agreement[0] is not None and fused.agreement[0] > 0.3


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_is_plain_greedy_fp32_and_the_pairs_carry_the_taps(k: int, fused_target: torch.nn.Module,
                                                                  fused_text: list[list[int]], fused: TrainResult) -> None:
    runner = HFRunner(fused_target)
    accepted = 0
    for prompt in prompts(fused_text):
        reference = run(runner, prompt, STOP).token_ids
        drafter = Watched(fused.head, runner, model=fused_target)
        out = run(runner, prompt, STOP, drafter, k)
        assert_near_tie_parting(fused_target, prompt, out.token_ids, reference)
        assert drafter.checked > 0
        accepted += out.stats.accepted
    assert accepted > 0


@pytest.mark.parametrize("tree", [None, TreeShape(2, depth=3)], ids=["chain", "tree"])
def test_greedy_is_bitwise_plain_greedy_int8(tree: TreeShape | None, fused_text: list[list[int]],
                                             fused: TrainResult) -> None:
    runner = LeanRunner(quantize_model(tiny_model("llama", seed=0, layers=3)))
    for prompt in prompts(fused_text):
        reference = run(runner, prompt, STOP).token_ids
        for head in (fused.head, FastHead(fused.head)):
            out = run(runner, prompt, STOP, HeadDrafter(head, runner), 3, tree=tree)
            assert out.token_ids == reference and out.stats.drafted > 0


def test_the_fast_form_fuses_as_the_trained_head(fused_target: torch.nn.Module, fused_text: list[list[int]],
                                                 fused: TrainResult) -> None:
    fast = FastHead(fused.head, "fp32")
    stream = fused_text[2]
    feats, ids = features(fused_target, torch.tensor([stream]), TAPS)[0], torch.tensor(stream)  # [T, F], [T]
    for n in (2, 7, 20):
        mine = fast.extend(HeadCache(), feats[:n], ids[1: n + 1])
        theirs = fused.head.extend(HeadCache(), feats[:n], ids[1: n + 1])
        assert torch.allclose(mine[1], theirs[1], atol=1e-4)


def test_a_runner_that_keeps_no_layer_rows_is_refused(fused: TrainResult) -> None:
    class NoTaps(HFRunner):  # its capabilities say it keeps no intermediate layers' rows
        def __init__(self, model) -> None:
            super().__init__(model)
            self.capabilities = dataclasses.replace(self.capabilities, taps=False)

    with pytest.raises(SpecdecError, match="layers \\[0, 1\\]"):
        HeadDrafter(fused.head, NoTaps(tiny_model("llama", seed=0, layers=3)))


def test_a_plain_head_after_a_fused_one_on_the_same_runner(fused: TrainResult, fused_text: list[list[int]]) -> None:
    """A runner a fused head tapped is set back by the next head's reset: a plain head drafts from it as ever."""
    target = tiny_model("llama", seed=0, layers=3)
    plain = train(target, fused_text, dataclasses.replace(QUICK, max_steps=5), heldout=fused_text[0])
    runner = LeanRunner(quantize_model(target))
    prompt = fused_text[1][:5]
    reference = run(runner, prompt, STOP).token_ids
    for head in (fused.head, plain.head, fused.head):
        out = run(runner, prompt, STOP, HeadDrafter(head, runner), 3)
        assert out.token_ids == reference and out.stats.drafted > 0
