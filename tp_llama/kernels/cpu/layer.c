/* The small operations of a layer on AVX-512 or AVX2 CPUs, float32 or bfloat16 activations.
 *
 * Between its four matmuls a decode layer runs about 25 eager PyTorch ops (RMSNorm alone is
 * six, RoPE five, the cache write two index_puts, attention a flash kernel built for long
 * queries). At a few rows each op costs its dispatch and an OpenMP fork, not its bytes
 * (bench/engine/step.py). Here each is one call:
 *   rms_norm          Meta's RMSNorm: normalise in float32, round to the activation type, scale
 *   decode_attention  one new token per row: RoPE on its query and key, the key and value
 *                     written to the row's place in its cache blocks, then softmax attention
 *                     over the blocks of its table
 *   rope_prompt_rows  a prompt chunk's RoPE and cache write, before its attention
 *   swiglu            silu(gate) * up where a matmul's tiles cannot end in it (Meta's int4 weights)
 * (SwiGLU's silu(gate) * up runs in the w1/w3 matmul's tiles, matmul.c.) Every output
 * element is computed from its own row alone, in a fixed order, so a row gets
 * the same bits whatever else shares the batch. bf16 = 1 means bfloat16 arrays, 0 float32;
 * arithmetic is float32, rounded where PyTorch's bfloat16 ops round.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "api.h"
#include "simd.h"

#define PARALLEL_ELEMENTS (1 << 15) /* below this, one thread: an OpenMP fork costs more */
#define PREFETCH_KEYS 32            /* how far ahead of its scores a query asks for keys */

void rms_norm_rows(const void *x, const void *weight, void *y, int64_t rows, int64_t dim, float eps, int bf16) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        vec squares = vzero();
        for (int64_t d = 0; d < dim; d += 16) {
            vec v = load16(x, r * dim + d, bf16, lanes(dim - d));
            squares = vfmadd(v, v, squares);
        }
        vec inv = vset1(1.0f / sqrtf(vsum(squares) / (float)dim + eps));
        for (int64_t d = 0; d < dim; d += 16) {
            mask16 m = lanes(dim - d);
            vec normed = as_stored(vmul(load16(x, r * dim + d, bf16, m), inv), bf16);
            store16(y, r * dim + d, vmul(normed, load16(weight, d, bf16, m)), bf16, m);
        }
    }
}

void rms_norm(const void *x, const void *weight, void *y, int64_t rows, int64_t dim, float eps, int bf16) {
#pragma omp parallel if (rows * dim >= PARALLEL_ELEMENTS)
    rms_norm_rows(x, weight, y, rows, dim, eps, bf16);
}

void swiglu_rows(const void *x, int64_t M, int64_t F, int x_bf16, void *y, int bf16) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < F; j += 16) {
            mask16 keep = lanes(F - j);
            vec gate = load16(x, m * 2 * F + j, x_bf16, keep), up = load16(x, m * 2 * F + F + j, x_bf16, keep);
            store16(y, m * F + j, swiglu16(gate, up, bf16), bf16, keep);
        }
}

void swiglu(const void *x, int64_t M, int64_t F, void *y, int bf16) {
#pragma omp parallel if (M * F >= PARALLEL_ELEMENTS)
    swiglu_rows(x, M, F, bf16, y, bf16);
}

/* 16 lanes of a head rotated by Meta's RoPE: lanes (2i, 2i+1) are one complex number, times
 * rot[2i] + rot[2i+1] j (cos, sin of its position). */
static inline vec rotate16(vec x, const float *rot, int64_t d, mask16 m) { return vrotate_pairs(x, vloadz(m, rot + d)); }

/* A layer's heads and its paged cache: cache_k/v [n_kv_heads][n_blocks * block_size][head_dim]. */
struct Attention {
    int64_t n_heads, n_kv_heads, n_blocks, block_size;
};

/* The element where key j of KV head g lies: its block from the row's table, then its place there.
 * A run of KEY_RUN keys from a multiple of KEY_RUN lies in one block. */
