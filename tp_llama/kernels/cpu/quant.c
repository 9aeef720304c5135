/* y[M, N] = x[M, K] @ w[N, K]^T for weights quantized at load to int8 or int4, on the CPU's integer
 * dot products.
 *
 * A decode step streams every weight once, so fewer bytes a weight is more tokens a second; and an
 * integer dot product (vpmaddubsw + vpmaddwd on AVX2, vpdpbusd with VNNI) does 4 multiply-adds a
 * lane where a float FMA does 1, which is what prompt rows are bound by.
 *
 * The weight comes in tiles of TILE_COLS output columns, as matmul.c's, each a run of blocks of
 * QBLOCK k (pack_quant_tiles lays them out):
 *   int8: [TILE_COLS fp16 scales][QSTEPS][TILE_COLS][4 k] int8             w = q * scale, q in -127..127
 *   int4: [TILE_COLS fp16 scales][TILE_COLS fp16 minimums][QSTEPS / 2][TILE_COLS][4 k] bytes, whose
 *         low nibble is the pair's first step and high nibble its second   w = q * scale + min, q in 0..15
 *   pairs (Q8_PAIRS): [TILE_COLS fp16 scales][QBLOCK / 2][TILE_COLS][2 k] int8, x quantized to int16
 *         per block instead (Meta's int8 output layer, which its loader runs on float inputs)
 * so a step (4 k of 16 columns) is one 64-byte load, and its 16 sums need no horizontal adds.
 * x is quantized per row and block (symmetric int8 with a float32 scale; int4's minimums also need
 * each block's sum), so a row's outputs never depend on the other rows of its call. A block's
 * products are summed exactly in int32, then added into float32 sums, block after block.
 *
 * vpmaddubsw multiplies unsigned by signed bytes into int16 pairs that saturate: int4's nibbles are
 * unsigned and x's bytes signed (pairs at most 2 * 15 * 127, so a block's 16 pairs a lane add up in
 * int16 too); int8 weights are signed, so the unsigned side is |x| and the weight takes x's sign
 * (pairs at most 2 * 127 * 127 < 2^15, widened to int32 every step).
 */
#include <math.h>
#include <stdlib.h>

#include "api.h"
#include "simd.h"

#define VECS (TILE_COLS / 16)
#define QSTEPS (QBLOCK / 4)
#define Q8_BLOCK_BYTES (2 * TILE_COLS + QBLOCK * TILE_COLS)
#define Q4_BLOCK_BYTES (4 * TILE_COLS + QBLOCK * TILE_COLS / 2)
#define QROWS 4 /* rows sharing each load of the weights: their sums (two ymm each on AVX2) fill the registers */
#define X_BLOCK_BYTES (1 << 20) /* the quantized rows that share one pass over the weights, kept in L2 */
#define AHEAD_BYTES 4096 /* how far ahead in its tile a block asks for lines (the next tile's first, at its end) */

/* A block's lines AHEAD_BYTES on, into L1 (bench/kernels/matmul.py --bits: the lines of the next
 * tile into L2 as well, as matmul.c asks for them, bought nothing here). */
static inline void prefetch_ahead(const uint8_t *block, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char *)block + AHEAD_BYTES + line, _MM_HINT_T0);
}

/* x quantized: q [M][K] and |q|, and per row and block its scale and scale * sum of q; or, for pair
 * tiles, x16 [M][K] (over q and a) and the scales. */
struct QRows {
    int8_t *q;
    uint8_t *a;
    int16_t *x16;
    float *d, *ds;
};

static struct QRows carve(void *scratch, int64_t M, int64_t K) {
    struct QRows r;
    r.q = scratch;
    r.a = (uint8_t *)scratch + M * K;
    r.x16 = scratch;
    r.d = (float *)((uint8_t *)scratch + 2 * M * K);
    r.ds = r.d + M * (K / QBLOCK);
    return r;
}

int64_t quant_block_bytes(int bits) { return bits == 4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES; }

int64_t quant_scratch_bytes(int64_t M, int64_t K) { return 2 * M * K + 2 * M * (K / QBLOCK) * (int64_t)sizeof(float); }

