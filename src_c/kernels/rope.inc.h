/* rope.inc.h - rotation of (x, y) pairs by per-token or shared angles: RoPE application and
 * the K-cache shift, one algorithm for every ISA.  Included by tu_<isa>.c after vec_<isa>.h.
 *
 * The angles arrive as (cos, sin) float pairs computed in double by the caller (ops.c), so
 * the kernel only multiplies.  fp32 rows: fp32 FMA arithmetic.  fp16 rows: widened to fp32,
 * rotated, rounded to fp16 once -- except on rows with complex fp16 multiplication
 * (KV_HAVE_CMUL_F16: AVX512-FP16), where a row is a vector of complex fp16 numbers rotated 16
 * pairs at a time by the multiplier split into fp16 hi + lo (vc16_mul_hilo: x*lo, then
 * x*hi + that; two roundings per component, none of the multiplier's own fp16 rounding).
 * The bounds of both are in kvsimd/bounds.py. */
#include "kvsimd.h"

/* Multipliers for one token, laid out for the pairing: gptj (x[2r], x[2r+1]) gets
 * c = (c0 c0 c1 c1 ...), s = (-s0 s0 -s1 s1 ...); neox (x[r], x[r+R]) gets c = (c0 c1 ...),
 * s = (s0 s1 ...). */
static void KV_FN(rot_prepare)(const float *cs, int64_t R, int32_t style, float *c, float *s)
{
    if (style == KV_ROPE_GPTJ) {
        for (int64_t r = 0; r < R; r++) {
            c[2 * r] = c[2 * r + 1] = cs[2 * r];
            s[2 * r] = -cs[2 * r + 1];
            s[2 * r + 1] = cs[2 * r + 1];
        }
    } else {
        for (int64_t r = 0; r < R; r++) {
            c[r] = cs[2 * r];
            s[r] = cs[2 * r + 1];
        }
    }
}

#ifndef KV_ROT_PAIRWISE
/* gptj: out = x * c + swap_pairs(x) * s, over the 2R leading elements */
#define KV_ROT_GPTJ(LOAD, LOADP, STORE, STOREP, row)                                     \
    do {                                                                                 \
        int64_t e = 0;                                                                   \
        for (; e + KV_W <= 2 * R; e += KV_W) {                                           \
            vf x = LOAD(row + e);                                                        \
            STORE(row + e, vf_fmadd(x, vf_load(c + e), vf_mul(vf_swap_pairs(x), vf_load(s + e)))); \
        }                                                                                \
        if (e < 2 * R) {                                                                 \
            vf x = LOADP(row + e, 2 * R - e);                                            \
            vf y = vf_fmadd(x, vf_load(c + e), vf_mul(vf_swap_pairs(x), vf_load(s + e))); \
            STOREP(row + e, y, 2 * R - e);                                               \
        }                                                                                \
    } while (0)
#endif

/* neox: lo' = lo c - hi s, hi' = hi c + lo s, lo = x[r..], hi = x[R + r..] */
#define KV_ROT_NEOX_STEP(LO, HI, r)                                                      \
    vf cv = vf_load(c + r), sv = vf_load(s + r);                                         \
    vf lo2 = vf_fnmadd(HI, sv, vf_mul(LO, cv)), hi2 = vf_fmadd(LO, sv, vf_mul(HI, cv))
#define KV_ROT_NEOX(LOAD, LOADP, STORE, STOREP, row)                                     \
    do {                                                                                 \
        int64_t r = 0;                                                                   \
        for (; r + KV_W <= R; r += KV_W) {                                               \
            vf lo = LOAD(row + r), hi = LOAD(row + R + r);                               \
            KV_ROT_NEOX_STEP(lo, hi, r);                                                 \
            STORE(row + r, lo2);                                                         \
            STORE(row + R + r, hi2);                                                     \
        }                                                                                \
        if (r < R) {                                                                     \
            vf lo = LOADP(row + r, R - r), hi = LOADP(row + R + r, R - r);               \
            KV_ROT_NEOX_STEP(lo, hi, r);                                                 \
            STOREP(row + r, lo2, R - r);                                                 \
            STOREP(row + R + r, hi2, R - r);                                             \
        }                                                                                \
    } while (0)

#ifdef KV_HAVE_CMUL_F16
/* fp16 rows as complex numbers.  m holds the R complex fp16 multipliers (padded to 16) as hi + lo,
   per 16 pairs: 32 halves of hi, then 32 of lo (one base pointer: fewer registers per row). */
