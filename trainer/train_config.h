// trainer/train_config.h — every option of tandem-train: defaults, --kebab-case flags, a JSON config file
// with TRL's snake_case keys, validation, and the help table (docs/configuration.md is generated from it).
//
// Sources, later wins: defaults < the JSON file (--config FILE) < command-line flags, whatever their order
// on the command line. Every option has one name: snake_case in the file (TRL's GRPOConfig name where TRL
// has the option) and --kebab-case as a flag (--snake_case is accepted too, as TRL's CLI spells them).
// Flag values: "--key value" or "--key=value"; a boolean flag alone means true and takes an explicit
// true/false/1/0/yes/no; lists are comma-separated; "none" clears an option that may be unset.
// Refused before any work starts, the message naming the key: an unknown key or flag (with a did-you-mean
// suggestion when a known one is close), a value of the wrong type, a value out of range, and the
// cross-option rules of train_config_finalize; every problem of a file (and of the flags) is reported in one
// message, a line each. A whole TRL GRPOConfig / SFTConfig dump (to_json_string) loads: every TRL key that is not
// a tandem option has a fate in train_config_trl.c (no effect: any value; or only the values tandem implements,
// TRL's default among them, anything else refused naming the key and what to do); TrainConfig.ignored lists the
// TRL keys accepted that way, for the one start-up log line. JSON null is TRL's None for the options that have it.
#ifndef TANDEM_TRAINER_TRAIN_CONFIG_H
#define TANDEM_TRAINER_TRAIN_CONFIG_H

#include <stddef.h>
#include <stdio.h>

#include "trainer/grpo_loss.h"
#include "trainer/lr_schedule.h"
#include "trainer/reward_service.h"
#include "trainer/rewards.h"

typedef enum { TRAIN_MODE_GRPO = 0, TRAIN_MODE_SFT } TrainMode;
typedef enum { TRAIN_DEVICE_AUTO = 0, TRAIN_DEVICE_CPU, TRAIN_DEVICE_CUDA } TrainDevice;
// PyTorch FSDP's ShardingStrategy names: FULL_SHARD = ZeRO over every rank, HYBRID_SHARD = HSDP (ZeRO within each
// node, replicas across nodes; trainer/zero3.h).
typedef enum { SHARDING_FULL_SHARD = 0, SHARDING_HYBRID_SHARD } ShardingStrategy;
typedef enum { OVERLONG_PROMPTS_SKIP = 0, OVERLONG_PROMPTS_ERROR } OverlongPrompts;
typedef enum { FORMAT_REGEX_FULL = 0, FORMAT_REGEX_SEARCH } FormatRegexMode;
typedef enum { WEIGHT_SYNC_AUTO = 0, WEIGHT_SYNC_NCCL, WEIGHT_SYNC_ZMQ, WEIGHT_SYNC_IPC } WeightSyncTransport;
typedef enum { LORA_SYNC_ADAPTER = 0, LORA_SYNC_MERGED } LoraSync;
typedef enum { TRUNCATION_KEEP_START = 0, TRUNCATION_KEEP_END } TruncationMode;
// TRL's (transformers') SaveStrategy: every save_steps, at each epoch's end, none but the final checkpoint; "best"
// needs evaluation and is refused.
typedef enum { SAVE_STRATEGY_STEPS = 0, SAVE_STRATEGY_EPOCH, SAVE_STRATEGY_NO, SAVE_STRATEGY_BEST } SaveStrategy;

