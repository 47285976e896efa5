/* specdec's exact causal attention for the CPU: every query row computed on its own, in one call for all rows.
 *
 * See specdec/native/kernels/attention.py for why.  Query row i of a call sits at position start + i and
 * attends to the keys and values at positions [lo, start + i + 1), lo = max(0, start + i + 1 - window) on
 * sliding-window layers (else 0).  Query head h reads key/value head h / (heads / kv_heads) (grouped-query
 * attention).  Per (row, head), with L visible keys:
 *
 *   s_j   = dot(q, k_j) * scale                  dot: the canonical 16-lane order below
 *   [s_j  = cap * tanhf(s_j / cap)]              where softcap > 0 (Gemma 2): on the per-row paths, below
 *   m     = max_j s_j
 *   e_j   = exp_sd(s_j - m)                      exp_sd: the polynomial below, elementwise
 *   Z     = sum_j e_j                            the canonical 16-lane order, j counted from lo
 *   out_d = (sum_j e_j * v_j,d) / Z              the sum over j in order, one fused multiply-add per j
 *
 * Canonical 16-lane order of a sum of x_0 .. x_{n-1}: lane l (0..15) accumulates x_l, x_{l+16}, ... in order
 * (dot: with fused multiply-adds, from 0), then t8_l = p_l + p_{l+8}, t4_l = t8_l + t8_{l+4},
 * t2_l = t4_l + t4_{l+2}, sum = t2_0 + t2_1.  The AVX-512 path holds the 16 lanes in one register, the AVX2
 * path in two, the portable C path in an array: the same operations on the same numbers, so every path gives
 * the same bits (tested).  Nothing in a row's result depends on the other rows, their number or the threads:
 * a token's attention is the same in a one-token step, a k-token verification and a prefill (batch
 * invariance, as the int8 linears).  Compiled with -ffp-contract=off: the multiply-adds are the explicit ones.
 *
 * Tree mode (tree_at non-NULL; issue 39, SpecInfer's tree attention, Miao et al. 2024, arXiv 2305.09781): the n
 * new rows are a token tree whose keys and values sit at positions start .. start + n - 1 in the order given.
 * Row i sees the new rows tree_rows[tree_at[i] .. tree_at[i + 1]) -- its ancestors from the root, itself last --
 * after the cached positions [lo, start): its position is start + depth, depth = that count - 1, and the window
 * counts positions, so it keeps the last `window` of (cache, ancestors, itself).  Those keys are the ones a chain
 * forward over the row's path sees, in the same order: the sums above run over the same numbers in the same
 * lanes, so a node's attention is bitwise its path's chain's (tested on every path).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specdec_kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SD_X86 1
#endif

#define LANES 16
#define ROWS_MAX 8 /* a chain's rows taken together by one AVX-512 task (at most 64 query vectors) */

/* ------------------------------------------------------------------ exp_sd
 * exp(x) for the x = s_j - m <= 0 of a softmax: x < EXP_MIN gives 0; else n = round_half_even(x log2 e),
 * r = (x - n LN2_HI) - n LN2_LO (two fused multiply-adds), p = the degree-7 Taylor polynomial of e^r in
 * Horner form (fused multiply-adds), result p * 2^n (2^n built from its exponent bits; n >= -126). */
