/* y[M, N] = x[M, K] @ w[N, K]^T on AVX-512 or AVX2 CPUs, float32 or bfloat16, for a served model's weights.
 *
 * A decode step multiplies a few rows by every weight, so it is bound by how fast the weights
 * stream from memory. oneDNN and MKL tile for many rows and lose part of that stream at 1 to 32
 * rows (bench/kernels/matmul.py), and oneDNN's bfloat16 path is bound by vdpbf16ps, which issues
 * slower than float32 FMAs on some CPUs (bench/kernels/peak.py).
 *
 * Here the weight is packed once, at load, into tiles of TILE_COLS output columns, each tile one
 * contiguous run (ops.py packs it):
 *   float32:  [tiles][K][TILE_COLS]          a vector of 16 columns per k
 *   bfloat16: [tiles][K / 2][TILE_COLS][2]   pairs of k per column, widened to float32 in
 *                                            registers (a shift and a mask) and multiplied by FMA
 * A tile is read once per call while up to F32_ROWS or BF16_ROWS rows of x accumulate against it in
 * registers, with no horizontal sums. Threads split the tiles (OpenMP, the runtime PyTorch
 * itself loaded), and each thread prefetches its next tile while it computes, in several runs
 * at once.
 */
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "simd.h"

#define VECS (TILE_COLS / 16)
#ifdef __AVX512F__
#define F32_ROWS 8 /* 8 x 2 sums: 2 cols x 8 rows share each weight load more than 4 x 6 (bench/kernels/matmul.py) */
#define BF16_ROWS 8
#else
#define F32_ROWS 3  /* AVX2 has 16 registers: 3 rows x 4 halves of sums, 2 for the weight */
#define BF16_ROWS 4 /* widening pairs costs more than spilling (bench/kernels/matmul.py) */
/* A call of BF16_HALVES_CALL rows or more (a prompt's) is bound by arithmetic, where a whole tile's
 * sums for 4 rows (16 registers) spill at every step: it runs chunks of up to BF16_HALVES_ROWS rows a
 * half tile at a time (bf16_halves), 2 registers of sums a row. A decode step's few rows are bound
 * by memory, and whole tiles stream it best (bench/kernels/matmul.py). */
#define BF16_HALVES_ROWS 5
#define BF16_HALVES_CALL 12
#endif
/* The k each step of a tile of MT rows takes: in order, or for the tests alone (a build with
 * TPL_TEST_REMAINDER_ORDER, tests/test_kernels.py) backwards in chunks of fewer rows than a full
 * one, a row's sum then depending on the chunk its batch puts it in, which the batch-invariance
 * tests must catch. STEP is 1 for float32, 2 for bfloat16 pairs. */
#ifdef TPL_TEST_REMAINDER_ORDER
#define K_AT(k, K, MT, ROWS, STEP) ((MT) < (ROWS) ? (K) - (STEP) - (k) : (k))
#else
#define K_AT(k, K, MT, ROWS, STEP) (k)
#endif
/* How far ahead in its own tile a chunk of MT rows asks for the next lines, into L1. From 3 rows a
 * line takes long enough to compute that 8 KiB ahead keeps memory streaming; one or two rows run
 * ahead by themselves, and asking that far ahead only costs them (bench/kernels/matmul.py). */
#define NEAR_BYTES(MT) ((MT) <= 2 ? 2048 : 8192)
#define STREAMS 4       /* runs of the next tile asked for side by side */
#define X_BLOCK_BYTES (1 << 20) /* the rows of x that share one pass over the weights, kept in L2 */
#define MIN_BLOCK_ROWS 64       /* a decode step's rows always share one pass */

/* The fewest chunks of rows at which a tile call asks for the next tile (set_next_tile_min_chunks). */
static int next_tile_min_chunks = 1;

void set_next_tile_min_chunks(int chunks) { next_tile_min_chunks = chunks; }

/* What one tile call asks for of the next tile: per_step cache lines each step, from line
 * number `first` on. A call with all the rows (VECS lines a step) numbers them across STREAMS
 * runs of `run` lines in turn: the L2's hardware streamer follows each run, so more lines are in
 * flight than the core's own fill buffers allow, which counts most at 8 rows, where the FMAs leave
 * the prefetches less room. Chunks of more rows ask front to back, which beats four runs there
 * (bench/kernels/matmul.py). */
struct Ahead {
    const char *next;
    int64_t first, run;
    int per_step; /* 0, 1 or VECS */
};

