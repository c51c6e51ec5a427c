// trainer/train_config_table.c — the table of tandem-train's options (names, types, help), the defaults, and
// what is generated from them: --help, docs/configuration.md's tables, the JSON dump of a configuration.
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer/train_config_internal.h"

#define F(field) offsetof(TrainConfig, field)

// ---- enum names -------------------------------------------------------------------------------------

static const char *pick(const char *const *names, size_t n, int v) {
    return (v >= 0 && (size_t)v < n) ? names[v] : NULL;
}
#define NAMES(fn, ...)                                                   \
    static const char *fn(int v) {                                       \
        static const char *const n[] = {__VA_ARGS__};                    \
        return pick(n, sizeof n / sizeof n[0], v);                       \
    }
NAMES(mode_name, "grpo", "sft")
NAMES(overlong_name, "skip", "error")
NAMES(regex_mode_name, "full", "search")
NAMES(device_name, "auto", "cpu", "cuda")
NAMES(sync_name, "auto", "nccl", "zmq", "ipc")
NAMES(lora_sync_name, "adapter", "merged")
NAMES(sharding_name, "full_shard", "hybrid_shard")
NAMES(truncation_name, "keep_start", "keep_end")
NAMES(save_strategy_name, "steps", "epoch", "no", "best")
static const char *sched_name(int v) { return pick(lr_schedule_names, LR_SCHED_COUNT, v); }
// GRPO enums: their own name functions answer "?" past the last value.
static const char *grpo_choice(const char *s) { return (s && strcmp(s, "?") != 0) ? s : NULL; }
static const char *loss_name(int v) { return grpo_choice(grpo_loss_type_name((GrpoLossType)v)); }
static const char *scale_name(int v) { return grpo_choice(grpo_scale_rewards_name((GrpoScaleRewards)v)); }
static const char *agg_name(int v) { return grpo_choice(grpo_multi_objective_name((GrpoMultiObjective)v)); }
static const char *level_name(int v) { return grpo_choice(grpo_is_level_name((GrpoIsLevel)v)); }
static const char *is_mode_name(int v) { return grpo_choice(grpo_rollout_is_mode_name((GrpoRolloutIsMode)v)); }

// ---- the table --------------------------------------------------------------------------------------

#define G_DATA "Model, data and output"
#define G_GEN "Generation"
#define G_GRPO "GRPO loss and advantages"
#define G_RWD "Rewards"
#define G_TOOLS "Multi-turn tool use"
#define G_OPT "Optimisation and schedule"
#define G_LOG "Logging and checkpoints"
#define G_DIST "Distribution, rollout servers, weight sync"
#define G_LORA "LoRA adapters (PEFT)"
#define G_SFT "Supervised fine-tuning (mode sft; TRL SFTConfig's names)"

#define OPT(k, t, field, g, h) {k, t, F(field), 0, NULL, 0, NULL, g, h, 0}
#define ENUM(k, field, fn, fl, g, h) {k, OPT_ENUM, F(field), 0, fn, fl, NULL, g, h, 0}
#define GRPO(k, t, field, g, h) {k, t, F(grpo.field), 0, NULL, OPTF_GRPO, NULL, g, h, 0}
#define GRPO_OPT(k, field, g, h) {k, OPT_OPT_F64, F(grpo.field), F(grpo.has_##field), NULL, OPTF_GRPO, NULL, g, h, 0}
// JSON null (flag: none) is TRL's None and sets nullv.
#define NULLABLE(k, t, field, nullv, g, h) {k, t, F(field), 0, NULL, OPTF_NULLABLE, NULL, g, h, nullv}
#define ALIAS(k, target) {k, OPT_INT, 0, 0, NULL, OPTF_ALIAS, target, NULL, NULL, 0}

