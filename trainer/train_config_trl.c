// trainer/train_config_trl.c — the fate of every key of TRL's GRPOConfig and SFTConfig (and of the transformers
// TrainingArguments they extend) that is not one of tandem-train's options, so that a whole
// `GRPOConfig(...).to_json_string()` / `SFTConfig(...)` dump loads as TRL wrote it:
//   no effect   the key configures TRL's or transformers' own machinery (vLLM launch, dataloader workers, Hub
//               credentials, progress bars, ...), and what tandem produces is the same whatever its value;
//               accepted with any value;
//   only values the key changes what a run produces and tandem implements only the listed values (TRL's default
//               first); any other value is refused, the message naming the key and what to do instead.
// Every accepted key is listed once in the start-up log. Keys that are tandem options (train_config_table.c) are
// not here; tests/reference/test_train_config_vs_trl.py fails when a TRL field is in neither table.
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/json_read.h"
#include "trainer/train_config_internal.h"

// model_init_kwargs: the loading precision and attention kernel are tandem's own choice (bf16 compute, its own
// attention); anything else (revision, quantization, ...) would load a different model.
static int model_init_kwargs_ok(const json_t *v) {
    static const char *const precision_only[] = {"torch_dtype", "dtype", "attn_implementation", "device_map",
                                                 "low_cpu_mem_usage", "use_cache", NULL};
    if (json_is_null(v)) return 1;
    if (!json_is_object(v)) return 0;
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)v, key, val) {
        int known = 0;
        for (int i = 0; precision_only[i]; i++) known |= strcmp(key, precision_only[i]) == 0;
        if (!known) return 0;
    }
    return 1;
}

#define NO_EFFECT(k, why) {k, TRL_NO_EFFECT, NULL, NULL, why}
#define ONLY(k, values, why) {k, TRL_ONLY_VALUES, values, NULL, why}

