"""specdec's exact causal attention for the CPU: every query row on its own, all rows in one call.

PyTorch's scaled-dot-product attention takes other paths for one query than for many, so a token's
attention would depend on how many tokens were evaluated with it.  ``attention.c`` computes each (row,
head) in one fixed order of operations (its top comment gives the numbers), the same on the AVX-512,
AVX2 and portable C paths: a token's result is the same bits in a one-token step, a k-token
verification and a prefill (batch invariance, as the int8 linears of :mod:`.int8`).

With ``tree`` (a :class:`specdec.backends.tree.Tree`) the new rows are a token tree (issue 39; SpecInfer's
tree attention, Miao et al. 2024, arXiv 2305.09781): each row sees the cache and its ancestors and itself,
in the order a chain over its path shows them, so its result is bitwise that chain's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.native.kernels.bindings import AttentionParams, library

if TYPE_CHECKING:
    from specdec.backends.tree import Tree

PATHS = {"c": 1, "avx2": 2, "avx512": 3}  # the attention's paths (ATT_* in specdec_kernels.h), slowest first


def paths() -> list[str]:
    """Every attention path this CPU can run (tests compare their outputs bit for bit)."""
    best = library().sd_attention_isa()
    return [name for name, value in PATHS.items() if value <= best]


def causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
           window: int | None = None, path: str | None = None, tree: Tree | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """Exact causal attention, each query row on its own (see attention.c for the numbers).

    q [H, n, D] fp32: the queries of positions start .. start + n - 1; keys, values [H_kv, >= start + n, D]
    fp32 (positions 0 .. start + n - 1 are read; query head h reads key/value head h // (H / H_kv)).
    window: a sliding window's size (None: the whole context).  Returns [n, H * D].  A row's result is
    bitwise the same whatever the other rows, their number and the threads, on every path.
    tree: the n new rows are this tree's nodes, in its order (their keys and values at positions start ..
    start + n - 1 all the same): row i sits at position start + its depth and sees the cached positions and
    its ancestors' and its own rows, the last `window` of them; bitwise the chain over its path.
    softcap: each score s capped to softcap * tanh(s / softcap) before the softmax (Gemma 2; None: not capped).
    """
    heads, n, d = q.shape
    kv_heads = keys.shape[0]
    if (q.dtype, keys.dtype, values.dtype) != (torch.float32,) * 3 or keys.shape != values.shape:
        raise ValueError("attention wants fp32 q, keys and values, keys and values of one shape")
    if keys.shape[1] < start + n or keys.shape[2] != d or heads % kv_heads:
        raise ValueError(f"attention: q {list(q.shape)} at {start} does not fit keys {list(keys.shape)}")
    if q.stride(2) != 1:
        q = q.contiguous()
    if keys.stride(2) != 1 or values.stride() != keys.stride():
        keys, values = keys.contiguous(), values.contiguous()
    if tree is not None and len(tree) != n:
        raise ValueError(f"attention: a tree of {len(tree)} nodes for {n} query rows")
    out = torch.empty(n, heads * d)
    params = AttentionParams(q.data_ptr(), q.stride(0), q.stride(1), keys.data_ptr(), values.data_ptr(),
                             keys.stride(0), keys.stride(1), out.data_ptr(), heads * d, d, n, start, heads, kv_heads,
                             d, scale, window or 0, torch.get_num_threads(), PATHS[path] if path else 0,
                             *((tree.at.data_ptr(), tree.rows.data_ptr()) if tree is not None else (None, None)),
                             softcap or 0.0)
    if library().sd_attention(params) != 0:
        raise MemoryError("attention kernel: out of memory")
    return out