const OptionSpec train_options[] = {
    {"config", OPT_STR, F(config_file), 0, NULL, OPTF_FLAG_ONLY, NULL, G_DATA,
     "JSON config file with these keys (TRL's GRPOConfig names); flags override it", 0},
    OPT("model", OPT_STR, model, G_DATA, "Hugging Face model folder (config.json, safetensors, tokenizer) [required]"),
    OPT("train_file", OPT_STR, train_file, G_DATA, "JSONL file or folder of *.jsonl shards [required]"),
    ENUM("mode", mode, mode_name, 0, G_DATA, "grpo (rollouts + rewards) or sft (cross-entropy on completions)"),
    OPT("output_dir", OPT_STR, output_dir, G_DATA, "folder for checkpoints and metrics.jsonl (created with its parents)"),
    OPT("overwrite_output_dir", OPT_BOOL, overwrite_output_dir, G_DATA,
        "delete an earlier run's metrics.jsonl and checkpoint-N folders in output_dir before starting; without it, "
        "an output_dir that holds them is refused unless resume continues that run"),
    OPT("chat_template", OPT_STR, chat_template, G_DATA,
        "force a chat template family (chatml, qwen3, llama3, llama3.1, llama2, mistral, mistral-v1, zephyr); "
        "none: recognised from tokenizer_config.json"),
    OPT("max_prompt_length", OPT_INT, max_prompt_length, G_DATA, "longest prompt in tokens; 0 = no limit"),
    ENUM("overlong_prompts", overlong_prompts, overlong_name, 0, G_DATA,
         "a prompt over max_prompt_length is skipped (and counted in the log) or an error"),
    OPT("shuffle_dataset", OPT_BOOL, shuffle_dataset, G_DATA, "shuffle each rank's shard every epoch"),
    NULLABLE("data_seed", OPT_LONG, data_seed, -1, G_DATA, "seed of the data order; -1 (null) = seed"),

    GRPO("num_generations", OPT_INT, num_generations, G_GEN, "completions per prompt (group size, >= 2)"),
    GRPO("max_completion_length", OPT_INT, max_completion_length, G_GEN, "most tokens generated per completion"),
    OPT("temperature", OPT_F64, temperature, G_GEN, "sampling temperature (also divides the logits in the loss)"),
    OPT("top_p", OPT_F64, top_p, G_GEN, "nucleus sampling mass in (0, 1]; 1 = off"),
    OPT("top_k", OPT_INT, top_k, G_GEN, "sample among the k most likely tokens; 0 = off"),
    NULLABLE("min_p", OPT_F64, min_p, 0, G_GEN, "drop tokens below min_p times the top probability; 0 (null) = off"),
    OPT("repetition_penalty", OPT_F64, repetition_penalty, G_GEN, "penalty on tokens already present; 1 = off"),
    OPT("generation_batch_size", OPT_INT, generation_batch_size, G_GEN,
        "completions per generation round over all ranks; 0 = per_device_train_batch_size x ranks x "
        "steps_per_generation"),
    OPT("steps_per_generation", OPT_INT, steps_per_generation, G_GEN,
        "micro-steps that share one generation round; 0 = gradient_accumulation_steps"),
    OPT("num_iterations", OPT_INT, num_iterations, G_GEN, "passes over each generation round (mu)"),
    OPT("max_staleness", OPT_INT, max_staleness, G_GEN, "asynchronous GRPO: the servers generate up to k rounds "
        "ahead of training, and a completion sampled more than k policy versions before the one it is trained at "
        "is dropped; 0 = synchronous"),

    GRPO("beta", OPT_F64, beta, G_GRPO, "k3 KL coefficient to the frozen reference; 0 = no reference model"),
    GRPO("epsilon", OPT_F64, epsilon, G_GRPO, "lower clip range of the ratio"),
    GRPO_OPT("epsilon_high", epsilon_high, G_GRPO, "upper clip range; none = epsilon (DAPO: 0.28)"),
    GRPO_OPT("delta", delta, G_GRPO, "two-sided clipping: upper bound of the ratio; none = off"),
    ENUM("loss_type", grpo.loss_type, loss_name, OPTF_GRPO, G_GRPO, "GRPO loss aggregation; an SFTConfig's \"nll\" "
         "(negative log-likelihood, the sft loss) is accepted in mode sft"),
    ENUM("scale_rewards", grpo.scale_rewards, scale_name, OPTF_GRPO, G_GRPO,
         "divide advantages by the std of the group, of the batch, or not (true = group, false = none)"),
    ENUM("multi_objective_aggregation", grpo.multi_objective_aggregation, agg_name, OPTF_GRPO, G_GRPO,
         "weighted sum of rewards then normalise, or normalise each then sum"),
    ENUM("importance_sampling_level", grpo.importance_sampling_level, level_name, OPTF_GRPO, G_GRPO,
         "ratio per token, or one per sequence (GSPO)"),
    GRPO("mask_truncated_completions", OPT_BOOL, mask_truncated_completions, G_GRPO,
         "leave completions that hit max_completion_length out of the loss"),
    {"reward_weights", OPT_F64LIST, F(reward_weights), F(n_reward_weights), NULL, 0, NULL, G_GRPO,
     "one weight per reward function (built-ins first, then the service's); none = all 1", 0},
    GRPO("top_entropy_quantile", OPT_F64, top_entropy_quantile, G_GRPO,
         "keep only the top quantile of tokens by entropy in the policy loss; 1 = all"),
    GRPO("sapo_temperature_neg", OPT_F64, sapo_temperature_neg, G_GRPO, "sapo gate temperature, advantage <= 0"),
    GRPO("sapo_temperature_pos", OPT_F64, sapo_temperature_pos, G_GRPO, "sapo gate temperature, advantage > 0"),
    GRPO("vespo_k_pos", OPT_F64, vespo_k_pos, G_GRPO, "vespo exponent k, positive advantages"),
    GRPO("vespo_lambda_pos", OPT_F64, vespo_lambda_pos, G_GRPO, "vespo decay lambda, positive advantages"),
    GRPO("vespo_k_neg", OPT_F64, vespo_k_neg, G_GRPO, "vespo exponent k, negative advantages"),
    GRPO("vespo_lambda_neg", OPT_F64, vespo_lambda_neg, G_GRPO, "vespo decay lambda, negative advantages"),
    GRPO("vllm_importance_sampling_correction", OPT_BOOL, vllm_importance_sampling_correction, G_GRPO,
         "correct for the rollout server's logprobs differing from the trainer's"),
    ENUM("vllm_importance_sampling_mode", grpo.vllm_importance_sampling_mode, is_mode_name, OPTF_GRPO, G_GRPO,
         "how that correction bounds the ratio"),
    GRPO_OPT("vllm_importance_sampling_clip_max", vllm_importance_sampling_clip_max, G_GRPO,
             "upper bound C_max of the correction ratio"),
    GRPO_OPT("vllm_importance_sampling_clip_min", vllm_importance_sampling_clip_min, G_GRPO,
             "lower bound C_min of the correction ratio"),
    {"vllm_importance_sampling_cap", OPT_OPT_F64, 0, 0, NULL, OPTF_GRPO | OPTF_NO_VALUE, NULL, G_GRPO,
     "deprecated spelling of vllm_importance_sampling_clip_max (wins over it, as in TRL)", 0},
    GRPO_OPT("off_policy_mask_threshold", off_policy_mask_threshold, G_GRPO,
             "mask sequences with negative advantage and KL above this; none = off"),
    GRPO("use_bias_correction_kl", OPT_BOOL, use_bias_correction_kl, G_GRPO,
         "multiply the KL term by the importance ratio (unbiased reverse-KL gradient)"),
    GRPO("entropy_coef", OPT_F64, entropy_coef, G_GRPO, "entropy bonus coefficient; 0 = off"),
    GRPO("use_adaptive_entropy", OPT_BOOL, use_adaptive_entropy, G_GRPO, "adapt entropy_coef toward entropy_target"),
    GRPO("entropy_coef_min", OPT_F64, entropy_coef_min, G_GRPO, "lower bound of the adaptive coefficient"),
    GRPO("entropy_coef_max", OPT_F64, entropy_coef_max, G_GRPO, "upper bound of the adaptive coefficient"),
    GRPO("entropy_coef_delta", OPT_F64, entropy_coef_delta, G_GRPO, "adaptive coefficient step"),
    GRPO("entropy_target", OPT_F64, entropy_target, G_GRPO, "adaptive control's target entropy (nats)"),

    {"rewards", OPT_STRLIST, F(rewards), F(n_rewards), NULL, 0, NULL, G_RWD,
     "built-in rewards: answer_match, regex_format, think_format, length_penalty, soft_overlong", 0},
    OPT("answer_column", OPT_STR, answer_column, G_RWD, "dataset column answer_match compares with"),
    OPT("format_regex", OPT_STR, format_regex, G_RWD, "PCRE2 pattern of regex_format"),
    ENUM("format_regex_mode", format_regex_mode, regex_mode_name, 0, G_RWD,
         "full: the whole completion must match; search: a match anywhere"),
    OPT("soft_punish_cache", OPT_INT, soft_punish_cache, G_RWD,
        "soft_overlong's L_cache: tokens before max_completion_length where the penalty ramps to -1"),
    OPT("length_penalty_coef", OPT_F64, length_penalty_coef, G_RWD, "length_penalty at max_completion_length"),
    OPT("length_penalty_target", OPT_INT, length_penalty_target, G_RWD, "completion length with no penalty"),
    OPT("reward_url", OPT_STR, reward_url, G_RWD, "external reward service, http://host:port/path"),
    OPT("reward_timeout", OPT_F64, reward_timeout, G_RWD, "seconds for the service to answer one batch"),
    OPT("reward_connect_timeout", OPT_F64, reward_connect_timeout, G_RWD, "seconds to connect to the service"),
    OPT("reward_retries", OPT_INT, reward_retries, G_RWD, "retries after a failed service call"),
    OPT("reward_backoff", OPT_F64, reward_backoff, G_RWD, "seconds before the first retry, doubled each time"),
    OPT("reward_max_response_mb", OPT_INT, reward_max_response_mb, G_RWD,
        "largest answer read from the service, MiB; a larger one is refused"),

    {"tools", OPT_STRLIST, F(tools), F(n_tools), NULL, 0, NULL, G_TOOLS,
     "built-in tools for multi-turn rollouts: calculator, lookup; none = single-turn GRPO", 0},
    OPT("tool_lookup_file", OPT_STR, tool_lookup_file, G_TOOLS, "JSON object file: the lookup tool's key -> value"),
    OPT("tool_call_format", OPT_STR, tool_call_format, G_TOOLS,
        "hermes, llama3 or mistral; unset = the chat template's (chatml/qwen3: hermes, llama3.1, mistral)"),
    NULLABLE("max_tool_calling_iterations", OPT_INT, max_tool_calling_iterations, -1, G_TOOLS,
             "most tool turns per rollout; -1 (null) = no limit (TRL's None)"),
    OPT("env_url", OPT_STR, env_url, G_TOOLS,
        "environment service http://host:port[/prefix] (docs/environments.md), instead of tools; its rewards are "
        "the reward function 'environment'"),
    OPT("env_timeout", OPT_F64, env_timeout, G_TOOLS, "seconds for the environment service to answer one call"),
    OPT("env_connect_timeout", OPT_F64, env_connect_timeout, G_TOOLS, "seconds to connect to it"),
    OPT("env_retries", OPT_INT, env_retries, G_TOOLS, "retries after a failed environment call"),
    OPT("env_backoff", OPT_F64, env_backoff, G_TOOLS, "seconds before the first retry, doubled each time"),

    OPT("learning_rate", OPT_F64, learning_rate, G_OPT, "peak learning rate of AdamW"),
    ENUM("lr_scheduler_type", lr_scheduler_type, sched_name, 0, G_OPT,
         "schedule after warmup (transformers' get_scheduler)"),
    OPT("warmup_steps", OPT_F64, warmup_steps, G_OPT, "warmup length: steps when >= 1, ratio of the total when < 1"),
    OPT("warmup_ratio", OPT_F64, warmup_ratio, G_OPT, "warmup as a ratio of the total steps (when warmup_steps = 0)"),
    OPT("weight_decay", OPT_F64, weight_decay, G_OPT, "AdamW decoupled weight decay"),
    OPT("adam_beta1", OPT_F64, adam_beta1, G_OPT, "AdamW beta1"),
    OPT("adam_beta2", OPT_F64, adam_beta2, G_OPT, "AdamW beta2"),
    OPT("adam_epsilon", OPT_F64, adam_epsilon, G_OPT, "AdamW epsilon"),
    OPT("max_grad_norm", OPT_F64, max_grad_norm, G_OPT, "clip the global gradient norm; 0 = off"),
    OPT("optim", OPT_STR, optim, G_OPT, "optimizer; AdamW only (any adamw_* name)"),
    OPT("per_device_train_batch_size", OPT_INT, per_device_train_batch_size, G_OPT,
        "completions (grpo) or sequences (sft) per rank per micro-step"),
    OPT("gradient_accumulation_steps", OPT_INT, gradient_accumulation_steps, G_OPT,
        "micro-steps per optimizer step"),
    OPT("max_steps", OPT_LONG, max_steps, G_OPT, "optimizer steps; -1 = num_train_epochs"),
    OPT("num_train_epochs", OPT_F64, num_train_epochs, G_OPT, "passes over the dataset when max_steps = -1"),
    OPT("seed", OPT_LONG, seed, G_OPT, "seed of sampling and data order"),
    OPT("gradient_checkpointing", OPT_BOOL, gradient_checkpointing, G_OPT,
        "recompute activations in backward instead of keeping them"),
    ALIAS("activation_checkpointing", "gradient_checkpointing"),
    OPT("keep_logits", OPT_BOOL, keep_logits, G_OPT,
        "keep the forward's lm_head logits (tokens x vocab, bf16) for the backward instead of recomputing them"),

    OPT("logging_steps", OPT_INT, logging_steps, G_LOG, "log a line and a metrics.jsonl record every k steps"),
    OPT("log_completions", OPT_BOOL, log_completions, G_LOG, "grpo: rank 0 writes each completion it trains on at "
        "a logged step to OUTPUT_DIR/completions.jsonl (ids, version, staleness, advantage, the servers' and the "
        "old logprobs, the importance-sampling ratio)"),
    OPT("logging_first_step", OPT_BOOL, logging_first_step, G_LOG, "also log the first step"),
    ENUM("save_strategy", save_strategy, save_strategy_name, 0, G_LOG, "steps: a checkpoint every save_steps steps; "
         "epoch: at the end of each pass over the data; no: none but the final one (the model TRL's "
         "trainer.save_model() would write); best is refused (it needs evaluation). The final step is always saved"),
    OPT("save_steps", OPT_INT, save_steps, G_LOG, "checkpoint every k steps (save_strategy steps); 0 = only at the "
        "end"),
    NULLABLE("save_total_limit", OPT_INT, save_total_limit, 0, G_LOG, "keep the last k checkpoints; 0 (null) = all"),
    OPT("resume", OPT_STR, resume, G_LOG,
        "checkpoint folder to resume from, \"latest\" in output_dir, or \"auto\": latest when output_dir has a "
        "complete checkpoint, else start at step 0 (for runs a scheduler restarts)"),
    ALIAS("resume_from_checkpoint", "resume"),

    OPT("zero_stage", OPT_INT, zero_stage, G_DIST, "ZeRO stage: 1 (optimizer), 2 (+ gradients), 3 (+ parameters)"),
    ENUM("sharding_strategy", sharding_strategy, sharding_name, 0, G_DIST, "full_shard: ZeRO state partitioned "
         "over every rank; hybrid_shard (HSDP): partitioned over each node's ranks, replicated across nodes, so "
         "forward/backward collectives stay inside the node (grpo: weight sync over ZeroMQ)"),
    OPT("zero_hpz_partition_size", OPT_INT, zero_hpz_partition_size, G_DIST, "ZeRO++ hpZ (zero_stage 3): the "
        "parameters that forward/backward gather are partitioned over this many ranks, the ranks per node "
        "(LOCAL_WORLD_SIZE), so those gathers stay inside the node; master, Adam and gradients stay over every "
        "rank; 1 = off (grpo: weight sync over ZeroMQ)"),
    OPT("overlap_comm", OPT_BOOL, overlap_comm, G_DIST, "DeepSpeed's name: ZeRO collectives overlap compute "
        "(the next unit's all-gather prefetched during this one's compute, each gradient reduce-scatter finished "
        "while the next backward runs); false serialises them (the same results, to measure what overlap hides)"),
    ENUM("device", device, device_name, 0, G_DIST, "compute backend; auto = cuda when a GPU is present"),
    OPT("init_timeout", OPT_F64, init_timeout, G_DIST, "seconds for every rank to join the rendezvous"),
    OPT("comm_timeout", OPT_F64, comm_timeout, G_DIST, "seconds one collective may take before it fails"),
    {"rollout_servers", OPT_CSV, F(rollout_servers), 0, NULL, 0, NULL, G_DIST,
     "rollout servers' control sockets, tcp://host:port, comma-separated [grpo: required]", 0},
    OPT("rollout_timeout", OPT_F64, rollout_timeout, G_DIST, "seconds before a generation request moves to "
        "another server"),
    OPT("control_server_key", OPT_STR, control_server_key, G_DIST, "file with the rollout servers' CURVE public "
        "key (tandem-train keygen DIR: DIR/server.pub); with control_client_key, the control sockets authenticate; "
        "unset: env TANDEM_CONTROL_SERVER_KEY"),
    OPT("control_client_key", OPT_STR, control_client_key, G_DIST, "file with this trainer's CURVE key pair "
        "(DIR/client.key), whose public key the servers' --control-authorized-keys lists; unset: env "
        "TANDEM_CONTROL_CLIENT_KEY"),
    OPT("weight_sync_steps", OPT_INT, weight_sync_steps, G_DIST, "push weights to the servers every k steps"),
    ENUM("weight_sync_transport", weight_sync_transport, sync_name, 0, G_DIST,
         "nccl (GPUs; CPU ranks: its CPU twin over the host communicator), zmq (frames over the control socket), "
         "ipc (ranks and servers on one host: each rank copies its slices straight into the servers' staging, "
         "mapped with CUDA IPC or, on the CPU, shared memory; full weights only); auto = nccl on cuda, then ipc "
         "(same host) or zmq where nccl cannot reach a server"),

    OPT("use_peft", OPT_BOOL, use_peft, G_LORA, "train LoRA adapters on a frozen base (sft, grpo); checkpoints are "
        "PEFT adapter folders"),
    OPT("lora_r", OPT_INT, lora_r, G_LORA, "adapter rank"),
    OPT("lora_alpha", OPT_F64, lora_alpha, G_LORA, "adapter scale numerator: scale = lora_alpha / lora_r"),
    OPT("lora_dropout", OPT_F64, lora_dropout, G_LORA, "dropout on each adapter's input, in [0, 1); masks seeded by "
        "seed, step, micro-batch and rank"),
    OPT("lora_target_modules", OPT_CSV, lora_target_modules, G_LORA, "projections given adapters: q_proj, k_proj, "
        "v_proj, o_proj, gate_proj, up_proj, down_proj, or all-linear"),
    OPT("use_rslora", OPT_BOOL, use_rslora, G_LORA, "rank-stabilised scale lora_alpha / sqrt(lora_r)"),
    OPT("lora_init", OPT_STR, lora_init, G_LORA, "adapter init: default (A kaiming-uniform, B zero) or gaussian "
        "(A normal(0, 1/r), B zero), as PEFT's init_lora_weights"),
    OPT("lora_save_merged", OPT_BOOL, lora_save_merged, G_LORA, "checkpoints also hold the base with the adapters "
        "merged in (PEFT's merge_and_unload) as a Hugging Face folder, checkpoint-N/merged, for transformers and "
        "tandem-serve"),
    ENUM("lora_sync", lora_sync, lora_sync_name, 0, G_LORA, "grpo: what each weight push sends the rollout servers: "
         "adapter (the A and B matrices alone, over weight_sync_transport: bf16 units from the rank that holds each "
         "layer over NCCL, the masters from rank 0 over ZeroMQ; the servers merge them or run them beside their base "
         "weights) or merged (the base with the adapters merged in, whole weights over weight_sync_transport)"),
    NULLABLE("max_length", OPT_INT, max_length, 0, G_SFT, "sequences (prompt + completion) are cut to this many "
             "tokens, and a row left with no token to learn is skipped as TRL drops it (counted in metrics.jsonl's "
             "prompts_skipped); 0 (null) = no cut"),
    ENUM("truncation_mode", truncation_mode, truncation_name, 0, G_SFT,
         "which end of a sequence over max_length is kept"),
    NULLABLE("completion_only_loss", OPT_BOOL, completion_only_loss, -1, G_SFT, "prompt/completion rows: the loss "
             "is on the completion tokens only (true, or none), or on every token (false)"),
    OPT("dataset_text_field", OPT_STR, dataset_text_field, G_SFT, "column of language-modelling rows (a row with "
        "this column and no prompt/messages): the loss is on every token, EOS appended as TRL does"),
};
const size_t train_options_count = sizeof train_options / sizeof train_options[0];

