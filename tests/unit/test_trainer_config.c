// tests/unit/test_trainer_config.c — tandem-train's options: defaults equal TRL's GRPOConfig; flags (kebab and
// snake spellings, "--k v" and "--k=v", bare booleans, lists, "none") and JSON file keys set the same fields;
// flags override the file whatever their order; every refusal (unknown key or flag with its suggestion, wrong
// type, out of range, rules between options) names the key; the derived batch sizes follow GRPOConfig; the
// help lists every option with its default; docs/configuration.md holds the generated tables verbatim.
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_macros.h"
#include "trainer/train_config.h"
#include "trainer/train_config_internal.h"

#define REQUIRED "--model", "/m", "--train-file", "/d.jsonl", "--rollout-servers", "tcp://h:5555", "--rewards", \
                 "think_format"

// Parses argv (NULL-terminated list after the program name) into a fresh config; returns the parse rc.
static int parse(TrainConfig *c, char *err, size_t err_len, ...) {
    char *argv[64] = {"tandem-train"};
    int argc = 1;
    va_list ap;
    va_start(ap, err_len);
    for (char *a; (a = va_arg(ap, char *)) && argc < 63;) argv[argc++] = a;
    va_end(ap);
    train_config_default(c);
    err[0] = '\0';
    return train_config_parse_args(c, argc, argv, err, err_len);
}

// Expects the flags (plus the required ones) to be refused at parse or at finalize with every needle in the
// message.
static void refuse_flags(int line, int world, const char *n1, const char *n2, const char *const *flags, int nflags) {
    char *argv[64] = {"tandem-train", REQUIRED};
    int argc = 9;
    for (int i = 0; i < nflags && argc < 63; i++) argv[argc++] = (char *)flags[i];
    TrainConfig c;
    train_config_default(&c);
    char err[1024] = "";
    int rc = train_config_parse_args(&c, argc, argv, err, sizeof err);
    if (rc == 0) rc = train_config_finalize(&c, world, err, sizeof err);
    if (rc >= 0 || (n1 && !strstr(err, n1)) || (n2 && !strstr(err, n2))) {
        fprintf(stderr, "line %d: expected refusal mentioning '%s' '%s'; rc %d, err '%s'\n", line, n1 ? n1 : "",
                n2 ? n2 : "", rc, err);
        failures++;
    }
    train_config_free(&c);
}
#define REFUSE(n1, n2, ...)                                                                     \
    do {                                                                                        \
        const char *const f_[] = {__VA_ARGS__};                                                 \
        refuse_flags(__LINE__, 1, n1, n2, f_, (int)(sizeof f_ / sizeof f_[0]));                 \
    } while (0)

// Same for a JSON config text applied on top of the required flags.
static void refuse_json(int line, const char *json, const char *n1, const char *n2) {
    TrainConfig c;
    char err[1024] = "";
    int rc = parse(&c, err, sizeof err, REQUIRED, NULL);
    if (rc == 0) rc = train_config_apply_json(&c, json, strlen(json), "cfg.json", err, sizeof err);
    if (rc == 0) rc = train_config_finalize(&c, 1, err, sizeof err);
    if (rc >= 0 || (n1 && !strstr(err, n1)) || (n2 && !strstr(err, n2))) {
        fprintf(stderr, "line %d: expected refusal of %s mentioning '%s' '%s'; rc %d, err '%s'\n", line, json,
                n1 ? n1 : "", n2 ? n2 : "", rc, err);
        failures++;
    }
    train_config_free(&c);
}

// Every valid JSON number is read (shared/json_read.h): an integer literal beyond int64 is that number for a
// FLOAT option, and an INT option refuses it by its type (jansson alone called the file invalid JSON).
static void test_json_numbers(void) {
    TrainConfig c;
    char err[1024] = "";
    const char *big = "{\"reward_timeout\": 100000000000000000000}";
    CHECK(parse(&c, err, sizeof err, REQUIRED, NULL) == 0);
    CHECK(train_config_apply_json(&c, big, strlen(big), "cfg.json", err, sizeof err) == 0 && c.reward_timeout == 1e20);
    train_config_free(&c);
    refuse_json(__LINE__, "{\"seed\": 100000000000000000000}", "seed", "expected an integer");
}

