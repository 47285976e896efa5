/* specdec's int4 linear for draft models on the CPU: y = x W^T (+ b) with 4-bit weights in groups of 64
 * columns, each group with its own fp32 scale, and the int8 kernel's per-token 7-bit activations.
 *
 * Why: a draft model's one-token step reads every weight once and is bound by memory bandwidth; half the
 * bytes of int8 make it nearly twice as fast, and a draft's numbers never change the output of
 * speculative decoding (verification decides), only how many of its tokens are accepted.  Group-wise
 * 4-bit weights as in GPTQ / llama.cpp's Q4_0 (Frantar et al. 2022); the integer dot products as in the
 * int8 kernel (int8_linear.c).
 *
 * Numbers, for output channel n and input row x (q, s: x quantized by sd_activations in int8_linear.c):
 *   W[n, 64 g + c] ~ v[n, g, c] * ws[n, g], v in [-7, 7];
 *   acc[g] = sum_c q[64 g + c] v[n, g, c] in int32 (exact), taken as 8 partial sums (lane l: columns
 *   4l..4l+3 and 32+4l..32+4l+3 of the group);
 *   lane_l = fma(acc[g]_l, ws[n, g], lane_l) over g in order, from 0 (fp32);
 *   y = ((lane_0 + lane_4) + (lane_2 + lane_6)) + ((lane_1 + lane_5) + (lane_3 + lane_7)), times s (+ b).
 * The AVX2 path and the portable C path compute exactly these numbers (the same bits; tested: the AVX2 path
 * gets each lane's exact int32 sum another way, see lane_offsets), and every output element depends on its
 * own input row and weight row only (batch-invariant, like int8).
 *
 * Layout: tiles of TILE4 = 4 output channels (rows); per tile, per group g, per row r: 32 bytes, byte b
 * holding v[., g, b] + 8 in its low nibble and v[., g, 32 + b] + 8 in its high nibble; offset
 * ((tile * G + g) * 4 + r) * 32, G = kp / 64.  Scales: ws4[(tile * G + g) * 4 + r].  Padding rows and
 * columns hold v = 0 (nibble 8) and scale 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SD4_X86 1
#endif

#define TILE4 4
#define GROUP 64
enum { ISA4_C = 1, ISA4_AVX2 = 2 }; /* activation paths of int8_linear.c: ISA_C = 1, ISA_AVX2 = 2 */

void *sd_activations(const float *x, int64_t ldx, int m, int k, int kp, int isa, int8_t **q, uint8_t **qabs,
                     float **xs, int32_t **qsum); /* int8_linear.c */

static inline float tree8(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* ------------------------------------------------------------------ portable path */

static void tiles4_c(const uint8_t *w, const float *ws, const float *bias, int n, int t0, int t1, int kp,
                     const int8_t *q, const float *xs, int m, float *y, int64_t ldy) {
    const int groups = kp / GROUP;
    for (int t = t0; t < t1; t++) {
        for (int r = 0; r < TILE4 && t * TILE4 + r < n; r++) {
            const int col = t * TILE4 + r;
            for (int i = 0; i < m; i++) {
                const int8_t *qi = q + (int64_t)i * kp;
                float lanes[8] = {0};
                for (int g = 0; g < groups; g++) {
                    const uint8_t *wg = w + (((int64_t)t * groups + g) * TILE4 + r) * 32;
                    const float scale = ws[((int64_t)t * groups + g) * TILE4 + r];
                    for (int l = 0; l < 8; l++) {
                        int32_t acc = 0;
                        for (int b = 4 * l; b < 4 * l + 4; b++) {
                            acc += (int32_t)qi[g * GROUP + b] * ((wg[b] & 15) - 8);
                            acc += (int32_t)qi[g * GROUP + 32 + b] * ((wg[b] >> 4) - 8);
                        }
                        lanes[l] = fmaf((float)acc, scale, lanes[l]);
                    }
                }
                float v = tree8(lanes) * xs[i];
                y[(int64_t)i * ldy + col] = bias ? v + bias[col] : v;
            }
        }
    }
}

/* ------------------------------------------------------------------ AVX2 path */

#ifdef SD4_X86
#define AVX2F __attribute__((target("avx2,fma")))

AVX2F static inline float hsum8(__m256 v) {
    float a[8];
    _mm256_storeu_ps(a, v);
    return tree8(a);
}

/* The lane sums, for the whole batch at once: the stored nibbles u = v + 8 in [0, 15] go into vpmaddubsw as they
 * are, against the signed activations q, and each lane then takes off 8 times the sum of its activations
 * (lane_offsets, once per call): sum u q - 8 sum q = sum v q, exact in int32 (|u q| pairs <= 1890, both halves
 * <= 3780: no s16 saturation).  A tile's group is unpacked once for two input rows.  Against the sign trick
 * (vpsign of the weights by q, times |q|), this takes fewer instructions per product: measured on a 2-core AMD
 * EPYC (Zen 3) through the 0.5B's four layer shapes, 1.24x faster for 64 rows (a draft's catch-up) and 1.18x
 * for one (a drafted token; benchmarks/runs/kernel-int4v2-zen3/ab_int4_kernel.py). */
AVX2F static void lane_offsets(const int8_t *q, int m, int kp, int32_t *off) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    const int groups = kp / GROUP;
    for (int i = 0; i < m; i++)
        for (int g = 0; g < groups; g++) {
            const int8_t *qg = q + (int64_t)i * kp + (int64_t)g * GROUP;
            const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(ones8, _mm256_loadu_si256((const __m256i *)qg)),
                                                 _mm256_maddubs_epi16(ones8, _mm256_loadu_si256((const __m256i *)(qg + 32))));
            _mm256_storeu_si256((__m256i *)(off + ((int64_t)i * groups + g) * 8),
                                _mm256_slli_epi32(_mm256_madd_epi16(s16, ones16), 3));
        }
}

