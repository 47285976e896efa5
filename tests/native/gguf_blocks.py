"""Random GGUF blocks and a numpy reference of the GGUF kernel's numbers (specdec.native.kernels.gguf).

The reference reads the file's block layout itself (not the kernel's packing), quantises activations as the
kernel's top comment says, sums the integers in int64 and runs the fp32 epilogue block by block in numpy's
float32: what every path of the kernel must give, bit for bit.  The unquantised types (F32, F16, BF16): the
kernel's four partial sums of float32 products, column by column, on x as it is.
"""

from __future__ import annotations

import numpy as np

from specdec.native.kernels.gguf import BLOCK, FILE_BYTES, TYPES

Q4_K, Q6_K, Q5_0, Q8_0, Q4_1 = (TYPES[name] for name in ("Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"))
Q4_0, Q5_1, IQ4_NL, Q2_K = (TYPES[name] for name in ("Q4_0", "Q5_1", "IQ4_NL", "Q2_K"))
F32, F16, BF16 = (TYPES[name] for name in ("F32", "F16", "BF16"))
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])  # ggml's kvalues_iq4nl
Q5_K, Q3_K, IQ4_XS = TYPES["Q5_K"], TYPES["Q3_K"], TYPES["IQ4_XS"]
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])  # kvalues_iq4nl
f32 = np.float32


def random_blocks(type_id: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """n rows of k columns of random blocks of `type_id`, as a file stores them: uint8 [n, k / block * bytes].
    Quants and sub-block scales are uniform over their range; fp16 scales and minimums small and finite."""
    nb, size = k // BLOCK[type_id], FILE_BYTES[type_id]
    if type_id in (F32, F16, BF16):  # the values themselves, small and finite
        values = (rng.standard_normal((n, k)) * 0.05).astype(f32)
        if type_id == F16:
            return values.astype(np.float16).view(np.uint8).reshape(n, 2 * k)
        if type_id == BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, 2 * k)
        return values.view(np.uint8).reshape(n, 4 * k)
    raw = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)

    def put_half(offset: int, low: float, high: float) -> None:
        values = rng.uniform(low, high, size=(n, nb)).astype(np.float16)
        raw[:, :, offset : offset + 2] = values.view(np.uint8).reshape(n, nb, 2)

    if type_id == Q4_K:
        put_half(0, 1e-4, 4e-3)
        put_half(2, 1e-4, 4e-3)
    elif type_id == Q6_K:
        put_half(208, 1e-4, 4e-3)
    elif type_id in (Q5_0, Q8_0):
        put_half(0, 1e-3, 2e-2)
    elif type_id == Q4_1:
        put_half(0, 1e-3, 2e-2)
        put_half(2, -0.1, 0.1)
    elif type_id in (Q4_0, IQ4_NL):
        put_half(0, 1e-3, 2e-2)
    elif type_id == Q5_1:
        put_half(0, 1e-3, 2e-2)
        put_half(2, -0.1, 0.1)
    elif type_id == Q2_K:
        put_half(80, 1e-4, 4e-3)
        put_half(82, 1e-4, 4e-3)
    elif type_id == Q5_K:
        put_half(0, 1e-4, 4e-3)
        put_half(2, 1e-4, 4e-3)
    elif type_id == Q3_K:
        put_half(108, 1e-4, 4e-3)
    elif type_id == IQ4_XS:
        put_half(0, 1e-5, 4e-4)
    return raw.reshape(n, nb * size)


