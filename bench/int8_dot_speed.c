/* int8_dot_speed.c - the scores of one block of 16 int8 keys (one float32 scale per 32 values, as
 * KVCache(dtype="int8") stores them), D = 128, for a group of G query heads, three ways, on the
 * avx512 row (AVX-512 F/BW/VL/DQ/VNNI):
 *
 *   A  the kernel's fp32 widening (attn.inc.h kv_scores, KV_ROWS_I8: what the avx2 row and MHA run
 *      over int8 keys): each key row widened to fp32 in registers and times its block scale, two
 *      keys per vector, fp32 FMAs with the float32 query, one add tree;
 *   B  integer dot products, keys on the lanes: the block widened to int16 and transposed (16x16
 *      dwords: 2 values of d per lane), the query rounded to int16 with one scale per head,
 *      VPDPWSSD (32 products per instruction), then per 32-value block one conversion and one FMA
 *      by the 16 keys' scales;
 *   C  the same with int8 queries (one scale per head and 32-value block, +128 to make them
 *      unsigned) and VPDPBUSD (64 products per instruction), less 128 x the keys' sums.  (The
 *      kernel's own integer form, kv_scores_i8, makes the keys unsigned instead, 8 keys per 256-bit
 *      vector: python bench/attn_rows_l2.py --dtype int8 times it in the whole call.)
 *
 * Nanoseconds per block (best of 5 rounds, the variants alternated; 32 blocks in L1/L2), the speed-up
 * over A, and each variant's largest score error against float64 math on the values the int8 rows
 * stand for, relative to the largest |score|.  Build and run (python bench/int8_dot_speed.py does
 * both, for G = 3, 4, 8, 32):
 *
 *   gcc -O2 -std=c11 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c \
 *       -Isrc_c -Isrc_c/kernels bench/int8_dot_speed.c -o /tmp/int8_dot_speed -lm
 *   /tmp/int8_dot_speed G
 */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "vec_avx512.h"
#define KV_ROW_CFLAGS ""
#define KV_CAT_(a, b) a##_##b
#define KV_CAT(a, b) KV_CAT_(a, b)
#define KV_FN(name) KV_CAT(kv_##name, KV_ISA)
#include "attn.inc.h"

void (*const kv_keep_attn)(const kv_attn_params *, int64_t, int64_t, int64_t, int64_t, void *) = KV_FN(attn);

#define D 128
#define NB (D / 32)
#define MAXG 32

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* A: the kernel's own scores (8 heads at a time, as attn_score_chunk calls them) */
__attribute__((noinline)) static void scores_a(const float *q2, const int8_t *kb, const float *ksc, float *s, vf *red,
                                                int G)
{
    for (int i0 = 0; i0 < G; i0 += KV_GS) {
        const int nh = G - i0 < KV_GS ? G - i0 : KV_GS;
        KV_FN(scores_n)(q2 + i0 * KV_KP * D, kb, KV_ROWS_I8, D, ksc, D, red, nh, NULL, 0, s + i0 * 16, 16);
    }
}

/* r[c] <- dword c of each of the 16 rows r[0..15] (a 16x16 transpose of 32-bit values) */
static inline void tr16x16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* r[4i + m], 128-bit lane L: rows 4i..4i+3 of column 4L + m */
    for (int m = 0; m < 4; m++) {
        const __m512i a = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x88), b = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xDD);
        const __m512i c = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x88), d = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xDD);
        t[m] = _mm512_shuffle_i32x4(a, c, 0x88);
        t[8 + m] = _mm512_shuffle_i32x4(a, c, 0xDD);
        t[4 + m] = _mm512_shuffle_i32x4(b, d, 0x88);
        t[12 + m] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
    for (int i = 0; i < 16; i++)
        r[i] = t[i];
}

/* the 16 keys' scales of block b (ksc: [16][NB]) */
static inline vf key_scales(const float *ksc, int b)
{
    return _mm512_i32gather_ps(_mm512_setr_epi32(0, NB, 2 * NB, 3 * NB, 4 * NB, 5 * NB, 6 * NB, 7 * NB, 8 * NB, 9 * NB,
                                                 10 * NB, 11 * NB, 12 * NB, 13 * NB, 14 * NB, 15 * NB), ksc + b, 4);
}