#define EXP_MIN -87.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
static const float EXP_POLY[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

static inline float exp_c(float x) {
    if (x < EXP_MIN) return 0.0f;
    float n = nearbyintf(x * LOG2E);
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = EXP_POLY[0];
    for (int i = 1; i < 8; i++) p = fmaf(p, r, EXP_POLY[i]);
    int32_t bits = ((int32_t)(n != n ? 0.0f : n) + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* ------------------------------------------------------------------ the visible keys of one (row, head)
 * Keys (or values) j = 0 .. n1 - 1 at run + j * stride (consecutive cached positions), then j = n1 .. n1 + n2 - 1
 * at slots + tail[j - n1] * stride (a tree row's ancestors and itself; n2 = 0 in a chain). */
typedef struct {
    const float *run, *slots;
    const int *tail;
    int n1, n2;
    int64_t stride;
} rows_view;

static inline const float *row_of(const rows_view *r, int j) {
    return j < r->n1 ? r->run + (int64_t)j * r->stride : r->slots + (int64_t)r->tail[j - r->n1] * r->stride;
}

/* ------------------------------------------------------------------ portable path */

static float tree16(const float *p) {
    float t8[8], t4[4];
    for (int l = 0; l < 8; l++) t8[l] = p[l] + p[l + 8];
    for (int l = 0; l < 4; l++) t4[l] = t8[l] + t8[l + 4];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

static float dot_c(const float *a, const float *b, int d) {
    float p[LANES] = {0};
    for (int i = 0; i < d; i++) p[i % LANES] = fmaf(a[i], b[i], p[i % LANES]);
    return tree16(p);
}

/* e[0:n] = exp_sd(s[0:n] - m) in place; returns their sum in the canonical order. */
static float softmax_c(float *s, int n, float m) {
    float p[LANES] = {0};
    for (int j = 0; j < n; j++) {
        s[j] = exp_c(s[j] - m);
        p[j % LANES] += s[j];
    }
    return tree16(p);
}

static void weighted_c(const float *e, const rows_view *v, int d, float z, float *out) {
    const float *et = e + v->n1;
    for (int c = 0; c < d; c++) {
        float acc = 0.0f;
        for (int j = 0; j < v->n1; j++) acc = fmaf(e[j], v->run[(int64_t)j * v->stride + c], acc);
        for (int j = 0; j < v->n2; j++) acc = fmaf(et[j], v->slots[(int64_t)v->tail[j] * v->stride + c], acc);
        out[c] = acc / z;
    }
}

/* ------------------------------------------------------------------ AVX2 path (16 lanes in two registers) */

#ifdef SD_X86
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline float tree8x2(__m256 lo, __m256 hi) {
    __m256 t8 = _mm256_add_ps(lo, hi);
    __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

AVX2 static float dot_avx2(const float *a, const float *b, int d) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int i = 0; i < d; i += LANES) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
    }
    return tree8x2(lo, hi);
}

AVX2 static inline __m256 exp_avx2(__m256 x) {
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
    __m256i ni = _mm256_cvtps_epi32(_mm256_blendv_ps(n, _mm256_setzero_ps(), _mm256_cmp_ps(n, n, _CMP_UNORD_Q)));
    __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23));
    __m256 y = _mm256_mul_ps(p, scale);
    return _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(EXP_MIN), _CMP_LT_OQ));
}

AVX2 static float softmax_avx2(float *s, int n, float m) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps(), vm = _mm256_set1_ps(m);
    int j = 0;
    for (; j + LANES <= n; j += LANES) {
        __m256 a = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        __m256 b = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), vm));
        _mm256_storeu_ps(s + j, a);
        _mm256_storeu_ps(s + j + 8, b);
        lo = _mm256_add_ps(lo, a);
        hi = _mm256_add_ps(hi, b);
    }
    float p[LANES];
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
    for (int l = 0; j < n; j++, l++) {
        s[j] = exp_c(s[j] - m);
        p[l] += s[j];
    }
    return tree16(p);
}

/* One weight times one value row into four (AVX2: 32 columns) or one (8 columns) accumulators. */
#define FMA4_AVX2(w, vj)                                      \
    do {                                                      \
        a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj), a0);      \
        a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8), a1);  \
        a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 16), a2); \
        a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 24), a3); \
    } while (0)

