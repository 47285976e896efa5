"""specdec's int8 kernel (specdec.native.kernels.int8): exact, the same on every path, batch-invariant.

- Every output equals the module doc's formula computed with exact int64 sums in torch, bitwise, for
  shapes that are and are not multiples of the kernel's tiles, with and without bias.
- Every path this CPU runs (AVX-512 VNNI, AVX2, portable C) gives the same bits.
- A row's outputs are the same alone, in any batch, in any order, and from several calling threads at
  once (the thread pool's chunks are claimed dynamically).
- All-zero rows give the bias; a NaN or inf in a row makes that row NaN and no other.
- pack / unpack round-trip; a machine without a C compiler gets a one-line error.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.native import kernels
from specdec.native.kernels import build
from specdec.native.quant import quantize_weight

QMAX = 63.0


def reference(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's numbers in torch: per-row 7-bit activations, exact int64 sums, the same float ops."""
    s = x.abs().amax(dim=1, keepdim=True)  # [M, 1]
    q = torch.round(x * (QMAX / s)).clamp(-QMAX, QMAX).to(torch.int64)  # [M, K]
    q[(s == 0).expand_as(q)] = 0
    acc = q @ values.to(torch.int64).T  # [M, N], exact
    y = (acc.float() * scale) * (s / QMAX)
    return y + bias if bias is not None else y


def layer(n: int, k: int, seed: int, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    values, scale = quantize_weight(torch.randn(n, k, generator=gen) * 0.05)
    return values, scale, (torch.randn(n, generator=gen) if bias else None), kernels.int8.pack(values)


@pytest.mark.parametrize("n,k", [(1, 1), (5, 50), (37, 64), (64, 96), (130, 700), (512, 1536)])
@pytest.mark.parametrize("bias", [True, False])
def test_outputs_are_the_exact_integer_formula(n, k, bias):
    values, scale, b, packed = layer(n, k, seed=n * 1000 + k, bias=bias)
    x = torch.randn(35, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-3, 3, 35)[:, None]
    # every row-block size of every path, blocks after blocks, and the VNNI path's row groups of 16+ rows
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 19, 35):
        y = kernels.int8.linear(x[:m], packed, k, scale, b)
        assert y.shape == (m, n) and torch.equal(y, reference(x[:m], values, scale, b)), m
        for path in kernels.int8.paths():  # the best path == AVX2 == portable C
            assert torch.equal(y, kernels.int8.linear(x[:m], packed, k, scale, b, path=path)), (m, path)


def test_pack_unpack_round_trip():
    for n, k in [(1, 1), (7, 33), (64, 1536), (9, 130)]:
        values, _, _, packed = layer(n, k, seed=k)
        assert packed.shape == (-(-n // kernels.int8.TILE) * kernels.int8.TILE, kernels.int8.padded(k))
        assert torch.equal(kernels.int8.unpack(packed, n, k), values)


def test_a_row_is_the_same_in_any_batch_and_from_concurrent_callers():
    n, k = 1024, 1536  # enough tiles for the thread pool
    values, scale, b, packed = layer(n, k, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(20, k, generator=gen)
    x[2] *= 1e4  # huge range
    x[4] = 0.0  # all zero
    x[6, 9] = 300.0  # an outlier
    alone = torch.cat([kernels.int8.linear(x[i : i + 1], packed, k, scale, b) for i in range(20)])
    assert torch.equal(alone[4], b) and torch.isfinite(alone).all()
    for m in (2, 3, 5, 8, 13, 20):
        assert torch.equal(kernels.int8.linear(x[:m], packed, k, scale, b), alone[:m]), m
    perm = torch.randperm(20, generator=gen)
    assert torch.equal(kernels.int8.linear(x[perm], packed, k, scale, b), alone[perm])
    strided = torch.zeros(20, k + 5)
    strided[:, 2 : k + 2] = x
    assert torch.equal(kernels.int8.linear(strided[:, 2 : k + 2], packed, k, scale, b), alone)  # a row stride != K
    with ThreadPoolExecutor(4) as pool:  # several callers at once: the pool serves one, the others run alone
        results = list(pool.map(lambda i: kernels.int8.linear(x[i % 20 : i % 20 + 3], packed, k, scale, b),
                                range(40)))
    for i, y in enumerate(results):
        assert torch.equal(y, alone[i % 20 : i % 20 + 3]), i


def test_a_nan_or_inf_poisons_only_its_row():
    values, scale, b, packed = layer(64, 96, seed=5)
    x = torch.randn(4, 96)
    x[1, 7] = float("nan")
    x[2, 90] = float("inf")
    y = kernels.int8.linear(x, packed, 96, scale, b)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert torch.equal(y[[0, 3]], reference(x[[0, 3]], values, scale, b))


def test_bad_input_and_no_compiler(monkeypatch):
    values, scale, b, packed = layer(8, 16, seed=6)
    with pytest.raises(ValueError, match=r"fp32 \[M, 16\]"):
        kernels.int8.linear(torch.randn(2, 17), packed, 16, scale, b)
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(SpecdecError, match="C compiler"):
        build.compiler()
