/* gemv.inc.h - the matrix product and the dequantization of one weight type, written once for
 * every type: a wt_<type>.inc.h defines the type's decoder and includes this file.
 *
 * The decoder gives, for a block of WT_BLOCK values stored in WT_BYTES bytes:
 *   WT_STATE, WT_PREP(blk, &st)   what the block's header decodes to (scales, minimums);
 *   WT_GROUP(blk, &st, g)         the block's g-th vector of KV_W values (g < WT_BLOCK / KV_W),
 *                                 in the order the decoder prefers (two vectors that come from
 *                                 one load, e.g. the low and high nibbles of the same bytes,
 *                                 next to each other); a constant once the loops unroll;
 *   WT_POS(g)                     where that vector's values start in the block (default
 *                                 g * KV_W: blocks in value order).
 * Float types (WT_BLOCK 1) give WT_LOAD(col, i) and WT_LOAD_PART(col, i, m) (m < KV_W values).
 *
 * The product widens each weight to float32 once -- exactly the float32 value gguf's
 * dequantization gives -- and multiplies it into every row of x (the B <= KV_GEMV_MAX_B rows of
 * a decode step share each decoded weight).  NC columns are done side by side so that each
 * vector of x, loaded once, serves NC columns and the chains of the NC columns overlap; per
 * (row, column) NA independent vector accumulators take the vectors of KV_W values in turn
 * (for block types: vector g of every block into accumulator g mod NA), so one row alone still
 * keeps the FMA units busy.  NC and NA depend on B only (KV_GEMV_NC / KV_GEMV_NA).
 *
 * Error: each lane of an accumulator is one chain of fused multiply-adds over k / (NA KV_W)
 * products; a column's sum is then acc_0 + ... + acc_{NA-1} and the lane tree of vf_hsum
 * (log2 KV_W adds): at most k / (NA KV_W) + NA - 1 + log2 KV_W roundings in any product's path
 * (KV_W = 1 on the scalar row, where the multiply and the add round separately: twice that).
 *
 * Memory: a column is a contiguous row of the file's tensor.  The columns are taken in tiles
 * of KV_GEMV_TILE and k in ranges of about KV_GEMV_XBYTES of x, so that x stays in the L1
 * cache while a tile goes through it (the tile's accumulators wait on the stack between
 * ranges); the columns one pass ahead are prefetched, the hardware prefetcher following NC
 * interleaved streams less well than one.
 *
 * Every column is computed by the same sequence of operations whether it is done in a pass of
 * NC columns or alone (the last columns of a tile), in one range of k or several: its
 * accumulators and the order it adds them do not depend on its neighbours, so results do not
 * depend on how columns are split across threads or tiles.
 */
#ifndef KV_GEMV_ONCE
#define KV_GEMV_ONCE
/* columns per pass and accumulators per (row, column), by rows of x: enough independent FMA
   chains (latency 4 x 2 ports) without spilling the register file (16 vectors on avx2, 32 on
   avx512; the scalar row has one lane and no FMA: anything works) */
#ifndef KV_GEMV_NC
#if KV_VREGS >= 32
#define KV_GEMV_NC(NB) ((NB) <= 2 ? 4 : 2)
#define KV_GEMV_NA(NB) ((NB) == 1 ? 2 : 1)
#else
#define KV_GEMV_NC(NB) ((NB) <= 2 ? 2 : 1)
#define KV_GEMV_NA(NB) ((NB) <= 4 ? 2 : 1)
#endif
#endif
/* groups of a block decoded in one unrolled stretch: all of them on the vector rows (the
   decoders' index arithmetic then folds to constants), a few on the scalar row */
#if KV_W == 1
#define KV_GEMV_GROUP_UNROLL 8
#else
#define KV_GEMV_GROUP_UNROLL 32
#endif
/* x bytes a range of k may take (the rest of the L1 data cache holds the weights streaming by) */
#define KV_GEMV_XBYTES 16384
#define KV_GEMV_TILE 16   /* columns through one range of k before the next range */
#define KV_GEMV_SAVE 8    /* vectors a column keeps between ranges: NB x NA <= 8 */
#ifndef KV_GEMV_PF_BYTES
#define KV_GEMV_PF_BYTES 2048
#endif
#define KV_GEMV_NCMAX 4
#define KV_GEMV_NAMAX 2
#define KV_GEMV_FITS(NB) (KV_GEMV_NC(NB) <= KV_GEMV_NCMAX && KV_GEMV_NA(NB) <= KV_GEMV_NAMAX && \
                          (NB) * KV_GEMV_NA(NB) <= KV_GEMV_SAVE)