// Sorted as TRL dumps them: TrainingArguments first, then GRPOConfig's and SFTConfig's own keys.
const TrlKey trl_keys[] = {
    // ---- transformers TrainingArguments ----
    ONLY("lr_scheduler_kwargs", "[null, {}]", "schedule arguments are not read; pick lr_scheduler_type, warmup_steps "
         "or warmup_ratio"),
    ONLY("optim_args", "[null]", "AdamW takes adam_beta1, adam_beta2, adam_epsilon and weight_decay; remove optim_args"),
    ONLY("optim_target_modules", "[null]", "GaLore/APOLLO-style optimizers are not implemented (AdamW on every "
         "parameter)"),
    ONLY("average_tokens_across_devices", "[true]", "tandem normalises the loss by the tokens of every rank (true)"),
    ONLY("label_smoothing_factor", "[0, 0.0]", "label smoothing is not implemented"),
    NO_EFFECT("bf16", "tandem computes in bf16 on GPUs and fp32 on CPUs, keeping fp32 master weights, whatever bf16 "
              "says"),
    ONLY("fp16", "[false]", "fp16 mixed precision is not implemented (bf16 on GPUs); remove fp16"),
    NO_EFFECT("bf16_full_eval", "tandem-train does no evaluation"),
    NO_EFFECT("fp16_full_eval", "tandem-train does no evaluation"),
    NO_EFFECT("tf32", "tandem's matmuls choose their own precision within bf16/fp32"),
    NO_EFFECT("activation_checkpointing_kwargs", "options of PyTorch's checkpoint function; tandem recomputes per "
              "layer (gradient_checkpointing)"),
    NO_EFFECT("gradient_checkpointing_kwargs", "options of PyTorch's checkpoint function; tandem recomputes per "
              "layer (gradient_checkpointing)"),
    NO_EFFECT("torch_compile", "tandem runs its own kernels (no PyTorch to compile)"),
    NO_EFFECT("torch_compile_backend", "tandem runs its own kernels (no PyTorch to compile)"),
    NO_EFFECT("torch_compile_mode", "tandem runs its own kernels (no PyTorch to compile)"),
    NO_EFFECT("use_liger_kernel", "Liger's fused kernels compute the same loss; tandem runs its own fused kernels"),
    NO_EFFECT("liger_kernel_config", "Liger's fused kernels compute the same loss; tandem runs its own fused kernels"),
    NO_EFFECT("use_cache", "the KV cache of transformers' forward; the training forward keeps none"),
    ONLY("neftune_noise_alpha", "[null]", "NEFTune embedding noise is not implemented"),
    NO_EFFECT("torch_empty_cache_steps", "PyTorch's allocator cache; tandem allocates its buffers once"),
    ONLY("auto_find_batch_size", "[false]", "batch sizes are never changed behind the user's back; set "
         "per_device_train_batch_size"),
    ONLY("logging_strategy", "[\"steps\"]", "metrics.jsonl gets a row every logging_steps steps (and the last)"),
    NO_EFFECT("log_on_each_node", "rank 0 alone writes the log and metrics.jsonl"),
    NO_EFFECT("logging_nan_inf_filter", "metrics.jsonl holds the values as computed"),
    ONLY("include_num_input_tokens_seen", "[\"no\", false]", "metrics.jsonl has num_tokens (prompt + completion "
         "tokens so far, every rank), TRL's count; num_input_tokens_seen is not written"),
    NO_EFFECT("log_level", "verbosity of transformers' Python logger"),
    NO_EFFECT("log_level_replica", "verbosity of transformers' Python logger"),
    NO_EFFECT("disable_tqdm", "tandem prints log lines, no progress bar"),
    ONLY("report_to", "[[], \"none\", [\"none\"], null]", "no W&B/TensorBoard/trackio writer: tandem writes "
         "OUTPUT_DIR/metrics.jsonl (one JSON object per logged step, TRL's metric names); set report_to to \"none\" "
         "and import that file"),
    NO_EFFECT("run_name", "used by the experiment trackers, which report_to does not enable here"),
    NO_EFFECT("project", "used by the experiment trackers, which report_to does not enable here"),
    NO_EFFECT("trackio_space_id", "used by trackio, which report_to does not enable here"),
    NO_EFFECT("trackio_bucket_id", "used by trackio, which report_to does not enable here"),
    NO_EFFECT("trackio_static_space_id", "used by trackio, which report_to does not enable here"),
    ONLY("eval_strategy", "[\"no\"]", "tandem-train does no evaluation during training; score checkpoints with "
         "tandem-train eval"),
    NO_EFFECT("eval_steps", "tandem-train does no evaluation (eval_strategy \"no\")"),
    NO_EFFECT("eval_delay", "tandem-train does no evaluation (eval_strategy \"no\")"),
    NO_EFFECT("per_device_eval_batch_size", "tandem-train does no evaluation (eval_strategy \"no\")"),
    NO_EFFECT("prediction_loss_only", "tandem-train does no evaluation (eval_strategy \"no\")"),
    ONLY("eval_on_start", "[false]", "tandem-train does no evaluation; score the base model with tandem-train eval"),
    NO_EFFECT("eval_do_concat_batches", "tandem-train does no evaluation (eval_strategy \"no\")"),
    NO_EFFECT("eval_use_gather_object", "tandem-train does no evaluation (eval_strategy \"no\")"),
    NO_EFFECT("eval_accumulation_steps", "tandem-train does no evaluation (eval_strategy \"no\")"),
    NO_EFFECT("include_for_metrics", "tandem-train does no evaluation (eval_strategy \"no\")"),
    NO_EFFECT("batch_eval_metrics", "tandem-train does no evaluation (eval_strategy \"no\")"),
    NO_EFFECT("save_only_model", "checkpoints always hold the optimizer state too, so any of them resumes"),
    NO_EFFECT("save_on_each_node", "rank 0 writes each checkpoint once, to output_dir"),
    ONLY("enable_jit_checkpoint", "[false]", "no checkpoint is written on SIGTERM; lower save_steps and resume "
         "latest"),
    ONLY("push_to_hub", "[false]", "nothing is pushed to the Hugging Face Hub; upload OUTPUT_DIR/checkpoint-N "
         "(a model folder) yourself"),
    NO_EFFECT("hub_token", "push_to_hub is false"),
    NO_EFFECT("hub_private_repo", "push_to_hub is false"),
    NO_EFFECT("hub_model_id", "push_to_hub is false"),
    NO_EFFECT("hub_strategy", "push_to_hub is false"),
    NO_EFFECT("hub_always_push", "push_to_hub is false"),
    NO_EFFECT("hub_revision", "push_to_hub is false"),
    ONLY("load_best_model_at_end", "[false]", "needs evaluation, which tandem-train does not run"),
    NO_EFFECT("metric_for_best_model", "load_best_model_at_end is false"),
    NO_EFFECT("greater_is_better", "load_best_model_at_end is false"),
    ONLY("ignore_data_skip", "[false]", "resume continues the data order exactly where the checkpoint stopped"),
    NO_EFFECT("restore_callback_states_from_checkpoint", "tandem-train has no Python callbacks"),
    NO_EFFECT("full_determinism", "tandem's kernels are deterministic for a given world size and device"),
    NO_EFFECT("use_cpu", "the device is chosen by tandem's device option (auto: the GPU when present)"),
    ONLY("accelerator_config",
         "[{\"split_batches\": false, \"dispatch_batches\": null, \"even_batches\": true, \"use_seedable_sampler\": "
         "true, \"non_blocking\": false, \"gradient_accumulation_kwargs\": null}, null]",
         "Accelerate's batch splitting and dispatching are not used: each rank reads its own shard"),
    ONLY("parallelism_config", "[null]", "context/tensor parallelism is not implemented; tandem shards with ZeRO "
         "(zero_stage, sharding_strategy)"),
    NO_EFFECT("dataloader_drop_last", "an optimizer step always takes whole batches: the records of an epoch that "
              "do not fill one are not trained on that epoch"),
    NO_EFFECT("dataloader_num_workers", "tandem reads its shard in the rank's own thread"),
    NO_EFFECT("dataloader_pin_memory", "tandem reads its shard in the rank's own thread"),
    NO_EFFECT("dataloader_persistent_workers", "tandem reads its shard in the rank's own thread"),
    NO_EFFECT("dataloader_prefetch_factor", "tandem reads its shard in the rank's own thread"),
    NO_EFFECT("dataloader_multiprocessing_context", "tandem reads its shard in the rank's own thread"),
    NO_EFFECT("dataloader_in_order", "tandem reads its shard in the rank's own thread"),
    NO_EFFECT("remove_unused_columns", "every column is kept and handed to the rewards"),
    NO_EFFECT("label_names", "tandem builds the targets itself"),
    ONLY("train_sampling_strategy", "[\"random\"]", "the order is set by shuffle_dataset (false: the file's order)"),
    NO_EFFECT("length_column_name", "train_sampling_strategy is \"random\""),
    NO_EFFECT("ddp_find_unused_parameters", "PyTorch DDP is not used; tandem's ZeRO collectives"),
    NO_EFFECT("ddp_bucket_cap_mb", "PyTorch DDP is not used; tandem's ZeRO collectives"),
    NO_EFFECT("ddp_broadcast_buffers", "PyTorch DDP is not used; tandem's ZeRO collectives"),
    NO_EFFECT("ddp_static_graph", "PyTorch DDP is not used; tandem's ZeRO collectives"),
    NO_EFFECT("ddp_backend", "collectives go over NCCL on GPUs and ZeroMQ otherwise"),
    NO_EFFECT("ddp_timeout", "tandem's timeouts are init_timeout and comm_timeout"),
    NO_EFFECT("fsdp", "parameters, gradients and optimizer state are always sharded (zero_stage, sharding_strategy)"),
    NO_EFFECT("fsdp_config", "parameters, gradients and optimizer state are always sharded (zero_stage, "
              "sharding_strategy)"),
    ONLY("deepspeed", "[null]", "a DeepSpeed config is not read (it may set the optimizer or scheduler); set "
         "zero_stage (and zero_hpz_partition_size) instead"),
    NO_EFFECT("debug", "PyTorch debugging aids"),
    NO_EFFECT("skip_memory_metrics", "PyTorch memory metrics"),
    NO_EFFECT("do_train", "not used by TRL's trainers either"),
    NO_EFFECT("do_eval", "not used by TRL's trainers either"),
    NO_EFFECT("do_predict", "not used by TRL's trainers either"),
    NO_EFFECT("local_rank", "ranks come from RANK / LOCAL_RANK / WORLD_SIZE (torchrun's contract)"),
    NO_EFFECT("trust_remote_code", "tandem runs no model code from the Hub; the architecture is its own"),
    ONLY("router_aux_loss_coef", "[null]", "mixture-of-experts router losses are not implemented"),
    // ---- TRL: both trainers ----
    {"model_init_kwargs", TRL_ONLY_VALUES, "[null]", model_init_kwargs_ok,
     "only loading-precision keys (torch_dtype, dtype, attn_implementation, device_map, low_cpu_mem_usage, "
     "use_cache) are accepted: tandem loads --model DIR in its own precision; a revision, quantization or other "
     "argument would load a different model"},
    NO_EFFECT("disable_dropout", "tandem's models apply no dropout (as disable_dropout true)"),
    NO_EFFECT("pad_to_multiple_of", "batches are packed without padding"),
    NO_EFFECT("activation_offloading", "memory only: tandem keeps activations on the device"),
    // ---- TRL GRPOConfig ----
    ONLY("cast_lm_head_to_fp32", "[false]", "the lm_head runs in the compute precision"),
    NO_EFFECT("num_generations_eval", "tandem-train does no evaluation (eval_strategy \"no\")"),
    NO_EFFECT("ds3_gather_for_generation", "generation runs on the rollout servers, which get whole weights"),
    ONLY("generation_kwargs", "[null, {}]", "sampling takes temperature, top_p, top_k, min_p, repetition_penalty "
         "and max_completion_length only; set those"),
    ONLY("chat_template_kwargs", "[null, {}]", "the chat template is rendered without extra variables "
         "(enable_thinking, ...); bake them into the prompts"),
    NO_EFFECT("cache_implementation", "generation runs on the rollout servers"),
    NO_EFFECT("use_vllm", "generation always runs on tandem's rollout servers (rollout_servers)"),
    NO_EFFECT("vllm_mode", "generation always runs on tandem's rollout servers (rollout_servers)"),
    NO_EFFECT("vllm_model_impl", "generation always runs on tandem's rollout servers"),
    NO_EFFECT("vllm_enable_sleep_mode", "generation always runs on tandem's rollout servers"),
    ONLY("vllm_structured_outputs_regex", "[null]", "constrained decoding during training is not implemented"),
    NO_EFFECT("vllm_server_base_url", "the servers are given by rollout_servers"),
    NO_EFFECT("vllm_server_host", "the servers are given by rollout_servers"),
    NO_EFFECT("vllm_server_port", "the servers are given by rollout_servers"),
    NO_EFFECT("vllm_server_timeout", "rollout_timeout bounds a generation request"),
    NO_EFFECT("vllm_group_port", "weights go over weight_sync_transport"),
    NO_EFFECT("vllm_gpu_memory_utilization", "a tandem-serve option (--gpu-memory-utilization)"),
    NO_EFFECT("vllm_max_model_length", "a tandem-serve option (--max-model-len)"),
    NO_EFFECT("vllm_tensor_parallel_size", "a tandem-serve option"),
    ONLY("sync_ref_model", "[false]", "the reference model stays the initial policy (TR-DPO syncing is not "
         "implemented)"),
    NO_EFFECT("ref_model_mixup_alpha", "sync_ref_model is false"),
    NO_EFFECT("ref_model_sync_steps", "sync_ref_model is false"),
    NO_EFFECT("log_multimodal", "text models only"),
    NO_EFFECT("num_completions_to_print", "console output of TRL; log_completions writes OUTPUT_DIR/completions.jsonl"),
    NO_EFFECT("log_unique_prompts", "a W&B table option; log_completions writes OUTPUT_DIR/completions.jsonl"),
    ONLY("log_completions_hub_repo", "[null]", "nothing is pushed to the Hub; log_completions writes "
         "OUTPUT_DIR/completions.jsonl"),
    NO_EFFECT("use_transformers_continuous_batching", "generation runs on the rollout servers"),
    NO_EFFECT("transformers_continuous_batching_config", "generation runs on the rollout servers"),
    NO_EFFECT("use_transformers_paged", "generation runs on the rollout servers"),
    // ---- TRL SFTConfig ----
    ONLY("chat_template_path", "[null]", "load a template family with chat_template (chatml, qwen3, llama3, ...)"),
    ONLY("dataset_kwargs", "[null, {}]", "the dataset is always prepared by tandem (tokenized, EOS added)"),
    NO_EFFECT("dataset_num_proc", "each rank tokenizes its own shard"),
    ONLY("eos_token", "[\"<EOS_TOKEN>\", null]", "the tokenizer's EOS token ends each completion (TRL would also "
         "write another one into the model's generation config); end the completions with that token's text "
         "yourself, and set it in the model folder's tokenizer and generation config"),
    ONLY("packing", "[false]", "sequences are not packed into max_length blocks (each row is one sequence, with no "
         "padding); remove packing"),
    NO_EFFECT("packing_strategy", "packing is false"),
    NO_EFFECT("padding_free", "batches are always padding-free (sequences concatenated, attention kept within each)"),
    NO_EFFECT("eval_packing", "tandem-train does no evaluation"),
    ONLY("assistant_only_loss", "[false]", "assistant-token masks from the chat template are not implemented; give "
         "prompt/completion rows (the loss is then on the completion only)"),
    NO_EFFECT("pad_token", "batches are packed without padding"),
};
const size_t trl_keys_count = sizeof trl_keys / sizeof trl_keys[0];

