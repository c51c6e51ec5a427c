// rollout_server/sampler.c — the draw's uniform and a host row's logprobs (see sampler.h).
#include "rollout_server/sampler.h"

#include <math.h>

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

double sampler_uniform(uint64_t stream, uint64_t pos) {
    // Two rounds of the splitmix64 finaliser over (stream, position): a counter-based generator, so any draw
    // can be recomputed from its coordinates alone.
    uint64_t h = mix64(mix64(stream + 0x9E3779B97F4A7C15ULL) ^ (pos * 0xD1B54A32D192ED03ULL + 0x8CB92BA72F3D8DD7ULL));
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

// logsumexp of logits * inv_t over V entries, in double (what kernels/cpu/cpu_sample.c normalises with).
static double row_lse(const float *logits, int V, float inv_t) {
    float m = -INFINITY;
    for (int i = 0; i < V; i++) {
        float z = logits[i] * inv_t;
        if (z > m) m = z;
    }
    if (m == -INFINITY) return -INFINITY;
    double sum = 0.0;
    for (int i = 0; i < V; i++) sum += exp((double)(logits[i] * inv_t) - m);
    return m + log(sum);
}

// The k best (value desc, id asc) of logits * inv_t as logprobs against lse, best first.
static void top_k_logprobs(const float *logits, int V, float inv_t, double lse, int k, TokenLogprob *top) {
    int n = 0;
    for (int i = 0; i < V; i++) {
        float z = logits[i] * inv_t;
        // Strictly greater than the current worst: an equal value with a larger id ranks below it.
        if (n == k && !(z > top[k - 1].logprob)) continue;
        int j = n < k ? n++ : k - 1;
        while (j > 0 && z > top[j - 1].logprob) {
            top[j] = top[j - 1];
            j--;
        }
        top[j].id = i;
        top[j].logprob = z;
    }
    for (int j = 0; j < n; j++) top[j].logprob = (float)(top[j].logprob - lse);
    for (int j = n; j < k; j++) top[j] = (TokenLogprob){-1, -INFINITY}; // fewer ids than asked for
}

float sampler_logprob(const float *logits, int V, float inv_temperature, int32_t id, int k, TokenLogprob *top) {
    double lse = row_lse(logits, V, inv_temperature);
    if (top && k > 0) top_k_logprobs(logits, V, inv_temperature, lse, k, top);
    return (float)((double)(logits[id] * inv_temperature) - lse);
}
