// shared/model.c — model set-up, resident weights and deterministic random initialisation.
#include "shared/model.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int model_init(Model *m, const ModelConfig *cfg, OpsCtx *ops, char *err, size_t err_len) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->ops = ops;
    m->shard = (ModelShard){.rank = 0, .size = 1, .vocab_total = cfg->vocab_size};
    if (layout_build(&m->layout, cfg, err, err_len) != 0) return -1;
    int half = cfg->head_dim / 2;
    float *host = malloc((size_t)half * sizeof(float));
    m->inv_freq = ops_malloc(ops, (size_t)half * sizeof(float));
    if (!host || !m->inv_freq) {
        free(host);
        snprintf(err, err_len, "out of memory for rotary frequencies: %s", ops_error(ops));
        model_free(m);
        return -1;
    }
    config_rope_inv_freq(cfg, host);
    ops_copy_to_device(ops, m->inv_freq, host, (size_t)half * sizeof(float));
    free(host);
    m->attn_scale = 1.0f / sqrtf((float)cfg->head_dim);
    return 0;
}

void model_free(Model *m) {
    if (m->ops) ops_free(m->ops, m->inv_freq);
    layout_free(&m->layout);
    memset(m, 0, sizeof *m);
}

int resident_alloc(ResidentWeights *w, const Model *m, int with_grads, char *err, size_t err_len) {
    memset(w, 0, sizeof *w);
    int n = m->layout.n_units;
    w->n_units = n;
    w->params = calloc((size_t)n, sizeof(void *));
    w->grads = with_grads ? calloc((size_t)n, sizeof(float *)) : NULL;
    if (!w->params || (with_grads && !w->grads)) goto fail;
    size_t es = ops_dtype_size(m->ops);
    for (int u = 0; u < n; u++) {
        w->params[u] = ops_malloc(m->ops, m->layout.unit_numel[u] * es);
        if (!w->params[u]) goto fail;
        if (with_grads) {
            w->grads[u] = ops_malloc(m->ops, m->layout.unit_numel[u] * sizeof(float));
            if (!w->grads[u]) goto fail;
        }
    }
    return 0;
fail:
    snprintf(err, err_len, "out of memory for the model's %zu parameters%s: %s", m->layout.n_params,
             with_grads ? " and gradients" : "", ops_error(m->ops));
    resident_free(w, m);
    return -1;
}

void resident_free(ResidentWeights *w, const Model *m) {
    for (int u = 0; u < w->n_units; u++) {
        if (w->params) ops_free(m->ops, w->params[u]);
        if (w->grads) ops_free(m->ops, w->grads[u]);
    }
    free(w->params);
    free(w->grads);
    memset(w, 0, sizeof *w);
}

void resident_zero_grads(ResidentWeights *w, const Model *m) {
    if (!w->grads) return;
    for (int u = 0; u < w->n_units; u++)
        ops_memset_zero(m->ops, w->grads[u], m->layout.unit_numel[u] * sizeof(float));
}

static const void *resident_acquire(void *user, int unit) { return ((ResidentWeights *)user)->params[unit]; }
static float *resident_grad(void *user, int unit) {
    ResidentWeights *w = user;
    return w->grads ? w->grads[unit] : NULL;
}

UnitSource resident_source(ResidentWeights *w) {
    return (UnitSource){.acquire = resident_acquire, .grad = resident_grad, .user = w};
}

// splitmix64 + Box-Muller: a tiny deterministic generator (same weights on every machine and backend).
static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
static double uniform01(uint64_t *s) { return ((splitmix64(s) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

void model_random_unit_f32(const Model *m, uint64_t seed, float std, int unit, float *host) {
    const Layout *L = &m->layout;
    // Each unit draws from its own stream, so a unit's values do not depend on which other units are made.
    uint64_t state = seed ^ (0xD1B54A32D192ED03ULL * (uint64_t)(unit + 1));
    memset(host, 0, L->unit_numel[unit] * sizeof(float));
    for (int i = 0; i < L->n_tensors; i++) {
        const LayoutTensor *t = &L->tensors[i];
        if (t->unit != unit) continue;
        float *dst = host + t->offset;
        int is_norm = strstr(t->name, "norm.weight") != NULL;
        int is_bias = strstr(t->name, ".bias") != NULL;
        for (size_t j = 0; j < t->numel; j++) {
            if (is_norm) dst[j] = 1.0f;
            else if (is_bias) dst[j] = 0.0f;
            else dst[j] = (float)(std * sqrt(-2.0 * log(uniform01(&state))) * cos(6.283185307179586 * uniform01(&state)));
        }
    }
}

typedef struct {
    const Model *m;
    uint64_t seed;
    float std;
    int unit;
    float *host;
} RandomUnitJob;

static void *random_unit_job(void *arg) {
    const RandomUnitJob *j = arg;
    model_random_unit_f32(j->m, j->seed, j->std, j->unit, j->host);
    return NULL;
}

// Units are drawn on up to RANDOM_INIT_THREADS threads at a time (each unit has its own stream, so the values are
// those of drawing them one by one) and uploaded in order by the calling thread, which owns the ops context. On
// one thread (~35 ns a value) a 1.5B model took most of the ~70 s each GPU benchmark process ran.
#define RANDOM_INIT_THREADS 8

void model_init_random(const Model *m, ResidentWeights *w, uint64_t seed, float std) {
    const Layout *L = &m->layout;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const int T = cores < 1 ? 1 : cores > RANDOM_INIT_THREADS ? RANDOM_INIT_THREADS : (int)cores;
    RandomUnitJob job[RANDOM_INIT_THREADS];
    pthread_t tid[RANDOM_INIT_THREADS];
    for (int u0 = 0; u0 < L->n_units && ops_status(m->ops) == 0; u0 += T) {
        const int n = L->n_units - u0 < T ? L->n_units - u0 : T;
        int started[RANDOM_INIT_THREADS] = {0}, ok = 1;
        for (int k = 0; k < n; k++) {
            job[k] = (RandomUnitJob){m, seed, std, u0 + k, malloc(L->unit_numel[u0 + k] * sizeof(float))};
            if (!job[k].host) ok = 0;
        }
        for (int k = 1; k < n && ok; k++)  // job 0 runs on this thread; a thread that cannot start runs here too
            started[k] = pthread_create(&tid[k], NULL, random_unit_job, &job[k]) == 0;
        if (ok) random_unit_job(&job[0]);
        for (int k = 1; k < n && ok; k++) {
            if (started[k]) pthread_join(tid[k], NULL);
            else random_unit_job(&job[k]);
        }
        for (int k = 0; k < n && ok; k++) ops_upload_f32(m->ops, w->params[u0 + k], job[k].host, L->unit_numel[u0 + k]);
        for (int k = 0; k < n; k++) free(job[k].host);
        if (!ok) {
            ops_set_error(m->ops, -1, __FILE__, __LINE__, "out of host memory for the random init");
            return;
        }
    }
}
