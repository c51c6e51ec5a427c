// trainer/zero3.c — sharded parameters, gradients and AdamW state over a Comm (see trainer/zero3.h).
#include "trainer/zero3.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/safetensors.h"

#define N_SLOTS 3       // stage 3: gathered units alive at once (a layer, the final unit and tied unit 0)
#define N_GRAD_WORK 2   // stages 2-3: full-unit gradients open at once (unit 0 when tied + the current unit)

struct Zero3 {
    Model *m;
    Comm *c;
    OpsCtx *o;
    int stage, rank, world, n_units;
    size_t *padded, *shard;        // per unit: padded numel, slice numel
    size_t max_padded, max_shard;
    float **master, **adam_m, **adam_v, **grad_shard; // (shard) fp32; grad_shard unused in stage 1
    void **param_shard;            // stage 3: (shard) storage dtype
    void **full;                   // stages 1-2: (padded) storage dtype, resident
    float **full_grad;             // stage 1: (padded) fp32, resident
    void *slot[N_SLOTS];           // stage 3: (max_padded) storage dtype
    int slot_unit[N_SLOTS], slot_refs[N_SLOTS];
    uint64_t slot_tick[N_SLOTS], tick;
    float *grad_work[N_GRAD_WORK]; // stages 2-3: (max_padded) fp32
    int grad_work_unit[N_GRAD_WORK];
    float *reduced;                // (max_shard) fp32 reduce-scatter result
    float *sumsq;                  // (1) fp32 backend
};

static CommDtype storage_dtype(const Zero3 *z) { return ops_dtype_size(z->o) == 2 ? COMM_BF16 : COMM_F32; }
static size_t es(const Zero3 *z) { return ops_dtype_size(z->o); }

// Collectives over backend memory. With one rank there is nobody to talk to: the gather is a device-side copy
// (or nothing, in place) and the reduction the identity, so a single GPU needs no collective backend at all.
static int gather(Zero3 *z, void *recv, const void *send, size_t count, CommDtype dtype) {
    if (z->world == 1) {
        if (recv != send) ops_copy(z->o, recv, send, count * comm_dtype_size(dtype));
        return 0;
    }
    return comm_all_gather(z->c, recv, send, count, dtype);
}
static int reduce_scatter(Zero3 *z, void *recv, const void *send, size_t count, CommDtype dtype) {
    if (z->world == 1) {
        ops_copy(z->o, recv, send, count * comm_dtype_size(dtype));
        return 0;
    }
    return comm_reduce_scatter(z->c, recv, send, count, dtype, COMM_SUM);
}
static int all_reduce(Zero3 *z, void *buf, size_t count, CommDtype dtype) {
    return z->world == 1 ? 0 : comm_all_reduce(z->c, buf, count, dtype, COMM_SUM);
}

size_t zero3_shard_offset(const Zero3 *z, int unit) { return (size_t)z->rank * z->shard[unit]; }
size_t zero3_shard_count(const Zero3 *z, int unit) { return z->shard[unit]; }
float *zero3_master_shard(Zero3 *z, int unit) { return z->master[unit]; }
float *zero3_adam_m_shard(Zero3 *z, int unit) { return z->adam_m[unit]; }
float *zero3_adam_v_shard(Zero3 *z, int unit) { return z->adam_v[unit]; }

// This rank's gradient slice of a unit (stage 1 keeps full gradients and slices them).
static float *grad_slice(Zero3 *z, int u) {
    return z->stage == 1 ? z->full_grad[u] + zero3_shard_offset(z, u) : z->grad_shard[u];
}