void train_config_default(TrainConfig *c) {
    memset(c, 0, sizeof *c);
    c->mode = TRAIN_MODE_GRPO;
    c->output_dir = strdup("output");
    c->max_prompt_length = 512;
    c->overlong_prompts = OVERLONG_PROMPTS_SKIP;
    c->shuffle_dataset = 1;
    c->data_seed = -1;
    c->temperature = 1.0, c->top_p = 1.0, c->top_k = 0, c->min_p = 0.0, c->repetition_penalty = 1.0;
    c->num_iterations = 1;
    grpo_options_default(&c->grpo);
    c->answer_column = strdup("answer");
    c->format_regex_mode = FORMAT_REGEX_FULL;
    c->length_penalty_coef = 1.0;
    c->reward_timeout = 60.0, c->reward_connect_timeout = 10.0, c->reward_retries = 3, c->reward_backoff = 1.0;
    c->reward_max_response_mb = 64;
    c->max_tool_calling_iterations = -1;
    c->env_timeout = 60.0, c->env_connect_timeout = 10.0, c->env_retries = 3, c->env_backoff = 1.0;
    c->learning_rate = 1e-6, c->weight_decay = 0.0, c->adam_beta1 = 0.9, c->adam_beta2 = 0.999;
    c->adam_epsilon = 1e-8, c->max_grad_norm = 1.0;
    c->lr_scheduler_type = LR_SCHED_LINEAR;
    c->per_device_train_batch_size = 8, c->gradient_accumulation_steps = 1;
    c->max_steps = -1, c->num_train_epochs = 3.0, c->seed = 42, c->gradient_checkpointing = 1;
    c->keep_logits = 1;
    c->optim = strdup("adamw_torch");
    c->logging_steps = 10, c->save_steps = 500, c->save_total_limit = 0;
    c->zero_stage = 3, c->device = TRAIN_DEVICE_AUTO, c->zero_hpz_partition_size = 1;
    c->overlap_comm = 1;
    c->init_timeout = 300.0, c->comm_timeout = 600.0, c->rollout_timeout = 600.0;
    c->weight_sync_steps = 1, c->weight_sync_transport = WEIGHT_SYNC_AUTO;
    c->lora_r = 16, c->lora_alpha = 32, c->lora_dropout = 0.05;
    c->lora_target_modules = strdup("q_proj,v_proj"), c->lora_init = strdup("default");
    c->max_length = 1024, c->truncation_mode = TRUNCATION_KEEP_START, c->completion_only_loss = -1;
    c->dataset_text_field = strdup("text");
}

