/* Sampling the next token of many rows at once, float32, in a few passes over each row's logits.
 *
 * A row keeps the tokens that pass min_p (p >= min_p * p_max), then its top_k, then the smallest
 * set of the highest whose probability reaches top_p of what is left; ties at a boundary are kept
 * together. Every filter is a threshold on the logit, so the kept set is {l >= a threshold}, and
 * the thresholds are found without sorting the vocabulary: one pass builds a histogram of count
 * and mass over 2048 bins of log-probability (1/64 wide in l / T, the last bin holding everything
 * below e^-32 of the best token), the bin where a count or a mass is reached is found by
 * scanning the bins from the top, and only that bin's tokens are sorted to place the threshold
 * exactly. The draw is the inverse CDF in token order with the row's one uniform, so a seeded
 * request consumes one number of its own stream a step, whatever else is in the batch.
 *
 * A row under a grammar brings its bitmask of allowed tokens. Every pass reads a row 16 tokens at a
 * time through its allowed lanes, so 16 tokens the grammar refuses cost one test of their bits, and
 * the refused tokens fall out of each filter exactly as -inf logits would: weight 0, never the best.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "simd.h"

#define BINS 2048
#define BIN_SCALE 64.0f /* bins per unit of (l - max) / T */

struct Member {
    float logit, weight;
};

static int by_logit_desc(const void *a, const void *b) {
    float x = ((const struct Member *)a)->logit, y = ((const struct Member *)b)->logit;
    return (x < y) - (x > y);
}

struct Row {
    const float *l;
    const uint32_t *allowed; /* the grammar's bitmask, NULL for a free row; w and bins hold its tokens only */
    float *w;      /* e^z per token, 0 where it is filtered out */
    int32_t *bins; /* each token's bin */
    uint16_t *upper; /* per 16 tokens, the kept ones in a bin above the last */
    int32_t *marks;  /* penalties' per-token counts and marks: all zero between rows */
    int64_t vocab;
    float floor; /* the least logit kept so far */
    double count[BINS], mass[BINS];
    struct Member *members; /* scratch for one bin's tokens */
};

/* Of the 16 tokens from i, the lanes in the row that its grammar allows (bit j of word w: token
 * 32 w + j): every lane in the row where it has no mask. */
static inline mask16 allowed_lanes(const uint32_t *allowed, int64_t vocab, int64_t i) {
    const mask16 k = lanes(vocab - i);
    return allowed == NULL ? k : k & (mask16)(allowed[i >> 5] >> (i & 16));
}

/* The least logit t such that the kept tokens with l >= t reach `need` of count (mass = 0) or of
 * mass (mass = 1), ties kept together; *reached is what they hold. Every kept token when they
 * never reach it. */
static float threshold(struct Row *r, double need, int mass, double *reached) {
    const double *hist = mass ? r->mass : r->count;
    double above = 0.0, total = 0.0;
    for (int b = 0; b < BINS; b++) total += hist[b];
    if (need >= total) {
        *reached = total;
        return r->floor;
    }
    int b = 0;
    for (; b < BINS - 1 && above + hist[b] < need; b++) above += hist[b];
    int64_t n = 0;
    for (int64_t i = 0; i < r->vocab; i += 16) {
        const mask16 k = allowed_lanes(r->allowed, r->vocab, i);
        if (!k) continue;
        for (unsigned in = veq_int(k, r->bins + i, b) & vgt(vloadz(k, r->w + i), vzero()); in; in &= in - 1) {
            const int64_t t = i + __builtin_ctz(in);
            r->members[n++] = (struct Member){r->l[t], r->w[t]};
        }
    }
    qsort(r->members, (size_t)n, sizeof(struct Member), by_logit_desc);
    for (int64_t j = 0; j < n; j++) {
        above += mass ? r->members[j].weight : 1.0;
        if (above >= need && (j + 1 == n || r->members[j + 1].logit < r->members[j].logit)) {
            *reached = above;
            return r->members[j].logit;
        }
    }
    *reached = above;
    return n ? r->members[n - 1].logit : r->floor;
}

/* Drop the tokens below `floor` from the weights and the histogram (top_k, before top_p's). */
static void cut(struct Row *r, float floor) {
    r->floor = floor;
    const vec least = vset1(floor), zero = vzero();
    for (int64_t i = 0; i < r->vocab; i += 16) {
        const mask16 k = allowed_lanes(r->allowed, r->vocab, i);
        if (!k) continue;
        unsigned out = vgt(least, vloadz(k, r->l + i)) & vgt(vloadz(k, r->w + i), zero) & k;
        for (; out; out &= out - 1) {
            const int64_t t = i + __builtin_ctz(out);
            r->count[r->bins[t]] -= 1.0;
            r->mass[r->bins[t]] -= r->w[t];
            r->w[t] = 0.0f;
        }
    }
}

