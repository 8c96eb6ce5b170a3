/* attn.inc.h - attention of one or several query rows over a KV cache, one algorithm for
 * every ISA.  Included by tu_<isa>.c after its vec_<isa>.h.
 *
 * For each KV head g, its G query heads -- of a tile of query rows (kv_attn_row_tile: a prefill
 * chunk's tokens; one row for a decode step) -- are processed together as M query vectors, so
 * that every K and V row is read from the cache once per group and tile.  Each vector keeps its
 * own online softmax; keys a row must not see (past its causal end, before its window) get
 * weight 0.  Keys are taken in blocks of KV_B tokens:
 *   1. scores s[i][j] = (scale * q_i) . k_j       (KV_B dot products, KV_KP keys per vector, one
 *      add-tree reduction per KV_W keys),
 *      soft-capped to softcap * tanh(s / softcap) when softcap > 0
 *   2. ALiBi bias, then an online-softmax update  (running max m_i, running sum l_i)
 *   3. acc_i = acc_i * exp(m_old - m_new) + sum_j p_ij v_j
 * A call may read several key ranges (kv_attn_range), each with q or q_alt, under the same
 * softmax.  Tokens are taken in chunks and blocks on the absolute token grid, and the rows of
 * the block ahead are prefetched spread over the work on the current block.
 * Head dims are padded with zeros to a multiple of KV_W in the workspace, so the inner
 * loops have no tails.  fp16 rows are widened to fp32 as they are loaded, int8 rows (KV_I8)
 * widened and multiplied by the scale of their 32-value block (in registers for a full block,
 * into the workspace block otherwise and on the lanes path); all arithmetic and accumulation
 * is fp32 -- but for int8 and int4 keys: each query vector is rounded to int8 by the int8 keys'
 * rule (round_query) and, on the KV_INT_DOT rows, full blocks of keys (head dims a multiple of 32)
 * are scored with exact integer dot products per 32-value block, then scaled in fp32 (kv_scores_i8:
 * keys on the lanes; kv_lane_scores_i8: query vectors on the lanes; int4 keys unpacked to int8
 * rows in the workspace block first, kv_i4_rows_i8).  A single query vector (MHA) takes them too:
 * with the tile's transposes unrolled, 0.75-0.93x the time of its fp32 widening on Zen 5.
 * Other blocks read the same rounded query in fp32.  Int8 and int4 values with several query
 * vectors, on the SIMD rows (VPDPWSSD; VPMADDWD on avx2), are multiplied by int16 weights
 * (kv_accumulate_i16).  The avx2 row has no VNNI: its vec header gives the integer dot products
 * as VPMADDWD over 16-bit halves of the bytes (vec_avx2.h), exact all the same.
 */
#include "kvsimd.h"

#define KV_AINLINE static inline __attribute__((always_inline))
#define KV_NEG_INF (-__builtin_inff())

/* The clamp and reduction of e^x: x = n ln2 + r (n integer-valued, |r| <= ln2/2; NaN passes
 * through), and p with e^r = 1 + r p: the degree-7 Taylor polynomial of e^r (error < 6e-9),
 * less its constant term, divided by r.  For |x| >= ln2/2 the reduction is Cody-Waite (n * the
 * high part of ln2 is exact and so is x minus it); for smaller x, n = 0 and r = x exactly. */
KV_AINLINE vf kv_exp_reduce(vf x, vf *n_out, vf *r_out)
{
    x = vf_min(vf_set1(88.37626f), vf_max(vf_set1(-87.33654f), x));
    vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693145751953125f), x);            /* ln2, high part: exact n*hi */
    r = vf_fnmadd(n, vf_set1(1.42860682030941723e-6f), r);          /* ln2, low part */
    vf p = vf_set1(1.0f / 5040.0f);
    p = vf_fmadd(p, r, vf_set1(1.0f / 720.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f / 120.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f / 24.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f / 6.0f));
    p = vf_fmadd(p, r, vf_set1(0.5f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    *n_out = n;
    *r_out = r;
    return p;
}

/* e^x for x <= 88.37, relative error ~1e-7; below -87.33 returns ~1.2e-38 instead of less
 * (harmless here: every use is a softmax weight relative to a maximum of 1). */
KV_AINLINE vf vf_exp(vf x)
{
    vf n, r;
    const vf p = kv_exp_reduce(x, &n, &r);
    return vf_mul(vf_fmadd(p, r, vf_set1(1.0f)), vf_pow2i(n));
}

/* tanh(x) = m / (m + 2) with m = e^(2x) - 1, formed without cancellation as
 * 2^n (r p) + (2^n - 1) (2x = n ln2 + r, kv_exp_reduce): relative error a few ulp everywhere
 * (kvsimd/bounds.py derives SOFTCAP_REL from it).  Saturates to exactly +-1: for 2x >= 88.37,
 * m ~ 2.4e38 (finite) and m + 2 == m; for 2x <= -87.33, m == -1.  +-inf gives +-1, NaN NaN. */
KV_AINLINE vf vf_tanh(vf x)
{
    vf n, r;
    const vf p = kv_exp_reduce(vf_add(x, x), &n, &r);
    const vf e = vf_pow2i(n);
    const vf m = vf_fmadd(vf_mul(p, r), e, vf_sub(e, vf_set1(1.0f)));
    return vf_div(m, vf_add(m, vf_set1(2.0f)));
}

static inline float KV_FN(expf1)(float x) { return vf_first(vf_exp(vf_set1(x))); }

/* How the inner loops read a block's rows: fp32 (the cache's, or a widened copy in the
   workspace), fp16 widened in registers, or int8 widened in registers and multiplied by the
   scale of its 32-value block (sc[si]: int8 only; a vector never straddles two blocks), or int4
   the same way.  Int4 rows are addressed by value as if each held kv_row_values (whole blocks):
   value `off` is in the nibbles kv_i4_at and kv_i4_hi give (kvsimd.h KV_I4). */
enum { KV_ROWS_F32 = 0, KV_ROWS_F16 = 1, KV_ROWS_I8 = 2, KV_ROWS_I4 = 3 };

/* The block of value index x >= 0.  Every index into a row is unsigned arithmetic: a signed
   division or remainder by a power of two costs gcc a sign fix-up (4 instructions more), and the
   int4 V loop spent more instructions on addresses than on vectors (perf annotate, Zen 5). */
KV_AINLINE int64_t kv_blk(int64_t x) { return (int64_t)((uint64_t)x / KV_I8_BLOCK); }
KV_AINLINE const uint8_t *kv_i4_at(const void *base, int64_t off)
{
    const uint64_t u = (uint64_t)off;
    return (const uint8_t *)base + (u / KV_I8_BLOCK) * KV_I4_BLOCK_BYTES + u % KV_I4_BLOCK_BYTES;
}
KV_AINLINE int kv_i4_hi(int64_t off) { return (int)((uint64_t)off / KV_I4_BLOCK_BYTES) & 1; }
/* Value index c >= 0 is in the first half of its block: the low nibbles, whose load gives c + 16 too. */
KV_AINLINE int kv_i4_low(int64_t c) { return (uint64_t)c % KV_I8_BLOCK < KV_I4_BLOCK_BYTES; }

KV_AINLINE vf kv_load_row(const void *base, int mode, int64_t off, const float *sc, int64_t si)
{
    if (mode == KV_ROWS_I8)
        return vf_mul(vf_load_i8((const int8_t *)base + off), vf_set1(sc[si]));
    if (mode == KV_ROWS_I4)
        return vf_mul(vf_load_i4(kv_i4_at(base, off), kv_i4_hi(off)), vf_set1(sc[si]));
    return mode == KV_ROWS_F16 ? vf_load_h((const uint16_t *)base + off) : vf_load((const float *)base + off);
}

/* Int4 rows: the vectors at value c (c % 32 < 16) and c + 16 of a block come from the same bytes,
   the low and the high nibbles, so one load and one widening give both (and one scale vector). */
KV_AINLINE void kv_load_row_i4_pair(const void *base, int64_t off, const float *sc, int64_t si, vf *lo, vf *hi)
{
    vf_load_i4_pair(kv_i4_at(base, off), lo, hi);
    const vf s = vf_set1(sc[si]);
    *lo = vf_mul(*lo, s);
    *hi = vf_mul(*hi, s);
}

/* Query heads are handled KV_GS at a time, and the inner loops keep about KV_ACC
 * accumulators in registers: enough independent FMA chains to cover FMA latency, while
 * every vector loaded (a query chunk, a K or V chunk) feeds several FMAs -- x86 cores load
 * at most two vectors per cycle, so one load per FMA would halve the FMA rate. */
#ifndef KV_GS
#define KV_GS 4
#endif
#ifndef KV_ACC
#define KV_ACC 8
#endif
#ifndef KV_CHUNK
#define KV_CHUNK KV_MAX_CHUNK   /* tokens per two-pass chunk (a multiple of every KV_B) */
#endif
#ifndef KV_NEXT_PASS
#define KV_NEXT_PASS 1   /* a pass's last block prefetches the first rows of the next pass */
#endif
/* Prefetch distance (kv_pf_distance): p->pf_values values ahead (kvsimd.h KV_PF_VALUES: what
   kv_prefetch_values gives this CPU), at most as many bytes as that of fp16 and at least
   KV_PF_MIN_BYTES.  A distance in values is one in time, since the work per value is about the
   same for every dtype: on Zen 5 (4,096) 8 KiB of fp16, 4 KiB of int8, 2 KiB of int4, 8 KiB of
   fp32.  It replaced one block (4 KiB of head_dim 128 fp16, 2 KiB of head_dim 64) on Zen 5
   (bench/kernel_ab.py, 1 thread, 88,064 keys, time new / old): fp16 SmolLM2 9/3/64 0.81-0.84, GQA
   32/8/128 0.90, MHA 32/32/128 0.93 (avx2 row 0.86), int8 9/3/64 0.92-1.0, the rest within noise;
   16 KiB of fp16 ahead was 5-9% slower than 8 KiB, 8 KiB of int8 1-8%.  Zen 4 is fastest 3 KiB
   of fp16 ahead (dispatch.c); there 768 bytes of int4 took 1.05x the time of 2 KiB. */
#define KV_POW2_FLOOR(x) ((x) >= 16 ? 16 : (x) >= 8 ? 8 : (x) >= 4 ? 4 : (x) >= 2 ? 2 : 1)

/* End of the grid cell of ``step`` tokens that holds token t (the next multiple of step),
   or ``end`` if that comes first: blocks (KV_B) and chunks (KV_CHUNK) of a range. */
KV_AINLINE int64_t kv_grid_end(int64_t t, int64_t step, int64_t end)
{
    const int64_t e = (t / step + 1) * step;
    return e < end ? e : end;
}

/* What to prefetch while working on the block at token t of a pass ending at c1: the KV_B rows'
   bytes that start pf bytes past the block's start (attn_setup: kv_pf_distance); in the pass's last
   block, the first rows of the pass that follows (``next``, may be NULL), so that no pass starts
   on a cold stream.  NULL: nothing (pf <= 0, or rows that pass the pass's end). */
KV_AINLINE const char *kv_ahead(const char *base, int64_t t, int64_t c1, size_t row_bytes, int64_t pf, const char *next)
{
    if (pf <= 0)
        return NULL;
    const size_t at = (size_t)t * row_bytes + (size_t)pf;
    if (at + KV_B * row_bytes <= (size_t)c1 * row_bytes)
        return base + at;
    return KV_NEXT_PASS && t + KV_B >= c1 ? next : NULL;
}

/* The prefetch distance in bytes for rows of D values and row_bytes: pf_values values ahead, but
   at most 2 pf_values bytes (pf_values of fp16), and at least KV_PF_MIN_BYTES (pf_values is
   taken as at most KV_MAX_TOKENS: no product wraps). */
KV_AINLINE int64_t kv_pf_distance(int64_t D, size_t row_bytes, int64_t pf_values)
{
    pf_values = pf_values < KV_MAX_TOKENS ? pf_values : KV_MAX_TOKENS;
    const int64_t a = pf_values * (int64_t)row_bytes / D, b = 2 * pf_values;
    const int64_t n = a < b ? a : b;
    return n > KV_PF_MIN_BYTES ? n : KV_PF_MIN_BYTES;
}

/* The 64-byte line that holds p, and the number of lines from line-aligned p to end: rows
   need not start on a line (NumPy's large arrays start 16 bytes into a page). */
KV_AINLINE const char *kv_line_floor(const char *p) { return (const char *)((uintptr_t)p & ~(uintptr_t)63); }
KV_AINLINE int64_t kv_lines(const char *p, const char *end) { return (int64_t)((end - p + 63) / 64); }

/* A prefetch spread over a block's work: each kv_pf_step issues the next n lines from p up to
   end, kv_pf_finish the rest.  A burst of a whole 4 KiB block (64 lines) at once stalls an Intel
   core: the prefetches wait for line fill buffers (16 on Golden Cove) and the FMAs behind them
   wait too.  Into L1 (the lanes path's fp16 / fp32 MQA 32/1/128 beyond the LLC took 0.96x the
   time of an L2 prefetch on Zen 5, avx512; int8 / int4 and the avx2 row the same). */
typedef struct kv_pf { const char *p, *end; int64_t n; } kv_pf;
KV_AINLINE kv_pf kv_pf_over(const char *p, const char *end, int64_t steps)
{
    const kv_pf c = {kv_line_floor(p), end, (kv_lines(kv_line_floor(p), end) + steps - 1) / steps};
    return c;
}
KV_AINLINE void kv_pf_step(kv_pf *c)
{
    for (int64_t i = 0; i < c->n && c->p < c->end; i++, c->p += 64)
        __builtin_prefetch(c->p, 0, 3);
}
KV_AINLINE void kv_pf_finish(kv_pf *c)
{
    for (; c->p < c->end; c->p += 64)
        __builtin_prefetch(c->p, 0, 3);
}

/* Keys per vector in the scores loop (KV_KP, from the row's vec header; 1 by default): KV_KP key
   rows side by side in one vector, KV_KW elements of each, so that one horizontal reduction
   (vf_reduce_keys: KV_W keys from KV_W / KV_KP vectors) finishes KV_KP dot products.  A block's
   KV_B keys are KV_B / KV_KP such vectors.  A single query head (MHA) takes one key per vector
   (KV_KPN): it reads K at the memory's pace, and half-rows cost it twice the load instructions
   per byte (measured 25% slower beyond the LLC on Zen 4), while its reductions are few. */
#ifndef KV_KP
#define KV_KP 1
#define vf_reduce_rows vf_reduce_keys   /* one key per vector either way */
#endif
#define KV_KW (KV_W / KV_KP)
#define KV_KPN(NH) ((NH) >= 2 ? KV_KP : 1)
_Static_assert(KV_B % KV_W == 0 && KV_W % KV_KP == 0, "a block holds whole key vectors");
_Static_assert(KV_KP <= KV_MAX_KP, "the workspace holds each query KV_MAX_KP times");

/* KP rows side by side from row j (row stride `stride` elements) at column c (int8: each times
   its own block scale; sc: the block's scales, KV_I8 rows of `stride` values). */
KV_AINLINE vf kv_load_keys(const void *base, int mode, int64_t stride, const float *sc, int64_t j, int64_t c, const int KP)
{
    if (KP == 1)
        return kv_load_row(base, mode, j * stride + c, sc, j * kv_i8_blocks(stride) + kv_blk(c));
#if KV_KP == 2
    const int64_t off = j * stride + c;
    if (mode == KV_ROWS_I8) {
        const int64_t si = j * kv_i8_blocks(stride) + kv_blk(c);
        return vf_mul(vf_load_i8_2((const int8_t *)base + off, (const int8_t *)base + off + stride),
                      vf_set2(sc[si], sc[si + kv_i8_blocks(stride)]));
    }
    /* int4 keys come in pairs of vectors: kv_load_keys_i4_pair */
    if (mode == KV_ROWS_F16)
        return vf_load_h2((const uint16_t *)base + off, (const uint16_t *)base + off + stride);
    return vf_load2((const float *)base + off, (const float *)base + off + stride);
#else
    _Static_assert(KV_KP == 1, "one or two keys per vector");
    return vf_zero();
#endif
}

/* kv_load_keys of int4 rows at c (c % 32 < 16) and at c + 16, from one load (kv_load_row_i4_pair). */
KV_AINLINE void kv_load_keys_i4_pair(const void *base, int64_t stride, const float *sc, int64_t j, int64_t c,
                                     const int KP, vf *lo, vf *hi)
{
    const int64_t nb = kv_i8_blocks(stride), off = j * stride + c, si = j * nb + kv_blk(c);
    if (KP == 1) {
        kv_load_row_i4_pair(base, off, sc, si, lo, hi);
        return;
    }
#if KV_KP == 2
    vf_load_i4_2pair(kv_i4_at(base, off), kv_i4_at(base, off + stride), lo, hi);
    const vf s = vf_set2(sc[si], sc[si + nb]);
    *lo = vf_mul(*lo, s);
    *hi = vf_mul(*hi, s);
#endif
}

/* Query elements c.. (stored KV_KP times side by side: attn_head_start) as the scores loop with KP
   keys per vector reads them. */
KV_AINLINE vf kv_load_query(const float *q, int64_t c, const int KP)
{
#if KV_KP == 2
    if (KP == 1)   /* [c, c + 8) and [c + 8, c + 16), each the first of its stored pair */
        return vf_load2(q + 2 * c, q + 2 * c + KV_W);
#endif
    (void)KP;
    return vf_load(q + KV_KP * c);
}

/* Column steps per partial sum of a score: each lane of a score chains at most KV_SEG FMAs, then
   the segments' sums are added in order.  Only the scalar row (one lane: D steps) ever has more
   than one segment, as KV_MAX_HEAD_DIM / KV_KW <= 64 on the vector rows; one chain of 512 (a
   multiply and an add each) went to 2.3x the attend bound with large scores at D = 512. */
#define KV_SEG 64

/* R key vectors from vector v0 (keys v0 KP ..), KP = KV_KPN(NH): per column step, NH query loads
   and R key loads feed R * NH FMAs.  Query i is at q + i KV_KP Dp (attn_head_start). */
KV_AINLINE void kv_scores_rows(const float *q, const void *kb, int mode, int64_t ks, const float *ksc, int64_t Dp,
                               vf *red, const int NH, const int v0, const int R, const char *pf, size_t pf_row)
{
    const int KP = KV_KPN(NH), KW = KV_W / KP, BV = KV_B / KP;
    /* the rows kv_pf_distance ahead that this pass mirrors, one line or so per column step:
       prefetches issued in bursts measured far slower from DRAM than spread ones */
    const int j0 = v0 * KP;
    const char *pl = pf ? kv_line_floor(pf + (size_t)j0 * pf_row) : NULL;
    const int64_t nl = pf ? kv_lines(pl, pf + (size_t)(j0 + R * KP) * pf_row) : 0;
    for (int64_t c0 = 0; c0 < Dp; c0 += KV_SEG * KW) {   /* one segment on the vector rows */
        const int64_t c1 = Dp - c0 > KV_SEG * KW ? c0 + KV_SEG * KW : Dp;
        vf a[KV_ACC];
#pragma GCC unroll 16
        for (int x = 0; x < R * NH; x++)
            a[x] = vf_zero();
        for (int64_t c = c0; c < c1; c += KW) {
            if (c / KW < nl)
                __builtin_prefetch(pl + (c / KW) * 64, 0, 3);
            if (mode == KV_ROWS_I4) {   /* c and c + 16 at once (kv_load_keys_i4_pair); c + 16 when < c1 */
                if (!kv_i4_low(c))
                    continue;
                const int both = c + KV_I4_BLOCK_BYTES < c1;
                /* More heads than key vectors: the R key pairs stay in registers and each query pair
                   is loaded for its R FMA pairs (8 heads on the AVX-512 rows pinned 16 query
                   vectors beside 16 accumulators, and spilled: 0.88x the time for G = 8 on Zen 5,
                   the same sums in the same order); else the NH query pairs stay. */
                if (NH > R) {
                    vf kl[KV_B], kh[KV_B];
#pragma GCC unroll 16
                    for (int r = 0; r < R; r++) {
                        kv_load_keys_i4_pair(kb, ks, ksc, j0 + r * KP, c, KP, &kl[r], &kh[r]);
                        kl[r] = vf_pin(kl[r]);
                        kh[r] = vf_pin(kh[r]);
                    }
#pragma GCC unroll 8
                    for (int i = 0; i < NH; i++) {
                        const vf l = vf_pin(kv_load_query(q + i * KV_KP * Dp, c, KP));
                        const vf h = both ? vf_pin(kv_load_query(q + i * KV_KP * Dp, c + KV_I4_BLOCK_BYTES, KP)) : vf_zero();
#pragma GCC unroll 16
                        for (int r = 0; r < R; r++)
                            a[r * NH + i] = vf_fmadd(h, kh[r], vf_fmadd(l, kl[r], a[r * NH + i]));
                    }
                    continue;
                }
                vf ql[KV_GS], qh[KV_GS];
#pragma GCC unroll 8
                for (int i = 0; i < NH; i++) {
                    ql[i] = vf_pin(kv_load_query(q + i * KV_KP * Dp, c, KP));
                    qh[i] = both ? vf_pin(kv_load_query(q + i * KV_KP * Dp, c + KV_I4_BLOCK_BYTES, KP)) : vf_zero();
                }
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) {
                    vf kl, kh;
                    kv_load_keys_i4_pair(kb, ks, ksc, j0 + r * KP, c, KP, &kl, &kh);
#pragma GCC unroll 8
                    for (int i = 0; i < NH; i++)
                        a[r * NH + i] = vf_fmadd(qh[i], kh, vf_fmadd(ql[i], kl, a[r * NH + i]));
                }
                continue;
            }
            vf qc[KV_GS];
#pragma GCC unroll 8
            for (int i = 0; i < NH; i++)   /* loaded once, not at each of its R uses */
                qc[i] = vf_pin(kv_load_query(q + i * KV_KP * Dp, c, KP));
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const vf kc = kv_load_keys(kb, mode, ks, ksc, j0 + r * KP, c, KP);
#pragma GCC unroll 8
                for (int i = 0; i < NH; i++)
                    a[r * NH + i] = vf_fmadd(qc[i], kc, a[r * NH + i]);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int i = 0; i < NH; i++)
                red[i * BV + v0 + r] = c0 ? vf_add(red[i * BV + v0 + r], a[r * NH + i]) : a[r * NH + i];
    }
    for (int64_t m = Dp / KW; m < nl; m++)   /* lines beyond one per column step (wide rows) */
        __builtin_prefetch(pl + m * 64, 0, 3);
}

