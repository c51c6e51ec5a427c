// rollout_server/model_runner_setup.c — a runner's set-up and tear-down (model_runner.h): compute contexts, the model
// and its weights (sliced into tensor-parallel shards), the step workspace, padded decode steps and their CUDA graphs,
// the KV pool sized from the memory budget, and the shards' threads.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rollout_server/model_runner.h"
#include "rollout_server/model_runner_internal.h"

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// ---- set-up -------------------------------------------------------------------------------------

// Records the decode graph of every ladder size before serving, on padding-only steps (token 0 at position 0 of
// block 0, slot -1: nothing is stored, the outputs are dropped), as vLLM captures its graphs at start-up: otherwise
// the first step at each batch size runs eagerly and records (40-140 ms each on an H100), and a load ramping up to
// 512 sequences met four or five of them. A size that fails here records, or runs eagerly, on its first real step.
// Tensor-parallel shards run these steps in lock-step like real ones (their graphs hold the all-reduces).
static void record_decode_graphs(ModelRunner *r, int top) {
    const double t0 = now_seconds();
    for (int i = 0; i < top; i++) {
        r->tok_ids[i] = 0;
        r->tok_pos[i] = 0;
        r->slots[i] = -1;
        r->tables[i] = 0;
    }
    int ladder[64];
    const int n_ladder = decode_ladder(top, ladder, 64);
    char err[512] = "";
    int failed = 0;
    for (int k = 0; k < n_ladder; k++) {
        r->plan = (RunnerStepPlan){.n = ladder[k], .n_seqs = ladder[k], .mb = 1, .n_rows = ladder[k], .padded = 1};
        if (runner_shards_run(r, SHARD_JOB_STEP, err, sizeof err) != 0) {
            failed++;
            for (int s = 0; s < r->tp; s++) ops_clear_error(r->shards[s].ops);
        }
    }
    for (int s = 0; s < r->tp; s++) {
        OpsCtx *o = r->shards[s].ops;
        ops_synchronize(o);
        if (ops_status(o)) {
            snprintf(err, sizeof err, "%s", ops_error(o));
            ops_clear_error(o);
            failed = failed ? failed : 1;
        }
    }
    DecodeGraphStats g;
    decode_bufs_graph_stats(r->shards[0].bufs, &g);
    r->graph_logged = g.recordings + g.failures;
    if (failed || g.failures)
        fprintf(stderr, "tandem-serve: recording the decode graphs at start-up failed for %d of %d batch sizes (%s); "
                        "they record on their first step instead\n", failed > g.failures ? failed : (int)g.failures,
                n_ladder, err[0] ? err : g.last_error);
    fprintf(stderr, "tandem-serve: %d decode graphs recorded in %.2f s\n", g.graphs, now_seconds() - t0);
}

// Decode-only steps on the GPU: padded to the ladder of batch sizes and replayed as CUDA graphs (recorded on the
// first step of each size). With --enforce-eager they run eagerly at the same padded sizes, which keeps their
// numbers identical to the graphs'. On the CPU nothing is padded: there is no launch cost to save.
static int set_up_padded(ModelRunner *r, const EngineConfig *cfg, char *err, size_t err_len) {
    if (cfg->backend != OPS_BACKEND_CUDA || cfg->cuda_graph_max_batch <= 0) return 0;
    char msg[512];
    int top = 0;
    for (int k = 0; k < r->tp; k++) {
        RunnerShard *s = &r->shards[k];
        if ((top = decode_bufs_enable_padded(s->bufs, &s->m, cfg->cuda_graph_max_batch, !cfg->enforce_eager, msg,
                                             sizeof msg)) < 0) {
            snprintf(err, err_len, "%s (lower --cuda-graph-max-batch)", msg);
            return ENGINE_ENOMEM;
        }
    }
    int ladder[64];
    const int n_ladder = decode_ladder(top, ladder, 64);
    char sizes[512];
    size_t used = 0;
    for (int i = 0; i < n_ladder && used < sizeof sizes; i++)
        used += (size_t)snprintf(sizes + used, sizeof sizes - used, "%s%d", i ? ", " : "", ladder[i]);
    fprintf(stderr, "tandem-serve: decode-only steps of up to %d sequences are padded to batch sizes %s and %s\n", top,
            sizes,
            decode_bufs_graphs_on(r->shards[0].bufs)
                ? (r->tp > 1 ? "replayed as CUDA graphs holding the tensor-parallel all-reduces (recorded now)"
                             : "replayed as CUDA graphs (recorded now)")
            : cfg->enforce_eager ? "run eagerly (--enforce-eager)"
            : r->tp > 1 && !comm_graph_capable(r->shards[0].comm)
                ? "run eagerly (the shards' communicator cannot be recorded into CUDA graphs)"
                : "run eagerly (CUDA graphs are off while profile_ops times each op)");
    return 0;
}

