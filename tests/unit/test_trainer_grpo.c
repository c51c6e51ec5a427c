// tests/unit/test_trainer_grpo.c — the GRPO math's edge cases and its gradient: options (defaults, JSON keys,
// every refusal naming the option), advantages (all-equal groups, None/NaN rewards, unscorable rows, one scored
// value, batch scaling, normalize_then_sum), truncation masking, the rollout IS ratio, the entropy threshold,
// adaptive entropy control, asynchronous GRPO's staleness bound, and the loss (empty masks, a single token,
// refusals of missing inputs) with dL/dlogprob checked by central finite differences for every loss type whose
// weights are not detached.
// tests/reference/test_grpo_vs_trl.py proves the same functions equal to TRL itself.
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "check_macros.h"
#include "trainer/grpo_loss.h"
#include "trainer/grpo_round.h"

static GrpoOptions opts(int num_generations) {
    GrpoOptions o;
    grpo_options_default(&o);
    o.num_generations = num_generations;
    o.vllm_importance_sampling_correction = 0;
    return o;
}

// ---- options ----

static void expect_invalid(int line, const GrpoOptions *o, const char *needle) {
    char err[512] = "";
    int rc = grpo_options_validate(o, err, sizeof err);
    if (rc != GRPO_ERR_INVALID || !strstr(err, needle)) {
        fprintf(stderr, "line %d: expected a refusal naming '%s', got rc=%d '%s'\n", line, needle, rc, err);
        failures++;
    }
}

static int set_json(GrpoOptions *o, const char *key, const char *json_text, char *err, size_t err_len) {
    json_error_t je;
    json_t *v = json_loads(json_text, JSON_DECODE_ANY, &je);
    int rc = grpo_options_set_json(o, key, v, err, err_len);
    json_decref(v);
    return rc;
}

