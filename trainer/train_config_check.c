// trainer/train_config_check.c — validation of a parsed configuration before any work starts, and the
// values derived from it (train_config_finalize; rules in train_config.h and docs/configuration.md).
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/model_lora.h"
#include "shared/tokenizer/chat_template.h"
#include "shared/tool_calls.h"
#include "trainer/http_client.h"
#include "trainer/reward_service.h"
#include "trainer/rewards.h"
#include "trainer/train_config_internal.h"

// Every check adds its problem to p: FAIL ends the check function (what follows depends on it), NEED goes on
// (the range checks are independent), so that one run lists every problem.
#define FAIL(...)                         \
    do {                                  \
        problems_add(p, __VA_ARGS__);     \
        return -1;                        \
    } while (0)

// Range helpers: each names the key and the value given.
#define NEED(cond, key, fmt, val)                                  \
    do {                                                           \
        if (!(cond)) problems_add(p, "%s: " fmt, key, val);        \
    } while (0)

static int check_servers(const char *list, Problems *p) {
    const char *s = list;
    while (*s) {
        const char *c = strchr(s, ',');
        size_t n = c ? (size_t)(c - s) : strlen(s);
        const char *colon = NULL;
        for (size_t k = 6; k < n; k++)
            if (s[k] == ':') colon = s + k;
        if (n < 8 || strncmp(s, "tcp://", 6) != 0 || !colon || colon == s + 6 || colon + 1 == s + n)
            FAIL("rollout_servers: '%.*s' is not tcp://host:port", (int)n, s);
        for (const char *d = colon + 1; d < s + n; d++)
            if (*d < '0' || *d > '9') FAIL("rollout_servers: '%.*s' has a bad port", (int)n, s);
        s += n + (c ? 1 : 0);
    }
    return 0;
}

static int check_model_and_data(const TrainConfig *c, Problems *p) {
    if (!c->model || !c->model[0]) FAIL("model: required (--model DIR, a Hugging Face model folder)");
    if (!c->train_file || !c->train_file[0]) FAIL("train_file: required (--train-file FILE.jsonl or a folder)");
    if (!c->output_dir || !c->output_dir[0]) FAIL("output_dir: must not be empty");
    if (c->overwrite_output_dir && c->resume && (strcmp(c->resume, "latest") == 0 || strcmp(c->resume, "auto") == 0))
        FAIL("overwrite_output_dir: it deletes the checkpoints of output_dir that resume %s continues from; "
             "give one of them", c->resume);
    NEED(c->max_prompt_length >= 0, "max_prompt_length", "must be >= 0 (0 = no limit), got %d", c->max_prompt_length);
    NEED(c->data_seed >= -1, "data_seed", "must be >= 0, or -1 for seed; got %ld", c->data_seed);
    if (c->chat_template) {
        ChatTemplate *ct = NULL;
        char terr[512];
        if (chat_template_create(&ct, NULL, c->chat_template, NULL, NULL, terr, sizeof terr) != 0)
            FAIL("chat_template: %s", terr);
        chat_template_free(ct);
    }
    return 0;
}

static int check_generation(const TrainConfig *c, Problems *p) {
    NEED(isfinite(c->temperature) && c->temperature > 0, "temperature", "must be > 0, got %g", c->temperature);
    NEED(c->top_p > 0 && c->top_p <= 1, "top_p", "must be in (0, 1], got %g", c->top_p);
    NEED(c->top_k >= 0, "top_k", "must be >= 0 (0 = off), got %d", c->top_k);
    NEED(c->min_p >= 0 && c->min_p <= 1, "min_p", "must be in [0, 1], got %g", c->min_p);
    NEED(isfinite(c->repetition_penalty) && c->repetition_penalty > 0, "repetition_penalty", "must be > 0, got %g",
         c->repetition_penalty);
    NEED(c->generation_batch_size >= 0, "generation_batch_size", "must be >= 0 (0 = derived), got %d",
         c->generation_batch_size);
    NEED(c->steps_per_generation >= 0, "steps_per_generation", "must be >= 0 (0 = derived), got %d",
         c->steps_per_generation);
    NEED(c->num_iterations >= 1, "num_iterations", "must be >= 1, got %d", c->num_iterations);
    NEED(c->max_staleness >= 0, "max_staleness", "must be >= 0 (0 = synchronous), got %d", c->max_staleness);
    return 0;
}

