"""A lean runner for int8 llama-family decoders: the int8 model's own numbers, with less work per token.

A transformers model quantized by :mod:`specdec.native.quant` spends a good
part of each one-token step outside its matrix kernels: module dispatch,
keyword plumbing, mask building, a cache that grows by concatenation.  This
runner computes the same network (llama, qwen2 and mistral architectures)
directly from the quantized model's tensors, gpt-fast style:

- q/k/v and gate/up projections fused into one Int8Linear each.  Weights and
  scales are per output channel and each token's activation scale is the same
  for all of them, so concatenating output channels changes no number;
- the rotary cos/sin table computed once, by the model's own rotary module,
  for every position;
- a preallocated KV cache per layer ([H_kv, capacity, D], fp32): sized once for a
  request whose length is known (``expect``: prompt + max_tokens), else grown by
  doubling; rollback moves a length, nothing is copied; ``trim`` shrinks it back
  after a long request;
- the fused weights are packed for the int8 kernel when the runner is built; the
  transformers model's own q/k/v and gate/up linears stay unpacked int8
  values (packed only if that model is itself run, e.g. by transformers'
  generate in the benchmark);
- the same elementwise and reduction operations in the same order as the
  transformers model, and attention through the same kernel as its
  :func:`specdec.native.quant.rowwise_attention` (every query row on its
  own: :func:`specdec.native.kernels.attention.causal`).

So its logits are bitwise those of the quantized transformers model (tested on
tiny and real models), and it inherits its batch invariance: speculative
output equals plain output.  Other architectures (Gemma 3, ...) run the
quantized transformers model through :class:`specdec.backends.hf.HFRunner`
-- except as int4 drafts, below.

**Several sequences in one forward** (:func:`forward_packed`, used by
:mod:`specdec.runtime.batching`): the new tokens of several runners -- each with its
own cache, its own length and its own draft -- are packed into one
[total, hidden] matrix (no padding).  Every operation but attention is per
token, so the matrix products read each weight once for the whole batch; each
runner's rows attend to that runner's own cache, with the same calls as when
it runs alone.  For an int8 model a token's logits are therefore bitwise the
same whatever its neighbours (tested).  The same packed forward runs fp32
llama-family models too (:func:`supports` with ``fp32=True``; their fused
projections use the weight-major product of :mod:`specdec.native.fastlinear`
for 2..128 rows): fp32 rounding then depends on the batch, as it does on the
draft length (see README), so fp32 batched output is exact up to near-ties.

**Layer sets.** How a runner computes its stack of layers is an object chosen
once, when it is built (:func:`choose_layers`), and shared by every runner over
the same model: :class:`Int8Layers` (the int8 model's own operations, attention
by specdec's exact kernel), :class:`Fp32Layers` (the same operations in fp32,
attention by PyTorch row by row), :class:`Int4Layers` (the int8 weights
requantized to int4, op by op in torch) and :class:`NativeInt4Layers` (the
same int4 network in one C call).  The forward itself has no branches on the
kind of model.

**int4 drafts** (``int4=True``, :mod:`specdec.native.int4`) run all their
layers in one C call (``kernels/layers.c``, :class:`NativeInt4Layers`):
norms, rotary embeddings and the MLP's SiLU are plain per-row loops there
instead of ~35 torch operations per layer, which made one-token steps of the small drafts much faster
(BENCHMARKS.md, Zen 3 component timings).  Its numbers are the torch path's up to
fp32 rounding (tested); a draft's numbers never change the output.  Gemma 3
text models (gemma3-270m) run as int4 drafts too (INT4_ARCHITECTURES): the
same layers with Gemma's extra norms (per-head q / k norms, norms on the
attention's and the MLP's outputs, each scaling by 1 + w), a tanh-GELU gate,
a scaled embedding and one rotary table per layer type (tested against the
transformers model with the same int4 linears).  Where the int8 kernel takes
its AVX-512 VNNI path, an int4 draft's forwards of several rows -- its
catch-ups -- run on the int8 weights instead (:class:`CatchUpLayers`): a
drafted token is bound by memory, a catch-up by arithmetic.

**Trimmed heads** (``trim_head`` / ``extend_head``; FR-Spec, Zhao et al. 2025): a draft's head may compute
the logits of some vocabulary ids only (:class:`TrimmedHead`: their rows gathered from the head's packed
weights, so bitwise the full head's logits there for int4 and int8), a fixed set shared by the model's
runners and a request's own few more; forward then returns [n, N] and ``head_ids`` names the columns
(specdec.drafters.draft_vocab).  A drafted token reads N of the head's rows instead of all of them.

**Hidden states** (``hidden()``, specdec.backends.base.ModelRunner.hidden):
the head's input, the final norm's output at the rows whose logits a forward
returns, is kept by reference: each runner of a packed forward gets its own rows.
A runner asked to keep more (``keep_hidden_rows(n)``) gets the final norm over
its chunk's last n rows (``hidden_tail()``); the head runs on the logits' rows
only, the last of them, as before: the norm is per row, so nothing changes.
With ``tap_layers`` the kept rows carry the outputs of those decoder layers
after the final hidden state (a fused-feature head's input; specdec.head.model).

**Token trees** (``forward_tree`` / ``keep_rows``, specdec.backends.base.ModelRunner.forward_tree;
issue 39, SpecInfer's tree attention, Miao et al. 2024, arXiv 2305.09781): a
tree's n new tokens run as one chunk, row i's keys and values written at cache
position cached + i, its rotary position cached + depth(i), and its attention
over the cache and its ancestors and itself only (the kernel's tree mode,
:mod:`specdec.backends.tree`).  Every other operation is per row, so an int8
node's logits are bitwise those of a chain forward over its path (tested).
After forward_tree, ``hidden()`` and ``hidden_tail()`` are the n nodes' rows in
the order given; ``keep_rows`` copies the kept path's keys and values to
consecutive positions (their rotary positions are already the chain's) and
narrows those rows to the path's: what a chain forward over the path would
have left.  A tree may be packed with other runners' chunks (forward_packed's
``trees``).  The fp32 and torch int4 layer sets take trees too (PyTorch's
attention over each row's gathered keys); the native int4 layers do not
(``capabilities.tree`` False).
"""

from __future__ import annotations

import copy
import hashlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from specdec.backends.base import Capabilities, Footprint, KeptHidden, checked_taps, decoder_footprint, refused
from specdec.backends.tree import Tree, check_forward, check_rollback, kept_rows
from specdec.errors import SpecdecError
from specdec.native import kernels
from specdec.native.fastlinear import is_fp32_cpu_linear, weight_major_linear
from specdec.native.int4 import Int4Linear
from specdec.native.kernels.bindings import LayersModel
from specdec.native.kernels.gguf import Parts
from specdec.native.modelconfig import (
    attention_shape,
    layer_window,
    model_eos_token_ids,
    model_identity,
    model_max_context,
)
from specdec.native.packcache import PackCache
from specdec.native.quant import Int8Linear, is_int8, pack_all