static void test_defaults(void) {
    TrainConfig c;
    train_config_default(&c);
    // TRL 1.16 GRPOConfig defaults.
    CHECK(c.learning_rate == 1e-6 && c.grpo.num_generations == 8 && c.grpo.max_completion_length == 512);
    CHECK(c.temperature == 1.0 && c.top_p == 1.0 && c.top_k == 0 && c.repetition_penalty == 1.0);
    CHECK(c.grpo.beta == 0.0 && c.grpo.epsilon == 0.2 && !c.grpo.has_epsilon_high && !c.grpo.has_delta);
    CHECK(c.grpo.loss_type == GRPO_LOSS_DAPO && c.grpo.scale_rewards == GRPO_SCALE_GROUP);
    CHECK(c.num_iterations == 1 && c.steps_per_generation == 0 && c.per_device_train_batch_size == 8);
    CHECK(c.max_staleness == 0);
    CHECK(c.gradient_accumulation_steps == 1 && c.max_steps == -1 && c.num_train_epochs == 3.0);
    CHECK(c.lr_scheduler_type == LR_SCHED_LINEAR && c.warmup_steps == 0 && c.weight_decay == 0.0);
    CHECK(c.adam_beta1 == 0.9 && c.adam_beta2 == 0.999 && c.adam_epsilon == 1e-8 && c.max_grad_norm == 1.0);
    CHECK(c.seed == 42 && c.logging_steps == 10 && c.save_steps == 500 && c.gradient_checkpointing == 1);
    CHECK(c.zero_stage == 3 && c.mode == TRAIN_MODE_GRPO && c.shuffle_dataset == 1);
    CHECK(strcmp(c.output_dir, "output") == 0 && strcmp(c.answer_column, "answer") == 0);
    train_config_free(&c);
}

static void test_flags_and_file(void) {
    char err[1024];
    TrainConfig c;
    // kebab and snake flags, "=" and separate values, bare bool, bool with value, lists, none.
    int rc = parse(&c, err, sizeof err, "--model", "/m", "--train_file=/d", "--learning-rate", "3e-4",
                   "--num-generations=4", "--mask-truncated-completions", "--shuffle-dataset", "false",
                   "--rewards", "answer_match, think_format", "--reward-weights", "1,0.5", "--epsilon-high", "0.28",
                   "--delta", "none", "--loss-type", "grpo", "--scale-rewards", "false", "--top-k", "-1", "--mode",
                   "sft", "--rollout-servers", "tcp://a:1,tcp://b:2", "--chat-template", "chatml",
                   "--activation-checkpointing=false", "--resume-from-checkpoint", "latest", NULL);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK(strcmp(c.model, "/m") == 0 && strcmp(c.train_file, "/d") == 0 && c.learning_rate == 3e-4);
    CHECK(c.grpo.num_generations == 4 && c.grpo.mask_truncated_completions == 1 && c.shuffle_dataset == 0);
    CHECK(c.n_rewards == 2 && strcmp(c.rewards[0], "answer_match") == 0 && strcmp(c.rewards[1], "think_format") == 0);
    CHECK(c.n_reward_weights == 2 && c.reward_weights[0] == 1.0 && c.reward_weights[1] == 0.5);
    CHECK(c.grpo.has_epsilon_high && c.grpo.epsilon_high == 0.28 && !c.grpo.has_delta);
    CHECK(c.grpo.loss_type == GRPO_LOSS_GRPO && c.grpo.scale_rewards == GRPO_SCALE_NONE && c.top_k == -1);
    CHECK(c.mode == TRAIN_MODE_SFT && strcmp(c.rollout_servers, "tcp://a:1,tcp://b:2") == 0);
    CHECK(c.gradient_checkpointing == 0 && strcmp(c.resume, "latest") == 0 && strcmp(c.chat_template, "chatml") == 0);
    train_config_free(&c);

    // A JSON file with TRL keys; flags override it even when they come before --config.
    char path[] = "/tmp/tandem_cfg_XXXXXX";
    int fd = mkstemp(path);
    const char *json = "{\"learning_rate\": 2e-5, \"num_generations\": 16, \"per_device_train_batch_size\": 16,"
                       " \"lr_scheduler_type\": \"cosine\", \"warmup_steps\": 0.1, \"beta\": 0.04,"
                       " \"scale_rewards\": true, \"reward_weights\": [1, 2], \"rewards\": [\"answer_match\","
                       " \"soft_overlong\"], \"soft_punish_cache\": 64, \"max_completion_length\": 256,"
                       " \"rollout_servers\": [\"tcp://x:1\", \"tcp://y:2\"], \"model\": \"/file-model\","
                       " \"train_file\": \"/f.jsonl\", \"report_to\": \"none\", \"use_vllm\": true,"
                       " \"sync_ref_model\": false, \"epsilon_high\": null, \"max_steps\": 100,"
                       " \"importance_sampling_level\": \"sequence\", \"bf16\": true}";
    CHECK(write(fd, json, strlen(json)) == (ssize_t)strlen(json));
    close(fd);
    char cfgflag[64];
    snprintf(cfgflag, sizeof cfgflag, "--config=%s", path);
    rc = parse(&c, err, sizeof err, "--learning-rate", "1e-5", cfgflag, "--max-steps", "7", NULL);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK(c.learning_rate == 1e-5 && c.max_steps == 7);                      // flags win
    CHECK(c.grpo.num_generations == 16 && c.per_device_train_batch_size == 16 && c.grpo.beta == 0.04);
    CHECK(c.lr_scheduler_type == LR_SCHED_COSINE && c.warmup_steps == 0.1 && c.grpo.scale_rewards == GRPO_SCALE_GROUP);
    CHECK(c.n_reward_weights == 2 && c.reward_weights[1] == 2.0 && c.soft_punish_cache == 64);
    CHECK(c.grpo.max_completion_length == 256 && strcmp(c.rollout_servers, "tcp://x:1,tcp://y:2") == 0);
    CHECK(strcmp(c.model, "/file-model") == 0 && c.grpo.importance_sampling_level == GRPO_IS_LEVEL_SEQUENCE);
    CHECK(c.config_file && strcmp(c.config_file, path) == 0);
    // TRL-only keys are recorded as ignored: report_to, use_vllm, bf16, and sync_ref_model at its default.
    CHECK(c.n_ignored == 4);
    CHECK(train_config_finalize(&c, 2, err, sizeof err) == 0);
    // steps_per_generation = gradient_accumulation_steps = 1; generation batch = 16 x 2 ranks x 1.
    CHECK(c.resolved_steps_per_generation == 1 && c.resolved_generation_batch_size == 32);
    CHECK(train_config_total_steps(&c, 1000) == 7);
    RewardOptions ro;
    train_config_reward_options(&c, &ro);
    CHECK(ro.max_completion_length == 256 && ro.soft_punish_cache == 64 && strcmp(ro.answer_column, "answer") == 0);
    RewardServiceOptions so;
    train_config_reward_service_options(&c, &so);
    CHECK(so.url == NULL && so.timeout_s == 60.0 && so.max_retries == 3 && so.backoff_s == 1.0);

    // The JSON dump reads back to the same configuration.
    char *dump = train_config_to_json(&c);
    TrainConfig c2;
    train_config_default(&c2);
    CHECK(dump && train_config_apply_json(&c2, dump, strlen(dump), "dump", err, sizeof err) == 0);
    char *dump2 = train_config_to_json(&c2);
    CHECK(dump && dump2 && strcmp(dump, dump2) == 0);
    free(dump);
    free(dump2);
    train_config_free(&c2);
    train_config_free(&c);
    unlink(path);

    // train_config_set with either spelling; --help.
    train_config_default(&c);
    CHECK(train_config_set(&c, "max-grad-norm", "0.5", err, sizeof err) == 0 && c.max_grad_norm == 0.5);
    CHECK(train_config_set(&c, "vllm_importance_sampling_cap", "2.5", err, sizeof err) == 0);
    CHECK(train_config_set(&c, "vllm_importance_sampling_clip_max", "9", err, sizeof err) == 0);
    CHECK(c.grpo.vllm_importance_sampling_clip_max == 2.5);  // the deprecated cap wins, as in TRL
    train_config_free(&c);
    CHECK(parse(&c, err, sizeof err, "--model", "/m", "--help", NULL) == TRAIN_CONFIG_HELP);
    train_config_free(&c);
    CHECK(parse(&c, err, sizeof err, "--model", "/m", "-h", NULL) == TRAIN_CONFIG_HELP);
    train_config_free(&c);
    CHECK(parse(&c, err, sizeof err, "--version", "--learnig-rate", "1", NULL) == TRAIN_CONFIG_VERSION);
    train_config_free(&c);
    // Epoch-based total: ceil(epochs * steps per epoch).
    train_config_default(&c);
    c.num_train_epochs = 2.5;
    CHECK(train_config_total_steps(&c, 3) == 8);
    train_config_free(&c);
}

