/* ops.c - C entry points over the active dispatch row.
 *
 * The angles of RoPE and of the K-cache shift are computed here, in double precision from
 * integer positions and the caller's inverse frequencies (libm is fine here; kernels never call
 * it), and handed to the kernel as (cos, sin) float pairs.  Callers validate their arguments
 * (the Python boundary does).
 */
#include <float.h>
#include <math.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "kvsimd.h"

/* a * b + c into *r; 0 on overflow (sizes here come from caller integers) */
static int mul_add(size_t a, size_t b, size_t c, size_t *r)
{
    size_t m;
    return !__builtin_mul_overflow(a, b, &m) && !__builtin_add_overflow(m, c, r);
}

size_t kv_attn_workspace_bytes(int64_t H, int64_t Hkv, int64_t D)
{
    if (H < 1 || Hkv < 1 || D < 1 || D > KV_MAX_HEAD_DIM)
        return 0;
    const size_t G = (size_t)(H / Hkv), Dp = (size_t)((D + KV_MAX_WIDTH - 1) / KV_MAX_WIDTH * KV_MAX_WIDTH);
    /* M = G x (rows per tile) query vectors, padded to Mp (a multiple of 16): qbuf, qalt
       [Mp, KP Dp], acc [Mp, Dp]; four [B, Dp] blocks (K, V, and two for the lanes path's int16
       value pairs); a [GS, B] array of vectors; scores [Mp, chunk];
       softmax state m, l and the lane tables lo, hi, row, slope [Mp]; the int8 queries of qbuf
       and qalt [Mp, kv_qint_floats(Dp)]; the lanes path's pair buffer [2 B, 2 Mp] (attn.inc.h, attn_setup) */
    const size_t fixed = 4 * KV_MAX_BLOCK * Dp + KV_MAX_GROUP * KV_MAX_BLOCK * KV_MAX_WIDTH;
    size_t M, Mp, floats, bytes;
    if (!mul_add(G, (size_t)kv_attn_row_tile((int64_t)G), 15, &M))
        return 0;
    Mp = M / 16 * 16;
    if (!mul_add(Mp, (2 * KV_MAX_KP + 1) * Dp + KV_MAX_CHUNK + 6 + 2 * (size_t)kv_qint_floats((int64_t)Dp) + 4 * KV_MAX_BLOCK, fixed, &floats) || !mul_add(floats, sizeof(float), 64, &bytes))
        return 0;
    return bytes;
}

static int kv_threads = 1;

void kv_set_num_threads(int n)
{
    __atomic_store_n(&kv_threads, n < 1 ? 1 : n > KV_MAX_THREADS ? KV_MAX_THREADS : n, __ATOMIC_RELAXED);
}
int kv_get_num_threads(void) { return __atomic_load_n(&kv_threads, __ATOMIC_RELAXED); }

static int kv_team = 0;   /* 1 once a parallel region of more than one thread has started */
int kv_threads_started(void) { return __atomic_load_n(&kv_team, __ATOMIC_RELAXED); }
void kv_mark_threads_started(void) { __atomic_store_n(&kv_team, 1, __ATOMIC_RELAXED); }

