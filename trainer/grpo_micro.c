// trainer/grpo_micro.c — a GRPO micro-batch on the trainer's model (trainer/grpo_micro.h): packing completions with
// their prompts, the forward's per-token logprobs and entropies, the GRPO loss and the backward.
#include "trainer/grpo_micro.h"

#include "shared/err.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/model_lora.h"

void grpo_micro_buffers_free(GrpoMicroBuffers *w) {
    free(w->idx), free(w->logps), free(w->entropies), free(w->old), free(w->ref), free(w->sampling), free(w->grad);
    free(w->grad_entropy), free(w->is_ratio), free(w->advantages), free(w->mask), free(w->truncated), free(w->tokens);
    free(w->targets), free(w->cu), free(w->packed_logps), free(w->packed_entropies), free(w->dlogps);
    free(w->dentropies);
    memset(w, 0, sizeof *w);
}

// Grows the buffers to hold B completions of T tokens packed into N tokens.
static int micro_buffers_fit(GrpoMicroBuffers *w, int B, int T, int N, char *err, size_t err_len) {
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
        grpo_micro_buffers_free(w);
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
static int forward_completions(Trainer *t, UnitSource *src, const GrpoRound *r, GrpoMicroBuffers *w, int B, int T,
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
    struct ModelLora *lora = t->model.lora;
    if (lora) {
        // LoRA dropout in the micro-step's forward only (with_entropies), masks of this step and micro-batch.
        lora->no_dropout = !with_entropies;
        lora->dropout_seed = lora_dropout_seed((uint64_t)t->cfg->seed, t->progress.step, idx[0], t->rank);
    }
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
int grpo_score_chunk(Trainer *t, UnitSource *src, GrpoRound *r, GrpoMicroBuffers *w, float *out, int s, int B,
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


// Micro-batch s of the round: forward, GRPO loss, backward (gradients accumulate in the ZeRO state).
int grpo_micro_step(Trainer *t, UnitSource *policy, const GrpoRound *r, GrpoMicroBuffers *w, int s, int need_old,
                    int off_policy, double active, GrpoEntropyControl *ec, GrpoStepSums *acc, char *err,
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
        const float *old_i = need_old ? r->old_logps + r->off[i] : NULL;
        const float *ref_i = trainer_has_ref(t) ? r->ref_logps + r->off[i] : NULL;
        w->advantages[b] = r->advantages[i];
        w->truncated[b] = r->truncated[i];
        for (int k = 0; k < T; k++) {
            int in = k < r->comp_len[i];
            // Multi-turn: tool-turn tokens are context, not the policy's: out of the loss (TRL's tool_mask).
            w->mask[b * T + k] = in && (!r->tool_mask || !r->tool_mask[i] || r->tool_mask[i][k]);
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
                        .ref_logps = trainer_has_ref(t) ? w->ref : NULL, .sampling_logps = w->sampling,
                        .entropies = w->entropies, .mask = w->mask, .advantages = w->advantages, .is_ratio = isr,
                        .num_items_in_batch = active, .num_processes = t->world, .gradient_accumulation_steps = GA,
                        .steps_per_generation = S, .training = 1, .entropy_coef = grpo_entropy_apply_coef(ec, o)};
    if (grpo_loss(o, &in, w->grad, gent, &lm, err, err_len) != 0) return -1;
    const long step = t->progress.step + 1;   // the optimizer step this micro-batch feeds
    if (t->completions && trainer_logs_step(t, step) &&
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
    if (acc->n >= acc->cap)
        return err_fail(err, err_len, "internal: more than %d micro-steps in one optimizer step", acc->cap);
    double *k = acc->micro[acc->n];
    k[GRPO_MICRO_KL] = lm.kl_sum, k[GRPO_MICRO_KL_N] = lm.kl_count;
    k[GRPO_MICRO_ENT] = lm.entropy_sum, k[GRPO_MICRO_ENT_N] = lm.entropy_count;
    k[GRPO_MICRO_LOW] = lm.clip_low_sum, k[GRPO_MICRO_HIGH] = lm.clip_high_sum;
    k[GRPO_MICRO_REGION] = lm.clip_region_sum, k[GRPO_MICRO_CLIP_N] = lm.clip_count;
    acc->low_min[acc->n] = lm.clip_low_min, acc->high_max[acc->n] = lm.clip_high_max;
    acc->n++;
    return 0;
}

int grpo_step_sums_init(GrpoStepSums *s, int cap, char *err, size_t err_len) {
    memset(s, 0, sizeof *s);
    s->micro = calloc((size_t)cap, sizeof *s->micro);
    s->low_min = calloc((size_t)cap, sizeof *s->low_min);
    s->high_max = calloc((size_t)cap, sizeof *s->high_max);
    s->cap = cap;
    if (!s->micro || !s->low_min || !s->high_max) {
        grpo_step_sums_free(s);
        return err_fail(err, err_len, "out of memory for the metrics of %d micro-steps", cap);
    }
    return 0;
}

void grpo_step_sums_reset(GrpoStepSums *s) { s->loss = 0, s->n = 0; }

void grpo_step_sums_free(GrpoStepSums *s) {
    free(s->micro), free(s->low_min), free(s->high_max);
    memset(s, 0, sizeof *s);
}
