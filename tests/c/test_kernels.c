/* C unit tests (ctest): every supported row against a double-precision reference written here,
 * the conversion routines exhaustively, and the dispatch logic.  No Python involved. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp16_soft.h"
#include "kvsimd.h"

static int failures = 0;
#define CHECK(cond, ...)                                    \
    do {                                                    \
        if (!(cond)) {                                      \
            failures++;                                     \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                   \
            fprintf(stderr, "\n");                          \
        }                                                   \
    } while (0)

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double urand(void) /* uniform in [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 4503599627370496.0 - 1.0;
}

/* out[h] = softmax(scale * K q_h) V, in double */
static void ref_attend(const float *q, const float *k, const float *v, int64_t H, int64_t Hkv, int64_t N,
                       int64_t D, double *out, double *wscale)
{
    const int64_t G = H / Hkv;
    double *s = malloc(sizeof(double) * (size_t)N);
    for (int64_t h = 0; h < H; h++) {
        const int64_t g = h / G;
        double mx = -INFINITY, sum = 0;
        for (int64_t t = 0; t < N; t++) {
            double d = 0;
            for (int64_t c = 0; c < D; c++)
                d += (double)q[h * D + c] * k[(g * N + t) * D + c];
            s[t] = d / sqrt((double)D);
            if (s[t] > mx)
                mx = s[t];
        }
        for (int64_t t = 0; t < N; t++)
            sum += (s[t] = exp(s[t] - mx));
        for (int64_t c = 0; c < D; c++) {
            double o = 0, w = 0;
            for (int64_t t = 0; t < N; t++) {
                o += s[t] / sum * v[(g * N + t) * D + c];
                w += s[t] / sum * fabs(v[(g * N + t) * D + c]);
            }
            out[h * D + c] = o;
            wscale[h * D + c] = w;
        }
    }
    free(s);
}

