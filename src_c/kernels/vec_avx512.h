/* vec_avx512.h - the vector layer on AVX-512 F/BW/VL/DQ/VNNI (Skylake-SP with VNNI: Cascade Lake,
 * Ice Lake, Tiger Lake; AMD Zen 4 / Zen 5): the AVX-512 part shared with the avx512fp16 row
 * (vec_avx512_common.h), fp16 widened with VCVTPH2PS zmm and narrowed with VCVTPS2PH, all math
 * in fp32.  No AVX512-FP16 instruction: no complex fp16 multiply (KV_HAVE_CMUL_F16), so fp16
 * rows are rotated through fp32 as on avx2.
 *
 * Everything here must stay freestanding (no libc): the tests run this row's machine code
 * in an instruction-level emulator, where a libc call would fault.
 */
#ifndef KV_VEC_H
#define KV_VEC_H
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512DQ__) || \
    !defined(__AVX512VNNI__) || !defined(__FMA__) || !defined(__F16C__)
#error "vec_avx512.h needs -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c"
#endif
#ifdef __AVX512FP16__
#error "the avx512 row must not use AVX512-FP16: compile it without -mavx512fp16"
#endif
#include <immintrin.h>

#define KV_ISA avx512

/* VCVTPH2PS zmm (AVX512F) widens 16 halves to 16 floats. */
static inline __m512 kv_widen16(__m256i h) { return _mm512_cvtph_ps(h); }

#include "vec_avx512_common.h"

/* VCVTPH2PS xmm (F16C) of one half */
static inline float kv_half(const uint8_t *p) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_loadu_si16(p))); }
/* the half at p (any alignment) in every lane */
static inline vf vf_half(const uint8_t *p) { return _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_loadu_si16(p))); }

#endif