/* The KV_B scores of NH queries (q: attn_head_start's layout) with the rows at kb, into
 * s + i * ss for query i.  Partial sums first: red[i * BV + v] holds q_i's with the KP keys of
 * vector v (KP = KV_KPN(NH), BV = KV_B / KP), about KV_ACC accumulators per pass (RP key
 * vectors x NH heads: independent FMA chains), the last pass takes the vectors left; then one
 * add tree per KV_W keys. */
KV_AINLINE void kv_scores(const float *q, const void *kb, int mode, int64_t ks, const float *ksc, int64_t Dp, vf *red,
                          const int NH, const char *pf, size_t pf_row, float *s, int64_t ss)
{
    const int KP = KV_KPN(NH), BV = KV_B / KP;
    const int RP0 = KV_ACC / NH > 0 ? KV_ACC / NH : 1;
    const int RP = RP0 > BV ? BV : RP0;
    int v0 = 0;
    for (; v0 + RP <= BV; v0 += RP)
        kv_scores_rows(q, kb, mode, ks, ksc, Dp, red, NH, v0, RP, pf, pf_row);
    if (BV % RP)
        kv_scores_rows(q, kb, mode, ks, ksc, Dp, red, NH, v0, BV % RP, pf, pf_row);
#pragma GCC unroll 8
    for (int i = 0; i < NH; i++)
        for (int jj = 0; jj < KV_B; jj += KV_W) {
            if (KP == 1)
                vf_reduce_rows(red + i * BV + jj, s + i * ss + jj);
            else
                vf_reduce_keys(red + i * BV + jj / KP, s + i * ss + jj);
        }
}

/* Columns c.. of CG vectors of kv_accumulate (CG a compile-time constant at every call): the NH x CG
 * accumulators loaded (times corr_i unless corr is NULL), then per row of the block CG V loads and
 * NH broadcast loads feed CG * NH FMAs; prefetch slots slot.. of the block ahead, one per row. */
