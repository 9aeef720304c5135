/* The small operations of a layer on AVX-512 CPUs, float32 or bfloat16 activations.
 *
 * Between its four matmuls a decode layer runs about 25 eager PyTorch ops (RMSNorm alone is
 * six, RoPE five, the cache write two index_puts, attention a flash kernel built for long
 * queries). At a few rows each op costs its dispatch and an OpenMP fork, not its bytes: 3.6 ms
 * of a 24 ms step on the bench's quarter model. Here each is one call:
 *   rms_norm          Meta's RMSNorm: normalise in float32, round to the activation type, scale
 *   decode_attention  one new token per row: RoPE on its query and key, the key and value
 *                     written to the row's place in its cache blocks, then softmax attention
 *                     over the blocks of its table
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
        __m512 squares = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
            __m512 v = load16(x, r * dim + d, bf16, lanes(dim - d));
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps));
        for (int64_t d = 0; d < dim; d += 16) {
            __mmask16 m = lanes(dim - d);
            __m512 normed = as_stored(_mm512_mul_ps(load16(x, r * dim + d, bf16, m), inv), bf16);
            store16(y, r * dim + d, _mm512_mul_ps(normed, load16(weight, d, bf16, m)), bf16, m);
        }
    }
}

void rms_norm(const void *x, const void *weight, void *y, int64_t rows, int64_t dim, float eps, int bf16) {
#pragma omp parallel if (rows * dim >= PARALLEL_ELEMENTS)
    rms_norm_rows(x, weight, y, rows, dim, eps, bf16);
}

/* 16 lanes of a head rotated by Meta's RoPE: lanes (2i, 2i+1) are one complex number, times
 * rot[2i] + rot[2i+1] j (cos, sin of its position). */
static inline __m512 rotate16(__m512 x, const float *rot, int64_t d, __mmask16 m) {
    __m512 cos_sin = _mm512_maskz_loadu_ps(m, rot + d);
    __m512 swapped = _mm512_permute_ps(x, 0xB1);
    return _mm512_fmaddsub_ps(x, _mm512_moveldup_ps(cos_sin), _mm512_mul_ps(swapped, _mm512_movehdup_ps(cos_sin)));
}

/* A layer's heads and its paged cache: cache_k/v [n_kv_heads][n_blocks * block_size][head_dim]. */
struct Attention {
    int64_t n_heads, n_kv_heads, n_blocks, block_size;
};

/* The element where key j of KV head g lies: its block from the row's table, then its place there.
 * A run of KEY_RUN keys from a multiple of KEY_RUN lies in one block. */
static inline int64_t key_at(const struct Attention *a, const int64_t *table, int64_t g, int64_t j, int64_t hd) {
    return (g * a->n_blocks * a->block_size + table[j / a->block_size] * a->block_size + j % a->block_size) * hd;
}

/* r[i] = the sum of v[i]'s lanes: 16 keys' dot products from their lane-wise partial sums, in
 * 45 shuffles and adds where 16 separate reductions take about 130. */
static inline __m512 sum_lanes16(const __m512 v[16]) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++) /* 128-bit lane l of w[i]: v[2i] at 0, 2 and v[2i+1] at 1, 3 */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* lane l of x[i]: its 128-bit lane's sums of v[4i .. 4i+3] */
        __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* then the four 128-bit lanes of each x[i] are added into lane i of the result */
    __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
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

/* One row's KV head g and the rep query heads that share it; `scores` (rep * (pos + 1)) is this
 * thread's scratch. A query (head_dim <= MAX_HEAD_DIM) stays in registers over all its keys.
 * Inlined with constant hd and bf16 for Llama's shapes, so its loops unroll and lose their masks. */
