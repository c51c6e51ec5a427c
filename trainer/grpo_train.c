// trainer/grpo_train.c — the GRPO loop of one rank (see trainer/trainer.h for the shape of a round).
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer/grpo_loss.h"
#include "trainer/trainer.h"

// One generation round's completions on this rank: n_local = prompts * G, completion i of prompt p at p*G + j.
typedef struct {
    int n_prompts, n;           // prompts, completions (n = n_prompts * G)
    DataRow *rows;              // (n_prompts)
    RolloutGroup *groups;       // (n_prompts)
    int32_t **comp;             // (n) completion ids (into groups)
    int *comp_len;              // (n)
    float **sampling_logps;     // (n) server logprobs (into groups)
    uint8_t *truncated;         // (n) finish reason "length"
    float *advantages;          // (n)
    float **old_logps;          // (n) -> (comp_len) trainer logprobs before this round's updates, or NULL
    float **ref_logps;          // (n) -> (comp_len), beta > 0
} Round;

static void round_free(Round *r) {
    for (int p = 0; p < r->n_prompts; p++) data_row_clear(&r->rows[p]);
    if (r->groups) rollout_groups_free(r->groups, r->n_prompts);
    for (int i = 0; i < r->n; i++) {
        if (r->old_logps) free(r->old_logps[i]);
        if (r->ref_logps) free(r->ref_logps[i]);
    }
    free(r->rows);
    free(r->groups);
    free(r->comp);
    free(r->comp_len);
    free(r->sampling_logps);
    free(r->truncated);
    free(r->advantages);
    free(r->old_logps);
    free(r->ref_logps);
    memset(r, 0, sizeof *r);
}

// Packs completions idx[0..B) (prompt + completion each) and runs the forward of `src`: per-token logprobs
// (and entropies) of the completion tokens into (B, T) arrays. T = longest completion.
static int forward_completions(Trainer *t, UnitSource *src, const Round *r, const int *idx, int B, int T,
                               float *logps, float *entropies, char *err, size_t err_len) {
    const int G = t->cfg->grpo.num_generations;
    int N = 0;
    for (int b = 0; b < B; b++) N += (int)r->rows[idx[b] / G].n_ids + r->comp_len[idx[b]];
    if (trainer_ensure_acts(t, N, B, err, err_len) != 0) return -1;
    int32_t *tok = malloc(N * 4), *tgt = malloc(N * 4), *cu = malloc((B + 1) * 4);
    float *lp = malloc(N * 4), *ent = malloc(N * 4);
    int rc = -1;
    if (!tok || !tgt || !cu || !lp || !ent) {
        snprintf(err, err_len, "out of memory packing a micro-batch of %d tokens", N);
        goto out;
    }
    int n = 0;
    cu[0] = 0;
    for (int b = 0; b < B; b++) {
        const DataRow *row = &r->rows[idx[b] / G];
        int P = (int)row->n_ids, L = r->comp_len[idx[b]];
        for (int j = 0; j < P + L; j++) {
            tok[n + j] = j < P ? row->ids[j] : r->comp[idx[b]][j - P];
            // Position j predicts token j + 1: scored only when that token is a completion token.
            tgt[n + j] = (j + 1 >= P && j + 1 < P + L) ? r->comp[idx[b]][j + 1 - P] : -1;
        }
        n += P + L;
        cu[b + 1] = n;
    }
    Batch batch = {.n_seqs = B, .n_tokens = N, .tokens = tok, .targets = tgt, .cu_seqlens = cu};
    if (model_forward(&t->model, t->acts, src, &batch, (float)(1.0 / t->cfg->temperature), lp, ent, NULL, err,
                      err_len) != 0)
        goto out;
    for (int b = 0; b < B; b++) {
        int P = (int)r->rows[idx[b] / G].n_ids, L = r->comp_len[idx[b]];
        for (int k = 0; k < T; k++) {
            int pos = cu[b] + P - 1 + k;
            logps[b * T + k] = k < L ? lp[pos] : 0.0f;
            if (entropies) entropies[b * T + k] = k < L ? ent[pos] : 0.0f;
        }
    }
    rc = 0;
out:
    free(tok), free(tgt), free(cu), free(lp), free(ent);
    return rc;
}