/* this thread's index in the OpenMP team (its slice of the workspace) */
static inline int thread_id(void)
{
#if defined(_OPENMP)
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static int clamp_threads(int threads) { return threads < 1 ? 1 : threads > KV_MAX_THREADS ? KV_MAX_THREADS : threads; }

/* Split-K ("flash decoding"): a single query row has one work item per KV head, so when the
   KV heads do not divide evenly among the threads (SmolLM2's 3 on 2 threads; an MQA model's 1),
   each head's keys are cut into S pieces as well: S is the smallest count that makes heads x S a
   multiple of the threads.  Each piece keeps its own softmax (max, sum, unnormalized weighted
   sum of V) and one merge combines them.  The cuts depend only on the keys and the thread
   count, so results are identical for a given count (and within the attention bound of the
   unsplit result).  Pieces of fewer than KV_SPLIT_MIN keys are not worth a thread. */
#define KV_SPLIT_MIN 512
#define KV_SPLIT_ALIGN 64   /* cuts on multiples of 64 keys of the ranges counted end to end */

static int64_t range_keys(const kv_attn_params *p)
{
    int64_t keys = 0;
    for (int64_t r = 0; r < p->n_ranges; r++)
        keys += p->ranges[r].t1 - p->ranges[r].t0;
    return keys;
}

int64_t kv_attend_pieces(const kv_attn_params *p, int threads)
{
    threads = clamp_threads(threads);
    if (p->T != 1 || threads < 2)
        return 1;
    int64_t s = 1;
    while (s < threads && (p->Hkv * s) % threads != 0)
        s++;
    return range_keys(p) / s >= KV_SPLIT_MIN ? s : 1;
}

/* floats of `areas` merge areas of T query rows: per area [T, H, D] sums and [T, H, 2] (max, sum) */
static int area_floats(int64_t T, int64_t H, int64_t D, int64_t areas, size_t *r)
{
    size_t th, per;
    return mul_add((size_t)T, (size_t)H, 0, &th) && mul_add(th, (size_t)D + 2, 0, &per) &&
           mul_add(per, (size_t)areas, 0, r);
}

/* merge areas: one per split-K piece of a single query row, else one per source */
static int64_t merge_areas(int64_t T, int64_t n, int threads) { return T == 1 ? n * threads : n; }

size_t kv_attend_sources_workspace_bytes(int64_t H, int64_t Hkv, int64_t D, int64_t T, int64_t n, int threads)
{
    const size_t one = kv_attn_workspace_bytes(H, Hkv, D);
    size_t total, part;
    threads = clamp_threads(threads);
    if (one == 0 || one > SIZE_MAX - 63 || T < 1 || n < 1 || n > KV_MAX_SOURCES ||
        !area_floats(T, H, D, merge_areas(T, n, threads), &part) ||
        !mul_add((one + 63) / 64 * 64, (size_t)threads, 64, &total) ||
        !mul_add(part, sizeof(float), total, &total))
        return 0;
    return total;
}

size_t kv_attend_workspace_bytes(int64_t H, int64_t Hkv, int64_t D, int threads)
{
    return kv_attend_sources_workspace_bytes(H, Hkv, D, 1, 1, threads);
}

/* The prefetch distance a call's kernels get: the caller's, else this CPU's (kv_prefetch_values). */
static int64_t prefetch_values(const kv_attn_params *p) { return p->pf_values > 0 ? p->pf_values : kv_prefetch_values(); }

/* The pieces of sources src[0..n-1] as kv_attend_sources describes them, then the merge:
   out[t, h] = sum_a e^(m_a - m) acc_a[t, h] / sum_a e^(m_a - m) l_a over the areas a, with m the
   largest max (an area without keys, l = 0, weighs nothing; NaN propagates).  S[s]: source s's
   split-K pieces per KV head when T == 1 (areas: one per piece), else 1 (areas: one per source,
   each computed by tiles of rows). */
static void attend_merged(const kv_attn_params *src, int64_t n, const int64_t *S, char *workspace, size_t one,
                          int threads)
{
    const kv_attn_params *p = src;
    const int64_t H = p->H, D = p->D, T = p->T, heads = p->Hkv, tile = kv_attn_row_tile(H / heads);
    const int64_t tiles = T == 1 ? 1 : (T + tile - 1) / tile;
    int64_t first[KV_MAX_SOURCES + 1], area0[KV_MAX_SOURCES + 1], keys[KV_MAX_SOURCES];
    first[0] = area0[0] = 0;
    for (int64_t s = 0; s < n; s++) {
        keys[s] = range_keys(&src[s]);
        first[s + 1] = first[s] + heads * S[s] * tiles;     /* work items of sources before s + 1 */
        area0[s + 1] = area0[s] + (T == 1 ? S[s] : 1);
    }
    const int64_t items = first[n], areas = area0[n], per = T * H;
    float *acc = (float *)(workspace + one * (size_t)threads), *ml = acc + areas * per * D;
    const int nt = (int)(items < threads ? items : threads);
    if (nt > 1)
        kv_mark_threads_started();
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
#endif
    for (int64_t i = 0; i < items; i++) {
        const int tid = thread_id();
        int64_t s = 0;
        while (i >= first[s + 1])
            s++;
        const int64_t j = i - first[s], Ss = S[s];
        kv_attn_params piece = src[s];
        piece.pf_values = prefetch_values(&piece);
        int64_t g, r0 = 0, r1 = T, a = area0[s];
        if (T == 1) {
            const int64_t k = keys[s], c = j % Ss;
            g = j / Ss;
            if (Ss > 1) {
                piece.part_lo = c == 0 ? 0 : (k / Ss * c + k % Ss * c / Ss) / KV_SPLIT_ALIGN * KV_SPLIT_ALIGN;
                piece.part_hi = c == Ss - 1 ? k : (k / Ss * (c + 1) + k % Ss * (c + 1) / Ss) / KV_SPLIT_ALIGN *
                                                  KV_SPLIT_ALIGN;
            }
            a += c;
        } else {    /* the last tiles of a causal pass read the most keys: they go first */
            g = j % heads;
            r0 = (tiles - 1 - j / heads) * tile;
            r1 = r0 + tile < T ? r0 + tile : T;
        }
        piece.out = acc + a * per * D;
        piece.out_stride = H * D;
        piece.part_ml = ml + a * per * 2;
        kv_isa_row(kv_attend_isa(&piece))->attn(&piece, g, g + 1, r0, r1, workspace + (size_t)tid * one);
    }
    double w[KV_MAX_SOURCES * KV_MAX_THREADS];   /* areas <= sum of S[s] <= n x threads */
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t at = t * H + h;
            float m = -FLT_MAX;
            for (int64_t b = 0; b < areas; b++)
                if (ml[(b * per + at) * 2 + 1] != 0.0f && ml[(b * per + at) * 2] > m)
                    m = ml[(b * per + at) * 2];
            double l = 0.0;
            for (int64_t b = 0; b < areas; b++) {
                const float mb = ml[(b * per + at) * 2], lb = ml[(b * per + at) * 2 + 1];
                w[b] = lb != 0.0f ? exp((double)mb - (double)m) : 0.0;
                l += w[b] * lb;
            }
            float *o = p->out + t * p->out_stride + h * D;
            for (int64_t d = 0; d < D; d++) {
                double x = 0.0;
                for (int64_t b = 0; b < areas; b++)
                    x += w[b] * acc[(b * per + at) * D + d];
                o[d] = (float)(x / l);
            }
        }
}