/* Each block of QBLOCK values as round(x / d) with d = max |x| / 127, or in int16 with d = max |x| / 32767
 * for pair tiles (wide), in-region. */
static void quantize_rows(const void *x, int64_t M, int64_t K, int bf16, int wide, struct QRows r) {
    int64_t blocks = K / QBLOCK;
    float top = wide ? 32767.0f : 127.0f;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        vec poison = vzero(); /* NaN where the row holds a NaN: vmax and vhighest drop NaN lanes */
        for (int64_t b = 0; b < blocks; b++) {
            int64_t at = m * K + b * QBLOCK;
            vec lo = load16(x, at, bf16, 0xFFFF), hi = load16(x, at + 16, bf16, 0xFFFF);
            poison = vadd(poison, vmul(vadd(lo, hi), vzero()));
            float amax = vhighest(vmax(vmax(lo, vsub(vzero(), lo)), vmax(hi, vsub(vzero(), hi))));
            vec inverse = vset1(amax > 0 ? top / amax : 0.0f);
            int32_t q[QBLOCK], sum = 0;
            vstore_int(q, 0xFFFF, vround(vmul(lo, inverse)));
            vstore_int(q + 16, 0xFFFF, vround(vmul(hi, inverse)));
            r.d[m * blocks + b] = amax / top;
            if (wide) {
                for (int i = 0; i < QBLOCK; i++) r.x16[at + i] = (int16_t)q[i];
                continue;
            }
            for (int i = 0; i < QBLOCK; i++) {
                r.q[at + i] = (int8_t)q[i];
                r.a[at + i] = (uint8_t)(q[i] < 0 ? -q[i] : q[i]);
                sum += q[i];
            }
            r.ds[m * blocks + b] = amax / top * (float)sum;
        }
        /* a NaN rounds to a finite integer: NaN scales instead, so that a NaN in x makes its row's outputs NaN,
         * as the float tiles' */
        if (isnan(vsum(poison)))
            for (int64_t b = 0; b < blocks; b++) r.d[m * blocks + b] = r.ds[m * blocks + b] = NAN;
    }
}

/* One tile's blocks for MT rows (rows m of r from row 0 of the call's block), their float32 sums in
 * acc [MT][VECS]. Each vector of 16 columns in turn through a block, so only MT sums are live (AVX2
 * has 16 registers); the loop over a block's steps stays a loop, or gcc hoists every product ahead
 * of the adds and spills them. pairs: pair tiles, whose 16 columns of a k pair widen to int16 in one
 * load and vpmaddwd sums each column's two products with x's int16 pair. */
static inline __attribute__((always_inline)) void q8_rows(struct QRows r, int64_t K, const uint8_t *wt, vec acc[][VECS],
                                                         const int pairs, const int MT) {
    int64_t blocks = K / QBLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = wt + b * Q8_BLOCK_BYTES, *steps = block + 2 * TILE_COLS;
        prefetch_ahead(block, Q8_BLOCK_BYTES);
        _Pragma("GCC unroll 2") for (int j = 0; j < VECS; j++) {
            ivec sum[QROWS];
            _Pragma("GCC unroll 4") for (int m = 0; m < MT; m++) sum[m] = izero();
            const int n_steps = pairs ? QBLOCK / 2 : QSTEPS;
            _Pragma("GCC unroll 1") for (int s = 0; s < n_steps; s++) {
                if (pairs) {
                    qvec w = qload_pairs(steps + (s * TILE_COLS + 16 * j) * 2);
                    _Pragma("GCC unroll 4") for (int m = 0; m < MT; m++)
                        sum[m] = pdot(sum[m], w, qset4(r.x16 + m * K + b * QBLOCK + 2 * s));
                    continue;
                }
                qvec w = qload(steps + (s * TILE_COLS + 16 * j) * 4);
                _Pragma("GCC unroll 4") for (int m = 0; m < MT; m++) {
                    int64_t at = m * K + b * QBLOCK + 4 * s;
                    sum[m] = idot(sum[m], qset4(r.a + at), qsign(w, qset4(r.q + at)));
                }
            }
            vec scale = load_halves(block + 32 * j);
            _Pragma("GCC unroll 4") for (int m = 0; m < MT; m++)
                acc[m][j] = vfmadd(ifloat(sum[m]), vmul(scale, vset1(r.d[m * blocks + b])), acc[m][j]);
        }
    }
}

