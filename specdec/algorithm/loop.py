"""The decode loop: speculative decoding, and plain decoding as its reference.

One step of speculative decoding (Leviathan et al. 2023; Chen et al. 2023):
propose k tokens with the drafter -> one target forward over
[last, *draft] -> verify -> roll back the rejected tokens -> emit
``accepted + 1`` tokens -> tell the drafter how it did.  With no drafter every
step is a plain one-token forward, which is the autoregressive reference the
speculative loop must reproduce.

Invariant at the top of every step: the target's cache holds the context but
its last token ("pending"), which the next forward feeds.  The CLI, the server,
the Python API and the benchmark all consume :func:`decode`.

What a request does to the target's distribution as a function of the prefix (penalties, logit_bias, a
grammar's mask: specdec.algorithm.processors) is one LogitsProcessor, applied by :class:`Shaping` to every
row of target logits before the verifier, so that plain and speculative decoding decide on the same
processed rows; the log-probabilities of the emitted tokens (specdec.algorithm.logprobs) come from the raw
rows that chose them.  A processor that constrains the output to a language (a grammar:
specdec.algorithm.processors.ConstrainingProcessor) also shapes the drafts: a chain is cut at the first token it
forbids, where that cannot change the output, and the tokens it forces are verified as drafts that need no
proposal, ahead of the drafter's (fast-forward; only where the request drafts at all: plain decoding stays one
token a forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from specdec.algorithm.control import Controller, FixedK, plan, propose
from specdec.algorithm.draft import FORCED, Draft, Drafter, TreeShape
from specdec.algorithm.logprobs import TokenLogprob, token_logprobs
from specdec.algorithm.processors import ConstrainingProcessor, LogitsProcessor
from specdec.algorithm.trees import depths
from specdec.algorithm.verify import GreedyVerifier, Verifier
from specdec.backends.base import ModelRunner, forward_chunked, reusable_prefix
from specdec.errors import SpecdecError
from specdec.text import check_prompt


@dataclass
class Stats:
    """What one generation did: its steps summed (add; each Step holds its own).  Counts of drafts are
    before stop truncation."""

    new_tokens: int = 0
    target_forwards: int = 0  # including the prompt's prefill
    reused_prompt_tokens: int = 0  # the prompt's first tokens taken from the target's cache (decode's reuse_prefix)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    draft_steps: int = 0  # steps that verified a draft
    plain_steps: int = 0  # one-token steps after the prefill (nothing drafted)
    proposed_at: list[int] = field(default_factory=list)  # [i]: steps that proposed a draft token i
    accepted_at: list[int] = field(default_factory=list)  # [i]: steps whose draft token i was accepted
    tree_steps: int = 0  # draft steps that verified a token tree (counted in draft_steps too)
    tree_nodes: int = 0  # draft tokens those trees held (their depth is what `drafted` counts)
    forced: int = 0  # draft tokens a grammar forced (counted in drafted too; specdec.algorithm.processors)
    process_s: float = 0.0  # in the request's logits processor (a grammar's masks, drafts' checks; part of the others)
    # per draft source (specdec.algorithm.control: "model", "lookup", "suffix", ...): [draft steps, drafted, accepted]
    by_source: dict[str, list[int]] = field(default_factory=dict)
    wall_s: float = 0.0
    draft_s: float = 0.0  # in the drafter (proposals)
    target_s: float = 0.0  # in target forwards and verification, the prefill included
    prefill_s: float = 0.0  # from the loop's start to the first token: the prompt's prefill (the drafter's too)
    steps: list[tuple[int, int, float]] = field(default_factory=list)  # per step after the prefill:
    # (draft tokens proposed, tokens emitted, seconds from drafting to the emitted tokens)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        """Mean draft tokens accepted per verified draft."""
        return self.accepted / self.draft_steps if self.draft_steps else 0.0

    @property
    def mean_tree_nodes(self) -> float:
        """Mean draft tokens per verified tree."""
        return self.tree_nodes / self.tree_steps if self.tree_steps else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """[i] = fraction of steps whose draft token i was accepted, given it was proposed."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def mean_k(self) -> float:
        """Mean draft tokens proposed per step after the prefill (plain steps count as 0)."""
        steps = self.draft_steps + self.plain_steps
        return self.drafted / steps if steps else 0.0

    @property
    def plain_fraction(self) -> float:
        """Fraction of the steps after the prefill that drafted nothing."""
        steps = self.draft_steps + self.plain_steps
        return self.plain_steps / steps if steps else 0.0

    @property
    def other_s(self) -> float:
        """Wall time outside the drafter and the target (stop checks, bookkeeping, the caller)."""
        return max(self.wall_s - self.draft_s - self.target_s, 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first one per second after it: the decoding speed, the prefill left out."""
        decode_s = self.wall_s - self.prefill_s
        return (self.new_tokens - 1) / decode_s if self.new_tokens > 1 and decode_s > 0 else 0.0

    def record_draft(self, num_drafted: int, num_accepted: int) -> None:
        self.draft_steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        while len(self.proposed_at) < num_drafted:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(num_drafted):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < num_accepted

    def record_source(self, source: str, num_drafted: int, num_accepted: int) -> None:
        """A verified draft's counts under the source it came from (as record_draft counts them)."""
        counts = self.by_source.setdefault(source, [0, 0, 0])
        counts[0] += 1
        counts[1] += num_drafted
        counts[2] += num_accepted

    def add(self, step: Step) -> None:
        """Count `step` in: the steps of one generation, in order, sum to its Stats (collect does so; so do
        the CLI's stream and the server's worker, which read each step as it comes)."""
        self.new_tokens += len(step.tokens)
        self.target_forwards += 1
        self.wall_s += step.wall_s
        self.draft_s += step.draft_s
        self.target_s += step.target_s
        self.process_s += step.process_s
        if step.prefill:
            self.prefill_s += step.target_s
            self.reused_prompt_tokens += step.reused_prompt_tokens
            return
        self.steps.append((step.drafted, len(step.tokens), step.step_s))
        if not step.drafted:
            self.plain_steps += 1
            return
        self.record_draft(step.drafted, step.accepted)
        self.record_source(step.source, step.drafted, step.accepted)
        self.forced += step.forced
        if step.tree_nodes:
            self.tree_steps += 1
            self.tree_nodes += step.tree_nodes

    @property
    def acceptance_by_source(self) -> dict[str, dict[str, float]]:
        """{source: {draft_steps, drafted, accepted, acceptance_rate}} for each source that drafted."""
        return {source: {"draft_steps": steps, "drafted": drafted, "accepted": accepted,
                         "acceptance_rate": accepted / drafted if drafted else 0.0}
                for source, (steps, drafted, accepted) in sorted(self.by_source.items())}

    def step_records(self) -> list[list[float]]:
        """The per-step records as JSON-friendly lists: [draft tokens, tokens emitted, seconds]."""
        return [[k, n, round(sec, 6)] for k, n, sec in self.steps]

    def to_dict(self) -> dict:
        skip = ("proposed_at", "accepted_at", "draft_steps", "steps", "by_source")
        out = {k: v for k, v in asdict(self).items() if k not in skip}
        out.update(
            steps=self.step_records(),
            by_source=self.acceptance_by_source,
            acceptance_rate=self.acceptance_rate,
            mean_accepted_per_step=self.mean_accepted_per_step,
            tokens_per_target_forward=self.tokens_per_target_forward,
            mean_tree_nodes=self.mean_tree_nodes,
            per_position_acceptance=self.per_position_acceptance,
            tokens_per_s=self.tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
            mean_k=self.mean_k,
            plain_fraction=self.plain_fraction,
            other_s=self.other_s,
        )
        return out


@dataclass(frozen=True)
class StopCondition:
    """When generation ends.

    eos_token_ids: end-of-sequence tokens (kept as the last token, like transformers' generate).
    stop_strings: generation ends at the token that completes one of them.
    decode: token ids -> text, needed for stop strings.
    """

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[Sequence[int]], str] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise SpecdecError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise SpecdecError("stop strings must not be empty")
        if self.stop_strings and self.decode is None:
            raise ValueError("stop strings need a decode function")

    def check(self, generated: Sequence[int]) -> str | None:
        """Finish reason after the last token of `generated` was appended, or None to go on."""
        if generated[-1] in self.eos_token_ids:
            return "stop"
        if self.stop_strings and self.decode is not None:  # (__post_init__ refused strings without decode)
            # A stop string completed by the last token lies in a short tail; a
            # token may be a fraction of a character, hence the generous window.
            window = 4 * max(len(s) for s in self.stop_strings) + 4
            tail = self.decode(generated[-window:])
            if any(s in tail for s in self.stop_strings):
                return "stop"
        if len(generated) >= self.max_new_tokens:
            return "length"
        return None