static void test_options(void) {
    char err[512];
    GrpoOptions o;
    grpo_options_default(&o);
    CHECK(grpo_options_validate(&o, err, sizeof err) == 0);
    CHECK(o.num_generations == 8 && o.loss_type == GRPO_LOSS_DAPO && o.epsilon == 0.2 && !o.has_epsilon_high);
    CHECK(o.vllm_importance_sampling_mode == GRPO_ROLLOUT_IS_SEQUENCE_MASK && o.vllm_importance_sampling_clip_max == 3.0);

    GrpoOptions b = o;
    b.num_generations = 1;
    expect_invalid(__LINE__, &b, "num_generations");
    b = o, b.epsilon = -0.1;
    expect_invalid(__LINE__, &b, "epsilon");
    b = o, b.has_epsilon_high = 1, b.epsilon_high = -1;
    expect_invalid(__LINE__, &b, "epsilon_high");
    b = o, b.has_delta = 1, b.delta = 0;
    expect_invalid(__LINE__, &b, "delta");
    b = o, b.beta = -1;
    expect_invalid(__LINE__, &b, "beta");
    b = o, b.top_entropy_quantile = 1.5;
    expect_invalid(__LINE__, &b, "top_entropy_quantile");
    b = o, b.loss_type = (GrpoLossType)42;
    expect_invalid(__LINE__, &b, "loss_type");
    b = o, b.has_vllm_importance_sampling_clip_min = 1, b.vllm_importance_sampling_clip_min = 3.0;
    expect_invalid(__LINE__, &b, "vllm_importance_sampling_clip_min");
    b = o, b.vllm_importance_sampling_mode = GRPO_ROLLOUT_IS_TOKEN_TRUNCATE, b.has_vllm_importance_sampling_clip_max = 0;
    expect_invalid(__LINE__, &b, "vllm_importance_sampling_clip_max");
    b.vllm_importance_sampling_correction = 0;   // without the correction the bounds are not needed
    CHECK(grpo_options_validate(&b, err, sizeof err) == 0);
    b = o, b.loss_type = GRPO_LOSS_VESPO;        // default mode is sequence_mask
    expect_invalid(__LINE__, &b, "vllm_importance_sampling_mode");
    b = o, b.sapo_temperature_neg = 0;
    expect_invalid(__LINE__, &b, "sapo_temperature_neg");
    b = o, b.max_completion_length = 0;
    expect_invalid(__LINE__, &b, "max_completion_length");
    b = o, b.has_off_policy_mask_threshold = 1, b.off_policy_mask_threshold = -0.5;
    expect_invalid(__LINE__, &b, "off_policy_mask_threshold");
    b = o, b.entropy_coef_min = 2;
    expect_invalid(__LINE__, &b, "entropy_coef_min");

    GrpoLossType lt;
    CHECK(grpo_loss_type_parse("cispo", &lt, err, sizeof err) == 0 && lt == GRPO_LOSS_CISPO);
    CHECK(grpo_loss_type_parse("ppo", &lt, err, sizeof err) == GRPO_ERR_INVALID && strstr(err, "loss_type") &&
          strstr(err, "'luspo'"));
    for (int i = 0; i <= GRPO_LOSS_VESPO; i++) {   // names round-trip
        CHECK(grpo_loss_type_parse(grpo_loss_type_name((GrpoLossType)i), &lt, err, sizeof err) == 0 && lt == i);
    }
    GrpoRolloutIsMode m;
    CHECK(grpo_rollout_is_mode_parse("token_mask", &m, err, sizeof err) == 0 && m == GRPO_ROLLOUT_IS_TOKEN_MASK);

    // JSON keys: TRL's names, null for None, bool scale_rewards, the deprecated cap winning in any order.
    GrpoOptions j;
    grpo_options_default(&j);
    CHECK(set_json(&j, "loss_type", "\"bnpo\"", err, sizeof err) == 1 && j.loss_type == GRPO_LOSS_BNPO);
    CHECK(set_json(&j, "epsilon_high", "0.28", err, sizeof err) == 1 && j.has_epsilon_high && j.epsilon_high == 0.28);
    CHECK(set_json(&j, "epsilon_high", "null", err, sizeof err) == 1 && !j.has_epsilon_high);
    CHECK(set_json(&j, "scale_rewards", "false", err, sizeof err) == 1 && j.scale_rewards == GRPO_SCALE_NONE);
    CHECK(set_json(&j, "scale_rewards", "true", err, sizeof err) == 1 && j.scale_rewards == GRPO_SCALE_GROUP);
    CHECK(set_json(&j, "num_generations", "4", err, sizeof err) == 1 && j.num_generations == 4);
    CHECK(set_json(&j, "num_generations", "4.5", err, sizeof err) == GRPO_ERR_INVALID && strstr(err, "num_generations"));
    CHECK(set_json(&j, "beta", "\"0.1\"", err, sizeof err) == GRPO_ERR_INVALID && strstr(err, "beta"));
    CHECK(set_json(&j, "mask_truncated_completions", "1", err, sizeof err) == GRPO_ERR_INVALID);
    CHECK(set_json(&j, "learning_rate", "1e-6", err, sizeof err) == 0);   // not a GRPO-math key
    CHECK(set_json(&j, "vllm_importance_sampling_cap", "2.0", err, sizeof err) == 1);
    CHECK(set_json(&j, "vllm_importance_sampling_clip_max", "5.0", err, sizeof err) == 1);
    CHECK(j.vllm_importance_sampling_clip_max == 2.0);
    CHECK(set_json(&j, "vllm_importance_sampling_mode", "\"token\"", err, sizeof err) == GRPO_ERR_INVALID &&
          strstr(err, "vllm_importance_sampling_mode"));
}

// ---- advantages ----