void train_config_free(TrainConfig *c) {
    if (!c) return;
    for (size_t i = 0; i < train_options_count; i++) {
        const OptionSpec *o = &train_options[i];
        if (o->flags & (OPTF_ALIAS | OPTF_NO_VALUE)) continue;
        char *base = (char *)c;
        if (o->type == OPT_STR || o->type == OPT_CSV || o->type == OPT_F64LIST) {
            free(*(void **)(base + o->off));
        } else if (o->type == OPT_STRLIST) {
            char **l = *(char ***)(base + o->off);
            size_t n = *(size_t *)(base + o->aux_off);
            for (size_t k = 0; k < n; k++) free(l[k]);
            free(l);
        }
    }
    for (size_t k = 0; k < c->n_ignored; k++) free(c->ignored[k]);
    free(c->ignored);
    memset(c, 0, sizeof *c);
}

const OptionSpec *train_option_find(const char *key) {
    for (size_t i = 0; i < train_options_count; i++)
        if (strcmp(train_options[i].key, key) == 0) {
            const OptionSpec *o = &train_options[i];
            return (o->flags & OPTF_ALIAS) ? train_option_find(o->alias_of) : o;
        }
    return NULL;
}

const char *train_option_type_name(const OptionSpec *o) {
    if (o->flags & OPTF_NULLABLE) {
        switch (o->type) {
        case OPT_INT: case OPT_LONG: return "INT|none";
        case OPT_F64: return "FLOAT|none";
        case OPT_BOOL: return "BOOL|none";
        default: break;
        }
    }
    switch (o->type) {
    case OPT_INT: case OPT_LONG: return "INT";
    case OPT_F64: return "FLOAT";
    case OPT_OPT_F64: return "FLOAT|none";
    case OPT_BOOL: return "BOOL";
    case OPT_STR: return "TEXT";
    case OPT_ENUM: return "CHOICE";
    case OPT_STRLIST: return "LIST";
    case OPT_F64LIST: return "FLOATS";
    case OPT_CSV: return "LIST";
    }
    return "?";
}

