// trainer/grpo_loss.c — TRL 1.16's GRPO per-token loss (GRPOTrainer._compute_loss) and its exact derivative with
// respect to the current policy's per-token logprobs: every loss_type, token/sequence importance sampling,
// epsilon/epsilon_high/delta clipping, k3 KL (with the bias-correction weight), off-policy sequence masking,
// top-entropy token selection, the rollout IS correction and the entropy bonus. docs/grpo.md has the formulas.
//
// The gradient is written by hand, branch for branch as autograd differentiates TRL's expression: torch.clamp
// passes the gradient where min <= x <= max, torch.min of two equal values splits it in half, and the cispo
// and vespo weights are detached.
#include "trainer/grpo_loss.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

// torch.clamp that keeps NaN (a plain fmin/fmax would drop it). Bounds given as +-INFINITY are no bound.
static double clampd(double x, double lo, double hi) { return x < lo ? lo : (x > hi ? hi : x); }

static double nan_to_num(double v) {
    if (isnan(v)) return 0.0;
    if (v > FLT_MAX) return FLT_MAX;
    if (v < -FLT_MAX) return -FLT_MAX;
    return v;
}

static int is_clipped_family(GrpoLossType t) {
    return t == GRPO_LOSS_GRPO || t == GRPO_LOSS_BNPO || t == GRPO_LOSS_DR_GRPO || t == GRPO_LOSS_DAPO ||
           t == GRPO_LOSS_LUSPO;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

float grpo_entropy_threshold(const GrpoOptions *o, float *values, size_t n) {
    if (n == 0) return INFINITY;
    qsort(values, n, sizeof(float), cmp_float);
    // torch.quantile(x, q) on an fp32 tensor, bit for bit (tests/reference/test_grpo_vs_trl.py checks it on
    // thousands of arrays): q is rounded to fp32, the rank q * (n - 1) is exact (double), the weight is the
    // rank's fraction rounded to fp32, and torch's lerp is fused (one rounding), from the nearer end.
    // Plain fp32 or double arithmetic misses by an ulp now and then, and an ulp decides ">= threshold".
    float q = (float)(1.0 - o->top_entropy_quantile);
    double rank = (double)q * (double)(n - 1);
    size_t below = (size_t)rank;
    size_t above = (size_t)ceil(rank);
    if (above >= n) above = n - 1;
    float weight = (float)(rank - (double)below);
    float a = values[below], b = values[above];
    float diff = b - a;
    return fabsf(weight) < 0.5f ? fmaf(weight, diff, a) : fmaf(-diff, 1.0f - weight, b);
}

// Per-sequence quantities that every token of sequence b needs.
typedef struct {
    double active;       // sum of mask
    double denom;        // max(active, 1)
    double coef1;        // sequence-level exp(mean log-ratio) (importance_sampling_level = sequence)
    double keep;         // off-policy mask (1 keep, 0 drop)
    double phi;          // vespo gamma weight
    double isr;          // sequence-level rollout IS ratio (1 when not used)
} SeqTerms;

static int check_inputs(const GrpoOptions *o, const GrpoLossInput *in, char *err, size_t err_len) {
#define NEED(cond, ...)                          \
    do {                                         \
        if (!(cond)) {                           \
            snprintf(err, err_len, __VA_ARGS__); \
            return GRPO_ERR_INVALID;             \
        }                                        \
    } while (0)
    NEED(in->batch >= 1 && in->max_len >= 1, "grpo_loss: batch (%d) and max_len (%d) must be >= 1", in->batch,
         in->max_len);
    NEED(in->logps, "grpo_loss: logps (B, T) is required");
    NEED(in->mask, "grpo_loss: mask (B, T) is required");
    NEED(in->advantages, "grpo_loss: advantages (B) is required");
    NEED(o->beta == 0.0 || in->ref_logps, "grpo_loss: ref_logps (B, T) is required when beta != 0 (beta = %g)",
         o->beta);
    NEED(!o->vllm_importance_sampling_correction || in->is_ratio,
         "grpo_loss: is_ratio is required when vllm_importance_sampling_correction is on");
    NEED(o->top_entropy_quantile >= 1.0 || in->entropies,
         "grpo_loss: entropies (B, T) are required when top_entropy_quantile < 1 (%g)", o->top_entropy_quantile);
    NEED(!(o->entropy_coef != 0.0 || o->use_adaptive_entropy) || in->entropies,
         "grpo_loss: entropies (B, T) are required for the entropy bonus (entropy_coef / use_adaptive_entropy)");
    NEED(in->gradient_accumulation_steps >= 1, "grpo_loss: gradient_accumulation_steps must be >= 1 (got %d)",
         in->gradient_accumulation_steps);
    NEED(in->steps_per_generation >= 1, "grpo_loss: steps_per_generation must be >= 1 (got %d)",
         in->steps_per_generation);
    NEED(in->num_processes >= 1, "grpo_loss: num_processes must be >= 1 (got %d)", in->num_processes);
    NEED(isfinite(in->num_items_in_batch) && in->num_items_in_batch >= 0,
         "grpo_loss: num_items_in_batch must be a finite count >= 0 (got %g)", in->num_items_in_batch);
    NEED(isfinite(in->entropy_coef), "grpo_loss: entropy_coef must be finite");
    return 0;
#undef NEED
}

// Policy weight per active token (policy_loss = sum over tokens of weight * per-token loss) and the divisor
// that turns policy_loss into the loss TRL backpropagates (gradient accumulation), per loss_type.
static double token_weight(const GrpoOptions *o, const GrpoLossInput *in, const SeqTerms *s, double total_active,
                           double *divisor) {
    double ga = in->training ? (double)in->gradient_accumulation_steps : 1.0;
    double B = (double)in->batch;
    *divisor = ga;
    switch (o->loss_type) {
    case GRPO_LOSS_GRPO:
    case GRPO_LOSS_SAPO: return 1.0 / (s->denom * B);
    case GRPO_LOSS_BNPO: return 1.0 / (total_active > 1.0 ? total_active : 1.0);
    case GRPO_LOSS_DR_GRPO: return 1.0 / (B * (double)o->max_completion_length);
    case GRPO_LOSS_LUSPO: return 1.0 / B;
    default: {   // dapo, cispo, vespo: num_items_in_batch spans the generation batch of every rank
        double normaliser = (in->num_items_in_batch > 1.0 ? in->num_items_in_batch : 1.0) / in->num_processes;
        if (in->training) normaliser = normaliser * in->gradient_accumulation_steps / in->steps_per_generation;
        *divisor = 1.0;
        return 1.0 / normaliser;
    }
    }
}

int grpo_loss(const GrpoOptions *o, const GrpoLossInput *in, float *grad_logps, float *grad_entropies,
              GrpoLossMetrics *metrics, char *err, size_t err_len) {
    int rc = check_inputs(o, in, err, err_len);
    if (rc) return rc;
    const int B = in->batch, T = in->max_len;
    const size_t BT = (size_t)B * T;
    const int seq_level = o->importance_sampling_level == GRPO_IS_LEVEL_SEQUENCE;
    const int is_seq_ratio = o->vllm_importance_sampling_mode == GRPO_ROLLOUT_IS_SEQUENCE_TRUNCATE ||
                             o->vllm_importance_sampling_mode == GRPO_ROLLOUT_IS_SEQUENCE_MASK;
    const int use_is = o->vllm_importance_sampling_correction;
    const double eps_low = o->epsilon, eps_high = o->has_epsilon_high ? o->epsilon_high : o->epsilon;
    const double lo = 1.0 - eps_low, hi = 1.0 + eps_high;
    const double log_1e8 = log(1e-8);   // vespo's lower clamp in log space

    SeqTerms *seq = calloc((size_t)B, sizeof(SeqTerms));
    double *row_grad = malloc(sizeof(double) * (size_t)T);   // (T) one sequence's gradient before rounding
    uint8_t *emask = NULL;   // (B, T) top-entropy selection, NULL when every token is kept
    if (!seq || !row_grad) goto nomem;

    // ---- per-sequence pass: counts, sequence IS weight, off-policy mask, vespo weight ----
    double total_active = 0.0;
    for (int b = 0; b < B; b++) {
        const float *lp = in->logps + (size_t)b * T, *old = in->old_logps ? in->old_logps + (size_t)b * T : lp;
        const uint8_t *m = in->mask + (size_t)b * T;
        SeqTerms *s = &seq[b];
        double lr_sum = 0.0, lr_clamped_sum = 0.0, log_is_sum = 0.0, kl_sum = 0.0;
        for (int t = 0; t < T; t++) {
            double mt = m[t] ? 1.0 : 0.0, lr = (double)lp[t] - (double)old[t];
            s->active += mt;
            lr_sum += lr * mt;
            lr_clamped_sum += clampd(lr, -20.0, 20.0) * mt;
            if (use_is && !is_seq_ratio)
                log_is_sum += clampd(log((double)in->is_ratio[(size_t)b * T + t]), log_1e8, 20.0);
            if (o->has_off_policy_mask_threshold) {
                // Forward KL of the sampling policy to the current one, from inference-time logprobs when given.
                const float *smp = in->sampling_logps ? in->sampling_logps + (size_t)b * T : old;
                kl_sum += nan_to_num((double)smp[t] - (double)lp[t]) * mt;
            }
        }
        total_active += s->active;
        s->denom = s->active > 1.0 ? s->active : 1.0;
        s->coef1 = exp(lr_sum / s->denom);
        double A = in->advantages[b];
        s->keep = 1.0;
        if (o->has_off_policy_mask_threshold)
            s->keep = (A >= 0.0 || kl_sum / s->denom <= o->off_policy_mask_threshold) ? 1.0 : 0.0;
        s->isr = (use_is && is_seq_ratio && o->loss_type != GRPO_LOSS_VESPO) ? in->is_ratio[b] : 1.0;
        if (o->loss_type == GRPO_LOSS_VESPO) {
            // phi(w) = e^lambda * w^k * e^(-lambda w) of the sequence ratio w, in log space; detached.
            double log_w = clampd(lr_clamped_sum + log_is_sum, log_1e8, 20.0);
            double k = A >= 0.0 ? o->vespo_k_pos : o->vespo_k_neg;
            double lam = A >= 0.0 ? o->vespo_lambda_pos : o->vespo_lambda_neg;
            if (lam < 1e-4) lam = 1e-4;
            double log_phi = lam + k * log_w - lam * exp(log_w);
            // TRL's exp runs in fp32 and its nan_to_num maps NaN and +-inf to 0.
            s->phi = (isnan(log_phi) || log_phi > log((double)FLT_MAX)) ? 0.0 : exp(log_phi);
        }
    }

    // ---- top-entropy token selection ----
    if (o->top_entropy_quantile < 1.0) {
        emask = malloc(BT);
        if (!emask) goto nomem;
        float thr = in->entropy_threshold;
        if (!in->has_entropy_threshold) {
            float *vals = malloc(sizeof(float) * (total_active > 0 ? (size_t)total_active : 1));
            if (!vals) goto nomem;
            size_t n = 0;
            for (size_t i = 0; i < BT; i++)
                if (in->mask[i]) vals[n++] = in->entropies[i];
            thr = grpo_entropy_threshold(o, vals, n);
            free(vals);
        }
        for (size_t i = 0; i < BT; i++)
            emask[i] = in->mask[i] && (double)in->entropies[i] * (in->mask[i] ? 1.0 : 0.0) >= (double)thr;
    }

    // ---- per-token pass ----
    GrpoLossMetrics mm = {0};
    mm.clip_low_min = NAN;
    mm.clip_high_max = NAN;
    double policy_loss = 0.0, divisor = 1.0;
    const int bonus = o->entropy_coef != 0.0 || o->use_adaptive_entropy;
    // TRL's metric helpers take a tensor of width 1 for one value per sequence: with T == 1 even per-token
    // metrics are then summed over every sequence, masked or not, and counted per sequence.
    const int width1 = T == 1;
    for (int b = 0; b < B; b++) {
        const size_t row = (size_t)b * T;
        const float *lp = in->logps + row, *old = in->old_logps ? in->old_logps + row : lp;
        const uint8_t *m = in->mask + row;
        const SeqTerms *s = &seq[b];
        const double A = in->advantages[b];
        const double w = token_weight(o, in, s, total_active, &divisor);
        double G = 0.0;   // sequence level: d policy_loss / d coef1 of this sequence
        double low_n = 0.0, high_n = 0.0;   // clipped active tokens (per-sequence clip means)
        for (int t = 0; t < T; t++) {
            const double mt = m[t] ? 1.0 : 0.0, u = w * mt;   // u = d policy_loss / d per_token_loss
            const double mw = width1 ? 1.0 : mt;              // metric weight
            const double c1 = seq_level ? s->coef1 : exp((double)lp[t] - (double)old[t]);
            double P, dPc = 0.0, dPl = 0.0, c1_metric = c1;
            switch (o->loss_type) {
            case GRPO_LOSS_CISPO: {
                double cc = clampd(c1, -INFINITY, eps_high);   // detached
                P = -cc * A * lp[t];
                dPl = -cc * A;
                break;
            }
            case GRPO_LOSS_SAPO: {
                double temp = A > 0.0 ? o->sapo_temperature_pos : o->sapo_temperature_neg;
                double sg = 1.0 / (1.0 + exp(-temp * (c1 - 1.0)));
                P = -sg * 4.0 / temp * A;
                dPc = -A * 4.0 * sg * (1.0 - sg);
                break;
            }
            case GRPO_LOSS_VESPO:
                P = -s->phi * A * lp[t];
                dPl = -s->phi * A;
                break;
            default: {   // grpo, bnpo, dr_grpo, dapo, luspo: -min(coef_1 * A, clamp(coef_1, lo, hi) * A)
                double c2 = clampd(c1, lo, hi), dc2 = (c1 >= lo && c1 <= hi) ? 1.0 : 0.0;
                double c1d = c1, dc1d = 1.0;
                if (o->has_delta) {
                    c1d = clampd(c1, -INFINITY, o->delta);
                    dc1d = c1 <= o->delta ? 1.0 : 0.0;
                }
                double x1 = c1d * A, x2 = c2 * A;
                P = -(x1 < x2 ? x1 : x2);
                if (x1 < x2) dPc = -A * dc1d;
                else if (x1 > x2) dPc = -A * dc2;
                else dPc = -0.5 * A * (dc1d + dc2);   // torch.min splits a tie's gradient
                c1_metric = c1d;                      // TRL logs clipping on the delta-clamped coef_1
                break;
            }
            }
            double S = s->keep * (emask ? (double)emask[row + t] : 1.0);
            if (use_is && o->loss_type != GRPO_LOSS_VESPO) S *= is_seq_ratio ? s->isr : in->is_ratio[row + t];
            double ptl = P * S, d_lp = S * dPl, d_c1 = S * dPc;
            if (o->beta != 0.0) {
                double d = (double)in->ref_logps[row + t] - (double)lp[t], ed = exp(d);
                double kl = ed - d - 1.0, dkl = 1.0 - ed;   // k3 estimator and its derivative in logps
                double kw = o->use_bias_correction_kl ? c1 : 1.0;
                ptl += o->beta * kl * kw;
                d_lp += o->beta * dkl * kw;
                if (o->use_bias_correction_kl) d_c1 += o->beta * kl;
                mm.kl_sum += kl * kw * mw;
                mm.kl_count += mw;
            }
            policy_loss += u * ptl;
            double g = u * d_lp;
            if (seq_level) G += u * d_c1;
            else g += u * d_c1 * c1;
            row_grad[t] = g;   // sequence level adds its share below

            if (in->entropies) {
                mm.entropy_sum += (double)in->entropies[row + t] * mw;
                mm.entropy_count += mw;
                double em = emask ? (double)emask[row + t] : mt;
                mm.entropy_window_sum += (double)in->entropies[row + t] * em;
                mm.entropy_window_count += em;
            }
            if (!seq_level) {
                if (is_clipped_family(o->loss_type)) {
                    double l = (c1_metric < lo && A < 0.0) ? 1.0 : 0.0, h = (c1_metric > hi && A > 0.0) ? 1.0 : 0.0;
                    low_n += l * mw;
                    high_n += h * mw;
                    mm.clip_low_sum += l * mw;
                    mm.clip_high_sum += h * mw;
                    mm.clip_region_sum += (l != 0.0 || h != 0.0) * mw;
                    mm.clip_count += mw;
                } else if (o->loss_type == GRPO_LOSS_CISPO) {
                    mm.cispo_clip_sum += ((c1 > eps_high && A > 0.0) ? 1.0 : 0.0) * mw;
                    mm.cispo_clip_count += mw;
                }
            }
        }
        if (grad_logps) {
            // Sequence level: d coef1 / d logps[t] = coef1 * mask[t] / max(active, 1).
            double scale = seq_level ? G * s->coef1 / s->denom : 0.0;
            for (int t = 0; t < T; t++)
                grad_logps[row + t] = (float)((row_grad[t] + scale * (m[t] ? 1.0 : 0.0)) / divisor);
        }
        // Sequence-level metrics (one value per sequence, masked or not) and the per-sequence clip means.
        double low_mean, high_mean;
        if (seq_level) {
            double c = s->coef1;
            if (o->has_delta) c = clampd(c, -INFINITY, o->delta);
            low_mean = (c < lo && A < 0.0) ? 1.0 : 0.0;
            high_mean = (c > hi && A > 0.0) ? 1.0 : 0.0;
            if (is_clipped_family(o->loss_type)) {
                mm.clip_low_sum += low_mean;
                mm.clip_high_sum += high_mean;
                mm.clip_region_sum += (low_mean != 0.0 || high_mean != 0.0);
                mm.clip_count += 1.0;
            } else if (o->loss_type == GRPO_LOSS_CISPO) {
                mm.cispo_clip_sum += (s->coef1 > eps_high && A > 0.0) ? 1.0 : 0.0;
                mm.cispo_clip_count += 1.0;
            }
        } else if (width1) {
            low_mean = low_n;
            high_mean = high_n;
        } else {
            low_mean = low_n / s->active;     // 0 / 0 = NaN for an empty sequence, skipped by nanmin / nanmax
            high_mean = high_n / s->active;
        }
        if (is_clipped_family(o->loss_type)) {
            if (!isnan(low_mean) && (isnan(mm.clip_low_min) || low_mean < mm.clip_low_min)) mm.clip_low_min = low_mean;
            if (!isnan(high_mean) && (isnan(mm.clip_high_max) || high_mean > mm.clip_high_max))
                mm.clip_high_max = high_mean;
        }
        if (o->loss_type == GRPO_LOSS_VESPO) {
            mm.vespo_phi_sum += s->phi;
            mm.vespo_phi_count += 1.0;
        }
    }
    mm.policy_loss = policy_loss;
    mm.loss = policy_loss / divisor;
    if (grad_entropies)
        for (size_t i = 0; i < BT; i++) grad_entropies[i] = 0.0f;
    if (bonus) {
        // loss -= coef * mean entropy over the bonus's tokens, scaled only for gradient accumulation.
        double acc = in->training ? (double)in->gradient_accumulation_steps : 1.0;
        double cnt = mm.entropy_window_count > 1.0 ? mm.entropy_window_count : 1.0;
        mm.loss -= in->entropy_coef * (mm.entropy_window_sum / cnt / acc);
        if (grad_entropies)
            for (size_t i = 0; i < BT; i++) {
                double em = emask ? (double)emask[i] : (in->mask[i] ? 1.0 : 0.0);
                grad_entropies[i] = (float)(-in->entropy_coef * em / cnt / acc);
            }
    }
    if (metrics) *metrics = mm;
    free(emask);
    free(row_grad);
    free(seq);
    return 0;

nomem:
    free(emask);
    free(row_grad);
    free(seq);
    snprintf(err, err_len, "grpo_loss: out of memory (B %d, T %d)", B, T);
    return GRPO_ERR_NOMEM;
}

void grpo_entropy_control_init(GrpoEntropyControl *c, const GrpoOptions *o) {
    c->coef = o->entropy_coef;
    c->last_world_entropy = INFINITY;   // no bonus until the first measurement (TRL's conservative start)
    c->window_sum = c->window_count = 0.0;
}

double grpo_entropy_apply_coef(const GrpoEntropyControl *c, const GrpoOptions *o) {
    if (!o->use_adaptive_entropy) return c->coef;
    return c->last_world_entropy <= o->entropy_target ? c->coef : 0.0;
}

void grpo_entropy_control_accumulate(GrpoEntropyControl *c, const GrpoOptions *o, const GrpoLossMetrics *m) {
    if (!o->use_adaptive_entropy) return;
    c->window_sum += m->entropy_window_sum;
    c->window_count += m->entropy_window_count;
}

void grpo_entropy_control_step(GrpoEntropyControl *c, const GrpoOptions *o, double world_sum, double world_count) {
    if (!o->use_adaptive_entropy) return;
    double world = world_sum / (world_count > 1.0 ? world_count : 1.0);
    if (world <= o->entropy_target) c->coef = fmin(c->coef + o->entropy_coef_delta, o->entropy_coef_max);
    else c->coef = fmax(c->coef - o->entropy_coef_delta, o->entropy_coef_min);
    c->last_world_entropy = world;
    c->window_sum = c->window_count = 0.0;
}
