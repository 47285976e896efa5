"""specdec's int4 kernel for draft models on the CPU: packing and the linear.

``int4_linear.c`` multiplies 8-bit per-token activations with 4-bit weights in groups of GROUP columns,
each group with its own fp16 scale and minimum (the format and the numbers: its top comment and
:mod:`specdec.native.int4`); exact int32 sums per group, then fp32 multiply-adds in a fixed order, so a
row's outputs do not depend on the other rows or the threads, on the AVX2 and the portable C path alike.
An int4 draft's decoder layers run in one call of ``layers.c`` (:mod:`.layers`).
"""

from __future__ import annotations

import torch

from specdec.native.kernels.bindings import LinearParams, library
from specdec.native.kernels.int8 import TILE, padded

PATHS = {"c": 1, "avx2": 2}  # the int4 kernel's paths (ISA4_* in specdec_kernels.h), slowest first
GROUP = 32  # int4 weights: columns per scale and minimum


def paths() -> list[str]:
    """Every path of the int4 kernel this CPU can run (tests compare their outputs bit for bit)."""
    best = library().sd_isa4()
    return [name for name, value in PATHS.items() if value <= best]


def _buffers(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 layout's (bytes, fp16 scales and minimums) for an [n, k] layer, uninitialised (the packers
    fill them)."""
    rows, kp = -(-n // TILE) * TILE, padded(k)
    return torch.empty(rows, kp // 2, dtype=torch.uint8), torch.empty(rows * kp // GROUP * 2, dtype=torch.float16)


def pack(values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values [N, K] in [0, 15] and fp16 scales and minimums [N, ceil(K / GROUP)] (w ~ value * scale + min of
    the column's group) -> the int4 kernel's layout: (bytes [ceil(N / TILE) * TILE, padded(K) / 2] uint8,
    scales and minimums [ceil(N / TILE) * TILE * padded(K) / GROUP * 2] fp16)."""
    n, k = values.shape
    for name, t in (("scales", scales), ("minimums", mins)):
        if t.shape != (n, -(-k // GROUP)):
            raise ValueError(f"int4 {name} must be [{n}, {-(-k // GROUP)}], got {list(t.shape)}")
    out, out_scales = _buffers(n, k)
    v = values.to(torch.uint8).contiguous()
    sc, mn = scales.to(torch.float16).contiguous(), mins.to(torch.float16).contiguous()
    library().sd_pack4(v.data_ptr(), sc.data_ptr(), mn.data_ptr(), n, k, padded(k), out.data_ptr(),
                       out_scales.data_ptr())
    return out, out_scales


def pack_int8(values: torch.Tensor, row_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 layer (values [N, K] int8, per-channel scales [N]) quantized to int4 and packed in one pass:
    the same as pack(*specdec.native.int4.quantize_int4(values * row_scales[:, None])), without the fp32
    copy."""
    n, k = values.shape
    out, out_scales = _buffers(n, k)
    v, sc = values.to(torch.int8).contiguous(), row_scales.float().contiguous()
    library().sd_pack4_int8(v.data_ptr(), sc.data_ptr(), n, k, padded(k), out.data_ptr(), out_scales.data_ptr(),
                            torch.get_num_threads())
    return out, out_scales


def linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, in_features: int, out_features: int,
           bias: torch.Tensor | None, path: str | None = None) -> torch.Tensor:
    """x [M, K] fp32 -> y [M, N] fp32 through the int4 kernel (packed, scales from :func:`pack`; bias
    [N] fp32 or None).  path: one of :func:`paths` instead of the best (for tests)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"expected fp32 [M, {in_features}] input, got {x.dtype} {list(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, out_features)
    params = LinearParams(packed.data_ptr(), scales.data_ptr(), None if bias is None else bias.data_ptr(),
                          out_features, in_features, packed.shape[1] * 2, x.data_ptr(), x.stride(0), m, y.data_ptr(),
                          out_features, torch.get_num_threads(), PATHS[path] if path else 0)
    if library().sd_linear4(params) != 0:
        raise MemoryError("int4 kernel: out of memory")
    return y
