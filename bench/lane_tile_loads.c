/* lane_tile_loads.c - what the query-on-lanes path's register tiles wait for, on the avx512 row:
 * loads per TSC cycle and FMAs per TSC cycle, data in L1.
 *
 *   load zmm      VMOVAPS zmm from memory, 8 independent loads per step
 *   bcast zmm     VBROADCASTSS zmm from memory (4 bytes read, a 512-bit destination)
 *   bcast ymm     VBROADCASTSS ymm from memory
 *   fma           FMAs on registers only (16 chains): the core's FMA rate
 *   tile 2x8      attn.inc.h's one-element-per-lane tile (kv_lane_scores): per head-dim element
 *                 2 query vectors loaded and 8 keys' elements broadcast, 16 FMAs per 10 loads
 *   tile 4x6 pair the pair layout's tile (kv_lane_scores2): per element pair 4 pair vectors loaded
 *                 and 6 keys' pairs broadcast (VBROADCASTSD), 24 FMAs per 10 loads
 *
 * The tiles compute the scores of 16 keys over a head dim of 128 for 32 query vectors (an MQA
 * decode step's block).  A core that issues fewer 512-bit loads per cycle than the tile needs
 * (2 x 8 at 2 FMAs per cycle: 1.25 loads) runs the tile below its FMA rate.  Each figure is per
 * TSC cycle, the quartiles over 51 rounds (each the best of 5 runs): the VMs this runs on share
 * cores, and a round's rate moves by 30% with the neighbours.  An argument scales the length.
 * Build and run (python bench/lane_tile_loads.py does both):
 *
 *   gcc -O2 -std=c11 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c \
 *       bench/lane_tile_loads.c -o /tmp/lane_tile_loads
 *   /tmp/lane_tile_loads [length]
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

#define ROUNDS 51
static float qT[128 * 32] __attribute__((aligned(64)));   /* [D][32 lanes] */
static float q2[64 * 64] __attribute__((aligned(64)));    /* [D / 2][64 pair lanes] */
static float kb[16 * 128] __attribute__((aligned(64)));   /* [16 keys][D] */
static float sT[16 * 64] __attribute__((aligned(64)));
static float buf[1024] __attribute__((aligned(64)));
static long reps = 400;

#define EIGHT(op, w) op " 0(%[p]), %%" w "0\n " op " 512(%[p]), %%" w "1\n " op " 1024(%[p]), %%" w "2\n " op \
    " 1536(%[p]), %%" w "3\n " op " 2048(%[p]), %%" w "4\n " op " 2560(%[p]), %%" w "5\n " op " 3072(%[p]), %%" w \
    "6\n " op " 3584(%[p]), %%" w "7\n"
#define LOADS(name, body)                                                                                        \
    static void name(void)                                                                                       \
    {                                                                                                            \
        const float *p = buf;                                                                                    \
        long n = 256;                                                                                            \
        __asm__ volatile("1:\n" body "dec %[n]\n jnz 1b\n"                                                       \
                         : [n] "+r"(n) : [p] "r"(p) : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", \
                           "xmm7", "memory");                                                                    \
    }
LOADS(load_zmm, EIGHT("vmovaps", "zmm"))
LOADS(bcast_zmm, EIGHT("vbroadcastss", "zmm"))
LOADS(bcast_ymm, EIGHT("vbroadcastss", "ymm"))

static void fma_only(void)
{
    __m512 a[16], b = _mm512_set1_ps(1.0f), c = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < 16; i++)
        a[i] = _mm512_set1_ps((float)i);
    for (int it = 0; it < 128; it++) {
        __asm__("" : "+v"(b), "+v"(c));
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            a[i] = _mm512_fmadd_ps(b, c, a[i]);
    }
    for (int i = 0; i < 16; i++)
        _mm512_store_ps(sT + i * 16, a[i]);
}

static void tile_2x8(void)
{
    for (int j0 = 0; j0 < 16; j0 += 8) {
        __m512 a[8][2];
        for (int j = 0; j < 8; j++)
            a[j][0] = a[j][1] = _mm512_setzero_ps();
        for (int d = 0; d < 128; d++) {
            const __m512 q0 = _mm512_load_ps(qT + d * 32), q1 = _mm512_load_ps(qT + d * 32 + 16);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m512 b = _mm512_set1_ps(kb[(j0 + j) * 128 + d]);
                a[j][0] = _mm512_fmadd_ps(b, q0, a[j][0]);
                a[j][1] = _mm512_fmadd_ps(b, q1, a[j][1]);
            }
        }
        for (int j = 0; j < 8; j++) {
            _mm512_store_ps(sT + (j0 + j) * 32, a[j][0]);
            _mm512_store_ps(sT + (j0 + j) * 32 + 16, a[j][1]);
        }
    }
}