_Static_assert(KV_GEMV_FITS(1) && KV_GEMV_FITS(2) && KV_GEMV_FITS(3) && KV_GEMV_FITS(4) && KV_GEMV_FITS(5) &&
               KV_GEMV_FITS(6) && KV_GEMV_FITS(7) && KV_GEMV_FITS(8), "gemv tiling exceeds its arrays");
#define KV_PRAGMA_(x) _Pragma(#x)
#define KV_UNROLL(n) KV_PRAGMA_(GCC unroll n)
/* the int8-activation product's unrolling (gemv_x8.inc.h and its decoders): on the vector rows;
   none on the scalar row, whose 8-lane forms are loops already (unrolled, they made its object
   take a minute to compile) */
#if KV_W == 1
#define KV_XU(n) KV_UNROLL(1)
#else
#define KV_XU(n) KV_UNROLL(n)
#endif
#endif

#define KV_WFN(f) KV_CAT(KV_CAT(kv_##f, WT_NAME), KV_ISA)   /* kv_gemv_q4_0_avx2 */

#if WT_BLOCK > 1
#define KV_WT_GROUPS (WT_BLOCK / KV_W)
#ifndef WT_POS
#define WT_POS(g) ((g) * KV_W)
#endif
#endif

/* Values [i0, i1) of columns j0 .. j0+NC-1 for the NB rows of x.  The accumulators start at
   zero (first) or from sv, and end in sv or (last) summed into y; sv holds [NC][NB][NA]
   vectors.  A column's accumulators see the same operations in the same order however k is
   cut into ranges (ranges start at multiples of NA vectors and of the block). */
static inline __attribute__((always_inline)) void KV_WFN(pass)(const kv_gemv_params *p, int64_t j0, const int NB,
                                                                const int NC, int64_t i0, int64_t i1, vf *sv,
                                                                int first, int last)
{
    const int64_t xs = p->x_stride, ys = p->y_stride;
#if WT_BLOCK == 1
    const int NA = KV_GEMV_NA(NB);
#else
    const int NA = KV_GEMV_NA(NB) < KV_WT_GROUPS ? KV_GEMV_NA(NB) : KV_WT_GROUPS;
#endif
    const uint8_t *col[KV_GEMV_NCMAX];
    const float *xr[KV_GEMV_MAX_B];   /* each row of x from i0, stepped along: constant offsets within a step */
    vf acc[KV_GEMV_MAX_B][KV_GEMV_NCMAX][KV_GEMV_NAMAX];
    KV_UNROLL(4)
    for (int c = 0; c < NC; c++)
        col[c] = (const uint8_t *)p->w + (j0 + c) * p->row_bytes;
    KV_UNROLL(8)
    for (int b = 0; b < NB; b++) {
        xr[b] = p->x + b * xs + i0;
        KV_UNROLL(4)
        for (int c = 0; c < NC; c++)
            KV_UNROLL(2)
            for (int a = 0; a < NA; a++)
                acc[b][c][a] = first ? vf_zero() : sv[(c * NB + b) * NA + a];
    }
    /* prefetch the same values of the columns one pass (or more: at least KV_GEMV_PF_BYTES) ahead */
    const int64_t ahead = NC * p->row_bytes, pf = (KV_GEMV_PF_BYTES + ahead - 1) / ahead * ahead;
#if WT_BLOCK == 1
    int64_t i = i0;
    for (; i + NA * KV_W <= i1; i += NA * KV_W) {
        KV_UNROLL(4)
        for (int c = 0; c < NC; c++)
            KV_UNROLL(4)
            for (int o = 0; o < NA * KV_W * WT_BYTES; o += 64)
                __builtin_prefetch((const void *)((uintptr_t)col[c] + i * WT_BYTES + pf + o));
        KV_UNROLL(2)
        for (int a = 0; a < NA; a++) {
            vf w[KV_GEMV_NCMAX];
            KV_UNROLL(4)
            for (int c = 0; c < NC; c++)
                w[c] = WT_LOAD(col[c], i + a * KV_W);
            KV_UNROLL(8)
            for (int b = 0; b < NB; b++) {
                const vf xv = vf_load(xr[b] + a * KV_W);
                KV_UNROLL(4)
                for (int c = 0; c < NC; c++)
                    acc[b][c][a] = vf_fmadd(w[c], xv, acc[b][c][a]);
            }
        }
        KV_UNROLL(8)
        for (int b = 0; b < NB; b++)
            xr[b] += NA * KV_W;
    }
    for (; i < i1; i += KV_W) {    /* fewer than NA vectors left (only at the end of k), the last one maybe partial */
        const int64_t m = i1 - i < KV_W ? i1 - i : KV_W;
        vf w[KV_GEMV_NCMAX];
        KV_UNROLL(4)
        for (int c = 0; c < NC; c++)
            w[c] = m == KV_W ? WT_LOAD(col[c], i) : WT_LOAD_PART(col[c], i, m);
        KV_UNROLL(8)
        for (int b = 0; b < NB; b++) {
            const vf xv = vf_load_part(xr[b], m);
            KV_UNROLL(4)
            for (int c = 0; c < NC; c++)
                acc[b][c][0] = vf_fmadd(w[c], xv, acc[b][c][0]);
            xr[b] += KV_W;
        }
    }
#else
    for (int64_t ib = i0 / WT_BLOCK; ib < i1 / WT_BLOCK; ib++) {
        const uint8_t *blk[KV_GEMV_NCMAX];
        WT_STATE st[KV_GEMV_NCMAX];
        KV_UNROLL(4)
        for (int c = 0; c < NC; c++) {
            blk[c] = col[c] + ib * WT_BYTES;
            KV_UNROLL(4)
            for (int o = 0; o < WT_BYTES; o += 64)   /* (maybe past the matrix: a prefetch never faults) */
                __builtin_prefetch((const void *)((uintptr_t)blk[c] + pf + o));
            __builtin_prefetch((const void *)((uintptr_t)blk[c] + pf + WT_BYTES - 1));
            WT_PREP(blk[c], &st[c]);
        }
        KV_UNROLL(KV_GEMV_GROUP_UNROLL)
        for (int g = 0; g < KV_WT_GROUPS; g += NA) {
            KV_UNROLL(2)
            for (int a = 0; a < NA; a++) {
                vf w[KV_GEMV_NCMAX];
                KV_UNROLL(4)
                for (int c = 0; c < NC; c++)
                    w[c] = WT_GROUP(blk[c], &st[c], g + a);
                KV_UNROLL(8)
                for (int b = 0; b < NB; b++) {
                    const vf xv = vf_load(xr[b] + WT_POS(g + a));
                    KV_UNROLL(4)
                    for (int c = 0; c < NC; c++)
                        acc[b][c][a] = vf_fmadd(w[c], xv, acc[b][c][a]);
                }
            }
        }
        KV_UNROLL(8)
        for (int b = 0; b < NB; b++)
            xr[b] += WT_BLOCK;
    }
#endif
    KV_UNROLL(8)
    for (int b = 0; b < NB; b++)
        KV_UNROLL(4)
        for (int c = 0; c < NC; c++) {
            if (!last) {
                KV_UNROLL(2)
                for (int a = 0; a < NA; a++)
                    sv[(c * NB + b) * NA + a] = acc[b][c][a];
                continue;
            }
            vf s = acc[b][c][0];
            KV_UNROLL(2)
            for (int a = 1; a < NA; a++)
                s = vf_add(s, acc[b][c][a]);
            p->y[b * ys + j0 + c] = vf_hsum(s);
        }
}

