"""A faster fp32 matmul for the few-token forwards of speculative verification on CPUs.

A verification forward runs every Linear layer over k + 1 rows.  PyTorch's
``F.linear(x, W)`` computes ``x @ W.T``; on the CPUs measured here its kernel
for a handful of rows is far from the one-row (matrix-vector) speed, while
the same product taken weight-major, ``(W @ x.T).T``, costs little more than
one row (and was faster at every row count measured from 2 to 128; at one
row both are a matrix-vector product and cost the same; the measurements are
in BENCHMARKS.md, Zen 1 component timings).  The
whole 1.5B fp32 forward then costs about what one token costs for k up to ~8,
which is what speculative decoding needs from its target.

Numbers: the weight-major product is used only inside :func:`enabled` blocks,
which HFRunner opens for forwards of a few tokens over a non-empty cache (a
verification, a draft's steps), and even there a one-row product goes through
``F.linear``.  A prompt's prefill and every one-token step are therefore
bitwise what the model computes without specdec: plain decoding is unchanged
(still token for token transformers' own greedy search).  A verification
computes the same sums in another order, so its logits differ from
``F.linear``'s by fp32 rounding (neither kernel is batch-invariant; fp32
speculative output is exact up to near-ties, as before: see README).

:func:`install` gives the fp32 CPU ``nn.Linear`` layers of a model this
forward, on those module instances only (the class is untouched); outside an
:func:`enabled` block they compute exactly as ``nn.Linear`` does.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

MARK = "_specdec_weight_major"
MAX_ROWS = 16  # forwards up to this many tokens take the weight-major product (verification sizes)
_state = threading.local()  # per thread: whether the weight-major product is on


@contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Within the block (this thread only), installed layers use the weight-major product if `on`."""
    before = getattr(_state, "on", False)
    _state.on = on
    try:
        yield
    finally:
        _state.on = before


def weight_major_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) -> [..., N], computed as (weight @ rows.T).T."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if rows.shape[0] == 1:
        return F.linear(x, weight, bias)  # one row: the model's own kernel, bitwise
    out = (weight @ rows.T).T  # [M, N]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if getattr(_state, "on", False):
        return weight_major_linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def is_fp32_cpu_linear(module: nn.Module) -> bool:
    """Whether `module` is a plain nn.Linear with fp32 weights on the CPU."""
    return type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"


def install(model: nn.Module) -> int:
    """Give the model's fp32 CPU nn.Linear layers the weight-major forward; returns how many."""
    count = 0
    for module in model.modules():
        if is_fp32_cpu_linear(module) and not getattr(module, MARK, False):
            module.forward = types.MethodType(_forward, module)
            setattr(module, MARK, True)
            count += 1
    return count