static int check_optimisation(const TrainConfig *c, Problems *p) {
    NEED(isfinite(c->learning_rate) && c->learning_rate >= 0, "learning_rate", "must be >= 0, got %g",
         c->learning_rate);
    NEED(isfinite(c->weight_decay) && c->weight_decay >= 0, "weight_decay", "must be >= 0, got %g", c->weight_decay);
    NEED(c->adam_beta1 >= 0 && c->adam_beta1 < 1, "adam_beta1", "must be in [0, 1), got %g", c->adam_beta1);
    NEED(c->adam_beta2 >= 0 && c->adam_beta2 < 1, "adam_beta2", "must be in [0, 1), got %g", c->adam_beta2);
    NEED(isfinite(c->adam_epsilon) && c->adam_epsilon >= 0, "adam_epsilon", "must be >= 0, got %g", c->adam_epsilon);
    NEED(isfinite(c->max_grad_norm) && c->max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 = no clipping), "
         "got %g", c->max_grad_norm);
    NEED(isfinite(c->warmup_steps) && c->warmup_steps >= 0, "warmup_steps", "must be >= 0, got %g", c->warmup_steps);
    NEED(c->warmup_ratio >= 0 && c->warmup_ratio <= 1, "warmup_ratio", "must be in [0, 1], got %g", c->warmup_ratio);
    if (c->warmup_steps > 0 && c->warmup_ratio > 0)
        FAIL("warmup_ratio: give warmup_steps or warmup_ratio, not both (warmup_steps %g, warmup_ratio %g)",
             c->warmup_steps, c->warmup_ratio);
    NEED(c->per_device_train_batch_size >= 1, "per_device_train_batch_size", "must be >= 1, got %d",
         c->per_device_train_batch_size);
    NEED(c->gradient_accumulation_steps >= 1, "gradient_accumulation_steps", "must be >= 1, got %d",
         c->gradient_accumulation_steps);
    NEED(c->max_steps == -1 || c->max_steps >= 1, "max_steps", "must be >= 1, or -1 to use num_train_epochs; got %ld",
         c->max_steps);
    if (c->max_steps == -1)
        NEED(isfinite(c->num_train_epochs) && c->num_train_epochs > 0, "num_train_epochs",
             "must be > 0 when max_steps is -1, got %g", c->num_train_epochs);
    NEED(c->seed >= 0, "seed", "must be >= 0, got %ld", c->seed);
    if (!c->optim || strncmp(c->optim, "adamw", 5) != 0)
        FAIL("optim: tandem trains with AdamW only (any adamw_* name); got '%s'", c->optim ? c->optim : "none");
    return 0;
}