static inline __m512 bcast2(const float *p)
{
    double x;
    memcpy(&x, p, sizeof x);
    return _mm512_castpd_ps(_mm512_set1_pd(x));
}
#define PAIR_TILE(NJ)                                                                                            \
    static inline void pair_tile_##NJ(int j0)                                                                   \
    {                                                                                                            \
        __m512 a[NJ][4];                                                                                         \
        for (int j = 0; j < NJ; j++)                                                                             \
            a[j][0] = a[j][1] = a[j][2] = a[j][3] = _mm512_setzero_ps();                                         \
        for (int e = 0; e < 64; e++) {                                                                           \
            __m512 q[4];                                                                                         \
            _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++)                                                  \
                q[u] = _mm512_load_ps(q2 + e * 64 + u * 16);                                                     \
            _Pragma("GCC unroll 8") for (int j = 0; j < NJ; j++)                                                 \
            {                                                                                                    \
                const __m512 b = bcast2(kb + (j0 + j) * 128 + 2 * e);                                            \
                _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++)                                              \
                    a[j][u] = _mm512_fmadd_ps(b, q[u], a[j][u]);                                                 \
            }                                                                                                    \
        }                                                                                                        \
        for (int j = 0; j < NJ; j++)                                                                             \
            for (int u = 0; u < 4; u++)                                                                          \
                _mm512_store_ps(sT + (j0 + j) * 64 + u * 16, a[j][u]);                                           \
    }
PAIR_TILE(6)
PAIR_TILE(4)
static void tile_4x6_pairs(void)
{
    pair_tile_6(0);
    pair_tile_6(6);
    pair_tile_4(12);
}

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void run(const char *name, void (*f)(void), double per_call)
{
    double r[ROUNDS];
    for (int k = 0; k < ROUNDS; k++) {
        uint64_t best = UINT64_MAX;
        for (int rep = 0; rep < 5; rep++) {
            const uint64_t t = __rdtsc();
            for (long i = 0; i < reps; i++) {
                f();
                __asm__ volatile("" ::: "memory");
            }
            const uint64_t dt = __rdtsc() - t;
            best = dt < best ? dt : best;
        }
        r[k] = per_call * (double)reps / (double)best;
    }
    qsort(r, ROUNDS, sizeof r[0], cmp);
    printf("%-14s %6.2f %6.2f %6.2f\n", name, r[ROUNDS / 4], r[ROUNDS / 2], r[3 * ROUNDS / 4]);
}

int main(int argc, char **argv)
{
    const double length = argc > 1 ? atof(argv[1]) : 1.0;
    if (!(length > 0 && length <= 100)) {
        fprintf(stderr, "length must be in (0, 100]\n");
        return 2;
    }
    reps = (long)(400 * length) > 1 ? (long)(400 * length) : 1;
    for (int i = 0; i < 128 * 32; i++)
        qT[i] = (float)(i % 7) * 0.1f;
    for (int i = 0; i < 64 * 64; i++)
        q2[i] = (float)(i % 7) * 0.1f;
    for (int i = 0; i < 16 * 128; i++)
        kb[i] = (float)(i % 5) * 0.1f;
    printf("%-14s %6s %6s %6s   (per TSC cycle: loads, then FMAs; quartiles of %d rounds)\n", "what", "q1", "median",
           "q3", ROUNDS);
    run("load zmm", load_zmm, 256 * 8);
    run("bcast zmm", bcast_zmm, 256 * 8);
    run("bcast ymm", bcast_ymm, 256 * 8);
    run("fma", fma_only, 128 * 16);
    run("tile 2x8", tile_2x8, 128 * 32);
    run("tile 4x6 pair", tile_4x6_pairs, 128 * 32);
    return 0;
}
