/* A prompt chunk's causal attention on AMX: its rows at positions start .. start + rows - 1 of a
 * sequence against the sequence's keys and values up to each row, read from the paged cache (where
 * rope_prompt_rows has written the chunk's own).
 *
 * PyTorch's flash kernel ran 270-370 GFLOPS on prompts of 200-256 tokens here (0.76-1.05 ms a layer
 * of the 1B shape; this kernel 0.41-0.54). Every KV head's keys and values are laid out once as
 * AMX B operands, then each 16-row block of a query head scores its visible keys in float32 tiles
 * (the products of bfloat16 exact), takes the exact softmax of each row in registers, and
 * multiplies the probabilities, rounded to bfloat16 as PyTorch's kernel rounds them, by the values.
 * A block's scores are all kept (16 rows x the chunk's keys), so there is no running rescale.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"

#ifdef __AMX_BF16__
#include <omp.h>

#include "simd.h"

/* Where key j of a KV head's cache (cache [n_blocks * block_size][hd]) lies, by the row's block table. */
static inline const uint16_t *cached(const uint16_t *cache, const int64_t *table, int64_t block_size, int64_t j,
                                     int64_t hd) {
    return cache + (table[j / block_size] * block_size + j % block_size) * hd;
}

/* One KV head's `keys` keys as B tiles of S = Q K^T: per 16 keys and 32 dims, [16 pairs of dims][16 keys][2],
 * and its values as B tiles of O = P V: per 32 keys and 16 dims, [16 pairs of keys][16 dims][2].
 * Keys past the last are zeros (a probability of 0 times a zero value). */
static void lay_out_head(const uint16_t *cache_k, const uint16_t *cache_v, const int64_t *table, int64_t block_size,
                         int64_t keys, int64_t hd, uint16_t *kt, uint16_t *vv, int64_t padded) {
    memset(kt, 0, (size_t)padded * hd * 2);
    memset(vv + keys / 32 * 32 * hd, 0, (size_t)(padded - keys / 32 * 32) * hd * 2); /* the last 32 keys' tiles */
    for (int64_t j = 0; j < keys; j++) {
        const uint16_t *key = cached(cache_k, table, block_size, j, hd);
        for (int64_t d = 0; d < hd; d += 2) { /* pair d/2 of key j */
            uint16_t *tile = kt + ((j / 16) * (hd / 32) + d / 32) * 512;
            memcpy(tile + ((d % 32) / 2) * 32 + (j % 16) * 2, key + d, 4);
        }
    }
    /* values two keys at a time: 16 dims of key j and of key j + 1, interleaved, are a row of a tile */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t j = 0; j < keys; j += 2) {
        const uint16_t *first = cached(cache_v, table, block_size, j, hd);
        const uint16_t *second = j + 1 < keys ? cached(cache_v, table, block_size, j + 1, hd) : NULL;
        for (int64_t d = 0; d < hd; d += 16) {
            const __m512i both = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(first + d))),
                second != NULL ? _mm256_loadu_si256((const __m256i *)(second + d)) : _mm256_setzero_si256(), 1);
            _mm512_storeu_si512(vv + ((j / 32) * (hd / 16) + d / 16) * 512 + ((j % 32) / 2) * 32,
                                _mm512_permutexvar_epi16(pairs, both));
        }
    }
}

/* Four 16-dim column tiles of O (C tiles 0-3) over the block's ks 32-key steps, from dims w0 on. */
static void values_times(const uint16_t *p, int64_t ldp, const uint16_t *vv, int64_t hd, int64_t ks, int64_t w0,
                         float *o, int64_t ldo) {
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
    _tile_stored(0, o + w0 * 16, ldo * 4);
    _tile_stored(1, o + w0 * 16 + 16, ldo * 4);
    _tile_stored(2, o + w0 * 16 + 32, ldo * 4);
    _tile_stored(3, o + w0 * 16 + 48, ldo * 4);
}

/* Rows r0 .. r0 + 15 (those under `rows`) of query head h against KV head g's laid-out keys and values;
 * row r is at position start + r. */