static void KV_FN(rot_row_cmul)(uint16_t *row, const uint16_t *m, int64_t R, int32_t style)
{
    if (style == KV_ROPE_GPTJ) {
        for (int64_t r = 0; r < R; r += 16) {
            const int64_t n = R - r < 16 ? R - r : 16;
            vc16 x = vc16_load_part(row + 2 * r, n);
            vc16_store_part(row + 2 * r, vc16_mul_hilo(x, vc16_load(m + 4 * r), vc16_load(m + 4 * r + 32)), n);
        }
    } else {
        for (int64_t r = 0; r < R; r += 16) {
            const int64_t n = R - r < 16 ? R - r : 16;
            vc16 z = vc16_interleave(vh16_load_part(row + r, n), vh16_load_part(row + R + r, n));
            vh16 lo, hi;
            vc16_deinterleave(vc16_mul_hilo(z, vc16_load(m + 4 * r), vc16_load(m + 4 * r + 32)), &lo, &hi);
            vh16_store_part(row + r, lo, n);
            vh16_store_part(row + R + r, hi, n);
        }
    }
}
#endif

static void KV_FN(rotate)(const kv_rot_params *p)
{
    const int64_t R = p->R, D = p->D, N = p->n_total;
    /* +KV_MAX_WIDTH: vector loads of the last chunk may read past 2R (values unused) */
    float c[KV_MAX_HEAD_DIM + KV_MAX_WIDTH], s[KV_MAX_HEAD_DIM + KV_MAX_WIDTH];
#ifdef KV_HAVE_CMUL_F16
    uint16_t m[2 * (KV_MAX_HEAD_DIM + 32)];
#endif
    for (int64_t t = p->t0; t < p->t1; t++) {
        const float *cs = p->cs + (t - p->t0) * p->cs_stride;
        const int fresh = t == p->t0 || p->cs_stride != 0;
#ifdef KV_HAVE_CMUL_F16
        if (p->dtype == KV_F16) {
            if (fresh)
                for (int64_t r = 0; r < R; r += 16) {
                    vc16 hi, lo;
                    vc16_split_f32_pairs(cs + 2 * r, R - r < 16 ? R - r : 16, &hi, &lo);
                    vc16_store(m + 4 * r, hi);
                    vc16_store(m + 4 * r + 32, lo);
                }
            for (int64_t h = 0; h < p->H; h++)
                KV_FN(rot_row_cmul)((uint16_t *)p->x + (h * N + t) * D, m, R, p->style);
            continue;
        }
#endif
        if (fresh)
            KV_FN(rot_prepare)(cs, R, p->style, c, s);
        for (int64_t h = 0; h < p->H; h++) {
            const int64_t off = (h * N + t) * D;
#ifdef KV_ROT_PAIRWISE
            if (p->dtype == KV_F16) {
                uint16_t *row = (uint16_t *)p->x + off;
                if (p->style == KV_ROPE_GPTJ) {
                    for (int64_t r = 0; r < R; r++) {
                        const float x = vf_load_h(row + 2 * r), y = vf_load_h(row + 2 * r + 1);
                        vf_store_h(row + 2 * r, x * c[2 * r] + y * s[2 * r]);
                        vf_store_h(row + 2 * r + 1, y * c[2 * r + 1] + x * s[2 * r + 1]);
                    }
                } else {
                    KV_ROT_NEOX(vf_load_h, vf_load_h_part, vf_store_h, vf_store_h_part, row);
                }
            } else {
                float *row = (float *)p->x + off;
                if (p->style == KV_ROPE_GPTJ) {
                    for (int64_t r = 0; r < R; r++) {
                        const float x = row[2 * r], y = row[2 * r + 1];
                        row[2 * r] = x * c[2 * r] + y * s[2 * r];
                        row[2 * r + 1] = y * c[2 * r + 1] + x * s[2 * r + 1];
                    }
                } else {
                    KV_ROT_NEOX(vf_load, vf_load_part, vf_store, vf_store_part, row);
                }
            }
#else
            if (p->dtype == KV_F16) {
                uint16_t *row = (uint16_t *)p->x + off;
                if (p->style == KV_ROPE_GPTJ)
                    KV_ROT_GPTJ(vf_load_h, vf_load_h_part, vf_store_h, vf_store_h_part, row);
                else
                    KV_ROT_NEOX(vf_load_h, vf_load_h_part, vf_store_h, vf_store_h_part, row);
            } else {
                float *row = (float *)p->x + off;
                if (p->style == KV_ROPE_GPTJ)
                    KV_ROT_GPTJ(vf_load, vf_load_part, vf_store, vf_store_part, row);
                else
                    KV_ROT_NEOX(vf_load, vf_load_part, vf_store, vf_store_part, row);
            }
#endif
        }
    }
}