static void test_advantages(void) {
    char err[512];
    GrpoOptions o = opts(4);
    float adv[8];
    GrpoRewardMetrics rm;
    double fm[2], fs[2];

    // Group 0 all equal -> exactly zero advantages and zero std; group 1 with a None reward excluded.
    float r1[8] = {0.7f, 0.7f, 0.7f, 0.7f, 1.0f, NAN, 3.0f, 5.0f};
    CHECK(grpo_advantages(&o, 8, 1, r1, NULL, adv, &rm, fm, fs, err, sizeof err) == 0);
    for (int i = 0; i < 4; i++) CHECK(adv[i] == 0.0f);
    double std1 = sqrt((4.0 + 0.0 + 4.0) / 2.0);   // Bessel over the 3 scored values {1, 3, 5}
    CHECK_NEAR(adv[4], (1.0 - 3.0) / (std1 + 1e-4), 1e-6);
    CHECK(adv[5] == 0.0f);   // the only function returned None: unscorable -> 0
    CHECK_NEAR(adv[7], (5.0 - 3.0) / (std1 + 1e-4), 1e-6);
    CHECK_NEAR(rm.frac_reward_zero_std, 0.5, 1e-12);
    CHECK_NEAR(rm.reward, (4 * 0.7 + 9.0) / 7.0, 1e-6);
    CHECK_NEAR(fm[0], rm.reward, 1e-12);

    // Two functions with weights: None excluded from the weighted sum (nansum), a row is unscorable only when
    // every function returned None.
    float r2[8] = {1, NAN, NAN, 2, 3, 4, NAN, NAN};
    float w2[2] = {1.0f, 0.5f};
    o = opts(2);
    CHECK(grpo_advantages(&o, 4, 2, r2, w2, adv, &rm, fm, fs, err, sizeof err) == 0);
    // rewards: row0 = 1, row1 = 0.5*2 = 1 -> equal group -> 0; row2 = 3 + 2 = 5, row3 unscorable.
    CHECK(adv[0] == 0.0f && adv[1] == 0.0f);
    CHECK(adv[2] == 0.0f && adv[3] == 0.0f);   // one scored value: std NaN -> NaN advantage -> 0
    CHECK_NEAR(rm.frac_reward_zero_std, 0.5, 1e-12);   // NaN std is not "zero"
    CHECK_NEAR(fm[0], 2.0, 1e-12);
    CHECK_NEAR(fm[1], 3.0, 1e-12);
    CHECK_NEAR(fs[1], sqrt(2.0), 1e-9);
    o.scale_rewards = GRPO_SCALE_NONE;   // r - mean: the lone scored value equals its mean
    CHECK(grpo_advantages(&o, 4, 2, r2, w2, adv, &rm, NULL, NULL, err, sizeof err) == 0);
    CHECK(adv[2] == 0.0f && adv[3] == 0.0f);

    // Batch scaling: group means, batch std.
    float r3[4] = {1, 2, 4, 8};
    o = opts(2);
    o.scale_rewards = GRPO_SCALE_BATCH;
    CHECK(grpo_advantages(&o, 4, 1, r3, NULL, adv, &rm, NULL, NULL, err, sizeof err) == 0);
    double m = 15.0 / 4, v = ((1 - m) * (1 - m) + (2 - m) * (2 - m) + (4 - m) * (4 - m) + (8 - m) * (8 - m)) / 3;
    CHECK_NEAR(adv[0], -0.5 / (sqrt(v) + 1e-4), 1e-6);
    CHECK_NEAR(adv[3], 2.0 / (sqrt(v) + 1e-4), 1e-6);
    o.scale_rewards = GRPO_SCALE_NONE;
    CHECK(grpo_advantages(&o, 4, 1, r3, NULL, adv, &rm, NULL, NULL, err, sizeof err) == 0);
    CHECK(adv[0] == -0.5f && adv[1] == 0.5f && adv[2] == -2.0f && adv[3] == 2.0f);

    // normalize_then_sum: each function z-scored within its group (std + 1e-4), weighted sum, batch z-score.
    float r4[8] = {1, 10, 3, 10, 0, 0, 2, 6};
    float w4[2] = {2.0f, 1.0f};
    o = opts(2);
    o.multi_objective_aggregation = GRPO_AGG_NORMALIZE_THEN_SUM;
    CHECK(grpo_advantages(&o, 4, 2, r4, w4, adv, &rm, NULL, NULL, err, sizeof err) == 0);
    // Group 0: func0 (1, 3) -> -+1 / (sqrt(2) + 1e-4), func1 (10, 10) -> 0. Group 1: func0 (0, 2) as above,
    // func1 (0, 6) -> -+3 / (3 sqrt(2) + 1e-4).
    double s[4];
    s[0] = 2 * (-1.0 / (sqrt(2.0) + 1e-4));
    s[1] = -s[0];
    s[2] = 2 * (-1.0 / (sqrt(2.0) + 1e-4)) + (-3.0 / (3 * sqrt(2.0) + 1e-4));
    s[3] = -s[2];
    double sm = 0, sv = 0;
    for (int i = 0; i < 4; i++) sm += s[i] / 4;
    for (int i = 0; i < 4; i++) sv += (s[i] - sm) * (s[i] - sm) / 3;
    for (int i = 0; i < 4; i++) CHECK_NEAR(adv[i], (s[i] - sm) / (sqrt(sv) + 1e-4), 1e-5);

    // Refusals.
    CHECK(grpo_advantages(&o, 3, 1, r3, NULL, adv, &rm, NULL, NULL, err, sizeof err) == GRPO_ERR_INVALID &&
          strstr(err, "num_generations"));
    float wn[1] = {NAN};
    CHECK(grpo_advantages(&o, 4, 1, r3, wn, adv, &rm, NULL, NULL, err, sizeof err) == GRPO_ERR_INVALID &&
          strstr(err, "reward_weights"));
}

// ---- masks, IS ratio, entropy threshold and control ----