KV_AINLINE void kv_accumulate_cols(float *acc, const float *corr, const float *pw, int64_t ws, const void *vb, int mode,
                                   int64_t vs, const float *vsc, int64_t Dp, const int NH, int64_t c, const int CG,
                                   const char *pl, int64_t nl, int64_t slot)
{
    vf x[KV_ACC];
#pragma GCC unroll 8
    for (int i = 0; i < NH; i++) {
        if (corr) {
            const vf cr = vf_set1(corr[i]);
#pragma GCC unroll 16
            for (int u = 0; u < CG; u++)
                x[i * CG + u] = vf_mul(vf_load(acc + i * Dp + c + u * KV_W), cr);
        } else {
#pragma GCC unroll 16
            for (int u = 0; u < CG; u++)
                x[i * CG + u] = vf_load(acc + i * Dp + c + u * KV_W);
        }
    }
    for (int j = 0; j < KV_B; j++) {
        if (slot + j < nl)
            __builtin_prefetch(pl + (slot + j) * 64, 0, 3);
        vf w[KV_GS];
#pragma GCC unroll 8
        for (int i = 0; i < NH; i++)
            w[i] = vf_set1(pw[i * ws + j]);
        if (mode == KV_ROWS_I4 && CG * KV_W >= KV_I8_BLOCK) {   /* whole blocks (c is a multiple of CG vectors): */
            enum { HALF = KV_I4_BLOCK_BYTES / KV_W };          /* pairs from one load, vectors c and c + 16 */
            vf vc[32], wb[32];   /* wb: one head's weight times each vector's block scale */
#pragma GCC unroll 16
            for (int u = 0; u < CG; u++)
                if (u % (2 * HALF) < HALF) {
                    const int64_t si = j * kv_i8_blocks(vs) + kv_blk(c + u * KV_W);
                    if (NH == 1) {   /* one head: the block's scale folded into its weight (KV_ROWS_I8 below) */
                        vf_load_i4_pair(kv_i4_at(vb, j * vs + c + u * KV_W), &vc[u], &vc[u + HALF]);
                        wb[u] = wb[u + HALF] = vf_mul(w[0], vf_set1(vsc[si]));
                    } else {
                        kv_load_row_i4_pair(vb, j * vs + c + u * KV_W, vsc, si, &vc[u], &vc[u + HALF]);
                    }
                }
#pragma GCC unroll 16
            for (int u = 0; u < CG; u++)
#pragma GCC unroll 8
                for (int i = 0; i < NH; i++)
                    x[i * CG + u] = vf_fmadd(NH == 1 ? wb[u] : w[i], vc[u], x[i * CG + u]);
            continue;
        }
        enum { VPB = KV_I8_BLOCK / KV_W };   /* vectors per int8 block */
        if (VPB <= KV_ACC /* not the scalar row */ && mode == KV_ROWS_I8 && NH == 1 && CG % VPB == 0 && c % KV_I8_BLOCK == 0) {
            /* one head: the block's scale folded into its weight once, not times each of its VPB
               vectors (MHA 32/32/128 int8 beyond the LLC, bench/kernel_ab.py, 1 thread: 0.96x the
               time on avx512, 0.90x on avx2; int4 0.96x / 0.99x; 2 heads took 1.03x: not for them) */
#pragma GCC unroll 16
            for (int u0 = 0; u0 < CG; u0 += VPB) {
                const vf wsc = vf_mul(w[0], vf_set1(vsc[j * kv_i8_blocks(vs) + kv_blk(c + u0 * KV_W)]));
#pragma GCC unroll 16
                for (int u = u0; u < u0 + VPB; u++)
                    x[u] = vf_fmadd(wsc, vf_load_i8((const int8_t *)vb + j * vs + c + u * KV_W), x[u]);
            }
            continue;
        }
#pragma GCC unroll 16
        for (int u = 0; u < CG; u++) {
            const vf vc = kv_load_row(vb, mode, j * vs + c + u * KV_W, vsc,
                                      j * kv_i8_blocks(vs) + kv_blk(c + u * KV_W));
#pragma GCC unroll 8
            for (int i = 0; i < NH; i++)
                x[i * CG + u] = vf_fmadd(w[i], vc, x[i * CG + u]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NH; i++)
#pragma GCC unroll 16
        for (int u = 0; u < CG; u++)
            vf_store(acc + i * Dp + c + u * KV_W, x[i * CG + u]);
}

/* acc_i = acc_i * corr_i (corr NULL: acc_i) + sum_j p_ij v_j for NH heads (acc rows of stride Dp); p_ij is
 * w[i * ws + j], broadcast straight from memory.  Column groups of CG vectors (about KV_ACC
 * accumulators), then the columns left in groups of CG / 2, CG / 4, .. 1 (a power-of-two split:
 * each group size at most once), so that even a head dim below CG vectors keeps independent FMA
 * chains (MHA on avx512, CG = 16 > D / 16: one chain per column was 4x slower in the L2). */
KV_AINLINE void kv_accumulate(float *acc, const float *corr, const float *pw, int64_t ws, const void *vb, int mode,
                              int64_t vs, const float *vsc, int64_t Dp, const int NH, const char *pf, size_t pf_row)
{
    const int CG = KV_POW2_FLOOR(KV_ACC / NH);
    /* the block kv_pf_distance ahead, spread over the row steps of the column groups (as in scores) */
    const char *pl = pf ? kv_line_floor(pf) : NULL;
    const int64_t nl = pf ? kv_lines(pl, pf + (size_t)KV_B * pf_row) : 0;
    int64_t c = 0, slot = 0;
    for (; c + CG * KV_W <= Dp; c += CG * KV_W, slot += KV_B)
        kv_accumulate_cols(acc, corr, pw, ws, vb, mode, vs, vsc, Dp, NH, c, CG, pl, nl, slot);
#define KV_AC_REST(n) if (n < CG && c + n * KV_W <= Dp) {                                                   \
        kv_accumulate_cols(acc, corr, pw, ws, vb, mode, vs, vsc, Dp, NH, c, n < CG ? n : 1, pl, nl, slot); \
        c += n * KV_W;                                                                                       \
        slot += KV_B;                                                                                        \
    }
    KV_AC_REST(8) KV_AC_REST(4) KV_AC_REST(2) KV_AC_REST(1)
#undef KV_AC_REST
    for (int64_t m = slot; m < nl; m++)   /* lines beyond one per row step */
        __builtin_prefetch(pl + m * 64, 0, 3);
}

_Static_assert(KV_POW2_FLOOR(KV_ACC) <= 16, "kv_accumulate splits what is left of a head dim in groups of 8, 4, 2, 1");

/* Instantiate the two helpers for a compile-time head count and row mode (int8 rows: ks / vs is
   D, the row length, int4 rows kv_row_values; ksc / vsc the block scales of the block's first row). */
#define KV_CASE_SC(n) case n: if (mode == KV_ROWS_F16) { kv_scores(q, kb, KV_ROWS_F16, ks, ksc, Dp, red, n, pf, pf_row, s, ss); } \
                              else if (mode == KV_ROWS_I8) { kv_scores(q, kb, KV_ROWS_I8, ks, ksc, Dp, red, n, pf, pf_row, s, ss); } \
                              else if (mode == KV_ROWS_I4) { kv_scores(q, kb, KV_ROWS_I4, ks, ksc, Dp, red, n, pf, pf_row, s, ss); } \
                              else { kv_scores(q, kb, KV_ROWS_F32, ks, ksc, Dp, red, n, pf, pf_row, s, ss); } break;
#define KV_CASE_AC(n) case n: if (mode == KV_ROWS_F16) { kv_accumulate(acc, corr, pw, ws, vb, KV_ROWS_F16, vs, vsc, Dp, n, pf, pf_row); } \
                              else if (mode == KV_ROWS_I8) { kv_accumulate(acc, corr, pw, ws, vb, KV_ROWS_I8, vs, vsc, Dp, n, pf, pf_row); } \
                              else if (mode == KV_ROWS_I4) { kv_accumulate(acc, corr, pw, ws, vb, KV_ROWS_I4, vs, vsc, Dp, n, pf, pf_row); } \
                              else { kv_accumulate(acc, corr, pw, ws, vb, KV_ROWS_F32, vs, vsc, Dp, n, pf, pf_row); } break;

/* switch (nh) over CASE(1) .. CASE(KV_GS): each head count a function of its own */
#if KV_GS > 4
#define KV_NH_SWITCH(nh, CASE) switch (nh) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) default: break; }
#else
#define KV_NH_SWITCH(nh, CASE) switch (nh) { CASE(1) CASE(2) CASE(3) CASE(4) default: break; }
#endif
_Static_assert(KV_GS == 4 || KV_GS == 8, "KV_NH_SWITCH instantiates 4 or 8 head counts");

static void KV_FN(scores_n)(const float *q, const void *kb, int mode, int64_t ks, const float *ksc, int64_t Dp, vf *red,
                            int nh, const char *pf, size_t pf_row, float *s, int64_t ss)
{
    KV_NH_SWITCH(nh, KV_CASE_SC)
}

#ifndef KV_INT_DOT
#define KV_INT_DOT 0   /* the rows that score full blocks of int8 keys with integer dot products */
#endif
#define KV_KDOT_OFF 128   /* kv_scores_i8 reads key k as the unsigned byte k + 128 (VPDPBUSD's operand) */
#if KV_INT_DOT
/* kv_scores_i8's key tile: KV_KL keys on the lanes (the row's vec header may give 16; else the
   8-lane forms, v8_x86.h / vec_scalar.h) */
#ifndef KV_KL
#define KV_KL 8
typedef v8b vkb;
typedef v8i vki;
typedef v8f vkf;
static inline void vkb_rows(vkb r[8], const uint8_t *p, int64_t stride)
{
    for (int l = 0; l < 8; l++)
        r[l] = v8b_load(p + l * stride);
}
#define vkb_transpose8 v8b_transpose8
#define vkb_flip v8b_flip
#define vkb_bcast4 v8b_bcast4
#define vki_set1 v8i_set1
#define vki_load v8i_load
#define vkb_load v8b_load
#define vkf_load v8f_load
#ifndef KV_HAVE_VKI_DOT
#define vki_dot v8i_dot
#endif
#define vkf_from v8f_from
#define vkf_set1 v8f_set1
#define vkf_zero v8f_zero
#define vkf_mul v8f_mul
#define vkf_fmadd v8f_fmadd
#define vkf_store v8f_store
#define vkf_cols v8f_cols
#endif
_Static_assert(KV_B % KV_KL == 0, "kv_scores_i8 takes a block's keys KV_KL at a time");
/* kv_scores_i8's query operand for values e..e+3 (q8 + e: the int8 values; q16 + e: round_query's
   int16 copy) and its dot product with a key tile: the 4 bytes in every lane (VPDPBUSD), unless
   the row's vec header has its own (vec_avx2.h: int16 pairs for VPMADDWD) */
#ifndef KV_HAVE_VKQ
typedef vkb vkq;
static inline vkq vkq_bcast(const int8_t *q8, const int16_t *q16)
{
    (void)q16;
    return vkb_bcast4(q8);
}
#define vki_dotq vki_dot
#endif

/* The KV_B scores of NH query vectors rounded to int8 (round_query: vector i's at qi + i * QF) with
 * the full block of int8 keys at kb (rows of D values, D a multiple of 32; ksc: the block scales
 * of its first row, D / 32 per row), into s + i * ss.  Per KV_KL keys and 32-value block: the keys'
 * bytes transposed so that lane l holds 4 values of key l, each made unsigned (k + 128); per query
 * vector 8 integer dot products of 4 values per lane from its offset -128 sum(q), exact in int32
 * (|sum| <= 32 x 127 x 127 < 2^24, so the conversion is exact too), then times the product of
 * the vector's step (times the softmax scale) and the keys' block scales, added to the score (the
 * product first: the sum times the step alone can pass float32's range where the score does not).  No horizontal sums:
 * the scores land on the lanes.  Prefetches the block at pf (rows pf_row bytes) spread over the
 * work. */
KV_AINLINE void kv_scores_i8(const float *qi, int64_t QF, const int8_t *kb, const float *ksc, int64_t D, const int NH,
                             const char *pf, size_t pf_row, float *s, int64_t ss)
{
    const int64_t nb = D / KV_I8_BLOCK;
    const int64_t qoff = 2 * nb;   /* the int8 values of a rounded query, in floats from its start */
    const int64_t q16off = kv_qint_q16(D);   /* their int16 copy */
    for (int j0 = 0; j0 < KV_B; j0 += KV_KL) {
        const char *pl = pf ? kv_line_floor(pf + (size_t)j0 * pf_row) : NULL;
        const int64_t nl = pf ? kv_lines(pl, pf + (size_t)(j0 + KV_KL) * pf_row) : 0, per = (nl + nb - 1) / nb;
        vkf tot[KV_GS], ks[KV_MAX_HEAD_DIM / KV_I8_BLOCK];
#pragma GCC unroll 8
        for (int i = 0; i < NH; i++)
            tot[i] = vkf_zero();
        vkf_cols(ks, ksc + j0 * nb, nb);   /* ks[b]: the keys' scales of block b */
        for (int64_t b = 0; b < nb; b++) {
            for (int64_t m = b * per; m < nl && m < (b + 1) * per; m++)
                __builtin_prefetch(pl + m * 64, 0, 3);
            vkb r[8];
            vkb_rows(r, (const uint8_t *)kb + j0 * D + b * KV_I8_BLOCK, D);
            vkb_transpose8(r);
#pragma GCC unroll 8
            for (int d = 0; d < 8; d++)
                r[d] = vkb_flip(r[d]);
            vki acc[KV_GS];
#pragma GCC unroll 8
            for (int i = 0; i < NH; i++)
                acc[i] = vki_set1(((const int32_t *)(qi + i * QF + nb))[b]);
            /* each group of 4 values for every vector in turn: a row's halves of a key group
               (vec_avx2.h) live only while its vectors take them */
#pragma GCC unroll 8
            for (int d = 0; d < 8; d++)
#pragma GCC unroll 8
                for (int i = 0; i < NH; i++) {
                    const float *q = qi + i * QF;
                    const int64_t e = b * KV_I8_BLOCK + 4 * d;
                    acc[i] = vki_dotq(acc[i], r[d], vkq_bcast((const int8_t *)(q + qoff) + e, (const int16_t *)(q + q16off) + e));
                }
#pragma GCC unroll 8
            for (int i = 0; i < NH; i++)
                tot[i] = vkf_fmadd(vkf_from(acc[i]), vkf_mul(vkf_set1(qi[i * QF + b]), ks[b]), tot[i]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < NH; i++)
            vkf_store(s + i * ss + j0, tot[i]);
    }
}

/* Rows of int4 keys (kvsimd.h KV_I4, D a multiple of 32: whole blocks, rows back to back) as the
   int8 rows kv_scores_i8 and kv_lane_scores_i8 read: n rows at src into n rows of D values q in
   -8..7 at dst, the same block scales.  A 4-bit key is an int8 key with a narrower range, so both
   score it with the same exact integer dot products. */
#ifndef KV_HAVE_I4_UNPACK
static inline void kv_i4_unpack(int8_t *dst, const uint8_t *src, int64_t bytes)
{
    for (int64_t o = 0; o < bytes; o += KV_I4_BLOCK_BYTES)
        for (int e = 0; e < KV_I4_BLOCK_BYTES; e++) {
            dst[2 * o + e] = (int8_t)((src[o + e] & 15) - 8);
            dst[2 * o + KV_I4_BLOCK_BYTES + e] = (int8_t)((src[o + e] >> 4) - 8);
        }
}
#endif
KV_AINLINE const int8_t *kv_i4_rows_i8(int8_t *dst, const void *src, int64_t n, int64_t D)
{
    kv_i4_unpack(dst, (const uint8_t *)src, n * D / 2);
    return dst;
}

#define KV_CASE_SI(n) case n: kv_scores_i8(qi, QF, kb, ksc, D, n, pf, pf_row, s, ss); break;
static void KV_FN(scores_i8_n)(const float *qi, int64_t QF, const int8_t *kb, const float *ksc, int64_t D, int nh,
                               const char *pf, size_t pf_row, float *s, int64_t ss)
{
    KV_NH_SWITCH(nh, KV_CASE_SI)
}
#undef KV_CASE_SI
#endif

/* ---- Int8 / int4 values with integer products (VPDPWSSD; avx2: VPMADDWD and VPADDD) ----
 * A block of fp32 weights times int8 values costs one FMA per value and head, plus the value's
 * widening and scale.  With the weights rounded to int16, VPDPWSSD takes two keys per lane and
 * instruction, and the values are only sign-extended (once for all heads of the group).  Over a
 * span of S keys (whole blocks, at most KV_V_SPAN, inside one cell of the KV_V_SPAN grid) and per
 * query vector i and value block b (32 values), the weight of key j, p_ij s_jb (s_jb: the key's
 * scale of block b), is rounded to w_ijb = round(32766 (p_ij / P_i) (s_jb / A_b)), P_i = max_j p_ij,
 * A_b = max_j |s_jb|; the int32 sums of w_ijb q_jd (exact: |sum| <= 64 x 32767 x 128 < 2^31) times
 * (P_i / 32766) A_b are added to the fp32 accumulators.  Each weight is off by at most half a step,
 * (P_i / 32766) A_b / 2, plus the fp32 roundings of forming it: kvsimd/bounds.py attend_bound's
 * int16 term.  A_b by quotients (it may be subnormal), P_i by the factor 32766 / P_i where that
 * is finite (KV_W16_RCP_MIN), else by quotients too.  A NaN or infinite weight or scale in the span
 * makes its sums NaN, as fp32 products would. */
#if KV_INT_DOT && defined(KV_HAVE_DPWSSD)
#define KV_INT_V 1
#else
#define KV_INT_V 0
#endif
/* ... and on the lanes path, whose tile of 8 values is 4 of vw_pairs' lo half and 4 of its hi
   half: the rows of 16 lanes and 32 registers (KV_LJ 8; not avx2's 8 lanes and tiles of 4) */
#define KV_LANE_INT_V (KV_INT_V && KV_W == 16 && KV_VREGS >= 32)
/* the query-on-lanes path's fp32 tiles hold two head-dim elements per lane on the AVX-512 rows
   (kv_lane_scores with P = 2: fewer 512-bit loads per FMA) */
#ifndef KV_LANE_PAIRS
#define KV_LANE_PAIRS (KV_W == 16 && KV_VREGS >= 32)
#endif
#if KV_INT_V
/* The span's prefetch of the next span's rows goes to L2 (locality 1), not L1: a span ahead is 8 KiB
   of int8 head_dim 128, which in L1 evicted rows still to be read (Zen 4, G8 64/8/128 int8 beyond
   the LLC: 0.96x the time of an L1 prefetch of the span after next; int4 the same time) */
#ifndef KV_I16_LOC
#define KV_I16_LOC 1
#endif
#define KV_W16_TOP 32766.0f   /* the largest |w_ijb| (32767 less a step: the quotients' roundings never saturate) */
/* p_ij 32766 / P_i as p_ij times (32766 / P_i): one division per query vector and span rather than
   one per 16 weights, the same two roundings (bench/kernel_ab.py, Ice Lake, avx512, 1 thread, int8:
   MQA 32/1/128 0.96-0.98x the time, 64/1/64 0.93-0.95x, G8 64/8/128 0.97-0.98x).  Below
   KV_W16_RCP_MIN the factor could overflow, and such P_i take the quotient. */
#define KV_W16_RCP_MIN 0x1p-100f
/* weights x (at most P, per lane mv) as 32766 x / P: times rcp = 32766 / P, or with quot the quotient */
KV_AINLINE vf kv_w16_weight(vf x, vf mv, vf rcp, int quot)
{
    return quot ? vf_mul(vf_div(x, mv), vf_set1(KV_W16_TOP)) : vf_mul(x, rcp);
}
_Static_assert(KV_V_SPAN % KV_B == 0 && KV_V_SPAN % KV_W == 0 && KV_KL == KV_W && KV_I8_BLOCK % (2 * KV_W) == 0,
               "a span is whole blocks and vectors of keys; a value block is whole pairs of vectors");
/* the weights (int16) and the scales by block (floats) in the free K block, int4 rows unpacked in the V block */
_Static_assert(KV_GS * KV_V_SPAN * 2 + KV_V_SPAN * 4 <= KV_I8_BLOCK * KV_B * 4 && KV_V_SPAN <= 4 * KV_B,
               "the span's weights, scales and rows fit the workspace's [KV_B, Dp] blocks");

/* The value blocks' side of the rounding, for S keys (a multiple of KV_W) with block scales vsc (nb
   per key): A_b = max_j |s_jb| into amax[b] (NaN when a scale is NaN or infinite) and
   vn[b S + j] = s_jb / A_b. */
KV_AINLINE void kv_i16_scales(const float *vsc, int64_t nb, int64_t S, float *vn, float *amax)
{
    for (int64_t j0 = 0; j0 < S; j0 += KV_W) {   /* vn[b S + j] = s_jb */
        vkf cols[KV_MAX_HEAD_DIM / KV_I8_BLOCK];
        vkf_cols(cols, vsc + j0 * nb, nb);
        for (int64_t b = 0; b < nb; b++)
            vkf_store(vn + b * S + j0, cols[b]);
    }
    for (int64_t b = 0; b < nb; b++) {   /* A_b, and vn <- s_jb / A_b */
        float *x = vn + b * S;
        vf mx = vf_zero(), z = vf_zero();
        for (int64_t j = 0; j < S; j += KV_W) {
            const vf v = vf_load(x + j);
            mx = vf_max(mx, vf_max(v, vf_sub(vf_zero(), v)));
            z = vf_add(z, vf_mul(v, vf_zero()));   /* NaN when a scale is NaN or infinite */
        }
        const float a = vf_hmax(mx);
        const vf av = vf_set1(a > 0.0f ? a : 1.0f);
        amax[b] = a + vf_hsum(z);
        for (int64_t j = 0; j < S; j += KV_W)
            vf_store(x + j, vf_div(vf_load(x + j), av));
    }
}

/* acc_i = acc_i * corr_i (corr NULL: acc_i) + sum_j p_ij v_j for NH query vectors (weights
 * pw + i * ws, acc rows of stride Dp) over S int8 rows at vb (D values each, D a multiple of 32;
 * vsc: their block scales) as above.  w16: NH x D / 32 x S int16 of scratch; vn: D / 32 x S floats.
 * Prefetches the S rows at pf (rows pf_row bytes) into L2 (KV_I16_LOC), spread over the work. */
KV_AINLINE void kv_accumulate_i16(float *acc, const float *corr, const float *pw, int64_t ws, const int8_t *vb,
                                  const float *vsc, int64_t D, int64_t Dp, const int NH, int64_t S, int16_t *w16,
                                  float *vn, const char *pf, size_t pf_row)
{
    const int64_t nb = D / KV_I8_BLOCK;
    float amax[KV_MAX_HEAD_DIM / KV_I8_BLOCK], pstep[KV_GS];
    kv_i16_scales(vsc, nb, S, vn, amax);
#pragma GCC unroll 8
    for (int i = 0; i < NH; i++) {   /* P_i, and the weights w_ijb */
        const float *p = pw + i * ws;
        vf mx = vf_zero(), z = vf_zero();
        for (int64_t j = 0; j < S; j += KV_W) {
            const vf x = vf_load(p + j);
            mx = vf_max(mx, x);
            z = vf_add(z, vf_mul(x, vf_zero()));
        }
        const float m = vf_hmax(mx);
        const vf mv = vf_set1(m > 0.0f ? m : 1.0f), top = vf_set1(KV_W16_TOP), rcp = vf_div(top, mv);
        const int quot = !(m >= KV_W16_RCP_MIN);
        pstep[i] = m / KV_W16_TOP + vf_hsum(z);
        for (int64_t j = 0; j < S; j += KV_W) {
            const vf pn = kv_w16_weight(vf_load(p + j), mv, rcp, quot);
            for (int64_t b = 0; b < nb; b++)
                vf_store_i16(w16 + (i * nb + b) * S + j, vf_mul(pn, vf_load(vn + b * S + j)));
        }
    }
    kv_pf pc = {NULL, NULL, 0};
    if (pf)
        pc = kv_pf_over(pf, pf + (size_t)S * pf_row, nb * S / 2);
    for (int64_t c = 0; c < D; c += 2 * KV_W) {   /* values c..c + 2 KV_W - 1 (all of a block on the AVX-512 rows) */
        const int64_t b = c / KV_I8_BLOCK;
        vw lo[KV_GS], hi[KV_GS];
#pragma GCC unroll 8
        for (int i = 0; i < NH; i++)
            lo[i] = hi[i] = vw_zero();
        const int8_t *r = vb + c;
        const int16_t *w = w16 + b * S;
        for (int64_t j = 0; j < S; j += 2) {
            if (pc.p < pc.end) {   /* one line per pair step until done: S int8 rows of D bytes are nb * S / 2 lines */
                __builtin_prefetch(pc.p, 0, KV_I16_LOC);
                pc.p += 64;
            }
            vw x0, x1;
            vw_pairs(r + j * D, r + (j + 1) * D, &x0, &x1);
#pragma GCC unroll 8
            for (int i = 0; i < NH; i++) {
                lo[i] = vw_dot(lo[i], x0, w + i * nb * S + j);
                hi[i] = vw_dot(hi[i], x1, w + i * nb * S + j);
            }
        }
        const vf ab = vf_set1(amax[b]);
#pragma GCC unroll 8
        for (int i = 0; i < NH; i++) {
            vf f0, f1;
            vw_cols(lo[i], hi[i], &f0, &f1);
            float *o = acc + i * Dp + c;
            vf a0 = vf_load(o), a1 = vf_load(o + KV_W);
            if (corr) {
                a0 = vf_mul(a0, vf_set1(corr[i]));
                a1 = vf_mul(a1, vf_set1(corr[i]));
            }
            const vf ps = vf_set1(pstep[i]);
            vf_store(o, vf_fmadd(vf_mul(f0, ps), ab, a0));
            vf_store(o + KV_W, vf_fmadd(vf_mul(f1, ps), ab, a1));
        }
    }
    kv_pf_finish(&pc);
}

#define KV_CASE_AI(n) case n: kv_accumulate_i16(acc, corr, pw, ws, vb, vsc, D, Dp, n, S, w16, vn, pf, pf_row); break;
static void KV_FN(accumulate_i16_n)(float *acc, const float *corr, const float *pw, int64_t ws, const int8_t *vb,
                                    const float *vsc, int64_t D, int64_t Dp, int nh, int64_t S, int16_t *w16, float *vn,
                                    const char *pf, size_t pf_row)
{
    KV_NH_SWITCH(nh, KV_CASE_AI)
}
#undef KV_CASE_AI
#endif

static void KV_FN(accumulate_n)(float *acc, const float *corr, const float *pw, int64_t ws, const void *vb, int mode,
                                int64_t vs, const float *vsc, int64_t Dp, int nh, const char *pf, size_t pf_row)
{
    KV_NH_SWITCH(nh, KV_CASE_AC)
}

_Static_assert(KV_I8_BLOCK % KV_W == 0, "an int8 block must hold whole vectors");

/* Copy rows t..t+nb-1 of one head into a zero-padded fp32 [KV_B, Dp] block: fp16 widened, int8
   widened and times its block's scale (one fp32 rounding: the value q * scale; a vector of KV_W
   values never straddles two blocks, KV_W dividing KV_I8_BLOCK). */
static void KV_FN(load_block)(float *dst, const void *src, const float *scale, int32_t dtype, int64_t t, int64_t nb,
                              int64_t D, int64_t Dp)
{
    for (int64_t j = 0; j < KV_B; j++) {
        float *row = dst + j * Dp;
        if (j >= nb) {
            for (int64_t c = 0; c < Dp; c += KV_W)
                vf_store(row + c, vf_zero());
            continue;
        }
        int64_t c = 0;
        if (dtype == KV_F16) {
            const uint16_t *s = (const uint16_t *)src + (t + j) * D;
            for (; c + KV_W <= D; c += KV_W)
                vf_store(row + c, vf_load_h(s + c));
            if (c < D)
                vf_store(row + c, vf_load_h_part(s + c, D - c));
        } else if (dtype == KV_I4) {   /* whole blocks, zero-padded: Dp values are there */
            const int64_t S = kv_row_values(KV_I4, D);
            const float *f = scale + (t + j) * kv_i8_blocks(D);
            for (; c < Dp; c += KV_W) {   /* c and c + 16 from one load (kv_load_row_i4_pair) */
                if (!kv_i4_low(c))
                    continue;
                vf lo, hi;
                kv_load_row_i4_pair(src, (t + j) * S + c, f, kv_blk(c), &lo, &hi);
                vf_store(row + c, lo);
                if (c + KV_I4_BLOCK_BYTES < Dp)
                    vf_store(row + c + KV_I4_BLOCK_BYTES, hi);
            }
        } else if (dtype == KV_I8) {
            const int8_t *s = (const int8_t *)src + (t + j) * D;
            const float *f = scale + (t + j) * kv_i8_blocks(D);
            for (; c + KV_W <= D; c += KV_W)
                vf_store(row + c, vf_mul(vf_load_i8(s + c), vf_set1(f[kv_blk(c)])));
            if (c < D)
                vf_store(row + c, vf_mul(vf_load_i8_part(s + c, D - c), vf_set1(f[kv_blk(c)])));
        } else {
            const float *s = (const float *)src + (t + j) * D;
            for (; c + KV_W <= D; c += KV_W)
                vf_store(row + c, vf_load(s + c));
            if (c < D)
                vf_store(row + c, vf_load_part(s + c, D - c));
        }
    }
}

/* The KV_B rows t.. of one head: in place when the block is full and needs no padding (fp16 and
   int8 / int4 are widened in registers later; *rsc: their block scales of row t), else a zero-padded fp32
   copy in buf. */
static inline const void *KV_FN(block_rows)(const char *base, const float *scale, float *buf, int32_t dtype, int64_t t,
                                            int64_t nb, int64_t D, int64_t Dp, int aligned, int64_t *stride, int *rmode,
                                            const float **rsc)
{
    *rsc = NULL;
    if (aligned && nb == KV_B) {
        *stride = kv_row_values((kv_dtype)dtype, D);
        *rmode = dtype == KV_F16 ? KV_ROWS_F16 : dtype == KV_I8 ? KV_ROWS_I8 : dtype == KV_I4 ? KV_ROWS_I4 : KV_ROWS_F32;
        if (kv_dtype_scaled((kv_dtype)dtype))
            *rsc = scale + t * kv_i8_blocks(D);
        return base + (size_t)t * kv_row_bytes((kv_dtype)dtype, D);
    }
    KV_FN(load_block)(buf, base, scale, dtype, t, nb, D, Dp);
    *stride = Dp;
    *rmode = KV_ROWS_F32;
    return buf;
}

/* One call's view of its workspace and of the KV head and row tile being computed.  Every
   array starts on a 64-byte boundary (offsets are multiples of 16 floats).  Query vector i is
   head h0 + i % G of row r0 + i / G. */
typedef struct KV_FN(attn_state) {
    const kv_attn_params *p;
    int64_t D, Dp, G, N;
    int64_t MQ;             /* query vectors the workspace holds: G x kv_attn_row_tile(G) */
    int64_t MQp;            /* MQ rounded up to 16: the size of every per-vector array */
    int64_t M;              /* query vectors of the current tile */
    int64_t MP;             /* lanes path: stride of its [., MP] arrays, the tile's M rounded up to KV_W */
    int64_t lo_max, hi_min; /* lanes path: the keys every vector of the tile sees */
    size_t krb, vrb;        /* kv_row_bytes of the K and V dtypes */
    int64_t kpf, vpf;       /* prefetch distances in bytes of K and V rows (kv_ahead) */
    int aligned;            /* D % KV_W == 0: full blocks are read in place */
    float *qbuf;            /* [MQ, KV_KP Dp] scaled queries (store_query) */
    float *qalt;            /* [MQ, KV_KP Dp] scaled q_alt */
    float *acc;             /* [MQ, Dp] running outputs */
    float *kblk, *vblk;     /* [KV_B, Dp] zero-padded blocks (tails only), one after the other */
    float *xblk;            /* [2 KV_B, Dp] after them: lane_accum_i16's value pairs */
    vf *red;                /* [KV_GS, KV_B] partial dot products */
    float *sc;              /* [MQ, KV_CHUNK] scores, then weights */
    float *m, *l;           /* [MQp] running max and sum of exp of the softmax */
    float *lo, *hi;         /* lanes path [MP]: each vector's first and end key (floats) */
    float *rowv, *slope;    /* lanes path [MP]: each vector's row (r0 + i / G) and ALiBi slope */
    float *qi, *qia;        /* [MQp, QF] the queries of qbuf / qalt rounded for int8 / int4 keys (round_query) */
    int64_t QF;             /* kv_qint_floats(Dp) */
    int qround;             /* int8 or int4 keys: queries are rounded (round_query) */
    int qint;               /* ... and full blocks are scored with integer dot products (kv_scores_i8) */
    int lqint;              /* ... and so are the lanes path's blocks (kv_lane_scores_i8) */
    int vint;               /* int8 or int4 values, D a multiple of 32: full spans take kv_accumulate_i16 */
    int lvint;              /* ... and on the lanes path, with MP <= KV_QVECS: full blocks take lane_accum_i16 */
    int lpk, lpv;           /* lanes path: fp32 scores (not lqint) / outputs (not lvint) in the pair layout (KV_LANE_PAIRS) */
    float *pbuf;            /* [2 KV_B, 2 MQp] the pair layout's partial scores, then its duplicated weights */
    float corr[KV_MAX_WIDTH > KV_GS ? KV_MAX_WIDTH : KV_GS];  /* this chunk's rescale, first group */
    int64_t g, h0;          /* the KV head, its first query head */
    int64_t r0;             /* the tile's first row */
    const char *kbase, *vbase;
    const float *kscale, *vscale;   /* KV_I8, KV_I4: head g's block scales; else NULL */
} KV_FN(attn_state);

KV_AINLINE void KV_FN(attn_setup)(KV_FN(attn_state) *st, const kv_attn_params *p, void *workspace)
{
    st->p = p;
    st->D = p->D;
    st->G = p->H / p->Hkv;
    st->MQ = st->G * kv_attn_row_tile(st->G);
    st->MQp = (st->MQ + 15) / 16 * 16;
    st->MP = (st->MQ + KV_W - 1) / KV_W * KV_W;
    st->N = p->n_total;
    st->Dp = (st->D + KV_W - 1) / KV_W * KV_W;
    st->krb = kv_row_bytes((kv_dtype)p->dtype, st->D);
    st->vrb = kv_row_bytes((kv_dtype)p->v_dtype, st->D);
    const int64_t pfv = p->pf_values > 0 ? p->pf_values : KV_PF_VALUES;
    st->kpf = kv_pf_distance(st->D, st->krb, pfv);
    st->vpf = kv_pf_distance(st->D, st->vrb, pfv);
    /* Full blocks are read straight from the cache (fp16 and int8 widened in registers); a
       partial last block, or a head_dim that is not a multiple of KV_W, goes through a zero-padded
       fp32 copy so that the inner loops never have tails. */
    st->aligned = (st->D % KV_W) == 0;
    /* the layout kv_attn_workspace_bytes sizes (ops.c); the lanes path keeps its [Dp, MP] and
       [KV_CHUNK, MP] arrays where the other keeps [MQ, Dp] and [MQ, KV_CHUNK] ones */
    const int64_t MQp = st->MQp, Dp = st->Dp;
    st->qbuf = (float *)workspace;
    st->qalt = st->qbuf + MQp * KV_KP * Dp;
    st->acc = st->qalt + MQp * KV_KP * Dp;
    st->kblk = st->acc + MQp * Dp;
    st->vblk = st->kblk + KV_B * Dp;
    st->xblk = st->vblk + KV_B * Dp;
    st->red = (vf *)(st->xblk + 2 * KV_B * Dp);
    st->sc = (float *)(st->red + KV_GS * KV_B);
    st->m = st->sc + MQp * KV_CHUNK;
    st->l = st->m + MQp;
    st->lo = st->l + MQp;
    st->hi = st->lo + MQp;
    st->rowv = st->hi + MQp;
    st->slope = st->rowv + MQp;
    st->QF = kv_qint_floats(Dp);
    st->qi = st->slope + MQp;
    st->qia = st->qi + MQp * st->QF;
    st->pbuf = st->qia + MQp * st->QF;
    st->qround = p->dtype == KV_I8 || p->dtype == KV_I4;
    /* whole blocks: int8 rows are read in place, int4 ones unpacked to int8 rows (kv_i4_rows_i8) */
    st->qint = KV_INT_DOT && st->qround && st->D % KV_I8_BLOCK == 0;
#if KV_INT_DOT
    st->lqint = st->qint && KV_W % KV_KL == 0;   /* whole KV_KL-lane vectors in every vector of query lanes */
#else
    st->lqint = 0;
#endif
    /* int8 / int4 values, whole blocks: integer products with int16 weights (kv_accumulate_i16) */
    st->vint = KV_INT_V && (p->v_dtype == KV_I8 || p->v_dtype == KV_I4) && st->D % KV_I8_BLOCK == 0;
    st->lvint = KV_LANE_INT_V && st->vint && st->MP <= KV_QVECS;
    st->lpk = KV_LANE_PAIRS && !st->lqint;
    st->lpv = KV_LANE_PAIRS && !st->lvint;
}

/* The state's KV head g (its K/V rows and int8 block scales) and rows r0..r1-1 (both paths). */
KV_AINLINE void KV_FN(attn_bind)(KV_FN(attn_state) *st, int64_t g, int64_t r0, int64_t r1)
{
    const kv_attn_params *p = st->p;
    st->g = g;
    st->h0 = g * st->G;
    st->r0 = r0;
    st->M = (r1 - r0) * st->G;
    st->kbase = (const char *)p->k + (size_t)(g * st->N) * st->krb;
    st->vbase = (const char *)p->v + (size_t)(g * st->N) * st->vrb;
    st->kscale = kv_dtype_scaled((kv_dtype)p->dtype) ? p->k_scale + g * st->N * kv_i8_blocks(st->D) : NULL;
    st->vscale = kv_dtype_scaled((kv_dtype)p->v_dtype) ? p->v_scale + g * st->N * kv_i8_blocks(st->D) : NULL;
}

/* Keys row r may read: [*lo, *hi) (the whole int64 range when uncut). */
KV_AINLINE void KV_FN(attn_row_keys)(const kv_attn_params *p, int64_t r, int64_t *lo, int64_t *hi)
{
    *hi = p->causal_end > 0 ? p->causal_end - p->key_base + r : INT64_MAX;
    *lo = p->causal_end > 0 && p->window > 0 ? p->causal_end - p->key_base + r - p->window : INT64_MIN;
}

/* The query over int8 (or int4) keys is rounded as the cache rounds an int8 key row
 * (kv_quantize_rows: per block of 32 values, step = max |x| / 127, q = x / step to nearest, ties
 * to even; step NaN and q 0 when a value is NaN or infinite), so that full blocks of keys are scored with exact integer dot
 * products (kv_scores_i8); every path then reads that same query.  x: Dp floats (0 past D), in
 * place: x <- q * (step * scale); qi (kv_qint_floats(Dp) floats): per block step * scale and
 * -KV_KDOT_OFF * sum(q) (what the unsigned keys of kv_scores_i8 add), then the Dp int8 q, then
 * the same q as int16 (kv_qint_q16: each group of 4 as q0 q2 q1 q3, vec_avx2.h's vkq_bcast). */
KV_AINLINE void KV_FN(round_query)(float *x, int64_t Dp, float scale, float *qi)
{
    const int64_t nb = kv_i8_blocks(Dp);
    float *stp = qi;
    int32_t *off = (int32_t *)(qi + nb);
    int8_t *q8 = (int8_t *)(qi + 2 * nb);
    int16_t *q16 = (int16_t *)(qi + kv_qint_q16(Dp));
    for (int64_t d0 = 0, b = 0; d0 < Dp; d0 += KV_I8_BLOCK, b++) {
        const int64_t d1 = d0 + KV_I8_BLOCK < Dp ? d0 + KV_I8_BLOCK : Dp;
        vf mx = vf_zero(), z = vf_zero();
        for (int64_t c = d0; c < d1; c += KV_W) {
            const vf v = vf_load(x + c);
            mx = vf_max(mx, vf_max(v, vf_sub(vf_zero(), v)));
            z = vf_add(z, vf_mul(v, vf_zero()));   /* NaN when a value is NaN or infinite */
        }
        const float zs = vf_hsum(z);
        const float step = zs == zs ? vf_hmax(mx) / 127.0f : __builtin_nanf("");
        const float ss = step * scale;
        int32_t sum = 0;
        for (int64_t c = d0; c < d1; c += KV_W) {
            vf r = step > 0.0f ? vf_round(vf_div(vf_load(x + c), vf_set1(step))) : vf_zero();
            r = vf_min(vf_set1(127.0f), vf_max(vf_set1(-127.0f), r));
            vf_store(x + c, r);
            for (int64_t e = c; e < c + KV_W; e++) {
                q8[e] = (int8_t)x[e];
                q16[e - e % 4 + (e % 2) * 2 + (e % 4) / 2] = q8[e];   /* q0 q2 q1 q3 */
                sum += q8[e];
            }
            vf_store(x + c, vf_mul(r, vf_set1(ss)));
        }
        stp[b] = ss;
        off[b] = -KV_KDOT_OFF * sum;
    }
}

/* The query x (D floats) times scale, into the workspace row dst as the scores loop reads it:
   KV_KW elements at a time, each step's once for every key of a vector (KV_KP copies side by
   side), zero past D; rounded first when qi is not NULL (round_query).  tmp: Dp floats of
   scratch. */
KV_AINLINE void KV_FN(store_query)(float *dst, const float *x, float scale, int64_t D, int64_t Dp, float *tmp, float *qi)
{
    const vf scv = vf_set1(qi ? 1.0f : scale);
    float *row = KV_KP == 1 ? dst : tmp;
    int64_t c = 0;
    for (; c + KV_W <= D; c += KV_W)
        vf_store(row + c, vf_mul(vf_load(x + c), scv));
    if (c < D)
        vf_store(row + c, vf_mul(vf_load_part(x + c, D - c), scv));
    if (qi)
        KV_FN(round_query)(row, Dp, scale, qi);
#if KV_KP > 1
    for (c = 0; c < Dp; c += KV_KW)
        vf_store(dst + KV_KP * c, vf_load_dup(tmp + c));
#else
    (void)Dp;
#endif
}

/* Start KV head g for rows r0..r1-1: their scaled queries (and q_alt) in the workspace, a fresh
   softmax state. */
KV_AINLINE void KV_FN(attn_head_start)(KV_FN(attn_state) *st, int64_t g, int64_t r0, int64_t r1)
{
    const kv_attn_params *p = st->p;
    const int64_t D = st->D, Dp = st->Dp, G = st->G, h0 = g * G;
    KV_FN(attn_bind)(st, g, r0, r1);
    for (int64_t i = 0; i < st->M; i++) {
        const int64_t at = (r0 + i / G) * p->q_stride + (h0 + i % G) * D;
        float *acc = st->acc + i * Dp;   /* also the scratch of store_query, zeroed after */
        KV_FN(store_query)(st->qbuf + i * KV_KP * Dp, p->q + at, p->scale, D, Dp, acc,
                           st->qround ? st->qi + i * st->QF : NULL);
        if (p->q_alt)
            KV_FN(store_query)(st->qalt + i * KV_KP * Dp, p->q_alt + at, p->scale, D, Dp, acc,
                               st->qround ? st->qia + i * st->QF : NULL);
        for (int64_t c = 0; c < Dp; c += KV_W)
            vf_store(acc + c, vf_zero());
        st->m[i] = KV_NEG_INF;
        st->l[i] = 0.0f;
    }
}

/* Pass 1 over the chunk c0..c1-1: the scores of every query vector (reading only K), soft cap
   and ALiBi included, into sc[i][t - c0]; padded rows of a short block score -inf.  The chunk's last
   block prefetches the start of V for pass 2.  query_pos: the range's ALiBi position of row 0. */
KV_AINLINE void KV_FN(attn_score_chunk)(KV_FN(attn_state) *st, const float *qs, const float *qi, int64_t c0,
                                        int64_t c1, int64_t query_pos)
{
    const kv_attn_params *p = st->p;
    const int64_t D = st->D, Dp = st->Dp, G = st->G, M = st->M;
    const char *kpf_next = st->vbase + (size_t)c0 * st->vrb;
    const int capped = p->softcap > 0.0f;
    const vf cap = vf_set1(p->softcap), inv_cap = vf_set1(capped ? 1.0f / p->softcap : 0.0f);
    (void)qi;
    for (int64_t t = c0, tn; t < c1; t = tn) {
        tn = kv_grid_end(t, KV_B, c1);
        const int64_t nb = tn - t;
        const char *kpf = kv_ahead(st->kbase, t, c1, st->krb, st->kpf, kpf_next);
        int64_t ks;
        int rmode;
        const float *ksc;
        const void *kb = KV_FN(block_rows)(st->kbase, st->kscale, st->kblk, p->dtype, t, nb, D, Dp, st->aligned, &ks, &rmode,
                                           &ksc);
#if KV_INT_DOT
        if (rmode == KV_ROWS_I4 && st->qint) {   /* as int8 rows (the buffer is free) */
            kb = kv_i4_rows_i8((int8_t *)st->kblk, kb, KV_B, D);
            rmode = KV_ROWS_I8;
            ks = D;
        }
#endif
        for (int64_t i0 = 0; i0 < M; i0 += KV_GS) {
            const int nh = (int)(M - i0 < KV_GS ? M - i0 : KV_GS);
#if KV_INT_DOT
            if (rmode == KV_ROWS_I8 && st->qint)
                KV_FN(scores_i8_n)(qi + i0 * st->QF, st->QF, (const int8_t *)kb, ksc, D, nh, i0 ? NULL : kpf, st->krb,
                                   st->sc + i0 * KV_CHUNK + (t - c0), KV_CHUNK);
            else
#endif
            KV_FN(scores_n)(qs + i0 * KV_KP * Dp, kb, rmode, ks, ksc, Dp, st->red, nh, i0 ? NULL : kpf, st->krb,
                            st->sc + i0 * KV_CHUNK + (t - c0), KV_CHUNK);
            for (int i = 0; i < nh; i++) {
                float *s = st->sc + (i0 + i) * KV_CHUNK + (t - c0);
                if (capped)   /* softcap * tanh(s / softcap); padded rows (0) become -inf below */
                    for (int jj = 0; jj < KV_B; jj += KV_W)
                        vf_store(s + jj, vf_mul(vf_tanh(vf_mul(vf_load(s + jj), inv_cap)), cap));
                for (int64_t j = nb; j < KV_B; j++)
                    s[j] = KV_NEG_INF;
                if (p->alibi) {
                    const int64_t v = i0 + i;
                    const float slope = p->alibi[st->h0 + v % G];
                    const int64_t qp = query_pos + st->r0 + v / G;
                    for (int64_t j = 0; j < nb; j++) {
                        const int64_t kp = p->key_pos ? p->key_pos[t + j] : t + j;
                        s[j] -= slope * (float)(qp - kp);
                    }
                }
            }
        }
    }
}

/* The online-softmax update, once per chunk c0.. and query vector: scores become weights
   exp(s - m_new), l and m are updated, and the accumulators' rescale exp(m_old - m_new) is
   left in corr (first KV_GS vectors: applied in pass 2) or applied here (the others).
   cn: tokens in the chunk; cpad: past the last block's padding.  Keys the vector's row does not
   see, and padded rows, get weight exactly 0; a vector that sees no key of the chunk keeps its
   state (weights 0, rescale 1). */
KV_AINLINE void KV_FN(attn_softmax_update)(KV_FN(attn_state) *st, int64_t c0, int64_t cn, int64_t cpad)
{
    const int64_t Dp = st->Dp, G = st->G;
    for (int64_t i = 0; i < st->M; i++) {
        float *s = st->sc + i * KV_CHUNK;
        float *m = st->m + i, *l = st->l + i;
        int64_t lo, hi;
        KV_FN(attn_row_keys)(st->p, st->r0 + i / G, &lo, &hi);
        const int64_t va = lo <= c0 ? 0 : lo - c0 < cn ? lo - c0 : cn;
        const int64_t vb = hi - c0 >= cn ? cn : hi <= c0 ? 0 : hi - c0;
        float cr = 1.0f;
        if (va >= vb) {   /* no key of this chunk */
            for (int64_t j = 0; j < cpad; j++)
                s[j] = 0.0f;
        } else {
            for (int64_t j = 0; j < va; j++)
                s[j] = KV_NEG_INF;
            for (int64_t j = vb; j < cpad; j++)
                s[j] = KV_NEG_INF;
            vf mx = vf_load(s);
            for (int64_t j = KV_W; j < cpad; j += KV_W)
                mx = vf_max(mx, vf_load(s + j));
            const float bmax = vf_hmax(mx);
            const float m_new = bmax > *m ? bmax : *m;
            const vf mv = vf_set1(m_new);
            vf sum = vf_zero();
            for (int64_t j = 0; j < cpad; j += KV_W) {
                const vf e = vf_exp(vf_sub(vf_load(s + j), mv));
                vf_store(s + j, e);
                sum = vf_add(sum, e);
            }
            float tail = 0.0f;  /* exp(-inf - m) is tiny, not 0: drop unseen and padded rows exactly */
            for (int64_t j = 0; j < va; j++) {
                tail += s[j];
                s[j] = 0.0f;
            }
            for (int64_t j = vb; j < cpad; j++) {
                tail += s[j];
                s[j] = 0.0f;
            }
            cr = KV_FN(expf1)(*m - m_new);
            *l = *l * cr + (vf_hsum(sum) - tail);
            *m = m_new;
        }
        if (i < KV_GS)
            st->corr[i] = cr;
        else if (cr != 1.0f)  /* vectors beyond the first group: rescale their accumulators here */
            for (int64_t c = 0; c < Dp; c += KV_W)
                vf_store(st->acc + i * Dp + c, vf_mul(vf_load(st->acc + i * Dp + c), vf_set1(cr)));
    }
}

/* Pass 2 over the chunk: acc += weights @ V (reading only V); the first block applies the
   rescale of the softmax update, the others none (corr NULL: no multiply by 1, 2.5% of a step
   for 8 query heads in the L2 on Zen 4).  next_k: the K rows read after this chunk (prefetched in
   its last block), or NULL.  (Runs of several blocks per pass, the accumulators loaded and
   stored once per run, measured +2% for 8 query heads in the LLC on Zen 4 and -10% for 4 heads
   beyond it on avx2: not kept.  Nor 8 heads as two groups of 4, whose tile is faster in L1
   (bench/fp16_widen_cost.py): 1.07x the time beyond the LLC on Zen 4.) */
KV_AINLINE void KV_FN(attn_accumulate_chunk)(KV_FN(attn_state) *st, int64_t c0, int64_t c1, const char *next_k)
{
    const kv_attn_params *p = st->p;
    const int64_t D = st->D, Dp = st->Dp, M = st->M;
    for (int64_t t = c0, tn; t < c1; t = tn) {
        tn = kv_grid_end(t, KV_B, c1);
        const int64_t nb = tn - t;
        const char *vpf = kv_ahead(st->vbase, t, c1, st->vrb, st->vpf, next_k);
#if KV_INT_V
        /* a span of whole blocks: int4 values from 2 query vectors on, int8 from 8 (one: memory-bound;
           int8 with 4 per KV head beyond the LLC took 1.0-1.12x the time of fp32, 8 0.82x, on Zen 4's
           avx512 row; avx2 on Zen 3, 32/8/128 at 32,768 keys: 1.12x) */
        if (st->vint && nb == KV_B && (M >= 8 || (M > 1 && p->v_dtype == KV_I4))) {
            tn = kv_grid_end(t, KV_V_SPAN, c1);
            tn = t + (tn - t) / KV_B * KV_B;
            const int8_t *vb = (const int8_t *)(st->vbase + (size_t)t * st->vrb);
            if (p->v_dtype == KV_I4)
                vb = kv_i4_rows_i8((int8_t *)st->vblk, vb, tn - t, D);
            const float *vsc = st->vscale + t * kv_i8_blocks(D);
            /* the next span's rows (of this chunk, else the next pass's first) over this one; the
               pass's first span also its own rows past the first block at once (pass 1's last block
               prefetched that one; nothing else would) */
            const char *span_pf = tn + (tn - t) <= c1 ? st->vbase + (size_t)tn * st->vrb : next_k;
            if (t == c0) {
                const char *own = st->vbase + (size_t)(t + KV_B) * st->vrb;
                kv_pf pc = kv_pf_over(own, own + (size_t)(tn - t - KV_B) * st->vrb, 1);
                kv_pf_finish(&pc);
            }
            int16_t *w16 = (int16_t *)st->kblk;   /* free in pass 2 */
            float *vn = (float *)(w16 + KV_GS * (D / KV_I8_BLOCK) * KV_V_SPAN);
            for (int64_t i0 = 0; i0 < M; i0 += KV_GS) {
                const int nh = (int)(M - i0 < KV_GS ? M - i0 : KV_GS);
                KV_FN(accumulate_i16_n)(st->acc + i0 * Dp, (t == c0 && i0 == 0) ? st->corr : NULL,
                                        st->sc + i0 * KV_CHUNK + (t - c0), KV_CHUNK, vb, vsc, D, Dp, nh, tn - t, w16, vn,
                                        i0 ? NULL : span_pf, st->vrb);
            }
            continue;
        }
#endif
        int64_t vs;
        int rmode;
        const float *vsc;
        const void *vb = KV_FN(block_rows)(st->vbase, st->vscale, st->vblk, p->v_dtype, t, nb, D, Dp, st->aligned, &vs, &rmode,
                                           &vsc);
        for (int64_t i0 = 0; i0 < M; i0 += KV_GS) {
            const int nh = (int)(M - i0 < KV_GS ? M - i0 : KV_GS);
            KV_FN(accumulate_n)(st->acc + i0 * Dp, (t == c0 && i0 == 0) ? st->corr : NULL,
                                st->sc + i0 * KV_CHUNK + (t - c0), KV_CHUNK, vb, rmode, vs, vsc, Dp, nh,
                                i0 ? NULL : vpf, st->vrb);
        }
    }
}

/* The K rows read after chunk c0..c1 of range ri (ending at e1): the next chunk, the next range
   or the next KV head's first range; NULL after the last (a prefetch hint only). */
KV_AINLINE const char *KV_FN(attn_next_k)(const KV_FN(attn_state) *st, int64_t ri, int64_t c1, int64_t e1, int64_t g1)
{
    const kv_attn_params *p = st->p;
    if (c1 < e1)
        return st->kbase + (size_t)c1 * st->krb;
    if (ri + 1 < p->n_ranges)
        return st->kbase + (size_t)p->ranges[ri + 1].t0 * st->krb;
    if (st->g + 1 < g1)
        return st->kbase + (size_t)(st->N + p->ranges[0].t0) * st->krb;
    return NULL;
}

/* What finalize multiplies vector i's sum by: 1 / l, or for a split-K piece 1 (the sum is
   written as it is) after storing (m, l) for the merge (kvsimd.h). */
KV_AINLINE float KV_FN(attn_part)(KV_FN(attn_state) *st, int64_t i, float m, float l)
{
    const kv_attn_params *p = st->p;
    if (!p->part_ml)
        return 1.0f / l;
    float *ml = p->part_ml + ((st->r0 + i / st->G) * p->H + st->h0 + i % st->G) * 2;
    ml[0] = m;
    ml[1] = l;
    return 1.0f;
}

/* out = acc / l for the query vectors of the current KV head and tile. */
KV_AINLINE void KV_FN(attn_finalize)(KV_FN(attn_state) *st)
{
    const kv_attn_params *p = st->p;
    const int64_t D = st->D, Dp = st->Dp, G = st->G;
    for (int64_t i = 0; i < st->M; i++) {
        float *o = p->out + (st->r0 + i / G) * p->out_stride + (st->h0 + i % G) * D;
        const vf inv = vf_set1(KV_FN(attn_part)(st, i, st->m[i], st->l[i]));
        int64_t c = 0;
        for (; c + KV_W <= D; c += KV_W)
            vf_store(o + c, vf_mul(vf_load(st->acc + i * Dp + c), inv));
        if (c < D)
            vf_store_part(o + c, vf_mul(vf_load(st->acc + i * Dp + c), inv), D - c);
    }
}

/* ---- The query-on-lanes path: tiles of many query vectors (prefill rows x group heads) ----
 * With M >= KV_LANES_MIN query vectors sharing one KV head, the tile is computed as two small
 * matrix products per block, with the query vectors on the lanes: queries transposed once per tile
 * (qT [D, MP]), each K and V row widened once per block into a fp32 buffer, and every element of it
 * broadcast against KV_LQ vectors of queries (scores) or of weights (outputs).  No horizontal sums;
 * the online softmax runs lane-wise (running max and sum per lane); keys a vector must not see are
 * -inf before the maximum and weigh exactly 0 after it.  Scores land in sc as [KV_CHUNK, MP]
 * (key-major), outputs accumulate in acc as [D, MP], and finalize transposes them back. */
/* Tiles of 2 x 8 (avx512) and 2 x 4 (avx2) against the 4 x 6 and 3 x 3 before, on Zen 4 (ops.attend,
   1 thread, fp16, best of 7): MQA decode 32/1/128 at 4096 keys +14% (avx512) and +18% (avx2: 4
   vectors of lanes, which 3 x 3 took as 3 + 1); prefill of 256 rows, SmolLM2 and 32/8/128, +7-8% on
   avx2 and the same speed on avx512. */
#if KV_VREGS >= 32
#define KV_LQ 2   /* vectors of query lanes per register tile */
#define KV_LJ 8   /* keys (scores) or head-dim elements (outputs) per register tile */
#elif KV_VREGS >= 16
#define KV_LQ 2
#define KV_LJ 4
#else
#define KV_LQ 4
#define KV_LJ 4
#endif
#ifndef KV_LANES_MIN
#define KV_LANES_MIN 32   /* query vectors of a tile from which the lanes path is taken */
#endif
#define KV_LANE_FAR 33554432.0f   /* 2^25: beyond every key index (< 2^24), exact in fp32 */

#ifndef KV_LANE_SB
#define KV_LANE_SB 16     /* head-dim elements per partial sum of a lanes score (see kv_lane_scores) */
#endif

/* The lanes path's register tiles, for one head-dim element per lane (P = 1: qT [D, MP], acc
   [D, MP]) and for the AVX-512 rows' pair layout (P = 2, KV_LANE_PAIRS: lane 2u + p holds element
   2e + p of query vector u; q2 and acc [Dh, 2 MP]).  A tile broadcasts P elements of a K or V row
   against NQ vectors of lanes (at most KV_LT_Q of them, by at most KV_LT_J keys or elements). */
#define KV_LT_Q 4
#define KV_LT_J 8
#if KV_LANE_PAIRS
#define kv_lane_bcast(p, P) ((P) == 2 ? vf_bcast2(p) : vf_set1(*(p)))
#else
#define kv_lane_bcast(p, P) vf_set1(*(p))
#endif

/* sT[j][u] = sum_d kb[j][d] q[d][u], keys j < NJ (kb rows of stride Dp), NQ vectors of lanes, q of
   stride S over n steps (elements; P = 2: element pairs).  Each score is the sum of partial FMA
   chains over SB steps, added in order into part (stride S; P = 1: sT itself): a chain of SB +
   n / SB roundings, as short as the one-vector path's lane chains and add tree (one chain over
   all of D rounded up to 8x more for D = 256 on avx2); with P = 2 the last partial's two lanes
   of each query vector are then added (vf_pair_sums) into sT (stride MP). */
KV_AINLINE void kv_lane_scores(const float *q, int64_t S, const float *kb, int64_t Dp, int64_t n, float *part,
                               float *sT, int64_t MP, kv_pf *pf, const int NQ, const int NJ, const int P, const int SB)
{
    vf a[KV_LT_J][KV_LT_Q];
    for (int64_t e0 = 0; e0 < n; e0 += SB) {
        kv_pf_step(pf);
        const int64_t e1 = n - e0 > SB ? e0 + SB : n;
#pragma GCC unroll 8
        for (int j = 0; j < NJ; j++)
#pragma GCC unroll 8
            for (int u = 0; u < NQ; u++)
                a[j][u] = vf_zero();
        for (int64_t e = e0; e < e1; e++) {
            vf qv[KV_LT_Q];
#pragma GCC unroll 8
            for (int u = 0; u < NQ; u++)
                qv[u] = vf_load(q + e * S + u * KV_W);
#pragma GCC unroll 8
            for (int j = 0; j < NJ; j++) {
                const vf b = kv_lane_bcast(kb + j * Dp + P * e, P);
#pragma GCC unroll 8
                for (int u = 0; u < NQ; u++)
                    a[j][u] = vf_fmadd(b, qv[u], a[j][u]);
            }
        }
        if (e0 > 0)
#pragma GCC unroll 8
            for (int j = 0; j < NJ; j++)
#pragma GCC unroll 8
                for (int u = 0; u < NQ; u++)
                    a[j][u] = vf_add(vf_load(part + j * S + u * KV_W), a[j][u]);
        if (P == 1 || e1 < n) {
#pragma GCC unroll 8
            for (int j = 0; j < NJ; j++)
#pragma GCC unroll 8
                for (int u = 0; u < NQ; u++)
                    vf_store(part + j * S + u * KV_W, a[j][u]);
        }
#if KV_LANE_PAIRS
        else {
#pragma GCC unroll 8
            for (int j = 0; j < NJ; j++)
#pragma GCC unroll 4
                for (int u = 0; u < NQ; u += 2)
                    vf_store(sT + j * MP + u / 2 * KV_W, vf_pair_sums(a[j][u], a[j][u + 1]));
        }
#else
        (void)sT, (void)MP;
#endif
    }
}

/* acc[e][u] += sum_j w[j][u] vb[j][P e ..] for NE elements (P = 2: element pairs; acc, vb from
   the first) and NQ vectors of lanes (acc and w of stride S), over the nb keys of a block. */
KV_AINLINE void kv_lane_accum(float *acc, int64_t S, const float *w, const float *vb, int64_t Dp, int64_t nb,
                              kv_pf *pf, const int NQ, const int NE, const int P)
{
    vf a[KV_LT_J][KV_LT_Q];
    kv_pf_step(pf);
#pragma GCC unroll 8
    for (int e = 0; e < NE; e++)
#pragma GCC unroll 8
        for (int u = 0; u < NQ; u++)
            a[e][u] = vf_load(acc + e * S + u * KV_W);
    for (int64_t j = 0; j < nb; j++) {
        vf wv[KV_LT_Q];
#pragma GCC unroll 8
        for (int u = 0; u < NQ; u++)
            wv[u] = vf_load(w + j * S + u * KV_W);
#pragma GCC unroll 8
        for (int e = 0; e < NE; e++) {
            const vf b = kv_lane_bcast(vb + j * Dp + P * e, P);
#pragma GCC unroll 8
            for (int u = 0; u < NQ; u++)
                a[e][u] = vf_fmadd(b, wv[u], a[e][u]);
        }
    }
#pragma GCC unroll 8
    for (int e = 0; e < NE; e++)
#pragma GCC unroll 8
        for (int u = 0; u < NQ; u++)
            vf_store(acc + e * S + u * KV_W, a[e][u]);
}
_Static_assert(KV_LQ <= KV_LT_Q && KV_LJ <= KV_LT_J, "the one-element tiles fit kv_lane_scores' arrays");

/* One block: scores of its KV_B keys (kb, zero-padded rows past the block's end) for nqv
   vectors of lanes, KV_LQ x KV_LJ at a time; a prefetch step per KV_LANE_SB elements of a tile. */
#define KV_LANE_SCORE_STEPS(nqv, D) \
    (((nqv) + KV_LQ - 1) / KV_LQ * ((KV_B + KV_LJ - 1) / KV_LJ) * (((D) + KV_LANE_SB - 1) / KV_LANE_SB))
#define KV_LS_Q(nq) { int j0 = 0;                                                                \
        for (; j0 + KV_LJ <= KV_B; j0 += KV_LJ)                                                  \
            kv_lane_scores(qT + u0 * KV_W, MP, kb + j0 * Dp, Dp, D, sT + j0 * MP + u0 * KV_W, NULL, MP, pf, nq, KV_LJ, 1, KV_LANE_SB); \
        if (KV_B % KV_LJ)                                                                        \
            kv_lane_scores(qT + u0 * KV_W, MP, kb + j0 * Dp, Dp, D, sT + j0 * MP + u0 * KV_W, NULL, MP, pf, nq, KV_B % KV_LJ, 1, KV_LANE_SB); }
static void KV_FN(lane_scores_block)(const float *qT, int64_t MP, const float *kb, int64_t Dp, int64_t D, float *sT,
                                     int64_t nqv, kv_pf *pf)
{
    int64_t u0 = 0;
    for (; u0 + KV_LQ <= nqv; u0 += KV_LQ)
        KV_LS_Q(KV_LQ)
    switch (nqv - u0) {
    case 1: KV_LS_Q(1) break;
#if KV_LQ > 2
    case 2: KV_LS_Q(2) break;
#endif
#if KV_LQ > 3
    case 3: KV_LS_Q(3) break;
#endif
    default: break;
    }
}
#undef KV_LS_Q

/* One block: accT += weights (pT, nb keys) @ V rows (vb), D elements and nqv vectors of lanes; a
   prefetch step per tile. */
#define KV_LANE_ACCUM_STEPS(nqv, D) (((nqv) + KV_LQ - 1) / KV_LQ * (((D) + KV_LJ - 1) / KV_LJ))
#define KV_LA_D(nq, nd) kv_lane_accum(accT + e0 * MP + u0 * KV_W, MP, pT + u0 * KV_W, vb + e0, Dp, nb, pf, nq, nd, 1)
/* The last tile of an outputs' pass: CALL(nq, n) for the n = left < NE (at most 7) elements left,
   with n a compile-time constant in every case */
#define KV_LANE_TAIL(left, CALL, nq, NE) switch (left) {                                         \
        case 1: CALL(nq, 1); break;                                                              \
        case 2: CALL(nq, 2 < (NE) ? 2 : 1); break;                                               \
        case 3: CALL(nq, 3 < (NE) ? 3 : 1); break;                                               \
        case 4: CALL(nq, 4 < (NE) ? 4 : 1); break;                                               \
        case 5: CALL(nq, 5 < (NE) ? 5 : 1); break;                                               \
        case 6: CALL(nq, 6 < (NE) ? 6 : 1); break;                                               \
        case 7: CALL(nq, 7 < (NE) ? 7 : 1); break;                                               \
        default: break; }