/* B: qi [G][D] int16, qs [G] (G a compile-time constant where it is inlined) */
static inline __attribute__((always_inline)) void scores_b_(const int16_t *qi, const float *qs, const int8_t *kb,
                                                            const float *ksc, float *s, const int G)
{
    vf tot[MAXG];
    for (int h = 0; h < G; h++)
        tot[h] = _mm512_setzero_ps();
    for (int b = 0; b < NB; b++) {
        __m512i r[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++)
            r[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(kb + j * D + b * 32)));
        tr16x16(r);
        const vf skv = key_scales(ksc, b);
        for (int h = 0; h < G; h++) {
            __m512i acc = _mm512_setzero_si512();
            const int32_t *q32 = (const int32_t *)(qi + h * D + b * 32);
#pragma GCC unroll 16
            for (int c = 0; c < 16; c++)
                acc = _mm512_dpwssd_epi32(acc, r[c], _mm512_set1_epi32(q32[c]));
            tot[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), skv, tot[h]);
        }
    }
    for (int h = 0; h < G; h++)
        _mm512_storeu_ps(s + h * 16, _mm512_mul_ps(tot[h], _mm512_set1_ps(qs[h])));
}

/* C: qu [G][D] uint8 (q / sq + 128), sq [G][NB] */
static inline __attribute__((always_inline)) void scores_c_(const uint8_t *qu, const float *sq, const int8_t *kb,
                                                            const float *ksc, float *s, const int G)
{
    vf tot[MAXG];
    for (int h = 0; h < G; h++)
        tot[h] = _mm512_setzero_ps();
    const __m512i ones = _mm512_set1_epi8(1);
    for (int b = 0; b < NB; b += 2) {   /* a 64-byte row holds two blocks */
        __m512i r[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++)
            r[j] = _mm512_loadu_si512(kb + j * D + b * 32);
        tr16x16(r);   /* r[c]: bytes 4c..4c+3 of the 16 keys; c < 8: block b, c >= 8: block b + 1 */
        for (int half = 0; half < 2; half++) {
            __m512i ks = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++)
                ks = _mm512_dpbusd_epi32(ks, ones, r[8 * half + c]);
            const vf corr = _mm512_mul_ps(_mm512_cvtepi32_ps(ks), _mm512_set1_ps(128.0f));
            const vf skv = key_scales(ksc, b + half);
            for (int h = 0; h < G; h++) {
                __m512i acc = _mm512_setzero_si512();
                const int32_t *q32 = (const int32_t *)(qu + h * D + (b + half) * 32);
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++)
                    acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(q32[c]), r[8 * half + c]);
                const vf dot = _mm512_sub_ps(_mm512_cvtepi32_ps(acc), corr);
                tot[h] = _mm512_fmadd_ps(dot, _mm512_mul_ps(skv, _mm512_set1_ps(sq[h * NB + b + half])), tot[h]);
            }
        }
    }
    for (int h = 0; h < G; h++)
        _mm512_storeu_ps(s + h * 16, tot[h]);
}

/* each head count of the table compiled on its own, as the kernel instantiates its head counts */
#define BY_G(f, ...) switch (G) { case 3: f(__VA_ARGS__, 3); break; case 4: f(__VA_ARGS__, 4); break; \
                                   case 8: f(__VA_ARGS__, 8); break; case 32: f(__VA_ARGS__, 32); break; \
                                   default: f(__VA_ARGS__, G); }
__attribute__((noinline)) static void scores_b(const int16_t *qi, const float *qs, const int8_t *kb, const float *ksc,
                                                float *s, int G)
{
    BY_G(scores_b_, qi, qs, kb, ksc, s)
}
__attribute__((noinline)) static void scores_c(const uint8_t *qu, const float *sq, const int8_t *kb, const float *ksc,
                                                float *s, int G)
{
    BY_G(scores_c_, qu, sq, kb, ksc, s)
}

