/* cpu.c - CPU feature detection with CPUID + XGETBV, and nothing else.
 *
 * An AVX bit in CPUID only says the CPU has the instructions; the OS must also save the
 * wider registers on a context switch, which XCR0 tells (read with XGETBV, legal only
 * when CPUID.1:ECX.OSXSAVE is set).  Freestanding: no libc, so the same machine code
 * also runs inside the instruction-level emulator used by the tests.
 */
#include "kvsimd.h"

#if !(defined(__x86_64__) || defined(_M_X64))
uint32_t kv_cpu_features(void) { return 0; }
#else

static inline void cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4])
{
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

static inline uint64_t xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

#define BIT(x, n) (((x) >> (n)) & 1u)

uint32_t kv_cpu_features(void)
{
    uint32_t r[4], f = 0;
    cpuid(0, 0, r);
    const uint32_t max_leaf = r[0];
    /* "AuthenticAMD" in EBX, EDX, ECX */
    const int amd = r[1] == 0x68747541u && r[3] == 0x69746e65u && r[2] == 0x444d4163u;
    if (max_leaf < 1)
        return 0;
    cpuid(1, 0, r);
    const uint32_t ecx1 = r[2], base_family = (r[0] >> 8) & 0xF;
    const uint32_t family = base_family == 0xF ? base_family + ((r[0] >> 20) & 0xFF) : base_family;
    if (BIT(ecx1, 12)) f |= KV_FEAT_FMA;
    if (BIT(ecx1, 28)) f |= KV_FEAT_AVX;
    if (BIT(ecx1, 29)) f |= KV_FEAT_F16C;
    if (BIT(ecx1, 27)) {
        f |= KV_FEAT_OSXSAVE;
        const uint64_t xcr0 = xgetbv0();
        if ((xcr0 & 0x6) == 0x6) f |= KV_FEAT_OS_YMM;    /* SSE + AVX state */
        if ((xcr0 & 0xE6) == 0xE6) f |= KV_FEAT_OS_ZMM;  /* + opmask, ZMM_Hi256, Hi16_ZMM */
    }
    if (max_leaf >= 7) {
        cpuid(7, 0, r);
        const uint32_t ebx7 = r[1], ecx7 = r[2], edx7 = r[3];
        if (BIT(ebx7, 5)) f |= KV_FEAT_AVX2_ONLY;
        if (BIT(ebx7, 16)) f |= KV_FEAT_AVX512F;
        if (BIT(ebx7, 17)) f |= KV_FEAT_AVX512DQ;
        if (BIT(ebx7, 30)) f |= KV_FEAT_AVX512BW;
        if (BIT(ebx7, 31)) f |= KV_FEAT_AVX512VL;
        if (BIT(ecx7, 11)) f |= KV_FEAT_AVX512VNNI;
        if (BIT(edx7, 23)) f |= KV_FEAT_AVX512_FP16_ONLY;
    }
    const uint32_t avx2 = KV_FEAT_OS_YMM | KV_FEAT_AVX | KV_FEAT_AVX2_ONLY | KV_FEAT_FMA | KV_FEAT_F16C;
    const uint32_t avx512 = avx2 | KV_FEAT_OS_ZMM | KV_FEAT_AVX512F | KV_FEAT_AVX512BW |
                            KV_FEAT_AVX512VL | KV_FEAT_AVX512DQ | KV_FEAT_AVX512VNNI;
    const uint32_t avx512fp16 = avx512 | KV_FEAT_AVX512_FP16_ONLY;
    if ((f & avx2) == avx2) f |= KV_FEAT_AVX2;
    if ((f & avx512) == avx512) f |= KV_FEAT_AVX512;
    if ((f & avx512fp16) == avx512fp16) f |= KV_FEAT_AVX512FP16;
    if (amd && family == 0x19 && (f & KV_FEAT_AVX512F))   /* Zen 4 (Zen 3, also 19h, has no AVX-512) */
        f |= KV_FEAT_SPLIT512;
    return f;
}
#endif