// The shortest form that reads back exactly, as a person writes it: %.17g would print 1e-06 as
// 9.9999999999999995e-07, and the shortest %g alone prints 60 as 6e+01. Exponents are kept only for magnitudes
// people write that way (below 1e-4, 1e16 and above).
static void fmt_double(double v, char *buf, size_t cap) {
    const double mag = fabs(v);
    const int exponent_ok = mag != 0 && (mag < 1e-4 || mag >= 1e16);
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, cap, "%.*g", p, v);
        if (strtod(buf, NULL) == v && (exponent_ok || !strchr(buf, 'e'))) return;
    }
}

void train_option_format(const TrainConfig *c, const OptionSpec *o, char *buf, size_t cap) {
    const char *base = (const char *)c;
    if (o->flags & OPTF_NO_VALUE) {
        snprintf(buf, cap, "none");
        return;
    }
    switch (o->type) {
    case OPT_INT: snprintf(buf, cap, "%d", *(const int *)(base + o->off)); break;
    case OPT_LONG: snprintf(buf, cap, "%ld", *(const long *)(base + o->off)); break;
    case OPT_F64: fmt_double(*(const double *)(base + o->off), buf, cap); break;
    case OPT_OPT_F64:
        if (*(const int *)(base + o->aux_off)) fmt_double(*(const double *)(base + o->off), buf, cap);
        else snprintf(buf, cap, "none");
        break;
    case OPT_BOOL: {
        const int b = *(const int *)(base + o->off);
        snprintf(buf, cap, "%s", b < 0 ? "none" : b ? "true" : "false");
        break;
    }
    case OPT_ENUM: {
        const char *n = o->choice(*(const int *)(base + o->off));
        snprintf(buf, cap, "%s", n ? n : "?");
        break;
    }
    case OPT_STR:
    case OPT_CSV: {
        const char *s = *(char *const *)(base + o->off);
        snprintf(buf, cap, "%s", s ? s : "none");
        break;
    }
    case OPT_STRLIST: {
        char *const *l = *(char **const *)(base + o->off);
        size_t n = *(const size_t *)(base + o->aux_off), used = 0;
        buf[0] = '\0';
        for (size_t k = 0; k < n && used < cap; k++)
            used += (size_t)snprintf(buf + used, cap - used, "%s%s", k ? "," : "", l[k]);
        if (n == 0) snprintf(buf, cap, "none");
        break;
    }
    case OPT_F64LIST: {
        const double *l = *(double *const *)(base + o->off);
        size_t n = *(const size_t *)(base + o->aux_off), used = 0;
        if (!l) {
            snprintf(buf, cap, "none");
            break;
        }
        buf[0] = '\0';
        for (size_t k = 0; k < n && used < cap; k++) {
            char num[32];
            fmt_double(l[k], num, sizeof num);
            used += (size_t)snprintf(buf + used, cap - used, "%s%s", k ? "," : "", num);
        }
        break;
    }
    }
}