static void attend_block(const uint16_t *qkv, int64_t rows, int64_t ld, int64_t start, int64_t h, int64_t hd,
                         int64_t r0, const uint16_t *kt, const uint16_t *vv, uint16_t *out, int64_t ld_out,
                         uint16_t *q, float *s, uint16_t *p, float *o) {
    const int64_t n = rows - r0 < 16 ? rows - r0 : 16, keys = start + r0 + n, kb = (keys + 15) / 16;
    const int64_t ks = (keys + 31) / 32;
    const int64_t lds = kb * 16, ldp = ks * 32;
    memset(q, 0, 16 * hd * 2);
    for (int64_t r = 0; r < n; r++) memcpy(q + r * hd, qkv + (r0 + r) * ld + h * hd, hd * 2);
    const int64_t next_block = hd / 32 * 512; /* elements from one 16-key block's tiles to the next's */
    int64_t b = 0;
    for (; b + 4 <= kb; b += 4) { /* four blocks at once: four independent sums for the tile unit */
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
    const vec scale = vset1(1.0f / sqrtf((float)hd));
    float total[16];
    for (int64_t r = 0; r < 16; r++) {
        const int64_t seen = r < n ? start + r0 + r + 1 : 0; /* causal: key j <= its position */
        float *row = s + r * lds;
        vec top = vset1(-INFINITY);
        for (int64_t j = 0; j < seen; j += 16) {
            const mask16 m = lanes(seen - j);
            top = vmax_in(top, m, top, vmul(vloadz(m, row + j), scale));
        }
        const vec high = vset1(vhighest(top));
        vec sum = vzero();
        for (int64_t j = 0; j < ldp; j += 16) {
            const mask16 m = lanes(seen - j);
            const vec e = vkeep(m, exp16(vsub(vmul(vloadz(m, row + j), scale), high)));
            sum = vadd(sum, e);
            store16(p + r * ldp, j, e, 1, 0xFFFF);
        }
        total[r] = vsum(sum);
    }
    for (int64_t w0 = 0; w0 < hd / 16; w0 += 4) values_times(p, ldp, vv, hd, ks, w0, o, hd);
    for (int64_t r = 0; r < n; r++) {
        const vec inv = vset1(1.0f / total[r]);
        uint16_t *row = out + (r0 + r) * ld_out + h * hd;
        for (int64_t d = 0; d < hd; d += 16) store16(row, d, vmul(vloadz(0xFFFF, o + r * hd + d), inv), 1, 0xFFFF);
    }
}

int prompt_attention(const void *qkv, int64_t rows, int64_t ld, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                     const void *cache_k, const void *cache_v, int64_t n_blocks, int64_t block_size,
                     const int64_t *table, int64_t start, void *out, int64_t ld_out) {
    if (head_dim % 64 || head_dim > MAX_HEAD_DIM || n_heads % n_kv_heads) return TPL_NO_AMX;
    if (rows <= 0) return TPL_OK;
    const int64_t keys = start + rows;
    if (start < 0 || blocks_in_cache(table, keys - 1, block_size, n_blocks)) return TPL_OFF_CACHE;
    const int64_t hd = head_dim, rep = n_heads / n_kv_heads, padded = (keys + 31) / 32 * 32, blocks = (rows + 15) / 16;
    const int64_t per_thread = 16 * hd * 2 + 16 * padded * 4 + 16 * padded * 2 + 16 * hd * 4 + 256;
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
        amx_configure();
#pragma omp for schedule(static)
        for (int64_t g = 0; g < n_kv_heads; g++) {
            uint16_t *kt = (uint16_t *)heads + g * 2 * padded * hd;
            const int64_t head = g * n_blocks * block_size * hd;
            lay_out_head((const uint16_t *)cache_k + head, (const uint16_t *)cache_v + head, table, block_size, keys,
                         hd, kt, kt + padded * hd, padded);
        }
        char *mine = scratch + omp_get_thread_num() * per_thread;
        uint16_t *q = (uint16_t *)mine;
        float *s = (float *)(mine + 16 * hd * 2);
        uint16_t *p = (uint16_t *)((char *)s + 16 * padded * 4);
        float *o = (float *)((char *)p + 16 * padded * 2);
        /* later blocks see more keys: dealt out one at a time, so each thread gets early and late ones */
#pragma omp for schedule(static, 1)
        for (int64_t item = 0; item < n_heads * blocks; item++) {
            const int64_t h = item / blocks, b = item % blocks, g = h / rep;
            const uint16_t *kt = (const uint16_t *)heads + g * 2 * padded * hd;
            attend_block(x, rows, ld, start, h, hd, b * 16, kt, kt + padded * hd, out, ld_out, q, s, p, o);
        }
        _tile_release();
    }
    free(heads);
    free(scratch);
    return TPL_OK;
}

#else

int prompt_attention(const void *qkv, int64_t rows, int64_t ld, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                     const void *cache_k, const void *cache_v, int64_t n_blocks, int64_t block_size,
                     const int64_t *table, int64_t start, void *out, int64_t ld_out) {
    (void)qkv, (void)rows, (void)ld, (void)n_heads, (void)n_kv_heads, (void)head_dim, (void)out, (void)ld_out;
    (void)cache_k, (void)cache_v, (void)n_blocks, (void)block_size, (void)table, (void)start;
    return TPL_NO_AMX;
}

#endif
