"""The draft head as a drafter (specdec.algorithm.draft.Drafter): proposals read off the target's own features.

A head drafts from pairs (f_t, x_{t+1}): the target's final hidden state at position t and the token
after it (specdec.head.model).  The target runner hands out the hidden states of the positions whose
logits its last forward returned (``hidden()``), and of a forward's last few rows when asked
(``keep_hidden_rows`` / ``hidden_tail()``), so after each step the head learns the features of the
positions the target has just verified, at no cost:

- after the prefill (the loop asks for the last row's logits only): the prompt's last ``window``
  positions (default 64, the training window).  The drafter asks the runner to keep that many rows at
  ``reset`` (the loop resets the drafter before its prefill; the setting stays with the runner, and
  costs the final norm of those rows in each forward that returns fewer logits, the prefill); the loop
  tells it the prefill has run (``prefilled``, Drafter.prefilled) and it keeps the
  rows then, before another drafter's step may replace them;
- after a verification of k tokens with n accepted, this drafter's or (in a hybrid) a lookup's: the
  pending token's and the n accepted tokens' positions, the first n + 1 rows (the rows after them are
  of rejected tokens); ``observe`` keeps them, since a plain step may come before the next proposal;
- after a plain step: the one position it computed (``plain_step``, Drafter.plain_step).

So the head sees the feature of every position the target verifies; until it drafts again it keeps
the last ``window`` of them.  A head that fuses the target's intermediate layers (``taps``,
specdec.head.model.DraftHead.fused) has the runner keep those layers' rows too (``tap_layers``, at
``reset``): a feature below is then [F], the final hidden state followed by the tapped layers' outputs.

Before each proposal the head's own KV cache is rolled back to the longest prefix whose tokens still
match the context and fed the new pairs, the last one being (f of the last position the target has
cached, the pending token).  At a request's first proposal that is the prompt's last ``window`` pairs
(the last one's token the first generated token), fed in one head forward: the head starts, as it
was trained, with up to a window of past pairs, as EAGLE runs its head over the prompt's features.
Where the features of some positions were never seen (the prompt before its last ``window``
positions, the positions of more than a window of steps it did not draft, a prompt's part taken from
the target's cache: specdec.algorithm.loop's reuse_prefix), the head's cache starts over at the first position
whose feature it has: its attention then sees its own past from there on (a head trained on windows
that start anywhere drafts from a short past as it was trained to).  When no feature of the last
cached position can be known (a loop that does not report plain steps or verifications to it), the
head proposes nothing and the loop takes a plain step, whose row it reads next time.

Grades (``grade``, specdec.algorithm.control.grade): before the controller chooses k it is told how sure the head
is of its first token -- the top probability of the head's draft softmax, in CONFIDENCE_GRADES -- and
keeps acceptance per grade, so it drafts where the head is sure and takes plain steps where it is
not, where one rate for all of the head's proposals drafted both alike.  Grading is the draft's first
head forward (the feed of the new pairs); the proposal that follows reuses it, so a step feeds the
head once whether it drafts or not.

Greedy: the head's argmax (q None).  Sampling: q = the warped head distribution over the target's
vocabulary, zero outside the draft vocabulary (the head's logits placed at their target ids, -inf
elsewhere, then the target's temperature / top-k / top-p), as the draft model's q is; a token is
sampled from q and returned with it, so verification stays lossless.  What the head proposes never
changes the output: the loop verifies every token.

Trees (``propose_tree``, greedy only): EAGLE-2's dynamic draft tree (Li et al. 2024, "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees", arXiv 2406.16858), grown by DraftHead.expand
with one head forward per level (as many as a chain of the same depth), its best path first: the greedy
chain, all of it by default (``keep_chain``; without it as far as pure EAGLE-2 ranking kept it), so the
controller's count of a tree's gain over its first branch (specdec.algorithm.loop.verify_tree) is its gain over the chain.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.algorithm.draft import Draft, Drafter
from specdec.algorithm.sampling import SamplingParams, make_generator, sample_from, warp_probs
from specdec.backends.base import ModelRunner, common_prefix_length
from specdec.errors import SpecdecError
from specdec.head.fast import FastHead
from specdec.head.model import DraftHead, HeadCache

WINDOW = 64  # the prompt's positions whose features seed the head: specdec.training.train's default window

# The grades of a head's proposal (HeadDrafter.grade): its draft softmax's top probability for the first
# token, at least each bound (the controller keeps acceptance per grade, specdec.algorithm.control).
CONFIDENCE_GRADES = (0.8, 0.5, 0.2, 0.0)


def confidence_grade(top: float) -> str:
    """The grade of a proposal whose first token the head gave probability `top`: "q>=0.8", ..., "q>=0"."""
    return f"q>={next((bound for bound in CONFIDENCE_GRADES if top >= bound), 0.0):g}"  # NaN: the lowest


class HeadDrafter(Drafter):
    """Proposes k tokens with a draft head over `target`'s hidden states (see the module docstring)."""

    def __init__(self, head: DraftHead | FastHead, target: ModelRunner, sampling: SamplingParams | None = None,
                 window: int = WINDOW, keep_chain: bool = True) -> None:
        if window < 1:
            raise SpecdecError(f"a draft head's prompt window must be at least 1 position, got {window}")
        self.window = window  # the prompt's last positions whose features seed the head's cache
        self.keep_chain = keep_chain  # trees hold the whole greedy chain (DraftHead.expand)
        if not target.capabilities.hidden_states:
            raise SpecdecError(f"a draft head reads the target's hidden states, which a {target.describe()} "
                               "target does not give: use another draft")
        if head.taps and not target.capabilities.taps:
            raise SpecdecError(f"this draft head reads the target's layers {list(head.taps)}, whose rows a "
                               f"{target.describe()} target does not keep: use another draft")
        if int(head.vocab.max()) >= target.vocab_size:
            raise SpecdecError(f"the draft head's vocabulary has ids up to {int(head.vocab.max())}, "
                               f"beyond the target's {target.vocab_size}: it was trained for another target")
        self.head, self.target = head.eval(), target
        self.params = sampling or SamplingParams()
        self.generator = make_generator(self.params.seed, stream=1)
        self.reset()

    def reset(self) -> None:
        self.cache = HeadCache()
        self.base = 0  # context position t of the cache's first pair (f_t, x_{t+1})
        self.fed: list[int] = []  # x_{t+1} of each pair in the cache
        self.rows: torch.Tensor | None = None  # [m, F]: features of verified positions not fed yet ...
        self.rows_at = 0  # ... from this position on
        # (len(context), (feature [H], logits [N], pairs fed)): the feed _start() made for that context
        self._fed_for: tuple[int, tuple[torch.Tensor, torch.Tensor, int]] | None = None
        self.target.keep_hidden_rows(self.window)  # before the loop's prefill: its last rows' features
        if self.target.capabilities.taps:  # each row then carries this head's tapped layers' outputs, or none:
            self.target.tap_layers(self.head.taps)  # [.., F] (and a runner another head tapped before is set back)

    def prefilled(self, prompt: Sequence[int]) -> None:
        """The target has just run the prefill of `prompt`: keep the features of its last `window` positions
        (the first pairs to feed), before another forward replaces them."""
        tail = self.target.hidden_tail()[-self.window:]  # [m, H]: positions len(prompt) - m ..
        self.rows, self.rows_at = tail.clone(), len(prompt) - len(tail)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Keep the features of the pending token and the accepted draft tokens: rows 0..num_accepted of
        the verification's, whichever drafter proposed (a hybrid's lookup too; a plain step may run before
        the next proposal)."""
        rows = self.target.hidden()  # [k + 1, H] (a tree's: its kept path's)
        if rows.shape[0] > num_accepted:
            self._keep(rows[: num_accepted + 1], len(context) - 1)

    def plain_step(self, context: Sequence[int]) -> None:
        """The target has just run a plain step on the pending token (Drafter.plain_step):
        keep its position's feature, so that plain steps in a row lose none."""
        self._keep(self.target.hidden()[-1:], len(context) - 1)

    def _keep(self, rows: torch.Tensor, at: int) -> None:
        """Features [m, H] of positions at.. verified just now: after the unfed ones kept so far where they
        meet, else in their place."""
        end = at + len(rows)  # the first position after them
        if self.rows is not None and self.rows_at + len(self.rows) == at:
            rows = torch.cat([self.rows, rows])  # a copy: the runner's rows are replaced by its next forward
        else:
            rows = rows.clone()
        rows = rows[-self.window:]  # [<= window, H]: a head that drafted from none of them starts over
        self.rows, self.rows_at = rows, end - len(rows)

    def known(self, context: Sequence[int]) -> tuple[torch.Tensor, int] | None:
        """(features [m, H], s): the features of positions s..len(context) - 2 that the head may still
        need, ending at the last position the target has cached; None when that one is unknown."""
        end = len(context) - 1  # the target caches positions < end; context[end] is pending
        if self.rows is not None and self.rows_at + len(self.rows) == end:
            return self.rows, self.rows_at
        try:
            last = self.target.hidden()  # [r, H]
        except RuntimeError:
            return None
        if last.shape[0] != 1:
            return None  # another drafter's verification: which rows were accepted is unknown here
        # A one-row forward (a plain step, the prefill's last row) is never rolled back: position end - 1.
        if self.rows is not None and self.rows_at + len(self.rows) == end - 1:
            return torch.cat([self.rows, last]), self.rows_at
        return last, end - 1

    def sync(self, context: Sequence[int]) -> tuple[torch.Tensor, list[int]] | None:
        """Roll the head's cache back to what still matches `context`; the new pairs to feed it
        (features [n, H], tokens [n]), at least one; None when the head cannot draft now."""
        known = self.known(context)
        if known is None:
            return None
        rows, start = known
        end = start + len(rows)
        keep = self.base + common_prefix_length(self.fed, context[self.base + 1:])  # first position to feed
        at = min(keep, end - 1)  # feed at least the last pair
        if at < start or at < self.base:  # positions whose features are lost: start over
            self.cache, self.base, self.fed, at = HeadCache(), start, [], start
        self.cache.crop(at - self.base)
        del self.fed[at - self.base:]
        self.rows = None
        return rows[at - start:], list(context[at + 1: end + 1])

    def _sample(self, qs: list[torch.Tensor]):
        """A choice for DraftHead.draft that samples from the warped head distribution, keeping q."""
        width = self.target.vocab_size

        def choose(logits: torch.Tensor) -> torch.Tensor:  # [N] -> [] target id
            full = logits.new_full((width,), float("-inf")).index_copy(0, self.head.vocab, logits)  # [V]
            q = warp_probs(full, self.params)  # [V]
            qs.append(q)
            return torch.tensor(sample_from(q, self.generator))

        return choose

    def _pairs(self, context: Sequence[int], k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Sync the head with `context` before drafting k tokens -> the new pairs to feed it (features
        [n, H], tokens [n]), or None when the head cannot draft now."""
        pairs = self.sync(context) if context and k > 0 else None
        if pairs is None:
            return None
        features, tokens = pairs
        if features.shape[-1] != self.head.width:
            raise SpecdecError(f"the draft head reads features of size {self.head.width}, the "
                               f"target gives {features.shape[-1]}: it was trained for another target")
        self.fed.extend(tokens)
        return features, torch.tensor(tokens)

    def _start(self, context: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Feed the head the new pairs of `context` (once: grade() and the proposal after it share the feed)
        -> (its predicted feature [H] and draft logits [N] after the last pair, the number of pairs fed),
        or None when the head cannot draft now."""
        start = self._fed_for
        if start is not None and start[0] == len(context) and self.fed == list(context[self.base + 1:]):
            return start[1]
        pairs = self._pairs(context, 1) if context else None
        if pairs is None:
            return None
        feature, logits = self.head.extend(self.cache, *pairs)  # [H], [N]
        self._fed_for = (len(context), (feature, logits, len(pairs[1])))
        return self._fed_for[1]

    def grade(self, context: Sequence[int], source: str) -> str | None:
        """The head's confidence in its first draft token for `context` (Drafter.grade): the top
        probability of its draft softmax, in CONFIDENCE_GRADES.  Computing it is the draft's first head
        forward, which the proposal then reuses; None when the head cannot draft now."""
        start = self._start(context)
        if start is None:
            return None
        return confidence_grade(float(torch.softmax(start[1].float(), dim=-1).max()))

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Draft:
        qs: list[torch.Tensor] = []
        start = self._start(context) if k > 0 else None
        if start is None:
            return Draft([])
        feature, logits, fed = start
        self._fed_for = None  # drafting again from this context feeds its last pair again
        proposed = self.head.draft_from(self.cache, feature, logits, k,
                                        None if self.params.greedy else self._sample(qs))
        return Draft(proposed, torch.stack(qs) if qs else None, fed)  # q: [k, V_target]

    def propose_tree(self, context: Sequence[int], k: int, width: int, nodes: int,
                     source: str | None = None) -> Draft:
        """EAGLE-2's dynamic tree (DraftHead.expand: k levels, the `width` best nodes of each expanded into
        their `width` likeliest children, the `nodes` best kept), its best path first: the greedy chain as
        far as the tree kept it (all k tokens with keep_chain).  A sampled draft stays a chain."""
        if not self.params.greedy:
            return self.propose(context, k)
        start = self._start(context) if k > 0 else None
        if start is None:
            return Draft([])
        feature, logits, fed = start
        self._fed_for = None
        tokens, parents, _ = self.head.expand(self.cache, None, None, k, width, nodes, self.keep_chain,
                                              (feature, logits))
        draft = Draft(tokens, None, fed, parents)
        return draft if draft.is_tree else Draft(tokens, None, fed)
