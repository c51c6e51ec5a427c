// rollout_server/engine_group.c — several engines behind one front end: creation, routing, control fan-out, the
// weight commit to every engine, aggregated statistics (see engine_group.h).
#include "rollout_server/engine_group.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shared/model_lora.h"

struct EngineGroup {
    int n;
    Engine *engines[ENGINE_GROUP_MAX];
    char names[ENGINE_GROUP_MAX][32];
    pthread_mutex_t mu;                     // guards the two arrays below
    int64_t outstanding[ENGINE_GROUP_MAX];  // completions submitted and not yet released, per engine
    int64_t routed[ENGINE_GROUP_MAX];       // requests routed to each engine
};

// ---- devices ------------------------------------------------------------------------------------

void engine_device_name(const EngineDevice *d, char *out, size_t cap) {
    if (d->backend == OPS_BACKEND_CUDA) snprintf(out, cap, "cuda:%d", d->device);
    else snprintf(out, cap, "cpu");
}

// One entry of a --devices list, [s, s + len).
static int parse_device(const char *s, size_t len, EngineDevice *d, char *err, size_t err_len) {
    char buf[32];
    if (len == 0 || len >= sizeof buf)
        return snprintf(err, err_len, "an entry is %s", len == 0 ? "empty" : "too long"), -1;
    memcpy(buf, s, len);
    buf[len] = 0;
    const char *num = NULL;
    if (strcmp(buf, "cpu") == 0) {
        *d = (EngineDevice){OPS_BACKEND_CPU, 0};
        return 0;
    }
    if (strcmp(buf, "cuda") == 0) {
        *d = (EngineDevice){OPS_BACKEND_CUDA, 0};
        return 0;
    }
    num = strncmp(buf, "cuda:", 5) == 0 ? buf + 5 : buf;
    char *end;
    errno = 0;
    long v = strtol(num, &end, 10);
    if (!*num || *end || errno || num[0] == '-' || num[0] == '+' || v > 1023)
        return snprintf(err, err_len, "'%s' is not a device (expected cpu, cuda, cuda:N or N, with N in 0..1023)",
                        buf), -1;
    *d = (EngineDevice){OPS_BACKEND_CUDA, (int)v};
    return 0;
}

int engine_devices_parse(const char *list, EngineDevice *out, int max, char *err, size_t err_len) {
    int n = 0;
    const char *s = list ? list : "";
    for (;;) {
        const char *comma = strchr(s, ',');
        size_t len = comma ? (size_t)(comma - s) : strlen(s);
        if (n == max) return snprintf(err, err_len, "more than %d devices", max), -1;
        if (parse_device(s, len, &out[n], err, err_len) != 0) return -1;
        if (n > 0 && out[n].backend != out[0].backend)
            return snprintf(err, err_len, "entries mix the CPU and CUDA devices; list only one kind"), -1;
        n++;
        if (!comma) break;
        s = comma + 1;
    }
    return n;
}

// ---- create / destroy ---------------------------------------------------------------------------

int engine_group_create(EngineGroup **out, const EngineConfig *cfg, const EngineDevice *devs, int n_devs, char *err,
                        size_t err_len) {
    *out = NULL;
    if (n_devs < 1 || n_devs > ENGINE_GROUP_MAX)
        return snprintf(err, err_len, "%d devices: between 1 and %d are possible", n_devs, ENGINE_GROUP_MAX),
               ENGINE_EINVAL;
    EngineGroup *g = calloc(1, sizeof *g);
    if (!g) return snprintf(err, err_len, "out of memory"), ENGINE_ENOMEM;
    pthread_mutex_init(&g->mu, NULL);
    for (int i = 0; i < n_devs; i++) {
        EngineConfig c = *cfg;
        c.backend = devs[i].backend;
        c.device = devs[i].device;
        engine_device_name(&devs[i], g->names[i], sizeof g->names[i]);
        char msg[1024];
        msg[0] = 0;
        int rc = engine_create(&g->engines[i], &c, msg, sizeof msg);
        if (rc == 0 && i > 0 &&
            engine_model(g->engines[i])->layout.hash != engine_model(g->engines[0])->layout.hash) {
            snprintf(msg, sizeof msg, "the model folder %s changed while the engines loaded it (another layout)",
                     cfg->model_dir);
            engine_destroy(g->engines[i], 0);
            rc = ENGINE_EINVAL;
        }
        if (rc != 0) {
            g->engines[i] = NULL;
            // One engine: its message as it is (the single-device server's wording).
            if (n_devs == 1) snprintf(err, err_len, "%s", msg[0] ? msg : "unknown error");
            else snprintf(err, err_len, "engine %d on device %s: %s", i, g->names[i], msg[0] ? msg : "unknown error");
            g->n = i;
            engine_group_destroy(g, 0);
            return rc;
        }
        g->n = i + 1;
    }
    *out = g;
    return 0;
}