// Blocks of shard s's KV pool that the memory budget holds (--kv-cache-memory: bytes per device; or what
// --gpu-memory-utilization leaves on its device). Returns 0 or an ENGINE_* code with a message.
static int shard_kv_blocks(ModelRunner *r, RunnerShard *s, const EngineConfig *cfg, size_t *n_blocks,
                           const char **budget_flag, char *err, size_t err_len) {
    size_t kv_bytes = cfg->kv_cache_bytes;
    *budget_flag = "--kv-cache-memory";
    const size_t weights = s->m.layout.n_params * ops_dtype_size(s->ops);
    if (cfg->gpu_memory_utilization > 0) {
        size_t free_b, total_b;
        if (ops_memory_info(s->ops, &free_b, &total_b) != 0) {
            snprintf(err, err_len, "--gpu-memory-utilization needs a CUDA device (this engine runs on the %s); use "
                     "--kv-cache-memory", cfg->backend == OPS_BACKEND_CUDA ? "GPU but its memory cannot be read" : "CPU");
            ops_clear_error(s->ops);
            return ENGINE_EINVAL;
        }
        // Everything in use now (our weights and workspace, other processes) counts against the fraction; the rest
        // goes to the KV pool, less the NCCL weight copy and a margin for the sampler, cuBLAS and NCCL. With shards,
        // each shard's NCCL copy holds its own slice of every unit.
        const size_t copy = cfg->reserve_weight_copy ? weights : 0;
        const size_t margin = (size_t)512 << 20;
        const double allowed = cfg->gpu_memory_utilization * (double)total_b;
        const double used = (double)(total_b - free_b);
        const double left = allowed - used - (double)margin - (double)copy;
        kv_bytes = left > 0 ? (size_t)left : 0;
        *budget_flag = "--gpu-memory-utilization";
        fprintf(stderr, "tandem-serve: %s%d: GPU memory %.1f GiB, %.0f %% allowed = %.1f GiB; in use %.1f GiB (weights "
                        "%.2f GiB, workspace, others), weight-update copy %.2f GiB, margin 0.5 GiB -> KV pool %.2f GiB\n",
                r->tp > 1 ? "shard " : "device ", r->tp > 1 ? s->index : cfg->device, total_b / 1073741824.0,
                cfg->gpu_memory_utilization * 100, allowed / 1073741824.0, used / 1073741824.0,
                weights / 1073741824.0, copy / 1073741824.0, kv_bytes / 1073741824.0);
    }
    *n_blocks = kv_bytes / kv_cache_bytes_per_block(&s->m, cfg->block_size);
    return 0;
}

