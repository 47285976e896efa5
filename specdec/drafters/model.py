"""Draft-model drafter: a smaller model with the target's tokenizer proposes tokens.

The draft model keeps its own KV cache (a ModelRunner).  Before each proposal
its cache is synchronised with the context by rolling back to the longest
common prefix and feeding what is new — typically the recovered/bonus token of
the last step — so rejected draft tokens are forgotten (Leviathan et al. 2023;
Chen et al. 2023).

At a generation's first draft the draft model reads the whole prompt (one
batched prefill, bounded only by its own context window): a draft that sees the
function signature or the document it is asked about proposes what the target
will write far more often than one that sees only the prompt's tail (measured
in BENCHMARKS.md).  Later catch-ups feed what the draft missed (the tokens of
the plain steps the speculation controller chose), never starting over.  Each
is a batched forward whose cost the controller prices before it drafts (see
specdec.algorithm.control: a catch-up is paid once, not per drafted token), so where a
prefill of the prompt costs more than drafting would save, the controller
drafts from prompt lookup or decodes plainly instead.  An optional `window`
bounds catch-ups the old way: a draft more than `window` tokens behind starts
over from the context's last `window` tokens.  A new generation keeps what the
draft's cache holds of its prompt (an earlier turn of the same conversation, a
shared system prompt) and reads only the rest.  What the draft sees never
changes the output: verification decides.

Greedy: the draft proposes its argmax (q = None, verified as one-hot).
Sampling: the draft samples from q = warp(draft logits) with the same
temperature / top-k / top-p as the target and returns q for verification --
or, where its runner drafts a greedy chain in one native call, proposes that
chain (q = None: each token accepted with the target's probability of it, the
residual p without it on a rejection; Leviathan et al.'s rule with a one-hot q,
exact for any proposal).  `draft_sampling` chooses; "auto" (the default) takes
the chain where the runner has one: on the built-in set at T 0.7 / top-p 0.9
(Zen 4, three seeds) the 0.5B's chain was right as often as its samples (49-51%
of drafted tokens), with no Python, warp or draw between its tokens, and each
seed's answers decoded 2-7% faster (BENCHMARKS.md, sampled).

A draft whose head is trimmed to part of the vocabulary (FR-Spec, Zhao et al. 2025; specdec.drafters.draft_vocab:
its runner's logits are [N] over specdec.backends.base.logit_ids) proposes among those tokens only: greedy,
the argmax over them; sampling, q = warp(its logits) over them and 0 at every other id.  Still lossless:
the standard rule is exact for any q, and a token outside the set is simply never proposed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.algorithm.draft import Draft, Drafter
from specdec.algorithm.sampling import SamplingParams, make_generator, sample_from, warp_probs
from specdec.backends.base import ModelRunner, common_prefix_length, forward_chunked, logit_ids, trimmable
from specdec.drafters.tree import alternatives, tree_draft

# What a drafter does with the draft model's logits [V_draft] at one position:
# (draft id to feed back to the draft model, proposed id in the target's
# vocabulary, q row [V_target] the proposal was sampled from or None).
Choice = tuple[int, int, "torch.Tensor | None"]


DEFAULT_WINDOW: int | None = None  # catch-ups unbounded: the draft reads the whole prompt
# How a sampled request's draft model proposes (module doc): "sample" x ~ q; "greedy" its argmax chain (q = None);
# "auto" the chain where its runner drafts one natively (Capabilities.draft_chain), else samples
DRAFT_SAMPLING = ("auto", "sample", "greedy")
DRAFT_ROOM = 16  # positions kept free in the draft's own context window for the tokens it drafts
NATIVE_FEED = 64  # a native greedy chain feeds at most this many catch-up tokens itself (more: chunked forwards first)


class DraftCache:
    """Which part of the context a draft model's cache holds: context[offset:] up to a common prefix.

    The cache follows the context from `offset` on: 0, the whole context, unless the context outgrows
    the draft's own window (then its last (max_context - DRAFT_ROOM) / 2 tokens, so that a restart is
    rare), or, with a `window`, when the draft would have to catch up on more than `window` tokens
    (then it starts over from the context's last `window` tokens).  Works in the draft model's ids
    (the universal drafter passes its re-tokenised context).
    """

    def __init__(self, runner: ModelRunner, window: int | None = DEFAULT_WINDOW) -> None:
        if window is not None and window < 1:
            raise ValueError(f"the catch-up window must be >= 1, got {window}")
        self.runner = runner
        self.window = window
        self.offset = 0

    def plan(self, context: Sequence[int]) -> tuple[int, int]:
        """(offset, keep): the view context[offset:] the cache will follow, and how much of the
        cache it keeps (at least one token is fed, for the logits after the context)."""
        offset = min(self.offset, len(context) - 1)
        room = max(self.runner.max_context - DRAFT_ROOM, 1)
        if len(context) - offset > room:  # outgrew the draft's window: start over from the last half of it
            return len(context) - max(room // 2, 1), 0
        view = context[offset:]
        keep = min(common_prefix_length(self.runner.tokens, view), len(view) - 1)
        if self.window is not None and len(view) - keep > self.window:
            return len(context) - self.window, 0  # too far behind: start over from a window
        return offset, keep

    def lag(self, context: Sequence[int]) -> int:
        """Context tokens the next proposal will feed the draft model before drafting."""
        if not context:
            return 0
        offset, keep = self.plan(context)
        return len(context) - offset - keep

    def reset(self) -> None:
        """A new generation: the cache keeps what it holds where it follows the context from its start
        (plan() then keeps the common prefix with the new context -- an earlier turn of the conversation,
        a shared system prompt -- and feeds the rest); one that followed a later view starts empty."""
        if self.offset:
            self.runner.reset()
        self.offset = 0


def widened(logits: torch.Tensor, ids: torch.Tensor, width: int) -> torch.Tensor:
    """Logits over vocabulary ids `ids` [..., N] -> [..., width]: -inf at every other id (a trimmed head's)."""
    full = logits.new_full((*logits.shape[:-1], width), float("-inf"))
    return full.index_copy_(-1, ids, logits)


def run_draft_model(
    cache: DraftCache,
    context: Sequence[int],
    k: int,
    choose: Callable[[torch.Tensor], Choice] | None,
    confidence: float | None = None,
    trimmed: bool = False,
) -> tuple[list[int], torch.Tensor | None, int]:
    """Sync the draft model's cache with `context` (draft ids), then draft up to k tokens.

    The cache keeps the longest common prefix with its view of the context (see DraftCache);
    rejected tokens of the last step are dropped there.  Returns the proposed ids, q [k, V] (None
    when the choices carry no q) and how many context tokens were fed to catch up.  No proposal
    when the window is full or the context holds an id the draft cannot embed.  confidence: stop
    drafting after a token the draft model gave less than this probability (the draft's own
    softmax; the token is still proposed): an optional early stop, as transformers'
    assistant_confidence_threshold.  Where to stop never changes what verification accepts.
    choose gets the draft's logits [V_draft]; where its runner's head is trimmed (logit_ids), those
    over the trimmed ids [N] as they are with trimmed=True, else widened to [V_draft] (-inf elsewhere).
    choose None: the draft's own greedy chain in one native call (runner.draft_greedy, Capabilities.draft_chain:
    the argmax of each last row over its head's ids, as a greedy `choose` takes it, with no Python between the
    drafted tokens).
    """
    runner = cache.runner
    ids = logit_ids(runner)
    if ids is not None and not trimmed and choose is not None:
        given = choose
        choose = lambda logits: given(widened(logits, ids, runner.vocab_size))  # noqa: E731
    if not context:
        return [], None, 0
    offset, keep = cache.plan(context)
    view = context[offset:]
    k = min(k, runner.max_context - len(view))  # room left in the draft's window
    fresh = list(view[keep:])
    if k <= 0 or not fresh or max(fresh) >= runner.vocab_size or min(fresh) < 0:
        return [], None, 0
    cache.offset = offset
    runner.rollback(keep)
    if choose is None:
        if len(fresh) > NATIVE_FEED:  # a long catch-up in chunks first (bounded memory), then the chain
            forward_chunked(runner, fresh[:-1], last_n=1)
        return runner.draft_greedy(fresh[-1:] if len(fresh) > NATIVE_FEED else fresh, k), None, len(fresh)
    logits = forward_chunked(runner, fresh, last_n=1)[-1]  # [V_draft]: a long catch-up in chunks
    proposed: list[int] = []
    qs: list[torch.Tensor] = []
    for i in range(k):
        feed, token, q = choose(logits)
        proposed.append(token)
        if q is not None:
            qs.append(q)
        if confidence is not None and _probability(logits, feed, ids) < confidence:
            break  # the draft doubts this token: the ones after it would be likelier still to fail
        if i < k - 1:  # the last draft token need not be fed: nobody reads logits after it yet
            logits = runner.forward([feed])[-1]
    return proposed, torch.stack(qs) if qs else None, len(fresh)  # q: [k, V_target]


def _probability(logits: torch.Tensor, token: int, ids: torch.Tensor | None) -> float:
    """The draft's own probability of `token` (a draft id): softmax of its logits [V_draft], or of those over
    the trimmed ids [N] (0 for a token outside them)."""
    probs = torch.softmax(logits.float(), dim=-1)
    if ids is None:
        return float(probs[token])
    column = torch.nonzero(ids == token)
    return float(probs[int(column[0, 0])]) if column.numel() else 0.0


class ModelDrafter(Drafter):
    """Proposes k tokens autoregressively with a draft model of the same vocabulary."""

    def __init__(
        self,
        runner: ModelRunner,
        params: SamplingParams | None = None,
        target_vocab_size: int | None = None,
        window: int | None = DEFAULT_WINDOW,
        confidence: float | None = None,
        draft_sampling: str = "auto",
    ) -> None:
        if confidence is not None and not 0 < confidence < 1:
            raise ValueError(f"a draft confidence threshold must be in (0, 1), got {confidence}")
        if draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, got {draft_sampling!r}")
        self.runner = runner
        self.cache = DraftCache(runner, window)
        self.confidence = confidence  # stop drafting after a token the draft gave less (None: never)
        self.params = params or SamplingParams()
        self.generator = make_generator(self.params.seed, stream=1)
        # Vocabularies may differ only by padding rows (e.g. 151936 vs 152064):
        # logits are cut or padded to the target's width so ids and q line up.
        self.target_vocab_size = target_vocab_size or runner.vocab_size
        # whether proposals are the draft's argmax (q = None): greedy requests, and sampled ones per draft_sampling
        self.argmax = self.params.greedy or draft_sampling == "greedy" or (draft_sampling == "auto" and self._chains())
        # A trimmed head (FR-Spec) also proposes the tokens of this request's context (_follow_context):
        self._context_ids: set[int] = set()  # every token of the context so far
        self._in_head: torch.Tensor | None = None  # [V_draft] bool: the ids the head's logits cover
        self._followed = 0  # context tokens looked at

    def _to_target_width(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V_draft] -> [V_target]; padding ids the draft lacks get -inf."""
        width = self.target_vocab_size
        if logits.shape[-1] >= width:
            return logits[..., :width]
        pad = logits.new_full((*logits.shape[:-1], width - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits as the runner gives them ([V_draft], or [N] over a trimmed head's ids) ->
        [V_target], -inf where the draft proposes nothing."""
        ids = logit_ids(self.runner)
        return self._to_target_width(logits if ids is None else widened(logits, ids, self.runner.vocab_size))

    def _choose(self, logits: torch.Tensor) -> Choice:
        ids = logit_ids(self.runner)
        if ids is not None and self.argmax:  # a trimmed head's argmax, no full-width row needed
            token = int(ids[int(logits.argmax())])
            if token < self.target_vocab_size:
                return token, token, None
        logits = self._full(logits)  # [V_target]
        if self.argmax:
            token = int(logits.argmax())
            return token, token, None
        q = warp_probs(logits, self.params)  # [V_target]
        token = sample_from(q, self.generator)
        return token, token, q

    def native(self) -> bool:
        """Whether a proposal is the runner's own greedy chain in one call (run_draft_model's choose None): an argmax
        draft (a greedy request, or a sampled one per draft_sampling) with no confidence stop, on a runner that
        drafts so, whose vocabulary is no wider than the target's
        (padding ids the draft lacks are -inf: an argmax over its own rows is the one over the target's width)."""
        return self.argmax and self._chains()

    def _chains(self) -> bool:
        """Whether the runner can draft this drafter's argmax chain in one native call (see native)."""
        return (self.confidence is None and self.runner.capabilities.draft_chain
                and self.runner.vocab_size <= self.target_vocab_size)

    def _follow_context(self, context: Sequence[int]) -> None:
        """Where the runner's head is trimmed to a set of tokens (specdec.drafters.draft_vocab): that set and every
        token of this request's context -- a prompt's tokens are likely in its answer (code, documents to
        summarize or answer from), and an answer repeats its own -- through LeanRunner.extend_head, once per new
        token outside them.  The first call replaces an earlier request's: what the head holds depends on this
        request's tokens alone."""
        head = trimmable(self.runner)
        if head is None or head.head_ids is None:
            return
        extend = head.extend_head
        if self._in_head is not None and len(context) <= self._followed:  # nothing new
            return
        fresh = [int(t) for t in context[self._followed :] if 0 <= int(t) < self.runner.vocab_size]
        self._followed = len(context)
        if self._in_head is not None and all(self._in_head[fresh].tolist()):
            return
        self._context_ids.update(fresh)
        extend(sorted(self._context_ids))
        ids = logit_ids(self.runner)
        assert ids is not None
        self._in_head = torch.zeros(self.runner.vocab_size, dtype=torch.bool)
        self._in_head[ids] = True

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Draft:
        self._follow_context(context)
        tokens, q, synced = run_draft_model(self.cache, context, k, None if self.native() else self._choose,
                                            self.confidence, trimmed=True)
        return Draft(tokens, q, synced)

    def propose_tree(self, context: Sequence[int], k: int, width: int, nodes: int,
                     source: str | None = None) -> Draft:
        """The greedy chain and the draft's runner-up tokens where it is least sure, as one tree
        (specdec.drafters.tree.alternatives: no extra draft forwards); a sampled draft stays a chain."""
        if not self.params.greedy:
            return self.propose(context, k)
        self._follow_context(context)
        rows: list[torch.Tensor] = []

        def choose(logits: torch.Tensor) -> Choice:
            rows.append(self._full(logits))  # [V_target]
            return self._choose(logits)

        tokens, _, synced = run_draft_model(self.cache, context, k, choose, self.confidence, trimmed=True)
        return tree_draft(alternatives(tokens, rows, width, nodes), width, nodes, synced)

    def lag(self, context: Sequence[int]) -> int:
        """Context tokens the next proposal feeds the draft model to catch up (see DraftCache)."""
        return self.cache.lag(context)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Nothing to learn; the cache is re-synchronised at the next proposal."""

    def reset(self) -> None:
        self.cache.reset()
        self._context_ids, self._in_head, self._followed = set(), None, 0
