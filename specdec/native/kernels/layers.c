/* A model's decoder layers in one call: llama / qwen2 / mistral layers (pre-norm, rotary attention with grouped
 * KV heads, SiLU-gated MLP) and Gemma 3 ones (the same, plus per-head q / k norms, norms on the attention's and
 * the MLP's outputs, a tanh-GELU gate and a rotary table per layer type) over the new tokens of one or more
 * sequences, each with its own KV cache (specdec.native.lean): an int4 draft's (its linears on int4_linear.c)
 * and the gguf target's (on gguf_linear.c, the GGUF file's own blocks; specdec.native.gguf).
 *
 * Why: a draft token of the 0.5B int4 draft spent about a third of its time between the matrix kernels --
 * some 35 torch operations and five ctypes calls per layer, each a few microseconds of dispatch -- and
 * smollm2-135m more than half (measured on a 2-core AMD EPYC, Zen 3).  Here the work between the kernels
 * is a few plain loops per row.  The matrix products and the attention are the linear and attention kernels'
 * (int4_linear.c or gguf_linear.c, attention.c); the norms, the rotary embedding and the activation are
 * computed here, per row, in fp32, each in one fixed order of operations.  Like the kernels, a row's numbers
 * depend on its own tokens only, not on the other rows, their number or the threads: with the GGUF kernel
 * (batch-invariant, exact integer sums) a token's logits are the same bits alone and inside any forward, so
 * the gguf target's speculative output is exactly its plain output.  An int4 draft's numbers differ from the
 * transformers model's in the last bits (fp32 sums in another order), which a draft's may (what a draft
 * proposes never changes the output of speculative decoding, Leviathan et al. 2023).
 *
 * Token trees (rows->trees): a sequence's new rows are a tree's nodes, each attending to the cache and its
 * ancestors (attention.c's tree mode; the rotary tables already give each row its depth's position).
 * Taps (rows->taps): a layer's output rows are copied out (a fused-feature draft head's input).
 *
 * Per layer, x [total, hidden] (the rows of all sequences, one after another; [opt] where the layer has it):
 *   h = rms_norm(x) * w_in;  qkv = h Wqkv^T + b;  [each q head rms_norm * w_q, each k head * w_k];
 *   q, k rotated (rotate-half form, cos / sin of the row's position, from the layer's table);  k, v written
 *   into the sequence's cache;  a = attention(q, cache) Wo^T;  [a = rms_norm(a) * w_attn_out];  x += a;
 *   h = rms_norm(x) * w_post;  [g | u] = h Wgu^T;  m = (act(g) * u) Wdown^T;  [m = rms_norm(m) * w_mlp_out];
 *   x += m.  (Gemma's norms scale by 1 + w: lean passes that sum as the weight.  Gemma 2's attention scores are
 *   soft-capped where model->softcap > 0: attention.c.)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specdec_kernels.h"

static inline int padded64(int k) { return (k + 63) / 64 * 64; }

/* out[i] = w * (x[i] * r), r = 1 / sqrt(mean + eps), for each of m rows (out may be x).  As llama.cpp's rms_norm:
 * the squares in fp32, their sum in double (here 8 partial sums in a fixed order), mean = fp32(sum / hidden): its
 * mean is llama.cpp's but where the double sums' order shows after the rounding to fp32 (fp32 sums moved it by an
 * ulp often enough to flip a quantised activation of a synthetic model now and then). */
void sd_rms_norm(const float *x, int m, int hidden, const float *w, float eps, float *out) {
    for (int i = 0; i < m; i++) {
        const float *xi = x + (int64_t)i * hidden;
        float *oi = out + (int64_t)i * hidden;
        double part[8] = {0};
        int j = 0;
        for (; j + 8 <= hidden; j += 8)
            for (int l = 0; l < 8; l++) part[l] += (double)(xi[j + l] * xi[j + l]);
        for (; j < hidden; j++) part[0] += (double)(xi[j] * xi[j]);
        const double sum = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
        const float mean = (float)(sum / (double)hidden);
        const float r = 1.0f / sqrtf(mean + eps);
        for (j = 0; j < hidden; j++) oi[j] = w[j] * (xi[j] * r);
    }
}

/* Rows of a forward on several threads from this many (the work a row is a few microseconds: fewer are not worth
 * waking the other threads for). */
#define ROWS_PARALLEL 4