int kv_attend_isa(const kv_attn_params *p)
{
    const int64_t G = p->H / p->Hkv;
    const int floats = (p->dtype == KV_F16 || p->dtype == KV_F32) && (p->v_dtype == KV_F16 || p->v_dtype == KV_F32);
    if (kv_active_isa() == KV_ISA_AVX512 && !kv_forced() && (kv_features() & KV_FEAT_SPLIT512) &&
        kv_isa_supported(KV_ISA_AVX2) && p->T == 1 && (G == 2 || G == 3) && floats)
        return KV_ISA_AVX2;
    return kv_active_isa();
}

/* Work is split across threads by KV head and, with several query rows, by tiles of
   kv_attn_row_tile rows: a (head, tile) item is computed by the same code whatever the thread
   count, and a row's keys are never split, so results are bit-identical for any count -- except
   a single query row under split-K (above), identical for a given count.
   `threads` is the value the workspace was sized for (kv_attend_workspace_bytes). */
void kv_attend(const kv_attn_params *p, void *workspace, int threads)
{
    kv_attn_params tuned = *p;
    tuned.pf_values = prefetch_values(p);
    p = &tuned;
    const kv_kernels *row = kv_isa_row(kv_attend_isa(p));
    const int64_t heads = p->Hkv, T = p->T, tile = kv_attn_row_tile(p->H / p->Hkv);
    const int64_t tiles = (T + tile - 1) / tile, items = heads * tiles;
    threads = clamp_threads(threads);
    const size_t one = (kv_attn_workspace_bytes(p->H, p->Hkv, p->D) + 63) / 64 * 64;
    const int64_t S = kv_attend_pieces(p, threads);
    if (S > 1) {
        attend_merged(p, 1, &S, (char *)workspace, one, threads);
        return;
    }
    const int nt = (int)(items < threads ? items : threads);
    if (nt <= 1) {
        row->attn(p, 0, heads, 0, T, workspace);
        return;
    }
    /* the last tiles of a causal pass read the most keys: they go first */
    if (nt > 1)
        kv_mark_threads_started();
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
#endif
    for (int64_t i = 0; i < items; i++) {
        const int tid = thread_id();
        const int64_t g = i % heads, r0 = (tiles - 1 - i / heads) * tile;
        row->attn(p, g, g + 1, r0, r0 + tile < T ? r0 + tile : T, (char *)workspace + (size_t)tid * one);
    }
}

