// trainer/grpo_advantages.c — rewards -> group-relative advantages, as TRL's _generate_and_score_completions
// computes them (reward_weights, None/NaN rewards, scale_rewards, multi_objective_aggregation), plus the
// completion-mask helpers that run before the loss (mask_truncated_completions, token counts).
#include "trainer/grpo_loss.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

// TRL adds this to the standard deviation before dividing (GRPOTrainer: `std_rewards + 1e-4`).
#define GRPO_STD_EPS 1e-4
// torch.isclose(std, 0) with its default atol (rtol * 0 vanishes): the "zero std" test of frac_reward_zero_std.
#define GRPO_ISCLOSE_ATOL 1e-8

// Values x[i * stride] for i < n, NaN entries ignored (torch.nanmean): NaN when every entry is NaN.
static double nan_mean(const double *x, int n, int stride) {
    double sum = 0.0;
    int count = 0;
    for (int i = 0; i < n; i++) {
        double v = x[(size_t)i * stride];
        if (!isnan(v)) {
            sum += v;
            count++;
        }
    }
    return count ? sum / count : NAN;
}

// trl.trainer.utils.nanstd: sqrt(nanmean((x - nanmean(x))^2) * count / (count - 1)); NaN when count <= 1.
static double nan_std(const double *x, int n, int stride) {
    double mean = nan_mean(x, n, stride);
    double sq = 0.0;
    int count = 0;
    for (int i = 0; i < n; i++) {
        double v = x[(size_t)i * stride];
        if (!isnan(v)) {
            sq += (v - mean) * (v - mean);
            count++;
        }
    }
    if (count <= 1) return NAN;
    return sqrt(sq / count * ((double)count / (count - 1)));
}

// torch.nan_to_num with its defaults: NaN -> 0, +-inf -> the largest finite fp32 value of that sign.
static float nan_to_num_f(double v) {
    if (isnan(v)) return 0.0f;
    if (v > FLT_MAX) return FLT_MAX;
    if (v < -FLT_MAX) return -FLT_MAX;
    return (float)v;
}

static int is_std_zero(double std) { return !isnan(std) && fabs(std) <= GRPO_ISCLOSE_ATOL; }

// Weighted nansum of one row of rewards_per_func; NaN when every function returned None ("unscorable").
static double weighted_row(const double *row, int num_funcs, const double *w) {
    double sum = 0.0;
    int scored = 0;
    for (int k = 0; k < num_funcs; k++) {
        if (!isnan(row[k])) scored = 1;
        double p = row[k] * w[k];
        if (!isnan(p)) sum += p;
    }
    return scored ? sum : NAN;
}