static void flag_of(const char *key, char *buf, size_t cap) {
    snprintf(buf, cap, "--%s", key);
    for (char *p = buf + 2; *p; p++)
        if (*p == '_') *p = '-';
}

// "a|b|c" for an enum's choices.
static void choices_of(const OptionSpec *o, char *buf, size_t cap) {
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; o->choice(i) && used < cap; i++)
        used += (size_t)snprintf(buf + used, cap - used, "%s%s", i ? "|" : "", o->choice(i));
}

void train_config_print_help(FILE *f) {
    TrainConfig d;
    train_config_default(&d);
    fprintf(f, "usage: tandem-train --model DIR --train-file FILE.jsonl [--config FILE.json] [options]\n"
               "Options (file key = flag with '_' for '-'; flags override the file):\n");
    const char *group = NULL;
    for (size_t i = 0; i < train_options_count; i++) {
        const OptionSpec *o = &train_options[i];
        if (o->flags & OPTF_ALIAS) continue;
        if (!group || strcmp(group, o->group) != 0) {
            group = o->group;
            fprintf(f, "\n%s:\n", group);
        }
        char flag[96], type[160], def[512];
        flag_of(o->key, flag, sizeof flag);
        if (o->type == OPT_ENUM) choices_of(o, type, sizeof type);
        else snprintf(type, sizeof type, "%s", train_option_type_name(o));
        train_option_format(&d, o, def, sizeof def);
        fprintf(f, "  %s %s  (default: %s)\n      %s\n", flag, type, def, o->help);
    }
    fprintf(f, "\nAlso accepted: --activation-checkpointing (= --gradient-checkpointing), "
               "--resume-from-checkpoint (= --resume).\n");
    train_config_free(&d);
}

