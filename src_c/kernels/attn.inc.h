/* attn.inc.h - single-query attention over a KV cache, one algorithm for every ISA.
 * Included by tu_<isa>.c after its vec_<isa>.h.
 *
 * For each KV head g, its G query heads are processed together so that every K and V row
 * is read from the cache once per group.  Keys are taken in blocks of KV_B tokens:
 *   1. scores s[i][j] = (scale * q_i) . k_j       (KV_B dot products, one add-tree reduction)
 *   2. ALiBi bias, then an online-softmax update  (running max m_i, running sum l_i)
 *   3. acc_i = acc_i * exp(m_old - m_new) + sum_j p_ij v_j
 * Head dims are padded with zeros to a multiple of KV_W in the workspace, so the inner
 * loops have no tails.  fp16 rows are widened to fp32 as they are loaded; all arithmetic
 * and accumulation is fp32.
 */
#include "kvsimd.h"

#define KV_AINLINE static inline __attribute__((always_inline))
#define KV_NEG_INF (-__builtin_inff())

/* e^x for x <= 88.37, relative error ~1e-7; below -87.33 returns ~1.2e-38 instead of less
 * (harmless here: every use is a softmax weight relative to a maximum of 1).
 * x = n ln2 + r, |r| <= ln2/2; e^r by its degree-7 Taylor polynomial (error < 6e-9). */
KV_AINLINE vf vf_exp(vf x)
{
    x = vf_min(vf_set1(88.37626f), vf_max(vf_set1(-87.33654f), x)); /* NaN passes through */
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
    p = vf_fmadd(p, r, vf_set1(1.0f));
    return vf_mul(p, vf_pow2i(n));
}

static inline float KV_FN(expf1)(float x) { return vf_first(vf_exp(vf_set1(x))); }

enum { KV_ROWS_F32 = 0, KV_ROWS_F16 = 1 };

KV_AINLINE vf kv_load_row(const void *base, int mode, int64_t off)
{
    return mode == KV_ROWS_F16 ? vf_load_h((const uint16_t *)base + off) : vf_load((const float *)base + off);
}

/* s[j] = q . k_j for the KV_B rows at kb (row stride ks elements), over Dp columns */
KV_AINLINE void kv_scores(const float *q, const void *kb, int mode, int64_t ks, int64_t Dp, float *s)
{
    vf a[KV_B];
#pragma GCC unroll 16
    for (int j = 0; j < KV_B; j++)
        a[j] = vf_zero();
    for (int64_t c = 0; c < Dp; c += KV_W) {
        const vf qc = vf_load(q + c);
#pragma GCC unroll 16
        for (int j = 0; j < KV_B; j++)
            a[j] = vf_fmadd(qc, kv_load_row(kb, mode, j * ks + c), a[j]);
    }
    vf_reduce_block(a, s);
}

/* acc = acc * corr + sum_j p[j] * v_j */
KV_AINLINE void kv_accumulate(float *acc, float corr, const float *p, const void *vb, int mode, int64_t vs, int64_t Dp)
{
    vf bp[KV_B];
#pragma GCC unroll 16
    for (int j = 0; j < KV_B; j++)
        bp[j] = vf_set1(p[j]);
    const vf vc = vf_set1(corr);
    for (int64_t c = 0; c < Dp; c += KV_W) {
        vf x = vf_mul(vf_load(acc + c), vc);
#pragma GCC unroll 16
        for (int j = 0; j < KV_B; j++)
            x = vf_fmadd(bp[j], kv_load_row(vb, mode, j * vs + c), x);
        vf_store(acc + c, x);
    }
}

/* Copy (widening fp16) rows t..t+nb-1 of one head into a zero-padded [KV_B, Dp] block. */
static void KV_FN(load_block)(float *dst, const void *src, int32_t dtype, int64_t t, int64_t nb, int64_t D, int64_t Dp)
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
        } else {
            const float *s = (const float *)src + (t + j) * D;
            for (; c + KV_W <= D; c += KV_W)
                vf_store(row + c, vf_load(s + c));
            if (c < D)
                vf_store(row + c, vf_load_part(s + c, D - c));
        }
    }
}

