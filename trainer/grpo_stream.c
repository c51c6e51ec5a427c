// trainer/grpo_stream.c — streaming groups (docs/grpo.md "Streaming groups"): a round's prompts come back from the
// rollout servers one group (the G completions of one prompt) at a time, and each group is decoded and scored —
// built-in rewards and one reward-service call for the groups that arrived together — as soon as it is in, while
// the servers still generate the others. Scores are per completion, so the round's scores are the same numbers
// whatever order and batches the groups arrived in. Meanwhile the ranks keep in step (one small all-reduce per
// wait): once every rank holds the groups of a chunk of completions (the first k x chunk of each rank's round), the
// caller's chunk work runs on it — the old and reference logprobs, and a micro-step where the options allow — on
// every rank at once. The rest waits for the whole round (trainer/grpo_round.c, trainer/grpo_train.c).
#include "trainer/grpo_round.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"
#include "trainer/grpo_loss.h"
#include "trainer/grpo_multiturn.h"

int group_progress_init(GroupProgress *g, int n_groups, char *err, size_t err_len) {
    memset(g, 0, sizeof *g);
    g->n_groups = n_groups;
    if (!(g->scored = calloc((size_t)(n_groups ? n_groups : 1), 1)))
        return err_fail(err, err_len, "out of memory for the progress of %d groups", n_groups);
    return 0;
}

void group_progress_reset(GroupProgress *g) {
    memset(g->scored, 0, (size_t)g->n_groups);
    g->n_scored = g->prefix = 0;
}

int group_progress_mark(GroupProgress *g, int group) {
    if (group < 0 || group >= g->n_groups || g->scored[group]) return -1;
    g->scored[group] = 1;
    g->n_scored++;
    while (g->prefix < g->n_groups && g->scored[g->prefix]) g->prefix++;
    return 0;
}

void group_progress_free(GroupProgress *g) {
    free(g->scored);
    memset(g, 0, sizeof *g);
}

// Group p's completions from what its server returned: ids, lengths, logprobs, versions, truncation.
static void take_group(Trainer *t, GrpoRound *r, int p) {
    const int G = t->cfg->grpo.num_generations;
    int32_t eos[16];
    int n_eos = (int)tokenizer_eos_ids(t->tok, eos, 16);
    for (int j = 0, off = 0; j < G; j++) {
        int i = p * G + j;
        r->comp[i] = r->groups[p].tokens + off;
        r->sampling_logps[i] = r->groups[p].logprobs + off;
        r->comp_len[i] = r->groups[p].lens[j];
        r->versions[i] = r->groups[p].versions[j];
        r->truncated[i] = grpo_completion_is_truncated(r->comp[i], r->comp_len[i], eos, n_eos,
                                                       tokenizer_pad_id(t->tok));
        off += r->comp_len[i];
    }
}

// Room for scoring: the built-ins' columns of every completion (F_builtin each), the reward service's (up to
// GRPO_SERVICE_MAX_FUNCS each), and one service call's samples and answers (every completion at most).
static int fit_stream_buffers(Trainer *t, GrpoRound *r, char *err, size_t err_len) {
    const size_t n = (size_t)(r->n ? r->n : 1), fb = rewards_count(t->rewards) ? rewards_count(t->rewards) : 1;
    if (!r->builtin_scores && !(r->builtin_scores = malloc(n * fb * sizeof *r->builtin_scores)))
        return err_fail(err, err_len, "out of memory for the built-in rewards of a round");
    if (!t->reward_service) return 0;
    if (!r->service_scores && !(r->service_scores = malloc(n * GRPO_SERVICE_MAX_FUNCS * sizeof *r->service_scores)))
        return err_fail(err, err_len, "out of memory for the reward service's scores");
    if (!r->call_samples && !(r->call_samples = malloc(n * sizeof *r->call_samples)))
        return err_fail(err, err_len, "out of memory for a reward service call");
    if (!r->call_scores && !(r->call_scores = malloc(n * GRPO_SERVICE_MAX_FUNCS * sizeof *r->call_scores)))
        return err_fail(err, err_len, "out of memory for a reward service call");
    return 0;
}