static inline __attribute__((always_inline)) void q4_rows(struct QRows r, int64_t K, const uint8_t *wt, vec acc[][VECS],
                                                         const int MT) {
    int64_t blocks = K / QBLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = wt + b * Q4_BLOCK_BYTES, *steps = block + 4 * TILE_COLS;
        prefetch_ahead(block, Q4_BLOCK_BYTES);
        _Pragma("GCC unroll 2") for (int j = 0; j < VECS; j++) {
            isums sum[QROWS];
            _Pragma("GCC unroll 4") for (int m = 0; m < MT; m++) sum[m] = izero();
            _Pragma("GCC unroll 1") for (int p = 0; p < QSTEPS / 2; p++) {
                qvec nibbles = qload(steps + (p * TILE_COLS + 16 * j) * 4);
                qvec first = qlow(nibbles), second = qhigh(nibbles);
                _Pragma("GCC unroll 4") for (int m = 0; m < MT; m++) {
                    const int8_t *xq = r.q + m * K + b * QBLOCK + 8 * p;
                    sum[m] = isums_add(isums_add(sum[m], first, qset4(xq)), second, qset4(xq + 4));
                }
            }
            vec scale = load_halves(block + 32 * j), low = load_halves(block + 2 * TILE_COLS + 32 * j);
            _Pragma("GCC unroll 4") for (int m = 0; m < MT; m++) {
                int64_t at = m * blocks + b;
                vec sums = vfmadd(ifloat(isums_end(sum[m])), vmul(scale, vset1(r.d[at])), acc[m][j]);
                acc[m][j] = vfmadd(low, vset1(r.ds[at]), sums);
            }
        }
    }
}

/* A tile for MT rows into y (row stride ldy, from column i). */
static inline __attribute__((always_inline)) void q_tile(struct QRows r, int64_t K, const uint8_t *wt, int bits,
                                                        void *y, int64_t ldy, int64_t i, int64_t cols, int gated,
                                                        int bf16, const int MT) {
    vec acc[QROWS][VECS];
    for (int m = 0; m < MT; m++)
        for (int j = 0; j < VECS; j++) acc[m][j] = vzero();
    if (bits == 8)
        q8_rows(r, K, wt, acc, 0, MT);
    else if (bits == Q8_PAIRS)
        q8_rows(r, K, wt, acc, 1, MT);
    else
        q4_rows(r, K, wt, acc, MT);
    for (int m = 0; m < MT; m++) put_row(y, m * ldy + i, acc[m][0], acc[m][1], cols, gated, bf16);
}

static struct QRows offset(struct QRows r, int64_t m, int64_t K) {
    r.q += m * K;
    r.a += m * K;
    r.x16 += m * K;
    r.d += m * (K / QBLOCK);
    r.ds += m * (K / QBLOCK);
    return r;
}

/* The threads split the tiles; rows go in near-equal chunks of at most QROWS, the tile's blocks
 * in cache between chunks. */
static void q_tiles(struct QRows r, int64_t M, int64_t K, const uint8_t *w, int64_t N, int bits, void *y, int gated,
                    int bf16) {
    int64_t tiles = (N + TILE_COLS - 1) / TILE_COLS, chunks = (M + QROWS - 1) / QROWS;
    int64_t tile_bytes = K / QBLOCK * quant_block_bytes(bits), ldy = gated ? N / 2 : N;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *wt = w + t * tile_bytes;
        int64_t cols = N - t * TILE_COLS, i = t * (gated ? TILE_COLS / 2 : TILE_COLS);
        for (int64_t c = 0, m0 = 0; c < chunks; c++) {
            int64_t m1 = M * (c + 1) / chunks;
            struct QRows rows = offset(r, m0, K);
            void *ym = (char *)y + m0 * ldy * (bf16 ? 2 : 4);
            switch (m1 - m0) {
            case 4: q_tile(rows, K, wt, bits, ym, ldy, i, cols, gated, bf16, 4); break;
            case 3: q_tile(rows, K, wt, bits, ym, ldy, i, cols, gated, bf16, 3); break;
            case 2: q_tile(rows, K, wt, bits, ym, ldy, i, cols, gated, bf16, 2); break;
            default: q_tile(rows, K, wt, bits, ym, ldy, i, cols, gated, bf16, 1);
            }
            m0 = m1;
        }
    }
}

