/* AVX-512 helpers shared by cpu_matmul.c and cpu_layer.c: lane masks, bfloat16 <-> float32. */
#ifndef TP_LLAMA_CPU_SIMD_H
#define TP_LLAMA_CPU_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* The lanes of a 16-wide vector that hold one of the `left` elements still to go. */
static inline __mmask16 lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* Round to nearest even, as PyTorch does; NaN stays NaN. */
static inline __m256i to_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

static inline __m512 from_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Up to 16 elements from p[i..] of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array, as float32. */
static inline __m512 load16(const void *p, int64_t i, int bf16, __mmask16 m) {
    if (bf16) return from_bf16(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

/* The inverse of load16: float32 lanes stored in the array's type (rounded for bfloat16). */
static inline void store16(void *p, int64_t i, __m512 v, int bf16, __mmask16 m) {
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m, to_bf16(v));
    else
        _mm512_mask_storeu_ps((float *)p + i, m, v);
}

/* v as the array's type would hold it: the rounding PyTorch applies between two bfloat16 ops. */
static inline __m512 as_stored(__m512 v, int bf16) {
    return bf16 ? from_bf16(to_bf16(v)) : v;
}

#endif
