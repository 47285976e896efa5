"""Transformers / PyTorch backend: a ModelRunner over a causal LM and a DynamicCache.

The model may be fp32, bf16, or int8 (specdec.native.quant: batch-invariant).
An fp32 model's Linear layers get a faster CPU kernel for verification-sized
forwards over a cache (specdec.native.fastlinear); the prompt's prefill and
one-token steps are bitwise unchanged.

Rollback crops the DynamicCache (transformers 5: ``DynamicCache.crop(-n)``
removes the last n tokens).  Logits come back as fp32 on the CPU whatever the
model's dtype (fp32 or bf16), so verification never depends on the backend.

The cache is built without the model's config on purpose: every layer is then
a full `DynamicLayer`, even in models with sliding-window attention (Gemma 3).
A sliding-window layer keeps only the last window of states and cannot be
rolled back past it; a full layer can, and the sliding-window attention mask
still hides what lies outside the window, so the logits are the same.

Hidden states (``hidden()``, specdec.backends.base.ModelRunner.hidden): the
model's output layer gets a forward pre-hook, installed once per model, that
keeps a reference to its input while a runner's forward collects it (a
context variable: runners over one model in other threads collect their own,
and the model run by anyone else keeps nothing).  That input is the final
norm's output at exactly the positions whose logits are computed
(``logits_to_keep``); nothing else is computed and no number changes.  That
input is a slice of the last rows of the base model's output (the final norm
ran over every new row), so a runner asked to keep more (``keep_hidden_rows``)
also keeps the base model's output (a forward hook, as for the output layer)
and copies its last rows (``hidden_tail``): no computation at all.  Where the
output layer's input is not the very memory of that output's last rows (a model
that transforms them after its base model) the tail is the logits' rows only.

Token trees (``forward_tree`` / ``keep_rows``, specdec.backends.base.ModelRunner.forward_tree;
issue 39, SpecInfer's tree attention, Miao et al. 2024, arXiv 2305.09781): the
tree's tokens run as one forward with position ids cached + depth and a 4D
additive attention mask (transformers uses a 4D mask as given; one per layer
type where layers' sliding windows differ) that shows each node the cache, its
ancestors and itself, the window counted in positions.  An int8 model's
attention (quant.rowwise_attention) ignores masks: it gets the tree itself
(quant.tree_attention) and computes each node exactly as a chain over its path,
so int8 tree logits are bitwise the chain's; fp32 ones equal them up to fp32
rounding.  keep_rows gathers the kept path's rows of every cache layer.  Trees
are offered for the architectures whose sliding windows are known here
(TREE_ARCHITECTURES) with sdpa, eager or specdec's rowwise attention.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

# transformers.cache_utils, not the package's top: `from transformers import PreTrainedModel` imports its
# modeling code, a second more at every start; PreTrainedModel only types this module
from transformers.cache_utils import CacheLayerMixin, DynamicCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from specdec.backends.base import (
    Capabilities,
    Footprint,
    KeptHidden,
    checked_new_tokens,
    checked_taps,
    decoder_footprint,
    refused,
)
from specdec.backends.tree import Tree, check_forward, check_rollback, kept_rows
from specdec.errors import SpecdecError
from specdec.native import fastlinear
from specdec.native.modelconfig import (  # what every runner reads of a model (transformers-free there)
    attention_shape,
    layer_window,
    model_eos_token_ids,
    model_identity,
    model_max_context,
)

# The inputs of output layers seen by the forward running in this thread (head_inputs), else None
_HEAD_INPUTS: ContextVar[list[torch.Tensor] | None] = ContextVar("specdec_head_inputs", default=None)
# The outputs of watched base models seen by the forward running in this thread (base_outputs), else None
_BASE_OUTPUTS: ContextVar[list[torch.Tensor] | None] = ContextVar("specdec_base_outputs", default=None)
# decoder layer -> its output [B, n, H] in the forward running in this thread (tap_layers), while collecting
_LAYER_OUTPUTS: ContextVar[dict[nn.Module, torch.Tensor | None] | None] = ContextVar("specdec_layer_outputs", default=None)
_WATCHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # output layers and base models with our hook
# architectures whose layers' sliding windows layer_window knows, so HFRunner can mask a token tree
TREE_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
TREE_ATTENTION = ("sdpa", "eager", "specdec_rowwise")  # implementations that take a 4D additive mask or the tree


def tree_windows(model: PreTrainedModel) -> dict[str, int | None] | None:
    """{layer type: its sliding window} of a model whose token trees HFRunner can mask (one entry, "", for a
    model whose layers all share one window), else None."""
    config = model.config
    layers = getattr(getattr(model, "model", None), "layers", None)
    if (config.model_type not in TREE_ARCHITECTURES or layers is None
            or getattr(config, "_attn_implementation", None) not in TREE_ATTENTION):
        return None
    windows = [layer_window(config, layer.self_attn) for layer in layers]
    if len(set(windows)) == 1:
        return {"": windows[0]}
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return None
    found: dict[str, int | None] = {}
    for kind, window in zip(kinds, windows):
        if found.setdefault(kind, window) != window:
            return None
    return found


def tree_mask(tree: Tree, cached: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask [1, 1, n, cached + n] of a token tree's n nodes after `cached` tokens
    (keys in cache order, the nodes' at cached + i): 0 where node i sees the key (a cached one or an
    ancestor or itself, within `window` positions of its own), the dtype's minimum elsewhere."""
    n = len(tree)
    depth = tree.depth_index  # [n]
    position = torch.cat([torch.arange(cached), cached + depth])  # [cached + n]: each key's position
    related = torch.zeros(n, n, dtype=torch.bool)  # [n, n]: j an ancestor of i, or i itself
    owner = torch.repeat_interleave(torch.arange(n), torch.diff(tree.at.long()))  # [at[n]]: whose path each entry is
    related[owner, tree.rows.long()] = True
    seen = torch.cat([torch.ones(n, cached, dtype=torch.bool), related], dim=1)  # [n, cached + n]
    if window:
        seen &= position[None] > (cached + depth)[:, None] - window
    mask = torch.zeros(n, cached + n, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
    return mask[None, None]


def model_vocab_size(model: PreTrainedModel) -> int:
    """Width V of the model's logits: its output head's rows (an nn.Linear, or an int8 linear
    without .weight)."""
    head = model.get_output_embeddings()
    return int(head.out_features if hasattr(head, "out_features") else head.weight.shape[0])


def model_backend(model: PreTrainedModel) -> str:
    """A transformers model's backend as the CLI names it: "transformers int8" (specdec.native.quant)
    or "transformers"."""
    from specdec.native.quant import is_int8

    return "transformers int8" if is_int8(model) else "transformers"


def model_footprint(model: PreTrainedModel, chunked: bool, decoder: bool = False) -> Footprint:
    """A transformers model's Footprint (ModelRunner.footprint) from its config: its cache and activations in
    the dtype of its embedding (fp32 for specdec's int8 models, whose linears compute in fp32).  `decoder`:
    an encoder-decoder model's decoder (its cross-attention cache is priced per source token like its own)."""
    c = model.config
    if decoder:
        c = c.get_text_config(decoder=True)
    layers = int(getattr(c, "decoder_layers", None) or getattr(c, "num_decoder_layers", None) or c.num_hidden_layers)
    heads, kv_heads, head_dim = attention_shape(c)
    hidden = int(c.hidden_size)
    intermediate = int(getattr(c, "intermediate_size", None) or getattr(c, "decoder_ffn_dim", None)
                       or getattr(c, "d_ff", None) or 4 * hidden)
    element = model.get_input_embeddings().weight.element_size()  # type: ignore[operator]  # a Parameter's method
    return decoder_footprint(layers, kv_heads, head_dim, heads, hidden, intermediate, model_vocab_size(model),
                             cache_element=element, element=element, chunked=chunked)


def _keep_head_input(module: nn.Module, args: tuple[Any, ...]) -> None:
    inputs = _HEAD_INPUTS.get()
    if inputs is not None:
        inputs.append(args[0])  # [B, n, H]: a reference, no copy


def watch_head_input(model: PreTrainedModel) -> bool:
    """Give the model's output layer the pre-hook that keeps its input for head_inputs (once per layer);
    False for a model without an output layer module."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Module):
        return False
    if head not in _WATCHED:
        head.register_forward_pre_hook(_keep_head_input)
        _WATCHED.add(head)
    return True


def own_rows(rows: torch.Tensor) -> torch.Tensor:
    """`rows`, or a copy of them where they are a view of a larger tensor: a runner keeping the last rows
    of a prompt's hidden states should not keep the whole prompt's alive."""
    return rows.clone() if rows.untyped_storage().nbytes() > rows.numel() * rows.element_size() else rows


def _keep_base_output(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    outputs = _BASE_OUTPUTS.get()
    if outputs is not None:
        hidden = getattr(output, "last_hidden_state", None)
        outputs.append(hidden if hidden is not None else output[0])  # [B, n, H]: a reference, no copy


def watch_base_output(model: PreTrainedModel) -> None:
    """Give the model's base model (its decoder stack, whose output transformers slices for the output
    layer) the forward hook that keeps its output for base_outputs (once per module)."""
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model and base not in _WATCHED:
        base.register_forward_hook(_keep_base_output)
        _WATCHED.add(base)


def _keep_layer_output(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    outputs = _LAYER_OUTPUTS.get()
    if outputs is not None and module in outputs:
        outputs[module] = output[0] if isinstance(output, tuple) else output  # [B, n, H]: a reference


def watch_layer_output(layer: nn.Module) -> None:
    """Give a decoder layer the forward hook that keeps its output for layer_outputs (once per layer)."""
    if layer not in _WATCHED:
        layer.register_forward_hook(_keep_layer_output)
        _WATCHED.add(layer)


@contextmanager
def layer_outputs(layers: Sequence[nn.Module]) -> Iterator[dict[nn.Module, torch.Tensor | None]]:
    """A dict that holds, after a forward in this thread inside the block, the output [B, n, H] of each of
    `layers` (watched by watch_layer_output); empty, collecting nothing, for no layers."""
    seen: dict[nn.Module, torch.Tensor | None] = dict.fromkeys(layers)  # None until the forward fills it in
    token = _LAYER_OUTPUTS.set(seen if layers else None)
    try:
        yield seen
    finally:
        _LAYER_OUTPUTS.reset(token)


def tail_rows(base_output: torch.Tensor | None, head_input: torch.Tensor, keep: int) -> torch.Tensor:
    """The last max(m, min(keep, n)) rows [t, H] of the base model's output base_output [1, n, H] when the
    output layer's input head_input [1, m, H] is its last m rows (the very memory: transformers' slice for
    logits_to_keep), else head_input's rows [m, H]."""
    m = head_input.shape[1]
    if keep > m and base_output is not None and base_output.dim() == 3 and base_output.shape[0] == 1:
        end = base_output[:, base_output.shape[1] - m:]  # [1, m, H]: transformers' slice of the last m rows
        if (end.shape == head_input.shape and end.stride() == head_input.stride()
                and end.data_ptr() == head_input.data_ptr()):
            return base_output[0, -min(keep, base_output.shape[1]):]  # [t, H]
    return head_input[0]  # [m, H]