/* The quantized rows through the weights a block of them at a time (in-region). */
static void q_rows_blocks(struct QRows r, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, int bf16,
                          int bits) {
    int64_t block = X_BLOCK_BYTES / (2 * K);
    block = block < QROWS ? QROWS : block - block % QROWS;
    int64_t ldy = gated ? N / 2 : N;
    for (int64_t m0 = 0; m0 < M; m0 += block) {
        int64_t m = M - m0 < block ? M - m0 : block;
        q_tiles(offset(r, m0, K), m, K, w, N, bits, (char *)y + m0 * ldy * (bf16 ? 2 : 4), gated, bf16);
    }
}

void quant_matmul(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, int bf16,
                  int bits, void *scratch) {
    struct QRows r = carve(scratch, M, K);
    quantize_rows(x, M, K, bf16, bits == Q8_PAIRS, r);
    q_rows_blocks(r, M, K, w, N, y, gated, bf16, bits);
}

int quant_linear(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, int bf16,
                 int bits) {
    void *scratch = malloc((size_t)quant_scratch_bytes(M, K));
    if (scratch == NULL) return TPL_NO_MEMORY;
#pragma omp parallel
    quant_matmul(x, M, K, w, N, y, gated, bf16, bits, scratch);
    free(scratch);
    return TPL_OK;
}

#define ACT_EPS 1.1920928955078125e-07f /* float32's epsilon: torchao's smallest activation step */

/* Row m of x quantized as torchao's per-token asymmetric int8 over [lo, hi] (its range widened to
 * hold zero), with the float32 operations and ties-to-even rounding PyTorch's do; its step and zero point
 * into d and ds of every block (the kernel's sums), and the row's shift, step * zero. */
static void meta_row(const void *x, int64_t m, int64_t K, int bf16, float hi, float lo, struct QRows r, float *shift) {
    hi = hi > 0.0f ? hi : 0.0f;
    lo = lo < 0.0f ? lo : 0.0f;
    float step = (hi - lo) / 255.0f;
    step = step < ACT_EPS ? ACT_EPS : step;
    float zero = -128.0f - vhighest(vround(vset1(lo / step)));
    zero = zero < -128.0f ? -128.0f : zero > 127.0f ? 127.0f : zero;
    vec inverse = vset1(1.0f / step), z = vset1(zero), low = vset1(-128.0f), high = vset1(127.0f);
    vec poison = vzero(); /* NaN where the row holds a NaN: the range and the clamps drop it */
    int64_t blocks = K / QBLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        int64_t at = m * K + b * QBLOCK;
        int32_t q[QBLOCK], sum = 0;
        for (int h = 0; h < QBLOCK; h += 16) {
            vec xv = load16(x, at + h, bf16, 0xFFFF);
            poison = vadd(poison, vmul(xv, vzero()));
            vec v = vadd(vround(vmul(xv, inverse)), z);
            vstore_int(q + h, 0xFFFF, vmin(vmax(v, low), high));
        }
        for (int i = 0; i < QBLOCK; i++) {
            r.q[at + i] = (int8_t)q[i];
            r.a[at + i] = (uint8_t)(q[i] < 0 ? -q[i] : q[i]);
            sum += q[i];
        }
        r.d[m * blocks + b] = step;
        r.ds[m * blocks + b] = step * (float)sum;
    }
    if (isnan(vsum(poison))) { /* every output of the row NaN, as the float tiles' */
        step = NAN;
        for (int64_t b = 0; b < blocks; b++) r.d[m * blocks + b] = r.ds[m * blocks + b] = NAN;
    }
    shift[m] = step * zero;
}

