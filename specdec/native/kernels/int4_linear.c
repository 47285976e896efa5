/* specdec's int4 linear for draft models on the CPU: y = x W^T (+ b) with 4-bit weights in groups of 32
 * columns, each group with its own fp16 scale and minimum (asymmetric, as llama.cpp's Q4_1), and 8-bit
 * per-token activations.
 *
 * Why: a draft model's one-token step reads every weight once and is bound by memory bandwidth; 5 bits a
 * weight instead of int8's 8 make it cheaper, and a draft's numbers never change the output of speculative
 * decoding (verification decides), only how many of its tokens are accepted.  Why this format: the zoo's
 * drafts ship as Q4_1 (smollm2-135m) and Q4_K (gemma3-270m) files, whose weights sit on an asymmetric grid
 * of 16 levels per 32 columns; a grid of the same shape keeps them nearly as they are, where the symmetric
 * 15-level grid per 64 columns (and 7-bit activations) this kernel had before lost many of them.  The greedy
 * next token of the int4 draft against its fp32 model's (four texts, teacher-forced; 2-core AMD EPYC, Zen 3,
 * benchmarks/runs/int4-q41-zen3): smollm2-135m 61% -> 85%, qwen2.5-coder-0.5b 77% -> 84%, gemma3-270m 81%
 * (63% when both roundings of the old format are simulated in torch).
 * Group-wise weights as in GPTQ (Frantar et al. 2022); integer dot products as in int8_linear.c.
 *
 * Numbers, for output channel n and input row x:
 *   x ~ q * s, q = round(x * 127 / amax) in [-127, 127] (quantize_rows4; s = amax / 127);
 *   W[n, 32 g + c] ~ u[n, g, c] * d[n, g] + m[n, g], u in [0, 15], d and m fp16;
 *   per block j of 64 columns (groups a = 2j and b = 2j + 1), from 0 over j in order, lanes l = 0..7 -- lane l
 *   < 4 holds columns 4l..4l+3 and 16+4l..16+4l+3 of group a, lane l >= 4 the same columns of group b:
 *     lane_l = fma(sum over its 8 columns of q u (exact in int32), d[n, its group], lane_l);
 *     mins_e = fma(qs[2j + e], m[n, 2j + e], mins_e) for e = 0, 1, with qs[g] the (exact) sum of q over group g;
 *   y = ((((lane_0 + lane_4) + (lane_2 + lane_6)) + ((lane_1 + lane_5) + (lane_3 + lane_7))) + (mins_0 + mins_1))
 *       * s (+ b).
 * The AVX2 path and the portable C path compute exactly these numbers (the same bits; tested), and every output
 * element depends on its own input row and weight row only (batch-invariant, like int8).
 *
 * Layout: tiles of TILE4 = 4 output channels (rows); per tile, per block j, per row r: 32 bytes at
 * ((tile * B + j) * 4 + r) * 32, B = kp / 64, byte 16 e + c (e = 0, 1; c < 16) holding u[., 2j + e, c] in its low
 * nibble and u[., 2j + e, 16 + c] in its high nibble: each 16-byte half one group.  The activations are stored
 * to match (quantize_rows4): per block, columns 0-15, 32-47, 16-31, 48-63.  Scales and minimums: 16 fp16 values per tile and block, at (tile * B + j) * 16: d[rows 0..3,
 * 2j], d[rows 0..3, 2j + 1], m[rows 0..3, 2j], m[rows 0..3, 2j + 1].  Padding rows and columns hold u = 0,
 * d = m = 0.  1 bit a weight for the scales: 5 bits a weight in all.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specdec_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SD4_X86 1
#endif

#define TILE4 4
#define BLOCK 64   /* columns per 32 bytes of a row's nibbles */
#define GROUP4 32  /* columns per scale and minimum */
#define QMAX4 127.0f

static inline float tree8(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* ------------------------------------------------------------------ fp16 */

/* An fp32 value as fp16 bits, rounded to nearest even (as torch's .half()): overflow to infinity, subnormals kept. */
static uint16_t half_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00;  /* NaN */
    if (ax >= 0x477ff000u) return sign | 0x7c00;  /* >= 65520: infinity */
    if (ax < 0x38800000u) {                       /* below 2^-14: a subnormal (or zero), in units of 2^-24 */
        float a;
        memcpy(&a, &ax, sizeof a);
        return sign | (uint16_t)nearbyintf(a * 16777216.0f);
    }
    uint32_t h = (ax - 0x38000000u) >> 13;        /* exponent rebased from 127 to 15, 10 mantissa bits */
    const uint32_t rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++;  /* a carry into the exponent is right */
    return sign | (uint16_t)h;
}