int main(int argc, char **argv)
{
    const int G = argc > 1 ? atoi(argv[1]) : 8;
    if (G < 1 || G > MAXG)
        return 2;
    enum { NBLK = 32 };
    int8_t *k = aligned_alloc(64, NBLK * 16 * D);
    float *ksc = aligned_alloc(64, NBLK * 16 * NB * 4), *q = aligned_alloc(64, MAXG * D * 4);
    float *q2 = aligned_alloc(64, MAXG * 2 * D * 4), *qs = aligned_alloc(64, MAXG * 4), *sq = aligned_alloc(64, MAXG * NB * 4);
    int16_t *qi = aligned_alloc(64, MAXG * D * 2);
    uint8_t *qu = aligned_alloc(64, MAXG * D);
    float *s[3];
    for (int i = 0; i < 3; i++)
        s[i] = aligned_alloc(64, MAXG * 16 * 4);
    vf *red = aligned_alloc(64, KV_GS * 16 * sizeof(vf));
    srand(1);
    for (int i = 0; i < NBLK * 16 * D; i++)
        k[i] = (int8_t)(rand() % 255 - 127);
    for (int i = 0; i < NBLK * 16 * NB; i++)
        ksc[i] = 0.01f * (float)(1 + rand() % 100) / 100.0f;
    for (int h = 0; h < G; h++) {
        float mx = 0;
        for (int d = 0; d < D; d++) {
            const float x = (float)rand() / (float)RAND_MAX - 0.5f;
            q[h * D + d] = x;
            q2[h * 2 * D + (d / 8) * 16 + d % 8] = q2[h * 2 * D + (d / 8) * 16 + 8 + d % 8] = x;   /* store_query's layout */
            mx = fabsf(x) > mx ? fabsf(x) : mx;
        }
        qs[h] = mx / 32767.0f;
        for (int d = 0; d < D; d++)
            qi[h * D + d] = (int16_t)lrintf(q[h * D + d] / qs[h]);
        for (int b = 0; b < NB; b++) {
            float m = 0;
            for (int d = b * 32; d < b * 32 + 32; d++)
                m = fabsf(q[h * D + d]) > m ? fabsf(q[h * D + d]) : m;
            sq[h * NB + b] = m / 127.0f;
            for (int d = b * 32; d < b * 32 + 32; d++)
                qu[h * D + d] = (uint8_t)(lrintf(q[h * D + d] / sq[h * NB + b]) + 128);
        }
    }
    const long reps = 50000;
    double best[3] = {1e30, 1e30, 1e30};
    for (int round = 0; round < 5; round++)   /* alternated, best of 5 */
        for (int v = 0; v < 3; v++) {
            const double t0 = now();
            for (long r = 0; r < reps; r++)
                for (int b = 0; b < NBLK; b++) {
                    const int8_t *kb = k + b * 16 * D;
                    const float *sb = ksc + b * 16 * NB;
                    if (v == 0)
                        scores_a(q2, kb, sb, s[0], red, G);
                    else if (v == 1)
                        scores_b(qi, qs, kb, sb, s[1], G);
                    else
                        scores_c(qu, sq, kb, sb, s[2], G);
                }
            const double t = now() - t0;
            best[v] = t < best[v] ? t : best[v];
        }
    double err[3] = {0, 0, 0}, top = 0;
    const int8_t *kl = k + (NBLK - 1) * 16 * D;
    const float *sl = ksc + (NBLK - 1) * 16 * NB;
    for (int h = 0; h < G; h++)
        for (int j = 0; j < 16; j++) {
            double r = 0;
            for (int d = 0; d < D; d++)
                r += (double)q[h * D + d] * kl[j * D + d] * sl[j * NB + d / 32];
            for (int v = 0; v < 3; v++)
                err[v] = fmax(err[v], fabs(s[v][h * 16 + j] - r));
            top = fmax(top, fabs(r));
        }
    const char *name[3] = {"A fp32 widening (kernel)", "B int16 q, VPDPWSSD", "C int8 q, VPDPBUSD"};
    for (int v = 0; v < 3; v++)
        printf("G=%-2d %-26s %8.1f ns/block  %.2fx A  max error %.1e of max|s|\n", G, name[v],
               best[v] / reps / NBLK * 1e9, best[0] / best[v], err[v] / top);
    return 0;
}
