/* fp16_widen_cost.c - what widening fp16 rows costs the FMA rate, on the avx512 row: the register
 * tile of attn.inc.h kv_accumulate_cols (NH query heads x CG vectors of V columns, CG = 16 / NH as
 * KV_ACC = 16 makes it; per row of the block NH weights broadcast from memory, CG V vectors, NH x CG
 * FMAs) with its data in L1, V read three ways:
 *
 *   fp32   V as fp32 rows (no widening: the tile's own FMA rate);
 *   fp16   V as fp16 rows, each vector widened by VCVTPH2PS zmm from memory (what the kernel does);
 *   int    fp16 widened by integer ops (VPMOVZXWD, VPSLLD, VPADDD: exact for normal numbers only,
 *          a bound on what a conversion off the float pipes could give).
 *
 * Each V vector feeds NH FMAs, one per head, so a group of NH heads does one widening per NH FMAs
 * in the scores (K) and in the outputs (V) alike.  On a core that runs the widening on its FMA
 * pipes, the fp16 rate over the fp32 one bounds the fraction of the FMA peak fp16 attention can
 * reach at that group size.  Prints GFLOP/s (best of 7 rounds) per NH and the fp16 / fp32 ratio;
 * an argument scales the rounds' length (default 1: about 10 s in all).
 * Build and run (python bench/fp16_widen_cost.py does both):
 *
 *   gcc -O2 -std=c11 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c \
 *       bench/fp16_widen_cost.c -o /tmp/fp16_widen_cost
 *   /tmp/fp16_widen_cost [length]
 */
#define _POSIX_C_SOURCE 199309L
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#define ROWS 16   /* rows per block (KV_B) */
#define COLS 128  /* head dim: the tile covers COLS / 16 / CG column groups per block */

static float weights[8 * ROWS] __attribute__((aligned(64)));
static uint16_t v16[ROWS * COLS] __attribute__((aligned(64)));
static float v32[ROWS * COLS] __attribute__((aligned(64)));
static float acc[8 * COLS] __attribute__((aligned(64)));

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline __m512 load_f32(int64_t j, int64_t c) { return _mm512_load_ps(v32 + j * COLS + c); }
static inline __m512 load_f16(int64_t j, int64_t c) { return _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(v16 + j * COLS + c))); }
static inline __m512 load_int(int64_t j, int64_t c)
{
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i *)(v16 + j * COLS + c)));
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(w, 13), _mm512_set1_epi32(112 << 23)));
}

/* blocks passes of the tile over a block of V: acc[i][c] += sum_j weights[i][j] V[j][c] */
#define TILE(NAME, NH, LOAD)                                                                   \
    static __attribute__((noinline)) void NAME(int64_t blocks)                                  \
    {                                                                                           \
        enum { CG = 16 / NH };                                                                  \
        for (int64_t b = 0; b < blocks; b++)                                                    \
            for (int64_t c = 0; c < COLS; c += 16 * CG) {                                       \
                __m512 x[NH * CG];                                                              \
                _Pragma("GCC unroll 16") for (int k = 0; k < NH * CG; k++)                      \
                    x[k] = _mm512_load_ps(acc + (k / CG) * COLS + c + (k % CG) * 16);            \
                for (int64_t j = 0; j < ROWS; j++) {                                            \
                    __m512 w[NH];                                                               \
                    _Pragma("GCC unroll 8") for (int i = 0; i < NH; i++)                        \
                        w[i] = _mm512_set1_ps(weights[i * ROWS + j]);                           \
                    _Pragma("GCC unroll 8") for (int u = 0; u < CG; u++) {                      \
                        const __m512 vc = LOAD(j, c + u * 16);                                  \
                        _Pragma("GCC unroll 8") for (int i = 0; i < NH; i++)                    \
                            x[i * CG + u] = _mm512_fmadd_ps(w[i], vc, x[i * CG + u]);           \
                    }                                                                           \
                }                                                                               \
                _Pragma("GCC unroll 16") for (int k = 0; k < NH * CG; k++)                      \
                    _mm512_store_ps(acc + (k / CG) * COLS + c + (k % CG) * 16, x[k]);            \
            }                                                                                   \
    }
TILE(f32_2, 2, load_f32) TILE(f16_2, 2, load_f16) TILE(int_2, 2, load_int)
TILE(f32_4, 4, load_f32) TILE(f16_4, 4, load_f16) TILE(int_4, 4, load_int)
TILE(f32_8, 8, load_f32) TILE(f16_8, 8, load_f16) TILE(int_8, 8, load_int)

/* GFLOP/s of fn (NH heads), best of 7 rounds of `blocks` blocks */
static double rate(void (*fn)(int64_t), int nh, int64_t blocks)
{
    fn(blocks / 10 + 1);
    double best = 1e30;
    for (int r = 0; r < 7; r++) {
        const double t0 = now();
        fn(blocks);
        const double t = now() - t0;
        best = t < best ? t : best;
    }
    return 2.0 * nh * ROWS * COLS * (double)blocks / best / 1e9;
}

int main(int argc, char **argv)
{
    double scale = 1.0;
    if (argc > 1 && (sscanf(argv[1], "%lf", &scale) != 1 || !(scale > 0.0 && scale <= 100.0))) {
        fprintf(stderr, "usage: %s [length in (0, 100]]\n", argv[0]);
        return 2;
    }
    for (int i = 0; i < 8 * ROWS; i++)
        weights[i] = 1e-7f;
    for (int i = 0; i < ROWS * COLS; i++) {
        v16[i] = 0x3c00;   /* 1.0 */
        v32[i] = 1.0f;
    }
    void (*fns[3][3])(int64_t) = {{f32_2, f16_2, int_2}, {f32_4, f16_4, int_4}, {f32_8, f16_8, int_8}};
    const int nhs[3] = {2, 4, 8};
    printf("heads  fp32 GFLOP/s  fp16 GFLOP/s  int GFLOP/s  fp16/fp32  int/fp32\n");
    for (int k = 0; k < 3; k++) {
        const int64_t blocks = (int64_t)(scale * 3200000.0 / nhs[k]) + 10;
        const double a = rate(fns[k][0], nhs[k], blocks), b = rate(fns[k][1], nhs[k], blocks),
                     c = rate(fns[k][2], nhs[k], blocks);
        printf("%5d  %12.1f  %12.1f  %11.1f  %9.3f  %8.3f\n", nhs[k], a, b, c, b / a, c / a);
    }
    return 0;
}