/* fp16 bits as an fp32 value (exact). */
static inline float half_value(uint16_t h) {
    const uint32_t e = (h >> 10) & 31, m = h & 1023;
    uint32_t x;
    float v;
    if (e == 0) {
        v = (float)m * 5.9604644775390625e-8f;  /* m * 2^-24 */
        return (h & 0x8000) ? -v : v;
    }
    x = ((uint32_t)(h & 0x8000) << 16) | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    memcpy(&v, &x, sizeof v);
    return v;
}

/* ------------------------------------------------------------------ activations */

/* One row: q[:k] = round(x * 127 / amax) (zero padded to kp); returns amax / 127 (0 for an all-zero row, NaN
 * when it holds a NaN or an infinity). */
static float quantize_row4_c(const float *row, int k, int kp, int8_t *q) {
    float amax = 0.0f;
    for (int j = 0; j < k; j++) {
        const float a = fabsf(row[j]);
        if (a > amax || a != a) amax = a;  /* a NaN sticks */
    }
    memset(q, 0, (size_t)kp);
    if (amax == 0.0f || !isfinite(amax)) return amax == 0.0f ? 0.0f : NAN;
    const float inv = QMAX4 / amax;
    for (int j = 0; j < k; j++) {
        const float v = nearbyintf(row[j] * inv);  /* round half to even */
        q[j] = (int8_t)(v > QMAX4 ? QMAX4 : (v < -QMAX4 ? -QMAX4 : v));
    }
    return amax / QMAX4;
}

#ifdef SD4_X86
/* quantize_row4_c with AVX2 (the same IEEE operations, so the same q and scale). */
__attribute__((target("avx2,fma"))) static float quantize_row4_avx2(const float *row, int k, int kp, int8_t *q) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    int j = 0, nan = 0;
    for (; j + 8 <= k; j += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(row + j), absmask);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, a);
    }
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, vmax);
    for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
    for (; j < k; j++) {
        const float a = fabsf(row[j]);
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
    if (nan) amax = NAN;
    memset(q, 0, (size_t)kp);
    if (amax == 0.0f || !isfinite(amax)) return amax == 0.0f ? 0.0f : NAN;
    const float inv = QMAX4 / amax;
    const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(QMAX4), lo = _mm256_set1_ps(-QMAX4);
    for (j = 0; j + 32 <= k; j += 32) {
        __m256i v[4];
        for (int u = 0; u < 4; u++) {
            const __m256 f = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(row + j + 8 * u), vinv),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v[u] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(f, lo), hi));
        }
        /* 32 int32 -> 32 int8; the packs interleave 128-bit halves, the permute puts them back in order */
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + j), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    for (; j < k; j++) {
        const float v = nearbyintf(row[j] * inv);
        q[j] = (int8_t)(v > QMAX4 ? QMAX4 : (v < -QMAX4 ? -QMAX4 : v));
    }
    return amax / QMAX4;
}
#endif

static int best_isa4(void);

/* Each of m rows of x (stride ldx): q[i * kp ..] = round(x * 127 / amax) (zero padded to kp), xs[i] = amax / 127
 * (0 for an all-zero row, NaN when it holds a NaN or an infinity), qs[i * kp / 32 + g] = the sum of q over
 * group g; then each 64-column block of q reordered to columns 0-15, 32-47, 16-31, 48-63 (the weights' order,
 * see Layout).  Returns the block holding q, xs and qs, or NULL when out of memory. */
static void *quantize_rows4(const float *x, int64_t ldx, int m, int k, int kp, int isa, int8_t **q, float **xs,
                            float **qs) {
    const int groups = kp / GROUP4;
    const size_t qbytes = ((size_t)m * kp + 63) / 64 * 64;
    const size_t bytes = qbytes + sizeof(float) * ((size_t)m + (size_t)m * groups);
    char *block = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!block) return NULL;
    *q = (int8_t *)block;
    *xs = (float *)(block + qbytes);
    *qs = *xs + m;
    for (int i = 0; i < m; i++) {
        const float *row = x + (int64_t)i * ldx;
        int8_t *qi = *q + (int64_t)i * kp;
#ifdef SD4_X86
        if (isa == ISA4_AVX2)
            (*xs)[i] = quantize_row4_avx2(row, k, kp, qi);
        else
#endif
            (*xs)[i] = quantize_row4_c(row, k, kp, qi);
        for (int g = 0; g < groups; g++) {
            int32_t sum = 0;
            for (int c = 0; c < GROUP4; c++) sum += qi[g * GROUP4 + c];
            (*qs)[(int64_t)i * groups + g] = (float)sum;
        }
        for (int j = 0; j < kp; j += BLOCK) {  /* swap columns 16-31 and 32-47 */
            int8_t swap[16];
            memcpy(swap, qi + j + 16, 16);
            memcpy(qi + j + 16, qi + j + 32, 16);
            memcpy(qi + j + 32, swap, 16);
        }
    }
    return block;
}

