/* vec_avx2.h - the vector layer on AVX2 + FMA + F16C: 8 floats per vector. */
#ifndef KV_VEC_H
#define KV_VEC_H
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "vec_avx2.h needs -mavx2 -mfma -mf16c"
#endif
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fp16_soft.h"

#define KV_ISA avx2
#define KV_W 8
#define KV_B 16  /* tokens per attention block (two reductions of 8) */
/* accumulators per attention inner loop: 12 (three KV groups' worth of FMA latency x ports)
   measured 5-10% faster than 8 for 3 query heads per KV head, with no spills in 16 ymm */
#define KV_ACC 12

typedef __m256 vf;

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }

static inline __m256i kv_avx2_mask(int64_t n)
{
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx);
}
static inline vf vf_load_part(const float *p, int64_t n) { return _mm256_maskload_ps(p, kv_avx2_mask(n)); }
static inline void vf_store_part(float *p, vf v, int64_t n) { _mm256_maskstore_ps(p, kv_avx2_mask(n), v); }

static inline vf vf_load_h(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void vf_store_h(uint16_t *p, vf v)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
/* 8 int8 values widened to 8 floats (exact: VPMOVSXBD, VCVTDQ2PS); _part: the first n, zeros after
   (through a small buffer, as the fp16 tails) */
static inline vf vf_load_i8(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* 8 4-bit values (kvsimd.h KV_I4: stored as q + 8), the low (hi = 0) or high nibbles of p[0..8) */
static inline vf vf_load_i4(const uint8_t *p, int hi)
{
    const __m256i x = _mm256_srl_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), _mm_cvtsi32_si128(4 * hi));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(x, _mm256_set1_epi32(15)), _mm256_set1_epi32(8)));
}
/* both: the low nibbles' values and the high ones' (the vectors at c and c + 16 of a block) */
static inline void vf_load_i4_pair(const uint8_t *p, vf *lo, vf *hi)
{
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), eight = _mm256_set1_epi32(8);
    *lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w, _mm256_set1_epi32(15)), eight));
    *hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(w, 4), eight));
}
static inline vf vf_load_i8_part(const int8_t *p, int64_t n)
{
    int8_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < n; i++)
        buf[i] = p[i];
    return vf_load_i8(buf);
}
/* AVX2 has no 16-bit masked moves: tails go through a small buffer, element by element. */
static inline vf vf_load_h_part(const uint16_t *p, int64_t n)
{
    uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < n; i++)
        buf[i] = p[i];
    return vf_load_h(buf);
}
static inline void vf_store_h_part(uint16_t *p, vf v, int64_t n)
{
    uint16_t buf[8];
    vf_store_h(buf, v);
    for (int64_t i = 0; i < n; i++)
        p[i] = buf[i];
}
/* NumPy-identical conversions: F16C quiets NaNs, NumPy does not; patch NaN lanes (rare). */
static inline void vf_store_h_exact(uint16_t *p, vf v)
{
    vf_store_h(p, v);
    int nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    if (nan) {
        float tmp[8];
        _mm256_storeu_ps(tmp, v);
        for (int i = 0; i < 8; i++)
            if (nan >> i & 1)
                p[i] = kv_f2h_soft(tmp[i]);
    }
}
static inline vf vf_load_h_exact(const uint16_t *p)
{
    vf v = vf_load_h(p);
    int nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    if (nan) {
        float tmp[8];
        _mm256_storeu_ps(tmp, v);
        for (int i = 0; i < 8; i++)
            if (nan >> i & 1)
                tmp[i] = kv_h2f_soft(p[i]);
        v = _mm256_loadu_ps(tmp);
    }
    return v;
}

/* x, where the compiler likes (vec_avx512_common.h pins it in a register): with 16 registers the
   accumulators of a scores pass take most of them, and pinned queries spilled (measured 15-20%
   slower on Zen 4); loads folded into the FMAs are cheap at 256 bits. */
