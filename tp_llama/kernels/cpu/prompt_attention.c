/* A prompt chunk's causal attention: its rows at positions start .. start + rows - 1 of a sequence
 * against the sequence's keys and values up to each row, read from the paged cache (where
 * rope_prompt_rows has written the chunk's own).
 *
 * PyTorch's flash kernel, built for long queries, runs prompts of a few hundred tokens far below the
 * CPU's matmul rate, with AMX and without (bench/kernels/attention.py). Every KV head's keys and values
 * are laid out once as pairs along the dot product, 16 keys (or dims) a row: the B operands of AMX
 * tiles, or the operands of vdpbf16ps (bf16_step in simd.h: FMAs on widened pairs in the builds
 * without it). Then each 16-row block of a query head scores its visible keys in float32 (the
 * products of bfloat16 exact), takes the exact softmax of each row in registers, and multiplies the
 * probabilities, rounded to bfloat16 as PyTorch's kernel rounds them, by the values. A block's
 * scores are all kept (16 rows x the chunk's keys), so there is no running rescale.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "simd.h"

/* Where key j of a KV head's cache (cache [n_blocks * block_size][hd]) lies, by the row's block table. */
static inline const uint16_t *cached(const uint16_t *cache, const int64_t *table, int64_t block_size, int64_t j,
                                     int64_t hd) {
    return cache + (table[j / block_size] * block_size + j % block_size) * hd;
}

/* One KV head's `keys` keys, per 16 keys and 32 dims: [16 pairs of dims][16 keys][2] (so a 16-key
 * block's pairs follow each other, hd * 16 elements a block), and its values, per 32 keys and 16
 * dims: [16 pairs of keys][16 dims][2]. Keys past the last are zeros (a probability of 0 times a
 * zero value). */
static void lay_out_head(const uint16_t *cache_k, const uint16_t *cache_v, const int64_t *table, int64_t block_size,
                         int64_t keys, int64_t hd, uint16_t *kt, uint16_t *vv, int64_t padded) {
    memset(kt, 0, (size_t)padded * hd * 2);
    memset(vv + keys / 32 * 32 * hd, 0, (size_t)(padded - keys / 32 * 32) * hd * 2); /* the last 32 keys' */
    for (int64_t j = 0; j < keys; j++) {
        const uint16_t *key = cached(cache_k, table, block_size, j, hd);
        for (int64_t d = 0; d < hd; d += 2) { /* pair d/2 of key j */
            uint16_t *tile = kt + ((j / 16) * (hd / 32) + d / 32) * 512;
            memcpy(tile + ((d % 32) / 2) * 32 + (j % 16) * 2, key + d, 4);
        }
    }
    /* values two keys at a time: 16 dims of key j and of key j + 1, interleaved, are a row */
    const __m256i none = _mm256_setzero_si256();
    for (int64_t j = 0; j < keys; j += 2) {
        const uint16_t *first = cached(cache_v, table, block_size, j, hd);
        const uint16_t *second = j + 1 < keys ? cached(cache_v, table, block_size, j + 1, hd) : NULL;
        for (int64_t d = 0; d < hd; d += 16) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(first + d));
            const __m256i b = second != NULL ? _mm256_loadu_si256((const __m256i *)(second + d)) : none;
            /* unpack interleaves within 128-bit lanes: dims 0-3 and 8-11, then 4-7 and 12-15 */
            const __m256i low = _mm256_unpacklo_epi16(a, b), high = _mm256_unpackhi_epi16(a, b);
            uint16_t *row = vv + ((j / 32) * (hd / 16) + d / 16) * 512 + ((j % 32) / 2) * 32;
            _mm256_storeu_si256((__m256i *)row, _mm256_permute2x128_si256(low, high, 0x20));
            _mm256_storeu_si256((__m256i *)(row + 16), _mm256_permute2x128_si256(low, high, 0x31));
        }
    }
}

#ifdef __AMX_BF16__
/* Scores s [16][lds] of the block's q [16][hd] (its first n rows real) against 16-key blocks 0 .. kb - 1,
 * in tiles: four blocks at once, four independent sums for the tile unit. A tile takes all 16 rows. */
