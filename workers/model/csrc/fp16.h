// fp16 <-> float32 in scalar C, as F16C's conversions (exact one way, rounded to nearest
// even the other): the portable builds' path.
#ifndef KVSERVE_FP16_H
#define KVSERVE_FP16_H
#include <stdint.h>
#include <string.h>

static inline float fp16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; --exp; }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// float32 -> fp16, rounded to nearest even as F16C's _cvtss_sh and torch's .half() round:
// out of range gives infinity, NaN stays NaN, below 2^-14 gives fp16's subnormals.
static inline uint16_t f32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7FFFFFFFu;
    if (x >= 0x7F800000u) return sign | 0x7C00 | (x > 0x7F800000u ? 0x200 : 0);
    if (x >= 0x477FF000u) return sign | 0x7C00;  // 65520 and above round to infinity
    if (x < 0x38800000u) {  // below 2^-14: adding 0.5 leaves the subnormal's bits, rounded
        float a;
        memcpy(&a, &x, 4);
        a += 0.5f;
        uint32_t r;
        memcpy(&r, &a, 4);
        return sign | (uint16_t)(r - 0x3F000000u);
    }
    // rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even
    x += 0xC8000FFFu + ((x >> 13) & 1);
    return sign | (uint16_t)(x >> 13);
}
#endif