// The KV pool: as many blocks as the memory budget holds on every shard (the same block ids on each). Each step
// writes up to max_num_batched_tokens tokens (or a whole context, if shorter), so a pool smaller than that is a
// configuration mistake. Returns 0 or an ENGINE_* code with a message.
static int size_kv_pool(ModelRunner *r, const EngineConfig *cfg, char *err, size_t err_len) {
    const char *budget_flag = "--kv-cache-memory";
    size_t n_blocks = SIZE_MAX;
    for (int k = 0; k < r->tp; k++) {
        size_t nb;
        const int rc = shard_kv_blocks(r, &r->shards[k], cfg, &nb, &budget_flag, err, err_len);
        if (rc != 0) return rc;
        if (nb < n_blocks) n_blocks = nb;
    }
    const int bs = cfg->block_size, max_len = runner_model(r)->cfg.max_seq_len;
    const size_t per_block = kv_cache_bytes_per_block(&r->shards[0].m, bs);
    const int step_tokens = cfg->max_num_batched_tokens < max_len ? cfg->max_num_batched_tokens : max_len;
    const size_t min_blocks = ((size_t)step_tokens + bs - 1) / bs;
    if (n_blocks < min_blocks || n_blocks > INT32_MAX / (size_t)bs) {
        snprintf(err, err_len, "the KV pool (%s) of %zu bytes%s holds %zu KV blocks of %d tokens (%zu bytes each), "
                 "but one step of %d tokens needs %zu (%zu bytes): raise %s%s or lower --max-num-batched-tokens",
                 budget_flag, n_blocks * per_block, r->tp > 1 ? " per shard" : "", n_blocks, bs, per_block,
                 step_tokens, min_blocks, min_blocks * per_block, budget_flag,
                 r->tp > 1 ? ", raise --tensor-parallel-size" : "");
        return ENGINE_EINVAL;
    }
    r->n_blocks = (int)n_blocks;
    for (int k = 0; k < r->tp; k++) {
        char msg[512];
        if (kv_cache_create(&r->shards[k].kv, &r->shards[k].m, r->n_blocks, bs, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "%s (lower %s)", msg, budget_flag);
            return ENGINE_ENOMEM;
        }
    }
    const Model *whole = runner_model(r);
    const double weights = (double)r->shards[0].m.layout.n_params * ops_dtype_size(r->ops);
    const long long tokens = (long long)r->n_blocks * bs;
    char shards[64] = "";
    if (r->tp > 1) snprintf(shards, sizeof shards, "%d tensor-parallel shards, on each: ", r->tp);
    fprintf(stderr, "tandem-serve: %sweights %.3f GiB and a KV pool of %d blocks x %d tokens (%.3f GiB): %lld tokens "
                    "in all, the longest context %lld tokens (the model's %d)\n", shards,
            weights / 1073741824.0, r->n_blocks, bs,
            (double)r->n_blocks * per_block / 1073741824.0, tokens,
            tokens < whole->cfg.max_seq_len ? tokens : (long long)whole->cfg.max_seq_len, whole->cfg.max_seq_len);
    return 0;
}

void runner_free(ModelRunner *r) {
    if (!r) return;
    runner_shards_stop(r);
    free(r->tok_ids);
    free(r->tok_seq);
    free(r->tok_pos);
    free(r->slots);
    free(r->tables);
    free(r->rows);
    free(r->score_rows);
    free(r->score_seq);
    free(r->score_pos);
    free(r->logits);
    free(r->samp_params);
    free(r->samp_off);
    free(r->samp_hist);
    free(r->samp_mask);
    free(r->samp_tok);
    free(r->samp_lp);
    free(r->samp_top);
    if (r->ops) {
        ops_free(r->ops, r->d_params);
        ops_free(r->ops, r->d_off);
        ops_free(r->ops, r->d_hist);
        ops_free(r->ops, r->d_mask);
        ops_free(r->ops, r->d_tok);
        ops_free(r->ops, r->d_lp);
    }
    runner_adapters_free(r);
    if (r->have_whole) model_free(&r->whole);
    for (int k = r->shards ? r->tp - 1 : -1; k >= 0; k--) {
        RunnerShard *s = &r->shards[k];
        if (s->bufs) decode_bufs_free(s->bufs, &s->m);
        if (s->kv.k) kv_cache_free(&s->kv, &s->m);
        if (s->comm) comm_destroy(s->comm);
        if (s->have_model) runner_ipc_release(s);   // before the frees: units in ipc regions are not ops_malloc's
        for (int u = 0; s->dstaging && u < s->m.layout.n_units; u++) ops_free(s->ops, s->dstaging[u]);
        free(s->dstaging);
        if (s->have_weights) resident_free(&s->w, &s->m);
        if (s->have_model) model_free(&s->m);
        if (s->ops) ops_destroy(s->ops);
    }
    free(r->shards);
    free(r);
}

