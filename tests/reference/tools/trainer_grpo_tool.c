// tests/reference/tools/trainer_grpo_tool.c — drives the trainer's GRPO math for tests/reference/test_grpo_vs_trl.py.
//
// Reads one JSON case on stdin (or a JSON array of cases, answered by an array in the same order):
//   options            {TRL GRPOConfig key: value}   (grpo_options_set_json; unknown keys are refused)
//   rewards_per_func   [[N x F]] (null = None/NaN)   -> advantages; or "advantages" [B] given directly
//   loss_advantages    [B] (optional): the advantages the loss uses instead of the computed ones
//   reward_weights     [F] (optional)
//   mask               [[B x T]] 0/1 completion mask; truncated [B] 0/1 (optional, mask_truncated_completions)
//   logps, old_logps, ref_logps, sampling_logps, entropies   [[B x T]] (null entries = NaN; arrays optional)
//   batch              {num_processes, gradient_accumulation_steps, steps_per_generation, training,
//                       num_items_in_batch (default: active tokens of the mask), sync_gradients}
//   completion_ids     [[ids]] with eos_token_ids [..] and pad_token_id: truncation flags as TRL derives them
//   entropy_control    {coef, last_world_entropy (null = +inf)} (optional)
// Prints {advantages, mask, num_items_in_batch, importance_sampling_ratio, loss, policy_loss, grad_logps,
// grad_entropies, metrics {TRL metric names}, entropy_control} on stdout; NaN and inf print as null.
// {"quantile_values", "top_entropy_quantile"} answers {"threshold"} (grpo_entropy_threshold) instead.
// A refused case answers {"error": message}; a single refused case also exits 1.
#include <jansson.h>
#include <math.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer/grpo_loss.h"

static char g_err[512];
static char g_fail_msg[512];
static jmp_buf g_case_jmp;   // a refused case unwinds to run_case's caller
// Every allocation of the current case, freed when it ends (normally or refused).
static void *g_allocs[64];
static int g_nallocs;

static _Noreturn void fail(const char *msg) {
    snprintf(g_fail_msg, sizeof g_fail_msg, "%s", msg);
    longjmp(g_case_jmp, 1);
}

static void *xmalloc(size_t n) {
    if (g_nallocs == (int)(sizeof g_allocs / sizeof g_allocs[0])) fail("too many arrays in one case");
    void *p = malloc(n ? n : 1);
    if (!p) fail("out of memory");
    g_allocs[g_nallocs++] = p;
    return p;
}

static void free_case(void) {
    while (g_nallocs > 0) free(g_allocs[--g_nallocs]);
}

static json_t *num(double x) { return isfinite(x) ? json_real(x) : json_null(); }

static double to_double(const json_t *v, const char *what) {
    if (json_is_null(v)) return NAN;
    if (!json_is_number(v)) {
        snprintf(g_err, sizeof g_err, "%s: expected numbers", what);
        fail(g_err);
    }
    return json_number_value(v);
}

// A [[rows x cols]] array of numbers (null = NaN) as fp32; NULL when the key is absent or null.
static float *matrix(const json_t *root, const char *key, int *rows, int *cols) {
    const json_t *a = json_object_get(root, key);
    if (!a || json_is_null(a)) return NULL;
    if (!json_is_array(a) || json_array_size(a) == 0) {
        snprintf(g_err, sizeof g_err, "%s: expected a non-empty array of arrays", key);
        fail(g_err);
    }
    int r = (int)json_array_size(a), c = -1;
    for (int i = 0; i < r; i++) {
        const json_t *row = json_array_get(a, i);
        if (!json_is_array(row) || (c >= 0 && (int)json_array_size(row) != c)) {
            snprintf(g_err, sizeof g_err, "%s: rows must be arrays of one length", key);
            fail(g_err);
        }
        c = (int)json_array_size(row);
    }
    float *m = xmalloc(sizeof(float) * (size_t)r * c);
    for (int i = 0; i < r; i++)
        for (int j = 0; j < c; j++) m[(size_t)i * c + j] = (float)to_double(json_array_get(json_array_get(a, i), j), key);
    *rows = r;
    *cols = c;
    return m;
}

