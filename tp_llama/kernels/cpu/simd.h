/* The 16-lane float32 vector every kernel is written in, and the helpers built on it: lane masks,
 * bfloat16 <-> float32, e^x, SwiGLU's gate, RoPE's pairs, horizontal sums.
 *
 * One source serves two builds (build.py): with AVX-512 a `vec` is one zmm register and a `mask16`
 * one k register; with AVX2 (AMD's Zen 2/3, older Xeons) a `vec` is two ymm registers and a
 * `mask16` 16 bits the helpers expand. The kernels never name an instruction set's intrinsics
 * outside this file, except where one build alone has the instruction (AMX, vdpbf16ps).
 */
#ifndef TP_LLAMA_CPU_SIMD_H
#define TP_LLAMA_CPU_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)

typedef __m512 vec;
typedef __mmask16 mask16;
typedef __m512d dvec; /* 8 float64 sums */

static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vset1(float a) { return _mm512_set1_ps(a); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vloadz(mask16 m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
static inline void vstorem(float *p, mask16 m, vec v) { _mm512_mask_storeu_ps(p, m, v); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vfmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
/* max and min return b where either is NaN, as the instructions do: argument order is NaN policy. */
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
static inline vec vkeep(mask16 m, vec v) { return _mm512_maskz_mov_ps(m, v); }
/* max(a, b) in the lanes of m, src in the others. */
static inline vec vmax_in(vec src, mask16 m, vec a, vec b) { return _mm512_mask_max_ps(src, m, a, b); }
static inline mask16 vge(mask16 m, vec a, vec b) { return _mm512_mask_cmp_ps_mask(m, a, b, _CMP_GE_OQ); }
static inline mask16 vgt(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline float vhighest(vec v) { return _mm512_reduce_max_ps(v); }
/* The lanes truncated to int32, stored in the lanes of m. */
static inline void vstore_int(int32_t *p, mask16 m, vec v) { _mm512_mask_storeu_epi32(p, m, _mm512_cvttps_epi32(v)); }
/* The lanes of m where p[i] == value. */
static inline mask16 veq_int(mask16 m, const int32_t *p, int32_t value) {
    return _mm512_mask_cmpeq_epi32_mask(m, _mm512_maskz_loadu_epi32(m, p), _mm512_set1_epi32(value));
}

static inline __m256 high_half(vec v) { /* AVX-512F alone: no DQ needed */
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
static inline dvec dzero(void) { return _mm512_setzero_pd(); }
/* acc plus the 16 lanes widened to float64, the low 8 then the high 8. */
static inline dvec dadd(dvec acc, vec v) {
    acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    return _mm512_add_pd(acc, _mm512_cvtps_pd(high_half(v)));
}
static inline double dsum(dvec acc) { return _mm512_reduce_add_pd(acc); }

/* Round to nearest even, as PyTorch does; NaN stays NaN. */
static inline __m256i to_bf16(vec v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

static inline vec from_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
static inline __m256i load_bf16(mask16 m, const uint16_t *p) { return _mm256_maskz_loadu_epi16(m, p); }
static inline void store_bf16(uint16_t *p, mask16 m, __m256i h) { _mm256_mask_storeu_epi16(p, m, h); }

/* 16 pairs of bfloat16 (a weight tile's k and k + 1 of 16 columns) as two float32 vectors. */
static inline void bf16_pairs(const uint16_t *p, vec *even, vec *odd) {
    __m512i pairs = _mm512_loadu_si512((const void *)p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000)));
}

/* x * 2^n for whole-number n in [-150, 128]. */
static inline vec vscale2(vec x, vec n) { return _mm512_scalef_ps(x, n); }
static inline vec vround(vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vfnmadd(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }

/* Lanes (2i, 2i+1) are one complex number, times cs[2i] + cs[2i+1] j. */
static inline vec vrotate_pairs(vec x, vec cs) {
    return _mm512_fmaddsub_ps(x, _mm512_moveldup_ps(cs), _mm512_mul_ps(_mm512_permute_ps(x, 0xB1), _mm512_movehdup_ps(cs)));
}

/* r[i] = the sum of v[i]'s lanes: 16 keys' dot products from their lane-wise partial sums, in
 * 45 shuffles and adds where 16 separate reductions take about 130. */
static inline vec vsum_each(const vec v[16]) {
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

/* Integer dot products (quant.c): a qvec is 16 columns x 4 k of bytes, an ivec their 16 int32 sums. */
typedef __m512i ivec;
typedef __m512i qvec;
static inline ivec izero(void) { return _mm512_setzero_si512(); }
static inline qvec qload(const void *p) { return _mm512_loadu_si512(p); }
static inline qvec qset4(const void *p) {
    int32_t four;
    memcpy(&four, p, sizeof(four));
    return _mm512_set1_epi32(four);
}
static inline qvec qlow(qvec b) { return _mm512_and_si512(b, _mm512_set1_epi8(0x0F)); }
static inline qvec qhigh(qvec b) { return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(0x0F)); }
/* w's bytes negated where x's are negative (no vpsignb in AVX-512; x's zeros meet |x| = 0 anyway). */
static inline qvec qsign(qvec w, qvec x) {
    return _mm512_mask_sub_epi8(w, _mm512_movepi8_mask(x), _mm512_setzero_si512(), w);
}
/* acc + each column's 4 products of unsigned u and signed s bytes; vpmaddubsw's int16 pairs must
 * not saturate (quant.c keeps every pair under 2^15). */
static inline ivec idot(ivec acc, qvec u, qvec s) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
/* A block's sums where its pairs' total stays under 2^15 (int4's nibbles): without VNNI they add as
 * vpmaddubsw's int16 pairs, widened once a block (isums_end) instead of once a step. */
#ifdef __AVX512VNNI__
typedef __m512i isums;
static inline isums isums_add(isums acc, qvec u, qvec s) { return _mm512_dpbusd_epi32(acc, u, s); }
static inline ivec isums_end(isums acc) { return acc; }
#else
typedef __m512i isums;
static inline isums isums_add(isums acc, qvec u, qvec s) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, s)); }
static inline ivec isums_end(isums acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
#endif
/* int8 weights with int16 inputs (quant.c's pair tiles): a qvec of 16 columns x 2 k as int16 (from 32
 * bytes; qset4 puts a k pair of x in every column), and acc + each column's 2 products. */
static inline qvec qload_pairs(const void *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline ivec pdot(ivec acc, qvec w, qvec x) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
static inline vec ifloat(ivec a) { return _mm512_cvtepi32_ps(a); }
static inline vec load_halves(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

#elif defined(__AVX2__) && defined(__FMA__)

typedef struct {
    __m256 lo, hi;
} vec;
typedef uint16_t mask16;
typedef struct {
    __m256d lo, hi;
} dvec;

#define BOTH(EXPR_LO, EXPR_HI) ((vec){EXPR_LO, EXPR_HI})
static inline vec vzero(void) { return BOTH(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vec vset1(float a) { return BOTH(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
static inline vec vload(const float *p) { return BOTH(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void vstore(float *p, vec v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}

/* 8 bits of a mask as 8 lanes of all ones or zeros. */
static inline __m256i expand8(unsigned bits) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}
static inline __m256 blend_zero(unsigned bits, __m256 v) { return _mm256_and_ps(_mm256_castsi256_ps(expand8(bits)), v); }

static inline vec vloadz(mask16 m, const float *p) {
    if (m == 0xFFFF) return vload(p);
    return BOTH(_mm256_maskload_ps(p, expand8(m & 0xFF)), _mm256_maskload_ps(p + 8, expand8(m >> 8)));
}
static inline void vstorem(float *p, mask16 m, vec v) {
    if (m == 0xFFFF) {
        vstore(p, v);
        return;
    }
    _mm256_maskstore_ps(p, expand8(m & 0xFF), v.lo);
    _mm256_maskstore_ps(p + 8, expand8(m >> 8), v.hi);
}
static inline vec vadd(vec a, vec b) { return BOTH(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline vec vsub(vec a, vec b) { return BOTH(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline vec vmul(vec a, vec b) { return BOTH(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline vec vdiv(vec a, vec b) { return BOTH(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
static inline vec vfmadd(vec a, vec b, vec c) {
    return BOTH(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline vec vfnmadd(vec a, vec b, vec c) {
    return BOTH(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
static inline vec vmax(vec a, vec b) { return BOTH(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline vec vmin(vec a, vec b) { return BOTH(_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)); }
static inline vec vkeep(mask16 m, vec v) { return BOTH(blend_zero(m & 0xFF, v.lo), blend_zero(m >> 8, v.hi)); }
static inline vec vmax_in(vec src, mask16 m, vec a, vec b) {
    vec high = vmax(a, b);
    return BOTH(_mm256_blendv_ps(src.lo, high.lo, _mm256_castsi256_ps(expand8(m & 0xFF))),
                _mm256_blendv_ps(src.hi, high.hi, _mm256_castsi256_ps(expand8(m >> 8))));
}
static inline mask16 vge(mask16 m, vec a, vec b) {
    unsigned lo = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ));
    return (mask16)(m & (lo | (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ)) << 8));
}
static inline mask16 vgt(vec a, vec b) {
    unsigned lo = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ));
    return (mask16)(lo | (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)) << 8);
}
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vsum(vec v) { return sum8(_mm256_add_ps(v.lo, v.hi)); }
static inline float vhighest(vec v) {
    __m256 m = _mm256_max_ps(v.lo, v.hi);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline void vstore_int(int32_t *p, mask16 m, vec v) {
    _mm256_maskstore_epi32(p, expand8(m & 0xFF), _mm256_cvttps_epi32(v.lo));
    _mm256_maskstore_epi32(p + 8, expand8(m >> 8), _mm256_cvttps_epi32(v.hi));
}
static inline mask16 veq_int(mask16 m, const int32_t *p, int32_t value) {
    const __m256i v = _mm256_set1_epi32(value);
    unsigned lo = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(
        _mm256_cmpeq_epi32(_mm256_maskload_epi32(p, expand8(m & 0xFF)), v)));
    unsigned hi = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(
        _mm256_cmpeq_epi32(_mm256_maskload_epi32(p + 8, expand8(m >> 8)), v)));
    return (mask16)(m & (lo | hi << 8));
}

static inline dvec dzero(void) { return (dvec){_mm256_setzero_pd(), _mm256_setzero_pd()}; }
static inline dvec dadd(dvec acc, vec v) {
    acc.lo = _mm256_add_pd(acc.lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v.lo)));
    acc.hi = _mm256_add_pd(acc.hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v.lo, 1)));
    acc.lo = _mm256_add_pd(acc.lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v.hi)));
    acc.hi = _mm256_add_pd(acc.hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v.hi, 1)));
    return acc;
}
static inline double dsum(dvec acc) {
    __m256d s = _mm256_add_pd(acc.lo, acc.hi);
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

/* Round to nearest even, as PyTorch does; NaN stays NaN. */
static inline __m256i round_bf16(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    rounded = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet),
                                                   _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm256_srli_epi32(rounded, 16);
}
static inline __m256i to_bf16(vec v) { /* packus interleaves 128-bit lanes; the permute restores order */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16(v.lo), round_bf16(v.hi)), 0xD8);
}
static inline vec from_bf16(__m256i h) {
    return BOTH(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16)),
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16)));
}
/* AVX2 masks no 16-bit lanes: a partial vector goes through a copy. */
static inline __m256i load_bf16(mask16 m, const uint16_t *p) {
    if (m == 0xFFFF) return _mm256_loadu_si256((const __m256i *)p);
    uint16_t part[16] = {0};
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) part[i] = p[i];
    return _mm256_loadu_si256((const __m256i *)part);
}
static inline void store_bf16(uint16_t *p, mask16 m, __m256i h) {
    if (m == 0xFFFF) {
        _mm256_storeu_si256((__m256i *)p, h);
        return;
    }
    uint16_t part[16];
    _mm256_storeu_si256((__m256i *)part, h);
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) p[i] = part[i];
}