// Backend bytes of one shard's weights at tensor-parallel size tp, or 0 when tp does not divide the model.
static size_t shard_weight_bytes(const ModelConfig *mc, int tp, size_t es) {
    ModelConfig sc;
    ModelShard sh;
    Layout L;
    char msg[256];
    if (model_shard_config(mc, 0, tp, &sc, &sh, msg, sizeof msg) != 0 || layout_build(&L, &sc, msg, sizeof msg) != 0)
        return 0;
    const size_t bytes = L.total_numel * es;
    layout_free(&L);
    return bytes;
}

// CUDA: refuses, before anything is allocated, weights that do not fit the free memory of a device (shard
// weights at tp, on ops's device), naming the smallest tensor-parallel size whose shards would fit. Returns 0, or
// ENGINE_ENOMEM with the message.
static int check_weights_fit(const ModelConfig *mc, int tp, OpsCtx *ops, int device, char *err, size_t err_len) {
    size_t free_b, total_b;
    if (ops_memory_info(ops, &free_b, &total_b) != 0) {
        ops_clear_error(ops);   // the CPU backend: host memory, nothing to say in advance
        return 0;
    }
    const size_t es = ops_dtype_size(ops), need = shard_weight_bytes(mc, tp, es);
    if (need == 0 || need < free_b) return 0;
    int fits = 0;
    for (int n = tp + 1; n <= 64 && !fits; n++) {
        const size_t b = shard_weight_bytes(mc, n, es);
        if (b && b < free_b * 9 / 10) fits = n;   // a tenth left for the step workspace and the KV pool
    }
    char hint[160];
    if (fits)
        snprintf(hint, sizeof hint, "the smallest --tensor-parallel-size whose shards fit is %d (%.2f GiB each)", fits,
                 shard_weight_bytes(mc, fits, es) / 1073741824.0);
    else
        snprintf(hint, sizeof hint, "no --tensor-parallel-size up to 64 that divides this model fits");
    snprintf(err, err_len, "the model's weights need %.2f GiB per GPU at --tensor-parallel-size %d, but cuda:%d has "
             "%.2f GiB free (of %.2f): %s", need / 1073741824.0, tp, device, free_b / 1073741824.0,
             total_b / 1073741824.0, hint);
    return ENGINE_ENOMEM;
}

// --load-format random's weights: one fixed seed, so that every server of a shape serves the same random model.
#define RANDOM_WEIGHTS_SEED 0x7A4D3E5Bu