typedef struct {
    // ---- model, data, output ----
    char *model;                    // Hugging Face model folder (required)
    char *train_file;               // JSONL file or folder of *.jsonl shards (required)
    TrainMode mode;                 // grpo | sft
    char *output_dir;               // checkpoints, metrics.jsonl
    int overwrite_output_dir;       // 1: an earlier run's files in output_dir are deleted first (else refused)
    char *chat_template;            // forced template family (NULL: recognised from the tokenizer)
    int max_prompt_length;          // tokens; 0 = no limit
    OverlongPrompts overlong_prompts;
    int shuffle_dataset;
    long data_seed;                 // -1: use seed
    // ---- sft (TRL SFTConfig's names) ----
    int max_length;                 // tokens of prompt + completion kept; 0 = no truncation (TRL's None)
    TruncationMode truncation_mode; // which end max_length keeps
    int completion_only_loss;       // -1 (TRL's None) / 1: prompt/completion rows train on the completion only; 0: all
    char *dataset_text_field;       // column of language-modelling rows (loss on every token)
    int loss_type_nll;              // loss_type "nll" was given (SFTConfig's loss; refused in grpo mode)
    // ---- generation (num_generations and max_completion_length live in grpo) ----
    double temperature, top_p, min_p, repetition_penalty;
    int top_k;                      // 0 = off
    int generation_batch_size;      // completions per generation round, all ranks (0: derived)
    int steps_per_generation;       // optimizer micro-steps per generation round (0: derived)
    int num_iterations;
    int max_staleness;              // rounds generated ahead of training, and the versions a sample may lag (0: sync)
    // ---- GRPO loss and advantages (TRL's GRPOConfig keys; see trainer/grpo_loss.h) ----
    GrpoOptions grpo;
    double *reward_weights;         // (n_reward_weights) or NULL = every reward weighs 1
    size_t n_reward_weights;
    // ---- rewards ----
    char **rewards;                 // built-in reward names (trainer/rewards.h), in order
    size_t n_rewards;
    char *answer_column;
    char *format_regex;
    FormatRegexMode format_regex_mode;
    int soft_punish_cache;
    double length_penalty_coef;
    int length_penalty_target;
    char *reward_url;               // external reward service (NULL: none)
    double reward_timeout, reward_connect_timeout, reward_backoff;   // seconds
    int reward_retries;
    int reward_max_response_mb;     // largest reward-service answer read, MiB
    // ---- multi-turn tool use (docs/environments.md) ----
    char **tools;                   // built-in tools the policy may call (calculator, lookup); none: single turn
    size_t n_tools;
    char *tool_lookup_file;         // JSON object file: the lookup tool's table
    char *tool_call_format;         // hermes, llama3, mistral; NULL: from the chat template's family
    int max_tool_calling_iterations;    // TRL's name; -1: no limit (TRL's None)
    char *env_url;                  // environment service (trainer/env_service.h), instead of tools (NULL: none)
    double env_timeout, env_connect_timeout, env_backoff;   // seconds
    int env_retries;
    // ---- optimisation ----
    double learning_rate, weight_decay, adam_beta1, adam_beta2, adam_epsilon, max_grad_norm;
    LrSchedType lr_scheduler_type;
    double warmup_steps;            // >= 1: steps; (0, 1): ratio of the total steps
    double warmup_ratio;            // used when warmup_steps is 0
    int per_device_train_batch_size;     // completions (grpo) / sequences (sft) per rank per micro-step
    int gradient_accumulation_steps;
    long max_steps;                 // -1: from num_train_epochs
    double num_train_epochs;
    long seed;
    int gradient_checkpointing;
    int keep_logits;                // the forward's (tokens, vocab) logits kept for the backward (no recompute)
    char *optim;                    // adamw_* only (AdamW is the one optimizer)
    // ---- logging and checkpoints ----
    int logging_steps;
    int logging_first_step;         // also log step 1
    int log_completions;            // rank 0 writes the completions of logged steps to completions.jsonl
    SaveStrategy save_strategy;
    int save_steps;                 // 0: only at the end
    int save_total_limit;           // 0: keep every checkpoint
    char *resume;                   // checkpoint folder to resume from, "latest", or NULL
    // ---- distribution and serving ----
    int zero_stage;                 // 1 | 2 | 3
    ShardingStrategy sharding_strategy;
    int zero_hpz_partition_size;    // DeepSpeed ZeRO++ hpZ: 1 = off, else the ranks per node (LOCAL_WORLD_SIZE)
    int overlap_comm;               // DeepSpeed's overlap_comm: ZeRO prefetch and lazy reduce-scatters (1), or
                                    // collectives serialised with compute (0)
    TrainDevice device;
    double init_timeout;            // seconds: rendezvous (ranks arriving)
    double comm_timeout;            // seconds: one collective
    char *rollout_servers;          // comma-separated tcp://host:port list (grpo)
    double rollout_timeout;         // seconds before a request is retried on another server
    char *control_server_key;       // the servers' CURVE public key file (NULL: plain ZeroMQ)
    char *control_client_key;       // this trainer's CURVE key pair file (NULL: plain ZeroMQ)
    int weight_sync_steps;          // push weights every k optimizer steps
    WeightSyncTransport weight_sync_transport;
    // ---- LoRA (TRL ModelConfig / PEFT LoraConfig names; trainer/lora_train.h) ----
    int use_peft, lora_r, use_rslora, lora_save_merged;
    LoraSync lora_sync;             // grpo: what reaches the rollout servers, the adapters or the merged weights
    double lora_alpha, lora_dropout;
    char *lora_target_modules;      // comma-separated PEFT module names, or all-linear
    char *lora_init;                // default | gaussian (PEFT's init_lora_weights)
    // ---- derived by train_config_finalize (not options) ----
    int world_size;
    int resolved_steps_per_generation;   // steps_per_generation, or gradient_accumulation_steps when 0
    int resolved_generation_batch_size;  // completions per generation round over all ranks
    // ---- bookkeeping ----
    char *config_file;              // the --config file read, or NULL
    char **ignored;                 // TRL keys accepted and ignored
    size_t n_ignored;
} TrainConfig;

