/* row.inc.h - one ISA's kernels and its row of the dispatch table.
 * A tu_<isa>.c includes its vec_<isa>.h and then this file; every symbol gets the ISA as a
 * suffix through KV_FN, so the algorithm sources never spell an ISA. */
#ifndef KV_ISA
#error "include a vec_<isa>.h first"
#endif
#ifndef KV_ROW_CFLAGS
#error "the build passes -DKV_ROW_CFLAGS=\"<this row's flags from isa_rows.def>\""
#endif
#define KV_CAT_(a, b) a##_##b
#define KV_CAT(a, b) KV_CAT_(a, b)
#define KV_FN(name) KV_CAT(kv_##name, KV_ISA)

#include "attn.inc.h"
#include "rope.inc.h"
#include "convert.inc.h"
#include "peak.inc.h"
/* the weight types of wtypes.def: one decoder each, one product and dequantization for all */
#include "wt_float.inc.h"
#include "wt_q8_0.inc.h"
#include "wt_q4_0.inc.h"
#include "wt_q4_1.inc.h"
#include "wt_kquant.inc.h"

const kv_kernels KV_FN(kernels) = {
    KV_ROW_CFLAGS,
    KV_FN(attn), KV_FN(rotate), KV_FN(f32_to_f16), KV_FN(f16_to_f32), KV_FN(fma_peak),
    {
#define KV_WTYPE(id, name, ggml, block, bytes) [KV_WT_##id] = KV_CAT(KV_CAT(kv_gemv, name), KV_ISA),
#include "wtypes.def"
#undef KV_WTYPE
    },
    {
#define KV_WTYPE(id, name, ggml, block, bytes) [KV_WT_##id] = KV_CAT(KV_CAT(kv_dequant, name), KV_ISA),
#include "wtypes.def"
#undef KV_WTYPE
    },
    {   /* int8 activations: the types kv_has_x8 names */
        [KV_WT_Q8_0] = KV_FN(gemv_x8_q8_0), [KV_WT_Q4_0] = KV_FN(gemv_x8_q4_0), [KV_WT_Q4_1] = KV_FN(gemv_x8_q4_1),
        [KV_WT_Q4_K] = KV_FN(gemv_x8_q4_k), [KV_WT_Q5_K] = KV_FN(gemv_x8_q5_k),
    },
};
