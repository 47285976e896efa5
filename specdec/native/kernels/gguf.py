"""specdec's kernel on a GGUF file's own quantised blocks: packing, the linear, rows of an embedding, its paths.

``gguf_linear.c`` multiplies the file's blocks of the types in TYPES -- their integers and scales unchanged,
repacked 16 output channels side by side -- with 8-bit per-token activations quantised in blocks (256 columns for
the K types and IQ4_XS, 32 for the others, as llama.cpp's Q8_K and Q8_0): exact integer
sums per block, then a fixed sequence of fp32 operations per block (the C file's top comment gives them).  Every
output element is a function of its own input row and the weights, so a token's outputs are the same bits alone,
inside a verification of several rows and inside a prefill (batch invariance), on the AVX-512 VNNI, AVX2 and
portable C paths alike.  Unlike llama.cpp's kernels, which re-read and re-unpack every block for each row of a small
batch, a pass here unpacks a block once for up to 8 rows.  Unquantised F32, F16 and BF16 matrices are multiplied
in fp32 with unquantised activations, in one fixed order of products and sums (the C file's top comment): exact
and batch-invariant alike.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.native.kernels.bindings import GGUFParams, GGUFPart, library

# ggml's type ids of the blocks the kernel multiplies (GG_* in specdec_kernels.h), with their columns per block
# and the file's bytes per block
TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
         "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30}
# the unquantised types (F32, F16, BF16) are packed in blocks of 32 columns too
BLOCK = {0: 32, 1: 32, 2: 32, 3: 32, 6: 32, 7: 32, 8: 32, 10: 256, 11: 256, 12: 256, 13: 256, 14: 256, 20: 32, 23: 256,
         30: 32}
FILE_BYTES = {0: 128, 1: 64, 2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 10: 84, 11: 110, 12: 144, 13: 176, 14: 210, 20: 18,
              23: 136, 30: 64}
NAMES = {v: k for k, v in TYPES.items()}
LANES = 16  # output channels per packed group
PATHS = {"c": 1, "avx2": 2, "avx512-vnni": 3}  # ISA_* in specdec_kernels.h, slowest first


def isa() -> str:
    """The path the kernel takes on this CPU: "avx512-vnni", "avx2" or "c"."""
    code = library().sd_gguf_isa()
    return next(name for name, value in PATHS.items() if value == code)


def paths() -> list[str]:
    """Every path this CPU can run (tests compare their outputs bit for bit)."""
    best = library().sd_gguf_isa()
    return [name for name, value in PATHS.items() if value <= best]


def supported(type_id: int) -> bool:
    """Whether the kernel multiplies blocks of this ggml type."""
    return bool(library().sd_gguf_supported(int(type_id)))


def _bytes(raw: np.ndarray | torch.Tensor) -> tuple[np.ndarray | torch.Tensor, int]:
    """A contiguous array of bytes (a memory-mapped file's stay mapped: no copy) and its address."""
    if isinstance(raw, torch.Tensor):
        raw = raw.contiguous()
        return raw, raw.data_ptr()
    raw = np.ascontiguousarray(raw)
    return raw, raw.ctypes.data


def packed_bytes(type_id: int, n: int, k: int) -> int:
    """Bytes of pack()'s layout of an [n, k] tensor, or -1 for a type or shape the kernel cannot multiply."""
    return int(library().sd_gguf_packed_bytes(int(type_id), n, k))


def pack(type_id: int, raw: np.ndarray | torch.Tensor, n: int, k: int, order: Sequence[int] | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor's blocks as the file stores them (n rows of k columns, row-major bytes) -> the kernel's layout
    (uint8, 16 channels side by side; the same integers and scales).  order: output channel c is the file's
    row order[c] (distinct rows of range(n): a permutation of them all, or some of them, e.g. a head's rows of
    a trimmed vocabulary; None: every row in the file's order).  out: where to write it (packed_bytes of
    len(order) rows, uint8, contiguous), else a new tensor."""
    channels = n if order is None else len(order)
    size = packed_bytes(type_id, channels, k)
    if size < 0 or channels < 1:
        raise ValueError(f"the GGUF kernel cannot multiply {NAMES.get(type_id, type_id)} blocks of {k} columns")
    if out is not None and (out.dtype != torch.uint8 or out.numel() != size or not out.is_contiguous()):
        raise ValueError(f"pack: out must be {size} contiguous bytes")
    data, address = _bytes(raw)
    expected = n * k // BLOCK[type_id] * FILE_BYTES[type_id]
    if data.nbytes != expected:
        raise ValueError(f"{NAMES[type_id]} [{n}, {k}] needs {expected} bytes, got {data.nbytes}")
    rows = None
    if order is not None:
        rows = torch.as_tensor(list(order), dtype=torch.int32)
        if rows.dim() != 1 or int(rows.min()) < 0 or int(rows.max()) >= n or rows.unique().numel() != channels:
            raise ValueError(f"order must hold distinct rows of range({n})")
    out = torch.empty(size, dtype=torch.uint8) if out is None else out
    if library().sd_gguf_pack(int(type_id), address, channels, k, None if rows is None else rows.data_ptr(),
                              out.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError(f"cannot pack {NAMES[type_id]} [{n}, {k}]")
    return out


@dataclass
class Part:
    """One block of output columns of a linear: a packed [n, k] tensor of one type and its bias."""

    packed: torch.Tensor  # pack()'s bytes
    type_id: int
    n: int
    bias: torch.Tensor | None = None  # [n] fp32


class Parts:
    """Several packed tensors side by side as one linear: y = x [W_0 | W_1 | ...]^T (+ biases), e.g. a layer's q,
    k and v projections in one call, whatever type each is stored in."""

    def __init__(self, parts: Sequence[Part], k: int, rows_of: Callable[[Sequence[int]], Parts] | None = None) -> None:
        """rows_of: what rows(ids) returns, where the tensors' blocks can be packed anew (a GGUF model's head)."""
        self.parts = list(parts)
        self.rows_of = rows_of
        self.in_features = k
        self.out_features = sum(p.n for p in self.parts)
        self.path: str | None = None  # the path a call takes by default (None: the best; tests set others)
        cols = np.cumsum([0] + [p.n for p in self.parts])
        self._array = (GGUFPart * len(self.parts))(*(
            GGUFPart(p.packed.data_ptr(), None if p.bias is None else p.bias.data_ptr(), p.type_id, p.n, int(c))
            for p, c in zip(self.parts, cols)))  # the C view, kept with the tensors it points into

    @property
    def address(self) -> int:
        return ctypes.addressof(self._array)

    def nbytes(self) -> int:
        return sum(p.packed.numel() + (0 if p.bias is None else p.bias.numel() * 4) for p in self.parts)

    def rows(self, ids: Sequence[int]) -> Parts:
        """This linear over its output channels `ids` only (a head over a trimmed vocabulary): outputs bitwise
        this one's at those channels; a ValueError where the blocks cannot be had again (rows_of None)."""
        if self.rows_of is None:
            raise ValueError("these packed tensors cannot be restricted to some of their rows")
        return self.rows_of([int(i) for i in ids])

    def __call__(self, x: torch.Tensor, path: str | None = None) -> torch.Tensor:
        """x [M, K] fp32 -> y [M, N] fp32 (see the module doc).  path: one of paths() instead of the best."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected fp32 [M, {self.in_features}] input, got {x.dtype} {list(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.out_features)
        path = path or self.path
        params = GGUFParams(self.address, len(self.parts), self.in_features, x.data_ptr(), x.stride(0), m,
                            y.data_ptr(), self.out_features, torch.get_num_threads(), PATHS[path] if path else 0)
        status = library().sd_gguf_linear(params)
        if status == -1:
            raise MemoryError("GGUF kernel: out of memory")
        if status != 0:
            raise ValueError("GGUF kernel: a part it cannot multiply")
        return y


def rows(type_id: int, blocks: np.ndarray | torch.Tensor, k: int, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a tensor as the file stores it (its blocks, row-major: e.g. a memory-mapped embedding) as
    fp32 [len(ids), k]: llama.cpp's de-quantised values."""
    index = torch.as_tensor(ids, dtype=torch.int64).contiguous()
    data, address = _bytes(blocks)
    if index.numel():
        end = (int(index.max()) + 1) * k * FILE_BYTES[type_id] // BLOCK[type_id]  # where the last row's bytes end
        if int(index.min()) < 0 or end > data.nbytes:
            raise ValueError("row index out of range")
    out = torch.empty(index.numel(), k)
    if library().sd_gguf_rows(int(type_id), address, k, index.data_ptr(), index.numel(), out.data_ptr()) != 0:
        raise ValueError(f"cannot read rows of {NAMES.get(type_id, type_id)} [*, {k}]")
    return out
