"""An EAGLE-style draft head: one decoder layer of the target's architecture on the target's own features.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty",
arXiv 2401.15077) drafts at the feature level: at position t the head reads the target's final hidden
state f_t [H] together with the embedding of the token x_{t+1} that follows it, predicts the next
feature f_{t+1}, and reads the next token's distribution off that prediction; run autoregressively on
its own predictions it drafts k tokens.  Its output layer covers a reduced draft vocabulary, the N most
frequent target tokens of the training text, as EAGLE-3 (Li et al. 2025, arXiv 2503.01840) and FR-Spec
(Zhao et al. 2025, arXiv 2502.14856) do, so the head's LM head costs a fraction of the target's.

    concat(f_t [H], embed(x_{t+1}) [H]) -> fc [2H -> H] -> one decoder layer (attending over the
    head's own past states) -> final norm = predicted f_{t+1} [H] -> LM head [H -> N] -> draft logits

Features are the target's *post-norm* final hidden states (the LM head's input, as the runners'
``hidden()`` gives them); the head's own norm (initialised from the target's) ends its prediction, so
a predicted feature is fed back in the same form.  The embedding table is the target's own and frozen:
it is not part of the head's weights (the store checks it by checksum instead).

The decoder layer is transformers' own class for the target's architecture (llama and qwen2: biases,
norms and GQA exactly as the target has them), built from the target's config with one layer.  The
KV cache is a small one of our own (``HeadCache``: two tensors, cropped to roll back) that the layer
updates through the cache interface, with an explicit causal mask, so drafting never depends on
transformers' cache classes.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from specdec.errors import SpecdecError

ARCHITECTURES = ("llama", "qwen2")  # targets whose decoder layer the head reuses


class HeadCache:
    """The head's own KV cache: keys and values of the positions fed so far; crop() rolls it back."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [1, kv_heads, S, head_dim]
        self.values: torch.Tensor | None = None  # [1, kv_heads, S, head_dim]

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer's cache hook: append this forward's keys/values, return all of them."""
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        """Forget every position from `length` on."""
        if self.keys is not None and self.values is not None and length < self.length:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def causal_mask(queries: int, past: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, queries, past + queries]: query i sees the past and new positions <= i."""
    allowed = torch.ones(queries, past + queries, dtype=torch.bool).tril(diagonal=past)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def draft_vocabulary(streams: list[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent target ids of `streams` (ties and unseen ids by id): [N] draft id -> target id."""
    counts = torch.zeros(vocab_size, dtype=torch.long)  # [V]
    for stream in streams:
        counts += torch.bincount(torch.tensor(stream, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(order[: min(size, vocab_size)], dtype=torch.long)


class DraftHead(nn.Module):
    """The head of one target (a transformers llama/qwen2 causal LM); see the module docstring."""

    def __init__(self, target: nn.Module, vocab: torch.Tensor) -> None:
        super().__init__()
        config = copy.deepcopy(target.config)
        if config.model_type not in ARCHITECTURES:
            raise SpecdecError(f"a draft head needs a {' or '.join(ARCHITECTURES)} target, not {config.model_type}")
        config.num_hidden_layers = 1
        config._attn_implementation = "sdpa"
        hidden = config.hidden_size
        backbone = target.get_decoder()
        self.config = config
        self.register_buffer("vocab", vocab.clone().long())  # [N] draft id -> target id
        self.fc = nn.Linear(2 * hidden, hidden)
        self.layer = type(backbone.layers[0])(config, 0)
        self.norm = copy.deepcopy(backbone.norm)
        self.lm_head = nn.Linear(hidden, len(vocab), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(target.get_output_embeddings().weight[self.vocab])  # [N, H]
        # The target's frozen embedding table and rotary embedding: used, not owned (kept out of the state dict).
        self._shared = (target.get_input_embeddings(), backbone.rotary_emb)

    @property
    def embed(self) -> nn.Module:
        return self._shared[0]

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (same shape)."""
        return self.vocab[draft_ids]

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, start: int = 0,
                cache: HeadCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, T, H] (f_t), tokens [B, T] (target ids of x_{t+1}) at positions start..start+T-1
        -> (predicted features [B, T, H] (f_{t+1}), draft logits [B, T, N] (for x_{t+2}))."""
        batch, length = tokens.shape
        past = cache.length if cache is not None else 0
        with torch.no_grad():
            embedded = self.embed(tokens).to(features.dtype)  # [B, T, H], frozen
        x = self.fc(torch.cat([features, embedded], dim=-1))  # [B, T, H]
        positions = torch.arange(start, start + length).expand(batch, length)  # [B, T]
        rotary = self._shared[1](x, positions)  # (cos, sin), each [B, T, head_dim]
        out = self.layer(x, causal_mask(length, past, x.dtype), positions, cache, position_embeddings=rotary)
        predicted = self.norm(out[0] if isinstance(out, tuple) else out)  # [B, T, H]
        return predicted, self.lm_head(predicted)

    @torch.no_grad()
    def extend(self, cache: HeadCache, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed pairs (features [n, H], next tokens [n]) after the cache's positions
        -> the last position's (predicted feature [H], draft logits [N])."""
        predicted, logits = self(features[None], tokens[None], cache.length, cache)
        return predicted[0, -1], logits[0, -1]

    @torch.no_grad()
    def draft(self, cache: HeadCache, features: torch.Tensor, tokens: torch.Tensor, k: int,
              choose: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[int]:
        """Feed the new verified pairs (features [n, H], tokens [n]), draft k target ids autoregressively
        on the head's own predicted features, then roll the drafted positions back.  `choose`: draft
        logits [N] -> the target id [] to propose (default greedy: the argmax's target id).
        Needs at least one new pair (to re-draft from the same context, crop one position and feed it again)."""
        if len(tokens) < 1:
            raise ValueError("a draft needs at least one new (feature, token) pair")
        choose = choose or (lambda logits: self.target_ids(logits.argmax()))
        feature, logits = self.extend(cache, features, tokens)
        verified = cache.length
        out: list[int] = []
        for i in range(k):
            token = choose(logits)  # [] target id
            out.append(int(token))
            if i + 1 < k:
                feature, logits = self.extend(cache, feature[None], token[None])
        cache.crop(verified)
        return out