void kv_attend_sources(const kv_attn_params *src, int64_t n, void *workspace, int threads)
{
    int64_t S[KV_MAX_SOURCES];
    threads = clamp_threads(threads);
    if (n == 1) {
        kv_attend(src, workspace, threads);
        return;
    }
    for (int64_t s = 0; s < n; s++)
        S[s] = src->T == 1 ? kv_attend_pieces(&src[s], threads) : 1;
    attend_merged(src, n, S, (char *)workspace, (kv_attn_workspace_bytes(src->H, src->Hkv, src->D) + 63) / 64 * 64,
                  threads);
}

void kv_f32_to_f16(uint16_t *dst, const float *src, size_t n) { kv_active()->f32_to_f16(dst, src, n); }

static const struct { const char *name; int ggml; int64_t block, bytes; } kv_wtypes[KV_WT_COUNT] = {
#define KV_WTYPE(id, name, ggml, block, bytes) [KV_WT_##id] = {#name, ggml, block, bytes},
#include "wtypes.def"
#undef KV_WTYPE
};

const char *kv_wtype_info(int t, int *ggml_id, int64_t *block, int64_t *block_bytes)
{
    const int ok = t >= 0 && t < KV_WT_COUNT;
    *ggml_id = ok ? kv_wtypes[t].ggml : -1;
    *block = ok ? kv_wtypes[t].block : 0;
    *block_bytes = ok ? kv_wtypes[t].bytes : 0;
    return ok ? kv_wtypes[t].name : NULL;
}

void kv_dequantize(kv_wtype t, float *dst, const void *src, int64_t n) { kv_active()->dequant[t](dst, src, n); }

/* Columns are taken KV_GEMV_TILE at a time, and each tile is multiplied into every slice of
   KV_GEMV_MAX_B rows of x before the next: a long input (a prefill chunk) reads each weight
   from memory once, the tile staying in cache across the slices. */
#define KV_GEMV_TILE 16

static void matmul_cols(const kv_kernels *row, const kv_gemv_params *p, int64_t n0, int64_t n1)
{
    kv_gemv_params s = *p;
    const kv_gemv_fn fn = p->xq ? row->gemv_x8[p->wtype] : row->gemv[p->wtype];
    const int64_t xqs = KV_XQ_ROW_BYTES(p->k);
    for (int64_t j0 = n0; j0 < n1; j0 += KV_GEMV_TILE) {
        const int64_t j1 = j0 + KV_GEMV_TILE < n1 ? j0 + KV_GEMV_TILE : n1;
        for (int64_t b0 = 0; b0 < p->B; b0 += KV_GEMV_MAX_B) {
            s.B = p->B - b0 < KV_GEMV_MAX_B ? p->B - b0 : KV_GEMV_MAX_B;
            s.x = p->x + b0 * p->x_stride;
            s.y = p->y + b0 * p->y_stride;
            if (p->xq)
                s.xq = (const uint8_t *)p->xq + b0 * xqs;
            fn(&s, j0, j1);
        }
    }
}

