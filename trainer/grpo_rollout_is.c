// trainer/grpo_rollout_is.c — the rollout importance-sampling correction (TRL's vllm_importance_sampling_*):
// the trainer's old logprobs against the logprobs the rollout server sampled with, per token or per sequence,
// truncated or masked to [clip_min, clip_max].
#include "trainer/grpo_loss.h"

#include <float.h>
#include <math.h>
#include <stdio.h>

static int sequence_mode(GrpoRolloutIsMode m) {
    return m == GRPO_ROLLOUT_IS_SEQUENCE_TRUNCATE || m == GRPO_ROLLOUT_IS_SEQUENCE_MASK;
}

size_t grpo_rollout_is_ratio_len(const GrpoOptions *o, int batch, int max_len) {
    return sequence_mode(o->vllm_importance_sampling_mode) ? (size_t)batch : (size_t)batch * max_len;
}

// torch.nan_to_num defaults: a token the server could not score (NaN) gets a zero log-difference (ratio 1).
static double nan_to_num(double v) {
    if (isnan(v)) return 0.0;
    if (v > FLT_MAX) return FLT_MAX;
    if (v < -FLT_MAX) return -FLT_MAX;
    return v;
}

// Applies the constraint of the mode to one raw ratio exp(log-difference).
static double constrain(const GrpoOptions *o, double r) {
    double lo = o->has_vllm_importance_sampling_clip_min ? o->vllm_importance_sampling_clip_min : -INFINITY;
    double hi = o->has_vllm_importance_sampling_clip_max ? o->vllm_importance_sampling_clip_max : INFINITY;
    switch (o->vllm_importance_sampling_mode) {
    case GRPO_ROLLOUT_IS_TOKEN_TRUNCATE:
    case GRPO_ROLLOUT_IS_SEQUENCE_TRUNCATE:
        if (r < lo) r = lo;
        if (r > hi) r = hi;
        return r;
    default:   // *_mask: a ratio outside the bounds drops the token (or the whole sequence)
        return (r < lo || r > hi) ? 0.0 : r;
    }
}

int grpo_rollout_is_ratio(const GrpoOptions *o, int batch, int max_len, const float *old_logps,
                          const float *sampling_logps, const uint8_t *mask, float *ratio,
                          GrpoRolloutIsMetrics *metrics, char *err, size_t err_len) {
    if (batch < 1 || max_len < 1) {
        snprintf(err, err_len, "rollout IS ratio: batch (%d) and max_len (%d) must be >= 1", batch, max_len);
        return GRPO_ERR_INVALID;
    }
    if (!old_logps || !sampling_logps || !mask || !ratio) {
        snprintf(err, err_len, "rollout IS ratio: old_logps, sampling_logps, mask and ratio are required");
        return GRPO_ERR_INVALID;
    }
    if ((unsigned)o->vllm_importance_sampling_mode > GRPO_ROLLOUT_IS_SEQUENCE_MASK) {
        snprintf(err, err_len, "vllm_importance_sampling_mode: unknown value %d", (int)o->vllm_importance_sampling_mode);
        return GRPO_ERR_INVALID;
    }
    int seq = sequence_mode(o->vllm_importance_sampling_mode);
    double diff_sum = 0.0, diff_max = 0.0, r_sum = 0.0, r_min = INFINITY, r_max = -INFINITY;
    size_t diff_n = 0, r_n = 0;
    for (int b = 0; b < batch; b++) {
        double seq_diff = 0.0;
        for (int t = 0; t < max_len; t++) {
            size_t i = (size_t)b * max_len + t;
            double d = (double)old_logps[i] - (double)sampling_logps[i];
            double dm = nan_to_num(d * (mask[i] ? 1.0 : 0.0));
            if (mask[i] && !isnan(d)) {   // sampling_logp_difference: scored, active tokens only
                diff_sum += fabs(d);
                if (fabs(d) > diff_max) diff_max = fabs(d);
                diff_n++;
            }
            if (seq) {
                seq_diff += dm;
            } else {
                double r = constrain(o, exp(dm));
                ratio[i] = (float)r;
                if (mask[i]) {
                    r_sum += r;
                    r_min = fmin(r_min, r);
                    r_max = fmax(r_max, r);
                    r_n++;
                }
            }
        }
        if (seq) {
            double r = constrain(o, exp(seq_diff));
            ratio[b] = (float)r;
            r_sum += r;   // sequence modes report every sequence's ratio, masked or not
            r_min = fmin(r_min, r);
            r_max = fmax(r_max, r);
            r_n++;
        }
    }
    if (metrics) {
        // TRL reports 0 (not NaN) for an empty selection.
        metrics->logp_difference_mean = diff_n ? diff_sum / diff_n : 0.0;
        metrics->logp_difference_max = diff_n ? diff_max : 0.0;
        metrics->ratio_mean = r_n ? r_sum / r_n : 0.0;
        metrics->ratio_min = r_n ? r_min : 0.0;
        metrics->ratio_max = r_n ? r_max : 0.0;
    }
    return 0;
}
