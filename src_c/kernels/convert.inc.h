/* convert.inc.h - bulk fp32 <-> fp16 conversion, bit-identical to NumPy's float16 casts
 * (round to nearest even; inf, NaN payloads and subnormals as NumPy has them). */
#include "kvsimd.h"

static void KV_FN(f32_to_f16)(uint16_t *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + KV_W <= n; i += KV_W)
        vf_store_h_exact(dst + i, vf_load(src + i));
    for (; i < n; i++)
        dst[i] = kv_f2h_soft(src[i]);
}

static void KV_FN(f16_to_f32)(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + KV_W <= n; i += KV_W)
        vf_store(dst + i, vf_load_h_exact(src + i));
    for (; i < n; i++)
        dst[i] = kv_h2f_soft(src[i]);
}