static void test_attention(const kv_kernels *row, const char *name)
{
    static const int64_t shapes[][4] = {{9, 3, 1, 64}, {9, 3, 77, 64}, {4, 1, 33, 17}, {8, 8, 300, 128}, {2, 2, 5, 1}, {6, 2, 40, 80}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t H = shapes[si][0], Hkv = shapes[si][1], N = shapes[si][2], D = shapes[si][3];
        for (int dt = 0; dt < 2; dt++) {
            const size_t nkv = (size_t)(Hkv * N * D);
            float *q = malloc(sizeof(float) * (size_t)(H * D)), *kf = malloc(sizeof(float) * nkv),
                  *vf = malloc(sizeof(float) * nkv), *out = malloc(sizeof(float) * (size_t)(H * D));
            uint16_t *kh = malloc(2 * nkv), *vh = malloc(2 * nkv);
            double *ref = malloc(sizeof(double) * (size_t)(H * D)), *wsc = malloc(sizeof(double) * (size_t)(H * D));
            void *ws = aligned_alloc(64, (kv_attn_workspace_bytes(H, Hkv, D) + 63) / 64 * 64);
            for (int64_t i = 0; i < H * D; i++)
                q[i] = (float)urand();
            for (size_t i = 0; i < nkv; i++) {
                kh[i] = kv_f2h_soft((float)urand());
                vh[i] = kv_f2h_soft((float)urand());
                kf[i] = kv_h2f_soft(kh[i]); /* same values in both dtypes */
                vf[i] = kv_h2f_soft(vh[i]);
            }
            ref_attend(q, kf, vf, H, Hkv, N, D, ref, wsc);
            const kv_attn_range whole = {.query = 0, .t0 = 0, .t1 = N, .query_pos = N - 1};
            kv_attn_params p = {.q = q, .k = dt ? (void *)kh : (void *)kf, .v = dt ? (void *)vh : (void *)vf,
                                .out = out, .ranges = &whole, .n_ranges = 1, .H = H, .Hkv = Hkv, .D = D,
                                .n_total = N, .T = 1, .scale = (float)(1.0 / sqrt((double)D)), .dtype = dt ? KV_F16 : KV_F32,
                                .v_dtype = dt ? KV_F16 : KV_F32};
            row->attn(&p, 0, Hkv, 0, 1, ws);
            double worst = 0;
            for (int64_t i = 0; i < H * D; i++) {
                double e = fabs(out[i] - ref[i]) / wsc[i];
                if (e > worst)
                    worst = e;
            }
            CHECK(worst <= 1e-5, "%s attn H=%lld Hkv=%lld N=%lld D=%lld %s: error %.3g", name, (long long)H,
                  (long long)Hkv, (long long)N, (long long)D, dt ? "f16" : "f32", worst);
            /* any prefetch distance (kv_attend passes this CPU's; 0 is the default): the same bits */
            static const int64_t dists[] = {1, 100, KV_PF_VALUES_SPLIT512, KV_PF_VALUES, (int64_t)1 << 40};
            float *outp = malloc(sizeof(float) * (size_t)(H * D));
            for (size_t di = 0; di < sizeof dists / sizeof dists[0]; di++) {
                kv_attn_params pd = p;
                pd.out = outp;
                pd.pf_values = dists[di];
                row->attn(&pd, 0, Hkv, 0, 1, ws);
                CHECK(memcmp(out, outp, sizeof(float) * (size_t)(H * D)) == 0, "%s attn: pf_values %lld differs", name,
                      (long long)dists[di]);
            }
            free(outp);
            /* one KV head per call (the thread split of ops.c): the same bits */
            float *out1 = malloc(sizeof(float) * (size_t)(H * D));
            p.out = out1;
            for (int64_t g = Hkv - 1; g >= 0; g--)
                row->attn(&p, g, g + 1, 0, 1, ws);
            CHECK(memcmp(out, out1, sizeof(float) * (size_t)(H * D)) == 0, "%s attn: per-head calls differ", name);
            /* the keys as two ranges, the later first, under one softmax: rounding only */
            const kv_attn_range halves[2] = {{0, N / 2, N, N - 1}, {0, 0, N / 2, N - 1}};
            p.ranges = N >= 2 ? halves : &whole;
            p.n_ranges = N >= 2 ? 2 : 1;
            row->attn(&p, 0, Hkv, 0, 1, ws);
            worst = 0;
            for (int64_t i = 0; i < H * D; i++) {
                double e = fabs(out1[i] - ref[i]) / wsc[i];
                if (e > worst)
                    worst = e;
            }
            CHECK(worst <= 1e-5, "%s attn, two ranges, N=%lld: error %.3g", name, (long long)N, worst);
            free(q); free(kf); free(vf); free(out); free(out1); free(kh); free(vh); free(ref); free(wsc); free(ws);
        }
    }
}

static void test_rotation(const kv_kernels *row, const char *name)
{
    const int64_t H = 3, N = 21, D = 80;
    const int64_t rds[] = {80, 32, 2};
    for (int style = 0; style < 2; style++)
        for (size_t ri = 0; ri < 3; ri++) {
            const int64_t rd = rds[ri], R = rd / 2;
            float x[3 * 21 * 80], cs[21 * 80];
            double want[3 * 21 * 80], inv[40];
            for (int64_t i = 0; i < H * N * D; i++)
                x[i] = (float)urand();
            kv_rope_inv_freq(inv, 10000.0, R, rd);
            for (int64_t t = 0; t < N; t++)
                kv_rope_table(cs + t * 2 * R, (double)(t * 37 - 100), inv, R, 1.0);
            for (int64_t h = 0; h < H; h++)
                for (int64_t t = 0; t < N; t++) {
                    const float *r = x + (h * N + t) * D;
                    double *w = want + (h * N + t) * D;
                    for (int64_t c = 0; c < D; c++)
                        w[c] = r[c];
                    for (int64_t i = 0; i < R; i++) {
                        const double a = (double)(t * 37 - 100) * pow(10000.0, -2.0 * i / rd);
                        const int64_t i0 = style == KV_ROPE_GPTJ ? 2 * i : i, i1 = style == KV_ROPE_GPTJ ? 2 * i + 1 : i + R;
                        w[i0] = r[i0] * cos(a) - r[i1] * sin(a);
                        w[i1] = r[i1] * cos(a) + r[i0] * sin(a);
                    }
                }
            kv_rot_params p = {x, cs, H, D, R, N, 0, N, 2 * R, KV_F32, style};
            row->rotate(&p);
            double worst = 0;
            for (int64_t i = 0; i < H * N * D; i++)
                if (fabs(x[i] - want[i]) > worst)
                    worst = fabs(x[i] - want[i]);
            CHECK(worst <= 4e-6, "%s rotate style=%d rd=%lld: error %.3g", name, style, (long long)rd, worst);
        }
}

