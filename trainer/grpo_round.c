// trainer/grpo_round.c — the generate, rewards and advantages phases of a GRPO step (trainer/grpo_round.h); the
// groups of a round are scored as they come back by trainer/grpo_stream.c.
#include "trainer/grpo_round.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"
#include "trainer/grpo_loss.h"
#include "trainer/grpo_multiturn.h"

int grpo_round_init(GrpoRound *r, int n_prompts, int G, int world, char *err, size_t err_len) {
    memset(r, 0, sizeof *r);
    r->n_prompts = n_prompts;
    r->n = n_prompts * G;
    const size_t n = (size_t)r->n;
    r->rows = calloc(n_prompts, sizeof *r->rows);
    r->groups = calloc(n_prompts, sizeof *r->groups);
    r->prompts = calloc(n_prompts, sizeof *r->prompts);
    r->prompt_lens = calloc(n_prompts, sizeof *r->prompt_lens);
    r->comp = calloc(n, sizeof *r->comp);
    r->comp_len = calloc(n, sizeof *r->comp_len);
    r->sampling_logps = calloc(n, sizeof *r->sampling_logps);
    r->truncated = calloc(n, 1);
    r->versions = calloc(n, sizeof *r->versions);
    r->keep = calloc(n, 1);
    r->advantages = calloc(n, sizeof *r->advantages);
    r->streamed_adv = calloc(n ? n : 1, sizeof *r->streamed_adv);
    r->off = calloc(n + 1, sizeof *r->off);
    r->samples = calloc(n, sizeof *r->samples);
    r->texts = calloc(n, sizeof *r->texts);
    r->adv_all = calloc(n * (size_t)world, sizeof *r->adv_all);
    r->progress_arrived = calloc(n_prompts ? n_prompts : 1, sizeof *r->progress_arrived);
    if (!r->progress_arrived || !r->streamed_adv || group_progress_init(&r->progress, n_prompts, err, err_len) != 0) {
        grpo_round_free(r);
        return err_fail(err, err_len, "out of memory for a generation round");
    }
    if (!r->rows || !r->groups || !r->prompts || !r->prompt_lens || !r->comp || !r->comp_len || !r->sampling_logps ||
        !r->truncated || !r->versions || !r->keep || !r->advantages || !r->off || !r->samples || !r->texts ||
        !r->adv_all) {
        grpo_round_free(r);
        return err_fail(err, err_len, "out of memory for a generation round");
    }
    return 0;
}

int grpo_round_policy_tokens(const GrpoRound *r, int i) {
    if (!r->tool_mask || !r->tool_mask[i]) return r->comp_len[i];
    int k = 0;
    for (int j = 0; j < r->comp_len[i]; j++) k += r->tool_mask[i][j] != 0;
    return k;
}

void grpo_round_clear(GrpoRound *r) {
    if (r->pending) rollout_generate_cancel(r->client, r->pending);
    r->pending = NULL;
    for (int p = 0; p < r->n_prompts; p++) data_row_clear(&r->rows[p]);
    rollout_groups_free(r->groups, r->n_prompts);   // the groups in, whole round or not (zeroed entries: nothing)
    for (int i = 0; i < r->n; i++) {
        free(r->texts[i]);
        r->texts[i] = NULL;
        if (r->traj) trajectory_free(&r->traj[i]);
        if (r->tool_mask) r->tool_mask[i] = NULL;
    }
    r->reward_seconds = r->stream_seconds = r->overlap_seconds = 0;
}

void grpo_round_free(GrpoRound *r) {
    if (r->rows && r->texts) grpo_round_clear(r);
    free(r->rows), free(r->groups), free(r->prompts), free(r->prompt_lens), free(r->comp), free(r->comp_len);
    free(r->sampling_logps), free(r->truncated), free(r->versions), free(r->keep), free(r->advantages), free(r->off);
    free(r->old_logps), free(r->ref_logps), free(r->samples), free(r->texts), free(r->service_scores);
    free(r->scores), free(r->local), free(r->builtin_scores), free(r->call_samples), free(r->call_scores);
    free(r->progress_arrived), free(r->streamed_adv);
    free(r->traj), free(r->tool_mask), free(r->answer_off);
    group_progress_free(&r->progress);
    free(r->all), free(r->adv_all), free(r->fmean), free(r->fstd), free(r->weights);
    memset(r, 0, sizeof *r);
}

