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