static void test_conversion(const kv_kernels *row, const char *name)
{
    static uint16_t h[65536], h2[65536];
    static float f[65536];
    for (int i = 0; i < 65536; i++)
        h[i] = (uint16_t)i;
    row->f16_to_f32(f, h, 65536);
    row->f32_to_f16(h2, f, 65536);
    int bad = 0;
    for (int i = 0; i < 65536; i++) {
        kv_f32bits a, b;
        a.f = f[i];
        b.f = kv_h2f_soft(h[i]);
        if (a.u != b.u || h2[i] != h[i])
            bad++;
    }
    CHECK(bad == 0, "%s: %d halves do not round-trip bit-exactly", name, bad);
    /* ties round to even: 1 + 2^-11 -> 1, 1 + 3*2^-11 -> 1 + 2^-9 */
    float t[2] = {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f};
    uint16_t o[2];
    row->f32_to_f16(o, t, 2);
    CHECK(o[0] == 0x3C00 && o[1] == 0x3C02, "%s: ties not to even (%x %x)", name, o[0], o[1]);
}

static void test_dispatch(void)
{
    char msg[256];
    CHECK(kv_select_isa(0) == KV_ISA_SCALAR, "no features -> scalar");
    CHECK(kv_select_isa(KV_FEAT_AVX2) == KV_ISA_AVX2, "avx2 features -> avx2");
    const int best512 = kv_isa_compiled(KV_ISA_AVX512) ? KV_ISA_AVX512 : KV_ISA_AVX2;
    CHECK(kv_select_isa(KV_FEAT_AVX2 | KV_FEAT_AVX512) == best512, "avx512 features -> best compiled");
    const int best = kv_isa_compiled(KV_ISA_AVX512FP16) ? KV_ISA_AVX512FP16 : best512;
    CHECK(kv_select_isa(KV_FEAT_AVX2 | KV_FEAT_AVX512 | KV_FEAT_AVX512FP16) == best, "avx512fp16 features -> best compiled");
    CHECK(kv_select_isa(KV_FEAT_AVX2 | KV_FEAT_AVX512FP16) == KV_ISA_AVX2, "FP16 without the avx512 row's features");
    CHECK(kv_set_isa("nonsense", 1, msg, sizeof msg) == KV_ERR_ISA, "unknown name accepted");
    CHECK(strstr(msg, "unknown ISA 'nonsense'") != NULL, "message: %s", msg);
    CHECK(kv_set_isa("scalar", 1, msg, sizeof msg) == KV_OK && kv_active_isa() == KV_ISA_SCALAR && kv_forced(), "scalar not settable");
    const uint32_t f = kv_cpu_features();
    CHECK(!(f & KV_FEAT_AVX2) || (f & KV_FEAT_OS_YMM), "AVX2 usable without OS YMM state");
    CHECK(!(f & KV_FEAT_AVX512) || (f & KV_FEAT_OS_ZMM), "AVX512 usable without OS ZMM state");
    CHECK(!(f & KV_FEAT_AVX512) || (f & KV_FEAT_AVX512VNNI), "avx512 row usable without VNNI");
    CHECK(!(f & KV_FEAT_AVX512FP16) || (f & KV_FEAT_AVX512), "AVX512-FP16 usable without the avx512 row's features");
}

