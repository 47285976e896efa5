/* specdec's C kernels: every exported function's prototype, the parameter structs and the constants that
 * callers share, in one place.
 *
 * The .c files of this folder include it and are built into one library (build.py); bindings.py mirrors it
 * for ctypes: one signature table for the functions, one ctypes.Structure per struct with the same fields in
 * the same order (tests/native/test_kernel_bindings.py compares both with this file and the compiler's
 * layout).  Kernels that take more than a handful of arguments take them as one struct.
 */
#ifndef SPECDEC_KERNELS_H
#define SPECDEC_KERNELS_H

#include <stdint.h>

/* ------------------------------------------------------------------ paths
 * Each kernel's paths, as its *_isa function reports the best one this CPU runs; a params' isa of 0 means
 * that best path, another value at most that path (the tests compare the paths: they give the same bits). */
enum { ISA_C = 1, ISA_AVX2 = 2, ISA_VNNI = 3 };   /* sd_linear (int8_linear.c) */
enum { ISA4_C = 1, ISA4_AVX2 = 2 };               /* sd_linear4 (int4_linear.c) */
enum { ATT_C = 1, ATT_AVX2 = 2, ATT_AVX512 = 3 }; /* sd_attention (attention.c) */
/* The highest path the user allows (isa.c: SPECDEC_ISA=c -> ISA_C, avx2 -> ISA_AVX2, else ISA_LIMIT_NONE); every
 * kernel's best path is at most this, and nothing runs an instruction set above it. */
enum { ISA_LIMIT_NONE = 3 };
int sd_isa_limit(void);
#define SD_CAP(best) ((best) < sd_isa_limit() ? (best) : sd_isa_limit())

/* ------------------------------------------------------------------ linears
 * y [m, n] (row stride ldy) = x [m, k] (row stride ldx) W^T (+ bias), on up to `threads` threads. */
typedef struct {
    const void *w;      /* sd_linear: int8 tiles from sd_pack; sd_linear4: nibbles from sd_pack4 */
    const void *scales; /* sd_linear: fp32 [n], one per output channel; sd_linear4: sd_pack4's fp16 scales, minimums */
    const float *bias;  /* [n], or NULL */
    int n, k, kp;       /* output channels, input columns, packed columns (k padded to a multiple of 64) */
    const float *x;
    int64_t ldx;
    int m;
    float *y;
    int64_t ldy;
    int threads, isa;
} sd_linear_params;

/* int8 weights (int8_linear.c).  Returns 0, or -1 when out of memory. */
int sd_linear(const sd_linear_params *p);
void sd_pack(const int8_t *w, int n, int k, int kp, int8_t *out);
int sd_isa(void);
int sd_openmp(void);

/* Group-wise int4 weights (int4_linear.c).  Returns 0, or -1 when out of memory. */
int sd_linear4(const sd_linear_params *p);
void sd_pack4(const uint8_t *u, const uint16_t *d, const uint16_t *mn, int n, int k, int kp, uint8_t *out,
              uint16_t *out_scales);
void sd_pack4_int8(const int8_t *v8, const float *row_scale, int n, int k, int kp, uint8_t *out,
                   uint16_t *out_scales, int threads);
int sd_isa4(void);

/* ------------------------------------------------------------------ GGUF blocks (gguf_linear.c)
 * A linear on a GGUF file's own quantised blocks, repacked 16 output channels side by side (sd_gguf_pack).  The
 * types are ggml's ids. */
enum { GG_F32 = 0, GG_F16 = 1, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q6_K = 14 };
enum { GG_Q4_0 = 2, GG_Q5_1 = 7, GG_IQ4_NL = 20, GG_Q2_K = 10, GG_BF16 = 30 };
enum { GG_Q3_K = 11, GG_Q5_K = 13, GG_IQ4_XS = 23 };

/* One block of output columns: a packed tensor [n, k] and its bias, written to y's columns col .. col + n - 1. */
typedef struct {
    const void *w;      /* sd_gguf_pack's layout */
    const float *bias;  /* [n], or NULL */
    int type, n;
    int64_t col;
} sd_gguf_part;

/* y [m, *] (row stride ldy) = x [m, k] (row stride ldx) [W_0 | W_1 | ...]^T, the parts' columns side by side. */
typedef struct {
    const sd_gguf_part *parts;
    int nparts, k;
    const float *x;
    int64_t ldx;
    int m;
    float *y;
    int64_t ldy;
    int threads, isa;  /* isa: ISA_C, ISA_AVX2, ISA_VNNI, or 0 for the best this CPU runs */
} sd_gguf_params;