static inline int64_t key_at(const struct Attention *a, const int64_t *table, int64_t g, int64_t j, int64_t hd) {
    return (g * a->n_blocks * a->block_size + table[j / a->block_size] * a->block_size + j % a->block_size) * hd;
}

/* Asks for the run of keys from j0 (those that exist) of head g. */
static inline __attribute__((always_inline)) void prefetch_run(const struct Attention *a, const void *cache,
                                                               const int64_t *table, int64_t g, int64_t j0,
                                                               int64_t keys, int64_t hd, int bf16) {
    if (j0 >= keys) return;
    int64_t size = bf16 ? 2 : 4, n = keys - j0 < KEY_RUN ? keys - j0 : KEY_RUN;
    const char *first = (const char *)cache + key_at(a, table, g, j0, hd) * size;
    for (int64_t at = 0; at < n * hd * size; at += 64) _mm_prefetch(first + at, _MM_HINT_T0);
}

/* A row's key (rotated) and value of KV head g, written to its position's place in the cache. */
static inline __attribute__((always_inline)) void write_key(const struct Attention *a, const void *qkv_row,
                                                             const float *rot, const int64_t *table, int64_t pos,
                                                             int64_t g, void *cache_k, void *cache_v, const int64_t hd,
                                                             const int bf16) {
    const int64_t own = key_at(a, table, g, pos, hd);
    const int64_t k_at = (a->n_heads + g) * hd, v_at = (a->n_heads + a->n_kv_heads + g) * hd;
    for (int64_t d = 0; d < hd; d += 16) {
        mask16 m = lanes(hd - d);
        store16(cache_k, own + d, rotate16(load16(qkv_row, k_at + d, bf16, m), rot, d, m), bf16, m);
        store16(cache_v, own + d, load16(qkv_row, v_at + d, bf16, m), bf16, m);
    }
}

/* One row's KV head g and the rep query heads that share it (its key and value written first where
 * `write`); `scores` (rep * (pos + 1)) is this thread's scratch. A query (head_dim <= MAX_HEAD_DIM) stays in registers over all its keys.
 * Inlined with constant hd and bf16 for Llama's shapes, so its loops unroll and lose their masks. */
