"""Group-wise int4 weights for draft models: fewer bytes than int8, so a draft token costs less.

A draft model's one-token step reads each of its weights once and is bound by
memory bandwidth; with 4-bit weights (per output channel and group of 32
columns an fp16 scale and minimum, as llama.cpp's Q4_1; group-wise weights as
in GPTQ, Frantar et al. 2022) it reads 5 bits a weight where int8 reads 8.
Its numbers are those of an approximation of the model, not the model's: that
is allowed for a draft and only for a draft, since what a draft proposes never
changes the output of speculative decoding (Leviathan et al. 2023; the target
verifies every token), only how many proposals are accepted.  Targets
therefore never take int4.

The weights are quantized from the int8 model (its cached int8 values times its
per-channel scales; no fp32 copy is needed), per output channel n and group g
of 32 columns: scale d = fp16((max w - min w) / 15), minimum m = fp16(min w),
u = round((w - m) / d) in [0, 15].  An asymmetric grid of 16 levels per 32
columns is the shape of the zoo drafts' own files (Q4_1, Q4_K), so it keeps
their weights nearly as they are.  The activations are quantized per token to
8 bits, and the products run in :mod:`specdec.native.kernels`
(``int4_linear.c``: exact int32 sums per group, then fp32 multiply-adds with
the group scales and minimums in a fixed order, so a row's outputs do not
depend on the other rows or the threads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.native import kernels
from specdec.native.kernels.int4 import GROUP
from specdec.native.kernels.int8 import TILE
from specdec.native.quant import Int8Linear

LEVELS = 15  # u in [0, 15]: unsigned 4-bit values
BLOCK = 64  # the packed layout's columns per 32 bytes of a row's nibbles (kernels/int4_linear.c)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 weight [N, K] -> (uint8 values [N, K] in [0, 15], fp16 scales and minimums [N, ceil(K / 32)]),
    w ~ value * scale + minimum of the column's group (where a group's scale is 0, value 0: w ~ minimum).
    A last group narrower than 32 columns takes its range from its own columns."""
    w = weight.detach().float()
    n, k = w.shape
    groups = -(-k // GROUP)
    # pad by repeating the last column: a group's range is that of its real columns
    padded = F.pad(w[None], (0, groups * GROUP - k), mode="replicate")[0] if k % GROUP else w
    blocks = padded.reshape(n, groups, GROUP)  # [N, G, 32]
    lo, hi = blocks.amin(dim=2), blocks.amax(dim=2)  # [N, G]
    scales, mins = ((hi - lo) / LEVELS).half(), lo.half()
    d, m = scales.float()[:, :, None], mins.float()[:, :, None]
    values = torch.where(d > 0, torch.round((blocks - m) / d), torch.zeros(())).clamp_(0, LEVELS).to(torch.uint8)
    return values.view(n, -1)[:, :k].contiguous(), scales, mins


class Int4Linear:
    """y = x W^T + b with group-wise int4 W and 8-bit per-token activations (see the module doc)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        """packed, scales (fp16 scales and minimums): the kernel's layout (kernels.int4.pack or pack_int8)."""
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else bias.detach().float().contiguous()  # [N]
        self.packed, self.scales = packed, scales

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        n, k = weight.shape
        return cls(*kernels.int4.pack(*quantize_int4(weight)), n, k, bias)

    @classmethod
    def from_int8(cls, linear: Int8Linear) -> Int4Linear:
        """The int8 layer's weights (values times per-channel scales) in int4: the same numbers as
        from_weight on those weights, made in one pass in C (the 0.5B's 494M weights: seconds less)."""
        return cls(*kernels.int4.pack_int8(linear.int8_weight(), linear.scale), linear.out_features,
                   linear.in_features, linear.bias)

    def rows(self, ids: torch.Tensor) -> Int4Linear:
        """The layer restricted to output channels `ids` [N'] (int64, each in [0, N)): their packed nibbles,
        scales and minimums gathered from this layer's tiles into tiles of their own, nothing requantized.
        Every output of the kernel depends on its own weight row only, so output j of the result is bitwise
        output ids[j] of this layer (an FR-Spec draft head: specdec.drafters.draft_vocab)."""
        ids = torch.as_tensor(ids, dtype=torch.int64)
        if ids.dim() != 1 or (ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features)):
            raise ValueError(f"output channel ids must be a 1-d tensor of ids in [0, {self.out_features})")
        blocks = self.packed.shape[1] // (BLOCK // 2)  # 64-column blocks per row (padded(K) / 64)
        tiles = self.packed.shape[0] // TILE
        # the layout (kernels/int4_linear.c): per tile, per block, per row 32 bytes; per tile and block 16 fp16
        # values, 4 kinds (the two groups' scales, then their minimums) x TILE rows.  Indexed by (tile, row in
        # tile) for each id, so only the kept rows are read: no copy of the whole layer
        tile, row = ids // TILE, ids % TILE
        n = ids.numel()
        out_tiles = -(-n // TILE)
        packed = torch.zeros(out_tiles * TILE, blocks, BLOCK // 2, dtype=torch.uint8)  # padding rows: u = 0
        scales = torch.zeros(out_tiles * TILE, blocks, 4, dtype=self.scales.dtype)  # d = m = 0
        packed[:n] = self.packed.view(tiles, blocks, TILE, BLOCK // 2)[tile, :, row]  # [n, blocks, 32]
        scales[:n] = self.scales.view(tiles, blocks, 4, TILE)[tile, :, :, row]  # [n, blocks, 4]
        packed = packed.view(out_tiles, TILE, blocks, -1).transpose(1, 2).reshape(out_tiles * TILE, -1)
        scales = scales.view(out_tiles, TILE, blocks, 4).permute(0, 2, 3, 1).reshape(-1)
        bias = None if self.bias is None else self.bias[ids]
        return Int4Linear(packed, scales, n, self.in_features, bias)

    def nbytes(self) -> int:
        """The bytes its kernel reads: the packed 4-bit weights, fp16 scales and minimums, and the bias."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.bias) if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            rows = rows.float()
        y = kernels.int4.linear(rows, self.packed, self.scales, self.in_features, self.out_features, self.bias)
        return y.reshape(*shape[:-1], self.out_features)


Q4_1_BYTES = 20  # ggml's block_q4_1: fp16 d, fp16 m, 16 bytes of nibbles for 32 columns


def q4_1_blocks(weight: torch.Tensor) -> torch.Tensor:
    """fp32 weight [N, K] (K a multiple of 32) -> the same int4 numbers as quantize_int4 in ggml's Q4_1 blocks,
    as a GGUF file stores them: uint8 [N, K / 32 * 20], per block d and m (fp16), then byte i holding column i
    in its low nibble and column i + 16 in its high one (w ~ d * q + m).  What the gguf kernel multiplies
    (specdec.native.gguf: a draft requantised to 4 bits)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"Q4_1 blocks need a multiple of {GROUP} columns, got {k}")
    values, scales, mins = quantize_int4(weight)  # [N, K] in 0..15, fp16 [N, K / 32] each
    q = values.view(n, k // GROUP, GROUP)
    nibbles = q[:, :, :16] | (q[:, :, 16:] << 4)  # [N, G, 16]
    head = torch.stack([scales, mins], dim=2).contiguous().view(torch.uint8)  # [N, G, 4]: d, m little-endian
    return torch.cat([head, nibbles], dim=2).reshape(n, -1)
