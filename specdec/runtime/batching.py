"""Batched decoding: the steps of several requests in one target forward, joining and leaving freely.

A server with several clients should not decode them one after another: a
decode step reads every weight of the target once whatever it computes, so B
requests in one forward cost little more than one (the same reason a k-token
verification is cheap).  This is continuous batching (Yu et al. 2022, Orca:
requests join and leave the running batch between steps), combined with
speculative decoding whose draft length backs off as the batch grows (the
balance studied by Liu et al. 2024, "Optimizing speculative decoding for
serving LLMs using goodput"; vLLM's num_speculative_tokens per batch size).

How it works:

- :class:`BatchedTarget` owns one :class:`~specdec.native.lean.LeanRunner`
  per slot over the same target model: each slot has its own KV cache, which
  grows and rolls back on its own.  Layout: **packed, not padded**
  (:func:`specdec.native.lean.forward_packed`): the new tokens of every slot
  -- a prompt, one plain token, or the pending token plus a draft of any length
  -- are rows of one matrix, and each slot's rows attend to its own cache.  No
  padding rows are computed and no attention mask is built; and for an int8
  target every row is computed exactly as when it runs alone, so a request's
  logits are bitwise independent of its neighbours.
- :meth:`Engine.enable_batching <specdec.runtime.engine.Engine.enable_batching>` gives
  the engine a :class:`BatchPool` (specdec.runtime.pool): every request still goes
  through ``Engine.stream`` and runs the one decode loop,
  :func:`specdec.algorithm.loop.decode`, in the thread that consumes it, over a
  :class:`SlotRunner` (a ModelRunner view of its slot) the pool lends it.  A
  slot's forward waits until every other active slot has submitted its forward
  too (or left); the last one to arrive runs the packed forward for all and
  hands each its logits.  Drafting, verification and
  rollback stay per request.
- Each speculative request gets its own cost-model controller
  (:class:`specdec.algorithm.control.AutoK`) that sees the load of the others (their
  tokens in the step, their expected tokens, their drafting time) and prices
  its k against t(total tokens) measured over packed forwards (a table timed
  once, then kept current by the batch from every packed forward's time
  against its rows): k shrinks as the batch grows and goes to 0 when plain
  batched decoding is faster.

Output: greedy output of every request equals its plain output alone, and a
seeded sampled request its own seed's output alone, bitwise for int8 targets
(the neighbours change nothing, k changes nothing).  fp32 targets: the batch
changes fp32 rounding, so identical up to near-ties (see README).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from specdec.algorithm.control import AutoK, Controller, Costs, Load
from specdec.algorithm.sampling import SamplingParams
from specdec.backends.base import PREFILL_CHUNK, Footprint, ModelRunner, Refusals, cannot_clone
from specdec.errors import SpecdecError
from specdec.native import lean
from specdec.native.lean import LeanRunner, forward_packed
from specdec.runtime import runners
from specdec.runtime.pool import Lease

if TYPE_CHECKING:
    from specdec.request import RequestConfig

# Rows of a prompt a joining request feeds a round while others decode (PREFILL_CHUNK while it is alone): each
# of their steps then waits for at most this many rows -- 32 rows of the 1.5B gguf target at a 20k-token depth
# are ~0.3 s on a 2-core Zen 4 (~10 ms a row there), where 512 held every step ~5 s and a 20-token answer sent
# during a long prefill took minutes; a chunk of 32 still fills the block kernel's 8-row passes, so the long
# prompt pays ~one extra weight read (~30 ms) per 32 rows for the others' sake.
SHARED_PREFILL_CHUNK = 32
BATCH_KS = (1, 2, 4, 8, 16, 32, 64)  # packed forward sizes timed for the batch controller
# weights of a packed forward's time in the shared costs: those a lone request's controller gives its steps
LEARN_SCALE, LEARN_SHAPE = AutoK.cost_ewma, AutoK.shape_ewma


class BatchedTarget:
    """`max_batch` slots over one target model, each with its own KV cache; forwards that arrive
    together run as one packed forward (see the module doc)."""

    def __init__(self, target: Any, max_batch: int) -> None:
        """target: a LeanRunner (a gguf target, an int8 one on the lean runner), whose clones -- its weights, a
        cache each -- are the slots, or a transformers model (fp32 or int8) to run lean runners over."""
        if max_batch < 1:
            raise SpecdecError(f"the batch size must be >= 1, got {max_batch}")
        if runners.batchable(target):
            self.runners = [target.clone() for _ in range(max_batch)]
        elif lean.supports(target, fp32=True):
            self.runners = [LeanRunner(target, fp32=True) for _ in range(max_batch)]
        else:
            raise SpecdecError(
                "batched decoding needs a gguf target or a transformers target of a llama / qwen2 / mistral "
                "architecture, fp32 or int8 on the CPU"
            )
        self.max_batch = max_batch
        self._cond = threading.Condition()
        self._free = list(range(max_batch - 1, -1, -1))  # pop() hands out slot 0 first
        self._active: set[int] = set()
        self._pending: dict[int, tuple[list[int], int | None]] = {}
        self._results: dict[int, torch.Tensor | BaseException] = {}
        self._running = False
        self.controllers: dict[int, AutoK] = {}  # slot -> its request's controller (for the others' load)
        # The batch controllers' shared costs, kept current from every packed forward's time against its
        # rows (Costs.learn_target: overall scale and per-size shape); None: nothing learns.
        self.costs: Costs | None = None
        self.forwards = 0  # packed forwards run
        self.rows = 0  # tokens computed in them
        self.batched = 0  # slots served by them (sum of batch sizes)

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._active)

    def acquire(self) -> SlotRunner:
        """A free slot, now active: the batch's forwards wait for it until it is released."""
        with self._cond:
            if not self._free:
                raise SpecdecError(f"all {self.max_batch} batch slots are busy")
            slot = self._free.pop()
            self._active.add(slot)
        self.runners[slot].reset()
        return SlotRunner(self, slot)

    def release(self, slot: int) -> None:
        """The slot's request is done: the others no longer wait for it."""
        with self._cond:
            if slot not in self._active:
                return
            self._active.discard(slot)
            self._pending.pop(slot, None)
            self._results.pop(slot, None)
            self.controllers.pop(slot, None)
            self._free.append(slot)
            self._cond.notify_all()  # a waiting slot may now be the last one to arrive

    def load(self, slot: int) -> Load:
        """What the other active slots planned for the coming step (their controllers' last choice;
        a request without one feeds a token and emits one)."""
        with self._cond:
            others = [self.controllers.get(s) for s in self._active if s != slot]
        plans = [c.planned if c is not None else Load(1, 1.0, 0.0) for c in others]
        return Load(sum(p.tokens for p in plans), sum(p.expected for p in plans), sum(p.draft_ms for p in plans))

    def submit(self, slot: int, new_tokens: Sequence[int], last_n: int | None) -> torch.Tensor:
        """Slot `slot`'s forward: waits for the batch and returns this slot's logits [n, V]."""
        tokens = self.runners[slot]._check(new_tokens)  # a bad request fails alone, before it joins
        with self._cond:
            if slot not in self._active:
                raise RuntimeError(f"slot {slot} is not active")
            self._pending[slot] = (tokens, last_n)
            while slot not in self._results:
                if not self._running and self._pending and self._active <= self._pending.keys():
                    self._lead()
                else:
                    self._cond.wait()
            result = self._results.pop(slot)
        if isinstance(result, BaseException):
            raise result
        return result

    def _lead(self) -> None:
        """Run the pending forwards as one (called with the lock held; computes without it)."""
        batch = sorted(self._pending.items())
        self._pending.clear()
        self._running = True
        self._cond.release()
        start = time.perf_counter()
        try:
            outcome: list[torch.Tensor] | BaseException = forward_packed(
                [self.runners[s] for s, _ in batch], [c for _, (c, _) in batch], [n for _, (_, n) in batch]
            )
        except BaseException as e:  # every slot of the batch sees the failure
            outcome = e
        finally:
            self._cond.acquire()
        ms = 1000 * (time.perf_counter() - start)
        rows = sum(len(c) for _, (c, _) in batch)
        self._running = False
        self.forwards += 1
        self.batched += len(batch)
        self.rows += rows
        if self.costs is not None and not isinstance(outcome, BaseException):
            self.costs.learn_target(rows, ms, LEARN_SCALE, LEARN_SHAPE)
        for i, (s, _) in enumerate(batch):
            if s in self._active:
                self._results[s] = outcome if isinstance(outcome, BaseException) else outcome[i]
        self._cond.notify_all()


