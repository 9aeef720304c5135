/* A decode step's layers on the tiled weights, in a few C calls.
 *
 * Run op by op from Python, a decode layer is nine calls, each with its own Python frames, output
 * allocation and OpenMP fork, which add up at a decode step's few rows (bench/engine/step.py). Here
 * each half of a layer runs in one parallel region, its ops separated by barriers only:
 *   attention_block  h += delta; x = attention_norm(h); qkv = x wqkv; attention; delta = . wo
 *   ffn_block        h += delta; x = ffn_norm(h);       g = SwiGLU(x w1, x w3);  delta = g w2
 * A step with prompt rows runs ffn_block too, its attention half from Python after residual_norm.
 * Under tensor parallelism delta is this rank's part of the sum, and the caller all-reduces it
 * between the calls; each half starts by adding the previous half's delta. Without it,
 * decode_stack runs all the layers in one call. The ops are the ones the op-by-op path runs, in
 * the same order, so both give the same bits.
 * Rows on LoRA adapters (DecodeRows.adapters) get each adapted projection's delta added to its
 * output (lora.c); on w1/w3 that delta lands before SwiGLU, so their matmul runs ungated there and
 * SwiGLU after it. A step without adapters runs as if the layer had none.
 */
#include <omp.h>
#include <stdlib.h>

#include "api.h"
#include "simd.h"

static void add_rows(void *h, const void *delta, int64_t rows, int64_t dim, int bf16) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < dim; d += 16) {
            mask16 m = lanes(dim - d);
            store16(h, r * dim + d, vadd(load16(h, r * dim + d, bf16, m), load16(delta, r * dim + d, bf16, m)),
                    bf16, m);
        }
}

/* A matmul of Meta's int4 (quant.c) into float32 at the start of `wide` (SpinQuant's w2 rotating its input
 * into float32 there first), then out into y in the activation type, through SwiGLU where gated (w1's
 * outputs then w3's): each output rounded to that type first, as the op-by-op path stores them. */
static void meta_matmul(const struct DecodeLayer *L, const void *x, int64_t M, int64_t K, const struct MetaInt4 *w,
                        int64_t N, void *y, int gated, float *wide) {
    float *out = wide, *rotated = out + M * N;
    int bf16 = L->bf16;
    if (w->hadamard) {
        hadamard_rows_in(x, M, K, bf16, rotated);
        x = rotated;
        bf16 = 0;
    }
    meta_int4_matmul(x, NULL, M, K, w, N, out, bf16, rotated + (w->hadamard ? M * K : 0));
    if (gated)
        swiglu_rows(out, M, N / 2, 0, y, L->bf16);
    else
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n += 16)
                store16(y, m * N + n, vloadz(lanes(N - n), out + m * N + n), L->bf16, lanes(N - n));
}

/* Scratch bytes meta_matmul needs in `wide` for the layer's largest matmul. */
static int64_t meta_wide_bytes(const struct DecodeLayer *L, int64_t rows) {
    const struct MetaInt4 *w[4] = {L->wqkv, L->wo, L->w13, L->w2};
    int64_t attn = L->n_heads * L->head_dim, qkv = attn + 2 * L->n_kv_heads * L->head_dim;
    int64_t k[4] = {L->dim, attn, L->dim, L->ffn}, n[4] = {qkv, L->dim, 2 * L->ffn, L->dim}, most = 0;
    for (int i = 0; i < 4; i++) {
        int64_t bytes = rows * (n[i] + (w[i]->hadamard ? k[i] : 0)) * (int64_t)sizeof(float) +
                        meta_int4_scratch_bytes(rows, k[i], w[i]->rank);
        most = bytes > most ? bytes : most;
    }
    return most;
}

/* A layer's matmul on its float tiles (matmul.c), its quantized ones (quant.c) or Meta's int4, with `wide`
 * as their scratch. */
static void layer_matmul(const struct DecodeLayer *L, const void *x, int64_t M, int64_t K, const void *w, int64_t N,
                         void *y, int gated, float *wide) {
    if (L->bits == META_INT4)
        meta_matmul(L, x, M, K, w, N, y, gated, wide);
    else if (L->bits == 16)
        tiled_matmul(x, M, K, w, N, y, gated, L->bf16, wide, L->amx);
    else
        quant_matmul(x, M, K, w, N, y, gated, L->bf16, L->bits, wide);
}

