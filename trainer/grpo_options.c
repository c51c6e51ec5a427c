// trainer/grpo_options.c — GRPOConfig's loss-related options: TRL 1.16 defaults, names, JSON keys, validation.
#include "trainer/grpo_loss.h"

#include <float.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "shared/json_get.h"

void grpo_options_default(GrpoOptions *o) {
    memset(o, 0, sizeof(*o));
    o->num_generations = 8;
    o->max_completion_length = 512;
    o->beta = 0.0;
    o->epsilon = 0.2;
    o->loss_type = GRPO_LOSS_DAPO;
    o->scale_rewards = GRPO_SCALE_GROUP;
    o->multi_objective_aggregation = GRPO_AGG_SUM_THEN_NORMALIZE;
    o->importance_sampling_level = GRPO_IS_LEVEL_TOKEN;
    o->mask_truncated_completions = 0;
    o->top_entropy_quantile = 1.0;
    o->sapo_temperature_neg = 1.05;
    o->sapo_temperature_pos = 1.0;
    o->vespo_k_pos = 2.0;
    o->vespo_lambda_pos = 3.0;
    o->vespo_k_neg = 3.0;
    o->vespo_lambda_neg = 2.0;
    o->vllm_importance_sampling_correction = 1;
    o->vllm_importance_sampling_mode = GRPO_ROLLOUT_IS_SEQUENCE_MASK;
    o->has_vllm_importance_sampling_clip_max = 1;
    o->vllm_importance_sampling_clip_max = 3.0;
    o->use_bias_correction_kl = 1;
    o->entropy_coef = 0.0;
    o->entropy_coef_min = 0.0;
    o->entropy_coef_max = 1.0;
    o->entropy_coef_delta = 0.005;
    o->entropy_target = 0.2;
}

// ---- names ----

