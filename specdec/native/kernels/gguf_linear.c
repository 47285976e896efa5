/* specdec's linear on a GGUF file's own quantised blocks: y = x W^T (+ b), W in one of the types below (quantised
 * or unquantised: F32, F16, BF16).
 *
 * The weights are the file's integers and scales, unchanged: repacked (sd_gguf_pack) so that 16 output channels
 * ("a group") sit side by side, one 32-bit SIMD lane each, but every quant, scale and minimum is the file's.  The
 * activations are quantised per token to 8 bits in blocks (256 columns for the K types and IQ4_XS, 32 for the
 * others, as llama.cpp's Q8_K and Q8_0), and every product is summed exactly in integers.  Per output element,
 * per weight block b (the type's block: 256 or 32 columns), with x's block quants xq = round-half-even(x * (127 /
 * amax)) and its scale dx: fp16(amax / 127) for 32 columns, 1 / (127 / amax) for 256 -- llama.cpp's own activation
 * blocks (block_scale), part of the numbers: with them, a file's logits are llama.cpp's up to float rounding:
 *
 *   Q4_K  T = sum_j sc_j * S_j,  M = sum_j m_j * X32_j            (j: the 8 sub-blocks of 32; S_j = sum q xq)
 *         acc += dx * (d * (float)T - dmin * (float)M)
 *   Q6_K  T = sum_j sc_j * (S_j - 32 X16_j)                        (j: the 16 sub-blocks of 16; q in 0..63)
 *         acc += dx * (d * (float)T)
 *   Q5_0  S = sum q xq - 16 X32  (q in 0..31);   Q8_0  S = sum q xq  (q in -128..127)
 *         acc += dx * (d * (float)S)
 *   Q4_1  S = sum q xq;  acc += dx * (d * (float)S) + m * sx     (sx = half(d32 * (float)X32): ggml's Q8_1 s)
 *   Q4_0  S = sum q xq - 8 X32  (q in 0..15);  acc += dx * (d * (float)S)
 *   Q5_1  S = sum q xq  (q in 0..31);  acc += dx * (d * (float)S) + m * sx
 *   IQ4_NL  S = sum (kv + 128) xq - 128 X32  (kv = kvalues_iq4nl[q], -127..113);  acc += dx * (d * (float)S)
 *   Q2_K  T = sum_j sc_j * S_j,  M = sum_j m_j * X16_j  (j: the 16 sub-blocks of 16; q in 0..3, sc and m 0..15)
 *         acc += dx * (d * (float)T - dmin * (float)M)
 *   F32, F16, BF16: no integers -- x as it is (fp32, unquantised) and the weights widened exactly to fp32:
 *         p_j = the columns k = j mod 4 in order, p_j += x_k * w_k (a product, then a sum; p_j = 0 at first)
 *         acc = (p_0 + p_1) + (p_2 + p_3)
 *   Q5_K  as Q4_K, q in 0..31
 *   Q3_K  T = sum_j (sc_j - 32) * (S_j - 4 X16_j)                 (j: the 16 sub-blocks of 16; q in 0..7)
 *         acc += dx * (d * (float)T)
 *   IQ4_XS  T = sum_j (ls_j - 32) * S_j,  S_j = sum kv[q] xq      (j: the 8 sub-blocks of 32; q in 0..15, kv
 *         acc += dx * (d * (float)T)                                ggml's kvalues_iq4nl, -127..113)
 *
 * with acc = 0 before the first block, the blocks in order, and y = acc (+ bias).  X16 / X32 are sums of xq over
 * 16 / 32 columns.  Q4_1's and Q5_1's minimums multiply sx, the sum a ggml Q8_1 activation block stores beside its
 * quants (s = fp16(d * sum q), d = amax / 127 in fp32, before d itself is rounded to fp16): llama.cpp adds m * s, so
 * the kernel does (half() rounds as fp16 does, to nearest even with fp16's subnormals, but does not overflow: past
 * 65504 it keeps 11 significant bits where ggml's fp16 would be inf).  Every integer is exact (|T| < 2^31), so the order of the integer sums, the SIMD width, the
 * tiling and the threads do not matter; the float operations are the same sequence for every element of every
 * call.  A token's outputs are therefore a function of its own row and the weights only -- **batch-invariant**:
 * the same bits alone, in a verification of several rows and in a prefill -- and the AVX-512 VNNI, AVX2 and
 * portable C paths give the same bits.  Compile with -ffp-contract=off (no FMA may fuse the epilogue).
 *
 * Paths: AVX-512 VNNI multiplies with vpdpbusd (unsigned quants times signed activations, four products a lane;
 * Q8_0's signed quants are stored + 128 and the offset taken back through X32), the sub-block scales with
 * vpmulld, the Q4_K minimums with vpdpwssd.  AVX2 multiplies with vpmaddubsw and folds each sub-block's scale
 * into the widening vpmaddwd.  IQ4_XS's indices become their values by vpshufb (on VNNI kv + 128, the offset
 * taken back through X32; on AVX2 signed, multiplied as |kv| and sign(kv) x).  Several activation rows share each
 * unpacked weight vector (up to R_MAX rows a pass), so a forward of 8 rows reads and unpacks the weights once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specdec_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SD_X86 1
#endif

#define LANES 16  /* output channels per group */
#define R_MAX 8   /* activation rows per pass over a group */

/* ------------------------------------------------------------------ the types */

enum { BLOCK_K = 256, BLOCK_0 = 32 };

/* Bytes of one group's block (16 channels, one weight block) in the packed layout, and the block's columns. */
static int group_block_bytes(int type) {
    switch (type) {
    case GG_Q4_K: return 2304; /* d[16], dmin[16] fp16; the file's 12 scale bytes [12][16]; 8 sub-blocks x 256 B */
    case GG_Q6_K: return 3360; /* d[16] fp16; sc s8 [16][16]; 8 chunks x (256 B nibbles + 128 B crumbs) */
    case GG_Q5_0: return 352;  /* d[16] fp16; 256 B nibbles; 64 B fifth bits */
    case GG_Q8_0: return 544;  /* d[16] fp16; 512 B quants + 128 */
    case GG_Q4_1: return 320;  /* d[16], m[16] fp16; 256 B nibbles */
    case GG_Q4_0: return 288;  /* d[16] fp16; 256 B nibbles */
    case GG_Q5_1: return 384;  /* d[16], m[16] fp16; 256 B nibbles; 64 B fifth bits */
    case GG_IQ4_NL: return 288; /* d[16] fp16; 256 B nibbles (the table's indices) */
    case GG_Q2_K: return 1344;  /* d[16], dmin[16] fp16; the file's 16 scale bytes [16][16]; 8 chunks x 128 B crumbs */
    case GG_F32: return 2048;   /* 32 columns x 16 channels fp32: column e's 16 channels side by side */
    case GG_F16: return 1024;   /* the same in fp16 */
    case GG_BF16: return 1024;  /* and in bf16 */
    case GG_Q5_K: return 2816; /* as Q4_K, each sub-block 256 B nibbles + 64 B fifth bits */
    case GG_Q3_K: return 1760; /* d[16] fp16; the file's 12 scale bytes [12][16]; 8 chunks x (128 B crumbs + 64 B third bits) */
    case GG_IQ4_XS: return 2176; /* d[16] fp16; the file's scales_h (2 bytes), scales_l (4) [6][16]; 8 sub-blocks x 256 B */
    default: return 0;
    }
}

static int block_columns(int type) {
    return type == GG_Q4_K || type == GG_Q6_K || type == GG_Q2_K || type == GG_Q5_K || type == GG_Q3_K || type == GG_IQ4_XS
               ? BLOCK_K : BLOCK_0;
}

/* The file's block bytes (ggml's block_* structs). */
static int file_block_bytes(int type) {
    switch (type) {
    case GG_Q4_K: return 144;
    case GG_Q6_K: return 210;
    case GG_Q5_0: return 22;
    case GG_Q8_0: return 34;
    case GG_Q4_1: return 20;
    case GG_Q4_0: return 18;
    case GG_Q5_1: return 24;
    case GG_IQ4_NL: return 18;
    case GG_Q2_K: return 84;
    case GG_F32: return 128; /* 32 columns of a row, as the file has them */
    case GG_F16: return 64;
    case GG_BF16: return 64;
    case GG_Q5_K: return 176;
    case GG_Q3_K: return 110;
    case GG_IQ4_XS: return 136;
    default: return 0;
    }
}

int sd_gguf_supported(int type) { return group_block_bytes(type) > 0; }

int64_t sd_gguf_packed_bytes(int type, int n, int k) {
    const int bytes = group_block_bytes(type), cols = block_columns(type);
    if (!bytes || k % cols) return -1;
    return (int64_t)((n + LANES - 1) / LANES) * (k / cols) * bytes;
}