static inline void bf16_pairs(const uint16_t *p, vec *even, vec *odd) {
    __m256i lo = _mm256_loadu_si256((const __m256i *)p), hi = _mm256_loadu_si256((const __m256i *)(p + 16));
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000);
    *even = BOTH(_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)));
    *odd = BOTH(_mm256_castsi256_ps(_mm256_and_si256(lo, high)), _mm256_castsi256_ps(_mm256_and_si256(hi, high)));
}

/* x * 2^n in two exact powers of two, so the result rounds once, as vscalefps does. */
static inline __m256 scale2_8(__m256 x, __m256 n) {
    __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1);
    __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    __m256i rest = _mm256_add_epi32(_mm256_sub_epi32(whole, half), _mm256_set1_epi32(127));
    return _mm256_mul_ps(_mm256_mul_ps(x, first), _mm256_castsi256_ps(_mm256_slli_epi32(rest, 23)));
}
static inline vec vscale2(vec x, vec n) { return BOTH(scale2_8(x.lo, n.lo), scale2_8(x.hi, n.hi)); }
/* The rounding mode is an immediate: a macro, so an unoptimised build (-O0) compiles it too. */
#define ROUND_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vec vround(vec v) { return BOTH(_mm256_round_ps(v.lo, ROUND_NEAREST), _mm256_round_ps(v.hi, ROUND_NEAREST)); }
#undef ROUND_NEAREST