/* Returns 0, -1 when out of memory, -2 for a type it lacks or k not a multiple of the type's block. */
int sd_gguf_linear(const sd_gguf_params *p);
int sd_gguf_pack(int type, const uint8_t *src, int n, int k, const int32_t *order, uint8_t *out, int threads);
int64_t sd_gguf_packed_bytes(int type, int n, int k);
int sd_gguf_supported(int type);
/* Rows of a tensor as a file stores it (row-major blocks, or an F32 / F16 table) in fp32: llama.cpp's de-quantised
 * values.  Returns 0, or -2 for a type it lacks. */
int sd_gguf_rows(int type, const void *blocks, int k, const int64_t *rows, int count, float *out);
int sd_gguf_isa(void);

/* ------------------------------------------------------------------ attention (attention.c)
 * out[i, h, :] = exact causal attention of query row i (position start + i), head h, over the keys and values
 * at positions [lo, start + i + 1), lo = max(0, start + i + 1 - window) when window > 0 (else 0).  Tree mode
 * (tree_at non-NULL): the new rows are a token tree; row i sees the cached positions [lo, start) and the new
 * rows tree_rows[tree_at[i] .. tree_at[i + 1]) (its ancestors from the root, itself last, each at position
 * start + its index), the last `window` of them all where window > 0. */
typedef struct {
    const float *q;          /* element (h, i, c) at q[h * q_head + i * q_row + c] */
    int64_t q_head, q_row;
    const float *k, *v;      /* (kv head g, position p, c) at [g * kv_head + p * kv_row + c] */
    int64_t kv_head, kv_row;
    float *out;              /* (i, h, c) at out[i * out_row + h * out_head + c] */
    int64_t out_row, out_head;
    int n, start, heads, kv_heads, d;
    float scale;
    int window;              /* a sliding window's size (0: none) */
    int threads, isa;
    const int *tree_at;      /* [n + 1], or NULL: a chain (row i at position start + i) */
    const int *tree_rows;    /* [tree_at[n]]: each row's visible new rows, root first */
    float softcap;           /* > 0: each score s capped to softcap * tanhf(s / softcap) before the softmax
                                (Gemma 2's attention logit soft-capping); 0: none */
} sd_attention_params;

/* Returns 0, or -1 when out of memory. */
int sd_attention(const sd_attention_params *p);
int sd_attention_isa(void);

/* ------------------------------------------------------------------ a model's layers in one call (layers.c)
 * llama / qwen2 / mistral and Gemma 3 decoder layers whose linears run on the int4 kernel (an int4 draft) or on
 * the GGUF block kernel (the gguf target). */

/* A layer's tensors, as one row of int64 addresses (specdec.native.lean builds them in this order); biases and
 * optional norms NULL (0) when absent; L_ROPE is not an address but the index of the layer's rotary table.
 * A linear takes three fields (L_QKV_W, L_QKV_S, L_QKV_B, ...): for LIN_INT4 its packed weight, fp16 scales
 * and minimums (int4_linear.c) and bias; for LIN_GGUF its sd_gguf_part array (biases in the parts), the number
 * of parts, and 0. */
enum { L_IN_NORM, L_POST_NORM, L_QKV_W, L_QKV_S, L_QKV_B, L_O_W, L_O_S, L_O_B, L_GU_W, L_GU_S, L_GU_B, L_DOWN_W,
       L_DOWN_S, L_DOWN_B, L_Q_NORM, L_K_NORM, L_ATTN_OUT_NORM, L_MLP_OUT_NORM, L_ROPE, L_FIELDS };

enum { ACT_SILU, ACT_GELU_TANH, ACT_GELU_FP16 };  /* the MLP gate's activation (layers.c's gate_rows) */
enum { LIN_INT4, LIN_GGUF };       /* the kernel a model's linears run on */

/* The model: what is the same in every call. */
typedef struct {
    const int64_t *tensors;  /* [layers, L_FIELDS]: layer l's addresses at tensors[l * L_FIELDS ..] */
    const float *scaling;    /* [layers]: the attention's scale */
    const int *window;       /* [layers]: the sliding window (0: none) */
    int layers, hidden, heads, kv_heads, d, intermediate;
    int act;                 /* ACT_* */
    float eps;               /* the norms' epsilon */
    int linear;              /* LIN_* */
    int isa;                 /* the linears' and the attention's path: 0 for the best (tests pick the others) */
    float softcap;           /* the attention's score cap (sd_attention_params.softcap; 0: none) */
} sd_layers_model;