/* The first kept token (w > 0, l >= floor) at which the running sum of weights passes target; the
 * last kept one when rounding leaves the target at the very end. Chunks of 16 are summed as
 * vectors, and only the chunk where the sum passes is walked token by token. */
static int64_t draw(const struct Row *r, float floor, double target) {
    const vec least = vset1(floor), zero = vzero();
    double sum = 0.0;
    int64_t last = 0;
    for (int64_t i = 0; i < r->vocab; i += 16) {
        mask16 k = allowed_lanes(r->allowed, r->vocab, i);
        if (!k) continue;
        vec w = vloadz(k, r->w + i);
        mask16 kept = vge(k, vloadz(k, r->l + i), least) & vgt(w, zero);
        if (!kept) continue;
        double chunk = vsum_double(vkeep(kept, w));
        if (sum + chunk <= target) {
            sum += chunk;
            last = i + 15 - __builtin_clz((unsigned)kept << 16);
            continue;
        }
        for (int j = 0; j < 16; j++)
            if (kept >> j & 1) {
                sum += r->w[i + j];
                last = i + j;
                if (sum > target) return last;
            }
    }
    return last;
}

static int64_t sample_row(struct Row *r, const struct SampleRow *p) {
    const float *l = r->l;
    const int64_t V = r->vocab;
    vec highest = vset1(-INFINITY);
    for (int64_t i = 0; i < V; i += 16) { /* NaN never wins: max_ps returns its second operand then */
        const mask16 k = allowed_lanes(r->allowed, V, i);
        if (k) highest = vmax_in(highest, k, vloadz(k, l + i), highest);
    }
    const float m = vhighest(highest);
    if (!(m > -INFINITY)) return 0;
    r->floor = -INFINITY;
    memset(r->count, 0, sizeof(r->count));
    memset(r->mass, 0, sizeof(r->mass));
    /* Weights (kept: at least min_p of the best token's weight, 1, and not NaN), bins, and the kept
     * tokens' count and mass (in double, as every sum here: the draw must land where float64 does).
     * A refused token counts as a -inf logit would: weight 0, in the last bin, kept where min_p is 0. */
    const vec top = vset1(m), inv_t = vset1(1.0f / p->temperature);
    const vec min_p = vset1(p->min_p), scale = vset1(-BIN_SCALE);
    const vec last_bin = vset1((float)(BINS - 1));
    dvec total = dzero();
    int64_t kept_count = 0, refused = 0;
    for (int64_t i = 0; i < V; i += 16) {
        mask16 k = allowed_lanes(r->allowed, V, i);
        refused += __builtin_popcount(lanes(V - i) & ~k);
        if (!k) {
            r->upper[i / 16] = 0;
            continue;
        }
        vec z = vmul(vsub(vloadz(k, l + i), top), inv_t);
        vec w = exp16(z);
        mask16 kept = vge(k, w, min_p);
        w = vkeep(kept, w);
        vstorem(r->w + i, k, w);
        vec bin = vmin(vmul(z, scale), last_bin); /* NaN z: weight 0, never read */
        vstore_int(r->bins + i, k, bin);
        r->upper[i / 16] = kept & vgt(last_bin, bin);
        total = dadd(total, w);
        kept_count += __builtin_popcount(kept);
    }
    if (p->min_p <= 0.0f) kept_count += refused;
    /* The bins above the last, token by token, reached through each 16 tokens' mask of them: a
     * branch per token on its bin mispredicts on a peaked row, a third of whose tokens lie in the
     * last bin at random. The last bin (everything below e^-32 of the best token) holds what is left
     * of the totals. Counts only where top_k asks for them. */
    const int top_k = p->top_k > 0 && p->top_k < V;
    double kept = dsum(total), above_last = 0.0, counted = 0.0;
    for (int64_t i = 0; i < V; i += 16)
        for (unsigned in = r->upper[i / 16]; in; in &= in - 1) {
            const int64_t t = i + __builtin_ctz(in);
            const int b = r->bins[t];
            if (top_k) r->count[b] += 1.0;
            r->mass[b] += r->w[t];
        }
    for (int b = 0; b < BINS - 1; b++) {
        above_last += r->mass[b];
        counted += r->count[b];
    }
    r->count[BINS - 1] = (double)kept_count - counted;
    r->mass[BINS - 1] = kept - above_last > 0.0 ? kept - above_last : 0.0;
    if (top_k) {
        cut(r, threshold(r, (double)p->top_k, 0, &kept));
        kept = 0.0;
        for (int b = 0; b < BINS; b++) kept += r->mass[b];
    }
    float floor = p->top_p < 1.0f ? threshold(r, (double)p->top_p * kept, 1, &kept) : r->floor;
    return draw(r, floor, p->uniform * kept);
}