static void test_parse_refusals(void) {
    REFUSE("unknown flag --learnig-rate", "did you mean --learning-rate?", "--learnig-rate", "1");
    REFUSE("unknown flag --zzz", NULL, "--zzz", "1");
    REFUSE("learning_rate (--learning-rate): expected a number, got \"fast\"", NULL, "--learning-rate", "fast");
    REFUSE("num_generations (--num-generations): expected an integer, got \"2.5\"", NULL, "--num-generations", "2.5");
    REFUSE("max_steps (--max-steps): expected an integer", NULL, "--max-steps", "10x");
    REFUSE("shuffle_dataset (--shuffle-dataset): expected true or false, got \"maybe\"", NULL,
           "--shuffle-dataset=maybe");
    REFUSE("reward_weights (--reward-weights): expected comma-separated numbers", NULL, "--reward-weights", "1,,2");
    REFUSE("delta (--delta): expected a number or none", NULL, "--delta", "big");
    REFUSE("lr_scheduler_type", "unknown value 'cosin'", "--lr-scheduler-type", "cosin");
    REFUSE("did you mean 'cosine'?", NULL, "--lr-scheduler-type", "cosin");
    REFUSE("loss_type", "unknown value 'dapoo'", "--loss-type", "dapoo");
    REFUSE("did you mean 'dapo'?", NULL, "--loss-type", "dapoo");
    REFUSE("learning_rate (--learning-rate): needs a value", NULL, "--learning-rate");
    REFUSE("unexpected argument 'extra'", NULL, "extra");
    REFUSE("malformed flag '--=1'", NULL, "--=1");
    REFUSE("unexpected argument '--'", NULL, "--");
    REFUSE("config (--config): needs a file path", NULL, "--config");
    // Transport ipc: whole weights, over ZeRO's flat cut only.
    REFUSE("weight_sync_transport: ipc carries whole weights only", "lora_sync merged", "--weight-sync-transport",
           "ipc", "--use-peft", "true", "--lora-sync", "adapter");
    REFUSE("weight_sync_transport: ipc from sharding_strategy hybrid_shard is not built", NULL,
           "--weight-sync-transport", "ipc", "--sharding-strategy", "hybrid_shard");
    REFUSE("config: cannot open /nonexistent/cfg.json", NULL, "--config", "/nonexistent/cfg.json");
    REFUSE("num_generations", "outside", "--num-generations", "99999999999");
    REFUSE("sync_ref_model: true is not supported by tandem (accepted: [false])", "TR-DPO", "--sync-ref-model", "true");
    REFUSE("report_to: \"wandb\" is not supported by tandem", "metrics.jsonl", "--report-to", "wandb");

    refuse_json(__LINE__, "{\"learning_rate\": 1e-5,", "cfg.json: invalid JSON", NULL);
    refuse_json(__LINE__, "[1]", "cfg.json: the config must be a JSON object", NULL);
    refuse_json(__LINE__, "{\"seed\": 1, \"seed\": 2}", "cfg.json: invalid JSON", "duplicate");
    refuse_json(__LINE__, "{\"num_generation\": 4}", "cfg.json: unknown key 'num_generation'",
                "did you mean 'num_generations'?");
    refuse_json(__LINE__, "{\"qqqq\": 4}", "cfg.json: unknown key 'qqqq'", NULL);
    refuse_json(__LINE__, "{\"seed\": 1.5}", "cfg.json: seed: expected an integer", NULL);
    refuse_json(__LINE__, "{\"learning_rate\": \"1e-5\"}", "cfg.json: learning_rate: expected a number", NULL);
    refuse_json(__LINE__, "{\"shuffle_dataset\": \"yes\"}", "cfg.json: shuffle_dataset: expected true or false", NULL);
    refuse_json(__LINE__, "{\"output_dir\": 3}", "cfg.json: output_dir: expected a string", NULL);
    refuse_json(__LINE__, "{\"mode\": 1}", "cfg.json: mode: expected a string", NULL);
    refuse_json(__LINE__, "{\"mode\": \"ppo\"}", "cfg.json: mode: unknown value 'ppo' (one of: grpo, sft)", NULL);
    refuse_json(__LINE__, "{\"rewards\": [\"think_format\", 3]}", "cfg.json: rewards: item 1 must be a non-empty string",
                NULL);
    refuse_json(__LINE__, "{\"rewards\": 3}", "cfg.json: rewards: expected a list of strings", NULL);
    refuse_json(__LINE__, "{\"reward_weights\": [1, \"2\"]}", "cfg.json: reward_weights: item 1 is not a number", NULL);
    refuse_json(__LINE__, "{\"reward_weights\": []}", "cfg.json: reward_weights: expected a non-empty list", NULL);
    refuse_json(__LINE__, "{\"epsilon_high\": \"x\"}", "cfg.json: epsilon_high: expected a number or null", NULL);
    refuse_json(__LINE__, "{\"beta\": true}", "cfg.json: beta: expected a number", NULL);
    refuse_json(__LINE__, "{\"num_generations\": 2.0}", "cfg.json: num_generations: expected an integer", NULL);
    refuse_json(__LINE__, "{\"mask_truncated_completions\": 1}",
                "cfg.json: mask_truncated_completions: expected true or false", NULL);
    refuse_json(__LINE__, "{\"scale_rewards\": \"grup\"}", "scale_rewards", "did you mean 'group'?");
    refuse_json(__LINE__, "{\"config\": \"other.json\"}", "cfg.json: config: only valid on the command line", NULL);
    refuse_json(__LINE__, "{\"sync_ref_model\": true}", "cfg.json: sync_ref_model: true is not supported", NULL);
    refuse_json(__LINE__, "{\"fp16\": true}", "fp16: true is not supported", "remove fp16");
    refuse_json(__LINE__, "{\"save_strategy\": \"best\"}", "save_strategy: \"best\" keeps the checkpoint", "no evaluation");
    refuse_json(__LINE__, "{\"logging_strategy\": \"epoch\"}", "logging_strategy: \"epoch\" is not supported",
                "logging_steps");
    refuse_json(__LINE__, "{\"report_to\": [\"wandb\"]}", "report_to: [\"wandb\"] is not supported", "metrics.jsonl");
    refuse_json(__LINE__, "{\"model_init_kwargs\": {\"revision\": \"x\"}}", "model_init_kwargs: {\"revision\":\"x\"} is "
                "not supported", NULL);
    refuse_json(__LINE__, "{\"loss_type\": \"dft\"}", "cfg.json: loss_type: \"dft\"", "not implemented");
    // Every problem of a file in one message, a line each.
    refuse_json(__LINE__, "{\"fp16\": true, \"packing\": true, \"seed\": 1.5, \"qqqq\": 1}", "4 problems:\n  cfg.json: fp16",
                "\n  cfg.json: packing: true is not supported");
    refuse_json(__LINE__, "{\"fp16\": true, \"packing\": true, \"seed\": 1.5, \"qqqq\": 1}", "cfg.json: seed: expected",
                "cfg.json: unknown key 'qqqq'");
}

