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

from specdec.backends.kernels.bindings import LayersModel, LayersRows, library

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
