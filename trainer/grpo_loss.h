// trainer/grpo_loss.h — the GRPO math of tandem-train as host functions: rewards -> advantages, the rollout
// (vLLM-style) importance-sampling correction, and the per-token policy loss with its exact derivative with
// respect to the current policy's per-token logprobs (the only gradient the model needs: model_backward takes
// dL/dlogprob). Semantics and option names are TRL 1.16's GRPOTrainer / GRPOConfig; docs/grpo.md writes out every
// formula, and tests/reference/test_grpo_vs_trl.py checks them against TRL's own code.
//
// Shapes: B sequences (completions) of a micro-batch, T = longest completion in it (row-major (B, T) arrays);
// N = every completion of the generation batch on every rank (N = groups * num_generations, consecutive
// num_generations entries are one prompt's group). Inputs are host fp32; accumulation is in double.
#ifndef TANDEM_TRAINER_GRPO_LOSS_H
#define TANDEM_TRAINER_GRPO_LOSS_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    GRPO_LOSS_GRPO = 0,   // per-sequence mean, then mean over sequences
    GRPO_LOSS_BNPO,       // sum over the local batch / local active tokens
    GRPO_LOSS_DR_GRPO,    // sum / (B * max_completion_length)
    GRPO_LOSS_DAPO,       // sum / active tokens of the global accumulated batch (num_items_in_batch)
    GRPO_LOSS_CISPO,      // clipped, detached IS weight * advantage * logprob; dapo normaliser
    GRPO_LOSS_SAPO,       // sigmoid gate instead of hard clipping; grpo normaliser
    GRPO_LOSS_LUSPO,      // per-sequence sum (length-scaled GSPO), mean over sequences
    GRPO_LOSS_VESPO,      // detached gamma weight of the sequence IS ratio * advantage * logprob; dapo normaliser
} GrpoLossType;

typedef enum { GRPO_SCALE_GROUP = 0, GRPO_SCALE_BATCH, GRPO_SCALE_NONE } GrpoScaleRewards;
typedef enum { GRPO_AGG_SUM_THEN_NORMALIZE = 0, GRPO_AGG_NORMALIZE_THEN_SUM } GrpoMultiObjective;
typedef enum { GRPO_IS_LEVEL_TOKEN = 0, GRPO_IS_LEVEL_SEQUENCE } GrpoIsLevel;
typedef enum {
    GRPO_ROLLOUT_IS_TOKEN_TRUNCATE = 0,
    GRPO_ROLLOUT_IS_TOKEN_MASK,
    GRPO_ROLLOUT_IS_SEQUENCE_TRUNCATE,
    GRPO_ROLLOUT_IS_SEQUENCE_MASK,
} GrpoRolloutIsMode;

// GRPOConfig fields that the GRPO math reads, with TRL's names. has_* = 0 is TRL's None.
typedef struct {
    int num_generations;                 // group size G (>= 2)
    int max_completion_length;           // dr_grpo's constant normaliser
    double beta;                         // k3 KL coefficient (0 = no reference model)
    double epsilon;                      // epsilon_low of the clip range
    int has_epsilon_high; double epsilon_high;   // unset: = epsilon (cispo: the max of the IS weight)
    int has_delta; double delta;                 // two-sided clipping: coef_1 <= delta
    GrpoLossType loss_type;
    GrpoScaleRewards scale_rewards;
    GrpoMultiObjective multi_objective_aggregation;
    GrpoIsLevel importance_sampling_level;
    int mask_truncated_completions;
    double top_entropy_quantile;         // 1.0 keeps every token in the policy loss
    double sapo_temperature_neg, sapo_temperature_pos;
    double vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg;
    // The rollout server always returns sampling logprobs (TRL's use_vllm = True); this flag turns the
    // correction with them on or off.
    int vllm_importance_sampling_correction;
    GrpoRolloutIsMode vllm_importance_sampling_mode;
    int has_vllm_importance_sampling_clip_max; double vllm_importance_sampling_clip_max;
    int has_vllm_importance_sampling_clip_min; double vllm_importance_sampling_clip_min;
    int clip_max_from_cap;               // set by the deprecated vllm_importance_sampling_cap (which wins, as in TRL)
    int has_off_policy_mask_threshold; double off_policy_mask_threshold;
    int use_bias_correction_kl;
    double entropy_coef;
    int use_adaptive_entropy;
    double entropy_coef_min, entropy_coef_max, entropy_coef_delta, entropy_target;
} GrpoOptions;

#define GRPO_ERR_INVALID (-1)   // an option or an input is refused; the message names it
#define GRPO_ERR_NOMEM   (-2)