// The completion ids of the round, with the per-token logprobs of `src` (no gradient): old or reference logps.
static int score_all(Trainer *t, UnitSource *src, Round *r, float **out, int micro, char *err, size_t err_len) {
    int *idx = malloc((size_t)micro * sizeof(int));
    if (!idx) {
        snprintf(err, err_len, "out of memory for a micro-batch");
        return -1;
    }
    for (int s = 0; s < r->n; s += micro) {
        int B = r->n - s < micro ? r->n - s : micro, T = 0;
        for (int b = 0; b < B; b++) {
            idx[b] = s + b;
            if (r->comp_len[s + b] > T) T = r->comp_len[s + b];
        }
        float *lp = malloc((size_t)B * T * 4);
        if (!lp || forward_completions(t, src, r, idx, B, T, lp, NULL, err, err_len) != 0) {
            free(lp);
            free(idx);
            return -1;
        }
        for (int b = 0; b < B; b++) {
            out[s + b] = malloc((r->comp_len[s + b] + 1) * 4);
            memcpy(out[s + b], lp + b * T, r->comp_len[s + b] * 4);
        }
        free(lp);
    }
    free(idx);
    return 0;
}

// Generation, rewards and advantages for one round. Fills metrics with TRL's names.
static int make_round(Trainer *t, Round *r, json_t *m, char *err, size_t err_len) {
    TrainConfig *c = t->cfg;
    const int G = c->grpo.num_generations;
    memset(r, 0, sizeof *r);
    r->n_prompts = c->per_device_train_batch_size * c->resolved_steps_per_generation / G;
    r->n = r->n_prompts * G;
    r->rows = calloc(r->n_prompts, sizeof *r->rows);
    r->groups = calloc(r->n_prompts, sizeof *r->groups);
    r->comp = calloc(r->n, sizeof *r->comp);
    r->comp_len = calloc(r->n, sizeof *r->comp_len);
    r->sampling_logps = calloc(r->n, sizeof *r->sampling_logps);
    r->truncated = calloc(r->n, 1);
    r->advantages = calloc(r->n, sizeof *r->advantages);
    const int32_t **prompts = calloc(r->n_prompts, sizeof *prompts);
    int *plens = calloc(r->n_prompts, sizeof *plens);
    if (!r->rows || !r->groups || !r->comp || !r->comp_len || !r->sampling_logps || !r->truncated || !r->advantages ||
        !prompts || !plens) {
        snprintf(err, err_len, "out of memory for a generation round");
        free(prompts), free(plens);
        return -1;
    }
    for (int p = 0; p < r->n_prompts; p++) {
        if (trainer_next_row(t, &r->rows[p], err, err_len) < 0) {
            free(prompts), free(plens);
            return -1;
        }
        prompts[p] = r->rows[p].ids;
        plens[p] = (int)r->rows[p].n_ids;
    }
    ZmsgSampling s;
    zmsg_sampling_default(&s);
    s.n = G;
    s.max_tokens = c->grpo.max_completion_length;
    s.temperature = (float)c->temperature;
    s.top_p = (float)c->top_p;
    s.top_k = c->top_k > 0 ? c->top_k : -1;
    s.min_p = (float)c->min_p;
    s.repetition_penalty = (float)c->repetition_penalty;
    s.has_seed = 1;
    // Distinct seeds per rank and step, reproducible from the run's seed.
    s.seed = ((uint64_t)c->seed * 1000003ULL + (uint64_t)t->progress.step * 7919ULL + (uint64_t)t->rank * 104729ULL) &
             0x3FFFFFFFFFFFFFFFULL;
    double t0 = trainer_now();
    int rc;
    for (int attempt = 1;; attempt++) {
        rc = rollout_generate(t->rollout, r->n_prompts, prompts, plens, &s, r->groups, err, err_len);
        if (rc == -1) break;
        // Every rank agrees whether the round's generation worked: if one lost all its servers, all retry
        // together after the servers come back with this run's weights (a collective weight push).
        int32_t lost = rc != 0;
        if (comm_all_reduce(t->comm, &lost, 1, COMM_I32, COMM_MAX) != 0) {
            snprintf(err, err_len, "%s", comm_error(t->comm));
            rc = -1;
            break;
        }
        if (!lost) break;
        if (rc == 0) rollout_groups_free(r->groups, r->n_prompts);
        if (attempt == 3) {
            snprintf(err, err_len, "generation failed 3 times: the rollout servers keep going away");
            rc = -1;
            break;
        }
        int stale;
        double secs;
        if (t->rank == 0)
            fprintf(stderr, "tandem-train: rollout servers lost mid-round (generation attempt %d of 3); waiting up to "
                    "%.0f s (6 x --rollout-timeout) for one to answer, then pushing the weights and generating the "
                    "round again\n", attempt, 6.0 * c->rollout_timeout);
        if (rollout_client_refresh(t->rollout, t->progress.policy_version, 2000, &stale, err, err_len) != 0 ||
            weight_sync_push(t, &secs, err, err_len) != 0) {
            rc = -1;
            break;
        }
    }
    free(prompts), free(plens);
    if (rc != 0) return -1;
    double t_gen = trainer_now() - t0;
    int32_t eos[16];
    int n_eos = (int)tokenizer_eos_ids(t->tok, eos, 16);
    double len_sum = 0, clipped = 0;
    for (int p = 0; p < r->n_prompts; p++) {
        int off = 0;
        for (int j = 0; j < G; j++) {
            int i = p * G + j;
            r->comp[i] = r->groups[p].tokens + off;
            r->sampling_logps[i] = r->groups[p].logprobs + off;
            r->comp_len[i] = r->groups[p].lens[j];
            r->truncated[i] = grpo_completion_is_truncated(r->comp[i], r->comp_len[i], eos, n_eos,
                                                           tokenizer_pad_id(t->tok));
            off += r->comp_len[i];
            len_sum += r->comp_len[i];
            clipped += r->groups[p].finish[j] == ZMSG_FINISH_LENGTH;
        }
    }
    // Rewards: built-ins, then the service's functions.
    t0 = trainer_now();
    int F_builtin = (int)rewards_count(t->rewards), F = F_builtin;
    RewardSample *samples = calloc(r->n, sizeof *samples);
    char **texts = calloc(r->n, sizeof *texts);
    double *svc = NULL;
    if (!samples || !texts) goto oom;
    for (int i = 0; i < r->n; i++) {
        size_t len;
        if (tokenizer_decode(t->tok, r->comp[i], r->comp_len[i], 1, &texts[i], &len, err, err_len) != 0) goto fail;
        samples[i] = (RewardSample){.completion = texts[i], .completion_tokens = r->comp_len[i],
                                    .prompt = r->rows[i / G].prompt, .columns = r->rows[i / G].columns};
    }
    int F_svc = 0;
    if (t->reward_service) {
        // The service's function count is known after its first answer: score into a wide buffer, then copy.
        svc = malloc((size_t)r->n * 64 * sizeof(double));
        if (!svc) goto oom;
        size_t nf = 0;
        if (reward_service_score(t->reward_service, samples, r->n, svc, 64, 64, &nf, err, err_len) != 0) goto fail;
        F_svc = (int)nf;
        F += F_svc;
    }
    double *scores = malloc((size_t)r->n * (F ? F : 1) * sizeof(double));
    float *local = malloc((size_t)r->n * (F ? F : 1) * sizeof(float));
    float *all = malloc((size_t)r->n * t->world * (F ? F : 1) * sizeof(float));
    float *adv_all = malloc((size_t)r->n * t->world * sizeof(float));
    double *fmean = calloc(F ? F : 1, sizeof(double)), *fstd = calloc(F ? F : 1, sizeof(double));
    float *weights = NULL;
    if (!scores || !local || !all || !adv_all || !fmean || !fstd) {
        free(scores), free(local), free(all), free(adv_all), free(fmean), free(fstd);
        goto oom;
    }
    if (rewards_score(t->rewards, samples, r->n, scores, F, err, err_len) != 0) goto fail2;
    for (int i = 0; i < r->n; i++)
        for (int f = 0; f < F_svc; f++) scores[i * F + F_builtin + f] = svc[i * 64 + f];
    for (size_t k = 0; k < (size_t)r->n * F; k++) local[k] = (float)scores[k];
    if (c->reward_weights) {
        if ((int)c->n_reward_weights != F) {
            snprintf(err, err_len, "reward_weights has %zu entries but there are %d reward functions", c->n_reward_weights, F);
            goto fail2;
        }
        weights = malloc(F * sizeof(float));
        for (int f = 0; f < F; f++) weights[f] = (float)c->reward_weights[f];
    }
    // Advantages over the whole generation batch: every rank's rewards, in rank order (TRL's gather).
    if (comm_all_gather(t->comm, all, local, (size_t)r->n * F, COMM_F32) != 0) {
        snprintf(err, err_len, "gathering rewards: %s", comm_error(t->comm));
        goto fail2;
    }
    GrpoRewardMetrics rm;
    if (grpo_advantages(&c->grpo, r->n * t->world, F, all, weights, adv_all, &rm, fmean, fstd, err, err_len) != 0)
        goto fail2;
    memcpy(r->advantages, adv_all + (size_t)t->rank * r->n, r->n * sizeof(float));
    json_object_set_new(m, "reward", json_real(rm.reward));
    json_object_set_new(m, "reward_std", json_real(rm.reward_std));
    json_object_set_new(m, "frac_reward_zero_std", json_real(rm.frac_reward_zero_std));
    for (int f = 0; f < F; f++) {
        const char *name = f < F_builtin ? rewards_name(t->rewards, f) : reward_service_name(t->reward_service, f - F_builtin);
        char key[160];
        snprintf(key, sizeof key, "rewards/%s/mean", name);
        json_object_set_new(m, key, json_real(fmean[f]));
        snprintf(key, sizeof key, "rewards/%s/std", name);
        json_object_set_new(m, key, json_real(fstd[f]));
    }
    double sums[3] = {len_sum, clipped, (double)r->n};
    if (comm_all_reduce(t->comm, sums, 3, COMM_F64, COMM_SUM) != 0) {
        snprintf(err, err_len, "reducing metrics: %s", comm_error(t->comm));
        goto fail2;
    }
    json_object_set_new(m, "completions/mean_length", json_real(sums[0] / sums[2]));
    json_object_set_new(m, "completions/clipped_ratio", json_real(sums[1] / sums[2]));
    json_object_set_new(m, "rollout_time", json_real(t_gen));
    json_object_set_new(m, "prompts_skipped", json_integer((json_int_t)data_skipped(t->data)));
    json_object_set_new(m, "reward_time", json_real(trainer_now() - t0));
    free(scores), free(local), free(all), free(adv_all), free(fmean), free(fstd), free(weights);
    for (int i = 0; i < r->n; i++) free(texts[i]);
    free(texts), free(samples), free(svc);
    return 0;
fail2:
    free(scores), free(local), free(all), free(adv_all), free(fmean), free(fstd), free(weights);
fail:
    if (texts)
        for (int i = 0; i < r->n; i++) free(texts[i]);
    free(texts), free(samples), free(svc);
    return -1;
oom:
    snprintf(err, err_len, "out of memory scoring %d completions", r->n);
    goto fail;
}

