/* AVX-512 helpers shared by matmul.c and layer.c: lane masks, bfloat16 <-> float32,
 * e^x and SwiGLU's gate. */
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

/* e^x to about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^6. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x); /* x second: NaN passes through */
    x = _mm512_min_ps(_mm512_set1_ps(88.7f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* ln2 in two parts */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* SwiGLU's silu(gate) * up, rounded where PyTorch's bfloat16 ops round (gate and up arrive as
 * they were stored). */
static inline __m512 swiglu16(__m512 gate, __m512 up, int bf16) {
    gate = as_stored(gate, bf16);
    __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
    return _mm512_mul_ps(as_stored(silu, bf16), as_stored(up, bf16));
}

#endif
