/* vec_avx512fp16.h - the vector layer on AVX-512 F/BW/VL/VNNI + AVX512-FP16: the AVX-512 part
 * shared with the avx512 row (vec_avx512_common.h), fp16 widened with VCVTPH2PSX, plus complex
 * fp16 multiplication (VFMULCPH, VFMADDCPH) for rotating fp16 rows.
 *
 * Everything here must stay freestanding (no libc): the tests run this row's machine code
 * in an instruction-level emulator, where a libc call would fault.
 */
#ifndef KV_VEC_H
#define KV_VEC_H
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512FP16__)
#error "vec_avx512fp16.h needs -mavx512f -mavx512bw -mavx512vl -mavx512fp16"
#endif
#include <immintrin.h>

#define KV_ISA avx512fp16

/* VCVTPH2PSX (AVX512-FP16) widens 16 halves to 16 floats. */
static inline __m512 kv_widen16(__m256i h) { return _mm512_cvtxph_ps(_mm256_castsi256_ph(h)); }

#include "vec_avx512_common.h"

/* ---- complex fp16: 16 (re, im) pairs per 512-bit vector ---- */
#define KV_HAVE_CMUL_F16 1
typedef __m512h vc16;
static inline vc16 vc16_load(const uint16_t *p) { return _mm512_loadu_ph(p); }
static inline vc16 vc16_load_part(const uint16_t *p, int64_t pairs)
{
    return _mm512_castsi512_ph(_mm512_maskz_loadu_epi32(kv_m16(pairs), p));
}
static inline void vc16_store(uint16_t *p, vc16 v) { _mm512_storeu_ph(p, v); }
static inline void vc16_store_part(uint16_t *p, vc16 v, int64_t pairs)
{
    _mm512_mask_storeu_epi32(p, kv_m16(pairs), _mm512_castph_si512(v));
}
/* x * m per complex pair, m given as fp16 hi + lo (m - hi rounded to fp16): the small part
   first, p = x * lo (VFMULCPH), then x * hi + p (VFMADDCPH).  Each component is rounded twice
   (the fused x_k * hi_re + p_k, then the fused second product), but no longer carries the
   error of an fp16-rounded multiplier: |out - x m| <= u (|x| + |out|) + O(u^2) |x|. */
static inline vc16 vc16_mul_hilo(vc16 x, vc16 hi, vc16 lo) { return _mm512_fmadd_pch(x, hi, _mm512_fmul_pch(x, lo)); }
/* 16 (cos, sin) float pairs -> 16 complex fp16 hi = fp16(m) and lo = fp16(m - hi)
   (m - hi is exact in fp32); VCVTPS2PHX / VCVTPH2PSX, pairs beyond `pairs` are 0. */
static inline void vc16_split_f32_pairs(const float *cs, int64_t pairs, vc16 *hi, vc16 *lo)
{
    __m512 a = _mm512_maskz_loadu_ps(kv_m16(2 * pairs), cs);
    __m512 b = _mm512_maskz_loadu_ps(kv_m16(2 * pairs - 16 > 0 ? 2 * pairs - 16 : 0), cs + 16);
    __m256h ah = _mm512_cvtxps_ph(a), bh = _mm512_cvtxps_ph(b);
    __m256h al = _mm512_cvtxps_ph(_mm512_sub_ps(a, _mm512_cvtxph_ps(ah)));
    __m256h bl = _mm512_cvtxps_ph(_mm512_sub_ps(b, _mm512_cvtxph_ps(bh)));
    *hi = _mm512_castsi512_ph(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_castph_si256(ah)),
                                                 _mm256_castph_si256(bh), 1));
    *lo = _mm512_castsi512_ph(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_castph_si256(al)),
                                                 _mm256_castph_si256(bl), 1));
}
/* 16 halves */
typedef __m256i vh16;
/* neox pairing: 16 halves x[r] and 16 halves x[r+R] <-> 16 complex pairs, in registers */
static inline vc16 vc16_interleave(vh16 lo, vh16 hi)
{
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_castsi512_ph(_mm512_permutexvar_epi16(idx, both));
}
static inline void vc16_deinterleave(vc16 z, vh16 *lo, vh16 *hi)
{
    const __m512i idx = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
                                         30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    __m512i s = _mm512_permutexvar_epi16(idx, _mm512_castph_si512(z));
    *lo = _mm512_castsi512_si256(s);
    *hi = _mm512_extracti64x4_epi64(s, 1);
}
static inline vh16 vh16_load_part(const uint16_t *p, int64_t n) { return _mm256_maskz_loadu_epi16(kv_m16(n), p); }
static inline void vh16_store_part(uint16_t *p, vh16 v, int64_t n) { _mm256_mask_storeu_epi16(p, kv_m16(n), v); }

/* VCVTSH2SS merges into its first source: given a zeroed one, a conversion does not wait for
   whatever last wrote its destination register (a false dependency that chained the blocks of
   a weight row one after the other) */
static inline float kv_half(const uint8_t *p)
{
    const __m128h h = _mm_castsi128_ph(_mm_loadu_si16(p));   /* VMOVW: a plain load */
    return _mm_cvtss_f32(_mm_cvtsh_ss(_mm_setzero_ps(), h));
}
/* the half at p (any alignment) in every lane */
static inline vf vf_half(const uint8_t *p)
{
    const __m128h h = _mm_castsi128_ph(_mm_loadu_si16(p));
    return _mm512_broadcastss_ps(_mm_cvtsh_ss(_mm_setzero_ps(), h));
}

#endif