/* fp16 <-> fp32 in plain C (the packed layout keeps the file's fp16 scales; the kernels widen them exactly). */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal: normalise */
            int e = -1;
            uint32_t m = man;
            do { e++; m <<= 1; } while (!(m & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t read16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* IQ4_NL's 16 non-linear values, its nibbles' meaning (ggml's kvalues_iq4nl). */
static const int8_t iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* The unquantised weight types, multiplied in floats (see the top comment); bf16 widens exactly to fp32. */
static int float_type(int type) { return type == GG_F32 || type == GG_F16 || type == GG_BF16; }
static float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ------------------------------------------------------------------ packing
 * The unsigned quant the kernels multiply: Q4_K, Q4_1 0..15; Q6_K 0..63 (the file's q, the -32 taken through
 * X16); Q5_0 0..31 (-16 through X32); Q8_0 q + 128 (0..255; -128 through X32).  Within a group's block, column
 * e of a 32-column chunk lives in 4-column group g = (e % 32) / 4 at byte e % 4 of channel c's lane: the
 * nibble layout puts groups 0..3 in the low nibbles of four 64-byte vectors and groups 4..7 in their high
 * nibbles; Q6_K's two high bits of group g sit at bits 2 (g % 4) of a 64-byte vector g / 4; Q5_0's fifth
 * bit of group g at bit g of one 64-byte vector.
 * The second set of types (added at the end of every list): Q4_0 0..15 (-8 through X32), nibbles as Q4_1's;
 * Q5_1 0..31, Q4_1's layout and Q5_0's fifth bits after it; IQ4_NL its nibbles (indices) as Q4_0's, each mapped
 * to its value + 128 (1..241; -128 through X32) by vpshufb as it is unpacked; Q2_K 0..3, group g's crumb at
 * bits 2 (g % 4) of a 64-byte vector g / 4 (as Q6_K's high bits), two vectors a 32-column chunk; F32, F16, BF16
 * the file's values, column e of a 32-column block as one vector of its 16 channels.  Q5_K: Q4_K's nibbles with
 * Q5_0's fifth-bit vector after each sub-block's four.  Q3_K (q = 2 low bits + 4 * the hmask bit, 0..7): group g's
 * low bits at bits 2 (g % 4) of a 64-byte vector g / 4 (as Q6_K's high bits), its third bit at bit g of a third
 * vector (as Q5_0's fifth).  IQ4_XS: the nibbles are indices into kvalues (the VNNI path maps them to kv + 128, the
 * -128 taken through X32). */

static void q4k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q3_K's 6-bit scale i (0..15) of the file's 12 bytes s: low 4 bits a nibble of s[i % 8], high 2 of s[8 + i % 4]. */
static int q3k_scale(const uint8_t *s, int i) {
    return ((i < 8 ? s[i] : s[i - 8] >> 4) & 0xF) | (((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4);
}

/* IQ4_XS's 6-bit scale j (0..7) of the file's 6 bytes s (scales_h, scales_l): low 4 bits a nibble of s[2 + j / 2],
 * high 2 bits 2 (j % 4) of s[j / 4]. */
static int iq4xs_scale(const uint8_t *s, int j) {
    return ((s[2 + j / 2] >> (4 * (j % 2))) & 0xF) | (((s[j / 4] >> (2 * (j % 4))) & 3) << 4);
}

/* A file block's quants, column by column (see above), into v[block_columns(type)]. */
static void decode_block(int type, const uint8_t *blk, uint8_t *v) {
    switch (type) {
    case GG_Q4_K:
        for (int c = 0; c < 4; c++) {
            const uint8_t *qs = blk + 16 + 32 * c;
            for (int l = 0; l < 32; l++) {
                v[64 * c + l] = qs[l] & 0xF;
                v[64 * c + 32 + l] = qs[l] >> 4;
            }
        }
        break;
    case GG_Q6_K:
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            uint8_t *o = v + 128 * h;
            for (int i = 0; i < 32; i++) {
                o[i] = (uint8_t)((ql[i] & 0xF) | ((qh[i] & 3) << 4));
                o[i + 32] = (uint8_t)((ql[i + 32] & 0xF) | (((qh[i] >> 2) & 3) << 4));
                o[i + 64] = (uint8_t)((ql[i] >> 4) | (((qh[i] >> 4) & 3) << 4));
                o[i + 96] = (uint8_t)((ql[i + 32] >> 4) | (((qh[i] >> 6) & 3) << 4));
            }
        }
        break;
    case GG_Q5_0: {
        const uint32_t qh = (uint32_t)blk[2] | ((uint32_t)blk[3] << 8) | ((uint32_t)blk[4] << 16) | ((uint32_t)blk[5] << 24);
        for (int e = 0; e < 16; e++) {
            v[e] = (uint8_t)((blk[6 + e] & 0xF) | (((qh >> e) & 1) << 4));
            v[e + 16] = (uint8_t)((blk[6 + e] >> 4) | (((qh >> (e + 16)) & 1) << 4));
        }
        break;
    }
    case GG_Q8_0:
        for (int e = 0; e < 32; e++) v[e] = (uint8_t)((int)(int8_t)blk[2 + e] + 128);
        break;
    case GG_Q4_1:
        for (int e = 0; e < 16; e++) {
            v[e] = blk[4 + e] & 0xF;
            v[e + 16] = blk[4 + e] >> 4;
        }
        break;
    case GG_Q5_K: /* column e: nibble of qs[32 (e / 64) + e % 32] (high for odd e / 32), fifth bit e / 32 of qh[e % 32] */
        for (int e = 0; e < 256; e++) {
            const uint8_t byte = blk[48 + 32 * (e / 64) + e % 32];
            v[e] = (uint8_t)(((e / 32) % 2 ? byte >> 4 : byte & 0xF) | (((blk[16 + e % 32] >> (e / 32)) & 1) << 4));
        }
        break;
    case GG_Q3_K: /* column e: bits 2 ((e % 128) / 32) of qs[32 (e / 128) + e % 32], third bit e / 32 of hmask[e % 32] */
        for (int e = 0; e < 256; e++) {
            const int low = (blk[32 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            v[e] = (uint8_t)(low | (((blk[e % 32] >> (e / 32)) & 1) << 2));
        }
        break;
    case GG_IQ4_XS: /* column 32 j + l: the low (l < 16) or high nibble of qs[16 j + l % 16] (indices) */
        for (int e = 0; e < 256; e++) {
            const uint8_t byte = blk[8 + 16 * (e / 32) + e % 16];
            v[e] = (e % 32) < 16 ? byte & 0xF : byte >> 4;
        }
        break;
    case GG_Q4_0:
    case GG_IQ4_NL: /* the nibbles: IQ4_NL's indices into iq4nl_values */
        for (int e = 0; e < 16; e++) {
            v[e] = blk[2 + e] & 0xF;
            v[e + 16] = blk[2 + e] >> 4;
        }
        break;
    case GG_Q2_K: /* column 128 h + 32 j + l: bits 2 j of qs[32 h + l] */
        for (int e = 0; e < 256; e++) v[e] = (blk[16 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        break;
    case GG_Q5_1: { /* Q5_0's quants after d and m */
        const uint32_t qh = (uint32_t)blk[4] | ((uint32_t)blk[5] << 8) | ((uint32_t)blk[6] << 16) | ((uint32_t)blk[7] << 24);
        for (int e = 0; e < 16; e++) {
            v[e] = (uint8_t)((blk[8 + e] & 0xF) | (((qh >> e) & 1) << 4));
            v[e + 16] = (uint8_t)((blk[8 + e] >> 4) | (((qh >> (e + 16)) & 1) << 4));
        }
        break;
    }
    }
}

/* Channel c's 32 quants v[32] into the nibble layout at out (four 64-byte vectors). */
static void put_nibbles(uint8_t *out, int c, const uint8_t *v) {
    for (int z = 0; z < 4; z++)
        for (int b = 0; b < 4; b++) out[64 * z + 4 * c + b] = (uint8_t)((v[4 * z + b] & 0xF) | ((v[16 + 4 * z + b] & 0xF) << 4));
}

static void pack_block(int type, const uint8_t *src, int c, uint8_t *dst) {
    uint8_t v[BLOCK_K];
    decode_block(type, src, v);
    switch (type) {
    case GG_Q4_K:
        memcpy(dst + 2 * c, src, 2);          /* d */
        memcpy(dst + 32 + 2 * c, src + 2, 2); /* dmin */
        for (int b = 0; b < 12; b++) dst[64 + 16 * b + c] = src[4 + b]; /* the 6-bit scales and minimums, as packed */
        for (int j = 0; j < 8; j++) put_nibbles(dst + 256 + 256 * j, c, v + 32 * j);
        break;
    case GG_Q6_K:
        memcpy(dst + 2 * c, src + 208, 2); /* d */
        for (int j = 0; j < 16; j++) dst[32 + 16 * j + c] = src[192 + j];
        for (int t = 0; t < 8; t++) {
            uint8_t *chunk = dst + 288 + 384 * t;
            const uint8_t *w = v + 32 * t;
            put_nibbles(chunk, c, w);
            for (int h = 0; h < 2; h++)
                for (int b = 0; b < 4; b++) {
                    uint8_t byte = 0;
                    for (int s = 0; s < 4; s++) byte |= (uint8_t)((w[16 * h + 4 * s + b] >> 4) << (2 * s));
                    chunk[256 + 64 * h + 4 * c + b] = byte;
                }
        }
        break;
    case GG_Q5_0:
        memcpy(dst + 2 * c, src, 2);
        put_nibbles(dst + 32, c, v);
        for (int b = 0; b < 4; b++) {
            uint8_t byte = 0;
            for (int g = 0; g < 8; g++) byte |= (uint8_t)((v[4 * g + b] >> 4) << g);
            dst[288 + 4 * c + b] = byte;
        }
        break;
    case GG_Q8_0:
        memcpy(dst + 2 * c, src, 2);
        for (int e = 0; e < 32; e++) dst[32 + 64 * (e / 4) + 4 * c + e % 4] = v[e];
        break;
    case GG_Q4_1:
        memcpy(dst + 2 * c, src, 2);          /* d */
        memcpy(dst + 32 + 2 * c, src + 2, 2); /* m */
        put_nibbles(dst + 64, c, v);
        break;
    case GG_Q5_K:
        memcpy(dst + 2 * c, src, 2);          /* d */
        memcpy(dst + 32 + 2 * c, src + 2, 2); /* dmin */
        for (int b = 0; b < 12; b++) dst[64 + 16 * b + c] = src[4 + b];
        for (int j = 0; j < 8; j++) {
            uint8_t *sub = dst + 256 + 320 * j;
            put_nibbles(sub, c, v + 32 * j);
            for (int b = 0; b < 4; b++) {
                uint8_t byte = 0;
                for (int g = 0; g < 8; g++) byte |= (uint8_t)((v[32 * j + 4 * g + b] >> 4) << g);
                sub[256 + 4 * c + b] = byte;
            }
        }
        break;
    case GG_Q3_K:
        memcpy(dst + 2 * c, src + 108, 2); /* d */
        for (int b = 0; b < 12; b++) dst[32 + 16 * b + c] = src[96 + b];
        for (int t = 0; t < 8; t++) {
            uint8_t *chunk = dst + 224 + 192 * t;
            const uint8_t *w = v + 32 * t;
            for (int b = 0; b < 4; b++) {
                uint8_t low[2] = {0, 0}, hi = 0;
                for (int g = 0; g < 8; g++) {
                    low[g / 4] |= (uint8_t)((w[4 * g + b] & 3) << (2 * (g % 4)));
                    hi |= (uint8_t)((w[4 * g + b] >> 2) << g);
                }
                chunk[4 * c + b] = low[0];
                chunk[64 + 4 * c + b] = low[1];
                chunk[128 + 4 * c + b] = hi;
            }
        }
        break;
    case GG_IQ4_XS:
        memcpy(dst + 2 * c, src, 2); /* d */
        for (int b = 0; b < 6; b++) dst[32 + 16 * b + c] = src[2 + b];
        for (int j = 0; j < 8; j++) put_nibbles(dst + 128 + 256 * j, c, v + 32 * j);
        break;
    case GG_Q4_0:
    case GG_IQ4_NL:
        memcpy(dst + 2 * c, src, 2);
        put_nibbles(dst + 32, c, v);
        break;
    case GG_Q5_1:
        memcpy(dst + 2 * c, src, 2);          /* d */
        memcpy(dst + 32 + 2 * c, src + 2, 2); /* m */
        put_nibbles(dst + 64, c, v);
        for (int b = 0; b < 4; b++) {
            uint8_t byte = 0;
            for (int g = 0; g < 8; g++) byte |= (uint8_t)((v[4 * g + b] >> 4) << g);
            dst[320 + 4 * c + b] = byte;
        }
        break;
    case GG_Q2_K:
        memcpy(dst + 2 * c, src + 80, 2);      /* d */
        memcpy(dst + 32 + 2 * c, src + 82, 2); /* dmin */
        for (int j = 0; j < 16; j++) dst[64 + 16 * j + c] = src[j]; /* scale | minimum << 4, as the file has them */
        for (int t = 0; t < 8; t++)
            for (int h = 0; h < 2; h++)
                for (int b = 0; b < 4; b++) {
                    uint8_t byte = 0;
                    for (int s = 0; s < 4; s++) byte |= (uint8_t)(v[32 * t + 16 * h + 4 * s + b] << (2 * s));
                    dst[320 + 128 * t + 64 * h + 4 * c + b] = byte;
                }
        break;
    case GG_F32:
    case GG_F16:
    case GG_BF16: {
        const int size = type == GG_F32 ? 4 : 2;
        for (int e = 0; e < 32; e++) memcpy(dst + (16 * e + c) * size, src + e * size, (size_t)size);
        break;
    }
    }
}

/* Repack n rows of k columns of the file's blocks (row-major, as the file stores a tensor) into out
 * (sd_gguf_packed_bytes of them; channels past n are zero): output channel c is the file's row order[c] (order
 * NULL: row c).  Returns 0, or -1 for a type or shape it cannot. */
int sd_gguf_pack(int type, const uint8_t *src, int n, int k, const int32_t *order, uint8_t *out, int threads) {
    const int64_t total = sd_gguf_packed_bytes(type, n, k);
    if (total < 0) return -1;
    const int gbytes = group_block_bytes(type), fbytes = file_block_bytes(type), nb = k / block_columns(type);
    const int groups = (n + LANES - 1) / LANES;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && groups > 8)
#endif
    for (int g = 0; g < groups; g++) {
        uint8_t *grp = out + (int64_t)g * nb * gbytes;
        memset(grp, 0, (size_t)nb * gbytes);
        for (int c = 0; c < LANES && g * LANES + c < n; c++) {
            const int64_t at = order ? order[g * LANES + c] : g * LANES + c;
            const uint8_t *row = src + at * nb * fbytes;
            for (int b = 0; b < nb; b++) pack_block(type, row + (int64_t)b * fbytes, c, grp + (int64_t)b * gbytes);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ activations
 * Row i of x: xq[i * k ..] int8 in [-127, 127], block scales dx (per BLOCK_K or BLOCK_0 columns), X16 int32 (per
 * 16 columns) and X32 (int32 per 32; for Q4_K's vpdpwssd also as int16 pairs): what the portable path reads.
 *
 * The SIMD paths read the same numbers laid out in panels, one per pass of up to R_MAX rows: the 4 columns a lane
 * multiplies at once sit side by side for the pass's rows, so that every activation a pass reads is at a constant
 * offset from one pointer, and the per-block sums and scales are gathered by block and row likewise: one pointer a
 * pass, where rows of their own took a register each and spilled (8 rows: 9 pointers live in the loop).  A pass of
 * P rows (rows 8 p .. 8 p + P - 1, P = min(R_MAX, m - 8 p)) has its panel at qp + 8 p k: column 32 s + 4 g + e of
 * its row r at 32 P s + 4 P g + 4 r + e (P = 1: the row as it is, so that a one-row pass reads no more memory than
 * its row: spread over 8 rows' room, a row of 8,960 columns took 70 KB of cache, and a down projection's step 30
 * us more). */
typedef struct {
    int8_t *q;
    float *dx;     /* [m, k / block] */
    int32_t *x16;  /* [m, k / 16] */
    int32_t *x32;  /* [m, k / 32] */
    int16_t *x32h; /* [m, k / 32] */
    float *sx;     /* [m, k / 32]: Q8_1's s, half(amax / 127 * X32) (32-column blocks only) */
    /* the panels, P = ceil(m / R_MAX) passes */
    int8_t *qp;     /* [P, k / 32, 8 groups of 4 columns, R_MAX rows, 4] */
    float *dxp;     /* [P, k / block, R_MAX] */
    int32_t *x32p;  /* [P, k / 32, 3, R_MAX]: X32, -16 X32 (Q5_0's offset), -128 X32 (Q8_0's) */
    int16_t *x32hp; /* [P, k / 256, R_MAX, 8]: Q4_K's minimums' X32 of a block's 8 sub-blocks */
    int32_t *x16np; /* [P, k / 16, R_MAX]: -32 X16, Q6_K's offset of each 16 columns (AVX-512 VNNI) */
    int16_t *x16hp; /* [P, k / 256, R_MAX, 16]: X16 of a block's 16 sub-blocks, Q6_K's offsets (AVX2) */
    float *sxp;     /* [P, k / 32, R_MAX]: sx (32-column blocks only) */
    int k, block, m;
    const float *x; /* F32, F16, BF16: the rows themselves (row stride ldx), no quants */
    int64_t ldx;
} acts_t;

/* A block's scale dx from its amax (> 0, finite), as llama.cpp's activation blocks hold it, so that the integer sums
 * and their scales are llama.cpp's own: a 32-column block (ggml's Q8_0 / Q8_1, for the types of 32) keeps
 * amax / 127 rounded to fp16 (its d is a ggml_half: round to nearest even, subnormals kept, past 65504 inf); a
 * 256-column block (Q8_K, for the K types and IQ4_XS) keeps 1 / (127 / amax) in fp32 (ggml's d = 1 / iscale, which
 * may differ from amax / 127 in the last bit).  The quants are q = round-half-even(x * (127 / amax)) for both, as
 * llama.cpp's x86 quantisers round them. */
/* v rounded to fp16's precision (nearest even; under 2^-14 a multiple of 2^-24, as fp16's subnormals), kept in
 * fp32; v finite.  Past 65504 it keeps 11 significant bits (fp16 would be inf): the caller says what it wants. */
static float half_round(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    if ((bits & 0x7fffffffu) < 0x38800000u) /* |v| under 2^-14: an fp16 subnormal (both scalings exact) */
        return nearbyintf(v * 16777216.0f) * (1.0f / 16777216.0f);
    bits = (bits + 0xfffu + ((bits >> 13) & 1u)) & ~0x1fffu; /* 23 mantissa bits to 10, half to even */
    float r;
    memcpy(&r, &bits, 4);
    return r;
}

static float block_scale(float amax, int n) {
    if (n != BLOCK_0) return 1.0f / (127.0f / amax);
    const float d = amax / 127.0f;
    uint32_t bits;
    memcpy(&bits, &d, 4);
    if (bits >= 0x477ff000u) return INFINITY; /* 65520 and up: fp16's nearest even is inf */
    return half_round(d);
}

/* Q8_1's s of a 32-column block: half(amax / 127 * X32), amax / 127 in fp32 (ggml's d before its fp16 rounding);
 * 0 for an all-zero block, NaN for a block with NaN or inf (whose dx is NaN). */
static float block_sum(float amax, int32_t x32) {
    if (amax == 0.0f || !isfinite(amax)) return amax == 0.0f ? 0.0f : NAN;
    return half_round(amax / 127.0f * (float)x32);
}

static float quantize_block_c(const float *x, int n, int8_t *q, float *amax_out) {
    float amax = 0.0f;
    for (int j = 0; j < n; j++) {
        const float a = fabsf(x[j]);
        if (a > amax || a != a) amax = a;
    }
    *amax_out = amax;
    if (amax == 0.0f || !isfinite(amax)) {
        memset(q, 0, (size_t)n);
        return amax == 0.0f ? 0.0f : NAN;
    }
    const float inv = 127.0f / amax;
    for (int j = 0; j < n; j++) {
        float v = nearbyintf(x[j] * inv); /* round half to even, as cvtps2dq */
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[j] = (int8_t)v;
    }
    return block_scale(amax, n);
}

#ifdef SD_X86
#define AVX512Q __attribute__((target("avx512f,avx512bw")))
AVX512Q static float quantize_block_avx512(const float *x, int n, int8_t *q, float *amax_out) {
    /* n is 32 or 256: whole vectors.  max |x| is exact in any order; NaN: cmp unordered */
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int j = 0; j < n; j += 16) {
        __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + j));
        nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(vmax, a);
    }
    float amax = _mm512_reduce_max_ps(vmax);
    if (nan) amax = NAN;
    *amax_out = amax;
    if (amax == 0.0f || !isfinite(amax)) {
        memset(q, 0, (size_t)n);
        return amax == 0.0f ? 0.0f : NAN;
    }
    const float inv = 127.0f / amax;
    const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    for (int j = 0; j < n; j += 16) {
        __m512 f = _mm512_mul_ps(_mm512_loadu_ps(x + j), vinv);
        f = _mm512_roundscale_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        f = _mm512_min_ps(_mm512_max_ps(f, lo), hi);
        _mm_storeu_si128((__m128i *)(q + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(f)));
    }
    return block_scale(amax, n);
}
#endif

static int has_avx512(void) {
#ifdef SD_X86
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && sd_isa_limit() > ISA_AVX2;
    }
    return cached;
#else
    return 0;
#endif
}

/* X16: the sums of q over each 16 columns of a row (n16 of them, an even number). */
static void sums16_c(const int8_t *q, int n16, int32_t *x16) {
    for (int j = 0; j < n16; j++) {
        int32_t s = 0;
        for (int e = 0; e < 16; e++) s += q[16 * j + e];
        x16[j] = s;
    }
}

#ifdef SD_X86
/* The same sums, 32 columns a step: pair sums (vpmaddubsw with ones), then sums of 4, then of 16 per 128 bits. */
__attribute__((target("avx2"))) static void sums16_avx2(const int8_t *q, int n16, int32_t *x16) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int j = 0; j < n16; j += 2) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 * j));
        const __m256i fours = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16); /* 8 sums of 4 */
        __m256i h = _mm256_hadd_epi32(fours, fours);
        h = _mm256_hadd_epi32(h, h); /* each 128-bit half: its 16 columns' sum */
        x16[j] = _mm256_extract_epi32(h, 0);
        x16[j + 1] = _mm256_extract_epi32(h, 4);
    }
}

static int has_avx2(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && sd_isa_limit() >= ISA_AVX2;
    }
    return cached;
}
#endif

static void quantize_row(const float *x, acts_t *a, int i, int isa) {
    const int k = a->k, nb = k / a->block;
    int8_t *q = a->q + (int64_t)i * k;
    float amax_k; /* 256 columns: amax unused */
    float *amaxes = a->block == BLOCK_0 ? a->sx + (int64_t)i * nb : NULL; /* 32 columns: sx holds amax until below */
    for (int b = 0; b < nb; b++) {
        float *at = amaxes ? amaxes + b : &amax_k;
#ifdef SD_X86
        if (isa > ISA_C && has_avx512())
            a->dx[(int64_t)i * nb + b] = quantize_block_avx512(x + (int64_t)b * a->block, a->block, q + (int64_t)b * a->block, at);
        else
#endif
            a->dx[(int64_t)i * nb + b] = quantize_block_c(x + (int64_t)b * a->block, a->block, q + (int64_t)b * a->block, at);
    }
    int32_t *x16 = a->x16 + (int64_t)i * (k / 16);
#ifdef SD_X86
    if (isa > ISA_C && has_avx2())
        sums16_avx2(q, k / 16, x16);
    else
#endif
        sums16_c(q, k / 16, x16);
    for (int j = 0; j < k / 32; j++) {
        const int32_t s = x16[2 * j] + x16[2 * j + 1];
        a->x32[(int64_t)i * (k / 32) + j] = s;
        a->x32h[(int64_t)i * (k / 32) + j] = (int16_t)s; /* |s| <= 32 * 127 */
        if (a->block == BLOCK_0) a->sx[(int64_t)i * nb + j] = block_sum(amaxes[j], s); /* (nb = k / 32) */
    }
}

/* Row i's numbers into its pass's panels (see acts_t).  A last pass's rows past m are never read (a pass of R rows
 * reads rows 0 .. R - 1 of its panel): they stay as they are. */
static void panel_row(acts_t *a, int i, int m) {
    const int k = a->k, nb = k / a->block, p = i / R_MAX, r = i % R_MAX, n32 = k / 32;
    const int rows = m - R_MAX * p < R_MAX ? m - R_MAX * p : R_MAX; /* the pass's P */
    int8_t *qp = a->qp + (int64_t)p * R_MAX * k + 4 * r;
    const int8_t *q = a->q + (int64_t)i * k;
    for (int s = 0; s < n32 && rows > 1; s++) /* a pass of one row reads the row itself (panel) */
        for (int g = 0; g < 8; g++) memcpy(qp + (int64_t)s * 32 * rows + 4 * rows * g, q + 32 * s + 4 * g, 4);
    for (int b = 0; b < nb; b++) a->dxp[((int64_t)p * nb + b) * R_MAX + r] = a->dx[(int64_t)i * nb + b];
    for (int s = 0; s < n32; s++) {
        const int32_t x32 = a->x32[(int64_t)i * n32 + s];
        int32_t *at = a->x32p + ((int64_t)p * n32 + s) * 3 * R_MAX + r;
        at[0] = x32;
        at[R_MAX] = -16 * x32;
        at[2 * R_MAX] = -128 * x32;
    }
    if (a->block != BLOCK_K) {
        for (int s = 0; s < n32; s++) a->sxp[((int64_t)p * n32 + s) * R_MAX + r] = a->sx[(int64_t)i * n32 + s];
        return;
    }
    for (int j = 0; j < k / 16; j++) a->x16np[((int64_t)p * (k / 16) + j) * R_MAX + r] = -32 * a->x16[(int64_t)i * (k / 16) + j];
    for (int b = 0; b < k / BLOCK_K; b++) {
        int16_t *mins = a->x32hp + (((int64_t)p * (k / BLOCK_K) + b) * R_MAX + r) * 8;
        int16_t *offs = a->x16hp + (((int64_t)p * (k / BLOCK_K) + b) * R_MAX + r) * 16;
        for (int j = 0; j < 8; j++) mins[j] = a->x32h[(int64_t)i * n32 + 8 * b + j];
        for (int j = 0; j < 16; j++) offs[j] = (int16_t)a->x16[(int64_t)i * (k / 16) + 16 * b + j]; /* |X16| <= 2032 */
    }
}

/* The activations of m rows in one block of scratch memory (slot 0 for the K types' blocks, 1 for the others). */
static void *alloc_acts(acts_t *a, int m, int k, int block) {
    const size_t rows = (size_t)(m > 0 ? m : 1), padded = (rows + R_MAX - 1) / R_MAX * R_MAX;
    const size_t sx = block == BLOCK_0 ? 4 : 0; /* sx and its panel: 32-column blocks only */
    const size_t sizes[13] = {rows * k, rows * (k / block) * 4, rows * (k / 16) * 4, rows * (k / 32) * 4,
                              rows * (k / 32) * 2, padded * k, padded * (k / block) * 4, padded * (k / 32) * 12,
                              padded * (k / 32) * 2, padded * (k / 16) * 4, padded * (k / 16) * 2,
                              rows * (k / 32) * sx, padded * (k / 32) * sx};
    size_t total = 0;
    for (int i = 0; i < 13; i++) total += (sizes[i] + 63) / 64 * 64;
    uint8_t *block_mem = scratch_take(block == BLOCK_K ? 0 : 1, total);
    if (!block_mem) return NULL;
    void *at[13];
    uint8_t *p = block_mem;
    for (int i = 0; i < 13; i++) {
        at[i] = p;
        p += (sizes[i] + 63) / 64 * 64;
    }
    a->q = at[0];
    a->dx = at[1];
    a->x16 = at[2];
    a->x32 = at[3];
    a->x32h = at[4];
    a->qp = at[5];
    a->dxp = at[6];
    a->x32p = at[7];
    a->x32hp = at[8];
    a->x16np = at[9];
    a->x16hp = at[10];
    a->sx = at[11];
    a->sxp = at[12];
    a->k = k;
    a->block = block;
    a->m = m;
    return block_mem;
}

/* ------------------------------------------------------------------ portable path
 * Reads the packed layout back and computes the integers and the epilogue of the top comment, element by element. */

static int packed_quant(int type, const uint8_t *blk, int c, int e) {
    const int g = (e % 32) / 4, b = e % 4;
    switch (type) {
    case GG_Q4_K: {
        const uint8_t byte = blk[256 + 256 * (e / 32) + 64 * (g % 4) + 4 * c + b];
        return g < 4 ? byte & 0xF : byte >> 4;
    }
    case GG_Q6_K: {
        const uint8_t *chunk = blk + 288 + 384 * (e / 32);
        const uint8_t byte = chunk[64 * (g % 4) + 4 * c + b], hi = chunk[256 + 64 * (g / 4) + 4 * c + b];
        return (g < 4 ? byte & 0xF : byte >> 4) | (((hi >> (2 * (g % 4))) & 3) << 4);
    }
    case GG_Q5_0: {
        const uint8_t byte = blk[32 + 64 * (g % 4) + 4 * c + b], hi = blk[288 + 4 * c + b];
        return (g < 4 ? byte & 0xF : byte >> 4) | (((hi >> g) & 1) << 4);
    }
    case GG_Q8_0: return blk[32 + 64 * g + 4 * c + b];
    case GG_Q4_1: {
        const uint8_t byte = blk[64 + 64 * (g % 4) + 4 * c + b];
        return g < 4 ? byte & 0xF : byte >> 4;
    }
    case GG_Q4_0: {
        const uint8_t byte = blk[32 + 64 * (g % 4) + 4 * c + b];
        return g < 4 ? byte & 0xF : byte >> 4;
    }
    case GG_Q5_1: {
        const uint8_t byte = blk[64 + 64 * (g % 4) + 4 * c + b], hi = blk[320 + 4 * c + b];
        return (g < 4 ? byte & 0xF : byte >> 4) | (((hi >> g) & 1) << 4);
    }
    case GG_IQ4_NL: {
        const uint8_t byte = blk[32 + 64 * (g % 4) + 4 * c + b];
        return iq4nl_values[g < 4 ? byte & 0xF : byte >> 4] + 128;
    }
    case GG_Q2_K: return (blk[320 + 128 * (e / 32) + 64 * (g / 4) + 4 * c + b] >> (2 * (g % 4))) & 3;
    case GG_Q5_K: {
        const uint8_t *sub = blk + 256 + 320 * (e / 32);
        const uint8_t byte = sub[64 * (g % 4) + 4 * c + b], hi = sub[256 + 4 * c + b];
        return (g < 4 ? byte & 0xF : byte >> 4) | (((hi >> g) & 1) << 4);
    }
    case GG_Q3_K: {
        const uint8_t *chunk = blk + 224 + 192 * (e / 32);
        const uint8_t low = chunk[64 * (g / 4) + 4 * c + b], hi = chunk[128 + 4 * c + b];
        return ((low >> (2 * (g % 4))) & 3) | (((hi >> g) & 1) << 2);
    }
    case GG_IQ4_XS: { /* the index */
        const uint8_t byte = blk[128 + 256 * (e / 32) + 64 * (g % 4) + 4 * c + b];
        return g < 4 ? byte & 0xF : byte >> 4;
    }
    default: return 0;
    }
}

/* Channel c of a group: the value its block b adds to acc for row i (the top comment's epilogue). */
static float block_c(int type, const uint8_t *blk, int c, const acts_t *a, int i, int b) {
    const int cols = block_columns(type), k = a->k;
    const int8_t *xq = a->q + (int64_t)i * k + (int64_t)b * cols;
    const float dx = a->dx[(int64_t)i * (k / a->block) + b];
    const int32_t *x16 = a->x16 + (int64_t)i * (k / 16) + (int64_t)b * (cols / 16);
    const int32_t *x32 = a->x32 + (int64_t)i * (k / 32) + (int64_t)b * (cols / 32);
    const float d = half_to_float(read16(blk + 2 * c));
    switch (type) {
    case GG_Q4_K: {
        int32_t t = 0, mm = 0;
        uint8_t raw[12];
        for (int b = 0; b < 12; b++) raw[b] = blk[64 + 16 * b + c];
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            q4k_scale_min(raw, j, &sc, &m);
            int32_t s = 0;
            for (int e = 32 * j; e < 32 * j + 32; e++) s += packed_quant(type, blk, c, e) * xq[e];
            t += (int32_t)sc * s;
            mm += (int32_t)m * x32[j];
        }
        const float dmin = half_to_float(read16(blk + 32 + 2 * c));
        return dx * (d * (float)t - dmin * (float)mm);
    }
    case GG_Q6_K: {
        int32_t t = 0;
        for (int j = 0; j < 16; j++) {
            int32_t s = -32 * x16[j];
            for (int e = 16 * j; e < 16 * j + 16; e++) s += packed_quant(type, blk, c, e) * xq[e];
            t += (int32_t)(int8_t)blk[32 + 16 * j + c] * s;
        }
        return dx * (d * (float)t);
    }
    case GG_Q5_0:
    case GG_Q8_0: {
        int32_t s = (type == GG_Q5_0 ? -16 : -128) * x32[0];
        for (int e = 0; e < 32; e++) s += packed_quant(type, blk, c, e) * xq[e];
        return dx * (d * (float)s);
    }
    case GG_Q4_1: {
        int32_t s = 0;
        for (int e = 0; e < 32; e++) s += packed_quant(type, blk, c, e) * xq[e];
        const float m = half_to_float(read16(blk + 32 + 2 * c)), sx = a->sx[(int64_t)i * (k / 32) + b];
        return dx * (d * (float)s) + m * sx;
    }
    case GG_Q5_K: { /* Q4_K's sums, q in 0..31 */
        int32_t t = 0, mm = 0;
        uint8_t raw[12];
        for (int b = 0; b < 12; b++) raw[b] = blk[64 + 16 * b + c];
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            q4k_scale_min(raw, j, &sc, &m);
            int32_t s = 0;
            for (int e = 32 * j; e < 32 * j + 32; e++) s += packed_quant(type, blk, c, e) * xq[e];
            t += (int32_t)sc * s;
            mm += (int32_t)m * x32[j];
        }
        const float dmin = half_to_float(read16(blk + 32 + 2 * c));
        return dx * (d * (float)t - dmin * (float)mm);
    }
    case GG_Q3_K: {
        uint8_t raw[12];
        for (int b = 0; b < 12; b++) raw[b] = blk[32 + 16 * b + c];
        int32_t t = 0;
        for (int j = 0; j < 16; j++) {
            int32_t s = -4 * x16[j];
            for (int e = 16 * j; e < 16 * j + 16; e++) s += packed_quant(type, blk, c, e) * xq[e];
            t += (q3k_scale(raw, j) - 32) * s;
        }
        return dx * (d * (float)t);
    }
    case GG_IQ4_XS: {
        uint8_t raw[6];
        for (int b = 0; b < 6; b++) raw[b] = blk[32 + 16 * b + c];
        int32_t t = 0;
        for (int j = 0; j < 8; j++) {
            int32_t s = 0;
            for (int e = 32 * j; e < 32 * j + 32; e++) s += iq4nl_values[packed_quant(type, blk, c, e)] * xq[e];
            t += (iq4xs_scale(raw, j) - 32) * s;
        }
        return dx * (d * (float)t);
    }
    case GG_Q4_0: {
        int32_t s = -8 * x32[0];
        for (int e = 0; e < 32; e++) s += packed_quant(type, blk, c, e) * xq[e];
        return dx * (d * (float)s);
    }
    case GG_Q5_1: {
        int32_t s = 0;
        for (int e = 0; e < 32; e++) s += packed_quant(type, blk, c, e) * xq[e];
        const float m = half_to_float(read16(blk + 32 + 2 * c)), sx = a->sx[(int64_t)i * (k / 32) + b];
        return dx * (d * (float)s) + m * sx;
    }
    case GG_IQ4_NL: {
        int32_t s = -128 * x32[0];
        for (int e = 0; e < 32; e++) s += packed_quant(type, blk, c, e) * xq[e];
        return dx * (d * (float)s);
    }
    case GG_Q2_K: {
        int32_t t = 0, mm = 0;
        for (int j = 0; j < 16; j++) {
            const int32_t sc = blk[64 + 16 * j + c] & 0xF, m = blk[64 + 16 * j + c] >> 4;
            int32_t s = 0;
            for (int e = 16 * j; e < 16 * j + 16; e++) s += packed_quant(type, blk, c, e) * xq[e];
            t += sc * s;
            mm += m * x16[j];
        }
        const float dmin = half_to_float(read16(blk + 32 + 2 * c));
        return dx * (d * (float)t - dmin * (float)mm);
    }
    default: return 0.0f;
    }
}

