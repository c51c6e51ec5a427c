// trainer/grpo_train.c — the GRPO loop of one rank: per round the phases generate, rewards and advantages
// (trainer/grpo_round.c), then old / reference logprobs, micro-steps (forward, GRPO loss, backward), optimizer
// steps, weight pushes and the log (see trainer/trainer.h for the shape of a round). The micro-steps' buffers
// live in one workspace that grows to the largest micro-batch seen, so a steady-state step allocates nothing here.
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"
#include "trainer/grpo_loss.h"
#include "trainer/grpo_round.h"
#include "trainer/trainer.h"

// A micro-batch's buffers: B completions of at most T tokens, N packed prompt + completion tokens.
typedef struct {
    size_t cap_bt, cap_b, cap_n;
    int *idx;                             // (B) completion indices
    float *logps, *entropies;             // (B, T) the forward's, on the completion tokens
    float *old, *ref, *sampling;          // (B, T)
    float *grad, *grad_entropy;           // (B, T) dL/dlogprob, dL/dentropy
    float *is_ratio;                      // (B, T) or (B): grpo_rollout_is_ratio_len
    float *advantages;                    // (B)
    uint8_t *mask, *truncated;            // (B, T), (B)
    int32_t *tokens, *targets, *cu;       // (N), (N), (B + 1) the packed batch
    float *packed_logps, *packed_entropies; // (N)
    float *dlogps, *dentropies;           // (N) gradients at the packed positions
} MicroBuffers;

static void micro_buffers_free(MicroBuffers *w) {
    free(w->idx), free(w->logps), free(w->entropies), free(w->old), free(w->ref), free(w->sampling), free(w->grad);
    free(w->grad_entropy), free(w->is_ratio), free(w->advantages), free(w->mask), free(w->truncated), free(w->tokens);
    free(w->targets), free(w->cu), free(w->packed_logps), free(w->packed_entropies), free(w->dlogps);
    free(w->dentropies);
    memset(w, 0, sizeof *w);
}

// Grows the buffers to hold B completions of T tokens packed into N tokens.
static int micro_buffers_fit(MicroBuffers *w, int B, int T, int N, char *err, size_t err_len) {
    size_t bt = (size_t)B * T + 1, b = (size_t)B + 1, n = (size_t)N + 1;
    int ok = 1;
#define GROW(field, count, cap) \
    if ((count) > (cap)) { \
        free(w->field); \
        ok &= (w->field = malloc((count) * sizeof *w->field)) != NULL; \
    }
    GROW(logps, bt, w->cap_bt) GROW(entropies, bt, w->cap_bt) GROW(old, bt, w->cap_bt) GROW(ref, bt, w->cap_bt)
    GROW(sampling, bt, w->cap_bt) GROW(grad, bt, w->cap_bt) GROW(grad_entropy, bt, w->cap_bt)
    GROW(is_ratio, bt, w->cap_bt) GROW(mask, bt, w->cap_bt)
    GROW(idx, b, w->cap_b) GROW(advantages, b, w->cap_b) GROW(truncated, b, w->cap_b) GROW(cu, b, w->cap_b)
    GROW(tokens, n, w->cap_n) GROW(targets, n, w->cap_n) GROW(packed_logps, n, w->cap_n)
    GROW(packed_entropies, n, w->cap_n) GROW(dlogps, n, w->cap_n) GROW(dentropies, n, w->cap_n)
#undef GROW
    if (!ok) {
        micro_buffers_free(w);
        snprintf(err, err_len, "out of memory for a micro-batch of %d completions (%d tokens)", B, N);
        return -1;
    }
    if (bt > w->cap_bt) w->cap_bt = bt;
    if (b > w->cap_b) w->cap_b = b;
    if (n > w->cap_n) w->cap_n = n;
    return 0;
}

// Tokens of completions idx[0..B) packed with their prompts.
static int packed_tokens(const Trainer *t, const GrpoRound *r, const int *idx, int B) {
    const int G = t->cfg->grpo.num_generations;
    int N = 0;
    for (int b = 0; b < B; b++) N += (int)r->rows[idx[b] / G].n_ids + r->comp_len[idx[b]];
    return N;
}

