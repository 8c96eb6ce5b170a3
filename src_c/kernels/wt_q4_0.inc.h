/* wt_q4_0.inc.h - Q4_0: blocks of 32 values, a half scale d then 16 bytes of 4-bit q (byte i:
 * value i in its low nibble, value i + 16 in its high one); value = d * (q - 8). */
typedef struct { vf d, off; } wt_q4_0_state;
static inline void wt_q4_0_prep(const uint8_t *b, wt_q4_0_state *st)
{
    const float d = kv_half(b);
    st->d = vf_set1(d);
    st->off = vf_set1(-8.0f * d);
}
static inline vf wt_q4_0_group(const uint8_t *b, const wt_q4_0_state *st, int j)
{
    const vi raw = vi_u8(b + 2 + (j & 15));
    const vi q = j < 16 ? vi_and(raw, 15) : vi_shr(raw, 4);
    return vf_fmadd(vf_from_vi(q), st->d, st->off);
}
#define WT_NAME q4_0
#define WT_BLOCK 32
#define WT_BYTES 18
#define WT_STATE wt_q4_0_state
#define WT_PREP wt_q4_0_prep
#define WT_GROUP wt_q4_0_group
#include "gemv.inc.h"
