// trainer/trainer.c — setting up one rank of tandem-train, and the pieces both training loops share.
#include "trainer/trainer.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "trainer/grpo_multiturn.h"
#include "trainer/lora_train.h"
#include "trainer/lr_schedule.h"
#include "trainer/make_dirs.h"
#include "shared/err.h"
#include "trainer/metrics_trim.h"
#include "trainer/output_dir.h"
#include "trainer/rank_watch.h"

double trainer_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void log0(const Trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void log0(const Trainer *t, const char *fmt, ...) {
    if (t->rank != 0) return;
    va_list ap;
    va_start(ap, fmt);
    if (isatty(STDERR_FILENO)) fputs("\r\033[K", stderr); // over the progress bar, if one is drawn
    fputs("tandem-train: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

// use_peft: the base loaded whole on every rank and frozen, the adapters initialised from the seed (every rank the
// same), and their optimizer (trainer/lora_train.h) in place of the ZeRO engine.
static int open_lora(Trainer *t, const ModelConfig *mc, char *err, size_t err_len) {
    TrainConfig *cfg = t->cfg;
    LoraConfig lc;
    if (train_config_lora(cfg, &lc, err, err_len) != 0) return -1;
    if (lora_train_create(&t->lora, &t->model, t->dcomm, &lc, cfg->model, (uint64_t)cfg->seed, err, err_len) != 0)
        return -1;
    t->lora_ref = cfg->mode == TRAIN_MODE_GRPO && cfg->grpo.beta != 0;
    LoraTrainMemory mem;
    lora_train_memory(t->lora, &mem);
    char targets[128];
    lora_targets_text(lc.targets, targets, sizeof targets);
    log0(t, "model %s: %s, %zu parameters frozen (%.1f MB resident on each rank); LoRA r %d, alpha %g%s on %s: %zu "
         "trainable parameters (%.2f%%), %.1f MB adapters + %.1f MB fp32 gradients, master and Adam on each rank (the "
         "master and Adam state split by layer over %d rank(s))", cfg->model, mc->arch_name, t->model.layout.n_params, mem.base_bytes / 1e6, lc.r,
         (double)lc.alpha, lc.use_rslora ? " (rsLoRA)" : "", targets, mem.n_adapter_params,
         100.0 * (double)mem.n_adapter_params / (double)t->model.layout.n_params, mem.adapter_bytes / 1e6,
         mem.state_bytes / 1e6, t->world);
    return 0;
}

static int open_model(Trainer *t, char *err, size_t err_len) {
    TrainConfig *cfg = t->cfg;
    ModelConfig mc;
    if (config_load(&mc, cfg->model, err, err_len) != 0) return -1;
    if (model_init(&t->model, &mc, t->ops, err, err_len) != 0) return -1;
    if (cfg->use_peft) return open_lora(t, &mc, err, err_len);
    const int hybrid = cfg->sharding_strategy == SHARDING_HYBRID_SHARD, hpz = cfg->zero_hpz_partition_size > 1;
    if ((hybrid || hpz) && comm_split_nodes(t->dcomm, &t->node_comm, &t->replica_comm, err, err_len) != 0) return -1;
    if (hpz && comm_world_size(t->node_comm) != cfg->zero_hpz_partition_size)
        return err_fail(err, err_len, "zero_hpz_partition_size %d must be the number of ranks per node "
                        "(LOCAL_WORLD_SIZE %d) in this version", cfg->zero_hpz_partition_size,
                        comm_world_size(t->node_comm));
    Comm *shard = hybrid ? t->node_comm : t->dcomm;
    if (hpz ? zero3_create_hpz(&t->policy, &t->model, t->dcomm, t->node_comm, t->replica_comm, err, err_len)
            : zero3_create_sharded(&t->policy, &t->model, shard, hybrid ? t->replica_comm : NULL, cfg->zero_stage,
                                   err, err_len))
        return -1;
    zero3_set_overlap(t->policy, cfg->overlap_comm);
    if (zero3_load(t->policy, cfg->model, err, err_len) != 0) return -1;
    if (cfg->mode == TRAIN_MODE_GRPO && cfg->grpo.beta != 0) {
        // The frozen reference: the same model, sharded the same way, never stepped.
        if (zero3_create_sharded(&t->ref, &t->model, shard, hybrid ? t->replica_comm : NULL, 3, err, err_len) != 0)
            return -1;
        zero3_set_overlap(t->ref, cfg->overlap_comm);
        if (zero3_load(t->ref, cfg->model, err, err_len) != 0) return -1;
    }
    if (!cfg->overlap_comm)
        log0(t, "overlap_comm false: ZeRO all-gathers and reduce-scatters are serialised with compute (no prefetch, "
             "each reduce-scatter finished at once)");
    Zero3Memory mem;
    zero3_memory(t->policy, &mem);
    char over[96];
    if (hybrid)
        snprintf(over, sizeof over, "%d rank(s) of each node, replicated over %d node(s) (HSDP)",
                 comm_world_size(shard), zero3_replicas(t->policy));
    else if (hpz)
        snprintf(over, sizeof over, "%d rank(s), parameters over the %d of each node (hpZ)", t->world,
                 comm_world_size(t->node_comm));
    else
        snprintf(over, sizeof over, "%d rank(s)", t->world);
    log0(t, "model %s: %s, %zu parameters, %d units; ZeRO-%d over %s: per rank %.1f MB parameters, %.1f MB "
         "master, %.1f MB Adam, %.1f MB gradients, %.1f MB gathered units, %.1f MB gradient work (arenas: state "
         "%.1f MB, workspace %.1f MB)",
         cfg->model, mc.arch_name, t->model.layout.n_params, t->model.layout.n_units, cfg->zero_stage, over,
         mem.param_shard_bytes / 1e6, mem.master_bytes / 1e6, mem.adam_bytes / 1e6, mem.grad_bytes / 1e6,
         mem.gathered_bytes / 1e6, mem.grad_work_bytes / 1e6, mem.state_arena_bytes / 1e6, mem.work_arena_bytes / 1e6);
    return 0;
}

// Rank 0 checks --output-dir for an earlier run (trainer/output_dir.h) before anything is loaded, and every rank
// learns the outcome, so that a refusal stops all of them at once.
// replace_earlier: resume auto found nothing to continue, so what an earlier attempt left goes (as with
// --overwrite-output-dir).
static int prepare_output_dir(Trainer *t, int replace_earlier, char *err, size_t err_len) {
    const TrainConfig *cfg = t->cfg;
    int32_t ok = 1;
    char removed[512] = "";
    if (t->rank == 0)
        ok = output_dir_prepare(cfg->output_dir, cfg->resume, cfg->overwrite_output_dir || replace_earlier, removed,
                                sizeof removed, err, err_len) == 0;
    if (comm_broadcast(t->comm, &ok, 1, COMM_I32, 0) != 0) {
        snprintf(err, err_len, "%s", comm_error(t->comm));
        return -1;
    }
    if (!ok) {
        if (t->rank != 0) snprintf(err, err_len, "rank 0 refused --output-dir %s (its message says why)", cfg->output_dir);
        return -1;
    }
    if (removed[0])
        log0(t, "%s: deleted the earlier run's %s from %s", replace_earlier ? "resume auto, nothing to resume from" :
             "--overwrite-output-dir", removed, cfg->output_dir);
    return 0;
}

// resume "auto" (a run that its scheduler restarts, docs/kubernetes.md): "latest" when output_dir holds a complete
// checkpoint, else a start at step 0 that replaces what an attempt stopped before its first checkpoint left there
// (*replace_earlier = 1). Rank 0 looks; every rank learns its answer.
static int resolve_resume_auto(Trainer *t, TrainConfig *cfg, int *replace_earlier, char *err, size_t err_len) {
    *replace_earlier = 0;
    if (!cfg->resume || strcmp(cfg->resume, "auto") != 0) return 0;
    int32_t found = 0;
    char path[PATH_MAX] = "";
    if (t->rank == 0) found = checkpoint_find_latest(cfg->output_dir, path, sizeof path, err, err_len);
    if (comm_broadcast(t->comm, &found, 1, COMM_I32, 0) != 0) {
        snprintf(err, err_len, "%s", comm_error(t->comm));
        return -1;
    }
    if (found < 0) {
        if (t->rank != 0) snprintf(err, err_len, "rank 0 could not look for checkpoints in %s (its message says why)",
                                   cfg->output_dir);
        return -1;
    }
    free(cfg->resume);
    cfg->resume = NULL;
    if (!found) {
        log0(t, "resume auto: no complete checkpoint in %s; starting at step 0", cfg->output_dir);
        *replace_earlier = 1;
        return 0;
    }
    if (!(cfg->resume = strdup("latest"))) return err_fail(err, err_len, "out of memory");
    log0(t, "resume auto: continuing from %s, the latest complete checkpoint", path);
    return 0;
}

// A rank lost before the rendezvous used to cost --init-timeout with no word: the rendezvous says every 10 s
// which ranks it still waits for.
static void print_rendezvous_progress(void *arg, const char *line) {
    (void)arg;
    // The waiting lines name the option that bounds the wait; the node map (rank 0, once everyone is in) is news.
    int waiting = strncmp(line, "node map", 8) != 0;
    fprintf(stderr, "tandem-train: %s%s\n", line, waiting ? " (--init-timeout)" : "");
}

// Opens OUTPUT_DIR/name, a JSONL file of one row per logged step ("step" in each), into *f: created, or, resumed,
// cut back to the rows of steps up to the checkpoint's (the stopped run's later rows would be logged twice).
static int open_step_log(Trainer *t, const char *name, FILE **f, char *err, size_t err_len) {
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/%s", t->cfg->output_dir, name);
    if (t->cfg->resume) {
        MetricsTrim trim;
        if (metrics_trim_after_step(path, t->progress.step, &trim, err, err_len) != 0) return -1;
        if (trim.later || trim.unreadable)
            log0(t, "%s: removed %zu row(s) of steps after %lld and %zu unreadable line(s), left by the run that "
                 "stopped after that checkpoint; kept %zu row(s), and this run logs the later steps again", path,
                 trim.later, (long long)t->progress.step, trim.unreadable, trim.kept);
    }
    if (!(*f = fopen(path, t->cfg->resume ? "a" : "w")))
        return err_fail(err, err_len, "cannot write %s: %s", path, strerror(errno));
    return 0;
}

// checkpoint_load_adapter's reader (every rank): the adapters and their optimizer state.
static int load_adapter(const char *dir, void *arg, char *err, size_t err_len) {
    return lora_train_load(((Trainer *)arg)->lora, dir, err, err_len);
}

// One line for every TRL key the configuration had that tandem accepts without a setting of its own (no effect
// here, or at the one value tandem implements): docs/configuration.md, "TRL keys", says why for each.
static void log_trl_keys(const Trainer *t) {
    const TrainConfig *c = t->cfg;
    if (c->n_ignored == 0) return;
    size_t len = 1;
    for (size_t i = 0; i < c->n_ignored; i++) len += strlen(c->ignored[i]) + 2;
    char *list = malloc(len);
    if (!list) return;
    size_t used = 0;
    for (size_t i = 0; i < c->n_ignored; i++)
        used += (size_t)snprintf(list + used, len - used, "%s%s", i ? ", " : "", c->ignored[i]);
    log0(t, "config: %zu TRL key(s) accepted with no effect on this run (TRL's own machinery, or the value tandem "
         "implements; docs/configuration.md, TRL keys): %s", c->n_ignored, list);
    free(list);
}

int trainer_open(Trainer *t, TrainConfig *cfg, char *err, size_t err_len) {
    memset(t, 0, sizeof *t);
    t->cfg = cfg;
    t->t_start = trainer_now();
    CommInit ci;
    if (comm_init_from_env(&ci, (int)(cfg->init_timeout * 1000), err, err_len) != 0) return -1;
    ci.progress = print_rendezvous_progress;
    t->rank = ci.rank;
    t->world = ci.world_size;
    if (train_config_finalize(cfg, t->world, err, err_len) != 0) return -1;
    log_trl_keys(t);
    // auto: the GPU when one is there (one per rank: LOCAL_RANK picks it). Several CUDA ranks exchange the ZeRO
    // state over NCCL; everything on host memory (rewards, metrics, flags) goes over the host communicator.
    OpsBackend backend = cfg->device == TRAIN_DEVICE_CUDA ||
                                 (cfg->device == TRAIN_DEVICE_AUTO && ops_backend_available(OPS_BACKEND_CUDA))
                             ? OPS_BACKEND_CUDA
                             : OPS_BACKEND_CPU;
    if (backend == OPS_BACKEND_CUDA && t->world > 1 && !comm_backend_available(COMM_BACKEND_NCCL)) {
        if (cfg->device == TRAIN_DEVICE_CUDA) {
            snprintf(err, err_len, "--device cuda with WORLD_SIZE=%d needs NCCL, which this build or machine does not "
                     "have (libnccl.so.2 not found?); run one CUDA rank, or --device cpu", t->world);
            return -1;
        }
        backend = OPS_BACKEND_CPU;
    }
    if (ops_create(&t->ops, backend, ci.local_rank, err, err_len) != 0) return -1;
    if (comm_create(&t->comm, COMM_BACKEND_HOST, &ci, t->ops, err, err_len) != 0) return -1;
    comm_set_timeout(t->comm, (int)(cfg->comm_timeout * 1000));
    t->dcomm = t->comm;
    if (backend == OPS_BACKEND_CUDA && t->world > 1) {
        // The NCCL id travels over the host communicator that just met: no second rendezvous.
        uint8_t id[COMM_UNIQUE_ID_BYTES] = {0};
        int32_t ok = t->rank != 0 || comm_unique_id(COMM_BACKEND_NCCL, id, err, err_len) == 0;
        if (comm_broadcast(t->comm, &ok, 1, COMM_I32, 0) != 0 || !ok) {
            if (t->rank != 0) snprintf(err, err_len, "rank 0 could not make an NCCL id: %s", comm_error(t->comm));
            return -1;
        }
        if (comm_broadcast(t->comm, id, sizeof id, COMM_U8, 0) != 0) {
            snprintf(err, err_len, "%s", comm_error(t->comm));
            return -1;
        }
        if (rank_watch_create(&t->rank_watch, t->comm, t->rank, t->world, err, err_len) != 0) return -1;
        const CommPeerWatch watch = rank_watch_peer_watch(t->rank_watch);
        if (comm_create_with_id_watched(&t->dcomm, COMM_BACKEND_NCCL, id, t->rank, t->world,
                                        (int)(cfg->init_timeout * 1000), &watch, t->ops, err, err_len) != 0) {
            t->dcomm = t->comm;
            return -1;
        }
        comm_set_timeout(t->dcomm, (int)(cfg->comm_timeout * 1000));
        // The same ranks as the host communicator: its node map (from the rendezvous) is the NCCL one's.
        int *nodes = malloc((size_t)t->world * sizeof *nodes);
        if (!nodes) return err_fail(err, err_len, "out of memory for the node map");
        for (int m = 0; m < t->world; m++) nodes[m] = comm_node(t->comm, m);
        comm_set_nodes(t->dcomm, nodes);
        free(nodes);
    }
    // Hybrid layouts (HSDP, hpZ) cut the model otherwise than slice r on rank r, which the NCCL sync sends: their
    // weights go over ZeroMQ (train_config_check.c refuses nccl with them).
    const int hybrid_layout = train_config_hybrid_layout(cfg);
    t->sync.use_ipc = cfg->weight_sync_transport == WEIGHT_SYNC_IPC;
    t->sync.use_nccl = cfg->weight_sync_transport == WEIGHT_SYNC_NCCL ||
                       (cfg->weight_sync_transport == WEIGHT_SYNC_AUTO && backend == OPS_BACKEND_CUDA &&
                        comm_backend_available(COMM_BACKEND_NCCL) && !(hybrid_layout && cfg->mode != TRAIN_MODE_SFT));
    // CPU ranks run transport nccl over the host backend (its CPU twin, trainer/weight_sync.h).
    if (cfg->weight_sync_transport == WEIGHT_SYNC_NCCL && backend == OPS_BACKEND_CUDA &&
        !comm_backend_available(COMM_BACKEND_NCCL)) {
        snprintf(err, err_len, "--weight-sync-transport nccl needs NCCL on CUDA ranks, and this rank's GPU has none; "
                 "use --weight-sync-transport zmq");
        return -1;
    }
    log0(t, "%d rank(s) joined (rendezvous at %s:%d, port from %s), %s backend, ZeRO collectives over %s, weight sync over %s",
         t->world, ci.master_addr, ci.master_port, ci.port_source, backend == OPS_BACKEND_CUDA ? "cuda" : "cpu",
         t->dcomm != t->comm ? "NCCL" : t->world > 1 ? "ZeroMQ" : "nothing (one rank)",
         t->sync.use_ipc    ? (backend == OPS_BACKEND_CUDA ? "CUDA IPC (ipc)" : "shared memory (ipc)")
         : !t->sync.use_nccl ? "ZeroMQ"
         : backend == OPS_BACKEND_CUDA ? "NCCL"
                                       : "the host communicator (nccl's CPU twin)");
    int replace_earlier;
    if (resolve_resume_auto(t, cfg, &replace_earlier, err, err_len) != 0) return -1;
    if (prepare_output_dir(t, replace_earlier, err, err_len) != 0) return -1;
    if (open_model(t, err, err_len) != 0) return -1;
    if (tokenizer_load(&t->tok, cfg->model, err, err_len) != 0) return -1;
    char cerr[512];
    if (chat_template_from_tokenizer(&t->chat, t->tok, cfg->chat_template, cerr, sizeof cerr) != 0) {
        t->chat = NULL; // text prompts still work; a message prompt will name the problem
        if (cfg->chat_template) {
            snprintf(err, err_len, "%s", cerr);
            return -1;
        }
    }
    // Multi-turn tool use: the environment first, since its tools' definitions go into the prompts.
    if (cfg->mode == TRAIN_MODE_GRPO && (cfg->n_tools || cfg->env_url)) {
        if (trainer_open_tools(t, cfg, err, err_len) != 0) return -1;
        const size_t n_defs = json_array_size(env_tool_schemas(t->env));
        if (t->tool_prompt.written)
            log0(t, "tools: %zu tool definition(s) written into message prompts by the %s chat template (as "
                 "apply_chat_template(tools=...))", n_defs, chat_family_name(chat_template_family(t->chat)));
        else
            log0(t, "tools: no tool definitions in the prompts (%s): the prompts must describe the tools themselves",
                 n_defs == 0 ? "the environment service gives none: it does not answer POST <url>/tools"
                             : "the model's chat template has no `tools` block; Qwen2.5, Qwen3, Llama 3.1 and "
                               "Mistral v0.3 templates have one");
    }
    DataOptions dopt = {.tok = t->tok, .chat = t->chat, .render = t->env ? &t->tool_prompt.opt : NULL,
                        .sft = cfg->mode == TRAIN_MODE_SFT,
                        .max_prompt_length = cfg->max_prompt_length,
                        .refuse_overlong = cfg->overlong_prompts == OVERLONG_PROMPTS_ERROR, .rank = t->rank,
                        .world_size = t->world, .seed = (uint64_t)(cfg->data_seed >= 0 ? cfg->data_seed : cfg->seed),
                        .shuffle = cfg->shuffle_dataset, .text_field = cfg->dataset_text_field,
                        .prompt_loss = cfg->completion_only_loss == 0, .max_length = cfg->max_length,
                        .keep_end = cfg->truncation_mode == TRUNCATION_KEEP_END};
    if (data_open(&t->data, cfg->train_file, &dopt, err, err_len) != 0) return -1;
    if (cfg->mode == TRAIN_MODE_GRPO) {
        RewardOptions ro;
        train_config_reward_options(cfg, &ro);
        if (rewards_create(&t->rewards, (const char *const *)cfg->rewards, cfg->n_rewards, &ro, err, err_len) != 0)
            return -1;
        if (cfg->reward_url) {
            RewardServiceOptions so;
            train_config_reward_service_options(cfg, &so);
            if (reward_service_create(&t->reward_service, &so, err, err_len) != 0) return -1;
        }
        if (cfg->n_rewards == 0 && !cfg->reward_url && !cfg->env_url) {
            snprintf(err, err_len, "grpo needs at least one reward: --rewards NAME[,NAME] (built-ins: answer_match, "
                     "regex_format, think_format, length_penalty, soft_overlong) or --reward-url URL");
            return -1;
        }
        if (!cfg->rollout_servers) {
            snprintf(err, err_len, "grpo needs --rollout-servers tcp://HOST:PORT[,...] (tandem-serve --control)");
            return -1;
        }
        if (rollout_client_create(&t->rollout, cfg->rollout_servers, t->model.layout.hash,
                                  (int)(cfg->rollout_timeout * 1000), cfg->control_server_key,
                                  cfg->control_client_key, err, err_len) != 0)
            return -1;
    }
    // Steps: per epoch, every rank consumes per_device_train_batch_size * gradient_accumulation_steps items per
    // optimizer step (grpo: completions, i.e. that / num_generations prompts).
    long per_step = (long)cfg->per_device_train_batch_size * cfg->gradient_accumulation_steps;
    if (cfg->mode == TRAIN_MODE_GRPO) per_step /= cfg->grpo.num_generations;
    long steps_per_epoch = (long)data_shard_records(t->data) / (per_step > 0 ? per_step : 1);
    if (steps_per_epoch < 1) steps_per_epoch = 1;
    t->total_steps = train_config_total_steps(cfg, steps_per_epoch);
    t->steps_per_epoch = steps_per_epoch;
    t->save_every = cfg->save_strategy == SAVE_STRATEGY_EPOCH ? steps_per_epoch
                    : cfg->save_strategy == SAVE_STRATEGY_STEPS ? cfg->save_steps : 0;
    if (cfg->resume) {
        char loaded[PATH_MAX];
        CheckpointOptions co = {.output_dir = cfg->output_dir, .base_model_dir = cfg->model,
                                .data_order_per_rank = cfg->shuffle_dataset};
        if (t->lora ? checkpoint_load_adapter(t->comm, &co, cfg->resume, &t->model, load_adapter, t, &t->progress,
                                              loaded, err, err_len)
                    : checkpoint_load(t->policy, &t->model, t->comm, &co, cfg->resume, &t->progress, loaded, err,
                                      err_len))
            return -1;
        if (data_seek(t->data, (uint64_t)t->progress.epoch, (size_t)t->progress.data_position, err, err_len) != 0)
            return -1;
        log0(t, "resumed from %s at step %lld", loaded, (long long)t->progress.step);
    } else {
        t->progress.rng[0] = (uint64_t)cfg->seed;
        t->progress.rng[1] = 0x9E3779B97F4A7C15ULL;
    }
    if (t->rank == 0) {
        char derr[PATH_MAX + 128];
        if (make_dirs(cfg->output_dir, derr, sizeof derr) != 0) {
            snprintf(err, err_len, "--output-dir: %s", derr);
            return -1;
        }
        if (open_step_log(t, "metrics.jsonl", &t->metrics, err, err_len) != 0) return -1;
        if (cfg->mode == TRAIN_MODE_GRPO && cfg->log_completions &&
            open_step_log(t, "completions.jsonl", &t->completions, err, err_len) != 0)
            return -1;
    }
    log0(t, "%s: %ld optimizer steps, %zu records in %s (%zu on this rank)", cfg->mode == TRAIN_MODE_GRPO ? "grpo" : "sft",
         t->total_steps, data_total_records(t->data), cfg->train_file, data_shard_records(t->data));
    return 0;
}

void trainer_close(Trainer *t) {
    if (t->metrics) fclose(t->metrics);
    if (t->completions) fclose(t->completions);
    if (t->acts) train_acts_free(t->acts, &t->model);
    rollout_client_destroy(t->rollout);
    reward_service_free(t->reward_service);
    env_free(t->env);
    tool_prompt_free(&t->tool_prompt);
    rewards_free(t->rewards);
    data_close(t->data);
    chat_template_free(t->chat);
    tokenizer_free(t->tok);
    zero3_destroy(t->ref);
    zero3_destroy(t->policy);
    lora_train_destroy(t->lora);
    if (t->model.ops) model_free(&t->model);
    weight_sync_free(&t->sync);
    comm_destroy(t->node_comm);
    comm_destroy(t->replica_comm);
    if (t->dcomm && t->dcomm != t->comm) comm_destroy(t->dcomm);
    rank_watch_destroy(t->rank_watch);
    comm_destroy(t->comm);
    ops_destroy(t->ops);
    memset(t, 0, sizeof *t);
}

int trainer_ensure_acts(Trainer *t, int n_tokens, int n_seqs, char *err, size_t err_len) {
    if (t->acts && n_tokens <= t->acts_tokens && n_seqs <= t->acts_seqs) return 0;
    int tokens = n_tokens > t->acts_tokens ? n_tokens : t->acts_tokens;
    int seqs = n_seqs > t->acts_seqs ? n_seqs : t->acts_seqs;
    if (t->acts) train_acts_free(t->acts, &t->model);
    t->acts = NULL;
    const int flags = (t->cfg->gradient_checkpointing ? TRAIN_ACTS_CHECKPOINT : 0) |
                      (t->cfg->keep_logits ? TRAIN_ACTS_KEEP_LOGITS : 0);
    if (train_acts_create(&t->acts, &t->model, tokens, seqs, flags, err, err_len) != 0) return -1;
    // The reference's forward runs with the adapters detached (GRPO with LoRA): they may not have grown with it.
    if (t->lora && lora_train_reserve(t->lora, tokens, err, err_len) != 0) return -1;
    t->acts_tokens = tokens;
    t->acts_seqs = seqs;
    if (t->rank == 0)
        fprintf(stderr, "tandem-train: activation buffers for %d tokens in %d sequences: %.1f MB (%s%.1f MB of it "
                "kept across the recompute: attention inputs and outputs; %.1f MB the batch's logits%s)\n", tokens, seqs,
                train_acts_bytes(t->acts) / 1e6,
                t->cfg->gradient_checkpointing ? "checkpointing per layer; " : "no checkpointing; ",
                train_acts_kept_bytes(t->acts) / 1e6, train_acts_logits_bytes(t->acts) / 1e6,
                t->cfg->keep_logits ? ", --keep-logits false recomputes them in chunks" : "");
    return 0;
}

int trainer_optimizer_step(Trainer *t, float *grad_norm, double *lr, char *err, size_t err_len) {
    TrainConfig *c = t->cfg;
    long step = t->progress.step + 1;
    long warmup = lr_schedule_warmup_steps(c->warmup_steps, c->warmup_ratio, t->total_steps);
    // The learning rate of optimizer step k is the schedule at k - 1 (as transformers' scheduler before its step).
    *lr = lr_schedule_lr(c->lr_scheduler_type, c->learning_rate, step - 1, warmup, t->total_steps);
    AdamWParams p = {.lr = (float)*lr, .beta1 = (float)c->adam_beta1, .beta2 = (float)c->adam_beta2,
                     .eps = (float)c->adam_epsilon, .weight_decay = (float)c->weight_decay,
                     .max_grad_norm = (float)c->max_grad_norm};
    if (t->lora ? lora_train_step(t->lora, &p, p.lr, (int)step, grad_norm, err, err_len)
                : zero3_step(t->policy, &p, p.lr, (int)step, grad_norm, err, err_len))
        return -1;
    t->progress.step = step;
    return 0;
}

int trainer_save(Trainer *t, char *err, size_t err_len) {
    uint64_t epoch;
    size_t pos;
    data_tell(t->data, &epoch, &pos);
    return trainer_save_at(t, epoch, pos, err, err_len);
}

UnitSource trainer_policy_source(Trainer *t) {
    return t->lora ? lora_train_source(t->lora) : zero3_source(t->policy);
}

// checkpoint_save_adapter's writer (rank 0): the adapters as a PEFT folder, and with lora_save_merged the merged
// model in dir/merged.
static int save_adapter(const char *dir, void *arg, char *err, size_t err_len) {
    Trainer *t = arg;
    if (lora_train_save(t->lora, dir, t->cfg->model, err, err_len) != 0) return -1;
    if (!t->cfg->lora_save_merged) return 0;
    char merged[PATH_MAX + 16];
    snprintf(merged, sizeof merged, "%s/merged", dir);
    if (lora_train_save_merged(t->lora, merged, err, err_len) != 0) return -1;
    return checkpoint_copy_tokenizer(t->cfg->model, merged, err, err_len);
}

int trainer_logs_step(const Trainer *t, long step) {
    return step % t->cfg->logging_steps == 0 || step == t->total_steps || (t->cfg->logging_first_step && step == 1);
}

int trainer_saves_step(const Trainer *t, long step) { return t->save_every > 0 && step % t->save_every == 0; }

int trainer_save_at(Trainer *t, uint64_t epoch, size_t pos, char *err, size_t err_len) {
    t->progress.epoch = (int64_t)epoch;
    t->progress.data_position = (int64_t)pos;
    CheckpointOptions co = {.output_dir = t->cfg->output_dir, .base_model_dir = t->cfg->model,
                            .keep_last = t->cfg->save_total_limit};
    char saved[PATH_MAX];
    // LoRA: rank 0, which writes, first collects the adapters' state from the ranks that hold it.
    if (t->lora && lora_train_collect(t->lora, err, err_len) != 0) return -1;
    const int rc = t->lora ? checkpoint_save_adapter(t->comm, &co, &t->progress, &t->model, save_adapter, t, saved, err,
                                                     err_len)
                           : checkpoint_save(t->policy, &t->model, t->comm, &co, &t->progress, saved, err, err_len);
    if (t->lora) lora_train_release(t->lora);
    if (rc != 0) return -1;
    log0(t, "saved %s", saved);
    return 0;
}

int trainer_next_row(Trainer *t, DataRow *row, char *err, size_t err_len) {
    for (int tries = 0; tries < 2; tries++) {
        int r = data_next(t->data, row, err, err_len);
        if (r != 0) return r;
        uint64_t epoch;
        size_t pos;
        data_tell(t->data, &epoch, &pos);
        if (data_seek(t->data, epoch + 1, 0, err, err_len) != 0) return -1;
    }
    snprintf(err, err_len, "%s: this rank's shard has no usable prompt (all over --max-prompt-length?)", t->cfg->train_file);
    return -1;
}

void trainer_progress(Trainer *t) {
    if (t->rank != 0 || !isatty(STDERR_FILENO)) return;
    const int width = 30;
    long done = t->progress.step, total = t->total_steps > 0 ? t->total_steps : 1;
    double elapsed = trainer_now() - t->t_start, eta = done > 0 ? elapsed / done * (total - done) : 0;
    char bar[64];
    int fill = (int)(width * done / total);
    for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
    bar[width] = 0;
    fprintf(stderr, "\r[%s] step %ld/%ld  %.0f%%  elapsed %dm%02ds  ETA %dm%02ds ", bar, done, total, 100.0 * done / total,
            (int)elapsed / 60, (int)elapsed % 60, (int)eta / 60, (int)eta % 60);
    fflush(stderr);
}

void trainer_log(Trainer *t, json_t *m) {
    if (t->rank != 0) {
        json_decref(m);
        return;
    }
    if (isatty(STDERR_FILENO)) fputs("\r\033[K", stderr); // the log line replaces the progress bar
    json_object_set_new(m, "step", json_integer(t->progress.step));
    // TRL's (the Trainer's) epoch: passes over the data so far, fractional.
    json_object_set_new(m, "epoch", json_real((double)t->progress.step / (double)t->steps_per_epoch));
    json_object_set_new(m, "elapsed", json_real(trainer_now() - t->t_start));
    // Several nodes: rank 0's ZeRO traffic (policy and reference, checkpoint gathers included) since the previous
    // row, split by whether it crossed the node boundary. One node has nothing to split, and its rows stay
    // comparable across world sizes and resumes.
    if (t->policy && comm_node_count(t->dcomm) > 1) {
        CommBytes pb = {0}, rb = {0};
        zero3_comm_bytes(t->policy, &pb);
        if (t->ref) zero3_comm_bytes(t->ref, &rb);
        CommBytes now = {pb.intra_node + rb.intra_node, pb.inter_node + rb.inter_node};
        json_object_set_new(m, "comm/bytes_intra_node", json_integer((json_int_t)(now.intra_node - t->logged_bytes.intra_node)));
        json_object_set_new(m, "comm/bytes_inter_node", json_integer((json_int_t)(now.inter_node - t->logged_bytes.inter_node)));
        t->logged_bytes = now;
    }
    char *line = json_dumps(m, JSON_COMPACT | JSON_REAL_PRECISION(7));
    if (line && t->metrics) {
        fprintf(t->metrics, "%s\n", line);
        fflush(t->metrics);
    }
    free(line);
    fprintf(stderr, "step %lld/%ld", (long long)t->progress.step, t->total_steps);
    const char *keys[] = {"loss", "reward", "reward_std", "kl", "grad_norm", "learning_rate",
                          "completions/mean_length", "step_time"};
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
        json_t *v = json_object_get(m, keys[i]);
        if (v && json_is_number(v)) fprintf(stderr, "  %s %.4g", keys[i], json_number_value(v));
    }
    fputc('\n', stderr);
    json_decref(m);
}
