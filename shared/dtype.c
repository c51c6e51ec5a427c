// shared/dtype.c — bf16/fp16 <-> fp32 conversions (see dtype.h for the rounding rules).
#include "shared/dtype.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tandem reads little-endian model files by memcpy and assumes a little-endian host"
#endif

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t dtype_f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)          // NaN: truncating could give infinity, so force the quiet bit
        return (uint16_t)((x >> 16) | 0x0040u);
    // Round to nearest even on the 16 dropped bits; a carry correctly ripples into the exponent (and up to inf).
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

float dtype_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
        // zero or subnormal: mant * 2^-24, exact in fp32
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));   // inf / NaN (payload kept)
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));         // rebias 15 -> 127
}

uint16_t dtype_f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN, quiet
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // >= 65520 rounds to inf (65504 is the max)
    if (ax < 0x38800000u) {
        // Below the smallest fp16 normal (2^-14): the result is a subnormal, a count of 2^-24 steps.
        uint32_t e = ax >> 23;
        if (e < 102) return sign;                  // < 2^-25: rounds to zero (2^-25 itself ties to even 0)
        uint32_t m = (ax & 0x7fffffu) | 0x800000u; // value = m * 2^(e-150)
        uint32_t shift = 126u - e;                 // 14..24: m * 2^(e-150) / 2^-24 = m >> shift
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) r++;  // may carry into the smallest normal: still right
        return (uint16_t)(sign | r);
    }
    uint32_t h = ax - 0x38000000u;                 // rebias 127 -> 15 (exponent field stays in place)
    h += 0xfffu + ((h >> 13) & 1u);                // round to nearest even on the 13 dropped bits
    return (uint16_t)(sign | (h >> 13));
}

// The array forms are written without branches or calls so that the compiler vectorizes them (weight pushes convert
// billions of values); each element gets exactly the scalar function's result.
void dtype_bf16_to_f32_n(float *dst, const void *src, size_t n) {
    const unsigned char *s = src;
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, s + 2 * i, 2);
        const uint32_t u = (uint32_t)h << 16;
        memcpy(dst + i, &u, sizeof u);
    }
}

void dtype_f16_to_f32_n(float *dst, const void *src, size_t n) {
    const unsigned char *s = src;
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, s + 2 * i, 2);
        dst[i] = dtype_f16_to_f32(h);
    }
}

void dtype_f32_to_bf16_n(void *dst, const float *src, size_t n) {
    unsigned char *d = dst;
    for (size_t i = 0; i < n; i++) {
        uint32_t x;
        memcpy(&x, src + i, sizeof x);
        const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16, quiet = (x >> 16) | 0x0040u;
        const uint16_t h = (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);   // dtype_f32_to_bf16
        memcpy(d + 2 * i, &h, 2);
    }
}

void dtype_f32_to_f16_n(void *dst, const float *src, size_t n) {
    unsigned char *d = dst;
    for (size_t i = 0; i < n; i++) {
        float f;
        memcpy(&f, src + i, sizeof f);
        uint16_t h = dtype_f32_to_f16(f);
        memcpy(d + 2 * i, &h, 2);
    }
}