static void group_c(int type, const uint8_t *grp, int nb, const acts_t *a, int i0, int rows, float out[R_MAX][LANES]) {
    const int gbytes = group_block_bytes(type);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < LANES; c++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) acc += block_c(type, grp + (int64_t)b * gbytes, c, a, i0 + r, b);
            out[r][c] = acc;
        }
}

/* F32, F16, BF16: the four partial sums of the top comment, column by column, per channel. */
static void group_float_c(int type, const uint8_t *grp, int nb, const acts_t *a, int i0, int rows, float out[R_MAX][LANES]) {
    const int gbytes = group_block_bytes(type), size = type == GG_F32 ? 4 : 2;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < LANES; c++) {
            const float *x = a->x + (int64_t)(i0 + r) * a->ldx;
            float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int b = 0; b < nb; b++)
                for (int e = 0; e < 32; e++) {
                    const uint8_t *at = grp + (int64_t)b * gbytes + (16 * e + c) * size;
                    float w;
                    if (type == GG_F32) memcpy(&w, at, 4);
                    else w = type == GG_F16 ? half_to_float(read16(at)) : bf16_to_float(read16(at));
                    p[e % 4] += x[32 * b + e] * w; /* a product, then a sum: -ffp-contract=off */
                }
            out[r][c] = (p[0] + p[1]) + (p[2] + p[3]);
        }
}