#define ADAPTOR_RANKS 4 /* ranks of A summed at once: their sums and x fill AVX2's registers */

/* t [M][R] = scale * x A^T for w's adaptor (in-region). */
static void adaptor_ranks(const void *x, int64_t M, int64_t K, int bf16, const struct MetaInt4 *w, float *t) {
    int64_t R = w->rank, chunks = (R + ADAPTOR_RANKS - 1) / ADAPTOR_RANKS;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M * chunks; i++) { /* ADAPTOR_RANKS ranks of A share each load of x */
        int64_t m = i / chunks, first = i % chunks * ADAPTOR_RANKS;
        int n = R - first < ADAPTOR_RANKS ? (int)(R - first) : ADAPTOR_RANKS;
        vec acc[ADAPTOR_RANKS];
        for (int j = 0; j < ADAPTOR_RANKS; j++) acc[j] = vzero();
        for (int64_t k = 0; k < K; k += 16) {
            vec xv = load16(x, m * K + k, bf16, 0xFFFF);
            for (int j = 0; j < n; j++) acc[j] = vfmadd(xv, load16(w->lora_a, (first + j) * K + k, 1, 0xFFFF), acc[j]);
        }
        for (int j = 0; j < n; j++) t[m * R + first + j] = vsum(acc[j]) * w->lora_scale;
    }
}

/* y [M][N] -= shift[m] * the weight's row sums, then (where t is not NULL) += t B^T for the adaptor's part of
 * each output: over the columns, so the one row of a decode step splits across the threads too (in-region). */
static void finish_columns(const struct MetaInt4 *w, int64_t M, int64_t N, const float *shift, const float *t,
                           float *y) {
    int64_t part_rank = w->rank / (w->lora_parts ? w->lora_parts : 1);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n += 16) {
        mask16 keep = lanes(N - n);
        vec sums = vloadz(keep, (const float *)w->row_sums + n);
        int64_t part = 0;
        while (t != NULL && n >= w->lora_ends[part]) part++;
        for (int64_t m = 0; m < M; m++) {
            vec acc = vfnmadd(vset1(shift[m]), sums, vloadz(keep, y + m * N + n));
            if (t != NULL) {
                const float *ts = t + m * w->rank + part * part_rank;
                for (int64_t j = 0; j < part_rank; j++)
                    acc = vfmadd(vset1(ts[j]), load16(w->lora_bt, j * N + n, 1, keep), acc);
            }
            vstorem(y + m * N + n, keep, acc);
        }
    }
}

int64_t meta_int4_scratch_bytes(int64_t M, int64_t K, int64_t R) {
    return quant_scratch_bytes(M, K) + M * (1 + R) * (int64_t)sizeof(float);
}

void meta_int4_matmul(const void *x, const void *bounds, int64_t M, int64_t K, const struct MetaInt4 *w, int64_t N,
                      float *y, int bf16, void *scratch) {
    struct QRows r = carve(scratch, M, K);
    float *shift = (float *)((uint8_t *)scratch + quant_scratch_bytes(M, K));
    const float *range = bounds;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float hi, lo;
        if (range != NULL) {
            hi = range[2 * m];
            lo = -range[2 * m + 1];
        } else {
            vec top = load16(x, m * K, bf16, 0xFFFF), bottom = top;
            for (int64_t i = 16; i < K; i += 16) {
                vec v = load16(x, m * K + i, bf16, 0xFFFF);
                top = vmax(top, v);
                bottom = vmin(bottom, v);
            }
            hi = vhighest(top);
            lo = -vhighest(vsub(vzero(), bottom));
        }
        meta_row(x, m, K, bf16, hi, lo, r, shift);
    }
    q_rows_blocks(r, M, K, w->tiles, N, y, 0, 0, 4);
    float *t = w->lora_a != NULL ? shift + M : NULL;
    if (t != NULL) adaptor_ranks(x, M, K, bf16, w, t);
    finish_columns(w, M, N, shift, t, y);
}