/* per_step is a constant at each call, so a loop that asks for nothing carries no address
 * arithmetic (it slowed prefill's passes, bench/kernels/matmul.py at 128 rows). gcc 12's ipa-modref
 * deleted these prefetches when the struct came through a pointer to an outlined function. */
static inline __attribute__((always_inline)) void prefetch(struct Ahead a, int64_t step, const int per_step) {
    for (int i = 0; i < per_step; i++) {
        uint64_t n = (uint64_t)(a.first + step * per_step + i);
        uint64_t line = per_step == VECS ? n % STREAMS * (uint64_t)a.run + n / STREAMS : n;
        _mm_prefetch(a.next + line * 64, _MM_HINT_T1);
    }
}

/* The tile function for each prefetch count: STEPS (a tile's loops, always inlined) with it as a
 * constant. */
#define BY_PREFETCH(PREFIX, XTYPE, TYPE, MT)                                                       \
    static void PREFIX##_tile_##MT(const XTYPE *x, int64_t K, const TYPE *wt, TYPE *y, int64_t ldy, \
                                   int64_t cols, int gated, struct Ahead ahead) {                  \
        if (ahead.per_step == VECS)                                                                \
            PREFIX##_steps_##MT(x, K, wt, y, ldy, cols, gated, ahead, VECS);                       \
        else if (ahead.per_step)                                                                   \
            PREFIX##_steps_##MT(x, K, wt, y, ldy, cols, gated, ahead, 1);                          \
        else                                                                                       \
            PREFIX##_steps_##MT(x, K, wt, y, ldy, cols, gated, ahead, 0);                          \
    }

/* One tile of MT rows into y (row stride ldy), asking for its share of the next tile (`ahead`).
 * `gated`: the tile's two vectors are 16 gate and 16 up columns of a SwiGLU, and silu(gate) * up
 * goes out, 16 columns. */
#define F32_TILE(MT)                                                                               \
    static inline __attribute__((always_inline)) void f32_steps_##MT(                              \
        const float *x, int64_t K, const float *wt, float *y, int64_t ldy, int64_t cols, int gated, \
        struct Ahead ahead, const int per_step) {                                                  \
        vec acc[MT][VECS];                                                                         \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                                       \
            _Pragma("GCC unroll 4") for (int j = 0; j < VECS; j++) acc[m][j] = vzero();            \
        for (int64_t step = 0; step < K; step++) {                                                 \
            const int64_t k = K_AT(step, K, MT, F32_ROWS, 1);                                      \
            const float *wk = wt + k * TILE_COLS;                                                  \
            prefetch(ahead, step, per_step);                                                       \
            _Pragma("GCC unroll 4") for (int j = 0; j < VECS; j++) {                               \
                _mm_prefetch((const char *)wk + NEAR_BYTES(MT) + 64 * j, _MM_HINT_T0);             \
                vec w = vload(wk + 16 * j);                                                        \
                _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                               \
                    acc[m][j] = vfmadd(vset1(x[m * K + k]), w, acc[m][j]);                         \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                                       \
            put_row(y, m * ldy, acc[m][0], acc[m][1], cols, gated, 0);                           \
    }                                                                                              \
    BY_PREFETCH(f32, float, float, MT)

#ifndef __AVX512F__
/* One half of a bfloat16 tile (16 columns, `half` 0 or 1) over all of k for MT rows of float32 x, into
 * acc: each pair's weights widened in turn, its even k for every row and then its odd k (both at once,
 * as bf16_pairs widens them, hold 4 more registers and spill sums: bench/kernels/matmul.py). Each sum
 * takes the same products in the same order as a whole tile's step (bf16_step), so a row's bits do
 * not depend on the call it is in. The first half asks for the second's lines too, and for its share
 * of the next tile, so memory streams each tile once. */
static inline __attribute__((always_inline)) void bf16_half(const float *x, int64_t K, const uint16_t *wt, int half,
                                                             int MT, vec *acc, struct Ahead ahead, const int per_step) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000);
    for (int m = 0; m < MT; m++) acc[m] = vzero();
    for (int64_t step = 0; step < K; step += 2) {
        const int64_t k = K_AT(step, K, MT, BF16_HALVES_ROWS, 2);
        const uint16_t *wk = wt + k * TILE_COLS + 32 * half;
        _mm_prefetch((const char *)wk + NEAR_BYTES(MT), _MM_HINT_T0);
        if (half == 0) {
            prefetch(ahead, step / 2, per_step);
            _mm_prefetch((const char *)wk + NEAR_BYTES(MT) + 64, _MM_HINT_T1);
        }
        __m256i lo = _mm256_loadu_si256((const __m256i *)wk), hi = _mm256_loadu_si256((const __m256i *)(wk + 16));
        vec w = {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
        for (int m = 0; m < MT; m++) acc[m] = vfmadd(vset1(x[m * K + k]), w, acc[m]);
        w = (vec){_mm256_castsi256_ps(_mm256_and_si256(lo, high)), _mm256_castsi256_ps(_mm256_and_si256(hi, high))};
        for (int m = 0; m < MT; m++) acc[m] = vfmadd(vset1(x[m * K + k + 1]), w, acc[m]);
    }
}

/* A bfloat16 tile for MT rows in its two halves (bf16_half): a gated tile's gate sums wait in `gate`
 * for its up sums, so that silu(gate) * up rounds as a whole tile's does. */
#define BF16_HALVES_TILE(MT)                                                                       \
    static inline __attribute__((always_inline)) void bf16_halves_steps_##MT(                      \
        const float *x, int64_t K, const uint16_t *wt, uint16_t *y, int64_t ldy, int64_t cols,     \
        int gated, struct Ahead ahead, const int per_step) {                                       \
        vec acc[MT], gate[MT];                                                                     \
        bf16_half(x, K, wt, 0, MT, acc, ahead, per_step);                                          \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                     \
            gate[m] = acc[m];                                                                      \
            if (!gated) store16(y, m * ldy, acc[m], 1, lanes(cols));                               \
        }                                                                                          \
        if (!gated && cols <= 16) return;                                                          \
        bf16_half(x, K, wt, 1, MT, acc, ahead, per_step);                                          \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                     \
            if (gated)                                                                             \
                put_row(y, m * ldy, gate[m], acc[m], cols, 1, 1);                                  \
            else                                                                                   \
                store16(y, m * ldy + 16, acc[m], 1, lanes(cols - 16));                             \
        }                                                                                          \
    }                                                                                              \
    BY_PREFETCH(bf16_halves, float, uint16_t, MT)
