"""The worker: the threads that own the Engine and run queued requests.

With ``max_batch`` 1 one thread runs the requests one at a time.  With more, ``max_batch`` threads
each take a request from the queue and run it through the engine with batching enabled
(``Engine.enable_batching``, specdec.runtime.batching): the running requests' decode steps share one target
forward (continuous batching: a request joins the batch when a thread takes it and leaves it when it
ends), and each request's draft length is chosen for the load of the whole batch.  Either way a
thread runs ``engine.stream(prompt_ids, config)``.

Model work never runs on the event loop.  A request becomes a :class:`Job`; the HTTP side puts it
in a bounded queue (full -> :class:`QueueFull`, a 503) and reads the job's events; the worker runs
the decode loop and sends one :class:`StepEvent` per decode step, or an :class:`ErrorEvent`.
A client that goes away sets the job's cancel flag; the worker checks it between decode steps,
so a cancelled generation stops within one step, and a job cancelled while queued never starts.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from specdec.algorithm.logprobs import TokenLogprob
from specdec.algorithm.loop import Stats
from specdec.errors import SpecdecError
from specdec.request import RequestConfig
from specdec.runtime.engine import Engine
from specdec.runtime.memory import RETAIN_TOKENS, MemoryBudget, Need, format_bytes
from specdec.serve.metrics import Metrics
from specdec.text import TextStream

log = logging.getLogger("specdec.serve")


@dataclass(frozen=True)
class Request:
    """One generation, validated and tokenized."""

    prompt_ids: list[int]
    config: RequestConfig  # max_new_tokens, sampling, stop, speculative (False: plain decoding), k, ...


@dataclass(frozen=True)
class StepEvent:
    """What one decode step added.

    text: the new text since the previous event, decoded incrementally (specdec.text.TextStream: never a
    broken character, never a piece of a stop string); accepted_text is its first part, from the
    draft tokens the target accepted, the rest came from the target's own token.  Text held back
    at a boundary (a partial character, a possible stop string) comes with the part that completes it.
    """

    text: str
    accepted_text: str
    drafted: int  # draft tokens proposed this step
    accepted: int  # of this step's emitted tokens, how many were accepted draft tokens
    emitted: int  # tokens this step added
    finish_reason: str | None  # set on the last step
    stats: Stats | None = None  # on the last step: the whole generation's
    logprobs: tuple[TokenLogprob, ...] = ()  # the step's tokens' (specdec.algorithm.logprobs), where asked for


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    user_error: bool  # a SpecdecError (the request's fault: a 400), else a bug (a 500)
    shutting_down: bool = False  # ended by the server's shutdown (a 503: the client may ask again elsewhere)

    @property
    def status(self) -> int:
        return 503 if self.shutting_down else 400 if self.user_error else 500

    @property
    def code(self) -> str:
        return SHUTTING_DOWN if self.shutting_down else "invalid_value" if self.user_error else "internal_error"


SHUTTING_DOWN = "server_shutting_down"  # the error code of a request the server's shutdown ended or refused


class Job:
    """A request on its way through the queue; the event loop reads its events."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue[StepEvent | ErrorEvent] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.arrived = time.perf_counter()
        self.ended_by: str | None = None  # why the server ended it (abort), None for a client that left
        self.need: Need | None = None  # the memory it needs, where the worker has a budget (Worker.submit)
        self.reserved = False  # whether that memory is reserved for it now

    def emit(self, event: StepEvent | ErrorEvent) -> None:
        """Hand an event to the event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()

    async def next_event(self) -> StepEvent | ErrorEvent:
        return await self.events.get()

    def cancel(self) -> None:
        self.cancelled.set()

    def abort(self, reason: str) -> None:
        """End it from the server's side: the worker stops it within a step and its client gets `reason` as a
        shutting-down error event (a stream's last event, or a 503)."""
        self.ended_by = reason
        self.cancelled.set()


class QueueFull(Exception):
    """The queue holds its maximum of waiting requests."""


class OverBudget(Exception):
    """A request needs more memory than the whole budget: it could never run (a 413)."""

    def __init__(self, need: Need, budget: MemoryBudget) -> None:
        held = f", {format_bytes(budget.held)} of it kept for the runners' cached prompts" if budget.held else ""
        super().__init__(f"the request needs {need.describe()}; --memory-budget is {format_bytes(budget.total)}"
                         f"{held}: send a shorter prompt or a smaller max_tokens")
        self.need = need


class Worker:
    """The threads that own `engine`; requests start in arrival order, up to `max_batch` at once
    (the engine's batching set to it).  `defaults`: the requests' defaults, refused now where the
    engine could run none of them (stairs verification in a batch).

    `memory_budget` (bytes, None: none; specdec.runtime.memory): each request's need (Engine.memory_need) is
    reserved before it starts and released when it ends.  submit() refuses one that needs more than the
    whole budget (OverBudget); the request at the head of the queue waits until the running ones leave it
    room, and those behind it wait behind it (no later, smaller request overtakes it).  Either way the
    runners keep at most RETAIN_TOKENS cached tokens between requests (Engine.retain_tokens); with a
    budget, that memory is held aside in it."""

    def __init__(self, engine: Engine, max_queue: int = 16, max_batch: int = 1,
                 defaults: RequestConfig = RequestConfig(), memory_budget: int | None = None) -> None:
        self.engine = engine
        engine.enable_batching(max_batch)
        engine.pool.check(defaults)
        engine.retain_tokens = RETAIN_TOKENS
        self.budget: MemoryBudget | None = None
        if memory_budget is not None:
            target, draft = engine.pool.footprints()
            per_token = target.cache_bytes_per_token + (draft.cache_bytes_per_token if draft is not None else 0)
            self.budget = MemoryBudget(memory_budget, held=max_batch * RETAIN_TOKENS * per_token)
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.active: set[Job] = set()  # the jobs running now
        self._admitting: Job | None = None  # the job taken from the queue, waiting for its memory
        self._admit = threading.Lock()  # held by the thread taking the next job: jobs start in arrival order
        self._lock = threading.Lock()
        budget = self.budget
        self.metrics = Metrics(running=lambda: float(len(self.active)), waiting=self._waiting,
                               store_tokens=lambda: float(engine.suffix_store.tokens if engine.suffix_store else 0),
                               budget=lambda: float(budget.total if budget else 0),
                               reserved=lambda: float(budget.reserved if budget else 0))
        self._threads = [threading.Thread(target=self._run, name=f"specdec-worker-{i}", daemon=True)
                         for i in range(max_batch)]
        self._closing = False
        self._ended_by: str | None = None  # set when a shutdown ends every request (drain's timeout)

    def _waiting(self) -> float:
        """The jobs waiting: in the queue, and the one waiting for its memory."""
        return float(self.jobs.qsize() + (self._admitting is not None))

    def need(self, request: Request) -> Need:
        """The memory `request` needs (Engine.memory_need)."""
        return self.engine.memory_need(len(request.prompt_ids), request.config.max_new_tokens)

    @property
    def running(self) -> Job | None:
        """A running job (the running one, with max_batch 1), or None when none runs."""
        return next(iter(list(self.active)), None)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    @property
    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    @property
    def closing(self) -> bool:
        """Whether it takes no more requests (draining for a shutdown, or stopped)."""
        return self._closing

    def drain(self, timeout: float) -> None:
        """A graceful shutdown's first half: take no more requests (submit raises QueueFull: a 503), let the
        running and the waiting ones go on for `timeout` seconds, then end each with a shutting-down error
        event (a stream ends with it, a whole response is a 503) instead of cutting its connection."""
        self._closing = True
        timer = threading.Timer(timeout, self._abort_all, args=(f"the server is shutting down (after {timeout:g} s)",))
        timer.daemon = True
        timer.start()

    def _abort_all(self, reason: str) -> None:
        self._ended_by = reason  # a job a thread takes from the queue from now on ends at once (_run)
        admitting = self._admitting
        for job in [*self.active, *([admitting] if admitting is not None else [])]:
            job.abort(reason)
        for job in self._take_waiting():
            job.abort(reason)
            job.emit(ErrorEvent(reason, user_error=False, shutting_down=True))

    def _take_waiting(self) -> list[Job]:
        """The jobs waiting in the queue, taken out of it."""
        taken: list[Job] = []
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return taken
            if job is not None:
                taken.append(job)

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull when max_queue jobs already wait (or the server is closing), OverBudget when
        it needs more memory than the whole budget."""
        if self._closing:
            raise QueueFull()
        if self.budget is not None:
            job.need = self.need(job.request)
            if job.need.total > self.budget.room:
                raise OverBudget(job.need, self.budget)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull() from None

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what runs and what waits, and end the thread."""
        self._closing = True
        admitting = self._admitting
        for job in [*self.active, *([admitting] if admitting is not None else []), *self._take_waiting()]:
            job.cancel()
        for _ in self._threads:
            self.jobs.put(None)
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._admit:  # one thread at a time takes the next job and waits for its memory
                job = self.jobs.get()
                if job is None:
                    return
                if not self._admitted(job):
                    continue
            try:
                self._generate(job)
            finally:
                with self._lock:
                    self.active.discard(job)
                self._give_back(job)

    def _admitted(self, job: Job) -> bool:
        """Whether `job`, just taken from the queue, starts now: its memory reserved (waiting for it), and it
        made active; False for a job the shutdown ended (told so) or whose client left meanwhile."""
        if self.budget is not None and job.need is not None and not job.cancelled.is_set():
            self._admitting = job
            try:
                job.reserved = self.budget.reserve(job.need.total, job.cancelled)
            finally:
                self._admitting = None
        if self._ended_by is not None or job.ended_by is not None:  # ended by the shutdown before it started
            reason = self._ended_by or job.ended_by
            assert reason is not None
            job.abort(reason)
            job.emit(ErrorEvent(reason, user_error=False, shutting_down=True))
            self._give_back(job)
            return False
        if job.cancelled.is_set():  # its client went away while it waited
            self._give_back(job)
            return False
        with self._lock:
            self.active.add(job)
        return True

    def _give_back(self, job: Job) -> None:
        """Release the memory `job` reserved, if it did (once)."""
        if self.budget is not None and job.need is not None and job.reserved:
            self.budget.release(job.need.total)
        job.reserved = False

    def _generate(self, job: Job) -> None:
        r, engine, metrics = job.request, self.engine, self.metrics
        started = time.perf_counter()
        stats: Stats | None = None  # the generation's totals so far, its steps summed (None: none yet, or recorded)
        steps = None
        try:
            steps = engine.stream(r.prompt_ids, r.config)
            text = TextStream(engine.decode_text, r.config.stop)
            for step in steps:
                if stats is None:  # the first step: the prefill and the first token
                    metrics.record_first_token(started - job.arrived, time.perf_counter() - job.arrived)
                    stats = Stats()
                stats.add(step)
                final = step.finish_reason is not None
                # The step emitted its accepted draft tokens, then the target's own token (unless a
                # stop cut the step short inside the accepted ones).
                n_accepted = min(step.accepted, len(step.tokens))
                if n_accepted == len(step.tokens):
                    accepted_text, own_text = text.push(step.tokens, final=final), ""
                else:
                    accepted_text = text.push(step.tokens[:n_accepted])
                    own_text = text.push(step.tokens[n_accepted:], final=final)
                event = StepEvent(accepted_text + own_text, accepted_text, step.drafted, n_accepted,
                                  len(step.tokens), step.finish_reason, stats if final else None, step.logprobs)
                if step.finish_reason is not None:  # final: counted before the client hears of it (/metrics is
                    # up to date once it has)
                    metrics.record_generation(len(r.prompt_ids), stats)
                    metrics.record_finish(step.finish_reason, time.perf_counter() - job.arrived)
                    stats = None
                job.emit(event)
                if final:
                    break
                if job.cancelled.is_set():  # checked between steps: at most one step after a cancel
                    if job.ended_by is not None:  # the server's shutdown, not a client that left: say so
                        job.emit(ErrorEvent(job.ended_by, user_error=False, shutting_down=True))
                    break
        except SpecdecError as e:
            job.emit(ErrorEvent(str(e), user_error=True))
        except Exception as e:  # a bug: logged with its traceback, answered without one
            log.exception("generation failed")
            job.emit(ErrorEvent(f"internal error: {type(e).__name__}", user_error=False))
        finally:
            if steps is not None:
                steps.close()
            if stats is not None:  # a generation cancelled (or failed) part way
                metrics.record_generation(len(r.prompt_ids), stats)