#define KV_LA_Q(nq) { int64_t e0 = 0;                                                            \
        for (; e0 + KV_LJ <= D; e0 += KV_LJ)                                                     \
            KV_LA_D(nq, KV_LJ);                                                                  \
        KV_LANE_TAIL(D - e0, KV_LA_D, nq, KV_LJ) }
_Static_assert(KV_LJ <= 8, "lane_accum_block's tail takes up to 7 elements");
static void KV_FN(lane_accum_block)(float *accT, int64_t MP, const float *pT, const float *vb, int64_t Dp, int64_t D,
                                    int64_t nb, int64_t nqv, kv_pf *pf)
{
    int64_t u0 = 0;
    for (; u0 + KV_LQ <= nqv; u0 += KV_LQ)
        KV_LA_Q(KV_LQ)
    switch (nqv - u0) {
    case 1: KV_LA_Q(1) break;
#if KV_LQ > 2
    case 2: KV_LA_Q(2) break;
#endif
#if KV_LQ > 3
    case 3: KV_LA_Q(3) break;
#endif
    default: break;
    }
}
#undef KV_LA_Q
#undef KV_LA_D

#if KV_LANE_PAIRS
/* The pair layout of the AVX-512 rows: two head-dim elements per lane, so that each broadcast
 * (vf_bcast2: one 8-byte load) feeds twice the FMAs.  Lane 2u + p of the pair arrays holds query
 * vector u's element 2e + p: the query q2 [Dh, 2 MP] (Dh = ceil(D / 2)), the outputs acc
 * [Dh, 2 MP]; the weights w2 [KV_B, 2 MP] hold each of a block's weights twice (vf_dup_lo /
 * vf_dup_hi).  A register tile is KV_LP_Q pair vectors (8 query vectors each) by 6 keys (scores)
 * or 6 element pairs (outputs): 24 FMAs per 10 loads, where the 2 x 8 tile of one element per
 * lane took 16 per 10.  Why: an Ice Lake Xeon issues 1.37 512-bit loads (VMOVAPS zmm, or even
 * VBROADCASTSS zmm of 4 bytes) per TSC cycle against 2.47 256-bit broadcasts, and the 2 x 8 tile
 * needs 1.25 per FMA cycle (python bench/lane_tile_loads.py, per TSC cycle, L1-resident: FMAs
 * alone 1.93, the 2 x 8 tile 1.60, the 4 x 6 pair tile 1.78).  A score is the sum of its two
 * lanes' chains (vf_pair_sums, once per key after the last partial): KV_LP_SB pairs per partial
 * sum, so KV_LP_SB + Dh / KV_LP_SB + 1 roundings, 35 for D = 128 (the one-element layout: 24;
 * kvsimd.bounds.score_chain allows the scalar row's 69).  32 pairs per partial rather than 16:
 * MQA 32/1/128 0.94-0.97x the time. */