ARCHITECTURES = ("llama", "qwen2", "mistral")
GEMMA = ("gemma3_text",)  # Gemma3ForCausalLM's model_type: int4 drafts only (see the module doc)
INT4_ARCHITECTURES = (*ARCHITECTURES, *GEMMA)
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # the gate activations kernels/layers.c computes (ACT_*)
STATIC_ROPE = ("default", "linear", "llama3")  # inv_freq does not change with the sequence length
_INITIAL_CAPACITY = 256
CACHE_DTYPE = torch.float32  # the KV cache's elements, whatever the weights (int8 and int4 compute in fp32)


WEIGHT_MAJOR_ROWS = 128  # fp32: forwards of 2..this many tokens take the weight-major product


def is_fp32_cpu(model: Any) -> bool:
    """Whether every nn.Linear of `model` is an fp32 CPU layer (and there is at least one)."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    return bool(linears) and all(is_fp32_cpu_linear(m) for m in linears)


def supports(model: Any, fp32: bool = False, int4: bool = False) -> bool:
    """Whether this runner can compute `model`: an int8 transformers model of a llama-family
    architecture (exactly: bitwise the quantized model), or with fp32=True also an fp32 one on the CPU
    (for batching; see the module doc); with int4=True an int8 model of INT4_ARCHITECTURES (whose
    weights the runner requantizes)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in (INT4_ARCHITECTURES if int4 else ARCHITECTURES):
        return False
    if not (is_int8(model) or (fp32 and is_fp32_cpu(model))):
        return False
    if config.model_type in GEMMA:
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
            return False
        return all(_static_rope(config.rope_parameters.get(kind)) for kind in set(config.layer_types))
    return _static_rope(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None))


def _static_rope(rope: dict | None) -> bool:
    rope = rope or {}
    return rope.get("rope_type", rope.get("type", "default")) in STATIC_ROPE


class FloatLinear:
    """An fp32 linear for the packed forward: the model's own kernel for one row or a prompt, the
    weight-major product (specdec.native.fastlinear) for 2..WEIGHT_MAJOR_ROWS rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.detach()  # [N, K]
        self.bias = None if bias is None else bias.detach()
        self.out_features, self.in_features = (int(d) for d in weight.shape)

    @classmethod
    def of(cls, linear: nn.Linear) -> FloatLinear:
        return cls(linear.weight, linear.bias)

    def nbytes(self) -> int:
        """The bytes a product reads: the fp32 weights and bias."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N]
        if 2 <= x.shape[0] <= WEIGHT_MAJOR_ROWS:
            return weight_major_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


Linear = Int8Linear | FloatLinear | Int4Linear | Parts  # Parts: a GGUF file's packed tensors (specdec.native.gguf)


def output_rows(linear: Linear, ids: torch.Tensor) -> Linear:
    """`linear` restricted to its output channels `ids` [N] (int64): the same weights gathered, so that each
    of its outputs is bitwise the full layer's at that id where each output depends on its own weight row
    only (int4, int8, a GGUF file's blocks: Parts that know where their rows come from); an fp32 layer's up to
    rounding (BLAS blocks its products by their width)."""
    if isinstance(linear, Int4Linear):
        return linear.rows(ids)
    if isinstance(linear, Parts):
        return linear.rows(ids.tolist())
    if isinstance(linear, Int8Linear | FloatLinear):
        bias = None if linear.bias is None else linear.bias.detach()[ids]
        if isinstance(linear, FloatLinear):
            return FloatLinear(linear.weight[ids], bias)
        rows = Int8Linear(linear.int8_weight()[ids], linear.scale[ids], bias)
        rows.pack()
        return rows
    raise SpecdecError(f"a head of {type(linear).__name__} cannot be trimmed to some of its rows")


