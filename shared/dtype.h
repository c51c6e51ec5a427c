// shared/dtype.h — exact conversions between the 16-bit float formats found in model files and fp32.
//
// bf16 and fp16 values are carried as their raw uint16_t bit patterns (little-endian in files).
// bf16 -> fp32 and fp16 -> fp32 are exact (every bf16/fp16 value is an fp32 value).
// fp32 -> bf16 / fp16 round to nearest, ties to even, like PyTorch's .to(torch.bfloat16 / torch.float16);
// NaN stays NaN (sign and the top payload bits kept, quiet bit set) instead of rounding into infinity.
#ifndef TANDEM_SHARED_DTYPE_H
#define TANDEM_SHARED_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline float dtype_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t dtype_f32_to_bf16(float f);
float dtype_f16_to_f32(uint16_t h);
uint16_t dtype_f32_to_f16(float f);

// Array forms. Source and destination may be unaligned (they read and write through memcpy), because
// tensor data inside a safetensors file is only guaranteed byte alignment.
void dtype_bf16_to_f32_n(float *dst, const void *src, size_t n);
void dtype_f16_to_f32_n(float *dst, const void *src, size_t n);
void dtype_f32_to_bf16_n(void *dst, const float *src, size_t n);
void dtype_f32_to_f16_n(void *dst, const float *src, size_t n);

#endif
