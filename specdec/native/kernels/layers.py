"""A model's decoder layers in one C call (``layers.c``): an int4 draft's, and the gguf target's.

Norms, rotary embeddings, attention (``attention.c``), the gated MLP and the residual adds over the new rows
of one or more sequences, each with its own KV cache, with the linears on the int4 kernel (``int4_linear.c``)
or on the GGUF block kernel (``gguf_linear.c``): a few plain loops per row between the kernels instead of
some 35 torch operations and several ctypes calls a layer.  A row's numbers depend on its own tokens only
(per-row loops in one fixed order, batch-invariant kernels), so with the GGUF kernel a token's logits are
the same bits alone and in any forward.  Sequences may be token trees (attention.c's tree mode), and a
layer's output rows may be copied out (taps: a fused-feature draft head's input).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from specdec.native.kernels.bindings import DraftParams, LayersModel, LayersRows, library

INT4, GGUF = 0, 1  # LIN_* in specdec_kernels.h: the kernel a model's linears run on


def run(model: LayersModel, x: torch.Tensor, starts: Sequence[int], sizes: Sequence[int], caches: Sequence[int],
        kv_head: Sequence[int], cos: torch.Tensor, sin: torch.Tensor,
        trees: Sequence[tuple[int, int] | None] | None = None, taps: Sequence[int] | None = None) -> None:
    """All of `model`'s layers over the new rows x [total, hidden] fp32 (contiguous; in place) of R sequences:
    sequence r's sizes[r] rows, one sequence after another, at positions starts[r].. of its cache.  caches:
    [R * layers * 2] addresses (sequence r, layer l: keys, values [H_kv, capacity_r, D] fp32, where the rows'
    keys and values are written); kv_head[r] = capacity_r * D; cos, sin [tables, total, D] fp32: each row's
    position's in each rotary table.  trees[r]: (tree_at, tree_rows) addresses of sequence r's token tree
    (specdec.backends.tree.Tree), or None for a chain.  taps: per layer, the address of a [total, hidden] fp32
    buffer its output rows are copied into, or 0."""
    n = len(starts)
    arrays: list[ctypes.Array[ctypes.c_int] | ctypes.Array[ctypes.c_int64]] = [
        (ctypes.c_int * n)(*starts), (ctypes.c_int * n)(*sizes), (ctypes.c_int64 * len(caches))(*caches),
        (ctypes.c_int64 * n)(*kv_head)]  # alive until the call returns
    extra: list[int | None] = [None, None]
    if trees is not None and any(t is not None for t in trees):
        flat = [a for t in trees for a in (t if t is not None else (0, 0))]
        arrays.append((ctypes.c_int64 * len(flat))(*flat))
        extra[0] = ctypes.addressof(arrays[-1])
    if taps is not None and any(taps):
        arrays.append((ctypes.c_int64 * len(taps))(*taps))
        extra[1] = ctypes.addressof(arrays[-1])
    rows = LayersRows(x.data_ptr(), x.shape[0], n, *map(ctypes.addressof, arrays[:4]), cos.data_ptr(), sin.data_ptr(),
                      torch.get_num_threads(), *extra)
    if library().sd_layers(model, rows) != 0:
        raise MemoryError("layers: out of memory")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.c's RMSNorm of each row of x [m, hidden] fp32 (contiguous): the same numbers as its layers' norms,
    a row's independent of the others."""
    x = x.contiguous()
    out = torch.empty_like(x)
    library().sd_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr())
    return out


def draft_greedy(model: LayersModel, caches: Sequence[int], kv_head: int, cos: torch.Tensor, sin: torch.Tensor,
                 final_norm: torch.Tensor, head: tuple[int, int, int], head_ids: torch.Tensor | None,
                 embed: tuple[int, int, int], feed: Sequence[int], start: int, k: int) -> list[int]:
    """draft.c's greedy chain: `feed` at positions start.. of one sequence's cache, then k tokens, each the argmax
    of the head over the last row (the last one not fed).  caches: [layers * 2] addresses of its keys and values;
    kv_head = capacity * D; cos, sin [capacity, D] fp32 (one rotary table, contiguous); head: (address of its
    sd_gguf_part array, parts, rows); head_ids: int32 [rows], each row's token (None: the row's index); embed:
    (ggml type, address, rows) of the token embedding."""
    addresses = (ctypes.c_int64 * len(caches))(*caches)
    tokens = (ctypes.c_int32 * len(feed))(*feed)
    out = (ctypes.c_int32 * k)()
    params = DraftParams(ctypes.addressof(model), ctypes.addressof(addresses), kv_head, cos.data_ptr(), sin.data_ptr(),
                         final_norm.data_ptr(), head[0], head[1], head[2],
                         None if head_ids is None else head_ids.data_ptr(), embed[0], embed[1], embed[2],
                         torch.get_num_threads(), ctypes.addressof(tokens), len(feed), start, k, ctypes.addressof(out))
    status = library().sd_draft_greedy(params)
    if status == -1:
        raise MemoryError("draft: out of memory")
    if status != 0:
        raise ValueError("draft: a token outside the embedding")
    return list(out)


def rope_table(positions: torch.Tensor, dims: int, base: float, scale: float = 1.0,
               factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's rotary table (layers.c's sd_rope_table: its iterated fp32 angles, cosf / sinf) for positions
    [n] int64: (cos, sin) [n, dims] fp32, each frequency's value at j and j + dims / 2 (rotate-half form).
    scale: llama.cpp's frequency scale (linear rotary scaling: 1 / factor); factors [dims / 2]: Llama 3's
    per-frequency divisors (rope_freqs.weight), or None."""
    positions = positions.to(torch.int64).contiguous()
    n = positions.numel()
    cos, sin = torch.empty(n, dims), torch.empty(n, dims)
    if factors is not None:
        factors = factors.to(torch.float32).contiguous()
    library().sd_rope_table(positions.data_ptr(), n, dims, base, scale,
                            None if factors is None else factors.data_ptr(), cos.data_ptr(), sin.data_ptr())
    return cos, sin