// Contexts, shard models and weights of a tensor-parallel runner: shard k on device cfg->device + k (CPU: a context
// each), the whole model described on shard 0, the folder read once and sliced. Returns 0 or an ENGINE_* code.
static int load_shards(ModelRunner *r, const EngineConfig *cfg, char *err, size_t err_len) {
    char msg[768];
    ModelConfig mc;
    if (config_load(&mc, cfg->model_dir, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "cannot load the model from %s: %s", cfg->model_dir, msg);
        return ENGINE_EINVAL;
    }
    ModelConfig probe;
    ModelShard probe_shard;
    if (model_shard_config(&mc, 0, r->tp, &probe, &probe_shard, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "%s: %s (--tensor-parallel-size)", cfg->model_dir, msg);
        return ENGINE_EINVAL;
    }
    Model *models[64];
    ResidentWeights *weights[64];
    for (int k = 0; k < r->tp; k++) {
        RunnerShard *s = &r->shards[k];
        s->index = k;
        s->runner = r;
        const int device = cfg->backend == OPS_BACKEND_CUDA ? cfg->device + k : cfg->device;
        if (ops_create_with_settings(&s->ops, cfg->backend, device, &cfg->ops, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "cannot start the %s backend for tensor-parallel shard %d (device %d): %s",
                     cfg->backend == OPS_BACKEND_CUDA ? "cuda" : "cpu", k, device, msg);
            return ENGINE_EINTERNAL;
        }
        const int fit = check_weights_fit(&mc, r->tp, s->ops, device, err, err_len);
        if (fit != 0) return fit;
        if (model_init_shard(&s->m, &mc, k, r->tp, s->ops, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "tensor-parallel shard %d: %s", k, msg);
            return ENGINE_EINVAL;
        }
        s->have_model = 1;
        if (resident_alloc(&s->w, &s->m, 0, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "tensor-parallel shard %d (device %d): %s (this model needs more tensor-parallel "
                     "shards, or GPUs with more memory)", k, device, msg);
            return ENGINE_ENOMEM;
        }
        s->have_weights = 1;
        s->src = resident_source(&s->w);
        models[k] = &s->m;
        weights[k] = &s->w;
    }
    r->ops = r->shards[0].ops;
    if (model_init(&r->whole, &mc, r->ops, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "%s", msg);
        return ENGINE_ENOMEM;
    }
    r->have_whole = 1;
    for (int k = 0; cfg->load_random && k < r->tp; k++)
        if (model_fill_random(models[k], &r->whole.layout, weights[k], RANDOM_WEIGHTS_SEED, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "tensor-parallel shard %d: %s", k, msg);
            return ENGINE_EINTERNAL;
        }
    if (!cfg->load_random &&
        model_load_shard_weights(&r->whole, models, weights, r->tp, cfg->model_dir, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "cannot load the model from %s: %s", cfg->model_dir, msg);
        return ENGINE_EINVAL;
    }
    return 0;
}

// One plain model: its folder's weights, or (--load-format random) random ones of its config.
static int load_one(RunnerShard *s, const EngineConfig *cfg, char *msg, size_t msg_len) {
    if (!cfg->load_random) return model_load(&s->m, &s->w, s->ops, cfg->model_dir, msg, msg_len);
    ModelConfig mc;
    if (config_load(&mc, cfg->model_dir, msg, msg_len) != 0 || model_init(&s->m, &mc, s->ops, msg, msg_len) != 0)
        return -1;
    if (resident_alloc(&s->w, &s->m, 0, msg, msg_len) != 0) {
        model_free(&s->m);
        return -1;
    }
    if (model_fill_random(&s->m, &s->m.layout, &s->w, RANDOM_WEIGHTS_SEED, msg, msg_len) != 0) {
        resident_free(&s->w, &s->m);
        model_free(&s->m);
        return -1;
    }
    return 0;
}