// Every field at its default (strings NULL unless the table gives one). Free with train_config_free.
void train_config_default(TrainConfig *cfg);
void train_config_free(TrainConfig *cfg);

// What train_config_parse_args returns when the command line asks for text instead of a run.
enum {
    TRAIN_CONFIG_HELP = 1,     // --help or -h: print train_config_print_help
    TRAIN_CONFIG_VERSION = 2,  // --version: print the version
};
// argv[0] is the program name. Reads --config FILE first, then applies every other flag. Returns 0,
// TRAIN_CONFIG_HELP or TRAIN_CONFIG_VERSION (nothing else is checked), or a negative code with a message
// naming the key. Does not run the cross-option checks: call train_config_finalize.
// HSDP (sharding_strategy hybrid_shard) or hpZ (zero_hpz_partition_size > 1): rank r does not hold slice r of every
// unit as flat ZeRO does, which the nccl and ipc weight syncs send by.
static inline int train_config_hybrid_layout(const TrainConfig *c) {
    return c->sharding_strategy == SHARDING_HYBRID_SHARD || c->zero_hpz_partition_size > 1;
}
int train_config_parse_args(TrainConfig *cfg, int argc, char *const *argv, char *err, size_t err_len);
// Applies a JSON object's keys (the config file's content). path names the source in messages (may be NULL).
int train_config_apply_json(TrainConfig *cfg, const char *json_text, size_t len, const char *path, char *err,
                            size_t err_len);
int train_config_load_file(TrainConfig *cfg, const char *path, char *err, size_t err_len);
// Sets one option from text as a flag would (key in snake_case or kebab-case, without dashes).
int train_config_set(TrainConfig *cfg, const char *key, const char *value, char *err, size_t err_len);

// Checks every value and the rules between options, and resolves the derived ones for world_size ranks
// (the resolved_* fields; the options keep the values given): steps_per_generation (default
// gradient_accumulation_steps) and generation_batch_size (= per_device_train_batch_size * world_size *
// steps_per_generation; when given instead, it must be a multiple of per_device_train_batch_size *
// world_size and sets steps_per_generation), as GRPOConfig does; giving both is refused. Each rank
// generates whole groups, so per_device_train_batch_size * steps_per_generation must be a multiple of
// num_generations. Both given (as a TRL dump holds them, GRPOConfig having derived one from the other) is accepted
// when they agree for world_size ranks. Returns 0, or -1 with every problem found, a line each, each naming its key.
int train_config_finalize(TrainConfig *cfg, int world_size, char *err, size_t err_len);

// The adapters' configuration these options give (use_peft). 0, or -1 with a message naming the key.
struct LoraConfig;
int train_config_lora(const TrainConfig *cfg, struct LoraConfig *out, char *err, size_t err_len);

// Total optimizer steps: max_steps when > 0, else ceil(num_train_epochs * steps_per_epoch).
long train_config_total_steps(const TrainConfig *cfg, long steps_per_epoch);

// The options of the reward modules as this configuration sets them (strings point into cfg).
void train_config_reward_options(const TrainConfig *cfg, RewardOptions *ro);
void train_config_reward_service_options(const TrainConfig *cfg, RewardServiceOptions *so);

// The option table: one line per option with its flag, type, default and description.
void train_config_print_help(FILE *f);
// The same table as Markdown (docs/configuration.md's tables).
void train_config_print_markdown(FILE *f);
// The fate of every TRL key that is not an option, as Markdown (docs/configuration.md's "TRL keys" table).
void train_config_print_trl_markdown(FILE *f);
// Current values as a JSON object with the file keys (for logs and checkpoints). malloc'd text.
char *train_config_to_json(const TrainConfig *cfg);

#endif