/* ------------------------------------------------------------------ portable path */

static void tiles4_c(const uint8_t *w, const uint16_t *ws, const float *bias, int n, int t0, int t1, int kp,
                     const int8_t *q, const float *xs, const float *qs, int m, float *y, int64_t ldy) {
    const int blocks = kp / BLOCK, groups = kp / GROUP4;
    for (int t = t0; t < t1; t++) {
        for (int r = 0; r < TILE4 && t * TILE4 + r < n; r++) {
            const int col = t * TILE4 + r;
            for (int i = 0; i < m; i++) {
                const int8_t *qi = q + (int64_t)i * kp;
                float lanes[8] = {0}, mins[2] = {0.0f, 0.0f};
                for (int j = 0; j < blocks; j++) {
                    const uint8_t *wb = w + (((int64_t)t * blocks + j) * TILE4 + r) * 32;
                    const int8_t *qb = qi + j * BLOCK;  /* reordered: the low nibbles' columns, then the high's */
                    const uint16_t *sb = ws + ((int64_t)t * blocks + j) * 16;
                    for (int l = 0; l < 8; l++) {
                        int32_t sum = 0;
                        for (int c = 4 * l; c < 4 * l + 4; c++) sum += qb[c] * (wb[c] & 15) + qb[32 + c] * (wb[c] >> 4);
                        lanes[l] = fmaf((float)sum, half_value(sb[(l >= 4) * 4 + r]), lanes[l]);
                    }
                    for (int e = 0; e < 2; e++)
                        mins[e] = fmaf(qs[(int64_t)i * groups + 2 * j + e], half_value(sb[8 + 4 * e + r]), mins[e]);
                }
                const float v = (tree8(lanes) + (mins[0] + mins[1])) * xs[i];
                y[(int64_t)i * ldy + col] = bias ? v + bias[col] : v;
            }
        }
    }
}

/* ------------------------------------------------------------------ AVX2 path */

#ifdef SD4_X86
#define AVX2F __attribute__((target("avx2,fma,f16c")))

AVX2F static inline float hsum8(__m256 v) {
    float a[8];
    _mm256_storeu_ps(a, v);
    return tree8(a);
}

/* One tile x T input rows i .. i + T - 1.  The nibbles u go into vpmaddubsw as they are (unsigned) against the
 * signed, reordered activations: |u q| pairs <= 2 * 15 * 127 = 3810, the low and high nibbles' sum <= 7620, no
 * 16-bit saturation; lanes 0-3 then hold group a's sums and lanes 4-7 group b's, so one multiply-add by
 * [d_a x 4, d_b x 4] scales them.  A tile's block is unpacked once for T rows; the minimums' products run the
 * tile's 4 channels x 2 groups in one vector. */