@dataclass(frozen=True)
class Step:
    """What one decode step did, as a value: the tokens it emitted (finish_reason set on the last step) and
    its own counts and times.  The first step is the prefill's (its token is the target's first); a
    generation's totals are its steps summed (Stats.add).  Counts of drafts are before stop truncation: a
    stop inside the accepted tokens emits fewer than accepted + 1."""

    tokens: list[int]
    finish_reason: str | None
    drafted: int = 0  # draft tokens verified (a tree's depth); 0: the prefill, or a plain step
    accepted: int = 0  # of them, how many the target accepted
    source: str = ""  # where a drafted step's draft came from (specdec.algorithm.control: "model", "lookup", ...)
    tree_nodes: int = 0  # the tokens of the tree it verified (0: a chain, or nothing drafted)
    forced: int = 0  # of the drafted tokens, how many a grammar forced (verified first, without a proposal)
    process_s: float = 0.0  # in the request's logits processor: its rows, forced tokens and draft checks (in the above)
    draft_s: float = 0.0  # in the drafter (planning and proposing)
    target_s: float = 0.0  # in the target's forward and verification (the prefill's: from the loop's start)
    step_s: float = 0.0  # from drafting to the tokens emitted (the prefill's: 0, see target_s)
    wall_s: float = 0.0  # since the step before was yielded (the first: since the loop's start), the caller's time included
    prefill: bool = False  # the prefill's step
    reused_prompt_tokens: int = 0  # the prefill's: the prompt's first tokens taken from the target's cache
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of `tokens` where decode was asked for them