static void test_masks_and_ratio(void) {
    char err[512];
    int32_t eos[2] = {2, 7}, ids1[3] = {5, 6, 2}, ids2[2] = {5, 9}, ids3[1] = {0};
    CHECK(!grpo_completion_is_truncated(ids1, 3, eos, 2, 0));
    CHECK(grpo_completion_is_truncated(ids2, 2, eos, 2, 0));
    CHECK(!grpo_completion_is_truncated(ids3, 1, eos, 2, 0));   // ends in pad
    CHECK(!grpo_completion_is_truncated(ids1, 0, eos, 2, 0));   // empty

    GrpoOptions o = opts(2);
    uint8_t mask[6] = {1, 1, 1, 1, 1, 0}, trunc[2] = {0, 1};
    grpo_mask_truncated_completions(&o, 2, 3, trunc, mask);   // option off: unchanged
    CHECK(grpo_count_tokens(2, 3, mask) == 5.0);
    o.mask_truncated_completions = 1;
    grpo_mask_truncated_completions(&o, 2, 3, trunc, mask);
    CHECK(grpo_count_tokens(2, 3, mask) == 3.0 && mask[3] == 0 && mask[4] == 0);

    // IS ratio: B = 2, T = 3, second row has one padded position and one unscored (NaN) token.
    float old[6] = {-1.0f, -2.0f, -0.5f, -1.0f, -1.0f, -3.0f};
    float smp[6] = {-1.5f, -1.0f, -0.5f, NAN, -2.0f, 0.0f};
    uint8_t m2[6] = {1, 1, 1, 1, 1, 0};
    float ratio[6];
    GrpoRolloutIsMetrics im;
    o.vllm_importance_sampling_correction = 1;
    o.vllm_importance_sampling_mode = GRPO_ROLLOUT_IS_TOKEN_TRUNCATE;
    o.has_vllm_importance_sampling_clip_max = 1, o.vllm_importance_sampling_clip_max = 1.5;
    o.has_vllm_importance_sampling_clip_min = 1, o.vllm_importance_sampling_clip_min = 0.5;
    CHECK(grpo_rollout_is_ratio_len(&o, 2, 3) == 6);
    CHECK(grpo_rollout_is_ratio(&o, 2, 3, old, smp, m2, ratio, &im, err, sizeof err) == 0);
    CHECK_NEAR(ratio[0], 1.5, 1e-7);            // exp(0.5) truncated to clip_max
    CHECK_NEAR(ratio[1], 0.5, 1e-7);            // exp(-1) truncated to clip_min
    CHECK_NEAR(ratio[2], 1.0, 1e-7);
    CHECK_NEAR(ratio[3], 1.0, 1e-7);            // NaN sampling logprob: no correction
    CHECK_NEAR(ratio[4], 1.5, 1e-7);            // exp(1)
    CHECK_NEAR(ratio[5], 1.0, 1e-7);            // padded
    CHECK_NEAR(im.logp_difference_mean, (0.5 + 1.0 + 0.0 + 1.0) / 4, 1e-7);   // scored active tokens only
    CHECK_NEAR(im.logp_difference_max, 1.0, 1e-7);
    CHECK_NEAR(im.ratio_mean, (1.5 + 0.5 + 1 + 1 + 1.5) / 5, 1e-7);
    o.vllm_importance_sampling_mode = GRPO_ROLLOUT_IS_TOKEN_MASK;
    CHECK(grpo_rollout_is_ratio(&o, 2, 3, old, smp, m2, ratio, &im, err, sizeof err) == 0);
    CHECK(ratio[0] == 0.0f && ratio[1] == 0.0f && ratio[4] == 0.0f && ratio[2] == 1.0f);
    CHECK(im.ratio_min == 0.0 && im.ratio_max == 1.0);
    o.vllm_importance_sampling_mode = GRPO_ROLLOUT_IS_SEQUENCE_TRUNCATE;
    o.vllm_importance_sampling_clip_max = 10.0;
    CHECK(grpo_rollout_is_ratio_len(&o, 2, 3) == 2);
    CHECK(grpo_rollout_is_ratio(&o, 2, 3, old, smp, m2, ratio, &im, err, sizeof err) == 0);
    CHECK_NEAR(ratio[0], exp(0.5 - 1.0), 1e-6);
    CHECK_NEAR(ratio[1], exp(1.0), 1e-6);
    o.vllm_importance_sampling_mode = GRPO_ROLLOUT_IS_SEQUENCE_MASK;
    o.vllm_importance_sampling_clip_max = 2.0;
    CHECK(grpo_rollout_is_ratio(&o, 2, 3, old, smp, m2, ratio, &im, err, sizeof err) == 0);
    CHECK(ratio[1] == 0.0f && ratio[0] > 0.6f);
    uint8_t none[6] = {0};
    CHECK(grpo_rollout_is_ratio(&o, 2, 3, old, smp, none, ratio, &im, err, sizeof err) == 0);
    CHECK(im.logp_difference_mean == 0.0 && im.logp_difference_max == 0.0);   // empty selection reports 0
    CHECK(grpo_rollout_is_ratio(&o, 2, 3, old, NULL, m2, ratio, &im, err, sizeof err) == GRPO_ERR_INVALID);

    // Entropy threshold: torch.quantile's linear interpolation.
    float v[5] = {5, 1, 4, 2, 3};
    o.top_entropy_quantile = 0.5;
    CHECK(grpo_entropy_threshold(&o, v, 5) == 3.0f);
    float v2[5] = {5, 1, 4, 2, 3};
    o.top_entropy_quantile = 0.2;   // rank 0.8 * 4 = 3.2
    CHECK_NEAR(grpo_entropy_threshold(&o, v2, 5), 4.2, 1e-6);
    o.top_entropy_quantile = 0.0;   // the maximum only
    CHECK(grpo_entropy_threshold(&o, v2, 5) == 5.0f);
    CHECK(isinf(grpo_entropy_threshold(&o, v2, 0)));

    // Adaptive entropy control: no bonus before a measurement; up when at/below the target, down above, clamped.
    o.use_adaptive_entropy = 1;
    o.entropy_coef = 0.01, o.entropy_target = 0.5, o.entropy_coef_delta = 0.005, o.entropy_coef_max = 0.012;
    GrpoEntropyControl ec;
    grpo_entropy_control_init(&ec, &o);
    CHECK(grpo_entropy_apply_coef(&ec, &o) == 0.0);
    GrpoLossMetrics lm = {0};
    lm.entropy_window_sum = 0.8, lm.entropy_window_count = 2;
    grpo_entropy_control_accumulate(&ec, &o, &lm);
    grpo_entropy_control_step(&ec, &o, ec.window_sum, ec.window_count);   // 0.4 <= 0.5
    CHECK_NEAR(ec.coef, 0.012, 1e-15);
    CHECK_NEAR(grpo_entropy_apply_coef(&ec, &o), 0.012, 1e-15);
    grpo_entropy_control_step(&ec, &o, 3.0, 2.0);   // 1.5 > 0.5
    CHECK_NEAR(ec.coef, 0.007, 1e-15);
    CHECK(grpo_entropy_apply_coef(&ec, &o) == 0.0 && ec.window_count == 0.0);
}

