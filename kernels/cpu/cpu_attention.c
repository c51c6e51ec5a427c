// kernels/cpu/cpu_attention.c — causal grouped-query attention for training, over packed sequences.
//
// Layout: q, out, dq (N, Hq, D); k, v, dk, dv (N, Hkv, D); lse (N, Hq); sequence b holds the tokens
// [cu_seqlens[b], cu_seqlens[b+1]); query head h reads kv head h / (Hq / Hkv).
//
// The work is tiled the way flash attention tiles it: for one (sequence, query head), a tile of ATT_BQ
// queries meets the keys of its causal prefix ATT_BK at a time. Scores of one tile pair live in a fixed
// stack buffer (ATT_BQ x ATT_BK, never a (T x T) matrix), and every product of the tile pair is one sgemm
// that reads q, k, v and writes out / dq / dk / dv in place through their row strides (Hq * D, Hkv * D).
//   forward : S = scale Q K^T; online softmax across key tiles (running max m and sum l per query row,
//             the partial output rescaled by exp(m_old - m_new)); O += P V; at the end O /= l and
//             lse = m + log l.
//   backward: P is recomputed as exp(S - lse) (no probabilities saved), D_i = rowsum(dO_i * O_i),
//             dP = dO V^T, dS = P * (dP - D_i), then dV += P^T dO, dK += scale dS^T Q, dQ += scale dS K.
// Threads (cpu_parallel.h): the forward splits over (sequence, query head), the backward over (sequence,
// kv head) so that the dk/dv rows summed over a group's query heads belong to one thread; every output
// element is written by one thread in a fixed order, so results do not depend on the thread count.
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
// After cpu_ops.h: OpenBLAS's cblas.h pulls in <complex.h>, whose macro I would rewrite the parameter
// named I in cpu_ops.h's prototypes.
#include <cblas.h>
#include "kernels/cpu/cpu_parallel.h"
#include "kernels/cpu/cpu_vecmath.h"

// Tile sizes: large enough that each sgemm amortizes OpenBLAS's packing, small enough that the two score
// tiles of the backward (2 x 32 KiB) sit on the stack and in L2. 64 query rows waste less work on the
// half-masked diagonal tiles than 128; measured on a sweep of 32..256 x 64..256 (D = 64, sequences of 128 to
// 2048 tokens), 64 x 128 was the fastest or within noise of it.
enum { ATT_BQ = 64, ATT_BK = 128 };

// Sequence b's first token and length; 0 when the offsets are not a valid non-empty range inside N
// (there is no error channel at this level: such a sequence is left untouched rather than read out of bounds).
static int sequence_range(const int32_t *cu_seqlens, int b, int N, int *start, int *len) {
    const int s0 = cu_seqlens[b], s1 = cu_seqlens[b + 1];
    if (s0 < 0 || s1 > N || s1 <= s0) return 0;
    *start = s0;
    *len = s1 - s0;
    return 1;
}

// Number of keys of the tile starting at key k0 (bk wide) that query q (same sequence) may see: q >= key.
static inline int causal_width(int q, int k0, int bk) {
    const int w = q - k0 + 1;
    return w < 0 ? 0 : (w > bk ? bk : w);
}