static int check_logging_and_dist(const TrainConfig *c, Problems *p) {
    NEED(c->logging_steps >= 1, "logging_steps", "must be >= 1, got %d", c->logging_steps);
    NEED(c->save_steps >= 0, "save_steps", "must be >= 0 (0 = only at the end), got %d", c->save_steps);
    if (c->save_strategy == SAVE_STRATEGY_BEST)
        problems_add(p, "save_strategy: \"best\" keeps the checkpoint with the best evaluation metric, and "
                     "tandem-train does no evaluation; use \"steps\" (save_steps) or \"epoch\", and score the "
                     "checkpoints with tandem-train eval");
    NEED(c->save_total_limit >= 0, "save_total_limit", "must be >= 0 (0 = keep all), got %d", c->save_total_limit);
    if (c->resume && !c->resume[0]) FAIL("resume: empty path (give a checkpoint folder, \"latest\" or \"auto\")");
    NEED(c->zero_stage >= 1 && c->zero_stage <= 3, "zero_stage", "must be 1, 2 or 3, got %d", c->zero_stage);
    // The rollout servers take weight slices cut over every rank (trainer/weight_sync.c); HSDP's are cut per node.
    NEED(c->zero_hpz_partition_size >= 1, "zero_hpz_partition_size", "must be >= 1 (1 = off), got %d",
         c->zero_hpz_partition_size);
    if (c->zero_hpz_partition_size > 1 && c->zero_stage != 3)
        FAIL("zero_hpz_partition_size: %d needs zero_stage 3 (it partitions the stage-3 parameters), got zero_stage %d",
             c->zero_hpz_partition_size, c->zero_stage);
    if (c->zero_hpz_partition_size > 1 && c->sharding_strategy != SHARDING_FULL_SHARD)
        FAIL("zero_hpz_partition_size: %d and sharding_strategy hybrid_shard are two different layouts: pick one",
             c->zero_hpz_partition_size);
    // The NCCL and ipc weight syncs have the servers receive slice r of every unit from trainer rank r; hybrid
    // layouts cut the model otherwise (trainer/weight_sync.c), so their weights travel over ZeroMQ (auto picks it).
    if (train_config_hybrid_layout(c) && c->mode != TRAIN_MODE_SFT &&
        (c->weight_sync_transport == WEIGHT_SYNC_NCCL || c->weight_sync_transport == WEIGHT_SYNC_IPC))
        FAIL("weight_sync_transport: %s from %s is not built; use zmq (or auto, which picks it for these layouts)",
             c->weight_sync_transport == WEIGHT_SYNC_IPC ? "ipc" : "nccl",
             c->sharding_strategy == SHARDING_HYBRID_SHARD ? "sharding_strategy hybrid_shard"
                                                           : "zero_hpz_partition_size > 1");
    // Transport ipc carries whole weights only: adapters go over nccl or zmq.
    if (c->use_peft && c->lora_sync == LORA_SYNC_ADAPTER && c->mode != TRAIN_MODE_SFT &&
        c->weight_sync_transport == WEIGHT_SYNC_IPC)
        FAIL("weight_sync_transport: ipc carries whole weights only; with lora_sync adapter use nccl or zmq, or set "
             "lora_sync merged");
    NEED(isfinite(c->init_timeout) && c->init_timeout > 0, "init_timeout", "must be > 0 seconds, got %g",
         c->init_timeout);
    NEED(isfinite(c->comm_timeout) && c->comm_timeout > 0, "comm_timeout", "must be > 0 seconds, got %g",
         c->comm_timeout);
    NEED(isfinite(c->rollout_timeout) && c->rollout_timeout > 0, "rollout_timeout", "must be > 0 seconds, got %g",
         c->rollout_timeout);
    NEED(c->weight_sync_steps >= 1, "weight_sync_steps", "must be >= 1, got %d", c->weight_sync_steps);
    if (c->rollout_servers) check_servers(c->rollout_servers, p);
    return 0;
}