// One drain deadline for all: each engine gets what is left of drain_timeout_ms when its turn comes (by then the
// front ends have drained, so the engines are idle or about to be).
void engine_group_destroy(EngineGroup *g, int drain_timeout_ms) {
    if (!g) return;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < g->n; i++) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        const long long spent = (t.tv_sec - t0.tv_sec) * 1000LL + (t.tv_nsec - t0.tv_nsec) / 1000000;
        engine_destroy(g->engines[i], drain_timeout_ms > spent ? (int)(drain_timeout_ms - spent) : 0);
    }
    pthread_mutex_destroy(&g->mu);
    free(g);
}

int engine_group_size(const EngineGroup *g) { return g->n; }
Engine *engine_group_engine(EngineGroup *g, int i) { return i >= 0 && i < g->n ? g->engines[i] : NULL; }
const char *engine_group_device_name(const EngineGroup *g, int i) { return i >= 0 && i < g->n ? g->names[i] : "?"; }
const Model *engine_group_model(const EngineGroup *g) { return engine_model(g->engines[0]); }
const Tokenizer *engine_group_tokenizer(const EngineGroup *g) { return engine_tokenizer(g->engines[0]); }
const char *engine_group_model_id(const EngineGroup *g) { return engine_model_id(g->engines[0]); }
int engine_group_adapter_count(const EngineGroup *g) { return engine_adapter_count(g->engines[0]); }
const char *engine_group_adapter_name(const EngineGroup *g, int k) { return engine_adapter_name(g->engines[0], k); }

int64_t engine_group_policy_version(const EngineGroup *g) {
    int64_t v = engine_policy_version(g->engines[0]);
    for (int i = 1; i < g->n; i++) {
        int64_t w = engine_policy_version(g->engines[i]);
        if (w < v) v = w;
    }
    return v;
}

// ---- routing ------------------------------------------------------------------------------------

int engine_group_submit(EngineGroup *g, const int32_t *prompt, int prompt_len, const SamplingParams *p,
                        EngineRequest **out, int *engine, char *err, size_t err_len) {
    *out = NULL;
    *engine = -1;
    const int64_t w = p && p->n > 0 ? p->n : 1;
    unsigned char tried[ENGINE_GROUP_MAX] = {0};
    int first_rc = 0;
    for (int attempt = 0; attempt < g->n; attempt++) {
        // Pick and count in one step, so that concurrent submissions spread instead of all seeing the same minimum.
        pthread_mutex_lock(&g->mu);
        int k = -1;
        for (int i = 0; i < g->n; i++)
            if (!tried[i] && (k < 0 || g->outstanding[i] < g->outstanding[k])) k = i;
        g->outstanding[k] += w;
        pthread_mutex_unlock(&g->mu);
        tried[k] = 1;
        char msg[512];
        msg[0] = 0;
        int rc = engine_submit(g->engines[k], prompt, prompt_len, p, out, msg, sizeof msg);
        pthread_mutex_lock(&g->mu);
        if (rc == 0) g->routed[k]++;
        else g->outstanding[k] -= w;
        pthread_mutex_unlock(&g->mu);
        if (rc == 0) {
            *engine = k;
            return 0;
        }
        if (first_rc == 0) {
            first_rc = rc;
            snprintf(err, err_len, "%s", msg);
        }
        // Only a lack of room is particular to one engine; anything else every engine would answer alike.
        if (rc != ENGINE_EQUEUE_FULL && rc != ENGINE_ETOOLONG) break;
    }
    return first_rc;
}

