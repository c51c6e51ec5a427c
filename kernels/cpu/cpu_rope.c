// kernels/cpu/cpu_rope.c — rotary position embedding in Hugging Face's "rotate_half" layout: within each
// head of D values, element i pairs with element i + D/2 (i < D/2) and the pair turns by the angle
// pos * inv_freq[i], computed in fp32 as transformers does (cos and sin of the fp32 product).
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

// Angles are shared by every head of a token: compute cos/sin for a chunk of frequencies once per token,
// then sweep the heads. The fixed chunk keeps the tables on the stack for any head size.
enum { ROPE_CHUNK = 256 };

// sign = +1: forward rotation  out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin.
// sign = -1: its transpose (the backward), the same formulas with sin negated.
// x (N, H, D) in place; positions (N); inv_freq (D/2). An odd D leaves the last element of a head as is.
static void rope_rotate(float *x, const int32_t *positions, const float *inv_freq, int N, int H, int D, float sign) {
    const int half = D / 2;
    float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
    for (int n = 0; n < N; n++) {
        const float pos = (float)positions[n];
        for (int i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
            const int len = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
            for (int i = 0; i < len; i++) {
                const float angle = pos * inv_freq[i0 + i];
                cs[i] = cosf(angle);
                sn[i] = sign * sinf(angle);
            }
            for (int h = 0; h < H; h++) {
                float *restrict x1 = x + ((size_t)n * H + h) * D + i0;
                float *restrict x2 = x1 + half;
                for (int i = 0; i < len; i++) {
                    const float a = x1[i], b = x2[i];
                    x1[i] = a * cs[i] - b * sn[i];
                    x2[i] = b * cs[i] + a * sn[i];
                }
            }
        }
    }
}

void cpu_rope_fwd(float *x, const int32_t *positions, const float *inv_freq, int N, int H, int D) {
    rope_rotate(x, positions, inv_freq, N, H, D, 1.0f);
}

void cpu_rope_bwd(float *dx, const int32_t *positions, const float *inv_freq, int N, int H, int D) {
    rope_rotate(dx, positions, inv_freq, N, H, D, -1.0f);
}

// The fused split / pack: each token's rows are copied, then turned by rope_rotate on that one token, so the values
// are the ones rope_fwd / rope_bwd compute on the copies (the same function, the same float operations).
void cpu_qkv_rope_fwd(float *q, float *k, float *v, const float *qkv, const int32_t *positions,
                      const float *inv_freq, int N, int Hq, int Hkv, int D) {
    const size_t QD = (size_t)Hq * D, KVD = (size_t)Hkv * D, QKV = QD + 2 * KVD;
    for (int n = 0; n < N; n++) {
        const float *row = qkv + (size_t)n * QKV;
        float *qn = q + (size_t)n * QD, *kn = k + (size_t)n * KVD;
        memcpy(qn, row, QD * sizeof *row);
        memcpy(kn, row + QD, KVD * sizeof *row);
        memcpy(v + (size_t)n * KVD, row + QD + KVD, KVD * sizeof *row);
        rope_rotate(qn, positions + n, inv_freq, 1, Hq, D, 1.0f);
        rope_rotate(kn, positions + n, inv_freq, 1, Hkv, D, 1.0f);
    }
}

// The same with k and v landing in the cache rows slot_mapping[n] (skipped when negative), turned there.
void cpu_qkv_rope_store_fwd(float *q, float *k_cache, float *v_cache, const int32_t *slot_mapping, const float *qkv,
                            const int32_t *positions, const float *inv_freq, int N, int Hq, int Hkv, int D) {
    const size_t QD = (size_t)Hq * D, KVD = (size_t)Hkv * D, QKV = QD + 2 * KVD;
    for (int n = 0; n < N; n++) {
        const float *row = qkv + (size_t)n * QKV;
        float *qn = q + (size_t)n * QD;
        memcpy(qn, row, QD * sizeof *row);
        rope_rotate(qn, positions + n, inv_freq, 1, Hq, D, 1.0f);
        const int slot = slot_mapping[n];
        if (slot < 0) continue;
        float *kn = k_cache + (size_t)slot * KVD;
        memcpy(kn, row + QD, KVD * sizeof *row);
        memcpy(v_cache + (size_t)slot * KVD, row + QD + KVD, KVD * sizeof *row);
        rope_rotate(kn, positions + n, inv_freq, 1, Hkv, D, 1.0f);
    }
}

void cpu_qkv_rope_bwd(float *dqkv, const float *dq, const float *dk, const float *dv, const int32_t *positions,
                      const float *inv_freq, int N, int Hq, int Hkv, int D) {
    const size_t QD = (size_t)Hq * D, KVD = (size_t)Hkv * D, QKV = QD + 2 * KVD;
    for (int n = 0; n < N; n++) {
        float *row = dqkv + (size_t)n * QKV;
        memcpy(row, dq + (size_t)n * QD, QD * sizeof *row);
        memcpy(row + QD, dk + (size_t)n * KVD, KVD * sizeof *row);
        memcpy(row + QD + KVD, dv + (size_t)n * KVD, KVD * sizeof *row);
        rope_rotate(row, positions + n, inv_freq, 1, Hq, D, -1.0f);
        rope_rotate(row + QD, positions + n, inv_freq, 1, Hkv, D, -1.0f);
    }
}