static int check_rewards(const TrainConfig *c, Problems *p) {
    NEED(c->soft_punish_cache >= 0, "soft_punish_cache", "must be >= 0, got %d", c->soft_punish_cache);
    NEED(isfinite(c->reward_timeout) && c->reward_timeout > 0, "reward_timeout", "must be > 0 seconds, got %g",
         c->reward_timeout);
    NEED(isfinite(c->reward_connect_timeout) && c->reward_connect_timeout > 0, "reward_connect_timeout",
         "must be > 0 seconds, got %g", c->reward_connect_timeout);
    NEED(c->reward_retries >= 0, "reward_retries", "must be >= 0, got %d", c->reward_retries);
    NEED(c->reward_max_response_mb >= 1, "reward_max_response_mb", "must be >= 1 MiB, got %d",
         c->reward_max_response_mb);
    NEED(isfinite(c->reward_backoff) && c->reward_backoff >= 0, "reward_backoff", "must be >= 0 seconds, got %g",
         c->reward_backoff);
    if (c->reward_url) {
        HttpUrl u;
        char uerr[512];
        if (http_parse_url(c->reward_url, &u, uerr, sizeof uerr) != 0) FAIL("reward_url: %s", uerr);
    }
    // Building the built-ins checks their names and options exactly as the trainer will use them.
    RewardOptions ro;
    train_config_reward_options(c, &ro);
    Rewards *r = NULL;
    char rerr[1024];
    if (rewards_create(&r, (const char *const *)c->rewards, c->n_rewards, &ro, rerr, sizeof rerr) != 0)
        FAIL("%s", rerr);
    rewards_free(r);
    if (c->reward_weights) {
        for (size_t i = 0; i < c->n_reward_weights; i++)
            if (!isfinite(c->reward_weights[i])) FAIL("reward_weights: item %zu is not finite", i);
        // Columns: the built-ins, the reward service's, then the environment service's ("environment").
        const size_t known = c->n_rewards + (c->env_url ? 1 : 0);
        if (!c->reward_url && c->n_reward_weights != known)
            FAIL("reward_weights: %zu weights for %zu reward functions (rewards: %zu built-ins%s, no reward_url)",
                 c->n_reward_weights, known, c->n_rewards, c->env_url ? ", then env_url's environment" : "");
        if (c->reward_url && c->n_reward_weights <= known)
            FAIL("reward_weights: %zu weights but %zu built-in rewards plus the reward service's functions%s",
                 c->n_reward_weights, c->n_rewards, c->env_url ? " plus env_url's environment" : "");
    }
    return 0;
}

void train_config_reward_options(const TrainConfig *c, RewardOptions *ro) {
    reward_options_default(ro);
    ro->answer_column = c->answer_column;
    ro->format_regex = c->format_regex;
    ro->format_regex_search = c->format_regex_mode == FORMAT_REGEX_SEARCH;
    ro->max_completion_length = c->grpo.max_completion_length;
    ro->soft_punish_cache = c->soft_punish_cache;
    ro->length_penalty_coef = c->length_penalty_coef;
    ro->length_penalty_target = c->length_penalty_target;
}

void train_config_reward_service_options(const TrainConfig *c, RewardServiceOptions *so) {
    reward_service_options_default(so);
    so->url = c->reward_url;
    so->timeout_s = c->reward_timeout;
    so->connect_timeout_s = c->reward_connect_timeout;
    so->max_retries = c->reward_retries;
    so->backoff_s = c->reward_backoff;
    so->max_response_bytes = (size_t)c->reward_max_response_mb << 20;
}

