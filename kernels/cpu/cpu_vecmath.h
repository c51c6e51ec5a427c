// kernels/cpu/cpu_vecmath.h — row primitives that the compiler can vectorize under the project's flags
// (-O3 -march=x86-64-v3, no -ffast-math), shared by the softmax-style kernels (attention, log-softmax,
// SwiGLU's sigmoid): cpu_vexp (exp) and cpu_vmax (maximum of a row).
//
// cpu_vexp. Why not expf(): glibc's vector expf is only offered under -ffast-math, so a loop over expf() runs
// one scalar call per element (~15 cycles); softmax over a vocabulary row or an attention score tile
// would then cost more than the GEMMs around it. This version is branch-free straight-line float and
// integer code, so a loop calling it becomes AVX2 code, and it stays within 1 ulp of exp (checked by
// tests/unit/test_kernels_fwd.c over the whole float range that does not round to 0 or inf):
//   exp(x) = 2^n * exp(r),  n = round(x / ln2),  r = rh + c = x - n ln2 (Cody-Waite split: rh = x - n ln2_hi
//   is exact, c = -n ln2_lo is tiny, |r| <= ln2/2),
//   exp(r) = (1 + rh) + (c + r^2 q(r)), q the Taylor polynomial of (exp(r) - 1 - r) / r^2 to degree 5
//   (truncation < 6e-9 relative, below half an ulp), 1 + rh kept exactly as a pair hi + lo (Fast2Sum),
//   2^n applied as two normal powers of two so results down to the subnormal range stay exact.
// Why the pair: the bound must hold under whatever flags the file is built with. Plain Horner for exp(r)
// needs the compiler to contract p * r + 1 into one FMA (GCC does under -march with FMA and its default
// -ffp-contract=fast); without FMA (Debug and sanitizer builds, TANDEM_CPU_ARCH=x86-64, -ffp-contract=off)
// its last steps round twice and it reached 1.16 ulp. With the pair only the final addition rounds at the
// result's scale: at most 0.77 ulp over every float in [-110, 100], with and without FMA (GCC and clang).
// Outside [-104, 88.8] the result is forced to 0 or +inf with integer masks (inside, the arithmetic itself
// rounds to 0 below the smallest subnormal and to +inf past the overflow point); NaN stays NaN.
// Why masks and not float clamps or selects: under the default -ftrapping-math, GCC threads a clamp into a
// separate path whose constant-folded arithmetic "could trap", refuses to if-convert it, and the loop stays
// scalar. Integer masks on the result's bits keep the body straight-line, and loops calling this vectorize.
#ifndef TANDEM_KERNELS_CPU_VECMATH_H
#define TANDEM_KERNELS_CPU_VECMATH_H

#include <stdint.h>
#include <string.h>

static inline float cpu_vexp(float x) {
    // Round x / ln2 to the nearest integer with the 1.5 * 2^23 trick: the integer lands in the low
    // mantissa bits, readable as an int without a float->int conversion (undefined for NaN or huge x).
    const float magic = 12582912.0f;
    float nf = x * 1.44269504088896341f + magic;
    uint32_t nbits, mbits;
    memcpy(&nbits, &nf, sizeof nbits);
    memcpy(&mbits, &magic, sizeof mbits);
    const int32_t n = (int32_t)(nbits - mbits);
    nf -= magic;
    // ln2 high part: few mantissa bits, so nf * it is exact, and so is the difference (Sterbenz).
    const float rh = x - nf * 0.693145751953125f;
    const float c = -(nf * 1.428606765330187045e-06f); // ln2 low part
    const float r = rh + c;
    float q = 1.0f / 5040.0f;
    q = q * r + 1.0f / 720.0f;
    q = q * r + 1.0f / 120.0f;
    q = q * r + 1.0f / 24.0f;
    q = q * r + 1.0f / 6.0f;
    q = q * r + 0.5f;
    const float hi = 1.0f + rh;
    const float lo = (1.0f - hi) + rh; // hi + lo == 1 + rh exactly (|rh| < 1)
    const float p = hi + (lo + (c + r * r * q));
    // In range n lies in [-150, 128]; split it in two halves so that both 2^half factors are normal floats.
    // Out of range the bits are garbage (wrapping unsigned arithmetic, no undefined behaviour) and masked below.
    const int32_t n1 = n / 2, n2 = n - n1;
    const uint32_t s1bits = ((uint32_t)n1 + 127u) << 23, s2bits = ((uint32_t)n2 + 127u) << 23;
    float s1, s2;
    memcpy(&s1, &s1bits, sizeof s1);
    memcpy(&s2, &s2bits, sizeof s2);
    const float y = p * s1 * s2;
    uint32_t ybits;
    memcpy(&ybits, &y, sizeof ybits);
    const uint32_t over = 0u - (uint32_t)(x > 88.8f), under = 0u - (uint32_t)(x < -104.0f);
    ybits = (ybits & ~(over | under)) | (over & 0x7f800000u);
    float out;
    memcpy(&out, &ybits, sizeof out);
    return out;
}

// cpu_vmax: max of x[0..n) (-inf for n = 0). A float compare-and-select is not vectorized under
// -ftrapping-math (the ordered compare may raise on NaN), so the loop compares integer keys instead: the
// map b -> b ^ ((b >> 31) & 0x7fffffff) on a float's bits orders every float like signed integers
// (negative floats have their magnitude bits flipped), and it is its own inverse. A positive NaN sorts
// above +inf and comes back as NaN, so a NaN in the row poisons the softmax instead of hiding.
static inline int32_t cpu_float_key(float x) {
    int32_t b;
    memcpy(&b, &x, sizeof b);
    return b ^ ((b >> 31) & 0x7fffffff);
}

static inline float cpu_vmax(const float *restrict x, int n) {
    int32_t m = cpu_float_key(-__builtin_inff());
    for (int i = 0; i < n; i++) {
        const int32_t k = cpu_float_key(x[i]);
        m = k > m ? k : m;
    }
    m = m ^ ((m >> 31) & 0x7fffffff);
    float out;
    memcpy(&out, &m, sizeof out);
    return out;
}

#endif