void engine_group_release(EngineGroup *g, EngineRequest *r, int engine, int n) {
    if (!r) return;
    engine_request_release(r);
    if (engine < 0 || engine >= g->n) return;
    pthread_mutex_lock(&g->mu);
    g->outstanding[engine] -= n > 0 ? n : 1;
    pthread_mutex_unlock(&g->mu);
}

// ---- control ------------------------------------------------------------------------------------

void engine_group_pause(EngineGroup *g) {
    for (int i = 0; i < g->n; i++) engine_pause(g->engines[i]);
}

void engine_group_resume(EngineGroup *g) {
    for (int i = 0; i < g->n; i++) engine_resume(g->engines[i]);
}

void engine_group_reset_prefix_cache(EngineGroup *g) {
    for (int i = 0; i < g->n; i++) engine_reset_prefix_cache(g->engines[i]);
}

void engine_group_abort_requests(EngineGroup *g) {
    for (int i = 0; i < g->n; i++) engine_abort_requests(g->engines[i]);
}

int engine_group_wait_idle(EngineGroup *g, int timeout_ms) {
    for (int i = 0; i < g->n; i++)
        if (!engine_wait_idle(g->engines[i], timeout_ms)) return 0;
    return 1;
}

// Pauses the engines that are not paused already (a peer's pause stays in force afterwards); was[i] says which
// were. The pause and resume requests come from the one control thread that also commits, so nothing changes
// the pause state in between.
static void pause_for_commit(EngineGroup *g, unsigned char *was) {
    for (int i = 0; i < g->n; i++) {
        EngineStats s;
        engine_stats(g->engines[i], &s);
        was[i] = s.paused != 0;
        if (!was[i]) engine_pause(g->engines[i]);
    }
}

static void resume_after_commit(EngineGroup *g, const unsigned char *was) {
    for (int i = 0; i < g->n; i++)
        if (!was[i]) engine_resume(g->engines[i]);
}

// After engine k failed a commit: which engines hold the new version now.
static void commit_failed(EngineGroup *g, int k, int64_t version, const char *msg, char *err, size_t err_len) {
    char done[256] = "";
    size_t at = 0;
    for (int i = 0; i < g->n; i++)
        if (i != k && engine_policy_version(g->engines[i]) == version && at + 8 < sizeof done)
            at += (size_t)snprintf(done + at, sizeof done - at, "%s%d", at ? ", " : "", i);
    snprintf(err, err_len, "engine %d (%s): %s; engines serving version %lld now: %s", k, g->names[k], msg,
             (long long)version, at ? done : "none");
}

void *engine_group_weights_staging(EngineGroup *g, int unit) { return engine_weights_staging(g->engines[0], unit); }

int engine_group_weights_staging_bf16(const EngineGroup *g) { return engine_weights_staging_bf16(g->engines[0]); }

// Adds engine k's commit report to the group's.
static void add_report(EngineCommitReport *total, const EngineCommitReport *k) {
    total->sequences_kept += k->sequences_kept;
    total->sequences_requeued += k->sequences_requeued;
}

int engine_group_commit_weights(EngineGroup *g, int64_t version, EngineUpdateMode mode, EngineCommitReport *rep,
                                char *err, size_t err_len) {
    EngineCommitReport total = {0}, one;
    if (rep) *rep = total;
    if (g->n == 1) return engine_commit_weights(g->engines[0], version, mode, rep, err, err_len);
    const Layout *L = &engine_model(g->engines[0])->layout;
    unsigned char was[ENGINE_GROUP_MAX];
    pause_for_commit(g, was);
    char msg[512];
    int rc = 0, k;
    // Engines n-1 .. 1 each get a copy of engine 0's staging, which their commit uploads and frees (so at most
    // one copy exists beside the received one); engine 0's own commit then takes the received one.
    for (k = g->n - 1; k >= 1 && rc == 0; k--) {
        for (int u = 0; u < L->n_units; u++) {
            const void *src = engine_weights_staging(g->engines[0], u);
            void *dst = engine_weights_staging(g->engines[k], u);
            if (!src || !dst) {
                snprintf(msg, sizeof msg, "out of host memory for the copy of unit %d", u);
                rc = ENGINE_ENOMEM;
                break;
            }
            memcpy(dst, src, L->unit_numel[u] * ops_dtype_size(engine_ops(g->engines[0])));
        }
        if (rc == 0 && (rc = engine_commit_weights(g->engines[k], version, mode, &one, msg, sizeof msg)) == 0)
            add_report(&total, &one);
        if (rc) break;
    }
    if (rc == 0 && (rc = engine_commit_weights(g->engines[0], version, mode, &one, msg, sizeof msg)) != 0) k = 0;
    else if (rc == 0) add_report(&total, &one);
    if (rc) commit_failed(g, k, version, msg, err, err_len);
    resume_after_commit(g, was);
    if (rep) *rep = total;
    return rc;
}