static inline __m256 rotate8(__m256 x, __m256 cs) {
    return _mm256_fmaddsub_ps(x, _mm256_moveldup_ps(cs), _mm256_mul_ps(_mm256_permute_ps(x, 0xB1), _mm256_movehdup_ps(cs)));
}
static inline vec vrotate_pairs(vec x, vec cs) { return BOTH(rotate8(x.lo, cs.lo), rotate8(x.hi, cs.hi)); }

/* Lane i of the result: the sum of s[i]'s lanes, for 8 vectors s. */
static inline __m256 sum_each8(const __m256 s[8]) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
static inline vec vsum_each(const vec v[16]) {
    __m256 s[16];
    for (int i = 0; i < 16; i++) s[i] = _mm256_add_ps(v[i].lo, v[i].hi);
    return BOTH(sum_each8(s), sum_each8(s + 8));
}
typedef struct {
    __m256i lo, hi;
} ivec;
typedef ivec qvec;
#define IBOTH(EXPR_LO, EXPR_HI) ((ivec){EXPR_LO, EXPR_HI})
static inline ivec izero(void) { return IBOTH(_mm256_setzero_si256(), _mm256_setzero_si256()); }
static inline qvec qload(const void *p) {
    return IBOTH(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
static inline qvec qset4(const void *p) {
    int32_t four;
    memcpy(&four, p, sizeof(four));
    return IBOTH(_mm256_set1_epi32(four), _mm256_set1_epi32(four));
}
static inline __m256i low8(__m256i b) { return _mm256_and_si256(b, _mm256_set1_epi8(0x0F)); }
static inline qvec qlow(qvec b) { return IBOTH(low8(b.lo), low8(b.hi)); }
static inline qvec qhigh(qvec b) { return IBOTH(low8(_mm256_srli_epi16(b.lo, 4)), low8(_mm256_srli_epi16(b.hi, 4))); }
static inline qvec qsign(qvec w, qvec x) { return IBOTH(_mm256_sign_epi8(w.lo, x.lo), _mm256_sign_epi8(w.hi, x.hi)); }
static inline __m256i idot8(__m256i acc, __m256i u, __m256i s) {
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
static inline ivec idot(ivec acc, qvec u, qvec s) { return IBOTH(idot8(acc.lo, u.lo, s.lo), idot8(acc.hi, u.hi, s.hi)); }
typedef ivec isums;
#ifdef __AVXVNNI__
static inline isums isums_add(isums acc, qvec u, qvec s) { return idot(acc, u, s); }
static inline ivec isums_end(isums acc) { return acc; }
#else
static inline __m256i pairs8(__m256i acc, __m256i u, __m256i s) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s)); }
static inline isums isums_add(isums acc, qvec u, qvec s) { return IBOTH(pairs8(acc.lo, u.lo, s.lo), pairs8(acc.hi, u.hi, s.hi)); }
static inline ivec isums_end(isums acc) {
    return IBOTH(_mm256_madd_epi16(acc.lo, _mm256_set1_epi16(1)), _mm256_madd_epi16(acc.hi, _mm256_set1_epi16(1)));
}
#endif
static inline qvec qload_pairs(const void *p) {
    return IBOTH(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)),
                 _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p + 1)));
}
static inline __m256i pdot8(__m256i acc, __m256i w, __m256i x) {
#ifdef __AVXVNNI__
    return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}