// Packs completions w->idx[0..B) (prompt + completion each) and runs the forward of `src`: per-token logprobs
// (and entropies) of the completion tokens into w->logps / w->entropies as (B, T). T = longest completion.
static int forward_completions(Trainer *t, UnitSource *src, const GrpoRound *r, MicroBuffers *w, int B, int T,
                               int with_entropies, char *err, size_t err_len) {
    const int G = t->cfg->grpo.num_generations;
    const int *idx = w->idx;
    int N = packed_tokens(t, r, idx, B);
    if (trainer_ensure_acts(t, N, B, err, err_len) != 0) return -1;
    int n = 0;
    w->cu[0] = 0;
    for (int b = 0; b < B; b++) {
        const DataRow *row = &r->rows[idx[b] / G];
        int P = (int)row->n_ids, L = r->comp_len[idx[b]];
        for (int j = 0; j < P + L; j++) {
            w->tokens[n + j] = j < P ? row->ids[j] : r->comp[idx[b]][j - P];
            // Position j predicts token j + 1: scored only when that token is a completion token.
            w->targets[n + j] = (j + 1 >= P && j + 1 < P + L) ? r->comp[idx[b]][j + 1 - P] : -1;
        }
        n += P + L;
        w->cu[b + 1] = n;
    }
    Batch batch = {.n_seqs = B, .n_tokens = N, .tokens = w->tokens, .targets = w->targets, .cu_seqlens = w->cu};
    if (model_forward(&t->model, t->acts, src, &batch, (float)(1.0 / t->cfg->temperature), w->packed_logps,
                      w->packed_entropies, NULL, err, err_len) != 0)
        return -1;
    for (int b = 0; b < B; b++) {
        int P = (int)r->rows[idx[b] / G].n_ids, L = r->comp_len[idx[b]];
        for (int k = 0; k < T; k++) {
            int pos = w->cu[b] + P - 1 + k;
            w->logps[b * T + k] = k < L ? w->packed_logps[pos] : 0.0f;
            if (with_entropies) w->entropies[b * T + k] = k < L ? w->packed_entropies[pos] : 0.0f;
        }
    }
    return 0;
}

// The per-token logprobs of `src` (no gradient) of completions [s, s + B) of the round into out (r->off slices):
// the old or the reference logprobs.
static int score_chunk(Trainer *t, UnitSource *src, GrpoRound *r, MicroBuffers *w, float *out, int s, int B,
                       char *err, size_t err_len) {
    int T = 0;
    for (int b = 0; b < B; b++)
        if (r->comp_len[s + b] > T) T = r->comp_len[s + b];
    if (micro_buffers_fit(w, B, T, 0, err, err_len) != 0) return -1;
    for (int b = 0; b < B; b++) w->idx[b] = s + b;
    if (micro_buffers_fit(w, B, T, packed_tokens(t, r, w->idx, B), err, err_len) != 0 ||
        forward_completions(t, src, r, w, B, T, 0, err, err_len) != 0)
        return -1;
    for (int b = 0; b < B; b++)
        memcpy(out + r->off[s + b], w->logps + (size_t)b * T, r->comp_len[s + b] * sizeof(float));
    return 0;
}

// The old and reference logprobs of a round, chunk by chunk (micro-batches of completions, in order): while the
// round streams in (RoundStream), then the rest.
typedef struct {
    Trainer *t;
    UnitSource *policy, *ref;
    MicroBuffers *w;
    int need_old;
    double old_seconds, ref_seconds;    // spent on chunks while the round was still coming in
} LogpsChunks;