/* A thread's per-token scratch, kept between calls (about 16 bytes a token, held by each thread that has
 * sampled): fresh pages for it on every call fault in again, which shows at a lone row of Llama 3's
 * vocabulary (bench/kernels/sampling.py). */
static __thread struct Row *kept_row;
static __thread int64_t kept_vocab;

static void free_row(struct Row *r) {
    if (r == NULL) return;
    free(r->w);
    free(r->bins);
    free(r->members);
    free(r->upper);
    free(r->marks);
    free(r);
}

static struct Row *row_scratch(int64_t vocab) {
    if (kept_row != NULL && kept_vocab >= vocab) return kept_row;
    free_row(kept_row);
    struct Row *r = calloc(1, sizeof(struct Row));
    if (r != NULL) {
        r->w = malloc((size_t)vocab * sizeof(float));
        r->bins = malloc((size_t)vocab * sizeof(int32_t));
        r->members = malloc((size_t)vocab * sizeof(struct Member));
        r->upper = malloc((size_t)(vocab + 15) / 16 * sizeof(uint16_t));
        r->marks = calloc((size_t)vocab, sizeof(int32_t));
        if (r->w == NULL || r->bins == NULL || r->members == NULL || r->upper == NULL || r->marks == NULL) {
            free_row(r);
            r = NULL;
        }
    }
    kept_row = r;
    kept_vocab = r != NULL ? vocab : 0;
    return r;
}

/* In a parallel region, every thread: its scratch once all have asked for theirs, or NULL for every
 * thread where any could not have it (*no_memory set), so all agree on whether to run the loop. */
static struct Row *region_scratch(int64_t vocab, int *no_memory) {
    struct Row *r = row_scratch(vocab);
    if (r == NULL) {
#pragma omp atomic write
        *no_memory = 1;
    }
#pragma omp barrier
    int failed;
#pragma omp atomic read
    failed = *no_memory;
    return failed ? NULL : r;
}

int sample_rows(const float *logits, int64_t vocab, struct SampleRow *rows, int64_t n) {
    int no_memory = 0;
#pragma omp parallel
    {
        struct Row *r = region_scratch(vocab, &no_memory);
        if (r != NULL) {
            r->vocab = vocab;
#pragma omp for schedule(dynamic, 1)
            for (int64_t j = 0; j < n; j++) {
                r->l = logits + rows[j].row * vocab;
                r->allowed = rows[j].allowed;
                rows[j].token = sample_row(r, &rows[j]);
            }
        }
    }
    return no_memory ? TPL_NO_MEMORY : TPL_OK;
}

#define SEEN (1 << 30) /* a mark: the repetition penalty is applied */

static int in_vocab(const int64_t *ids, int64_t n, int64_t vocab) {
    for (int64_t j = 0; j < n; j++)
        if (ids[j] < 0 || ids[j] >= vocab) return 0;
    return 1;
}

/* One row's bias, then its penalties in a pass over its history (vLLM's order: a biased token's logit is what the
 * repetition penalty divides), with each token's output count in marks (left
 * all zero again): each token is penalized once however often it recurs. The shift is summed in
 * double, rounded to float32 and subtracted, as sampling.py's PyTorch path does (to within the one
 * rounding a fused multiply-add may save). */
static int penalize_row(float *l, int64_t vocab, const struct PenaltyRow *p, int32_t *marks) {
    const int64_t n = p->n_prompt + p->n_output;
    if (!in_vocab(p->tokens, n, vocab) || !in_vocab(p->bias_ids, p->n_bias, vocab)) return TPL_BAD_TOKEN;
    const int64_t *output = p->tokens + p->n_prompt;
    for (int64_t j = 0; j < p->n_bias; j++) l[p->bias_ids[j]] += p->bias_values[j];
    for (int64_t j = 0; j < p->n_output; j++) marks[output[j]] += 1;
    if (p->repetition != 1.0f)
        for (int64_t j = 0; j < n; j++) {
            const int64_t t = p->tokens[j];
            if (marks[t] & SEEN) continue;
            marks[t] |= SEEN;
            l[t] = l[t] > 0.0f ? fminf(l[t] / p->repetition, FLT_MAX) : l[t] * p->repetition;
        }
    const int shift = p->frequency != 0.0 || p->presence != 0.0;
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = p->tokens[j];
        const int32_t count = marks[t] & ~SEEN;
        if (shift && count) l[t] -= (float)(p->frequency * count + p->presence);
        marks[t] = 0;
    }
    return TPL_OK;
}