class SlotRunner(Refusals):  # no trees
    """A ModelRunner over one slot of a BatchedTarget: its own cache; its forwards join the batch."""

    def __init__(self, batch: BatchedTarget, slot: int) -> None:
        self.batch, self.slot = batch, slot
        self.runner = batch.runners[slot]
        # a slot's forwards join the batch as chains: no token trees through it (yet)
        self.capabilities = replace(self.runner.capabilities, tree=False)
        self.vocab_size = self.runner.vocab_size
        self.max_context = self.runner.max_context
        self.eos_token_ids = self.runner.eos_token_ids

    @property
    def model(self) -> Any:
        """The slot's runner's transformers model (a gguf target's is built when first asked for)."""
        return self.runner.model

    @property
    def tokens(self) -> list[int]:
        return self.runner.tokens

    @tokens.setter
    def tokens(self, tokens: list[int]) -> None:  # ModelRunner.tokens is an attribute
        self.runner.tokens = tokens

    def forward(self, new_tokens: Sequence[int], last_n: int | None = None) -> torch.Tensor:
        """The slot's forward in the batch.  A long one (a prompt's prefill) joins it a chunk a round --
        PREFILL_CHUNK rows while this slot is alone, SHARED_PREFILL_CHUNK while others decode -- so the other
        slots' decode steps go on between its chunks rather than wait for all of it: what forward_chunked does
        for a batch-invariant runner (gguf, int8: bitwise the same however it is split), and for an fp32 one
        too, whose rounding depends on the batch anyway (see the module doc)."""
        tokens = list(new_tokens)
        if len(tokens) <= SHARED_PREFILL_CHUNK or last_n is None or last_n > PREFILL_CHUNK:
            return self.batch.submit(self.slot, tokens, last_n)
        at = 0
        while True:  # each round's chunk as the batch is then; the last one holds the last_n rows asked for
            chunk = PREFILL_CHUNK if self.batch.active <= 1 else SHARED_PREFILL_CHUNK
            size = min(chunk, len(tokens) - at - last_n)
            if len(tokens) - at <= chunk or size < 1:
                return self.batch.submit(self.slot, tokens[at:], last_n)
            self.batch.submit(self.slot, tokens[at : at + size], 1)
            at += size

    def footprint(self) -> Footprint:
        """Its runner's, prefilling in chunks (forward) whatever the runner (ModelRunner.footprint)."""
        return replace(self.runner.footprint(), chunked=True)

    def expect(self, tokens: int) -> None:
        self.runner.expect(tokens)

    def trim(self, tokens: int) -> int:
        return self.runner.trim(tokens)

    def hidden(self) -> torch.Tensor:
        """The slot's final hidden states [n, hidden] of its last forward (ModelRunner.hidden)."""
        return self.runner.hidden()

    def keep_hidden_rows(self, n: int) -> None:
        """The slot's runner keeps its forwards' last n hidden rows too (ModelRunner.keep_hidden_rows)."""
        self.runner.keep_hidden_rows(n)

    def hidden_tail(self) -> torch.Tensor:
        """The slot's last forward's last hidden rows [m, hidden] (ModelRunner.hidden_tail)."""
        return self.runner.hidden_tail()

    def tap_layers(self, layers: Sequence[int]) -> None:
        """The slot's runner keeps these layers' outputs with its hidden rows (ModelRunner.tap_layers)."""
        self.runner.tap_layers(layers)

    def rollback(self, n: int) -> None:
        self.runner.rollback(n)

    def reset(self) -> None:
        self.runner.reset()

    def release(self) -> None:
        self.batch.release(self.slot)

    def clone(self) -> ModelRunner:
        raise cannot_clone(self)

    def describe(self) -> str:
        return self.runner.describe()

    def identity(self) -> dict[str, Any]:
        return self.runner.identity()


