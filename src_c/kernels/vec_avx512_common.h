/* vec_avx512_common.h - the part of the vector layer both AVX-512 rows share (avx512 and
 * avx512fp16): 16 floats per vector, AVX-512 F/BW/VL code only, plus the int8 products of
 * v8_x86.h (VPDPBUSD: both rows are compiled with VNNI).
 *
 * A row's vec_<isa>.h defines KV_ISA and kv_widen16 (16 halves -> 16 floats, however its ISA
 * does it), includes this file, then adds what is its own (kv_half, vf_half; complex fp16 on
 * avx512fp16).  Everything here must stay freestanding (no libc): the tests run both rows'
 * machine code in an instruction-level emulator, where a libc call would fault.
 *
 * Loops of a fixed small count over arrays of vectors (transposes, add trees, the int8 keys'
 * tile) carry `#pragma GCC unroll`, here and in v8_x86.h / vec_avx2.h: at -O2 gcc left some as
 * loops over arrays on the stack, and the int8 keys' tile took 1.25-1.4x the time (Zen 5).
 */
#ifndef KV_VEC_AVX512_COMMON_H
#define KV_VEC_AVX512_COMMON_H
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "vec_avx512_common.h needs -mavx512f -mavx512bw -mavx512vl -mavx512vnni"
#endif
#ifndef KV_ISA
#error "include a row's vec_<isa>.h, which defines KV_ISA and kv_widen16 first"
#endif
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "fp16_soft.h"

#define KV_W 16
#define KV_B 16
#define KV_GS 8
#define KV_ACC 16

typedef __m512 vf;

static inline __mmask16 kv_m16(int64_t n) { return (__mmask16)(n >= 16 ? 0xFFFFu : ((1u << n) - 1u)); }
static inline __mmask32 kv_m32(int64_t n) { return (__mmask32)(n >= 32 ? 0xFFFFFFFFu : ((1u << n) - 1u)); }

/* upper 256 bits of a (AVX512F only: extractf32x8 would need AVX512DQ) */
static inline __m256 kv_hi256(__m512 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_load_part(const float *p, int64_t n) { return _mm512_maskz_loadu_ps(kv_m16(n), p); }
static inline void vf_store_part(float *p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, kv_m16(n), v); }

/* 16 int8 values widened to 16 floats (exact: VPMOVSXBD, VCVTDQ2PS); _part: the first n, zeros after */
static inline vf vf_load_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf vf_load_i8_part(const int8_t *p, int64_t n)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(kv_m16(n), p)));
}
/* 4-bit values (kvsimd.h KV_I4: stored as q + 8) of the 16 bytes in x, low (hi = 0) or high nibbles:
   each byte widened to a lane, shifted, and its low 4 bits pick q as a float from a 16-entry table
   (VPERMPS reads only those bits of each index: no mask, no subtraction, no conversion) */