void kv_matmul(const kv_gemv_params *p, int threads)
{
    const kv_kernels *row = kv_active();
    threads = clamp_threads(threads);
    if (p->xq)
        kv_quantize_x((void *)p->xq, p->x, p->B, p->k, p->x_stride);
    /* at least 64 columns per thread: below that a thread costs more than it saves; with int8
       activations the ranges are whole groups of 8 columns */
    const int64_t most = p->n / 64 > 0 ? p->n / 64 : 1, unit = p->xq ? 8 : 1, units = p->n / unit;
    const int nt = (int)(most < threads ? most : threads);
    if (nt <= 1) {
        matmul_cols(row, p, 0, p->n);
        return;
    }
    if (nt > 1)
        kv_mark_threads_started();
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static, 1)
#endif
    for (int t = 0; t < nt; t++)
        matmul_cols(row, p, units * t / nt * unit, units * (t + 1) / nt * unit);
}

int kv_has_x8(kv_wtype t)
{
    return t == KV_WT_Q8_0 || t == KV_WT_Q4_0 || t == KV_WT_Q4_1 || t == KV_WT_Q4_K || t == KV_WT_Q5_K;
}

int64_t kv_x8_bytes(kv_wtype t, int64_t rows, int64_t k)
{
    if (!kv_has_x8(t))
        return 0;
    const int64_t per = t == KV_WT_Q4_K ? 1184 : t == KV_WT_Q5_K ? 1440 : 8 * kv_wtypes[t].bytes;
    return rows / 8 * (k / kv_wtypes[t].block) * per;
}

/* scale and minimum of sub-block j (0..7) of a Q4_K/Q5_K super-block's 12 packed bytes */
static void kquant_scale_min(const uint8_t *s12, int j, uint8_t *sc, uint8_t *mn)
{
    if (j < 4) {
        *sc = s12[j] & 63;
        *mn = s12[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s12[j + 4] & 15) | ((s12[j - 4] >> 6) << 4));
        *mn = (uint8_t)((s12[j + 4] >> 4) | ((s12[j] >> 6) << 4));
    }
}

static void repack_kquant(kv_wtype t, uint8_t *o, const uint8_t *src, int64_t rows, int64_t row_bytes)
{
    const int64_t bb = kv_wtypes[t].bytes, nsb = row_bytes / bb, per = t == KV_WT_Q4_K ? 1184 : 1440;
    const int64_t qh_at = t == KV_WT_Q5_K ? 16 : -1, qs_at = t == KV_WT_Q5_K ? 48 : 16;
    const int64_t out_qs = t == KV_WT_Q5_K ? 416 : 160;
    for (int64_t g = 0; g < rows / 8; g++)
        for (int64_t ib = 0; ib < nsb; ib++, o += per)
            for (int c = 0; c < 8; c++) {
                const uint8_t *b = src + (g * 8 + c) * row_bytes + ib * bb;
                memcpy(o + 2 * c, b, 2);                       /* d */
                memcpy(o + 16 + 2 * c, b + 2, 2);              /* dmin */
                for (int j = 0; j < 8; j++)
                    kquant_scale_min(b + 4, j, o + 32 + 8 * j + c, o + 96 + 8 * j + c);
                if (qh_at >= 0)
                    for (int i = 0; i < 8; i++)
                        memcpy(o + 160 + 32 * i + 4 * c, b + qh_at + 4 * i, 4);
                for (int i = 0; i < 32; i++)                   /* pair i / 8, vector i % 8 */
                    memcpy(o + out_qs + 32 * i + 4 * c, b + qs_at + 4 * i, 4);
            }
}

kv_status kv_repack_x8(kv_wtype t, void *dst, const void *src, int64_t rows, int64_t row_bytes)
{
    if (!kv_has_x8(t) || rows % 8)
        return KV_ERR_ARG;
    if (t == KV_WT_Q4_K || t == KV_WT_Q5_K) {
        repack_kquant(t, (uint8_t *)dst, (const uint8_t *)src, rows, row_bytes);
        return KV_OK;
    }
    const int64_t bb = kv_wtypes[t].bytes, nb = row_bytes / bb;
    const int64_t hb = t == KV_WT_Q4_1 ? 4 : 2, qb = bb - hb;  /* header (d, m) and quant bytes */
    uint8_t *o = (uint8_t *)dst;
    for (int64_t g = 0; g < rows / 8; g++)
        for (int64_t ib = 0; ib < nb; ib++) {
            for (int c = 0; c < 8; c++) {
                const uint8_t *b = (const uint8_t *)src + (g * 8 + c) * row_bytes + ib * bb;
                for (int64_t f = 0; f < hb / 2; f++)
                    memcpy(o + f * 16 + 2 * c, b + 2 * f, 2);
                for (int64_t i = 0; i < qb / 4; i++)
                    memcpy(o + 8 * hb + 32 * i + 4 * c, b + hb + 4 * i, 4);
            }
            o += 8 * bb;
        }
    return KV_OK;
}

