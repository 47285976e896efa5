/* specdec's int8 linear for the CPU: y = x W^T (+ b) with int8 weights and per-token 7-bit activations.
 *
 * See specdec/native/kernels/int8.py for the numerics and why they are batch-invariant.  In short:
 *   - W: int8 in [-127, 127], one fp32 scale per output channel (row of W), packed in tiles (see "layout"),
 *     rows padded with zeros to a multiple of 64 columns (kp);
 *   - each input row x is quantized on its own: s = max|x|, q = round(x * (63 / s)) in [-63, 63];
 *   - acc = sum_k q[k] * W[n, k] in int32 -- exact, so the order of the sum does not matter;
 *   - y[m, n] = ((float)acc * wscale[n]) * (s / 63) (+ bias[n]), the same expression for every element.
 * Every output element is therefore a function of its own input row and weight row only: the same
 * whatever the other rows, their number, the tiling or the threads.
 *
 * The AVX2 path multiplies with vpmaddubsw (u8 x s8 -> pairs summed in s16) on |q| and sign(q) * w:
 * a pair is at most 2 * 63 * 127 = 16002, so two of them add in s16 without saturating before vpmaddwd
 * widens to int32 (see DOT64).  On CPUs with AVX-512 VNNI (Ice Lake and later Xeons, Zen 4) the AVX-512
 * path multiplies with vpdpbusd (u8 x s8, four products summed into each int32 lane) on w + 128 (w xor
 * 0x80, unsigned) and q, then subtracts 128 * sum(q): again the exact int32 sum (see VTILE).  A portable
 * C path computes the same int32 sums (for CPUs without AVX2).  Every path gives the same bits, so the
 * path a CPU takes changes no output.  Compiled without -march flags; the AVX2 and AVX-512 functions
 * carry target attributes and are chosen at run time.  Compile with -ffp-contract=off so that no path
 * fuses the dequantization into an FMA.
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

#define TILE_N 4    /* output channels per tile */
#define QMAX 63.0f  /* activations: 7 bits, |q| <= 63 (see DOT64) */

/* ------------------------------------------------------------------ layout
 * Weights are packed in tiles of TILE_N output channels (rows), N padded with zero rows to a multiple
 * of TILE_N and K with zero columns to kp (a multiple of 64).  Within a tile the 32-column chunks of
 * its rows alternate: byte (t, c, r, b) = W[t * TILE_N + r, c * 32 + b] at ((t * kp/32 + c) * TILE_N + r) * 32 + b,
 * so each thread reads one sequential stream. */

static inline int64_t tile_offset(int64_t tile, int kp) { return tile * kp * TILE_N; }

/* ------------------------------------------------------------------ activation quantization */

/* One input row: q[:k] = round(x * QMAX / s), zero padded to kp; qabs = |q|; returns s / QMAX (0 for an
 * all-zero row, NaN when the row holds a NaN or an infinity). */
static float quantize_row_c(const float *row, int k, int kp, int8_t *q, uint8_t *qabs) {
    float amax = 0.0f;
    for (int j = 0; j < k; j++) {
        float a = fabsf(row[j]);
        if (a > amax || a != a) amax = a; /* a NaN sticks */
    }
    memset(q, 0, kp);
    memset(qabs, 0, kp);
    if (amax == 0.0f || !isfinite(amax)) return amax == 0.0f ? 0.0f : NAN;
    float inv = QMAX / amax;
    for (int j = 0; j < k; j++) {
        float v = nearbyintf(row[j] * inv); /* round half to even, as cvtps2dq */
        v = v > QMAX ? QMAX : (v < -QMAX ? -QMAX : v);
        q[j] = (int8_t)v;
        qabs[j] = (uint8_t)(q[j] < 0 ? -q[j] : q[j]);
    }
    return amax / QMAX;
}

static inline float dequant(int32_t acc, float wscale, float xscale, const float *bias, int n) {
    float y = ((float)acc * wscale) * xscale;
    return bias ? y + bias[n] : y;
}

/* ------------------------------------------------------------------ portable path */