const TrlKey *trl_key_find(const char *key) {
    for (size_t i = 0; i < trl_keys_count; i++)
        if (strcmp(trl_keys[i].key, key) == 0) return &trl_keys[i];
    return NULL;
}

// JSON equality with 0 == 0.0 (a dump may write either).
static int same_value(const json_t *a, const json_t *b) {
    if (json_is_number(a) && json_is_number(b)) return json_number_value(a) == json_number_value(b);
    return json_equal((json_t *)a, (json_t *)b);
}

int trl_key_accepts(const TrlKey *k, const json_t *v) {
    if (k->fate == TRL_NO_EFFECT) return 1;
    if (k->accepts && k->accepts(v)) return 1;
    json_t *values = json_read_buffer(k->values, strlen(k->values), 0, NULL);
    int ok = 0;
    for (size_t i = 0; values && i < json_array_size(values) && !ok; i++) ok = same_value(json_array_get(values, i), v);
    json_decref(values);
    return ok;
}

const char *trl_fate_name(TrlFate f) { return f == TRL_NO_EFFECT ? "no effect" : "only values"; }

void train_config_print_trl_markdown(FILE *f) {
    fputs("| TRL key | fate | values accepted | why / what to do |\n|---|---|---|---|\n", f);
    for (size_t i = 0; i < trl_keys_count; i++) {
        const TrlKey *k = &trl_keys[i];
        fprintf(f, "| `%s` | %s | ", k->key, k->fate == TRL_NO_EFFECT ? "accepted, no effect" : "only these values");
        if (k->fate == TRL_NO_EFFECT) {
            fputs("any", f);
        } else {
            // One value per line of the cell, as JSON.
            json_t *values = json_read_buffer(k->values, strlen(k->values), 0, NULL);
            for (size_t j = 0; values && j < json_array_size(values); j++) {
                char *txt = json_dumps(json_array_get(values, j), JSON_ENCODE_ANY | JSON_COMPACT);
                fprintf(f, "%s`%s`", j ? ", " : "", txt ? txt : "?");
                free(txt);
            }
            json_decref(values);
        }
        fprintf(f, " | %s |\n", k->why);
    }
}