class Shaping:
    """What the loop does to the target's logits rows besides verifying them: the request's processor (None:
    the rows as they are) and the log-probabilities of the emitted tokens (logprobs: None = not asked for;
    n >= 0: each token's own and its n most likely alternatives).  `generated` is the loop's list (prompt
    excluded): a row's prefix is the prompt, then it, then the row's path."""

    def __init__(self, processor: LogitsProcessor | None, logprobs: int | None, generated: list[int]) -> None:
        self.processor, self.logprobs, self.generated = processor, logprobs, generated
        self.last: list[TokenLogprob] = []  # the log-probabilities of the last verification's emitted tokens
        self.spent = 0.0  # seconds in the processor since `take`
        # the processor where it constrains the output to a language (drafts cut, forced tokens); found once, not
        # by a protocol check on every step
        self.constraint = processor if isinstance(processor, ConstrainingProcessor) else None

    def take(self) -> float:
        """The seconds spent in the processor since the last call (a step's Step.process_s)."""
        spent, self.spent = self.spent, 0.0
        return spent

    def process(self, paths: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        """The rows the verifier sees: logits [R, V] (row r after paths[r]) processed; the same tensor without
        a processor."""
        if self.processor is None:
            return logits
        return self._timed(self.processor.process, paths, logits)

    def _timed(self, method: Callable[..., Any], *args: Any) -> Any:
        """method(generated, *args), its time counted in `spent`."""
        t0 = time.perf_counter()
        out = method(self.generated, *args)
        self.spent += time.perf_counter() - t0
        return out

    def record(self, logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int]) -> None:
        """Keep the log-probabilities of tokens[i] under raw row rows[i] of logits [R, V] (if asked for)."""
        if self.logprobs is not None:
            self.last = token_logprobs(logits[list(rows)], tokens, self.logprobs)

    def forced(self, limit: int) -> list[int]:
        """The tokens the processor forces next (at most `limit`; none without a constraining processor)."""
        if limit <= 0 or self.constraint is None:
            return []
        return self._timed(self.constraint.forced, limit)

    def cut(self, draft: Draft | None, deterministic: bool) -> Draft | None:
        """A chain `draft` cut at the first token the processor forbids.  Where the cut cannot change the output
        (the proposal is `deterministic`: no q, or greedy verification) the forbidden token goes too; a sampled
        draft keeps it, so that verification rejects it and draws the next token from the residual as it must
        (cutting there would draw from p instead, which is not the target's distribution once the draft's q put
        mass on forbidden tokens: tests/constrain/test_processor.py measured it)."""
        if draft is None or draft.is_tree or self.constraint is None:
            return draft
        n = self._timed(self.constraint.valid, draft.tokens)  # (the forced tokens all pass)
        keep = n if deterministic or n == len(draft.tokens) else n + 1
        if keep == len(draft.tokens):
            return draft
        return replace(draft, tokens=draft.tokens[:keep], q=None if draft.q is None else draft.q[:keep],
                       parents=None if draft.parents is None else draft.parents[:keep])