/* Per row i of x [total, hidden]: x[i] += add[i] (add NULL: nothing), then out[i] = rms_norm(x[i]) * w (w NULL: no
 * norm), each row in one fixed order of operations, whichever thread computes it (out may be x). */
static void add_norm_rows(float *x, const float *add, int total, int hidden, const float *w, float eps, float *out,
                          int threads) {
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && total >= ROWS_PARALLEL)
#endif
    for (int i = 0; i < total; i++) {
        float *row = x + (int64_t)i * hidden;
        if (add)
            for (int j = 0; j < hidden; j++) row[j] += add[(int64_t)i * hidden + j];
        if (w) sd_rms_norm(row, 1, hidden, w, eps, out + (int64_t)i * hidden);
    }
}

/* Rotate `count` heads of d values each at v (contiguous): v = v cos + rotate_half(v) sin, with
 * rotate_half(v) = [-v[d/2:], v[:d/2]]. */
static void rotate_heads(float *v, int count, int d, const float *cos, const float *sin, float *tmp) {
    const int half = d / 2;
    for (int h = 0; h < count; h++, v += d) {
        memcpy(tmp, v, sizeof(float) * (size_t)d);
        for (int c = 0; c < half; c++) v[c] = tmp[c] * cos[c] - tmp[c + half] * sin[c];
        for (int c = half; c < d; c++) v[c] = tmp[c] * cos[c] + tmp[c - half] * sin[c];
    }
}

/* llama.cpp's rotary table (ggml's rope cache) for `count` positions: per position p, theta_0 = p and theta_{j+1} =
 * theta_j * s in fp32, s = powf(base, -2 / dims); angle_j = scale * (theta_j / factors[j]) (factors NULL: theta_j);
 * cos / sin [count, 2 half] = cosf / sinf(angle_j) at j and j + half (half = dims / 2).  llama.cpp's float
 * operations, so that a GGUF file rotates as llama.cpp rotates it: on a synthetic llama file, with llama.cpp's tables
 * a rotated q is llama.cpp's to an ulp (a quarter of the values: llama.cpp's build fuses x0 cos - x1 sin into one
 * fma), where tables built from base^(-2j/d) moved 41% of the values, by up to 1e-6 of them -- enough to flip a
 * quantised activation downstream now and then. */
void sd_rope_table(const int64_t *positions, int count, int dims, float base, float scale, const float *factors,
                   float *cos_out, float *sin_out) {
    const int half = dims / 2;
    const float s = powf(base, -2.0f / (float)dims);
    for (int i = 0; i < count; i++) {
        float theta = (float)positions[i];
        float *c = cos_out + (int64_t)i * 2 * half, *sn = sin_out + (int64_t)i * 2 * half;
        for (int j = 0; j < half; j++) {
            const float angle = scale * (factors ? theta / factors[j] : theta);
            c[j] = c[j + half] = cosf(angle);
            sn[j] = sn[j + half] = sinf(angle);
            theta *= s;
        }
    }
}

/* SiLU(g) * u = g / (1 + e^-g) * u, with e^x = 2^n p(r) computed from plain multiplies and adds (no library
 * call, no fused multiply-add): n = round(x log2 e) by the 1.5 * 2^23 trick, r = x - n ln2 in two parts, p the
 * degree-7 Taylor polynomial, 2^n from its exponent bits; x clamped to [-87, 88].  The same operations in the
 * same order on every lane of the AVX-512 and AVX2 paths and in the C loop: the same bits on every path. */
#define SILU_OPS(V, SPLAT, ADD, SUB, MUL, DIV, MIN, MAX, POW2)                                                 \
    do {                                                                                                      \
        const V x = MIN(MAX(SUB(SPLAT(0.0f), g), SPLAT(-87.0f)), SPLAT(88.0f));                               \
        const V n = SUB(ADD(MUL(x, SPLAT(1.44269504088896341f)), SPLAT(12582912.0f)), SPLAT(12582912.0f));     \
        const V r = SUB(SUB(x, MUL(n, SPLAT(0.693359375f))), MUL(n, SPLAT(-2.12194440e-4f)));                  \
        V p = SPLAT(1.0f / 5040);                                                                             \
        p = ADD(MUL(p, r), SPLAT(1.0f / 720));                                                                \
        p = ADD(MUL(p, r), SPLAT(1.0f / 120));                                                                \
        p = ADD(MUL(p, r), SPLAT(1.0f / 24));                                                                 \
        p = ADD(MUL(p, r), SPLAT(1.0f / 6));                                                                  \
        p = ADD(MUL(p, r), SPLAT(0.5f));                                                                      \
        p = ADD(MUL(p, r), SPLAT(1.0f));                                                                      \
        p = ADD(MUL(p, r), SPLAT(1.0f));                                                                      \
        const V e = MUL(p, POW2(n));                                                                          \
        out = MUL(DIV(g, ADD(SPLAT(1.0f), e)), u);                                                            \
    } while (0)