// TRL 1.16 defaults (GRPOConfig): num_generations 8, max_completion_length 512, beta 0, epsilon 0.2,
// loss_type dapo, scale_rewards group, importance_sampling_level token, top_entropy_quantile 1,
// vllm_importance_sampling_correction on, mode sequence_mask, clip_max 3, use_bias_correction_kl on, ...
void grpo_options_default(GrpoOptions *o);
// Refuses what TRL refuses (num_generations < 2, clip_min >= clip_max, a *_truncate mode with no bound,
// vespo with a sequence-level correction mode) and what the math cannot take (epsilon < 0, epsilon_high < 0,
// delta <= 0, beta < 0, top_entropy_quantile outside [0, 1], non-positive sapo temperatures,
// max_completion_length < 1, a negative off_policy_mask_threshold, entropy_coef_min > entropy_coef_max, ...).
// Returns 0 or GRPO_ERR_INVALID with a message naming the option.
int grpo_options_validate(const GrpoOptions *o, char *err, size_t err_len);

// Names <-> enums (TRL's strings). Parse functions return 0, or GRPO_ERR_INVALID listing the accepted names.
const char *grpo_loss_type_name(GrpoLossType t);
const char *grpo_scale_rewards_name(GrpoScaleRewards s);
const char *grpo_multi_objective_name(GrpoMultiObjective a);
const char *grpo_is_level_name(GrpoIsLevel l);
const char *grpo_rollout_is_mode_name(GrpoRolloutIsMode m);
int grpo_loss_type_parse(const char *s, GrpoLossType *out, char *err, size_t err_len);
int grpo_scale_rewards_parse(const char *s, GrpoScaleRewards *out, char *err, size_t err_len);
int grpo_multi_objective_parse(const char *s, GrpoMultiObjective *out, char *err, size_t err_len);
int grpo_is_level_parse(const char *s, GrpoIsLevel *out, char *err, size_t err_len);
int grpo_rollout_is_mode_parse(const char *s, GrpoRolloutIsMode *out, char *err, size_t err_len);

// Sets one option from a JSON value under its TRL key (value is a jansson json_t*; JSON null = TRL's None where
// TRL allows it; scale_rewards also takes true/false as TRL does). Returns 1 when key is a GRPO-math key and
// was set, 0 when key is not one of them (the caller's config parser handles it), GRPO_ERR_INVALID on a
// mistyped value (message names the key). Call grpo_options_validate once every key is set.
struct json_t;
int grpo_options_set_json(GrpoOptions *o, const char *key, const struct json_t *value, char *err, size_t err_len);

// ---- rewards -> advantages (TRL: _generate_and_score_completions) ----

typedef struct {
    double reward;                 // "reward": nanmean of the weighted reward sum (unscorable rows excluded)
    double reward_std;             // "reward_std": nanstd of the same
    double frac_reward_zero_std;   // "frac_reward_zero_std": share of samples whose std is ~0 (isclose, atol 1e-8)
} GrpoRewardMetrics;

// rewards_per_func (N, F): one column per reward function, NaN where it returned None. reward_weights (F) or
// NULL (all 1). advantages (N) out: grouped by num_generations; nan-aware mean/std (Bessel-corrected, NaN for
// fewer than 2 values), std + 1e-4 in the denominator; rows where every function returned None, and any NaN
// advantage, become 0. func_mean / func_std (F) or NULL: "rewards/<name>/mean" and ".../std". N must be a
// multiple of num_generations. Returns 0 or GRPO_ERR_INVALID.
int grpo_advantages(const GrpoOptions *o, int n, int num_funcs, const float *rewards_per_func,
                    const float *reward_weights, float *advantages, GrpoRewardMetrics *metrics,
                    double *func_mean, double *func_std, char *err, size_t err_len);

// mask_truncated_completions: zeroes mask rows (B, T) whose completion is truncated (truncated (B): 1 when the
// completion's last token is neither an EOS id nor the pad id). No-op when the option is off.
void grpo_mask_truncated_completions(const GrpoOptions *o, int batch, int max_len, const uint8_t *truncated,
                                     uint8_t *mask);
// TRL's truncation test for one completion: its last id is not in eos_ids and not pad_id (empty: not truncated).
int grpo_completion_is_truncated(const int32_t *ids, int len, const int32_t *eos_ids, int n_eos, int32_t pad_id);
// Active tokens of a (B, T) mask. num_items_in_batch = this summed over the generation batch of every rank.
double grpo_count_tokens(int batch, int max_len, const uint8_t *mask);

// ---- rollout importance-sampling correction (TRL: vllm_importance_sampling_*) ----

typedef struct {
    // Local values; across ranks TRL takes the mean of the means, the max of the maxes, the nanmin of the mins.
    double logp_difference_mean, logp_difference_max;   // "sampling/sampling_logp_difference/{mean,max}"
    double ratio_min, ratio_mean, ratio_max;            // "sampling/importance_sampling_ratio/{min,mean,max}"
} GrpoRolloutIsMetrics;

// old_logps (B, T): the trainer's logprobs of the sampled tokens before any update; sampling_logps (B, T): the
// rollout server's (NaN where it could not score a token); mask (B, T). ratio out: (B, T) for token_* modes,
// (B) for sequence_* modes (grpo_rollout_is_ratio_len says which). Returns 0 or GRPO_ERR_INVALID.
size_t grpo_rollout_is_ratio_len(const GrpoOptions *o, int batch, int max_len);
int grpo_rollout_is_ratio(const GrpoOptions *o, int batch, int max_len, const float *old_logps,
                          const float *sampling_logps, const uint8_t *mask, float *ratio,
                          GrpoRolloutIsMetrics *metrics, char *err, size_t err_len);