static void gemm_tiles_c(const int8_t *w, const float *ws, const float *bias, int n, int t0, int t1, int kp,
                         const int8_t *q, const float *xs, int m, float *y, int64_t ldy) {
    for (int t = t0; t < t1; t++) {
        const int8_t *tile = w + tile_offset(t, kp);
        for (int r = 0; r < TILE_N && t * TILE_N + r < n; r++) {
            int col = t * TILE_N + r;
            for (int i = 0; i < m; i++) {
                const int8_t *qi = q + (int64_t)i * kp;
                int32_t acc = 0;
                for (int c = 0; c < kp / 32; c++) {
                    const int8_t *wc = tile + ((int64_t)c * TILE_N + r) * 32;
                    for (int b = 0; b < 32; b++) acc += (int32_t)qi[c * 32 + b] * (int32_t)wc[b];
                }
                y[(int64_t)i * ldy + col] = dequant(acc, ws[col], xs[i], bias, col);
            }
        }
    }
}

/* ------------------------------------------------------------------ AVX2 path */

#ifdef SD_X86
#define AVX2 __attribute__((target("avx2")))

AVX2 static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

AVX2 static float quantize_row_avx2(const float *row, int k, int kp, int8_t *q, uint8_t *qabs) {
    int j = 0;
    __m256 vmax = _mm256_setzero_ps();
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int nan = 0;
    for (; j + 8 <= k; j += 8) {
        __m256 a = _mm256_and_ps(_mm256_loadu_ps(row + j), absmask);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, a);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    float amax = 0.0f;
    for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
    for (; j < k; j++) {
        float a = fabsf(row[j]);
        if (a != a) nan = 1;
        amax = a > amax ? a : amax;
    }
    if (nan) amax = NAN;
    memset(q, 0, kp);
    memset(qabs, 0, kp);
    if (amax == 0.0f || !isfinite(amax)) return amax == 0.0f ? 0.0f : NAN;
    const float inv = QMAX / amax;
    const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(QMAX), lo = _mm256_set1_ps(-QMAX);
    for (j = 0; j + 32 <= k; j += 32) {
        __m256i v[4];
        for (int u = 0; u < 4; u++) {
            __m256 f = _mm256_mul_ps(_mm256_loadu_ps(row + j + 8 * u), vinv);
            f = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
            v[u] = _mm256_cvtps_epi32(f);
        }
        /* pack 32 int32 -> 32 int8 in order (packs work within 128-bit lanes: fix the order after) */
        __m256i w01 = _mm256_packs_epi32(v[0], v[1]), w23 = _mm256_packs_epi32(v[2], v[3]);
        __m256i b = _mm256_packs_epi16(w01, w23);
        b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + j), b);
        _mm256_storeu_si256((__m256i *)(qabs + j), _mm256_abs_epi8(b));
    }
    for (; j < k; j++) {
        float v = nearbyintf(row[j] * inv);
        v = v > QMAX ? QMAX : (v < -QMAX ? -QMAX : v);
        q[j] = (int8_t)v;
        qabs[j] = (uint8_t)(q[j] < 0 ? -q[j] : q[j]);
    }
    return amax / QMAX;
}

/* acc (int32 x 8) += sum over two 32-column chunks of q * w: |q| <= 63 and |w| <= 127, so each s16 lane
 * of a vpmaddubsw is at most 2 * 63 * 127 = 16002 and two of them add up without saturating. */
#define DOT64(acc, w0, w1, q0, q1, a0, a1)                                                        \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(                                                \
        _mm256_add_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(w0, q0)),                        \
                         _mm256_maddubs_epi16(a1, _mm256_sign_epi8(w1, q1))), ones))

/* Software prefetch of the weight stream: the four cache lines of one 64-column step of a tile, some
 * bytes ahead (the stream runs on through the thread's next tiles).  The distances were measured on
 * 1.5B-model shapes, 2 threads, with 1 to 8 input rows: the further ahead, the more the weight traffic
 * overlaps the multiplies of a several-row product, which is what a verification forward is.
 *   AVX2 path: into L1, 1024 bytes ahead (best on a Zen 1 EPYC).
 *   VNNI path: into L1 2048 bytes ahead and into L2 8192 bytes ahead (Xeon, family 6 model 207: the
 *   1.5B model's linears at 8 rows went from 1.54x to 1.21x the one-row time, one row about 5% faster;
 *   BENCHMARKS.md). */
#define PREFETCH_STEP(wj)                                                                         \
    do {                                                                                          \
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(wj) + 1024 + 64 * l, _MM_HINT_T0); \
    } while (0)
