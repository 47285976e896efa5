"""specdec's int8 matrix kernel for the CPU (W8A8 linears): packing, the linear, its paths.

The int8 linear of :mod:`specdec.native.quant` (weights int8 per output
channel, activations int8 per token: "W8A8", as in LLM.int8() -- Dettmers et
al. 2022 -- and ZeroQuant -- Yao et al. 2022) runs here.  A one-token decode
step is bound by memory bandwidth (each weight byte is read once), so the
kernel streams tiled int8 weights with prefetch, multiplying with AVX2
(``vpmaddubsw`` on |q| and sign(q)*w, two of them added in 16 bits, then
``vpmaddwd``: exact int32 sums, no 16-bit saturation since
2 * (2 * 63 * 127) < 2^15) or, where the CPU has AVX-512 VNNI, with
``vpdpbusd`` on w + 128 and q (minus 128 * sum(q): the same exact int32
sums, four times the multiplies per instruction), and does no per-call work
but the activation quantization.

Numerics, per output element (the same expression for every element of every
call, hence **batch-invariant**: a token's outputs do not depend on the other
rows, their number, the tiling or the threads):

    s_m   = max_k |x[m, k]|                  (a NaN or inf in the row: that row's outputs are NaN)
    q     = round_half_even(x[m, k] * (63 / s_m))       in [-63, 63]  (7 bits)
    acc   = sum_k q[k] * W[n, k]                        (int32, exact)
    y     = ((float) acc * wscale[n]) * (s_m / 63)   (+ bias[n])

The C source is ``int8_linear.c`` (built by :mod:`.build`, with the other kernels); its AVX2 and
AVX-512 VNNI functions are chosen at run time, and a portable C path computes the same int32 sums, hence
the same numbers, on CPUs without AVX2: every path gives the same bits.  Output channels are shared among
torch's threads in chunks claimed dynamically; which thread computes a chunk changes no number.
"""

from __future__ import annotations

import torch

from specdec.native.kernels.bindings import LinearParams, library

ALIGN = 64  # weight rows are padded with zeros to a multiple of this many columns
TILE = 4  # output channels per tile of the packed layout (TILE_N in the C source)
PATHS = {"c": 1, "avx2": 2, "avx512-vnni": 3}  # the kernel's paths (ISA_* in specdec_kernels.h), slowest first


def isa() -> str:
    """The path the kernel takes on this CPU: "avx512-vnni", "avx2" or "c"."""
    code = library().sd_isa()
    return next(name for name, value in PATHS.items() if value == code)


def paths() -> list[str]:
    """Every path this CPU can run (tests compare their outputs bit for bit)."""
    best = library().sd_isa()
    return [name for name, value in PATHS.items() if value <= best]


def padded(k: int) -> int:
    """k columns padded to the packed layout's width (a multiple of ALIGN)."""
    return -(-k // ALIGN) * ALIGN


def pack(weight: torch.Tensor) -> torch.Tensor:
    """int8 weight [N, K] -> the kernel's tiled layout, [ceil(N / TILE) * TILE, padded(K)] bytes (zero-padded)."""
    n, k = weight.shape
    out = torch.empty(-(-n // TILE) * TILE, padded(k), dtype=torch.int8)
    w = weight.contiguous()
    library().sd_pack(w.data_ptr(), n, k, out.shape[1], out.data_ptr())
    return out


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 weight [n, k] back from :func:`pack`'s layout (tile, 32-column chunk, row, byte)."""
    rows, kp = packed.shape
    tiled = packed.view(rows // TILE, kp // 32, TILE, 32).permute(0, 2, 1, 3)  # [tiles, TILE, chunks, 32]
    return tiled.reshape(rows, kp)[:n, :k].contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, in_features: int, scale: torch.Tensor,
           bias: torch.Tensor | None, path: str | None = None) -> torch.Tensor:
    """x [M, K] fp32 -> y [M, N] fp32 (see the module doc); packed [N, padded(K)] from :func:`pack`,
    scale [N] fp32, bias [N] fp32 or None.  path: one of :func:`paths` instead of the best (for tests)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"expected fp32 [M, {in_features}] input, got {x.dtype} {list(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], scale.shape[0]
    y = torch.empty(m, n)
    params = LinearParams(packed.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(), n,
                          in_features, packed.shape[1], x.data_ptr(), x.stride(0), m, y.data_ptr(), n,
                          torch.get_num_threads(), PATHS[path] if path else 0)
    status = library().sd_linear(params)
    if status != 0:
        raise MemoryError("int8 kernel: out of memory")
    return y