#define KV_LP_Q 4    /* pair vectors per register tile */
#define KV_LP_J 6    /* keys (scores) or element pairs (outputs) per tile of KV_LP_Q pair vectors */
#define KV_LP_J2 8   /* ... per tile of 2 pair vectors */
#define KV_LP_SB 32  /* element pairs per partial sum of a score */
_Static_assert(KV_B == 16 && KV_W == 16, "lane_scores2_block tiles 16 keys as 6 + 6 + 4 or 8 + 8; a pair vector is 8 lanes");

/* Prefetch steps per block (kv_pf_step calls) of the two block functions below, for nq2 pair vectors */
#define KV_LP_DH(D) (((D) + 1) / 2)
#define KV_LANE_SCORE2_STEPS(nq2, D) \
    (((nq2) / KV_LP_Q * 3 + (nq2) % KV_LP_Q / 2 * 2) * ((KV_LP_DH(D) + KV_LP_SB - 1) / KV_LP_SB))
#define KV_LANE_ACCUM2_STEPS(nq2, D) \
    ((nq2) / KV_LP_Q * ((KV_LP_DH(D) + KV_LP_J - 1) / KV_LP_J) + (nq2) % KV_LP_Q / 2 * ((KV_LP_DH(D) + KV_LP_J2 - 1) / KV_LP_J2))

