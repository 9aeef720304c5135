/* The small operations of a layer on AVX-512 CPUs, float32 or bfloat16 activations.
 *
 * Between its four matmuls a decode layer runs about 25 eager PyTorch ops (RMSNorm alone is
 * six, RoPE five, the cache write two index_puts, attention a flash kernel built for long
 * queries). At a few rows each op costs its dispatch and an OpenMP fork, not its bytes: 3.6 ms
 * of a 24 ms step on the bench's quarter model. Here each is one call:
 *   rms_norm          Meta's RMSNorm: normalise in float32, round to the activation type, scale
 *   decode_attention  one new token per row: RoPE on its query and key, the key and value
 *                     written to the row's cache slot, then softmax attention over the slot
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

struct Attention {
    int64_t n_heads, n_kv_heads, max_seq_len;
};

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

/* Asks for keys j0 .. j0 + 15 of a head (key 0 at element `base`), those that exist. */
static inline __attribute__((always_inline)) void prefetch_keys(const void *cache, int64_t base, int64_t j0, int64_t keys, int64_t hd, int bf16) {
    int64_t size = bf16 ? 2 : 4, end = j0 + 16 < keys ? j0 + 16 : keys;
    const char *first = (const char *)cache + (base + j0 * hd) * size;
    for (int64_t at = 0; at < (end - j0) * hd * size; at += 64) _mm_prefetch(first + at, _MM_HINT_T0);
}

/* One row's KV head g and the rep query heads that share it; `scores` (rep * (pos + 1)) is this
 * thread's scratch. A query (head_dim <= MAX_HEAD_DIM) stays in registers over all its keys.
 * Inlined with constant hd and bf16 for Llama's shapes, so its loops unroll and lose their masks. */
static inline __attribute__((always_inline)) void attend(const struct Attention *a, const void *qkv_row,
                                                          const float *rot, int64_t slot, int64_t pos, int64_t g,
                                                          void *cache_k, void *cache_v, void *out_row, float *scores,
                                                          const int64_t hd, const int bf16) {
    const int64_t vecs = (hd + 15) / 16, rep = a->n_heads / a->n_kv_heads, keys = pos + 1;
    const int64_t base = (slot * a->n_kv_heads + g) * a->max_seq_len * hd; /* key 0 of this head */
    const int64_t k_at = (a->n_heads + g) * hd, v_at = (a->n_heads + a->n_kv_heads + g) * hd;
    for (int64_t d = 0; d < hd; d += 16) {
        __mmask16 m = lanes(hd - d);
        store16(cache_k, base + pos * hd + d, rotate16(load16(qkv_row, k_at + d, bf16, m), rot, d, m), bf16, m);
        store16(cache_v, base + pos * hd + d, load16(qkv_row, v_at + d, bf16, m), bf16, m);
    }
    for (int64_t j0 = 0; j0 < PREFETCH_KEYS; j0 += 16) prefetch_keys(cache_k, base, j0, keys, hd, bf16);
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf((float)hd));
    for (int64_t i = 0; i < rep; i++) {
        const int64_t q_at = (g * rep + i) * hd;
        __m512 q[MAX_HEAD_DIM / 16], acc[MAX_HEAD_DIM / 16];
        for (int64_t v = 0; v < vecs; v++) {
            __mmask16 m = lanes(hd - 16 * v);
            q[v] = as_stored(rotate16(load16(qkv_row, q_at + 16 * v, bf16, m), rot, 16 * v, m), bf16);
        }
        float *s = scores + i * keys;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t j0 = 0; j0 < keys; j0 += 16) {
            if (i == 0) { /* the first query pulls this head's keys and values in ahead of use */
                prefetch_keys(cache_k, base, j0 + PREFETCH_KEYS, keys, hd, bf16);
                prefetch_keys(cache_v, base, j0, keys, hd, bf16);
            }
            __m512 part[16];
            for (int jj = 0; jj < 16; jj++) {
                part[jj] = _mm512_setzero_ps();
                if (j0 + jj >= keys) continue;
                for (int64_t v = 0; v < vecs; v++)
                    part[jj] = _mm512_fmadd_ps(q[v], load16(cache_k, base + (j0 + jj) * hd + 16 * v, bf16,
                                                            lanes(hd - 16 * v)), part[jj]);
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
        for (int64_t v = 0; v < vecs; v++) acc[v] = _mm512_setzero_ps();
        for (int64_t j = 0; j < keys; j++) {
            __m512 p = _mm512_set1_ps(s[j]);
            for (int64_t v = 0; v < vecs; v++)
                acc[v] = _mm512_fmadd_ps(p, load16(cache_v, base + j * hd + 16 * v, bf16, lanes(hd - 16 * v)), acc[v]);
        }
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
        for (int64_t v = 0; v < vecs; v++)
            store16(out_row, q_at + 16 * v, _mm512_mul_ps(acc[v], inv), bf16, lanes(hd - 16 * v));
    }
}

int check_rows(const int64_t *slots, const int64_t *positions, int64_t rows, int64_t n_slots, int64_t max_seq_len,
               int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t *scores_per_thread) {
    if (head_dim > MAX_HEAD_DIM) return TPL_HEAD_DIM;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (slots[r] < 0 || slots[r] >= n_slots || positions[r] < 0 || positions[r] >= max_seq_len) return TPL_OFF_CACHE;
        longest = positions[r] + 1 > longest ? positions[r] + 1 : longest;
    }
    *scores_per_thread = n_heads / n_kv_heads * longest;
    return TPL_OK;
}

void attention_rows(const void *qkv, const float *rotation, const int64_t *slots, const int64_t *positions,
                    int64_t rows, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, void *cache_k,
                    void *cache_v, int64_t max_seq_len, void *out, int bf16, float *scores,
                    int64_t scores_per_thread) {
    const struct Attention a = {n_heads, n_kv_heads, max_seq_len};
    const int64_t width = (n_heads + 2 * n_kv_heads) * head_dim, size = bf16 ? 2 : 4;
    float *mine = scores + omp_get_thread_num() * scores_per_thread;
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < n_kv_heads; g++) {
            const void *row = (const char *)qkv + r * width * size;
            const float *rot = rotation + r * head_dim;
            void *out_row = (char *)out + r * n_heads * head_dim * size;
#define ATTEND(HD, BF16) attend(&a, row, rot, slots[r], positions[r], g, cache_k, cache_v, out_row, mine, HD, BF16)
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
 * rotation [rows][head_dim]: cos, sin pairs at the row's position. cache_k/v [slots][n_kv_heads]
 * [max_seq_len][head_dim]. out [rows][n_heads head_dim]. Rows must be in distinct slots.
 * TPL_OK, TPL_NO_MEMORY, TPL_OFF_CACHE or TPL_HEAD_DIM. */
int decode_attention(const void *qkv, const float *rotation, const int64_t *slots, const int64_t *positions,
                     int64_t rows, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, void *cache_k,
                     void *cache_v, int64_t n_slots, int64_t max_seq_len, void *out, int bf16) {
    int64_t per_thread;
    int status = check_rows(slots, positions, rows, n_slots, max_seq_len, n_heads, n_kv_heads, head_dim, &per_thread);
    if (status) return status;
    float *scores = malloc((size_t)(omp_get_max_threads() * per_thread) * sizeof(float));
    if (scores == NULL) return TPL_NO_MEMORY;
#pragma omp parallel
    attention_rows(qkv, rotation, slots, positions, rows, n_heads, n_kv_heads, head_dim, cache_k, cache_v,
                   max_seq_len, out, bf16, scores, per_thread);
    free(scores);
    return TPL_OK;
}