/* The step of an int4 block (kv_quantize_rows): the smallest |step| that keeps every value within
   half a step of one of the 16 levels -8..7.  Levels -8..7 times s > 0 reach from -8.5 s to 7.5 s,
   so s = max(neg / 8.5, pos / 7.5) (neg, pos: the block's largest magnitudes below and above 0),
   taken up by an ulp or two until both quotients, as the rounding computes them, are below 8.5 and
   7.5: no value is ever clamped.  s < 0 mirrors the levels (+8.5 |s| .. -7.5 |s|): whichever sign
   needs the smaller step is taken, s > 0 on a tie. */
static float i4_step_for(float top, float other)   /* |step| with `top` on the side of -8 */
{
    float s = top / 8.5f, t = other / 7.5f;
    s = t > s ? t : s;
    while ((top > 0.0f || other > 0.0f) && !(top / s < 8.5f && other / s < 7.5f))
        s = nextafterf(s, INFINITY);
    return s;
}

static float i4_step(const float *v, int64_t n)
{
    float pos = 0.0f, neg = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        pos = v[i] > pos ? v[i] : pos;
        neg = -v[i] > neg ? -v[i] : neg;
    }
    const float sp = i4_step_for(neg, pos), sn = i4_step_for(pos, neg);
    return sp <= sn ? sp : -sn;
}

/* The one rounding rule of int8 activations and of the int8 and int4 KV caches: n values into q
   with one step -- int8 max |x| / 127, int4 i4_step --, q = x / step to nearest (ties to even),
   which is within half a step of x (the clamps to -127..127 and -8..7 never move a value further);
   returns the step, NaN (q all 0) when a value is NaN or infinite.  Returns sum(q) in *sum. */
static float quantize_run(int8_t *q, const float *v, int64_t n, int int4, int32_t *sum)
{
    float amax = 0.0f;
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(v[i]);
        finite &= a <= FLT_MAX;          /* false for NaN and infinity */
        amax = a > amax ? a : amax;
    }
    *sum = 0;
    if (!finite) {
        memset(q, 0, (size_t)n);
        return NAN;
    }
    const float step = int4 ? i4_step(v, n) : amax / 127.0f, qmax = int4 ? 7.0f : 127.0f, qmin = int4 ? -8.0f : -127.0f;
    for (int64_t i = 0; i < n; i++) {
        float r = step != 0.0f ? nearbyintf(v[i] / step) : 0.0f;
        r = r > qmax ? qmax : r < qmin ? qmin : r;
        q[i] = (int8_t)r;
        *sum += (int32_t)r;
    }
    return step;
}

void kv_quantize_x(void *xq, const float *x, int64_t B, int64_t k, int64_t xs)
{
    const int64_t nb = k / 32;
    for (int64_t b = 0; b < B; b++) {
        int8_t *q = (int8_t *)xq + b * KV_XQ_ROW_BYTES(k);
        float *d = (float *)(q + k), *s = d + nb;
        for (int64_t ib = 0; ib < nb; ib++) {
            int32_t sum;
            d[ib] = quantize_run(q + 32 * ib, x + b * xs + 32 * ib, 32, 0, &sum);
            s[ib] = d[ib] * (float)sum;
        }
    }
}

/* x <- H x * post / 32 for one block: the block times 1/32 first, so that no partial sum leaves
   float32's range where the result does not (32 values of 2e37 summed to 6.4e38 and stored a NaN
   scale); powers of 2, so the bits are those of H x * post / 32 but for values below 2^-120. */