// ---- the loss (TRL: _compute_loss) ----

typedef struct {
    int batch, max_len;             // B, T (T >= 1)
    const float *logps;             // (B, T) current policy logprobs: the variable the gradient is taken for
    const float *old_logps;         // (B, T) logprobs before this generation batch's updates; NULL = on-policy
                                    // (TRL's per_token_logps.detach(): every ratio is exactly 1)
    const float *ref_logps;         // (B, T) frozen reference; required when beta != 0
    const float *sampling_logps;    // (B, T) rollout server logprobs or NULL (off_policy_mask_threshold uses them,
                                    // old_logps otherwise, as TRL does)
    const float *entropies;         // (B, T) per-token entropy or NULL; required for top_entropy_quantile < 1 and
                                    // the entropy bonus; feeds the "entropy" metric
    const uint8_t *mask;            // (B, T) loss mask (completion mask after truncation masking)
    const float *advantages;        // (B)
    const float *is_ratio;          // rollout IS ratio from grpo_rollout_is_ratio, required when the correction is on
    double num_items_in_batch;      // dapo/cispo/vespo: active tokens of the whole generation batch, all ranks
    int num_processes;              // ranks
    int gradient_accumulation_steps;   // TRL's current_gradient_accumulation_steps
    int steps_per_generation;
    int training;                   // 1 = train (accumulation scaling), 0 = eval
    int has_entropy_threshold;      // top_entropy_quantile < 1: threshold over every rank's active entropies
    float entropy_threshold;        // (grpo_entropy_threshold on the all-gathered values); else local tokens only
    double entropy_coef;            // the entropy bonus coefficient applied now (grpo_entropy_apply_coef)
} GrpoLossInput;

typedef struct {
    double loss;            // the value whose gradient grpo_loss returns (already scaled for accumulation)
    double policy_loss;     // TRL "policy_loss": the policy(+KL) term before accumulation scaling and bonus
    // Global means as TRL logs them: all-reduce (sum) each *_sum and *_count over ranks, then sum / max(count, 1).
    double kl_sum, kl_count;                 // "kl" (beta != 0)
    double entropy_sum, entropy_count;       // "entropy" (entropies given)
    double clip_low_sum, clip_high_sum, clip_region_sum, clip_count;  // "clip_ratio/{low,high,region}_mean"
    double clip_low_min, clip_high_max;      // "clip_ratio/low_min", "clip_ratio/high_max": local nanmin / nanmax
                                             // of per-sequence means (NaN when none); reduce with MIN / MAX
    double cispo_clip_sum, cispo_clip_count; // "cispo_clip_ratio"
    double vespo_phi_sum, vespo_phi_count;   // "vespo/phi_seq_mean"
    double entropy_window_sum, entropy_window_count;  // entropy over the bonus's token set (adaptive control)
} GrpoLossMetrics;

// Computes the loss and, when grad_logps (B, T) is not NULL, dL/dlogps for every token (0 where masked), and when
// grad_entropies (B, T) is not NULL, dL/dentropy (non-zero only with the entropy bonus). Returns 0 or
// GRPO_ERR_INVALID / GRPO_ERR_NOMEM with a message naming the missing or malformed input.
int grpo_loss(const GrpoOptions *o, const GrpoLossInput *in, float *grad_logps, float *grad_entropies,
              GrpoLossMetrics *metrics, char *err, size_t err_len);

// top_entropy_quantile's threshold: torch.quantile(values, 1 - top_entropy_quantile) with linear interpolation
// in fp32, as TRL computes it over the active tokens' entropies gathered from every rank. values (n) are
// sorted in place. n == 0 returns +inf (no token passes, as TRL's all-false mask).
float grpo_entropy_threshold(const GrpoOptions *o, float *values, size_t n);

// Adaptive entropy control (use_adaptive_entropy, Skywork-OR1), the state TRL keeps across steps.
typedef struct {
    double coef;                 // current entropy_coef
    double last_world_entropy;   // +inf until the first optimizer step
    double window_sum, window_count;   // this accumulation window's (local) entropy totals
} GrpoEntropyControl;
void grpo_entropy_control_init(GrpoEntropyControl *c, const GrpoOptions *o);
// The coefficient every micro-batch of the current window applies (GrpoLossInput.entropy_coef).
double grpo_entropy_apply_coef(const GrpoEntropyControl *c, const GrpoOptions *o);
// After each training micro-batch: adds its entropy_window_{sum,count} (adaptive mode only).
void grpo_entropy_control_accumulate(GrpoEntropyControl *c, const GrpoOptions *o, const GrpoLossMetrics *m);
// At the optimizer step: world_sum / world_count = the window totals all-reduced over ranks. Moves coef by
// entropy_coef_delta towards more bonus when the entropy is at or below entropy_target, clamps it to
// [entropy_coef_min, entropy_coef_max], and resets the window.
void grpo_entropy_control_step(GrpoEntropyControl *c, const GrpoOptions *o, double world_sum, double world_count);

#endif