int meta_int4_linear(const void *x, const void *bounds, int64_t M, int64_t K, const struct MetaInt4 *w, int64_t N,
                     float *y, int bf16) {
    void *scratch = malloc((size_t)meta_int4_scratch_bytes(M, K, w->rank));
    if (scratch == NULL) return TPL_NO_MEMORY;
#pragma omp parallel
    meta_int4_matmul(x, bounds, M, K, w, N, y, bf16, scratch);
    free(scratch);
    return TPL_OK;
}

void hadamard_rows_in(const void *x, int64_t M, int64_t n, int bf16, float *y) {
    float norm = sqrtf((float)n);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float *row = y + m * n;
        for (int64_t j = 0; j < n; j += 16) vstorem(row + j, lanes(n - j), load16(x, m * n + j, bf16, lanes(n - j)));
        for (int64_t half = 1; half < n; half *= 2)
            for (int64_t start = 0; start < n; start += 2 * half)
                for (int64_t j = start; j < start + half; j++) {
                    float a = row[j], b = row[j + half];
                    row[j] = a + b;
                    row[j + half] = a - b;
                }
        for (int64_t j = 0; j < n; j++) row[j] /= norm;
    }
}

void hadamard_rows(void *x, int64_t M, int64_t n) {
#pragma omp parallel
    hadamard_rows_in(x, M, n, 0, x);
}

/* Rows of q [N][K] (int8, or int4 values 0..15 one a byte) with their scales and (int4) minimums
 * [N][K / QBLOCK] as fp16 bits, in tiles (layout above); columns past N are zeros. */
void pack_quant_tiles(const void *q, const void *scales, const void *mins, int64_t N, int64_t K, int bits, void *out) {
    const int8_t *values = q;
    const uint16_t *scale = scales, *low = mins;
    int64_t blocks = K / QBLOCK, block_bytes = bits == 8 ? Q8_BLOCK_BYTES : Q4_BLOCK_BYTES;
    int64_t tiles = (N + TILE_COLS - 1) / TILE_COLS;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *block = (uint8_t *)out + (t * blocks + b) * block_bytes;
            uint16_t *halves = (uint16_t *)block;
            uint8_t *steps = block + (bits == 8 ? 2 : 4) * TILE_COLS;
            for (int64_t c = 0; c < TILE_COLS; c++) {
                int64_t n = t * TILE_COLS + c;
                int real = n < N;
                halves[c] = real ? scale[n * blocks + b] : 0;
                if (bits == 4) halves[TILE_COLS + c] = real ? low[n * blocks + b] : 0;
                const int8_t *row = values + n * K + b * QBLOCK;
                for (int k = 0; k < QBLOCK; k++) {
                    int s = k / 4, v = real ? row[k] : 0;
                    if (bits == 8)
                        steps[(s * TILE_COLS + c) * 4 + k % 4] = (uint8_t)v;
                    else if (s % 2 == 0)
                        steps[(s / 2 * TILE_COLS + c) * 4 + k % 4] = (uint8_t)v;
                    else
                        steps[(s / 2 * TILE_COLS + c) * 4 + k % 4] |= (uint8_t)(v << 4);
                }
            }
        }
}

static float to_half(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); }

/* A group's int4 values (two vectors of whole numbers) for scale d and minimum m, both as fp16 holds
 * them; its squared error. */
static float fit4(const vec x[2], float d, float m, vec q[2]) {
    vec step = vset1(d), low = vset1(m), error = vzero();
    for (int h = 0; h < 2; h++) {
        vec v = d > 0 ? vround(vdiv(vsub(x[h], low), step)) : vzero();
        q[h] = vmin(vset1(15.0f), vmax(vzero(), v));
        vec e = vsub(vfmadd(q[h], step, low), x[h]);
        error = vfmadd(e, e, error);
    }
    return vsum(error);
}

/* A group of int4: from its range, then `refits` rounds of least squares for the scale and minimum
 * that fit the values chosen, each kept only where it lowers the group's error (a k-quant-style
 * search, at a cost quantizing every worker start can bear). */
