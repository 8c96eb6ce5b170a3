/* wt_kquant.inc.h - the k-quants Q4_K and Q5_K (super-blocks of 256 values in 8 sub-blocks of
 * 32, each with a 6-bit scale and minimum) and Q6_K (16 sub-blocks of 16, int8 scales).
 * Layouts as ggml stores them (byte offsets in a super-block):
 *   Q4_K (144): d half @0, dmin half @2, scales[12] @4, qs[128] @16
 *   Q5_K (176): d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48
 *   Q6_K (210): ql[128] @0, qh[64] @128, scales int8[16] @192, d half @208
 * Q4_K/Q5_K: sub-block s takes the low (s even) or high (s odd) nibbles of qs[32 (s/2) ..+32];
 * Q5_K adds bit s of qh[o] as bit 4 of value o; value = d*scale_s*q - dmin*min_s.
 *
 * The header decodes once per block, KV_W entries at a time, into the float multipliers of its
 * sub-blocks; the vectors of a block come in the order of the bytes they are read from (the
 * low and high nibbles of one load next to each other).  Each value is d*scale*q - dmin*min
 * rounded once (d*scale*q is exact in a float), as gguf's dequantization computes it; where the
 * row looks values up in a table (KV_HAVE_LUT16), the table holds exactly those values. */

/* The 12 packed bytes s12 give 16 entries: e < 8 the scale of sub-block e, e >= 8 the minimum
 * of sub-block e - 8.  Entry e = ((s12[P[e]] >> SH[e]) & M[e]) | ((s12[Q[e]] >> 6) << 4), with
 * s12[-1] read as 0: sub-blocks 0-3 keep 6 bits of one byte, 4-7 join a nibble of bytes 8-11
 * with the top 2 bits of bytes 0-7. */
static const int8_t wt_k_P[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11};
static const int8_t wt_k_Q[16] = {-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7};
static const int32_t wt_k_SH[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4};
static const int32_t wt_k_M[16] = {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15};
static const float wt_k_ISD[16] = {1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0};   /* entry is a scale */

typedef struct { float m[16]; } wt_k8_state;   /* m[s] = d*scale_s, m[8 + s] = -dmin*min_s */
static inline void wt_k8_prep(const uint8_t *b, wt_k8_state *st)
{
    const vf d = vf_half(b), nmin = vf_mul(vf_half(b + 2), vf_set1(-1.0f));
    for (int e = 0; e < 16; e += KV_W) {
        const vi p = vi_srlv(vi_gather_u8(b + 4, wt_k_P + e), vi_load(wt_k_SH + e));
        const vi q = vi_shl(vi_shr(vi_gather_u8(b + 4, wt_k_Q + e), 6), 4);
        const vi v = vi_or(vi_andv(p, vi_load(wt_k_M + e)), q);
        const vf isd = vf_load(wt_k_ISD + e);   /* d where the entry is a scale, -dmin where a minimum */
        vf_store(st->m + e, vf_mul(vf_from_vi(v), vf_fmadd(isd, d, vf_fnmadd(isd, nmin, nmin))));
    }
}

/* Q4_K/Q5_K vector g: pair t = g / (64/KV_W) of sub-blocks (2t, 2t+1) reads qs[32t ..+32];
   within it, r = g mod (64/KV_W): bytes 32t + (r/2) KV_W .., low nibbles (r even: sub-block
   2t) or high ones (r odd: sub-block 2t+1) */
#define WT_K8_T(g) ((g) / (64 / KV_W))
#define WT_K8_HI(g) ((g) & 1)
#define WT_K8_OFF(g) ((((g) % (64 / KV_W)) >> 1) * KV_W)            /* offset within the 32 bytes */
#define WT_K8_POS(g) (64 * WT_K8_T(g) + 32 * WT_K8_HI(g) + WT_K8_OFF(g))

/* the 16 values q = 0..15 of sub-block s (vf_lut16's table) */
#define WT_K8_TABLE(st, s) vf_fmadd(vf_iota(), vf_set1((st)->m[s]), vf_set1((st)->m[8 + (s)]))