static inline __attribute__((always_inline)) void attend(const struct Attention *a, const void *qkv_row,
                                                          const float *rot, const int64_t *table, int64_t pos,
                                                          int64_t g, void *cache_k, void *cache_v, void *out_row,
                                                          float *scores, const int64_t hd, const int bf16,
                                                          const int write) {
    const int64_t vecs = (hd + 15) / 16, rep = a->n_heads / a->n_kv_heads, keys = pos + 1;
    if (write) write_key(a, qkv_row, rot, table, pos, g, cache_k, cache_v, hd, bf16);
    for (int64_t j0 = 0; j0 < PREFETCH_KEYS; j0 += KEY_RUN) prefetch_run(a, cache_k, table, g, j0, keys, hd, bf16);
    const vec scale = vset1(1.0f / sqrtf((float)hd));
    for (int64_t i = 0; i < rep; i++) {
        const int64_t q_at = (g * rep + i) * hd;
        vec q[MAX_HEAD_DIM / 16];
        for (int64_t v = 0; v < vecs; v++) {
            mask16 m = lanes(hd - 16 * v);
            q[v] = as_stored(rotate16(load16(qkv_row, q_at + 16 * v, bf16, m), rot, 16 * v, m), bf16);
        }
#ifdef __AVX512BF16__
        /* bfloat16 keys are scored in pairs (vdpbf16ps: exact products, summed in float32), the
         * query already rounded to bfloat16 above, so packing it loses nothing. */
        const int paired = bf16 && hd % 32 == 0;
        __m512bh q_pairs[MAX_HEAD_DIM / 32];
        if (paired)
            for (int64_t u = 0; u < hd / 32; u++) q_pairs[u] = _mm512_cvtne2ps_pbh(q[2 * u + 1], q[2 * u]);
#endif
        float *s = scores + i * keys;
        vec top = vset1(-INFINITY);
        for (int64_t j0 = 0; j0 < keys; j0 += KEY_RUN) {
            if (i == 0) { /* the first query pulls this head's keys and values in ahead of use */
                prefetch_run(a, cache_k, table, g, j0 + PREFETCH_KEYS, keys, hd, bf16);
                prefetch_run(a, cache_v, table, g, j0, keys, hd, bf16);
            }
            const int64_t run = key_at(a, table, g, j0, hd);
            vec part[KEY_RUN];
            for (int jj = 0; jj < KEY_RUN; jj++) {
                part[jj] = vzero();
                if (j0 + jj >= keys) continue;
#ifdef __AVX512BF16__
                if (paired) {
                    const uint16_t *key = (const uint16_t *)cache_k + run + jj * hd;
                    for (int64_t u = 0; u < hd / 32; u++)
                        part[jj] = _mm512_dpbf16_ps(part[jj], q_pairs[u], (__m512bh)_mm512_loadu_si512(key + 32 * u));
                    continue;
                }
#endif
                for (int64_t v = 0; v < vecs; v++)
                    part[jj] = vfmadd(q[v], load16(cache_k, run + jj * hd + 16 * v, bf16, lanes(hd - 16 * v)),
                                               part[jj]);
            }
            vec dots = vmul(vsum_each(part), scale);
            vstorem(s + j0, lanes(keys - j0), dots);
            top = vmax_in(top, lanes(keys - j0), top, dots);
        }
        vec high = vset1(vhighest(top)), total = vzero();
        for (int64_t j = 0; j < keys; j += 16) {
            mask16 m = lanes(keys - j);
            vec e = exp16(vsub(vloadz(m, s + j), high));
            vstorem(s + j, m, e);
            total = vadd(total, vkeep(m, e));
        }
        vec inv = vset1(1.0f / vsum(total));
        for (int64_t j = 0; j < keys; j += 16)
            vstorem(s + j, lanes(keys - j), vmul(vloadz(lanes(keys - j), s + j), inv));
    }
    /* softmax(qK) V for up to 4 query heads at once: each value vector is loaded (and widened) once
     * for the heads that share it, not once per head. */
    for (int64_t i0 = 0; i0 < rep; i0 += 4)
        for (int64_t v0 = 0; v0 < vecs; v0 += 4) {
            vec acc[4][4];
            for (int h = 0; h < 4; h++)
                for (int w = 0; w < 4; w++) acc[h][w] = vzero();
            for (int64_t j0 = 0; j0 < keys; j0 += KEY_RUN) {
                const int64_t run = key_at(a, table, g, j0, hd), n = keys - j0 < KEY_RUN ? keys - j0 : KEY_RUN;
                for (int64_t jj = 0; jj < n; jj++) {
                    vec value[4];
                    for (int w = 0; w < 4; w++)
                        if (v0 + w < vecs)
                            value[w] = load16(cache_v, run + jj * hd + 16 * (v0 + w), bf16, lanes(hd - 16 * (v0 + w)));
                    for (int h = 0; h < 4; h++) {
                        if (i0 + h >= rep) break;
                        vec p = vset1(scores[(i0 + h) * keys + j0 + jj]);
                        for (int w = 0; w < 4; w++)
                            if (v0 + w < vecs) acc[h][w] = vfmadd(p, value[w], acc[h][w]);
                    }
                }
            }
            for (int h = 0; h < 4 && i0 + h < rep; h++)
                for (int w = 0; w < 4 && v0 + w < vecs; w++)
                    store16(out_row, ((g * rep + i0 + h) * hd) + 16 * (v0 + w), acc[h][w], bf16,
                            lanes(hd - 16 * (v0 + w)));
        }
}