@dataclass
class Output:
    token_ids: list[int]
    finish_reason: str
    stats: Stats
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token where decode was asked for them


def decode(
    target: ModelRunner,
    prompt_ids: Sequence[int],
    stop: StopCondition,
    drafter: Drafter | None = None,
    num_speculative_tokens: int | Controller = 5,
    verifier: Verifier | None = None,
    tree: TreeShape | None = None,
    reuse_prefix: bool = False,
    processor: LogitsProcessor | None = None,
    logprobs: int | None = None,
) -> Iterator[Step]:
    """Generate after `prompt_ids`, yielding the tokens of each step.

    drafter None -> plain autoregressive decoding (the reference).
    num_speculative_tokens: a fixed draft length γ, or a Controller (specdec.algorithm.control) that
    chooses k each step (0 = a plain step) from measured costs and acceptance.
    verifier: how target logits become tokens (default greedy).
    tree: drafts may be token trees of this shape (specdec.algorithm.draft.TreeShape; built by
    specdec.drafters.tree), verified in one forward where the target can (capabilities.tree); None: chains only.
    reuse_prefix: keep the part of the target's cache that the prompt starts with (an earlier turn of
    the conversation) and prefill only the rest, where that is exact (specdec.backends.base.reusable_prefix:
    batch-invariant targets); False: the whole prompt is prefilled from an empty cache.
    processor: what transforms the target's logits as a function of the prefix (specdec.algorithm.processors:
    penalties, logit_bias, a grammar), applied to every row before the verifier; None: the raw logits.
    logprobs: None, or each emitted token's log-probability under the target's raw logits with this many
    alternatives (Step.logprobs; specdec.algorithm.logprobs).
    """
    prompt_ids = list(prompt_ids)
    verifier = verifier or GreedyVerifier()
    controller, tree = _checked(target, prompt_ids, drafter, num_speculative_tokens, tree)
    generated: list[int] = []
    shaping = Shaping(processor, logprobs, generated)
    if processor is not None:
        processor.start(prompt_ids)

    start = time.perf_counter()
    first, reused = _prefill(target, prompt_ids, drafter, controller, verifier, reuse_prefix, shaping)
    prefilled = time.perf_counter() - start
    context = list(prompt_ids)  # prompt + generated; the target caches all of it but the last token
    emitted, reason = _append([first], generated, context, stop, target.max_context, shaping)
    step = Step(emitted, reason, target_s=prefilled, prefill=True, reused_prompt_tokens=reused, process_s=shaping.take(),
                logprobs=tuple(shaping.last[: len(emitted)]))
    last = start  # when the step before was yielded
    while True:
        now = time.perf_counter()
        if step.finish_reason is not None and drafter is not None:  # before the last yield: a caller may stop there
            controller.finish(len(generated))  # the answer's length: what the next answers' catch-ups are priced over
        yield replace(step, wall_s=now - last)
        last = now
        if step.finish_reason is not None:
            return
        step = _step(target, verifier, drafter, controller, tree, stop, context, generated, shaping)