static void scores(const BF16_X *q, int64_t n, int64_t hd, const uint16_t *kt, int64_t kb, float *s, int64_t lds) {
    (void)n;
    const int64_t next_block = hd * 16;
    int64_t b = 0;
    for (; b + 4 <= kb; b += 4) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t d = 0; d < hd; d += 32) {
            const uint16_t *t = kt + b * next_block + d / 32 * 512;
            _tile_loadd(4, q + d, hd * 2);
            _tile_loadd(6, t, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, t + next_block, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, t + 2 * next_block, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, t + 3 * next_block, 64);
            _tile_dpbf16ps(3, 4, 7);
        }
        _tile_stored(0, s + b * 16, lds * 4);
        _tile_stored(1, s + b * 16 + 16, lds * 4);
        _tile_stored(2, s + b * 16 + 32, lds * 4);
        _tile_stored(3, s + b * 16 + 48, lds * 4);
    }
    for (; b < kb; b++) {
        _tile_zero(0);
        for (int64_t d = 0; d < hd; d += 32) {
            _tile_loadd(4, q + d, hd * 2);
            _tile_loadd(6, kt + b * next_block + d / 32 * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, s + b * 16, lds * 4);
    }
}

/* O [16][hd] = P [16][ldp] V over ks 32-key steps: four 16-dim column tiles at a time. */
static void values(const BF16_X *p, int64_t n, int64_t ldp, const uint16_t *vv, int64_t hd, int64_t ks, float *o) {
    (void)n;
    for (int64_t w0 = 0; w0 < hd / 16; w0 += 4) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < ks; s++) {
            const uint16_t *b = vv + (s * (hd / 16) + w0) * 512;
            _tile_loadd(4, p + s * 32, ldp * 2);
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, b + 1024, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, b + 1536, 64);
            _tile_dpbf16ps(3, 4, 7);
        }
        _tile_stored(0, o + w0 * 16, hd * 4);
        _tile_stored(1, o + w0 * 16 + 16, hd * 4);
        _tile_stored(2, o + w0 * 16 + 32, hd * 4);
        _tile_stored(3, o + w0 * 16 + 48, hd * 4);
    }
}

static void start_thread(void) { amx_configure(); }
static void end_thread(void) { _tile_release(); }

#else
#ifdef __AVX512F__
/* 8 rows x 2 key blocks of sums, and 4 rows x 4 groups of 16 dims for the values: 16 of 32 registers */
#define SCORE_ROWS 8
#define SCORE_BLOCKS 2
#define VALUE_ROWS 4
#define VALUE_COLS 4
#else
/* AVX2's 16 registers: a sum is two, a pair of widened weights four. Four rows share each widened
 * pair (8 sums), where two rows against two key blocks spilled and one row a value pair widened it for
 * that row alone (bench/kernels/attention.py). */
#define SCORE_ROWS 4
#define SCORE_BLOCKS 1
#define VALUE_ROWS 4
#define VALUE_COLS 1
#endif

/* The same by bf16_step, SCORE_ROWS rows at a time against SCORE_BLOCKS 16-key blocks (the keys are
 * laid out to a multiple of 32, and lds holds them), for the groups of rows that hold real ones: a
 * short chunk's block (a cached prefix's few new tokens) skips its padding. */