// Markdown cell text: '|' escaped.
static void md_cell(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '|') fputs("\\|", f);
        else fputc(*s, f);
    }
}

void train_config_print_markdown(FILE *f) {
    TrainConfig d;
    train_config_default(&d);
    const char *group = NULL;
    for (size_t i = 0; i < train_options_count; i++) {
        const OptionSpec *o = &train_options[i];
        if (o->flags & OPTF_ALIAS) continue;
        if (!group || strcmp(group, o->group) != 0) {
            group = o->group;
            fprintf(f, "%s### %s\n\n| file key | flag | type | default | description |\n|---|---|---|---|---|\n",
                    i ? "\n" : "", group);
        }
        char flag[96], type[160], def[512];
        flag_of(o->key, flag, sizeof flag);
        if (o->type == OPT_ENUM) choices_of(o, type, sizeof type);
        else snprintf(type, sizeof type, "%s", train_option_type_name(o));
        train_option_format(&d, o, def, sizeof def);
        if (o->flags & OPTF_FLAG_ONLY) fprintf(f, "| — | `%s` | ", flag);  // no file key
        else fprintf(f, "| `%s` | `%s` | ", o->key, flag);
        md_cell(f, type);
        fputs(" | `", f);
        md_cell(f, def);
        fputs("` | ", f);
        md_cell(f, o->help);
        fputs(" |\n", f);
    }
    train_config_free(&d);
}