static inline float c_splat(float v) { return v; }
static inline float c_add(float a, float b) { return a + b; }
static inline float c_sub(float a, float b) { return a - b; }
static inline float c_mul(float a, float b) { return a * b; }
static inline float c_div(float a, float b) { return a / b; }
static inline float c_min(float a, float b) { return a < b ? a : b; }
static inline float c_max(float a, float b) { return a > b ? a : b; }
static inline float c_pow2(float n) {
    const int32_t bits = ((int32_t)n + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void silu_mul_c(float *gate, const float *up, int n) {
    for (int j = 0; j < n; j++) {
        const float g = gate[j], u = up[j];
        float out;
        SILU_OPS(float, c_splat, c_add, c_sub, c_mul, c_div, c_min, c_max, c_pow2);
        gate[j] = out;
    }
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define AVX512L __attribute__((target("avx512f")))
#define AVX2L __attribute__((target("avx2")))
AVX512L static inline __m512 z_pow2(__m512 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
}
AVX512L static void silu_mul_avx512(float *gate, const float *up, int n) {
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 g = _mm512_loadu_ps(gate + j), u = _mm512_loadu_ps(up + j);
        __m512 out;
        SILU_OPS(__m512, _mm512_set1_ps, _mm512_add_ps, _mm512_sub_ps, _mm512_mul_ps, _mm512_div_ps, _mm512_min_ps,
                 _mm512_max_ps, z_pow2);
        _mm512_storeu_ps(gate + j, out);
    }
    silu_mul_c(gate + j, up + j, n - j);
}
AVX2L static inline __m256 y_pow2(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
}
AVX2L static void silu_mul_avx2(float *gate, const float *up, int n) {
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 g = _mm256_loadu_ps(gate + j), u = _mm256_loadu_ps(up + j);
        __m256 out;
        SILU_OPS(__m256, _mm256_set1_ps, _mm256_add_ps, _mm256_sub_ps, _mm256_mul_ps, _mm256_div_ps, _mm256_min_ps,
                 _mm256_max_ps, y_pow2);
        _mm256_storeu_ps(gate + j, out);
    }
    silu_mul_c(gate + j, up + j, n - j);
}
#endif

/* min / max: vminps returns its second operand when either is NaN, c_min / c_max likewise (a < b false):
 * a NaN g stays NaN through g / (1 + e) either way. */
static void silu_mul(float *gate, const float *up, int n, int path) {
#if defined(__x86_64__) || defined(__i386__)
    static int best = -1;
    if (best < 0) {
        __builtin_cpu_init();
        best = SD_CAP(__builtin_cpu_supports("avx512f") ? 3 : __builtin_cpu_supports("avx2") ? 2 : 1);
    }
    path = path <= 0 || path > best ? best : path; /* 1: C, 2: AVX2, 3: AVX-512 (the model's isa) */
    if (path == 3) return silu_mul_avx512(gate, up, n);
    if (path == 2) return silu_mul_avx2(gate, up, n);
#endif
    (void)path;
    silu_mul_c(gate, up, n);
}

/* v rounded to fp16's precision and back (nearest even; fp16's subnormals under 2^-14), for |v| < 65504: as
 * gguf_linear.c's half_round. */
static float half_precision(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    if ((bits & 0x7fffffffu) < 0x38800000u) return nearbyintf(v * 16777216.0f) * (1.0f / 16777216.0f);
    bits = (bits + 0xfffu + ((bits >> 13) & 1u)) & ~0x1fffu;
    float r;
    memcpy(&r, &bits, 4);
    return r;
}

/* llama.cpp's tanh-GELU of a GGUF file (ACT_GELU_FP16: ggml's geglu reads a table of fp16 values at the gate's fp16
 * value): 0 for g <= -10, g for g >= 10, else h = fp16(g) and fp16(0.5 h (1 + tanhf(sqrt(2 / pi) h (1 + 0.044715 h
 * h)))) -- ggml's gelu of the table's entry, rounded to fp16 as the table holds it (on gemma3-270m's first layer,
 * the fp32 GELU's products were 3.6e-4 from llama.cpp's, 0.1% of them its bits; these 99.4%).  NaN stays NaN. */
static float gelu_fp16(float g) {
    if (g <= -10.0f) return 0.0f;
    if (g >= 10.0f) return g;
    const float h = half_precision(g);
    return half_precision(0.5f * h * (1.0f + tanhf(0.7978845608f * h * (1.0f + 0.044715f * h * h))));
}

/* The gate's activation times the up projection, into the gate's half of each row: gu [total, 2 I]. */
static void gate_rows(float *gu, int total, int intermediate, int act, int threads, int path) {
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && total >= ROWS_PARALLEL)
#endif
    for (int i = 0; i < total; i++) {
        float *g = gu + (int64_t)i * 2 * intermediate;
        const float *u = g + intermediate;
        if (act == ACT_GELU_TANH)  /* 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) */
            for (int j = 0; j < intermediate; j++)
                g[j] = 0.5f * g[j] * (1.0f + tanhf(0.7978845608f * (g[j] + 0.044715f * g[j] * g[j] * g[j]))) * u[j];
        else if (act == ACT_GELU_FP16)
            for (int j = 0; j < intermediate; j++) g[j] = gelu_fp16(g[j]) * u[j];
        else
            silu_mul(g, u, intermediate, path);
    }
}