// ---- the loss ----

typedef struct {
    int B, T;
    float lp[64], old[64], ref[64], smp[64], ent[64], adv[8], ratio[64];
    uint8_t mask[64];
} Case;

static uint64_t rng_state;
static double urand(void) {   // uniform in [0, 1)
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(rng_state >> 11) * (1.0 / 9007199254740992.0);
}

// Log-ratios are placed so no coefficient sits within 0.02 of a clipping kink (1 - 0.2, 1 + 0.28, 1.2, delta 1.4)
// even after the sequence mean: central differences across a kink would not be a derivative.
static int near_kink(double c) {
    const double kinks[] = {0.8, 1.2, 1.28, 1.4};
    for (int i = 0; i < 4; i++)
        if (fabs(c - kinks[i]) < 0.02) return 1;
    return 0;
}

static void make_case(Case *c, int B, int T, unsigned seed) {
    rng_state = seed * 7919ULL + 1;
    c->B = B, c->T = T;
    for (int b = 0; b < B; b++) {
        int len = 1 + (int)(urand() * T);
        if (b == 0) len = T;
        if (b == B - 1) len = 0;   // an empty completion row
        double shift = 0.0;
        for (int tries = 0; tries < 50; tries++) {
            double sum = 0.0;
            int kink = 0;
            for (int t = 0; t < T; t++) {
                int i = b * T + t;
                c->mask[i] = t < len;
                c->lp[i] = (float)(-0.1 - 2.0 * urand());
                double lr = (urand() - 0.5) * 0.8 + shift;
                if (c->mask[i]) kink |= near_kink(exp(lr));
                c->old[i] = (float)(c->lp[i] - lr);
                sum += c->mask[i] ? (double)c->lp[i] - (double)c->old[i] : 0.0;
                c->ref[i] = (float)(c->lp[i] + (urand() - 0.5) * 0.6);
                c->smp[i] = (float)(c->old[i] + (urand() - 0.5) * 0.4);
                c->ent[i] = (float)(0.1 + 2.0 * urand());
                c->ratio[i] = (float)(0.5 + urand());
            }
            if (!kink && !near_kink(exp(sum / (len > 1 ? len : 1)))) break;
            shift += 0.013;
        }
        c->adv[b] = (float)((urand() - 0.5) * 3.0);
    }
}