char *train_config_to_json(const TrainConfig *c) {
    json_t *root = json_object();
    if (!root) return NULL;
    const char *base = (const char *)c;
    for (size_t i = 0; i < train_options_count; i++) {
        const OptionSpec *o = &train_options[i];
        if (o->flags & (OPTF_ALIAS | OPTF_NO_VALUE | OPTF_FLAG_ONLY)) continue;
        json_t *v = NULL;
        switch (o->type) {
        case OPT_INT: v = json_integer(*(const int *)(base + o->off)); break;
        case OPT_LONG: v = json_integer(*(const long *)(base + o->off)); break;
        case OPT_F64: v = json_real(*(const double *)(base + o->off)); break;
        case OPT_OPT_F64:
            v = *(const int *)(base + o->aux_off) ? json_real(*(const double *)(base + o->off)) : json_null();
            break;
        case OPT_BOOL: {
            const int b = *(const int *)(base + o->off);
            v = b < 0 ? json_null() : json_boolean(b);
            break;
        }
        case OPT_ENUM: v = json_string(o->choice(*(const int *)(base + o->off))); break;
        case OPT_STR:
        case OPT_CSV: {
            const char *s = *(char *const *)(base + o->off);
            v = s ? json_string(s) : json_null();
            break;
        }
        case OPT_STRLIST: {
            char *const *l = *(char **const *)(base + o->off);
            size_t n = *(const size_t *)(base + o->aux_off);
            v = json_array();
            for (size_t k = 0; v && k < n; k++) json_array_append_new(v, json_string(l[k]));
            break;
        }
        case OPT_F64LIST: {
            const double *l = *(double *const *)(base + o->off);
            size_t n = *(const size_t *)(base + o->aux_off);
            v = l ? json_array() : json_null();
            for (size_t k = 0; l && v && k < n; k++) json_array_append_new(v, json_real(l[k]));
            break;
        }
        }
        if (!v || json_object_set_new(root, o->key, v) != 0) {
            json_decref(root);
            return NULL;
        }
    }
    char *txt = json_dumps(root, JSON_INDENT(2) | JSON_REAL_PRECISION(17));
    json_decref(root);
    return txt;
}