int grpo_round_issue(Trainer *t, GrpoRound *r, long first_step, char *err, size_t err_len) {
    TrainConfig *c = t->cfg;
    const int G = c->grpo.num_generations;
    double t0 = trainer_now();
    for (int p = 0; p < r->n_prompts; p++) {
        if (trainer_next_row(t, &r->rows[p], err, err_len) < 0) return -1;
        r->prompts[p] = r->rows[p].ids;
        r->prompt_lens[p] = (int)r->rows[p].n_ids;
    }
    data_tell(t->data, &r->data_epoch_end, &r->data_pos_end);
    ZmsgSampling *s = &r->sampling;
    zmsg_sampling_default(s);
    s->n = G;
    s->max_tokens = c->grpo.max_completion_length;
    s->temperature = (float)c->temperature;
    s->top_p = (float)c->top_p;
    s->top_k = c->top_k > 0 ? c->top_k : -1;
    s->min_p = (float)c->min_p;
    s->repetition_penalty = (float)c->repetition_penalty;
    s->has_seed = 1;
    // Distinct seeds per rank and step, reproducible from the run's seed: the step is the one the round's training
    // starts from, so a round generated ahead samples with the seeds the synchronous run gives it.
    s->seed = ((uint64_t)c->seed * 1000003ULL + (uint64_t)first_step * 7919ULL + (uint64_t)t->rank * 104729ULL) &
              0x3FFFFFFFFFFFFFFFULL;
    r->first_step = first_step;
    r->client = t->rollout;
    r->issued_at = t0;
    if (rollout_generate_start(t->rollout, r->n_prompts, r->prompts, r->prompt_lens, s, &r->pending, err,
                               err_len) != 0)
        return -1;
    return 0;
}

int grpo_round_collect(Trainer *t, GrpoRound *r, const GrpoStreamWork *work, char *err, size_t err_len) {
    TrainConfig *c = t->cfg;
    if (grpo_round_stream_begin(t, r, err, err_len) != 0) return -1;
    for (int attempt = 1;; attempt++) {
        // Every rank agrees whether the round's generation worked (grpo_round_stream): if one lost all its servers,
        // all wait for the servers to come back, push them this run's weights (a collective weight push) and go
        // on: the groups already in stay, the prompts still out are sent again.
        int rc = grpo_round_stream(t, r, work, err, err_len);
        if (rc == -1) return -1;
        if (rc == 0) break;
        if (attempt == 3) {
            snprintf(err, err_len, "generation failed 3 times: the rollout servers keep going away");
            rollout_generate_cancel(r->client, r->pending);
            r->pending = NULL;
            rollout_groups_free(r->groups, r->n_prompts);
            return -1;
        }
        int stale;
        double secs;
        if (t->rank == 0)
            fprintf(stderr, "tandem-train: rollout servers lost mid-round (generation attempt %d of 3); waiting up to "
                    "%.0f s (6 x --rollout-timeout) for one to answer, then pushing the weights and generating the "
                    "rest of the round\n", attempt, 6.0 * c->rollout_timeout);
        if (rollout_client_refresh(t->rollout, t->progress.policy_version, 2000, &stale, err, err_len) != 0 ||
            weight_sync_push(t, &secs, err, err_len) != 0) {
            rollout_generate_cancel(r->client, r->pending);
            r->pending = NULL;
            rollout_groups_free(r->groups, r->n_prompts);
            return -1;
        }
    }
    double t1 = trainer_now();
    r->stream_seconds = r->reward_seconds;
    r->generate_seconds = t1 - r->issued_at;
    r->off[0] = 0;
    for (int i = 0; i < r->n; i++) r->off[i + 1] = r->off[i] + (size_t)r->comp_len[i];
    memset(r->keep, 1, (size_t)r->n);
    r->staleness = (GrpoStaleness){.kept = r->n};
    return 0;
}

void grpo_staleness_filter(int n, const int64_t *versions, int64_t policy_version, int max_staleness,
                           uint8_t *keep, GrpoStaleness *st) {
    *st = (GrpoStaleness){0};
    for (int i = 0; i < n; i++) {
        int64_t s = policy_version - versions[i];
        if (s < 0) s = 0;
        keep[i] = s <= max_staleness;
        if (!keep[i]) {
            st->dropped++;
            continue;
        }
        st->kept++;
        st->sum += s;
        if (s > st->max) st->max = s;
        st->hist[s < GRPO_STALENESS_BINS ? s : GRPO_STALENESS_BINS - 1]++;
    }
}