static float *vector(const json_t *root, const char *key, int *n) {
    const json_t *a = json_object_get(root, key);
    if (!a || json_is_null(a)) return NULL;
    if (!json_is_array(a)) {
        snprintf(g_err, sizeof g_err, "%s: expected an array", key);
        fail(g_err);
    }
    *n = (int)json_array_size(a);
    float *v = xmalloc(sizeof(float) * *n);
    for (int i = 0; i < *n; i++) v[i] = (float)to_double(json_array_get(a, i), key);
    return v;
}

static json_t *matrix_json(const float *m, int rows, int cols) {
    json_t *a = json_array();
    for (int i = 0; i < rows; i++) {
        json_t *row = json_array();
        for (int j = 0; j < cols; j++) json_array_append_new(row, num(m[(size_t)i * cols + j]));
        json_array_append_new(a, row);
    }
    return a;
}

static int get_int(const json_t *obj, const char *key, int dflt) {
    const json_t *v = obj ? json_object_get(obj, key) : NULL;
    if (!v) return dflt;
    if (json_is_boolean(v)) return json_is_true(v);
    if (!json_is_integer(v)) {
        snprintf(g_err, sizeof g_err, "batch.%s: expected an integer", key);
        fail(g_err);
    }
    return (int)json_integer_value(v);
}

// Completion ids (B rows of any length) -> TRL's truncation flags (last id neither EOS nor pad).
static float *truncation_from_ids(const json_t *root, int B) {
    const json_t *ids = json_object_get(root, "completion_ids"), *eos = json_object_get(root, "eos_token_ids");
    const json_t *pad = json_object_get(root, "pad_token_id");
    if (!json_is_array(ids) || (int)json_array_size(ids) != B || !json_is_array(eos) || !json_is_integer(pad))
        fail("completion_ids: B arrays of ids, with eos_token_ids and pad_token_id, are expected");
    int n_eos = (int)json_array_size(eos);
    int32_t *eos_ids = xmalloc(sizeof(int32_t) * n_eos);
    for (int k = 0; k < n_eos; k++) eos_ids[k] = (int32_t)json_integer_value(json_array_get(eos, k));
    float *flags = xmalloc(sizeof(float) * B);
    for (int b = 0; b < B; b++) {
        const json_t *row = json_array_get(ids, b);
        int len = (int)json_array_size(row);
        int32_t *r = xmalloc(sizeof(int32_t) * len);
        for (int t = 0; t < len; t++) r[t] = (int32_t)json_integer_value(json_array_get(row, t));
        flags[b] = (float)grpo_completion_is_truncated(r, len, eos_ids, n_eos, (int32_t)json_integer_value(pad));
    }
    return flags;
}

// {"quantile_values": [...], "top_entropy_quantile": q} -> {"threshold": grpo_entropy_threshold(values)}.
static json_t *run_quantile(const json_t *root, json_t *out) {
    GrpoOptions o;
    grpo_options_default(&o);
    const json_t *q = json_object_get(root, "top_entropy_quantile");
    o.top_entropy_quantile = q ? to_double(q, "top_entropy_quantile") : 1.0;
    int n = 0;
    float *v = vector(root, "quantile_values", &n);
    json_object_set_new(out, "threshold", num(grpo_entropy_threshold(&o, v, (size_t)n)));
    return out;
}