AVX2 static void weighted_avx2(const float *e, const rows_view *v, int d, float z, float *out) {
    const __m256 vz = _mm256_set1_ps(z);
    const float *et = e + v->n1;
    const int64_t vstride = v->stride;
    int c = 0;
    for (; c + 32 <= d; c += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = 0; j < v->n1; j++) FMA4_AVX2(_mm256_broadcast_ss(e + j), v->run + (int64_t)j * vstride + c);
        for (int j = 0; j < v->n2; j++) FMA4_AVX2(_mm256_broadcast_ss(et + j), v->slots + (int64_t)v->tail[j] * vstride + c);
        _mm256_storeu_ps(out + c, _mm256_div_ps(a0, vz));
        _mm256_storeu_ps(out + c + 8, _mm256_div_ps(a1, vz));
        _mm256_storeu_ps(out + c + 16, _mm256_div_ps(a2, vz));
        _mm256_storeu_ps(out + c + 24, _mm256_div_ps(a3, vz));
    }
    for (; c < d; c += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int j = 0; j < v->n1; j++)
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(e + j), _mm256_loadu_ps(v->run + (int64_t)j * vstride + c), a);
        for (int j = 0; j < v->n2; j++)
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(et + j), _mm256_loadu_ps(v->slots + (int64_t)v->tail[j] * vstride + c), a);
        _mm256_storeu_ps(out + c, _mm256_div_ps(a, vz));
    }
}
#undef FMA4_AVX2

/* ------------------------------------------------------------------ AVX-512 path (16 lanes in one register) */

#define AVX512 __attribute__((target("avx2,fma,avx512f")))

AVX512 static inline float tree16_zmm(__m512 p) {
    return tree8x2(_mm512_castps512_ps256(p), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
}

AVX512 static float dot_avx512(const float *a, const float *b, int d) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < d; i += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return tree16_zmm(acc);
}

AVX512 static inline __m512 exp_avx512(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
    __m512i ni = _mm512_cvtps_epi32(_mm512_mask_mov_ps(n, _mm512_cmp_ps_mask(n, n, _CMP_UNORD_Q), _mm512_setzero_ps()));
    __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23));
    __m512 y = _mm512_mul_ps(p, scale);
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MIN), _CMP_LT_OQ), _mm512_setzero_ps());
}

AVX512 static float softmax_avx512(float *s, int n, float m) {
    __m512 acc = _mm512_setzero_ps(), vm = _mm512_set1_ps(m);
    int j = 0;
    for (; j + LANES <= n; j += LANES) {
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
        _mm512_storeu_ps(s + j, e);
        acc = _mm512_add_ps(acc, e);
    }
    float p[LANES];
    _mm512_storeu_ps(p, acc);
    for (int l = 0; j < n; j++, l++) {
        s[j] = exp_c(s[j] - m);
        p[l] += s[j];
    }
    return tree16(p);
}

/* ------------------------------------------------------------------ AVX-512: a kv head's query heads together
 * Grouped-query attention gives the `group` query heads of one kv head the same keys and values; computed one
 * (row, head) at a time, every head streams them again from L2, which bounds the attention (Zen 4: ~47 cycles
 * per key and head against ~16 of arithmetic).  Here one task is a kv head and a row, or up to ROWS_MAX rows of
 * a chain without a window (row i0 + r sees the same keys as row i0 and r more): a block of keys is read once for
 * all their query heads, and each head's numbers are those of the per-head functions above, operation for
 * operation:
 *   - scores 16 keys at a time: key t's 16-lane products in its own register, in the same fused multiply-add
 *     order as dot_avx512; then the 16 registers are reduced together by a transposing network whose every
 *     addition is one of tree16's (t8_l = p_l + p_{l+8}, t4_l = t8_l + t8_{l+4}, t2_l = t4_l + t4_{l+2},
 *     t2_0 + t2_1), the operands only sitting in other lanes; keys past the last whole block take dot_avx512;
 *   - a row's weighted sums, up to GROUP_BLOCK heads at once, each column's chain of multiply-adds over j in
 *     order as in weighted_avx2 and weighted_c, a value row loaded once for all of them (the next rows of the task find the
 *     values in L2). */

#define GROUP_BLOCK 6 /* heads whose weighted sums run together: 6 x 4 accumulators + 4 value registers */

/* out[t] = tree16 of acc[t] for t = 0..15 (see above).  The network leaves key 4c + b's sum in lane 4b + c;
 * acc is read through that transposition so that lane t holds key t's. */