/* One block: the scores of its KV_B keys (kb: zero-padded fp32 rows, Dp >= 2 Dh) for nq2 pair
   vectors (an even number), into sT [KV_B][MP]; s2 [KV_B][2 MP] holds the partial sums. */
#define KV_LS2(nq, j0, nj) kv_lane_scores(q2 + u0 * KV_W, 2 * MP, kb + (j0) * Dp, Dp, Dh, s2 + (j0) * 2 * MP + u0 * KV_W, \
                                          sT + (j0) * MP + u0 / 2 * KV_W, MP, pf, nq, nj, 2, KV_LP_SB)
static void KV_FN(lane_scores2_block)(const float *q2, int64_t MP, const float *kb, int64_t Dp, int64_t D, float *sT,
                                      float *s2, int64_t nq2, kv_pf *pf)
{
    const int64_t Dh = KV_LP_DH(D);
    int64_t u0 = 0;
    for (; u0 + KV_LP_Q <= nq2; u0 += KV_LP_Q) {
        KV_LS2(KV_LP_Q, 0, KV_LP_J);
        KV_LS2(KV_LP_Q, KV_LP_J, KV_LP_J);
        KV_LS2(KV_LP_Q, 2 * KV_LP_J, KV_B - 2 * KV_LP_J);
    }
    if (nq2 - u0 == 2) {
        KV_LS2(2, 0, KV_LP_J2);
        KV_LS2(2, KV_LP_J2, KV_LP_J2);
    }
}
#undef KV_LS2

/* One block: acc2 += weights (pT [nb][MP], nqv vectors of lanes; duplicated into w2) @ V rows
   (vb), Dh element pairs and 2 nqv pair vectors. */
#define KV_LA2(nq, ne) kv_lane_accum(acc2 + e0 * MP2 + u0 * KV_W, MP2, w2 + u0 * KV_W, vb + 2 * e0, Dp, nb, pf, nq, ne, 2)
_Static_assert(KV_LP_J < KV_LP_J2 && KV_LP_J2 <= 8, "lane_accum2_block's tails take up to 7 pairs");
static void KV_FN(lane_accum2_block)(float *acc2, int64_t MP, const float *pT, float *w2, const float *vb, int64_t Dp,
                                     int64_t D, int64_t nb, int64_t nqv, kv_pf *pf)
{
    const int64_t MP2 = 2 * MP, Dh = KV_LP_DH(D), nq2 = 2 * nqv;
    for (int64_t j = 0; j < nb; j++)
        for (int64_t u = 0; u < nqv; u++) {
            const vf w = vf_load(pT + j * MP + u * KV_W);
            vf_store(w2 + j * MP2 + 2 * u * KV_W, vf_dup_lo(w));
            vf_store(w2 + j * MP2 + (2 * u + 1) * KV_W, vf_dup_hi(w));
        }
    int64_t u0 = 0;
    for (; u0 + KV_LP_Q <= nq2; u0 += KV_LP_Q) {
        int64_t e0 = 0;
        for (; e0 + KV_LP_J <= Dh; e0 += KV_LP_J)
            KV_LA2(KV_LP_Q, KV_LP_J);
        KV_LANE_TAIL(Dh - e0, KV_LA2, KV_LP_Q, KV_LP_J)
    }
    if (nq2 - u0 == 2) {
        int64_t e0 = 0;
        for (; e0 + KV_LP_J2 <= Dh; e0 += KV_LP_J2)
            KV_LA2(2, KV_LP_J2);
        KV_LANE_TAIL(Dh - e0, KV_LA2, 2, KV_LP_J2)
    }
}
#undef KV_LA2
#endif

