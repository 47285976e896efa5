"""The GGUF block kernel (specdec.native.kernels.gguf): the file's integers, exact sums, the same bits everywhere.

- On every path this CPU has (and the portable C path), y equals a numpy reference that reads the file's block
  layout itself, bit for bit, for each type the kernel takes and for 1..9, 19 and 40 rows.
- Batch invariance: a row's outputs alone equal its outputs inside any forward; for the types added second
  (Q4_0, Q5_1, IQ4_NL, Q2_K and the unquantised F32, F16, BF16) in passes of every size 1..8 and a 70-row
  prefill, each row the reference's bits.
- Parts side by side (q | k | v of mixed types, with biases) equal the parts alone.
- The reference's reading of the blocks is llama.cpp's (gguf's own de-quantisation), and rows() de-quantises
  the file's blocks as llama.cpp does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.native.kernels import gguf
from tests.native.gguf_blocks import (
    BF16,
    F16,
    F32,
    IQ4_NL,
    IQ4_XS,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    dequantize,
    random_blocks,
    reference,
)

# the types added second: every row count of a pass and a prefill below as well
SECOND = [Q4_0, Q5_1, IQ4_NL, Q2_K, F32, F16, BF16]
ALL = [Q4_K, Q6_K, Q5_0, Q8_0, Q4_1, Q5_K, Q3_K, IQ4_XS] + SECOND
COLUMNS = {Q4_K: 512, Q6_K: 768, Q5_0: 96, Q8_0: 128, Q4_1: 64, Q5_K: 512, Q3_K: 768, IQ4_XS: 512,
           Q4_0: 160, Q5_1: 96, IQ4_NL: 128, Q2_K: 512, F32: 96, F16: 128, BF16: 64}


def packed(type_id: int, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, gguf.Part]:
    raw = random_blocks(type_id, n, k, np.random.default_rng(seed))
    return raw, gguf.Part(gguf.pack(type_id, raw, n, k), type_id, n)


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, :: 7] *= 9.0  # outliers, as real activations have
    return x


@pytest.mark.parametrize("type_id", ALL, ids=[gguf.NAMES[t] for t in ALL])
@pytest.mark.parametrize("path", gguf.paths())
def test_every_path_gives_the_references_bits(type_id, path):
    k, n = COLUMNS[type_id], 37  # 37: the last group of 16 channels is partial
    raw, part = packed(type_id, n, k)
    linear = gguf.Parts([part], k)
    for m in (*range(1, 10), 19, 40):  # every pass size of 1..8 rows, and a prefill's passes
        x = activations(m, k, seed=m)
        want = reference(type_id, raw, n, k, x.numpy())
        got = linear(x, path=path).numpy()
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), (path, m, np.abs(got - want).max())


@pytest.mark.parametrize("type_id", SECOND, ids=[gguf.NAMES[t] for t in SECOND])
@pytest.mark.parametrize("path", gguf.paths())
def test_every_pass_size_and_a_prefill_give_the_references_bits_row_by_row(type_id, path):
    k, n, m = COLUMNS[type_id], 40, 70  # 70 rows: a prefill's, in 8 passes of 8 and one of 6
    raw, part = packed(type_id, n, k, seed=2)
    linear = gguf.Parts([part], k)
    x = activations(m, k, seed=3)
    want = reference(type_id, raw, n, k, x.numpy())
    alone = torch.cat([linear(x[i : i + 1], path=path) for i in range(m)])
    assert np.array_equal(alone.numpy().view(np.int32), want.view(np.int32))
    for rows in (*range(2, 9), m):  # every pass size; the prefill
        assert torch.equal(linear(x[:rows], path=path), alone[:rows]), rows
        assert torch.equal(linear(x[m - rows :], path=path), alone[m - rows :]), rows


@pytest.mark.parametrize("path", gguf.paths())
def test_a_row_alone_is_the_row_in_any_forward(path):
    k = 512
    parts = [packed(t, 40, k, seed=i)[1] for i, t in enumerate((Q4_K, Q6_K, Q5_K, Q3_K, IQ4_XS))]
    linear = gguf.Parts(parts, k)
    x = activations(24, k)
    alone = torch.cat([linear(x[i : i + 1], path=path) for i in range(24)])
    for m in (2, 3, 8, 13, 24):
        assert torch.equal(linear(x[:m], path=path), alone[:m]), m
        assert torch.equal(linear(x[24 - m :], path=path), alone[24 - m :]), m


def test_parts_side_by_side_are_the_parts_alone():
    k = 256
    specs = [(Q4_K, 48), (Q4_K, 16), (Q6_K, 20)]  # a layer's q, k, v: v in Q6_K as Q4_K_M files have it
    parts = []
    for i, (t, n) in enumerate(specs):
        raw, part = packed(t, n, k, seed=10 + i)
        part.bias = torch.randn(n)
        parts.append(part)
    x = activations(5, k)
    fused = gguf.Parts(parts, k)(x)
    alone = torch.cat([gguf.Parts([p], k)(x) for p in parts], dim=1)
    assert fused.shape == (5, 84) and torch.equal(fused, alone)
    # the biases are added after the sums
    bare = gguf.Parts([gguf.Part(p.packed, p.type_id, p.n) for p in parts], k)(x)
    assert torch.equal(fused, bare + torch.cat([p.bias for p in parts]))


def test_mixed_block_sizes_in_one_call():
    k = 256
    parts = [packed(Q4_K, 20, k, seed=3)[1], packed(Q5_0, 24, k, seed=4)[1], packed(Q8_0, 16, k, seed=5)[1]]
    parts += [packed(F16, 18, k, seed=6)[1], packed(Q2_K, 17, k, seed=7)[1]]  # a float part: no activations of its own
    x = activations(6, k)
    fused = gguf.Parts(parts, k)(x)
    assert torch.equal(fused, torch.cat([gguf.Parts([p], k)(x) for p in parts], dim=1))


@pytest.mark.parametrize("type_id", ALL, ids=[gguf.NAMES[t] for t in ALL])
def test_the_blocks_read_as_llama_cpp_reads_them(type_id):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    k, n = COLUMNS[type_id], 19
    raw, part = packed(type_id, n, k, seed=7)
    theirs = gguf_dequantize(raw, GGMLQuantizationType(type_id)).reshape(n, k)
    ours = dequantize(type_id, raw, n, k)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    ids = [18, 0, 5, 16, 5]
    np.testing.assert_array_equal(gguf.rows(type_id, raw, k, ids).numpy(), ours[ids])


def test_a_non_finite_row_spoils_only_itself():
    k = 256
    raw, part = packed(Q4_K, 16, k)
    linear = gguf.Parts([part], k)
    x = activations(3, k)
    clean = linear(x)
    x[1, 5] = float("nan")
    y = linear(x)
    assert torch.isnan(y[1]).all() and torch.equal(y[[0, 2]], clean[[0, 2]])
    x[1, 5] = float("inf")
    assert torch.isnan(linear(x)[1]).all()
    assert torch.equal(linear(torch.zeros(1, k)), torch.zeros(1, 16))


def test_what_it_cannot_multiply_is_refused():
    with pytest.raises(ValueError, match="cannot multiply Q4_K blocks of 300 columns"):
        gguf.pack(Q4_K, np.zeros(10, np.uint8), 1, 300)
    with pytest.raises(ValueError, match="cannot multiply 16 blocks"):
        gguf.pack(16, np.zeros(66, np.uint8), 1, 256)  # IQ2_XXS: not a type the kernel takes
    with pytest.raises(ValueError, match="needs 144 bytes"):
        gguf.pack(Q4_K, np.zeros(100, np.uint8), 1, 256)


def test_a_channel_order_is_the_files_rows_in_that_order():
    k, n = 256, 40
    raw = random_blocks(Q4_K, n, k, np.random.default_rng(5))
    order = list(np.random.default_rng(6).permutation(n))
    x = activations(3, k)
    permuted = gguf.Parts([gguf.Part(gguf.pack(Q4_K, raw, n, k, order), Q4_K, n)], k)(x)
    reordered = gguf.Parts([gguf.Part(gguf.pack(Q4_K, raw[order], n, k), Q4_K, n)], k)(x)
    assert torch.equal(permuted, reordered)
    some = [31, 2, 17, 0, 39, 8, 25]  # some of the rows (a trimmed head's): the full layer's outputs at those
    picked = gguf.Parts([gguf.Part(gguf.pack(Q4_K, raw, n, k, some), Q4_K, len(some))], k)(x)
    full = gguf.Parts([gguf.Part(gguf.pack(Q4_K, raw, n, k), Q4_K, n)], k)(x)
    assert torch.equal(picked, full[:, some])
    for bad in ([0] * n, [3, 3], [n], [-1]):
        with pytest.raises(ValueError, match="distinct rows"):
            gguf.pack(Q4_K, raw, n, k, bad)



def tie_amaxes() -> list[float]:
    """Two block maxima whose amax / 127 (in fp32) lies exactly halfway between two fp16 values: 1 + 2^-11 (fp16
    keeps the even 1, rounding down) and 1 + 3 * 2^-11 (the even 1 + 2^-9, rounding up), each times 2^-e for the
    first e whose amax = d * 127 gives d back."""
    found: list[float] = []
    for bits in (0x3F801000, 0x3F803000):
        for e in range(24):  # 2^-e keeps the mantissa's 13 low bits (and the tie)
            d = np.array([bits - (e << 23)], np.uint32).view(np.float32)[0]
            amax = np.float32(d * np.float32(127))
            if np.float32(amax / np.float32(127)) == d:
                found.append(float(amax))
                break
    assert len(found) == 2
    return found


@pytest.mark.parametrize("type_id", [Q8_0, Q4_1, Q4_K], ids=["Q8_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("path", gguf.paths())
def test_the_activation_scales_are_llama_cpps_at_every_magnitude(type_id, path):
    """Blocks of 32 keep amax / 127 in fp16 (ties to even, fp16's subnormals below 2^-14), blocks of 256
    1 / (127 / amax): rows from 1e-7 to 1e3, and rows whose blocks' scales are fp16 ties, give the reference's bits."""
    k, n = COLUMNS[type_id], 21
    raw, part = packed(type_id, n, k)
    linear = gguf.Parts([part], k)
    x = activations(8, k, seed=5)  # [8, k]
    for i, scale in enumerate((1e-7, 3e-6, 1e-4, 1e-3, 1.0, 1e3)):  # the first two: fp16-subnormal scales
        x[i] *= scale
    for i, amax in enumerate(tie_amaxes()):  # rows 6, 7: every block's largest value the tie
        blocks = x[6 + i].view(-1, 32)  # [k / 32, 32]
        blocks.mul_(0.999 * amax / blocks.abs().amax(-1, keepdim=True))
        blocks[:, 3] = amax
    want = reference(type_id, raw, n, k, x.numpy())
    got = linear(x, path=path).numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32)), (path, np.abs(got - want).max())