static inline __attribute__((always_inline)) void attend(const struct Attention *a, const void *qkv_row,
                                                          const float *rot, const int64_t *table, int64_t pos,
                                                          int64_t g, void *cache_k, void *cache_v, void *out_row,
                                                          float *scores, const int64_t hd, const int bf16) {
    const int64_t vecs = (hd + 15) / 16, rep = a->n_heads / a->n_kv_heads, keys = pos + 1;
    const int64_t own = key_at(a, table, g, pos, hd);
    const int64_t k_at = (a->n_heads + g) * hd, v_at = (a->n_heads + a->n_kv_heads + g) * hd;
    for (int64_t d = 0; d < hd; d += 16) {
        __mmask16 m = lanes(hd - d);
        store16(cache_k, own + d, rotate16(load16(qkv_row, k_at + d, bf16, m), rot, d, m), bf16, m);
        store16(cache_v, own + d, load16(qkv_row, v_at + d, bf16, m), bf16, m);
    }
    for (int64_t j0 = 0; j0 < PREFETCH_KEYS; j0 += KEY_RUN) prefetch_run(a, cache_k, table, g, j0, keys, hd, bf16);
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf((float)hd));
    for (int64_t i = 0; i < rep; i++) {
        const int64_t q_at = (g * rep + i) * hd;
        __m512 q[MAX_HEAD_DIM / 16];
        for (int64_t v = 0; v < vecs; v++) {
            __mmask16 m = lanes(hd - 16 * v);
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
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t j0 = 0; j0 < keys; j0 += KEY_RUN) {
            if (i == 0) { /* the first query pulls this head's keys and values in ahead of use */
                prefetch_run(a, cache_k, table, g, j0 + PREFETCH_KEYS, keys, hd, bf16);
                prefetch_run(a, cache_v, table, g, j0, keys, hd, bf16);
            }
            const int64_t run = key_at(a, table, g, j0, hd);
            __m512 part[KEY_RUN];
            for (int jj = 0; jj < KEY_RUN; jj++) {
                part[jj] = _mm512_setzero_ps();
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
                    part[jj] = _mm512_fmadd_ps(q[v], load16(cache_k, run + jj * hd + 16 * v, bf16, lanes(hd - 16 * v)),
                                               part[jj]);
            }
            __m512 dots = _mm512_mul_ps(sum_lanes16(part), scale);
            _mm512_mask_storeu_ps(s + j0, lanes(keys - j0), dots);
            top = _mm512_mask_max_ps(top, lanes(keys - j0), top, dots);
        }
        __m512 high = _mm512_set1_ps(_mm512_reduce_max_ps(top)), total = _mm512_setzero_ps();
        for (int64_t j = 0; j < keys; j += 16) {
            __mmask16 m = lanes(keys - j);
            __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), high));
            _mm512_mask_storeu_ps(s + j, m, e);
            total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
        }
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
        for (int64_t j = 0; j < keys; j += 16)
            _mm512_mask_storeu_ps(s + j, lanes(keys - j), _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(keys - j), s + j), inv));
    }
    /* softmax(qK) V for up to 4 query heads at once: each value vector is loaded (and widened) once
     * for the heads that share it, not once per head. */
    for (int64_t i0 = 0; i0 < rep; i0 += 4)
        for (int64_t v0 = 0; v0 < vecs; v0 += 4) {
            __m512 acc[4][4];
            for (int h = 0; h < 4; h++)
                for (int w = 0; w < 4; w++) acc[h][w] = _mm512_setzero_ps();
            for (int64_t j0 = 0; j0 < keys; j0 += KEY_RUN) {
                const int64_t run = key_at(a, table, g, j0, hd), n = keys - j0 < KEY_RUN ? keys - j0 : KEY_RUN;
                for (int64_t jj = 0; jj < n; jj++) {
                    __m512 value[4];
                    for (int w = 0; w < 4; w++)
                        if (v0 + w < vecs)
                            value[w] = load16(cache_v, run + jj * hd + 16 * (v0 + w), bf16, lanes(hd - 16 * (v0 + w)));
                    for (int h = 0; h < 4; h++) {
                        if (i0 + h >= rep) break;
                        __m512 p = _mm512_set1_ps(scores[(i0 + h) * keys + j0 + jj]);
                        for (int w = 0; w < 4; w++)
                            if (v0 + w < vecs) acc[h][w] = _mm512_fmadd_ps(p, value[w], acc[h][w]);
                    }
                }
            }
            for (int h = 0; h < 4 && i0 + h < rep; h++)
                for (int w = 0; w < 4 && v0 + w < vecs; w++)
                    store16(out_row, ((g * rep + i0 + h) * hd) + 16 * (v0 + w), acc[h][w], bf16,
                            lanes(hd - 16 * (v0 + w)));
        }
}