// Resolves steps_per_generation / generation_batch_size as GRPOConfig.__post_init__ does. A TRL dump holds both
// (GRPOConfig derived one from the other for the ranks of the process that wrote it): accepted when they agree
// for these ranks.
static int resolve_batches(TrainConfig *c, int ws, Problems *p) {
    long per_step = (long)c->per_device_train_batch_size * ws;  // completions per micro-step, all ranks
    long spg, gbs;
    if (c->generation_batch_size && c->steps_per_generation &&
        (long)c->generation_batch_size != per_step * c->steps_per_generation) {
        long written_for = (long)c->generation_batch_size / ((long)c->per_device_train_batch_size *
                                                             c->steps_per_generation);
        FAIL("generation_batch_size: %d and steps_per_generation %d disagree for per_device_train_batch_size %d x %d "
             "rank(s) (%ld completions per round)%s%ld rank(s)%s; give only one of them (without "
             "generation_batch_size, steps_per_generation %d gives %ld per round)",
             c->generation_batch_size, c->steps_per_generation, c->per_device_train_batch_size, ws,
             per_step * c->steps_per_generation, written_for >= 1 ? ": the pair was derived for " : "",
             written_for >= 1 ? written_for : 0L, written_for >= 1 ? " (as TRL writes it)" : "",
             c->steps_per_generation, per_step * c->steps_per_generation);
    }
    if (c->generation_batch_size && !c->steps_per_generation) {
        if (c->generation_batch_size % per_step != 0)
            FAIL("generation_batch_size: %d must be divisible by per_device_train_batch_size (%d) x %d ranks = %ld",
                 c->generation_batch_size, c->per_device_train_batch_size, ws, per_step);
        gbs = c->generation_batch_size;
        spg = gbs / per_step;
    } else {
        spg = c->steps_per_generation ? c->steps_per_generation : c->gradient_accumulation_steps;
        gbs = per_step * spg;
        if (gbs > 2147483647L)
            FAIL("per_device_train_batch_size: the generation batch (%ld completions) is too large", gbs);
    }
    c->resolved_steps_per_generation = (int)spg;
    c->resolved_generation_batch_size = (int)gbs;
    if (c->mode == TRAIN_MODE_GRPO) {
        int g = c->grpo.num_generations;
        long per_rank = (long)c->per_device_train_batch_size * spg;
        if (g >= 2 && per_rank % g != 0)
            FAIL("per_device_train_batch_size: %d completions x %ld steps_per_generation = %ld completions per rank "
                 "per generation round, not divisible by num_generations (%d): each rank generates whole groups",
                 c->per_device_train_batch_size, spg, per_rank, g);
    }
    return 0;
}

int train_config_lora(const TrainConfig *c, LoraConfig *out, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    out->r = c->lora_r;
    out->alpha = (float)c->lora_alpha;
    out->dropout = (float)c->lora_dropout;
    out->use_rslora = c->use_rslora;
    if (lora_parse_targets(c->lora_target_modules, &out->targets, err, err_len) != 0 ||
        lora_parse_init(c->lora_init ? c->lora_init : "", &out->init, err, err_len) != 0 ||
        lora_config_check(out, err, err_len) != 0)
        return -1;
    return 0;
}

// use_peft: the adapters' options, and what LoRA training does not do in this version.
static int check_lora(const TrainConfig *c, Problems *p) {
    if (!c->use_peft && c->lora_save_merged) FAIL("lora_save_merged: needs use_peft (there are no adapters to merge)");
    if (!c->use_peft && c->lora_sync != LORA_SYNC_ADAPTER) FAIL("lora_sync: needs use_peft (there are no adapters)");
    if (!c->use_peft) return 0;
    LoraConfig lc;
    char msg[384];
    if (train_config_lora(c, &lc, msg, sizeof msg) != 0) FAIL("%s", msg);
    if (c->sharding_strategy != SHARDING_FULL_SHARD || c->zero_hpz_partition_size > 1)
        FAIL("use_peft: the base is replicated and frozen and the adapters are replicated: sharding_strategy "
             "hybrid_shard and zero_hpz_partition_size do not apply; leave them at their defaults");
    return 0;
}