#endif

/* The bfloat16 tile: pairs along k, each loaded once per step for all MT rows. */
#define BF16_TILE(MT)                                                                              \
    static inline __attribute__((always_inline)) void bf16_steps_##MT(                             \
        const BF16_X *x, int64_t K, const uint16_t *wt, uint16_t *y, int64_t ldy, int64_t cols,    \
        int gated, struct Ahead ahead, const int per_step) {                                       \
        vec acc[MT][VECS];                                                                         \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                                       \
            _Pragma("GCC unroll 4") for (int j = 0; j < VECS; j++) acc[m][j] = vzero();            \
        for (int64_t step = 0; step < K; step += 2) {                                              \
            const int64_t k = K_AT(step, K, MT, BF16_ROWS, 2);                                     \
            const uint16_t *wk = wt + k * TILE_COLS;                                               \
            prefetch(ahead, step / 2, per_step);                                                   \
            _Pragma("GCC unroll 4") for (int j = 0; j < VECS; j++) {                               \
                _mm_prefetch((const char *)wk + NEAR_BYTES(MT) + 64 * j, _MM_HINT_T0);             \
                bf16_weights w = load_bf16_weights(wk + 32 * j);                                   \
                _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                               \
                    acc[m][j] = bf16_step(acc[m][j], x + m * K + k, w);                            \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                                       \
            put_row(y, m * ldy, acc[m][0], acc[m][1], cols, gated, 1);                          \
    }                                                                                              \
    BY_PREFETCH(bf16, BF16_X, uint16_t, MT)

/* A tile function for every chunk size up to each dtype's rows, and their tables by rows - 1. */
#define TILES_3(D) D(1) D(2) D(3)
#define TILES_4(D) TILES_3(D) D(4)
#define TILES_5(D) TILES_4(D) D(5)
#define TILES_8(D) TILES_5(D) D(6) D(7) D(8)
#define BY_ROWS_3(P) P##_tile_1, P##_tile_2, P##_tile_3
#define BY_ROWS_4(P) BY_ROWS_3(P), P##_tile_4
#define BY_ROWS_5(P) BY_ROWS_4(P), P##_tile_5
#define BY_ROWS_8(P) BY_ROWS_5(P), P##_tile_6, P##_tile_7, P##_tile_8
#define PASTE(A, B) A##B
#define WITH_ROWS(MACRO, ROWS) PASTE(MACRO, ROWS) /* ROWS expanded first: TILES_8, not TILES_F32_ROWS */
WITH_ROWS(TILES_, F32_ROWS)(F32_TILE)
WITH_ROWS(TILES_, BF16_ROWS)(BF16_TILE)
#define TABLE(PREFIX, XTYPE, TYPE, ROWS)                                                           \
    static void (*const PREFIX##_by_rows[ROWS])(const XTYPE *, int64_t, const TYPE *, TYPE *, int64_t, int64_t, \
                                                int, struct Ahead) = {WITH_ROWS(BY_ROWS_, ROWS)(PREFIX)};
TABLE(f32, float, float, F32_ROWS)
TABLE(bf16, BF16_X, uint16_t, BF16_ROWS)
/* A call's chunk size at most, and its tile functions by chunk size - 1. */
#define F32_CHUNK(M) F32_ROWS
#define F32_TABLE(M) f32_by_rows
#ifdef __AVX512F__
#define BF16_CHUNK(M) BF16_ROWS
#define BF16_TABLE(M) bf16_by_rows
#else
WITH_ROWS(TILES_, BF16_HALVES_ROWS)(BF16_HALVES_TILE)
TABLE(bf16_halves, float, uint16_t, BF16_HALVES_ROWS)
#define BF16_CHUNK(M) ((M) >= BF16_HALVES_CALL ? BF16_HALVES_ROWS : BF16_ROWS)
#define BF16_TABLE(M) ((M) >= BF16_HALVES_CALL ? bf16_halves_by_rows : bf16_by_rows)
#endif

/* Rows go in near-equal chunks of at most CHUNK(M) (10 rows: 5 + 5, not 8 + 2), so every
 * chunk has enough independent sums; the tile stays in cache between chunks. In a call of
 * next_tile_min_chunks chunks or more, each chunk prefetches its share of the thread's next tile (VECS cache lines per step of the tile in
 * all), so memory keeps streaming while the later chunks compute from cache. The threads of
 * the enclosing parallel region split the tiles. */
#define TILED(XTYPE, TYPE, PREFIX, CHUNK, BY_ROWS)                                                 \
    static void PREFIX##_tiled(const XTYPE *x, int64_t M, int64_t K, const TYPE *w, int64_t N,     \
                               TYPE *y, int gated) {                                               \
        int64_t tiles = (N + TILE_COLS - 1) / TILE_COLS;                                           \
        int64_t chunks = (M + CHUNK(M) - 1) / CHUNK(M);                                            \
        int per_step = chunks < next_tile_min_chunks ? 0 : (int)((VECS + chunks - 1) / chunks);   \
        int64_t tile_bytes = K * TILE_COLS * (int64_t)sizeof(TYPE), steps = tile_bytes / (VECS * 64); \
        int64_t run = (tile_bytes / 64 + STREAMS - 1) / STREAMS; /* a short last run asks past the tile */ \
        _Pragma("omp for schedule(static)") for (int64_t t = 0; t < tiles; t++) {                  \
            const TYPE *wt = w + t * K * TILE_COLS;                                                \
            int64_t cols = N - t * TILE_COLS;                                                      \
            for (int64_t c = 0, m0 = 0; c < chunks; c++) {                                         \
                int64_t m1 = M * (c + 1) / chunks;                                                 \
                const XTYPE *xm = x + m0 * K;                                                      \
                int64_t ldy = gated ? N / 2 : N; /* gated: TILE_COLS / 2 outputs per tile */      \
                TYPE *ym = y + m0 * ldy + t * (gated ? TILE_COLS / 2 : TILE_COLS);                 \
                struct Ahead ahead = {(const char *)wt + tile_bytes, c * per_step * steps, run,            \
                                      c * per_step < VECS ? per_step : 0}; /* later: it is whole */          \
                BY_ROWS(M)[m1 - m0 - 1](xm, K, wt, ym, ldy, cols, gated, ahead);                     \
                m0 = m1;                                                                           \
            }                                                                                      \
        }                                                                                          \
    }

TILED(float, float, f32, F32_CHUNK, F32_TABLE)
TILED(BF16_X, uint16_t, bf16, BF16_CHUNK, BF16_TABLE)

/* One tile from `real` plain rows [real][K] of 4-byte units (a float32, or a pair of bfloat16
 * along k): out[k][c] = rows[c][k], zeros past row `real`. Blocks of 16 units per row keep reads a
 * cache line long and writes within 2 KiB, so packing runs near copy speed. */
static void pack_tile(const uint32_t *rows, int64_t real, int64_t K, uint32_t *out) {
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
        int64_t k1 = k0 + 16 < K ? k0 + 16 : K;
        for (int64_t c = 0; c < TILE_COLS; c++)
            for (int64_t k = k0; k < k1; k++) out[k * TILE_COLS + c] = c < real ? rows[c * K + k] : 0;
    }
}