static void add(double *acc, double v) { *acc += v; }

// The entropy threshold of top_entropy_quantile over the active tokens of this micro-batch on every rank.
static int entropy_threshold(Trainer *t, const GrpoOptions *o, int B, int T, const float *ent, const uint8_t *mask,
                             float *thr, char *err, size_t err_len) {
    int32_t k = 0, *counts = calloc(t->world, sizeof(int32_t));
    for (int i = 0; i < B * T; i++) k += mask[i] != 0;
    int rc = -1;
    float *mine = NULL, *all = NULL, *vals = NULL;
    if (!counts || comm_all_gather(t->comm, counts, &k, 1, COMM_I32) != 0) {
        snprintf(err, err_len, "gathering entropy counts: %s", counts ? comm_error(t->comm) : "out of memory");
        goto out;
    }
    int32_t kmax = 1, total = 0;
    for (int r = 0; r < t->world; r++) {
        if (counts[r] > kmax) kmax = counts[r];
        total += counts[r];
    }
    mine = calloc(kmax, sizeof(float));
    all = malloc((size_t)kmax * t->world * sizeof(float));
    vals = malloc((size_t)(total ? total : 1) * sizeof(float));
    if (!mine || !all || !vals) {
        snprintf(err, err_len, "out of memory gathering entropies");
        goto out;
    }
    for (int i = 0, j = 0; i < B * T; i++)
        if (mask[i]) mine[j++] = ent[i];
    if (comm_all_gather(t->comm, all, mine, kmax, COMM_F32) != 0) {
        snprintf(err, err_len, "gathering entropies: %s", comm_error(t->comm));
        goto out;
    }
    for (int r = 0, n = 0; r < t->world; r++)
        for (int j = 0; j < counts[r]; j++) vals[n++] = all[(size_t)r * kmax + j];
    *thr = grpo_entropy_threshold(o, vals, (size_t)total);
    rc = 0;
out:
    free(counts), free(mine), free(all), free(vals);
    return rc;
}

