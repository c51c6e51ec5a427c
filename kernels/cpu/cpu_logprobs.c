// kernels/cpu/cpu_logprobs.c — log-softmax of logits / temperature, the gathered per-token logprob, the
// log-sum-exp and the entropy of each row, and the gradient of the logprobs. A row is a vocabulary
// (10^4..10^5 wide), so everything is a streaming pass: max, then one pass of exp with the sums.
//
// Numerics: with z = logits * inv_temperature, m = max z, y = z - m (<= 0, no overflow for any logits),
//   S = sum exp(y),  lse = m + log S,  logprob = y[target] - log S,
//   entropy = -sum p log p = log S - sum exp(y) * y / S.
// Working with y instead of z keeps the result accurate when the logits are large (z ~ 1e4: z - lse would
// cancel to a few digits, y[target] - log S does not).
#include <math.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_parallel.h"
#include "kernels/cpu/cpu_vecmath.h"

// Rows are handled in chunks: exponentials go to a stack buffer in one vectorizable loop, then eight float
// lanes sum the chunk and the chunk sums are added in double (a float running sum over 10^5 terms would
// lose ~1e-4 relative; this stays near float rounding).
enum { LP_CHUNK = 1024 };

// max over j of x[j] * s. Rounding is monotonic, so for s > 0 this is max(x) * s exactly, and the max runs
// vectorized; a non-positive inverse temperature (meaningless, but not worth a crash) takes a plain loop.
static float row_max_scaled(const float *restrict x, int V, float s) {
    if (s > 0.0f) return cpu_vmax(x, V) * s;
    float m = -INFINITY;
    for (int c = 0; c < V; c++) m = x[c] * s > m ? x[c] * s : m;
    return m;
}

// Sums over one row: *sum_e = sum exp(y), *sum_ey = sum exp(y) * y, y = x * s - m.
static void row_exp_sums(const float *restrict x, int V, float s, float m, double *sum_e, double *sum_ey) {
    float e[LP_CHUNK], y[LP_CHUNK];
    double se = 0.0, sey = 0.0;
    for (int c0 = 0; c0 < V; c0 += LP_CHUNK) {
        const int len = V - c0 < LP_CHUNK ? V - c0 : LP_CHUNK;
        for (int c = 0; c < len; c++) {
            y[c] = x[c0 + c] * s - m;
            e[c] = cpu_vexp(y[c]);
        }
        float a[8] = {0}, b[8] = {0};
        int c = 0;
        for (; c + 8 <= len; c += 8)
            for (int j = 0; j < 8; j++) {
                a[j] += e[c + j];
                b[j] += e[c + j] * y[c + j];
            }
        double ca = 0.0, cb = 0.0;
        for (int j = 0; j < 8; j++) { ca += a[j]; cb += b[j]; }
        for (; c < len; c++) { ca += e[c]; cb += (double)e[c] * y[c]; }
        se += ca;
        sey += cb;
    }
    *sum_e = se;
    *sum_ey = sey;
}

// logits (N, V); targets, logprobs, lse, entropy (N); entropy may be NULL.
// targets[n] < 0: ignored row, logprob 0. targets[n] >= V has no meaning and no error channel here: the
// row's logprob becomes NaN so that the mistake surfaces in the loss instead of reading out of bounds.
void cpu_logprobs_fwd(float *logprobs, float *lse, float *entropy, const float *logits, const int32_t *targets,
                      int N, int V, float inv_temperature) {
    // Rows are independent: each is computed by one thread in a fixed order, so the thread count does not
    // change the result.
    CPU_OMP("omp parallel for schedule(static) if ((long)N * V >= 65536)")
    for (int n = 0; n < N; n++) {
        const float *row = logits + (size_t)n * V;
        const float m = row_max_scaled(row, V, inv_temperature);
        double sum_e, sum_ey;
        row_exp_sums(row, V, inv_temperature, m, &sum_e, &sum_ey);
        const double log_s = log(sum_e);
        lse[n] = (float)((double)m + log_s);
        if (entropy) entropy[n] = (float)(log_s - sum_ey / sum_e);
        const int t = targets[n];
        if (t < 0) logprobs[n] = 0.0f;
        else if (t >= V) logprobs[n] = NAN;
        else logprobs[n] = (float)((double)(row[t] * inv_temperature - m) - log_s);
    }
}

// dlogits (N, V) = dlogprobs[n] * inv_temperature * (onehot(target) - softmax(z)), overwritten; zero rows for
// ignored targets. softmax(z)_j = exp(z_j - lse[n]) with lse from the forward. dlogits may be logits (in place):
// each element is read before it is written, the target's probability before its row is overwritten.
void cpu_logprobs_bwd(float *dlogits, const float *dlogprobs, const float *dentropy, const float *entropy,
                      const float *logits, const int32_t *targets, const float *lse, int N, int V,
                      float inv_temperature) {
    CPU_OMP("omp parallel for schedule(static) if ((long)N * V >= 65536)")
    for (int n = 0; n < N; n++) {
        const float *row = logits + (size_t)n * V;
        float *d = dlogits + (size_t)n * V;
        const int t = targets[n];
        const int scored = t >= 0 && t < V;
        const float g = scored ? dlogprobs[n] * inv_temperature : 0.0f;
        const float l = lse[n];
        if (dentropy) {
            // d entropy / d z_j = -p_j (log p_j + H)
            const float gh = dentropy[n] * inv_temperature, h = entropy[n];
            for (int j = 0; j < V; j++) {
                const float lp = row[j] * inv_temperature - l, p = cpu_vexp(lp);
                d[j] = -g * p - gh * p * (lp + h);
            }
            if (scored) d[t] += g;
        } else if (!scored) {
            for (int j = 0; j < V; j++) d[j] = 0.0f;
        } else {
            const float p_t = cpu_vexp(row[t] * inv_temperature - l);
            for (int j = 0; j < V; j++) d[j] = -g * cpu_vexp(row[j] * inv_temperature - l);
            d[t] = g * (1.0f - p_t);
        }
    }
}
