/* wt_q8_0.inc.h - Q8_0: blocks of 32 values, a half scale d then 32 int8 q; value = d * q. */
typedef struct { vf d; } wt_q8_0_state;
static inline void wt_q8_0_prep(const uint8_t *b, wt_q8_0_state *st) { st->d = vf_half(b); }
static inline vf wt_q8_0_group(const uint8_t *b, const wt_q8_0_state *st, int g)
{
    return vf_mul(vf_from_vi(vi_i8(b + 2 + g * KV_W)), st->d);
}
#define WT_NAME q8_0
#define WT_BLOCK 32
#define WT_BYTES 34
#define WT_STATE wt_q8_0_state
#define WT_PREP wt_q8_0_prep
#define WT_GROUP wt_q8_0_group
#include "gemv.inc.h"

/* Int8 activations (gemv_x8.inc.h): 32 repacked bytes are values 4i..4i+3 of each column.  With
   VPDPBUSD (unsigned times signed, no saturation) the weights go in as q_w + 128; otherwise as
   |q_w| against x carrying q_w's sign (v8i_sdot). */
static inline void wx_q8_decode(const uint8_t *qs, v8b *w)
{
    KV_XU(8)
    for (int i = 0; i < 8; i++)
#ifdef KV_HAVE_DPBUSD
        w[i] = v8b_flip(v8b_load(qs + 32 * i));
#else
        w[i] = v8b_load(qs + 32 * i);
#endif
}
typedef struct { int unused; } wx_q8_state;
#define WX_NAME q8_0
#define WX_SUPER 32
#define WX_BYTES 272
#define WX_STATE wx_q8_state
#define WX_PREP(blk, st) ((void)(st))
#define WX_DECODE(blk, st, j, w) wx_q8_decode((blk) + 16, (w))
#define WX_SCALE(blk, st, j, D, M) (*(D) = v8f_half8(blk), *(M) = *(D))
#define WX_MIN 0
#ifdef KV_HAVE_DPBUSD
#define WX_OFF -128.0f
#define WX_DOT v8i_dot
#else
#define WX_OFF 0.0f
#define WX_DOT v8i_sdot
#endif
#define WX_XPOS(i) (4 * (i))
#include "gemv_x8.inc.h"