void grpo_round_filter_stale(Trainer *t, GrpoRound *r) {
    // Synchronous rounds are sampled by the version they are trained at: counted, never dropped.
    int bound = t->cfg->max_staleness > 0 ? t->cfg->max_staleness : INT_MAX;
    r->train_version = t->progress.policy_version;
    grpo_staleness_filter(r->n, r->versions, t->progress.policy_version, bound, r->keep, &r->staleness);
}

// Grows the per-function buffers to F functions.
static int fit_funcs(Trainer *t, GrpoRound *r, int F, char *err, size_t err_len) {
    if (F <= r->cap_f && r->scores) return 0;
    const size_t n = (size_t)r->n, f = (size_t)(F ? F : 1);
    free(r->scores), free(r->local), free(r->all), free(r->fmean), free(r->fstd), free(r->weights);
    r->scores = malloc(n * f * sizeof *r->scores);
    r->local = malloc(n * f * sizeof *r->local);
    r->all = malloc(n * (size_t)t->world * f * sizeof *r->all);
    r->fmean = calloc(f, sizeof *r->fmean);
    r->fstd = calloc(f, sizeof *r->fstd);
    r->weights = malloc(f * sizeof *r->weights);
    if (!r->scores || !r->local || !r->all || !r->fmean || !r->fstd || !r->weights) {
        r->cap_f = 0;
        return err_fail(err, err_len, "out of memory for the rewards of a round");
    }
    r->cap_f = (int)f;
    return 0;
}

int grpo_round_rewards(Trainer *t, GrpoRound *r, int *n_funcs, char *err, size_t err_len) {
    double t0 = trainer_now();
    const int F_builtin = (int)rewards_count(t->rewards), F_svc = t->reward_service ? r->n_service_funcs : 0;
    const int F = F_builtin + F_svc + grpo_env_reward_column(t);
    if (fit_funcs(t, r, F, err, err_len) != 0) return -1;
    for (int i = 0; i < r->n; i++) {
        for (int f = 0; f < F_builtin; f++) r->scores[i * F + f] = r->builtin_scores[(size_t)i * F_builtin + f];
        for (int f = 0; f < F_svc; f++)
            r->scores[i * F + F_builtin + f] = r->service_scores[(size_t)i * GRPO_SERVICE_MAX_FUNCS + f];
        if (grpo_env_reward_column(t)) r->scores[i * F + F_builtin + F_svc] = r->traj[i].env_reward;
    }
    for (size_t k = 0; k < (size_t)r->n * F; k++) r->local[k] = (float)r->scores[k];
    // A dropped (too stale) completion is unscorable: no reward statistic counts it and its advantage is 0.
    for (int i = 0; i < r->n; i++)
        if (!r->keep[i])
            for (int f = 0; f < F; f++) r->local[(size_t)i * F + f] = NAN;
    r->reward_seconds += trainer_now() - t0;
    *n_funcs = F;
    return 0;
}

// reward_weights for F functions in r->weights (*weights = NULL when not set: all 1).
static int reward_weights(const TrainConfig *c, GrpoRound *r, int F, const float **weights, char *err,
                          size_t err_len) {
    *weights = NULL;
    if (!c->reward_weights) return 0;
    if ((int)c->n_reward_weights != F)
        return err_fail(err, err_len, "reward_weights has %zu entries but there are %d reward functions",
                        c->n_reward_weights, F);
    for (int f = 0; f < F; f++) r->weights[f] = (float)c->reward_weights[f];
    *weights = r->weights;
    return 0;
}