/* ------------------------------------------------------------------ AVX-512 VNNI path */
#ifdef SD_X86
#define INLINE __attribute__((always_inline)) static inline

/* Q4_K's 6-bit scales and minimums of 16 channels (the file's 12 bytes each, byte b of the 16 channels at row b):
 * sc[j], m[j] as 16 bytes, j = 0..7 (ggml's get_scale_min_k4 on every lane at once); for the AVX2 and VNNI
 * paths alike. */
__attribute__((target("avx2"))) INLINE void q4k_scales(const uint8_t *blk, __m128i sc[8], __m128i m[8]) {
    const __m128i six = _mm_set1_epi8(63), low = _mm_set1_epi8(0x0F), top = _mm_set1_epi8(0x30);
    __m128i s[12];
    for (int b = 0; b < 12; b++) s[b] = _mm_loadu_si128((const __m128i *)(blk + 64 + 16 * b));
    for (int j = 0; j < 4; j++) {
        sc[j] = _mm_and_si128(s[j], six);
        m[j] = _mm_and_si128(s[j + 4], six);
        /* bits 6-7 of s[j - 4] (here s[j]) and s[j] (here s[j + 4]) become bits 4-5 */
        sc[j + 4] = _mm_or_si128(_mm_and_si128(s[j + 8], low), _mm_and_si128(_mm_srli_epi16(s[j], 2), top));
        m[j + 4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(s[j + 8], 4), low), _mm_and_si128(_mm_srli_epi16(s[j + 4], 2), top));
    }
}

#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

/* Software prefetch of the weight stream, `ahead` bytes ahead: the lines of [p, p + bytes) (each group's blocks
 * follow one another, and a thread's groups too, so the stream runs on).  The distance was measured on the 1.5B
 * (Zen 4, two builds alternated in one process, medians of 8): one row, where a step only streams, is fastest
 * far ahead (8 KiB: 21.9 ms a step, 4 KiB 23.6, none 21.9); several rows, where the multiplies must overlap
 * the stream, nearer (4 KiB: 4 rows 33.4 ms, 8 KiB 34.1, none 47.0; 8 rows 48.2, 49.0, 77.0), and into L2 from
 * 16 KiB ahead as well (8 rows 47.9 -> 44.1 ms, medians of 12, 32 and 64 KiB no better; one row no faster). */
#define PF_AHEAD(R) ((R) == 1 ? 8192 : 4096)
#define PF_L2 16384 /* several rows: each line into L2 this far ahead too */
VNNI INLINE void prefetch_ahead(const uint8_t *p, int bytes, int ahead) {
    for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)p + ahead + l, _MM_HINT_T0);
    if (ahead != PF_AHEAD(1))
        for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)p + PF_L2 + l, _MM_HINT_T1);
}

VNNI INLINE __m512 load_half16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
typedef int32_t __attribute__((may_alias, aligned(1))) i32u; /* 4 bytes of activations read as one lane */
VNNI INLINE __m512i bcast32(const void *p) { return _mm512_set1_epi32(*(const i32u *)p); }
/* acc += the four products of w's unsigned bytes and the 4 signed bytes at p in every lane: vpdpbusd with p as
 * an embedded broadcast ({1to16}: one instruction, where the compiler would load and broadcast first) */
VNNI INLINE __m512i dpbusd_at(__m512i acc, __m512i w, const void *p) {
#if defined(__GNUC__) && !defined(SD_NO_ASM)
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const i32u *)p));
    return acc;
#else
    return _mm512_dpbusd_epi32(acc, w, bcast32(p));
#endif
}

/* S = the sums of w[g]'s unsigned bytes times the 4 activations at x + step g (g = 0..7: 32 columns) for one row.
 * `chains` independent accumulators (1, 2 or 4, a constant once inlined), summed at the end: a pass of one or two
 * rows would otherwise wait on vpdpbusd's latency (eight in a chain), where many rows interleave their chains.
 * Integer sums: the order changes no bit. */
VNNI INLINE __m512i dot32(const __m512i w[8], const int8_t *x, const int step, const int chains) {
    __m512i s[4];
    for (int c = 0; c < chains; c++) s[c] = _mm512_setzero_si512();
    for (int g = 0; g < 8; g++) s[g % chains] = dpbusd_at(s[g % chains], w[g], x + step * g);
    for (int c = 1; c < chains; c++) s[0] = _mm512_add_epi32(s[0], s[c]);
    return s[0];
}
#define CHAINS(R) ((R) == 1 ? 4 : (R) <= 3 ? 2 : 1)

/* The panel (see acts_t) of the pass of rows i0 ..: a pass of one row's is the row itself. */
INLINE const int8_t *panel(const acts_t *a, int i0) { return (a->m - i0 == 1 ? a->q : a->qp) + (int64_t)i0 * a->k; }

/* Q4_K: one group's blocks against rows i0 .. i0 + R - 1 (R a constant once inlined). */
/* The end of a Q4_K or Q5_K block (their layouts share d and dmin at 0 and 32): the minimums' sums M = sum_j m_j X32_j
 * by vpdpwssd on (m_2p, m_2p+1) pairs, then acc += dx * (d * T - dmin * M) for each of the R rows. */
VNNI INLINE void q4k_block_end_vnni(const uint8_t *blk, const __m128i m8[8], const int16_t *mins, const float *dxs, int b,
                                    const int R, const __m512i t[R_MAX], __m512 acc[R_MAX]) {
    const __m512 d = load_half16(blk), dmin = load_half16(blk + 32);
    __m512i mp[4]; /* lane c: (m_2p, m_2p+1) as two int16 */
    for (int p = 0; p < 4; p++) {
        const __m128i lo = _mm_unpacklo_epi8(m8[2 * p], m8[2 * p + 1]), hi = _mm_unpackhi_epi8(m8[2 * p], m8[2 * p + 1]);
        mp[p] = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
    }
    for (int r = 0; r < R; r++) {
        const int16_t *x32 = mins + ((int64_t)b * R_MAX + r) * 8;
        __m512i mm = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) mm = _mm512_dpwssd_epi32(mm, mp[p], bcast32(x32 + 2 * p));
        const __m512 dx = _mm512_set1_ps(dxs[b * R_MAX + r]);
        const __m512 v = _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(t[r])), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mm)));
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dx, v));
    }
}

VNNI INLINE void q4k_vnni(const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, float out[R_MAX][LANES]) {
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int16_t *mins = a->x32hp + (int64_t)(i0 / R_MAX) * nb * R_MAX * 8;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * 2304;
        __m128i sc8[8], m8[8];
        q4k_scales(blk, sc8, m8);
        __m512i t[R_MAX];
        for (int r = 0; r < R; r++) t[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = blk + 256 + 256 * j;
            const int8_t *xs = xq + (int64_t)(8 * b + j) * 32 * R;
            prefetch_ahead(blk + 288 * j, 320, PF_AHEAD(R)); /* 8 x 288 = 2304: the whole stream, headers included */
            const __m512i sc = _mm512_cvtepu8_epi32(sc8[j]);
            __m512i w[8];
            for (int z = 0; z < 4; z++) {
                const __m512i v = _mm512_loadu_si512(qs + 64 * z);
                w[z] = _mm512_and_si512(v, low);
                w[z + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < R; r++) t[r] = _mm512_add_epi32(t[r], _mm512_mullo_epi32(dot32(w, xs + 4 * r, 4 * R, CHAINS(R)), sc));
        }
        q4k_block_end_vnni(blk, m8, mins, dxs, b, R, t, acc);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
}

/* Q6_K: w = low nibble | the two high bits moved to bits 4..5 (vpternlogd: a | (b & c)). */
VNNI INLINE __m512i q6_high(__m512i h, int s) {
    switch (s) {
    case 0: return _mm512_slli_epi16(h, 4);
    case 1: return _mm512_slli_epi16(h, 2);
    case 2: return h;
    default: return _mm512_srli_epi16(h, 2);
    }
}

/* Q6_K: each 16-column sub-block's sum starts at its offset -32 X16 (a broadcast from the panel). */
VNNI INLINE void q6k_vnni(const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, float out[R_MAX][LANES]) {
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int32_t *offs = a->x16np + (int64_t)(i0 / R_MAX) * nb * 16 * R_MAX;
    const __m512i low = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    __m512 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * 3360;
        __m512i t[R_MAX];
        for (int r = 0; r < R; r++) t[r] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            const uint8_t *chunk = blk + 288 + 384 * c;
            const int8_t *xs = xq + (int64_t)(8 * b + c) * 32 * R;
            const int32_t *off = offs + (int64_t)(16 * b + 2 * c) * R_MAX;
            prefetch_ahead(blk + 420 * c, 448, PF_AHEAD(R)); /* 8 x 420 = 3360 */
            const __m512i h0 = _mm512_loadu_si512(chunk + 256), h1 = _mm512_loadu_si512(chunk + 320);
            __m512i w[8];
            for (int z = 0; z < 4; z++) {
                const __m512i v = _mm512_loadu_si512(chunk + 64 * z);
                w[z] = _mm512_ternarylogic_epi32(_mm512_and_si512(v, low), q6_high(h0, z), bits45, 0xF8);
                w[z + 4] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), q6_high(h1, z),
                                                     bits45, 0xF8);
            }
            const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * (2 * c))));
            const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * (2 * c + 1))));
            for (int r = 0; r < R; r++) {
                const int8_t *x = xs + 4 * r;
                __m512i s0 = _mm512_set1_epi32(off[r]), s1 = _mm512_set1_epi32(off[R_MAX + r]);
                for (int g = 0; g < 4; g++) s0 = dpbusd_at(s0, w[g], x + 4 * R * g);
                for (int g = 4; g < 8; g++) s1 = dpbusd_at(s1, w[g], x + 4 * R * g);
                t[r] = _mm512_add_epi32(t[r], _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1)));
            }
        }
        const __m512 d = load_half16(blk);
        for (int r = 0; r < R; r++) {
            const __m512 dx = _mm512_set1_ps(dxs[b * R_MAX + r]);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dx, _mm512_mul_ps(d, _mm512_cvtepi32_ps(t[r]))));
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
}

/* The 32-column types: Q5_0 (fifth bit of group g at bit g), Q8_0 (bytes), Q4_1 (nibbles and a minimum), Q4_0
 * (nibbles; its offset -8 X32 from X32), Q5_1 (Q5_0's quants, Q4_1's minimum), IQ4_NL (nibbles mapped through
 * its table by vpshufb; Q8_0's offset). */
VNNI INLINE __m512i q5_high(__m512i h, int g) {
    switch (g) {
    case 0: return _mm512_slli_epi16(h, 4);
    case 1: return _mm512_slli_epi16(h, 3);
    case 2: return _mm512_slli_epi16(h, 2);
    case 3: return _mm512_slli_epi16(h, 1);
    case 4: return h;
    case 5: return _mm512_srli_epi16(h, 1);
    case 6: return _mm512_srli_epi16(h, 2);
    default: return _mm512_srli_epi16(h, 3);
    }
}