// Multi-turn tool use: known tool names, a readable lookup table when lookup is on, a known call format.
static int check_tools(const TrainConfig *c, Problems *p) {
    NEED(c->max_tool_calling_iterations >= -1, "max_tool_calling_iterations",
         "must be >= 0, or -1 for no limit, got %d", c->max_tool_calling_iterations);
    int lookup = 0;
    for (size_t i = 0; i < c->n_tools; i++) {
        if (strcmp(c->tools[i], "lookup") == 0) lookup = 1;
        else if (strcmp(c->tools[i], "calculator") != 0)
            FAIL("tools: unknown built-in tool '%s' (built-ins: calculator, lookup)", c->tools[i]);
    }
    if (c->n_tools && c->mode != TRAIN_MODE_GRPO) FAIL("tools: multi-turn tool use is for mode grpo");
    if (c->n_tools && c->env_url)
        FAIL("env_url: give tools (tandem's built-in tools) or env_url (an environment service), not both");
    if (c->env_url) {
        HttpUrl u;
        char uerr[512];
        if (http_parse_url(c->env_url, &u, uerr, sizeof uerr) != 0) FAIL("env_url: %s", uerr);
        if (c->mode != TRAIN_MODE_GRPO) FAIL("env_url: environments are for mode grpo");
    }
    NEED(isfinite(c->env_timeout) && c->env_timeout > 0, "env_timeout", "must be > 0 seconds, got %g",
         c->env_timeout);
    NEED(isfinite(c->env_connect_timeout) && c->env_connect_timeout > 0, "env_connect_timeout",
         "must be > 0 seconds, got %g", c->env_connect_timeout);
    NEED(c->env_retries >= 0, "env_retries", "must be >= 0, got %d", c->env_retries);
    NEED(isfinite(c->env_backoff) && c->env_backoff >= 0, "env_backoff", "must be >= 0 seconds, got %g",
         c->env_backoff);
    if (lookup && !c->tool_lookup_file)
        FAIL("tools: lookup needs tool_lookup_file (a JSON object file of key -> value)");
    if (c->tool_lookup_file && !lookup) FAIL("tool_lookup_file: set, but tools does not list lookup");
    if (c->tool_call_format) {
        ToolCallFormat f;
        char ferr[256];
        if (tool_call_format_from_name(c->tool_call_format, &f, ferr, sizeof ferr) != 0)
            FAIL("tool_call_format: %s", ferr);
    }
    return 0;
}

static int check_mode(const TrainConfig *c, Problems *p) {
    if (c->mode == TRAIN_MODE_GRPO) {
        char gerr[512];
        if (grpo_options_validate(&c->grpo, gerr, sizeof gerr) != 0) problems_add(p, "%s", gerr);
        if (c->loss_type_nll)
            problems_add(p, "loss_type: \"nll\" is SFTConfig's loss; for supervised fine-tuning add mode \"sft\" "
                         "(--mode sft), for grpo give one of grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo");
        if (!c->rollout_servers)
            problems_add(p, "rollout_servers: grpo needs at least one rollout server (--rollout-servers "
                         "tcp://host:port)");
        if (c->n_rewards == 0 && !c->reward_url && !c->env_url)
            problems_add(p, "rewards: grpo needs a reward (--rewards with built-in names, --reward-url, or "
                         "--env-url)");
    } else {
        NEED(c->max_length >= 0, "max_length", "must be >= 0 (0 or null = no truncation), got %d", c->max_length);
        if (!c->dataset_text_field || !c->dataset_text_field[0])
            problems_add(p, "dataset_text_field: must name a column (TRL's default is \"text\")");
    }
    return 0;
}

int train_config_finalize(TrainConfig *c, int world_size, char *err, size_t err_len) {
    Problems probs = {0}, *p = &probs;
    if (world_size < 1) {
        problems_add(p, "world size %d: must be >= 1 (WORLD_SIZE)", world_size);
        return problems_report(p, err, err_len);
    }
    c->world_size = world_size;
    // Every group runs, so that one run lists every problem; the batch arithmetic needs sane sizes.
    check_model_and_data(c, p);
    check_generation(c, p);
    check_optimisation(c, p);
    check_logging_and_dist(c, p);
    check_rewards(c, p);
    check_mode(c, p);
    check_lora(c, p);
    check_tools(c, p);
    if (c->per_device_train_batch_size >= 1 && c->gradient_accumulation_steps >= 1 && c->steps_per_generation >= 0 &&
        c->generation_batch_size >= 0)
        resolve_batches(c, world_size, p);
    return problems_report(p, err, err_len);
}

long train_config_total_steps(const TrainConfig *c, long steps_per_epoch) {
    if (c->max_steps > 0) return c->max_steps;
    return (long)ceil(c->num_train_epochs * (double)steps_per_epoch);
}
