/* kernel_ab.c - one ISA row's attention kernel from two source trees, A and B, timed call by call
 * in one process (bench/kernel_ab.py builds it: each tree's row object with its symbols prefixed
 * A_ / B_, linked against the C core of tree B).
 *
 *   kernel_ab H HKV D N REPS DTYPE OFFSET
 *
 * One decode step (one query row, every KV head, one thread: the row's kernel called directly),
 * K and V of N tokens as DTYPE (float16, float32, int8, int4), the buffers 2 MiB aligned, advised
 * as huge pages (as a KVCache's are), plus OFFSET bytes.  Each repeat times A, then B; printed:
 * both medians, the median and quartiles of B / A over the repeats, and the largest |A - B| of
 * the outputs. */
#define _DEFAULT_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include "kvsimd.h"

extern const kv_kernels ROW_A, ROW_B;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static void *huge_buffer(size_t bytes, size_t offset)
{
    const size_t huge = (size_t)2 << 20, total = (bytes + offset + huge - 1) / huge * huge;
    unsigned char *p = aligned_alloc(huge, total);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    madvise(p, total, MADV_HUGEPAGE);
    return p + offset;
}

int main(int argc, char **argv)
{
    if (argc != 8) {
        fprintf(stderr, "usage: kernel_ab H HKV D N REPS DTYPE OFFSET\n");
        return 2;
    }
    char msg[256];
    kv_init(NULL, msg, sizeof msg);   /* the CPU's features, for kv_prefetch_values */
    const int64_t H = atoll(argv[1]), Hkv = atoll(argv[2]), D = atoll(argv[3]), N = atoll(argv[4]);
    const int reps = atoi(argv[5]);
    const char *dname = argv[6];
    const size_t offset = (size_t)atoll(argv[7]);
    const kv_dtype dt = !strcmp(dname, "float32") ? KV_F32 : !strcmp(dname, "int8") ? KV_I8
                        : !strcmp(dname, "int4") ? KV_I4 : KV_F16;
    if (H < 1 || Hkv < 1 || H % Hkv || D < 1 || D > KV_MAX_HEAD_DIM || N < 1 || reps < 1) {
        fprintf(stderr, "kernel_ab: bad arguments\n");
        return 2;
    }
    const size_t nb = (size_t)Hkv * (size_t)N * kv_row_bytes(dt, D);
    unsigned char *k = huge_buffer(nb, offset), *v = huge_buffer(nb, offset);
    srand(1);
    if (dt == KV_F16) {   /* halves of magnitude 0.125 .. 0.25, either sign */
        uint16_t *kh = (uint16_t *)k, *vh = (uint16_t *)v;
        for (size_t i = 0; i < nb / 2; i++) {
            kh[i] = (uint16_t)(0x3000 + (rand() & 0x3ff) + ((rand() & 1) << 15));
            vh[i] = (uint16_t)(0x3000 + (rand() & 0x3ff) + ((rand() & 1) << 15));
        }
    } else if (dt == KV_F32) {
        float *kf = (float *)k, *vf = (float *)v;
        for (size_t i = 0; i < nb / 4; i++) {
            kf[i] = (float)(rand() % 2001 - 1000) / 4000.0f;
            vf[i] = (float)(rand() % 2001 - 1000) / 4000.0f;
        }
    } else {
        for (size_t i = 0; i < 2 * nb; i++) {   /* int8 values in -127..127, as the cache stores them */
            const int x = rand() & 255;
            (i < nb ? k : v)[i % nb] = (unsigned char)(dt == KV_I8 && x == 128 ? 0 : x);
        }
    }
    const size_t ns = (size_t)Hkv * (size_t)N * (size_t)kv_i8_blocks(D);
    float *ks = malloc(ns * sizeof(float)), *vs = malloc(ns * sizeof(float));
    float *q = malloc((size_t)(H * D) * sizeof(float)), *oa = malloc((size_t)(H * D) * sizeof(float)),
          *ob = malloc((size_t)(H * D) * sizeof(float));
    double *ta = malloc((size_t)reps * sizeof(double)), *tb = malloc((size_t)reps * sizeof(double)),
           *ratio = malloc((size_t)reps * sizeof(double));
    const size_t wsb = kv_attn_workspace_bytes(H, Hkv, D);
    void *ws = aligned_alloc(64, (wsb + 63) / 64 * 64);
    if (!ks || !vs || !q || !oa || !ob || !ta || !tb || !ratio || !wsb || !ws) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < ns; i++)
        ks[i] = vs[i] = 0.01f;
    for (int64_t i = 0; i < H * D; i++)
        q[i] = (float)(rand() % 2001 - 1000) / 1000.0f;
    kv_attn_range r = {0, 0, N, N};
    kv_attn_params pa;
    memset(&pa, 0, sizeof pa);
    pa.q = q, pa.k = k, pa.v = v, pa.ranges = &r, pa.n_ranges = 1, pa.H = H, pa.Hkv = Hkv, pa.D = D;
    pa.n_total = N, pa.T = 1, pa.q_stride = H * D, pa.out_stride = H * D, pa.scale = 0.088f;
    pa.dtype = dt, pa.v_dtype = dt, pa.k_scale = ks, pa.v_scale = vs;
    pa.pf_values = kv_prefetch_values();   /* as kv_attend passes it on this CPU (an older tree's row ignores it) */
    kv_attn_params pb = pa;
    pa.out = oa, pb.out = ob;
    ROW_A.attn(&pa, 0, Hkv, 0, 1, ws);   /* warm: pages touched, code loaded */
    ROW_B.attn(&pb, 0, Hkv, 0, 1, ws);
    double diff = 0.0;
    for (int64_t i = 0; i < H * D; i++) {
        const double d = oa[i] > ob[i] ? (double)oa[i] - ob[i] : (double)ob[i] - oa[i];
        diff = d > diff ? d : diff;
    }
    for (int i = 0; i < reps; i++) {
        const double t0 = now();
        ROW_A.attn(&pa, 0, Hkv, 0, 1, ws);
        const double t1 = now();
        ROW_B.attn(&pb, 0, Hkv, 0, 1, ws);
        const double t2 = now();
        ta[i] = t1 - t0, tb[i] = t2 - t1, ratio[i] = tb[i] / ta[i];
    }
    qsort(ta, (size_t)reps, sizeof(double), cmp);
    qsort(tb, (size_t)reps, sizeof(double), cmp);
    qsort(ratio, (size_t)reps, sizeof(double), cmp);
    const double flop = 4.0 * (double)H * (double)N * (double)D;
    printf("%lld/%lld/%lld N=%lld %s offset=%zu reps=%d: A %.3f ms (%.1f GFLOP/s)  B %.3f ms (%.1f GFLOP/s)  "
           "B/A median %.3f [quartiles %.3f, %.3f]  max|A-B| %.3g\n",
           (long long)H, (long long)Hkv, (long long)D, (long long)N, dname, offset, reps, 1e3 * ta[reps / 2],
           flop / ta[reps / 2] / 1e9, 1e3 * tb[reps / 2], flop / tb[reps / 2] / 1e9, ratio[reps / 2], ratio[reps / 4],
           ratio[3 * reps / 4], diff);
    return 0;
}