int zero3_create(Zero3 **out, Model *m, Comm *c, int stage, char *err, size_t err_len) {
    *out = NULL;
    if (stage < 1 || stage > 3) {
        snprintf(err, err_len, "--zero-stage must be 1, 2 or 3 (got %d)", stage);
        return -1;
    }
    Zero3 *z = calloc(1, sizeof *z);
    if (!z) goto oom;
    z->m = m;
    z->c = c;
    z->o = m->ops;
    z->stage = stage;
    z->rank = comm_rank(c);
    z->world = comm_world_size(c);
    int U = z->n_units = m->layout.n_units;
    z->padded = calloc(U, sizeof(size_t));
    z->shard = calloc(U, sizeof(size_t));
    z->master = calloc(U, sizeof(float *));
    z->adam_m = calloc(U, sizeof(float *));
    z->adam_v = calloc(U, sizeof(float *));
    z->grad_shard = calloc(U, sizeof(float *));
    z->param_shard = calloc(U, sizeof(void *));
    z->full = calloc(U, sizeof(void *));
    z->full_grad = calloc(U, sizeof(float *));
    if (!z->padded || !z->shard || !z->master || !z->adam_m || !z->adam_v || !z->grad_shard || !z->param_shard ||
        !z->full || !z->full_grad)
        goto oom;
    for (int u = 0; u < U; u++) {
        z->padded[u] = layout_padded_unit_numel(&m->layout, u, z->world);
        z->shard[u] = z->padded[u] / z->world;
        if (z->padded[u] > z->max_padded) z->max_padded = z->padded[u];
        if (z->shard[u] > z->max_shard) z->max_shard = z->shard[u];
        z->master[u] = ops_malloc(z->o, z->shard[u] * 4);
        z->adam_m[u] = ops_malloc(z->o, z->shard[u] * 4);
        z->adam_v[u] = ops_malloc(z->o, z->shard[u] * 4);
        if (stage == 1) {
            z->full_grad[u] = ops_malloc(z->o, z->padded[u] * 4);
        } else {
            z->grad_shard[u] = ops_malloc(z->o, z->shard[u] * 4);
        }
        if (stage == 3) z->param_shard[u] = ops_malloc(z->o, z->shard[u] * es(z));
        else z->full[u] = ops_malloc(z->o, z->padded[u] * es(z));
        if (ops_status(z->o)) goto oom;
    }
    for (int s = 0; s < N_SLOTS; s++) {
        z->slot_unit[s] = -1;
        if (stage == 3 && !(z->slot[s] = ops_malloc(z->o, z->max_padded * es(z)))) goto oom;
    }
    for (int g = 0; g < N_GRAD_WORK; g++) {
        z->grad_work_unit[g] = -1;
        if (stage != 1 && !(z->grad_work[g] = ops_malloc(z->o, z->max_padded * 4))) goto oom;
    }
    z->reduced = ops_malloc(z->o, z->max_shard * 4);
    z->sumsq = ops_malloc(z->o, 4);
    if (!z->reduced || !z->sumsq) goto oom;
    *out = z;
    return 0;
oom:
    snprintf(err, err_len, "out of memory for ZeRO-%d state (%zu parameters over %d ranks): %s", stage,
             m->layout.n_params, comm_world_size(c), ops_error(m->ops));
    zero3_destroy(z);
    return -1;
}

void zero3_destroy(Zero3 *z) {
    if (!z) return;
    OpsCtx *o = z->o;
    for (int u = 0; u < z->n_units; u++) {
        if (z->master) ops_free(o, z->master[u]);
        if (z->adam_m) ops_free(o, z->adam_m[u]);
        if (z->adam_v) ops_free(o, z->adam_v[u]);
        if (z->grad_shard) ops_free(o, z->grad_shard[u]);
        if (z->param_shard) ops_free(o, z->param_shard[u]);
        if (z->full) ops_free(o, z->full[u]);
        if (z->full_grad) ops_free(o, z->full_grad[u]);
    }
    for (int s = 0; s < N_SLOTS; s++) ops_free(o, z->slot[s]);
    for (int g = 0; g < N_GRAD_WORK; g++) ops_free(o, z->grad_work[g]);
    ops_free(o, z->reduced);
    ops_free(o, z->sumsq);
    free(z->padded);
    free(z->shard);
    free(z->master);
    free(z->adam_m);
    free(z->adam_v);
    free(z->grad_shard);
    free(z->param_shard);
    free(z->full);
    free(z->full_grad);
    free(z);
}

