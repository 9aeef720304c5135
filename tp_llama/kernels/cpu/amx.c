/* bfloat16 matmuls on Intel's AMX, at every row count, on weight tiles laid out for it.
 *
 * A weight tile of TILE_COLS columns (matmul.c) holds each 32 k as two runs of 1 KiB
 * (pack_tiles with amx): AMX B operands, 16 pairs of k of 16 columns of 2 values, 64 bytes a row,
 * for the tile's two halves. The FMA tiles' layout ([K / 2][TILE_COLS][2]) holds the same 2 KiB
 * with the halves' rows interleaved, and AMX's tile loads read that (a row stride of 128 bytes)
 * every other line, which the hardware prefetchers follow badly; the contiguous runs stream as a
 * plain read does (bench/kernels/matmul.py's GB/s). Each thread takes whole weight tiles and
 * multiplies every 32-row block of x by each (by_pieces, or by_panels for a call of one block):
 * C[32][32] in four float32 tiles, A (two 16-row blocks of x) and B (the tile's two halves) in
 * the other four, TDPBF16PS over k 32 at a time. The epilogue is the decode kernel's: rounded to
 * bfloat16, or SwiGLU of a gated tile. So prefill needs no second copy of the weights.
 *
 * Built into the library only by the avx512-amx variant (build.py); elsewhere amx_matmul answers
 * TPL_NO_AMX and the decode tiles do the work. tiled_matmul (matmul.c) calls it for every bfloat16
 * call when the caller asks: at a few rows it streams the weights a little slower than the FMA
 * tiles (bench/kernels/matmul.py), but a row then gets the same bits in any batch (AMX's sums round
 * differently from the FMAs'), so seeded sampling draws the same tokens alone and under load.
 */
#include <stdlib.h>

#include "api.h"

#ifdef __AMX_BF16__
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for a state component */
#define XFEATURE_XTILEDATA 18      /* the tile registers' data */
#define X_L2_BYTES (1 << 20)       /* x up to this size stays in L2 while the weights pass over it */
#define PANEL_TILES 8              /* weight tiles that share each slab of a larger x */
#define PIECE_K 2048               /* the most k of one piece (by_pieces) */
#define PANEL_SLAB 2048            /* k of a panel's slab (by_panels): 128 KiB of a tile */
#define NEAR_K 16                  /* how far ahead a one-block call asks for its own tile's lines */
#define PREFETCH_RUNS 4            /* runs of the next tile asked for side by side (as matmul.c's) */

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

int amx_enable(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? TPL_OK : TPL_NO_AMX;
}

/* Tiles 0-3: C, 16 rows of 16 float32; 4-5: A, 16 rows of 32 bfloat16; 6-7: B, 16 pairs of 16 columns.
 * A constant: GCC does not see LDTILECFG read its operand, and dropped the stores that filled one on
 * the stack (the reserved bytes left as they were, so the load faulted). */
