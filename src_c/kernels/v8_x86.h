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
static inline v8i v8i_set1(int32_t a) { return _mm256_set1_epi32(a); }
static inline v8i v8i_load(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* The first two steps of an 8x8 transpose of 4-byte groups, within each 128-bit lane, for registers
   of W bits (256 here, 512 in vec_avx512_common.h's 16-key form): u[m] then holds dwords m and m + 4
   of rows 0-3 in lanes 0 and 1 (u[4 + m]: rows 4-7). */
#define KV_T8_IN_LANES(W, r, u) do {                                                  \
        __m##W##i t_[8];                                                              \
        _Pragma("GCC unroll 4")                                                       \
        for (int i_ = 0; i_ < 4; i_++) {                                              \
            t_[2 * i_] = _mm##W##_unpacklo_epi32(r[2 * i_], r[2 * i_ + 1]);           \
            t_[2 * i_ + 1] = _mm##W##_unpackhi_epi32(r[2 * i_], r[2 * i_ + 1]);       \
        }                                                                             \
        _Pragma("GCC unroll 2")                                                       \
        for (int i_ = 0; i_ < 2; i_++) {                                              \
            u[4 * i_] = _mm##W##_unpacklo_epi64(t_[4 * i_], t_[4 * i_ + 2]);          \
            u[4 * i_ + 1] = _mm##W##_unpackhi_epi64(t_[4 * i_], t_[4 * i_ + 2]);      \
            u[4 * i_ + 2] = _mm##W##_unpacklo_epi64(t_[4 * i_ + 1], t_[4 * i_ + 3]);  \
            u[4 * i_ + 3] = _mm##W##_unpackhi_epi64(t_[4 * i_ + 1], t_[4 * i_ + 3]);  \
        }                                                                             \
    } while (0)
/* r[d] <- dword d (bytes 4d..4d+3) of each of r[0..7], lane l from r[l]: an 8x8 transpose of 4-byte
   groups (int8 attention keys onto the lanes) */
static inline void v8b_transpose8(v8b r[8])
{
    __m256i u[8];
    KV_T8_IN_LANES(256, r, u);
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++) {   /* u[m]: dwords m (low half) and m + 4 (high half) of rows 0-3; u[4 + m] rows 4-7 */
        r[m] = _mm256_permute2x128_si256(u[m], u[4 + m], 0x20);
        r[m + 4] = _mm256_permute2x128_si256(u[m], u[4 + m], 0x31);
    }
}
static inline v8i v8i_add(v8i a, v8i b) { return _mm256_add_epi32(a, b); }
/* attn.inc.h kv_i4_rows_i8 on every x86 row: int4 rows as int8 ones, 32 bytes (2 blocks) to 64 at a
   time -- each block's low nibbles, then its high ones, minus 8 */
#define KV_HAVE_I4_UNPACK 1
static inline void kv_i4_unpack(int8_t *dst, const uint8_t *src, int64_t bytes)
{
    const __m256i m = _mm256_set1_epi8(15), e8 = _mm256_set1_epi8(8);
    int64_t o = 0;
    for (; o + 32 <= bytes; o += 32) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(src + o));
        const __m256i lo = _mm256_sub_epi8(_mm256_and_si256(x, m), e8);
        const __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(x, 4), m), e8);
        _mm256_storeu_si256((__m256i *)(dst + 2 * o), _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256((__m256i *)(dst + 2 * o + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
    for (; o < bytes; o += 16) {   /* bytes: whole blocks of 16 */
        const __m128i x = _mm_loadu_si128((const __m128i *)(src + o));
        const __m128i m4 = _mm256_castsi256_si128(m), s8 = _mm256_castsi256_si128(e8);
        _mm_storeu_si128((__m128i *)(dst + 2 * o), _mm_sub_epi8(_mm_and_si128(x, m4), s8));
        _mm_storeu_si128((__m128i *)(dst + 2 * o + 16), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(x, 4), m4), s8));
    }
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KV_HAVE_DPBUSD 1
#define KV_INT_DOT 1   /* attention scores over int8 keys as integer dot products (attn.inc.h) */
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
static inline v8f v8f_load(const float *p) { return _mm256_loadu_ps(p); }
/* out[c] <- p[c], p[n + c], .. p[7 n + c] for c < n: 8 rows of n floats, transposed (n = 2: one
   shuffle per vector after 128-bit loads; n a multiple of 4: in-lane 4x4 transposes; else gathers,
   slower on Zen 4) */
static inline void v8f_cols(v8f *out, const float *p, int64_t n)
{
    if (n == 2) {   /* rows 0-1 | 4-5 and 2-3 | 6-7, then the even and the odd floats */
        const __m256 a = _mm256_loadu2_m128(p + 8, p), b = _mm256_loadu2_m128(p + 12, p + 4);
        out[0] = _mm256_shuffle_ps(a, b, 0x88);
        out[1] = _mm256_shuffle_ps(a, b, 0xDD);
        return;
    }
    if (n % 4 == 0) {
#pragma GCC unroll 4
        for (int64_t c = 0; c < n; c += 4) {
            __m256 a[4], t[4];
#pragma GCC unroll 4
            for (int l = 0; l < 4; l++)   /* row l | row l + 4 */
                a[l] = _mm256_loadu2_m128(p + (l + 4) * n + c, p + l * n + c);
            t[0] = _mm256_unpacklo_ps(a[0], a[1]);
            t[1] = _mm256_unpackhi_ps(a[0], a[1]);
            t[2] = _mm256_unpacklo_ps(a[2], a[3]);
            t[3] = _mm256_unpackhi_ps(a[2], a[3]);
            out[c] = _mm256_shuffle_ps(t[0], t[2], 0x44);
            out[c + 1] = _mm256_shuffle_ps(t[0], t[2], 0xEE);
            out[c + 2] = _mm256_shuffle_ps(t[1], t[3], 0x44);
            out[c + 3] = _mm256_shuffle_ps(t[1], t[3], 0xEE);
        }
        return;
    }
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)n));
    for (int64_t c = 0; c < n; c++)
        out[c] = _mm256_i32gather_ps(p + c, idx, 4);
}
static inline v8f v8f_zero(void) { return _mm256_setzero_ps(); }
static inline v8f v8f_mul(v8f a, v8f b) { return _mm256_mul_ps(a, b); }
#ifdef __FMA__
static inline v8f v8f_fmadd(v8f a, v8f b, v8f c) { return _mm256_fmadd_ps(a, b, c); }
#else   /* the avx512 rows: the AVX512VL form (a mask of all lanes) */
static inline v8f v8f_fmadd(v8f a, v8f b, v8f c) { return _mm256_mask3_fmadd_ps(a, b, c, (__mmask8)0xFF); }
#endif
static inline void v8f_store(float *p, v8f a) { _mm256_storeu_ps(p, a); }
#endif