def clone_runner(runner: ModelRunner) -> ModelRunner:
    """Another runner over the same loaded model with a cache of its own (a draft per slot)."""
    return runner.clone()


def check_batchable(config: RequestConfig) -> None:
    """A SpecdecError for a request a batch cannot run: it verifies causally (block verification included)."""
    if config.verify == "stairs":
        raise SpecdecError("batched serving verifies causally: drop --verify stairs or use --max-batch 1")


class BatchPool:
    """An Engine's models serving up to `max_batch` concurrent requests, one packed target forward per
    step (see the module doc): the runner pool Engine.enable_batching gives the engine
    (specdec.runtime.pool).  Each request's lease is a slot: a SlotRunner, a draft runner of its own and a
    controller that sees the other slots' load.  What it needs of the engine that builds it comes as values:
    its runners; `speculation`, what Engine.speculation makes of a request's k; `shared`, the engine's "auto"
    controller (made on first use); `drafts`, whether the engine drafts at all."""

    def __init__(self, target: ModelRunner, draft: ModelRunner | None, max_batch: int = 4, *,
                 speculation: Callable[[int | str | Controller, SamplingParams], int | Controller],
                 shared: Callable[[], AutoK], drafts: bool) -> None:
        self._speculation, self._shared, self._drafting = speculation, shared, drafts
        if not runners.batchable(target):
            target = target.model
            if target is None:
                raise SpecdecError("batched decoding needs a gguf or transformers target (not --backend llamacpp)")
        self.target = BatchedTarget(target, max_batch)
        self._drafts = [clone_runner(draft) for _ in range(max_batch)] if draft is not None else []
        self._costs: Costs | None = None
        self._costs_lock = threading.Lock()

    @property
    def max_batch(self) -> int:
        return self.target.max_batch

    def costs(self) -> Costs:
        """The batch controller's costs: t(n) of packed forwards of n = 1..64 tokens (measured once,
        cached on disk like the engine's) and the engine's measured drafting costs."""
        with self._costs_lock:
            if self._costs is None:
                from specdec.runtime.profile import _cached, measure_forwards
                from specdec.zoo import home

                runner = self.target.runners[0].clone()  # the slots' weights, a cache of its own
                ks = [k for k in BATCH_KS if k + 64 < runner.max_context]
                ms = _cached("batch-target", runner, {"ks": ks, "prefix": 64, "repeats": 2},
                             lambda: {str(k): v for k, v in measure_forwards(runner, ks, prefix=64, repeats=2).ms.items()},
                             home() / "profiles")
                draft = self._shared().costs
                self._costs = Costs({int(k): float(v) for k, v in ms.items()}, draft.draft_ms,
                                    draft_overhead_ms=draft.draft_overhead_ms, sync_ms=draft.sync_ms,
                                    short_sync_ms=draft.short_sync_ms)
                self.target.costs = self._costs  # learns from the packed forwards from now on
            return self._costs

    def controller(self, slot: int, k: int | str | Controller, sampling: SamplingParams) -> int | Controller:
        """What Engine.speculation gives (a fixed γ, a caller's controller, a seeded sampled request's
        own controller: its k depends on its seed and tokens only, so the same seed gives the same
        text whatever the neighbours, and as when served alone) -- except that the engine's shared
        "auto" controller becomes one of the request's own that sees the other slots' load.  Its
        acceptance estimates are its own; its costs are the batch's, shared by every such request and
        learnt by the batch itself from each packed forward's time against its rows (a request's own
        step time holds its waits for the others, so the controller learns no costs itself)."""
        chosen, shared = self._speculation(k, sampling), self._shared()
        if chosen is not shared:
            return chosen
        # the engine's lengths of recent answers and their sources' acceptance (shared: each request adds its own)
        # and share of model steps
        auto = AutoK(self.costs(), max_k=shared.max_k, cost_ewma=0.0, load=lambda: self.target.load(slot),
                     lengths=shared.lengths, answers=shared.answers, model_share=shared.model_share)
        self.target.controllers[slot] = auto
        return auto

    def check(self, config: RequestConfig) -> None:
        check_batchable(config)

    def footprints(self) -> tuple[Footprint, Footprint | None]:
        """A slot's target runner's and draft runner's (RunnerPool.footprints): the target's prefill in chunks."""
        target = replace(self.target.runners[0].footprint(), chunked=True)
        return target, self._drafts[0].footprint() if self._drafts else None

    @contextmanager
    def lease(self, config: RequestConfig) -> Iterator[Lease]:
        """A slot for one request, from when its first step is asked for until its steps end or are closed."""
        if config.speculative and self._drafting:
            self.costs()  # measured before the slot is taken: the others do not wait for it
        slot = self.target.acquire()
        try:
            yield Lease(slot, self._drafts[slot.slot] if self._drafts else None, partial(self.controller, slot.slot))
        finally:
            slot.release()