static void test_finalize_refusals(void) {
    char err[1024];
    TrainConfig c;
    // Required options.
    CHECK(parse(&c, err, sizeof err, NULL) == 0);
    CHECK(train_config_finalize(&c, 1, err, sizeof err) < 0 && strstr(err, "model: required"));
    train_config_free(&c);
    CHECK(parse(&c, err, sizeof err, "--model", "/m", NULL) == 0);
    CHECK(train_config_finalize(&c, 1, err, sizeof err) < 0 && strstr(err, "train_file: required"));
    train_config_free(&c);
    CHECK(parse(&c, err, sizeof err, "--model", "/m", "--train-file", "/d", "--rewards", "think_format", NULL) == 0);
    CHECK(train_config_finalize(&c, 1, err, sizeof err) < 0 && strstr(err, "rollout_servers: grpo needs"));
    train_config_free(&c);
    CHECK(parse(&c, err, sizeof err, "--model", "/m", "--train-file", "/d", "--rollout-servers", "tcp://h:1",
                NULL) == 0);
    CHECK(train_config_finalize(&c, 1, err, sizeof err) < 0 && strstr(err, "rewards: grpo needs a reward"));
    train_config_free(&c);
    // sft needs neither servers nor rewards.
    CHECK(parse(&c, err, sizeof err, "--model", "/m", "--train-file", "/d", "--mode", "sft", NULL) == 0);
    CHECK(train_config_finalize(&c, 1, err, sizeof err) == 0);
    train_config_free(&c);
    CHECK(parse(&c, err, sizeof err, REQUIRED, NULL) == 0);
    CHECK(train_config_finalize(&c, 0, err, sizeof err) < 0 && strstr(err, "WORLD_SIZE"));
    train_config_free(&c);

    REFUSE("output_dir: must not be empty", NULL, "--output-dir", "");
    REFUSE("max_prompt_length: must be >= 0", "-1", "--max-prompt-length", "-1");
    REFUSE("data_seed: must be >= 0", NULL, "--data-seed", "-2");
    REFUSE("chat_template:", "unknown", "--chat-template", "gpt9");
    REFUSE("temperature: must be > 0", "got 0", "--temperature", "0");
    REFUSE("top_p: must be in (0, 1]", "got 1.5", "--top-p", "1.5");
    REFUSE("top_p: must be in (0, 1]", "got 0", "--top-p", "0");
    REFUSE("top_k: must be >= 0", NULL, "--top-k", "-3");
    REFUSE("min_p: must be in [0, 1]", NULL, "--min-p", "2");
    REFUSE("repetition_penalty: must be > 0", NULL, "--repetition-penalty", "0");
    REFUSE("generation_batch_size: must be >= 0", NULL, "--generation-batch-size", "-8");
    REFUSE("steps_per_generation: must be >= 0", NULL, "--steps-per-generation", "-1");
    REFUSE("num_iterations: must be >= 1", NULL, "--num-iterations", "0");
    REFUSE("max_staleness: must be >= 0 (0 = synchronous), got -1", NULL, "--max-staleness", "-1");
    REFUSE("learning_rate: must be >= 0", "got -1e-05", "--learning-rate", "-1e-5");
    REFUSE("weight_decay: must be >= 0", NULL, "--weight-decay", "-0.1");
    REFUSE("adam_beta1: must be in [0, 1)", NULL, "--adam-beta1", "1");
    REFUSE("adam_beta2: must be in [0, 1)", NULL, "--adam-beta2", "-0.5");
    REFUSE("adam_epsilon: must be >= 0", NULL, "--adam-epsilon", "-1e-8");
    REFUSE("max_grad_norm: must be >= 0", NULL, "--max-grad-norm", "-1");
    REFUSE("warmup_steps: must be >= 0", NULL, "--warmup-steps", "-5");
    REFUSE("warmup_ratio: must be in [0, 1]", NULL, "--warmup-ratio", "1.5");
    REFUSE("warmup_ratio: give warmup_steps or warmup_ratio, not both", NULL, "--warmup-ratio", "0.1",
           "--warmup-steps", "10");
    REFUSE("per_device_train_batch_size: must be >= 1", NULL, "--per-device-train-batch-size", "0");
    REFUSE("gradient_accumulation_steps: must be >= 1", NULL, "--gradient-accumulation-steps", "0");
    REFUSE("max_steps: must be >= 1, or -1", NULL, "--max-steps", "0");
    REFUSE("num_train_epochs: must be > 0 when max_steps is -1", NULL, "--num-train-epochs", "0");
    REFUSE("seed: must be >= 0", NULL, "--seed", "-1");
    REFUSE("tools: unknown built-in tool 'search'", "calculator, lookup", "--tools", "calculator,search");
    REFUSE("tools: lookup needs tool_lookup_file", NULL, "--tools", "lookup");
    REFUSE("tool_lookup_file: set, but tools does not list lookup", NULL, "--tools", "calculator",
           "--tool-lookup-file", "t.json");
    REFUSE("tool_call_format: unknown tool-call format 'qwen'", "hermes", "--tools", "calculator",
           "--tool-call-format", "qwen");
    REFUSE("max_tool_calling_iterations: must be >= 0, or -1", NULL, "--max-tool-calling-iterations", "-2");
    REFUSE("optim: tandem trains with AdamW only", "'sgd'", "--optim", "sgd");
    REFUSE("logging_steps: must be >= 1", NULL, "--logging-steps", "0");
    REFUSE("save_steps: must be >= 0", NULL, "--save-steps", "-1");
    REFUSE("save_total_limit: must be >= 0", NULL, "--save-total-limit", "-2");
    REFUSE("resume: empty path", NULL, "--resume", "");
    REFUSE("overwrite_output_dir: it deletes the checkpoints of output_dir that resume auto continues from", NULL,
           "--resume", "auto", "--overwrite-output-dir");
    REFUSE("zero_stage: must be 1, 2 or 3", "got 4", "--zero-stage", "4");
    REFUSE("init_timeout: must be > 0 seconds", NULL, "--init-timeout", "0");
    REFUSE("comm_timeout: must be > 0 seconds", NULL, "--comm-timeout", "-1");
    REFUSE("rollout_timeout: must be > 0 seconds", NULL, "--rollout-timeout", "0");
    REFUSE("weight_sync_steps: must be >= 1", NULL, "--weight-sync-steps", "0");
    REFUSE("rollout_servers: 'localhost:5555' is not tcp://host:port", NULL, "--rollout-servers", "localhost:5555");
    REFUSE("rollout_servers: 'tcp://h' is not tcp://host:port", NULL, "--rollout-servers", "tcp://a:1,tcp://h");
    REFUSE("rollout_servers: 'tcp://h:5x' has a bad port", NULL, "--rollout-servers", "tcp://h:5x");
    REFUSE("soft_punish_cache: must be >= 0", NULL, "--soft-punish-cache", "-1");
    REFUSE("reward_timeout: must be > 0 seconds", NULL, "--reward-timeout", "0");
    REFUSE("reward_connect_timeout: must be > 0 seconds", NULL, "--reward-connect-timeout", "0");
    REFUSE("reward_retries: must be >= 0", NULL, "--reward-retries", "-1");
    REFUSE("reward_backoff: must be >= 0 seconds", NULL, "--reward-backoff", "-1");
    REFUSE("reward_url:", "https:// is not supported", "--reward-url", "https://x/score");
    REFUSE("reward_url:", "must start with http://", "--reward-url", "x:80");
    REFUSE("rewards: unknown built-in reward 'acuracy'", "answer_match", "--rewards", "acuracy");
    REFUSE("rewards: 'think_format' is listed twice", NULL, "--rewards", "think_format,think_format");
    REFUSE("format_regex: regex_format is selected but no pattern", NULL, "--rewards", "regex_format");
    REFUSE("format_regex: the pattern does not compile", NULL, "--rewards", "regex_format", "--format-regex", "(a");
    REFUSE("soft_punish_cache: soft_overlong needs", NULL, "--rewards", "soft_overlong");
    REFUSE("length_penalty_target:", NULL, "--rewards", "length_penalty", "--length-penalty-target", "600");
    REFUSE("length_penalty_coef:", NULL, "--rewards", "length_penalty", "--length-penalty-coef", "-2");
    REFUSE("reward_weights: 2 weights for 1 reward functions", NULL, "--reward-weights", "1,2");
    REFUSE("reward_weights: 1 weights but 1 built-in rewards plus the reward service", NULL, "--reward-weights", "1",
           "--reward-url", "http://h:1/s");
    REFUSE("num_generations:", "at least 2", "--num-generations", "1");
    REFUSE("beta: must be", NULL, "--beta", "-0.1");
    REFUSE("vllm_importance_sampling_clip_min (5) must be less than", NULL, "--vllm-importance-sampling-clip-min", "5");
    REFUSE("generation_batch_size: 16 and steps_per_generation 1 disagree", "derived for 2 rank(s)",
           "--generation-batch-size", "16", "--steps-per-generation", "1");
    REFUSE("generation_batch_size: 12 must be divisible by per_device_train_batch_size (8)", NULL,
           "--generation-batch-size", "12");
    REFUSE("per_device_train_batch_size: 6 completions x 1 steps_per_generation", "num_generations (4)",
           "--per-device-train-batch-size", "6", "--num-generations", "4");
    // TRL's rule holds for the whole batch (12 over 2 ranks is divisible by 4) but each rank needs whole groups.
    {
        const char *const f[] = {"--per-device-train-batch-size", "6", "--num-generations", "4"};
        refuse_flags(__LINE__, 2, "not divisible by num_generations (4)", "each rank generates whole groups", f, 4);
    }
    // A reward weight that is not finite (only reachable programmatically).
    CHECK(parse(&c, err, sizeof err, REQUIRED, "--reward-weights", "1", NULL) == 0);
    c.reward_weights[0] = INFINITY;
    CHECK(train_config_finalize(&c, 1, err, sizeof err) < 0 && strstr(err, "reward_weights: item 0 is not finite"));
    train_config_free(&c);

    // Accepted batch shapes: steps_per_generation 2 with 4 completions a micro-step and groups of 8.
    CHECK(parse(&c, err, sizeof err, REQUIRED, "--per-device-train-batch-size", "4", "--num-generations", "8",
                "--steps-per-generation", "2", NULL) == 0);
    CHECK(train_config_finalize(&c, 3, err, sizeof err) == 0);
    CHECK(c.resolved_steps_per_generation == 2 && c.resolved_generation_batch_size == 24);
    train_config_free(&c);
    CHECK(parse(&c, err, sizeof err, REQUIRED, "--per-device-train-batch-size", "4", "--num-generations", "4",
                "--generation-batch-size", "32", NULL) == 0);
    CHECK(train_config_finalize(&c, 2, err, sizeof err) == 0);
    CHECK(c.resolved_steps_per_generation == 4 && c.resolved_generation_batch_size == 32);
    train_config_free(&c);
}