static inline ivec pdot(ivec acc, qvec w, qvec x) { return IBOTH(pdot8(acc.lo, w.lo, x.lo), pdot8(acc.hi, w.hi, x.hi)); }
#undef IBOTH
static inline vec ifloat(ivec a) { return BOTH(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); }
static inline vec load_halves(const void *p) {
    return BOTH(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p + 1)));
}
#undef BOTH

#else
#error "tp_llama's C kernels need AVX-512 (avx512f, avx512bw, avx512vl) or AVX2 with FMA"
#endif

/* The lanes' sum in float64. */
static inline double vsum_double(vec v) { return dsum(dadd(dzero(), v)); }

/* The lanes of a 16-wide vector that hold one of the `left` elements still to go. */
static inline mask16 lanes(int64_t left) {
    return left >= 16 ? (mask16)0xFFFF : left <= 0 ? (mask16)0 : (mask16)((1u << left) - 1);
}

/* Up to 16 elements from p[i..] of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array, as float32. */
static inline vec load16(const void *p, int64_t i, int bf16, mask16 m) {
    if (bf16) return from_bf16(load_bf16(m, (const uint16_t *)p + i));
    return vloadz(m, (const float *)p + i);
}

/* The inverse of load16: float32 lanes stored in the array's type (rounded for bfloat16). */
static inline void store16(void *p, int64_t i, vec v, int bf16, mask16 m) {
    if (bf16)
        store_bf16((uint16_t *)p + i, m, to_bf16(v));
    else
        vstorem((float *)p + i, m, v);
}