static void hadamard32(float *x, float post)
{
    for (int i = 0; i < KV_I8_BLOCK; i++)
        x[i] *= 1.0f / KV_I8_BLOCK;
    for (int h = 1; h < KV_I8_BLOCK; h *= 2)
        for (int i = 0; i < KV_I8_BLOCK; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    if (post != 1.0f)
        for (int i = 0; i < KV_I8_BLOCK; i++)
            x[i] *= post;
}

void kv_hadamard_rows(float *x, int64_t xs, int64_t n, int64_t D)
{
    for (int64_t r = 0; r < n; r++)
        for (int64_t d = 0; d + KV_I8_BLOCK <= D; d += KV_I8_BLOCK)
            hadamard32(x + r * xs + d, (float)KV_I8_BLOCK);
}

kv_status kv_quantize_rows(kv_dtype dtype, int hadamard, void *q, int64_t qs, float *scale, const float *x, int64_t xs,
                           int64_t n, int64_t D)
{
    if (dtype != KV_I8 && dtype != KV_I4)
        return KV_ERR_ARG;
    const int64_t nb = kv_i8_blocks(D);
    int32_t sum;
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0, d = 0; b < nb; b++, d += KV_I8_BLOCK) {
            const int64_t len = D - d < KV_I8_BLOCK ? D - d : KV_I8_BLOCK;
            const int rot = hadamard && len == KV_I8_BLOCK;
            float hx[KV_I8_BLOCK];
            const float *src = x + r * xs + d;
            if (rot) {
                memcpy(hx, src, sizeof hx);
                hadamard32(hx, 1.0f);     /* H x / 32: what q * scale stands for */
                src = hx;
            }
            int8_t v[KV_I8_BLOCK] = {0};   /* int4: the padding of a short last block is value 0 */
            float *sc = scale + r * nb + b;
            *sc = quantize_run(dtype == KV_I8 ? (int8_t *)q + r * qs + d : v, src, len, dtype == KV_I4, &sum);
            if (dtype == KV_I4) {
                uint8_t *o = (uint8_t *)q + r * qs + b * KV_I4_BLOCK_BYTES;
                for (int e = 0; e < KV_I4_BLOCK_BYTES; e++)
                    o[e] = (uint8_t)((v[e] + 8) | ((v[e + KV_I4_BLOCK_BYTES] + 8) << 4));
            }
        }
    return KV_OK;
}

void kv_dequantize_rows(kv_dtype dtype, int hadamard, float *x, int64_t xs, const void *q, int64_t qs,
                        const float *scale, int64_t n, int64_t D)
{
    const int64_t nb = kv_i8_blocks(D);
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = (const uint8_t *)q + r * qs;
        for (int64_t d = 0; d < D; d++) {
            const int64_t b = d / KV_I8_BLOCK, e = d % KV_I8_BLOCK;
            const int v = dtype == KV_I8 ? (int)(int8_t)row[d]
                        : (int)((row[b * KV_I4_BLOCK_BYTES + e % KV_I4_BLOCK_BYTES] >> (e >= KV_I4_BLOCK_BYTES ? 4 : 0)) & 15) - 8;
            x[r * xs + d] = (float)v * scale[r * nb + b];
        }
    }
    if (hadamard)
        kv_hadamard_rows(x, xs, n, D);
}
void kv_f16_to_f32(float *dst, const uint16_t *src, size_t n) { kv_active()->f16_to_f32(dst, src, n); }

/* inv[r] = theta^(-2r / rotary_dim): the frequencies of a spec that gives none of its own */
void kv_rope_inv_freq(double *inv, double theta, int64_t R, int64_t rotary_dim)
{
    for (int64_t r = 0; r < R; r++)
        inv[r] = pow(theta, -(double)(2 * r) / (double)rotary_dim);
}

/* The one table builder: (cos, sin) * scale of units * inv[r], in double, stored as float. */
void kv_rope_table(float *cs, double units, const double *inv, int64_t R, double scale)
{
    for (int64_t r = 0; r < R; r++) {
        const double a = units * inv[r];
        cs[2 * r] = (float)(cos(a) * scale);
        cs[2 * r + 1] = (float)(sin(a) * scale);
    }
}

