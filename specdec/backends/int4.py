"""Group-wise int4 weights for draft models: half the bytes of int8, so a draft token costs less.

A draft model's one-token step reads each of its weights once and is bound by
memory bandwidth; with 4-bit weights (a scale per 64 columns of each output
channel, as GPTQ -- Frantar et al. 2022 -- and llama.cpp's Q4_0 do) it reads
about half of what its int8 form reads.  Its numbers are those of an
approximation of the model, not the model's: that is allowed for a draft and
only for a draft, since what a draft proposes never changes the output of
speculative decoding (Leviathan et al. 2023; the target verifies every token),
only how many proposals are accepted.  Targets therefore never take int4.

The weights are quantized from the int8 model (its cached int8 values times its
per-channel scales; no fp32 copy is needed), per output channel n and group g
of 64 columns: scale = max |w| / 7, v = round(w / scale) in [-7, 7].  The
activations are the int8 kernel's 7-bit per-token ones, and the products run
in :mod:`specdec.backends.kernels` (``int4_linear.c``: exact int32 sums per
group, then fp32 multiply-adds with the group scales in a fixed order, so a
row's outputs do not depend on the other rows or the threads).
"""

from __future__ import annotations

import torch

from specdec.backends import kernel
from specdec.backends.quant import Int8Linear

LEVELS = 7  # |v| <= 7: symmetric 4-bit values


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weight [N, K] -> (int8 values [N, K] in [-7, 7], fp32 scales [N, ceil(K / 64)]), w ≈ v * scale
    of the column's group."""
    w = weight.detach().float()
    n, k = w.shape
    groups = -(-k // kernel.GROUP)
    padded = torch.zeros(n, groups * kernel.GROUP)
    padded[:, :k] = w
    blocks = padded.view(n, groups, kernel.GROUP)  # [N, G, 64]
    scales = (blocks.abs().amax(dim=2) / LEVELS).clamp_min(1e-12)  # [N, G]; an all-zero group: a harmless scale
    values = torch.round(blocks / scales[:, :, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return values.view(n, -1)[:, :k].contiguous(), scales


class Int4Linear:
    """y = x W^T + b with group-wise int4 W and the int8 kernel's per-token activations (see module doc)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        """packed, scales: the kernel's layout (kernel.pack4 or kernel.pack4_int8)."""
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else bias.detach().float().contiguous()  # [N]
        self.packed, self.scales = packed, scales

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int4Linear":
        n, k = weight.shape
        return cls(*kernel.pack4(*quantize_int4(weight)), n, k, bias)

    @classmethod
    def from_int8(cls, linear: Int8Linear) -> "Int4Linear":
        """The int8 layer's weights (values times per-channel scales) in int4: the same numbers as
        from_weight on those weights, made in one pass in C (the 0.5B's 494M weights: seconds less)."""
        return cls(*kernel.pack4_int8(linear.int8_weight(), linear.scale), linear.out_features,
                   linear.in_features, linear.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            rows = rows.float()
        y = kernel.linear4(rows, self.packed, self.scales, self.in_features, self.out_features, self.bias)
        return y.reshape(*shape[:-1], self.out_features)