static int logps_chunk(LogpsChunks *x, GrpoRound *r, int k, int micro, char *err, size_t err_len) {
    const int s = k * micro, B = r->n - s < micro ? r->n - s : micro;
    // Chunks come in order, so off[s] is known: the slices of this one follow it.
    for (int i = s; i < s + B; i++) r->off[i + 1] = r->off[i] + (size_t)r->comp_len[i];
    if (r->off[s + B] > r->logps_cap)
        return err_fail(err, err_len, "the round's completions hold %zu tokens, more than max_completion_length "
                        "allows (%zu)", r->off[s + B], r->logps_cap);
    double t0 = trainer_now();
    if (x->need_old && score_chunk(x->t, x->policy, r, x->w, r->old_logps, s, B, err, err_len) != 0) return -1;
    double t1 = trainer_now();
    if (x->t->ref && score_chunk(x->t, x->ref, r, x->w, r->ref_logps, s, B, err, err_len) != 0) return -1;
    x->old_seconds += t1 - t0;
    x->ref_seconds += trainer_now() - t1;
    return 0;
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
static int micro_step(Trainer *t, UnitSource *policy, const GrpoRound *r, MicroBuffers *w, int s, int need_old,
                      int off_policy, double active, GrpoEntropyControl *ec, StepSums *acc, char *err,
                      size_t err_len) {
    const GrpoOptions *o = &t->cfg->grpo;
    const int GA = t->cfg->gradient_accumulation_steps, S = t->cfg->resolved_steps_per_generation;
    const int B = t->cfg->per_device_train_batch_size, G = o->num_generations;
    int T = 0;
    for (int b = 0; b < B; b++)
        if (r->comp_len[s * B + b] > T) T = r->comp_len[s * B + b];
    if (micro_buffers_fit(w, B, T, 0, err, err_len) != 0) return -1;
    for (int b = 0; b < B; b++) w->idx[b] = s * B + b;
    const int N = packed_tokens(t, r, w->idx, B);
    if (micro_buffers_fit(w, B, T, N, err, err_len) != 0) return -1;
    const size_t BT = (size_t)B * T;
    // dL/dentropy: only the entropy bonus has one.
    const int bonus = o->entropy_coef != 0 || o->use_adaptive_entropy;
    float *gent = bonus ? w->grad_entropy : NULL;
    if (gent) memset(gent, 0, BT * sizeof *gent);
    for (int b = 0; b < B; b++) {
        int i = w->idx[b];
        const float *old_i = need_old ? r->old_logps + r->off[i] : NULL, *ref_i = t->ref ? r->ref_logps + r->off[i] : NULL;
        w->advantages[b] = r->advantages[i];
        w->truncated[b] = r->truncated[i];
        for (int k = 0; k < T; k++) {
            int in = k < r->comp_len[i];
            w->mask[b * T + k] = in;
            w->sampling[b * T + k] = in ? r->sampling_logps[i][k] : 0.0f;
            if (old_i) w->old[b * T + k] = in ? old_i[k] : 0.0f;
            if (ref_i) w->ref[b * T + k] = in ? ref_i[k] : 0.0f;
        }
    }
    const float *old = need_old ? w->old : NULL;
    grpo_mask_truncated_completions(o, B, T, w->truncated, w->mask);
    // A completion dropped as too stale stays in the micro-batch (every rank runs the same micro-steps) with no
    // active token: it adds nothing to the loss, its gradient or num_items_in_batch.
    for (int b = 0; b < B; b++)
        if (!r->keep[w->idx[b]]) memset(w->mask + (size_t)b * T, 0, (size_t)T);
    int rc = forward_completions(t, policy, r, w, B, T, 1, err, err_len);
    const float *isr = NULL;
    if (rc == 0 && o->vllm_importance_sampling_correction) {
        GrpoRolloutIsMetrics im;
        rc = grpo_rollout_is_ratio(o, B, T, old, w->sampling, w->mask, w->is_ratio, &im, err, err_len);
        isr = w->is_ratio;
    }
    // top_entropy_quantile < 1: the threshold is the quantile over every rank's active tokens (TRL gathers them).
    int has_thr = 0;
    float thr = 0;
    if (rc == 0 && o->top_entropy_quantile < 1) {
        rc = entropy_threshold(t, o, B, T, w->entropies, w->mask, &thr, err, err_len);
        has_thr = rc == 0;
    }
    if (rc != 0) return -1;
    GrpoLossMetrics lm;
    GrpoLossInput in = {.has_entropy_threshold = has_thr, .entropy_threshold = thr, .batch = B, .max_len = T,
                        .logps = w->logps, .old_logps = off_policy ? old : NULL,
                        .ref_logps = t->ref ? w->ref : NULL, .sampling_logps = w->sampling,
                        .entropies = w->entropies, .mask = w->mask, .advantages = w->advantages, .is_ratio = isr,
                        .num_items_in_batch = active, .num_processes = t->world, .gradient_accumulation_steps = GA,
                        .steps_per_generation = S, .training = 1, .entropy_coef = grpo_entropy_apply_coef(ec, o)};
    if (grpo_loss(o, &in, w->grad, gent, &lm, err, err_len) != 0) return -1;
    const long step = t->progress.step + 1;   // the optimizer step this micro-batch feeds
    if (t->completions && (step % t->cfg->logging_steps == 0 || step == t->total_steps) &&
        grpo_log_completions(t, r, step, w->idx, B, T, old, isr, grpo_rollout_is_ratio_len(o, 1, 2) == 2, err,
                             err_len) != 0)
        return -1;
    grpo_entropy_control_accumulate(ec, o, &lm);
    // dL/dlogprob back to the packed token positions of the forward just run.
    memset(w->dlogps, 0, (size_t)N * sizeof *w->dlogps);
    if (gent) memset(w->dentropies, 0, (size_t)N * sizeof *w->dentropies);
    for (int b = 0, n = 0; b < B; b++) {
        int P = (int)r->rows[w->idx[b] / G].n_ids, L = r->comp_len[w->idx[b]];
        for (int k = 0; k < L; k++) {
            w->dlogps[n + P - 1 + k] = w->grad[b * T + k];
            if (gent) w->dentropies[n + P - 1 + k] = gent[b * T + k];
        }
        n += P + L;
    }
    if (model_backward_entropy(&t->model, t->acts, policy, w->dlogps, gent ? w->dentropies : NULL, err, err_len) != 0)
        return -1;
    add(&acc->loss, lm.loss);
    add(&acc->kl, lm.kl_sum), add(&acc->kl_n, lm.kl_count);
    add(&acc->ent, lm.entropy_sum), add(&acc->ent_n, lm.entropy_count);
    add(&acc->clip_low, lm.clip_low_sum), add(&acc->clip_high, lm.clip_high_sum);
    add(&acc->clip_region, lm.clip_region_sum);
    add(&acc->clip_n, lm.clip_count);
    return 0;
}

// What runs on a round while it streams in (GrpoStreamWork): for micro-batch k, once every rank holds its groups,
// its old and reference logprobs, and — when the options let a micro-step run before the whole round is in (see
// early_micro_steps) — its micro-step, the first `early` of the round.
typedef struct {
    LogpsChunks logps;
    int early;                  // micro-steps that may run while the round comes in
    int off_policy;
    GrpoEntropyControl *ec;
    StepSums *sums;             // the first optimizer step's sums, carried on by run_round
    double *t_train;
    int micro_done;             // micro-steps run while the round came in
    double fwd_bwd_seconds;
} RoundStream;

// Micro-steps that may start before the whole round is in, with the same result: those before the round's first
// optimizer step (a step would push weights to servers still generating the round), when nothing they need reads
// the whole batch — dapo, cispo and vespo divide by num_items_in_batch (every rank's active tokens of the round),
// scale_rewards batch and normalize_then_sum normalise advantages over the batch. 0 otherwise.
static int early_micro_steps(const TrainConfig *c) {
    const GrpoOptions *o = &c->grpo;
    if (o->loss_type == GRPO_LOSS_DAPO || o->loss_type == GRPO_LOSS_CISPO || o->loss_type == GRPO_LOSS_VESPO ||
        o->scale_rewards == GRPO_SCALE_BATCH || o->multi_objective_aggregation != GRPO_AGG_SUM_THEN_NORMALIZE)
        return 0;
    const int S = c->resolved_steps_per_generation, GA = c->gradient_accumulation_steps;
    return S < GA ? S : GA;
}

static int round_stream_chunk(void *ctx, GrpoRound *r, int k, char *err, size_t err_len) {
    RoundStream *x = ctx;
    Trainer *t = x->logps.t;
    const int B = t->cfg->per_device_train_batch_size, G = t->cfg->grpo.num_generations;
    if (logps_chunk(&x->logps, r, k, B, err, err_len) != 0) return -1;
    if (k >= x->early) return 0;
    // The groups micro-batch k draws on are all in (the stream counts whole groups).
    for (int g = k * B / G; g <= ((k + 1) * B - 1) / G; g++)
        if (grpo_round_group_advantages(t, r, g, err, err_len) != 0) return -1;
    double t0 = trainer_now();
    // num_items_in_batch is not known yet; none of the loss types that run here reads it.
    if (micro_step(t, x->logps.policy, r, x->logps.w, k, x->logps.need_old, x->off_policy, 0, x->ec, x->sums, err,
                   err_len) != 0)
        return -1;
    double dt = trainer_now() - t0;
    *x->t_train += dt;
    x->fwd_bwd_seconds += dt;
    x->micro_done = k + 1;
    return 0;
}

// The push that ends an optimizer step, when due: its timings for the log.
typedef struct {
    double seconds, bytes, transfer, begin, end, commit;
} SyncTimes;

static int push_if_due(Trainer *t, SyncTimes *st, char *err, size_t err_len) {
    *st = (SyncTimes){0};
    if (t->progress.step % t->cfg->weight_sync_steps != 0 && t->progress.step != t->total_steps) return 0;
    if (weight_sync_push(t, &st->seconds, err, err_len) != 0) return -1;
    *st = (SyncTimes){.seconds = st->seconds, .bytes = t->sync.bytes, .transfer = t->sync.transfer_seconds,
                      .begin = t->sync.begin_seconds, .end = t->sync.end_seconds, .commit = t->sync.commit_seconds};
    return 0;
}

// Where the wall time of one optimizer step went on this rank (seconds), from the moment the previous step's
// record was written (the run's start for the first) to the moment this one's is: every second lands in exactly
// one field, `other` taking what no phase claims. A round's own phases (refresh to reference logprobs) fall in the
// window of its first optimizer step. Logged as the *_time fields of docs/training.md.
typedef enum {
    PHASE_REFRESH,      // hello to every server, and a push to one holding other weights
    PHASE_ISSUE,        // sending prompts: this round's, or rounds generated ahead
    PHASE_WAIT,         // waiting for a round's completions once its training is due (the trainer idles)
    PHASE_REWARDS,      // decoding, reward functions and service, advantages
    PHASE_OLD_LOGPS,    // the old logprobs of the round
    PHASE_REF_LOGPS,    // the reference model's
    PHASE_FWD_BWD,      // micro-steps: forward, loss, backward
    PHASE_OPTIMIZER,    // the optimizer step (and the adaptive-entropy reduce)
    PHASE_SYNC,         // the weight push
    PHASE_LOG,          // the metrics reduce, writing the previous record, the progress line
    PHASE_CHECKPOINT,   // the checkpoint saved after the previous record
    N_PHASES
} StepPhase;

static const char *const PHASE_KEYS[N_PHASES] = {
    "refresh_time", "generate_issue_time", "generate_wait_time", "rewards_phase_time", "old_logps_time",
    "ref_logps_time", "forward_backward_time", "optimizer_time", "weight_sync_phase_time", "log_time",
    "checkpoint_time"};

typedef struct {
    double start;               // trainer_now() when the window opened
    double seconds[N_PHASES];
    double mark;                // the start of the phase being timed (moved by step_clock_charge)
    // rank 0: the servers' engine step seconds (stats) at the previous record, for the rollout pool's busy fraction
    double pool_at, pool_step_seconds;
    int pool_servers;           // servers that answered then; 0: no reading
} StepClock;

// Rank 0: how busy the rollout pool was since the previous reading — engine step seconds over wall seconds x
// servers (a server of several engines counts each engine's seconds) — as `rollout_busy_fraction`, when the same
// number of servers answered both readings.
static int log_pool_busy(Trainer *t, StepClock *k, json_t *mm, char *err, size_t err_len) {
    double step_seconds;
    int n;
    if (rollout_client_step_seconds(t->rollout, 1000, &step_seconds, &n, err, err_len) != 0) return -1;
    double now = trainer_now();
    if (mm && n > 0 && n == k->pool_servers && now > k->pool_at)
        json_object_set_new(mm, "rollout_busy_fraction",
                            json_real((step_seconds - k->pool_step_seconds) / ((now - k->pool_at) * n)));
    k->pool_at = now, k->pool_step_seconds = step_seconds, k->pool_servers = n;
    return 0;
}

static void step_clock_open(StepClock *k, double now) {
    k->start = k->mark = now;
    for (int p = 0; p < N_PHASES; p++) k->seconds[p] = 0;
}

// Charges the time since the last mark to `phase` and moves the mark to now.
static void step_clock_charge(StepClock *k, StepPhase phase) {
    double now = trainer_now();
    k->seconds[phase] += now - k->mark;
    k->mark = now;
}

// The same for a stretch in which seconds[j] (j < n) belonged to phases[j], the rest to `phase`: collecting a
// round, during which the groups that came back were scored and the chunks every rank held were given their old and
// reference logprobs (streaming groups).
static void step_clock_charge_parts(StepClock *k, StepPhase phase, const StepPhase *phases, const double *seconds,
                                    int n) {
    double now = trainer_now(), left = now - k->mark;
    for (int j = 0; j < n; j++) {
        double part = seconds[j] < left ? seconds[j] : left;
        k->seconds[phases[j]] += part;
        left -= part;
    }
    k->seconds[phase] += left;
    k->mark = now;
}

// The log phase: the round's metrics (m) with this optimizer step's, reduced over ranks, to metrics.jsonl. Opens
// the next step's clock at the moment the record is handed to trainer_log.
static int log_step(Trainer *t, const json_t *m, const StepSums *sums, float grad_norm, double lr, double active,
                    double t_train, const SyncTimes *st, double t_round, StepClock *clock, char *err,
                    size_t err_len) {
    const GrpoOptions *o = &t->cfg->grpo;
    double red[10] = {sums->loss, sums->kl, sums->kl_n, sums->ent, sums->ent_n, sums->clip_low, sums->clip_high,
                      sums->clip_region, sums->clip_n, st->bytes};
    if (comm_all_reduce(t->comm, red, 10, COMM_F64, COMM_SUM) != 0) {
        snprintf(err, err_len, "%s", comm_error(t->comm));
        return -1;
    }
    step_clock_charge(clock, PHASE_LOG);
    if (t->progress.step % t->cfg->logging_steps != 0 && t->progress.step != t->total_steps) {
        step_clock_open(clock, trainer_now());
        return 0;
    }
    json_t *mm = json_deep_copy(m);
    if (!mm) {
        snprintf(err, err_len, "out of memory for the step's metrics");
        return -1;
    }
    json_object_set_new(mm, "loss", json_real(red[0] / t->world));
    if (o->beta != 0) json_object_set_new(mm, "kl", json_real(red[1] / (red[2] > 0 ? red[2] : 1)));
    json_object_set_new(mm, "entropy", json_real(red[3] / (red[4] > 0 ? red[4] : 1)));
    json_object_set_new(mm, "clip_ratio/low_mean", json_real(red[5] / (red[8] > 0 ? red[8] : 1)));
    json_object_set_new(mm, "clip_ratio/high_mean", json_real(red[6] / (red[8] > 0 ? red[8] : 1)));
    json_object_set_new(mm, "clip_ratio/region_mean", json_real(red[7] / (red[8] > 0 ? red[8] : 1)));
    if (t->rank == 0 && log_pool_busy(t, clock, mm, err, err_len) != 0) {
        json_decref(mm);
        return -1;
    }
    step_clock_charge(clock, PHASE_LOG);
    json_object_set_new(mm, "grad_norm", json_real(grad_norm));
    json_object_set_new(mm, "learning_rate", json_real(lr));
    json_object_set_new(mm, "num_tokens", json_real(active));
    json_object_set_new(mm, "train_time", json_real(t_train));
    json_object_set_new(mm, "sync_time", json_real(st->seconds));
    json_object_set_new(mm, "sync_bytes", json_real(red[9]));   // sent by all ranks to all servers
    json_object_set_new(mm, "sync_transfer_time", json_real(st->transfer));   // rank 0's sending alone
    // the rest of rank 0's push: weights_begin answered, weights_end answered (the servers' receive finishing +
    // their swap), and the swap alone as the slowest server reports it
    json_object_set_new(mm, "sync_begin_time", json_real(st->begin));
    json_object_set_new(mm, "sync_end_time", json_real(st->end));
    json_object_set_new(mm, "sync_commit_time", json_real(st->commit));
    double now = trainer_now(), attributed = 0;
    json_object_set_new(mm, "step_time", json_real(now - t_round));
    for (int p = 0; p < N_PHASES; p++) {
        json_object_set_new(mm, PHASE_KEYS[p], json_real(clock->seconds[p]));
        attributed += clock->seconds[p];
    }
    json_object_set_new(mm, "step_wall_time", json_real(now - clock->start));
    json_object_set_new(mm, "other_time", json_real(now - clock->start - attributed));
    // The trainer's model compute (its GPUs' work) over the step's wall time.
    const double compute = clock->seconds[PHASE_OLD_LOGPS] + clock->seconds[PHASE_REF_LOGPS] +
                           clock->seconds[PHASE_FWD_BWD] + clock->seconds[PHASE_OPTIMIZER];
    const double wall = now - clock->start;
    json_object_set_new(mm, "trainer_busy_fraction", json_real(wall > 0 ? compute / wall : 0));
    json_object_set_new(mm, "policy_version", json_integer(t->progress.policy_version));
    step_clock_open(clock, now);
    trainer_log(t, mm);
    return 0;
}

// Before a round: a server that restarted (or missed a push) gets this run's weights before it generates for it.
static int refresh_servers(Trainer *t, char *err, size_t err_len) {
    int stale = 0;
    if (rollout_client_refresh(t->rollout, t->progress.policy_version, 2000, &stale, err, err_len) != 0) return -1;
    int32_t any_stale = stale;
    if (comm_all_reduce(t->comm, &any_stale, 1, COMM_I32, COMM_MAX) != 0) {
        snprintf(err, err_len, "%s", comm_error(t->comm));
        return -1;
    }
    if (!any_stale) return 0;
    double secs;
    if (t->rank == 0)
        fprintf(stderr, "tandem-train: a rollout server holds other weights than version %lld: pushing them\n",
                (long long)t->progress.policy_version);
    return weight_sync_push(t, &secs, err, err_len);
}

// The rounds of a run: rounds[head] is trained next; the `issued` rounds from head on (a ring of n =
// max_staleness + 1) have been sent to the servers, the ones after head generating while head trains.
typedef struct {
    GrpoRound *rounds;
    int n, head, issued;
    long next_first_step;       // the optimizer step the next round to send starts from
    long steps_per_round;       // optimizer steps of one round: steps_per_generation x num_iterations / GA
} RoundRing;

// Sends rounds ahead until max_staleness rounds are generating beyond head (none past the run's last step), once
// head's completions are in: they sample with the weights the servers hold now.
static int issue_ahead(Trainer *t, RoundRing *q, StepClock *clock, char *err, size_t err_len) {
    while (q->issued < q->n && q->next_first_step < t->total_steps) {
        GrpoRound *a = &q->rounds[(q->head + q->issued) % q->n];
        if (grpo_round_issue(t, a, q->next_first_step, err, err_len) != 0) return -1;
        q->issued++;
        q->next_first_step += q->steps_per_round;
    }
    step_clock_charge(clock, PHASE_ISSUE);
    return 0;
}

// One round: collect its completions (sending it first unless it went ahead; each group scored as it comes back),
// send the rounds ahead, drop what is too stale, the rewards' columns, advantages, old / reference logprobs, then
// its micro-steps and optimizer steps (each followed by the push when due, the log and a checkpoint when due).
static int run_round(Trainer *t, RoundRing *q, MicroBuffers *w, UnitSource *policy, UnitSource *ref,
                     GrpoEntropyControl *ec, StepClock *clock, char *err, size_t err_len) {
    TrainConfig *c = t->cfg;
    const GrpoOptions *o = &c->grpo;
    const int micro = c->per_device_train_batch_size, GA = c->gradient_accumulation_steps;
    const int S = c->resolved_steps_per_generation;
    double t_round = trainer_now();
    GrpoRound *r = &q->rounds[q->head];
    if (refresh_servers(t, err, err_len) != 0) return -1;
    step_clock_charge(clock, PHASE_REFRESH);
    json_t *m = json_object();
    int F = 0, rc = -1;
    if (!m) {
        snprintf(err, err_len, "out of memory for the round's metrics");
        return -1;
    }
    if (q->issued == 0) {   // not sent ahead: every round of a synchronous run, the first of an asynchronous one
        if (grpo_round_issue(t, r, t->progress.step, err, err_len) != 0) goto out;
        q->issued = 1;
        q->next_first_step = t->progress.step + q->steps_per_round;
        step_clock_charge(clock, PHASE_ISSUE);
    }
    // Logprobs before any update of this round: the off-policy ratio (num_iterations > 1 or more micro-steps than
    // one optimizer step) and the rollout importance-sampling correction need them. Room for the longest round
    // (every completion max_completion_length tokens): chunks are scored while the round comes in, before its
    // length is known.
    const int need_old = c->num_iterations > 1 || S > GA || o->vllm_importance_sampling_correction;
    if (grpo_round_reserve_logps(r, need_old, t->ref != NULL, (size_t)r->n * o->max_completion_length, err,
                                 err_len) != 0)
        goto out;
    const int off_policy = c->num_iterations > 1 || S > GA;
    StepSums sums = {0};
    double t_train = 0;
    RoundStream rs = {.logps = {.t = t, .policy = policy, .ref = ref, .w = w, .need_old = need_old},
                      .early = early_micro_steps(c), .off_policy = off_policy, .ec = ec, .sums = &sums,
                      .t_train = &t_train};
    LogpsChunks *chunks = &rs.logps;
    GrpoStreamWork work = {.chunk = micro, .run = round_stream_chunk, .ctx = &rs};
    if (grpo_round_collect(t, r, (need_old || t->ref || rs.early) ? &work : NULL, err, err_len) != 0) goto out;
    const StepPhase parts[4] = {PHASE_REWARDS, PHASE_OLD_LOGPS, PHASE_REF_LOGPS, PHASE_FWD_BWD};
    const double part_seconds[4] = {r->stream_seconds, chunks->old_seconds, chunks->ref_seconds, rs.fwd_bwd_seconds};
    step_clock_charge_parts(clock, PHASE_WAIT, parts, part_seconds, 4);
    json_object_set_new(m, "logps_overlap_time", json_real(chunks->old_seconds + chunks->ref_seconds));
    json_object_set_new(m, "train_overlap_time", json_real(rs.fwd_bwd_seconds));
    if (issue_ahead(t, q, clock, err, err_len) != 0) goto out;
    grpo_round_filter_stale(t, r);
    if (grpo_round_rewards(t, r, &F, err, err_len) != 0 || grpo_round_advantages(t, r, F, m, err, err_len) != 0)
        goto out;
    // The micro-steps run while the round came in used group-by-group advantages: the batch's must be the same.
    if (rs.micro_done && memcmp(r->advantages, r->streamed_adv, (size_t)rs.micro_done * micro * sizeof(float))) {
        snprintf(err, err_len, "the advantages of the micro-steps run while the round came in differ from the "
                 "round's");
        goto out;
    }
    step_clock_charge(clock, PHASE_REWARDS);
    // The chunks no rank streamed.
    if (need_old || t->ref) {
        chunks->old_seconds = chunks->ref_seconds = 0;
        for (int k = r->chunks_done; k * micro < r->n; k++)
            if (logps_chunk(chunks, r, k, micro, err, err_len) != 0) goto out;
        const double seconds[2] = {chunks->old_seconds, chunks->ref_seconds};
        step_clock_charge_parts(clock, PHASE_REF_LOGPS, parts + 1, seconds, 1);
    }
    // num_items_in_batch: active completion tokens of the whole generation batch, every rank.
    double active = 0;
    for (int i = 0; i < r->n; i++)
        active += (!r->keep[i] || (o->mask_truncated_completions && r->truncated[i])) ? 0 : r->comp_len[i];
    if (comm_all_reduce(t->comm, &active, 1, COMM_F64, COMM_SUM) != 0) {
        snprintf(err, err_len, "%s", comm_error(t->comm));
        goto out;
    }
    int micro_done = 0;
    for (int it = 0; it < c->num_iterations && t->progress.step < t->total_steps; it++) {
        for (int s = 0; s < S && t->progress.step < t->total_steps; s++) {
            if (it > 0 || s >= rs.micro_done) {   // not run while the round came in
                double t0 = trainer_now();
                if (micro_step(t, policy, r, w, s, need_old, off_policy, active, ec, &sums, err, err_len) != 0)
                    goto out;
                t_train += trainer_now() - t0;
                step_clock_charge(clock, PHASE_FWD_BWD);
            }
            if (++micro_done % GA != 0) continue;
            float gn;
            double lr;
            double t0 = trainer_now();
            if (trainer_optimizer_step(t, &gn, &lr, err, err_len) != 0) goto out;
            t_train += trainer_now() - t0;
            if (o->use_adaptive_entropy) {
                double win[2] = {ec->window_sum, ec->window_count};
                if (comm_all_reduce(t->comm, win, 2, COMM_F64, COMM_SUM) != 0) {
                    snprintf(err, err_len, "%s", comm_error(t->comm));
                    goto out;
                }
                grpo_entropy_control_step(ec, o, win[0], win[1]);
            }
            step_clock_charge(clock, PHASE_OPTIMIZER);
            SyncTimes st;
            if (push_if_due(t, &st, err, err_len) != 0) goto out;
            step_clock_charge(clock, PHASE_SYNC);
            if (log_step(t, m, &sums, gn, lr, active, t_train, &st, t_round, clock, err, err_len) != 0) goto out;
            trainer_progress(t);
            step_clock_charge(clock, PHASE_LOG);
            sums = (StepSums){0};
            t_train = 0;
            if (c->save_steps > 0 && t->progress.step % c->save_steps == 0) {
                // A resumed run reads the data after this round's prompts, not after those of rounds sent ahead.
                if (trainer_save_at(t, r->data_epoch_end, r->data_pos_end, err, err_len) != 0) goto out;
                step_clock_charge(clock, PHASE_CHECKPOINT);
                // The round's rollouts are not part of a checkpoint: a run resumed from one saved before the
                // round's last micro-step generates a new round there, so it does not repeat this run's next steps.
                if (t->rank == 0 && (it < c->num_iterations - 1 || s < S - 1) && t->progress.step < t->total_steps)
                    fprintf(stderr, "tandem-train: checkpoint-%lld was saved inside a generation round (%d "
                            "micro-steps x %d iterations): a run resumed from it generates a new round there, so "
                            "it will not repeat this run's next steps bit for bit; checkpoints at a round's last "
                            "step do\n", (long long)t->progress.step, S, c->num_iterations);
            }
        }
    }
    rc = 0;
out:
    json_decref(m);
    grpo_round_clear(r);
    q->head = (q->head + 1) % q->n;
    if (q->issued > 0) q->issued--;
    return rc;
}

int trainer_run_grpo(Trainer *t, char *err, size_t err_len) {
    TrainConfig *c = t->cfg;
    UnitSource policy = zero3_source(t->policy), ref = t->ref ? zero3_source(t->ref) : (UnitSource){0};
    GrpoEntropyControl ec;
    grpo_entropy_control_init(&ec, &c->grpo);
    StepClock clock = {0};
    step_clock_open(&clock, trainer_now());
    if (t->rank == 0 && log_pool_busy(t, &clock, NULL, err, err_len) != 0) return -1;
    // Resumed: the servers may hold other weights (a later step of the run that stopped, or the base model
    // after a restart) — give them this step's before the first rollout.
    if (c->resume) {
        double secs;
        if (weight_sync_push(t, &secs, err, err_len) != 0) return -1;
        step_clock_charge(&clock, PHASE_SYNC);
    }
    RoundRing q = {.n = c->max_staleness + 1,
                   .steps_per_round = (long)c->resolved_steps_per_generation * c->num_iterations /
                                      c->gradient_accumulation_steps};
    if (t->rank == 0 && c->max_staleness > 0 &&
        q.steps_per_round * c->max_staleness + c->weight_sync_steps - 1 > c->max_staleness)
        fprintf(stderr, "tandem-train: max_staleness %d with %ld optimizer step(s) per generation round and "
                "weight_sync_steps %d: a round generated %d round(s) ahead can be up to %ld policy versions old when "
                "trained, so some or all of its completions will be dropped (samples_dropped_stale)\n",
                c->max_staleness, q.steps_per_round, c->weight_sync_steps, c->max_staleness,
                q.steps_per_round * c->max_staleness + c->weight_sync_steps - 1);
    MicroBuffers w = {0};
    const int n_prompts = c->per_device_train_batch_size * c->resolved_steps_per_generation / c->grpo.num_generations;
    int rc = 0;
    if (!(q.rounds = calloc((size_t)q.n, sizeof *q.rounds)))
        return err_fail(err, err_len, "out of memory for %d generation rounds", q.n);
    for (int i = 0; i < q.n && rc == 0; i++)
        rc = grpo_round_init(&q.rounds[i], n_prompts, c->grpo.num_generations, t->world, err, err_len);
    while (rc == 0 && t->progress.step < t->total_steps)
        rc = run_round(t, &q, &w, &policy, &ref, &ec, &clock, err, err_len);
    for (int i = 0; i < q.n; i++) grpo_round_free(&q.rounds[i]);
    free(q.rounds);
    micro_buffers_free(&w);
    if (rc != 0) return -1;
    if (c->save_steps == 0 || t->progress.step % c->save_steps != 0) return trainer_save(t, err, err_len);
    return 0;
}