/* h += delta (unless NULL), then y = RMSNorm(h): how each half layer starts. */
static void add_and_norm(void *h, const void *delta, const void *weight, void *y, int64_t rows, int64_t dim, float eps,
                         int bf16) {
    if (delta != NULL) add_rows(h, delta, rows, dim, bf16);
    rms_norm_rows(h, weight, y, rows, dim, eps, bf16);
}

/* The scratch of either block for `rows` rows, laid out from address `at`: the normed rows, the
 * widest matmul output (qkv or SwiGLU's; rows rounded up to 32, as AMX packs it), attention's
 * output, and the next matmul's input widened to float32 or quantized (64-byte aligned); then, only
 * for a layer with adapters, lora_rows' scratch (`lora`) and, with adapters on w1/w3, their ungated
 * output (`gates`); `end` is one past its last byte. */
struct Scratch {
    void *normed, *first, *second, *gates;
    float *wide, *lora;
    uintptr_t end;
};

/* The largest rank of the layer's adapters, -1 where it has none. */
static int64_t lora_rank(const struct DecodeLayer *L) {
    const struct LoraWeights *l[4] = {L->lora_qkv, L->lora_wo, L->lora_w13, L->lora_w2};
    int64_t most = -1;
    for (int i = 0; i < 4; i++)
        if (l[i] != NULL && l[i]->rank > most) most = l[i]->rank;
    return most;
}

static struct Scratch carve(const struct DecodeLayer *L, int64_t rows, uintptr_t at) {
    int64_t size = L->bf16 ? 2 : 4, attn = L->n_heads * L->head_dim, qkv = attn + 2 * L->n_kv_heads * L->head_dim;
    int64_t first = qkv > L->ffn ? qkv : L->ffn, widest = L->dim > attn ? L->dim : attn;
    widest = widest > L->ffn ? widest : L->ffn;
    struct Scratch s;
    s.normed = (void *)at;
    s.first = (void *)(at += rows * L->dim * size);
    s.second = (void *)(at += (rows + 31) / 32 * 32 * first * size);
    at = (at + rows * attn * size + 63) & ~(uintptr_t)63;
    s.wide = (float *)at;
    int64_t wide = (rows < WIDE_MIN_ROWS ? WIDE_MIN_ROWS : rows) * widest * (int64_t)sizeof(float);
    int64_t meta = L->bits == META_INT4 ? meta_wide_bytes(L, rows) : 0, rank = lora_rank(L);
    at += wide > meta ? wide : meta;
    s.lora = (float *)at;
    at += rank < 0 ? 0 : lora_scratch_bytes(rows, rank);
    s.gates = (void *)at;
    s.end = at + (L->lora_w13 != NULL ? rows * 2 * L->ffn * size : 0);
    return s;
}

/* Bytes of scratch either block needs for `rows` rows (laid out from 0, plus the most that
 * aligning `wide` can add elsewhere). */
int64_t decode_scratch_bytes(const struct DecodeLayer *L, int64_t rows) {
    return (int64_t)carve(L, rows, 0).end + 63;
}

/* TPL_OK, or a status of decode_attention (layer.c) with nothing written then. */
int attention_block(const struct DecodeLayer *L, const struct DecodeRows *R, void *h, const void *delta_in,
                    void *delta_out, void *scratch, int write_first) {
    int64_t per_thread, rows = R->rows, attn = L->n_heads * L->head_dim;
    int status = check_rows(R, L->n_blocks, L->block_size, L->n_heads, L->n_kv_heads, L->head_dim, &per_thread);
    if (status) return status;
    float *scores = malloc((size_t)(omp_get_max_threads() * per_thread) * sizeof(float));
    if (scores == NULL) return TPL_NO_MEMORY;
    struct Scratch s = carve(L, rows, (uintptr_t)scratch);
    int64_t qkv = (L->n_heads + 2 * L->n_kv_heads) * L->head_dim;
    const int32_t *adapters = L->bits == META_INT4 ? NULL : R->adapters;
#pragma omp parallel
    {
        add_and_norm(h, delta_in, L->attention_norm, s.normed, rows, L->dim, L->eps, L->bf16);
        layer_matmul(L, s.normed, rows, L->dim, L->wqkv, qkv, s.first, 0, s.wide);
        if (adapters && L->lora_qkv)
            lora_rows(L->lora_qkv, s.normed, rows, L->dim, adapters, s.first, qkv, L->bf16, s.lora);
        attention_rows(s.first, R, L->n_heads, L->n_kv_heads, L->head_dim, L->cache_k, L->cache_v, L->n_blocks,
                       L->block_size, s.second, L->bf16, scores, per_thread, write_first, 0);
        layer_matmul(L, s.second, rows, attn, L->wo, L->dim, delta_out, 0, s.wide);
        if (adapters && L->lora_wo)
            lora_rows(L->lora_wo, s.second, rows, attn, adapters, delta_out, L->dim, L->bf16, s.lora);
    }
    free(scores);
    return TPL_OK;
}

