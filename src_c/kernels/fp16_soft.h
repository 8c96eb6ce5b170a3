/* fp16_soft.h - bit-exact float <-> half conversion in plain integer C.
 *
 * Matches NumPy's float16 casts bit for bit: round-to-nearest-even, overflow to inf,
 * subnormals, and NaN handled as NumPy does (the payload's top bits are kept and a NaN
 * never turns into inf; nothing is quieted).  Hardware F16C/AVX-512 conversions quiet
 * NaNs, so the SIMD rows use these routines to patch NaN lanes.
 */
#ifndef KV_FP16_SOFT_H
#define KV_FP16_SOFT_H
#include <stdint.h>

typedef union { float f; uint32_t u; } kv_f32bits;

static inline uint16_t kv_f2h_soft(float value)
{
    kv_f32bits b;
    b.f = value;
    const uint32_t sign = (b.u >> 16) & 0x8000u;
    const uint32_t ax = b.u & 0x7fffffffu;
    if (ax >= 0x7f800000u) {                       /* inf or NaN */
        if (ax == 0x7f800000u)
            return (uint16_t)(sign | 0x7c00u);
        uint32_t h = 0x7c00u | ((ax & 0x7fffffu) >> 13);
        if ((h & 0x3ffu) == 0)
            h |= 1u;                                /* keep it a NaN */
        return (uint16_t)(sign | h);
    }
    if (ax >= 0x477ff000u)                          /* >= 65520 rounds to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (ax >= 0x38800000u) {                        /* normal half: >= 2^-14 */
        const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
        return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
    }
    if (ax < 0x33000000u)                           /* < 2^-25: rounds to zero */
        return (uint16_t)sign;
    /* subnormal half: value / 2^-24 rounded to nearest even */
    const uint32_t e = ax >> 23;                    /* 102 .. 112 */
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;                /* 14 .. 24 */
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u)))
        q++;
    return (uint16_t)(sign | q);
}

static inline float kv_h2f_soft(uint16_t h)
{
    const uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    kv_f32bits b;
    if (e == 0x1fu) {
        b.u = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        b.u = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m == 0) {
        b.u = sign;
    } else {
        e = 113u;
        while (!(m & 0x400u)) {
            m <<= 1;
            e--;
        }
        b.u = sign | (e << 23) | ((m & 0x3ffu) << 13);
    }
    return b.f;
}

#endif