AVX512 static inline __m512 tree16_x16(const __m512 *acc) {
    __m512 b[8], c[4], d[2];
    for (int m = 0; m < 8; m++) { /* t8: lanes 0-7 of key 2m's sum in 0-7 and of key 2m + 1's in 8-15 */
        const __m512 p = acc[(2 * m) % 4 * 4 + (2 * m) / 4], q = acc[(2 * m + 1) % 4 * 4 + (2 * m + 1) / 4];
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x44), _mm512_shuffle_f32x4(p, q, 0xee));
    }
    for (int m = 0; m < 4; m++) /* t4: one 4-lane block per key */
        c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xdd));
    for (int m = 0; m < 2; m++) /* t2: two lanes per key */
        d[m] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
}

/* s_r[j] = dot_avx512(q_r, k_j, D) * scale for `count` query vectors r (s_r = s + r * stride) over the first
 * ns[r] keys of k, for the keys of their whole 16-key blocks; D (64 or 128) a constant so that a vector's q
 * stays in registers beside the 16 accumulators.  A block of keys is read for every vector that sees all of
 * it (a row's heads, the rows of a chain) while it sits in L1. */
#define SCORES_BLOCKS(D)                                                                                    \
    AVX512 static void score_blocks_##D(const float *const *qs, const int *ns, int count, const rows_view *k, \
                                        float scale, float *s, int64_t stride) {                            \
        const __m512 vscale = _mm512_set1_ps(scale);                                                        \
        const int fixed = k->stride == D; /* consecutive rows (a runner's cache): keys at fixed offsets */   \
        int most = 0;                                                                                       \
        for (int r = 0; r < count; r++) most = ns[r] > most ? ns[r] : most;                                 \
        for (int j = 0; j + LANES <= most; j += LANES) {                                                    \
            const float *rows[LANES];                                                                       \
            for (int t = 0; t < LANES; t++) rows[t] = row_of(k, j + t);                                     \
            const int run = fixed && j + LANES <= k->n1;                                                    \
            for (int r = 0; r < count; r++) {                                                               \
                if (j + LANES > ns[r]) continue;                                                            \
                __m512 qc[D / LANES], acc[LANES];                                                           \
                _Pragma("GCC unroll 8") for (int c = 0; c < D / LANES; c++) qc[c] = _mm512_loadu_ps(qs[r] + c * LANES); \
                _Pragma("GCC unroll 16") for (int t = 0; t < LANES; t++) acc[t] = _mm512_setzero_ps();     \
                if (run) { /* each key's products in order, interleaved across the keys */                   \
                    const float *base = rows[0];                                                            \
                    _Pragma("GCC unroll 8") for (int c = 0; c < D / LANES; c++)                             \
                        _Pragma("GCC unroll 16") for (int t = 0; t < LANES; t++)                            \
                            acc[t] = _mm512_fmadd_ps(qc[c], _mm512_loadu_ps(base + t * D + c * LANES), acc[t]); \
                } else {                                                                                    \
                    _Pragma("GCC unroll 16") for (int t = 0; t < LANES; t++)                                \
                        _Pragma("GCC unroll 8") for (int c = 0; c < D / LANES; c++)                         \
                            acc[t] = _mm512_fmadd_ps(qc[c], _mm512_loadu_ps(rows[t] + c * LANES), acc[t]);  \
                }                                                                                           \
                _mm512_storeu_ps(s + r * stride + j, _mm512_mul_ps(tree16_x16(acc), vscale));               \
            }                                                                                               \
        }                                                                                                   \
    }
SCORES_BLOCKS(64)
SCORES_BLOCKS(128)
#undef SCORES_BLOCKS

/* s_r[j] = dot_avx512(q_r, k_j, d) * scale for j in [0, ns[r]) and `count` query vectors r (s_r = s + r *
 * stride); m[r]: the maximum of s_r (as attend's loop takes it). */
AVX512 static void scores_avx512(const float *const *qs, const int *ns, int count, const rows_view *k, int d,
                                 float scale, float *s, int64_t stride, float *m) {
    if (d == 128) score_blocks_128(qs, ns, count, k, scale, s, stride);
    if (d == 64) score_blocks_64(qs, ns, count, k, scale, s, stride);
    for (int r = 0; r < count; r++) {
        float *sr = s + r * stride, top = -INFINITY;
        for (int j = d == 128 || d == 64 ? ns[r] / LANES * LANES : 0; j < ns[r]; j++)
            sr[j] = dot_avx512(qs[r], row_of(k, j), d) * scale;
        for (int j = 0; j < ns[r]; j++) top = sr[j] > top ? sr[j] : top;
        m[r] = top;
    }
}

