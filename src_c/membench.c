/* membench.c - the memory roofline the benchmark reports kernels against: streaming read,
 * write and copy with plain 16-byte loads and stores (baseline SSE2, no non-temporal tricks),
 * on one thread or split across OpenMP threads.  The read prefetches into L1 as far ahead as the
 * attention kernels prefetch fp16 rows (kv_prefetch_values: 8 KiB on Zen 5, 3 KiB on Zen 4):
 * without it the probe read 6-8% below what a prefetching stream reaches on Zen 5 (1 and 2
 * threads; 4 KiB ahead the same, 2 KiB and none alike low), and 2-thread attention measured
 * above "the" read ceiling. */
#include <emmintrin.h>

#include "kvsimd.h"

uint64_t kv_bench_read(const void *buf, size_t bytes)
{
    const __m128i *p = (const __m128i *)buf;
    __m128i a = _mm_setzero_si128(), b = a, c = a, d = a;
    const size_t n = bytes / 64, ahead = (size_t)(2 * kv_prefetch_values()) / 64;
    for (size_t i = 0; i < n; i++, p += 4) {
        if (i + ahead < n)
            _mm_prefetch((const char *)(p + 4 * ahead), _MM_HINT_T0);
        a = _mm_add_epi64(a, _mm_loadu_si128(p));
        b = _mm_add_epi64(b, _mm_loadu_si128(p + 1));
        c = _mm_add_epi64(c, _mm_loadu_si128(p + 2));
        d = _mm_add_epi64(d, _mm_loadu_si128(p + 3));
    }
    a = _mm_add_epi64(_mm_add_epi64(a, b), _mm_add_epi64(c, d));
    uint64_t out[2];
    _mm_storeu_si128((__m128i *)out, a);
    return out[0] + out[1];
}

void kv_bench_copy(void *dst, const void *src, size_t bytes)
{
    const __m128i *s = (const __m128i *)src;
    __m128i *d = (__m128i *)dst;
    size_t n = bytes / 64;
    for (size_t i = 0; i < n; i++, s += 4, d += 4) {
        __m128i x0 = _mm_loadu_si128(s), x1 = _mm_loadu_si128(s + 1);
        __m128i x2 = _mm_loadu_si128(s + 2), x3 = _mm_loadu_si128(s + 3);
        _mm_storeu_si128(d, x0);
        _mm_storeu_si128(d + 1, x1);
        _mm_storeu_si128(d + 2, x2);
        _mm_storeu_si128(d + 3, x3);
    }
}

void kv_bench_write(void *dst, size_t bytes)
{
    __m128i *d = (__m128i *)dst;
    const __m128i x = _mm_set1_epi32(0x3c003c00);
    size_t n = bytes / 64;
    for (size_t i = 0; i < n; i++, d += 4) {
        _mm_storeu_si128(d, x);
        _mm_storeu_si128(d + 1, x);
        _mm_storeu_si128(d + 2, x);
        _mm_storeu_si128(d + 3, x);
    }
}

uint64_t kv_bench_run(int op, void *dst, const void *src, size_t bytes, int threads)
{
    if (threads < 1)
        threads = 1;
    const size_t per = (bytes / (size_t)threads) & ~(size_t)63;
    uint64_t sum = 0;
    if (threads > 1)
        kv_mark_threads_started();
#pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(+ : sum)
    for (int t = 0; t < threads; t++) {
        const size_t off = (size_t)t * per;
        if (op == KV_BENCH_READ)
            sum += kv_bench_read((const char *)src + off, per);
        else if (op == KV_BENCH_WRITE)
            kv_bench_write((char *)dst + off, per);
        else
            kv_bench_copy((char *)dst + off, (const char *)src + off, per);
    }
    return sum;
}