/* One tile x T input rows i .. i + T - 1; off: lane_offsets of q, [m][groups][8]. */
#define TILE4_X(T)                                                                                   \
    AVX2F static inline void tile4_x##T(const uint8_t *tile, const float *ws, const float *bias, int col, \
                                        int n, int groups, int kp, const int8_t *q, const int32_t *off, \
                                        const float *xs, int i, float *y, int64_t ldy) {             \
        const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);                       \
        __m256 acc[TILE4][T];                                                                        \
        for (int r = 0; r < TILE4; r++)                                                              \
            for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();                             \
        for (int g = 0; g < groups; g++) {                                                           \
            const uint8_t *wg = tile + (int64_t)g * TILE4 * 32;                                      \
            const float *sg = ws + (int64_t)g * TILE4;                                               \
            _mm_prefetch((const char *)wg + 1024, _MM_HINT_T0);                                      \
            _mm_prefetch((const char *)wg + 1024 + 64, _MM_HINT_T0);                                 \
            for (int r = 0; r < TILE4; r++) {                                                        \
                const __m256i b = _mm256_loadu_si256((const __m256i *)(wg + 32 * r));                \
                const __m256i u0 = _mm256_and_si256(b, low);                                         \
                const __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);                   \
                const __m256 scale = _mm256_set1_ps(sg[r]);                                          \
                for (int t = 0; t < T; t++) {                                                        \
                    const int8_t *qt = q + (int64_t)(i + t) * kp + (int64_t)g * GROUP;               \
                    const __m256i s16 = _mm256_add_epi16(                                            \
                        _mm256_maddubs_epi16(u0, _mm256_loadu_si256((const __m256i *)qt)),           \
                        _mm256_maddubs_epi16(u1, _mm256_loadu_si256((const __m256i *)(qt + 32))));   \
                    const __m256i sum = _mm256_sub_epi32(                                            \
                        _mm256_madd_epi16(s16, ones),                                                \
                        _mm256_loadu_si256((const __m256i *)(off + ((int64_t)(i + t) * groups + g) * 8))); \
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r][t]);          \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int t = 0; t < T; t++)                                                                  \
            for (int r = 0; r < TILE4 && col + r < n; r++) {                                         \
                const float v = hsum8(acc[r][t]) * xs[i + t];                                        \
                y[(int64_t)(i + t) * ldy + col + r] = bias ? v + bias[col + r] : v;                  \
            }                                                                                        \
    }

TILE4_X(1)
TILE4_X(2)

AVX2F static void tiles4_avx2(const uint8_t *w, const float *ws, const float *bias, int n, int t0, int t1, int kp,
                              const int8_t *q, const int32_t *off, const float *xs, int m, float *y, int64_t ldy) {
    const int groups = kp / GROUP;
    for (int t = t0; t < t1; t++) {
        const uint8_t *tile = w + (int64_t)t * groups * TILE4 * 32;
        const float *wst = ws + (int64_t)t * groups * TILE4;
        int col = t * TILE4, i = 0;
        for (; i + 2 <= m; i += 2) tile4_x2(tile, wst, bias, col, n, groups, kp, q, off, xs, i, y, ldy);
        if (i < m) tile4_x1(tile, wst, bias, col, n, groups, kp, q, off, xs, i, y, ldy);
    }
}

static int best_isa4(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? ISA4_AVX2 : ISA4_C;
    }
    return cached;
}
#else
static int best_isa4(void) { return ISA4_C; }
#endif

/* ------------------------------------------------------------------ entry points */

/* The packed buffers of an n x kp layer, cleared to v = 0 (nibble 8) and scale 0. */
static void clear_packed(int n, int kp, uint8_t *out, float *out_scales) {
    const int tiles = (n + TILE4 - 1) / TILE4;
    memset(out, 0x88, (size_t)tiles * TILE4 * kp / 2);
    memset(out_scales, 0, sizeof(float) * (size_t)tiles * TILE4 * (kp / GROUP));
}

/* Row r of tile t, group g: where its 32 bytes start. */
static inline uint8_t *group_bytes(uint8_t *out, int t, int groups, int g, int r) {
    return out + (((int64_t)t * groups + g) * TILE4 + r) * 32;
}

