/* wt_q4_1.inc.h - Q4_1: blocks of 32 values, half scale d and half minimum m, then 16 bytes
 * of 4-bit q (as Q4_0); value = d * q + m. */
typedef struct { vf d, m; } wt_q4_1_state;
static inline void wt_q4_1_prep(const uint8_t *b, wt_q4_1_state *st)
{
    st->d = vf_set1(kv_half(b));
    st->m = vf_set1(kv_half(b + 2));
}
static inline vf wt_q4_1_group(const uint8_t *b, const wt_q4_1_state *st, int j)
{
    const vi raw = vi_u8(b + 4 + (j & 15));
    const vi q = j < 16 ? vi_and(raw, 15) : vi_shr(raw, 4);
    return vf_fmadd(vf_from_vi(q), st->d, st->m);
}
#define WT_NAME q4_1
#define WT_BLOCK 32
#define WT_BYTES 20
#define WT_STATE wt_q4_1_state
#define WT_PREP wt_q4_1_prep
#define WT_GROUP wt_q4_1_group
#include "gemv.inc.h"
