"""A lean runner for int8 llama-family decoders: the int8 model's own numbers, with less work per token.

A transformers model quantized by :mod:`specdec.backends.quant` spends a good
part of each one-token step outside its matrix kernels: module dispatch,
keyword plumbing, mask building, a cache that grows by concatenation.  This
runner computes the same network (llama, qwen2 and mistral architectures)
directly from the quantized model's tensors, gpt-fast style:

- q/k/v and gate/up projections fused into one Int8Linear each.  Weights and
  scales are per output channel and each token's activation scale is the same
  for all of them, so concatenating output channels changes no number;
- the rotary cos/sin table computed once, by the model's own rotary module,
  for every position;
- a preallocated KV cache per layer ([H_kv, capacity, D], grown by doubling):
  rollback moves a length, nothing is copied;
- the fused weights are packed for fbgemm when the runner is built; the
  transformers model's own q/k/v and gate/up linears stay unpacked int8
  values (packed only if that model is itself run, e.g. by transformers'
  generate in the benchmark);
- the same elementwise and reduction operations in the same order as the
  transformers model, and attention through the same
  :func:`specdec.backends.quant.rowwise_attention` rows.

So its logits are bitwise those of the quantized transformers model (tested on
tiny and real models), and it inherits its batch invariance: speculative
output equals plain output.  Other architectures (Gemma 3, ...) run the
quantized transformers model through :class:`specdec.backends.hf.HFRunner`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from specdec.backends.base import Capabilities
from specdec.backends.hf import model_max_context
from specdec.backends.quant import Int8Linear, is_int8, pack_all
from specdec.errors import SpecdecError

ARCHITECTURES = ("llama", "qwen2", "mistral")
STATIC_ROPE = ("default", "linear", "llama3")  # inv_freq does not change with the sequence length
_INITIAL_CAPACITY = 256


def supports(model: Any) -> bool:
    """Whether `model` is an int8 transformers model this runner can compute exactly."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in ARCHITECTURES or not is_int8(model):
        return False
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope.get("rope_type", rope.get("type", "default")) in STATIC_ROPE


def fuse(linears: Sequence[Int8Linear]) -> Int8Linear:
    """One Int8Linear whose output is the concatenation of the given ones' outputs (bitwise)."""
    biases = [lin.bias for lin in linears]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("cannot fuse linears where only some have a bias")
    weight = torch.cat([lin.int8_weight() for lin in linears])  # [sum N, K]
    scale = torch.cat([lin.scale for lin in linears])  # [sum N]
    bias = None if biases[0] is None else torch.cat(biases)
    return Int8Linear(weight, scale, bias)


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
    qkv: Int8Linear  # hidden -> (H + 2 H_kv) D
    o: Int8Linear  # H D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Int8Linear  # hidden -> 2 I
    down: Int8Linear  # I -> hidden
    scaling: float
    sliding_window: int | None


_FUSED: "weakref.WeakKeyDictionary[Any, list[_Layer]]" = weakref.WeakKeyDictionary()


