/* The kernels one C file lends another. Each runs inside an OpenMP parallel region: every thread
 * of the region calls it, the threads split its work, and it ends in a barrier, so a caller can
 * chain several in one region (cpu_decode.c) instead of starting one per operation. */
#ifndef TP_LLAMA_CPU_KERNELS_H
#define TP_LLAMA_CPU_KERNELS_H

#include <stdint.h>

#define MAX_HEAD_DIM 256 /* a query and its sums in registers (Llama's heads are 64 or 128) */

/* y [M][N] = x [M][K] @ w^T, w in cpu_matmul.c's tiles (gated: SwiGLU's w1/w3, y [M][N / 2]).
 * bf16: x and y are bfloat16, and x is widened into `wide` (M * K floats) first. */
void tiled_matmul(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, int bf16,
                  float *wide);

/* Meta's RMSNorm of rows x [rows][dim] into y. */
void rms_norm_rows(const void *x, const void *weight, void *y, int64_t rows, int64_t dim, float eps, int bf16);

/* Decode attention (cpu_layer.c's decode_attention) on rows already checked to lie on the cache;
 * scores: max_threads * scores_per_thread floats. */
void attention_rows(const void *qkv, const float *rotation, const int64_t *slots, const int64_t *positions,
                    int64_t rows, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, void *cache_k,
                    void *cache_v, int64_t max_seq_len, void *out, int bf16, float *scores,
                    int64_t scores_per_thread);

/* 0 when every row's slot and position lie on the cache, -2 when one does not, -3 for a head_dim
 * over MAX_HEAD_DIM; *scores_per_thread: the scratch attention_rows needs per thread. */
int check_rows(const int64_t *slots, const int64_t *positions, int64_t rows, int64_t n_slots, int64_t max_seq_len,
               int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t *scores_per_thread);

#endif
