/* wt_float.inc.h - the float weight types F32, F16 and BF16: each value widened to float32.
 * Column data is aligned to the element size (the Python boundary checks it). */
static inline vf wt_f32_load(const uint8_t *col, int64_t i) { return vf_load((const float *)col + i); }
static inline vf wt_f32_part(const uint8_t *col, int64_t i, int64_t m) { return vf_load_part((const float *)col + i, m); }
#define WT_NAME f32
#define WT_BLOCK 1
#define WT_BYTES 4
#define WT_LOAD wt_f32_load
#define WT_LOAD_PART wt_f32_part
#include "gemv.inc.h"

static inline vf wt_f16_load(const uint8_t *col, int64_t i) { return vf_load_h((const uint16_t *)col + i); }
static inline vf wt_f16_part(const uint8_t *col, int64_t i, int64_t m)
{
    return vf_load_h_part((const uint16_t *)col + i, m);
}
#define WT_NAME f16
#define WT_BLOCK 1
#define WT_BYTES 2
#define WT_LOAD wt_f16_load
#define WT_LOAD_PART wt_f16_part
#include "gemv.inc.h"

/* bfloat16: the upper half of a float32 */
static inline vf wt_bf16_load(const uint8_t *col, int64_t i) { return vf_load_bf16((const uint16_t *)col + i); }
static inline vf wt_bf16_part(const uint8_t *col, int64_t i, int64_t m)
{
    uint16_t buf[KV_W];
    const uint16_t *src = (const uint16_t *)col + i;
    for (int64_t t = 0; t < KV_W; t++)
        buf[t] = t < m ? src[t] : 0;
    return vf_load_bf16(buf);
}
#define WT_NAME bf16
#define WT_BLOCK 1
#define WT_BYTES 2
#define WT_LOAD wt_bf16_load
#define WT_LOAD_PART wt_bf16_part
#include "gemv.inc.h"