// Engine 0's device staging of adapter units (units of numel elements) copied into every other engine's.
static int spread_adapter_staging(EngineGroup *g, size_t numel, char *err, size_t err_len) {
    OpsCtx *src_ops = engine_ops(g->engines[0]);
    const size_t bytes = numel * ops_dtype_size(src_ops);
    for (int k = 1; k < g->n; k++)
        for (int layer = 0; layer < engine_model(g->engines[0])->cfg.num_layers; layer++) {
            const void *src = engine_adapter_device_staging(g->engines[0], numel, layer);
            void *dst = engine_adapter_device_staging(g->engines[k], numel, layer);
            char msg[512];
            if (!src || !dst)
                return snprintf(err, err_len, "engine %d (%s) has no device memory for layer %d's adapter units",
                                src ? k : 0, g->names[src ? k : 0], layer), -1;
            if (ops_copy_peer(engine_ops(g->engines[k]), dst, src_ops, src, bytes, msg, sizeof msg) != 0)
                return snprintf(err, err_len, "copying layer %d's adapter units from engine 0 (%s) to engine %d (%s): "
                                "%s", layer, g->names[0], k, g->names[k], msg), -1;
        }
    return 0;
}

int engine_group_commit_adapter(EngineGroup *g, int64_t version, const struct LoraConfig *c, float *const *units,
                                EngineUpdateMode mode, EngineCommitReport *rep, char *err, size_t err_len) {
    EngineCommitReport total = {0}, one;
    if (rep) *rep = total;
    if (!units && spread_adapter_staging(g, model_lora_unit_numel(&engine_model(g->engines[0])->cfg, c), err,
                                         err_len) != 0)
        return ENGINE_ENOMEM;
    unsigned char was[ENGINE_GROUP_MAX];
    pause_for_commit(g, was);
    char msg[512];
    int rc = 0, k;
    for (k = 0; k < g->n && rc == 0; k++)
        if ((rc = engine_commit_adapter(g->engines[k], version, c, units, mode, &one, msg, sizeof msg)) == 0)
            add_report(&total, &one);
    if (rc) commit_failed(g, k - 1, version, msg, err, err_len);
    resume_after_commit(g, was);
    if (rep) *rep = total;
    return rc;
}

int engine_group_device_staging_ready(EngineGroup *g, int *engine, int *shard, int *unit) {
    for (int i = 0; i < g->n; i++)
        for (int k = 0; k < engine_tp(g->engines[i]); k++)
            for (int u = 0; u < engine_shard_model(g->engines[i], k)->layout.n_units; u++)
                if (!engine_weights_device_staging(g->engines[i], k, u)) {
                    *engine = i;
                    *shard = k;
                    *unit = u;
                    return -1;
                }
    return 0;
}

int engine_group_spread_device_staging(EngineGroup *g, char *err, size_t err_len) {
    for (int k = 1; k < g->n; k++)
        for (int sh = 0; sh < engine_tp(g->engines[0]); sh++) {
            const Layout *L = &engine_shard_model(g->engines[0], sh)->layout;
            OpsCtx *src_ops = engine_shard_ops(g->engines[0], sh), *dst_ops = engine_shard_ops(g->engines[k], sh);
            const size_t es = ops_dtype_size(src_ops);
            for (int u = 0; u < L->n_units; u++) {
                const void *src = engine_weights_device_staging(g->engines[0], sh, u);
                void *dst = engine_weights_device_staging(g->engines[k], sh, u);
                char msg[512];
                if (!src || !dst)
                    return snprintf(err, err_len, "engine %d (%s) has no device staging for unit %d of shard %d",
                                    src ? k : 0, g->names[src ? k : 0], u, sh), -1;
                if (ops_copy_peer(dst_ops, dst, src_ops, src, L->unit_numel[u] * es, msg, sizeof msg) != 0)
                    return snprintf(err, err_len, "copying unit %d (shard %d) from engine 0 (%s) to engine %d (%s): %s",
                                    u, sh, g->names[0], k, g->names[k], msg), -1;
            }
        }
    return 0;
}