// Decodes and scores groups idx[0..k): each completion's built-in scores into builtin_scores (row i, F_builtin
// columns), the service's into service_scores (row i, GRPO_SERVICE_MAX_FUNCS columns) through one call for all k
// groups, in the order listed.
static int score_groups(Trainer *t, GrpoRound *r, const int *idx, int k, char *err, size_t err_len) {
    const int G = t->cfg->grpo.num_generations;
    const size_t Fb = rewards_count(t->rewards);
    for (int q = 0; q < k; q++) {
        const int p = idx[q];
        for (int i = p * G; i < (p + 1) * G; i++) {
            size_t len;
            // A trajectory's rewards read its final answer, the last assistant turn (tool answers would hand an
            // answer_match reward the calculator's result).
            const int from = r->tool_mask && r->tool_mask[i] ? r->answer_off[i] : 0;
            if (tokenizer_decode(t->tok, r->comp[i] + from, r->comp_len[i] - from, 1, &r->texts[i], &len, err,
                                 err_len) != 0)
                return -1;
            r->samples[i] = (RewardSample){.completion = r->texts[i], .completion_tokens = r->comp_len[i],
                                           .prompt = r->rows[p].prompt, .columns = r->rows[p].columns};
        }
        if (Fb && rewards_score(t->rewards, r->samples + (size_t)p * G, (size_t)G,
                                r->builtin_scores + (size_t)p * G * Fb, Fb, err, err_len) != 0)
            return -1;
    }
    if (!t->reward_service || k == 0) return 0;
    for (int q = 0; q < k; q++)
        memcpy(r->call_samples + (size_t)q * G, r->samples + (size_t)idx[q] * G, (size_t)G * sizeof *r->samples);
    size_t nf = 0;
    if (reward_service_score(t->reward_service, r->call_samples, (size_t)k * G, r->call_scores,
                             GRPO_SERVICE_MAX_FUNCS, GRPO_SERVICE_MAX_FUNCS, &nf, err, err_len) != 0)
        return -1;
    r->n_service_funcs = (int)nf;
    for (int q = 0; q < k; q++)
        memcpy(r->service_scores + (size_t)idx[q] * G * GRPO_SERVICE_MAX_FUNCS,
               r->call_scores + (size_t)q * G * GRPO_SERVICE_MAX_FUNCS,
               (size_t)G * GRPO_SERVICE_MAX_FUNCS * sizeof *r->call_scores);
    return 0;
}

// This rank's part of one step of the ranks' lockstep: waits for groups, scores those that came back. 0 (r->pending
// NULL once every group is in), ROLLOUT_ESERVERS_LOST (the groups in and the handle kept) or -1 (both freed).
static int stream_local(Trainer *t, GrpoRound *r, char *err, size_t err_len) {
    int *arrived = r->progress_arrived, k = 0;
    int polled = rollout_generate_poll(t->rollout, r->pending, r->groups, 1000, arrived, &k, err, err_len);
    if (polled == -1) {
        r->pending = NULL;
        return -1;
    }
    const int generating = rollout_generate_remaining(r->pending) > 0;
    double t0 = trainer_now();
    int rc = 0;
    for (int q = 0; q < k && rc == 0; q++) {
        if (group_progress_mark(&r->progress, arrived[q]) != 0)
            rc = err_fail(err, err_len, "prompt %d of the round came back twice", arrived[q]);
        else if (r->groups[arrived[q]].n != t->cfg->grpo.num_generations)
            rc = err_fail(err, err_len, "prompt %d of the round came back with %d completions, not %d", arrived[q],
                          r->groups[arrived[q]].n, t->cfg->grpo.num_generations);
        else {
            take_group(t, r, arrived[q]);
            // Multi-turn: the group's first turns become trajectories, continued to their end before scoring.
            if (t->env) rc = grpo_round_group_trajectories(t, r, arrived[q], err, err_len);
        }
    }
    if (rc == 0) rc = score_groups(t, r, arrived, k, err, err_len);
    const double dt = trainer_now() - t0;
    r->reward_seconds += dt;
    if (generating) r->overlap_seconds += dt;
    if (rc != 0) {
        rollout_groups_free(r->groups, r->n_prompts);
        rollout_generate_cancel(r->client, r->pending);
        r->pending = NULL;
        return -1;
    }
    if (polled != 0) return polled;
    if (!generating) {
        rc = rollout_generate_finish(t->rollout, r->pending, r->groups, err, err_len);
        r->pending = NULL;
    }
    return rc;
}

int grpo_round_stream_begin(Trainer *t, GrpoRound *r, char *err, size_t err_len) {
    group_progress_reset(&r->progress);
    r->chunks_done = 0;
    return fit_stream_buffers(t, r, err, err_len);
}

int grpo_round_stream(Trainer *t, GrpoRound *r, const GrpoStreamWork *work, char *err, size_t err_len) {
    const int G = t->cfg->grpo.num_generations;
    const int n_chunks = work ? (r->n + work->chunk - 1) / work->chunk : 0;
    int local = 0;
    for (;;) {
        const int done = !r->pending;
        if (!done && local == 0) {
            local = stream_local(t, r, err, err_len);
            if (local == -1) return -1;
        }
        // The ranks' lockstep: the chunks every rank holds, whether every rank has all its groups, whether one lost
        // its servers. Every rank takes the same decisions from these, so all run the same collectives in the same
        // order (the chunk work's forwards and backwards are collective under ZeRO-3).
        const int all_in = !r->pending;
        int ready = all_in ? n_chunks : work ? r->progress.prefix * G / work->chunk : 0;
        int32_t agree[3] = {-ready, -all_in, local != 0};
        if (comm_all_reduce(t->comm, agree, 3, COMM_I32, COMM_MAX) != 0) {
            snprintf(err, err_len, "%s", comm_error(t->comm));
            rollout_generate_cancel(r->client, r->pending);
            r->pending = NULL;
            rollout_groups_free(r->groups, r->n_prompts);
            return -1;
        }
        // Lost somewhere: every rank keeps what it has; the caller brings the servers back and streams on.
        if (agree[2]) return ROLLOUT_ESERVERS_LOST;
        if (-agree[1]) return 0;   // the chunks left are the caller's, after the round is in
        for (; r->chunks_done < -agree[0]; r->chunks_done++)
            if (work->run(work->ctx, r, r->chunks_done, err, err_len) != 0) return -1;
    }
}
