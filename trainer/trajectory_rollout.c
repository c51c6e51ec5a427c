// trainer/trajectory_rollout.c — trajectory turns from the rollout servers (trajectory_rollout.h).
#include "trainer/trajectory_rollout.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"

uint64_t trajectory_turn_seed(uint64_t seed, size_t episode, int turn) {
    // splitmix64 over the three: nearby episodes and turns get unrelated seeds.
    uint64_t x = seed ^ (0x9e3779b97f4a7c15ULL * ((uint64_t)episode + 1)) ^ (0xbf58476d1ce4e5b9ULL * (uint64_t)turn);
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x & 0x7fffffffffffffffULL;
}

int trajectory_rollout_sample(void *ctx, const TrajectorySampleRequest *req, size_t n, TrajectorySample *out,
                              char *err, size_t err_len) {
    TrajectoryRolloutSampler *s = ctx;
    memset(out, 0, n * sizeof *out);
    RolloutPending **pending = calloc(n + 1, sizeof *pending);
    const int32_t **prompts = calloc(n + 1, sizeof *prompts);
    int *lens = calloc(n + 1, sizeof *lens);
    if (!pending || !prompts || !lens) {
        free(pending), free(prompts), free(lens);
        return err_fail(err, err_len, "trajectory sampler: out of memory");
    }
    int rc = 0;
    size_t sent = 0;
    for (; sent < n; sent++) {
        if (req[sent].n_ids > INT_MAX || req[sent].max_new_tokens > INT_MAX) {
            rc = err_fail(err, err_len, "trajectory of episode %zu is too long to send", req[sent].episode);
            break;
        }
        ZmsgSampling sp = s->sampling;
        sp.n = 1;
        sp.max_tokens = (int)req[sent].max_new_tokens;
        sp.has_seed = 1;
        sp.seed = trajectory_turn_seed(s->seed, req[sent].episode, req[sent].turn);
        prompts[sent] = req[sent].ids;
        lens[sent] = (int)req[sent].n_ids;
        rc = rollout_generate_start(s->client, 1, &prompts[sent], &lens[sent], &sp, &pending[sent], err, err_len);
        if (rc != 0) break;
    }
    for (size_t i = 0; i < sent; i++) {
        if (rc != 0) {
            rollout_generate_cancel(s->client, pending[i]);
            continue;
        }
        RolloutGroup g = {0};
        rc = rollout_generate_finish(s->client, pending[i], &g, err, err_len);
        if (rc != 0) continue;
        size_t m = g.n == 1 ? (size_t)g.lens[0] : 0;
        out[i].ids = malloc((m + 1) * sizeof *out[i].ids);
        out[i].logprobs = malloc((m + 1) * sizeof *out[i].logprobs);
        if (!out[i].ids || !out[i].logprobs) {
            rc = err_fail(err, err_len, "trajectory sampler: out of memory");
        } else {
            if (m) memcpy(out[i].ids, g.tokens, m * sizeof *g.tokens);
            if (m) memcpy(out[i].logprobs, g.logprobs, m * sizeof *g.logprobs);
            out[i].n = m;
            out[i].version = g.n == 1 ? g.versions[0] : -1;
        }
        rollout_groups_free(&g, 1);
    }
    if (rc != 0)
        for (size_t i = 0; i < n; i++) {
            free(out[i].ids), free(out[i].logprobs);
            out[i].ids = NULL, out[i].logprobs = NULL;
        }
    free(pending), free(prompts), free(lens);
    return rc;
}
