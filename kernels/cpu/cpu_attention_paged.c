// kernels/cpu/cpu_attention_paged.c — the paged KV cache of the rollout server: storing new tokens' k/v into
// their slots, and attention of query tokens (prefill chunks and decodes alike) through block tables.
//
// Cache layout: k_cache, v_cache (n_slots, Hkv, D) with n_slots = n_blocks * block_size; the k/v of position
// pos of a sequence whose block table is T live in slot T[pos / block_size] * block_size + pos % block_size.
// The positions of one block are consecutive slots, so attention walks the context block by block with an
// online softmax (running max and sum, output rescaled when the max grows) and needs no buffer that grows
// with the context.
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_vecmath.h"

// k, v (N, Hkv, D) -> the slots slot_mapping (N); a negative slot (padding) is skipped.
void cpu_kv_cache_store(float *k_cache, float *v_cache, const float *k, const float *v, const int32_t *slot_mapping,
                        int N, int Hkv, int D) {
    const size_t row = (size_t)Hkv * D;
    for (int i = 0; i < N; i++) {
        const int32_t slot = slot_mapping[i];
        if (slot < 0) continue;
        memcpy(k_cache + (size_t)slot * row, k + (size_t)i * row, row * sizeof(float));
        memcpy(v_cache + (size_t)slot * row, v + (size_t)i * row, row * sizeof(float));
    }
}

// Scores of one block are computed for at most PA_CHUNK positions at a time (block_size may exceed it).
enum { PA_CHUNK = 128 };

static inline float dot8(const float *restrict a, const float *restrict b, int D) {
    float acc[8] = {0};
    int d = 0;
    for (; d + 8 <= D; d += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[d + j] * b[d + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

// One query head against positions 0..pos of its sequence. qh, o (D); table (max_blocks).
// Returns 0, or -1 when the block table does not cover the position range (o is then left to the caller).
static int attend_one(float *restrict o, const float *restrict qh, const float *k_cache, const float *v_cache,
                      const int32_t *table, int pos, int g, int Hkv, int D, int block_size, int max_blocks,
                      float scale) {
    const size_t row = (size_t)Hkv * D;
    float sc[PA_CHUNK];
    float m = -INFINITY, l = 0.0f;
    for (int d = 0; d < D; d++) o[d] = 0.0f;
    const int n_ctx = pos + 1;
    for (int p0 = 0; p0 < n_ctx;) {
        const int lb = p0 / block_size, off = p0 % block_size;
        if (lb >= max_blocks || table[lb] < 0) return -1;
        int len = block_size - off;
        if (len > n_ctx - p0) len = n_ctx - p0;
        if (len > PA_CHUNK) len = PA_CHUNK;
        const size_t slot0 = (size_t)table[lb] * block_size + off;
        const float *K = k_cache + slot0 * row + (size_t)g * D;
        const float *V = v_cache + slot0 * row + (size_t)g * D;
        float mx = -INFINITY;
        for (int j = 0; j < len; j++) {
            sc[j] = scale * dot8(qh, K + (size_t)j * row, D);
            mx = sc[j] > mx ? sc[j] : mx;
        }
        const float m_new = mx > m ? mx : m;
        const float alpha = cpu_vexp(m - m_new); // 0 on the first chunk (m = -inf), when o is still zero
        float sum = 0.0f;
        for (int j = 0; j < len; j++) {
            sc[j] = cpu_vexp(sc[j] - m_new);
            sum += sc[j];
        }
        l = l * alpha + sum;
        m = m_new;
        if (alpha != 1.0f)
            for (int d = 0; d < D; d++) o[d] *= alpha;
        for (int j = 0; j < len; j++) {
            const float p = sc[j];
            const float *restrict Vj = V + (size_t)j * row;
            for (int d = 0; d < D; d++) o[d] += p * Vj[d];
        }
        p0 += len;
    }
    const float inv = 1.0f / l;
    for (int d = 0; d < D; d++) o[d] *= inv;
    return 0;
}

// q, out (N, Hq, D); block_tables (n_seqs, max_blocks); token_seq, token_pos (N).
// A token whose sequence or position has no cache behind it (negative ids, a position past the block table,
// an unassigned block) gets NaN outputs: there is no error channel at this level, and NaN makes the
// mistake visible in the logits instead of reading memory outside the cache.
void cpu_attention_paged_fwd(float *out, const float *q, const float *k_cache, const float *v_cache,
                             const int32_t *block_tables, const int32_t *token_seq, const int32_t *token_pos, int N,
                             int Hq, int Hkv, int D, int block_size, int max_blocks, float scale) {
    if (Hkv <= 0 || Hq % Hkv != 0 || D <= 0 || block_size <= 0 || max_blocks <= 0) return;
    const int group = Hq / Hkv;
    for (int i = 0; i < N; i++) {
        const int seq = token_seq[i], pos = token_pos[i];
        const int32_t *table = block_tables + (size_t)(seq < 0 ? 0 : seq) * max_blocks;
        for (int h = 0; h < Hq; h++) {
            float *o = out + ((size_t)i * Hq + h) * D;
            const float *qh = q + ((size_t)i * Hq + h) * D;
            if (seq < 0 || pos < 0 ||
                attend_one(o, qh, k_cache, v_cache, table, pos, h / group, Hkv, D, block_size, max_blocks, scale)) {
                for (int d = 0; d < D; d++) o[d] = NAN;
            }
        }
    }
}