static void scores(const BF16_X *q, int64_t n, int64_t hd, const uint16_t *kt, int64_t kb, float *s, int64_t lds) {
    const int64_t next_block = hd * 16;
    for (int64_t r0 = 0; r0 < n; r0 += SCORE_ROWS)
        for (int64_t b = 0; b < kb; b += SCORE_BLOCKS) {
            const uint16_t *t = kt + b * next_block;
            vec acc[SCORE_ROWS][SCORE_BLOCKS];
            _Pragma("GCC unroll 8") for (int r = 0; r < SCORE_ROWS; r++)
                _Pragma("GCC unroll 2") for (int i = 0; i < SCORE_BLOCKS; i++) acc[r][i] = vzero();
            for (int64_t d = 0; d < hd; d += 2) {
                _Pragma("GCC unroll 2") for (int i = 0; i < SCORE_BLOCKS; i++) {
                    const bf16_weights k = load_bf16_weights(t + i * next_block + d * 16);
                    _Pragma("GCC unroll 8") for (int r = 0; r < SCORE_ROWS; r++)
                        acc[r][i] = bf16_step(acc[r][i], q + (r0 + r) * hd + d, k);
                }
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < SCORE_ROWS; r++)
                _Pragma("GCC unroll 2") for (int i = 0; i < SCORE_BLOCKS; i++)
                    vstore(s + (r0 + r) * lds + (b + i) * 16, acc[r][i]);
        }
}

static void values(const BF16_X *p, int64_t n, int64_t ldp, const uint16_t *vv, int64_t hd, int64_t ks, float *o) {
    for (int64_t r0 = 0; r0 < n; r0 += VALUE_ROWS)
        for (int64_t w0 = 0; w0 < hd / 16; w0 += VALUE_COLS) {
            vec acc[VALUE_ROWS][VALUE_COLS];
            _Pragma("GCC unroll 8") for (int r = 0; r < VALUE_ROWS; r++)
                _Pragma("GCC unroll 4") for (int w = 0; w < VALUE_COLS; w++) acc[r][w] = vzero();
            for (int64_t j = 0; j < ks * 32; j += 2) { /* a pair of keys */
                const uint16_t *b = vv + ((j / 32) * (hd / 16) + w0) * 512 + (j % 32) * 16;
                _Pragma("GCC unroll 4") for (int w = 0; w < VALUE_COLS; w++) {
                    const bf16_weights pair = load_bf16_weights(b + w * 512);
                    _Pragma("GCC unroll 8") for (int r = 0; r < VALUE_ROWS; r++)
                        acc[r][w] = bf16_step(acc[r][w], p + (r0 + r) * ldp + j, pair);
                }
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < VALUE_ROWS; r++)
                _Pragma("GCC unroll 4") for (int w = 0; w < VALUE_COLS; w++)
                    vstore(o + (r0 + r) * hd + (w0 + w) * 16, acc[r][w]);
        }
}

static void start_thread(void) {}
static void end_thread(void) {}
#endif

/* 16 probabilities rounded to bfloat16, stored as BF16_X. */
static inline void put_probs(BF16_X *to, vec e) {
#ifdef __AVX512BF16__
    store16(to, 0, e, 1, 0xFFFF);
#else
    vstore(to, as_stored(e, 1));
#endif
}

/* Rows r0 .. r0 + 15 (those under `rows`) of query head h against KV head g's laid-out keys and values;
 * row r is at position start + r. q and the probabilities are held as bf16_step reads its x (BF16_X). */