#if KV_LANE_INT_V
/* The lanes path's int8 / int4 values with integer products: kv_accumulate_i16's rounding with the
 * query vectors on the lanes.  Per span of S = KV_B or 2 KV_B keys (whole blocks, S-aligned: inside
 * one cell of the KV_V_SPAN grid), lane u's weight of key j times its block scale,
 * (p_ju / P_u) (s_jb / A_b), is rounded to int16, keys j and j + 1 side by side in each 32-bit
 * lane (weight pairs [nb][S / 2][MP] in the free K and V blocks); the values as int16 pairs of the
 * same keys (vw_pairs: [S / 2][D] in xblk; int4 rows unpacked past 2 KV_B / 2 such rows).  One
 * VPDPWSSD per value pair broadcast and vector of lanes does what two fp32 FMAs did, with no
 * widened copy of V; the int32 sums (|sum| <= S x 32767 x 128 < 2^31) times (P_u / 32766) A_b are
 * added to acc once per span.  MP <= KV_QVECS: the weight pairs (2 D MP bytes at most) fit the K
 * and V blocks (128 Dp bytes). */
KV_AINLINE void kv_lane_accum_i16_tile(float *accT, int64_t MP, const int32_t *wq, const int32_t *vpr, int64_t D,
                                       int64_t S, const float *pst, float ab, kv_pf *pf, const int NQ)
{
    vw a[KV_LJ][KV_LQ];
    kv_pf_step(pf);
#pragma GCC unroll 8
    for (int e = 0; e < KV_LJ; e++)
#pragma GCC unroll 4
        for (int u = 0; u < NQ; u++)
            a[e][u] = vw_zero();
    for (int64_t jp = 0; jp < S / 2; jp++) {
        vw w[KV_LQ];
#pragma GCC unroll 4
        for (int u = 0; u < NQ; u++)
            w[u] = vw_load(wq + jp * MP + u * KV_W);
#pragma GCC unroll 8
        for (int e = 0; e < KV_LJ; e++) {   /* value e of the tile: vw_pairs' lo (e < 4) or hi half */
            const int16_t *pair = (const int16_t *)(vpr + jp * D + (e >= 4 ? KV_W : 0) + e % 4);
#pragma GCC unroll 4
            for (int u = 0; u < NQ; u++)
                a[e][u] = vw_dot(a[e][u], w[u], pair);
        }
    }
    const vf abv = vf_set1(ab);
#pragma GCC unroll 8
    for (int e = 0; e < KV_LJ; e++)
#pragma GCC unroll 4
        for (int u = 0; u < NQ; u++) {
            float *o = accT + e * MP + u * KV_W;
            vf_store(o, vf_fmadd(vf_mul(vw_float(a[e][u]), vf_load(pst + u * KV_W)), abv, vf_load(o)));
        }
}
_Static_assert(KV_LJ == 8 && KV_I8_BLOCK == 4 * KV_LJ && KV_W == 2 * KV_LJ,
               "a tile's 8 values are 4 of vw_pairs' lo half and 4 of its hi half");

/* One span of S = KV_B or 2 KV_B keys at t of the chunk's weights pT ([S, MP]) times int8 rows vb
   (block scales vsc). */
static void KV_FN(lane_accum_i16)(KV_FN(attn_state) *st, const float *pT, const int8_t *vb, const float *vsc,
                                  int64_t nqv, int64_t S, kv_pf *pf)
{
    const int64_t D = st->D, MP = st->MP, nb = D / KV_I8_BLOCK;
    int32_t *wq = (int32_t *)st->kblk, *vpr = (int32_t *)st->xblk;
    float amax[KV_MAX_HEAD_DIM / KV_I8_BLOCK], vn[KV_MAX_HEAD_DIM / KV_I8_BLOCK * 2 * KV_B], pst[KV_QVECS];
    kv_i16_scales(vsc, nb, S, vn, amax);
    const vf top = vf_set1(KV_W16_TOP), one = vf_set1(1.0f);
    for (int64_t u = 0; u < nqv; u++) {   /* P_u lane by lane, and the weight pairs */
        const float *p = pT + u * KV_W;
        vf mx = vf_zero(), z = vf_zero();
        for (int64_t j = 0; j < S; j++) {
            const vf x = vf_load(p + j * MP);
            mx = vf_max(mx, x);
            z = vf_add(z, vf_mul(x, vf_zero()));
        }
        const vf mv = vf_select_lt(vf_zero(), mx, mx, one), rcp = vf_div(top, mv);
        /* some lane's P_u: the whole vector takes the quotient (its other lanes' last bits move) */
        const int quot = !(-vf_hmax(vf_sub(vf_zero(), mv)) >= KV_W16_RCP_MIN);
        vf_store(pst + u * KV_W, vf_add(vf_div(mx, top), z));
        for (int64_t jp = 0; jp < S / 2; jp++) {
            const vf p0 = kv_w16_weight(vf_load(p + 2 * jp * MP), mv, rcp, quot);
            const vf p1 = kv_w16_weight(vf_load(p + (2 * jp + 1) * MP), mv, rcp, quot);
            for (int64_t b = 0; b < nb; b++)
                vw_store(wq + (b * (S / 2) + jp) * MP + u * KV_W,
                         vw_wpair(vf_mul(p0, vf_set1(vn[b * S + 2 * jp])), vf_mul(p1, vf_set1(vn[b * S + 2 * jp + 1]))));
        }
    }
    for (int64_t jp = 0; jp < S / 2; jp++)   /* the value pairs */
        for (int64_t c = 0; c < D; c += KV_I8_BLOCK) {
            vw lo, hi;
            vw_pairs(vb + 2 * jp * D + c, vb + (2 * jp + 1) * D + c, &lo, &hi);
            vw_store(vpr + jp * D + c, lo);
            vw_store(vpr + jp * D + c + KV_W, hi);
        }
    int64_t u0 = 0;
    for (; u0 < nqv; u0 += KV_LQ) {
        const int two = nqv - u0 >= KV_LQ;
        for (int64_t e0 = 0; e0 < D; e0 += KV_LJ) {
            const int64_t b = e0 / KV_I8_BLOCK;
            float *o = st->acc + e0 * MP + u0 * KV_W;
            const int32_t *w = wq + b * (S / 2) * MP + u0 * KV_W;
            const int32_t *v = vpr + b * KV_I8_BLOCK + (e0 % KV_I8_BLOCK) / KV_LJ * 4;
            if (two)
                kv_lane_accum_i16_tile(o, MP, w, v, D, S, pst + u0 * KV_W, amax[b], pf, KV_LQ);
            else
                kv_lane_accum_i16_tile(o, MP, w, v, D, S, pst + u0 * KV_W, amax[b], pf, 1);
        }
    }
}
_Static_assert(KV_LQ == 2, "lane_accum_i16 takes the query vectors two at a time, then one");
_Static_assert(KV_QVECS <= 2 * KV_I8_BLOCK, "a span's weight pairs, D / 32 x KV_B x MP int32, fit the K and V blocks");
#endif

/* The lanes path over int8 keys (lqint): the rounded queries with the query vectors on the lanes,
 * in the int8 query region of the workspace (qi or qia): steps (times the softmax scale) [nb, MP],
 * offsets -128 sum(q) [nb, MP], then the int8 values in groups of 4 [D / 4, MP] (lane i of group
 * g: values 4g..4g+3 of vector i), so that one key's 4 values, broadcast, meet every vector's
 * (VPDPBUSD) with no transpose of K.  lane_int_query stores vector i (qr: round_query's output). */
KV_AINLINE void KV_FN(lane_int_query)(float *reg, int64_t MP, int64_t D, int64_t i, const float *qr)
{
    const int64_t nb = D / KV_I8_BLOCK;
    int32_t *off = (int32_t *)(reg + nb * MP);
    uint8_t *q8 = (uint8_t *)(reg + 2 * nb * MP);
    const int8_t *src = (const int8_t *)(qr + 2 * nb);
    for (int64_t b = 0; b < nb; b++) {
        reg[b * MP + i] = qr[b];
        off[b * MP + i] = ((const int32_t *)(qr + nb))[b];
    }
    for (int64_t d = 0; d < D; d++)
        q8[((d / 4) * MP + i) * 4 + d % 4] = (uint8_t)src[d];
}

#if KV_INT_DOT
#define KV_LIQ (32 / KV_KL)   /* KV_KL-lane vectors of query lanes per register tile (int8 keys) */
#define KV_LIJ (KV_KL / 4)    /* keys per register tile */
/* sT[j][u] = the scores of keys j < NJ (int8 rows of D values at kb, block scales ksc, D / 32 per
   row) for NQ KV_KL-lane vectors of query lanes (reg: lane_int_query's region, all from the
   first): per 32-value block, 8 integer dot products of 4 values per lane from the offsets
   (exact), one conversion, times the product of the lanes' steps and the key's block scale (the
   product first, as kv_scores_i8), added in block order.  The tile is 32 query lanes by KV_LIJ
   keys either way: 16 lanes (the AVX-512 rows) do in one VPDPBUSD what 8 lanes do in two. */