class TrimmedHead:
    """An output head over some vocabulary ids only (a draft's: FR-Spec, Zhao et al. 2025, arXiv 2502.14856;
    specdec.drafters.draft_vocab): hidden states [n, hidden] -> logits [n, N] whose column j is the full head's
    column ids[j], bitwise for int4 and int8 (output_rows).  A drafted token then reads N of the head's V rows.

    Its ids are a fixed set (made once per model: LayerSet.trimmed_head) and, in a head made by
    :meth:`extended`, a request's own few more (its context's tokens outside the set), computed by a second,
    small product whose columns follow the set's."""

    def __init__(self, head: Linear, ids: torch.Tensor) -> None:
        self.full = head  # the untrimmed head the rows come from
        self.ids = self._checked(torch.as_tensor(ids, dtype=torch.int64), head.out_features)  # [N]
        self.fixed = self.ids  # the set's ids (ids: these, then an extended head's extra ones)
        self.parts = [output_rows(head, self.ids)]  # hidden -> N (then hidden -> the extra ids)
        self.out_features, self.in_features = int(self.ids.numel()), head.in_features

    @staticmethod
    def _checked(ids: torch.Tensor, width: int) -> torch.Tensor:
        if ids.dim() != 1 or not ids.numel() or len(set(ids.tolist())) != ids.numel() \
                or int(ids.min()) < 0 or int(ids.max()) >= width:
            raise ValueError(f"a trimmed head needs distinct vocabulary ids in [0, {width}), at least one")
        return ids

    def extended(self, extra: torch.Tensor) -> TrimmedHead:
        """This head's set and the ids `extra` [E] (distinct, none in the set): logits [n, N + E], the set's
        columns first; `extra` empty: the set alone (this head's first part).  Rows gathered per call (E of them)."""
        extra = torch.as_tensor(extra, dtype=torch.int64)
        head = copy.copy(self)
        head.parts = self.parts[:1]
        head.ids = self.fixed
        if extra.numel():
            if bool(torch.isin(extra, self.fixed).any()):
                raise ValueError("a trimmed head's extra ids must lie outside its set")
            head.ids = self._checked(torch.cat([self.fixed, extra]), self.full.out_features)
            head.parts = [self.parts[0], output_rows(self.full, extra)]
        head.out_features = int(head.ids.numel())
        return head

    def nbytes(self) -> int:
        """The bytes a product reads: the kept rows' weights."""
        return sum(part.nbytes() for part in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [n, hidden] -> [n, N (+ E)]
        if len(self.parts) == 1:
            return self.parts[0](x)
        return torch.cat([part(x) for part in self.parts], dim=-1)


def fuse(linears: Sequence[Any]) -> Linear:
    """One linear whose output is the concatenation of the given ones' outputs: Int8Linears
    (bitwise: every output channel keeps its weights, scale and per-token activation scale) or fp32
    nn.Linears (a FloatLinear)."""
    biases = [lin.bias for lin in linears]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("cannot fuse linears where only some have a bias")
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    if all(isinstance(lin, Int8Linear) for lin in linears):
        weight = torch.cat([lin.int8_weight() for lin in linears])  # [sum N, K]
        scale = torch.cat([lin.scale for lin in linears])  # [sum N]
        return Int8Linear(weight, scale, bias)
    return FloatLinear(torch.cat([lin.weight.detach() for lin in linears]), bias)


def _own(linear: Any) -> Linear:
    """A model's linear as the packed forward calls it (an Int8Linear as it is)."""
    return linear if isinstance(linear, Int8Linear) else FloatLinear.of(linear)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen2RMSNorm, operation for operation (fp32)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor: x [H, n, D], cos / sin [n, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (H + 2 H_kv) D
    o: Linear  # H D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 I
    down: Linear  # I -> hidden
    scaling: float
    sliding_window: int | None
    # Gemma 3 only (None elsewhere); its norms' weights are stored as 1 + w, the factor they scale by
    q_norm: torch.Tensor | None = None  # [D]: each q head's rms norm, before the rotation
    k_norm: torch.Tensor | None = None  # [D]
    attn_out_norm: torch.Tensor | None = None  # [hidden]: on the attention's output, before the residual
    mlp_out_norm: torch.Tensor | None = None  # [hidden]: on the MLP's output, before the residual
    rope: int = 0  # the layer's rotary table (LeanRunner._cos / _sin [tables, positions, D])


@dataclass
class _NativeTable:
    """An int4 model's layers as kernels/layers.c reads them: the tensors' addresses, one row of
    L_FIELDS per layer (the _Layer objects keep the tensors alive), attention scales and sliding windows."""

    tensors: torch.Tensor  # [layers, 19] int64
    scaling: torch.Tensor  # [layers] fp32
    window: torch.Tensor  # [layers] int32 (0: none)

    @classmethod
    def of(cls, layers: Sequence[_Layer]) -> _NativeTable:
        def address(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.data_ptr()

        rows = []
        for layer in layers:
            row = [address(layer.input_norm), address(layer.post_norm)]
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                assert isinstance(lin, Int4Linear)
                row += [address(lin.packed), address(lin.scales), address(lin.bias)]
            row += [address(layer.q_norm), address(layer.k_norm), address(layer.attn_out_norm),
                    address(layer.mlp_out_norm), layer.rope]
            rows.append(row)
        return cls(torch.tensor(rows, dtype=torch.int64), torch.tensor([layer.scaling for layer in layers]),
                   torch.tensor([layer.sliding_window or 0 for layer in layers], dtype=torch.int32))


# What a layer set makes of some of the model's linears side by side (a layer's q, k and v; gate and up; one
# alone), given the name its packed weights are kept under in the model's pack cache: (name, linears) -> linear
Make = Callable[[str, Sequence[Any]], Linear]


def _fused(name: str, linears: Sequence[Any]) -> Linear:
    """The model's linears as one (fuse), a single one as it is (_own)."""
    return fuse(linears) if len(linears) > 1 else _own(linears[0])


def _int4(linear: Any) -> Int4Linear:
    """An int8 (or fp32) linear's weights in int4 (specdec.native.int4)."""
    if isinstance(linear, Int8Linear):
        return Int4Linear.from_int8(linear)
    return Int4Linear.from_weight(linear.weight, linear.bias)


def _bias(linears: Sequence[Any]) -> torch.Tensor | None:
    """The linears' biases side by side (fuse's), None without."""
    return None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])


# A model's cache of its packed weights (its int4 requantisation, its int8 linears in the kernel's layout), for
# the layer sets built over it (use_pack_cache)
_PACK_CACHES: weakref.WeakKeyDictionary[Any, PackCache] = weakref.WeakKeyDictionary()


def use_pack_cache(model: Any, cache: PackCache) -> None:
    """Build `model`'s layer sets from the packed weights in `cache` (specdec.native.packcache: a file that an
    earlier load wrote, memory-mapped), and keep there what they pack afresh (cache.save() writes it): no
    requantisation, no packing, not even the fused int8 copies they are made from."""
    _PACK_CACHES[model] = cache


def _int4_make(cache: PackCache | None) -> Make:
    """Make for the int4 layer sets: the fused linears requantised to int4, or as `cache` holds them."""

    def make(name: str, linears: Sequence[Any]) -> Linear:
        n, k = sum(lin.out_features for lin in linears), linears[0].in_features
        if cache is not None:
            packed, scales = cache.get(f"int4.{name}.packed"), cache.get(f"int4.{name}.scales")
            if packed is not None and scales is not None and [packed.shape, scales.shape] == [
                    t.shape for t in kernels.int4._buffers(n, k)]:
                return Int4Linear(packed, scales, n, k, _bias(linears))
        made = _int4(_fused(name, linears))
        if cache is not None:
            cache.tensor(f"int4.{name}.packed", lambda: made.packed)
            cache.tensor(f"int4.{name}.scales", lambda: made.scales)
        return made

    return make


def _int8_make(cache: PackCache | None, made: dict[str, Linear]) -> Make:
    """Make for the torch layer sets: the fused linears (an int8 one in the kernel's layout as `cache` holds it);
    what it makes goes into `made` by name."""

    def make(name: str, linears: Sequence[Any]) -> Linear:
        packed = cache.get(f"int8.{name}") if cache is not None else None
        if packed is not None and all(isinstance(lin, Int8Linear) for lin in linears):
            scale = torch.cat([lin.scale for lin in linears])
            lin = linears[0] if len(linears) == 1 else Int8Linear.from_packed(
                packed, scale, _bias(linears), sum(lin.out_features for lin in linears), linears[0].in_features)
            if not lin.packed:
                lin.use_packed(packed)
        else:
            lin = _fused(name, linears)
        made[name] = lin
        return lin

    return make


def _layers(model: Any, make: Make = _fused) -> list[_Layer]:
    """The model's layers with fused (unpacked) projections, each made by `make` (named "<layer>.qkv" and so on);
    a Gemma 3 layer with its extra norms, its norms' factors 1 + w, and its rotary table."""
    config = model.config
    gemma = config.model_type in GEMMA
    norm = _gemma_norm if gemma else (lambda module: module.weight.detach())
    tables = _rope_kinds(config)
    layers = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        extra: dict[str, Any] = dict(q_norm=norm(attn.q_norm), k_norm=norm(attn.k_norm),
                     attn_out_norm=norm(layer.post_attention_layernorm),
                     mlp_out_norm=norm(layer.post_feedforward_layernorm),
                     rope=tables.index(config.layer_types[i])) if gemma else {}
        layers.append(_Layer(
            input_norm=norm(layer.input_layernorm),
            qkv=make(f"{i}.qkv", [attn.q_proj, attn.k_proj, attn.v_proj]),
            o=make(f"{i}.o", [attn.o_proj]),
            # the pre-MLP norm: Gemma names it pre_feedforward_layernorm (its post_attention_layernorm is on
            # the attention's output)
            post_norm=norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm),
            gate_up=make(f"{i}.gate_up", [mlp.gate_proj, mlp.up_proj]),
            down=make(f"{i}.down", [mlp.down_proj]),
            scaling=float(attn.scaling),
            sliding_window=layer_window(config, attn),
            **extra,
        ))
    return layers


def _gemma_norm(norm: nn.Module) -> torch.Tensor:
    """A Gemma RMSNorm's factor, 1 + w (its forward computes the same sum before multiplying)."""
    weight = norm.weight
    assert isinstance(weight, torch.Tensor)  # a Parameter (nn.Module types its attributes Tensor | Module)
    return 1.0 + weight.detach().float()


def _rope_kinds(config: Any) -> list[str | None]:
    """The rotary tables a model needs, in the order its layers' `rope` index them: one per Gemma 3 layer
    type, one (None) for the llama family."""
    return sorted(set(config.layer_types)) if config.model_type in GEMMA else [None]