VNNI INLINE void q32_vnni(int type, const uint8_t *grp, int nb, const acts_t *a, int i0, const int R,
                          float out[R_MAX][LANES]) {
    const int gbytes = group_block_bytes(type);
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int32_t *x32s = a->x32p + (int64_t)(i0 / R_MAX) * nb * 3 * R_MAX; /* [nb, 3, R_MAX] */
    const float *sxs = a->sxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;         /* [nb, R_MAX] */
    const int which = type == GG_Q5_0 ? 1 : type == GG_Q8_0 || type == GG_IQ4_NL ? 2 : 0; /* the offset's row of x32p */
    const __m512i low = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    /* IQ4_NL: its values + 128 in every 128-bit lane, for vpshufb to map the nibbles through */
    const __m512i table = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)iq4nl_values)),
                                           _mm512_set1_epi8((char)0x80));
    __m512 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * gbytes;
        const int8_t *xs = xq + (int64_t)b * 32 * R;
        prefetch_ahead(blk, gbytes, PF_AHEAD(R));
        __m512i w[8];
        if (type == GG_Q8_0) {
            for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(blk + 32 + 64 * g);
        } else {
            const uint8_t *qs = blk + (type == GG_Q4_1 || type == GG_Q5_1 ? 64 : 32);
            for (int z = 0; z < 4; z++) {
                const __m512i v = _mm512_loadu_si512(qs + 64 * z);
                w[z] = _mm512_and_si512(v, low);
                w[z + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            if (type == GG_Q5_0 || type == GG_Q5_1) {
                const __m512i h = _mm512_loadu_si512(blk + (type == GG_Q5_0 ? 288 : 320));
                for (int g = 0; g < 8; g++) w[g] = _mm512_ternarylogic_epi32(w[g], q5_high(h, g), bit4, 0xF8);
            }
            if (type == GG_IQ4_NL)
                for (int g = 0; g < 8; g++) w[g] = _mm512_shuffle_epi8(table, w[g]);
        }
        const __m512 d = load_half16(blk);
        const __m512 m = type == GG_Q4_1 || type == GG_Q5_1 ? load_half16(blk + 32) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const int32_t *x32 = x32s + (int64_t)b * 3 * R_MAX + r;
            __m512i s = dot32(w, xs + 4 * r, 4 * R, CHAINS(R));
            if (which) s = _mm512_add_epi32(s, _mm512_set1_epi32(x32[which * R_MAX]));
            if (type == GG_Q4_0) s = _mm512_add_epi32(s, _mm512_set1_epi32(-8 * x32[0]));
            const __m512 dx = _mm512_set1_ps(dxs[b * R_MAX + r]);
            __m512 v = _mm512_mul_ps(dx, _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
            if (type == GG_Q4_1 || type == GG_Q5_1) v = _mm512_add_ps(v, _mm512_mul_ps(m, _mm512_set1_ps(sxs[b * R_MAX + r])));
            acc[r] = _mm512_add_ps(acc[r], v);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
}

#define VNNI_ROWS(NAME, CALL)                                                                                      \
    VNNI static void NAME(int type, const uint8_t *grp, int nb, const acts_t *a, int i0, int rows,                   \
                          float out[R_MAX][LANES]) {                                                                \
        (void)type;                                                                                                 \
        switch (rows) {                                                                                             \
        case 1: CALL(1); break;                                                                                     \
        case 2: CALL(2); break;                                                                                     \
        case 3: CALL(3); break;                                                                                     \
        case 4: CALL(4); break;                                                                                     \
        case 5: CALL(5); break;                                                                                     \
        case 6: CALL(6); break;                                                                                     \
        case 7: CALL(7); break;                                                                                     \
        default: CALL(8); break;                                                                                    \
        }                                                                                                           \
    }
#define Q4K_CALL(R) q4k_vnni(grp, nb, a, i0, R, out)
#define Q6K_CALL(R) q6k_vnni(grp, nb, a, i0, R, out)
#define Q50_CALL(R) q32_vnni(GG_Q5_0, grp, nb, a, i0, R, out)
#define Q80_CALL(R) q32_vnni(GG_Q8_0, grp, nb, a, i0, R, out)
#define Q41_CALL(R) q32_vnni(GG_Q4_1, grp, nb, a, i0, R, out)
VNNI_ROWS(group_q4k_vnni, Q4K_CALL)
VNNI_ROWS(group_q6k_vnni, Q6K_CALL)
VNNI_ROWS(group_q50_vnni, Q50_CALL)
VNNI_ROWS(group_q80_vnni, Q80_CALL)
VNNI_ROWS(group_q41_vnni, Q41_CALL)
#define Q40_CALL(R) q32_vnni(GG_Q4_0, grp, nb, a, i0, R, out)
VNNI_ROWS(group_q40_vnni, Q40_CALL)
#define Q51_CALL(R) q32_vnni(GG_Q5_1, grp, nb, a, i0, R, out)
VNNI_ROWS(group_q51_vnni, Q51_CALL)
#define IQ4NL_CALL(R) q32_vnni(GG_IQ4_NL, grp, nb, a, i0, R, out)
VNNI_ROWS(group_iq4nl_vnni, IQ4NL_CALL)

/* Q2_K: Q6_K's loop on crumbs alone (each 16-column sub-block's sum times its 4-bit scale, vpmulld), Q4_K's
 * minimums by vpdpwssd on (m_2p, m_2p+1) pairs, here against the X16 of a block's 16 sub-blocks. */
VNNI INLINE void q2k_vnni(const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, float out[R_MAX][LANES]) {
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int16_t *x16s = a->x16hp + (int64_t)(i0 / R_MAX) * nb * R_MAX * 16;
    const __m512i two = _mm512_set1_epi8(3);
    const __m128i low = _mm_set1_epi8(0x0F);
    __m512 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * 1344;
        __m512i t[R_MAX];
        for (int r = 0; r < R; r++) t[r] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            const uint8_t *chunk = blk + 320 + 128 * c;
            const int8_t *xs = xq + (int64_t)(8 * b + c) * 32 * R;
            prefetch_ahead(blk + 168 * c, 192, PF_AHEAD(R)); /* 8 x 168 = 1344 */
            const __m512i h0 = _mm512_loadu_si512(chunk), h1 = _mm512_loadu_si512(chunk + 64);
            __m512i w[8];
            for (int z = 0; z < 4; z++) { /* groups z and z + 4: bits 2 z of the two vectors */
                w[z] = _mm512_and_si512(z ? _mm512_srli_epi16(h0, 2 * z) : h0, two);
                w[z + 4] = _mm512_and_si512(z ? _mm512_srli_epi16(h1, 2 * z) : h1, two);
            }
            const __m512i sc0 = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_loadu_si128((const __m128i *)(blk + 64 + 32 * c)), low));
            const __m512i sc1 = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_loadu_si128((const __m128i *)(blk + 80 + 32 * c)), low));
            for (int r = 0; r < R; r++) {
                const int8_t *x = xs + 4 * r;
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                for (int g = 0; g < 4; g++) s0 = dpbusd_at(s0, w[g], x + 4 * R * g);
                for (int g = 4; g < 8; g++) s1 = dpbusd_at(s1, w[g], x + 4 * R * g);
                t[r] = _mm512_add_epi32(t[r], _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1)));
            }
        }
        __m512i mp[8]; /* lane c: (m_2p, m_2p+1) as two int16 */
        for (int p = 0; p < 8; p++) {
            const __m128i m0 = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(blk + 64 + 32 * p)), 4), low);
            const __m128i m1 = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(blk + 80 + 32 * p)), 4), low);
            mp[p] = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(m0, m1), _mm_unpacklo_epi8(m0, m1)));
        }
        const __m512 d = load_half16(blk), dmin = load_half16(blk + 32);
        for (int r = 0; r < R; r++) {
            const int16_t *x16 = x16s + ((int64_t)b * R_MAX + r) * 16;
            __m512i mm = _mm512_setzero_si512();
            for (int p = 0; p < 8; p++) mm = _mm512_dpwssd_epi32(mm, mp[p], bcast32(x16 + 2 * p));
            const __m512 dx = _mm512_set1_ps(dxs[b * R_MAX + r]);
            const __m512 v = _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(t[r])), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mm)));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dx, v));
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#define Q2K_CALL(R) q2k_vnni(grp, nb, a, i0, R, out)
VNNI_ROWS(group_q2k_vnni, Q2K_CALL)

/* F32, F16, BF16: column e's 16 weights, widened exactly. */
VNNI INLINE __m512 float16_at(int type, const uint8_t *blk, int e) {
    if (type == GG_F32) return _mm512_loadu_ps(blk + 64 * e);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 32 * e));
    return type == GG_F16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The four partial sums of up to 4 rows (16 registers), a product then a sum (no FMA) per column. */
VNNI INLINE void float_vnni(int type, const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, float out[R_MAX][LANES]) {
    const int gbytes = group_block_bytes(type);
    const float *x = a->x + (int64_t)i0 * a->ldx;
    __m512 p[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) p[r][j] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * gbytes;
        prefetch_ahead(blk, gbytes, PF_AHEAD(R));
        for (int e = 0; e < 32; e++) {
            const __m512 w = float16_at(type, blk, e);
            for (int r = 0; r < R; r++)
                p[r][e % 4] = _mm512_add_ps(p[r][e % 4], _mm512_mul_ps(_mm512_set1_ps(x[r * a->ldx + 32 * b + e]), w));
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(out[r], _mm512_add_ps(_mm512_add_ps(p[r][0], p[r][1]), _mm512_add_ps(p[r][2], p[r][3])));
}

/* A group's rows in passes of up to PASS rows (each pass reads the group's weights again: from L2 after the first). */
#define FLOAT_ROWS(NAME, FN, TYPE, PASS, TARGET)                                                                   \
    TARGET static void NAME(int type, const uint8_t *grp, int nb, const acts_t *a, int i0, int rows,              \
                            float out[R_MAX][LANES]) {                                                             \
        (void)type;                                                                                                \
        for (int r0 = 0; r0 < rows; r0 += PASS) switch (rows - r0 < PASS ? rows - r0 : PASS) {                    \
            case 1: FN(TYPE, grp, nb, a, i0 + r0, 1, out + r0); break;                                             \
            case 2: FN(TYPE, grp, nb, a, i0 + r0, 2, out + r0); break;                                             \
            case 3: FN(TYPE, grp, nb, a, i0 + r0, 3, out + r0); break;                                             \
            default: FN(TYPE, grp, nb, a, i0 + r0, 4, out + r0); break;                                            \
            }                                                                                                      \
    }
FLOAT_ROWS(group_f32_vnni, float_vnni, GG_F32, 4, VNNI)
FLOAT_ROWS(group_f16_vnni, float_vnni, GG_F16, 4, VNNI)
FLOAT_ROWS(group_bf16_vnni, float_vnni, GG_BF16, 4, VNNI)

/* Q5_K: Q4_K's sub-blocks with Q5_0's fifth bits (bit g of the vector after a sub-block's nibbles). */
VNNI INLINE void q5k_vnni(const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, float out[R_MAX][LANES]) {
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int16_t *mins = a->x32hp + (int64_t)(i0 / R_MAX) * nb * R_MAX * 8;
    const __m512i low = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    __m512 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * 2816;
        __m128i sc8[8], m8[8];
        q4k_scales(blk, sc8, m8);
        __m512i t[R_MAX];
        for (int r = 0; r < R; r++) t[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = blk + 256 + 320 * j;
            const int8_t *xs = xq + (int64_t)(8 * b + j) * 32 * R;
            prefetch_ahead(blk + 352 * j, 384, PF_AHEAD(R)); /* 8 x 352 = 2816 */
            const __m512i sc = _mm512_cvtepu8_epi32(sc8[j]);
            const __m512i h = _mm512_loadu_si512(qs + 256);
            __m512i w[8];
            for (int z = 0; z < 4; z++) {
                const __m512i v = _mm512_loadu_si512(qs + 64 * z);
                w[z] = _mm512_ternarylogic_epi32(_mm512_and_si512(v, low), q5_high(h, z), bit4, 0xF8);
                w[z + 4] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), q5_high(h, z + 4), bit4, 0xF8);
            }
            for (int r = 0; r < R; r++) t[r] = _mm512_add_epi32(t[r], _mm512_mullo_epi32(dot32(w, xs + 4 * r, 4 * R, CHAINS(R)), sc));
        }
        q4k_block_end_vnni(blk, m8, mins, dxs, b, R, t, acc);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#define Q5K_CALL(R) q5k_vnni(grp, nb, a, i0, R, out)
VNNI_ROWS(group_q5k_vnni, Q5K_CALL)

/* Q3_K's 16 scales of 16 channels, minus 32, as int8 (byte b of the file's 12 at row b of the packed block);
 * for the AVX2 and VNNI paths alike. */
__attribute__((target("avx2"))) INLINE void q3k_scales(const uint8_t *blk, __m128i sc[16]) {
    const __m128i low = _mm_set1_epi8(0x0F), top = _mm_set1_epi8(0x30), bias = _mm_set1_epi8(32);
    __m128i s[12];
    for (int b = 0; b < 12; b++) s[b] = _mm_loadu_si128((const __m128i *)(blk + 32 + 16 * b));
    for (int i = 0; i < 16; i++) {
        const __m128i lo = i < 8 ? _mm_and_si128(s[i], low) : _mm_and_si128(_mm_srli_epi16(s[i - 8], 4), low);
        const __m128i h = s[8 + i % 4]; /* its bits 2 (i / 4) .. + 1 to bits 4..5 */
        const __m128i hi = i < 4 ? _mm_slli_epi16(h, 4) : i < 8 ? _mm_slli_epi16(h, 2) : i < 12 ? h : _mm_srli_epi16(h, 2);
        sc[i] = _mm_sub_epi8(_mm_or_si128(lo, _mm_and_si128(hi, top)), bias);
    }
}

/* Q3_K's third bit of group g (bit g of h) to bit 2. */
VNNI INLINE __m512i q3_high(__m512i h, int g) {
    switch (g) {
    case 0: return _mm512_slli_epi16(h, 2);
    case 1: return _mm512_slli_epi16(h, 1);
    case 2: return h;
    default: return _mm512_srli_epi16(h, g - 2);
    }
}

/* Q3_K: Q6_K's form, each 16-column sum starting at -4 X16 (the panel's -32 X16 / 8: exact). */
VNNI INLINE void q3k_vnni(const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, float out[R_MAX][LANES]) {
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int32_t *offs = a->x16np + (int64_t)(i0 / R_MAX) * nb * 16 * R_MAX;
    const __m512i bits01 = _mm512_set1_epi8(3), bit2 = _mm512_set1_epi8(4);
    __m512 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * 1760;
        __m128i sc8[16];
        q3k_scales(blk, sc8);
        __m512i t[R_MAX];
        for (int r = 0; r < R; r++) t[r] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            const uint8_t *chunk = blk + 224 + 192 * c;
            const int8_t *xs = xq + (int64_t)(8 * b + c) * 32 * R;
            const int32_t *off = offs + (int64_t)(16 * b + 2 * c) * R_MAX;
            prefetch_ahead(blk + 220 * c, 256, PF_AHEAD(R)); /* 8 x 220 = 1760 */
            const __m512i l0 = _mm512_loadu_si512(chunk), l1 = _mm512_loadu_si512(chunk + 64);
            const __m512i h = _mm512_loadu_si512(chunk + 128);
            __m512i w[8];
            for (int g = 0; g < 8; g++) {
                const __m512i crumb = _mm512_and_si512(_mm512_srli_epi16(g < 4 ? l0 : l1, 2 * (g % 4)), bits01);
                w[g] = _mm512_ternarylogic_epi32(crumb, q3_high(h, g), bit2, 0xF8);
            }
            const __m512i sc0 = _mm512_cvtepi8_epi32(sc8[2 * c]), sc1 = _mm512_cvtepi8_epi32(sc8[2 * c + 1]);
            for (int r = 0; r < R; r++) {
                const int8_t *x = xs + 4 * r;
                __m512i s0 = _mm512_set1_epi32(off[r] / 8), s1 = _mm512_set1_epi32(off[R_MAX + r] / 8);
                for (int g = 0; g < 4; g++) s0 = dpbusd_at(s0, w[g], x + 4 * R * g);
                for (int g = 4; g < 8; g++) s1 = dpbusd_at(s1, w[g], x + 4 * R * g);
                t[r] = _mm512_add_epi32(t[r], _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1)));
            }
        }
        const __m512 d = load_half16(blk);
        for (int r = 0; r < R; r++) {
            const __m512 dx = _mm512_set1_ps(dxs[b * R_MAX + r]);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dx, _mm512_mul_ps(d, _mm512_cvtepi32_ps(t[r]))));
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#define Q3K_CALL(R) q3k_vnni(grp, nb, a, i0, R, out)
VNNI_ROWS(group_q3k_vnni, Q3K_CALL)