static GrpoLossInput input_of(const Case *c) {
    GrpoLossInput in = {
        .batch = c->B, .max_len = c->T, .logps = c->lp, .old_logps = c->old, .ref_logps = c->ref,
        .sampling_logps = c->smp, .entropies = c->ent, .mask = c->mask, .advantages = c->adv, .is_ratio = c->ratio,
        .num_items_in_batch = 40, .num_processes = 2, .gradient_accumulation_steps = 2, .steps_per_generation = 4,
        .training = 1,
    };
    return in;
}

static double loss_of(const GrpoOptions *o, const GrpoLossInput *in) {
    char err[512];
    GrpoLossMetrics m;
    int rc = grpo_loss(o, in, NULL, NULL, &m, err, sizeof err);
    if (rc) fprintf(stderr, "grpo_loss: %s\n", err);
    CHECK(rc == 0);
    return m.loss;
}

// dL/dlogps against central differences at every token (masked ones included: their derivative is 0).
static void check_gradient(const GrpoOptions *o, const char *what) {
    Case c;
    make_case(&c, 6, 5, (unsigned)(o->loss_type * 131 + o->importance_sampling_level * 17 + (o->beta > 0) * 7 +
                                   o->has_delta * 3 + o->use_bias_correction_kl));
    GrpoLossInput in = input_of(&c);
    in.entropy_coef = o->entropy_coef;
    float grad[64], grad_ent[64];
    char err[512];
    GrpoLossMetrics m;
    if (grpo_loss(o, &in, grad, grad_ent, &m, err, sizeof err) != 0) {
        fprintf(stderr, "%s: %s\n", what, err);
        failures++;
        return;
    }
    double gmax = 0.0, worst = 0.0;
    for (int i = 0; i < c.B * c.T; i++) gmax = fmax(gmax, fabs(grad[i]));
    for (int i = 0; i < c.B * c.T; i++) {
        float keep = c.lp[i];
        c.lp[i] = (float)(keep + 1e-3);
        double up = c.lp[i], lp_plus = loss_of(o, &in);
        c.lp[i] = (float)(keep - 1e-3);
        double down = c.lp[i], lp_minus = loss_of(o, &in);
        c.lp[i] = keep;
        double fd = (lp_plus - lp_minus) / (up - down);   // divided by the step fp32 actually took
        worst = fmax(worst, fabs(fd - grad[i]));
        if (!c.mask[i]) CHECK(grad[i] == 0.0f);
    }
    if (!(worst <= 1e-4 * gmax + 1e-8) || gmax == 0.0) {
        fprintf(stderr, "%s: finite differences differ by %.3g (max |grad| %.3g)\n", what, worst, gmax);
        failures++;
    }
    if (o->entropy_coef != 0.0 && o->top_entropy_quantile >= 1.0) {   // the bonus is linear in the entropies
        double emax = 0.0, eworst = 0.0;
        for (int i = 0; i < c.B * c.T; i++) emax = fmax(emax, fabs(grad_ent[i]));
        for (int i = 0; i < c.B * c.T; i++) {
            float keep = c.ent[i];
            c.ent[i] = (float)(keep + 1e-2);
            double up = c.ent[i], l1 = loss_of(o, &in);
            c.ent[i] = (float)(keep - 1e-2);
            double down = c.ent[i], l0 = loss_of(o, &in);
            c.ent[i] = keep;
            eworst = fmax(eworst, fabs((l1 - l0) / (up - down) - grad_ent[i]));
        }
        if (!(eworst <= 1e-5 * emax + 1e-9) || emax == 0.0) {
            fprintf(stderr, "%s: entropy gradient off by %.3g (max %.3g)\n", what, eworst, emax);
            failures++;
        }
    }
}