int grpo_advantages(const GrpoOptions *o, int n, int num_funcs, const float *rewards_per_func,
                    const float *reward_weights, float *advantages, GrpoRewardMetrics *metrics,
                    double *func_mean, double *func_std, char *err, size_t err_len) {
    int G = o->num_generations;
    if (G < 2) {
        snprintf(err, err_len, "num_generations: must be >= 2 (got %d)", G);
        return GRPO_ERR_INVALID;
    }
    if (n < 1 || n % G != 0) {
        snprintf(err, err_len, "rewards: %d completions is not a positive multiple of num_generations (%d)", n, G);
        return GRPO_ERR_INVALID;
    }
    if (num_funcs < 1) {
        snprintf(err, err_len, "reward_weights: at least one reward function is required");
        return GRPO_ERR_INVALID;
    }
    if (!rewards_per_func || !advantages) {
        snprintf(err, err_len, "rewards_per_func and advantages are required");
        return GRPO_ERR_INVALID;
    }
    for (int k = 0; reward_weights && k < num_funcs; k++)
        if (!isfinite(reward_weights[k])) {
            snprintf(err, err_len, "reward_weights[%d]: must be finite", k);
            return GRPO_ERR_INVALID;
        }

    // Scratch: rpf (N, F) in double, weights (F), rewards (N), per-sample std (N), normalised rpf (N, F).
    size_t nf = (size_t)n * num_funcs;
    double *buf = malloc(sizeof(double) * (2 * nf + num_funcs + 2 * (size_t)n));
    if (!buf) {
        snprintf(err, err_len, "grpo_advantages: out of memory (%d x %d rewards)", n, num_funcs);
        return GRPO_ERR_NOMEM;
    }
    double *rpf = buf, *norm = rpf + nf, *w = norm + nf, *rewards = w + num_funcs, *std = rewards + n;
    for (size_t i = 0; i < nf; i++) rpf[i] = rewards_per_func[i];
    for (int k = 0; k < num_funcs; k++) w[k] = reward_weights ? reward_weights[k] : 1.0;
    int groups = n / G;

    if (o->multi_objective_aggregation == GRPO_AGG_SUM_THEN_NORMALIZE) {
        for (int i = 0; i < n; i++) rewards[i] = weighted_row(rpf + (size_t)i * num_funcs, num_funcs, w);
        double batch_std = o->scale_rewards == GRPO_SCALE_BATCH ? nan_std(rewards, n, 1) : 0.0;
        for (int g = 0; g < groups; g++) {
            const double *r = rewards + (size_t)g * G;
            double mean = nan_mean(r, G, 1);
            // scale_rewards "none" still computes the group std: it decides frac_reward_zero_std.
            double s = o->scale_rewards == GRPO_SCALE_BATCH ? batch_std : nan_std(r, G, 1);
            for (int j = 0; j < G; j++) {
                int i = g * G + j;
                double a = r[j] - mean;
                if (o->scale_rewards != GRPO_SCALE_NONE) a /= s + GRPO_STD_EPS;
                advantages[i] = nan_to_num_f(a);
                std[i] = s;
            }
        }
    } else {
        // GDPO: each function normalised within its group first, then the weighted sum, then batch-normalised.
        for (int g = 0; g < groups; g++)
            for (int k = 0; k < num_funcs; k++) {
                const double *col = rpf + (size_t)g * G * num_funcs + k;
                double mean = nan_mean(col, G, num_funcs), s = nan_std(col, G, num_funcs);
                for (int j = 0; j < G; j++) {
                    size_t idx = ((size_t)g * G + j) * num_funcs + k;
                    norm[idx] = (rpf[idx] - mean) / (s + GRPO_STD_EPS);
                }
            }
        for (int i = 0; i < n; i++) {
            double r = weighted_row(norm + (size_t)i * num_funcs, num_funcs, w);
            // "unscorable" is decided on the raw rewards: every function returned None.
            int scored = 0;
            for (int k = 0; k < num_funcs; k++) scored |= !isnan(rpf[(size_t)i * num_funcs + k]);
            rewards[i] = scored ? (isnan(r) ? 0.0 : r) : NAN;
        }
        double s = n > 1 ? nan_std(rewards, n, 1) : 0.0, mean = nan_mean(rewards, n, 1);
        for (int i = 0; i < n; i++) {
            advantages[i] = nan_to_num_f((rewards[i] - mean) / (s + GRPO_STD_EPS));
            std[i] = s;
        }
    }

    if (metrics) {
        int zero = 0;
        for (int i = 0; i < n; i++) zero += is_std_zero(std[i]);
        // The logged reward is always the weighted sum of the raw rewards, whatever the aggregation.
        for (int i = 0; i < n; i++) rewards[i] = weighted_row(rpf + (size_t)i * num_funcs, num_funcs, w);
        metrics->reward = nan_mean(rewards, n, 1);
        metrics->reward_std = nan_std(rewards, n, 1);
        metrics->frac_reward_zero_std = (double)zero / n;
    }
    for (int k = 0; k < num_funcs; k++) {
        if (func_mean) func_mean[k] = nan_mean(rpf + k, n, num_funcs);
        if (func_std) func_std[k] = nan_std(rpf + k, n, num_funcs);
    }
    free(buf);
    return 0;
}

void grpo_mask_truncated_completions(const GrpoOptions *o, int batch, int max_len, const uint8_t *truncated,
                                     uint8_t *mask) {
    if (!o->mask_truncated_completions || !truncated) return;
    for (int b = 0; b < batch; b++)
        if (truncated[b])
            for (int t = 0; t < max_len; t++) mask[(size_t)b * max_len + t] = 0;
}

int grpo_completion_is_truncated(const int32_t *ids, int len, const int32_t *eos_ids, int n_eos, int32_t pad_id) {
    if (len <= 0) return 0;
    int32_t last = ids[len - 1];
    if (last == pad_id) return 0;
    for (int i = 0; i < n_eos; i++)
        if (last == eos_ids[i]) return 0;
    return 1;
}

double grpo_count_tokens(int batch, int max_len, const uint8_t *mask) {
    double n = 0.0;
    for (size_t i = 0; i < (size_t)batch * max_len; i++) n += mask[i] != 0;
    return n;
}