int penalize_rows(float *logits, int64_t vocab, const struct PenaltyRow *rows, int64_t n) {
    int status = TPL_OK, no_memory = 0;
#pragma omp parallel
    {
        struct Row *r = region_scratch(vocab, &no_memory);
        if (r != NULL) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t j = 0; j < n; j++) {
                const int failed = penalize_row(logits + rows[j].row * vocab, vocab, &rows[j], r->marks);
                if (failed) {
#pragma omp atomic write
                    status = failed;
                }
            }
        }
    }
    return no_memory ? TPL_NO_MEMORY : status;
}

/* A row's first index of its largest allowed logit: a pass for the largest and the sum (NaN when the
 * row holds a NaN, or infinities of both signs: then the plain loop, which counts a NaN as the
 * largest, as torch.argmax does), and a pass, from L2, for where the largest first is. A row whose
 * allowed logits are all -inf (or that allows none) takes 0, as torch.argmax of a row of -inf does:
 * the refused tokens are -inf logits to it. */
static int64_t argmax_row(const float *l, int64_t vocab, const uint32_t *allowed) {
    vec best = vset1(-INFINITY), sum = vzero();
    for (int64_t i = 0; i < vocab; i += 16) {
        const mask16 m = allowed_lanes(allowed, vocab, i);
        if (!m) continue;
        vec v = vloadz(m, l + i);
        best = vmax_in(best, m, best, v); /* the zeros in lanes outside m are not logits */
        sum = vadd(sum, v);
    }
    if (isnan(vsum(sum))) {
        int64_t arg = -1;
        for (int64_t i = 0; i < vocab; i += 16)
            for (unsigned in = allowed_lanes(allowed, vocab, i); in; in &= in - 1) {
                const int64_t t = i + __builtin_ctz(in);
                if (isnan(l[t])) return t;
                if (arg < 0 || l[t] > l[arg]) arg = t;
            }
        return arg < 0 ? 0 : arg;
    }
    const float highest = vhighest(best);
    if (!(highest > -INFINITY)) return 0;
    const vec top = vset1(highest);
    for (int64_t i = 0; i < vocab; i += 16) {
        const mask16 m = allowed_lanes(allowed, vocab, i);
        const mask16 hit = m ? vge(m, vloadz(m, l + i), top) : 0;
        if (hit) return i + __builtin_ctz(hit);
    }
    return 0; /* not reached: the largest is in the row */
}

void argmax_rows(const float *logits, int64_t vocab, int64_t n, const uint32_t *const *allowed, int64_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++)
        out[r] = argmax_row(logits + r * vocab, vocab, allowed == NULL ? NULL : allowed[r]);
}

/* Row r's log of its sum of exp and its `top` largest logits, best first (equal ones: the lower id
 * first; NaN ones last). One pass for the largest, one for the sum and the top (a chunk is looked at
 * only where a lane beats the last of the top so far), where PyTorch's logsumexp and topk take more
 * passes, each its own dispatch (bench/kernels/sampling.py's logprobs). */
static void top_row(const float *l, int64_t vocab, int64_t top, double *lse, int64_t *ids, float *values) {
    vec highest = vset1(-INFINITY);
    for (int64_t i = 0; i < vocab; i += 16)
        highest = vmax_in(highest, lanes(vocab - i), vloadz(lanes(vocab - i), l + i), highest);
    const float m = vhighest(highest);
    const vec shift = vset1(m);
    dvec sum = dzero();
    int64_t held = 0;
    for (int64_t i = 0; i < vocab; i += 16) {
        const mask16 k = lanes(vocab - i);
        const vec v = vloadz(k, l + i);
        sum = dadd(sum, vkeep(k, exp16(vsub(v, shift))));
        unsigned in = held < top ? vge(k, v, v) : top ? vgt(v, vset1(values[top - 1])) & k : 0; /* no NaN */
        for (; in; in &= in - 1) {
            const int64_t t = i + __builtin_ctz(in);
            if (held == top && !(l[t] > values[top - 1])) continue; /* beaten by one inserted before it */
            int64_t at = held < top ? held++ : top - 1;
            for (; at > 0 && l[t] > values[at - 1]; at--) {
                values[at] = values[at - 1];
                ids[at] = ids[at - 1];
            }
            values[at] = l[t];
            ids[at] = t;
        }
    }
    /* Fewer than `top` logits are not NaN: the NaN ones, by id, fill the rest (log-probabilities NaN);
     * left unwritten, those slots were garbage ids, past the vocabulary. */
    for (int64_t t = 0; held < top && t < vocab; t++)
        if (isnan(l[t])) {
            values[held] = l[t];
            ids[held++] = t;
        }
    *lse = (double)m + log(dsum(sum));
}

void top_logits(const float *logits, int64_t vocab, const int64_t *rows, int64_t n, int64_t top, double *lse,
                int64_t *ids, float *values) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t j = 0; j < n; j++)
        top_row(logits + rows[j] * vocab, vocab, top, lse + j, ids + j * top, values + j * top);
}