static void test_loss_gradients(void) {
    // cispo's weight is detached; with epsilon_high below every ratio it is the constant clamp, so its gradient is
    // the derivative of the loss. vespo's weight is detached and varies, so only TRL itself can check it.
    const GrpoLossType types[] = {GRPO_LOSS_GRPO, GRPO_LOSS_BNPO, GRPO_LOSS_DR_GRPO, GRPO_LOSS_DAPO,
                                  GRPO_LOSS_SAPO, GRPO_LOSS_LUSPO, GRPO_LOSS_CISPO};
    int checked = 0;
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++)
        for (int level = 0; level < 2; level++)
            for (int beta = 0; beta < 2; beta++)
                for (int delta = 0; delta < 2; delta++)
                    for (int bias = 0; bias < 2; bias++)
                        for (int extras = 0; extras < 3; extras++) {
                            GrpoOptions o = opts(2);
                            o.loss_type = types[k];
                            o.importance_sampling_level = (GrpoIsLevel)level;
                            o.beta = beta ? 0.04 : 0.0;
                            o.has_delta = delta, o.delta = 1.4;
                            o.use_bias_correction_kl = bias;
                            o.has_epsilon_high = 1, o.epsilon_high = 0.28;
                            o.max_completion_length = 8;
                            if (types[k] == GRPO_LOSS_CISPO) o.epsilon_high = 0.3;
                            if (extras) {   // constant multipliers: rollout IS ratio, entropy selection; bonus
                                o.vllm_importance_sampling_correction = 1;
                                o.vllm_importance_sampling_mode = GRPO_ROLLOUT_IS_TOKEN_TRUNCATE;
                                o.entropy_coef = 0.03;
                                // The selection is a step function of the entropies: dL/dentropy is checked
                                // without it (extras 2).
                                if (extras == 1) o.top_entropy_quantile = 0.5;
                            }
                            char what[160];
                            snprintf(what, sizeof what, "%s level=%d beta=%d delta=%d bias_kl=%d extras=%d",
                                     grpo_loss_type_name(o.loss_type), level, beta, delta, bias, extras);
                            check_gradient(&o, what);
                            checked++;
                        }
    CHECK(checked == 7 * 48);
}

static void test_loss_edges(void) {
    char err[512];
    Case c;
    make_case(&c, 4, 3, 5);
    float grad[64], grad_ent[64];
    GrpoLossMetrics m;

    // Every mask empty: loss 0, gradients 0, nothing NaN, per-sequence clip means absent (NaN).
    memset(c.mask, 0, sizeof c.mask);
    for (int t = 0; t <= GRPO_LOSS_VESPO; t++) {
        GrpoOptions o = opts(2);
        o.loss_type = (GrpoLossType)t;
        o.beta = 0.04;
        GrpoLossInput in = input_of(&c);
        in.num_items_in_batch = 0;
        CHECK(grpo_loss(&o, &in, grad, grad_ent, &m, err, sizeof err) == 0);
        CHECK(m.loss == 0.0 && m.kl_count == 0.0);
        for (int i = 0; i < 12; i++) CHECK(grad[i] == 0.0f && grad_ent[i] == 0.0f);
        if (t == GRPO_LOSS_GRPO) CHECK(isnan(m.clip_low_min) && isnan(m.clip_high_max) && m.clip_count == 0.0);
    }

    // A single token per sequence, on-policy (ratio exactly 1): grpo loss = mean(-A), dL/dlogp = -A / B.
    float lp[2] = {-1.0f, -2.0f}, adv[2] = {1.0f, -1.0f};
    uint8_t mask[2] = {1, 1};
    GrpoOptions o = opts(2);
    o.loss_type = GRPO_LOSS_GRPO;
    GrpoLossInput in = {.batch = 2, .max_len = 1, .logps = lp, .mask = mask, .advantages = adv,
                        .num_processes = 1, .gradient_accumulation_steps = 1, .steps_per_generation = 1,
                        .training = 1, .num_items_in_batch = 2};
    CHECK(grpo_loss(&o, &in, grad, NULL, &m, err, sizeof err) == 0);
    CHECK_NEAR(m.loss, 0.0, 1e-15);
    CHECK_NEAR(grad[0], -0.5, 1e-7);
    CHECK_NEAR(grad[1], 0.5, 1e-7);
    CHECK(m.clip_low_sum == 0.0 && m.clip_count == 2.0);
    // dapo on the same: normaliser num_items_in_batch / processes * accumulation / steps_per_generation.
    o.loss_type = GRPO_LOSS_DAPO;
    in.num_items_in_batch = 8, in.num_processes = 2, in.gradient_accumulation_steps = 2, in.steps_per_generation = 4;
    CHECK(grpo_loss(&o, &in, grad, NULL, &m, err, sizeof err) == 0);
    CHECK_NEAR(grad[0], -1.0 / 2.0, 1e-7);   // 8 / 2 * 2 / 4 = 2
    in.training = 0;                          // eval: no accumulation rescaling
    CHECK(grpo_loss(&o, &in, grad, NULL, &m, err, sizeof err) == 0);
    CHECK_NEAR(grad[0], -1.0 / 4.0, 1e-7);

    // Refusals name the missing input.
    o = opts(2);
    o.beta = 0.1;
    in = input_of(&c);
    in.ref_logps = NULL;
    CHECK(grpo_loss(&o, &in, grad, NULL, &m, err, sizeof err) == GRPO_ERR_INVALID && strstr(err, "ref_logps"));
    o = opts(2);
    o.vllm_importance_sampling_correction = 1;
    in = input_of(&c);
    in.is_ratio = NULL;
    CHECK(grpo_loss(&o, &in, grad, NULL, &m, err, sizeof err) == GRPO_ERR_INVALID && strstr(err, "is_ratio"));
    o = opts(2);
    o.top_entropy_quantile = 0.2;
    in = input_of(&c);
    in.entropies = NULL;
    CHECK(grpo_loss(&o, &in, grad, NULL, &m, err, sizeof err) == GRPO_ERR_INVALID && strstr(err, "entropies"));
    o = opts(2);
    in = input_of(&c);
    in.batch = 0;
    CHECK(grpo_loss(&o, &in, grad, NULL, &m, err, sizeof err) == GRPO_ERR_INVALID && strstr(err, "batch"));
    in = input_of(&c);
    in.gradient_accumulation_steps = 0;
    CHECK(grpo_loss(&o, &in, grad, NULL, &m, err, sizeof err) == GRPO_ERR_INVALID &&
          strstr(err, "gradient_accumulation_steps"));
}