static void KV_FN(attn)(const kv_attn_params *p, void *workspace)
{
    const int64_t D = p->D, G = p->H / p->Hkv, N = p->n_total;
    const int64_t Dp = (D + KV_W - 1) / KV_W * KV_W;
    const size_t esize = p->dtype == KV_F16 ? 2 : 4;
    float *qbuf = (float *)workspace;       /* [G, Dp] scaled queries */
    float *acc = qbuf + G * Dp;             /* [G, Dp] running outputs */
    float *kblk = acc + G * Dp;             /* [KV_B, Dp] */
    float *vblk = kblk + KV_B * Dp;         /* [KV_B, Dp] */
    float *sb = vblk + KV_B * Dp;           /* [G, KV_B] scores, then weights */
    /* Read cache rows in place when no padding is needed; fp16 rows are widened in
       registers for small groups, and once into the block buffer for larger ones. */
    const int aligned = (D % KV_W) == 0;
    const int in_place = aligned && (p->dtype == KV_F32 || G <= 2);
    const int mode = p->dtype == KV_F16 ? KV_ROWS_F16 : KV_ROWS_F32;

    for (int64_t g = p->g0; g < p->g1; g++) {
        const int64_t h0 = g * G;
        const char *kbase = (const char *)p->k + (size_t)(g * N) * (size_t)D * esize;
        const char *vbase = (const char *)p->v + (size_t)(g * N) * (size_t)D * esize;
        for (int64_t i = 0; i < G; i++) {
            const float *qi = p->q + (h0 + i) * D;
            float *o = p->out + (h0 + i) * D;
            const vf sc = vf_set1(p->scale);
            int64_t c = 0;
            for (; c + KV_W <= D; c += KV_W) {
                vf_store(qbuf + i * Dp + c, vf_mul(vf_load(qi + c), sc));
                vf_store(acc + i * Dp + c, p->init ? vf_zero() : vf_load(o + c));
            }
            if (c < D) {
                vf_store(qbuf + i * Dp + c, vf_mul(vf_load_part(qi + c, D - c), sc));
                vf_store(acc + i * Dp + c, p->init ? vf_zero() : vf_load_part(o + c, D - c));
            }
            if (p->init) {
                p->m[h0 + i] = KV_NEG_INF;
                p->l[h0 + i] = 0.0f;
            }
        }
        for (int64_t t = p->t0; t < p->t1; t += KV_B) {
            const int64_t nb = p->t1 - t < KV_B ? p->t1 - t : KV_B;
            const void *kb, *vb;
            int64_t ks, rmode;
            if (in_place && nb == KV_B) {
                kb = kbase + (size_t)(t * D) * esize;
                vb = vbase + (size_t)(t * D) * esize;
                ks = D;
                rmode = mode;
            } else {
                KV_FN(load_block)(kblk, kbase, p->dtype, t, nb, D, Dp);
                KV_FN(load_block)(vblk, vbase, p->dtype, t, nb, D, Dp);
                kb = kblk;
                vb = vblk;
                ks = Dp;
                rmode = KV_ROWS_F32;
            }
            for (int64_t i = 0; i < G; i++) {
                float *s = sb + i * KV_B;
                if (rmode == KV_ROWS_F16)
                    kv_scores(qbuf + i * Dp, kb, KV_ROWS_F16, ks, Dp, s);
                else
                    kv_scores(qbuf + i * Dp, kb, KV_ROWS_F32, ks, Dp, s);
                for (int64_t j = nb; j < KV_B; j++)
                    s[j] = KV_NEG_INF;
                if (p->alibi) {
                    const float slope = p->alibi[h0 + i];
                    for (int64_t j = 0; j < nb; j++) {
                        const int64_t kp = p->key_pos ? p->key_pos[t + j] : t + j;
                        s[j] -= slope * (float)(p->query_pos - kp);
                    }
                }
                /* online softmax */
                vf mx = vf_load(s);
                for (int j = KV_W; j < KV_B; j += KV_W)
                    mx = vf_max(mx, vf_load(s + j));
                const float m_old = p->m[h0 + i];
                const float bmax = vf_hmax(mx);
                const float m_new = bmax > m_old ? bmax : m_old;
                const float corr = KV_FN(expf1)(m_old - m_new);
                const vf mv = vf_set1(m_new);
                for (int j = 0; j < KV_B; j += KV_W)
                    vf_store(s + j, vf_exp(vf_sub(vf_load(s + j), mv)));
                for (int64_t j = nb; j < KV_B; j++)
                    s[j] = 0.0f;  /* exp(-inf - m) is tiny, not 0: drop padded rows exactly */
                vf sum = vf_zero();
                for (int j = 0; j < KV_B; j += KV_W)
                    sum = vf_add(sum, vf_load(s + j));
                p->l[h0 + i] = p->l[h0 + i] * corr + vf_hsum(sum);
                p->m[h0 + i] = m_new;
                if (rmode == KV_ROWS_F16)
                    kv_accumulate(acc + i * Dp, corr, s, vb, KV_ROWS_F16, ks, Dp);
                else
                    kv_accumulate(acc + i * Dp, corr, s, vb, KV_ROWS_F32, ks, Dp);
            }
        }
        for (int64_t i = 0; i < G; i++) {
            float *o = p->out + (h0 + i) * D;
            const vf inv = vf_set1(p->finalize ? 1.0f / p->l[h0 + i] : 1.0f);
            int64_t c = 0;
            for (; c + KV_W <= D; c += KV_W)
                vf_store(o + c, vf_mul(vf_load(acc + i * Dp + c), inv));
            if (c < D)
                vf_store_part(o + c, vf_mul(vf_load(acc + i * Dp + c), inv), D - c);
        }
    }
}
