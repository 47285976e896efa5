/* A draft model's greedy chain in one call: the k drafted tokens of a speculative step with no Python between them.
 *
 * Speculative decoding's drafter proposes k tokens one after another, each a one-token forward of the draft model
 * whose argmax is the next one's input (Leviathan et al. 2023).  For a small draft on a CPU the weights' stream is
 * the token's cost, and what runs between two forwards -- the Python of a forward (the embedding's rows, the
 * packed-forward bookkeeping, the final norm and the head as torch calls, the argmax) -- is a good part of the rest.
 * Here the whole chain is one call: the tokens to feed first (what the draft's cache lacks of the context: the
 * last step's bonus token, or a catch-up), then k - 1 one-token forwards, each token the argmax of the head over
 * the last row, on the GGUF block kernel (gguf_linear.c) and the layers of layers.c -- the very numbers the same
 * forwards give one at a time (the same calls, one row each).  The head may be trimmed to some of the vocabulary's
 * rows (FR-Spec, Zhao et al. 2025): head_ids maps each of its rows to its token.  The last drafted token is not fed
 * (nobody reads the logits after it yet); the caller's cache then holds feed and the first k - 1 drafted tokens.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specdec_kernels.h"

/* The embedding's row of `token` into x [hidden] (an F32 or F16 table, or a GGUF file's blocks: sd_gguf_rows). */
static int embed(const sd_draft_params *p, int32_t token, float *x) {
    if (token < 0 || token >= p->embed_rows) return -2;
    const int64_t row = token;
    return sd_gguf_rows(p->embed_type, p->embed, p->model->hidden, &row, 1, x);
}

/* The layers over x's n rows at positions start.. (the caller's cache: one sequence, one rotary table). */
static int layers(const sd_draft_params *p, float *x, int n, int start) {
    const int d = p->model->d;
    const sd_layers_rows rows = {.x = x, .total = n, .runners = 1, .starts = &start, .sizes = &n,
                                 .caches = p->caches, .kv_head = &p->kv_head, .cos = p->cos + (int64_t)start * d,
                                 .sin = p->sin + (int64_t)start * d, .threads = p->threads, .trees = NULL,
                                 .taps = NULL};
    return sd_layers(p->model, &rows);
}

/* The head's argmax token for the row x [hidden] (normed here; logits [head_rows] scratch); -1 on error.  The
 * first of equal maxima, as torch's argmax; a NaN row gives the first token whose logit is not below it. */
static int32_t next_token(const sd_draft_params *p, const float *x, float *h, float *logits) {
    sd_rms_norm(x, 1, p->model->hidden, p->final_norm, p->model->eps, h);
    const sd_gguf_params head = {.parts = p->head, .nparts = p->head_parts, .k = p->model->hidden, .x = h,
                                 .ldx = p->model->hidden, .m = 1, .y = logits, .ldy = p->head_rows,
                                 .threads = p->threads, .isa = p->model->isa};
    if (sd_gguf_linear(&head) != 0) return -1;
    int best = 0;
    for (int i = 1; i < p->head_rows; i++)
        if (logits[i] > logits[best]) best = i;
    return p->head_ids ? p->head_ids[best] : best;
}

int sd_draft_greedy(const sd_draft_params *p) {
    const int hidden = p->model->hidden;
    if (p->nfeed < 1 || p->k < 1) return -2;
    float *x = malloc(sizeof(float) * ((size_t)p->nfeed * hidden + 2 * (size_t)hidden + (size_t)p->head_rows));
    if (!x) return -1;
    float *h = x + (size_t)p->nfeed * hidden, *one = h + hidden, *logits = one + hidden;
    int status = 0;
    for (int i = 0; i < p->nfeed && status == 0; i++) status = embed(p, p->feed[i], x + (int64_t)i * hidden);
    if (status == 0) status = layers(p, x, p->nfeed, p->start);
    const float *last = x + (int64_t)(p->nfeed - 1) * hidden;
    for (int i = 0; i < p->k && status == 0; i++) {
        const int32_t token = next_token(p, last, h, logits);
        if (token < 0) {
            status = -1;
            break;
        }
        p->out[i] = token;
        if (i == p->k - 1) break; /* the last drafted token is not fed */
        status = embed(p, token, one);
        if (status == 0) status = layers(p, one, 1, p->start + p->nfeed + i);
        last = one;
    }
    free(x);
    return status;
}