/* One tile in AMX's layout (amx.c), K a multiple of 16 units: each 16 units (32 k of bfloat16) of
 * the tile are two runs of 1 KiB, the B operands of its two halves of 16 columns:
 * out[s][half][q][c] = rows[half * 16 + c][s * 16 + q]. */
static void pack_amx_tile(const uint32_t *rows, int64_t real, int64_t K, uint32_t *out) {
    for (int64_t s = 0; s < K / 16; s++)
        for (int64_t c = 0; c < TILE_COLS; c++)
            for (int64_t q = 0; q < 16; q++)
                out[((s * 2 + c / 16) * 16 + q) * 16 + c % 16] = c < real ? rows[c * K + s * 16 + q] : 0;
}

/* The tile layout of a plain weight [N][K]: out[t][k][c] = w[t * TILE_COLS + c][k], zeros past row N. */
void pack_tiles(const uint32_t *w, int64_t N, int64_t K, uint32_t *out, int amx) {
    int64_t tiles = (N + TILE_COLS - 1) / TILE_COLS;
    void (*pack)(const uint32_t *, int64_t, int64_t, uint32_t *) = amx && K % 16 == 0 ? pack_amx_tile : pack_tile;
    _Pragma("omp parallel for schedule(static)") for (int64_t t = 0; t < tiles; t++)
        pack(w + t * TILE_COLS * K, N - t * TILE_COLS, K, out + t * K * TILE_COLS);
}