static inline __m512 kv_i4_table(void) { return _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline vf kv_i4_widen(__m128i x, int hi)
{
    return _mm512_permutexvar_ps(_mm512_srl_epi32(_mm512_cvtepu8_epi32(x), _mm_cvtsi32_si128(4 * hi)), kv_i4_table());
}
static inline vf vf_load_i4(const uint8_t *p, int hi) { return kv_i4_widen(_mm_loadu_si128((const __m128i *)p), hi); }
/* both halves of the 16 bytes in x: the low nibbles' values and the high ones' (the vectors at c and
   c + 16 of a block), from one widening */
static inline void kv_i4_pair(__m128i x, vf *lo, vf *hi)
{
    const __m512i w = _mm512_cvtepu8_epi32(x);
    *lo = _mm512_permutexvar_ps(w, kv_i4_table());
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), kv_i4_table());
}
static inline void vf_load_i4_pair(const uint8_t *p, vf *lo, vf *hi) { kv_i4_pair(_mm_loadu_si128((const __m128i *)p), lo, hi); }
/* 16 halves widened to 16 floats by the row's kv_widen16 */
static inline vf vf_load_h(const uint16_t *p) { return kv_widen16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vf_load_h_part(const uint16_t *p, int64_t n) { return kv_widen16(_mm256_maskz_loadu_epi16(kv_m16(n), p)); }
static inline void vf_store_h(uint16_t *p, vf v)
{
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline void vf_store_h_part(uint16_t *p, vf v, int64_t n)
{
    _mm256_mask_storeu_epi16(p, kv_m16(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* NumPy-identical conversions: hardware quiets NaNs, NumPy does not; patch NaN lanes. */
static inline void vf_store_h_exact(uint16_t *p, vf v)
{
    vf_store_h(p, v);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan) {
        float tmp[16];
        _mm512_storeu_ps(tmp, v);
        for (int i = 0; i < 16; i++)
            if (nan >> i & 1)
                p[i] = kv_f2h_soft(tmp[i]);
    }
}
static inline vf vf_load_h_exact(const uint16_t *p)
{
    vf v = vf_load_h(p);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan) {
        float tmp[16];
        _mm512_storeu_ps(tmp, v);
        for (int i = 0; i < 16; i++)
            if (nan >> i & 1)
                tmp[i] = kv_h2f_soft(p[i]);
        v = _mm512_loadu_ps(tmp);
    }
    return v;
}

/* x, kept in a register: the compiler may not fold its load into each use (an empty asm that
   "changes" it).  A load folded into R FMAs is R loads, and two per FMA starve the FMA ports. */
static inline vf vf_pin(vf x) { __asm__("" : "+v"(x)); return x; }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
/* lane-wise a < b ? x : y (false for NaN lanes) */
static inline vf vf_select_lt(vf a, vf b, vf x, vf y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x); }
static inline float vf_hmax(vf a)
{
    __m256 x = _mm256_max_ps(_mm512_castps512_ps256(a), kv_hi256(a));
    __m128 y = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_max_ps(y, _mm_movehl_ps(y, y));
    y = _mm_max_ss(y, _mm_movehdup_ps(y));
    return _mm_cvtss_f32(y);
}
static inline float vf_hsum(vf a)
{
    __m256 x = _mm256_add_ps(_mm512_castps512_ps256(a), kv_hi256(a));
    __m128 y = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_add_ps(y, _mm_movehl_ps(y, y));
    y = _mm_add_ss(y, _mm_movehdup_ps(y));
    return _mm_cvtss_f32(y);
}
static inline float vf_first(vf a) { return _mm512_cvtss_f32(a); }
static inline vf vf_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_pow2i(vf n)
{
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}

/* The attention scores hold two keys per vector (KV_KP): key rows side by side, 8 elements of
   each (attn.inc.h, kv_load_keys).  With one key per vector, each dot product would end in a
   16-lane reduction of its own -- cross-lane shuffles that cost as much as the products at
   D = 64 on a core that splits 512-bit shuffles in two (Zen 4); with two, one tree reduces 16. */
#define KV_KP 2
/* the 8 floats at p in both halves (VBROADCASTF64X4: AVX512F, a load) */
static inline vf vf_load_dup(const float *p) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)p))); }
/* 8 elements of two rows, p0's in lanes 0-7 and p1's in lanes 8-15: float32, float16 widened,
   int8 widened (exact) */
static inline vf vf_load2(const float *p0, const float *p1)
{
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_loadu_pd((const double *)p0)),
                                               _mm256_loadu_pd((const double *)p1), 1));
}
static inline vf vf_load_h2(const uint16_t *p0, const uint16_t *p1)
{
    return kv_widen16(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                              _mm_loadu_si128((const __m128i *)p1), 1));
}
static inline vf vf_load_i8_2(const int8_t *p0, const int8_t *p1)
{
    const __m128i x = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p0), _mm_loadl_epi64((const __m128i *)p1));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
}
static inline void vf_load_i4_2pair(const uint8_t *p0, const uint8_t *p1, vf *lo, vf *hi)
{
    kv_i4_pair(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p0), _mm_loadl_epi64((const __m128i *)p1)), lo, hi);
}
/* a in lanes 0-7, b in lanes 8-15 */
static inline vf vf_set2(float a, float b)
{
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(a)), _mm256_castps_pd(_mm256_set1_ps(b)), 1));
}

/* out[j] = the sum of the 8 lanes of key j, for the 16 keys of 8 vectors (vector p: key 2p in
   lanes 0-7, key 2p + 1 in lanes 8-15): an add tree inside 128-bit lanes, then across them. */
static inline void vf_reduce_keys(const vf *a, float *out)
{
    __m512 b[4], c[2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)   /* lane k: [x0 + x2, y0 + y2, x1 + x3, y1 + y3] of lane k of x = a[2i], y = a[2i+1] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) {   /* lane k: the sums of lane k of a[4i], .., a[4i+3] */
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* [c0 lanes 0+1, c0 lanes 2+3, c1 lanes 0+1, c1 lanes 2+3]: keys 0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15 */
    const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, d));
}

/* out[j] = sum of the 16 lanes of a[j], for 16 vectors of one key each (a transposing add
   tree: a single query head's scores, attn.inc.h KV_KPN). */