def _step(target: ModelRunner, verifier: Verifier, drafter: Drafter | None, controller: Controller,
          tree: TreeShape | None, stop: StopCondition, context: list[int], generated: list[int],
          shaping: Shaping) -> Step:
    """One step after the prefill: draft (or not), verify, emit (appended to `context` and `generated`),
    tell the drafter and the controller how it went.  The Step returned has no wall_s yet (decode's)."""
    # Draft no more than can be used: k accepted + 1 bonus must not pass
    # max_new_tokens, and the verification forward must fit the window.
    limit = min(stop.max_new_tokens - len(generated) - 1, target.max_context - len(context))
    t0 = time.perf_counter()  # planning is drafting time: a drafter may run its first forward to grade (a head)
    forced = shaping.forced(limit) if drafter is not None else []  # a grammar's fixed text: drafts without a proposal
    if forced:  # the drafter continues after them, as a chain
        k, source, shape, draft = _draft(target, drafter, controller, None, context + forced, limit - len(forced))
        draft = _after_forced(forced, draft)
        k = len(draft.tokens)
    else:
        k, source, shape, draft = _draft(target, drafter, controller, tree, context, limit)
    draft = shaping.cut(draft, draft is None or draft.q is None or isinstance(verifier, GreedyVerifier))
    t1 = time.perf_counter()

    nodes = 0
    if draft is None or not draft.tokens:
        k = n = 0
        new = _plain_step(target, verifier, drafter, context, shaping)
    elif draft.is_tree:
        if shape is None or shape.nodes is None:
            raise ValueError("the drafter proposed a tree where a chain was asked for")
        k, new, extra = verify_tree(target, verifier, draft, context[-1], k, shape.nodes, drafter, shaping)
        n, nodes = len(new) - 1, len(draft.tokens)
        controller.observe_tree(len(draft.tokens) + 1, time.perf_counter() - t1, extra, source)
    else:
        k, n, new = verify_chain(target, verifier, draft, context[-1], k, drafter, shaping)
    t2 = time.perf_counter()
    f = min(len(forced), k)  # the forced tokens verified (all of them, unless the step ended plain)
    if drafter is not None:
        if k:
            drafter.observe(context, n)  # every verification, the forced tokens' too (a draft head keeps their rows)
        # a tree's verification holds more rows than its depth, a forced step's more than the drafter's k: their
        # time is not t(k + 1); the controller hears the drafter's part of the step only
        target_s = 0.0 if draft is not None and draft.is_tree or forced else t2 - t1
        controller.observe(k - f, max(n - f, 0), t1 - t0, target_s, draft.synced if draft is not None else 0, source)
        if f and k == f:
            source = FORCED
    emitted, reason = _append(new, generated, context, stop, target.max_context, shaping)
    return Step(emitted, reason, drafted=k, accepted=n, source=source if k else "", tree_nodes=nodes, forced=f,
                draft_s=t1 - t0, target_s=t2 - t1, step_s=time.perf_counter() - t0, process_s=shaping.take(),
                logprobs=tuple(shaping.last[: len(emitted)]))


def _checked(target: ModelRunner, prompt_ids: list[int], drafter: Drafter | None,
             num_speculative_tokens: int | Controller, tree: TreeShape | None) -> tuple[Controller, TreeShape | None]:
    """decode's arguments checked: (the controller that chooses k each step, the tree shape or None
    where the target verifies chains only); raises SpecdecError for what cannot be decoded."""
    check_prompt(prompt_ids, target.max_context)  # the check every prompt passes (an engine's before its steps)
    if isinstance(num_speculative_tokens, int):
        if num_speculative_tokens < 1 and drafter is not None:
            raise SpecdecError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        controller: Controller = FixedK(max(num_speculative_tokens, 1))
    else:
        controller = num_speculative_tokens
    if drafter is not None and not target.capabilities.rollback:
        raise SpecdecError("speculative decoding needs a target backend that can roll back its cache")
    if tree is not None and not target.capabilities.tree:
        tree = None  # chains: the same output, fewer tokens per forward (the engine says so up front)
    return controller, tree