void zero3_memory(const Zero3 *z, Zero3Memory *mem) {
    memset(mem, 0, sizeof *mem);
    for (int u = 0; u < z->n_units; u++) {
        mem->master_bytes += z->shard[u] * 4;
        mem->adam_bytes += 2 * z->shard[u] * 4;
        mem->grad_bytes += (z->stage == 1 ? z->padded[u] : z->shard[u]) * 4;
        if (z->stage == 3) mem->param_shard_bytes += z->shard[u] * es(z);
        else mem->gathered_bytes += z->padded[u] * es(z);
    }
    if (z->stage == 3) mem->gathered_bytes = N_SLOTS * z->max_padded * es(z);
    if (z->stage != 1) mem->grad_work_bytes = N_GRAD_WORK * z->max_padded * 4;
}

// Places one unit's full fp32 values (padded numel, host) into this rank's state.
static void place_unit(Zero3 *z, int u, const float *host) {
    size_t off = zero3_shard_offset(z, u), n = z->shard[u];
    ops_copy_to_device(z->o, z->master[u], host + off, n * 4);
    if (z->stage == 3) ops_upload_f32(z->o, z->param_shard[u], host + off, n);
    else ops_upload_f32(z->o, z->full[u], host, z->padded[u]);
    ops_memset_zero(z->o, z->adam_m[u], n * 4);
    ops_memset_zero(z->o, z->adam_v[u], n * 4);
}

static void invalidate_slots(Zero3 *z) {
    for (int s = 0; s < N_SLOTS; s++) z->slot_unit[s] = -1;
}

int zero3_load(Zero3 *z, const char *model_dir, char *err, size_t err_len) {
    SafetensorsSet *set = NULL;
    if (st_open(&set, model_dir, err, err_len) != 0) return -1;
    int rc = -1;
    float *host = calloc(z->max_padded, sizeof(float));
    if (!host) {
        snprintf(err, err_len, "out of host memory loading %s", model_dir);
        goto out;
    }
    if (model_check_tensors(z->m, set, err, err_len) != 0) goto out;
    for (int u = 0; u < z->n_units; u++) {
        memset(host, 0, z->padded[u] * sizeof(float));
        if (model_read_unit(z->m, set, u, host, err, err_len) != 0) goto out;
        place_unit(z, u, host);
    }
    ops_synchronize(z->o);
    if (ops_status(z->o)) {
        snprintf(err, err_len, "loading %s: %s", model_dir, ops_error(z->o));
        goto out;
    }
    invalidate_slots(z);
    zero3_zero_grad(z);
    rc = 0;
out:
    free(host);
    st_close(set);
    return rc;
}

int zero3_init_random(Zero3 *z, uint64_t seed, float std, char *err, size_t err_len) {
    float *host = calloc(z->max_padded, sizeof(float));
    if (!host) {
        snprintf(err, err_len, "out of host memory for the random init");
        return -1;
    }
    for (int u = 0; u < z->n_units; u++) {
        memset(host, 0, z->padded[u] * sizeof(float));
        model_random_unit_f32(z->m, seed, std, u, host);
        place_unit(z, u, host);
    }
    free(host);
    invalidate_slots(z);
    zero3_zero_grad(z);
    if (ops_status(z->o)) {
        snprintf(err, err_len, "random init: %s", ops_error(z->o));
        return -1;
    }
    return 0;
}

void zero3_zero_grad(Zero3 *z) {
    for (int u = 0; u < z->n_units; u++) {
        if (z->stage == 1) ops_memset_zero(z->o, z->full_grad[u], z->padded[u] * 4);
        else ops_memset_zero(z->o, z->grad_shard[u], z->shard[u] * 4);
    }
    for (int g = 0; g < N_GRAD_WORK; g++) z->grad_work_unit[g] = -1;
}

static int comm_failed(Zero3 *z, const char *what, int unit) {
    ops_set_error(z->o, -1, __FILE__, __LINE__, "%s of unit %d failed: %s", what, unit, comm_error(z->c));
    return -1;
}

// ---- the UnitSource the model reads through -------------------------------------------------------