static inline float sum_of(const float *restrict x, int n) {
    float acc[8] = {0};
    int c = 0;
    for (; c + 8 <= n; c += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[c + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; c < n; c++) s += x[c];
    return s;
}

// Geometry shared by the per-(sequence, head) workers.
typedef struct {
    int Hq, Hkv, D, group;
    size_t qs, ks; // row strides of q/out (Hq * D) and k/v (Hkv * D)
    float scale;
} AttnShape;

static AttnShape attn_shape(int Hq, int Hkv, int D, float scale) {
    AttnShape a = {Hq, Hkv, D, Hq / Hkv, (size_t)Hq * D, (size_t)Hkv * D, scale};
    return a;
}

// Forward of query head h over one sequence of L tokens starting at token s0.
static void fwd_head(float *out, float *lse, const float *q, const float *k, const float *v, int s0, int L, int h,
                     const AttnShape *a) {
    const int D = a->D;
    const size_t qs = a->qs, ks = a->ks;
    float S[ATT_BQ * ATT_BK];         // scores, then probabilities, of one tile pair
    float mrow[ATT_BQ], lrow[ATT_BQ]; // running max and sum per query row
    const float *Kh = k + (size_t)s0 * ks + (size_t)(h / a->group) * D;
    const float *Vh = v + (size_t)s0 * ks + (size_t)(h / a->group) * D;
    for (int q0 = 0; q0 < L; q0 += ATT_BQ) {
        const int bq = L - q0 < ATT_BQ ? L - q0 : ATT_BQ;
        const float *Q = q + (size_t)(s0 + q0) * qs + (size_t)h * D;
        float *O = out + (size_t)(s0 + q0) * qs + (size_t)h * D;
        const int kend = q0 + bq; // causal: this query tile sees keys [0, kend)
        for (int k0 = 0; k0 < kend; k0 += ATT_BK) {
            const int bk = kend - k0 < ATT_BK ? kend - k0 : ATT_BK;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bq, bk, D, a->scale, Q, (int)qs,
                        Kh + (size_t)k0 * ks, (int)ks, 0.0f, S, ATT_BK);
            for (int i = 0; i < bq; i++) {
                float *restrict Si = S + (size_t)i * ATT_BK;
                const int w = causal_width(q0 + i, k0, bk);
                // Keys past the diagonal get probability 0, so the P V product below ignores them.
                for (int j = w; j < bk; j++) Si[j] = 0.0f;
                if (w == 0) continue; // the first key tile always has w >= 1, so m and l exist here
                const float m_old = k0 == 0 ? -INFINITY : mrow[i];
                const float mx = cpu_vmax(Si, w);
                const float m_new = mx > m_old ? mx : m_old;
                for (int j = 0; j < w; j++) Si[j] = cpu_vexp(Si[j] - m_new);
                const float sum = sum_of(Si, w);
                if (k0 == 0) {
                    lrow[i] = sum;
                } else {
                    const float alpha = cpu_vexp(m_old - m_new);
                    lrow[i] = lrow[i] * alpha + sum;
                    if (alpha != 1.0f) {
                        float *restrict Oi = O + (size_t)i * qs;
                        for (int d = 0; d < D; d++) Oi[d] *= alpha;
                    }
                }
                mrow[i] = m_new;
            }
            // O (bq, D) = P V on the first key tile, += afterwards.
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, bq, D, bk, 1.0f, S, ATT_BK, Vh + (size_t)k0 * ks,
                        (int)ks, k0 == 0 ? 0.0f : 1.0f, O, (int)qs);
        }
        for (int i = 0; i < bq; i++) {
            float *restrict Oi = O + (size_t)i * qs;
            const float inv = 1.0f / lrow[i];
            for (int d = 0; d < D; d++) Oi[d] *= inv;
            lse[(size_t)(s0 + q0 + i) * a->Hq + h] = mrow[i] + logf(lrow[i]);
        }
    }
}

