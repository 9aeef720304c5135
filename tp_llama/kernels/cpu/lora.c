/* LoRA adapters per row: y[m] += (x[m] A_s^T) B_s^T for each row m on adapter slot s > 0.
 *
 * A step's rows may each run their own adapter, all held in fixed slots (struct LoraWeights), so
 * a step never gathers weights: rows are grouped by slot, and each group reads its adapter's A and
 * B^T once, whatever number of rows use it. Two passes, each split by static schedules:
 *   t[m][r] = x[m] . A_s[r]                     threads split the (group, r) pairs
 *   y[m][n] = stored(y[m][n] + sum_r t[m][r] B_s^T[r][n])   threads split vectors of 16 columns
 * The second sum reads only the vector's lines of B^T, in one run: a fused projection's B^T is
 * block-diagonal, and the zeros off its blocks, read line by line, would be most of a step's time
 * (BENCHMARKS.md, LoRA adapters). Each element's sum runs over k (or r) in order in its own
 * accumulator, so a row's bits never depend on which rows share its step. t stays float32; y is
 * rounded to its type once, after the add.
 */
#include <stdlib.h>

#include "api.h"
#include "simd.h"

#define ROW_RUN 4 /* rows of a group that share each load of A's and B^T's lines: 4 sums in AVX2's 16 registers */

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

/* t[row][r] = x[row] . A[at ..] for up to ROW_RUN rows, each sum over k in order. */
static void dot_rows(const struct LoraWeights *l, int64_t at, const void *x, int64_t K, int bf16,
                     const int32_t *rows, int n, float *t, int64_t R, int64_t r) {
    vec acc[ROW_RUN];
    for (int j = 0; j < ROW_RUN; j++) acc[j] = vzero();
    for (int64_t k = 0; k < K; k += 16) {
        const mask16 m = lanes(K - k);
        const vec w = load16(l->a, at + k, l->bf16, m);
        for (int j = 0; j < n; j++) acc[j] = vfmadd(load16(x, rows[j] * K + k, bf16, m), w, acc[j]);
    }
    for (int j = 0; j < n; j++) t[rows[j] * R + r] = vsum(acc[j]);
}

/* y[row][16v ..] += t[row] B^T[.][16v ..] for up to ROW_RUN rows, B^T's vector v of the slot whose lines
 * start at element `at`, each sum over the vector's lines in order, then added to y in float32 and rounded
 * to y's type once. */
static void delta_rows(const struct LoraWeights *l, int64_t at, const float *t, int64_t R, const int32_t *rows,
                       int n, void *y, int64_t N, int64_t v, int bf16) {
    const mask16 m = lanes(N - v * 16), all = lanes(16);
    const int64_t lines = l->lines, first = l->first[v], from = at + v * lines * 16;
    vec acc[ROW_RUN];
    for (int j = 0; j < ROW_RUN; j++) acc[j] = vzero();
    for (int64_t i = 0; i < lines; i++) {
        const vec b = load16(l->bt, from + i * 16, l->bf16, all);
        for (int j = 0; j < n; j++) acc[j] = vfmadd(vset1(t[rows[j] * R + first + i]), b, acc[j]);
    }
    for (int j = 0; j < n; j++) {
        const int64_t to = rows[j] * N + v * 16;
        store16(y, to, vadd(load16(y, to, bf16, m), acc[j]), bf16, m);
    }
}

void lora_rows(const struct LoraWeights *l, const void *x, int64_t M, int64_t K, const int32_t *adapters, void *y,
               int64_t N, int bf16, float *scratch) {
    const int64_t R = l->rank, vectors = (N + 15) / 16;
    float *t = scratch;
    int32_t *order = (int32_t *)(scratch + M * R), *starts = order + M, *count = starts + M + 1;
#pragma omp single
    *count = group_rows(adapters, M, l->slots, order, starts);
    const int64_t groups = *count;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < groups * R; item++) {
        const int64_t g = item / R, r = item % R;
        const int64_t at = ((int64_t)adapters[order[starts[g]]] * R + r) * K;
        for (int32_t i = starts[g]; i < starts[g + 1]; i += ROW_RUN) {
            const int n = starts[g + 1] - i < ROW_RUN ? starts[g + 1] - i : ROW_RUN;
            dot_rows(l, at, x, K, bf16, order + i, n, t, R, r);
        }
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < groups * vectors; item++) {
        const int64_t g = item / vectors, v = item % vectors;
        const int64_t at = (int64_t)adapters[order[starts[g]]] * vectors * l->lines * 16;
        for (int32_t i = starts[g]; i < starts[g + 1]; i += ROW_RUN) {
            const int n = starts[g + 1] - i < ROW_RUN ? starts[g + 1] - i : ROW_RUN;
            delta_rows(l, at, t, R, order + i, n, y, N, v, bf16);
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