/* out_r[c] = (sum_j e_r[j] v_j,c) / z_r for R heads r (e_r = e + r * stride), columns c in [c0, c0 + 64). */
#define WEIGHTED_GROUP(R)                                                                                   \
    AVX512 static inline void weighted64_x##R(const float *e, int64_t stride, const rows_view *v, int c0,     \
                                              const float *z, float *const *out) {                          \
        __m512 acc[R][4];                                                                                   \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                                                                         \
            _Pragma("GCC unroll 4") for (int x = 0; x < 4; x++) acc[r][x] = _mm512_setzero_ps();                                   \
        const int n = v->n1 + v->n2;                                                                        \
        for (int j = 0; j < n; j++) {                                                                       \
            const float *vj = row_of(v, j) + c0;                                                            \
            const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);                           \
            const __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);                      \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                                   \
                const __m512 w = _mm512_set1_ps(e[r * stride + j]);                                        \
                acc[r][0] = _mm512_fmadd_ps(w, v0, acc[r][0]);                                              \
                acc[r][1] = _mm512_fmadd_ps(w, v1, acc[r][1]);                                              \
                acc[r][2] = _mm512_fmadd_ps(w, v2, acc[r][2]);                                              \
                acc[r][3] = _mm512_fmadd_ps(w, v3, acc[r][3]);                                              \
            }                                                                                               \
        }                                                                                                   \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                                       \
            const __m512 vz = _mm512_set1_ps(z[r]);                                                         \
            _Pragma("GCC unroll 4") for (int x = 0; x < 4; x++) _mm512_storeu_ps(out[r] + c0 + 16 * x, _mm512_div_ps(acc[r][x], vz)); \
        }                                                                                                   \
    }
WEIGHTED_GROUP(1)
WEIGHTED_GROUP(2)
WEIGHTED_GROUP(3)
WEIGHTED_GROUP(4)
WEIGHTED_GROUP(5)
WEIGHTED_GROUP(6)
#undef WEIGHTED_GROUP

/* Columns [c0, c0 + 16) of one head (what weighted64_x1 leaves of a head size that is not a multiple of 64). */
AVX512 static void weighted16(const float *e, const rows_view *v, int c0, float z, float *out) {
    __m512 a = _mm512_setzero_ps();
    const int n = v->n1 + v->n2;
    for (int j = 0; j < n; j++) a = _mm512_fmadd_ps(_mm512_set1_ps(e[j]), _mm512_loadu_ps(row_of(v, j) + c0), a);
    _mm512_storeu_ps(out + c0, _mm512_div_ps(a, _mm512_set1_ps(z)));
}

/* Query rows i0 .. i0 + rows - 1, every head of kv head g, over the keys and values k, v (rows_view of the
 * first row; row r sees ns[r] of them: a chain without a window, rows > 1, sees one run of them); s: room for
 * rows * group * stride scores. */
