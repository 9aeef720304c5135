/* LoRA adapters per row: y[m] += (x[m] A_s^T) B_s^T for each row m on adapter slot s > 0.
 *
 * A step's rows may each run their own adapter, all held in fixed slots (struct LoraWeights), so
 * a step never gathers weights: rows are grouped by slot, and each group reads its adapter's A and
 * B^T once, whatever number of rows use it. Two passes, each split by static schedules:
 *   t[m][r] = x[m] . A_s[r]                     threads split the (group, r) pairs
 *   y[m][n] = stored(y[m][n] + sum_r t[m][r] B_s^T[r][n])   threads split runs of COL_RUN columns
 * Each element's sum runs over k (or r) in order in its own accumulator, so a row's bits never
 * depend on which rows share its step. t stays float32; y is rounded to its type once, after the add.
 */
#include <stdlib.h>

#include "api.h"
#include "simd.h"

#define ROW_RUN 4  /* rows of a group that share each load of A's and B^T's lines */
#define COL_RUN 32 /* output columns of one work item of the second pass: two vectors */

/* The scratch lora_rows takes: t [M][R] float32, then the rows grouped by slot (int32 [M]), each
 * group's start in that order (int32 [M + 1]) and the number of groups (int32). */
int64_t lora_scratch_bytes(int64_t M, int64_t R) { return (M * R + 2 * M + 2) * (int64_t)sizeof(float); }

/* The rows on slots 1 .. slots - 1 in `order`, grouped by slot in the order of each slot's first row,
 * each group in row order; group g is order[starts[g]] .. order[starts[g + 1] - 1]. Slots outside that
 * range are the base, as slot 0 is. The number of groups is returned. */
static int32_t group_rows(const int32_t *adapters, int64_t M, int64_t slots, int32_t *order, int32_t *starts) {
    int32_t groups = 0, placed = 0;
    for (int64_t m = 0; m < M; m++) {
        const int32_t s = adapters[m];
        int seen = s <= 0 || s >= slots;
        for (int32_t g = 0; g < groups && !seen; g++) seen = adapters[order[starts[g]]] == s;
        if (seen) continue;
        starts[groups++] = placed;
        for (int64_t i = m; i < M; i++)
            if (adapters[i] == s) order[placed++] = (int32_t)i;
    }
    starts[groups] = placed;
    return groups;
}

/* t[row][r] = x[row] . a for up to ROW_RUN rows, each sum over k in order. */
static void dot_rows(const float *a, const void *x, int64_t K, int bf16, const int32_t *rows, int n, float *t,
                     int64_t R, int64_t r) {
    vec acc[ROW_RUN];
    for (int j = 0; j < ROW_RUN; j++) acc[j] = vzero();
    for (int64_t k = 0; k < K; k += 16) {
        const mask16 m = lanes(K - k);
        const vec w = vloadz(m, a + k);
        for (int j = 0; j < n; j++) acc[j] = vfmadd(load16(x, rows[j] * K + k, bf16, m), w, acc[j]);
    }
    for (int j = 0; j < n; j++) t[rows[j] * R + r] = vsum(acc[j]);
}

/* y[row][n0 ..] += t[row] B^T[.][n0 ..] for up to ROW_RUN rows and COL_RUN columns, each sum over r in
 * order, then added to y in float32 and rounded to y's type once. */
static void delta_rows(const float *bt, const float *t, int64_t R, const int32_t *rows, int n, void *y, int64_t N,
                     int64_t n0, int bf16) {
    const mask16 lo = lanes(N - n0), hi = lanes(N - n0 - 16);
    vec acc[ROW_RUN][2];
    for (int j = 0; j < ROW_RUN; j++) acc[j][0] = acc[j][1] = vzero();
    for (int64_t r = 0; r < R; r++) {
        const vec b0 = vloadz(lo, bt + r * N + n0), b1 = vloadz(hi, bt + r * N + n0 + 16);
        for (int j = 0; j < n; j++) {
            const vec tr = vset1(t[rows[j] * R + r]);
            acc[j][0] = vfmadd(tr, b0, acc[j][0]);
            acc[j][1] = vfmadd(tr, b1, acc[j][1]);
        }
    }
    for (int j = 0; j < n; j++) {
        const int64_t at = rows[j] * N + n0;
        store16(y, at, vadd(load16(y, at, bf16, lo), acc[j][0]), bf16, lo);
        if (hi) store16(y, at + 16, vadd(load16(y, at + 16, bf16, hi), acc[j][1]), bf16, hi);
    }
}

void lora_rows(const struct LoraWeights *l, const void *x, int64_t M, int64_t K, const int32_t *adapters, void *y,
               int64_t N, int bf16, float *scratch) {
    const int64_t R = l->rank, chunks = (N + COL_RUN - 1) / COL_RUN;
    float *t = scratch;
    int32_t *order = (int32_t *)(scratch + M * R), *starts = order + M, *count = starts + M + 1;
#pragma omp single
    *count = group_rows(adapters, M, l->slots, order, starts);
    const int64_t groups = *count;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < groups * R; item++) {
        const int64_t g = item / R, r = item % R;
        const float *a = l->a + ((int64_t)adapters[order[starts[g]]] * R + r) * K;
        for (int32_t i = starts[g]; i < starts[g + 1]; i += ROW_RUN) {
            const int n = starts[g + 1] - i < ROW_RUN ? starts[g + 1] - i : ROW_RUN;
            dot_rows(a, x, K, bf16, order + i, n, t, R, r);
        }
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < groups * chunks; item++) {
        const int64_t g = item / chunks, n0 = item % chunks * COL_RUN;
        const float *bt = l->bt + (int64_t)adapters[order[starts[g]]] * R * N;
        for (int32_t i = starts[g]; i < starts[g + 1]; i += ROW_RUN) {
            const int n = starts[g + 1] - i < ROW_RUN ? starts[g + 1] - i : ROW_RUN;
            delta_rows(bt, t, R, order + i, n, y, N, n0, bf16);
        }
    }
}

int lora_add(const struct LoraWeights *l, const void *x, int64_t M, int64_t K, const int32_t *adapters, void *y,
             int64_t N, int bf16) {
    float *scratch = malloc((size_t)lora_scratch_bytes(M, l->rank));
    if (scratch == NULL) return TPL_NO_MEMORY;
#pragma omp parallel
    lora_rows(l, x, M, K, adapters, y, N, bf16, scratch);
    free(scratch);
    return TPL_OK;
}
