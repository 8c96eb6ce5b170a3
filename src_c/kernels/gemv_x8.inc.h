/* gemv_x8.inc.h - the product with int8 activations, written once for the types that have it: a
 * wt_<type>.inc.h defines its decoder and includes this file (after gemv.inc.h).
 *
 * Weights are in the repacked layout (kvsimd.h, kv_repack_x8): 8 columns side by side, lane c of
 * every vector = column c, so 32 values of 8 columns are 8 integer dot products of 4 bytes per
 * lane (v8i_dot: the 4 bytes of x broadcast to every lane), with no horizontal sum; x comes
 * quantized per block of 32 (kv_quantize_x: int8 q_x, step d_x, s_x = d_x sum(q_x)).  Per block
 * of 32 and column the integer sum is exact; it becomes a float once, scaled by d_x, and is
 * accumulated as  acc += D (d_x sum(q_w q_x) + WX_OFF s_x)  (+ M s_x with a minimum), D and M
 * the block's scale and minimum for each of the 8 columns.
 *
 * The decoder gives:
 *   WX_NAME                  the type (kv_gemv_x8_<name>_<isa>);
 *   WX_SUPER                 values per repacked block (32; 256 for the k-quants' super-blocks);
 *   WX_BYTES                 bytes of a repacked block (8 columns x WX_SUPER values);
 *   WX_STATE, WX_PREP(blk, &st)   what the block's header decodes to;
 *   WX_DECODE(blk, &st, j, w)     the 8 weight vectors of its j-th 32 values into w[0..7]
 *                            (w[i] meets x values WX_XPOS(i) .. + 3 of those 32);
 *   WX_SCALE(blk, &st, j, &D, &M) their scales D (and minimums M, with WX_MIN) for the 8 columns;
 *   WX_MIN                   1 if the type has minimums, else 0;
 *   WX_OFF                   what the decoder's weights carry beyond q_w (Q4_0 gives its nibbles
 *                            0..15 for q_w = nibble - 8: WX_OFF -8), a float constant;
 *   WX_DOT                   v8i_dot (unsigned weights) or v8i_sdot (signed ones).
 * A column's result does not depend on which columns share its pass (lanes are independent), so
 * results are the same for any split of the columns into multiples of 8.
 */
#ifndef KV_GEMV_X8_ONCE
#define KV_GEMV_X8_ONCE

#ifndef KV_GEMV_X8_PF
#define KV_GEMV_X8_PF 1024   /* bytes ahead prefetched in a column group's stream */
#endif
#endif

#define KV_XFN(f) KV_CAT(KV_CAT(kv_##f, WX_NAME), KV_ISA)   /* kv_gemv_x8_q4_0_avx2 */

static inline __attribute__((always_inline)) void KV_XFN(x8_cols)(const kv_gemv_params *p, int64_t n0, int64_t n1,
                                                                  const int NB)
{
    const int64_t k = p->k, nb = k / 32, nsb = k / WX_SUPER, qs = KV_XQ_ROW_BYTES(k);
    const uint8_t *xq = (const uint8_t *)p->xq;
    for (int64_t g = n0 / 8; g < n1 / 8; g++) {
        const uint8_t *blk = (const uint8_t *)p->w + g * nsb * WX_BYTES;
        v8f acc[KV_GEMV_MAX_B];
        KV_XU(8)
        for (int b = 0; b < NB; b++)
            acc[b] = v8f_zero();
        for (int64_t isb = 0; isb < nsb; isb++, blk += WX_BYTES) {
            KV_XU(4)
            for (int o = 0; o < WX_BYTES; o += 512)   /* (maybe past the matrix: a prefetch never faults) */
                __builtin_prefetch((const void *)((uintptr_t)blk + KV_GEMV_X8_PF + o));
            __builtin_prefetch((const void *)((uintptr_t)blk + KV_GEMV_X8_PF + WX_BYTES - 1));
            WX_STATE st;
            WX_PREP(blk, &st);
            KV_XU(8)
            for (int j = 0; j < WX_SUPER / 32; j++) {
                const int64_t ib = isb * (WX_SUPER / 32) + j;    /* x's block */
                v8b w[8];
                v8f D, M;
                WX_DECODE(blk, &st, j, w);
                WX_SCALE(blk, &st, j, &D, &M);
                (void)M;
                KV_XU(8)
                for (int b = 0; b < NB; b++) {
                    const int8_t *xb = (const int8_t *)(xq + b * qs) + ib * 32;
                    const float *xd = (const float *)(xq + b * qs + k) + ib, *xs = xd + nb;
                    v8i s0 = v8i_zero(), s1 = v8i_zero();   /* two chains: integer sums, any order is exact */
                    KV_XU(8)
                    for (int i = 0; i < 8; i += 2) {
                        s0 = WX_DOT(s0, w[i], v8b_bcast4(xb + WX_XPOS(i)));
                        s1 = WX_DOT(s1, w[i + 1], v8b_bcast4(xb + WX_XPOS(i + 1)));
                    }
                    const v8f t = v8f_mul(v8f_from(v8i_add(s0, s1)), v8f_bcast(xd));
#if WX_MIN
                    acc[b] = v8f_fmadd(M, v8f_bcast(xs), v8f_fmadd(t, D, acc[b]));
#else
                    acc[b] = v8f_fmadd(v8f_fmadd(v8f_bcast(xs), v8f_set1(WX_OFF), t), D, acc[b]);
#endif
                }
            }
        }
        KV_XU(8)
        for (int b = 0; b < NB; b++)
            v8f_store(p->y + b * p->y_stride + g * 8, acc[b]);
    }
}

static void KV_XFN(gemv_x8)(const kv_gemv_params *p, int64_t n0, int64_t n1)
{
    switch (p->B) {   /* one body per row count: the loops over rows unroll */
    case 1: KV_XFN(x8_cols)(p, n0, n1, 1); break;
    case 2: KV_XFN(x8_cols)(p, n0, n1, 2); break;
    case 3: KV_XFN(x8_cols)(p, n0, n1, 3); break;
    case 4: KV_XFN(x8_cols)(p, n0, n1, 4); break;
    case 5: KV_XFN(x8_cols)(p, n0, n1, 5); break;
    case 6: KV_XFN(x8_cols)(p, n0, n1, 6); break;
    case 7: KV_XFN(x8_cols)(p, n0, n1, 7); break;
    default: KV_XFN(x8_cols)(p, n0, n1, 8); break;
    }
}

#undef KV_XFN
#undef WX_NAME
#undef WX_SUPER
#undef WX_STATE
#undef WX_PREP
#undef WX_SCALE
#undef WX_BYTES
#undef WX_MIN
#undef WX_OFF
#undef WX_DECODE
#undef WX_DOT
#undef WX_XPOS