int grpo_round_group_advantages(Trainer *t, GrpoRound *r, int g, char *err, size_t err_len) {
    TrainConfig *c = t->cfg;
    const int G = c->grpo.num_generations, F_builtin = (int)rewards_count(t->rewards);
    const int F_svc = t->reward_service ? r->n_service_funcs : 0, F = F_builtin + F_svc + grpo_env_reward_column(t);
    // The staleness filter grpo_round_filter_stale applies once the round is in (the policy version does not
    // change while it comes in), for this group now.
    GrpoStaleness st;
    r->train_version = t->progress.policy_version;
    grpo_staleness_filter(G, r->versions + (size_t)g * G, r->train_version,
                          c->max_staleness > 0 ? c->max_staleness : INT_MAX, r->keep + (size_t)g * G, &st);
    const float *weights;
    if (fit_funcs(t, r, F, err, err_len) != 0 || reward_weights(c, r, F, &weights, err, err_len) != 0) return -1;
    float *rows = r->local + (size_t)g * G * F;
    for (int i = g * G; i < (g + 1) * G; i++)
        for (int f = 0; f < F; f++) {
            double v = f < F_builtin          ? r->builtin_scores[(size_t)i * F_builtin + f]
                       : f < F_builtin + F_svc ? r->service_scores[(size_t)i * GRPO_SERVICE_MAX_FUNCS + f - F_builtin]
                                               : r->traj[i].env_reward;
            r->local[(size_t)i * F + f] = r->keep[i] ? (float)v : NAN;
        }
    if (grpo_advantages(&c->grpo, G, F, rows, weights, r->advantages + (size_t)g * G, NULL, NULL, NULL, err,
                        err_len) != 0)
        return -1;
    memcpy(r->streamed_adv + (size_t)g * G, r->advantages + (size_t)g * G, (size_t)G * sizeof(float));
    return 0;
}

