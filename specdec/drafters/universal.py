"""Universal drafter: a draft model with a different tokenizer (universal assisted generation).

Each proposal re-expresses the target's context in the draft's tokens (through
text, see specdec.bridge.TextBridge), lets the draft model continue it, and
hands the target candidates in the target's own tokens.  Two modes:

- "text": the draft's continuation is carried over as text and re-tokenised
  for the target.  The candidates carry no q: verification is exact match
  under greedy decoding and the one-hot rule under sampling (accept x with
  probability p(x), else sample from p without x), which is lossless for any
  proposal.
- "intersection": the draft is restricted to the tokens both vocabularies
  share (specdec.bridge.VocabularyMap); each draft token *is* a target token,
  and its sampling distribution q maps onto the target's vocabulary, so the
  standard speculative-sampling rule applies with a real q (Timor et al. 2025).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.algorithm.draft import Draft, Drafter
from specdec.algorithm.sampling import SamplingParams, make_generator, sample_from, warp_probs
from specdec.backends.base import ModelRunner
from specdec.bridge import TextBridge, VocabularyMap
from specdec.drafters.model import DEFAULT_WINDOW, Choice, DraftCache, run_draft_model


class UniversalDrafter(Drafter):
    """Drafts with a model whose tokenizer differs from the target's.

    bridge: moves sequences between the two tokenizers through text.
    vocab_map: the shared vocabulary; given -> "intersection" mode, else "text".
    Build both once per model pair (the map takes seconds for large vocabularies).
    """

    def __init__(
        self,
        runner: ModelRunner,
        bridge: TextBridge,
        params: SamplingParams | None = None,
        vocab_map: VocabularyMap | None = None,
        window: int | None = DEFAULT_WINDOW,
        confidence: float | None = None,
    ) -> None:
        if confidence is not None and not 0 < confidence < 1:
            raise ValueError(f"a draft confidence threshold must be in (0, 1), got {confidence}")
        self.confidence = confidence  # stop drafting after a token the draft gave less (None: never)
        self.runner = runner
        self.cache = DraftCache(runner, window)  # in draft ids
        self._seen = 0  # target tokens of the context the draft has seen (approximately)
        self.bridge = bridge
        self.params = params or SamplingParams()
        self.vocab_map = vocab_map
        self.mode = "intersection" if vocab_map is not None else "text"
        self.generator = make_generator(self.params.seed, stream=1)

    def _choose_text(self, logits: torch.Tensor) -> Choice:
        """Any draft token; the proposal is carried over as text (q is not used)."""
        if self.params.greedy:
            token = int(logits.argmax())
        else:
            token = sample_from(warp_probs(logits, self.params), self.generator)
        return token, token, None

    def _choose_shared(self, logits: torch.Tensor) -> Choice:
        """A shared token, proposed as its target id with q mapped to the target's vocabulary."""
        vocab_map = self.vocab_map
        assert vocab_map is not None  # the intersection mode's chooser: it has a map
        shared = vocab_map.restrict(logits)  # [S]
        if self.params.greedy:
            j = int(shared.argmax())
            q = None
        else:
            q_shared = warp_probs(shared, self.params)  # [S]
            j = sample_from(q_shared, self.generator)
            q = vocab_map.to_target(q_shared)  # [V_target]
        return int(vocab_map.draft_ids[j]), int(vocab_map.target_ids[j]), q

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Draft:
        self._seen = len(context)
        draft_context = self.bridge.to_draft(context)
        if draft_context is None:  # the target is inside a multi-byte character
            return Draft([])
        if self.vocab_map is not None:
            tokens, q, synced = run_draft_model(self.cache, draft_context, k, self._choose_shared, self.confidence)
            return Draft(tokens, q, synced)
        proposal, _, synced = run_draft_model(self.cache, draft_context, k, self._choose_text, self.confidence)
        text = self.bridge.proposal_text(draft_context, proposal)
        return Draft(self.bridge.to_target(context, text)[:k], synced=synced)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Nothing to learn (the cache is re-synchronised at the next proposal); after its own proposal
        the accepted tokens are in the draft's cache already, which lag() counts (a hybrid reports its
        lookups' verifications too: their tokens are not)."""
        if self._seen == len(context):
            self._seen += num_accepted

    def lag(self, context: Sequence[int]) -> int:
        """About how many tokens the next proposal feeds the draft model to catch up: the target
        tokens it has not seen (re-tokenising the context to count draft tokens exactly costs more
        than the estimate is worth), at most the window."""
        lag = max(len(context) - self._seen, 1)
        return lag if self.cache.window is None else min(lag, self.cache.window)

    def reset(self) -> None:
        self.cache.reset()
        self._seen = 0