/* IQ4_XS's 8 scales of 16 channels, minus 32, as int8 (the file's 6 bytes at rows 0..5 of the packed block). */
__attribute__((target("avx2"))) INLINE void iq4xs_scales(const uint8_t *blk, __m128i sc[8]) {
    const __m128i low = _mm_set1_epi8(0x0F), top = _mm_set1_epi8(0x30), bias = _mm_set1_epi8(32);
    __m128i s[6];
    for (int b = 0; b < 6; b++) s[b] = _mm_loadu_si128((const __m128i *)(blk + 32 + 16 * b));
    for (int j = 0; j < 8; j++) {
        const __m128i l = s[2 + j / 2], lo = _mm_and_si128(j % 2 ? _mm_srli_epi16(l, 4) : l, low);
        const __m128i h = s[j / 4]; /* its bits 2 (j % 4) .. + 1 to bits 4..5 */
        const __m128i hi = j % 4 == 0 ? _mm_slli_epi16(h, 4) : j % 4 == 1 ? _mm_slli_epi16(h, 2) : j % 4 == 2 ? h : _mm_srli_epi16(h, 2);
        sc[j] = _mm_sub_epi8(_mm_or_si128(lo, _mm_and_si128(hi, top)), bias);
    }
}

/* IQ4_XS: the indices through kv + 128 (vpshufb: unsigned for vpdpbusd), each sub-block's sum starting at -128 X32. */
VNNI INLINE void iq4xs_vnni(const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, float out[R_MAX][LANES]) {
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int32_t *x32s = a->x32p + (int64_t)(i0 / R_MAX) * nb * 8 * 3 * R_MAX; /* [nb * 8, 3, R_MAX] */
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i table = _mm512_broadcast_i32x4(
        _mm_xor_si128(_mm_loadu_si128((const __m128i *)iq4nl_values), _mm_set1_epi8((char)0x80))); /* kv + 128 */
    __m512 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * 2176;
        __m128i sc8[8];
        iq4xs_scales(blk, sc8);
        __m512i t[R_MAX];
        for (int r = 0; r < R; r++) t[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = blk + 128 + 256 * j;
            const int8_t *xs = xq + (int64_t)(8 * b + j) * 32 * R;
            const int32_t *x32 = x32s + (int64_t)(8 * b + j) * 3 * R_MAX + 2 * R_MAX; /* -128 X32 */
            prefetch_ahead(blk + 272 * j, 320, PF_AHEAD(R)); /* 8 x 272 = 2176 */
            const __m512i sc = _mm512_cvtepi8_epi32(sc8[j]);
            __m512i w[8];
            for (int z = 0; z < 4; z++) {
                const __m512i v = _mm512_loadu_si512(qs + 64 * z);
                w[z] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
                w[z + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            }
            for (int r = 0; r < R; r++) {
                const __m512i s = _mm512_add_epi32(dot32(w, xs + 4 * r, 4 * R, CHAINS(R)), _mm512_set1_epi32(x32[r]));
                t[r] = _mm512_add_epi32(t[r], _mm512_mullo_epi32(s, sc));
            }
        }
        const __m512 d = load_half16(blk);
        for (int r = 0; r < R; r++) {
            const __m512 dx = _mm512_set1_ps(dxs[b * R_MAX + r]);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dx, _mm512_mul_ps(d, _mm512_cvtepi32_ps(t[r]))));
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#define IQ4XS_CALL(R) iq4xs_vnni(grp, nb, a, i0, R, out)
VNNI_ROWS(group_iq4xs_vnni, IQ4XS_CALL)

/* ------------------------------------------------------------------ AVX2 path
 * The same integers: vpmaddubsw (u8 quants x s8 activations, pairs summed in s16 without saturating: at most
 * 2 * 63 * 127) then vpmaddwd with each lane's sub-block scale (or ones), on the two halves (lanes 0-7, 8-15)
 * of a group in turn.  Q8_0's quants + 128 would saturate vpmaddubsw: there the signed quants are multiplied
 * as |q| (unsigned: 128 for -128) and sign(q) * x (at most 2 * 128 * 127 < 2^15), the offset then not taken. */
#define AVX2F __attribute__((target("avx2,fma,f16c")))

AVX2F INLINE __m256 load_half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
AVX2F INLINE __m256i bcast32_8(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
/* Each lane's 16-bit scale twice (for vpmaddwd): from 8 consecutive s8. */
AVX2F INLINE __m256i pair16_s8(const uint8_t *p) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

/* The end of a Q4_K or Q5_K block on one half of the group (d and dmin at 0 and 32): the minimums' sums
 * M = sum_j m_j X32_j by vpmaddwd on (m_2p, m_2p+1) pairs, then acc += dx * (d * T - dmin * M) for rows r0.. */
AVX2F INLINE void q4k_block_end_avx2(const uint8_t *blk, const __m128i m8[8], const int16_t *mins, const float *dxs, int b,
                                    const int R, const int r0, int half, const __m256i t[R_MAX], __m256 acc[R_MAX]) {
    const __m256 d = load_half8(blk + 16 * half), dmin = load_half8(blk + 32 + 16 * half);
    __m256i mp[4]; /* lane c: (m_2p, m_2p+1) as two int16 */
    for (int p = 0; p < 4; p++) {
        const __m128i pairs = half ? _mm_unpackhi_epi8(m8[2 * p], m8[2 * p + 1]) : _mm_unpacklo_epi8(m8[2 * p], m8[2 * p + 1]);
        mp[p] = _mm256_cvtepu8_epi16(pairs);
    }
    for (int r = 0; r < R; r++) {
        const int16_t *x32 = mins + ((int64_t)b * R_MAX + r0 + r) * 8;
        __m256i mm = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) mm = _mm256_add_epi32(mm, _mm256_madd_epi16(mp[p], bcast32_8(x32 + 2 * p)));
        const __m256 dx = _mm256_set1_ps(dxs[b * R_MAX + r0 + r]);
        const __m256 v = _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(t[r])), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mm)));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dx, v));
    }
}

AVX2F INLINE void q4k_avx2(const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, const int r0, const int P, int half,
                           float out[R_MAX][LANES]) {
    const int h32 = 32 * half;
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int16_t *mins = a->x32hp + (int64_t)(i0 / R_MAX) * nb * R_MAX * 8;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * 2304;
        __m128i sc8[8], m8[8];
        q4k_scales(blk, sc8, m8);
        __m256i t[R_MAX];
        for (int r = 0; r < R; r++) t[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = blk + 256 + 256 * j + h32;
            const int8_t *xs = xq + (int64_t)(8 * b + j) * 32 * P;
            const __m256i v32 = _mm256_cvtepu8_epi32(half ? _mm_srli_si128(sc8[j], 8) : sc8[j]);
            const __m256i sc = _mm256_or_si256(v32, _mm256_slli_epi32(v32, 16)); /* each lane's scale twice */
            __m256i w[8];
            for (int z = 0; z < 4; z++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * z));
                w[z] = _mm256_and_si256(v, low);
                w[z + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < R; r++) {
                const int8_t *x = xs + 4 * (r0 + r);
                __m256i p = _mm256_setzero_si256();
                for (int g = 0; g < 8; g++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[g], bcast32_8(x + 4 * P * g)));
                /* eight pair sums of 2 * 15 * 127 each stay within s16 */
                t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(p, sc));
            }
        }
        q4k_block_end_avx2(blk, m8, mins, dxs, b, R, r0, half, t, acc);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r0 + r] + 8 * half, acc[r]);
}

AVX2F INLINE __m256i q6_high8(__m256i h, int s) {
    switch (s) {
    case 0: return _mm256_slli_epi16(h, 4);
    case 1: return _mm256_slli_epi16(h, 2);
    case 2: return h;
    default: return _mm256_srli_epi16(h, 2);
    }
}

/* Q6_K: T = sum_j sc_j S_j - 32 sum_j sc_j X16_j (the top comment's sum, regrouped: the same integer), the second
 * sum once a block and row, by vpmaddwd on (sc_2p, sc_2p+1) pairs, rather than a multiply per sub-block. */
AVX2F INLINE void q6k_avx2(const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, const int r0, const int P, int half,
                           float out[R_MAX][LANES]) {
    const int h32 = 32 * half;
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int16_t *offs = a->x16hp + (int64_t)(i0 / R_MAX) * nb * R_MAX * 16;
    const __m256i low = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
    __m256 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * 3360;
        __m256i t[R_MAX];
        for (int r = 0; r < R; r++) t[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const uint8_t *chunk = blk + 288 + 384 * c + h32;
            const int8_t *xs = xq + (int64_t)(8 * b + c) * 32 * P;
            const __m256i h0 = _mm256_loadu_si256((const __m256i *)(chunk + 256));
            const __m256i h1 = _mm256_loadu_si256((const __m256i *)(chunk + 320));
            __m256i w[8];
            for (int z = 0; z < 4; z++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(chunk + 64 * z));
                w[z] = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(q6_high8(h0, z), bits45));
                w[z + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                           _mm256_and_si256(q6_high8(h1, z), bits45));
            }
            const __m256i sc0 = pair16_s8(blk + 32 + 16 * (2 * c) + 8 * half);
            const __m256i sc1 = pair16_s8(blk + 32 + 16 * (2 * c + 1) + 8 * half);
            for (int r = 0; r < R; r++) {
                const int8_t *x = xs + 4 * (r0 + r);
                __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
                /* four pair sums of 2 * 63 * 127 each would pass s16: widen every second one */
                for (int g = 0; g < 4; g += 2) {
                    p0 = _mm256_add_epi32(p0, _mm256_madd_epi16(_mm256_add_epi16(
                        _mm256_maddubs_epi16(w[g], bcast32_8(x + 4 * P * g)),
                        _mm256_maddubs_epi16(w[g + 1], bcast32_8(x + 4 * P * (g + 1)))), sc0));
                    p1 = _mm256_add_epi32(p1, _mm256_madd_epi16(_mm256_add_epi16(
                        _mm256_maddubs_epi16(w[g + 4], bcast32_8(x + 4 * P * (g + 4))),
                        _mm256_maddubs_epi16(w[g + 5], bcast32_8(x + 4 * P * (g + 5)))), sc1));
                }
                t[r] = _mm256_add_epi32(t[r], _mm256_add_epi32(p0, p1));
            }
        }
        __m256i sp[8]; /* lane c: (sc_2p, sc_2p+1) as two int16 */
        for (int p = 0; p < 8; p++) {
            const __m128i s0 = _mm_loadu_si128((const __m128i *)(blk + 32 + 16 * (2 * p)));
            const __m128i s1 = _mm_loadu_si128((const __m128i *)(blk + 32 + 16 * (2 * p + 1)));
            sp[p] = _mm256_cvtepi8_epi16(half ? _mm_unpackhi_epi8(s0, s1) : _mm_unpacklo_epi8(s0, s1));
        }
        const __m256 d = load_half8(blk + 16 * half);
        for (int r = 0; r < R; r++) {
            const int16_t *x16 = offs + ((int64_t)b * R_MAX + r0 + r) * 16;
            __m256i o = _mm256_setzero_si256();
            for (int p = 0; p < 8; p++) o = _mm256_add_epi32(o, _mm256_madd_epi16(sp[p], bcast32_8(x16 + 2 * p)));
            const __m256i tt = _mm256_sub_epi32(t[r], _mm256_slli_epi32(o, 5));
            const __m256 dx = _mm256_set1_ps(dxs[b * R_MAX + r0 + r]);
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dx, _mm256_mul_ps(d, _mm256_cvtepi32_ps(tt))));
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r0 + r] + 8 * half, acc[r]);
}

AVX2F INLINE __m256i q5_high8(__m256i h, int g) {
    switch (g) {
    case 0: return _mm256_slli_epi16(h, 4);
    case 1: return _mm256_slli_epi16(h, 3);
    case 2: return _mm256_slli_epi16(h, 2);
    case 3: return _mm256_slli_epi16(h, 1);
    case 4: return h;
    case 5: return _mm256_srli_epi16(h, 1);
    case 6: return _mm256_srli_epi16(h, 2);
    default: return _mm256_srli_epi16(h, 3);
    }
}

AVX2F INLINE void q32_avx2(int type, const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, const int r0, const int P, int half,
                           float out[R_MAX][LANES]) {
    const int h32 = 32 * half, gbytes = group_block_bytes(type);
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int32_t *x32s = a->x32p + (int64_t)(i0 / R_MAX) * nb * 3 * R_MAX; /* [nb, 3, R_MAX] */
    const float *sxs = a->sxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;         /* [nb, R_MAX] */
    const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4nl_values)); /* IQ4_NL's, signed */
    __m256 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * gbytes;
        const int8_t *xs = xq + (int64_t)b * 32 * P;
        __m256i w[8];
        if (type == GG_Q8_0) {
            for (int g = 0; g < 8; g++) w[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 32 + 64 * g + h32)), flip);
        } else {
            const uint8_t *qs = blk + (type == GG_Q4_1 || type == GG_Q5_1 ? 64 : 32) + h32;
            for (int z = 0; z < 4; z++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * z));
                w[z] = _mm256_and_si256(v, low);
                w[z + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            if (type == GG_Q5_0 || type == GG_Q5_1) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + (type == GG_Q5_0 ? 288 : 320) + h32));
                for (int g = 0; g < 8; g++) w[g] = _mm256_or_si256(w[g], _mm256_and_si256(q5_high8(h, g), bit4));
            }
            if (type == GG_IQ4_NL) /* the signed values: multiplied as Q8_0's, the offset then not taken */
                for (int g = 0; g < 8; g++) w[g] = _mm256_shuffle_epi8(table, w[g]);
        }
        const __m256 d = load_half8(blk + 16 * half);
        const __m256 m = type == GG_Q4_1 || type == GG_Q5_1 ? load_half8(blk + 32 + 16 * half) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            const int8_t *x = xs + 4 * (r0 + r);
            const int32_t *x32 = x32s + (int64_t)b * 3 * R_MAX + r0 + r;
            __m256i s = _mm256_set1_epi32(type == GG_Q5_0 ? x32[R_MAX] : type == GG_Q4_0 ? -8 * x32[0] : 0);
            for (int g = 0; g < 8; g += 2) {
                const __m256i x0 = bcast32_8(x + 4 * P * g), x1 = bcast32_8(x + 4 * P * (g + 1));
                __m256i p;
                if (type == GG_Q8_0 || type == GG_IQ4_NL) /* signed quants: |q| (128 for -128, as u8) times sign(q) x */
                    p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[g]), _mm256_sign_epi8(x0, w[g])), ones),
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[g + 1]), _mm256_sign_epi8(x1, w[g + 1])), ones));
                else
                    p = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w[g], x0), _mm256_maddubs_epi16(w[g + 1], x1)), ones);
                s = _mm256_add_epi32(s, p);
            }
            const __m256 dx = _mm256_set1_ps(dxs[b * R_MAX + r0 + r]);
            __m256 v = _mm256_mul_ps(dx, _mm256_mul_ps(d, _mm256_cvtepi32_ps(s)));
            if (type == GG_Q4_1 || type == GG_Q5_1) v = _mm256_add_ps(v, _mm256_mul_ps(m, _mm256_set1_ps(sxs[b * R_MAX + r0 + r])));
            acc[r] = _mm256_add_ps(acc[r], v);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r0 + r] + 8 * half, acc[r]);
}