static inline void vf_reduce_rows(const vf *a, float *out)
{
    __m512 b[8], c[4], d[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {   /* 256-bit half 0: item 2i, half 1: item 2i+1 */
        __m512 x = a[2 * i], y = a[2 * i + 1];
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {   /* 128-bit lane k: item 4i+k */
        __m512 x = b[2 * i], y = b[2 * i + 1];
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) {   /* lane k: [X_a, Y_a, X_b, Y_b], X = item 8i+k, Y = item 8i+4+k */
        __m512 x = c[2 * i], y = c[2 * i + 1];
        d[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    /* lane k: [item k, item 4+k, item 8+k, item 12+k] */
    __m512d x = _mm512_castps_pd(d[0]), y = _mm512_castps_pd(d[1]);
    __m512 e = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    /* position 4k+s holds item 4s+k */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, e));
}

static inline vf vf_swap_pairs(vf x) { return _mm512_permute_ps(x, 0xB1); }

/* The query-on-lanes path's pair layout (attn.inc.h, KV_LANE_PAIRS): lane 2i + p of a vector
   holds element 2e + p of query vector i.  vf_bcast2: the two floats at p in every pair of lanes
   (one 8-byte VBROADCASTSD); vf_pair_sums: lanes 2i + 2i+1 of a into lane i and of b into lane
   8 + i; vf_dup_lo / vf_dup_hi: lanes 0..7 / 8..15 of a, each twice. */
static inline vf vf_bcast2(const float *p)
{
    double x;
    __builtin_memcpy(&x, p, sizeof x);
    return _mm512_castpd_ps(_mm512_set1_pd(x));
}
static inline vf vf_pair_sums(vf a, vf b)
{
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}
static inline vf vf_dup_lo(vf a) { return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), a); }
static inline vf vf_dup_hi(vf a)
{
    return _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), a);
}

/* Integer lanes for the weight decoders (wt_*.inc.h): KV_W int32 lanes. */
#define KV_VREGS 32   /* vector registers (gemv.inc.h sizes its register tiles by it) */
typedef __m512i vi;
static inline vi vi_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vi_i8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vi_and(vi a, int32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_shr(vi a, int s) { return _mm512_srli_epi32(a, (unsigned)s); }
static inline vi vi_shl(vi a, int s) { return _mm512_slli_epi32(a, (unsigned)s); }
static inline vi vi_load(const int32_t *p) { return _mm512_loadu_si512(p); }
static inline vi vi_andv(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_srlv(vi a, vi n) { return _mm512_srlv_epi32(a, n); }
/* lane l: p16[idx[l]], or 0 where idx[l] < 0 (p16: 16 readable bytes; idx: KV_W entries) */
static inline vi vi_gather_u8(const uint8_t *p16, const int8_t *idx)
{
    const __m128i b = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)p16), _mm_loadu_si128((const __m128i *)idx));
    return _mm512_cvtepu8_epi32(b);
}
static inline vf vf_from_vi(vi a) { return _mm512_cvtepi32_ps(a); }
/* lane l: t[idx[l] mod 16] (VPERMPS reads the low 4 bits of each index) */
#define KV_HAVE_LUT16 1
static inline vf vf_lut16(vf t, vi idx) { return _mm512_permutexvar_ps(idx, t); }
static inline vf vf_iota(void) { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
/* lane l: (t0, t1)[idx[l] mod 32] (VPERMT2PS reads the low 5 bits) */
static inline vf vf_lut32(vf t0, vf t1, vi idx) { return _mm512_permutex2var_ps(t0, idx, t1); }
static inline vf vf_load_bf16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#include "v8_x86.h"   /* the int8-activation product's 8-lane forms */

/* The int8 attention keys' tile (attn.inc.h, kv_scores_i8): 16 keys on the lanes of a 512-bit
   register, keys 0-7 in the low half and 8-15 in the high half, each half as the 8-lane forms
   above have them.  One transpose and one VPDPBUSD per 4 values then serve 16 keys, not 8. */
#define KV_KL 16
typedef __m512i vkb;   /* 4 bytes per lane */
typedef __m512i vki;
typedef __m512 vkf;
/* r[l]: the 32 bytes at p + l stride (low half) and at p + (l + 8) stride (high half) */
static inline void vkb_rows(vkb r[8], const uint8_t *p, int64_t stride)
{
#pragma GCC unroll 8
    for (int l = 0; l < 8; l++)
        r[l] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + l * stride))),
                                  _mm256_loadu_si256((const __m256i *)(p + (l + 8) * stride)), 1);
}
/* v8b_transpose8 in each half: r[d] <- dword d of each row, lane l from row l */
static inline void vkb_transpose8(vkb r[8])
{
    __m512i u[8];
    KV_T8_IN_LANES(512, r, u);
    /* per half, 128-bit lane 0 (then 1) of u[m] and of u[4 + m]: v8b_transpose8's permute2x128 */
    const __m512i even = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), odd = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++) {
        r[m] = _mm512_permutex2var_epi64(u[m], even, u[4 + m]);
        r[m + 4] = _mm512_permutex2var_epi64(u[m], odd, u[4 + m]);
    }
}
static inline vkb vkb_flip(vkb a) { return _mm512_xor_si512(a, _mm512_set1_epi8((char)0x80)); }
static inline vkb vkb_bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
/* attn.inc.h kv_accumulate_i16: int8 values times int16 weights, two keys per VPDPWSSD.
   vw_pairs: values c..c+31 of two rows r0, r1 as 32 int16 pairs (r0's first), in two vectors: lo
   holds values 0-3, 8-11, 16-19, 24-27 (four per 128-bit lane), hi 4-7, 12-15, 20-23, 28-31 (the
   in-lane unpack of the widened rows); vw_cols puts the sums back in order. */