#define TILE4_X(T)                                                                                       \
    AVX2F static inline void tile4_x##T(const uint8_t *tile, const uint16_t *ws, const float *bias, int col, \
                                        int n, int blocks, int kp, const int8_t *q, const float *xs,     \
                                        const float *qs, int i, float *y, int64_t ldy) {                 \
        const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);                           \
        const __m256i pick = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);                                  \
        const int groups = 2 * blocks;                                                                   \
        __m256 acc[TILE4][T], mins[T];  /* mins: lane e * 4 + r, channel col + r, group 2j + e */         \
        for (int t = 0; t < T; t++) {                                                                    \
            mins[t] = _mm256_setzero_ps();                                                               \
            for (int r = 0; r < TILE4; r++) acc[r][t] = _mm256_setzero_ps();                             \
        }                                                                                                \
        for (int j = 0; j < blocks; j++) {                                                               \
            const uint8_t *wb = tile + (int64_t)j * TILE4 * 32;                                          \
            const __m256i halves = _mm256_loadu_si256((const __m256i *)(ws + (int64_t)j * 16));          \
            const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));                            \
            const __m256 mn = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));                      \
            _mm_prefetch((const char *)wb + 1024, _MM_HINT_T0);                                          \
            _mm_prefetch((const char *)wb + 1024 + 64, _MM_HINT_T0);                                     \
            for (int t = 0; t < T; t++) {                                                                \
                const __m256 sums = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(    \
                    _mm_loadl_epi64((const __m128i *)(qs + (int64_t)(i + t) * groups + 2 * j)))), pick); \
                mins[t] = _mm256_fmadd_ps(sums, mn, mins[t]);                                            \
            }                                                                                            \
            for (int r = 0; r < TILE4; r++) {                                                            \
                const __m256i b = _mm256_loadu_si256((const __m256i *)(wb + 32 * r));                    \
                const __m256i u0 = _mm256_and_si256(b, low);                                             \
                const __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);                       \
                const __m256 scale = _mm256_permutevar8x32_ps(d, _mm256_add_epi32(_mm256_slli_epi32(pick, 2), _mm256_set1_epi32(r))); \
                for (int t = 0; t < T; t++) {                                                            \
                    const int8_t *qt = q + (int64_t)(i + t) * kp + (int64_t)j * BLOCK;                   \
                    const __m256i s16 = _mm256_add_epi16(                                                \
                        _mm256_maddubs_epi16(u0, _mm256_loadu_si256((const __m256i *)qt)),               \
                        _mm256_maddubs_epi16(u1, _mm256_loadu_si256((const __m256i *)(qt + 32))));       \
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)), scale, acc[r][t]); \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int t = 0; t < T; t++) {                                                                    \
            float m8[8];                                                                                 \
            _mm256_storeu_ps(m8, mins[t]);                                                               \
            for (int r = 0; r < TILE4 && col + r < n; r++) {                                             \
                const float v = (hsum8(acc[r][t]) + (m8[r] + m8[4 + r])) * xs[i + t];                    \
                y[(int64_t)(i + t) * ldy + col + r] = bias ? v + bias[col + r] : v;                      \
            }                                                                                            \
        }                                                                                                \
    }

TILE4_X(1)
TILE4_X(2)

AVX2F static void tiles4_avx2(const uint8_t *w, const uint16_t *ws, const float *bias, int n, int t0, int t1,
                              int kp, const int8_t *q, const float *xs, const float *qs, int m, float *y,
                              int64_t ldy) {
    const int blocks = kp / BLOCK;
    for (int t = t0; t < t1; t++) {
        const uint8_t *tile = w + (int64_t)t * blocks * TILE4 * 32;
        const uint16_t *wst = ws + (int64_t)t * blocks * 16;
        int col = t * TILE4, i = 0;
        for (; i + 2 <= m; i += 2) tile4_x2(tile, wst, bias, col, n, blocks, kp, q, xs, qs, i, y, ldy);
        if (i < m) tile4_x1(tile, wst, bias, col, n, blocks, kp, q, xs, qs, i, y, ldy);
    }
}

static int best_isa4(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")
                     ? ISA4_AVX2 : ISA4_C;
        cached = SD_CAP(cached);
    }
    return cached;
}
#else
static int best_isa4(void) { return ISA4_C; }
#endif

/* ------------------------------------------------------------------ packing */

/* The packed buffers of an n x kp layer, cleared to u = 0, d = m = 0. */
static void clear_packed(int n, int kp, uint8_t *out, uint16_t *out_scales) {
    const int tiles = (n + TILE4 - 1) / TILE4;
    memset(out, 0, (size_t)tiles * TILE4 * kp / 2);
    memset(out_scales, 0, sizeof(uint16_t) * (size_t)tiles * TILE4 * (kp / GROUP4) * 2);
}

/* Column c (0..31) of group g of row `row` gets nibble u (see Layout). */
static inline void put_nibble(uint8_t *out, int blocks, int row, int g, int c, int u) {
    uint8_t *dst = out + (((int64_t)(row / TILE4) * blocks + g / 2) * TILE4 + row % TILE4) * 32 + 16 * (g & 1) + (c & 15);
    *dst = c >= 16 ? (uint8_t)((*dst & 0x0f) | (u << 4)) : (uint8_t)((*dst & 0xf0) | u);
}

static inline void put_scale(uint16_t *out_scales, int blocks, int row, int g, uint16_t d, uint16_t mn) {
    uint16_t *s = out_scales + ((int64_t)(row / TILE4) * blocks + g / 2) * 16 + (g & 1) * 4 + row % TILE4;
    s[0] = d;
    s[8] = mn;
}

/* Pack u [n, k] (uint8 in [0, 15], row-major), d and mn [n, ceil(k / 32)] (fp16 bits, row-major) into the
 * layout above: out holds ceil(n / 4) * 4 * kp / 2 bytes, out_scales ceil(n / 4) * 4 * kp / 16 fp16 values. */