def _fused_layers(model: Any) -> list[_Layer]:
    """The model's layers with fused, packed projections, built once per model (packing takes seconds)
    and shared by all its runners: a runner owns only its KV cache."""
    layers = _FUSED.get(model)
    if layers is None:
        config = model.config
        layers = [
            _Layer(
                input_norm=layer.input_layernorm.weight.detach(),
                qkv=fuse([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                o=layer.self_attn.o_proj,
                post_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=fuse([layer.mlp.gate_proj, layer.mlp.up_proj]),
                down=layer.mlp.down_proj,
                scaling=float(layer.self_attn.scaling),
                sliding_window=_sliding_window(config, layer.self_attn),
            )
            for layer in model.model.layers
        ]
        pack_all([model.lm_head, *(lin for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))])
        _FUSED[model] = layers
    return layers


class LeanRunner:
    """A ModelRunner over an int8 llama / qwen2 / mistral model (see the module doc)."""

    capabilities = Capabilities(rollback=True, logits_all_positions=True, batching=False, batch_invariant=True)

    def __init__(self, model: Any, max_context: int | None = None) -> None:
        if not supports(model):
            raise SpecdecError(f"the lean runner needs an int8 model of a {'/'.join(ARCHITECTURES)} architecture")
        config = model.config
        self.model = model  # kept for its config, generation config and eos ids
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach()  # [V, hidden]
        self.final_norm = inner.norm.weight.detach()
        self.eps = float(config.rms_norm_eps)
        self.head: Int8Linear = model.lm_head
        self.vocab_size = self.head.out_features
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.max_context = max_context or model_max_context(model)
        self.act: Callable[[torch.Tensor], torch.Tensor] = inner.layers[0].mlp.act_fn
        self.layers = _fused_layers(model)  # shared by every runner over this model
        self.intermediate = self.layers[0].gate_up.out_features // 2
        self._rotary = inner.rotary_emb
        self._cos = self._sin = torch.empty(0, self.head_dim)  # [positions, D], grown with the cache
        self.tokens: list[int] = []
        self.capacity = 0
        self.keys: list[torch.Tensor] = []  # per layer [H_kv, capacity, D]
        self.values: list[torch.Tensor] = []

    def _reserve(self, length: int) -> None:
        """Room in the cache and the rotary table for `length` positions."""
        if length <= self.capacity:
            return
        capacity = min(max(length, 2 * self.capacity, _INITIAL_CAPACITY), self.max_context)
        shape = (self.num_kv_heads, capacity, self.head_dim)
        used = len(self.tokens)
        for cache in (self.keys, self.values):
            for i in range(len(self.layers)):
                grown = torch.empty(shape)
                if i < len(cache):
                    grown[:, :used] = cache[i][:, :used]
                    cache[i] = grown
                else:
                    cache.append(grown)
        positions = torch.arange(capacity)[None]  # [1, capacity]
        cos, sin = self._rotary(self.embed[:1], positions)  # [1, capacity, D] each, the model's own computation
        self._cos, self._sin = cos[0], sin[0]
        self.capacity = capacity

    @torch.inference_mode()
    def forward(self, new_tokens: Sequence[int], last_n: int | None = None) -> torch.Tensor:
        new_tokens = list(new_tokens)
        if not new_tokens:
            raise ValueError("forward needs at least one token")
        start, n = len(self.tokens), len(new_tokens)
        if start + n > self.max_context:
            raise SpecdecError(f"context of {start + n} tokens exceeds the model's window of {self.max_context}")
        if min(new_tokens) < 0 or max(new_tokens) >= self.embed.shape[0]:
            raise ValueError(f"token ids must be in [0, {self.embed.shape[0]})")
        self._reserve(start + n)
        end = start + n
        cos, sin = self._cos[start:end], self._sin[start:end]  # [n, D]
        h_q, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(torch.tensor(new_tokens), self.embed)  # [n, hidden]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, self.eps)
            qkv = layer.qkv(h)  # [n, (H + 2 H_kv) D]
            # q and k rotated in one go: the same elementwise operations on every element
            qk = rotate(qkv[:, : (h_q + h_kv) * d].view(n, h_q + h_kv, d).transpose(0, 1), cos, sin)  # [H + H_kv, n, D]
            q, k = qk[:h_q], qk[h_q:]  # [H, n, D], [H_kv, n, D]
            v = qkv[:, (h_q + h_kv) * d :].view(n, h_kv, d).transpose(0, 1)  # [H_kv, n, D]
            keys, values = self.keys[i], self.values[i]
            keys[:, start:end] = k
            values[:, start:end] = v
            attn = _rowwise(q, keys, values, start, layer.scaling, layer.sliding_window)  # [n, H D]
            x = x + layer.o(attn)
            h = rms_norm(x, layer.post_norm, self.eps)
            gate_up = layer.gate_up(h)  # [n, 2 I]
            x = x + layer.down(self.act(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :])
        self.tokens.extend(new_tokens)
        keep = n if last_n is None else min(last_n, n)
        x = rms_norm(x[n - keep :], self.final_norm, self.eps)
        return self.head(x)  # [keep, V]

    def rollback(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"rollback to a negative length {n}")
        del self.tokens[n:]  # the cache rows past n are simply overwritten later

    def reset(self) -> None:
        self.tokens = []


def _sliding_window(config: Any, attention: Any) -> int | None:
    """The window each architecture's attention passes to the attention function (None: full)."""
    if config.model_type == "qwen2":
        return getattr(attention, "sliding_window", None)  # per layer type
    if config.model_type == "mistral":
        return getattr(config, "sliding_window", None)
    return None  # llama


def _rowwise(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scaling: float,
             window: int | None) -> torch.Tensor:
    """rowwise_attention's rows over this runner's cache: q [H, n, D] at positions start.. -> [n, H D]."""
    n = q.shape[1]
    gqa = q.shape[0] != keys.shape[0]
    rows = []
    for i in range(n):
        end = start + i + 1
        lo = max(0, end - window) if window else 0
        rows.append(F.scaled_dot_product_attention(
            q[None, :, i : i + 1], keys[None, :, lo:end], values[None, :, lo:end], scale=scaling, enable_gqa=gqa,
        ))  # [1, H, 1, D]
    out = rows[0] if n == 1 else torch.cat(rows, dim=2)  # [1, H, n, D]
    return out.transpose(1, 2).reshape(n, -1)
