/* v8_x86.h - the 8-lane forms of the int8-activation product (gemv_x8.inc.h) on the x86 rows:
 * 256-bit registers, lane c = weight column c.  v8b: 32 bytes (4 per lane), v8i: 8 int32,
 * v8f: 8 floats.  The avx512 and avx512fp16 rows (compiled with VNNI) sum u8 x s8 products with VPDPBUSD;
 * avx2 with VPMADDUBSW + VPMADDWD, whose 16-bit pair sums must not saturate: unsigned bytes
 * <= 128 times signed ones in [-127, 127] (2 * 128 * 127 < 2^15), which is what the decoders
 * give it. */
#ifndef KV_V8_X86_H
#define KV_V8_X86_H
#include <string.h>
typedef __m256 v8f;
typedef __m256i v8i;
typedef __m256i v8b;
static inline v8b v8b_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline v8b v8b_lo4(v8b a) { return _mm256_and_si256(a, _mm256_set1_epi8(15)); }
static inline v8b v8b_hi4(v8b a) { return _mm256_and_si256(_mm256_srli_epi16(a, 4), _mm256_set1_epi8(15)); }
static inline v8b v8b_or(v8b a, v8b b) { return _mm256_or_si256(a, b); }
/* 16 in each byte whose bit j (0..7) is set, else 0 (16-bit shifts: bit 4 of each byte comes from
   bit j of the same byte for shifts up to 4 left or 3 right) */
static inline v8b v8b_bit4(v8b a, int j)
{
    const v8b s = j <= 4 ? _mm256_slli_epi16(a, 4 - j) : _mm256_srli_epi16(a, j - 4);
    return _mm256_and_si256(s, _mm256_set1_epi8(16));
}
/* signed bytes as unsigned ones plus 128 */
static inline v8b v8b_flip(v8b a) { return _mm256_xor_si256(a, _mm256_set1_epi8((char)0x80)); }
/* the 4 bytes at p in every lane */
static inline v8b v8b_bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline v8i v8i_zero(void) { return _mm256_setzero_si256(); }
static inline v8i v8i_add(v8i a, v8i b) { return _mm256_add_epi32(a, b); }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KV_HAVE_DPBUSD 1
/* acc + the sums of 4 products u * s per lane (u unsigned bytes, s signed) */
static inline v8i v8i_dot(v8i acc, v8b u, v8b s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
static inline v8i v8i_dot(v8i acc, v8b u, v8b s)
{
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif
/* acc + the sums of 4 products w * x per lane, both signed (|w| unsigned, x with w's sign) */
static inline v8i v8i_sdot(v8i acc, v8b w, v8b x) { return v8i_dot(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w)); }
static inline v8f v8f_from(v8i a) { return _mm256_cvtepi32_ps(a); }
static inline v8f v8f_half8(const uint8_t *p)
{
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else   /* the avx512 rows: the AVX512VL form */
    return _mm256_maskz_cvtph_ps((__mmask8)0xFF, _mm_loadu_si128((const __m128i *)p));
#endif
}
/* 8 unsigned bytes as floats */
static inline v8f v8f_u8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline v8f v8f_bcast(const float *p) { return _mm256_broadcast_ss(p); }
static inline v8f v8f_set1(float a) { return _mm256_set1_ps(a); }
static inline v8f v8f_zero(void) { return _mm256_setzero_ps(); }
static inline v8f v8f_mul(v8f a, v8f b) { return _mm256_mul_ps(a, b); }
#ifdef __FMA__
static inline v8f v8f_fmadd(v8f a, v8f b, v8f c) { return _mm256_fmadd_ps(a, b, c); }
#else   /* the avx512 rows: the AVX512VL form (a mask of all lanes) */
static inline v8f v8f_fmadd(v8f a, v8f b, v8f c) { return _mm256_mask3_fmadd_ps(a, b, c, (__mmask8)0xFF); }
#endif
static inline void v8f_store(float *p, v8f a) { _mm256_storeu_ps(p, a); }
#endif
