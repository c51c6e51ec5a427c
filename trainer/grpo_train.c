// trainer/grpo_train.c — the GRPO loop of one rank: per round the phases generate, rewards and advantages
// (trainer/grpo_round.c, streamed by trainer/grpo_stream.c), then old / reference logprobs and micro-steps
// (trainer/grpo_micro.c; those that may, while the round streams in), optimizer steps, weight pushes and the log
// (see trainer/trainer.h for the shape of a round).
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"
#include "trainer/grpo_loss.h"
#include "trainer/grpo_micro.h"
#include "trainer/grpo_round.h"
#include "trainer/lora_train.h"
#include "trainer/trainer.h"

// The old and reference logprobs of a round, chunk by chunk (micro-batches of completions, in order): while the
// round streams in (RoundStream), then the rest.
typedef struct {
    Trainer *t;
    UnitSource *policy, *ref;
    GrpoMicroBuffers *w;
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
    if (x->need_old && grpo_score_chunk(x->t, x->policy, r, x->w, r->old_logps, s, B, err, err_len) != 0) return -1;
    double t1 = trainer_now();
    if (trainer_has_ref(x->t)) {
        // With LoRA the reference is the frozen base itself, run with the adapters detached.
        struct ModelLora *adapters = x->t->model.lora;
        x->t->model.lora = x->t->lora_ref ? NULL : adapters;
        const int rc = grpo_score_chunk(x->t, x->ref, r, x->w, r->ref_logps, s, B, err, err_len);
        x->t->model.lora = adapters;
        if (rc != 0) return -1;
    }
    x->old_seconds += t1 - t0;
    x->ref_seconds += trainer_now() - t1;
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
    GrpoStepSums *sums;             // the first optimizer step's sums, carried on by run_round
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
    if (grpo_micro_step(t, x->logps.policy, r, x->logps.w, k, x->logps.need_old, x->off_policy, 0, x->ec, x->sums, err,
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
static int log_step(Trainer *t, const json_t *m, const GrpoStepSums *sums, float grad_norm, double lr, double active,
                    double t_train, const SyncTimes *st, double t_round, StepClock *clock, char *err,
                    size_t err_len) {
    const GrpoOptions *o = &t->cfg->grpo;
    // Every rank has run the same micro-steps: their sums add up, their clip extremes meet in one max (the minima
    // negated, NaN -- no sequence to take it over -- as -inf).
    const int n = sums->n, W = GRPO_MICRO_SUMS;
    double *red = malloc(((size_t)n * (W + 2) + 2) * sizeof *red);
    if (!red) return err_fail(err, err_len, "out of memory for the step's metrics");
    double *ext = red + (size_t)n * W + 2;
    red[0] = sums->loss, red[1] = st->bytes;
    for (int k = 0; k < n; k++) {
        memcpy(red + 2 + (size_t)k * W, sums->micro[k], W * sizeof *red);
        ext[2 * k] = isnan(sums->low_min[k]) ? -INFINITY : -sums->low_min[k];
        ext[2 * k + 1] = isnan(sums->high_max[k]) ? -INFINITY : sums->high_max[k];
    }
    if (comm_all_reduce(t->comm, red, (size_t)n * W + 2, COMM_F64, COMM_SUM) != 0 ||
        comm_all_reduce(t->comm, ext, (size_t)n * 2, COMM_F64, COMM_MAX) != 0) {
        free(red);
        return err_fail(err, err_len, "%s", comm_error(t->comm));
    }
    // TRL's log: the mean over the micro-steps of each micro-step's value, NaNs left out (null when none is left).
    enum { KL, ENT, LOW, HIGH, REGION, LOW_MIN, HIGH_MAX, N_AVG };
    double avg_sum[N_AVG] = {0}, avg_n[N_AVG] = {0};
    for (int k = 0; k < n; k++) {
        const double *x = red + 2 + (size_t)k * W;
        const double clip_n = x[GRPO_MICRO_CLIP_N] > 1 ? x[GRPO_MICRO_CLIP_N] : 1;   // torch's clamp(min=1)
        const double v[N_AVG] = {x[GRPO_MICRO_KL] / (x[GRPO_MICRO_KL_N] > 1 ? x[GRPO_MICRO_KL_N] : 1),
                                 x[GRPO_MICRO_ENT] / (x[GRPO_MICRO_ENT_N] > 1 ? x[GRPO_MICRO_ENT_N] : 1),
                                 x[GRPO_MICRO_LOW] / clip_n, x[GRPO_MICRO_HIGH] / clip_n, x[GRPO_MICRO_REGION] / clip_n,
                                 isinf(ext[2 * k]) ? NAN : -ext[2 * k], isinf(ext[2 * k + 1]) ? NAN : ext[2 * k + 1]};
        for (int j = 0; j < N_AVG; j++)
            if (!isnan(v[j])) avg_sum[j] += v[j], avg_n[j] += 1;
    }
    const double loss = red[0], sync_bytes = red[1];
    free(red);
    step_clock_charge(clock, PHASE_LOG);
    if (!trainer_logs_step(t, t->progress.step)) {
        step_clock_open(clock, trainer_now());
        return 0;
    }
    json_t *mm = json_deep_copy(m);
    if (!mm) {
        snprintf(err, err_len, "out of memory for the step's metrics");
        return -1;
    }
    json_object_set_new(mm, "loss", json_real(loss / t->world));
    static const char *const avg_keys[N_AVG] = {"kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                                                "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max"};
    for (int j = 0; j < N_AVG; j++) {
        if (j == KL && o->beta == 0) continue;
        json_object_set_new(mm, avg_keys[j], avg_n[j] > 0 ? json_real(avg_sum[j] / avg_n[j]) : json_null());
    }
    if (t->rank == 0 && log_pool_busy(t, clock, mm, err, err_len) != 0) {
        json_decref(mm);
        return -1;
    }
    step_clock_charge(clock, PHASE_LOG);
    json_object_set_new(mm, "grad_norm", json_real(grad_norm));
    json_object_set_new(mm, "learning_rate", json_real(lr));
    // The loss's normaliser (TRL's num_items_in_batch): completion tokens in the loss, the generation round's,
    // every rank. (num_tokens, TRL's cumulative prompt + completion count, comes with the round's metrics.)
    json_object_set_new(mm, "num_items_in_batch", json_real(active));
    json_object_set_new(mm, "train_time", json_real(t_train));
    json_object_set_new(mm, "sync_time", json_real(st->seconds));
    json_object_set_new(mm, "sync_bytes", json_real(sync_bytes));   // sent by all ranks to all servers
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
static int run_round(Trainer *t, RoundRing *q, GrpoMicroBuffers *w, UnitSource *policy, UnitSource *ref,
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
    GrpoStepSums sums = {0};
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
    if (grpo_round_reserve_logps(r, need_old, trainer_has_ref(t), (size_t)r->n * o->max_completion_length, err,
                                 err_len) != 0)
        goto out;
    const int off_policy = c->num_iterations > 1 || S > GA;
    if (grpo_step_sums_init(&sums, GA, err, err_len) != 0) goto out;
    double t_train = 0;
    RoundStream rs = {.logps = {.t = t, .policy = policy, .ref = ref, .w = w, .need_old = need_old},
                      .early = early_micro_steps(c), .off_policy = off_policy, .ec = ec, .sums = &sums,
                      .t_train = &t_train};
    LogpsChunks *chunks = &rs.logps;
    GrpoStreamWork work = {.chunk = micro, .run = round_stream_chunk, .ctx = &rs};
    if (grpo_round_collect(t, r, (need_old || trainer_has_ref(t) || rs.early) ? &work : NULL, err, err_len) != 0) goto out;
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
    if (need_old || trainer_has_ref(t)) {
        chunks->old_seconds = chunks->ref_seconds = 0;
        for (int k = r->chunks_done; k * micro < r->n; k++)
            if (logps_chunk(chunks, r, k, micro, err, err_len) != 0) goto out;
        const double seconds[2] = {chunks->old_seconds, chunks->ref_seconds};
        step_clock_charge_parts(clock, PHASE_REF_LOGPS, parts + 1, seconds, 1);
    }
    // num_items_in_batch: active completion tokens of the whole generation batch, every rank.
    double active = 0;
    for (int i = 0; i < r->n; i++)
        active += (!r->keep[i] || (o->mask_truncated_completions && r->truncated[i])) ? 0
                                                                                       : grpo_round_policy_tokens(r, i);
    if (comm_all_reduce(t->comm, &active, 1, COMM_F64, COMM_SUM) != 0) {
        snprintf(err, err_len, "%s", comm_error(t->comm));
        goto out;
    }
    int micro_done = 0;
    for (int it = 0; it < c->num_iterations && t->progress.step < t->total_steps; it++) {
        for (int s = 0; s < S && t->progress.step < t->total_steps; s++) {
            if (it > 0 || s >= rs.micro_done) {   // not run while the round came in
                double t0 = trainer_now();
                if (grpo_micro_step(t, policy, r, w, s, need_old, off_policy, active, ec, &sums, err, err_len) != 0)
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
            grpo_step_sums_reset(&sums);
            t_train = 0;
            if (trainer_saves_step(t, t->progress.step)) {
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
    grpo_step_sums_free(&sums);
    grpo_round_clear(r);
    q->head = (q->head + 1) % q->n;
    if (q->issued > 0) q->issued--;
    return rc;
}

int trainer_run_grpo(Trainer *t, char *err, size_t err_len) {
    TrainConfig *c = t->cfg;
    UnitSource policy = trainer_policy_source(t);
    UnitSource ref = t->ref ? zero3_source(t->ref) : t->lora_ref ? lora_train_source(t->lora) : (UnitSource){0};
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
    GrpoMicroBuffers w = {0};
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
    grpo_micro_buffers_free(&w);
    if (rc != 0) return -1;
    if (!trainer_saves_step(t, t->progress.step)) return trainer_save(t, err, err_len);
    return 0;
}