static const void *src_acquire(void *user, int u) {
    Zero3 *z = user;
    if (z->stage != 3) return z->full[u];
    for (int s = 0; s < N_SLOTS; s++)
        if (z->slot_unit[s] == u) {
            z->slot_refs[s]++;
            z->slot_tick[s] = ++z->tick;
            return z->slot[s];
        }
    // Not gathered: take an empty slot, else the least recently used slot nobody holds.
    int free_slot = -1;
    for (int s = 0; s < N_SLOTS; s++) {
        if (z->slot_refs[s] > 0) continue;
        if (free_slot < 0 || (z->slot_unit[s] < 0 && z->slot_unit[free_slot] >= 0) ||
            (z->slot_unit[free_slot] >= 0 && z->slot_tick[s] < z->slot_tick[free_slot]))
            free_slot = s;
    }
    if (free_slot < 0) {
        ops_set_error(z->o, -1, __FILE__, __LINE__, "ZeRO-3: more than %d units held at once (unit %d)", N_SLOTS, u);
        return NULL;
    }
    comm_wait_compute(z->c);
    if (gather(z, z->slot[free_slot], z->param_shard[u], z->shard[u], storage_dtype(z)) != 0) {
        comm_failed(z, "all-gather", u);
        return NULL;
    }
    comm_compute_wait(z->c);
    z->slot_unit[free_slot] = u;
    z->slot_refs[free_slot] = 1;
    z->slot_tick[free_slot] = ++z->tick;
    return z->slot[free_slot];
}

static void src_release(void *user, int u) {
    Zero3 *z = user;
    if (z->stage != 3) return;
    for (int s = 0; s < N_SLOTS; s++)
        if (z->slot_unit[s] == u && z->slot_refs[s] > 0) {
            z->slot_refs[s]--;
            return;
        }
}

static float *src_grad(void *user, int u) {
    Zero3 *z = user;
    if (z->stage == 1) return z->full_grad[u];
    int free_g = -1;
    for (int g = 0; g < N_GRAD_WORK; g++) {
        if (z->grad_work_unit[g] == u) return z->grad_work[g];
        if (z->grad_work_unit[g] < 0 && free_g < 0) free_g = g;
    }
    if (free_g < 0) {
        ops_set_error(z->o, -1, __FILE__, __LINE__, "ZeRO: more than %d unit gradients open at once (unit %d)",
                      N_GRAD_WORK, u);
        return NULL;
    }
    z->grad_work_unit[free_g] = u;
    ops_memset_zero(z->o, z->grad_work[free_g], z->padded[u] * 4);
    return z->grad_work[free_g];
}

// Backward is done with unit u: reduce-scatter its gradient and add this rank's slice to the accumulator.
static void src_grad_done(void *user, int u) {
    Zero3 *z = user;
    if (z->stage == 1) return;
    for (int g = 0; g < N_GRAD_WORK; g++) {
        if (z->grad_work_unit[g] != u) continue;
        comm_wait_compute(z->c);
        if (reduce_scatter(z, z->reduced, z->grad_work[g], z->shard[u], COMM_F32) != 0) {
            comm_failed(z, "reduce-scatter", u);
            return;
        }
        comm_compute_wait(z->c);
        ops_add_f32(z->o, z->grad_shard[u], z->reduced, z->shard[u]);
        z->grad_work_unit[g] = -1;
        return;
    }
}

UnitSource zero3_source(Zero3 *z) {
    return (UnitSource){.acquire = src_acquire, .release = src_release, .grad = src_grad,
                        .grad_done = src_grad_done, .user = z};
}

// ---- optimizer step -----------------------------------------------------------------------------

