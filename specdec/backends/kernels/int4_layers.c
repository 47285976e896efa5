/* The decoder layers of an int4 draft model in one call: llama / qwen2 / mistral layers (pre-norm, rotary
 * attention with grouped KV heads, SiLU-gated MLP) and Gemma 3 ones (the same, plus per-head q / k norms,
 * norms on the attention's and the MLP's outputs, a tanh-GELU gate and a rotary table per layer type) over
 * the new tokens of one or more sequences, each with its own KV cache (specdec.backends.lean, int4=True).
 *
 * Why: a draft token of the 0.5B int4 draft spent about a third of its time between the matrix kernels --
 * some 35 torch operations and five ctypes calls per layer, each a few microseconds of dispatch -- and
 * smollm2-135m more than half (measured on a 2-core AMD EPYC, Zen 3).  Here the work between the kernels
 * is a few plain loops per row.  The matrix products and the attention are the int4 and attention kernels'
 * (int4_linear.c, attention.c); the norms, the rotary embedding and the activation are computed here, per
 * row, in fp32.  These are a draft model's numbers only (an int4 draft is an approximation of the model
 * anyway; what a draft proposes never changes the output of speculative decoding, Leviathan et al. 2023):
 * they differ from the transformers model's in the last bits (fp32 sums in another order), and like the
 * kernels they depend on a row's own tokens only, not on the other rows, their number or the threads.
 *
 * Per layer, x [total, hidden] (the rows of all sequences, one after another; [opt] where the layer has it):
 *   h = rms_norm(x) * w_in;  qkv = h Wqkv^T + b;  [each q head rms_norm * w_q, each k head * w_k];
 *   q, k rotated (rotate-half form, cos / sin of the row's position, from the layer's table);  k, v written
 *   into the sequence's cache;  a = attention(q, cache) Wo^T;  [a = rms_norm(a) * w_attn_out];  x += a;
 *   h = rms_norm(x) * w_post;  [g | u] = h Wgu^T;  m = (act(g) * u) Wdown^T;  [m = rms_norm(m) * w_mlp_out];
 *   x += m.  (Gemma's norms scale by 1 + w: lean passes that sum as the weight.)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specdec_kernels.h"

static inline int padded64(int k) { return (k + 63) / 64 * 64; }

/* out[i] = w * (x[i] / sqrt(mean(x[i]^2) + eps)) for each of m rows (out may be x). */
static void rms_norm_rows(const float *x, int m, int hidden, const float *w, float eps, float *out) {
    for (int i = 0; i < m; i++) {
        const float *xi = x + (int64_t)i * hidden;
        float *oi = out + (int64_t)i * hidden;
        float part[8] = {0};
        int j = 0;
        for (; j + 8 <= hidden; j += 8)
            for (int l = 0; l < 8; l++) part[l] += xi[j + l] * xi[j + l];
        for (; j < hidden; j++) part[0] += xi[j] * xi[j];
        const float sum = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
        const float r = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (j = 0; j < hidden; j++) oi[j] = w[j] * (xi[j] * r);
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

/* The gate's activation times the up projection, into the gate's half of each row: gu [total, 2 I]. */
static void gate_rows(float *gu, int total, int intermediate, int act) {
    for (int i = 0; i < total; i++) {
        float *g = gu + (int64_t)i * 2 * intermediate;
        const float *u = g + intermediate;
        if (act == ACT_GELU_TANH)  /* 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) */
            for (int j = 0; j < intermediate; j++)
                g[j] = 0.5f * g[j] * (1.0f + tanhf(0.7978845608f * (g[j] + 0.044715f * g[j] * g[j] * g[j]))) * u[j];
        else
            for (int j = 0; j < intermediate; j++) g[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* y = x W^T (+ b) through the int4 kernel, with the linear whose weight, scales and bias addresses sit at
 * t[field], t[field + 1], t[field + 2] (L_QKV_W, L_O_W, L_GU_W or L_DOWN_W): x [m, k] (row stride ldx), y [m, n]. */
static int linear4(const int64_t *t, int field, int n, int k, const float *x, int64_t ldx, int m, float *y,
                   int threads) {
    const sd_linear_params p = {.w = (const void *)(intptr_t)t[field], .scales = (const void *)(intptr_t)t[field + 1],
                                .bias = (const float *)(intptr_t)t[field + 2], .n = n, .k = k, .kp = padded64(k),
                                .x = x, .ldx = ldx, .m = m, .y = y, .ldy = n, .threads = threads, .isa = 0};
    return sd_linear4(&p);
}

/* The layers over the rows' x [total, hidden] (updated in place: the last layer's output, before the final
 * norm); see sd_int4_model and sd_int4_rows.  Returns 0, or -1 when out of memory. */
int sd_int4_layers(const sd_int4_model *model, const sd_int4_rows *rows) {
    float *x = rows->x;
    const int total = rows->total, threads = rows->threads;
    const int hidden = model->hidden, heads = model->heads, kv_heads = model->kv_heads, d = model->d;
    const int intermediate = model->intermediate, layers = model->layers;
    const float eps = model->eps;
    const int width = (heads + 2 * kv_heads) * d, attn_width = heads * d;
    float *h = malloc(sizeof(float) * (size_t)total * hidden);
    float *qkv = malloc(sizeof(float) * (size_t)total * width);
    float *att = malloc(sizeof(float) * (size_t)total * attn_width);
    float *gu = malloc(sizeof(float) * (size_t)total * 2 * intermediate);
    float *tmp = malloc(sizeof(float) * ((size_t)total * hidden + (size_t)d));
    int status = h && qkv && att && gu && tmp ? 0 : -1;
    for (int l = 0; l < layers && status == 0; l++) {
        const int64_t *t = model->tensors + (int64_t)l * L_FIELDS;
#define PTR(type, field) ((const type *)(intptr_t)t[field])
        rms_norm_rows(x, total, hidden, PTR(float, L_IN_NORM), eps, h);
        status |= linear4(t, L_QKV_W, width, hidden, h, hidden, total, qkv, threads);
        const int64_t table = t[L_ROPE] * (int64_t)total * d;
        for (int i = 0; i < total; i++) {  /* q and k heads are the first heads + kv_heads of the row */
            float *row = qkv + (int64_t)i * width;
            if (t[L_Q_NORM]) rms_norm_rows(row, heads, d, PTR(float, L_Q_NORM), eps, row);
            if (t[L_K_NORM]) rms_norm_rows(row + (int64_t)heads * d, kv_heads, d, PTR(float, L_K_NORM), eps,
                                           row + (int64_t)heads * d);
            rotate_heads(row, heads + kv_heads, d, rows->cos + table + (int64_t)i * d,
                         rows->sin + table + (int64_t)i * d, tmp + (size_t)total * hidden);
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
                .scale = model->scaling[l], .window = model->window[l], .threads = threads, .isa = 0};
            status |= sd_attention(&attention);
        }
        status |= linear4(t, L_O_W, hidden, attn_width, att, attn_width, total, tmp, threads);
        if (t[L_ATTN_OUT_NORM]) rms_norm_rows(tmp, total, hidden, PTR(float, L_ATTN_OUT_NORM), eps, tmp);
        for (int64_t j = 0; j < (int64_t)total * hidden; j++) x[j] += tmp[j];
        rms_norm_rows(x, total, hidden, PTR(float, L_POST_NORM), eps, h);
        status |= linear4(t, L_GU_W, 2 * intermediate, hidden, h, hidden, total, gu, threads);
        gate_rows(gu, total, intermediate, model->act);
        status |= linear4(t, L_DOWN_W, hidden, intermediate, gu, 2 * intermediate, total, tmp, threads);
        if (t[L_MLP_OUT_NORM]) rms_norm_rows(tmp, total, hidden, PTR(float, L_MLP_OUT_NORM), eps, tmp);
        for (int64_t j = 0; j < (int64_t)total * hidden; j++) x[j] += tmp[j];
#undef PTR
    }
    free(h);
    free(qkv);
    free(att);
    free(gu);
    free(tmp);
    return status ? -1 : 0;
}
