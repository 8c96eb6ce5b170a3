/* vec_scalar.h - the vector layer with one float per "vector" (baseline x86-64, any CPU). */
#ifndef KV_VEC_H
#define KV_VEC_H
#include <stddef.h>
#include <stdint.h>

#include "fp16_soft.h"

#define KV_ISA scalar
#define KV_W 1   /* floats per vector */
#define KV_B 8   /* tokens per attention block */

typedef float vf;

static inline vf vf_zero(void) { return 0.0f; }
static inline vf vf_set1(float x) { return x; }
static inline vf vf_load(const float *p) { return *p; }
static inline void vf_store(float *p, vf v) { *p = v; }
static inline vf vf_load_part(const float *p, int64_t n) { return n > 0 ? *p : 0.0f; }
static inline void vf_store_part(float *p, vf v, int64_t n) { if (n > 0) *p = v; }
static inline vf vf_load_h(const uint16_t *p) { return kv_h2f_soft(*p); }
static inline vf vf_load_h_part(const uint16_t *p, int64_t n) { return n > 0 ? kv_h2f_soft(*p) : 0.0f; }
static inline vf vf_load_i8(const int8_t *p) { return (float)*p; }
static inline vf vf_load_i8_part(const int8_t *p, int64_t n) { return n > 0 ? (float)*p : 0.0f; }
/* KV_W 4-bit values (kvsimd.h KV_I4: stored as q + 8), the low (hi = 0) or high nibbles of p[0..KV_W) */
static inline vf vf_load_i4(const uint8_t *p, int hi) { return (float)(((*p >> (4 * hi)) & 15) - 8); }
/* both: the low nibbles' values and the high ones' (the vectors at c and c + 16 of a block) */
static inline void vf_load_i4_pair(const uint8_t *p, vf *lo, vf *hi)
{
    *lo = (float)((*p & 15) - 8);
    *hi = (float)((*p >> 4) - 8);
}
static inline void vf_store_h(uint16_t *p, vf v) { *p = kv_f2h_soft(v); }
static inline void vf_store_h_part(uint16_t *p, vf v, int64_t n) { if (n > 0) *p = kv_f2h_soft(v); }
/* exact (NumPy-identical) conversions for the public conversion op */
static inline void vf_store_h_exact(uint16_t *p, vf v) { *p = kv_f2h_soft(v); }
static inline vf vf_load_h_exact(const uint16_t *p) { return kv_h2f_soft(*p); }

/* x, kept in a register (a hint for the vector rows; nothing to do here) */
static inline vf vf_pin(vf x) { return x; }
static inline vf vf_add(vf a, vf b) { return a + b; }
static inline vf vf_sub(vf a, vf b) { return a - b; }
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_div(vf a, vf b) { return a / b; }
/* a*b + c and c - a*b.  Not fused here: the scalar row is the portable reference. */
static inline vf vf_fmadd(vf a, vf b, vf c) { return a * b + c; }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return c - a * b; }
/* x86 maxps/minps semantics: the second operand is returned when either is NaN. */
static inline vf vf_max(vf a, vf b) { return a > b ? a : b; }
static inline vf vf_min(vf a, vf b) { return a < b ? a : b; }
/* a < b ? x : y (false for NaN) */
static inline vf vf_select_lt(vf a, vf b, vf x, vf y) { return a < b ? x : y; }
static inline float vf_hmax(vf a) { return a; }
static inline float vf_hsum(vf a) { return a; }
static inline float vf_first(vf a) { return a; }

/* round to nearest integer (ties to even) for |x| < 2^22, the range exp needs */
static inline vf vf_round(vf x)
{
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    return (x + magic) - magic;
}
/* 2^n for integer-valued n in [-126, 127] */
static inline vf vf_pow2i(vf n)
{
    kv_f32bits b;
    b.u = (uint32_t)((int32_t)n + 127) << 23;
    return b.f;
}

/* out[j] = sum of the lanes of a[j], for KV_W (here: one) vectors */
static inline void vf_reduce_keys(const vf *a, float *out) { out[0] = a[0]; }

/* gptj pairing: (x0, x1, x2, x3, ...) -> (x1, x0, x3, x2, ...); needs KV_W even, so the
   scalar row rotates pairs directly (KV_ROT_PAIRWISE). */
#define KV_ROT_PAIRWISE 1

/* Integer lanes for the weight decoders (wt_*.inc.h): KV_W int32 lanes. */
#define KV_VREGS 1   /* vector registers (gemv.inc.h sizes its register tiles by it) */
typedef int32_t vi;
static inline vi vi_u8(const uint8_t *p) { return p[0]; }                 /* KV_W bytes, zero-extended */
static inline vi vi_i8(const uint8_t *p) { return (int8_t)p[0]; }         /* KV_W bytes, sign-extended */
static inline vi vi_and(vi a, int32_t m) { return a & m; }
static inline vi vi_or(vi a, vi b) { return a | b; }
static inline vi vi_shr(vi a, int s) { return (vi)((uint32_t)a >> s); }
static inline vi vi_shl(vi a, int s) { return (vi)((uint32_t)a << s); }
static inline vi vi_load(const int32_t *p) { return p[0]; }
static inline vi vi_andv(vi a, vi b) { return a & b; }
static inline vi vi_srlv(vi a, vi n) { return (vi)((uint32_t)a >> n); }
/* lane l: p16[idx[l]], or 0 where idx[l] < 0 */
static inline vi vi_gather_u8(const uint8_t *p16, const int8_t *idx) { return idx[0] < 0 ? 0 : p16[idx[0]]; }
static inline vf vf_from_vi(vi a) { return (float)a; }
static inline vf vf_load_bf16(const uint16_t *p)
{
    kv_f32bits b;
    b.u = (uint32_t)p[0] << 16;
    return b.f;
}
/* the half at p (any alignment) as a float */
static inline float kv_half(const uint8_t *p) { return kv_h2f_soft((uint16_t)(p[0] | p[1] << 8)); }
static inline vf vf_half(const uint8_t *p) { return kv_half(p); }