static void group4(const vec x[2], int refits, int8_t *out, uint16_t *scale, uint16_t *low) {
    float lo = -vhighest(vmax(vsub(vzero(), x[0]), vsub(vzero(), x[1]))), hi = vhighest(vmax(x[0], x[1]));
    float d = to_half((hi - lo) / 15), m = to_half(lo);
    vec q[2], trial[2];
    float best = fit4(x, d, m, q);
    for (int round = 0; round < refits; round++) {
        float sq = vsum(vadd(q[0], q[1])), sqq = vsum(vfmadd(q[0], q[0], vmul(q[1], q[1])));
        float sx = vsum(vadd(x[0], x[1])), sqx = vsum(vfmadd(q[0], x[0], vmul(q[1], x[1])));
        float det = QBLOCK * sqq - sq * sq; /* whole numbers under 2^24: exact */
        if (det <= 0) break;
        float fitted = (QBLOCK * sqx - sq * sx) / det;
        float d2 = to_half(fitted), m2 = to_half((sx - fitted * sq) / QBLOCK);
        float error = fit4(x, d2, m2, trial);
        if (!(d2 > 0) || error >= best) break;
        best = error, d = d2, m = m2, q[0] = trial[0], q[1] = trial[1];
    }
    int32_t values[QBLOCK];
    vstore_int(values, 0xFFFF, q[0]);
    vstore_int(values + 16, 0xFFFF, q[1]);
    for (int i = 0; i < QBLOCK; i++) out[i] = (int8_t)values[i];
    *scale = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    *low = _cvtss_sh(m, _MM_FROUND_TO_NEAREST_INT);
}

/* A group's int8 values (two vectors of whole numbers) for scale d as fp16 holds it; its squared error. */
static float fit8(const vec x[2], float d, vec q[2]) {
    vec step = vset1(d), error = vzero();
    for (int h = 0; h < 2; h++) {
        vec v = d > 0 ? vround(vdiv(x[h], step)) : vzero();
        q[h] = vmin(vset1(127.0f), vmax(vset1(-127.0f), v));
        vec e = vsub(vmul(q[h], step), x[h]);
        error = vfmadd(e, e, error);
    }
    return vsum(error);
}

/* A group of int8: symmetric, its scale max |x| / 127 as fp16 holds it, then `refits` rounds of the
 * least-squares scale for the values chosen, each kept only where it lowers the group's error. */
static void group8(const vec x[2], int refits, int8_t *out, uint16_t *scale) {
    vec high = vmax(vmax(x[0], vsub(vzero(), x[0])), vmax(x[1], vsub(vzero(), x[1])));
    float d = to_half(vhighest(high) / 127);
    vec q[2], trial[2];
    float best = fit8(x, d, q);
    for (int round = 0; round < refits; round++) {
        float qq = vsum(vfmadd(q[0], q[0], vmul(q[1], q[1]))), qx = vsum(vfmadd(q[0], x[0], vmul(q[1], x[1])));
        if (!(qq > 0)) break;
        float d2 = to_half(qx / qq), error = fit8(x, d2, trial);
        if (!(d2 > 0) || error >= best) break;
        best = error, d = d2, q[0] = trial[0], q[1] = trial[1];
    }
    int32_t values[QBLOCK];
    vstore_int(values, 0xFFFF, q[0]);
    vstore_int(values + 16, 0xFFFF, q[1]);
    for (int i = 0; i < QBLOCK; i++) out[i] = (int8_t)values[i];
    *scale = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
}

void quantize_groups(const void *w, int64_t N, int64_t K, int bf16, int bits, int refits, void *q, void *scales,
                     void *mins) {
    int64_t blocks = K / QBLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t at = n * K + b * QBLOCK;
            vec x[2] = {load16(w, at, bf16, 0xFFFF), load16(w, at + 16, bf16, 0xFFFF)};
            int8_t *group = (int8_t *)q + at;
            uint16_t *scale = (uint16_t *)scales + n * blocks + b;
            if (bits == 8)
                group8(x, refits, group, scale);
            else
                group4(x, refits, group, scale, (uint16_t *)mins + n * blocks + b);
        }
}