int grpo_round_advantages(Trainer *t, GrpoRound *r, int F, json_t *m, char *err, size_t err_len) {
    TrainConfig *c = t->cfg;
    double t0 = trainer_now();
    const int F_builtin = (int)rewards_count(t->rewards);
    const float *weights;
    if (reward_weights(c, r, F, &weights, err, err_len) != 0) return -1;
    // Every rank's rewards, in rank order (TRL's gather).
    if (comm_all_gather(t->comm, r->all, r->local, (size_t)r->n * F, COMM_F32) != 0) {
        snprintf(err, err_len, "gathering rewards: %s", comm_error(t->comm));
        return -1;
    }
    GrpoRewardMetrics rm;
    if (grpo_advantages(&c->grpo, r->n * t->world, F, r->all, weights, r->adv_all, &rm, r->fmean, r->fstd, err,
                        err_len) != 0)
        return -1;
    memcpy(r->advantages, r->adv_all + (size_t)t->rank * r->n, r->n * sizeof(float));
    json_object_set_new(m, "reward", json_real(rm.reward));
    json_object_set_new(m, "reward_std", json_real(rm.reward_std));
    json_object_set_new(m, "frac_reward_zero_std", json_real(rm.frac_reward_zero_std));
    for (int f = 0; f < F; f++) {
        const char *name = f < F_builtin ? rewards_name(t->rewards, f)
                           : t->reward_service && f - F_builtin < (int)reward_service_count(t->reward_service)
                               ? reward_service_name(t->reward_service, f - F_builtin)
                               : GRPO_ENV_REWARD_NAME;
        char key[160];
        snprintf(key, sizeof key, "rewards/%s/mean", name);
        json_object_set_new(m, key, json_real(r->fmean[f]));
        snprintf(key, sizeof key, "rewards/%s/std", name);
        json_object_set_new(m, key, json_real(r->fstd[f]));
    }
    // Lengths of the completions trained on (a dropped one is not), and the staleness of those.
    const int G = c->grpo.num_generations;
    const GrpoStaleness *st = &r->staleness;
    // TRL's completions/*: lengths of every completion, and of those that ended (not cut at
    // max_completion_length: clipped) alone, 0 when none did; num_tokens: prompt + completion tokens so far.
    enum { LEN, CLIPPED, TERM_LEN, TERM, TOKENS, KEPT, DROPPED, STALE_SUM, STALE_MAX, HIST,
           N_SUMS = HIST + GRPO_STALENESS_BINS };
    enum { MAX_LEN, NEG_MIN_LEN, MAX_TERM, NEG_MIN_TERM, STALE, N_MAX };
    double sums[N_SUMS] = {0}, maxes[N_MAX] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, (double)st->max};
    for (int i = 0; i < r->n; i++) {
        if (!r->keep[i]) continue;
        // With tools, the policy's own tokens (as TRL counts them) and its trajectory's truncation; num_tokens
        // counts every token of the trajectory, tool turns included, as TRL's attention mask does.
        const double len = grpo_round_policy_tokens(r, i);
        const int clipped = r->traj ? r->truncated[i] : r->groups[i / G].finish[i % G] == ZMSG_FINISH_LENGTH;
        sums[LEN] += len;
        sums[CLIPPED] += clipped;
        sums[TOKENS] += (double)r->rows[i / G].n_ids + r->comp_len[i];
        maxes[MAX_LEN] = fmax(maxes[MAX_LEN], len), maxes[NEG_MIN_LEN] = fmax(maxes[NEG_MIN_LEN], -len);
        if (clipped) continue;
        sums[TERM_LEN] += len, sums[TERM] += 1;
        maxes[MAX_TERM] = fmax(maxes[MAX_TERM], len), maxes[NEG_MIN_TERM] = fmax(maxes[NEG_MIN_TERM], -len);
    }
    sums[KEPT] = (double)st->kept, sums[DROPPED] = (double)st->dropped, sums[STALE_SUM] = (double)st->sum;
    for (int b = 0; b < GRPO_STALENESS_BINS; b++) sums[HIST + b] = (double)st->hist[b];
    if (comm_all_reduce(t->comm, sums, N_SUMS, COMM_F64, COMM_SUM) != 0 ||
        comm_all_reduce(t->comm, maxes, N_MAX, COMM_F64, COMM_MAX) != 0) {
        snprintf(err, err_len, "reducing metrics: %s", comm_error(t->comm));
        return -1;
    }
    const double kept = sums[KEPT] > 0 ? sums[KEPT] : 1;
    const int any = sums[KEPT] > 0, any_term = sums[TERM] > 0;
    t->progress.num_input_tokens_seen += (int64_t)sums[TOKENS];
    json_object_set_new(m, "num_tokens", json_real((double)t->progress.num_input_tokens_seen));
    json_object_set_new(m, "completions/mean_length", json_real(sums[LEN] / kept));
    json_object_set_new(m, "completions/min_length", json_real(any ? -maxes[NEG_MIN_LEN] : 0));
    json_object_set_new(m, "completions/max_length", json_real(any ? maxes[MAX_LEN] : 0));
    json_object_set_new(m, "completions/clipped_ratio", json_real(sums[CLIPPED] / kept));
    json_object_set_new(m, "completions/mean_terminated_length", json_real(any_term ? sums[TERM_LEN] / sums[TERM] : 0));
    json_object_set_new(m, "completions/min_terminated_length", json_real(any_term ? -maxes[NEG_MIN_TERM] : 0));
    json_object_set_new(m, "completions/max_terminated_length", json_real(any_term ? maxes[MAX_TERM] : 0));
    json_object_set_new(m, "staleness/mean", json_real(sums[STALE_SUM] / kept));
    json_object_set_new(m, "staleness/max", json_integer((json_int_t)maxes[STALE]));
    const int bins = c->max_staleness + 1 < GRPO_STALENESS_BINS ? c->max_staleness + 1 : GRPO_STALENESS_BINS;
    for (int b = 0; b < bins; b++) {
        char key[48];
        snprintf(key, sizeof key, "staleness/hist/%d", b);
        json_object_set_new(m, key, json_integer((json_int_t)sums[HIST + b]));
    }
    json_object_set_new(m, "samples_dropped_stale", json_integer((json_int_t)sums[DROPPED]));
    json_object_set_new(m, "rollout_time", json_real(r->generate_seconds));
    json_object_set_new(m, "prompts_skipped", json_integer((json_int_t)data_skipped(t->data)));
    json_object_set_new(m, "reward_time", json_real(r->reward_seconds + trainer_now() - t0));
    // Streaming groups: how much of the decoding and scoring ran while the servers still generated the round.
    json_object_set_new(m, "reward_overlap_time", json_real(r->overlap_seconds));
    if (t->env && grpo_round_tool_metrics(t, r, m, err, err_len) != 0) return -1;
    return 0;
}

int grpo_round_reserve_logps(GrpoRound *r, int old, int ref, size_t need, char *err, size_t err_len) {
    if (need == 0) need = 1;
    if (need > r->logps_cap) {
        free(r->old_logps), free(r->ref_logps);
        r->old_logps = r->ref_logps = NULL;
        r->logps_cap = need;
    }
    if (old && !r->old_logps && !(r->old_logps = malloc(r->logps_cap * sizeof(float))))
        return err_fail(err, err_len, "out of memory for the round's old logprobs");
    if (ref && !r->ref_logps && !(r->ref_logps = malloc(r->logps_cap * sizeof(float))))
        return err_fail(err, err_len, "out of memory for the round's reference logprobs");
    return 0;
}
