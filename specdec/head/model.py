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

Trees (``grow`` / ``expand``): EAGLE-2's dynamic draft trees (Li et al. 2024, "EAGLE-2: Faster Inference
of Language Models with Dynamic Draft Trees", arXiv 2406.16858).  The tree grows level by level, one head
forward per level over the level's best nodes with a tree mask (``tree_mask``: each node sees the cache's
verified pairs, its ancestors and itself; its rotary position is that of its depth), so each node's
logits are those of the head's chain forward over its path; nodes are scored by the head's probability
of their whole path, and the best of the whole tree are kept (specdec.drafters.tree.rerank).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from specdec.drafters.tree import rerank
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


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """allowed [queries, keys] (bool) -> the additive mask [1, 1, queries, keys]: 0 where allowed, else min."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def band(queries: int, past: int, window: int | None = None) -> torch.Tensor:
    """Which keys each query sees, [queries, past + queries] (bool): query i, at position past + i, sees the
    positions up to its own, and with a `window` only the last `window` of them (itself included)."""
    allowed = torch.ones(queries, past + queries, dtype=torch.bool).tril(diagonal=past)
    if window is not None:
        allowed &= ~torch.ones(queries, past + queries, dtype=torch.bool).tril(diagonal=past - window)
    return allowed


def causal_mask(queries: int, past: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive mask [1, 1, queries, past + queries]: query i sees the past and new positions <= i (with a
    `window`, the last `window` of them)."""
    return additive_mask(band(queries, past, window), dtype)


