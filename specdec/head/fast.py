"""The draft head's inference form: its linears on specdec's int8 (or int4) CPU kernels, the rest in plain torch.

A drafted token costs one forward of the head (specdec.head.model.DraftHead): fc [2H -> H], one decoder
layer (q/k/v/o, gate/up/down) and the LM head [H -> N]; for a 1.5B target's shapes that is ~100M
weights, which in fp32 a token reads as ~400 MB, far over the twentieth of a target step a head may
cost (issue 38).  Like the int8 target (specdec.native.lean), :class:`FastHead` computes the same
network with its linears quantized once, when the head is loaded for drafting:

- int8 (the default where the kernel multiplies in SIMD: AVX-512 VNNI or AVX2): every linear an
  :class:`specdec.native.quant.Int8Linear` (W8A8, the int8 target's own kernel), q/k/v and gate/up
  fused into one linear each (the same numbers as apart: per output channel weights, one activation
  scale per token) -- except fc's half that reads the target's feature, which stays fp32 (below);
- int4 (on request): the same weights group-wise in 4 bits (:class:`specdec.native.int4.Int4Linear`,
  the int4 drafts' kernel): fewer bytes a token, a coarser approximation;
- fp32: the trained weights as they are (lean's FloatLinear), where specdec's kernel does not run
  (no C compiler) or multiplies without SIMD; describe() says which and why.

fc [2H -> H] reads concat(f_t, embed(x_{t+1})): it runs as two linears whose outputs add up, one on
the feature and one on the embedding, since one activation scale over both would round the small
embedding away next to the feature's large entries.  The feature's half stays fp32: the target's final
hidden states have a few huge channels (max |f| is ~15 times the rms on the 1.5B), so a 7-bit
per-token quantization of f adds ~7% noise to the head's logits; in fp32 this linear (H x H, 9 MB)
costs ~7% more bytes a token and the int8 head's first tokens agreed with the fp32 head's on 0.94 of
256 positions of real text instead of 0.86 (qwen2.5-coder-1.5b, a smoke-trained head).

Norms, rotary embeddings, the activation and residuals are the head's own per-token operations
(specdec.native.lean.rms_norm / rotate: transformers' operations for llama and qwen2); attention runs
over the head's own short cache (a :class:`specdec.head.model.HeadCache`, as the fp32 head's) with
PyTorch's scaled-dot-product attention.  The head's embedding table and rotary embedding stay the
target's (shared, not copied).

Its proposals are an approximation of the fp32 head's (tested: nearly all greedy drafts agree); what a
head proposes never changes the output, since the loop verifies every token.  It has the interface
HeadDrafter uses (draft / draft_from / expand / extend / extend_tree / vocab / config / target_ids / eval), so the
drafter runs either form, chains and EAGLE-2 trees alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecdecError
from specdec.head.model import DraftHead, HeadCache, HeadDrafting, causal_mask, fuse_features, tree_mask
from specdec.native.int4 import Int4Linear
from specdec.native.lean import FloatLinear, rms_norm, rotate
from specdec.native.modelconfig import attention_shape
from specdec.native.quant import Int8Linear, pack_all, quantize_weight

DTYPES = ("auto", "int8", "int4", "fp32")
SIMD = ("avx512-vnni", "avx2")  # the int8 kernel's paths that beat fp32 (specdec.native.kernels.int8.isa)


def kernel_path() -> tuple[str | None, str]:
    """(the int8 kernel's path on this CPU, or None where it cannot run; why it does not run fast, or "")."""
    try:
        from specdec.native import kernels

        isa = kernels.int8.isa()
    except SpecdecError as e:  # no C compiler to build the kernels
        return None, str(e)
    except OSError as e:  # the library did not load
        return None, f"specdec's kernels did not load ({e})"
    if isa not in SIMD:
        return isa, "specdec's int8 kernel has no AVX2 or AVX-512 VNNI path on this CPU"
    return isa, ""


def choose_dtype(dtype: str = "auto") -> tuple[str, str]:
    """(the dtype the head runs in, a note on why when it is not the one asked for).  "auto": int8 where the
    kernel multiplies in SIMD, else fp32; "int8"/"int4" fall back to fp32 where the kernels do not run."""
    if dtype not in DTYPES:
        raise SpecdecError(f"a draft head runs in {', '.join(DTYPES)}, not {dtype}")
    if dtype == "fp32":
        return "fp32", ""
    isa, why = kernel_path()
    if isa is None or (dtype == "auto" and why):
        return "fp32", f"fp32: {why}"
    return ("int8" if dtype == "auto" else dtype), ""


def _quantize(weight: torch.Tensor, bias: torch.Tensor | None, dtype: str) -> Any:
    """A linear y = x weight^T + bias (weight [N, K]) on `dtype`'s kernel: int8, int4 or fp32."""
    if dtype == "fp32":
        return FloatLinear(weight.detach().float().contiguous(), None if bias is None else bias.detach().float())
    int8 = Int8Linear(*quantize_weight(weight), bias)
    return Int4Linear.from_int8(int8) if dtype == "int4" else int8


def _side_by_side(linears: list[nn.Linear], dtype: str) -> Any:
    """One linear computing the given nn.Linears' outputs side by side (their outputs concatenated)."""
    biases = [lin.bias for lin in linears]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    return _quantize(torch.cat([lin.weight.detach() for lin in linears]), bias, dtype)


class FastHead(HeadDrafting):  # the autoregressive draft and the tree: the fp32 head's own
    """A DraftHead's inference form over quantized linears (see the module docstring); built once from a
    trained head, whose vocabulary, config, norms and shared target tables it keeps."""

    def __init__(self, head: DraftHead, dtype: str = "auto") -> None:
        self.dtype, self.note = choose_dtype(dtype)
        config = head.config
        layer, attention, mlp = head.layer, head.layer.self_attn, head.layer.mlp
        self.config = config
        self.vocab = head.vocab  # [N] draft id -> target id
        self.window = head.window  # the positions a query attends to (None: all)
        self.taps = head.taps  # the target's layers its verified pairs' features carry (DraftHead.fused)
        embed, self.rotary = head._shared  # the target's embedding table and rotary embedding
        self.embed = embed.weight.detach()  # [V, H]
        self._cos = self._sin = torch.empty(0, 0)  # [positions, D]: the rotary table, grown by doubling
        self.heads, self.kv_heads, self.head_dim = attention_shape(config)
        self.scaling = float(attention.scaling)
        self.eps = float(config.rms_norm_eps)
        self.act: Callable[[torch.Tensor], torch.Tensor] = mlp.act_fn
        self.input_norm = layer.input_layernorm.weight.detach().float()  # [H]
        self.post_norm = layer.post_attention_layernorm.weight.detach().float()  # [H]
        self.final_norm = head.norm.weight.detach().float()  # [H]
        self.intermediate = mlp.gate_proj.out_features  # I
        with torch.no_grad():
            # fc [2H -> H] as two linears, on the feature and on the embedding (their sum is fc's output); the
            # feature's half stays fp32 (see the module docstring).
            hidden = config.hidden_size
            self.fc_feature = _quantize(head.fc.weight[:, :hidden], head.fc.bias, "fp32")  # H -> H
            self.fc_embed = _quantize(head.fc.weight[:, hidden:], None, self.dtype)  # H -> H
            # the tapped layers' projection stays fp32 as the feature's half of fc does (a verified pair's only)
            self.fuse = _quantize(head.fuse.weight, None, "fp32") if self.taps else None  # taps H -> H
            qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
            self.qkv = _side_by_side(qkv, self.dtype)  # H -> (Hq + 2 Hkv) D
            self.o = _side_by_side([attention.o_proj], self.dtype)  # Hq D -> H
            self.gate_up = _side_by_side([mlp.gate_proj, mlp.up_proj], self.dtype)  # H -> 2 I
            self.down = _side_by_side([mlp.down_proj], self.dtype)  # I -> H
            self.lm_head = _side_by_side([head.lm_head], self.dtype)  # H -> N
        linears = (self.fc_feature, self.fc_embed, self.qkv, self.o, self.gate_up, self.down, self.lm_head)
        pack_all([lin for lin in linears if isinstance(lin, Int8Linear)])

    @property
    def width(self) -> int:
        """F, a verified pair's feature width (DraftHead.width)."""
        return self.config.hidden_size * (1 + len(self.taps))

    def eval(self) -> FastHead:
        """Already an inference form (HeadDrafter calls eval() on the head it is given)."""
        return self

    def describe(self) -> str:
        """How the head runs, e.g. "int8 (specdec kernel)", or "fp32: <why the kernels do not run>"."""
        return self.note or (f"{self.dtype} (specdec kernel)" if self.dtype != "fp32" else "fp32")

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (same shape)."""
        return self.vocab[draft_ids]

    def rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, D] of positions start..start + n - 1 (the rotary embedding's own values, computed for
        a table of positions once and again each time it doubles)."""
        if start + n > self._cos.shape[0]:
            positions = torch.arange(max(start + n, 2 * self._cos.shape[0], 256))[None]  # [1, P]
            cos, sin = self.rotary(self.embed[:1].float(), positions)  # each [1, P, D], fp32
            self._cos, self._sin = cos[0], sin[0]
        return self._cos[start: start + n], self._sin[start: start + n]

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, cache: HeadCache, position: int | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """features [n, H or F] (f_t; DraftHead.fused), tokens [n] (x_{t+1}) after the cache's positions -> (predicted features
        [n, H], draft logits [n, N]); their keys and values go into `cache`.  A tree level (extend_tree)
        puts all n at one rotary `position` under its additive mask [1, 1, n, past + n] (tree_mask)."""
        n, past = tokens.shape[0], cache.length
        h_q, h_kv, d = self.heads, self.kv_heads, self.head_dim
        embedded = self.embed.index_select(0, tokens).float()  # [n, H]
        features = fuse_features(features.float(), self.config.hidden_size, len(self.taps), self.fuse)  # [n, H]
        x = self.fc_feature(features) + self.fc_embed(embedded)  # [n, H]: fc(concat(f, e))
        if position is None:
            cos, sin = self.rope(past, n)  # each [n, D]
        else:
            cos, sin = (table.expand(n, -1) for table in self.rope(position, 1))  # each [n, D]
        qkv = self.qkv(rms_norm(x, self.input_norm, self.eps))  # [n, (Hq + 2 Hkv) D]
        qk = qkv[:, : (h_q + h_kv) * d].view(n, h_q + h_kv, d).transpose(0, 1)  # [Hq + Hkv, n, D]
        qk = rotate(qk, cos, sin)  # q and k rotated in one go
        v = qkv[:, (h_q + h_kv) * d :].view(n, h_kv, d).transpose(0, 1)  # [Hkv, n, D]
        keys, values = cache.update(qk[None, h_q:], v[None], 0)  # each [1, Hkv, past + n, D]
        if mask is None and n > 1:
            mask = causal_mask(n, past, x.dtype, self.window)  # [1, 1, n, past + n]
        elif mask is None and self.window is not None and past + 1 > self.window:  # one query: the last keys
            keys, values = keys[:, :, -self.window:], values[:, :, -self.window:]
        attn = F.scaled_dot_product_attention(qk[None, :h_q], keys, values, attn_mask=mask, scale=self.scaling,
                                              enable_gqa=h_q != h_kv)  # [1, Hq, n, D]
        x = x + self.o(attn[0].transpose(0, 1).reshape(n, h_q * d))  # [n, H]
        gate_up = self.gate_up(rms_norm(x, self.post_norm, self.eps))  # [n, 2 I]
        x = x + self.down(self.act(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :])  # [n, H]
        predicted = rms_norm(x, self.final_norm, self.eps)  # [n, H]
        return predicted, self.lm_head(predicted)

    @torch.inference_mode()
    def extend(self, cache: HeadCache, features: torch.Tensor,
               tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As DraftHead.extend: feed pairs (features [n, H], tokens [n]) -> the last position's
        (predicted feature [H], draft logits [N])."""
        predicted, logits = self.forward(features, tokens, cache)
        return predicted[-1], logits[-1]

    @torch.inference_mode()
    def extend_tree(self, cache: HeadCache, features: torch.Tensor, tokens: torch.Tensor, position: int,
                    visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As DraftHead.extend_tree: one level of a tree, all at `position`, seeing what `visible` [q, t]
        allows of the tree's positions -> (predicted features [q, H], draft logits [q, N])."""
        prefix = cache.length + len(tokens) - visible.shape[1]
        return self.forward(features, tokens, cache, position, tree_mask(prefix, visible, torch.float32, self.window))


def for_drafting(head: DraftHead | FastHead, dtype: str = "auto") -> FastHead:
    """The head in the form a drafter runs (quantized once; a FastHead as it is)."""
    return head if isinstance(head, FastHead) else FastHead(head, dtype)