// Sums of one optimizer step's micro-batch metrics (TRL's names, reduced over ranks when logged).
typedef struct {
    double loss, kl, kl_n, ent, ent_n, clip_low, clip_high, clip_region, clip_n;
} StepSums;

// Micro-batch s of the round: forward, GRPO loss, backward (gradients accumulate in the ZeRO state).
static int micro_step(Trainer *t, UnitSource *policy, Round *r, int s, int need_old, int off_policy, double active,
                      GrpoEntropyControl *ec, StepSums *acc, char *err, size_t err_len) {
    const GrpoOptions *o = &t->cfg->grpo;
    const int GA = t->cfg->gradient_accumulation_steps, S = t->cfg->resolved_steps_per_generation;
    const int B = t->cfg->per_device_train_batch_size;
    int T = 0, *idx = malloc(B * sizeof(int));
    if (!idx) {
        snprintf(err, err_len, "out of memory for a micro-batch");
        return -1;
    }
    for (int b = 0; b < B; b++) {
        idx[b] = s * B + b;
        if (r->comp_len[idx[b]] > T) T = r->comp_len[idx[b]];
    }
    size_t BT = (size_t)B * T;
    float *lp = malloc(BT * 4), *ent = malloc(BT * 4), *old = NULL, *refl = NULL, *samp = malloc(BT * 4);
    float *grad = malloc(BT * 4), *adv = malloc(B * 4), *isr = NULL;
    // dL/dentropy: only the entropy bonus has one.
    const int bonus = o->entropy_coef != 0 || o->use_adaptive_entropy;
    float *gent = bonus ? calloc(BT, 4) : NULL;
    uint8_t *mask = calloc(BT, 1), *trunc = malloc(B);
    if (need_old) old = calloc(BT, 4);
    if (t->ref) refl = calloc(BT, 4);
    for (int b = 0; b < B; b++) {
        int i = idx[b];
        adv[b] = r->advantages[i];
        trunc[b] = r->truncated[i];
        for (int k = 0; k < T; k++) {
            int in = k < r->comp_len[i];
            mask[b * T + k] = in;
            samp[b * T + k] = in ? r->sampling_logps[i][k] : 0.0f;
            if (old) old[b * T + k] = in ? r->old_logps[i][k] : 0.0f;
            if (refl) refl[b * T + k] = in ? r->ref_logps[i][k] : 0.0f;
        }
    }
    grpo_mask_truncated_completions(o, B, T, trunc, mask);
    int rc = forward_completions(t, policy, r, idx, B, T, lp, ent, err, err_len);
    if (rc == 0 && o->vllm_importance_sampling_correction) {
        isr = malloc(grpo_rollout_is_ratio_len(o, B, T) * 4 + 4);
        GrpoRolloutIsMetrics im;
        rc = grpo_rollout_is_ratio(o, B, T, old, samp, mask, isr, &im, err, err_len);
    }
    // top_entropy_quantile < 1: the threshold is the quantile over every rank's active tokens (TRL gathers them).
    int has_thr = 0;
    float thr = 0;
    if (rc == 0 && o->top_entropy_quantile < 1) {
        rc = entropy_threshold(t, o, B, T, ent, mask, &thr, err, err_len);
        has_thr = rc == 0;
    }
    GrpoLossMetrics lm;
    if (rc == 0) {
        GrpoLossInput in = {.has_entropy_threshold = has_thr, .entropy_threshold = thr, .batch = B, .max_len = T,
                            .logps = lp,
                            .old_logps = off_policy ? old : NULL,
                            .ref_logps = refl, .sampling_logps = samp, .entropies = ent, .mask = mask,
                            .advantages = adv, .is_ratio = isr, .num_items_in_batch = active,
                            .num_processes = t->world, .gradient_accumulation_steps = GA,
                            .steps_per_generation = S, .training = 1,
                            .entropy_coef = grpo_entropy_apply_coef(ec, o)};
        rc = grpo_loss(o, &in, grad, gent, &lm, err, err_len);
    }
    if (rc == 0) {
        grpo_entropy_control_accumulate(ec, o, &lm);
        // dL/dlogprob back to the packed token positions of the forward just run.
        int N = 0;
        for (int b = 0; b < B; b++) N += (int)r->rows[idx[b] / o->num_generations].n_ids + r->comp_len[idx[b]];
        float *dlp = calloc(N, 4), *dent = gent ? calloc(N, 4) : NULL;
        int n = 0;
        for (int b = 0; b < B; b++) {
            int P = (int)r->rows[idx[b] / o->num_generations].n_ids, L = r->comp_len[idx[b]];
            for (int k = 0; k < L; k++) {
                dlp[n + P - 1 + k] = grad[b * T + k];
                if (dent) dent[n + P - 1 + k] = gent[b * T + k];
            }
            n += P + L;
        }
        rc = model_backward_entropy(&t->model, t->acts, policy, dlp, dent, err, err_len);
        free(dlp);
        free(dent);
        add(&acc->loss, lm.loss);
        add(&acc->kl, lm.kl_sum), add(&acc->kl_n, lm.kl_count);
        add(&acc->ent, lm.entropy_sum), add(&acc->ent_n, lm.entropy_count);
        add(&acc->clip_low, lm.clip_low_sum), add(&acc->clip_high, lm.clip_high_sum);
        add(&acc->clip_region, lm.clip_region_sum);
        add(&acc->clip_n, lm.clip_count);
    }
    free(gent);
    free(lp), free(ent), free(old), free(refl), free(samp), free(grad), free(adv), free(isr), free(mask),
        free(trunc);
    free(idx);
    return rc;
}