void sd_pack4(const uint8_t *u, const uint16_t *d, const uint16_t *mn, int n, int k, int kp, uint8_t *out,
              uint16_t *out_scales) {
    const int blocks = kp / BLOCK, kg = (k + GROUP4 - 1) / GROUP4;
    clear_packed(n, kp, out, out_scales);
    for (int row = 0; row < n; row++)
        for (int g = 0; g < kg; g++) {
            for (int c = 0; c < GROUP4 && g * GROUP4 + c < k; c++)
                put_nibble(out, blocks, row, g, c, u[(int64_t)row * k + g * GROUP4 + c] & 15);
            put_scale(out_scales, blocks, row, g, d[(int64_t)row * kg + g], mn[(int64_t)row * kg + g]);
        }
}

/* Quantize an int8 layer's weights to int4 and pack them as sd_pack4 does, in one pass: row n's weights are
 * w = (float)v8[n, :] * row_scale[n]; per group of 32 columns (the columns < k of it) lo = min w, hi = max w,
 * d = fp16((hi - lo) / 15), m = fp16(lo), u = round_half_even((w - m) / d) clamped to [0, 15] (0 where d = 0)
 * -- the same IEEE operations as specdec.native.int4.quantize_int4 on those weights, hence the same values.
 * Rows are shared among up to `threads` threads. */
void sd_pack4_int8(const int8_t *v8, const float *row_scale, int n, int k, int kp, uint8_t *out,
                   uint16_t *out_scales, int threads) {
    const int blocks = kp / BLOCK;
    clear_packed(n, kp, out, out_scales);
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) if (threads > 1)
#endif
    for (int row = 0; row < n; row++) {
        for (int g = 0; g * GROUP4 < k; g++) {
            float w[GROUP4];
            const int width = k - g * GROUP4 < GROUP4 ? k - g * GROUP4 : GROUP4;
            float lo = INFINITY, hi = -INFINITY;
            for (int c = 0; c < width; c++) {
                w[c] = (float)v8[(int64_t)row * k + g * GROUP4 + c] * row_scale[row];
                lo = w[c] < lo ? w[c] : lo;
                hi = w[c] > hi ? w[c] : hi;
            }
            const uint16_t dh = half_bits((hi - lo) / 15.0f), mh = half_bits(lo);
            const float d = half_value(dh), mn = half_value(mh);
            for (int c = 0; c < width; c++) {
                float v = d > 0.0f ? nearbyintf((w[c] - mn) / d) : 0.0f;
                put_nibble(out, blocks, row, g, c, (int)(v > 15.0f ? 15.0f : (v < 0.0f ? 0.0f : v)));
            }
            put_scale(out_scales, blocks, row, g, dh, mh);
        }
    }
}

/* ------------------------------------------------------------------ entry points */

/* y = x W^T (+ bias) (see sd_linear_params); p->w and p->scales packed by sd_pack4.  p->isa: 0 for the best
 * path, else at most that path (ISA4_C, ISA4_AVX2; the same bits).  Returns 0, or -1 when out of memory. */
int sd_linear4(const sd_linear_params *p) {
    const uint8_t *w = p->w;
    const uint16_t *ws = p->scales;
    const float *bias = p->bias, *x = p->x;
    const int n = p->n, k = p->k, kp = p->kp, m = p->m, threads = p->threads;
    const int64_t ldx = p->ldx, ldy = p->ldy;
    float *y = p->y;
    const int isa = p->isa <= 0 || p->isa > best_isa4() ? best_isa4() : p->isa;
    int8_t *q;
    float *xs, *qs;
    void *block = quantize_rows4(x, ldx, m, k, kp, isa, &q, &xs, &qs);
    if (!block) return -1;
    const int tiles = (n + TILE4 - 1) / TILE4;
    int chunk = tiles / (8 * (threads > 0 ? threads : 1));
    if (chunk < 4) chunk = 4;
    const int chunks = (tiles + chunk - 1) / chunk;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads > 0 ? threads : 1) if (threads > 1 && chunks > 1)
#endif
    for (int c = 0; c < chunks; c++) {
        const int t0 = c * chunk, t1 = (c + 1) * chunk < tiles ? (c + 1) * chunk : tiles;
#ifdef SD4_X86
        if (isa == ISA4_AVX2) {
            tiles4_avx2(w, ws, bias, n, t0, t1, kp, q, xs, qs, m, y, ldy);
            continue;
        }
#endif
        tiles4_c(w, ws, bias, n, t0, t1, kp, q, xs, qs, m, y, ldy);
    }
    free(block);
    return 0;
}

/* Which path sd_linear4 takes here: 2 (AVX2) or 1 (portable C). */
int sd_isa4(void) { return best_isa4(); }