def _activation_code(config: Any) -> int:
    """The gate activation's code in kernels/layers.c (ACT_*), or -1 for one it does not compute."""
    name = "hidden_activation" if config.model_type in GEMMA else "hidden_act"
    return ACTIVATIONS.get(getattr(config, name, None) or "", -1)


def _rowwise(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scaling: float,
             window: int | None, tree: Tree | None = None) -> torch.Tensor:
    """fp32 attention over this runner's cache, one PyTorch call per query row (the batched engine's fp32
    path; int8 runners take kernels.attention.causal): q [H, n, D] at positions start.. (a tree's rows: the
    keys each sees gathered) -> [n, H D]."""
    n = q.shape[1]
    gqa = q.shape[0] != keys.shape[0]
    rows = []
    for i in range(n):
        if tree is None:
            end = start + i + 1
            lo = max(0, end - window) if window else 0
            k, v = keys[None, :, lo:end], values[None, :, lo:end]  # [1, H_kv, L, D]
        else:
            seen = torch.tensor(tree.visible(i, start, window))
            k, v = keys[None, :, seen], values[None, :, seen]
        rows.append(F.scaled_dot_product_attention(q[None, :, i : i + 1], k, v, scale=scaling, enable_gqa=gqa))
        # [1, H, 1, D]
    out = rows[0] if n == 1 else torch.cat(rows, dim=2)  # [1, H, n, D]
    return out.transpose(1, 2).reshape(n, -1)


# model -> its layer sets by kind, each built once (packing or requantizing takes seconds)
_SETS: weakref.WeakKeyDictionary[Any, dict[type, LayerSet]] = weakref.WeakKeyDictionary()


