"""Shared tiny targets, training text and a trained head for tests/head/ (one short training run per session)."""

from __future__ import annotations

import pytest
import torch

from specdec.head.store import TrainResult
from specdec.training.train import TrainConfig, train
from tests.tiny import tiny_model

# A short run on the tiny target: a couple hundred steps of 4 windows of 32 positions (about a second).
QUICK = TrainConfig(draft_vocab=64, window=32, batch=4, lr=3e-3, max_steps=200, eval_tokens=64, eval_every_s=1e9)


def own_text(model: torch.nn.Module, streams: int = 6, length: int = 60) -> list[list[int]]:
    """The model's own greedy continuations of a few one-token prompts: text it predicts."""
    out = []
    for s in range(streams):
        prompt = torch.tensor([[1, 3 + 7 * s]])  # [1, 2]
        out.append(model.generate(prompt, max_new_tokens=length, do_sample=False, pad_token_id=0)[0].tolist())
    return out


def target_pass(target: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target over ids [B, T] -> (post-norm final hidden states [B, T, H], logits [B, T, V]), fp32: the
    reference the heads' features are checked against, read off a hook on the final norm."""
    captured: list[torch.Tensor] = []
    hook = target.get_decoder().norm.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        with torch.no_grad():
            logits = target(input_ids=ids).logits
    finally:
        hook.remove()
    return captured[-1].float(), logits.float()


@pytest.fixture(scope="session")
def target() -> torch.nn.Module:
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="session")
def text(target: torch.nn.Module) -> list[list[int]]:
    return own_text(target)


@pytest.fixture(scope="session")
def trained(target: torch.nn.Module, text: list[list[int]]) -> TrainResult:
    return train(target, text, QUICK, heldout=text[0])  # agreement measured on (part of) the training text