/* The VNNI path's prefetch is tuned per vendor (the numbers are the same either way).  Intel (Xeon): 2 KiB ahead
 * into L1 and 8 KiB into L2 (BENCHMARKS.md, Xeon component timings).  AMD (Zen 4): 4 KiB ahead into L1 only,
 * with two accumulator chains from 2 input rows on (VTILE's S).  Measured on a Zen 4 over the 1.5B's 113
 * linears out of cache, the two tunings alternated in one process: 7% less time than Intel's at 1 row, 18% at
 * 2, 16% at 3, 7% at 4 (a run of a first version: 4 / 10 / 10 / 6%, 8% at 6 rows, the same at 16, 3% less at
 * 256).  The VM's bandwidth moves from minute to minute, so only alternated builds compare. */
#define PREFETCH_VNNI_INTEL(wj)                                                                   \
    do {                                                                                          \
        for (int l = 0; l < 4; l++) {                                                             \
            _mm_prefetch((const char *)(wj) + 2048 + 64 * l, _MM_HINT_T0);                        \
            _mm_prefetch((const char *)(wj) + 8192 + 64 * l, _MM_HINT_T1);                        \
        }                                                                                         \
    } while (0)
#define PREFETCH_VNNI_AMD(wj)                                                                     \
    do {                                                                                          \
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(wj) + 4096 + 64 * l, _MM_HINT_T0); \
    } while (0)

/* One tile (TILE_N output channels) x T input rows i .. i + T - 1. */
#define TILE(T)                                                                                     \
    AVX2 static inline void tile_x##T(const int8_t *tile, const float *ws, const float *bias, int col, \
                                      int n, int kp, const int8_t *q, const uint8_t *qabs,          \
                                      const float *xs, int i, float *y, int64_t ldy) {              \
        const __m256i ones = _mm256_set1_epi16(1);                                                  \
        __m256i acc[TILE_N][T];                                                                     \
        for (int r = 0; r < TILE_N; r++)                                                            \
            for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_si256();                         \
        for (int j = 0; j < kp; j += 64) {                                                          \
            const int8_t *wj = tile + (int64_t)j * TILE_N;                                          \
            PREFETCH_STEP(wj);                                                                      \
            for (int r = 0; r < TILE_N; r++) {                                                      \
                __m256i w0 = _mm256_loadu_si256((const __m256i *)(wj + 32 * r));                    \
                __m256i w1 = _mm256_loadu_si256((const __m256i *)(wj + 32 * (TILE_N + r)));         \
                for (int t = 0; t < T; t++) {                                                       \
                    const int64_t o = (int64_t)(i + t) * kp + j;                                    \
                    __m256i q0 = _mm256_loadu_si256((const __m256i *)(q + o));                      \
                    __m256i q1 = _mm256_loadu_si256((const __m256i *)(q + o + 32));                 \
                    __m256i a0 = _mm256_loadu_si256((const __m256i *)(qabs + o));                   \
                    __m256i a1 = _mm256_loadu_si256((const __m256i *)(qabs + o + 32));              \
                    DOT64(acc[r][t], w0, w1, q0, q1, a0, a1);                                       \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < T; t++)                                                                 \
            for (int r = 0; r < TILE_N && col + r < n; r++)                                         \
                y[(int64_t)(i + t) * ldy + col + r] = dequant(hsum(acc[r][t]), ws[col + r], xs[i + t], bias, col + r); \
    }

TILE(1)
TILE(2)
TILE(3)

AVX2 static void gemm_tiles_avx2(const int8_t *w, const float *ws, const float *bias, int n, int t0, int t1,
                                 int kp, const int8_t *q, const uint8_t *qabs, const float *xs, int m, float *y,
                                 int64_t ldy) {
    for (int t = t0; t < t1; t++) {
        const int8_t *tile = w + tile_offset(t, kp);
        int col = t * TILE_N, i = 0;
        for (; i + 3 <= m; i += 3) tile_x3(tile, ws, bias, col, n, kp, q, qabs, xs, i, y, ldy);
        if (m - i == 2) tile_x2(tile, ws, bias, col, n, kp, q, qabs, xs, i, y, ldy);
        else if (m - i == 1) tile_x1(tile, ws, bias, col, n, kp, q, qabs, xs, i, y, ldy);
    }
}

/* ------------------------------------------------------------------ AVX-512 VNNI path */

#define VNNI __attribute__((target("avx2,avx512f,avx512bw,avx512vnni")))

/* One tile (TILE_N = 4 output channels) x T input rows i .. i + T - 1.  A 64-byte load of the tile's
 * stream holds two rows' 32-column chunk (see "layout"), so each zmm accumulator serves a pair of output
 * channels: lanes 0-7 the first, 8-15 the second, against the input chunk broadcast to both halves.
 * vpdpbusd wants one unsigned operand: it gets u = w + 128 (w xor 0x80, in [1, 255]) and the signed q, so
 * acc = sum u q = sum w q + 128 sum q, exact in int32 (|acc| <= kp * 255 * 63 < 2^31 for kp < 133,000),
 * and sum w q = acc - 128 * qsum[row]. */
#define VTILE(V, T, S)                                                                              \
    VNNI static inline void vtile_##V##_x##T(const int8_t *tile, const float *ws, const float *bias, int col, \
                                       int n, int kp, const int8_t *q, const int32_t *qsum,         \
                                       const float *xs, int i, float *y, int64_t ldy) {             \
        const __m512i flip = _mm512_set1_epi8((char)0x80);                                          \
        __m512i acc[S][T]; /* [S / 2 chains per pair of channels (S = 4: two, short dependencies)] */ \
        for (int p = 0; p < S; p++)                                                                 \
            for (int t = 0; t < T; t++) acc[p][t] = _mm512_setzero_si512();                         \
        for (int j = 0; j < kp; j += 64) {                                                          \
            const int8_t *wj = tile + (int64_t)j * TILE_N;                                          \
            PREFETCH_VNNI_##V(wj);                                                                  \
            /* rows (0, 1) and (2, 3) of column chunk j / 32, then of chunk j / 32 + 1 */            \
            const __m512i u0 = _mm512_xor_si512(_mm512_loadu_si512(wj), flip);                      \
            const __m512i u1 = _mm512_xor_si512(_mm512_loadu_si512(wj + 64), flip);                 \
            const __m512i u2 = _mm512_xor_si512(_mm512_loadu_si512(wj + 128), flip);                \
            const __m512i u3 = _mm512_xor_si512(_mm512_loadu_si512(wj + 192), flip);                \
            for (int t = 0; t < T; t++) {                                                           \
                const int8_t *qt = q + (int64_t)(i + t) * kp + j;                                   \
                __m512i q0 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qt));       \
                __m512i q1 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qt + 32))); \
                acc[0][t] = _mm512_dpbusd_epi32(acc[0][t], u0, q0);                                 \
                acc[1][t] = _mm512_dpbusd_epi32(acc[1][t], u1, q0);                                 \
                acc[S - 2][t] = _mm512_dpbusd_epi32(acc[S - 2][t], u2, q1);                         \
                acc[S - 1][t] = _mm512_dpbusd_epi32(acc[S - 1][t], u3, q1);                         \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < T; t++) {                                                               \
            const int32_t offset = 128 * qsum[i + t];                                               \
            if (S == 4) {                                                                           \
                acc[0][t] = _mm512_add_epi32(acc[0][t], acc[S - 2][t]);                             \
                acc[1][t] = _mm512_add_epi32(acc[1][t], acc[S - 1][t]);                             \
            }                                                                                       \
            for (int r = 0; r < TILE_N && col + r < n; r++) {                                       \
                __m512i a = acc[r / 2][t];                                                          \
                __m256i half = r % 2 ? _mm512_extracti64x4_epi64(a, 1) : _mm512_castsi512_si256(a); \
                y[(int64_t)(i + t) * ldy + col + r] =                                               \
                    dequant(hsum(half) - offset, ws[col + r], xs[i + t], bias, col + r);          \
            }                                                                                       \
        }                                                                                           \
    }