class LayerSet:
    """A model's decoder layers as the lean runner computes them: the layers, the output head, and how the
    stack runs over the packed new rows of several runners (:meth:`run`).  Built once per model and kind
    (:meth:`of`) and shared by all its runners: a runner owns only its KV cache."""

    backend: str  # ModelRunner.describe(): the CLI's name for it
    dtype: str | None = None  # what its timings are keyed by where not the model's dtype (int8, or its parameters')
    batch_invariant = True  # a row's numbers do not depend on the other rows of the forward
    native = False  # the whole stack runs in one C call (kernels/layers.c)
    tappable = True  # run() fills `tapped` (a fused-feature head's intermediate layers)
    tree = True  # run() takes token trees

    def __init__(self, layers: list[_Layer], head: Linear) -> None:
        self.layers = layers
        self.head = head  # hidden -> V
        self.intermediate = layers[0].gate_up.out_features // 2  # I
        self._trimmed: dict[bytes, TrimmedHead] = {}  # the heads trimmed to some ids (trimmed_head), by those ids

    def trimmed_head(self, ids: torch.Tensor) -> TrimmedHead:
        """The head over vocabulary ids `ids` [N] only (TrimmedHead), made once and shared by this model's
        runners (a batch's draft runners, clones)."""
        ids = torch.as_tensor(ids, dtype=torch.int64)
        key = ids.numpy().tobytes()
        if key not in self._trimmed:
            self._trimmed[key] = TrimmedHead(self.head, ids)
        return self._trimmed[key]

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The final norm of rows x [n, hidden] (transformers' RMSNorm, op for op)."""
        return rms_norm(x, weight, eps)

    def step_bytes(self, head: Linear | TrimmedHead | None = None) -> int:
        """The weight bytes a one-token step reads: every layer's linears and the head (`head`, default this
        set's: a runner's trimmed one), as stored for their kernels (profile's roof)."""
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(lin.nbytes() for lin in [*linears, head or self.head])

    @classmethod
    def of(cls, model: Any) -> Self:
        """This kind of layer set over `model`, built at the first call and shared after it."""
        sets = _SETS.setdefault(model, {})
        if cls not in sets:
            sets[cls] = cls.build(model)
        return sets[cls]  # type: ignore[return-value]  # each kind's own set: cls.build's, above

    @classmethod
    def build(cls, model: Any) -> Self:
        raise NotImplementedError

    def run(self, runners: Sequence[LeanRunner], starts: Sequence[int], offsets: Sequence[int], x: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor, trees: Sequence[Tree | None] | None = None,
            tapped: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """All layers over the packed new rows x [total, hidden] of `runners` (over this set's model); returns
        the last layer's output [total, hidden].  Chunk r is rows offsets[r] .. offsets[r + 1] at positions
        starts[r] on, or where trees[r] is a Tree the nodes of that tree (row i's keys and values at cache
        position starts[r] + i); cos, sin [tables, total, D]: each row's position's.  The rows' keys and
        values go into their runners' caches.  `tapped`, where given, maps layer indices to the output of
        that layer [total, hidden] (the residual stream after it), filled in by the call."""
        raise NotImplementedError


class TorchLayers(LayerSet):
    """Layers run op by op in torch, the int8 model's own operations (see the module doc), attention by
    :meth:`attend`."""

    @classmethod
    def build(cls, model: Any) -> Self:
        """The model's layers with fused projections, their int8 weights packed for the kernel (the model's
        own q/k/v and gate/up linears stay unpacked)."""
        cache, made = _PACK_CACHES.get(model), dict[str, Linear]()
        make = _int8_make(cache, made)
        layers, head = _layers(model, make), make("head", [model.lm_head])
        pack_all(lin for lin in made.values() if isinstance(lin, Int8Linear))
        if cache is not None:
            for name, lin in made.items():
                if isinstance(lin, Int8Linear):
                    cache.tensor(f"int8.{name}", lin.packed_weight)
        return cls(layers, head)

    @staticmethod
    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scaling: float,
               window: int | None, tree: Tree | None = None) -> torch.Tensor:
        """q [H, n, D] at positions start.. (or a tree's nodes) over a runner's cache -> [n, H D]: specdec's
        attention kernel, each row on its own (kernels.attention), as the int8 model's rowwise_attention."""
        return kernels.attention.causal(q, keys, values, start, scaling, window, tree=tree)

    def run(self, runners: Sequence[LeanRunner], starts: Sequence[int], offsets: Sequence[int], x: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor, trees: Sequence[Tree | None] | None = None,
            tapped: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        lead, total = runners[0], x.shape[0]
        trees = trees or [None] * len(runners)
        h_q, h_kv, d = lead.num_heads, lead.num_kv_heads, lead.head_dim
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, lead.eps)
            qkv = layer.qkv(h)  # [total, (H + 2 H_kv) D]
            qk = qkv[:, : (h_q + h_kv) * d].view(total, h_q + h_kv, d)
            if layer.q_norm is not None and layer.k_norm is not None:  # Gemma: each q and k head normed on its own
                qk = torch.cat([rms_norm(qk[:, :h_q], layer.q_norm, lead.eps),
                                rms_norm(qk[:, h_q:], layer.k_norm, lead.eps)], dim=1)
            # q and k rotated in one go: the same elementwise operations on every element
            qk = rotate(qk.transpose(0, 1), cos[layer.rope], sin[layer.rope])  # [H + H_kv, total, D]
            v = qkv[:, (h_q + h_kv) * d :].view(total, h_kv, d).transpose(0, 1)  # [H_kv, total, D]
            rows = []
            for r, start, lo, hi, tree in zip(runners, starts, offsets, offsets[1:], trees):
                end = start + hi - lo
                r.keys[i][:, start:end] = qk[h_q:, lo:hi]
                r.values[i][:, start:end] = v[:, lo:hi]
                q = qk[:h_q, lo:hi].contiguous()  # [H, n, D]: the same layout whatever the neighbours
                rows.append(self.attend(q, r.keys[i], r.values[i], start, layer.scaling,
                                        layer.sliding_window, tree))  # [n, H D]
            attn = rows[0] if len(rows) == 1 else torch.cat(rows)  # [total, H D]
            out = layer.o(attn)  # [total, hidden]
            if layer.attn_out_norm is not None:
                out = rms_norm(out, layer.attn_out_norm, lead.eps)
            x = x + out
            h = rms_norm(x, layer.post_norm, lead.eps)
            gate_up = layer.gate_up(h)  # [total, 2 I]
            out = layer.down(lead.act(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :])
            if layer.mlp_out_norm is not None:
                out = rms_norm(out, layer.mlp_out_norm, lead.eps)
            x = x + out
            if tapped is not None and i in tapped:
                tapped[i] = x  # [total, hidden]: a new tensor each layer, never written in place
        return x


class Int8Layers(TorchLayers):
    """An int8 model's layers: bitwise the quantized transformers model's numbers, whatever the batch."""

    backend = "transformers int8"


class Fp32Layers(TorchLayers):
    """An fp32 model's layers on the CPU (the batched engine's): fused projections take the weight-major
    product for 2..WEIGHT_MAJOR_ROWS rows, attention PyTorch's, row by row; fp32 rounding depends on the
    batch."""

    backend = "transformers"
    batch_invariant = False
    attend = staticmethod(_rowwise)


class Int4Layers(TorchLayers):
    """An int8 model's weights requantized to int4 (a draft's: specdec.native.int4), op by op in torch;
    where kernels/layers.c lacks the model's activation, and the C layers' reference in tests."""

    backend = "specdec int4"
    dtype = "int4"

    @classmethod
    def build(cls, model: Any) -> Self:
        make = _int4_make(_PACK_CACHES.get(model))
        return cls(_layers(model, make), make("head", [model.lm_head]))


class NativeInt4Layers(LayerSet):
    """:class:`Int4Layers`' network (the same int4 weights) in one call of kernels/layers.c: its numbers
    up to fp32 rounding."""

    backend = "specdec int4"
    dtype = "int4"
    native = True
    tappable = False
    tree = False  # the native int4 layers compute chains only

    def __init__(self, layers: list[_Layer], head: Linear, act_code: int) -> None:
        super().__init__(layers, head)
        self.table = _NativeTable.of(layers)
        self.act_code = act_code  # the gate activation (ACTIVATIONS)
        self._model: LayersModel | None = None  # the kernel's view of the model, made at the first forward

    def kernel_model(self, lead: LeanRunner, hidden: int) -> LayersModel:
        """The model as kernels.layers.run takes it (its table's addresses and shapes), made once: nothing
        in it changes between forwards."""
        if self._model is None:
            table = self.table
            self._model = LayersModel(tensors=table.tensors.data_ptr(), scaling=table.scaling.data_ptr(),
                                      window=table.window.data_ptr(), layers=len(self.layers), hidden=hidden,
                                      heads=lead.num_heads, kv_heads=lead.num_kv_heads, d=lead.head_dim,
                                      intermediate=self.intermediate, act=self.act_code, eps=lead.eps,
                                      linear=kernels.layers.INT4)
        return self._model

    @classmethod
    def build(cls, model: Any) -> Self:
        torch_path = Int4Layers.of(model)  # the same int4 weights, requantized once
        return cls(torch_path.layers, torch_path.head, _activation_code(model.config))

    def run(self, runners: Sequence[LeanRunner], starts: Sequence[int], offsets: Sequence[int], x: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor, trees: Sequence[Tree | None] | None = None,
            tapped: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """In place: x is the last layer's output after the call.  Chains only (trees: None each)."""
        if trees and any(t is not None for t in trees):
            raise ValueError("the native int4 layers compute no token trees (LayerSet.tree)")
        if tapped:
            raise ValueError("the native int4 layers keep no intermediate layers' rows")
        lead = runners[0]
        sizes = [hi - lo for lo, hi in zip(offsets, offsets[1:])]
        assert x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
        model = self.kernel_model(lead, x.shape[1])
        caches = [a for r in runners for a in r._addresses]  # [R * layers * 2]
        kernels.layers.run(model, x, starts, sizes, caches, [r.capacity * lead.head_dim for r in runners], cos, sin)
        return x


class CatchUpLayers(LayerSet):
    """An int4 draft whose forwards of many rows (its catch-ups: the prompt at a generation's first draft, the
    tokens of plain steps it did not see) run on the int8 model's own weights, and its few-row forwards (a
    drafted token, the bonus token) on the int4 ones.

    A one-row step reads every weight once and is bound by memory, so fewer bytes win: on an AMD EPYC Zen 4
    (AVX-512 VNNI) the 0.5B draft's one-token step took 13 ms in int4 against 29 ms in int8.  A forward of
    many rows is bound by arithmetic, where the int8 kernel's VNNI path beats the int4 kernel's unpacking:
    there 64 rows took 136 ms in int8 against 254 ms in int4, and int8 was already the faster from 4 rows
    (BENCHMARKS.md, Zen 4 component timings).  Both write the same caches (keys and values in fp32), so
    the runner's rows may come from either; the drafted numbers are an approximation of the model's
    either way, which a draft's may be (specdec.native.int4): they never change the output."""

    dtype = "int4+int8"  # what its timings are keyed by: not those of an int4 draft that catches up in int4
    batch_invariant = False  # a row's numbers depend on how many rows its forward has

    def __init__(self, small: LayerSet, large: LayerSet, rows: int) -> None:
        super().__init__(small.layers, small.head)
        self.small, self.large, self.rows = small, large, rows
        self.backend = f"{small.backend} (catch-ups of {rows}+ tokens in int8)"
        self.native = small.native
        self.tappable = small.tappable and large.tappable
        self.tree = small.tree and large.tree

    @classmethod
    def build(cls, model: Any) -> Self:
        small = (NativeInt4Layers if _activation_code(model.config) >= 0 else Int4Layers).of(model)
        return cls(small, Int8Layers.of(model), INT8_CATCH_UP_ROWS)

    def run(self, runners: Sequence[LeanRunner], starts: Sequence[int], offsets: Sequence[int], x: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor, trees: Sequence[Tree | None] | None = None,
            tapped: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        side = self.large if x.shape[0] >= self.rows else self.small
        return side.run(runners, starts, offsets, x, cos, sin, trees, tapped)


# Rows from which an int4 draft's forward runs on the int8 weights where the int8 kernel takes its VNNI path
# (CatchUpLayers; Zen 4, the 0.5B, after 64 cached tokens: 1 / 2 / 3 / 4 / 8 rows 13 / 15 / 18 / 29 / 47 ms
# in int4 against 29 / 23 / 23 / 24 / 33 ms in int8, best of 5).
INT8_CATCH_UP_ROWS = 4


def int8_catch_ups() -> bool:
    """Whether int4 drafts run their catch-ups on the int8 weights by default: where the int8 kernel's
    AVX-512 VNNI path runs (on AVX2 both kernels multiply many rows at about the same speed, and the int8
    copy would cost memory for nothing)."""
    try:
        return kernels.int8.isa() == "avx512-vnni"
    except SpecdecError:  # no C compiler: no kernel at all
        return False


def choose_layers(model: Any, fp32: bool = False, int4: bool = False, int8_catch_up: bool | None = None) -> LayerSet:
    """The layer set a LeanRunner computes `model` with: an int8 model's own (Int8Layers), with fp32=True an
    fp32 model's (Fp32Layers), with int4=True an int8 model's weights in int4 (NativeInt4Layers, or
    Int4Layers for an activation the C layers lack), whose catch-ups run on its int8 weights
    (CatchUpLayers) where int8_catch_up says so (None: int8_catch_ups()); a SpecdecError for a model it
    cannot compute."""
    if not supports(model, fp32=fp32, int4=int4) or (int4 and not is_int8(model)):
        kinds = "an int8 or fp32" if fp32 else "an int8"
        archs = INT4_ARCHITECTURES if int4 else ARCHITECTURES
        raise SpecdecError(f"the lean runner needs {kinds} model of a {'/'.join(archs)} architecture")
    if int4:
        if int8_catch_up if int8_catch_up is not None else int8_catch_ups():
            return CatchUpLayers.of(model)
        return (NativeInt4Layers if _activation_code(model.config) >= 0 else Int4Layers).of(model)
    return Int8Layers.of(model) if is_int8(model) else Fp32Layers.of(model)


class Rotary:
    """The rotary cos / sin tables of a llama / qwen2 / mistral model with default or linear scaling, computed with
    the operations of transformers' rotary module for them (the same bits: tested), without importing its
    modeling code (a second at start): a GGUF model's (specdec.native.gguf), a saved int8 draft's
    (specdec.native.skeleton).

    `config`: a config, or its rope_parameters themselves (one layer type's: Gemma 3's, see RotaryTables).
    `factors` [D/2], where given: each frequency's divisor (a GGUF file's rope_freqs.weight, which llama.cpp's
    converter writes for Llama 3's rotary scaling: its inv_freq is base^(-2i/D) / factors[i], as llama.cpp
    divides each rotation angle by its factor)."""

    def __init__(self, config: Any, head_dim: int, factors: torch.Tensor | None = None) -> None:
        rope = config if isinstance(config, dict) else config.rope_parameters
        base = rope["rope_theta"]
        self.inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]
        if rope.get("rope_type") == "linear":
            self.inv_freq /= rope["factor"]
        if factors is not None:
            self.inv_freq = self.inv_freq / factors.float()

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, n] -> (cos, sin) [B, n, D] in x's dtype."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * 1.0).to(dtype=x.dtype), (emb.sin() * 1.0).to(dtype=x.dtype)  # attention scaling 1


class RotaryTables:
    """One Rotary per layer type (Gemma 3's sliding and full attention layers rotate with their own bases),
    called as LeanRunner calls a model's rotary module for a table of its `rope_kinds`: (x, positions, kind)."""

    def __init__(self, tables: dict[str, Rotary]) -> None:
        self.tables = tables

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables[kind](x, position_ids)


class LeanRunner(KeptHidden):
    """A ModelRunner over an int8 llama / qwen2 / mistral model (see the module doc); with fp32=True
    also over an fp32 one (the batched engine's; a single fp32 sequence runs on HFRunner); with
    int4=True over the int8 model's weights in int4 (a draft model's: specdec.native.int4, not the
    model's own numbers).  The flags choose its layer set (choose_layers); `layer_set` gives one
    directly (one of this model's, e.g. a runner's own: LeanRunner.clone)."""

    def __init__(self, model: Any, max_context: int | None = None, fp32: bool = False, int4: bool = False,
                 layer_set: LayerSet | None = None, int8_catch_up: bool | None = None) -> None:
        # shared by the model's runners
        self.layer_set = layer_set or choose_layers(model, fp32=fp32, int4=int4, int8_catch_up=int8_catch_up)
        config = model.config
        self.model = model  # kept for its config, generation config and eos ids
        inner = model.model
        gemma = config.model_type in GEMMA
        attention = attention_shape(config)
        self.embed = inner.embed_tokens.weight.detach()  # [V, hidden]
        self.act: Callable[[torch.Tensor], torch.Tensor] = inner.layers[0].mlp.act_fn
        self._setup(
            embed_rows=self.embed.shape[0],
            # Gemma scales its embeddings (by sqrt(hidden), an fp32 0-d tensor) and its norms by 1 + w
            embed_scale=inner.embed_tokens.embed_scale.float() if gemma else None,
            final_norm=_gemma_norm(inner.norm) if gemma else inner.norm.weight.detach(),
            eps=float(config.rms_norm_eps), num_heads=attention.heads, num_kv_heads=attention.kv_heads,
            head_dim=attention.head_dim,
            max_context=max_context or model_max_context(model), rotary=inner.rotary_emb,
            rope_kinds=_rope_kinds(config))

    def _setup(self, embed_rows: int, embed_scale: torch.Tensor | None, final_norm: torch.Tensor, eps: float,
               num_heads: int, num_kv_heads: int, head_dim: int, max_context: int, rotary: Any,
               rope_kinds: list[str | None], logit_softcap: float | None = None) -> None:
        """The model's shapes and shared tensors (after layer_set and model are set), and an empty cache.
        logit_softcap: the logits capped to c * tanh(logits / c) (Gemma 2's final soft-capping; None: not)."""
        self.logit_softcap = logit_softcap
        # int8 models are batch-invariant (specdec.native.quant); fp32 ones are not
        self.capabilities = Capabilities(batch_invariant=self.layer_set.batch_invariant, hidden_states=True,
                                         taps=self.layer_set.tappable, tree=self.layer_set.tree, trim_head=True)
        self.embed_rows = embed_rows  # the token ids the embedding has
        self.embed_scale = embed_scale
        self.final_norm = final_norm  # [hidden]
        self.eps = eps
        self.head: Linear | TrimmedHead = self.layer_set.head  # trim_head() may swap it for a trimmed one
        self.head_ids: torch.Tensor | None = None  # [N]: the vocabulary ids of the logits' columns (None: all V)
        self._fixed: TrimmedHead | None = None  # the trimmed head's set (trim_head), before any extra ids
        self.vocab_size = self.layer_set.head.out_features
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.max_context = max_context
        self._rotary = rotary
        self._rope_kinds = rope_kinds
        self._cos = self._sin = torch.empty(len(self._rope_kinds), 0, self.head_dim)  # [tables, positions, D]
        self.tokens: list[int] = []
        self.capacity = 0
        self.keys: list[torch.Tensor] = []  # per layer [H_kv, capacity, D]
        self.values: list[torch.Tensor] = []
        self._addresses: list[int] = []  # keys[0], values[0], keys[1], ... for layers.c (set by _reserve)
        self._hidden: torch.Tensor | None = None  # [n, hidden]: the head's input in the last forward
        self._tail: torch.Tensor | None = None  # [m, hidden]: the last forward's last m rows, _hidden their end
        self.hidden_rows = 0  # keep_hidden_rows: rows of each forward to keep beyond the logits'
        self.taps: tuple[int, ...] = ()  # tap_layers: layers whose outputs follow the final hidden states' columns
        # the last forward_tree's (cached, tree) until keep_rows, rollback or reset settles it
        self._tree: tuple[int, Tree] | None = None

    def embed_tokens(self, tokens: Sequence[int]) -> torch.Tensor:
        """The embedding's rows of `tokens` [n, hidden] fp32 (before any scaling)."""
        return F.embedding(torch.tensor(list(tokens)), self.embed)

    def _reserve(self, length: int) -> None:
        """Room in the cache and the rotary table for `length` positions: by doubling, unless expect() made it."""
        if length > self.capacity:
            self._resize(min(max(length, 2 * self.capacity, _INITIAL_CAPACITY), self.max_context))

    def _resize(self, capacity: int) -> None:
        """The cache and the rotary tables for exactly `capacity` positions, the cached tokens copied over."""
        shape = (self.num_kv_heads, capacity, self.head_dim)
        used = len(self.tokens)
        for cache in (self.keys, self.values):
            for i in range(len(self.layer_set.layers)):
                resized = torch.empty(shape, dtype=CACHE_DTYPE)
                if i < len(cache):
                    resized[:, :used] = cache[i][:, :used]
                    cache[i] = resized
                else:
                    cache.append(resized)
        positions = torch.arange(capacity)[None]  # [1, capacity]
        # [1, capacity, D] each per table, the model's own computation
        probe = torch.zeros(1, 1)  # the rotary module reads only its dtype and device
        tables = [self._rotary(probe, positions, *(() if kind is None else (kind,))) for kind in self._rope_kinds]
        self._cos = torch.cat([cos for cos, _ in tables])  # [tables, capacity, D]
        self._sin = torch.cat([sin for _, sin in tables])
        self.capacity = capacity
        self._addresses = [t.data_ptr() for pair in zip(self.keys, self.values) for t in pair]

    def footprint(self) -> Footprint:
        """Its fp32 cache's bytes per token and a forward's per row (ModelRunner.footprint); a long prefill in
        chunks where the runner is batch-invariant (forward_chunked)."""
        return decoder_footprint(len(self.layer_set.layers), self.num_kv_heads, self.head_dim, self.num_heads,
                                 int(self.final_norm.shape[0]), self.layer_set.intermediate, self.head.out_features,
                                 CACHE_DTYPE.itemsize, chunked=self.capabilities.batch_invariant)

    def expect(self, tokens: int) -> None:
        """Room for `tokens` cached tokens now, exactly (capped at max_context; ModelRunner.expect): a long
        request's cache is allocated once, not doubled up to twice its need."""
        tokens = min(int(tokens), self.max_context)
        if tokens > self.capacity:
            self._resize(tokens)

    def trim(self, tokens: int) -> int:
        """Keep at most the first `tokens` cached tokens, in a cache of their size (at least the initial one);
        the larger one is freed (ModelRunner.trim).  Returns the bytes freed."""
        if self._tree is not None:  # a token tree left half settled: nothing in it is worth keeping
            self.reset()
        del self.tokens[max(0, int(tokens)):]
        capacity = max(len(self.tokens), _INITIAL_CAPACITY)
        if capacity >= self.capacity:
            return 0
        freed = (self.capacity - capacity) * self.footprint().cache_bytes_per_token
        self._resize(capacity)
        return freed

    def _check(self, new_tokens: Sequence[int]) -> list[int]:
        check_forward(self._tree)
        new_tokens = list(new_tokens)
        if not new_tokens:
            raise ValueError("forward needs at least one token")
        if len(self.tokens) + len(new_tokens) > self.max_context:
            raise SpecdecError(f"context of {len(self.tokens) + len(new_tokens)} tokens exceeds the model's window "
                               f"of {self.max_context}")
        if min(new_tokens) < 0 or max(new_tokens) >= self.embed_rows:
            raise ValueError(f"token ids must be in [0, {self.embed_rows})")
        return new_tokens

    def forward(self, new_tokens: Sequence[int], last_n: int | None = None) -> torch.Tensor:
        return forward_packed([self], [new_tokens], [last_n])[0]

    def forward_tree(self, new_tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Append a token tree (ModelRunner.forward_tree): fp32 logits [n, V], row i bitwise a chain forward's
        over token i's path for an int8 model.  hidden() and hidden_tail() are then the n nodes' final
        hidden states [n, hidden], row i of node i, until keep_rows narrows them to the kept path's."""
        if not self.capabilities.tree:
            raise SpecdecError(f"the {self.describe()} lean runner cannot verify a token tree")
        new_tokens = list(new_tokens)
        return forward_packed([self], [new_tokens], [None], trees=[Tree(parents, len(new_tokens))])[0]

    @torch.inference_mode()  # the caches are inference tensors
    def keep_rows(self, cached: int, rows: Sequence[int]) -> None:
        """After forward_tree over `cached` tokens, keep those and the tree's nodes `rows` (a root-to-node
        path; ModelRunner.keep_rows): their keys and values move to positions cached, cached + 1, ..., and
        hidden() / hidden_tail() become those rows' [len(rows), hidden], as after a chain forward over them."""
        rows = kept_rows(self._tree, cached, rows)
        if rows != list(range(len(rows))):  # the path is not already in place
            source = torch.tensor(rows) + cached  # [m]: ascending, each >= its destination
            for cache in (*self.keys, *self.values):
                cache[:, cached : cached + len(rows)] = cache[:, source]  # [H_kv, m, D]
        new = self.tokens[cached:]
        self.tokens[cached:] = [new[r] for r in rows]
        if self._hidden is not None:
            self._hidden = self._tail = self._hidden[rows]  # [m, hidden]: a tree forward keeps every row
        self._tree = None

    def tap_layers(self, layers: Sequence[int]) -> None:
        """From the next forward on, hidden() and hidden_tail() rows hold the outputs of these decoder layers
        (0-based: the residual stream after layer i, before any norm) after the final hidden state: [n, hidden
        x (1 + len(layers))].  A fused-feature head reads them (EAGLE-3's low, middle and high layers)."""
        taps = checked_taps(layers, len(self.layer_set.layers))
        if taps and not self.capabilities.taps:
            raise SpecdecError(f"the {self.describe()} lean runner keeps no intermediate layers' rows")
        self.taps = taps

    def draft_greedy(self, feed: Sequence[int], k: int) -> list[int]:
        """Refused: the lean runner's layer sets draft token by token (the gguf runner overrides it)."""
        raise refused(self, "drafts no chain in one call")

    def rollback(self, n: int) -> None:
        check_rollback(self._tree, n)
        self._tree = None
        del self.tokens[n:]  # the cache rows past n are simply overwritten later

    def reset(self) -> None:
        self.tokens, self._tree = [], None
        self._hidden = self._tail = None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return model_eos_token_ids(self.model)

    def clone(self) -> LeanRunner:
        twin = LeanRunner(self.model, self.max_context, layer_set=self.layer_set)
        twin.trim_head(None if self._fixed is None else self._fixed.ids)
        return twin

    def trim_head(self, ids: torch.Tensor | None) -> None:
        """From the next forward on, compute logits over vocabulary ids `ids` [N] only (a draft's trimmed
        vocabulary: specdec.drafters.draft_vocab): forward returns [n, N], column j bitwise the full head's column
        ids[j] (TrimmedHead), and head_ids says which; None: the whole vocabulary again ([n, vocab_size])."""
        self._fixed = None if ids is None else self.layer_set.trimmed_head(ids)
        self.head = self._fixed or self.layer_set.head
        self.head_ids = None if self._fixed is None else self._fixed.ids

    def extend_head(self, extra: Sequence[int]) -> None:
        """A trimmed head's set (trim_head) and the ids `extra` among those outside it (a request's context:
        specdec.drafters.model.ModelDrafter), in place of any extra ids before; logits then [n, N + E], head_ids
        the set's then these.  Nothing for an untrimmed head."""
        if self._fixed is None:
            return
        fixed = self._fixed.fixed
        wanted = torch.tensor(sorted({int(t) for t in extra}), dtype=torch.int64)
        wanted = wanted[(wanted >= 0) & (wanted < self.vocab_size)]
        wanted = wanted[~torch.isin(wanted, fixed)]
        assert self.head_ids is not None  # trimmed
        if torch.equal(wanted, self.head_ids[len(fixed):]):  # the same extra ids as now
            return
        self.head = self._fixed.extended(wanted) if wanted.numel() else self._fixed
        self.head_ids = self.head.ids

    def describe(self) -> str:
        trimmed = f", a head of {self.head.out_features:,} tokens" if self.head_ids is not None else ""
        return self.layer_set.backend + trimmed

    def identity(self) -> dict[str, Any]:
        return self._trimmed_identity(model_identity(type(self).__name__, self.model, self.layer_set.dtype))

    def _trimmed_identity(self, identity: dict[str, Any]) -> dict[str, Any]:
        """`identity` with the trimmed head's size and ids (a digest) where the head is trimmed: what the
        profile's cached timings are keyed by (a drafted token costs less)."""
        if self._fixed is None:
            return identity
        digest = hashlib.sha256(self._fixed.ids.numpy().tobytes()).hexdigest()[:16]
        return {**identity, "head_rows": self._fixed.out_features, "head_ids": digest}


@torch.inference_mode()
def forward_packed(runners: Sequence[LeanRunner], chunks: Sequence[Sequence[int]],
                   last_ns: Sequence[int | None], trees: Sequence[Tree | None] | None = None) -> list[torch.Tensor]:
    """One forward for several runners over the same model: runner r appends chunks[r] to its cache
    and gets fp32 logits [n_r, V] for the last last_ns[r] (None: all) of them.

    The chunks are packed one after another into one [total, hidden] matrix: norms, projections,
    rotary embeddings and the MLP are per token; each chunk attends to its own runner's cache.
    trees[r], where given and not None, makes chunk r a token tree of that shape (LeanRunner.forward_tree:
    last_ns[r] must be None; the runner then waits for keep_rows).
    """
    trees = list(trees) if trees is not None else [None] * len(runners)
    if not runners or len(runners) != len(chunks) or len(chunks) != len(last_ns) or len(trees) != len(runners):
        raise ValueError("forward_packed needs one chunk, one last_n and one tree (or None) per runner")
    if any(t is not None and (last_n is not None or len(t) != len(c)) for t, c, last_n in zip(trees, chunks, last_ns)):
        raise ValueError("a tree chunk needs one parent per token and every row's logits (last_n None)")
    if len({id(r) for r in runners}) != len(runners):
        raise ValueError("a runner appears twice in one packed forward")
    lead = runners[0]
    if any(r.layer_set is not lead.layer_set or r.head is not lead.head for r in runners):
        raise ValueError("a packed forward needs runners over the same model and head")
    chunks = [r._check(c) for r, c in zip(runners, chunks)]
    starts = [len(r.tokens) for r in runners]
    for r, start, c in zip(runners, starts, chunks):
        r._reserve(start + len(c))
    sizes = [len(c) for c in chunks]
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]  # chunk i is rows offsets[i]:offsets[i + 1]
    total = offsets[-1]
    # each chunk's rotary rows: a chain's positions s .., a tree's s + depth
    at = [slice(s, s + n) if t is None else s + t.depth_index for s, n, t in zip(starts, sizes, trees)]
    cos = torch.cat([r._cos[:, a] for r, a in zip(runners, at)], dim=1)  # [tables, total, D]
    sin = torch.cat([r._sin[:, a] for r, a in zip(runners, at)], dim=1)
    x = lead.embed_tokens([t for c in chunks for t in c])  # [total, hidden]
    if lead.embed_scale is not None:
        x = x * lead.embed_scale
    taps = sorted({i for r in runners for i in r.taps})  # every layer some runner taps (tap_layers)
    tapped = dict.fromkeys(taps, x) if taps else None  # layer -> its output [total, hidden], set by run()
    x = lead.layer_set.run(runners, starts, offsets, x, cos, sin, trees, tapped)  # [total, hidden]
    keeps = [n if last_n is None else min(last_n, n) for n, last_n in zip(sizes, last_ns)]
    # the rows to norm: the logits' and, where a runner keeps more hidden rows, its chunk's last ones
    tails = [max(keep, min(r.hidden_rows, n)) for r, keep, n in zip(runners, keeps, sizes)]

    def pick(rows: torch.Tensor) -> torch.Tensor:  # [total, hidden] -> the kept rows [sum tails, hidden]
        if len(runners) == 1:
            return rows[total - tails[0] :]
        return torch.cat([rows[hi - tail : hi] for hi, tail in zip(offsets[1:], tails)])

    normed = lead.layer_set.norm(pick(x), lead.final_norm, lead.eps)  # [sum tails, hidden]: the final hidden states
    finals = normed.split(tails)  # runner r's [tail_r, hidden]
    rows = finals  # runner r's [tail_r, F]: its final hidden states, then its tapped layers' rows
    if tapped:
        columns = {i: pick(tapped[i]).split(tails) for i in taps}  # layer -> runner r's [tail_r, hidden]
        rows = tuple(torch.cat([final, *(columns[i][j] for i in r.taps)], dim=1) if r.taps else final
                     for j, (r, final) in enumerate(zip(runners, finals)))
    hiddens = [tail[tail.shape[0] - keep :] for tail, keep in zip(rows, keeps)]  # runner r's [keep_r, F]
    if tails == keeps:
        logits = lead.head(normed)  # [sum keeps, V]
    else:  # the head over the logits' rows only
        ends = [final[final.shape[0] - keep :] for final, keep in zip(finals, keeps)]  # runner r's [keep_r, hidden]
        logits = lead.head(ends[0] if len(runners) == 1 else torch.cat(ends))  # [sum keeps, V]
    if lead.logit_softcap:  # elementwise: a trimmed head's columns are still the full head's
        logits = torch.tanh(logits / lead.logit_softcap) * lead.logit_softcap
    for r, c, tail, hidden, start, tree in zip(runners, chunks, rows, hiddens, starts, trees):
        r.tokens.extend(c)
        r._tail, r._hidden = tail, hidden  # [tail_r, F], [keep_r, F]: views, no copy where F is hidden
        r._tree = None if tree is None else (start, tree)
    return list(logits.split(keeps)) if len(runners) > 1 else [logits]

