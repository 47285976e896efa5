"""Draft-model drafter: a smaller model with the target's tokenizer proposes tokens.

The draft model keeps its own KV cache (a ModelRunner).  Before each proposal
its cache is synchronised with the context by rolling back to the longest
common prefix and feeding what is new — typically the recovered/bonus token of
the last step — so rejected draft tokens are forgotten (Leviathan et al. 2023;
Chen et al. 2023).

Greedy: the draft proposes its argmax (q = None, verified as one-hot).
Sampling: the draft samples from q = warp(draft logits) with the same
temperature / top-k / top-p as the target and returns q for verification.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.backends.base import ModelRunner, common_prefix_length
from specdec.drafters.base import Draft
from specdec.sampling import SamplingParams, make_generator, sample_from, warp_probs


class ModelDrafter:
    """Proposes k tokens autoregressively with a draft model of the same vocabulary."""

    def __init__(
        self,
        runner: ModelRunner,
        params: SamplingParams | None = None,
        target_vocab_size: int | None = None,
    ) -> None:
        self.runner = runner
        self.params = params or SamplingParams()
        self.generator = make_generator(self.params.seed, stream=1)
        # Vocabularies may differ only by padding rows (e.g. 151936 vs 152064):
        # logits are cut or padded to the target's width so ids and q line up.
        self.target_vocab_size = target_vocab_size or runner.vocab_size

    def _to_target_width(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V_draft] -> [V_target]; padding ids the draft lacks get -inf."""
        width = self.target_vocab_size
        if logits.shape[-1] >= width:
            return logits[..., :width]
        pad = logits.new_full((*logits.shape[:-1], width - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        k = min(k, self.runner.max_context - len(context))  # room left in the draft's window
        # Sync the cache with the context: keep the common prefix, but at least
        # one token to feed, since we need the logits after the context.
        keep = min(common_prefix_length(self.runner.tokens, context), len(context) - 1)
        fresh = context[keep:]
        if k <= 0 or max(fresh) >= self.runner.vocab_size:
            # Out of room, or the target emitted an id the (narrower) draft
            # cannot embed: no draft this step; the loop decodes plainly.
            return Draft([])
        self.runner.rollback(keep)
        logits = self.runner.forward(fresh, last_n=1)[-1]  # [V_draft]
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            logits = self._to_target_width(logits)  # [V]
            if self.params.greedy:
                token = int(logits.argmax())
            else:
                q = warp_probs(logits, self.params)  # [V]
                token = sample_from(q, self.generator)
                qs.append(q)
            tokens.append(token)
            if i < k - 1:  # the last draft token need not be fed: nobody reads logits after it yet
                logits = self.runner.forward([token])[-1]
        return Draft(tokens, torch.stack(qs) if qs else None)  # q: [k, V] or None

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Nothing to learn; the cache is re-synchronised at the next proposal."""

    def reset(self) -> None:
        self.runner.reset()