static json_t *run_case(const json_t *root, json_t *out, json_t *metrics) {
    if (!json_is_object(root)) fail("each case must be a JSON object");
    if (json_object_get(root, "quantile_values")) return run_quantile(root, out);
    GrpoOptions o;
    grpo_options_default(&o);
    const json_t *opts = json_object_get(root, "options");
    const char *key;
    json_t *val;
    if (opts) json_object_foreach((json_t *)opts, key, val) {
            int rc = grpo_options_set_json(&o, key, val, g_err, sizeof g_err);
            if (rc < 0) fail(g_err);
            if (rc == 0) {
                snprintf(g_err, sizeof g_err, "options: unknown key '%s'", key);
                fail(g_err);
            }
        }
    if (grpo_options_validate(&o, g_err, sizeof g_err)) fail(g_err);

    int B = 0, T = 0, r, c;
    float *maskf = matrix(root, "mask", &B, &T);
    if (!maskf) fail("mask: required");
    uint8_t *mask = xmalloc((size_t)B * T);
    for (size_t i = 0; i < (size_t)B * T; i++) mask[i] = maskf[i] != 0.0f;
    float *arrays[5];
    const char *names[5] = {"logps", "old_logps", "ref_logps", "sampling_logps", "entropies"};
    for (int k = 0; k < 5; k++) {
        arrays[k] = matrix(root, names[k], &r, &c);
        if (arrays[k] && (r != B || c != T)) {
            snprintf(g_err, sizeof g_err, "%s: shape (%d, %d) differs from mask (%d, %d)", names[k], r, c, B, T);
            fail(g_err);
        }
    }
    if (!arrays[0]) fail("logps: required");

    // Advantages, from rewards or given.
    float *adv = NULL;
    int n = 0, F = 0;
    float *rpf = matrix(root, "rewards_per_func", &n, &F);
    if (rpf) {
        int nw = 0;
        float *weights = vector(root, "reward_weights", &nw);
        if (weights && nw != F) {
            snprintf(g_err, sizeof g_err, "reward_weights: %d weights for %d reward functions", nw, F);
            fail(g_err);
        }
        if (n != B) fail("rewards_per_func: one row per completion of the batch is expected");
        adv = xmalloc(sizeof(float) * n);
        double *fm = xmalloc(sizeof(double) * F), *fs = xmalloc(sizeof(double) * F);
        GrpoRewardMetrics rm;
        if (grpo_advantages(&o, n, F, rpf, weights, adv, &rm, fm, fs, g_err, sizeof g_err)) fail(g_err);
        for (int k = 0; k < F; k++) {
            char name[64];
            snprintf(name, sizeof name, "rewards/func%d/mean", k);
            json_object_set_new(metrics, name, num(fm[k]));
            snprintf(name, sizeof name, "rewards/func%d/std", k);
            json_object_set_new(metrics, name, num(fs[k]));
        }
        json_object_set_new(metrics, "reward", num(rm.reward));
        json_object_set_new(metrics, "reward_std", num(rm.reward_std));
        json_object_set_new(metrics, "frac_reward_zero_std", num(rm.frac_reward_zero_std));
    } else {
        adv = vector(root, "advantages", &n);
        if (!adv || n != B) fail("advantages: one per completion is required when rewards_per_func is absent");
    }
    json_t *adv_json = json_array();
    for (int i = 0; i < B; i++) json_array_append_new(adv_json, num(adv[i]));
    json_object_set_new(out, "advantages", adv_json);
    if (json_object_get(root, "loss_advantages")) {
        adv = vector(root, "loss_advantages", &n);
        if (!adv || n != B) fail("loss_advantages: one per completion");
    }

    // Truncation masking, then the token count.
    int nt = 0;
    float *trunc = json_object_get(root, "completion_ids") ? truncation_from_ids(root, B) : NULL;
    if (!trunc) {
        trunc = vector(root, "truncated", &nt);
        if (trunc && nt != B) fail("truncated: one flag per completion");
    }
    if (trunc) {
        uint8_t *tr = xmalloc((size_t)B);
        json_t *ta = json_array();
        for (int i = 0; i < B; i++) {
            tr[i] = trunc[i] != 0.0f;
            json_array_append_new(ta, json_boolean(tr[i]));
        }
        json_object_set_new(out, "truncated", ta);
        grpo_mask_truncated_completions(&o, B, T, tr, mask);
    }
    for (size_t i = 0; i < (size_t)B * T; i++) maskf[i] = mask[i];
    json_object_set_new(out, "mask", matrix_json(maskf, B, T));

    const json_t *batch = json_object_get(root, "batch");
    const json_t *ni = batch ? json_object_get(batch, "num_items_in_batch") : NULL;
    double num_items = ni ? to_double(ni, "batch.num_items_in_batch") : grpo_count_tokens(B, T, mask);
    json_object_set_new(out, "num_items_in_batch", num(num_items));

    // Rollout IS ratio from the old and the sampling logprobs.
    float *ratio = NULL;
    if (o.vllm_importance_sampling_correction) {
        if (!arrays[1] || !arrays[3]) fail("old_logps and sampling_logps are required for the IS correction");
        size_t len = grpo_rollout_is_ratio_len(&o, B, T);
        ratio = xmalloc(sizeof(float) * len);
        GrpoRolloutIsMetrics im;
        if (grpo_rollout_is_ratio(&o, B, T, arrays[1], arrays[3], mask, ratio, &im, g_err, sizeof g_err))
            fail(g_err);
        json_t *ra = json_array();
        for (size_t i = 0; i < len; i++) json_array_append_new(ra, num(ratio[i]));
        json_object_set_new(out, "importance_sampling_ratio", ra);
        json_object_set_new(metrics, "sampling/sampling_logp_difference/mean", num(im.logp_difference_mean));
        json_object_set_new(metrics, "sampling/sampling_logp_difference/max", num(im.logp_difference_max));
        json_object_set_new(metrics, "sampling/importance_sampling_ratio/min", num(im.ratio_min));
        json_object_set_new(metrics, "sampling/importance_sampling_ratio/mean", num(im.ratio_mean));
        json_object_set_new(metrics, "sampling/importance_sampling_ratio/max", num(im.ratio_max));
    }

    // Entropy control state (adaptive or static bonus).
    GrpoEntropyControl ec;
    grpo_entropy_control_init(&ec, &o);
    const json_t *ecj = json_object_get(root, "entropy_control");
    if (ecj) {
        const json_t *v = json_object_get(ecj, "coef");
        if (v) ec.coef = to_double(v, "entropy_control.coef");
        v = json_object_get(ecj, "last_world_entropy");
        if (v) ec.last_world_entropy = json_is_null(v) ? INFINITY : to_double(v, "entropy_control.last_world_entropy");
    }

    GrpoLossInput in = {
        .batch = B, .max_len = T, .logps = arrays[0], .old_logps = arrays[1], .ref_logps = arrays[2],
        .sampling_logps = arrays[3], .entropies = arrays[4], .mask = mask, .advantages = adv, .is_ratio = ratio,
        .num_items_in_batch = num_items,
        .num_processes = get_int(batch, "num_processes", 1),
        .gradient_accumulation_steps = get_int(batch, "gradient_accumulation_steps", 1),
        .steps_per_generation = get_int(batch, "steps_per_generation", 1),
        .training = get_int(batch, "training", 1),
        .entropy_coef = grpo_entropy_apply_coef(&ec, &o),
    };
    float *grad = xmalloc(sizeof(float) * (size_t)B * T), *grad_ent = xmalloc(sizeof(float) * (size_t)B * T);
    GrpoLossMetrics lm;
    if (grpo_loss(&o, &in, grad, grad_ent, &lm, g_err, sizeof g_err)) fail(g_err);
    json_object_set_new(out, "loss", num(lm.loss));
    json_object_set_new(out, "policy_loss", num(lm.policy_loss));
    json_object_set_new(out, "grad_logps", matrix_json(grad, B, T));
    json_object_set_new(out, "grad_entropies", matrix_json(grad_ent, B, T));

    // Metrics under TRL's names, only where TRL logs them. One process: the all-reduce is the identity.
#define MEAN(s, c) ((s) / ((c) > 1.0 ? (c) : 1.0))
    if (o.beta != 0.0) json_object_set_new(metrics, "kl", num(MEAN(lm.kl_sum, lm.kl_count)));
    if (arrays[4]) json_object_set_new(metrics, "entropy", num(MEAN(lm.entropy_sum, lm.entropy_count)));
    GrpoLossType lt = o.loss_type;
    if (lt == GRPO_LOSS_GRPO || lt == GRPO_LOSS_BNPO || lt == GRPO_LOSS_DR_GRPO || lt == GRPO_LOSS_DAPO ||
        lt == GRPO_LOSS_LUSPO) {
        json_object_set_new(metrics, "clip_ratio/low_mean", num(MEAN(lm.clip_low_sum, lm.clip_count)));
        json_object_set_new(metrics, "clip_ratio/high_mean", num(MEAN(lm.clip_high_sum, lm.clip_count)));
        json_object_set_new(metrics, "clip_ratio/region_mean", num(MEAN(lm.clip_region_sum, lm.clip_count)));
        json_object_set_new(metrics, "clip_ratio/low_min", num(lm.clip_low_min));
        json_object_set_new(metrics, "clip_ratio/high_max", num(lm.clip_high_max));
    } else if (lt == GRPO_LOSS_CISPO) {
        json_object_set_new(metrics, "cispo_clip_ratio", num(MEAN(lm.cispo_clip_sum, lm.cispo_clip_count)));
    } else if (lt == GRPO_LOSS_VESPO) {
        json_object_set_new(metrics, "vespo/phi_seq_mean", num(MEAN(lm.vespo_phi_sum, lm.vespo_phi_count)));
    }
    if (o.entropy_coef != 0.0 || o.use_adaptive_entropy) {
        json_object_set_new(metrics, "policy_loss", num(lm.policy_loss));
        int sync = get_int(batch, "sync_gradients", 1);
        if (in.training) {
            grpo_entropy_control_accumulate(&ec, &o, &lm);
            if (sync) grpo_entropy_control_step(&ec, &o, ec.window_sum, ec.window_count);
        }
        if (in.training && sync) json_object_set_new(metrics, "entropy_coef", num(ec.coef));
    }
    json_object_set(out, "metrics", metrics);
    json_object_set_new(out, "entropy_control",
                        json_pack("{s:o,s:o}", "coef", num(ec.coef), "last_world_entropy",
                                  num(ec.last_world_entropy)));
    return out;
}