VTILE(INTEL, 1, 4)
VTILE(INTEL, 2, 4)
VTILE(INTEL, 3, 4)
VTILE(INTEL, 4, 4)
VTILE(INTEL, 5, 2)
VTILE(INTEL, 6, 2)
VTILE(INTEL, 7, 2)
VTILE(INTEL, 8, 2)
VTILE(AMD, 1, 4)
VTILE(AMD, 2, 2)
VTILE(AMD, 3, 2)
VTILE(AMD, 4, 2)
VTILE(AMD, 5, 2)
VTILE(AMD, 6, 2)
VTILE(AMD, 7, 2)
VTILE(AMD, 8, 2)

#define GEMM_VNNI(V)                                                                                        \
VNNI static void gemm_tiles_vnni_##V(const int8_t *w, const float *ws, const float *bias, int n, int t0, int t1, \
                                 int kp, const int8_t *q, const int32_t *qsum, const float *xs, int m, float *y, \
                                 int64_t ldy) {                                                             \
    /* Many rows: a group of 8 rows' activations stays in L1 while the chunk's tiles (sized for L2 by run_job) \
     * pass under it, rather than every tile reading all the rows again */                                  \
    int i0 = 0;                                                                                             \
    for (; m >= 16 && i0 + 8 <= m; i0 += 8)                                                                 \
        for (int t = t0; t < t1; t++)                                                                      \
            vtile_##V##_x8(w + tile_offset(t, kp), ws, bias, t * TILE_N, n, kp, q, qsum, xs, i0, y, ldy); \
    for (int t = t0; t < t1; t++) {                                                                         \
        const int8_t *tile = w + tile_offset(t, kp);                                                        \
        int col = t * TILE_N, i = i0;                                                                       \
        for (; i + 8 <= m; i += 8) vtile_##V##_x8(tile, ws, bias, col, n, kp, q, qsum, xs, i, y, ldy);      \
        switch (m - i) {                                                                                    \
        case 7: vtile_##V##_x7(tile, ws, bias, col, n, kp, q, qsum, xs, i, y, ldy); break;                  \
        case 6: vtile_##V##_x6(tile, ws, bias, col, n, kp, q, qsum, xs, i, y, ldy); break;                  \
        case 5: vtile_##V##_x5(tile, ws, bias, col, n, kp, q, qsum, xs, i, y, ldy); break;                  \
        case 4: vtile_##V##_x4(tile, ws, bias, col, n, kp, q, qsum, xs, i, y, ldy); break;                  \
        case 3: vtile_##V##_x3(tile, ws, bias, col, n, kp, q, qsum, xs, i, y, ldy); break;                  \
        case 2: vtile_##V##_x2(tile, ws, bias, col, n, kp, q, qsum, xs, i, y, ldy); break;                  \
        case 1: vtile_##V##_x1(tile, ws, bias, col, n, kp, q, qsum, xs, i, y, ldy); break;                  \
        default: break;                                                                                     \
        }                                                                                                   \
    }                                                                                                       \
}