/* The new rows of one call, of `runners` sequences: sequence r owns rows offsets r (sizes[r] of them, after the
 * previous sequences'), at positions starts[r] .. starts[r] + sizes[r] - 1 of its cache. */
typedef struct {
    float *x;                /* [total, hidden], updated in place */
    int total, runners;
    const int *starts, *sizes;  /* [runners] */
    const int64_t *caches;   /* [runners, layers, 2]: layer l's keys and values, [kv_heads, capacity_r, d] */
    const int64_t *kv_head;  /* [runners]: capacity_r * d */
    const float *cos, *sin;  /* [tables, total, d]: each row's position's in each rotary table */
    int threads;
    const int64_t *trees;    /* [runners, 2] (tree_at, tree_rows as sd_attention_params takes them, 0 for a chain),
                                or NULL: every sequence a chain */
    const int64_t *taps;     /* [layers]: where to copy layer l's output [total, hidden] (0: nowhere), or NULL */
} sd_layers_rows;

/* Returns 0, or -1 when out of memory. */
int sd_layers(const sd_layers_model *model, const sd_layers_rows *rows);

/* out[i] = w * (x[i] / sqrt(mean(x[i]^2) + eps)) for each of m rows of `hidden` (out may be x): the layers' norm. */
void sd_rms_norm(const float *x, int m, int hidden, const float *w, float eps, float *out);
void sd_rope_table(const int64_t *positions, int count, int dims, float base, float scale, const float *factors,
                   float *cos_out, float *sin_out);

/* ------------------------------------------------------------------ a draft's greedy chain (draft.c)
 * A draft model on the GGUF block kernel (LIN_GGUF layers) feeds `feed` (nfeed tokens at positions start..), then
 * drafts k tokens greedily, each the argmax of the head over the last row, all in one call; the last drafted token
 * is not fed.  One sequence, one rotary table. */
typedef struct {
    const sd_layers_model *model;
    const int64_t *caches;      /* [layers, 2]: keys, values [kv_heads, capacity, d] */
    int64_t kv_head;            /* capacity * d */
    const float *cos, *sin;     /* [capacity, d]: the rotary table from position 0 */
    const float *final_norm;    /* [hidden] */
    const sd_gguf_part *head;   /* the head's parts (sd_gguf_linear's), over head_rows tokens */
    int head_parts, head_rows;
    const int32_t *head_ids;    /* [head_rows]: each head row's token, or NULL: the row's index */
    int embed_type;             /* the embedding's ggml type: 0 F32, 1 F16, or a block type sd_gguf_rows reads */
    const void *embed;
    int64_t embed_rows;
    int threads;
    const int32_t *feed;        /* [nfeed] */
    int nfeed, start, k;
    int32_t *out;               /* [k]: the drafted tokens */
} sd_draft_params;

/* Returns 0, -1 when out of memory or a kernel fails, -2 for a token the embedding lacks or nfeed, k < 1. */
int sd_draft_greedy(const sd_draft_params *p);

/* ------------------------------------------------------------------ scratch memory (internal, not exported)
 * A call's temporary buffers, kept per thread and slot for the next call (up to SCRATCH_KEEP bytes): a prefill's
 * linears and layers would otherwise map fresh pages, and the kernel zero them, at every call.  Larger buffers
 * are allocated and freed per call.  scratch_take's buffer is 64-byte aligned; give it back with
 * scratch_give (which frees only what it did not keep). */
#include <stdlib.h>
#define SCRATCH_KEEP ((size_t)64 << 20)
#define SCRATCH_SLOTS 4
static _Thread_local void *scratch_kept[SCRATCH_SLOTS];
static _Thread_local size_t scratch_size[SCRATCH_SLOTS];

static inline void *scratch_take(int slot, size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    if (bytes > SCRATCH_KEEP) return aligned_alloc(64, bytes);
    if (scratch_size[slot] < bytes) {
        free(scratch_kept[slot]);
        scratch_kept[slot] = aligned_alloc(64, bytes);
        scratch_size[slot] = scratch_kept[slot] ? bytes : 0;
    }
    return scratch_kept[slot];
}

static inline void scratch_give(int slot, void *p) {
    if (p && p != scratch_kept[slot]) free(p);
}

/* ------------------------------------------------------------------ the machine (bandwidth.c) */

/* GB/s of the best of `passes` streaming reads of a `bytes` buffer on `threads` threads (each its own part);
 * *checksum: the bytes' sum.  Negative when out of memory. */
double sd_read_bandwidth(int64_t bytes, int threads, int passes, uint64_t *checksum);

#endif
