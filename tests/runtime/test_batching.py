"""Batched decoding (specdec.runtime.batching, specdec.native.lean.forward_packed): neighbours change nothing.

- The packed forward: several runners' chunks in one forward give each runner
  bitwise the logits it gets alone (int8; tiny llama / qwen2 / mistral with a
  sliding window), over random forward / rollback sequences; fp32 within
  rounding.
- The batch engine: requests started from threads in random orders, with
  random lengths, drafters and draft lengths (fixed and auto), one that
  finishes early and one that is cancelled: every request's greedy output
  equals its plain output alone, and a seeded sampled request its output alone.
- The controller backs off as the batch's load grows.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from specdec.algorithm.control import AutoK, Costs, Load
from specdec.algorithm.sampling import SamplingParams
from specdec.errors import SpecdecError
from specdec.native.lean import LeanRunner, forward_packed
from specdec.runtime.batching import BATCH_KS, BatchedTarget
from specdec.runtime.engine import Engine
from tests.native.test_lean import int8 as int8_model
from tests.tiny import VOCAB, tiny_model, tiny_tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_packed_forward_is_bitwise_each_runner_alone(arch):
    model = int8_model(arch)
    batch = [LeanRunner(model) for _ in range(4)]
    alone = [LeanRunner(model) for _ in range(4)]
    rng = random.Random(arch)
    for _ in range(40):
        members = rng.sample(range(4), rng.randint(1, 4))
        for i in members:  # now and then a member rolls back or starts over
            if batch[i].tokens and rng.random() < 0.3:
                keep = rng.randrange(len(batch[i].tokens) + 1)
                batch[i].rollback(keep)
                alone[i].rollback(keep)
            if len(batch[i].tokens) > 200:
                batch[i].reset()
                alone[i].reset()
        chunks = [[rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 2, 5, 9, 17]))] for _ in members]
        last_ns = [rng.choice([None, 1]) for _ in members]
        packed = forward_packed([batch[i] for i in members], chunks, last_ns)
        for i, chunk, last_n, logits in zip(members, chunks, last_ns, packed):
            assert torch.equal(logits, alone[i].forward(chunk, last_n=last_n))
            assert batch[i].tokens == alone[i].tokens


def test_packed_forward_fp32_matches_alone_and_the_model():
    model = tiny_model("qwen2", 0)
    a, b, solo = LeanRunner(model, fp32=True), LeanRunner(model, fp32=True), LeanRunner(model, fp32=True)
    with pytest.raises(SpecdecError, match="int8"):
        LeanRunner(model)  # fp32 only where asked for (the batch engine)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = model(torch.tensor([prompt + [7, 7]])).logits[0]  # [10, V]
    first, _ = forward_packed([a, b], [prompt, [8, 8, 8]], [None, 1])
    second, _ = forward_packed([a, b], [[7, 7], [9]], [None, None])
    torch.testing.assert_close(torch.cat([first, second]), reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(solo.forward(prompt + [7, 7]), reference, atol=1e-4, rtol=1e-4)


def test_packed_forward_refuses_mixed_input():
    model = int8_model("llama")
    a = LeanRunner(model)
    with pytest.raises(ValueError, match="twice"):
        forward_packed([a, a], [[1], [2]], [None, None])
    with pytest.raises(ValueError, match="same model"):
        forward_packed([a, LeanRunner(int8_model("qwen2"))], [[1], [2]], [None, None])
    with pytest.raises(ValueError, match="one chunk"):
        forward_packed([a], [[1], [2]], [None])


def _engine(dtype: str, draft: str) -> Engine:
    tok = tiny_tokenizer(0)
    target = tiny_model("qwen2", 0, vocab_size=len(tok))
    if dtype == "gguf":  # the default target: a GGUF file's own blocks, batched over its runner's clones
        from specdec.native import gguf
        from tests.native.test_gguf import save_tiny_gguf_cached

        target = gguf.load(save_tiny_gguf_cached("qwen2"))
    if dtype == "int8":
        from specdec.native.quant import quantize_model

        target = quantize_model(target)
    if draft in ("lookup", "suffix"):
        return Engine(target, tok, lookup=draft == "lookup", suffix=draft == "suffix")
    model = tiny_model("llama", 3, vocab_size=len(tok))  # another network: drafts right and wrong
    if draft == "self":
        model = target  # the target drafting for itself: long accepted runs
    return Engine(target, tok, model, tok, lookup=draft == "hybrid", suffix=draft == "suffix-hybrid")


PROMPTS = ["def fibonacci(n):", "The quick brown fox", "for i in range(10):", "Once upon a time",
           "print(i * i)", "a small model helped"]


def _run_concurrently(jobs):
    """Run each job (a function) in a thread of its own, started in the given order; results in order."""
    results: list = [None] * len(jobs)
    errors: list = []

    def work(i, job):
        try:
            results[i] = job()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a batched request hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("dtype,draft", [("int8", "self"), ("int8", "lookup"), ("int8", "other"), ("int8", "suffix"),
                                         ("fp32", "hybrid"), ("fp32", "other"), ("fp32", "suffix-hybrid"),
                                         ("gguf", "lookup"), ("gguf", "other")])
def test_batched_greedy_equals_each_request_alone(dtype, draft):
    engine = _engine(dtype, draft)
    engine.enable_batching(4)
    batch = engine.pool
    rng = random.Random(f"{dtype}{draft}")
    requests = []
    for i in range(6):
        k = rng.choice(["auto", 1, 3, 6])
        requests.append(dict(prompt=PROMPTS[i], max_new_tokens=rng.choice([3, 12, 30]), num_speculative_tokens=k,
                             use_draft=i != 5))
    # the reference: each request alone, plain decoding (no draft), in a batch of one
    alone = [engine.generate(r["prompt"], max_new_tokens=r["max_new_tokens"], use_draft=False).token_ids
             for r in requests]
    for _ in range(2):
        order = rng.sample(range(6), 6)
        outs = [None] * 6

        def job(i, outs=outs):
            def go():
                outs[i] = engine.generate(**requests[i]).token_ids
            return go

        # 6 requests, 4 slots: two waves, whoever finishes first frees a slot for the next
        first, second = order[:4], order[4:]
        _run_concurrently([job(i) for i in first])
        _run_concurrently([job(i) for i in second])
        assert outs == alone
    assert batch.target.forwards > 0 and batch.target.batched > batch.target.forwards  # really batched
    assert batch.target.active == 0
    if engine.suffix_store is not None:  # one store for every slot: each request's answer, each time
        assert len(engine.suffix_store) == sum(len(a) > 0 for a in alone) * 3  # each after its prompt's end


def test_a_cancelled_request_leaves_and_the_others_go_on():
    engine = _engine("int8", "self")
    engine.enable_batching(3)
    batch = engine.pool
    alone = [engine.generate(p, max_new_tokens=20, use_draft=False).token_ids for p in PROMPTS[:2]]
    outs = [None, None]
    started = threading.Event()

    def cancelled():
        steps = engine.stream(PROMPTS[2], max_new_tokens=200, num_speculative_tokens=2)
        next(steps)
        started.set()
        next(steps)
        steps.close()  # the client went away: the slot is given back at once

    def normal(i):
        def go():
            started.wait(30)
            outs[i] = engine.generate(PROMPTS[i], max_new_tokens=20, num_speculative_tokens="auto").token_ids
        return go

    _run_concurrently([cancelled, normal(0), normal(1)])
    assert outs == alone
    assert batch.target.active == 0


def test_seeded_sampling_in_a_batch_is_its_seed_alone():
    engine = _engine("int8", "other")
    engine.enable_batching(4)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in (1, 2, 3)]
    alone = [engine.generate(PROMPTS[i], max_new_tokens=24, sampling=p, num_speculative_tokens="auto").token_ids
             for i, p in enumerate(params)]
    outs = _run_concurrently([
        (lambda i=i, p=p: engine.generate(PROMPTS[i], max_new_tokens=24, sampling=p,
                                          num_speculative_tokens="auto").token_ids)
        for i, p in enumerate(params)
    ])
    assert outs == alone


def test_batch_refusals():
    tok = tiny_tokenizer(0)
    with pytest.raises(SpecdecError, match="llama / qwen2 / mistral"):
        BatchedTarget(tiny_model("gemma3", 0, vocab_size=len(tok)), 2)
    with pytest.raises(SpecdecError, match=">= 1"):
        BatchedTarget(tiny_model("llama", 0, vocab_size=len(tok)), 0)
    target = BatchedTarget(tiny_model("llama", 0, vocab_size=len(tok)), 1)
    slot = target.acquire()
    with pytest.raises(SpecdecError, match="busy"):
        target.acquire()
    with pytest.raises(ValueError):
        slot.forward([])  # a bad forward fails alone and leaves the slot usable
    assert slot.forward([1, 2, 3]).shape == (3, len(tok))
    slot.release()
    assert target.acquire().tokens == []  # a fresh cache for the next request


def test_controller_backs_off_as_the_batch_grows():
    # A forward is nearly flat up to 8 tokens, then linear (a CPU past its memory-bound region).
    table = {1: 100.0, 2: 102.0, 4: 106.0, 8: 115.0, 16: 230.0, 32: 460.0, 64: 920.0}
    ks = []
    for others in range(0, 8):
        auto = AutoK(Costs(table, draft_ms=2.0), max_k=8, prior=0.8, load=lambda o=others: Load(o, float(o), 0.0))
        ks.append(auto.choose(limit=100))
    assert ks[0] >= 4  # alone: a long draft is nearly free
    assert ks == sorted(ks, reverse=True) and ks[-1] == 0  # falls with the load, to plain decoding
    alone = AutoK(Costs(table, draft_ms=2.0), max_k=8, prior=0.8)
    assert alone.choose(limit=100) == ks[0]  # no load: the single-request choice


def test_the_batch_learns_its_costs_from_packed_forwards(monkeypatch):
    engine = _engine("int8", "self")
    engine.enable_batching(2)
    batch = engine.pool
    # A table ten times slower than this tiny model runs: every packed forward measures faster.
    monkeypatch.setattr(batch, "_costs", Costs({n: 1000.0 * (1 + n / 64) for n in BATCH_KS}, draft_ms=1.0))
    batch.target.costs = batch._costs
    costs = batch.costs()
    controllers = [batch.controller(s, "auto", SamplingParams()) for s in (0, 1)]
    assert all(c.costs is costs for c in controllers)  # one shared table, not copies
    assert costs.target_scale == 1.0 and not costs.shape
    a, b = batch.target.acquire(), batch.target.acquire()
    _run_concurrently([lambda: a.forward([1, 2, 3]), lambda: b.forward([4, 5])])  # one packed forward of 5 rows
    assert batch.target.forwards == 1 and batch.target.rows == 5
    assert set(costs.shape) == {5} and costs.shape[5] < 1.0 and costs.target_scale < 1.0  # learnt: faster
    before = costs.target(5)
    _run_concurrently([lambda: a.forward([6]), lambda: b.forward([7])])
    assert set(costs.shape) == {5, 2} and costs.target(5) < before  # the scale keeps falling
    a.release()
    b.release()
    # A seeded sampled request keeps a controller of its own: its k must not depend on timings.
    seeded = batch.controller(0, "auto", SamplingParams(temperature=0.9, seed=1))
    assert seeded.costs is not costs


@pytest.mark.parametrize("dtype", ["int8", "fp32"])
def test_a_long_prefill_joins_the_batch_a_chunk_a_round(dtype, monkeypatch):
    """A prompt of several chunks, admitted while another request decodes: each of its chunks (of
    SHARED_PREFILL_CHUNK rows while the other decodes, PREFILL_CHUNK once alone) is one packed forward with the
    other request's step, so that request's tokens go on during the prefill (counted in rounds, not time);
    int8 answers are bitwise each alone."""
    from specdec.backends.base import PREFILL_CHUNK
    from specdec.runtime import batching

    tok = tiny_tokenizer(0)
    target = tiny_model("qwen2", 0, vocab_size=len(tok), positions=4 * PREFILL_CHUNK)
    if dtype == "int8":
        from specdec.native.quant import quantize_model

        target = quantize_model(target)
    engine = Engine(target, tok)
    engine.enable_batching(2)
    gen = torch.Generator().manual_seed(0)
    long_prompt = [int(t) for t in torch.randint(3, len(tok), (3 * PREFILL_CHUNK - 100,), generator=gen)]
    short_prompt = engine.encode("for i in range")
    alone = [engine.generate(p, max_new_tokens=n, use_draft=False).token_ids
             for p, n in ((short_prompt, 40), (long_prompt, 4))]
    rounds: list[list[tuple[int, int]]] = []  # each packed forward's (runner, rows)
    packed = batching.forward_packed

    def logged(runners, chunks, last_ns, trees=None):
        rounds.append([(id(r), len(c)) for r, c in zip(runners, chunks)])
        return packed(runners, chunks, last_ns, trees)

    monkeypatch.setattr(batching, "forward_packed", logged)
    short_started, long_admitted = threading.Event(), threading.Event()
    outs: dict[str, list[int]] = {}

    def short():
        tokens = []
        for step in engine.stream(short_prompt, max_new_tokens=40, use_draft=False):
            tokens += step.tokens
            if not short_started.is_set():
                short_started.set()
                assert long_admitted.wait(30)  # decodes on once the long request holds its slot
        outs["short"] = tokens

    def long():
        assert short_started.wait(30)
        outs["long"] = engine.generate(long_prompt, max_new_tokens=4, use_draft=False).token_ids

    threads = [threading.Thread(target=short), threading.Thread(target=long)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while engine.pool.target.active < 2 and threads[1].is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    long_admitted.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    slots = {id(r) for r in engine.pool.target.runners}
    assert {s for r in rounds for s, _ in r} <= slots
    long_slot = max((rows, s) for r in rounds for s, rows in r)[1]
    prefill = [dict(r) for r in rounds if dict(r).get(long_slot, 0) > 1]  # the long prompt's chunks, in order
    assert sum(r[long_slot] for r in prefill) == len(long_prompt)
    shared = [r for r in prefill if len(r) == 2]  # chunks beside the short request's step of one row
    assert all(r[long_slot] <= batching.SHARED_PREFILL_CHUNK and min(r.values()) == 1 for r in shared)
    assert all(r[long_slot] <= PREFILL_CHUNK for r in prefill)  # alone again once the short one is done
    assert len(shared) >= 10  # the short request's tokens went on, one a round, during the prefill
    if dtype == "int8":
        assert [outs["short"], outs["long"]] == alone