AVX512 static void attend_rows_avx512(const sd_attention_params *job, int i0, int rows, int g, const rows_view *k,
                                      const rows_view *v, const int *ns, int stride, float *s) {
    const int d = job->d, group = job->heads / job->kv_heads, count = rows * group;
    const float *qs[64];
    int vn[64];
    float m[64];
    for (int x = 0; x < count; x++) {
        const int r = x / group, h = g * group + x % group;
        qs[x] = job->q + (int64_t)h * job->q_head + (int64_t)(i0 + r) * job->q_row;
        vn[x] = ns[r];
    }
    scores_avx512(qs, vn, count, k, d, job->scale, s, stride, m);
    for (int r = 0; r < rows; r++) {
        rows_view vr = *v; /* row r's values: the first ns[r] (a chain's run, or the one row's view) */
        vr.n1 = ns[r] - v->n2;
        const float *e = s + (int64_t)r * group * stride;
        for (int b = 0; b < group; b += GROUP_BLOCK) {
            const int heads = group - b < GROUP_BLOCK ? group - b : GROUP_BLOCK;
            float z[GROUP_BLOCK];
            float *outs[GROUP_BLOCK];
            for (int x = 0; x < heads; x++) {
                const float *ex = e + (int64_t)(b + x) * stride;
                z[x] = softmax_avx512((float *)ex, ns[r], m[r * group + b + x]);
                outs[x] = job->out + (int64_t)(i0 + r) * job->out_row + (int64_t)(g * group + b + x) * job->out_head;
            }
            const float *eb = e + (int64_t)b * stride;
            int c = 0;
            for (; c + 64 <= d; c += 64) {
                switch (heads) {
                case 6: weighted64_x6(eb, stride, &vr, c, z, outs); break;
                case 5: weighted64_x5(eb, stride, &vr, c, z, outs); break;
                case 4: weighted64_x4(eb, stride, &vr, c, z, outs); break;
                case 3: weighted64_x3(eb, stride, &vr, c, z, outs); break;
                case 2: weighted64_x2(eb, stride, &vr, c, z, outs); break;
                default: weighted64_x1(eb, stride, &vr, c, z, outs); break;
                }
            }
            for (; c < d; c += LANES)
                for (int x = 0; x < heads; x++) weighted16(eb + (int64_t)x * stride, &vr, c, z[x], outs[x]);
        }
    }
}

static int best_isa(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma"))
            cached = ATT_AVX512;
        else
            cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? ATT_AVX2 : ATT_C;
        cached = SD_CAP(cached);
    }
    return cached;
}
#else
static int best_isa(void) { return ATT_C; }
#endif

/* ------------------------------------------------------------------ one (row, head) */

/* The keys and values query row i sees in the kv head at offset kvh of job->k / job->v (the cached positions
 * [lo, cut), then in tree mode the new rows tail[0 .. n2)); returns how many. */
static int visible(const sd_attention_params *job, int i, int64_t kvh, rows_view *k, rows_view *v) {
    const int *tail = NULL;
    int end, cut, n2 = 0;
    if (job->tree_at) {
        const int first = job->tree_at[i], count = job->tree_at[i + 1] - first; /* ancestors and itself */
        end = job->start + count; /* one past the row's position, start + depth */
        cut = job->start;
        tail = job->tree_rows + first;
        n2 = count;
    } else {
        end = cut = job->start + i + 1;
    }
    const int lo = job->window > 0 && end > job->window ? end - job->window : 0;
    if (lo > cut) { /* the window starts among the ancestors */
        tail += lo - cut;
        n2 -= lo - cut;
        cut = lo;
    }
    const int64_t new_rows = (int64_t)job->start * job->kv_row;
    *k = (rows_view){job->k + kvh + (int64_t)lo * job->kv_row, job->k + kvh + new_rows, tail, cut - lo, n2, job->kv_row};
    *v = (rows_view){job->v + kvh + (int64_t)lo * job->kv_row, job->v + kvh + new_rows, tail, cut - lo, n2, job->kv_row};
    return cut - lo + n2;
}

/* Query row i, head h of the job; s: room for start + n scores.  The vector paths need d % 16 == 0
 * (sd_attention takes the C path otherwise: the same numbers). */
static void attend(const sd_attention_params *job, int i, int h, float *s) {
    rows_view k, v;
    const int n = visible(job, i, (int64_t)(h / (job->heads / job->kv_heads)) * job->kv_head, &k, &v), d = job->d;
    const float *q = job->q + (int64_t)h * job->q_head + (int64_t)i * job->q_row;
    float *out = job->out + (int64_t)i * job->out_row + (int64_t)h * job->out_head;
    float m = -INFINITY;
/* The three steps of the top of the file, on one path's functions (dot_P, softmax_P, weighted_P). */
#define ATTEND_ON(P)                                                                                \
    do {                                                                                            \
        for (int j = 0; j < n; j++) {                                                               \
            s[j] = dot_##P(q, row_of(&k, j), d) * job->scale;                                       \
            if (job->softcap > 0) s[j] = job->softcap * tanhf(s[j] / job->softcap);                 \
            m = s[j] > m ? s[j] : m;                                                                \
        }                                                                                           \
        weighted_##P(s, &v, d, softmax_##P(s, n, m), out);                                          \
    } while (0)
#ifdef SD_X86
    if (job->isa == ATT_AVX2) { /* (the AVX-512 path takes a kv head's heads together: attend_kv_rows) */
        ATTEND_ON(avx2);
        return;
    }
#endif
    ATTEND_ON(c);
#undef ATTEND_ON
}