/* Prefill rows come in blocks whose x (row_bytes a row, as the tiles read it) fits X_BLOCK_BYTES:
 * every tile of the weight meets a block from cache instead of all M rows from memory
 * (bench/kernels/matmul.py at 1024 rows), for one more pass over the weights per block. */
static int64_t rows_per_block(int64_t row_bytes, int64_t chunk) {
    int64_t rows = X_BLOCK_BYTES / row_bytes;
    rows -= rows % chunk;
    return rows < MIN_BLOCK_ROWS ? MIN_BLOCK_ROWS : rows;
}

void tiled_matmul(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, int bf16,
                  float *wide, int amx) {
    if (amx && bf16 && amx_matmul(x, M, K, w, N, y, gated, wide, 0) == TPL_OK) return;
    const BF16_X *bf16_rows = x;
    const float *rows = x;
#ifndef __AVX512BF16__
    if (bf16) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) put_bf16_x(wide + r * K, (const uint16_t *)x + r * K, K);
        bf16_rows = rows = wide;
    }
#endif
    int64_t block = rows_per_block(K * (int64_t)(bf16 ? sizeof(BF16_X) : sizeof(float)), bf16 ? BF16_CHUNK(M) : F32_ROWS);
    int64_t ldy = gated ? N / 2 : N;
    for (int64_t m0 = 0; m0 < M; m0 += block) {
        int64_t m = M - m0 < block ? M - m0 : block;
        if (bf16)
            bf16_tiled(bf16_rows + m0 * K, m, K, w, N, (uint16_t *)y + m0 * ldy, gated);
        else
            f32_tiled(rows + m0 * K, m, K, w, N, (float *)y + m0 * ldy, gated);
    }
}

/* Whether tiled_matmul reads x from `wide`: AMX packs bfloat16 rows there, and FMA tiles read
 * them widened there, but vdpbf16ps tiles read bfloat16 x as it is. */
static int reads_wide(int bf16, int amx) {
#ifdef __AVX512BF16__
    return bf16 && amx;
#else
    (void)amx;
    return bf16;
#endif
}

/* The entry point: tiled_matmul on this call's own threads; 0 on success, -1 when memory for
 * the widened or packed bfloat16 rows cannot be had. gated = 1: w is a SwiGLU's w1 and w3
 * interleaved in runs of GATE_RUN rows (ops.py), N a multiple of TILE_COLS, and y [M][N / 2] gets
 * silu(x w1^T) * (x w3^T). */
int tiled_linear(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, int bf16,
                 int amx) {
    float *wide = NULL;
    int64_t wide_rows = M < WIDE_MIN_ROWS ? WIDE_MIN_ROWS : M;
    if (reads_wide(bf16, amx) && (wide = malloc((size_t)(wide_rows * K) * sizeof(float))) == NULL)
        return TPL_NO_MEMORY;
#pragma omp parallel
    tiled_matmul(x, M, K, w, N, y, gated, bf16, wide, amx);
    free(wide);
    return TPL_OK;
}