GEMM_VNNI(INTEL)
GEMM_VNNI(AMD)

/* The best path this CPU runs: ISA_VNNI, ISA_AVX2 or ISA_C. */
static int best_isa(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vnni"))
            cached = ISA_VNNI;
        else
            cached = __builtin_cpu_supports("avx2") ? ISA_AVX2 : ISA_C;
        cached = SD_CAP(cached);
    }
    return cached;
}

/* Whether the CPU is AMD's: the VNNI path's tuning (see PREFETCH_VNNI_AMD). */
static int amd(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_is("amd") ? 1 : 0;
    }
    return cached;
}
#else
static int best_isa(void) { return ISA_C; }
#endif

/* ------------------------------------------------------------------ threads
 * Built with -fopenmp, the kernel runs on the OpenMP runtime that PyTorch has loaded (torch ships
 * libgomp.so.1; this library's libgomp.so.1 resolves to the same one), so its threads are torch's own
 * and the two never compete for cores.  The output channels are cut into chunks of whole tiles that the
 * threads claim dynamically.  Which thread computes a chunk never changes a number. */

typedef struct {
    const int8_t *w;
    const float *ws, *bias, *xs;
    const int8_t *q;
    const uint8_t *qabs;
    const int32_t *qsum;
    float *y;
    int64_t ldy;
    int n, kp, m;
    int isa;
} job_t;

static void run_tiles(const job_t *job, int t0, int t1) {
#ifdef SD_X86
    if (job->isa == ISA_VNNI) {
        (amd() ? gemm_tiles_vnni_AMD : gemm_tiles_vnni_INTEL)(job->w, job->ws, job->bias, job->n, t0, t1, job->kp,
                                                              job->q, job->qsum, job->xs, job->m, job->y, job->ldy);
        return;
    }
    if (job->isa == ISA_AVX2) {
        gemm_tiles_avx2(job->w, job->ws, job->bias, job->n, t0, t1, job->kp, job->q, job->qabs, job->xs, job->m,
                        job->y, job->ldy);
        return;
    }
#endif
    gemm_tiles_c(job->w, job->ws, job->bias, job->n, t0, t1, job->kp, job->q, job->xs, job->m, job->y, job->ldy);
}

static void run_job(const job_t *job, int threads) {
    int tiles = (job->n + TILE_N - 1) / TILE_N;
#ifdef _OPENMP
    if (threads > 1 && tiles >= 2 * TILE_N) {
        int chunk_tiles = tiles / (8 * threads);
        const int l2_tiles = (256 << 10) / (TILE_N * job->kp); /* many rows: a chunk's weights stay in L2 */
        if (job->m >= 16 && chunk_tiles > l2_tiles) chunk_tiles = l2_tiles;
        if (chunk_tiles < 4) chunk_tiles = 4;
        int chunks = (tiles + chunk_tiles - 1) / chunk_tiles;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int c = 0; c < chunks; c++) {
            int t1 = (c + 1) * chunk_tiles;
            run_tiles(job, c * chunk_tiles, t1 < tiles ? t1 : tiles);
        }
        return;
    }