#ifdef SD_X86
/* Query rows i0 .. i0 + rows - 1 (rows > 1: a chain without a window), every head of kv head g (the AVX-512
 * path); s: room for rows * (heads / kv_heads) * stride scores, stride >= start + n. */
static void attend_kv_rows(const sd_attention_params *job, int i0, int rows, int g, float *s, int stride) {
    rows_view k, v;
    int ns[ROWS_MAX];
    ns[0] = visible(job, i0, (int64_t)g * job->kv_head, &k, &v);
    for (int r = 1; r < rows; r++) ns[r] = ns[0] + r; /* row i0 + r sees the same run, r keys longer */
    k.n1 = v.n1 = ns[rows - 1] - k.n2;
    attend_rows_avx512(job, i0, rows, g, &k, &v, ns, stride, s);
}
#endif

/* out[i, h, :] = attention of query row i (position start + i, or start + its depth in tree mode), head h (see
 * sd_attention_params and the top of the file).  Rows and heads are shared among up to p->threads threads (which thread computes one changes no
 * number).  p->isa: 0 for the best path, else at most that path (the tests compare them).  Returns 0, or -1
 * when out of memory. */
int sd_attention(const sd_attention_params *p) {
    sd_attention_params job = *p;
    if (job.isa <= 0 || job.isa > best_isa()) job.isa = best_isa();
    if (job.d % LANES) job.isa = ATT_C;
    /* A task: one (row, head), or on the AVX-512 path a block of rows (a chain's, without a window: up to
     * ROWS_MAX; else one row) with every query head of one kv head */
    const int n = job.n, group = job.heads / job.kv_heads;
    if (job.isa == ATT_AVX512 && group > 64) job.isa = ATT_AVX2; /* the AVX-512 task's 64 query vectors at most */
    /* capped scores: the per-row path (AVX2's dot products are AVX-512's, lane for lane: the same bits) */
    if (job.isa == ATT_AVX512 && job.softcap > 0) job.isa = ATT_AVX2;
    const int grouped = job.isa == ATT_AVX512;
    int block = grouped && !job.tree_at && job.window <= 0 ? 64 / group : 1;
    block = block < ROWS_MAX ? block : ROWS_MAX;
    const int blocks = (n + block - 1) / block, tasks = grouped ? blocks * job.kv_heads : n * job.heads;
    const int stride = job.start + n; /* a query vector's scores at most */
    const size_t room = (size_t)stride * (grouped ? (size_t)block * group : 1);
    int threads = job.threads;
    if (threads < 1 || tasks < 2) threads = 1;
    if (threads > tasks) threads = tasks;
    float *scores = malloc(sizeof(float) * room * (size_t)threads);
    if (!scores) return -1;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int t = 0; t < tasks; t++) {
        float *s = scores + room * omp_get_thread_num();
#else
    for (int t = 0; t < tasks; t++) {
        float *s = scores;
#endif
#ifdef SD_X86
        if (grouped) {
            const int i0 = t / job.kv_heads * block, rows = n - i0 < block ? n - i0 : block;
            attend_kv_rows(&job, i0, rows, t % job.kv_heads, s, stride);
            continue;
        }
#endif
        attend(&job, t / job.heads, t % job.heads, s);
    }
    free(scores);
    return 0;
}

/* Which path sd_attention takes here: ATT_AVX512 (3), ATT_AVX2 (2) or ATT_C (1, portable). */
int sd_attention_isa(void) { return best_isa(); }
