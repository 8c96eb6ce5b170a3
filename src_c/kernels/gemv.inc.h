/* gemv.inc.h - the matrix product and the dequantization of one weight type, written once for
 * every type: a wt_<type>.inc.h defines the type's decoder and includes this file.
 *
 * The decoder gives, for a block of WT_BLOCK values stored in WT_BYTES bytes:
 *   WT_STATE, WT_PREP(blk, &st)   what the block's header decodes to (scales, minimums);
 *   WT_GROUP(blk, &st, j)         values j..j+KV_W-1 of the block as one float vector.
 * Float types (WT_BLOCK 1) give WT_LOAD(col, i) and WT_LOAD_PART(col, i, m) (m < KV_W values).
 *
 * The product widens each weight to float32 once and multiplies it into every row of x (the
 * B <= KV_GEMV_MAX_B rows of a decode step share each decoded weight): per column, NB x NA
 * vector accumulators, NA independent chains per row so that one row alone still keeps the
 * FMA units busy.  Column sums are added in a fixed order: results do not depend on how
 * columns are split across threads.
 */
#define KV_WFN(f) KV_CAT(KV_CAT(kv_##f, WT_NAME), KV_ISA)   /* kv_gemv_q4_0_avx2 */

#define KV_GEMV_NA 4 /* accumulators per row of x for B = 1 (2 for B = 2, 1 beyond) */
#if WT_BLOCK > 1
#define KV_WT_GROUPS (WT_BLOCK / KV_W)
#endif

static inline __attribute__((always_inline)) void KV_WFN(cols)(const kv_gemv_params *p, int64_t n0, int64_t n1,
                                                                const int NB)
{
    const int64_t k = p->k, xs = p->x_stride, ys = p->y_stride;
#if WT_BLOCK == 1
    const int NA = NB == 1 ? KV_GEMV_NA : NB == 2 ? 2 : 1;
#else
    const int NA0 = NB == 1 ? KV_GEMV_NA : NB == 2 ? 2 : 1;
    const int NA = NA0 < KV_WT_GROUPS ? NA0 : KV_WT_GROUPS;
#endif
    for (int64_t j = n0; j < n1; j++) {
        const uint8_t *col = (const uint8_t *)p->w + j * p->row_bytes;
        vf acc[KV_GEMV_MAX_B][KV_GEMV_NA];
#pragma GCC unroll 8
        for (int b = 0; b < NB; b++)
#pragma GCC unroll 4
            for (int a = 0; a < NA; a++)
                acc[b][a] = vf_zero();
#if WT_BLOCK == 1
        int64_t i = 0;
        for (; i + NA * KV_W <= k; i += NA * KV_W) {
#pragma GCC unroll 4
            for (int a = 0; a < NA; a++) {
                const vf w = WT_LOAD(col, i + a * KV_W);
#pragma GCC unroll 8
                for (int b = 0; b < NB; b++)
                    acc[b][a] = vf_fmadd(w, vf_load(p->x + b * xs + i + a * KV_W), acc[b][a]);
            }
        }
        for (; i < k; i += KV_W) {    /* fewer than NA vectors left, the last one maybe partial */
            const int64_t m = k - i < KV_W ? k - i : KV_W;
            const vf w = m == KV_W ? WT_LOAD(col, i) : WT_LOAD_PART(col, i, m);
#pragma GCC unroll 8
            for (int b = 0; b < NB; b++)
                acc[b][0] = vf_fmadd(w, vf_load_part(p->x + b * xs + i, m), acc[b][0]);
        }
#else
        const int64_t nblocks = k / WT_BLOCK;
        for (int64_t ib = 0; ib < nblocks; ib++) {
            const uint8_t *blk = col + ib * WT_BYTES;
            const float *xb = p->x + ib * WT_BLOCK;
            WT_STATE st;
            WT_PREP(blk, &st);
            for (int g = 0; g < KV_WT_GROUPS; g += NA) {
#pragma GCC unroll 4
                for (int a = 0; a < NA; a++) {
                    const vf w = WT_GROUP(blk, &st, (g + a) * KV_W);
#pragma GCC unroll 8
                    for (int b = 0; b < NB; b++)
                        acc[b][a] = vf_fmadd(w, vf_load(xb + b * xs + (g + a) * KV_W), acc[b][a]);
                }
            }
        }
#endif
#pragma GCC unroll 8
        for (int b = 0; b < NB; b++) {
            vf s = acc[b][0];
#pragma GCC unroll 4
            for (int a = 1; a < NA; a++)
                s = vf_add(s, acc[b][a]);
            p->y[b * ys + j] = vf_hsum(s);
        }
    }
}

static void KV_WFN(gemv)(const kv_gemv_params *p, int64_t n0, int64_t n1)
{
    switch (p->B) {   /* one body per row count: the loops over rows and chains unroll */
    case 1: KV_WFN(cols)(p, n0, n1, 1); break;
    case 2: KV_WFN(cols)(p, n0, n1, 2); break;
    case 3: KV_WFN(cols)(p, n0, n1, 3); break;
    case 4: KV_WFN(cols)(p, n0, n1, 4); break;
    case 5: KV_WFN(cols)(p, n0, n1, 5); break;
    case 6: KV_WFN(cols)(p, n0, n1, 6); break;
    case 7: KV_WFN(cols)(p, n0, n1, 7); break;
    default: KV_WFN(cols)(p, n0, n1, 8); break;
    }
}

static void KV_WFN(dequant)(float *dst, const void *src, int64_t n)
{
    const uint8_t *s = (const uint8_t *)src;
#if WT_BLOCK == 1
    int64_t i = 0;
    for (; i + KV_W <= n; i += KV_W)
        vf_store(dst + i, WT_LOAD(s, i));
    if (i < n)
        vf_store_part(dst + i, WT_LOAD_PART(s, i, n - i), n - i);
#else
    for (int64_t ib = 0; ib < n / WT_BLOCK; ib++) {
        const uint8_t *blk = s + ib * WT_BYTES;
        WT_STATE st;
        WT_PREP(blk, &st);
        for (int g = 0; g < KV_WT_GROUPS; g++)
            vf_store(dst + ib * WT_BLOCK + g * KV_W, WT_GROUP(blk, &st, g * KV_W));
    }
#endif
}

#undef KV_WT_GROUPS
#undef KV_WFN
#undef WT_NAME
#undef WT_BLOCK
#undef WT_BYTES
#undef WT_STATE
#undef WT_PREP
#undef WT_GROUP
#undef WT_LOAD
#undef WT_LOAD_PART