/* Prompt rows before PyTorch's flash kernel attends them: each row's query and key heads rotated
 * in place in qkv ([rows][(n_heads + 2 n_kv_heads) head_dim]) and its key and value written to
 * cache index locations[r] of cache_k/v [n_kv_heads][cache_len][head_dim], as attend does for a
 * decode row. rotation [rows][head_dim]: cos, sin pairs at the row's position. Eager, RoPE and
 * the cache write were 12 ops a layer, each its own dispatch (bench/engine/generate.py's prefill).
 * TPL_OK, or TPL_OFF_CACHE before anything is written. */
int rope_prompt_rows(void *qkv, int64_t rows, const float *rotation, const int64_t *locations, int64_t n_heads,
                     int64_t n_kv_heads, int64_t head_dim, void *cache_k, void *cache_v, int64_t cache_len, int bf16) {
    for (int64_t r = 0; r < rows; r++)
        if (locations[r] < 0 || locations[r] >= cache_len) return TPL_OFF_CACHE;
    const int64_t width = (n_heads + 2 * n_kv_heads) * head_dim;
#pragma omp parallel for schedule(static) if (rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *rot = rotation + r * head_dim;
        for (int64_t h = 0; h < n_heads + n_kv_heads; h++)
            for (int64_t d = 0; d < head_dim; d += 16) {
                mask16 m = lanes(head_dim - d);
                int64_t at = r * width + h * head_dim + d;
                store16(qkv, at, rotate16(load16(qkv, at, bf16, m), rot, d, m), bf16, m);
            }
        for (int64_t g = 0; g < n_kv_heads; g++)
            for (int64_t d = 0; d < head_dim; d += 16) {
                mask16 m = lanes(head_dim - d);
                int64_t own = (g * cache_len + locations[r]) * head_dim + d, at = r * width + (n_heads + g) * head_dim + d;
                store16(cache_k, own, load16(qkv, at, bf16, m), bf16, m);
                store16(cache_v, own, load16(qkv, at + n_kv_heads * head_dim, bf16, m), bf16, m);
            }
    }
    return TPL_OK;
}

int blocks_in_cache(const int64_t *table, int64_t last, int64_t block_size, int64_t n_blocks) {
    for (int64_t b = 0; b <= last / block_size; b++)
        if (table[b] < 0 || table[b] >= n_blocks) return TPL_OFF_CACHE;
    return TPL_OK;
}

int check_rows(const struct DecodeRows *R, int64_t n_blocks, int64_t block_size, int64_t n_heads,
               int64_t n_kv_heads, int64_t head_dim, int64_t *scores_per_thread) {
    if (head_dim > MAX_HEAD_DIM) return TPL_HEAD_DIM;
    if (block_size < KEY_RUN || block_size % KEY_RUN) return TPL_OFF_CACHE;
    int64_t longest = 0;
    for (int64_t r = 0; r < R->rows; r++) {
        int64_t pos = R->positions[r];
        if (pos < 0 || pos / block_size >= R->width) return TPL_OFF_CACHE;
        int status = blocks_in_cache(R->tables + r * R->width, pos, block_size, n_blocks);
        if (status) return status;
        longest = pos + 1 > longest ? pos + 1 : longest;
    }
    *scores_per_thread = n_heads / n_kv_heads * longest;
    return TPL_OK;
}

/* Row r's KV head g, inlined with constant hd and bf16 for Llama's head sizes. */
static void attend_item(const struct Attention *a, const void *qkv, const struct DecodeRows *R, int64_t r, int64_t g,
                        int64_t head_dim, void *cache_k, void *cache_v, void *out, int bf16, float *scores, int write,
                        int64_t window) {
    const int64_t width = (a->n_heads + 2 * a->n_kv_heads) * head_dim, size = bf16 ? 2 : 4;
    const void *row = (const char *)qkv + r * width * size;
    const float *rot = R->rotation + r * head_dim;
    /* A window starts at a block's first position, so the row's keys from there are those of a
     * table that starts at that block, at positions counted from it. */
    const int64_t pos = R->positions[r], first = window ? pos / window * window : 0;
    const int64_t *table = R->tables + r * R->width + first / a->block_size;
    void *out_row = (char *)out + r * a->n_heads * head_dim * size;
#define ATTEND(HD, BF16, W) attend(a, row, rot, table, pos - first, g, cache_k, cache_v, out_row, scores, HD, BF16, W)
#define BY_HEAD_DIM(W)                                         \
    if (head_dim == 128)                                       \
        bf16 ? ATTEND(128, 1, W) : ATTEND(128, 0, W);          \
    else if (head_dim == 64)                                   \
        bf16 ? ATTEND(64, 1, W) : ATTEND(64, 0, W);            \
    else                                                       \
        ATTEND(head_dim, bf16, W);
    if (write) {
        BY_HEAD_DIM(1)
    } else {
        BY_HEAD_DIM(0)
    }
#undef BY_HEAD_DIM
#undef ATTEND
}