static char *slurp(FILE *f) {
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    size_t got = fread(s, 1, (size_t)n, f);
    s[got] = '\0';
    return s;
}

static void test_help_and_doc(void) {
    FILE *f = tmpfile();
    train_config_print_help(f);
    char *help = slurp(f);
    fclose(f);
    TrainConfig d;
    train_config_default(&d);
    for (size_t i = 0; i < train_options_count; i++) {
        const OptionSpec *o = &train_options[i];
        if (o->flags & OPTF_ALIAS) continue;
        char flag[128], def[256], line[512];
        snprintf(flag, sizeof flag, "--%s", o->key);
        for (char *p = flag + 2; *p; p++)
            if (*p == '_') *p = '-';
        train_option_format(&d, o, def, sizeof def);
        snprintf(line, sizeof line, "(default: %s)", def);
        const char *at = strstr(help, flag);
        if (!at || !strstr(at, line) || !o->help || !strstr(help, o->help)) {
            fprintf(stderr, "help lacks %s with %s\n", flag, line);
            failures++;
        }
    }
    CHECK(strstr(help, "--learning-rate FLOAT  (default: 1e-06)"));
    // Defaults as a person writes them: 60 and 300 seconds, not 6e+01 and 3e+02.
    CHECK(strstr(help, "--reward-timeout FLOAT  (default: 60)"));
    CHECK(strstr(help, "--reward-connect-timeout FLOAT  (default: 10)"));
    CHECK(strstr(help, "--init-timeout FLOAT  (default: 300)"));
    CHECK(strstr(help, "--comm-timeout FLOAT  (default: 600)"));
    CHECK(strstr(help, "--adam-beta2 FLOAT  (default: 0.999)"));
    CHECK(strstr(help, "--max-staleness INT  (default: 0)"));
    CHECK(strstr(help, "--adam-epsilon FLOAT  (default: 1e-08)"));
    CHECK(!strstr(help, "e+0"));
    CHECK(strstr(help, "--loss-type grpo|bnpo|dr_grpo|dapo|cispo|sapo|luspo|vespo  (default: dapo)"));
    train_config_free(&d);
    free(help);

    // docs/configuration.md carries the generated tables verbatim (regenerate with
    // build/tests/trainer_config_tool --markdown when the table changes).
    f = tmpfile();
    train_config_print_markdown(f);
    char *md = slurp(f);
    fclose(f);
    FILE *doc = fopen("docs/configuration.md", "rb");
    CHECK(doc != NULL);
    if (doc) {
        char *text = slurp(doc);
        fclose(doc);
        if (!strstr(text, md)) {
            fprintf(stderr, "docs/configuration.md is out of date with the option table\n");
            failures++;
        }
        // And the fate of every TRL key (build/tests/trainer_config_tool --trl-markdown).
        FILE *tf = tmpfile();
        train_config_print_trl_markdown(tf);
        char *trl = slurp(tf);
        fclose(tf);
        if (!strstr(text, trl)) {
            fprintf(stderr, "docs/configuration.md is out of date with the TRL key table\n");
            failures++;
        }
        free(trl);
        free(text);
    }
    free(md);
}

