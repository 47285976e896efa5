"""The head starts a request from the prompt's last `window` features (the runner keeps them from the prefill):
greedy output stays plain greedy's (int8, bitwise) on prompts longer and shorter than the window, alone and
behind prompt lookup, and the first draft is that of a head fed the same pairs directly."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from specdec.algorithm.draft import Draft
from specdec.algorithm.loop import StopCondition, run
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.lookup import LookupDrafter
from specdec.errors import SpecdecError
from specdec.head.drafter import WINDOW, HeadDrafter
from specdec.head.model import HeadCache
from specdec.head.store import TrainResult
from specdec.native.lean import LeanRunner
from specdec.native.quant import quantize_model
from tests.tiny import tiny_model

STOP = StopCondition(max_new_tokens=30)


@pytest.fixture(scope="module")
def int8_target() -> torch.nn.Module:
    return quantize_model(tiny_model("llama", seed=0))  # the head's target, in int8


def seeding_prompts(text: list[list[int]]) -> list[list[int]]:
    """One prompt longer than the window (two streams of the training text), two shorter."""
    long = text[1] + text[2]
    assert len(long) > WINDOW
    return [long, text[3][:9], [1, 50, 7, 88, 13]]


class Recorded(HeadDrafter):
    """A head drafter that records its proposals and the pairs each one fed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drafts: list[tuple[int, Draft]] = []  # (len(context), draft)
        self.first_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # the cache after the first proposal

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Draft:
        draft = super().propose(context, k, source)
        self.drafts.append((len(context), draft))
        if self.first_cache is None and draft.tokens:
            self.first_cache = (self.cache.keys.clone(), self.cache.values.clone())
        return draft


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_is_bitwise_plain_greedy_with_prompt_seeding(k: int, int8_target: torch.nn.Module,
                                                            text: list[list[int]], trained: TrainResult) -> None:
    runner = LeanRunner(int8_target)
    for prompt in seeding_prompts(text):
        reference = run(runner, prompt, STOP).token_ids
        drafter = Recorded(trained.head, runner)
        out = run(runner, prompt, STOP, drafter, k)
        assert out.token_ids == reference
        at, first = drafter.drafts[0]
        assert at == len(prompt) + 1 and first.synced == min(WINDOW, len(prompt))  # seeded from the prefill
        assert drafter.base == max(0, len(prompt) - WINDOW)  # the head's cache starts at the window's start


@pytest.mark.parametrize("k", [1, 3, 5])
def test_behind_prompt_lookup_with_prompt_seeding(k: int, int8_target: torch.nn.Module, text: list[list[int]],
                                                  trained: TrainResult) -> None:
    """In a hybrid the head hears of the prefill too; where the lookup goes first it starts over later."""
    runner = LeanRunner(int8_target)
    seeded = 0
    for prompt in seeding_prompts(text):
        head = Recorded(trained.head, runner)
        drafter = HybridDrafter(head, LookupDrafter(max_ngram=3, min_ngram=2), short_matches=False)
        out = run(runner, prompt, STOP, drafter, k)
        assert out.token_ids == run(runner, prompt, STOP).token_ids
        at, first = head.drafts[0]
        seeded += at == len(prompt) + 1 and first.synced == min(WINDOW, len(prompt))
        assert drafter.proposals["model"] > 0
    assert seeded > 0


@pytest.mark.parametrize("window", [WINDOW, 8])
def test_the_first_draft_is_that_of_a_head_fed_the_prompts_pairs(window: int, int8_target: torch.nn.Module,
                                                                 text: list[list[int]],
                                                                 trained: TrainResult) -> None:
    """The drafter's first proposal after a prompt longer than the window, and its cache, are those of a head
    fed directly the pairs (f_t, x_{t+1}) of the prompt's last `window` positions, f from a full-logits
    forward's hidden() (bitwise: int8), the last pair's token the first generated token."""
    k = 4
    prompt = seeding_prompts(text)[0]
    runner = LeanRunner(int8_target)
    first_token = run(runner, prompt, StopCondition(max_new_tokens=1)).token_ids[0]
    drafter = Recorded(trained.head, runner, window=window)
    run(runner, prompt, StopCondition(max_new_tokens=k + 2), drafter, k)  # room for a draft of k

    alone = LeanRunner(int8_target)
    alone.forward(prompt)  # logits and hidden states of every position
    features = alone.hidden()[-window:]  # [window, H]
    tokens = torch.tensor(prompt[len(prompt) - window + 1:] + [first_token])  # [window]
    cache = HeadCache()
    expected = trained.head.draft(cache, features, tokens, k)

    at, first = drafter.drafts[0]
    assert at == len(prompt) + 1 and first.tokens == expected and first.synced == window
    assert drafter.first_cache is not None and cache.length == window
    assert torch.equal(drafter.first_cache[0], cache.keys) and torch.equal(drafter.first_cache[1], cache.values)


def test_the_drafter_asks_the_runner_for_its_window(int8_target: torch.nn.Module, trained: TrainResult) -> None:
    runner = LeanRunner(int8_target)
    HeadDrafter(trained.head, runner, window=12)
    assert runner.hidden_rows == 12
    with pytest.raises(SpecdecError, match="window"):
        HeadDrafter(trained.head, runner, window=0)