static inline vf wt_q4_k_group(const uint8_t *b, const wt_k8_state *st, int g)
{
    const int s = 2 * WT_K8_T(g) + WT_K8_HI(g);
    const vi raw = vi_u8(b + 16 + 32 * WT_K8_T(g) + WT_K8_OFF(g));
#ifdef KV_HAVE_LUT16
    return vf_lut16(WT_K8_TABLE(st, s), WT_K8_HI(g) ? vi_shr(raw, 4) : raw);
#else
    const vi q = WT_K8_HI(g) ? vi_shr(raw, 4) : vi_and(raw, 15);
    return vf_fmadd(vf_from_vi(q), vf_set1(st->m[s]), vf_set1(st->m[8 + s]));
#endif
}
#define WT_NAME q4_k
#define WT_BLOCK 256
#define WT_BYTES 144
#define WT_STATE wt_k8_state
#define WT_PREP wt_k8_prep
#define WT_GROUP wt_q4_k_group
#define WT_POS WT_K8_POS
#include "gemv.inc.h"

static inline vf wt_q5_k_group(const uint8_t *b, const wt_k8_state *st, int g)
{
    const int s = 2 * WT_K8_T(g) + WT_K8_HI(g);
    const vi raw = vi_u8(b + 48 + 32 * WT_K8_T(g) + WT_K8_OFF(g));
    const vi lo = WT_K8_HI(g) ? vi_shr(raw, 4) : vi_and(raw, 15);
    const vi qh = vi_u8(b + 16 + WT_K8_OFF(g));
    const vi hi = vi_and(s <= 4 ? vi_shl(qh, 4 - s) : vi_shr(qh, s - 4), 16);   /* bit s of qh as 16 */
#ifdef KV_HAVE_LUT16
    /* q = 0..31: the table of q < 16 and, 16 up, the one of q >= 16 */
    const vf sc = vf_set1(st->m[s]), mn = vf_set1(st->m[8 + s]);
    return vf_lut32(vf_fmadd(vf_iota(), sc, mn), vf_fmadd(vf_add(vf_iota(), vf_set1(16.0f)), sc, mn), vi_or(lo, hi));
#else
    return vf_fmadd(vf_from_vi(vi_or(lo, hi)), vf_set1(st->m[s]), vf_set1(st->m[8 + s]));
#endif
}
#define WT_NAME q5_k
#define WT_BLOCK 256
#define WT_BYTES 176
#define WT_STATE wt_k8_state
#define WT_PREP wt_k8_prep
#define WT_GROUP wt_q5_k_group
#define WT_POS WT_K8_POS
#include "gemv.inc.h"

/* Int8 activations (gemv_x8.inc.h) for Q4_K and Q5_K, repacked (kv_repack_x8) per super-block of
 * 8 columns as: 8 half d @0, 8 half dmin @16, the 6-bit scales as bytes [sub-block][column] @32,
 * the minimums likewise @96; Q5_K then its qh bytes 4 at a time (32 bytes i: qh[4i..4i+3] of each
 * column) @160; then the qs bytes 4 at a time, 8 vectors per pair of sub-blocks (@160 Q4_K, @416
 * Q5_K): sub-block j reads pair j/2's vectors, low nibbles (j even) or high ones (j odd), plus
 * (Q5_K) bit j of the qh vectors as 16.  D = d scale_j, M = -dmin min_j. */
typedef struct { v8f d, nmin; } wx_k8_state;
static inline void wx_k8_prep(const uint8_t *b, wx_k8_state *st)
{
    st->d = v8f_half8(b);
    st->nmin = v8f_mul(v8f_half8(b + 16), v8f_set1(-1.0f));
}
static inline void wx_k8_scale(const uint8_t *b, const wx_k8_state *st, int j, v8f *D, v8f *M)
{
    *D = v8f_mul(st->d, v8f_u8(b + 32 + 8 * j));
    *M = v8f_mul(st->nmin, v8f_u8(b + 96 + 8 * j));
}
static inline void wx_k8_decode(const uint8_t *qs, const uint8_t *qh, int j, v8b *w)
{
    KV_XU(8)
    for (int v = 0; v < 8; v++) {
        const v8b raw = v8b_load(qs + 256 * (j >> 1) + 32 * v);
        w[v] = (j & 1) ? v8b_hi4(raw) : v8b_lo4(raw);
        if (qh)
            w[v] = v8b_or(w[v], v8b_bit4(v8b_load(qh + 32 * v), j));
    }
}
#define WX_NAME q4_k
#define WX_SUPER 256
#define WX_BYTES 1184
#define WX_STATE wx_k8_state
#define WX_PREP wx_k8_prep
#define WX_DECODE(blk, st, j, w) wx_k8_decode((blk) + 160, NULL, (j), (w))
#define WX_SCALE wx_k8_scale
#define WX_MIN 1
#define WX_OFF 0.0f
#define WX_DOT v8i_dot
#define WX_XPOS(i) (4 * (i))
#include "gemv_x8.inc.h"