int trainer_run_grpo(Trainer *t, char *err, size_t err_len) {
    TrainConfig *c = t->cfg;
    GrpoOptions *o = &c->grpo;
    const int micro = c->per_device_train_batch_size, GA = c->gradient_accumulation_steps;
    const int S = c->resolved_steps_per_generation;
    UnitSource policy = zero3_source(t->policy), ref = t->ref ? zero3_source(t->ref) : (UnitSource){0};
    GrpoEntropyControl ec;
    grpo_entropy_control_init(&ec, o);
    // Resumed: the servers may hold other weights (a later step of the run that stopped, or the base model
    // after a restart) — give them this step's before the first rollout.
    if (c->resume) {
        double secs;
        if (weight_sync_push(t, &secs, err, err_len) != 0) return -1;
    }
    while (t->progress.step < t->total_steps) {
        double t_round = trainer_now();
        // A server that restarted (or missed a push) gets this run's weights before it generates for it.
        int stale = 0;
        if (rollout_client_refresh(t->rollout, t->progress.policy_version, 2000, &stale, err, err_len) != 0) return -1;
        int32_t any_stale = stale;
        if (comm_all_reduce(t->comm, &any_stale, 1, COMM_I32, COMM_MAX) != 0) {
            snprintf(err, err_len, "%s", comm_error(t->comm));
            return -1;
        }
        if (any_stale) {
            double secs;
            if (t->rank == 0)
                fprintf(stderr, "tandem-train: a rollout server holds other weights than version %lld: pushing them\n",
                        (long long)t->progress.policy_version);
            if (weight_sync_push(t, &secs, err, err_len) != 0) return -1;
        }
        Round r;
        json_t *m = json_object();
        if (make_round(t, &r, m, err, err_len) != 0) {
            json_decref(m);
            round_free(&r);
            return -1;
        }
        // Logprobs before any update of this round: the off-policy ratio (num_iterations > 1 or more micro-steps
        // than one optimizer step) and the rollout importance-sampling correction need them.
        int need_old = c->num_iterations > 1 || S > GA || o->vllm_importance_sampling_correction;
        if (need_old) {
            r.old_logps = calloc(r.n, sizeof(float *));
            if (score_all(t, &policy, &r, r.old_logps, micro, err, err_len) != 0) goto fail;
        }
        if (t->ref) {
            r.ref_logps = calloc(r.n, sizeof(float *));
            if (score_all(t, &ref, &r, r.ref_logps, micro, err, err_len) != 0) goto fail;
        }
        // num_items_in_batch: active completion tokens of the whole generation batch, every rank.
        double active = 0;
        for (int i = 0; i < r.n; i++)
            active += (o->mask_truncated_completions && r.truncated[i]) ? 0 : r.comp_len[i];
        if (comm_all_reduce(t->comm, &active, 1, COMM_F64, COMM_SUM) != 0) {
            snprintf(err, err_len, "%s", comm_error(t->comm));
            goto fail;
        }
        StepSums sums = {0};
        double t_train = 0;
        int micro_done = 0;
        for (int it = 0; it < c->num_iterations; it++) {
            for (int s = 0; s < S; s++) {
                double t0 = trainer_now();
                int rc = micro_step(t, &policy, &r, s, need_old, c->num_iterations > 1 || S > GA, active, &ec, &sums,
                                    err, err_len);
                if (rc != 0) goto fail;
                t_train += trainer_now() - t0;
                if (++micro_done % GA != 0) continue;
                // Optimizer step.
                float gn;
                double lr;
                t0 = trainer_now();
                if (trainer_optimizer_step(t, &gn, &lr, err, err_len) != 0) goto fail;
                t_train += trainer_now() - t0;
                if (o->use_adaptive_entropy) {
                    double w[2] = {ec.window_sum, ec.window_count};
                    if (comm_all_reduce(t->comm, w, 2, COMM_F64, COMM_SUM) != 0) {
                        snprintf(err, err_len, "%s", comm_error(t->comm));
                        goto fail;
                    }
                    grpo_entropy_control_step(&ec, o, w[0], w[1]);
                }
                double t_sync = 0, sync_bytes = 0, t_transfer = 0, t_begin = 0, t_end = 0, t_commit = 0;
                if (t->progress.step % c->weight_sync_steps == 0 || t->progress.step == t->total_steps) {
                    if (weight_sync_push(t, &t_sync, err, err_len) != 0) goto fail;
                    sync_bytes = t->sync.bytes;
                    t_transfer = t->sync.transfer_seconds;
                    t_begin = t->sync.begin_seconds;
                    t_end = t->sync.end_seconds;
                    t_commit = t->sync.commit_seconds;
                }
                double red[10] = {sums.loss, sums.kl, sums.kl_n, sums.ent, sums.ent_n, sums.clip_low, sums.clip_high,
                                  sums.clip_region, sums.clip_n, sync_bytes};
                if (comm_all_reduce(t->comm, red, 10, COMM_F64, COMM_SUM) != 0) {
                    snprintf(err, err_len, "%s", comm_error(t->comm));
                    goto fail;
                }
                json_t *mm = json_deep_copy(m);
                json_object_set_new(mm, "loss", json_real(red[0] / t->world));
                if (o->beta != 0) json_object_set_new(mm, "kl", json_real(red[1] / (red[2] > 0 ? red[2] : 1)));
                json_object_set_new(mm, "entropy", json_real(red[3] / (red[4] > 0 ? red[4] : 1)));
                json_object_set_new(mm, "clip_ratio/low_mean", json_real(red[5] / (red[8] > 0 ? red[8] : 1)));
                json_object_set_new(mm, "clip_ratio/high_mean", json_real(red[6] / (red[8] > 0 ? red[8] : 1)));
                json_object_set_new(mm, "clip_ratio/region_mean", json_real(red[7] / (red[8] > 0 ? red[8] : 1)));
                json_object_set_new(mm, "grad_norm", json_real(gn));
                json_object_set_new(mm, "learning_rate", json_real(lr));
                json_object_set_new(mm, "num_tokens", json_real(active));
                json_object_set_new(mm, "train_time", json_real(t_train));
                json_object_set_new(mm, "sync_time", json_real(t_sync));
                json_object_set_new(mm, "sync_bytes", json_real(red[9]));   // sent by all ranks to all servers
                json_object_set_new(mm, "sync_transfer_time", json_real(t_transfer));   // rank 0's sending alone
                // the rest of rank 0's push: weights_begin answered, weights_end answered (the servers' receive
                // finishing + their swap), and the swap alone as the slowest server reports it
                json_object_set_new(mm, "sync_begin_time", json_real(t_begin));
                json_object_set_new(mm, "sync_end_time", json_real(t_end));
                json_object_set_new(mm, "sync_commit_time", json_real(t_commit));
                json_object_set_new(mm, "step_time", json_real(trainer_now() - t_round));
                json_object_set_new(mm, "policy_version", json_integer(t->progress.policy_version));
                if (t->progress.step % c->logging_steps == 0 || t->progress.step == t->total_steps) trainer_log(t, mm);
                else json_decref(mm);
                trainer_progress(t);
                sums = (StepSums){0};
                t_train = 0;
                if (c->save_steps > 0 && t->progress.step % c->save_steps == 0) {
                    if (trainer_save(t, err, err_len) != 0) goto fail;
                    // The round's rollouts are not part of a checkpoint: a run resumed from one saved before the
                    // round's last micro-step generates a new round, so it does not repeat this run's next steps.
                    if (t->rank == 0 && (it < c->num_iterations - 1 || s < S - 1) &&
                        t->progress.step < t->total_steps)
                        fprintf(stderr, "tandem-train: checkpoint-%lld was saved inside a generation round (%d "
                                "micro-steps x %d iterations): a run resumed from it generates a new round there, so "
                                "it will not repeat this run's next steps bit for bit; checkpoints at a round's last "
                                "step do\n", (long long)t->progress.step, S, c->num_iterations);
                }
                if (t->progress.step >= t->total_steps) break;
            }
            if (t->progress.step >= t->total_steps) break;
        }
        json_decref(m);
        round_free(&r);
        continue;
    fail:
        json_decref(m);
        round_free(&r);
        return -1;
    }
    if (c->save_steps == 0 || t->progress.step % c->save_steps != 0) return trainer_save(t, err, err_len);
    return 0;
}