def tree_mask(prefix: int, visible: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive mask [1, 1, q, prefix + t] of a tree forward: every query sees the cache's first `prefix`
    positions (the verified pairs), and of the t tree positions after them (the nodes fed by earlier levels,
    then this forward's q) those `visible` [q, t] (bool) allows: its ancestors and itself.  With a `window`,
    a query whose path holds c of the tree's positions sees only the last window - c verified pairs: the
    keys a chain forward over its path would see (causal_mask's band)."""
    seen = visible.new_ones(visible.shape[0], prefix)  # [q, prefix]
    if window is not None:
        keep = (window - visible.sum(dim=1)).clamp(min=0)  # [q]: verified pairs each query still sees
        seen = torch.arange(prefix)[None] >= (prefix - keep)[:, None]  # [q, prefix]
    return additive_mask(torch.cat([seen, visible], dim=1), dtype)


def head_intermediate(config: Any, ratio: float = 2 / 3) -> int:
    """The head's MLP width for a target config: `ratio` x its hidden size, a multiple of 64 (at least 64),
    at most the target's own.  Far narrower than the target's layer (8960 on a 1.5B of hidden size 1536;
    the head's 1024), it costs less to draft with and learns faster in a CPU's hour.  Measured on
    qwen2.5-coder-1.5b (Zen 4, 3 minutes of training on the same 57k positions of the target's answers,
    bf16): first-token agreement 0.41 at width 2048 against 0.28 at 8960 (teacher forcing only); with
    training-time test 0.34 at 1024 against 0.33 at 2048 on held-out answers, second token 0.49 / 0.45."""
    width = max(64, int(round(config.hidden_size * ratio / 64)) * 64)
    return min(width, int(config.intermediate_size))


def draft_vocabulary(streams: list[list[int]], size: int, vocab_size: int, text_share: float = 1.0) -> torch.Tensor:
    """The draft vocabulary, [N] draft id -> target id: the round(`text_share` x `size`) most frequent target
    ids of `streams` (ties and unseen ids by id), then the lowest ids not taken, up to `size`.

    Why ids: a BPE tokenizer numbers its tokens in merge order, and a merge is made when the pair is frequent
    in the tokenizer's own (broad, multilingual) corpus, so low ids are the tokens common in any text, where
    the training text here is mostly installed code and manuals.  Measured on qwen2.5-coder-1.5b's greedy
    answers to 79 chat prompts of all eight bench categories (64 tokens each), the share of answer tokens a
    16,384-token vocabulary covers: 0.847 by text frequency alone (translation 0.70: " September",
    " education", " salary" were missing), 0.874 by id alone, 0.883 with a quarter by frequency (translation
    0.84); 24,576 tokens cover 0.918 but cost the head's LM head half as much again."""
    counts = torch.zeros(vocab_size, dtype=torch.long)  # [V]
    for stream in streams:
        counts += torch.bincount(torch.tensor(stream, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    size = min(size, vocab_size)
    by_text = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))[: round(size * text_share)]
    taken = set(by_text)
    rest = (i for i in range(vocab_size) if i not in taken)
    return torch.tensor(by_text + [next(rest) for _ in range(size - len(by_text))], dtype=torch.long)


def fuse_features(features: torch.Tensor, hidden: int, taps: int,
                  project: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """DraftHead.fused for a head of `taps` tapped layers whose fuse projection is `project` ([.., taps H]
    -> [.., H]): features [.., H] as they are, [.., H (1 + taps)] -> final + project(RMS-normalised taps)."""
    if features.shape[-1] == hidden:
        return features
    if project is None or features.shape[-1] != hidden * (1 + taps):
        raise ValueError(f"features of width {features.shape[-1]}: this head reads {hidden}"
                         + (f" or {hidden * (1 + taps)}" if project is not None else ""))
    final, tapped = features[..., :hidden], features[..., hidden:].unflatten(-1, (taps, hidden))  # [.., H], [.., taps, H]
    tapped = tapped * torch.rsqrt(tapped.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(tapped.dtype)
    return final + project(tapped.flatten(-2))


class HeadDrafting:
    """The autoregressive draft and EAGLE-2's tree, over a head's extend, extend_tree and target_ids: the fp32
    head's (DraftHead) and its quantized inference form's (specdec.head.fast.FastHead) alike."""

    def extend(self, cache: HeadCache, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def extend_tree(self, cache: HeadCache, features: torch.Tensor, tokens: torch.Tensor, position: int,
                    visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def draft(self, cache: HeadCache, features: torch.Tensor, tokens: torch.Tensor, k: int,
              choose: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[int]:
        """Feed the new verified pairs (features [n, H], tokens [n]), draft k target ids autoregressively
        on the head's own predicted features, then roll the drafted positions back.  `choose`: draft
        logits [N] -> the target id [] to propose (default greedy: the argmax's target id).
        Needs at least one new pair (to re-draft from the same context, crop one position and feed it again)."""
        if len(tokens) < 1:
            raise ValueError("a draft needs at least one new (feature, token) pair")
        return self.draft_from(cache, *self.extend(cache, features, tokens), k, choose)

    @torch.no_grad()
    def draft_from(self, cache: HeadCache, feature: torch.Tensor, logits: torch.Tensor, k: int,
                   choose: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[int]:
        """draft() after its feed: from the last fed pair's (predicted feature [H], draft logits [N]), as
        extend() returned them for the cache as it is."""
        choose = choose or (lambda logits: self.target_ids(logits.argmax()))
        verified = cache.length
        out: list[int] = []
        for i in range(k):
            token = choose(logits)  # [] target id
            out.append(int(token))
            if i + 1 < k:
                feature, logits = self.extend(cache, feature[None], token[None])
        cache.crop(verified)
        return out

    @torch.no_grad()
    def grow(self, cache: HeadCache, features: torch.Tensor | None, tokens: torch.Tensor | None, depth: int,
             top_k: int, keep_chain: bool = False,
             start: tuple[torch.Tensor, torch.Tensor] | None = None) -> GrownTree:
        """EAGLE-2's expansion phase: feed the new verified pairs (features [n, H], tokens [n]) as draft()
        does, then grow a tree level by level, one head forward per level after the first, and roll the
        tree's positions back.  The root's `top_k` likeliest tokens are the first level; each later level
        feeds the `top_k` best nodes of the one before (by path score, the head's log probability of the
        whole path) in one forward with tree attention (each node sees the verified pairs, its ancestors
        and itself, at position verified + its depth - 1), and each of them proposes its `top_k` likeliest
        children.  `depth` levels: `depth` head forwards in all, as a chain of `depth` tokens costs.
        keep_chain: the greedy chain's node of each level is expanded even when it is not among the best
        (it then takes the place of the last of them), so the tree holds the whole greedy chain.
        `start`: the pairs were fed already (features and tokens None); extend()'s (predicted feature [H],
        draft logits [N]) for the cache as it is (draft_from's start)."""
        if start is None and (tokens is None or len(tokens) < 1):
            raise ValueError("a draft needs at least one new (feature, token) pair")
        if depth < 1 or top_k < 1:
            raise ValueError(f"a tree needs depth and top_k >= 1, got {depth} and {top_k}")
        if start is None:
            assert features is not None and tokens is not None  # the pairs to feed
            start = self.extend(cache, features, tokens)
        feature, logits = start  # [H], [N]
        verified = cache.length
        tree = GrownTree([], [], [], {-1: logits})
        predicted = {-1: feature}  # node -> the head's predicted feature after it [H]
        fed: list[int] = []  # the nodes whose pairs the cache holds after `verified`, in its order
        level = tree.add_children([-1], logits[None], top_k)
        tree.chain.append(level[0])
        for d in range(1, depth):  # expand the best nodes of depth d
            chosen = sorted(level, key=lambda i: (-tree.scores[i], i))[:top_k]
            if keep_chain and tree.chain[-1] not in chosen:
                chosen[-1] = tree.chain[-1]
            slot = {node: j for j, node in enumerate(fed)}
            visible = torch.zeros(len(chosen), len(fed) + len(chosen), dtype=torch.bool)  # [q, t]
            for row, node in enumerate(chosen):
                visible[row, len(fed) + row] = True
                ancestor = tree.parents[node]
                while ancestor >= 0:
                    visible[row, slot[ancestor]] = True
                    ancestor = tree.parents[ancestor]
            pairs = torch.stack([predicted[tree.parents[node]] for node in chosen])  # [q, H]
            ids = self.target_ids(torch.tensor([tree.tokens[node] for node in chosen]))  # [q]
            # depth d sits at position verified + d - 1: [q, H], [q, N]
            out, rows = self.extend_tree(cache, pairs, ids, verified + d - 1, visible)
            fed.extend(chosen)
            for row, node in enumerate(chosen):
                predicted[node], tree.logits[node] = out[row], rows[row]
            level = tree.add_children(chosen, rows, top_k)
            if tree.chain[-1] in chosen:
                tree.chain.append(next(c for c in level if tree.parents[c] == tree.chain[-1]))
        cache.crop(verified)
        tree.tokens = self.target_ids(torch.tensor(tree.tokens, dtype=torch.long)).tolist()
        return tree

    @torch.no_grad()
    def expand(self, cache: HeadCache, features: torch.Tensor | None, tokens: torch.Tensor | None, depth: int,
               top_k: int, nodes: int, keep_chain: bool = False,
               start: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[list[int], list[int], list[float]]:
        """An EAGLE-2 dynamic draft tree: grow() it, then rerank (specdec.drafters.tree.rerank): keep the
        `nodes` best nodes by path score, the best path first -> (target ids [n], parents [n] (-1: a child
        of the context's end, parents[i] < i), log path probabilities [n]).  The best path is the greedy
        chain as far as the tree kept it; keep_chain: the whole chain (up to `nodes` tokens), kept first
        whatever its scores, the rest of the budget for the best other nodes.  `start`: as grow()'s."""
        tree = self.grow(cache, features, tokens, min(depth, nodes), top_k, keep_chain, start)
        order, parents = rerank(tree.parents, tree.scores, nodes, tree.chain if keep_chain else ())
        return [tree.tokens[i] for i in order], parents, [tree.scores[i] for i in order]



class HeadTarget(Protocol):
    """What DraftHead's constructor reads of its target: a transformers causal LM, or a stand-in with its
    parts (specdec.head.store's, for an int8 target); what they return is transformers'."""

    @property
    def config(self) -> Any: ...

    def get_decoder(self) -> Any: ...

    def get_input_embeddings(self) -> Any: ...

    def get_output_embeddings(self) -> Any: ...


class DraftHead(HeadDrafting, nn.Module):
    """The head of one target (a transformers llama/qwen2 causal LM); see the module docstring."""

    vocab: torch.Tensor  # a buffer (nn.Module types what it holds as Tensor | Module): [N] draft id -> target id

    def __init__(self, target: HeadTarget, vocab: torch.Tensor, intermediate: int | None = None,
                 window: int | None = None, taps: tuple[int, ...] = ()) -> None:
        """`intermediate`: the decoder layer's MLP width (default the target's; see head_intermediate).
        `window`: the head attends to the last `window` positions only (itself included; None: all).
        `taps`: the target's layers whose outputs the verified pairs' features carry too (fused features,
        :meth:`fused`; () reads the final feature alone)."""
        super().__init__()
        self.window = window
        self.taps = tuple(int(i) for i in taps)
        config = copy.deepcopy(target.config)
        if config.model_type not in ARCHITECTURES:
            raise SpecdecError(f"a draft head needs a {' or '.join(ARCHITECTURES)} target, not {config.model_type}")
        config.num_hidden_layers = 1
        if intermediate is not None:
            config.intermediate_size = int(intermediate)
        config._attn_implementation = "sdpa"
        hidden = config.hidden_size
        backbone = target.get_decoder()
        self.config = config
        self.register_buffer("vocab", vocab.clone().long())  # [N] draft id -> target id
        self.fc = nn.Linear(2 * hidden, hidden)
        if self.taps:  # zero at first: a fused head starts as the head of the final feature alone
            self.fuse = nn.Linear(len(self.taps) * hidden, hidden, bias=False)
            nn.init.zeros_(self.fuse.weight)
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

    @property
    def width(self) -> int:
        """F, the width of a verified pair's feature: the hidden size H x (1 + the tapped layers)."""
        return self.config.hidden_size * (1 + len(self.taps))

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """features [.., F] of verified pairs (the final feature, then the tapped layers' outputs) or [.., H]
        (the head's own predicted features) -> [.., H]: the final feature plus a learnt projection of the
        tapped layers' outputs, each RMS-normalised first (a residual stream's scale grows with depth).
        EAGLE-3 (arXiv 2503.01840) fuses low, middle and high layers' features into the head's input, as the
        final layer's alone is shaped for the next token only."""
        return fuse_features(features, self.config.hidden_size, len(self.taps), self.fuse if self.taps else None)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (same shape)."""
        return self.vocab[draft_ids]

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, start: int = 0, cache: HeadCache | None = None,
                positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, T, H or F] (f_t; :meth:`fused`), tokens [B, T] (target ids of x_{t+1}) at positions
        start..start+T-1 -> (predicted features [B, T, H] (f_{t+1}), draft logits [B, T, N] (for x_{t+2})).
        A tree forward gives its own positions [B, T] and additive mask [1, 1, T, past + T] (tree_mask)."""
        batch, length = tokens.shape
        past = cache.length if cache is not None else 0
        features = self.fused(features)  # [B, T, H]
        with torch.no_grad():
            embedded = self.embed(tokens).to(features.dtype)  # [B, T, H], frozen
        x = self.fc(torch.cat([features, embedded], dim=-1))  # [B, T, H]
        if positions is None:
            positions = torch.arange(start, start + length).expand(batch, length)  # [B, T]
        if mask is None:
            mask = causal_mask(length, past, x.dtype, self.window)  # [1, 1, T, past + T]
        rotary = self._shared[1](x, positions)  # (cos, sin), each [B, T, head_dim]
        out = self.layer(x, mask, positions, cache, position_embeddings=rotary)
        predicted = self.norm(out[0] if isinstance(out, tuple) else out)  # [B, T, H]
        return predicted, self.lm_head(predicted)

    @torch.no_grad()
    def extend(self, cache: HeadCache, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed pairs (features [n, H], next tokens [n]) after the cache's positions
        -> the last position's (predicted feature [H], draft logits [N])."""
        predicted, logits = self(features[None], tokens[None], cache.length, cache)
        return predicted[0, -1], logits[0, -1]

    @torch.no_grad()
    def extend_tree(self, cache: HeadCache, features: torch.Tensor, tokens: torch.Tensor, position: int,
                    visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed one level of a tree: pairs (features [q, H], tokens [q]) all at rotary position `position`,
        each seeing the cache's positions before the tree's and, of the tree's t positions (the cache's
        last t - q, then these q), those `visible` [q, t] (bool) allows -> (predicted features [q, H],
        draft logits [q, N])."""
        prefix = cache.length + len(tokens) - visible.shape[1]
        predicted, logits = self(features[None], tokens[None], cache=cache,
                                 positions=torch.full((1, len(tokens)), position),
                                 mask=tree_mask(prefix, visible, self.fc.weight.dtype, self.window))
        return predicted[0], logits[0]


@dataclass
class GrownTree:
    """Every node a head's tree expansion generated, in the order generated (parents[i] < i, -1: a child of
    the context's end): its token (draft ids while growing, target ids once grown), its path score (the
    head's log probability of the path up to it, never above its parent's), and for the expanded nodes
    (and the root, -1) the head's draft logits after them [N], from the tree forward; and which nodes are
    the head's greedy chain."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]
    logits: dict[int, torch.Tensor]
    chain: list[int] = field(default_factory=list)  # the greedy chain's nodes (first children), as far as grown

    def add_children(self, nodes: list[int], logits: torch.Tensor, top_k: int) -> list[int]:
        """Give each of `nodes` the `top_k` likeliest children under its draft logits [q, N], likeliest first
        (exact ties by draft id), so a node's first child is its greedy token (draft()'s argmax) -> the new nodes."""
        logp = torch.log_softmax(logits.float(), dim=-1)  # [q, N]
        values, ids = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)  # [q, top_k]
        added: list[int] = []
        for node, row, picked, chances in zip(nodes, values.tolist(), ids.tolist(), logp):
            base = self.scores[node] if node >= 0 else 0.0
            for _, token in sorted(zip(row, picked), key=lambda c: (-c[0], c[1])):
                self.tokens.append(token)
                self.parents.append(node)
                self.scores.append(min(base + float(chances[token]), base))  # log q <= 0: never above the parent
                added.append(len(self.tokens) - 1)
        return added