int check_rows(const struct DecodeRows *R, int64_t n_blocks, int64_t block_size, int64_t n_heads,
               int64_t n_kv_heads, int64_t head_dim, int64_t *scores_per_thread) {
    if (head_dim > MAX_HEAD_DIM) return TPL_HEAD_DIM;
    if (block_size < KEY_RUN || block_size % KEY_RUN) return TPL_OFF_CACHE;
    int64_t longest = 0;
    for (int64_t r = 0; r < R->rows; r++) {
        int64_t pos = R->positions[r];
        if (pos < 0 || pos / block_size >= R->width) return TPL_OFF_CACHE;
        for (int64_t b = 0; b <= pos / block_size; b++) {
            int64_t block = R->tables[r * R->width + b];
            if (block < 0 || block >= n_blocks) return TPL_OFF_CACHE;
        }
        longest = pos + 1 > longest ? pos + 1 : longest;
    }
    *scores_per_thread = n_heads / n_kv_heads * longest;
    return TPL_OK;
}

void attention_rows(const void *qkv, const struct DecodeRows *R, int64_t n_heads, int64_t n_kv_heads,
                    int64_t head_dim, void *cache_k, void *cache_v, int64_t n_blocks, int64_t block_size, void *out,
                    int bf16, float *scores, int64_t scores_per_thread) {
    const struct Attention a = {n_heads, n_kv_heads, n_blocks, block_size};
    const int64_t width = (n_heads + 2 * n_kv_heads) * head_dim, size = bf16 ? 2 : 4;
    float *mine = scores + omp_get_thread_num() * scores_per_thread;
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < R->rows; r++)
        for (int64_t g = 0; g < n_kv_heads; g++) {
            const void *row = (const char *)qkv + r * width * size;
            const float *rot = R->rotation + r * head_dim;
            const int64_t *table = R->tables + r * R->width;
            void *out_row = (char *)out + r * n_heads * head_dim * size;
#define ATTEND(HD, BF16) attend(&a, row, rot, table, R->positions[r], g, cache_k, cache_v, out_row, mine, HD, BF16)
            if (head_dim == 128)
                bf16 ? ATTEND(128, 1) : ATTEND(128, 0);
            else if (head_dim == 64)
                bf16 ? ATTEND(64, 1) : ATTEND(64, 0);
            else
                ATTEND(head_dim, bf16);
#undef ATTEND
        }
}

/* qkv [rows][(n_heads + 2 n_kv_heads) head_dim]: each row's new token, q then k then v heads.
 * cache_k/v [n_kv_heads][n_blocks * block_size][head_dim], block_size a multiple of KEY_RUN.
 * out [rows][n_heads head_dim]. Rows must write distinct cache positions.
 * TPL_OK, TPL_NO_MEMORY, TPL_OFF_CACHE or TPL_HEAD_DIM. */
int decode_attention(const void *qkv, const struct DecodeRows *rows, int64_t n_heads, int64_t n_kv_heads,
                     int64_t head_dim, void *cache_k, void *cache_v, int64_t n_blocks, int64_t block_size, void *out,
                     int bf16) {
    int64_t per_thread;
    int status = check_rows(rows, n_blocks, block_size, n_heads, n_kv_heads, head_dim, &per_thread);
    if (status) return status;
    float *scores = malloc((size_t)(omp_get_max_threads() * per_thread) * sizeof(float));
    if (scores == NULL) return TPL_NO_MEMORY;
#pragma omp parallel
    attention_rows(qkv, rows, n_heads, n_kv_heads, head_dim, cache_k, cache_v, n_blocks, block_size, out, bf16, scores,
                   per_thread);
    free(scores);
    return TPL_OK;
}