/* Columns n0..n1-1, KV_GEMV_TILE at a time.  k is cut into ranges of about KV_GEMV_XBYTES of x
   (one range when x is short), so that x stays in the L1 cache while the tile's columns go
   through it; the tile's accumulators wait on the stack between ranges. */
static inline __attribute__((always_inline)) void KV_WFN(cols)(const kv_gemv_params *p, int64_t n0, int64_t n1,
                                                                const int NB)
{
    const int NC = KV_GEMV_NC(NB);
#if WT_BLOCK == 1
    const int64_t unit = KV_GEMV_NA(NB) * KV_W;
#else
    const int64_t unit = WT_BLOCK;
#endif
    const int64_t k = p->k, want = KV_GEMV_XBYTES / (int64_t)sizeof(float) / NB;
    const int64_t kc = want > unit ? want / unit * unit : unit;
    vf sv[KV_GEMV_TILE * KV_GEMV_SAVE];
    for (int64_t t0 = n0; t0 < n1; t0 += KV_GEMV_TILE) {
        const int64_t t1 = t0 + KV_GEMV_TILE < n1 ? t0 + KV_GEMV_TILE : n1;
        for (int64_t i0 = 0; i0 < k; i0 += kc) {
            const int64_t i1 = i0 + kc < k ? i0 + kc : k;
            int64_t j = t0;
            for (; j + NC <= t1; j += NC)
                KV_WFN(pass)(p, j, NB, NC, i0, i1, sv + (j - t0) * KV_GEMV_SAVE, i0 == 0, i1 == k);
            for (; j < t1; j++)
                KV_WFN(pass)(p, j, NB, 1, i0, i1, sv + (j - t0) * KV_GEMV_SAVE, i0 == 0, i1 == k);
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
        KV_UNROLL(KV_GEMV_GROUP_UNROLL)
        for (int g = 0; g < KV_WT_GROUPS; g++)
            vf_store(dst + ib * WT_BLOCK + WT_POS(g), WT_GROUP(blk, &st, g));
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
#undef WT_POS
#undef WT_LOAD
#undef WT_LOAD_PART