/* y = x W^T (+ b) with the linear whose fields sit at t[field], t[field + 1], t[field + 2] (L_QKV_W, L_O_W,
 * L_GU_W or L_DOWN_W; see specdec_kernels.h): x [m, k] (row stride ldx), y [m, n]. */
static int linear(const sd_layers_model *model, const int64_t *t, int field, int n, int k, const float *x, int64_t ldx,
                  int m, float *y, int threads) {
    if (model->linear == LIN_GGUF) {
        const sd_gguf_params p = {.parts = (const sd_gguf_part *)(intptr_t)t[field], .nparts = (int)t[field + 1],
                                  .k = k, .x = x, .ldx = ldx, .m = m, .y = y, .ldy = n, .threads = threads,
                                  .isa = model->isa};
        return sd_gguf_linear(&p) == 0 ? 0 : -1;
    }
    const sd_linear_params p = {.w = (const void *)(intptr_t)t[field], .scales = (const void *)(intptr_t)t[field + 1],
                                .bias = (const float *)(intptr_t)t[field + 2], .n = n, .k = k, .kp = padded64(k),
                                .x = x, .ldx = ldx, .m = m, .y = y, .ldy = n, .threads = threads, .isa = model->isa};
    return sd_linear4(&p);
}

/* The layers over the rows' x [total, hidden] (updated in place: the last layer's output, before the final
 * norm); see sd_int4_model and sd_int4_rows.  Returns 0, or -1 when out of memory. */