#define WX_NAME q5_k
#define WX_SUPER 256
#define WX_BYTES 1440
#define WX_STATE wx_k8_state
#define WX_PREP wx_k8_prep
#define WX_DECODE(blk, st, j, w) wx_k8_decode((blk) + 416, (blk) + 160, (j), (w))
#define WX_SCALE wx_k8_scale
#define WX_MIN 1
#define WX_OFF 0.0f
#define WX_DOT v8i_dot
#define WX_XPOS(i) (4 * (i))
#include "gemv_x8.inc.h"

/* Q6_K: half h (128 values) of a super-block uses ql[64h ..+64], qh[32h ..+32] and scales
 * [8h ..+8]; its value 32 qd + l (quarter qd, l < 32) has low bits in ql[64h + l + 32 (qd & 1)]
 * (low nibble for qd < 2, high nibble else), high bits 2qd..2qd+1 of qh[32h + l], and scale
 * scales[8h + l/16 + 2qd]; value = d * scale * (q - 32).
 * Vector g: half h = g / (4 NV) (NV = 32/KV_W vectors per quarter); r = g mod 4 NV gives the
 * ql bytes read, u = (r/2) / NV (which 32 of the half's 64) and chunk (r/2) mod NV, and the
 * nibble: low (r even, quarter u) or high (r odd, quarter u + 2). */
#define WT_Q6_NV (32 / KV_W)
#define WT_Q6_H(g) ((g) / (4 * WT_Q6_NV))
#define WT_Q6_HI(g) ((g) & 1)
#define WT_Q6_U(g) ((((g) % (4 * WT_Q6_NV)) >> 1) / WT_Q6_NV)
#define WT_Q6_L(g) (((((g) % (4 * WT_Q6_NV)) >> 1) % WT_Q6_NV) * KV_W)   /* first l of the vector */
#define WT_Q6_QD(g) (WT_Q6_U(g) + 2 * WT_Q6_HI(g))
#define WT_Q6_POS(g) (128 * WT_Q6_H(g) + 32 * WT_Q6_QD(g) + WT_Q6_L(g))
typedef struct { float sc[16], off[16]; } wt_q6_k_state;   /* d * scale, -32 d * scale */
static inline void wt_q6_k_prep(const uint8_t *b, wt_q6_k_state *st)
{
    const vf d = vf_half(b + 208);
    for (int e = 0; e < 16; e += KV_W) {
        const vf sc = vf_mul(vf_from_vi(vi_i8(b + 192 + e)), d);
        vf_store(st->sc + e, sc);
        vf_store(st->off + e, vf_mul(sc, vf_set1(-32.0f)));
    }
}
static inline vf wt_q6_k_group(const uint8_t *b, const wt_q6_k_state *st, int g)
{
    const int h = WT_Q6_H(g), qd = WT_Q6_QD(g), l = WT_Q6_L(g);
    const vi raw = vi_u8(b + 64 * h + 32 * WT_Q6_U(g) + l);
    const vi lo = WT_Q6_HI(g) ? vi_shr(raw, 4) : vi_and(raw, 15);
    const vi qh = vi_u8(b + 128 + 32 * h + l);
    const vi hi = vi_and(qd <= 2 ? vi_shl(qh, 4 - 2 * qd) : vi_shr(qh, 2 * qd - 4), 48);   /* bits 2qd.. as 16, 32 */
    const int si = 8 * h + l / 16 + 2 * qd;
    return vf_fmadd(vf_from_vi(vi_or(lo, hi)), vf_set1(st->sc[si]), vf_set1(st->off[si]));
}
#define WT_NAME q6_k
#define WT_BLOCK 256
#define WT_BYTES 210
#define WT_STATE wt_q6_k_state
#define WT_PREP wt_q6_k_prep
#define WT_GROUP wt_q6_k_group
#define WT_POS WT_Q6_POS
#include "gemv.inc.h"