// Backward of query head h over one sequence; adds into dq (this head's rows) and dk, dv (its kv head's rows).
static void bwd_head(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                     const float *v, const float *out, const float *lse, int s0, int L, int h, const AttnShape *a) {
    const int D = a->D;
    const size_t qs = a->qs, ks = a->ks;
    float P[ATT_BQ * ATT_BK];  // probabilities of one tile pair (bq, bk)
    float dS[ATT_BQ * ATT_BK]; // dP, then dS, of the same tile pair
    float Drow[ATT_BQ], Lrow[ATT_BQ];
    const size_t kv_off = (size_t)s0 * ks + (size_t)(h / a->group) * D;
    const float *Kh = k + kv_off, *Vh = v + kv_off;
    float *dKh = dk + kv_off, *dVh = dv + kv_off;
    for (int q0 = 0; q0 < L; q0 += ATT_BQ) {
        const int bq = L - q0 < ATT_BQ ? L - q0 : ATT_BQ;
        const size_t q_off = (size_t)(s0 + q0) * qs + (size_t)h * D;
        const float *Q = q + q_off, *dO = dout + q_off, *O = out + q_off;
        float *dQ = dq + q_off;
        for (int i = 0; i < bq; i++) {
            const float *restrict x = dO + (size_t)i * qs, *restrict y = O + (size_t)i * qs;
            double s = 0.0;
            for (int d = 0; d < D; d++) s += (double)x[d] * y[d];
            Drow[i] = (float)s;
            Lrow[i] = lse[(size_t)(s0 + q0 + i) * a->Hq + h];
        }
        const int kend = q0 + bq;
        for (int k0 = 0; k0 < kend; k0 += ATT_BK) {
            const int bk = kend - k0 < ATT_BK ? kend - k0 : ATT_BK;
            const float *Kt = Kh + (size_t)k0 * ks, *Vt = Vh + (size_t)k0 * ks;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bq, bk, D, a->scale, Q, (int)qs, Kt, (int)ks, 0.0f,
                        P, ATT_BK);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bq, bk, D, 1.0f, dO, (int)qs, Vt, (int)ks, 0.0f, dS,
                        ATT_BK);
            for (int i = 0; i < bq; i++) {
                float *restrict Pi = P + (size_t)i * ATT_BK, *restrict dSi = dS + (size_t)i * ATT_BK;
                const int w = causal_width(q0 + i, k0, bk);
                const float li = Lrow[i], di = Drow[i];
                for (int j = 0; j < w; j++) {
                    const float p = cpu_vexp(Pi[j] - li);
                    Pi[j] = p;
                    dSi[j] = p * (dSi[j] - di);
                }
                for (int j = w; j < bk; j++) Pi[j] = dSi[j] = 0.0f;
            }
            // dV (bk, D) += P^T dO ; dK (bk, D) += scale dS^T Q ; dQ (bq, D) += scale dS K
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, bk, D, bq, 1.0f, P, ATT_BK, dO, (int)qs, 1.0f,
                        dVh + (size_t)k0 * ks, (int)ks);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, bk, D, bq, a->scale, dS, ATT_BK, Q, (int)qs, 1.0f,
                        dKh + (size_t)k0 * ks, (int)ks);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, bq, D, bk, a->scale, dS, ATT_BK, Kt, (int)ks, 1.0f,
                        dQ, (int)qs);
        }
    }
}

void cpu_attention_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                       const int32_t *cu_seqlens, int B, int N, int Hq, int Hkv, int D, float scale) {
    if (Hkv <= 0 || Hq % Hkv != 0 || D <= 0 || B <= 0) return;
    const AttnShape a = attn_shape(Hq, Hkv, D, scale);
    const int blas_threads = cpu_blas_threads_begin_single();
    const long items = (long)B * Hq; // (sequence, query head); dynamic: sequence lengths differ
    CPU_OMP("omp parallel for schedule(dynamic, 1)")
    for (long it = 0; it < items; it++) {
        int s0, L;
        if (sequence_range(cu_seqlens, (int)(it / Hq), N, &s0, &L))
            fwd_head(out, lse, q, k, v, s0, L, (int)(it % Hq), &a);
    }
    cpu_blas_threads_restore(blas_threads);
}

void cpu_attention_bwd(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                       const float *v, const float *out, const float *lse, const int32_t *cu_seqlens, int B, int N,
                       int Hq, int Hkv, int D, float scale) {
    if (Hkv <= 0 || Hq % Hkv != 0 || D <= 0 || N <= 0) return;
    const AttnShape a = attn_shape(Hq, Hkv, D, scale);
    // Overwrite semantics: start from zero, then every tile pair adds its share (dk, dv also sum over the
    // query heads of a group).
    memset(dq, 0, (size_t)N * a.qs * sizeof(float));
    memset(dk, 0, (size_t)N * a.ks * sizeof(float));
    memset(dv, 0, (size_t)N * a.ks * sizeof(float));
    if (B <= 0) return;
    const int blas_threads = cpu_blas_threads_begin_single();
    const long items = (long)B * Hkv; // (sequence, kv head): owns its dk/dv rows and its query heads' dq rows
    CPU_OMP("omp parallel for schedule(dynamic, 1)")
    for (long it = 0; it < items; it++) {
        int s0, L;
        if (!sequence_range(cu_seqlens, (int)(it / Hkv), N, &s0, &L)) continue;
        const int g = (int)(it % Hkv);
        for (int h = g * a.group; h < (g + 1) * a.group; h++)
            bwd_head(dq, dk, dv, dout, q, k, v, out, lse, s0, L, h, &a);
    }
    cpu_blas_threads_restore(blas_threads);
}