def _half(raw: np.ndarray, offset: int) -> np.ndarray:
    return raw[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(f32)


def decode(type_id: int, raw: np.ndarray, n: int, k: int) -> dict[str, np.ndarray]:
    """The integers and scales of [n, k] blocks: "q" [n, k] (the unsigned quant: Q6_K 0..63, Q5_0 0..31, Q8_0
    -128..127 signed, Q4_0 0..15, Q5_1 and Q5_K 0..31, IQ4_NL and IQ4_XS the table's value -127..113, Q2_K 0..3,
    Q3_K 0..7), per block "d" (and "dmin" / "m") [n, nb] fp32, Q4_K / Q5_K "sc" and "mn" [n, nb, 8], Q6_K "sc" and
    Q2_K "sc" and "mn" [n, nb, 16], Q3_K "sc" - 32 [n, nb, 16], IQ4_XS "sc" - 32 [n, nb, 8]."""
    nb = k // BLOCK[type_id]
    b = raw.reshape(n, nb, FILE_BYTES[type_id])
    out: dict[str, np.ndarray] = {}
    if type_id in (Q4_K, Q5_K):  # the same header: d, dmin, 12 bytes of 6-bit scales and minimums
        out["d"], out["dmin"] = _half(b, 0), _half(b, 2)
        s = b[..., 4:16].astype(np.int64)
        sc = np.zeros((n, nb, 8), np.int64)
        mn = np.zeros((n, nb, 8), np.int64)
        for j in range(8):
            if j < 4:
                sc[..., j], mn[..., j] = s[..., j] & 63, s[..., j + 4] & 63
            else:
                sc[..., j] = (s[..., j + 4] & 0xF) | ((s[..., j - 4] >> 6) << 4)
                mn[..., j] = (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
        out["sc"], out["mn"] = sc, mn
        start = 16 if type_id == Q4_K else 48  # Q5_K: qh[32] first
        qs = b[..., start : start + 128].astype(np.int64).reshape(n, nb, 4, 32)
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [n, nb, 4 chunks, 64]
        if type_id == Q5_K:  # column 32 i + l's fifth bit: bit i of qh[l]
            qh = b[..., 16:48].astype(np.int64)  # [n, nb, 32]
            q = q | (((qh[..., None, :] >> np.arange(8)[:, None]) & 1) << 4).reshape(n, nb, 4, 64)
        out["q"] = q.reshape(n, k)
    elif type_id == Q6_K:
        ql = b[..., 0:128].astype(np.int64).reshape(n, nb, 2, 64)
        qh = b[..., 128:192].astype(np.int64).reshape(n, nb, 2, 32)
        parts = [(ql[..., :32] & 0xF) | (((qh >> 0) & 3) << 4), (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4),
                 (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
        out["q"] = np.concatenate(parts, axis=-1).reshape(n, k)
        out["sc"] = b[..., 192:208].copy().view(np.int8).astype(np.int64)
        out["d"] = _half(b, 208)
    elif type_id == Q5_0:
        out["d"] = _half(b, 0)
        qh = b[..., 2:6].copy().view(np.uint32)[..., 0].astype(np.int64)  # [n, nb]
        qs = b[..., 6:22].astype(np.int64)
        high = (qh[..., None] >> np.arange(32)) & 1  # [n, nb, 32]
        out["q"] = (np.concatenate([qs & 0xF, qs >> 4], axis=-1) | (high << 4)).reshape(n, k)
    elif type_id == Q8_0:
        out["d"] = _half(b, 0)
        out["q"] = b[..., 2:34].copy().view(np.int8).astype(np.int64).reshape(n, k)
    elif type_id == Q4_1:
        out["d"], out["m"] = _half(b, 0), _half(b, 2)
        qs = b[..., 4:20].astype(np.int64)
        out["q"] = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k)
    elif type_id in (Q4_0, IQ4_NL):
        out["d"] = _half(b, 0)
        qs = b[..., 2:18].astype(np.int64)
        out["q"] = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k)
        if type_id == IQ4_NL:
            out["q"] = IQ4_NL_VALUES[out["q"]]
    elif type_id == Q5_1:
        out["d"], out["m"] = _half(b, 0), _half(b, 2)
        qh = b[..., 4:8].copy().view(np.uint32)[..., 0].astype(np.int64)  # [n, nb]
        qs = b[..., 8:24].astype(np.int64)
        high = (qh[..., None] >> np.arange(32)) & 1  # [n, nb, 32]
        out["q"] = (np.concatenate([qs & 0xF, qs >> 4], axis=-1) | (high << 4)).reshape(n, k)
    elif type_id == Q2_K:
        out["d"], out["dmin"] = _half(b, 80), _half(b, 82)
        scales = b[..., 0:16].astype(np.int64)
        out["sc"], out["mn"] = scales & 0xF, scales >> 4  # [n, nb, 16]
        qs = b[..., 16:80].astype(np.int64).reshape(n, nb, 2, 1, 32)
        out["q"] = ((qs >> (2 * np.arange(4)[:, None])) & 3).reshape(n, k)  # column 128 h + 32 j + l: bits 2 j
    elif type_id == Q3_K:  # column 128 h + 32 i + l: bits 2 i of qs[32 h + l], third bit 4 h + i of hmask[l]
        hmask = b[..., 0:32].astype(np.int64)  # [n, nb, 32]
        qs = b[..., 32:96].astype(np.int64).reshape(n, nb, 2, 1, 32)
        low = (qs >> (2 * np.arange(4))[:, None]) & 3  # [n, nb, 2, 4, 32]
        third = (hmask[..., None, :] >> np.arange(8)[:, None]) & 1  # [n, nb, 8, 32]
        out["q"] = (low.reshape(n, nb, 8, 32) | (third << 2)).reshape(n, k)  # 0..7: the file's q + 4
        s = b[..., 96:108].astype(np.int64)
        i = np.arange(16)
        lo = np.where(i < 8, s[..., i % 8] & 0xF, s[..., i % 8] >> 4)
        out["sc"] = (lo | (((s[..., 8 + i % 4] >> (2 * (i // 4))) & 3) << 4)) - 32  # [n, nb, 16] in -32..31
        out["d"] = _half(b, 108)
    elif type_id == IQ4_XS:  # column 32 j + l: the low (l < 16) or high nibble of qs[16 j + l % 16], an index
        out["d"] = _half(b, 0)
        qs = b[..., 8:136].astype(np.int64).reshape(n, nb, 8, 16)
        out["q"] = IQ4_VALUES[np.concatenate([qs & 0xF, qs >> 4], axis=-1)].reshape(n, k)  # the values, -127..113
        high = b[..., 2:4].copy().view(np.uint16)[..., 0].astype(np.int64)  # scales_h [n, nb]
        j = np.arange(8)
        lo = (b[..., 4 + j // 2].astype(np.int64) >> (4 * (j % 2))) & 0xF
        out["sc"] = (lo | (((high[..., None] >> (2 * j)) & 3) << 4)) - 32  # [n, nb, 8] in -32..31
    return out


def dequantize(type_id: int, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """The weights [n, k] fp32 as llama.cpp de-quantises them: (d * sc) * q - (dmin * m) for Q4_K, (d * sc) *
    (q - 32) for Q6_K, d * (q - 16) for Q5_0, d * q for Q8_0, d * q + m for Q4_1 and Q5_1, d * (q - 8) for Q4_0,
    d * kv for IQ4_NL, (d * sc) * q - (dmin * m) for Q2_K and Q5_K, (d * (sc - 32)) * (q - 4) for Q3_K, (d * (sc - 32))
    * kv for IQ4_XS."""
    if type_id in (F32, F16, BF16):
        return floats(type_id, raw, n, k)
    t = decode(type_id, raw, n, k)
    nb, cols = k // BLOCK[type_id], BLOCK[type_id]
    q = t["q"].reshape(n, nb, cols)
    if type_id in (Q4_K, Q5_K):
        j = np.arange(cols) // 32
        scale = t["d"][..., None] * t["sc"][..., j].astype(f32)
        low = t["dmin"][..., None] * t["mn"][..., j].astype(f32)
        w = scale * q.astype(f32) - low
    elif type_id == Q6_K:
        w = (t["d"][..., None] * t["sc"][..., np.arange(cols) // 16].astype(f32)) * (q - 32).astype(f32)
    elif type_id == Q5_0:
        w = t["d"][..., None] * (q - 16).astype(f32)
    elif type_id == Q8_0:
        w = t["d"][..., None] * q.astype(f32)
    elif type_id in (Q4_1, Q5_1):
        w = t["d"][..., None] * q.astype(f32) + t["m"][..., None]
    elif type_id == Q4_0:
        w = t["d"][..., None] * (q - 8).astype(f32)
    elif type_id == IQ4_NL:
        w = t["d"][..., None] * q.astype(f32)
    elif type_id == Q2_K:
        j = np.arange(cols) // 16
        w = (t["d"][..., None] * t["sc"][..., j].astype(f32)) * q.astype(f32) - t["dmin"][..., None] * t["mn"][..., j].astype(f32)
    elif type_id == Q3_K:
        w = (t["d"][..., None] * t["sc"][..., np.arange(cols) // 16].astype(f32)) * (q - 4).astype(f32)
    elif type_id == IQ4_XS:
        w = (t["d"][..., None] * t["sc"][..., np.arange(cols) // 32].astype(f32)) * q.astype(f32)
    return w.reshape(n, k).astype(f32)


def floats(type_id: int, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """The weights [n, k] fp32 of an unquantised tensor (F32, F16 or BF16 bytes)."""
    if type_id == F32:
        return raw.copy().view(f32).reshape(n, k)
    if type_id == F16:
        return raw.copy().view(np.float16).astype(f32).reshape(n, k)
    return (raw.copy().view(np.uint16).astype(np.uint32) << 16).view(f32).reshape(n, k)


def float_product(w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """The kernel's y [m, n] for the float types: per element four partial sums p_j over the columns k = j mod 4 in
    order, each a float32 product then a float32 sum, then (p_0 + p_1) + (p_2 + p_3)."""
    m, k = x.shape
    x = x.astype(f32)
    p = np.zeros((4, m, w.shape[0]), f32)
    for col in range(k):
        p[col % 4] = p[col % 4] + x[:, col : col + 1] * w[None, :, col]  # [m, 1] * [1, n]: float32 products
    acc = (p[0] + p[1]) + (p[2] + p[3])
    return acc if bias is None else acc + bias.astype(f32)[None]


def half_round(v: np.ndarray) -> np.ndarray:
    """float32 `v` rounded to fp16's precision as the kernel's half(): nearest even, fp16's subnormals, but no
    overflow (past 65504 it keeps 11 significant bits where fp16 would be inf); kept in float32."""
    v = np.asarray(v, f32)
    bits = v.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0xFFF + ((bits >> 13) & 1)) & ~np.uint64(0x1FFF)).astype(np.uint32).view(f32)
    with np.errstate(over="ignore", invalid="ignore"):
        subnormal = (np.rint(v * f32(2**24)) * f32(2**-24)).astype(f32)
    return np.where(np.abs(v) < f32(2**-14), subnormal, rounded).astype(f32)


def block_sums(x: np.ndarray) -> np.ndarray:
    """The s of ggml's Q8_1 activation blocks of x [m, k] (32 columns a block): half(amax / 127 * sum q), amax / 127
    in float32 before its fp16 rounding [m, k / 32], what Q4_1's and Q5_1's minimums multiply."""
    m, k = x.shape
    q, _ = quantize_activations(x, 32)
    amax = np.abs(x.astype(f32).reshape(m, k // 32, 32)).max(axis=-1)
    x32 = q.reshape(m, k // 32, 32).sum(-1).astype(f32)
    return np.where(amax > 0, half_round((amax / f32(127)).astype(f32) * x32), f32(0)).astype(f32)


def quantize_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """x [m, k] fp32 -> (quants [m, k] int64 in [-127, 127], scales [m, k / block] fp32), per block of columns, as
    llama.cpp quantises activations: q = round-half-even(x * (127 / amax)); the scale of a block of 32 (ggml's
    Q8_0 / Q8_1) amax / 127 rounded to fp16, of a block of 256 (Q8_K) 1 / (127 / amax) in fp32."""
    m, k = x.shape
    xb = x.astype(f32).reshape(m, k // block, block)
    amax = np.abs(xb).max(axis=-1)  # [m, k / block]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = (f32(127) / amax).astype(f32)
        q = np.clip(np.rint(xb * inv[..., None]), -127, 127)
        if block == 32:
            d = (amax / f32(127)).astype(f32).astype(np.float16).astype(f32)  # numpy's fp16: nearest even
        else:
            d = (f32(1) / inv).astype(f32)
    q = np.where(amax[..., None] > 0, q, 0).astype(np.int64)
    return q.reshape(m, k), np.where(amax > 0, d, f32(0)).astype(f32)


def reference(type_id: int, raw: np.ndarray, n: int, k: int, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """The kernel's y [m, n] fp32 for x [m, k] (finite), bit for bit."""
    if type_id in (F32, F16, BF16):
        return float_product(floats(type_id, raw, n, k), x, bias)
    t = decode(type_id, raw, n, k)
    cols = BLOCK[type_id]
    nb = k // cols
    xq, dx = quantize_activations(x, cols)
    sx = block_sums(x) if type_id in (Q4_1, Q5_1) else None  # [m, nb]
    m = x.shape[0]
    q = t["q"].reshape(n, nb, cols)
    xs = xq.reshape(m, nb, cols)
    acc = np.zeros((m, n), f32)
    for b in range(nb):
        if type_id in (Q4_K, Q5_K):
            s = np.einsum("ncj,mcj->mnc", q[:, b].reshape(n, 8, 32), xs[:, b].reshape(m, 8, 32))  # [m, n, 8]
            x32 = xs[:, b].reshape(m, 8, 32).sum(-1)  # [m, 8]
            tt = (s * t["sc"][None, :, b]).sum(-1)
            mm = (t["mn"][None, :, b] * x32[:, None]).sum(-1)
            v = t["d"][None, :, b] * tt.astype(f32) - t["dmin"][None, :, b] * mm.astype(f32)
        elif type_id == Q6_K:
            s = np.einsum("ncj,mcj->mnc", q[:, b].reshape(n, 16, 16), xs[:, b].reshape(m, 16, 16))
            s = s - 32 * xs[:, b].reshape(m, 16, 16).sum(-1)[:, None]
            tt = (s * t["sc"][None, :, b]).sum(-1)
            v = t["d"][None, :, b] * tt.astype(f32)
        elif type_id == Q3_K:
            s = np.einsum("ncj,mcj->mnc", q[:, b].reshape(n, 16, 16), xs[:, b].reshape(m, 16, 16))
            s = s - 4 * xs[:, b].reshape(m, 16, 16).sum(-1)[:, None]
            tt = (s * t["sc"][None, :, b]).sum(-1)
            v = t["d"][None, :, b] * tt.astype(f32)
        elif type_id == IQ4_XS:
            s = np.einsum("ncj,mcj->mnc", q[:, b].reshape(n, 8, 32), xs[:, b].reshape(m, 8, 32))
            tt = (s * t["sc"][None, :, b]).sum(-1)
            v = t["d"][None, :, b] * tt.astype(f32)
        elif type_id == Q2_K:
            s = np.einsum("ncj,mcj->mnc", q[:, b].reshape(n, 16, 16), xs[:, b].reshape(m, 16, 16))  # [m, n, 16]
            x16 = xs[:, b].reshape(m, 16, 16).sum(-1)  # [m, 16]
            tt = (s * t["sc"][None, :, b]).sum(-1)
            mm = (t["mn"][None, :, b] * x16[:, None]).sum(-1)
            v = t["d"][None, :, b] * tt.astype(f32) - t["dmin"][None, :, b] * mm.astype(f32)
        else:
            s = xs[:, b] @ q[:, b].T  # [m, n]
            x32 = xs[:, b].sum(-1)[:, None]  # [m, 1]
            if type_id == Q5_0:
                s = s - 16 * x32
            if type_id == Q4_0:
                s = s - 8 * x32
            v = t["d"][None, :, b] * s.astype(f32)
            if type_id in (Q4_1, Q5_1):  # dx * (d * S) + m * sx
                acc = acc + (dx[:, b : b + 1] * v.astype(f32) + t["m"][None, :, b] * sx[:, b : b + 1])
                continue
        acc = acc + dx[:, b : b + 1] * v.astype(f32)
    return acc if bias is None else acc + bias.astype(f32)[None]
