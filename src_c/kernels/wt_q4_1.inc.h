/* wt_q4_1.inc.h - Q4_1: blocks of 32 values, half scale d and half minimum m, then 16 bytes
 * of 4-bit q (as Q4_0, whose nibble helpers it shares: wt_q4_0.inc.h comes first); value =
 * d * q + m, rounded once (d q is exact), as gguf's dequantization does. */
#ifdef KV_HAVE_LUT16
typedef struct { vf t; } wt_q4_1_state;   /* t[i] = d i + m */
static inline void wt_q4_1_prep(const uint8_t *b, wt_q4_1_state *st)
{
    st->t = vf_fmadd(vf_iota(), vf_half(b), vf_half(b + 2));
}
static inline vf wt_q4_1_group(const uint8_t *b, const wt_q4_1_state *st, int g)
{
    return vf_lut16(st->t, wt_q4_nibbles(b + 4, g, 0));
}
#else
typedef struct { vf d, m; } wt_q4_1_state;
static inline void wt_q4_1_prep(const uint8_t *b, wt_q4_1_state *st)
{
    st->d = vf_half(b);
    st->m = vf_half(b + 2);
}
static inline vf wt_q4_1_group(const uint8_t *b, const wt_q4_1_state *st, int g)
{
    return vf_fmadd(vf_from_vi(wt_q4_nibbles(b + 4, g, 1)), st->d, st->m);
}
#endif
#define WT_NAME q4_1
#define WT_BLOCK 32
#define WT_BYTES 20
#define WT_STATE wt_q4_1_state
#define WT_PREP wt_q4_1_prep
#define WT_GROUP wt_q4_1_group
#define WT_POS WT_Q4_POS
#include "gemv.inc.h"

/* Int8 activations (gemv_x8.inc.h): as Q4_0's (wt_q4_0.inc.h), nibbles q_w, 8 minimums after
   the 8 scales. */
#define WX_NAME q4_1
#define WX_SUPER 32
#define WX_BYTES 160
#define WX_STATE wx_none_state
#define WX_PREP WX_NO_PREP
#define WX_DECODE(blk, st, j, w) wx_q4_decode((blk) + 32, (w))
#define WX_SCALE(blk, st, j, D, M) (*(D) = v8f_half8(blk), *(M) = v8f_half8((blk) + 16))
#define WX_MIN 1
#define WX_OFF 0.0f
#define WX_DOT v8i_dot
#define WX_XPOS WX_Q4_XPOS
#include "gemv_x8.inc.h"