@contextmanager
def _collecting(var: ContextVar[list[torch.Tensor] | None]) -> Iterator[list[torch.Tensor]]:
    seen: list[torch.Tensor] = []
    token = var.set(seen)
    try:
        yield seen
    finally:
        var.reset(token)


def head_inputs() -> contextlib.AbstractContextManager[list[torch.Tensor]]:
    """A list that collects the inputs of watched output layers (watch_head_input) that run in this thread
    inside the block: [B, n, H] each, in the model's dtype."""
    return _collecting(_HEAD_INPUTS)


def base_outputs(collect: bool = True) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
    """A list that collects the outputs of watched base models (watch_base_output) that run in this thread
    inside the block, [B, n, H] each; with collect False an empty list that collects nothing."""
    return _collecting(_BASE_OUTPUTS) if collect else nullcontext([])


class HFRunner(KeptHidden):
    """A transformers causal LM with its own KV cache."""

    capabilities = Capabilities()
    _tree: tuple[int, Tree] | None = None  # the last forward_tree's (cached, tree) until keep_rows settles it
    taps: tuple[int, ...] = ()  # tap_layers: layers whose outputs follow the final hidden states' columns

    def __init__(self, model: PreTrainedModel, max_context: int | None = None) -> None:
        from specdec.native.quant import Int8Linear, is_int8, pack_all

        self.model = model.eval()
        pack_all(m for m in model.modules() if isinstance(m, Int8Linear))  # now, not at the first token
        fastlinear.install(model)  # fp32 on CPU: k-token verification at about the cost of one token
        # int8 models (specdec.native.quant) are batch-invariant; float models are not.
        self._windows = tree_windows(model)  # the sliding windows a tree's mask needs (None: no trees)
        # taps: tap_layers is offered (a model without a stack of decoder layers refuses there, in one line)
        self.capabilities = Capabilities(batch_invariant=is_int8(model), hidden_states=watch_head_input(model),
                                         taps=True, tree=self._windows is not None)
        self._int8 = is_int8(model)
        if self.capabilities.hidden_states:
            watch_base_output(model)
        self._hidden: torch.Tensor | None = None  # [n, H]: the output layer's input in the last forward
        self._tail: torch.Tensor | None = None  # [m, H]: the last forward's last m rows, _hidden their end
        self.hidden_rows = 0  # keep_hidden_rows: rows of each forward to keep beyond the logits'
        self.device = next(model.parameters()).device
        self.vocab_size = model_vocab_size(model)
        self.max_context = max_context or model_max_context(model)
        self.tokens: list[int] = []
        self.cache = DynamicCache()
        self._tree = None

    def forward(self, new_tokens: Sequence[int], last_n: int | None = None) -> torch.Tensor:
        return self._forward(self._checked(new_tokens), last_n)

    def forward_tree(self, new_tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Append a token tree (ModelRunner.forward_tree): fp32 logits [n, V], row i bitwise a chain forward's
        over token i's path for an int8 model, up to fp32 rounding for a float one.  hidden() and
        hidden_tail() are then the n nodes' final hidden states [n, H], row i of node i, until keep_rows
        narrows them to the kept path's."""
        if self._windows is None:
            raise SpecdecError(f"the transformers runner cannot verify a token tree on a {self.model.config.model_type} "
                               "model")
        from specdec.native.quant import tree_attention

        new_tokens = self._checked(new_tokens)
        tree, cached = Tree(parents, len(new_tokens)), len(self.tokens)
        positions = (cached + tree.depth_index)[None].to(self.device)  # [1, n]
        if self._int8:  # rowwise_attention takes the tree itself and no mask
            mask: Any = None
        else:
            dtype = next(self.model.parameters()).dtype
            masks = {kind: tree_mask(tree, cached, window, dtype).to(self.device) for kind, window in self._windows.items()}
            mask = masks[""] if "" in masks else masks  # [1, 1, n, cached + n], or one per layer type
        with tree_attention(tree) if self._int8 else nullcontext():
            logits = self._forward(new_tokens, None, attention_mask=mask, position_ids=positions)
        self._tree = (cached, tree)
        return logits

    def draft_greedy(self, feed: Sequence[int], k: int) -> list[int]:
        """Refused: a transformers model drafts token by token."""
        raise refused(self, "drafts no chain in one call")

    def keep_rows(self, cached: int, rows: Sequence[int]) -> None:
        """After forward_tree over `cached` tokens, keep those and the tree's nodes `rows` (a root-to-node
        path; ModelRunner.keep_rows): every cache layer keeps those positions, and hidden() / hidden_tail()
        become those rows' [len(rows), H], as after a chain forward over them."""
        rows = kept_rows(self._tree, cached, rows)
        self._tree = None
        new = self.tokens[cached:]
        if rows == list(range(len(rows))):  # the path is in place: drop the rest
            self.rollback(cached + len(rows))
        else:
            keep = torch.cat([torch.arange(cached), cached + torch.tensor(rows)]).to(self.device)  # [cached + m]
            for layer in self.cache.layers:
                # (a tree's model has attention layers only: tree_windows refuses others)
                if isinstance(layer, CacheLayerMixin) and layer.is_initialized and layer.keys is not None \
                        and layer.values is not None and layer.keys.numel():
                    layer.keys, layer.values = layer.keys[..., keep, :], layer.values[..., keep, :]  # [B, H, cached + m, D]
            self.tokens[cached:] = [new[r] for r in rows]
        if self._hidden is not None:
            self._hidden = self._tail = self._hidden[rows]  # [m, H]: a tree forward keeps every row

    def _checked(self, new_tokens: Sequence[int]) -> list[int]:
        check_forward(self._tree)
        return checked_new_tokens(new_tokens, len(self.tokens), self.max_context)

    @torch.inference_mode()
    def _forward(self, new_tokens: list[int], last_n: int | None, **extra: Any) -> torch.Tensor:
        input_ids = torch.tensor([new_tokens], dtype=torch.long, device=self.device)  # [1, n]
        # A few tokens over a cache (a verification): the fast fp32 product; a prompt's prefill keeps
        # the model's own kernel, so plain decoding stays bitwise the model's (see fastlinear).
        layers = [self.model.get_decoder().layers[i] for i in self.taps]
        with (fastlinear.enabled(bool(self.tokens) and len(new_tokens) <= fastlinear.MAX_ROWS), head_inputs() as seen,
              base_outputs(self.hidden_rows > 0) as bases, layer_outputs(layers) as tapped):
            out = self.model(
                input_ids=input_ids,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=last_n or 0,  # 0 = keep every position
                **extra,
            )
        self.tokens.extend(new_tokens)
        self._tail = own_rows(tail_rows(bases[-1] if bases else None, seen[-1], self.hidden_rows)) if seen else None
        if self._tail is not None and layers:  # [m, H (1 + taps)]: the tapped layers' rows after the final ones
            m = self._tail.shape[0]
            parts = [self._tail]
            for layer in layers:
                rows = tapped[layer]
                assert rows is not None  # the forward ran every tapped layer, whose hook kept its output
                parts.append(rows[0, -m:])
            self._tail = torch.cat(parts, dim=1)
        # [n, H]: the rows the head computed the logits of, the tail's last
        self._hidden = None if self._tail is None else self._tail[self._tail.shape[0] - seen[-1].shape[1]:]
        return out.logits[0].float().cpu()  # [n, V]

    def tap_layers(self, layers: Sequence[int]) -> None:
        """From the next forward on, hidden() and hidden_tail() rows hold the outputs of these decoder layers
        after the final hidden state (ModelRunner.tap_layers)."""
        decoder = self.model.get_decoder()
        stack = getattr(decoder, "layers", None)
        if layers and not isinstance(stack, nn.ModuleList):
            raise SpecdecError(f"a {self.describe()} model has no decoder layers to tap")
        taps = checked_taps(layers, len(stack) if stack is not None else 0)
        for i in taps:
            assert isinstance(stack, nn.ModuleList)  # (checked above: there are taps)
            watch_layer_output(stack[i])
        self.taps = taps

    def rollback(self, n: int) -> None:
        check_rollback(self._tree, n)
        self._tree = None
        drop = len(self.tokens) - n
        if drop <= 0:
            return
        if n == 0:
            self.reset()
            return
        self.cache.crop(-drop)  # transformers 5: a negative count of tokens to drop
        del self.tokens[n:]

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.tokens = []
        self._hidden = self._tail = None
        self._tree = None

    def footprint(self) -> Footprint:
        """From the model's config (model_footprint); a long prefill in chunks where the model is batch-invariant."""
        return model_footprint(self.model, chunked=self.capabilities.batch_invariant)

    def expect(self, tokens: int) -> None:
        """Nothing to make room for: the DynamicCache grows by concatenation, to exactly what it holds."""

    def trim(self, tokens: int) -> int:
        """Keep the first `tokens` cached tokens (ModelRunner.trim): the DynamicCache's crop leaves views over
        the longer tensors, so the kept rows are copied out and those freed."""
        drop = len(self.tokens) - max(0, int(tokens))
        if self._tree is not None:
            self.reset()
            return 0
        if drop <= 0:
            return 0
        freed = drop * self.footprint().cache_bytes_per_token
        self.rollback(max(0, int(tokens)))
        for layer in self.cache.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)  # attention layers' tensors
            if keys is not None and values is not None and keys.numel():
                layer.keys, layer.values = keys.clone(), values.clone()  # type: ignore[union-attr]  # [B, H, tokens, D]
        return freed

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return model_eos_token_ids(self.model)

    def clone(self) -> HFRunner:
        return HFRunner(self.model, self.max_context)

    def describe(self) -> str:
        return model_backend(self.model)

    def identity(self) -> dict[str, Any]:
        return model_identity(type(self).__name__, self.model)