#define KV_ROPE_CHUNK 16 /* tokens whose angles are computed per kernel call */

kv_status kv_apply_rope(void *x, kv_dtype dtype, int64_t H, int64_t N, int64_t D, const int64_t *positions,
                        const double *inv, double scale, kv_rope_style style, int64_t rotary_dim)
{
    if (rotary_dim <= 0 || rotary_dim % 2 || rotary_dim > D || D > KV_MAX_HEAD_DIM)
        return KV_ERR_ARG;
    const int64_t R = rotary_dim / 2;
    float cs[KV_ROPE_CHUNK * KV_MAX_HEAD_DIM];
    const kv_kernels *row = kv_active();
    for (int64_t t0 = 0; t0 < N; t0 += KV_ROPE_CHUNK) {
        const int64_t t1 = t0 + KV_ROPE_CHUNK < N ? t0 + KV_ROPE_CHUNK : N;
        for (int64_t t = t0; t < t1; t++)
            kv_rope_table(cs + (t - t0) * 2 * R, (double)positions[t], inv, R, scale);
        kv_rot_params p = {x, cs, H, D, R, N, t0, t1, 2 * R, dtype, style};
        row->rotate(&p);
    }
    return KV_OK;
}

/* A key rotated at p (its attention factor applied then) is moved to p + delta by the rotation
   of delta alone: scale 1, or the factor would be applied again at every shift. */
kv_status kv_shift_keys(void *k, float *k_scale, kv_dtype dtype, int hadamard, int64_t Hkv, int64_t N, int64_t D,
                        int64_t delta, const double *inv, kv_rope_style style, int64_t rotary_dim, int64_t start,
                        int64_t stop)
{
    if (rotary_dim <= 0 || rotary_dim % 2 || rotary_dim > D || D > KV_MAX_HEAD_DIM)
        return KV_ERR_ARG;
    if (start < 0 || stop > N || start > stop)
        return KV_ERR_POSITION;
    if (kv_dtype_scaled(dtype) ? !k_scale : hadamard)
        return KV_ERR_ARG;
    const int64_t R = rotary_dim / 2;
    float cs[KV_MAX_HEAD_DIM];
    kv_rope_table(cs, (double)delta, inv, R, 1.0);
    if (!kv_dtype_scaled(dtype)) {
        kv_rotate_rows(k, dtype, Hkv, N, D, cs, style, rotary_dim, start, stop);
        return KV_OK;
    }
    /* int8, int4: SHIFT_ROWS rows at a time widened into buf, rotated there in fp32, quantized back */
    enum { SHIFT_ROWS = 16 };
    float buf[SHIFT_ROWS * KV_MAX_HEAD_DIM];
    const int64_t nb = kv_i8_blocks(D);
    const size_t rb = kv_row_bytes(dtype, D);
    for (int64_t g = 0; g < Hkv; g++)
        for (int64_t t = start; t < stop; t += SHIFT_ROWS) {
            const int64_t n = stop - t < SHIFT_ROWS ? stop - t : SHIFT_ROWS;
            char *q = (char *)k + (size_t)(g * N + t) * rb;
            float *sc = k_scale + (g * N + t) * nb;
            kv_dequantize_rows(dtype, hadamard, buf, D, q, (int64_t)rb, sc, n, D);
            kv_rotate_rows(buf, KV_F32, 1, n, D, cs, style, rotary_dim, 0, n);
            kv_quantize_rows(dtype, hadamard, q, (int64_t)rb, sc, buf, D, n, D);
        }
    return KV_OK;
}

void kv_rotate_rows(void *x, kv_dtype dtype, int64_t H, int64_t N, int64_t D, const float *cs, kv_rope_style style,
                    int64_t rotary_dim, int64_t t0, int64_t t1)
{
    kv_rot_params p = {x, cs, H, D, rotary_dim / 2, N, t0, t1, 0, dtype, style};
    kv_active()->rotate(&p);
}