#else
    (void)threads;
#endif
    run_tiles(job, 0, tiles);
}

/* Whether this build runs on several threads (1) or one (0: built without OpenMP). */
int sd_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------ entry points */

/* Pack W [n, k] int8 (row-major) into the tiled layout (see "layout"): ceil(n / TILE_N) * TILE_N * kp bytes,
 * kp a multiple of 64 and >= k. */
void sd_pack(const int8_t *w, int n, int k, int kp, int8_t *out) {
    int tiles = (n + TILE_N - 1) / TILE_N;
    memset(out, 0, (size_t)tiles * TILE_N * kp);
    for (int row = 0; row < n; row++) {
        int8_t *tile = out + tile_offset(row / TILE_N, kp);
        for (int j = 0; j < k; j++) tile[((int64_t)(j / 32) * TILE_N + row % TILE_N) * 32 + j % 32] = w[(int64_t)row * k + j];
    }
}

/* The quantized input rows of one call (see "activation quantization"), in one allocation: row i of x
 * (stride ldx) -> q[i * kp ..] (zero padded to kp), qabs = |q|, xs[i] = its scale s / QMAX, qsum[i] = the sum
 * of its q (the VNNI path's offset).  isa: the path's activation code (ISA_C or at least ISA_AVX2: the same
 * numbers).  Returns the block to free(), or NULL when out of memory. */
static void *sd_activations(const float *x, int64_t ldx, int m, int k, int kp, int isa, int threads, int8_t **q,
                            uint8_t **qabs, float **xs, int32_t **qsum) {
    const size_t bytes = (size_t)m * kp, rows = (size_t)(m > 0 ? m : 1);
    const size_t room = (bytes * 2 + 63) / 64 * 64 + 64 + rows * (sizeof(float) + sizeof(int32_t));
    uint8_t *block = aligned_alloc(64, (room + 63) / 64 * 64);
    if (!block) return NULL;
    *q = (int8_t *)block;
    *qabs = block + bytes;
    *xs = (float *)(block + (bytes * 2 + 63) / 64 * 64 + 64);
    *qsum = (int32_t *)(*xs + rows);
    (void)threads;
    /* rows on their own: which thread quantizes one changes nothing (a prefill's many rows, in parallel) */
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m >= 16)
#endif
    for (int i = 0; i < m; i++) {
        int8_t *qi = *q + (int64_t)i * kp;
#ifdef SD_X86
        if (isa >= ISA_AVX2)
            (*xs)[i] = quantize_row_avx2(x + (int64_t)i * ldx, k, kp, qi, *qabs + (int64_t)i * kp);
        else
#endif
            (*xs)[i] = quantize_row_c(x + (int64_t)i * ldx, k, kp, qi, *qabs + (int64_t)i * kp);
        int32_t sum = 0; /* for the AVX-512 path's offset (see VTILE) */
        for (int j = 0; j < k; j++) sum += qi[j];
        (*qsum)[i] = sum;
    }
    return block;
}

/* y = x W^T (+ bias) (see sd_linear_params); p->w packed by sd_pack, p->scales fp32 [n].  Returns 0, or -1
 * when out of memory.  p->isa: 0 for the best path this CPU runs, else at most that path (ISA_C, ISA_AVX2,
 * ISA_VNNI: the tests compare them; every path gives the same bits). */
int sd_linear(const sd_linear_params *p) {
    const int isa = p->isa <= 0 || p->isa > best_isa() ? best_isa() : p->isa;
    int8_t *q;
    uint8_t *qabs;
    float *xs;
    int32_t *qsum;
    void *block = sd_activations(p->x, p->ldx, p->m, p->k, p->kp, isa, p->threads, &q, &qabs, &xs, &qsum);
    if (!block) return -1;
    job_t job = {p->w, p->scales, p->bias, xs, q, qabs, qsum, p->y, p->ldy, p->n, p->kp, p->m, isa};
    run_job(&job, p->threads);
    free(block);
    return 0;
}

/* Which path sd_linear takes here: ISA_VNNI (3, AVX-512 VNNI), ISA_AVX2 (2) or ISA_C (1, portable). */
int sd_isa(void) { return best_isa(); }