// TRL dump conventions: null is TRL's None, the derived generation_batch_size / steps_per_generation pair is
// accepted when it agrees, SFTConfig's names and loss_type "nll" in mode sft, and one report of every rule problem.
static void test_trl_dump_keys(void) {
    char err[4096];
    TrainConfig c;
    CHECK(parse(&c, err, sizeof err, REQUIRED, NULL) == 0);
    const char *json = "{\"data_seed\": null, \"min_p\": null, \"save_total_limit\": null, \"max_length\": null,"
                       " \"completion_only_loss\": null, \"generation_batch_size\": 16, \"steps_per_generation\": 2,"
                       " \"hub_token\": \"<HUB_TOKEN>\", \"report_to\": [], \"model_init_kwargs\": {\"torch_dtype\": "
                       "\"bfloat16\"}, \"learning_rate\": 0, \"weight_decay\": 0}";
    c.data_seed = 5, c.min_p = 0.1, c.save_total_limit = 3;
    CHECK(train_config_apply_json(&c, json, strlen(json), "cfg.json", err, sizeof err) == 0);
    CHECK(c.data_seed == -1 && c.min_p == 0.0 && c.save_total_limit == 0 && c.max_length == 0);
    CHECK(c.completion_only_loss == -1 && c.n_ignored == 3);
    // 16 = 8 per rank x 1 rank x 2 steps: the pair agrees.
    CHECK(train_config_finalize(&c, 1, err, sizeof err) == 0);
    CHECK(c.resolved_generation_batch_size == 16 && c.resolved_steps_per_generation == 2);
    // The same pair over 2 ranks disagrees: refused with what to do.
    CHECK(train_config_finalize(&c, 2, err, sizeof err) < 0 && strstr(err, "derived for 1 rank(s)") &&
          strstr(err, "give only one of them"));
    train_config_free(&c);

    // SFTConfig: loss_type "nll" is the sft loss; its names set the sft options.
    CHECK(parse(&c, err, sizeof err, "--model", "/m", "--train-file", "/d", "--mode", "sft", NULL) == 0);
    json = "{\"loss_type\": \"nll\", \"max_length\": 64, \"truncation_mode\": \"keep_end\", "
           "\"completion_only_loss\": false, \"dataset_text_field\": \"body\", \"packing\": false, "
           "\"assistant_only_loss\": false, \"eos_token\": \"<EOS_TOKEN>\", \"pad_token\": \"<PAD_TOKEN>\"}";
    CHECK(train_config_apply_json(&c, json, strlen(json), "sft.json", err, sizeof err) == 0);
    CHECK(c.loss_type_nll == 1 && c.max_length == 64 && c.truncation_mode == TRUNCATION_KEEP_END);
    CHECK(c.completion_only_loss == 0 && strcmp(c.dataset_text_field, "body") == 0);
    CHECK(train_config_finalize(&c, 1, err, sizeof err) == 0);
    // The same config in grpo mode: nll is refused, naming what to do.
    c.mode = TRAIN_MODE_GRPO;
    CHECK(train_config_finalize(&c, 1, err, sizeof err) < 0 && strstr(err, "loss_type: \"nll\" is SFTConfig's loss") &&
          strstr(err, "--mode sft"));
    train_config_free(&c);

    // Every rule problem in one report, a line each.
    CHECK(parse(&c, err, sizeof err, REQUIRED, "--top-p", "7", "--learning-rate", "-1", "--zero-stage", "9", NULL) ==
          0);
    CHECK(train_config_finalize(&c, 1, err, sizeof err) < 0 && strncmp(err, "3 problems:\n  ", 14) == 0);
    CHECK(strstr(err, "top_p: must be") && strstr(err, "\n  learning_rate: must be") && strstr(err, "zero_stage:"));
    train_config_free(&c);
    // Flags: every problem too.
    CHECK(parse(&c, err, sizeof err, REQUIRED, "--qqq", "1", "--seed", "x", "--fp16", "true", NULL) < 0);
    CHECK(strstr(err, "3 problems:") && strstr(err, "unknown flag --qqq") && strstr(err, "seed (--seed): expected") &&
          strstr(err, "fp16: true is not supported"));
    train_config_free(&c);
}

int main(void) {
    test_defaults();
    test_flags_and_file();
    test_parse_refusals();
    test_finalize_refusals();
    test_help_and_doc();
    test_json_numbers();
    test_trl_dump_keys();
    return check_exit_code("test_trainer_config");
}