def _prefill(target: ModelRunner, prompt_ids: list[int], drafter: Drafter | None, controller: Controller,
             verifier: Verifier, reuse_prefix: bool, shaping: Shaping) -> tuple[int, int]:
    """The caches readied (the target's cut to the prefix it may keep, or emptied; the drafter's and the
    controller's reset) and the prompt prefilled: (the first token, how many of the prompt's tokens the
    target's cache kept)."""
    reused = reusable_prefix(target, prompt_ids) if reuse_prefix else 0
    if reused:
        target.rollback(reused)
    else:
        target.reset()
    if drafter is not None:
        drafter.reset()
        controller.reset()

    # Prefill: the prompt (what the cache does not hold of it), in chunks where that is exact
    # (forward_chunked); its last logits give the first token.
    last = forward_chunked(target, prompt_ids[reused:], last_n=1)[-1:]  # [1, V]
    first = verifier.choose(shaping.process([[]], last)[-1])
    shaping.record(last, [0], [first])
    if drafter is not None:
        drafter.target_logits(prompt_ids[-1:], last)
        drafter.prefilled(prompt_ids)  # a draft head keeps the prompt's last hidden states now
    return first, reused


def _append(new: list[int], generated: list[int], context: list[int], stop: StopCondition,
            max_context: int, shaping: Shaping) -> tuple[list[int], str | None]:
    """Append tokens one by one to `generated` and `context`, stopping at the first one that ends
    generation: (the tokens appended, the finish reason or None); the processor hears them."""
    emitted, reason = new, None
    for i, token in enumerate(new):
        generated.append(token)
        context.append(token)
        reason = stop.check(generated)
        if reason is None and len(context) >= max_context:
            reason = "length"  # the context window is full
        if reason is not None:
            emitted = new[: i + 1]
            break
    if shaping.processor is not None:
        shaping.processor.accept(emitted)
    return emitted, reason


def _draft(target: ModelRunner, drafter: Drafter | None, controller: Controller, tree: TreeShape | None,
           context: list[int], limit: int) -> tuple[int, str, TreeShape | None, Draft | None]:
    """One step's drafting: the draft length k and the source the controller plans (at most `limit`),
    the tree's shape where the step drafts a tree (None: a chain), the drafter's proposal (None: a plain
    step).  Returns (k, source, shape, draft)."""
    k, source = 0, ""
    if drafter is not None and limit > 0:
        source, k = plan(drafter, context, controller, limit)
    shape = None
    if tree is not None and k > 0:
        k = min(tree.depth or k, limit)
        nodes = min(tree.budget(k), target.max_context - len(context) - 1)
        # auto (no fixed depth): a controller that prices trees decides tree or chain; WxD: always a tree
        if tree.depth is None:
            nodes = controller.tree_nodes(k, nodes, source)
        shape = replace(tree, nodes=nodes) if nodes > k else None
    draft = propose(drafter, context, k, source, shape) if drafter is not None and k > 0 else None
    return k, source, shape, draft