static const char *const LOSS_NAMES[] = {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"};
static const char *const SCALE_NAMES[] = {"group", "batch", "none"};
static const char *const AGG_NAMES[] = {"sum_then_normalize", "normalize_then_sum"};
static const char *const LEVEL_NAMES[] = {"token", "sequence"};
static const char *const MODE_NAMES[] = {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"};
#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

static const char *name_of(const char *const *names, int n, int v) { return (v >= 0 && v < n) ? names[v] : "?"; }

// Finds s among names; on failure the message lists every accepted name.
static int parse_name(const char *what, const char *const *names, int n, const char *s, int *out, char *err,
                      size_t err_len) {
    for (int i = 0; i < n; i++)
        if (s && strcmp(s, names[i]) == 0) {
            *out = i;
            return 0;
        }
    size_t used = (size_t)snprintf(err, err_len, "%s: unknown value '%s' (one of", what, s ? s : "(null)");
    for (int i = 0; i < n && used < err_len; i++)
        used += (size_t)snprintf(err + used, err_len - used, "%s '%s'", i ? "," : "", names[i]);
    if (used < err_len) snprintf(err + used, err_len - used, ")");
    return GRPO_ERR_INVALID;
}

const char *grpo_loss_type_name(GrpoLossType t) { return name_of(LOSS_NAMES, COUNT(LOSS_NAMES), (int)t); }
const char *grpo_scale_rewards_name(GrpoScaleRewards s) { return name_of(SCALE_NAMES, COUNT(SCALE_NAMES), (int)s); }
const char *grpo_multi_objective_name(GrpoMultiObjective a) { return name_of(AGG_NAMES, COUNT(AGG_NAMES), (int)a); }
const char *grpo_is_level_name(GrpoIsLevel l) { return name_of(LEVEL_NAMES, COUNT(LEVEL_NAMES), (int)l); }
const char *grpo_rollout_is_mode_name(GrpoRolloutIsMode m) { return name_of(MODE_NAMES, COUNT(MODE_NAMES), (int)m); }

int grpo_loss_type_parse(const char *s, GrpoLossType *out, char *err, size_t err_len) {
    int v = 0, rc = parse_name("loss_type", LOSS_NAMES, COUNT(LOSS_NAMES), s, &v, err, err_len);
    if (rc == 0) *out = (GrpoLossType)v;
    return rc;
}
int grpo_scale_rewards_parse(const char *s, GrpoScaleRewards *out, char *err, size_t err_len) {
    int v = 0, rc = parse_name("scale_rewards", SCALE_NAMES, COUNT(SCALE_NAMES), s, &v, err, err_len);
    if (rc == 0) *out = (GrpoScaleRewards)v;
    return rc;
}
int grpo_multi_objective_parse(const char *s, GrpoMultiObjective *out, char *err, size_t err_len) {
    int v = 0, rc = parse_name("multi_objective_aggregation", AGG_NAMES, COUNT(AGG_NAMES), s, &v, err, err_len);
    if (rc == 0) *out = (GrpoMultiObjective)v;
    return rc;
}
int grpo_is_level_parse(const char *s, GrpoIsLevel *out, char *err, size_t err_len) {
    int v = 0, rc = parse_name("importance_sampling_level", LEVEL_NAMES, COUNT(LEVEL_NAMES), s, &v, err, err_len);
    if (rc == 0) *out = (GrpoIsLevel)v;
    return rc;
}
int grpo_rollout_is_mode_parse(const char *s, GrpoRolloutIsMode *out, char *err, size_t err_len) {
    int v = 0, rc = parse_name("vllm_importance_sampling_mode", MODE_NAMES, COUNT(MODE_NAMES), s, &v, err, err_len);
    if (rc == 0) *out = (GrpoRolloutIsMode)v;
    return rc;
}

// ---- validation ----

#define FAIL(...)                               \
    do {                                        \
        snprintf(err, err_len, __VA_ARGS__);    \
        return GRPO_ERR_INVALID;                \
    } while (0)

int grpo_options_validate(const GrpoOptions *o, char *err, size_t err_len) {
    if (o->num_generations < 2)
        FAIL("num_generations: GRPO requires at least 2 generations per prompt to compute advantages (got %d)",
             o->num_generations);
    if ((unsigned)o->loss_type >= (unsigned)COUNT(LOSS_NAMES)) FAIL("loss_type: unknown value %d", (int)o->loss_type);
    if ((unsigned)o->scale_rewards >= (unsigned)COUNT(SCALE_NAMES))
        FAIL("scale_rewards: unknown value %d", (int)o->scale_rewards);
    if ((unsigned)o->multi_objective_aggregation >= (unsigned)COUNT(AGG_NAMES))
        FAIL("multi_objective_aggregation: unknown value %d", (int)o->multi_objective_aggregation);
    if ((unsigned)o->importance_sampling_level >= (unsigned)COUNT(LEVEL_NAMES))
        FAIL("importance_sampling_level: unknown value %d", (int)o->importance_sampling_level);
    if ((unsigned)o->vllm_importance_sampling_mode >= (unsigned)COUNT(MODE_NAMES))
        FAIL("vllm_importance_sampling_mode: unknown value %d", (int)o->vllm_importance_sampling_mode);
    if (o->max_completion_length < 1) FAIL("max_completion_length: must be >= 1 (got %d)", o->max_completion_length);
    if (!isfinite(o->beta) || o->beta < 0) FAIL("beta: must be a finite value >= 0 (got %g)", o->beta);
    if (!isfinite(o->epsilon) || o->epsilon < 0) FAIL("epsilon: must be a finite value >= 0 (got %g)", o->epsilon);
    if (o->has_epsilon_high && (!isfinite(o->epsilon_high) || o->epsilon_high < 0))
        FAIL("epsilon_high: must be a finite value >= 0 (got %g)", o->epsilon_high);
    if (o->has_delta && (!isfinite(o->delta) || o->delta <= 0))
        FAIL("delta: must be a finite value > 0 (got %g)", o->delta);
    if (!(o->top_entropy_quantile >= 0.0 && o->top_entropy_quantile <= 1.0))
        FAIL("top_entropy_quantile: must be in [0, 1] (got %g)", o->top_entropy_quantile);
    if (!isfinite(o->sapo_temperature_neg) || o->sapo_temperature_neg <= 0)
        FAIL("sapo_temperature_neg: must be a finite value > 0 (got %g)", o->sapo_temperature_neg);
    if (!isfinite(o->sapo_temperature_pos) || o->sapo_temperature_pos <= 0)
        FAIL("sapo_temperature_pos: must be a finite value > 0 (got %g)", o->sapo_temperature_pos);
    if (!isfinite(o->vespo_k_pos)) FAIL("vespo_k_pos: must be finite");
    if (!isfinite(o->vespo_lambda_pos)) FAIL("vespo_lambda_pos: must be finite");
    if (!isfinite(o->vespo_k_neg)) FAIL("vespo_k_neg: must be finite");
    if (!isfinite(o->vespo_lambda_neg)) FAIL("vespo_lambda_neg: must be finite");
    if (o->has_vllm_importance_sampling_clip_max && isnan(o->vllm_importance_sampling_clip_max))
        FAIL("vllm_importance_sampling_clip_max: must be a number");
    if (o->has_vllm_importance_sampling_clip_min && isnan(o->vllm_importance_sampling_clip_min))
        FAIL("vllm_importance_sampling_clip_min: must be a number");
    if (o->has_vllm_importance_sampling_clip_min && o->has_vllm_importance_sampling_clip_max &&
        o->vllm_importance_sampling_clip_min >= o->vllm_importance_sampling_clip_max)
        FAIL("vllm_importance_sampling_clip_min (%g) must be less than vllm_importance_sampling_clip_max (%g)",
             o->vllm_importance_sampling_clip_min, o->vllm_importance_sampling_clip_max);
    int truncate = o->vllm_importance_sampling_mode == GRPO_ROLLOUT_IS_TOKEN_TRUNCATE ||
                   o->vllm_importance_sampling_mode == GRPO_ROLLOUT_IS_SEQUENCE_TRUNCATE;
    if (o->vllm_importance_sampling_correction && truncate && !o->has_vllm_importance_sampling_clip_min &&
        !o->has_vllm_importance_sampling_clip_max)
        FAIL("vllm_importance_sampling_mode '%s': at least one of vllm_importance_sampling_clip_min or "
             "vllm_importance_sampling_clip_max must be set",
             grpo_rollout_is_mode_name(o->vllm_importance_sampling_mode));
    if (o->loss_type == GRPO_LOSS_VESPO && o->vllm_importance_sampling_correction &&
        o->vllm_importance_sampling_mode != GRPO_ROLLOUT_IS_TOKEN_TRUNCATE &&
        o->vllm_importance_sampling_mode != GRPO_ROLLOUT_IS_TOKEN_MASK)
        FAIL("vllm_importance_sampling_mode: the vespo loss requires 'token_truncate' or 'token_mask' (got '%s')",
             grpo_rollout_is_mode_name(o->vllm_importance_sampling_mode));
    if (o->has_off_policy_mask_threshold &&
        (!isfinite(o->off_policy_mask_threshold) || o->off_policy_mask_threshold < 0))
        FAIL("off_policy_mask_threshold: must be a finite value >= 0 (got %g)", o->off_policy_mask_threshold);
    if (!isfinite(o->entropy_coef)) FAIL("entropy_coef: must be finite");
    if (!isfinite(o->entropy_coef_min) || !isfinite(o->entropy_coef_max) || o->entropy_coef_min > o->entropy_coef_max)
        FAIL("entropy_coef_min (%g) must be <= entropy_coef_max (%g)", o->entropy_coef_min, o->entropy_coef_max);
    if (!isfinite(o->entropy_coef_delta) || o->entropy_coef_delta < 0)
        FAIL("entropy_coef_delta: must be a finite value >= 0 (got %g)", o->entropy_coef_delta);
    if (!isfinite(o->entropy_target)) FAIL("entropy_target: must be finite");
    return 0;
}

// ---- JSON keys ----
// Each value is read through shared/json_get.h under its key, so a refusal names it
// (`field "beta" must be a number, got a string`).

// A float that TRL allows to be None: JSON null clears *has.
static int get_optional_number(const JsonAt *at, int *has, double *out) {
    if (json_is_null(at->json)) {
        *has = 0;
        return 0;
    }
    int rc = json_get_double(at, NULL, JSON_GET_REQUIRED, 0.0, -DBL_MAX, DBL_MAX, out);
    if (rc == 0) *has = 1;
    return rc;
}

int grpo_options_set_json(GrpoOptions *o, const char *key, const json_t *v, char *err, size_t err_len) {
    const JsonAt options = json_at_document(NULL, NULL, 0, GRPO_ERR_INVALID, err, err_len);
    const JsonAt at = json_at_value(&options, v, key);
    const char *s = NULL;
    int rc;
    struct { const char *key; double *dst; } numbers[] = {
        {"beta", &o->beta},
        {"epsilon", &o->epsilon},
        {"top_entropy_quantile", &o->top_entropy_quantile},
        {"sapo_temperature_neg", &o->sapo_temperature_neg},
        {"sapo_temperature_pos", &o->sapo_temperature_pos},
        {"vespo_k_pos", &o->vespo_k_pos},
        {"vespo_lambda_pos", &o->vespo_lambda_pos},
        {"vespo_k_neg", &o->vespo_k_neg},
        {"vespo_lambda_neg", &o->vespo_lambda_neg},
        {"entropy_coef", &o->entropy_coef},
        {"entropy_coef_min", &o->entropy_coef_min},
        {"entropy_coef_max", &o->entropy_coef_max},
        {"entropy_coef_delta", &o->entropy_coef_delta},
        {"entropy_target", &o->entropy_target},
    };
    for (int i = 0; i < COUNT(numbers); i++)
        if (strcmp(key, numbers[i].key) == 0) {
            rc = json_get_double(&at, NULL, JSON_GET_REQUIRED, 0.0, -DBL_MAX, DBL_MAX, numbers[i].dst);
            return rc < 0 ? rc : 1;
        }
    struct { const char *key; int *has; double *dst; } optionals[] = {
        {"epsilon_high", &o->has_epsilon_high, &o->epsilon_high},
        {"delta", &o->has_delta, &o->delta},
        {"vllm_importance_sampling_clip_min", &o->has_vllm_importance_sampling_clip_min,
         &o->vllm_importance_sampling_clip_min},
        {"off_policy_mask_threshold", &o->has_off_policy_mask_threshold, &o->off_policy_mask_threshold},
    };
    for (int i = 0; i < COUNT(optionals); i++)
        if (strcmp(key, optionals[i].key) == 0) {
            rc = get_optional_number(&at, optionals[i].has, optionals[i].dst);
            return rc < 0 ? rc : 1;
        }
    struct { const char *key; int *dst; } bools[] = {
        {"mask_truncated_completions", &o->mask_truncated_completions},
        {"vllm_importance_sampling_correction", &o->vllm_importance_sampling_correction},
        {"use_bias_correction_kl", &o->use_bias_correction_kl},
        {"use_adaptive_entropy", &o->use_adaptive_entropy},
    };
    for (int i = 0; i < COUNT(bools); i++)
        if (strcmp(key, bools[i].key) == 0) {
            rc = json_get_bool(&at, NULL, JSON_GET_REQUIRED, 0, bools[i].dst);
            return rc < 0 ? rc : 1;
        }
    if (strcmp(key, "num_generations") == 0) {
        rc = json_get_int(&at, NULL, JSON_GET_REQUIRED, 0, -INT_MAX, INT_MAX, &o->num_generations);
        return rc < 0 ? rc : 1;
    }
    if (strcmp(key, "max_completion_length") == 0) {
        rc = json_get_int(&at, NULL, JSON_GET_REQUIRED, 0, -INT_MAX, INT_MAX, &o->max_completion_length);
        return rc < 0 ? rc : 1;
    }
    if (strcmp(key, "vllm_importance_sampling_clip_max") == 0) {
        // The deprecated _cap, when given, overrides clip_max whatever the key order (GRPOConfig.__post_init__).
        if (o->clip_max_from_cap) return 1;
        rc = get_optional_number(&at, &o->has_vllm_importance_sampling_clip_max, &o->vllm_importance_sampling_clip_max);
        return rc < 0 ? rc : 1;
    }
    if (strcmp(key, "vllm_importance_sampling_cap") == 0) {
        if (json_is_null(v)) return 1;   // None: clip_max stays as it is
        rc = json_get_double(&at, NULL, JSON_GET_REQUIRED, 0.0, -DBL_MAX, DBL_MAX,
                             &o->vllm_importance_sampling_clip_max);
        if (rc < 0) return rc;
        o->has_vllm_importance_sampling_clip_max = 1;
        o->clip_max_from_cap = 1;
        return 1;
    }
    if (strcmp(key, "scale_rewards") == 0) {
        if (json_is_boolean(v)) {   // GRPOConfig maps True -> "group", False -> "none"
            o->scale_rewards = json_is_true(v) ? GRPO_SCALE_GROUP : GRPO_SCALE_NONE;
            return 1;
        }
        if ((rc = json_get_string(&at, NULL, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL)) < 0) return rc;
        rc = grpo_scale_rewards_parse(s, &o->scale_rewards, err, err_len);
        return rc < 0 ? rc : 1;
    }
    if (strcmp(key, "loss_type") == 0) {
        if ((rc = json_get_string(&at, NULL, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL)) < 0) return rc;
        rc = grpo_loss_type_parse(s, &o->loss_type, err, err_len);
        return rc < 0 ? rc : 1;
    }
    if (strcmp(key, "multi_objective_aggregation") == 0) {
        if ((rc = json_get_string(&at, NULL, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL)) < 0) return rc;
        rc = grpo_multi_objective_parse(s, &o->multi_objective_aggregation, err, err_len);
        return rc < 0 ? rc : 1;
    }
    if (strcmp(key, "importance_sampling_level") == 0) {
        if ((rc = json_get_string(&at, NULL, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL)) < 0) return rc;
        rc = grpo_is_level_parse(s, &o->importance_sampling_level, err, err_len);
        return rc < 0 ? rc : 1;
    }
    if (strcmp(key, "vllm_importance_sampling_mode") == 0) {
        if ((rc = json_get_string(&at, NULL, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL)) < 0) return rc;
        GrpoRolloutIsMode m;
        rc = grpo_rollout_is_mode_parse(s, &m, err, err_len);
        if (rc < 0) return rc;
        o->vllm_importance_sampling_mode = m;
        return 1;
    }
    return 0;
}