// Asynchronous GRPO's bound: a completion is kept when its version >= policy_version - max_staleness; the counts,
// the staleness sum, max and histogram are of the kept ones; a version newer than the policy counts as 0.
static void test_staleness_filter(void) {
    const int64_t versions[8] = {7, 6, 5, 4, 8, 6, 2, 7};
    uint8_t keep[8];
    GrpoStaleness st;
    grpo_staleness_filter(8, versions, 7, 1, keep, &st);
    const uint8_t want[8] = {1, 1, 0, 0, 1, 1, 0, 1};
    CHECK(memcmp(keep, want, sizeof want) == 0);
    CHECK(st.kept == 5 && st.dropped == 3);
    CHECK(st.sum == 2 && st.max == 1);   // 0, 1, 0 (8 is newer), 1, 0
    CHECK(st.hist[0] == 3 && st.hist[1] == 2 && st.hist[2] == 0);
    // Bound 0 keeps only the policy's own version; a wide bound keeps all, the histogram's last bin taking the
    // oldest.
    grpo_staleness_filter(8, versions, 7, 0, keep, &st);
    CHECK(st.kept == 3 && st.dropped == 5 && st.max == 0);
    const int64_t old[2] = {0, 100};
    grpo_staleness_filter(2, old, 100, 1000, keep, &st);
    CHECK(keep[0] && keep[1] && st.kept == 2 && st.max == 100 && st.sum == 100);
    CHECK(st.hist[GRPO_STALENESS_BINS - 1] == 1 && st.hist[0] == 1);
}

// Streaming groups' bookkeeping: groups are marked as they come back, each once (a second report or one out of
// range is refused and changes nothing); the prefix (groups 0 .. prefix - 1 all in, what decides the micro-batches
// a rank holds) grows only when the gaps fill; a reset (a new round) forgets them.
static void test_group_progress(void) {
    char err[128];
    GroupProgress g;
    REQUIRE(group_progress_init(&g, 5, err, sizeof err) == 0, "%s", err);
    const int arrive[5] = {3, 0, 4, 1, 2}, prefix[5] = {0, 1, 1, 2, 5};
    for (int q = 0; q < 5; q++) {
        CHECK(group_progress_mark(&g, arrive[q]) == 0, "group %d", arrive[q]);
        CHECK(group_progress_mark(&g, arrive[q]) == -1, "group %d taken twice", arrive[q]);
        CHECK_EQ(g.n_scored, q + 1);
        CHECK(g.prefix == prefix[q], "after group %d: prefix %d, want %d", arrive[q], g.prefix, prefix[q]);
    }
    for (int k = 0; k < 5; k++) CHECK(g.scored[k] == 1);
    CHECK(group_progress_mark(&g, 5) == -1 && group_progress_mark(&g, -1) == -1 && g.n_scored == 5);
    group_progress_reset(&g);
    CHECK(g.n_scored == 0 && g.prefix == 0 && g.scored[3] == 0);
    CHECK(group_progress_mark(&g, 0) == 0 && g.prefix == 1 && g.n_scored == 1);
    group_progress_free(&g);
    CHECK(g.scored == NULL);
}

int main(void) {
    test_group_progress();
    test_staleness_filter();
    test_options();
    test_advantages();
    test_masks_and_ratio();
    test_loss_gradients();
    test_loss_edges();
    return check_exit_code("test_trainer_grpo");
}