static inline vf vf_pin(vf x) { return x; }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
/* lane-wise a < b ? x : y (false for NaN lanes) */
static inline vf vf_select_lt(vf a, vf b, vf x, vf y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
static inline float vf_hmax(vf a)
{
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline float vf_hsum(vf a)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline float vf_first(vf a) { return _mm256_cvtss_f32(a); }
static inline vf vf_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_pow2i(vf n)
{
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}

/* out[j] = sum of the 8 lanes of a[j], for 8 vectors at once (a transposing add tree). */
static inline void vf_reduce_keys(const vf *a, float *out)
{
    __m256 b[4], c[2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {   /* [x.lo + x.hi | y.lo + y.hi]: items 2i | 2i+1 */
        __m256 x = a[2 * i], y = a[2 * i + 1];
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) {   /* 128-bit lane k: [X_a, Y_a, X_b, Y_b], X = item 4i+k, Y = 4i+2+k */
        __m256 x = b[2 * i], y = b[2 * i + 1];
        c[i] = _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
    }
    /* lane k: [item k, item 2+k, item 4+k, item 6+k] */
    __m256d x = _mm256_castps_pd(c[0]), y = _mm256_castps_pd(c[1]);
    __m256 e = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    /* position 4k+s holds item 2s+k */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(e, order));
}

/* gptj pairing: (x0, x1, x2, x3, ...) -> (x1, x0, x3, x2, ...) */
static inline vf vf_swap_pairs(vf x) { return _mm256_permute_ps(x, 0xB1); }

/* Integer lanes for the weight decoders (wt_*.inc.h): KV_W int32 lanes. */
#define KV_VREGS 16   /* vector registers (gemv.inc.h sizes its register tiles by it) */
typedef __m256i vi;
static inline vi vi_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi vi_i8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi vi_and(vi a, int32_t m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
static inline vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vi_shr(vi a, int s) { return _mm256_srli_epi32(a, s); }
static inline vi vi_shl(vi a, int s) { return _mm256_slli_epi32(a, s); }
static inline vi vi_load(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_andv(vi a, vi b) { return _mm256_and_si256(a, b); }
static inline vi vi_srlv(vi a, vi n) { return _mm256_srlv_epi32(a, n); }
/* lane l: p16[idx[l]], or 0 where idx[l] < 0 (p16: 16 readable bytes; idx: KV_W entries) */
static inline vi vi_gather_u8(const uint8_t *p16, const int8_t *idx)
{
    const __m128i b = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)p16), _mm_loadl_epi64((const __m128i *)idx));
    return _mm256_cvtepu8_epi32(b);
}
static inline vf vf_from_vi(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf vf_load_bf16(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float kv_half(const uint8_t *p) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_loadu_si16(p))); }
/* the half at p (any alignment) in every lane */
static inline vf vf_half(const uint8_t *p) { return _mm256_cvtph_ps(_mm_set1_epi16((short)(p[0] | p[1] << 8))); }

#include "v8_x86.h"   /* the int8-activation product's 8-lane forms */

/* ---- Integer products for attention over int8 / int4 K and V (attn.inc.h), without VNNI ----
 * VPMADDWD multiplies 16 int16 pairs and adds each pair into an int32 lane: 16 products per
 * instruction where an FMA takes 8, at the same throughput (2 per cycle on Zen 3), and exact.
 * VPMADDUBSW would take 32 bytes but saturates its 16-bit sums on these operands (unsigned keys
 * k + 128 times the query's int8 values: 2 x 255 x 127 > 2^15), so the bytes go to 16-bit halves
 * first: a 32-bit lane's bytes 0 and 2 (the AND), 1 and 3 (the shift).  The sums go into the
 * accumulator through asm: GCC 12 reassociates integer adds, summing a block's products as a tree
 * after all of them, which spilled nearly every product of kv_scores_i8 to the stack. */
