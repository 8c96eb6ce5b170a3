/* peak.inc.h - the compute roofline: fp32 multiply-add throughput of this ISA's vectors.
 * KV_PEAK_CHAINS independent accumulators cover FMA latency times issue width on current
 * cores (4-5 cycles x 2 ports); each round is one FMA per chain. */
#define KV_PEAK_CHAINS 12

static uint64_t KV_FN(fma_peak)(int64_t iters, float *sink)
{
    vf a[KV_PEAK_CHAINS];
    const vf m = vf_set1(0.999999f), c = vf_set1(1e-6f);
#pragma GCC unroll 16
    for (int j = 0; j < KV_PEAK_CHAINS; j++)
        a[j] = vf_set1(1.0f + (float)j * 1e-3f);
    for (int64_t i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int j = 0; j < KV_PEAK_CHAINS; j++)
            a[j] = vf_fmadd(a[j], m, c);
    }
    vf s = a[0];
    for (int j = 1; j < KV_PEAK_CHAINS; j++)
        s = vf_add(s, a[j]);
    *sink = vf_first(s);
    return (uint64_t)iters * KV_PEAK_CHAINS * KV_W * 2;
}