int sd_layers(const sd_layers_model *model, const sd_layers_rows *rows) {
    float *x = rows->x;
    const int total = rows->total, threads = rows->threads;
    const int hidden = model->hidden, heads = model->heads, kv_heads = model->kv_heads, d = model->d;
    const int intermediate = model->intermediate, layers = model->layers;
    const float eps = model->eps;
    const int width = (heads + 2 * kv_heads) * d, attn_width = heads * d;
    /* the rows' buffers in one block of scratch memory: h, qkv, att, gu, tmp (with room for one head more a row) */
    const size_t sizes[5] = {(size_t)total * hidden, (size_t)total * width, (size_t)total * attn_width,
                             (size_t)total * 2 * intermediate, (size_t)total * (hidden + d)};
    size_t room = 0;
    for (int i = 0; i < 5; i++) room += (sizes[i] + 15) / 16 * 16;
    float *block = scratch_take(0, sizeof(float) * room);
    float *h = block, *qkv = h + (sizes[0] + 15) / 16 * 16, *att = qkv + (sizes[1] + 15) / 16 * 16;
    float *gu = att + (sizes[2] + 15) / 16 * 16, *tmp = gu + (sizes[3] + 15) / 16 * 16;
    int status = block ? 0 : -1;
    for (int l = 0; l < layers && status == 0; l++) {
        const int64_t *t = model->tensors + (int64_t)l * L_FIELDS;
#define PTR(type, field) ((const type *)(intptr_t)t[field])
        add_norm_rows(x, NULL, total, hidden, PTR(float, L_IN_NORM), eps, h, threads);
        status |= linear(model, t, L_QKV_W, width, hidden, h, hidden, total, qkv, threads);
        const int64_t table = t[L_ROPE] * (int64_t)total * d;
        (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && total >= ROWS_PARALLEL)
#endif
        for (int i = 0; i < total; i++) {  /* q and k heads are the first heads + kv_heads of the row */
            float *row = qkv + (int64_t)i * width;
            if (t[L_Q_NORM]) sd_rms_norm(row, heads, d, PTR(float, L_Q_NORM), eps, row);
            if (t[L_K_NORM]) sd_rms_norm(row + (int64_t)heads * d, kv_heads, d, PTR(float, L_K_NORM), eps,
                                           row + (int64_t)heads * d);
            rotate_heads(row, heads + kv_heads, d, rows->cos + table + (int64_t)i * d,
                         rows->sin + table + (int64_t)i * d, tmp + (size_t)total * hidden + (size_t)i * d);
        }
        for (int r = 0, lo = 0; r < rows->runners && status == 0; lo += rows->sizes[r], r++) {
            float *keys = (float *)(intptr_t)rows->caches[((int64_t)r * layers + l) * 2];
            float *values = (float *)(intptr_t)rows->caches[((int64_t)r * layers + l) * 2 + 1];
            const int64_t kv_head = rows->kv_head[r];
            const int start = rows->starts[r], size = rows->sizes[r];
            for (int i = 0; i < size; i++) {
                const float *row = qkv + (int64_t)(lo + i) * width;
                for (int g = 0; g < kv_heads; g++) {
                    const int64_t at = g * kv_head + (int64_t)(start + i) * d;
                    memcpy(keys + at, row + (int64_t)(heads + g) * d, sizeof(float) * (size_t)d);
                    memcpy(values + at, row + (int64_t)(heads + kv_heads + g) * d, sizeof(float) * (size_t)d);
                }
            }
            const sd_attention_params attention = {
                .q = qkv + (int64_t)lo * width, .q_head = d, .q_row = width, .k = keys, .v = values,
                .kv_head = kv_head, .kv_row = d, .out = att + (int64_t)lo * attn_width, .out_row = attn_width,
                .out_head = d, .n = size, .start = start, .heads = heads, .kv_heads = kv_heads, .d = d,
                .scale = model->scaling[l], .window = model->window[l], .threads = threads, .isa = model->isa,
                .softcap = model->softcap,
                .tree_at = rows->trees ? (const int *)(intptr_t)rows->trees[2 * r] : NULL,
                .tree_rows = rows->trees ? (const int *)(intptr_t)rows->trees[2 * r + 1] : NULL};
            status |= sd_attention(&attention);
        }
        status |= linear(model, t, L_O_W, hidden, attn_width, att, attn_width, total, tmp, threads);
        if (t[L_ATTN_OUT_NORM]) add_norm_rows(tmp, NULL, total, hidden, PTR(float, L_ATTN_OUT_NORM), eps, tmp, threads);
        add_norm_rows(x, tmp, total, hidden, PTR(float, L_POST_NORM), eps, h, threads);
        status |= linear(model, t, L_GU_W, 2 * intermediate, hidden, h, hidden, total, gu, threads);
        gate_rows(gu, total, intermediate, model->act, threads, model->isa);
        status |= linear(model, t, L_DOWN_W, hidden, intermediate, gu, 2 * intermediate, total, tmp, threads);
        if (t[L_MLP_OUT_NORM]) add_norm_rows(tmp, NULL, total, hidden, PTR(float, L_MLP_OUT_NORM), eps, tmp, threads);
        add_norm_rows(x, tmp, total, hidden, NULL, eps, NULL, threads);
        if (rows->taps && rows->taps[l]) memcpy((void *)(intptr_t)rows->taps[l], x, sizeof(float) * (size_t)total * hidden);
#undef PTR
    }
    scratch_give(0, block);
    return status ? -1 : 0;
}