static inline __m256i kv_avx2_add2(__m256i acc, __m256i a, __m256i b)
{
    __asm__("vpaddd %1, %0, %0\n\tvpaddd %2, %0, %0" : "+x"(acc) : "x"(a), "x"(b));
    return acc;
}
#define KV_INT_DOT 1   /* attention scores over int8 keys as integer dot products */
#define KV_HAVE_VKI_DOT 1
/* acc + the sums of 4 products u * s per lane (u unsigned bytes, s signed), as VPDPBUSD */
static inline __m256i vki_dot(__m256i acc, __m256i u, __m256i s)
{
    const __m256i ue = _mm256_and_si256(u, _mm256_set1_epi16(0xFF)), uo = _mm256_srli_epi16(u, 8);
    const __m256i se = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), so = _mm256_srai_epi16(s, 8);
    return kv_avx2_add2(acc, _mm256_madd_epi16(ue, se), _mm256_madd_epi16(uo, so));
}
/* kv_scores_i8's query operand, from the query's int16 copy (round_query: values 4d, 4d + 2,
   4d + 1, 4d + 3 of each group of 4): the even and the odd pair in every lane, so that a key
   tile's halves meet them with no per-query shifts */
#define KV_HAVE_VKQ 1
typedef struct { __m256i e, o; } vkq;
static inline vkq vkq_bcast(const int8_t *q8, const int16_t *q16)
{
    int32_t e, o;
    (void)q8;
    memcpy(&e, q16, 4);
    memcpy(&o, q16 + 2, 4);
    vkq r = {_mm256_set1_epi32(e), _mm256_set1_epi32(o)};
    return r;
}
static inline __m256i vki_dotq(__m256i acc, __m256i u, vkq q)
{
    const __m256i ue = _mm256_and_si256(u, _mm256_set1_epi16(0xFF)), uo = _mm256_srli_epi16(u, 8);
    return kv_avx2_add2(acc, _mm256_madd_epi16(ue, q.e), _mm256_madd_epi16(uo, q.o));
}
/* kv_accumulate_i16: int8 values times int16 weights, two keys per VPMADDWD.  vw_pairs: values
   c..c+15 of two rows r0, r1 as 16 int16 pairs (r0's first) in two vectors: lo holds values 0-3
   and 8-11 (four per 128-bit lane), hi 4-7 and 12-15; vw_cols puts the sums back in order. */
#define KV_HAVE_DPWSSD 1
typedef __m256i vw;
static inline vw vw_zero(void) { return _mm256_setzero_si256(); }
static inline void vw_pairs(const int8_t *r0, const int8_t *r1, vw *lo, vw *hi)
{
    const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)r0));
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)r1));
    *lo = _mm256_unpacklo_epi16(a, b);
    *hi = _mm256_unpackhi_epi16(a, b);
}
/* acc + per lane the pair's two products with the int16 weights w[0] (r0's) and w[1] */
static inline vw vw_dot(vw acc, vw pair, const int16_t *w)
{
    int32_t x;
    memcpy(&x, w, 4);
    const __m256i t = _mm256_madd_epi16(pair, _mm256_set1_epi32(x));
    __asm__("vpaddd %1, %0, %0" : "+x"(acc) : "x"(t));   /* as kv_avx2_add2 */
    return acc;
}
/* the sums of a (lo, hi) pair of vw_pairs as floats in value order: values 0-7 in *f0, 8-15 in *f1 */
static inline void vw_cols(vw lo, vw hi, vf *f0, vf *f1)
{
    const __m256 a = _mm256_cvtepi32_ps(lo), b = _mm256_cvtepi32_ps(hi);
    *f0 = _mm256_permute2f128_ps(a, b, 0x20);
    *f1 = _mm256_permute2f128_ps(a, b, 0x31);
}
/* a's lanes rounded to the nearest integer (ties to even), saturated to int16, at p */
static inline void vf_store_i16(int16_t *p, vf a)
{
    const __m256i x = _mm256_cvtps_epi32(a);
    _mm_storeu_si128((__m128i *)p, _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
}

#endif