static const struct TileConfig TILES = {.palette = 1,
                                        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                        .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

void amx_configure(void) { _tile_loadconfig(&TILES); }

/* Step `step`'s per_step lines of `ahead`, spread over PREFETCH_RUNS runs of `run` lines (see block). */
static inline __attribute__((always_inline)) void ask_ahead(const char *ahead, int64_t step, int64_t per_step,
                                                             int64_t run) {
    for (int64_t i = step * per_step; i < step * per_step + per_step; i++)
        _mm_prefetch(ahead + (i % PREFETCH_RUNS * run + i / PREFETCH_RUNS) * 64, _MM_HINT_T1);
}

/* One k step of a block: A (x's 32 rows, packed) times B (the tile's two halves) into the sums. */
static inline __attribute__((always_inline)) void k_step(const uint16_t *a, const char *wt, int64_t k, int full) {
    _tile_loadd(4, a, 64);
    _tile_loadd(6, wt + k / 2 * 128, 64);
    _tile_loadd(7, wt + k / 2 * 128 + 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (full) {
        _tile_loadd(5, a + 16 * 32, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

static inline __attribute__((always_inline)) void store_sums(float *acc, int full) {
    _tile_stored(0, acc, 128);
    _tile_stored(1, acc + 16, 128);
    if (full) {
        _tile_stored(2, acc + 16 * 32, 128);
        _tile_stored(3, acc + 16 * 32 + 16, 128);
    }
}

/* A block's finished sums (float32 [32][32]) and where its rows go: y's rows from `next` on are
 * still to be written. */
struct Rows {
    const float *sums;
    uint16_t *y;
    int64_t ldy, rows, cols, next;
    int gated;
};

/* The epilogue of one row: rounded to bfloat16, or SwiGLU of a gated tile (16 outputs). */
static inline __attribute__((always_inline)) void epilogue_row(struct Rows *r) {
    const int64_t m = r->next++;
    vec lo = vload(r->sums + m * 32), hi = vload(r->sums + m * 32 + 16);
    if (r->gated) {
        store16(r->y + m * r->ldy, 0, swiglu16(lo, hi, 1), 1, 0xFFFF);
        return;
    }
    store16(r->y + m * r->ldy, 0, lo, 1, lanes(r->cols));
    store16(r->y + m * r->ldy + 16, 0, hi, 1, lanes(r->cols - 16));
}

/* The rows still waiting in r. */
static inline void finish(struct Rows *r) {
    while (r->next < r->rows) epilogue_row(r);
}

/* The product of a 32-row block of x, packed (pack_rows), and weight tile wt, over k in [k0, k1):
 * added to the sums in acc (float32 [32][32]) unless `first`, and left there; if `last`, its rows
 * (up to `rows` of them) wait in `before` for the epilogue into y (see below). ahead: weight the
 * thread needs next (NULL: none), asked for per_step lines a k step, in PREFETCH_RUNS interleaved
 * runs that the L2's streamer follows: a prefill call reads each tile once per row block, from L2
 * after the first (by_pieces). streams: a one-block call reads its tile once, straight from
 * memory, and asks only for the tile's lines NEAR_K ahead into L1 (by_panels); it also asks to own
 * the lines of y that its epilogue writes a block later: without that, those stores miss while
 * the weights stream, and a decode step of several rows pays for them (bench/engine/step.py).
 * Prefill's blocks (by_pieces) do not ask: there the asks cost more than the misses
 * (bench/engine/generate.py's prefill).
 * The epilogue runs a block late: the rows of the block before (`before`) go out one every other
 * k step, beside the AMX work, and all of them before acc is stored to (so one acc can serve both);
 * a last block leaves its own rows in `before`, for the next block or the caller (finish). Run after
 * the sums, SwiGLU's exp and the stores into y's rows (16 KiB apart for w1/w3) had held AMX idle;
 * beside the AMX work they cost about nothing (bench/kernels/matmul.py at prefill's rows). */
static inline __attribute__((always_inline)) void
block(const uint16_t *packed, const char *wt, const char *ahead, int64_t per_step, int streams, int64_t k0, int64_t k1,
      int first, int last, float *acc, uint16_t *y, int64_t ldy, int64_t rows, int64_t cols, int gated,
      struct Rows *before) {
    const int64_t run = per_step * ((k1 - k0) / 32) / PREFETCH_RUNS; /* lines of `ahead` in each run */
    const int full = rows > 16; /* else the block's second 16 rows are padding: half the work */
    if (last && streams) /* the lines of y that this block's epilogue will write, owned before it runs */
        for (int64_t m = 0; m < rows; m++) {
            _m_prefetchw(y + m * ldy);
            _m_prefetchw(y + m * ldy + (gated ? TILE_COLS / 2 : TILE_COLS) - 1);
        }
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, acc, 128);
        _tile_loadd(1, acc + 16, 128);
        if (full) {
            _tile_loadd(2, acc + 16 * 32, 128);
            _tile_loadd(3, acc + 16 * 32 + 16, 128);
        }
    }
    for (int64_t k = k0; k < k1; k += 32) {
        const uint16_t *a = packed + k * 32; /* 32 rows x 32 k, 2 KiB */
        if (ahead != NULL) ask_ahead(ahead, (k - k0) / 32, per_step, run); /* the step's lines of what comes next */
        if (streams) /* the tile's lines NEAR_K ahead into L1 */
            for (int i = 0; i < 32; i++) _mm_prefetch(wt + (k + NEAR_K) / 2 * 128 + i * 64, _MM_HINT_T0);
        k_step(a, wt, k, full);
        if (k & 32 && before->next < before->rows) epilogue_row(before);
    }
    finish(before);
    store_sums(acc, full);
    if (last) *before = (struct Rows){acc, y, ldy, rows, cols, 0, gated};
}

/* x [M][K] as 32-row blocks of [K / 32][32 rows][32 k] (zeros past row M), so an A tile is 1 KiB
 * in one piece rather than 16 rows K apart. The threads split the blocks' k. */
static void pack_rows(const uint16_t *x, int64_t M, int64_t K, uint16_t *packed) {
    int64_t blocks = (M + 31) / 32, kb = K / 32;
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t k = 0; k < kb; k++)
            for (int64_t r = 0; r < 32; r++) {
                int64_t row = b * 32 + r;
                __m512i v = row < M ? _mm512_loadu_si512(x + row * K + k * 32) : _mm512_setzero_si512();
                _mm512_storeu_si512(packed + ((b * kb + k) * 32 + r) * 32, v);
            }
}

/* Where tile t's outputs for row block b start in y, and the distance between their rows: y
 * [M][width] plainly, or (AMX_PACKED_Y) in pack_rows' layout, the next matmul's x with K = width:
 * a tile's 32 columns (16 if gated) are one run of a row's 32 k. */
static uint16_t *tile_out(void *y, int64_t b, int64_t t, int64_t width, int gated, int packed, int64_t *ldy) {
    const int64_t col = t * (gated ? TILE_COLS / 2 : TILE_COLS);
    *ldy = packed ? 32 : width;
    if (packed) return (uint16_t *)y + ((b * (width / 32) + col / 32) * 32) * 32 + col % 32;
    return (uint16_t *)y + b * 32 * width + col;
}

/* Several row blocks: k in pieces of at most PIECE_K, rows in chunks whose packed x of one piece
 * stays in L2 (X_L2_BYTES). Every row block of a chunk meets each tile over the piece's k, the sums
 * in the tile registers from its first k to its last (a store and reload of the sums every 256 k
 * stalls AMX), while the tile comes from L2 after its first block; the next tile is asked for in
 * shares, one per row block, and each block's epilogue runs during the next
 * block's k steps (block). Each chunk after the first is one more pass over the weights (from L3
 * while they fit). Where k takes several pieces (w2's 8,192), the sums of each (block, tile) wait
 * in memory between pieces, which beats panels of 8 tiles in k slabs of 256 at prefill's row counts
 * (bench/kernels/matmul.py). Without memory for those sums, k goes in one piece. */
static void by_pieces(const uint16_t *packed, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated,
                      int packed_y) {
    const int64_t tiles = (N + TILE_COLS - 1) / TILE_COLS, width = gated ? N / 2 : N, blocks = (M + 31) / 32;
    const int64_t tile_bytes = K * TILE_COLS * 2, threads = omp_get_num_threads();
    int64_t piece = K < PIECE_K ? K : PIECE_K, chunk = X_L2_BYTES / (piece * 2) / 32;
    chunk = chunk < 1 ? 1 : chunk < blocks ? chunk : blocks;
    float one[32 * 32] __attribute__((aligned(64))), *acc = NULL;
    if (piece < K && (acc = aligned_alloc(64, (size_t)(chunk * ((tiles + threads - 1) / threads)) * 32 * 32 *
                                                   sizeof(float))) == NULL)
        piece = K;
    struct Rows before = {0};
    for (int64_t c0 = 0; c0 < blocks; c0 += chunk) {
        const int64_t c1 = c0 + chunk < blocks ? c0 + chunk : blocks, share = piece * TILE_COLS * 2 / (c1 - c0);
        for (int64_t k0 = 0; k0 < K; k0 += piece) {
            const int64_t k1 = k0 + piece < K ? k0 + piece : K;
            int64_t slot = 0; /* this thread's (tile, block) pairs in order: the same tiles for every piece */
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < tiles; t++) {
                const char *wt = (const char *)w + t * tile_bytes;
                const char *next = t + 1 < tiles ? wt + tile_bytes + k0 / 2 * 128 : NULL;
                for (int64_t b = c0; b < c1; b++, slot++) {
                    int64_t ldy;
                    uint16_t *out = tile_out(y, b, t, width, gated, packed_y, &ldy);
                    block(packed + b * 32 * K, wt, next != NULL ? next + (b - c0) * share : NULL, 32 / (c1 - c0), 0,
                          k0, k1, k0 == 0, k1 == K, acc != NULL ? acc + slot * 32 * 32 : one, out, ldy,
                          M - b * 32 < 32 ? M - b * 32 : 32, N - t * TILE_COLS, gated, &before);
                }
            }
        }
        finish(&before);
#pragma omp barrier
    }
    free(acc);
}

/* One row block (a decode step's rows): a tile at a time, or for x too wide to stay in L2 a panel
 * of tiles that each slab of x serves while the weights stream from memory once a call. Nothing of
 * the next tile is asked for ahead, only the own tile's lines just ahead (NEAR_K): on the
 * contiguous runs the hardware streams the rest, and asking for the next tile into L2 (which
 * prefill's calls need, by_pieces) slows that stream (bench/kernels/matmul.py at 1-32 rows). */
static void by_panels(const uint16_t *packed, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated,
                      int packed_y) {
    const int64_t tiles = (N + TILE_COLS - 1) / TILE_COLS, width = gated ? N / 2 : N;
    const int64_t panel = M * K * 2 > X_L2_BYTES ? PANEL_TILES : 1;
    float *acc = NULL; /* a panel's sums wait here between slabs */
    if (panel > 1) acc = aligned_alloc(64, (size_t)panel * 32 * 32 * sizeof(float));
    const int64_t slab = acc != NULL ? PANEL_SLAB : K; /* or no memory for the sums: whole k at once */
    float one[32 * 32] __attribute__((aligned(64)));
    struct Rows before = {0};
#pragma omp for schedule(static) nowait
    for (int64_t p0 = 0; p0 < tiles; p0 += panel) {
        const int64_t p1 = p0 + panel < tiles ? p0 + panel : tiles;
        for (int64_t k0 = 0; k0 < K; k0 += slab) {
            const int64_t k1 = k0 + slab < K ? k0 + slab : K;
            for (int64_t t = p0; t < p1; t++) {
                int64_t ldy;
                uint16_t *out = tile_out(y, 0, t, width, gated, packed_y, &ldy);
                block(packed, (const char *)w + t * K * TILE_COLS * 2, NULL, 0, 1, k0, k1, k0 == 0, k1 == K,
                      acc != NULL ? acc + (t - p0) * 32 * 32 : one, out, ldy, M, N - t * TILE_COLS, gated, &before);
            }
        }
    }
    finish(&before);
#pragma omp barrier
    free(acc);
}

int amx_matmul(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, void *scratch,
               int layout) {
    const int64_t blocks = (M + 31) / 32;
    const uint16_t *packed = x;
    if (K % 32 || layout & AMX_PACKED_Y && (gated ? N / 2 : N) % 32) return TPL_NO_AMX;
    amx_configure();
    if (!(layout & AMX_PACKED_X)) {
        pack_rows(x, M, K, scratch); /* ends in a barrier: x is whole before use */
        packed = scratch;
    }
    if (blocks > 1)
        by_pieces(packed, M, K, w, N, y, gated, layout & AMX_PACKED_Y);
    else
        by_panels(packed, M, K, w, N, y, gated, layout & AMX_PACKED_Y);
    _tile_release();
    return TPL_OK;
}

#else

int amx_enable(void) { return TPL_NO_AMX; }

void amx_configure(void) {}

int amx_matmul(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, void *scratch,
               int layout) {
    (void)x, (void)M, (void)K, (void)w, (void)N, (void)y, (void)gated, (void)scratch, (void)layout;
    return TPL_NO_AMX;
}

#endif