KV_AINLINE void kv_lane_scores_i8(const float *reg, int64_t MP, int64_t u0, const int8_t *kb, const float *ksc,
                                  int64_t D, float *sT, const int NQ, const int NJ)
{
    const int64_t nb = D / KV_I8_BLOCK;
    const int32_t *off = (const int32_t *)(reg + nb * MP);
    const uint8_t *q8 = (const uint8_t *)(reg + 2 * nb * MP);
    vkf s[KV_LIJ][KV_LIQ];
#pragma GCC unroll 4
    for (int j = 0; j < NJ; j++)
#pragma GCC unroll 4
        for (int u = 0; u < NQ; u++)
            s[j][u] = vkf_zero();
    for (int64_t b = 0; b < nb; b++) {
        vki a[KV_LIJ][KV_LIQ];
#pragma GCC unroll 4
        for (int j = 0; j < NJ; j++)
#pragma GCC unroll 4
            for (int u = 0; u < NQ; u++)
                a[j][u] = vki_load(off + b * MP + u0 + KV_KL * u);
#pragma GCC unroll 8
        for (int d = 0; d < 8; d++) {
            vkb qv[KV_LIQ];
#pragma GCC unroll 4
            for (int u = 0; u < NQ; u++)
                qv[u] = vkb_load(q8 + ((b * 8 + d) * MP + u0 + KV_KL * u) * 4);
#pragma GCC unroll 4
            for (int j = 0; j < NJ; j++) {
                const vkb kq = vkb_flip(vkb_bcast4(kb + j * D + b * KV_I8_BLOCK + 4 * d));
#pragma GCC unroll 4
                for (int u = 0; u < NQ; u++)
                    a[j][u] = vki_dot(a[j][u], kq, qv[u]);
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < NJ; j++) {
            const vkf kscv = vkf_set1(ksc[j * nb + b]);
#pragma GCC unroll 4
            for (int u = 0; u < NQ; u++)
                s[j][u] = vkf_fmadd(vkf_from(a[j][u]), vkf_mul(vkf_load(reg + b * MP + u0 + KV_KL * u), kscv), s[j][u]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NJ; j++)
#pragma GCC unroll 4
        for (int u = 0; u < NQ; u++)
            vkf_store(sT + j * MP + u0 + KV_KL * u, s[j][u]);
}

/* One block: the scores of its nk int8 keys (kb, ksc) for nqk KV_KL-lane vectors of query lanes. */
#define KV_LSI(nq, nj) kv_lane_scores_i8(reg, MP, u0 * KV_KL, kb + j0 * D, ksc + j0 * nb, D, sT + j0 * MP, nq, nj)
#define KV_LSI_Q(nq) { int64_t j0 = 0;                        \
        for (; j0 + KV_LIJ <= nk; j0 += KV_LIJ)               \
            KV_LSI(nq, KV_LIJ);                               \
        for (; j0 < nk; j0++)                                 \
            KV_LSI(nq, 1); }
static void KV_FN(lane_scores_i8_block)(const float *reg, int64_t MP, const int8_t *kb, const float *ksc, int64_t D,
                                        float *sT, int64_t nqk, int64_t nk)
{
    const int64_t nb = D / KV_I8_BLOCK;
    int64_t u0 = 0;
    for (; u0 + KV_LIQ <= nqk; u0 += KV_LIQ)
        KV_LSI_Q(KV_LIQ)
    for (; u0 < nqk; u0++)
        KV_LSI_Q(1)
}
#undef KV_LSI_Q
#undef KV_LSI
#endif

/* Query vector i's D elements x times s into column i of the lanes path's qT [Dp, MP], or of the
   pair layout's q2 [Dh, 2 MP] (pairs: elements 2e and 2e + 1 side by side, stored together) */
KV_AINLINE void KV_FN(lane_put_q)(float *dT, int64_t MP, int pairs, int64_t i, const float *x, int64_t D, float s)
{
    if (pairs) {
        float *c = dT + 2 * i;
        int64_t e = 0;
        for (; 2 * e + 1 < D; e++) {
            c[e * 2 * MP] = s * x[2 * e];
            c[e * 2 * MP + 1] = s * x[2 * e + 1];
        }
        if (2 * e < D)
            c[e * 2 * MP] = s * x[2 * e];
        return;
    }
    for (int64_t d = 0; d < D; d++)
        dT[d * MP + i] = s * x[d];
}

/* Start KV head g for rows r0..r1-1 on the lanes path: transposed scaled queries (zero lanes
   past M), the lane tables, a fresh softmax state. */
KV_AINLINE void KV_FN(lane_head_start)(KV_FN(attn_state) *st, int64_t g, int64_t r0, int64_t r1)
{
    const kv_attn_params *p = st->p;
    KV_FN(attn_bind)(st, g, r0, r1);
    /* the stride of the tile's [., MP] arrays: its own vectors' lanes, not the workspace's (an MQA
       decode step has 32 query vectors where the workspace holds 64, for two-row prefill tiles;
       with a stride of 64 half of every line the tiles touch was idle) */
    st->MP = (st->M + KV_W - 1) / KV_W * KV_W;
    const int64_t D = st->D, G = st->G, MP = st->MP, M = st->M, h0 = g * G;
    const float scale = p->scale;
    float *qT = st->qbuf, *qaT = st->qalt;
    for (int64_t c = 0; c < st->Dp * MP; c += KV_W) {   /* MP is a multiple of KV_W; the pair layout reads past D */
        vf_store(qT + c, vf_zero());
        vf_store(st->acc + c, vf_zero());
        if (p->q_alt)
            vf_store(qaT + c, vf_zero());
    }
    if (st->lqint)   /* padded lanes: q 0, step 0 */
        for (int64_t c = 0; c < st->MQp * st->QF; c++)
            st->qi[c] = st->qia[c] = 0.0f;
    for (int64_t i = 0; i < M; i++) {
        const int64_t at = (r0 + i / G) * p->q_stride + (h0 + i % G) * D;
        for (int a = 0; a < (p->q_alt ? 2 : 1); a++) {
            const float *x = (a ? p->q_alt : p->q) + at;
            float *dT = a ? qaT : qT;
            if (st->qround) {   /* rounded in the (free) K block buffer first */
                float *row = st->kblk, *qr = row + st->Dp;
                for (int64_t d = 0; d < st->Dp; d++)
                    row[d] = d < D ? x[d] : 0.0f;
                KV_FN(round_query)(row, st->Dp, scale, qr);
                KV_FN(lane_put_q)(dT, MP, st->lpk, i, row, D, 1.0f);
                if (st->lqint)
                    KV_FN(lane_int_query)(a ? st->qia : st->qi, MP, D, i, qr);
            } else {
                KV_FN(lane_put_q)(dT, MP, st->lpk, i, x, D, scale);
            }
        }
    }
    st->lo_max = INT64_MIN;
    st->hi_min = INT64_MAX;
    for (int64_t i = 0; i < MP; i++) {
        const int64_t iv = i < M ? i : M - 1;      /* padded lanes: a copy of the last row's table */
        const int64_t r = r0 + iv / G;
        int64_t lo, hi;
        KV_FN(attn_row_keys)(p, r, &lo, &hi);
        st->lo_max = lo > st->lo_max ? lo : st->lo_max;
        st->hi_min = hi < st->hi_min ? hi : st->hi_min;
        st->lo[i] = lo < -(int64_t)KV_LANE_FAR ? -KV_LANE_FAR : (float)lo;
        st->hi[i] = hi > (int64_t)KV_LANE_FAR ? KV_LANE_FAR : (float)hi;
        st->rowv[i] = (float)r;
        st->slope[i] = p->alibi ? p->alibi[h0 + iv % G] : 0.0f;
        st->m[i] = KV_NEG_INF;
        st->l[i] = 0.0f;
    }
}

/* The lanes path's prefetch for the block at token t of a pass ending at c1: the KV_B rows' bytes
   pf bytes ahead (kv_pf_distance; cut at the pass's end), spread over the block's `steps` steps
   of work (kv_pf).  Each 16-row block of a head_dim 128 fp16 cache is one 4 KiB page, where the hardware prefetchers
   stop: without it, MQA beyond the LLC ran at 55% of the FMA peak, with it 67% (in the LLC 70%;
   Zen 4).  Spread rather than issued as one burst at the block's start: MQA 32/1/128 at 65,536
   keys took 0.92x / 0.97x / 0.95x the time on the Xeon (avx512 / avx512fp16 / avx2 rows, K/V on
   huge pages; 0.91x / 0.87x 16 bytes into a page; bench/kernel_ab.py). */
KV_AINLINE kv_pf kv_lane_prefetch(const char *base, int64_t t, int64_t c1, size_t row_bytes, int64_t pf, int64_t steps,
                                   int64_t rows)
{
    const size_t a = (size_t)t * row_bytes + (size_t)pf, end = (size_t)c1 * row_bytes;
    if (a >= end)
        return kv_pf_over(base, base, 1);   /* nothing */
    return kv_pf_over(base + a, base + (end - a < rows * row_bytes ? end : a + rows * row_bytes), steps);
}

/* Prefetch steps per block of the lanes path's fp32 tiles, nqv vectors of lanes */
KV_AINLINE int64_t KV_FN(lane_score_steps)(const KV_FN(attn_state) *st, int64_t nqv)
{
#if KV_LANE_PAIRS
    if (st->lpk)
        return KV_LANE_SCORE2_STEPS(2 * nqv, st->D);
#endif
    return KV_LANE_SCORE_STEPS(nqv, st->D);
}
KV_AINLINE int64_t KV_FN(lane_accum_steps)(const KV_FN(attn_state) *st, int64_t nqv)
{
#if KV_LANE_PAIRS
    if (st->lpv)
        return KV_LANE_ACCUM2_STEPS(2 * nqv, st->D);
#endif
    return KV_LANE_ACCUM_STEPS(nqv, st->D);
}

/* Pass 1 over the chunk c0..c1-1: the scores of every lane (reading only K) into sc[t - c0][.].
   (Widening each block during the work on the block before, into a second buffer, took 1.05x the
   time of MQA 32/1/128 in the L2 and 1.09-1.14x beyond the LLC on Zen 4, likely because the two
   buffers and the transposed query overfill L1.  Not kept.) */
KV_AINLINE void KV_FN(lane_score_chunk)(KV_FN(attn_state) *st, const float *qT, int64_t c0, int64_t c1)
{
    const int64_t D = st->D, Dp = st->Dp, MP = st->MP, nqv = (st->M + KV_W - 1) / KV_W;
    for (int64_t t = c0, tn; t < c1; t = tn) {
        tn = kv_grid_end(t, KV_B, c1);
        kv_pf pf = kv_lane_prefetch(st->kbase, t, c1, st->krb, st->kpf, KV_FN(lane_score_steps)(st, nqv), KV_B);
#if KV_INT_DOT
        if (st->lqint) {   /* int8 keys read in place, int4 ones as int8 rows; every lane the softmax reads scored */
            kv_pf_finish(&pf);
            const int8_t *kb = st->p->dtype == KV_I4
                ? kv_i4_rows_i8((int8_t *)st->kblk, st->kbase + (size_t)t * st->krb, tn - t, D)
                : (const int8_t *)st->kbase + t * D;
            KV_FN(lane_scores_i8_block)(qT == st->qalt ? st->qia : st->qi, MP, kb, st->kscale + t * (D / KV_I8_BLOCK), D,
                                        st->sc + (t - c0) * MP, nqv * KV_W / KV_KL, tn - t);
            continue;
        }
#endif
#if KV_LANE_PAIRS
        if (st->lpk) {
            KV_FN(load_block)(st->kblk, st->kbase, st->kscale, st->p->dtype, t, tn - t, D, Dp);
            KV_FN(lane_scores2_block)(qT, MP, st->kblk, Dp, D, st->sc + (t - c0) * MP, st->pbuf, 2 * nqv, &pf);
            kv_pf_finish(&pf);
            continue;
        }
#endif
        KV_FN(load_block)(st->kblk, st->kbase, st->kscale, st->p->dtype, t, tn - t, D, Dp);
        KV_FN(lane_scores_block)(qT, MP, st->kblk, Dp, D, st->sc + (t - c0) * MP, nqv, &pf);
        kv_pf_finish(&pf);
    }
}

/* The lane-wise online-softmax update over the chunk's cn scores (keys c0..): soft cap, ALiBi,
   the keys each lane does not see (only when some lane misses some key of the chunk), then
   weights exp(s - m_new), the running max and sum, and acc rescaled by exp(m_old - m_new).  A
   lane that has seen no key yet keeps m = -inf, l = 0 and acc = 0. */
KV_AINLINE void KV_FN(lane_softmax)(KV_FN(attn_state) *st, int64_t c0, int64_t cn, int64_t query_pos)
{
    const kv_attn_params *p = st->p;
    const int64_t D = st->D, MP = st->MP, nqv = (st->M + KV_W - 1) / KV_W;
    const int capped = p->softcap > 0.0f;
    const vf cap = vf_set1(p->softcap), inv_cap = vf_set1(capped ? 1.0f / p->softcap : 0.0f);
    const int masked = !(c0 >= st->lo_max && c0 + cn <= st->hi_min);
    const vf ninf = vf_set1(KV_NEG_INF), lowest = vf_set1(-3.4028234e38f);
    for (int64_t u = 0; u < nqv; u++) {
        float *s = st->sc + u * KV_W;
        const vf lo = vf_load(st->lo + u * KV_W), hi = vf_load(st->hi + u * KV_W);
        const vf rowv = vf_load(st->rowv + u * KV_W), slope = vf_load(st->slope + u * KV_W);
        vf mx = ninf;
        for (int64_t j = 0; j < cn; j++) {
            vf x = vf_load(s + j * MP);
            if (capped)
                x = vf_mul(vf_tanh(vf_mul(x, inv_cap)), cap);
            if (p->alibi) {   /* distance (query_pos + row) - key position, exact below 2^24 */
                const int64_t kp = p->key_pos ? p->key_pos[c0 + j] : c0 + j;
                x = vf_fnmadd(slope, vf_add(vf_set1((float)(query_pos - kp)), rowv), x);
            }
            if (masked) {
                const vf tv = vf_set1((float)(c0 + j));
                x = vf_select_lt(tv, lo, ninf, vf_select_lt(tv, hi, x, ninf));
            }
            if (capped || p->alibi || masked)
                vf_store(s + j * MP, x);
            mx = vf_max(mx, x);
        }
        const vf m_old = vf_load(st->m + u * KV_W);
        const vf m_new = vf_max(m_old, mx);
        const vf m_use = vf_select_lt(m_new, lowest, vf_zero(), m_new);   /* -inf (nothing seen): 0 */
        vf sum = vf_zero();
        for (int64_t j = 0; j < cn; j++) {
            const vf x = vf_load(s + j * MP);
            vf e = vf_exp(vf_sub(x, m_use));
            if (masked)   /* exp(-inf - m) is tiny, not 0 */
                e = vf_select_lt(x, lowest, vf_zero(), e);
            vf_store(s + j * MP, e);
            sum = vf_add(sum, e);
        }
        const vf corr = vf_exp(vf_sub(m_old, m_use));
        vf_store(st->l + u * KV_W, vf_fmadd(vf_load(st->l + u * KV_W), corr, sum));
        vf_store(st->m + u * KV_W, m_new);
#if KV_LANE_PAIRS
        if (st->lpv) {
            const vf c0d = vf_dup_lo(corr), c1d = vf_dup_hi(corr);
            for (int64_t e = 0; e < KV_LP_DH(D); e++) {
                float *a = st->acc + e * 2 * MP + 2 * u * KV_W;
                vf_store(a, vf_mul(vf_load(a), c0d));
                vf_store(a + KV_W, vf_mul(vf_load(a + KV_W), c1d));
            }
            continue;
        }
#endif
        for (int64_t d = 0; d < D; d++)
            vf_store(st->acc + d * MP + u * KV_W, vf_mul(vf_load(st->acc + d * MP + u * KV_W), corr));
    }
}

/* Pass 2 over the chunk: acc += weights @ V (reading only V). */
KV_AINLINE void KV_FN(lane_accumulate_chunk)(KV_FN(attn_state) *st, int64_t c0, int64_t c1)
{
    const int64_t D = st->D, Dp = st->Dp, MP = st->MP, nqv = (st->M + KV_W - 1) / KV_W;
    for (int64_t t = c0, tn; t < c1; t = tn) {
        tn = kv_grid_end(t, KV_B, c1);
        kv_pf pf = kv_lane_prefetch(st->vbase, t, c1, st->vrb, st->vpf, KV_FN(lane_accum_steps)(st, nqv), KV_B);
#if KV_LANE_INT_V
        if (st->lvint && tn - t == KV_B) {   /* int8 rows read in place, int4 ones unpacked past the value pairs */
            /* two full blocks at once where the chunk has them and they share a cell of 2 KV_B:
               the accumulators loaded, converted and stored once per 2 KV_B keys (kernel_ab vs
               7c693ae, Ice Lake, avx512, 1 thread, 4,096 / 32,768 keys: MQA 32/1/128 int8 and int4
               0.91x the time, 64/1/64 int8 0.91-0.94x, int4 0.94-0.97x; four blocks were no faster:
               0.97-1.06x of two) */
            const int64_t S = (t % (2 * KV_B) == 0 && tn + KV_B <= c1) ? 2 * KV_B : KV_B;
            if (S > KV_B)
                pf = kv_lane_prefetch(st->vbase, t, c1, st->vrb, st->vpf, KV_FN(lane_accum_steps)(st, nqv), S);
            const int8_t *vb = st->p->v_dtype == KV_I4
                ? kv_i4_rows_i8((int8_t *)st->xblk + KV_B * D * 4, st->vbase + (size_t)t * st->vrb, S, D)
                : (const int8_t *)st->vbase + t * D;
            KV_FN(lane_accum_i16)(st, st->sc + (t - c0) * MP, vb, st->vscale + t * (D / KV_I8_BLOCK), nqv, S, &pf);
            tn = t + S;
            kv_pf_finish(&pf);
            continue;
        }
#endif
#if KV_LANE_PAIRS
        if (st->lpv) {
            /* two full blocks at once where the chunk has them (widened into the K and V block
               buffers, which lie one after the other): the accumulators loaded and stored once per
               2 KV_B keys */
            const float *vb = st->vblk;
            int64_t nb = tn - t;
            if (nb == KV_B && tn + KV_B <= c1) {
                pf = kv_lane_prefetch(st->vbase, t, c1, st->vrb, st->vpf, KV_FN(lane_accum_steps)(st, nqv), 2 * KV_B);
                KV_FN(load_block)(st->kblk, st->vbase, st->vscale, st->p->v_dtype, t, KV_B, D, Dp);
                KV_FN(load_block)(st->vblk, st->vbase, st->vscale, st->p->v_dtype, tn, KV_B, D, Dp);
                vb = st->kblk;
                nb = 2 * KV_B;
                tn += KV_B;
            } else {
                KV_FN(load_block)(st->vblk, st->vbase, st->vscale, st->p->v_dtype, t, nb, D, Dp);
            }
            KV_FN(lane_accum2_block)(st->acc, MP, st->sc + (t - c0) * MP, st->pbuf, vb, Dp, D, nb, nqv, &pf);
            kv_pf_finish(&pf);
            continue;
        }
#endif
        KV_FN(load_block)(st->vblk, st->vbase, st->vscale, st->p->v_dtype, t, tn - t, D, Dp);
        KV_FN(lane_accum_block)(st->acc, MP, st->sc + (t - c0) * MP, st->vblk, Dp, D, tn - t, nqv, &pf);
        kv_pf_finish(&pf);
    }
}

/* out = acc / l for the tile's vectors (acc [D, MP], or [Dh, 2 MP] in the pair layout, back to rows). */
KV_AINLINE void KV_FN(lane_finalize)(KV_FN(attn_state) *st)
{
    const kv_attn_params *p = st->p;
    const int64_t D = st->D, G = st->G;
    for (int64_t i = 0; i < st->M; i++) {
        float *o = p->out + (st->r0 + i / G) * p->out_stride + (st->h0 + i % G) * D;
        const float inv = KV_FN(attn_part)(st, i, st->m[i], st->l[i]);
        if (st->lpv) {   /* the pair layout: elements 2e and 2e + 1 side by side */
            const float *c = st->acc + 2 * i;
            int64_t e = 0;
            for (; 2 * e + 1 < D; e++) {
                o[2 * e] = c[e * 2 * st->MP] * inv;
                o[2 * e + 1] = c[e * 2 * st->MP + 1] * inv;
            }
            if (2 * e < D)
                o[2 * e] = c[e * 2 * st->MP] * inv;
            continue;
        }
        for (int64_t d = 0; d < D; d++)
            o[d] = st->acc[d * st->MP + i] * inv;
    }
}

/* Each range in chunks of KV_CHUNK tokens, in two passes: all scores of the chunk (reading
   only K), one softmax update, then the weighted sum (reading only V).  Each pass reads one
   sequential stream: alternating K and V blocks measured ~15% slower from DRAM.
   Chunks and blocks sit on multiples of KV_CHUNK and KV_B tokens, whatever the range's start:
   a range from token 4 reads a 12-row block, then whole blocks that never straddle a 2 KiB
   boundary (misaligned blocks measured ~4% slower from DRAM).  Blocks write KV_B scores at
   (t - c0): a short first block's tail is overwritten by the next block, and the chunk's
   scores end at the padded end of its last block.  With several rows, a tile reads the keys
   of each range that any of its rows sees (from its first row's start to its last row's end). */
static void KV_FN(attn)(const kv_attn_params *p, int64_t g0, int64_t g1, int64_t r0, int64_t r1, void *workspace)
{
    KV_FN(attn_state) st;
    KV_FN(attn_setup)(&st, p, workspace);
    const int64_t tile = kv_attn_row_tile(st.G);
    for (int64_t g = g0; g < g1; g++)
        for (int64_t ta = r0; ta < r1; ta += tile) {
            const int64_t tb = ta + tile < r1 ? ta + tile : r1;
            int64_t lo, hi, lo_last, hi_last;
            KV_FN(attn_row_keys)(p, ta, &lo, &hi);
            KV_FN(attn_row_keys)(p, tb - 1, &lo_last, &hi_last);
            const int lanes = (tb - ta) * st.G >= KV_LANES_MIN;
            if (lanes)
                KV_FN(lane_head_start)(&st, g, ta, tb);
            else
                KV_FN(attn_head_start)(&st, g, ta, tb);
            for (int64_t ri = 0, before = 0; ri < p->n_ranges; ri++) {
                const kv_attn_range *r = &p->ranges[ri];
                const float *qs = r->query && p->q_alt ? st.qalt : st.qbuf;
                int64_t t0 = r->t0, t1 = r->t1;
                if (p->part_hi > 0) {   /* a split-K piece: its keys of this range */
                    const int64_t n = t1 - t0;
                    t1 = p->part_hi - before < n ? t0 + (p->part_hi - before) : t1;
                    t0 = p->part_lo > before ? t0 + (p->part_lo - before) : t0;
                    before += n;
                }
                const int64_t e0 = t0 > lo ? t0 : lo, e1 = t1 < hi_last ? t1 : hi_last;
                for (int64_t c0 = e0, c1; c0 < e1; c0 = c1) {
                    c1 = kv_grid_end(c0, KV_CHUNK, e1);
                    if (lanes) {
                        KV_FN(lane_score_chunk)(&st, r->query && p->q_alt ? st.qalt : st.qbuf, c0, c1);
                        KV_FN(lane_softmax)(&st, c0, c1 - c0, r->query_pos);
                        KV_FN(lane_accumulate_chunk)(&st, c0, c1);
                        continue;
                    }
                    const int64_t last = (c1 - 1) / KV_B * KV_B > c0 ? (c1 - 1) / KV_B * KV_B : c0;
                    const int64_t cend = last - c0 + KV_B;
                    KV_FN(attn_score_chunk)(&st, qs, qs == st.qalt ? st.qia : st.qi, c0, c1, r->query_pos);
                    KV_FN(attn_softmax_update)(&st, c0, c1 - c0, (cend + KV_B - 1) / KV_B * KV_B);
                    KV_FN(attn_accumulate_chunk)(&st, c0, c1, KV_FN(attn_next_k)(&st, ri, c1, e1, g1));
                }
            }
            if (lanes)
                KV_FN(lane_finalize)(&st);
            else
                KV_FN(attn_finalize)(&st);
        }
}