/* SwiGLU of an ungated w1/w3 matmul's output x [rows][2 ffn], whose tiles' 32 columns are GATE_RUN gate
 * columns then GATE_RUN up columns, into y [rows][ffn] as the gated matmul writes it: swiglu16 on the
 * sums as stored, which is what the tiles' own SwiGLU reads, so a row without a delta gets its bits. */
static void swiglu_runs(const void *x, int64_t rows, int64_t ffn, void *y, int bf16) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < ffn; j += GATE_RUN) {
            const int64_t at = m * 2 * ffn + 2 * j;
            vec gate = load16(x, at, bf16, 0xFFFF), up = load16(x, at + GATE_RUN, bf16, 0xFFFF);
            store16(y, m * ffn + j, swiglu16(gate, up, bf16), bf16, 0xFFFF);
        }
}

/* On AMX, SwiGLU's outputs go out in the layout w2's matmul reads (AMX_PACKED_Y), so w2 does not
 * pack them again: a 512-row step of the 1B shape packed 8 MiB a layer there. Not with adapters on
 * w1/w3 (their delta comes before SwiGLU) or w2 (its delta reads SwiGLU's outputs as rows). */
void ffn_block(const struct DecodeLayer *L, int64_t rows, const int32_t *adapters, void *h, const void *delta_in,
               void *delta_out, void *scratch) {
    struct Scratch s = carve(L, rows, (uintptr_t)scratch);
    if (L->bits == META_INT4) adapters = NULL;
    const int w13 = adapters && L->lora_w13, w2 = adapters && L->lora_w2;
#pragma omp parallel
    {
        add_and_norm(h, delta_in, L->ffn_norm, s.normed, rows, L->dim, L->eps, L->bf16);
        if (!w13 && !w2 && L->amx && L->bf16 &&
            amx_matmul(s.normed, rows, L->dim, L->w13, 2 * L->ffn, s.first, 1, s.wide, AMX_PACKED_Y) == TPL_OK)
            amx_matmul(s.first, rows, L->ffn, L->w2, L->dim, delta_out, 0, NULL, AMX_PACKED_X);
        else {
            if (w13) {
                layer_matmul(L, s.normed, rows, L->dim, L->w13, 2 * L->ffn, s.gates, 0, s.wide);
                lora_rows(L->lora_w13, s.normed, rows, L->dim, adapters, s.gates, 2 * L->ffn, L->bf16, s.lora);
                swiglu_runs(s.gates, rows, L->ffn, s.first, L->bf16);
            } else
                layer_matmul(L, s.normed, rows, L->dim, L->w13, 2 * L->ffn, s.first, 1, s.wide);
            layer_matmul(L, s.first, rows, L->ffn, L->w2, L->dim, delta_out, 0, s.wide);
            if (w2) lora_rows(L->lora_w2, s.first, rows, L->ffn, adapters, delta_out, L->dim, L->bf16, s.lora);
        }
    }
}

/* h += delta (unless NULL), then y = RMSNorm(h): a step with prompt rows between its layers, whose
 * attention runs from Python (each prompt chunk on its own). */
void residual_norm(void *h, const void *delta, const void *weight, void *y, int64_t rows, int64_t dim, float eps,
                   int bf16) {
#pragma omp parallel
    add_and_norm(h, delta, weight, y, rows, dim, eps, bf16);
}

/* Without tensor parallelism nothing happens between the halves: every layer in one call, and
 * h ends as the residual stream after the last layer. delta [rows][dim] is scratch. */
int decode_stack(const struct DecodeLayer *layers, int64_t n_layers, const struct DecodeRows *R, void *h, void *delta,
                 void *scratch, int write_first) {
    if (n_layers == 0) return TPL_OK;
    for (int64_t i = 0; i < n_layers; i++) {
        int status = attention_block(&layers[i], R, h, i ? delta : NULL, delta, scratch, write_first);
        if (status) return status; /* only the first layer can refuse: every layer sees the same rows */
        ffn_block(&layers[i], R->rows, R->adapters, h, delta, delta, scratch);
    }
#pragma omp parallel
    add_rows(h, delta, R->rows, layers[0].dim, layers[0].bf16);
    return TPL_OK;
}