// Runs one case: its answer, or {"error": message} when it is refused (*refused set).
static json_t *answer(const json_t *c, int *refused) {
    json_t *volatile out = json_object();
    json_t *volatile metrics = json_object();
    json_t *result;
    if (setjmp(g_case_jmp) == 0) {
        result = json_incref(run_case(c, out, metrics));
    } else {
        result = json_pack("{s:s}", "error", g_fail_msg);
        *refused = 1;
    }
    free_case();
    json_decref(out);
    json_decref(metrics);
    return result;
}

int main(void) {
    json_error_t jerr;
    json_t *root = json_loadf(stdin, 0, &jerr);
    int refused = 0;
    json_t *result;
    if (!root) {
        result = json_pack("{s:s}", "error", "stdin: not JSON");
        refused = 1;
    } else if (json_is_array(root)) {
        result = json_array();
        for (size_t i = 0; i < json_array_size(root); i++) {
            int r = 0;
            json_array_append_new(result, answer(json_array_get(root, i), &r));
        }
    } else {
        result = answer(root, &refused);
    }
    json_dumpf(result, stdout, JSON_COMPACT | JSON_REAL_PRECISION(17));
    fputc('\n', stdout);
    json_decref(result);
    json_decref(root);
    return refused ? 1 : 0;
}