int engine_group_commit_device_weights(EngineGroup *g, int64_t version, EngineUpdateMode mode,
                                       EngineCommitReport *rep, char *err, size_t err_len) {
    EngineCommitReport total = {0}, one;
    if (rep) *rep = total;
    if (g->n == 1) return engine_commit_device_weights(g->engines[0], version, mode, rep, err, err_len);
    unsigned char was[ENGINE_GROUP_MAX];
    pause_for_commit(g, was);
    int rc = 0;
    for (int k = 0; k < g->n && rc == 0; k++) {
        char msg[512];
        if ((rc = engine_commit_device_weights(g->engines[k], version, mode, &one, msg, sizeof msg)) != 0)
            commit_failed(g, k, version, msg, err, err_len);
        else
            add_report(&total, &one);
    }
    resume_after_commit(g, was);
    if (rep) *rep = total;
    return rc;
}

// ---- statistics ---------------------------------------------------------------------------------

void engine_group_stats(EngineGroup *g, EngineStats *total, EngineMemberStats *per) {
    memset(total, 0, sizeof *total);
    for (int i = 0; i < g->n; i++) {
        EngineStats s;
        engine_stats(g->engines[i], &s);
        total->requests_waiting += s.requests_waiting;
        total->requests_running += s.requests_running;
        total->sequences_running += s.sequences_running;
        total->kv_blocks_total += s.kv_blocks_total;
        total->kv_blocks_used += s.kv_blocks_used;
        total->kv_blocks_cached += s.kv_blocks_cached;
        total->prompt_tokens_total += s.prompt_tokens_total;
        total->generation_tokens_total += s.generation_tokens_total;
        total->cached_prompt_tokens_total += s.cached_prompt_tokens_total;
        total->preemptions_total += s.preemptions_total;
        total->steps_total += s.steps_total;
        total->step_seconds_sum += s.step_seconds_sum;
        total->step_compute_seconds_sum += s.step_compute_seconds_sum;
        for (int k = 0; k < 3; k++) {
            total->steps_by_kind[k] += s.steps_by_kind[k];
            total->compute_seconds_by_kind[k] += s.compute_seconds_by_kind[k];
        }
        for (size_t b = 0; b < sizeof s.step_seconds_buckets / sizeof s.step_seconds_buckets[0]; b++)
            total->step_seconds_buckets[b] += s.step_seconds_buckets[b];
        total->weight_updates_total += s.weight_updates_total;
        total->weight_update_sequences_kept_total += s.weight_update_sequences_kept_total;
        total->weight_update_sequences_requeued_total += s.weight_update_sequences_requeued_total;
        total->weight_update_pause_seconds_sum += s.weight_update_pause_seconds_sum;
        for (size_t b = 0; b < sizeof s.weight_update_pause_buckets / sizeof s.weight_update_pause_buckets[0]; b++)
            total->weight_update_pause_buckets[b] += s.weight_update_pause_buckets[b];
        for (int k = 0; k < LATENCY_KINDS; k++) latency_add(&total->latency[k], &s.latency[k]);
        for (int f = 0; f <= FINISH_ERROR; f++) total->completions_finished[f] += s.completions_finished[f];
        if (i == 0 || s.policy_version < total->policy_version) total->policy_version = s.policy_version;
        total->paused |= s.paused != 0;
        if (per) {
            per[i].stats = s;
            pthread_mutex_lock(&g->mu);
            per[i].requests_routed = g->routed[i];
            per[i].outstanding = g->outstanding[i];
            pthread_mutex_unlock(&g->mu);
        }
    }
}