int zero3_step(Zero3 *z, const AdamWParams *p, float lr, int step, float *grad_norm, char *err, size_t err_len) {
    OpsCtx *o = z->o;
    if (z->stage == 1) {
        comm_wait_compute(z->c);
        for (int u = 0; u < z->n_units; u++)
            if (all_reduce(z, z->full_grad[u], z->padded[u], COMM_F32) != 0) {
                snprintf(err, err_len, "all-reduce of unit %d's gradient failed: %s", u, comm_error(z->c));
                return -1;
            }
        comm_compute_wait(z->c);
    }
    // Global gradient norm: each rank sums the squares of its slices, then one all-reduce.
    ops_memset_zero(o, z->sumsq, 4);
    for (int u = 0; u < z->n_units; u++) ops_sum_squares(o, z->sumsq, grad_slice(z, u), z->shard[u]);
    comm_wait_compute(z->c);
    if (all_reduce(z, z->sumsq, 1, COMM_F32) != 0) {
        snprintf(err, err_len, "all-reduce of the gradient norm failed: %s", comm_error(z->c));
        return -1;
    }
    comm_compute_wait(z->c);
    float sumsq = 0;
    ops_copy_to_host(o, &sumsq, z->sumsq, 4);
    float norm = sqrtf(sumsq);
    if (grad_norm) *grad_norm = norm;
    // torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1.
    float scale = 1.0f;
    if (p->max_grad_norm > 0) {
        float coef = p->max_grad_norm / (norm + 1e-6f);
        scale = coef < 1.0f ? coef : 1.0f;
    }
    for (int u = 0; u < z->n_units; u++) {
        size_t off = zero3_shard_offset(z, u);
        void *param_out = z->stage == 3 ? z->param_shard[u] : (char *)z->full[u] + off * es(z);
        ops_adamw_step(o, z->master[u], z->adam_m[u], z->adam_v[u], grad_slice(z, u), param_out, z->shard[u], lr,
                       p->beta1, p->beta2, p->eps, p->weight_decay, step, scale);
    }
    if (z->stage != 3) {
        comm_wait_compute(z->c);
        for (int u = 0; u < z->n_units; u++) {
            char *full = z->full[u];
            // In place: this rank's slice sits at its own offset of the receive buffer.
            if (gather(z, full, full + zero3_shard_offset(z, u) * es(z), z->shard[u], storage_dtype(z)) != 0) {
                snprintf(err, err_len, "all-gather of unit %d's parameters failed: %s", u, comm_error(z->c));
                return -1;
            }
        }
        comm_compute_wait(z->c);
    }
    invalidate_slots(z);
    zero3_zero_grad(z);
    ops_synchronize(o);
    if (ops_status(o)) {
        snprintf(err, err_len, "optimizer step %d: %s", step, ops_error(o));
        return -1;
    }
    return 0;
}

int zero3_restore_shard(Zero3 *z, int u, const float *master, const float *m, const float *v) {
    size_t n = z->shard[u];
    ops_copy_to_device(z->o, z->master[u], master, n * 4);
    if (m) ops_copy_to_device(z->o, z->adam_m[u], m, n * 4);
    else ops_memset_zero(z->o, z->adam_m[u], n * 4);
    if (v) ops_copy_to_device(z->o, z->adam_v[u], v, n * 4);
    else ops_memset_zero(z->o, z->adam_v[u], n * 4);
    return ops_status(z->o);
}

int zero3_republish(Zero3 *z, char *err, size_t err_len) {
    float *host = malloc(z->max_shard * sizeof(float));
    if (!host) {
        snprintf(err, err_len, "out of host memory republishing parameters");
        return -1;
    }
    for (int u = 0; u < z->n_units; u++) {
        size_t n = z->shard[u];
        ops_copy_to_host(z->o, host, z->master[u], n * 4);
        if (z->stage == 3) {
            ops_upload_f32(z->o, z->param_shard[u], host, n);
            continue;
        }
        char *full = z->full[u];
        ops_upload_f32(z->o, full + zero3_shard_offset(z, u) * es(z), host, n);
        comm_wait_compute(z->c);
        if (gather(z, full, full + zero3_shard_offset(z, u) * es(z), n, storage_dtype(z)) != 0) {
            snprintf(err, err_len, "all-gather of unit %d's parameters failed: %s", u, comm_error(z->c));
            free(host);
            return -1;
        }
        comm_compute_wait(z->c);
    }
    free(host);
    invalidate_slots(z);
    ops_synchronize(z->o);
    if (ops_status(z->o)) {
        snprintf(err, err_len, "republishing parameters: %s", ops_error(z->o));
        return -1;
    }
    return 0;
}

int zero3_gather_unit_f32(Zero3 *z, int unit, float *host, char *err, size_t err_len) {
    const void *p = src_acquire(z, unit);
    if (!p) {
        snprintf(err, err_len, "gathering unit %d: %s", unit, ops_error(z->o));
        return -1;
    }
    ops_download_f32(z->o, host, p, z->padded[unit]);
    src_release(z, unit);
    ops_synchronize(z->o);
    if (ops_status(z->o)) {
        snprintf(err, err_len, "gathering unit %d: %s", unit, ops_error(z->o));
        return -1;
    }
    return 0;
}