/* Sizes from caller integers are checked before use: no product wraps. */
static void test_sizes(void)
{
    kv_cache c;
    CHECK(kv_cache_create(&c, 1000000, 1000000, 1000000, 1000000, 512, KV_F16, KV_F16) == KV_ERR_CAPACITY,
          "a cache whose size wraps size_t was accepted");
    CHECK(c.data == NULL && c.nbytes == 0, "a refused cache holds memory");
    CHECK(kv_cache_create(&c, INT64_MAX, 1, 1, 1, 1, KV_F32, KV_F32) == KV_ERR_CAPACITY, "n_layers * 2 wraps");
    CHECK(kv_cache_create(&c, 1, 1, 1, (int64_t)1 << 62, 64, KV_F32, KV_F32) == KV_ERR_CAPACITY,
          "capacity * head_dim wraps");
    CHECK(kv_cache_create(&c, 1, 1, 1, 1, 1, (kv_dtype)7, KV_F32) == KV_ERR_ARG, "an unknown dtype was accepted");
    CHECK(kv_cache_create(&c, 1, 1, 1, 1, 1, KV_F32, (kv_dtype)7) == KV_ERR_ARG, "an unknown V dtype was accepted");
    CHECK(kv_cache_create(&c, 1, 1, 1, 1, 32, KV_F16, KV_I8) == KV_ERR_ARG, "scales for V only were accepted");
    CHECK(kv_cache_create(&c, 2, 3, 4, 5, 6, KV_F16, KV_F16) == KV_OK && c.nbytes == (size_t)2 * 2 * 3 * 4 * 5 * 6 * 2,
          "nbytes %zu", c.nbytes);
    kv_cache_destroy(&c);
    /* int8 K (64 bytes a row) and int4 V (32): V of layer 1, sequence 2 after layer 0's K and V and
       layer 1's K, and the values of every row before the scales */
    CHECK(kv_cache_create(&c, 2, 3, 4, 5, 64, KV_I8, KV_I4) == KV_OK, "int8 K with int4 V refused");
    CHECK((char *)kv_cache_block(&c, 1, 1, 2) - (char *)c.data == 3 * 4 * 5 * (64 + 32) + 3 * 4 * 5 * 64 + 2 * 4 * 5 * 32,
          "V block of layer 1, sequence 2 at %td", (char *)kv_cache_block(&c, 1, 1, 2) - (char *)c.data);
    CHECK((char *)c.scales - (char *)c.data >= 2 * 3 * 4 * 5 * (64 + 32) &&
          c.nbytes == (size_t)((char *)c.scales - (char *)c.data) + 2 * 2 * 3 * 4 * 5 * 2 * 4, "scales of the mixed cache");
    kv_cache_destroy(&c);
    CHECK(kv_attn_workspace_bytes(4, 0, 64) == 0, "Hkv = 0 has a workspace");
    CHECK(kv_attn_workspace_bytes((int64_t)1 << 62, 1, 64) == 0, "a workspace size that wraps was returned");
    CHECK(kv_attend_workspace_bytes(8, 2, 64, 1 << 30) == kv_attend_workspace_bytes(8, 2, 64, KV_MAX_THREADS),
          "thread count not clamped in the workspace size");
    kv_set_num_threads(1 << 30);
    CHECK(kv_get_num_threads() == KV_MAX_THREADS, "kv_set_num_threads not clamped: %d", kv_get_num_threads());
    kv_set_num_threads(-5);
    CHECK(kv_get_num_threads() == 1, "kv_set_num_threads(-5) gave %d", kv_get_num_threads());
}

int main(void)
{
    char msg[256];
    if (kv_init(getenv("KVSIMD_FORCE_ISA"), msg, sizeof msg) != KV_OK) {
        fprintf(stderr, "kv_init: %s\n", msg);
        return 1;
    }
    for (int i = 0; i < kv_isa_count(); i++) {
        if (!kv_isa_supported(i))
            continue;
        const kv_kernels *row = kv_isa_row(i);
        printf("row %s\n", kv_isa_name(i));
        test_attention(row, kv_isa_name(i));
        test_rotation(row, kv_isa_name(i));
        test_conversion(row, kv_isa_name(i));
    }
    test_dispatch();
    test_sizes();
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "OK", failures);
    return failures ? 1 : 0;
}