int runner_create(ModelRunner **out, const EngineConfig *cfg, char *err, size_t err_len) {
    *out = NULL;
    if (cfg->load_random)
        fprintf(stderr, "tandem-serve: --load-format random: random weights of %s/config.json, no weight file read\n",
                cfg->model_dir);
    const int tp = cfg->tensor_parallel_size > 0 ? cfg->tensor_parallel_size : 1;
    if (tp > 64) return snprintf(err, err_len, "--tensor-parallel-size %d: at most 64 shards", tp), ENGINE_EINVAL;
    ModelRunner *r = calloc(1, sizeof *r);
    if (!r || !(r->shards = calloc((size_t)tp, sizeof *r->shards))) {
        free(r);
        return snprintf(err, err_len, "out of memory"), ENGINE_ENOMEM;
    }
    r->tp = tp;
    r->comm_backend = cfg->backend == OPS_BACKEND_CUDA ? COMM_BACKEND_NCCL : COMM_BACKEND_HOST;
    r->block_size = cfg->block_size;
    r->max_num_seqs = cfg->max_num_seqs;
    r->max_num_batched_tokens = cfg->max_num_batched_tokens;
    char msg[768];
    int rc = ENGINE_EINTERNAL;
    if (tp == 1) {
        RunnerShard *s = &r->shards[0];
        if (ops_create_with_settings(&s->ops, cfg->backend, cfg->device, &cfg->ops, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "cannot start the %s backend: %s", cfg->backend == OPS_BACKEND_CUDA ? "cuda" : "cpu",
                     msg);
            goto fail;
        }
        r->ops = s->ops;
        ModelConfig mc;
        if (config_load(&mc, cfg->model_dir, msg, sizeof msg) == 0 &&
            (rc = check_weights_fit(&mc, 1, s->ops, cfg->device, err, err_len)) != 0)
            goto fail;
        rc = ENGINE_EINTERNAL;
        if (load_one(s, cfg, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "cannot load the model from %s: %s", cfg->model_dir, msg);
            rc = ENGINE_EINVAL;
            goto fail;
        }
        s->have_model = s->have_weights = 1;
        s->src = resident_source(&s->w);
    } else if ((rc = load_shards(r, cfg, err, err_len)) != 0) {
        goto fail;
    }
    const Model *whole = runner_model(r);
    r->V = whole->cfg.vocab_size;
    if ((rc = runner_adapters_load(r, cfg, err, err_len)) != 0) goto fail;
    // The shards join their communicator before the padded steps are set up (whether graphs can hold its calls) and
    // before the KV pool is sized (NCCL's buffers take device memory).
    if ((rc = runner_shards_start(r, err, err_len)) != 0) goto fail;
    // Step workspace first, so that --gpu-memory-utilization sees what it takes.
    r->max_blocks = (whole->cfg.max_seq_len + cfg->block_size - 1) / cfg->block_size;
    for (int k = 0; k < tp; k++) {
        RunnerShard *s = &r->shards[k];
        if (decode_bufs_create(&s->bufs, &s->m, cfg->max_num_batched_tokens, cfg->max_num_seqs, r->max_blocks,
                               cfg->max_num_seqs, msg, sizeof msg) != 0) {
            snprintf(err, err_len, "%s (lower --max-num-batched-tokens or --max-num-seqs)", msg);
            rc = ENGINE_ENOMEM;
            goto fail;
        }
    }
    if ((rc = set_up_padded(r, cfg, err, err_len)) != 0 || (rc = size_kv_pool(r, cfg, err, err_len)) != 0) goto fail;
    const size_t T = (size_t)cfg->max_num_batched_tokens, S = (size_t)cfg->max_num_seqs;
    r->tok_ids = malloc(T * sizeof *r->tok_ids);
    r->tok_seq = malloc(T * sizeof *r->tok_seq);
    r->tok_pos = malloc(T * sizeof *r->tok_pos);
    r->slots = malloc(T * sizeof *r->slots);
    r->tables = malloc(S * r->max_blocks * sizeof *r->tables);
    r->rows = malloc(S * sizeof *r->rows);
    r->score_rows = malloc(T * sizeof *r->score_rows);
    r->score_seq = malloc(T * sizeof *r->score_seq);
    r->score_pos = malloc(T * sizeof *r->score_pos);
    r->logits = malloc(S * r->V * sizeof *r->logits);
    int staging = 1;
    for (int k = 0; k < r->tp; k++)
        staging &= (r->shards[k].dstaging = calloc((size_t)whole->layout.n_units, sizeof(void *))) != NULL;
    if (!r->tok_ids || !r->tok_seq || !r->tok_pos || !r->slots || !r->tables || !r->rows || !r->logits ||
        !r->score_rows || !r->score_seq || !r->score_pos ||
        !staging || runner_samp_reserve(r, cfg->max_num_seqs, 0, 0) != 0) {
        snprintf(err, err_len, "out of host memory setting up the engine");
        rc = ENGINE_ENOMEM;
        goto fail;
    }
    if (decode_bufs_graphs_on(r->shards[0].bufs)) record_decode_graphs(r, decode_bufs_padded_max(r->shards[0].bufs));
    *out = r;
    return 0;
fail:
    runner_free(r);
    return rc;
}