void attention_rows(const void *qkv, const struct DecodeRows *R, int64_t n_heads, int64_t n_kv_heads,
                    int64_t head_dim, void *cache_k, void *cache_v, int64_t n_blocks, int64_t block_size, void *out,
                    int bf16, float *scores, int64_t scores_per_thread, int write_first, int64_t window) {
    const struct Attention a = {n_heads, n_kv_heads, n_blocks, block_size};
    float *mine = scores + omp_get_thread_num() * scores_per_thread;
    if (!write_first) {
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < R->rows; r++)
            for (int64_t g = 0; g < n_kv_heads; g++)
                attend_item(&a, qkv, R, r, g, head_dim, cache_k, cache_v, out, bf16, mine, 1, window);
        return;
    }
    /* Rows of one sequence see each other's keys: all are written (the loop's barrier) before any
     * attends, and a later row's longer work is dealt out one at a time. */
    const int64_t width = (n_heads + 2 * n_kv_heads) * head_dim, size = bf16 ? 2 : 4;
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < R->rows; r++)
        for (int64_t g = 0; g < n_kv_heads; g++)
            write_key(&a, (const char *)qkv + r * width * size, R->rotation + r * head_dim, R->tables + r * R->width,
                      R->positions[r], g, cache_k, cache_v, head_dim, bf16);
#pragma omp for collapse(2) schedule(static, 1)
    for (int64_t r = 0; r < R->rows; r++)
        for (int64_t g = 0; g < n_kv_heads; g++)
            attend_item(&a, qkv, R, r, g, head_dim, cache_k, cache_v, out, bf16, mine, 0, window);
}

/* qkv [rows][(n_heads + 2 n_kv_heads) head_dim]: each row's new token, q then k then v heads.
 * cache_k/v [n_kv_heads][n_blocks * block_size][head_dim], block_size a multiple of KEY_RUN.
 * out [rows][n_heads head_dim]. Rows must write distinct cache positions. write_first: rows may
 * see each other's keys (a prompt chunk's tokens, each at its own position): every row's key and
 * value are written before any row attends. Either way a row's bits are those of a decode step.
 * window: a row at position p sees only keys from p / window * window on (Llama 4's chunked layers;
 * a multiple of block_size), 0 every key. TPL_OK, TPL_NO_MEMORY, TPL_OFF_CACHE or TPL_HEAD_DIM. */
int decode_attention(const void *qkv, const struct DecodeRows *rows, int64_t n_heads, int64_t n_kv_heads,
                     int64_t head_dim, void *cache_k, void *cache_v, int64_t n_blocks, int64_t block_size, void *out,
                     int bf16, int write_first, int64_t window) {
    int64_t per_thread;
    int status = check_rows(rows, n_blocks, block_size, n_heads, n_kv_heads, head_dim, &per_thread);
    if (status) return status;
    float *scores = malloc((size_t)(omp_get_max_threads() * per_thread) * sizeof(float));
    if (scores == NULL) return TPL_NO_MEMORY;
#pragma omp parallel
    attention_rows(qkv, rows, n_heads, n_kv_heads, head_dim, cache_k, cache_v, n_blocks, block_size, out, bf16, scores,
                   per_thread, write_first, window);
    free(scores);
    return TPL_OK;
}
