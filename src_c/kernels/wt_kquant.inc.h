/* wt_kquant.inc.h - the k-quants Q4_K and Q5_K (super-blocks of 256 values in 8 sub-blocks of
 * 32, each with a 6-bit scale and minimum) and Q6_K (16 sub-blocks of 16, int8 scales).
 * Layouts as ggml stores them (byte offsets in a super-block):
 *   Q4_K (144): d half @0, dmin half @2, scales[12] @4, qs[128] @16
 *   Q5_K (176): d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48
 *   Q6_K (210): ql[128] @0, qh[64] @128, scales int8[16] @192, d half @208
 * Q4_K/Q5_K: sub-block s takes the low (s even) or high (s odd) nibbles of qs[32 (s/2) ..+32];
 * Q5_K adds bit s of qh[o] as bit 4 of value o; value = d*scale_s*q - dmin*min_s. */

/* the 6-bit scale and minimum of sub-block s from the 12 packed bytes */
static inline void wt_k_scale_min(const uint8_t *s12, int s, int *sc, int *mn)
{
    if (s < 4) {
        *sc = s12[s] & 63;
        *mn = s12[s + 4] & 63;
    } else {
        *sc = (s12[s + 4] & 15) | ((s12[s - 4] >> 6) << 4);
        *mn = (s12[s + 4] >> 4) | ((s12[s] >> 6) << 4);
    }
}

typedef struct { float sc[8], mn[8]; } wt_k8_state;   /* d*scale and -dmin*min per sub-block */
static inline void wt_k8_prep(const uint8_t *b, wt_k8_state *st)
{
    const float d = kv_half(b), dmin = kv_half(b + 2);
    for (int s = 0; s < 8; s++) {
        int sc, mn;
        wt_k_scale_min(b + 4, s, &sc, &mn);
        st->sc[s] = d * (float)sc;
        st->mn[s] = -dmin * (float)mn;
    }
}

static inline vf wt_q4_k_group(const uint8_t *b, const wt_k8_state *st, int j)
{
    const int s = j >> 5, o = j & 31;
    const vi raw = vi_u8(b + 16 + 32 * (s >> 1) + o);
    const vi q = (s & 1) ? vi_shr(raw, 4) : vi_and(raw, 15);
    return vf_fmadd(vf_from_vi(q), vf_set1(st->sc[s]), vf_set1(st->mn[s]));
}
#define WT_NAME q4_k
#define WT_BLOCK 256
#define WT_BYTES 144
#define WT_STATE wt_k8_state
#define WT_PREP wt_k8_prep
#define WT_GROUP wt_q4_k_group
#include "gemv.inc.h"

static inline vf wt_q5_k_group(const uint8_t *b, const wt_k8_state *st, int j)
{
    const int s = j >> 5, o = j & 31;
    const vi raw = vi_u8(b + 48 + 32 * (s >> 1) + o);
    const vi lo = (s & 1) ? vi_shr(raw, 4) : vi_and(raw, 15);
    const vi hi = vi_and(vi_shr(vi_u8(b + 16 + o), s), 1);
    return vf_fmadd(vf_from_vi(vi_or(lo, vi_shl(hi, 4))), vf_set1(st->sc[s]), vf_set1(st->mn[s]));
}
#define WT_NAME q5_k
#define WT_BLOCK 256
#define WT_BYTES 176
#define WT_STATE wt_k8_state
#define WT_PREP wt_k8_prep
#define WT_GROUP wt_q5_k_group
#include "gemv.inc.h"

/* Q6_K: half h (128 values) of a super-block uses ql[64h ..+64], qh[32h ..+32] and scales
 * [8h ..+8]; its value 32 qd + l (quarter qd, l < 32) has low bits in ql[64h + l + 32 (qd & 1)]
 * (low nibble for qd < 2, high nibble else), high bits 2qd..2qd+1 of qh[32h + l], and scale
 * scales[8h + l/16 + 2qd]; value = d * scale * (q - 32). */
typedef struct { float sc[16]; } wt_q6_k_state;   /* d * scale */
static inline void wt_q6_k_prep(const uint8_t *b, wt_q6_k_state *st)
{
    const float d = kv_half(b + 208);
    for (int i = 0; i < 16; i++)
        st->sc[i] = d * (float)(int8_t)b[192 + i];
}
static inline vf wt_q6_k_group(const uint8_t *b, const wt_q6_k_state *st, int j)
{
    const int h = j >> 7, qd = (j >> 5) & 3, l = j & 31;
    const vi raw = vi_u8(b + 64 * h + l + 32 * (qd & 1));
    const vi lo = qd < 2 ? vi_and(raw, 15) : vi_shr(raw, 4);
    const vi hi = vi_and(vi_shr(vi_u8(b + 128 + 32 * h + l), 2 * qd), 3);
    const float sc = st->sc[8 * h + (l >> 4) + 2 * qd];
    return vf_fmadd(vf_from_vi(vi_or(lo, vi_shl(hi, 4))), vf_set1(sc), vf_set1(-32.0f * sc));
}
#define WT_NAME q6_k
#define WT_BLOCK 256
#define WT_BYTES 210
#define WT_STATE wt_q6_k_state
#define WT_PREP wt_q6_k_prep
#define WT_GROUP wt_q6_k_group
#include "gemv.inc.h"