/* Column c (0..63) of a group gets value v (in [-7, 7]): low nibbles for columns 0..31, high for 32..63. */
static inline void put_nibble(uint8_t *dst, int c, int v) {
    const uint8_t nib = (uint8_t)(v + 8);
    if (c < 32) dst[c] = (uint8_t)((dst[c] & 0xf0) | nib);
    else dst[c - 32] = (uint8_t)((dst[c - 32] & 0x0f) | (nib << 4));
}

/* Pack v [n, k] (int8 values in [-7, 7], row-major) and scales [n, ceil(k / 64)] (fp32, row-major) into the
 * layout above: out holds ceil(n / 4) * 4 * kp / 2 bytes, out_scales ceil(n / 4) * 4 * kp / 64 floats. */
void sd_pack4(const int8_t *v, const float *scales, int n, int k, int kp, uint8_t *out, float *out_scales) {
    const int groups = kp / GROUP, kg = (k + GROUP - 1) / GROUP;
    clear_packed(n, kp, out, out_scales);
    for (int row = 0; row < n; row++) {
        const int t = row / TILE4, r = row % TILE4;
        for (int g = 0; g < kg; g++) {
            uint8_t *dst = group_bytes(out, t, groups, g, r);
            for (int c = 0; c < GROUP && g * GROUP + c < k; c++) put_nibble(dst, c, v[(int64_t)row * k + g * GROUP + c]);
            out_scales[((int64_t)t * groups + g) * TILE4 + r] = scales[(int64_t)row * kg + g];
        }
    }
}

/* Quantize an int8 layer's weights to int4 and pack them as sd_pack4 does, in one pass: row n's weights are
 * w = (float)v8[n, :] * row_scale[n]; per group of 64 columns scale = max(max |w| / 7, 1e-12) and
 * v = round_half_even(w / scale) clamped to [-7, 7] -- the same IEEE operations as
 * specdec.backends.int4.quantize_int4 on those weights, hence the same values and scales.  Rows are
 * shared among up to `threads` threads. */
void sd_pack4_int8(const int8_t *v8, const float *row_scale, int n, int k, int kp, uint8_t *out, float *out_scales,
                   int threads) {
    const int groups = kp / GROUP;
    clear_packed(n, kp, out, out_scales);
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) if (threads > 1)
#endif
    for (int row = 0; row < n; row++) {
        const int t = row / TILE4, r = row % TILE4;
        for (int g = 0; g < groups && g * GROUP < k; g++) {
            float w[GROUP], amax = 0.0f;
            const int width = k - g * GROUP < GROUP ? k - g * GROUP : GROUP;
            for (int c = 0; c < width; c++) {
                w[c] = (float)v8[(int64_t)row * k + g * GROUP + c] * row_scale[row];
                amax = fabsf(w[c]) > amax ? fabsf(w[c]) : amax;
            }
            float scale = amax / 7.0f;
            scale = scale < 1e-12f ? 1e-12f : scale;
            uint8_t *dst = group_bytes(out, t, groups, g, r);
            for (int c = 0; c < width; c++) {
                float v = nearbyintf(w[c] / scale);
                put_nibble(dst, c, (int)(v > 7.0f ? 7.0f : (v < -7.0f ? -7.0f : v)));
            }
            out_scales[((int64_t)t * groups + g) * TILE4 + r] = scale;
        }
    }
}

/* y [m, ldy] = x [m, ldx] W^T (+ bias), W packed by sd_pack4; on up to `threads` threads.  isa: 0 for the
 * best path, else at most that path (1: C, 2: AVX2; the same bits).  Returns 0, or -1 when out of memory. */
int sd_linear4(const uint8_t *w, const float *ws, const float *bias, int n, int k, int kp, const float *x,
               int64_t ldx, int m, float *y, int64_t ldy, int threads, int isa) {
    if (isa <= 0 || isa > best_isa4()) isa = best_isa4();
    int8_t *q;
    uint8_t *qabs;
    float *xs;
    int32_t *qsum;
    void *block = sd_activations(x, ldx, m, k, kp, isa, &q, &qabs, &xs, &qsum);
    if (!block) return -1;
    int32_t *off = NULL; /* the AVX2 path's lane offsets, [m][kp / 64][8] */
#ifdef SD4_X86
    if (isa == ISA4_AVX2) {
        off = aligned_alloc(32, sizeof(int32_t) * 8 * (size_t)m * (kp / GROUP));
        if (!off) {
            free(block);
            return -1;
        }
        lane_offsets(q, m, kp, off);
    }
#endif
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
            tiles4_avx2(w, ws, bias, n, t0, t1, kp, q, off, xs, m, y, ldy);
            continue;
        }
#endif
        tiles4_c(w, ws, bias, n, t0, t1, kp, q, xs, m, y, ldy);
    }
    free(off);
    free(block);
    return 0;
}

/* Which path sd_linear4 takes here: 2 (AVX2) or 1 (portable C). */
int sd_isa4(void) { return best_isa4(); }