/* Rows r0 .. r0 + R - 1 of a pass a call (R a constant once inlined).  16 ymm registers hold 8 unpacked weight
 * vectors and a few rows' sums: where SPLIT, 7 and 8 rows run as 4 and the rest (Q4_K on one Zen 4 core, AVX2 path,
 * in G products of 64 a second: 8 rows at once 1.41, as 4 + 4 1.52, 6 rows 1.67); Q6_K's dearer unpacking pays
 * for 8 at once (1.42, as 4 + 4 1.19), and so do the 32-column types'. */
#define AVX2_ROWS(NAME, CALL, SPLIT)                                                                               \
    AVX2F static void NAME(int type, const uint8_t *grp, int nb, const acts_t *a, int i0, int rows,                  \
                           float out[R_MAX][LANES]) {                                                               \
        (void)type;                                                                                                 \
        for (int half = 0; half < 2; half++) switch (rows) {                                                        \
            case 1: CALL(1, 0, 1); break;                                                                           \
            case 2: CALL(2, 0, 2); break;                                                                           \
            case 3: CALL(3, 0, 3); break;                                                                           \
            case 4: CALL(4, 0, 4); break;                                                                           \
            case 5: CALL(5, 0, 5); break;                                                                           \
            case 6: CALL(6, 0, 6); break;                                                                           \
            case 7: if (SPLIT) { CALL(4, 0, 7); CALL(3, 4, 7); } else CALL(7, 0, 7); break;                         \
            default: if (SPLIT) { CALL(4, 0, 8); CALL(4, 4, 8); } else CALL(8, 0, 8); break;                        \
            }                                                                                                       \
    }
#define Q4K_CALL2(R, R0, P) q4k_avx2(grp, nb, a, i0, R, R0, P, half, out)
#define Q6K_CALL2(R, R0, P) q6k_avx2(grp, nb, a, i0, R, R0, P, half, out)
#define Q50_CALL2(R, R0, P) q32_avx2(GG_Q5_0, grp, nb, a, i0, R, R0, P, half, out)
#define Q80_CALL2(R, R0, P) q32_avx2(GG_Q8_0, grp, nb, a, i0, R, R0, P, half, out)
#define Q41_CALL2(R, R0, P) q32_avx2(GG_Q4_1, grp, nb, a, i0, R, R0, P, half, out)
AVX2_ROWS(group_q4k_avx2, Q4K_CALL2, 1)
AVX2_ROWS(group_q6k_avx2, Q6K_CALL2, 0)
AVX2_ROWS(group_q50_avx2, Q50_CALL2, 0)
AVX2_ROWS(group_q80_avx2, Q80_CALL2, 0)
AVX2_ROWS(group_q41_avx2, Q41_CALL2, 0)
#define Q40_CALL2(R, R0, P) q32_avx2(GG_Q4_0, grp, nb, a, i0, R, R0, P, half, out)
AVX2_ROWS(group_q40_avx2, Q40_CALL2, 0)
#define Q51_CALL2(R, R0, P) q32_avx2(GG_Q5_1, grp, nb, a, i0, R, R0, P, half, out)
AVX2_ROWS(group_q51_avx2, Q51_CALL2, 0)
#define IQ4NL_CALL2(R, R0, P) q32_avx2(GG_IQ4_NL, grp, nb, a, i0, R, R0, P, half, out)
AVX2_ROWS(group_iq4nl_avx2, IQ4NL_CALL2, 0)

/* Q2_K: each sub-block's four vpmaddubsw summed in s16 (at most 4 * 2 * 3 * 127) and widened with its scale by
 * vpmaddwd, as Q4_K's; the minimums as Q6_K's offsets, by vpmaddwd on (m_2p, m_2p+1) pairs against X16. */
AVX2F INLINE void q2k_avx2(const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, const int r0, const int P, int half,
                           float out[R_MAX][LANES]) {
    const int h32 = 32 * half;
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int16_t *x16s = a->x16hp + (int64_t)(i0 / R_MAX) * nb * R_MAX * 16;
    const __m256i two = _mm256_set1_epi8(3), low16 = _mm256_set1_epi32(0x0F);
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * 1344;
        __m256i t[R_MAX];
        for (int r = 0; r < R; r++) t[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const uint8_t *chunk = blk + 320 + 128 * c + h32;
            const int8_t *xs = xq + (int64_t)(8 * b + c) * 32 * P;
            const __m256i h0 = _mm256_loadu_si256((const __m256i *)chunk), h1 = _mm256_loadu_si256((const __m256i *)(chunk + 64));
            __m256i w[8];
            for (int z = 0; z < 4; z++) {
                w[z] = _mm256_and_si256(z ? _mm256_srli_epi16(h0, 2 * z) : h0, two);
                w[z + 4] = _mm256_and_si256(z ? _mm256_srli_epi16(h1, 2 * z) : h1, two);
            }
            /* each lane's 4-bit scale twice (for vpmaddwd) */
            __m256i sc0 = _mm256_and_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 64 + 32 * c + 8 * half))), low16);
            __m256i sc1 = _mm256_and_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 80 + 32 * c + 8 * half))), low16);
            sc0 = _mm256_or_si256(sc0, _mm256_slli_epi32(sc0, 16));
            sc1 = _mm256_or_si256(sc1, _mm256_slli_epi32(sc1, 16));
            for (int r = 0; r < R; r++) {
                const int8_t *x = xs + 4 * (r0 + r);
                __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
                for (int g = 0; g < 4; g++) {
                    p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(w[g], bcast32_8(x + 4 * P * g)));
                    p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(w[g + 4], bcast32_8(x + 4 * P * (g + 4))));
                }
                t[r] = _mm256_add_epi32(t[r], _mm256_add_epi32(_mm256_madd_epi16(p0, sc0), _mm256_madd_epi16(p1, sc1)));
            }
        }
        __m256i mp[8]; /* lane c: (m_2p, m_2p+1) as two int16 */
        for (int p = 0; p < 8; p++) {
            const __m128i m0 = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(blk + 64 + 32 * p)), 4), low);
            const __m128i m1 = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(blk + 80 + 32 * p)), 4), low);
            mp[p] = _mm256_cvtepu8_epi16(half ? _mm_unpackhi_epi8(m0, m1) : _mm_unpacklo_epi8(m0, m1));
        }
        const __m256 d = load_half8(blk + 16 * half), dmin = load_half8(blk + 32 + 16 * half);
        for (int r = 0; r < R; r++) {
            const int16_t *x16 = x16s + ((int64_t)b * R_MAX + r0 + r) * 16;
            __m256i mm = _mm256_setzero_si256();
            for (int p = 0; p < 8; p++) mm = _mm256_add_epi32(mm, _mm256_madd_epi16(mp[p], bcast32_8(x16 + 2 * p)));
            const __m256 dx = _mm256_set1_ps(dxs[b * R_MAX + r0 + r]);
            const __m256 v = _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(t[r])), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mm)));
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dx, v));
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r0 + r] + 8 * half, acc[r]);
}
#define Q2K_CALL2(R, R0, P) q2k_avx2(grp, nb, a, i0, R, R0, P, half, out)
AVX2_ROWS(group_q2k_avx2, Q2K_CALL2, 1) /* Q4_K's registers: 8 weight vectors, the scales, a sum a row */

/* F32, F16, BF16: lanes 8 half .. 8 half + 7 of column e, widened exactly. */
AVX2F INLINE __m256 float8_at(int type, const uint8_t *blk, int e, int half) {
    if (type == GG_F32) return _mm256_loadu_ps((const float *)(blk + 64 * e + 32 * half));
    const __m128i h = _mm_loadu_si128((const __m128i *)(blk + 32 * e + 16 * half));
    return type == GG_F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* float_vnni's sums on each half of the group, up to 3 rows a pass (12 of the 16 registers). */
AVX2F INLINE void float_avx2(int type, const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, float out[R_MAX][LANES]) {
    const int gbytes = group_block_bytes(type);
    const float *x = a->x + (int64_t)i0 * a->ldx;
    for (int half = 0; half < 2; half++) {
        __m256 p[3][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) p[r][j] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = grp + (int64_t)b * gbytes;
            for (int e = 0; e < 32; e++) {
                const __m256 w = float8_at(type, blk, e, half);
                for (int r = 0; r < R; r++)
                    p[r][e % 4] = _mm256_add_ps(p[r][e % 4], _mm256_mul_ps(_mm256_set1_ps(x[r * a->ldx + 32 * b + e]), w));
            }
        }
        for (int r = 0; r < R; r++)
            _mm256_storeu_ps(out[r] + 8 * half, _mm256_add_ps(_mm256_add_ps(p[r][0], p[r][1]), _mm256_add_ps(p[r][2], p[r][3])));
    }
}
#define FLOAT_AVX2(TYPE, GRP, NB, A, I0, R, OUT) float_avx2(TYPE, GRP, NB, A, I0, (R) < 3 ? (R) : 3, OUT)
FLOAT_ROWS(group_f32_avx2, FLOAT_AVX2, GG_F32, 3, AVX2F)
FLOAT_ROWS(group_f16_avx2, FLOAT_AVX2, GG_F16, 3, AVX2F)
FLOAT_ROWS(group_bf16_avx2, FLOAT_AVX2, GG_BF16, 3, AVX2F)

/* Q5_K: Q4_K's with the fifth bits; pair sums of 2 * 31 * 127 stay within s16 four at a time, not eight. */
AVX2F INLINE void q5k_avx2(const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, const int r0, const int P, int half,
                           float out[R_MAX][LANES]) {
    const int h32 = 32 * half;
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int16_t *mins = a->x32hp + (int64_t)(i0 / R_MAX) * nb * R_MAX * 8;
    const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    __m256 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * 2816;
        __m128i sc8[8], m8[8];
        q4k_scales(blk, sc8, m8);
        __m256i t[R_MAX];
        for (int r = 0; r < R; r++) t[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = blk + 256 + 320 * j + h32;
            const int8_t *xs = xq + (int64_t)(8 * b + j) * 32 * P;
            const __m256i v32 = _mm256_cvtepu8_epi32(half ? _mm_srli_si128(sc8[j], 8) : sc8[j]);
            const __m256i sc = _mm256_or_si256(v32, _mm256_slli_epi32(v32, 16)); /* each lane's scale twice */
            const __m256i h = _mm256_loadu_si256((const __m256i *)(qs + 256));
            __m256i w[8];
            for (int z = 0; z < 4; z++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * z));
                w[z] = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(q5_high8(h, z), bit4));
                w[z + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_and_si256(q5_high8(h, z + 4), bit4));
            }
            for (int r = 0; r < R; r++) {
                const int8_t *x = xs + 4 * (r0 + r);
                __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
                for (int g = 0; g < 4; g++) {
                    p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(w[g], bcast32_8(x + 4 * P * g)));
                    p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(w[g + 4], bcast32_8(x + 4 * P * (g + 4))));
                }
                t[r] = _mm256_add_epi32(t[r], _mm256_add_epi32(_mm256_madd_epi16(p0, sc), _mm256_madd_epi16(p1, sc)));
            }
        }
        q4k_block_end_avx2(blk, m8, mins, dxs, b, R, r0, half, t, acc);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r0 + r] + 8 * half, acc[r]);
}
#define Q5K_CALL2(R, R0, P) q5k_avx2(grp, nb, a, i0, R, R0, P, half, out)
AVX2_ROWS(group_q5k_avx2, Q5K_CALL2, 1)

AVX2F INLINE __m256i q3_high8(__m256i h, int g) {
    switch (g) {
    case 0: return _mm256_slli_epi16(h, 2);
    case 1: return _mm256_slli_epi16(h, 1);
    case 2: return h;
    default: return _mm256_srli_epi16(h, g - 2);
    }
}

/* Q3_K: Q6_K's regrouping, T = sum_j (sc_j - 32) S_j - 4 sum_j (sc_j - 32) X16_j; pair sums of 2 * 7 * 127 stay
 * within s16 eight at a time. */
AVX2F INLINE void q3k_avx2(const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, const int r0, const int P, int half,
                           float out[R_MAX][LANES]) {
    const int h32 = 32 * half;
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const int16_t *offs = a->x16hp + (int64_t)(i0 / R_MAX) * nb * R_MAX * 16;
    const __m256i bits01 = _mm256_set1_epi8(3), bit2 = _mm256_set1_epi8(4);
    __m256 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * 1760;
        __m128i sc8[16];
        q3k_scales(blk, sc8);
        __m256i t[R_MAX];
        for (int r = 0; r < R; r++) t[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const uint8_t *chunk = blk + 224 + 192 * c + h32;
            const int8_t *xs = xq + (int64_t)(8 * b + c) * 32 * P;
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)chunk), l1 = _mm256_loadu_si256((const __m256i *)(chunk + 64));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(chunk + 128));
            __m256i w[8];
            for (int g = 0; g < 8; g++)
                w[g] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(g < 4 ? l0 : l1, 2 * (g % 4)), bits01),
                                       _mm256_and_si256(q3_high8(h, g), bit2));
            __m256i sc[2]; /* each lane's scale twice, the chunk's two sub-blocks */
            for (int u = 0; u < 2; u++) {
                const __m256i v = _mm256_cvtepi8_epi32(half ? _mm_srli_si128(sc8[2 * c + u], 8) : sc8[2 * c + u]);
                sc[u] = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
            }
            for (int r = 0; r < R; r++) {
                const int8_t *x = xs + 4 * (r0 + r);
                __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
                for (int g = 0; g < 4; g++) {
                    p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(w[g], bcast32_8(x + 4 * P * g)));
                    p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(w[g + 4], bcast32_8(x + 4 * P * (g + 4))));
                }
                t[r] = _mm256_add_epi32(t[r], _mm256_add_epi32(_mm256_madd_epi16(p0, sc[0]), _mm256_madd_epi16(p1, sc[1])));
            }
        }
        __m256i sp[8]; /* lane c: (sc_2p - 32, sc_2p+1 - 32) as two int16 */
        for (int p = 0; p < 8; p++)
            sp[p] = _mm256_cvtepi8_epi16(half ? _mm_unpackhi_epi8(sc8[2 * p], sc8[2 * p + 1]) : _mm_unpacklo_epi8(sc8[2 * p], sc8[2 * p + 1]));
        const __m256 d = load_half8(blk + 16 * half);
        for (int r = 0; r < R; r++) {
            const int16_t *x16 = offs + ((int64_t)b * R_MAX + r0 + r) * 16;
            __m256i o = _mm256_setzero_si256();
            for (int p = 0; p < 8; p++) o = _mm256_add_epi32(o, _mm256_madd_epi16(sp[p], bcast32_8(x16 + 2 * p)));
            const __m256i tt = _mm256_sub_epi32(t[r], _mm256_slli_epi32(o, 2));
            const __m256 dx = _mm256_set1_ps(dxs[b * R_MAX + r0 + r]);
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dx, _mm256_mul_ps(d, _mm256_cvtepi32_ps(tt))));
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r0 + r] + 8 * half, acc[r]);
}
#define Q3K_CALL2(R, R0, P) q3k_avx2(grp, nb, a, i0, R, R0, P, half, out)
AVX2_ROWS(group_q3k_avx2, Q3K_CALL2, 0)