static void attend_block(const uint16_t *qkv, int64_t rows, int64_t ld, int64_t start, int64_t h, int64_t hd,
                         int64_t r0, const uint16_t *kt, const uint16_t *vv, uint16_t *out, int64_t ld_out,
                         BF16_X *q, float *s, BF16_X *p, float *o) {
    const int64_t n = rows - r0 < 16 ? rows - r0 : 16, keys = start + r0 + n, kb = (keys + 15) / 16;
    const int64_t ks = (keys + 31) / 32, ldp = ks * 32;
    memset(q + n * hd, 0, (size_t)(16 - n) * hd * sizeof(BF16_X));
    for (int64_t r = 0; r < n; r++) put_bf16_x(q + r * hd, qkv + (r0 + r) * ld + h * hd, hd);
    scores(q, n, hd, kt, kb, s, ldp);
    const vec scale = vset1(1.0f / sqrtf((float)hd));
    float total[16];
    for (int64_t r = 0; r < 16; r++) {
        const int64_t seen = r < n ? start + r0 + r + 1 : 0; /* causal: key j <= its position */
        float *row = s + r * ldp;
        vec top = vset1(-INFINITY);
        for (int64_t j = 0; j < seen; j += 16) {
            const mask16 m = lanes(seen - j);
            top = vmax_in(top, m, top, vmul(vloadz(m, row + j), scale));
        }
        const vec high = vset1(vhighest(top));
        vec sum = vzero();
        int64_t j = 0;
        for (; j < seen; j += 16) {
            const mask16 m = lanes(seen - j);
            const vec e = vkeep(m, exp16(vsub(vmul(vloadz(m, row + j), scale), high)));
            sum = vadd(sum, e);
            put_probs(p + r * ldp + j, e);
        }
        /* past the visible keys nothing is loaded: masked loads of scratch that scores never wrote
         * (the rows past a short chunk's) stalled the whole kernel (bench/kernels/attention.py) */
        for (; j < ldp; j += 16) put_probs(p + r * ldp + j, vzero());
        total[r] = vsum(sum);
    }
    values(p, n, ldp, vv, hd, ks, o);
    for (int64_t r = 0; r < n; r++) {
        const vec inv = vset1(1.0f / total[r]);
        uint16_t *row = out + (r0 + r) * ld_out + h * hd;
        for (int64_t d = 0; d < hd; d += 16) store16(row, d, vmul(vload(o + r * hd + d), inv), 1, 0xFFFF);
    }
}

int prompt_attention(const void *qkv, int64_t rows, int64_t ld, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                     const void *cache_k, const void *cache_v, int64_t n_blocks, int64_t block_size,
                     const int64_t *table, int64_t start, void *out, int64_t ld_out) {
    if (head_dim % 64 || head_dim > MAX_HEAD_DIM || n_heads % n_kv_heads) return TPL_HEAD_DIM;
    if (rows <= 0) return TPL_OK;
    const int64_t keys = start + rows;
    if (start < 0 || blocks_in_cache(table, keys - 1, block_size, n_blocks)) return TPL_OFF_CACHE;
    const int64_t hd = head_dim, rep = n_heads / n_kv_heads, padded = (keys + 31) / 32 * 32, blocks = (rows + 15) / 16;
    const int64_t per_thread = (16 * hd + 16 * padded) * (int64_t)sizeof(BF16_X) + 16 * padded * 4 + 16 * hd * 4 + 256;
    const int threads = omp_get_max_threads();
    char *heads = aligned_alloc(64, (size_t)(n_kv_heads * 2 * padded * hd * 2));
    char *scratch = aligned_alloc(64, (size_t)(threads * per_thread));
    if (heads == NULL || scratch == NULL) {
        free(heads);
        free(scratch);
        return TPL_NO_MEMORY;
    }
    const uint16_t *x = qkv;
#pragma omp parallel
    {
        start_thread();
#pragma omp for schedule(static)
        for (int64_t g = 0; g < n_kv_heads; g++) {
            uint16_t *kt = (uint16_t *)heads + g * 2 * padded * hd;
            const int64_t head = g * n_blocks * block_size * hd;
            lay_out_head((const uint16_t *)cache_k + head, (const uint16_t *)cache_v + head, table, block_size, keys,
                         hd, kt, kt + padded * hd, padded);
        }
        char *mine = scratch + omp_get_thread_num() * per_thread;
        BF16_X *q = (BF16_X *)mine;
        float *s = (float *)(q + 16 * hd);
        BF16_X *p = (BF16_X *)((char *)s + 16 * padded * 4);
        float *o = (float *)(p + 16 * padded);
        /* later blocks see more keys: dealt out one at a time, so each thread gets early and late ones */
#pragma omp for schedule(static, 1)
        for (int64_t item = 0; item < n_heads * blocks; item++) {
            const int64_t h = item / blocks, b = item % blocks, g = h / rep;
            const uint16_t *kt = (const uint16_t *)heads + g * 2 * padded * hd;
            attend_block(x, rows, ld, start, h, hd, b * 16, kt, kt + padded * hd, out, ld_out, q, s, p, o);
        }
        end_thread();
    }
    free(heads);
    free(scratch);
    return TPL_OK;
}
