"""specdec.runtime.memory: sizes as users write them, a request's need from its runners' footprints, the budget that
admits requests, and the lean runner's cache sized exactly for a request and trimmed after it."""

from __future__ import annotations

import threading

import pytest
import torch

from specdec.backends.base import PREFILL_CHUNK, Footprint
from specdec.errors import SpecdecError
from specdec.native.lean import LeanRunner
from specdec.runtime.memory import DRAFT_ROWS, MemoryBudget, format_bytes, parse_bytes, request_need
from tests.native.test_lean import int8 as int8_model


@pytest.mark.parametrize("text, size", [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("4000000000", 4_000_000_000),
                                        ("8GB", 8_000_000_000), ("1.5Gi", 3 << 29), (" 2 gib ", 2 << 30),
                                        ("64k", 64_000), ("100", 100)])
def test_sizes_are_parsed(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "lots", "4XB", "-1", "0", "1e9", "4 GiB extra"])
def test_bad_sizes_are_one_line_errors(text):
    with pytest.raises(SpecdecError) as e:
        parse_bytes(text)
    assert "\n" not in str(e.value)


def test_sizes_are_said_in_binary_units():
    assert [format_bytes(n) for n in (900, 5 << 10, int(5.1 * 2**30))] == ["900 B", "5.0 KiB", "5.1 GiB"]


def test_a_need_counts_both_caches_and_the_larger_forward():
    target = Footprint(cache_bytes_per_token=100, row_bytes=10, logits_row_bytes=7, chunked=True)
    draft = Footprint(cache_bytes_per_token=30, row_bytes=1, logits_row_bytes=7, chunked=False)
    need = request_need(target, draft, prompt=25_000, max_tokens=16)
    assert need.cache_bytes == (25_000 + 16 + DRAFT_ROWS) * 130
    # the target prefills a chunk at a time, the draft all of it in one forward: the larger of the two
    assert need.activation_bytes == max(PREFILL_CHUNK * 10, 25_000 * 1) + DRAFT_ROWS * 7
    assert need.total == need.cache_bytes + need.activation_bytes
    assert "for 25,000 + 16 tokens" in need.describe()
    alone = request_need(target, None, prompt=10, max_tokens=5)
    assert alone.cache_bytes == (10 + 5 + DRAFT_ROWS) * 100 and alone.activation_bytes == DRAFT_ROWS * (10 + 7)


def test_the_budget_waits_for_room_and_gives_up_when_cancelled():
    budget = MemoryBudget(100, held=20)
    assert budget.room == 80 and budget.reserved == 20
    assert budget.reserve(50)
    with pytest.raises(ValueError):
        budget.reserve(81)  # never fits
    cancelled = threading.Event()
    cancelled.set()
    assert not budget.reserve(40, cancelled)  # does not fit beside the 50: gave up, nothing reserved
    assert budget.reserved == 70
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(budget.reserve(40)))
    waiter.start()
    budget.release(50)  # room now: the waiter goes on
    waiter.join(10)
    assert got == [True] and budget.reserved == 60


def test_the_lean_cache_is_sized_exactly_for_a_request_and_trimmed_after_it():
    model = int8_model("llama")
    runner = LeanRunner(model)
    prompt = [int(t) for t in torch.randint(3, 90, (200,), generator=torch.Generator().manual_seed(0))]
    per_token = runner.footprint().cache_bytes_per_token
    assert per_token == len(runner.layer_set.layers) * runner.num_kv_heads * runner.head_dim * 2 * 4
    runner.expect(230)
    assert runner.capacity == 230  # exactly, not the next power of two
    reference = runner.forward(prompt)
    runner.forward([5, 6])
    assert runner.capacity == 230 and runner.keys[0].shape[1] == 230
    assert runner.trim(150) == 0  # nothing to free: its capacity is already the smallest it keeps
    assert runner.tokens == prompt[:150]
    runner.reset()
    runner.expect(runner.max_context)
    runner.forward(prompt)
    freed = runner.trim(120)
    assert freed == (runner.max_context - 256) * per_token and runner.capacity == 256
    assert runner.tokens == prompt[:120]
    # what it kept is the same cache: the rest of the prompt on top of it gives the same logits, bitwise
    assert torch.equal(runner.forward(prompt[120:]), reference[120:])
