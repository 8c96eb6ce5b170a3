/* wt_q4_0.inc.h - Q4_0: blocks of 32 values, a half scale d then 16 bytes of 4-bit q (byte i:
 * value i in its low nibble, value i + 16 in its high one); value = d * (q - 8).
 *
 * Vector g of a block is the low (g even) or the high (g odd) nibbles of bytes (g / 2) KV_W ..:
 * one load serves two vectors.  Where the row can look values up in a 16-entry table
 * (KV_HAVE_LUT16), the block's 16 possible values d (i - 8) are made once and each nibble
 * picks its value (the lookup reads the low 4 bits: no masking, no conversion); otherwise
 * each nibble is converted and scaled.  Both give d (q - 8) exactly (an 11-bit d times a
 * 4-bit integer fits a float), as gguf's dequantization does. */
#define WT_Q4_POS(g) (((g) >> 1) * KV_W + 16 * ((g) & 1))
/* the nibbles of vector g, in int32 lanes (the high ones alone; the low ones with the high
   nibble still above them when `masked` is 0, for a lookup that reads the low 4 bits only) */
static inline vi wt_q4_nibbles(const uint8_t *qs, int g, int masked)
{
    const vi raw = vi_u8(qs + (g >> 1) * KV_W);
    return (g & 1) ? vi_shr(raw, 4) : masked ? vi_and(raw, 15) : raw;
}

#ifdef KV_HAVE_LUT16
typedef struct { vf t; } wt_q4_0_state;   /* t[i] = d (i - 8) */
static inline void wt_q4_0_prep(const uint8_t *b, wt_q4_0_state *st)
{
    st->t = vf_mul(vf_add(vf_iota(), vf_set1(-8.0f)), vf_half(b));
}
static inline vf wt_q4_0_group(const uint8_t *b, const wt_q4_0_state *st, int g)
{
    return vf_lut16(st->t, wt_q4_nibbles(b + 2, g, 0));
}
#else
typedef struct { vf d, off; } wt_q4_0_state;
static inline void wt_q4_0_prep(const uint8_t *b, wt_q4_0_state *st)
{
    st->d = vf_half(b);
    st->off = vf_mul(st->d, vf_set1(-8.0f));
}
static inline vf wt_q4_0_group(const uint8_t *b, const wt_q4_0_state *st, int g)
{
    return vf_fmadd(vf_from_vi(wt_q4_nibbles(b + 2, g, 1)), st->d, st->off);
}
#endif
#define WT_NAME q4_0
#define WT_BLOCK 32
#define WT_BYTES 18
#define WT_STATE wt_q4_0_state
#define WT_PREP wt_q4_0_prep
#define WT_GROUP wt_q4_0_group
#define WT_POS WT_Q4_POS
#include "gemv.inc.h"

/* Int8 activations (gemv_x8.inc.h): 32 repacked bytes hold two weight vectors, their low nibbles
   (values 4i..4i+3 of each column) and their high ones (values 16+4i..); nibbles 0..15 stand for
   q_w + 8.  Blocks of 32: the 8 half scales first. */
#define WX_Q4_XPOS(i) (((i) >> 1) * 4 + 16 * ((i) & 1))
static inline void wx_q4_decode(const uint8_t *qs, v8b *w)
{
    KV_XU(4)
    for (int v = 0; v < 4; v++) {
        const v8b raw = v8b_load(qs + 32 * v);
        w[2 * v] = v8b_lo4(raw);
        w[2 * v + 1] = v8b_hi4(raw);
    }
}
typedef struct { int unused; } wx_none_state;
#define WX_NO_PREP(blk, st) ((void)(st))
#define WX_NAME q4_0
#define WX_SUPER 32
#define WX_BYTES 144
#define WX_STATE wx_none_state
#define WX_PREP WX_NO_PREP
#define WX_DECODE(blk, st, j, w) wx_q4_decode((blk) + 16, (w))
#define WX_SCALE(blk, st, j, D, M) (*(D) = v8f_half8(blk), *(M) = *(D))
#define WX_MIN 0
#define WX_OFF -8.0f
#define WX_DOT v8i_dot
#define WX_XPOS WX_Q4_XPOS
#include "gemv_x8.inc.h"