/* The 8-lane forms of the int8-activation product (gemv_x8.inc.h; v8_x86.h has the SIMD ones):
   lane c = weight column c, plain loops. */
#define KV_INT_DOT 1   /* attention scores over int8 keys as integer dot products (attn.inc.h) */
typedef struct { float v[8]; } v8f;
typedef struct { int32_t v[8]; } v8i;
typedef struct { uint8_t v[32]; } v8b;
static inline v8b v8b_load(const uint8_t *p)
{
    v8b r;
    for (int i = 0; i < 32; i++) r.v[i] = p[i];
    return r;
}
static inline v8b v8b_lo4(v8b a)
{
    for (int i = 0; i < 32; i++) a.v[i] &= 15;
    return a;
}
static inline v8b v8b_hi4(v8b a)
{
    for (int i = 0; i < 32; i++) a.v[i] >>= 4;
    return a;
}
static inline v8b v8b_or(v8b a, v8b b)
{
    for (int i = 0; i < 32; i++) a.v[i] |= b.v[i];
    return a;
}
static inline v8b v8b_bit4(v8b a, int j)
{
    for (int i = 0; i < 32; i++) a.v[i] = (uint8_t)(((a.v[i] >> j) & 1) << 4);
    return a;
}
static inline v8b v8b_flip(v8b a)
{
    for (int i = 0; i < 32; i++) a.v[i] ^= 0x80;
    return a;
}
static inline v8b v8b_bcast4(const int8_t *p)
{
    v8b r;
    for (int i = 0; i < 32; i++) r.v[i] = (uint8_t)p[i % 4];
    return r;
}
static inline v8i v8i_zero(void) { v8i r = {{0}}; return r; }
static inline v8i v8i_load(const int32_t *p)
{
    v8i r;
    for (int c = 0; c < 8; c++) r.v[c] = p[c];
    return r;
}
static inline v8f v8f_load(const float *p)
{
    v8f r;
    for (int c = 0; c < 8; c++) r.v[c] = p[c];
    return r;
}
static inline v8i v8i_set1(int32_t a)
{
    v8i r;
    for (int c = 0; c < 8; c++) r.v[c] = a;
    return r;
}
/* r[d] <- bytes 4d..4d+3 of each of r[0..7], lane l from r[l] */
static inline void v8b_transpose8(v8b r[8])
{
    v8b t[8];
    for (int d = 0; d < 8; d++)
        for (int l = 0; l < 8; l++)
            for (int j = 0; j < 4; j++) t[d].v[4 * l + j] = r[l].v[4 * d + j];
    for (int d = 0; d < 8; d++) r[d] = t[d];
}
static inline v8i v8i_add(v8i a, v8i b)
{
    for (int c = 0; c < 8; c++) a.v[c] += b.v[c];
    return a;
}
/* acc + the sums of 4 products u * s per lane (u unsigned bytes, s signed) */
static inline v8i v8i_dot(v8i acc, v8b u, v8b s)
{
    for (int c = 0; c < 8; c++)
        for (int j = 0; j < 4; j++) acc.v[c] += (int32_t)u.v[4 * c + j] * (int8_t)s.v[4 * c + j];
    return acc;
}
/* both signed */
static inline v8i v8i_sdot(v8i acc, v8b w, v8b x)
{
    for (int c = 0; c < 8; c++)
        for (int j = 0; j < 4; j++) acc.v[c] += (int32_t)(int8_t)w.v[4 * c + j] * (int8_t)x.v[4 * c + j];
    return acc;
}
static inline v8f v8f_from(v8i a)
{
    v8f r;
    for (int c = 0; c < 8; c++) r.v[c] = (float)a.v[c];
    return r;
}
static inline v8f v8f_half8(const uint8_t *p)
{
    v8f r;
    for (int c = 0; c < 8; c++) r.v[c] = kv_half(p + 2 * c);
    return r;
}
static inline v8f v8f_set1(float a)
{
    v8f r;
    for (int c = 0; c < 8; c++) r.v[c] = a;
    return r;
}
static inline v8f v8f_bcast(const float *p) { return v8f_set1(*p); }
/* out[c] <- p[c], p[n + c], .. p[7 n + c] for c < n */
static inline void v8f_cols(v8f *out, const float *p, int64_t n)
{
    for (int64_t c = 0; c < n; c++)
        for (int l = 0; l < 8; l++) out[c].v[l] = p[l * n + c];
}
static inline v8f v8f_u8(const uint8_t *p)
{
    v8f r;
    for (int c = 0; c < 8; c++) r.v[c] = (float)p[c];
    return r;
}
static inline v8f v8f_zero(void) { return v8f_set1(0.0f); }
static inline v8f v8f_mul(v8f a, v8f b)
{
    for (int c = 0; c < 8; c++) a.v[c] *= b.v[c];
    return a;
}
static inline v8f v8f_fmadd(v8f a, v8f b, v8f c)
{
    for (int l = 0; l < 8; l++) c.v[l] = a.v[l] * b.v[l] + c.v[l];   /* as vf_fmadd: no FMA on this row */
    return c;
}
static inline void v8f_store(float *p, v8f a)
{
    for (int c = 0; c < 8; c++) p[c] = a.v[c];
}

#endif