#define KV_HAVE_DPWSSD 1
typedef __m512i vw;
static inline vw vw_zero(void) { return _mm512_setzero_si512(); }
static inline void vw_pairs(const int8_t *r0, const int8_t *r1, vw *lo, vw *hi)
{
    const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)r0));
    const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)r1));
    *lo = _mm512_unpacklo_epi16(a, b);
    *hi = _mm512_unpackhi_epi16(a, b);
}
/* acc + per lane the pair's two products with the int16 weights w[0] (r0's) and w[1] */
static inline vw vw_dot(vw acc, vw pair, const int16_t *w)
{
    int32_t x;
    memcpy(&x, w, 4);
    /* asm: GCC 12 copies the accumulator through another register around _mm512_dpwssd_epi32 */
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(pair), "v"(_mm512_set1_epi32(x)));
    return acc;
}
/* attn.inc.h lane_accum_i16 (query vectors on the lanes): per lane the int16 pair (w0, w1), each
   rounded to the nearest integer, ties to even (|w| <= 32766.5, so it fits; NaN gives a garbage
   pair, and the span's step NaN then makes the sums NaN), and an int32 sum vector as floats */
static inline vw vw_wpair(vf w0, vf w1)
{
    return _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_cvtps_epi32(w0), _mm512_slli_epi32(_mm512_cvtps_epi32(w1), 16));
}
static inline vw vw_load(const int32_t *p) { return _mm512_loadu_si512(p); }
static inline void vw_store(int32_t *p, vw a) { _mm512_storeu_si512(p, a); }
static inline vf vw_float(vw a) { return _mm512_cvtepi32_ps(a); }
/* the sums of a (lo, hi) pair of vw_pairs as floats in value order: values 0-15 in *f0, 16-31 in *f1 */
static inline void vw_cols(vw lo, vw hi, vf *f0, vf *f1)
{
    const __m512 a = _mm512_cvtepi32_ps(lo), b = _mm512_cvtepi32_ps(hi);
    *f0 = _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), b);
    *f1 = _mm512_permutex2var_ps(a, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), b);
}
/* a's lanes rounded to the nearest integer (ties to even), saturated to int16, at p */
static inline void vf_store_i16(int16_t *p, vf a)
{
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(a)));
}
static inline vki vki_set1(int32_t a) { return _mm512_set1_epi32(a); }
static inline vki vki_load(const int32_t *p) { return _mm512_loadu_si512(p); }
static inline vkb vkb_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline vkf vkf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vki vki_dot(vki acc, vkb u, vkb s) { return _mm512_dpbusd_epi32(acc, u, s); }
static inline vkf vkf_from(vki a) { return _mm512_cvtepi32_ps(a); }
static inline vkf vkf_set1(float a) { return _mm512_set1_ps(a); }
static inline vkf vkf_zero(void) { return _mm512_setzero_ps(); }
static inline vkf vkf_mul(vkf a, vkf b) { return _mm512_mul_ps(a, b); }
static inline vkf vkf_fmadd(vkf a, vkf b, vkf c) { return _mm512_fmadd_ps(a, b, c); }
static inline void vkf_store(float *p, vkf a) { _mm512_storeu_ps(p, a); }
/* out[c] <- p[c], p[n + c], .. p[15 n + c] for c < n <= 16: v8f_cols of rows 0-7 and of 8-15 */
static inline void vkf_cols(vkf *out, const float *p, int64_t n)
{
    v8f lo[16], hi[16];
    v8f_cols(lo, p, n);
    v8f_cols(hi, p + 8 * n, n);
    for (int64_t c = 0; c < n; c++)
        out[c] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo[c])),
                                                     _mm256_castps_pd(hi[c]), 1));
}

#endif