/* v as the array's type would hold it: the rounding PyTorch applies between two bfloat16 ops. */
static inline vec as_stored(vec v, int bf16) { return bf16 ? from_bf16(to_bf16(v)) : v; }

/* e^x to about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^6. */
static inline vec exp16(vec x) {
    x = vmax(vset1(-104.0f), x); /* x second: NaN passes through */
    x = vmin(vset1(88.7f), x);
    vec n = vround(vmul(x, vset1(1.44269504f)));
    vec r = vfnmadd(n, vset1(0.693359375f), x); /* ln2 in two parts */
    r = vfnmadd(n, vset1(-2.12194440e-4f), r);
    vec p = vset1(1.0f / 720);
    p = vfmadd(p, r, vset1(1.0f / 120));
    p = vfmadd(p, r, vset1(1.0f / 24));
    p = vfmadd(p, r, vset1(1.0f / 6));
    p = vfmadd(p, r, vset1(0.5f));
    p = vfmadd(p, r, vset1(1.0f));
    p = vfmadd(p, r, vset1(1.0f));
    return vscale2(p, n);
}

/* SwiGLU's silu(gate) * up, rounded where PyTorch's bfloat16 ops round (gate and up arrive as
 * they were stored). */
static inline vec swiglu16(vec gate, vec up, int bf16) {
    gate = as_stored(gate, bf16);
    vec silu = vdiv(gate, vadd(vset1(1.0f), exp16(vsub(vzero(), gate))));
    return vmul(as_stored(silu, bf16), as_stored(up, bf16));
}

/* One row of a tile's output: 32 columns as two vectors (`cols` of them real) stored at y[i..] in y's
 * type; gated, they are 16 gate and 16 up columns, and silu(gate) * up goes out, 16 columns. */
static inline void put_row(void *y, int64_t i, vec lo, vec hi, int64_t cols, int gated, int bf16) {
    if (gated) {
        store16(y, i, swiglu16(lo, hi, bf16), bf16, 0xFFFF);
        return;
    }
    store16(y, i, lo, bf16, lanes(cols));
    store16(y, i + 16, hi, bf16, lanes(cols - 16));
}

/* bfloat16 x times pairs of bfloat16 weights along k, 16 columns a pair (a matmul tile's, an
 * attention's keys or values), into float32 sums. With avx512_bf16 by vdpbf16ps, which adds a
 * column's two exact products into its sum: x comes as pairs broadcast from memory, nothing is
 * widened, and one instruction does what takes two FMAs and a widening below. CPUs with
 * avx512_bf16 and no AMX (AMD's Zen 4 and 5) run it at every row count, so a row's bits do not
 * depend on its batch. Elsewhere x is float32 (the caller widens it once), the weights' pairs are
 * widened in registers (a shift and a mask) and multiplied by FMA: the same exact products. */
#ifdef __AVX512BF16__
#define BF16_X uint16_t
typedef __m512bh bf16_weights;

static inline bf16_weights load_bf16_weights(const uint16_t *w) { return (__m512bh)_mm512_loadu_si512(w); }

/* acc += the pair x[0], x[1] times each column's pair of weights. */
static inline vec bf16_step(vec acc, const BF16_X *x, bf16_weights w) {
    int32_t pair;
    memcpy(&pair, x, sizeof(pair));
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), w);
}
#else
#define BF16_X float
typedef struct {
    vec even, odd;
} bf16_weights;

static inline bf16_weights load_bf16_weights(const uint16_t *w) {
    bf16_weights pairs;
    bf16_pairs(w, &pairs.even, &pairs.odd);
    return pairs;
}

static inline vec bf16_step(vec acc, const BF16_X *x, bf16_weights w) {
    return vfmadd(vset1(x[1]), w.odd, vfmadd(vset1(x[0]), w.even, acc));
}
#endif

/* n bfloat16 values as bf16_step reads its x: as they are for vdpbf16ps, widened for the FMAs. */
static inline void put_bf16_x(BF16_X *to, const uint16_t *from, int64_t n) {
#ifdef __AVX512BF16__
    memcpy(to, from, (size_t)n * sizeof(uint16_t));
#else
    for (int64_t i = 0; i < n; i += 16) vstorem(to + i, lanes(n - i), load16(from, i, 1, lanes(n - i)));
#endif
}

#endif