/* IQ4_XS: the indices through the signed kv (vpshufb), multiplied as |kv| and sign(kv) x (as Q8_0's: each pair
 * sum at most 2 * 127 * 127, widened one vpmaddubsw at a time by vpmaddwd with the sub-block's scale). */
AVX2F INLINE void iq4xs_avx2(const uint8_t *grp, int nb, const acts_t *a, int i0, const int R, const int r0, const int P, int half,
                             float out[R_MAX][LANES]) {
    const int h32 = 32 * half;
    const int8_t *xq = panel(a, i0);
    const float *dxs = a->dxp + (int64_t)(i0 / R_MAX) * nb * R_MAX;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4nl_values));
    __m256 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * 2176;
        __m128i sc8[8];
        iq4xs_scales(blk, sc8);
        __m256i t[R_MAX];
        for (int r = 0; r < R; r++) t[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = blk + 128 + 256 * j + h32;
            const int8_t *xs = xq + (int64_t)(8 * b + j) * 32 * P;
            const __m256i v32 = _mm256_cvtepi8_epi32(half ? _mm_srli_si128(sc8[j], 8) : sc8[j]);
            const __m256i sc = _mm256_or_si256(_mm256_and_si256(v32, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v32, 16));
            __m256i w[8], aw[8];
            for (int z = 0; z < 4; z++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * z));
                w[z] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
                w[z + 4] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            }
            for (int g = 0; g < 8; g++) aw[g] = _mm256_abs_epi8(w[g]);
            for (int r = 0; r < R; r++) {
                const int8_t *x = xs + 4 * (r0 + r);
                __m256i p = _mm256_setzero_si256();
                for (int g = 0; g < 8; g++)
                    p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[g], _mm256_sign_epi8(bcast32_8(x + 4 * P * g), w[g])), sc));
                t[r] = _mm256_add_epi32(t[r], p);
            }
        }
        const __m256 d = load_half8(blk + 16 * half);
        for (int r = 0; r < R; r++) {
            const __m256 dx = _mm256_set1_ps(dxs[b * R_MAX + r0 + r]);
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dx, _mm256_mul_ps(d, _mm256_cvtepi32_ps(t[r]))));
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r0 + r] + 8 * half, acc[r]);
}
#define IQ4XS_CALL2(R, R0, P) iq4xs_avx2(grp, nb, a, i0, R, R0, P, half, out)
AVX2_ROWS(group_iq4xs_avx2, IQ4XS_CALL2, 1)
#endif /* SD_X86 */

/* ------------------------------------------------------------------ dispatch */

static int best_isa(void) {
#ifdef SD_X86
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c"))
            cached = ISA_VNNI;
        else
            cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? ISA_AVX2 : ISA_C;
        cached = SD_CAP(cached);
    }
    return cached;
#else
    return ISA_C;
#endif
}

int sd_gguf_isa(void) { return best_isa(); }

typedef void (*group_fn)(int, const uint8_t *, int, const acts_t *, int, int, float[R_MAX][LANES]);

static void group_portable(int type, const uint8_t *grp, int nb, const acts_t *a, int i0, int rows,
                           float out[R_MAX][LANES]) {
    group_c(type, grp, nb, a, i0, rows, out);
}

static group_fn group_function(int type, int isa) {
#ifdef SD_X86
    if (isa == ISA_VNNI) switch (type) {
        case GG_Q4_K: return group_q4k_vnni;
        case GG_Q6_K: return group_q6k_vnni;
        case GG_Q5_0: return group_q50_vnni;
        case GG_Q8_0: return group_q80_vnni;
        case GG_Q4_1: return group_q41_vnni;
        case GG_Q4_0: return group_q40_vnni;
        case GG_Q5_1: return group_q51_vnni;
        case GG_IQ4_NL: return group_iq4nl_vnni;
        case GG_Q2_K: return group_q2k_vnni;
        case GG_F32: return group_f32_vnni;
        case GG_F16: return group_f16_vnni;
        case GG_BF16: return group_bf16_vnni;
        case GG_Q5_K: return group_q5k_vnni;
        case GG_Q3_K: return group_q3k_vnni;
        case GG_IQ4_XS: return group_iq4xs_vnni;
        }
    if (isa == ISA_AVX2) switch (type) {
        case GG_Q4_K: return group_q4k_avx2;
        case GG_Q6_K: return group_q6k_avx2;
        case GG_Q5_0: return group_q50_avx2;
        case GG_Q8_0: return group_q80_avx2;
        case GG_Q4_1: return group_q41_avx2;
        case GG_Q4_0: return group_q40_avx2;
        case GG_Q5_1: return group_q51_avx2;
        case GG_IQ4_NL: return group_iq4nl_avx2;
        case GG_Q2_K: return group_q2k_avx2;
        case GG_F32: return group_f32_avx2;
        case GG_F16: return group_f16_avx2;
        case GG_BF16: return group_bf16_avx2;
        case GG_Q5_K: return group_q5k_avx2;
        case GG_Q3_K: return group_q3k_avx2;
        case GG_IQ4_XS: return group_iq4xs_avx2;
        }
#endif
    (void)isa;
    if (float_type(type)) return group_float_c;
    return group_portable;
}

/* One unit of work: groups [g0, g1) of part p, all rows. */
typedef struct {
    int part, g0, g1;
} unit_t;

static void run_unit(const sd_gguf_params *p, const acts_t *acts[2], int isa, unit_t u) {
    const sd_gguf_part *part = &p->parts[u.part];
    const int type = part->type, nb = p->k / block_columns(type), gbytes = group_block_bytes(type);
    const acts_t *a = acts[block_columns(type) == BLOCK_K ? 0 : 1];
    acts_t xs = {0}; /* F32, F16, BF16: x itself */
    if (float_type(type)) {
        xs.x = p->x;
        xs.ldx = p->ldx;
        xs.k = p->k;
        xs.m = p->m;
        a = &xs;
    }
    const group_fn fn = group_function(type, isa);
    float out[R_MAX][LANES];
    for (int i0 = 0; i0 < p->m; i0 += R_MAX) {
        const int rows = p->m - i0 < R_MAX ? p->m - i0 : R_MAX;
        for (int g = u.g0; g < u.g1; g++) {
            fn(type, (const uint8_t *)part->w + (int64_t)g * nb * gbytes, nb, a, i0, rows, out);
            const int lanes = part->n - g * LANES < LANES ? part->n - g * LANES : LANES;
            for (int r = 0; r < rows; r++) {
                float *y = p->y + (int64_t)(i0 + r) * p->ldy + part->col + (int64_t)g * LANES;
                for (int c = 0; c < lanes; c++) y[c] = part->bias ? out[r][c] + part->bias[g * LANES + c] : out[r][c];
            }
        }
    }
}

/* y = x W^T (+ bias) over the parts (see sd_gguf_params).  Returns 0, -1 when out of memory, -2 for a part it
 * cannot multiply (a type it lacks, or k not a multiple of the type's block). */
int sd_gguf_linear(const sd_gguf_params *p) {
    const int isa = p->isa <= 0 || p->isa > best_isa() ? best_isa() : p->isa;
    int need[2] = {0, 0}, groups = 0;
    for (int i = 0; i < p->nparts; i++) {
        const int type = p->parts[i].type;
        if (!sd_gguf_supported(type) || p->k % block_columns(type)) return -2;
        if (!float_type(type)) need[block_columns(type) == BLOCK_K ? 0 : 1] = 1; /* the float types read x itself */
        groups += (p->parts[i].n + LANES - 1) / LANES;
    }
    acts_t ak = {0}, a0 = {0};
    void *mk = NULL, *m0 = NULL;
    if (need[0] && !(mk = alloc_acts(&ak, p->m, p->k, BLOCK_K))) return -1;
    if (need[1] && !(m0 = alloc_acts(&a0, p->m, p->k, BLOCK_0))) {
        scratch_give(0, mk);
        return -1;
    }
    const int threads = p->threads > 0 ? p->threads : 1;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && p->m >= 4)
#endif
    for (int i = 0; i < p->m; i++) {
        if (need[0]) quantize_row(p->x + (int64_t)i * p->ldx, &ak, i, isa);
        if (need[1]) quantize_row(p->x + (int64_t)i * p->ldx, &a0, i, isa);
        if (need[0] && isa > ISA_C) panel_row(&ak, i, p->m);
        if (need[1] && isa > ISA_C) panel_row(&a0, i, p->m);
    }
    const acts_t *acts[2] = {&ak, &a0};
    /* units of a few groups each, claimed dynamically; many rows: fewer, larger units */
#ifndef UNITS_PER_THREAD
#define UNITS_PER_THREAD 2
#endif
    int per = groups / (UNITS_PER_THREAD * threads);
    if (p->m > R_MAX && per > 2) per = 2;
    if (per < 1) per = 1;
    int units = 0;
    for (int i = 0; i < p->nparts; i++) units += ((p->parts[i].n + LANES - 1) / LANES + per - 1) / per;
    unit_t *list = malloc(sizeof(unit_t) * (size_t)(units > 0 ? units : 1));
    if (!list) {
        scratch_give(0, mk);
        scratch_give(1, m0);
        return -1;
    }
    int u = 0;
    for (int i = 0; i < p->nparts; i++) {
        const int g = (p->parts[i].n + LANES - 1) / LANES;
        for (int g0 = 0; g0 < g; g0 += per) list[u++] = (unit_t){i, g0, g0 + per < g ? g0 + per : g};
    }
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && units > 1)
#endif
    for (int i = 0; i < units; i++) run_unit(p, acts, isa, list[i]);
    free(list);
    scratch_give(0, mk);
    scratch_give(1, m0);
    return 0;
}

/* Dequantise rows of a tensor as the file stores them (row-major blocks; e.g. an embedding's): out[r, :] =
 * W[rows[r], :] as llama.cpp de-quantises it, (d * sc) * q - (dmin * m) for Q4_K, Q5_K and Q2_K, (d * sc) * (q - 32)
 * for Q6_K, d * (q - 16) for Q5_0, d * q for Q8_0, d * q + m for Q4_1 and Q5_1, d * (q - 8) for Q4_0,
 * d * kvalues_iq4nl[q] for IQ4_NL, (d * (sc - 32)) * (q - 4) for Q3_K, (d * (ls - 32)) * kvalues_iq4nl[q] for IQ4_XS;
 * an F32, F16 or BF16 table's rows as they are (widened).
 * Returns 0, or -2 for a type it lacks. */
int sd_gguf_rows(int type, const void *blocks, int k, const int64_t *rows, int count, float *out) {
    if (type == GG_F32 || type == GG_F16) { /* an unquantised table: its rows as they are, widened */
        for (int r = 0; r < count; r++)
            for (int j = 0; j < k; j++)
                out[(int64_t)r * k + j] = type == GG_F32 ? ((const float *)blocks)[rows[r] * k + j]
                                                         : half_to_float(((const uint16_t *)blocks)[rows[r] * k + j]);
        return 0;
    }
    if (type == GG_BF16) { /* bf16: the top half of an fp32 */
        for (int r = 0; r < count; r++)
            for (int j = 0; j < k; j++) out[(int64_t)r * k + j] = bf16_to_float(((const uint16_t *)blocks)[rows[r] * k + j]);
        return 0;
    }
    if (!sd_gguf_supported(type) || k % block_columns(type)) return -2;
    const int cols = block_columns(type), nb = k / cols, fbytes = file_block_bytes(type);
    uint8_t v[BLOCK_K];
    for (int r = 0; r < count; r++) {
        const uint8_t *row = (const uint8_t *)blocks + rows[r] * nb * fbytes;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (int64_t)b * fbytes;
            float *o = out + (int64_t)r * k + (int64_t)b * cols;
            decode_block(type, blk, v);
            switch (type) {
            case GG_Q4_K: {
                const float d = half_to_float(read16(blk)), dmin = half_to_float(read16(blk + 2));
                for (int j = 0; j < 8; j++) {
                    uint8_t sc, m;
                    q4k_scale_min(blk + 4, j, &sc, &m);
                    const float d1 = d * (float)sc, m1 = dmin * (float)m;
                    for (int e = 32 * j; e < 32 * j + 32; e++) o[e] = d1 * (float)v[e] - m1;
                }
                break;
            }
            case GG_Q6_K: {
                const float d = half_to_float(read16(blk + 208));
                for (int e = 0; e < 256; e++) o[e] = (d * (float)(int8_t)blk[192 + e / 16]) * (float)(v[e] - 32);
                break;
            }
            case GG_Q5_0:
            case GG_Q8_0: {
                const float d = half_to_float(read16(blk));
                const int offset = type == GG_Q5_0 ? 16 : 128;
                for (int e = 0; e < 32; e++) o[e] = d * (float)(v[e] - offset);
                break;
            }
            case GG_Q4_1: {
                const float d = half_to_float(read16(blk)), m = half_to_float(read16(blk + 2));
                for (int e = 0; e < 32; e++) o[e] = d * (float)v[e] + m;
                break;
            }
            case GG_Q4_0: {
                const float d = half_to_float(read16(blk));
                for (int e = 0; e < 32; e++) o[e] = d * (float)(v[e] - 8);
                break;
            }
            case GG_Q5_1: {
                const float d = half_to_float(read16(blk)), m = half_to_float(read16(blk + 2));
                for (int e = 0; e < 32; e++) o[e] = d * (float)v[e] + m;
                break;
            }
            case GG_IQ4_NL: {
                const float d = half_to_float(read16(blk));
                for (int e = 0; e < 32; e++) o[e] = d * (float)iq4nl_values[v[e]];
                break;
            }
            case GG_Q2_K: {
                const float d = half_to_float(read16(blk + 80)), dmin = half_to_float(read16(blk + 82));
                for (int j = 0; j < 16; j++) {
                    const float d1 = d * (float)(blk[j] & 0xF), m1 = dmin * (float)(blk[j] >> 4);
                    for (int e = 16 * j; e < 16 * j + 16; e++) o[e] = d1 * (float)v[e] - m1;
                }
                break;
            }
            case GG_Q5_K: {
                const float d = half_to_float(read16(blk)), dmin = half_to_float(read16(blk + 2));
                for (int j = 0; j < 8; j++) {
                    uint8_t sc, m;
                    q4k_scale_min(blk + 4, j, &sc, &m);
                    const float d1 = d * (float)sc, m1 = dmin * (float)m;
                    for (int e = 32 * j; e < 32 * j + 32; e++) o[e] = d1 * (float)v[e] - m1;
                }
                break;
            }
            case GG_Q3_K: {
                const float d = half_to_float(read16(blk + 108));
                for (int e = 0; e < 256; e++) o[e] = (d * (float)(q3k_scale(blk + 96, e / 16) - 32)) * (float)(v[e] - 4);
                break;
            }
            case GG_IQ4_XS: {
                const float d = half_to_float(read16(blk));
                for (int e = 0; e < 256; e++) o[e] = (d * (float)(iq4xs_scale(blk + 2, e / 32) - 32)) * (float)iq4nl_values[v[e]];
                break;
            }
            }
        }
    }
    return 0;
}