def _after_forced(forced: list[int], draft: Draft | None) -> Draft:
    """The step's draft: the `forced` tokens, then the drafter's chain after them (a q's rows for the forced
    tokens one-hot: a deterministic proposal, as Draft's q None is)."""
    if draft is None or not draft.tokens:
        return Draft(list(forced), synced=draft.synced if draft is not None else 0)
    q = None
    if draft.q is not None:
        q = torch.zeros(len(forced) + len(draft.tokens), draft.q.shape[-1], dtype=draft.q.dtype)  # [f + k, V]
        q[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
        q[len(forced):] = draft.q
    return Draft([*forced, *draft.tokens], q, draft.synced)


def _plain_step(target: ModelRunner, verifier: Verifier, drafter: Drafter | None, context: list[int],
                shaping: Shaping) -> list[int]:
    """A step with nothing drafted: one forward over the pending token; returns the token it gives."""
    logits = target.forward([context[-1]])  # [1, V]
    new = [verifier.choose(shaping.process([[]], logits)[-1])]
    shaping.record(logits, [0], new)
    if drafter is not None:
        drafter.target_logits(context[-1:], logits)
        drafter.plain_step(context)
    return new


def verify_chain(target: ModelRunner, verifier: Verifier, draft: Draft, pending: int, k: int,
                 drafter: Drafter | None = None, shaping: Shaping | None = None) -> tuple[int, int, list[int]]:
    """One chain step (a chain asked for at most k long): the target's forward over [pending, *draft]
    (whose raw logits `drafter` hears: Drafter.target_logits), verification (Verifier.verify) of the rows
    `shaping` processed (row i after draft[:i]), the target's cache cut to pending and the accepted tokens.
    Returns
    (the draft's length, how many of its tokens were accepted, the tokens emitted: those and the next)."""
    if len(draft.tokens) > k:
        raise ValueError(f"the drafter proposed {len(draft.tokens)} tokens where {k} were asked for")
    k = len(draft.tokens)
    cached = len(target.tokens)
    fed = [pending, *draft.tokens]
    logits = target.forward(fed)  # [k+1, V]
    if drafter is not None:
        drafter.target_logits(fed, logits)
    scored = logits if shaping is None else shaping.process([draft.tokens[:i] for i in range(k + 1)], logits)
    verdict = verifier.verify(draft, scored)
    n = verdict.num_accepted
    target.rollback(cached + 1 + n)  # keep pending + the accepted draft tokens
    new = draft.tokens[:n] + [verdict.next_token]
    if shaping is not None:
        shaping.record(logits, range(n + 1), new)  # row i chose token i
    return k, n, new


def verify_tree(target: ModelRunner, verifier: Verifier, draft: Draft, pending: int, k: int, nodes: int,
                drafter: Drafter | None = None, shaping: Shaping | None = None) -> tuple[int, list[int], int]:
    """One tree step (a tree asked for at most k deep, `nodes` tokens): the target's forward over
    [pending, *tree] with tree attention (whose logits `drafter` hears, row by row), verification
    (Verifier.verify_tree), the target's cache cut to the accepted path.  Returns (the tree's depth, the
    tokens emitted: the accepted path's and the next, how many more the tree accepted than its first branch
    alone: the chain 0, 1, .. the drafters put first)."""
    assert draft.parents is not None
    depth = max(depths(draft.parents)) + 1  # tokens on the longest path
    if len(draft.tokens) > nodes or depth > k:
        raise ValueError(f"the drafter proposed a tree of {len(draft.tokens)} tokens, {depth} deep, "
                         f"where at most {nodes} tokens, {k} deep were asked for")
    cached = len(target.tokens)
    fed = [pending, *draft.tokens]
    logits = target.forward_tree(fed, [-1, *(p + 1 for p in draft.parents)])  # [nodes + 1, V]
    if drafter is not None:
        drafter.target_logits(fed, logits)
    scored = logits if shaping is None else shaping.process(tree_paths(draft.tokens, draft.parents), logits)
    verdict = verifier.verify_tree(draft, scored)
    target.keep_rows(cached, [0, *(i + 1 for i in verdict.path)])  # pending + the accepted path
    if shaping is not None:  # the accepted path's rows chose its tokens, the last one's row the next token
        shaping.record(logits, [0, *(i + 1 for i in verdict.path)],
                       [draft.tokens[i] for i in verdict.path] + [verdict.next_token])
    on_chain = 0
    while on_chain < len(verdict.path) and verdict.path[on_chain] == on_chain and draft.parents[on_chain] == on_chain - 1:
        on_chain += 1
    return depth, [draft.tokens[i] for i in verdict.path] + [verdict.next_token], verdict.num_accepted - on_chain


def tree_paths(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """The prefix of each row of a tree's verification: [] for the pending token's row, then for node i the
    tokens on the path from the root to it, itself included (parents[i]: its parent node, -1 the root)."""
    paths: list[list[int]] = []
    for i, token in enumerate(tokens):
        paths.append((paths[parents[i]] if parents[i] >= 0 else []) + [token])  # parents come before children
    return [[], *paths]


def collect(steps: Iterable[Step]) -> Output:
    """Run a stream of steps to the end and gather its tokens and its totals."""
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    stats = Stats()
    step = None
    for step in steps:
        tokens.extend(step.tokens)
        logprobs.extend(step.logprobs)
        stats.add(step)
    if step is None or step.finish_reason is None:
        raise RuntimeError("the decode loop ended without a finish reason")
    return Output(tokens, step.finish_reason, stats, logprobs)


def run(*args, **kwargs) -> Output:
    """:func:`decode` to the end; same arguments."""
    return collect(decode(*args, **kwargs))
