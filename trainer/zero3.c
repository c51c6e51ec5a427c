// trainer/zero3.c — sharded parameters, gradients and AdamW state over a Comm (see trainer/zero3.h).
#include "trainer/zero3.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/safetensors.h"

// Stage 3 gathers units into slots, one pool per kind of unit so that a small layer never waits behind the
// embedding's size: unit 0 (embedding, also the tied lm_head) and the final unit each get one slot of their
// own, layers share LAYER_SLOTS (the one being computed and the next, all-gathered ahead by prefetch).
// Gradients (stages 2-3, several ranks) use the same pools: unit 0's gradient stays open from the lm_head
// backward to the embedding backward; a layer's reduce-scatter runs on the communication stream while the
// next layer's backward computes, and its result is added to the local slice only when its buffer is needed
// again (or at the optimizer step).
// overlap_comm false (zero3_set_overlap; on by default) turns both overlaps off, for measuring what
// they save (bench/bench_zero3_gpu.py): prefetch hints do nothing, so every all-gather starts when its unit is
// acquired, and every reduce-scatter is finished (compute waits for it, its result added) right after it is
// issued. Results are the same; communication is then serialised with compute.
enum { POOL_EMBED = 0, POOL_FINAL, POOL_LAYER, N_POOLS };
#define LAYER_SLOTS 2
#define MAX_POOL_SLOTS LAYER_SLOTS

typedef struct {
    void *buf;             // (numel) storage dtype
    int unit, refs;
    uint64_t tick;
} ParamSlot;

typedef struct {
    float *buf;            // (numel) fp32: the full-unit gradient while backward accumulates into it
    float *reduced;        // (numel / pworld) fp32: this rank's slice reduce-scattered over pc
    float *cross;          // hpZ: (numel / world) fp32: `reduced` reduce-scattered over xc, this rank's global slice
    int unit;              // open for this unit, or -1
    int pending;           // unit whose reduce-scatter was queued but not yet added, or -1
    int cross_pending;     // hpZ: unit whose reduce-scatter across nodes (reduced -> cross) is queued, or -1
} GradWork;

typedef struct {
    size_t numel;          // padded numel of the largest unit in the pool
    int n;
    ParamSlot slot[MAX_POOL_SLOTS];
    GradWork work[MAX_POOL_SLOTS];
} Pool;

struct Zero3 {
    Model *m;
    Comm *c;                       // the ranks the state is partitioned over (all of them, or one node's: HSDP)
    Comm *rc;                      // HSDP: the replicas of this rank's slices (one rank per node); NULL: none
    // The stage-3 parameters the model gathers: partitioned over pc (pworld ranks, this one prank) in slices of
    // pshard. Flat and HSDP: pc = c, slices as the rest of the state. hpZ: pc = this node's ranks (the secondary
    // copy, pshard = padded / G), and xc = the ranks with this LOCAL_RANK on every node (M of them, this one xrank),
    // over which a node-local slice is cut into the M global slices of the master, Adam and gradient state.
    Comm *pc, *xc;
    int pworld, prank, xrank, owner;  // owner: the index of this rank's global slice (hpZ: prank * M + xrank)
    size_t *pshard;
    CommBytes bytes;               // sent by the collectives issued here (zero3_comm_bytes)
    OpsCtx *o;
    int stage, rank, world, n_units;
    int overlap;                   // 0: communication serialised with compute (zero3_set_overlap)
    size_t *padded, *shard;        // per unit: padded numel, slice numel
    size_t max_padded, max_shard;
    float **master, **adam_m, **adam_v, **grad_shard; // (shard) fp32; grad_shard unused in stage 1
    void **param_shard;            // stage 3: (shard) storage dtype
    void **full;                   // stages 1-2: (padded) storage dtype, resident
    float **full_grad;             // stage 1: (padded) fp32, resident
    Pool pool[N_POOLS];
    uint64_t tick;
    float *sumsq;                  // (1) fp32 backend
    void *state_block, *work_block; // the two arenas every buffer above lives in
    size_t state_bytes, work_bytes;
};

// One backend allocation per purpose — the rank's ZeRO state (kept for the whole run) and its workspace
// (gathered units, gradient buffers) — sized at start-up: the same placement runs twice, first to add up the
// sizes (base NULL), then to hand out pieces of the one block (256-byte aligned).
typedef struct {
    char *base;
    size_t used;
} Arena;

static void *carve(Arena *a, size_t bytes) {
    size_t off = (a->used + 255) & ~(size_t)255;
    a->used = off + bytes;
    return a->base ? a->base + off : NULL;
}

static int pool_of(const Zero3 *z, int u) {
    return u == 0 ? POOL_EMBED : u == z->n_units - 1 ? POOL_FINAL : POOL_LAYER;
}
// With one rank the slice is the whole padded unit: parameters and gradients are used in place, no slots.
static int uses_param_slots(const Zero3 *z) { return z->stage == 3 && z->pworld > 1; }
static int uses_grad_work(const Zero3 *z) { return z->stage != 1 && z->world > 1; }

static CommDtype storage_dtype(const Zero3 *z) { return ops_dtype_size(z->o) == 2 ? COMM_BF16 : COMM_F32; }
static size_t es(const Zero3 *z) { return ops_dtype_size(z->o); }

// Collectives over backend memory. With one rank there is nobody to talk to: the gather is a device-side copy
// (or nothing, in place) and the all-reduce the identity (and one rank never reduce-scatters: backward
// accumulates straight into its slice), so a single GPU needs no collective backend at all.
// Every call below adds what it sent to z->bytes (comm_bytes before and after), so that the trainer can report the
// ZeRO traffic alone, even over a communicator that also carries other collectives.
static int tally(Zero3 *z, Comm *c, CommBytes before, int rc) {
    CommBytes now;
    comm_bytes(c, &now);
    z->bytes.intra_node += now.intra_node - before.intra_node;
    z->bytes.inter_node += now.inter_node - before.inter_node;
    return rc;
}
static int gather_on(Zero3 *z, Comm *c, void *recv, const void *send, size_t count, CommDtype dtype) {
    if (comm_world_size(c) == 1) {
        if (recv != send) ops_copy(z->o, recv, send, count * comm_dtype_size(dtype));
        return 0;
    }
    CommBytes b;
    comm_bytes(c, &b);
    return tally(z, c, b, comm_all_gather(c, recv, send, count, dtype));
}
static int gather(Zero3 *z, void *recv, const void *send, size_t count, CommDtype dtype) {
    return gather_on(z, z->c, recv, send, count, dtype);
}
static int reduce_scatter_on(Zero3 *z, Comm *c, void *recv, const void *send, size_t count, CommDtype dtype) {
    CommBytes b;
    comm_bytes(c, &b);
    return tally(z, c, b, comm_reduce_scatter(c, recv, send, count, dtype, COMM_SUM));
}
static int all_reduce_on(Zero3 *z, Comm *c, void *buf, size_t count, CommDtype dtype) {
    if (!c || comm_world_size(c) == 1) return 0;
    CommBytes b;
    comm_bytes(c, &b);
    return tally(z, c, b, comm_all_reduce(c, buf, count, dtype, COMM_SUM));
}
static int all_reduce(Zero3 *z, void *buf, size_t count, CommDtype dtype) { return all_reduce_on(z, z->c, buf, count, dtype); }
static int replicated(const Zero3 *z) { return z->rc && comm_world_size(z->rc) > 1; }

size_t zero3_shard_offset(const Zero3 *z, int unit) { return (size_t)z->owner * z->shard[unit]; }
size_t zero3_shard_count(const Zero3 *z, int unit) { return z->shard[unit]; }
int zero3_stage(const Zero3 *z) { return z->stage; }

void zero3_set_overlap(Zero3 *z, int on) { z->overlap = on != 0; }
float *zero3_master_shard(Zero3 *z, int unit) { return z->master[unit]; }
float *zero3_adam_m_shard(Zero3 *z, int unit) { return z->adam_m[unit]; }
float *zero3_adam_v_shard(Zero3 *z, int unit) { return z->adam_v[unit]; }
const void *zero3_param_shard(Zero3 *z, int unit) {
    if (z->stage != 3) return (const char *)z->full[unit] + zero3_shard_offset(z, unit) * es(z);
    return (const char *)z->param_shard[unit] + (size_t)z->xrank * z->shard[unit] * es(z);
}

// This rank's gradient slice of a unit (stage 1 keeps full gradients and slices them).
static float *grad_slice(Zero3 *z, int u) {
    return z->stage == 1 ? z->full_grad[u] + zero3_shard_offset(z, u) : z->grad_shard[u];
}

static int create(Zero3 **out, Model *m, Comm *c, Comm *replicas, Comm *node, Comm *cross, int stage, char *err,
                  size_t err_len);

int zero3_create(Zero3 **out, Model *m, Comm *c, int stage, char *err, size_t err_len) {
    return create(out, m, c, NULL, NULL, NULL, stage, err, err_len);
}

int zero3_create_sharded(Zero3 **out, Model *m, Comm *shard, Comm *replicas, int stage, char *err, size_t err_len) {
    return create(out, m, shard, replicas, NULL, NULL, stage, err, err_len);
}

int zero3_create_hpz(Zero3 **out, Model *m, Comm *all, Comm *node, Comm *cross, char *err, size_t err_len) {
    *out = NULL;
    if (!node || !cross || comm_world_size(node) * comm_world_size(cross) != comm_world_size(all)) {
        snprintf(err, err_len, "ZeRO hpZ: %d ranks per node x %d nodes is not the %d ranks", comm_world_size(node),
                 comm_world_size(cross), comm_world_size(all));
        return -1;
    }
    return create(out, m, all, NULL, node, cross, 3, err, err_len);
}

static int create(Zero3 **out, Model *m, Comm *c, Comm *replicas, Comm *node, Comm *cross, int stage, char *err,
                  size_t err_len) {
    *out = NULL;
    if (stage < 1 || stage > 3) {
        snprintf(err, err_len, "--zero-stage must be 1, 2 or 3 (got %d)", stage);
        return -1;
    }
    Zero3 *z = calloc(1, sizeof *z);
    if (!z) goto oom;
    z->overlap = 1;
    z->m = m;
    z->c = c;
    z->rc = replicas;
    z->o = m->ops;
    z->stage = stage;
    z->rank = comm_rank(c);
    z->world = comm_world_size(c);
    z->pc = node ? node : c;
    z->xc = cross;
    z->pworld = comm_world_size(z->pc);
    z->prank = comm_rank(z->pc);
    z->xrank = cross ? comm_rank(cross) : 0;
    z->owner = cross ? z->prank * comm_world_size(cross) + z->xrank : z->rank;
    int U = z->n_units = m->layout.n_units;
    z->padded = calloc(U, sizeof(size_t));
    z->shard = calloc(U, sizeof(size_t));
    z->pshard = calloc(U, sizeof(size_t));
    z->master = calloc(U, sizeof(float *));
    z->adam_m = calloc(U, sizeof(float *));
    z->adam_v = calloc(U, sizeof(float *));
    z->grad_shard = calloc(U, sizeof(float *));
    z->param_shard = calloc(U, sizeof(void *));
    z->full = calloc(U, sizeof(void *));
    z->full_grad = calloc(U, sizeof(float *));
    if (!z->padded || !z->shard || !z->pshard || !z->master || !z->adam_m || !z->adam_v || !z->grad_shard || !z->param_shard ||
        !z->full || !z->full_grad)
        goto oom;
    for (int u = 0; u < U; u++) {
        z->padded[u] = layout_padded_unit_numel(&m->layout, u, z->world);
        z->shard[u] = z->padded[u] / z->world;
        z->pshard[u] = z->padded[u] / z->pworld;
        if (z->padded[u] > z->max_padded) z->max_padded = z->padded[u];
        if (z->shard[u] > z->max_shard) z->max_shard = z->shard[u];
        Pool *pl = &z->pool[pool_of(z, u)];
        if (z->padded[u] > pl->numel) pl->numel = z->padded[u];
    }
    z->pool[POOL_EMBED].n = z->pool[POOL_FINAL].n = 1;
    z->pool[POOL_LAYER].n = U > 2 ? LAYER_SLOTS : 0;
    for (int pass = 0; pass < 2; pass++) {
        Arena st = {pass ? z->state_block : NULL, 0}, wk = {pass ? z->work_block : NULL, 0};
        for (int u = 0; u < U; u++) {
            z->master[u] = carve(&st, z->shard[u] * 4);
            z->adam_m[u] = carve(&st, z->shard[u] * 4);
            z->adam_v[u] = carve(&st, z->shard[u] * 4);
            if (stage == 1) z->full_grad[u] = carve(&st, z->padded[u] * 4);
            else z->grad_shard[u] = carve(&st, z->shard[u] * 4);
            if (stage == 3) z->param_shard[u] = carve(&st, z->pshard[u] * es(z));
            else z->full[u] = carve(&st, z->padded[u] * es(z));
        }
        for (int k = 0; k < N_POOLS; k++) {
            Pool *pl = &z->pool[k];
            for (int i = 0; i < pl->n; i++) {
                pl->slot[i].unit = -1;
                pl->work[i].unit = pl->work[i].pending = pl->work[i].cross_pending = -1;
                if (uses_param_slots(z)) pl->slot[i].buf = carve(&wk, pl->numel * es(z));
                if (uses_grad_work(z)) {
                    pl->work[i].buf = carve(&wk, pl->numel * 4);
                    pl->work[i].reduced = carve(&wk, pl->numel / z->pworld * 4);
                    if (z->xc) pl->work[i].cross = carve(&wk, pl->numel / z->world * 4);
                }
            }
        }
        z->sumsq = carve(&wk, 4);
        if (pass == 0) {
            z->state_bytes = st.used, z->work_bytes = wk.used;
            if (!(z->state_block = ops_malloc(z->o, z->state_bytes)) || !(z->work_block = ops_malloc(z->o, z->work_bytes)))
                goto oom;
        }
    }
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
    ops_free(z->o, z->state_block);
    ops_free(z->o, z->work_block);
    free(z->padded);
    free(z->shard);
    free(z->pshard);
    free(z->master);
    free(z->adam_m);
    free(z->adam_v);
    free(z->grad_shard);
    free(z->param_shard);
    free(z->full);
    free(z->full_grad);
    free(z);
}

int zero3_replicas(const Zero3 *z) { return z->rc ? comm_world_size(z->rc) : 1; }
// On one node HSDP and hpZ cut exactly as flat ZeRO does (no replicas; global slice = rank), so they say so.
void zero3_slicing(const Zero3 *z, char *out, size_t len) {
    if (z->xc && comm_world_size(z->xc) > 1) snprintf(out, len, "hpz:%d", z->pworld);
    else if (replicated(z)) snprintf(out, len, "hybrid_shard:%d", z->world);
    else snprintf(out, len, "full_shard");
}
void zero3_comm_bytes(const Zero3 *z, CommBytes *out) { *out = z->bytes; }

void zero3_memory(const Zero3 *z, Zero3Memory *mem) {
    memset(mem, 0, sizeof *mem);
    for (int u = 0; u < z->n_units; u++) {
        mem->master_bytes += z->shard[u] * 4;
        mem->adam_bytes += 2 * z->shard[u] * 4;
        mem->grad_bytes += (z->stage == 1 ? z->padded[u] : z->shard[u]) * 4;
        if (z->stage == 3) mem->param_shard_bytes += z->pshard[u] * es(z);
        else mem->gathered_bytes += z->padded[u] * es(z);
    }
    mem->state_arena_bytes = z->state_bytes;
    mem->work_arena_bytes = z->work_bytes;
    if (z->stage == 3) mem->gathered_bytes = 0;
    for (int k = 0; k < N_POOLS; k++) {
        const Pool *pl = &z->pool[k];
        if (uses_param_slots(z)) mem->gathered_bytes += pl->n * pl->numel * es(z);
        if (uses_grad_work(z))
            mem->grad_work_bytes += pl->n * (pl->numel + pl->numel / z->pworld + (z->xc ? pl->numel / z->world : 0)) * 4;
    }
}

// Places one unit's full fp32 values (padded numel, host) into this rank's state.
static void place_unit(Zero3 *z, int u, const float *host) {
    size_t off = zero3_shard_offset(z, u), n = z->shard[u];
    ops_copy_to_device(z->o, z->master[u], host + off, n * 4);
    if (z->stage == 3) ops_upload_f32(z->o, z->param_shard[u], host + (size_t)z->prank * z->pshard[u], z->pshard[u]);
    else ops_upload_f32(z->o, z->full[u], host, z->padded[u]);
    ops_memset_zero(z->o, z->adam_m[u], n * 4);
    ops_memset_zero(z->o, z->adam_v[u], n * 4);
}

static void invalidate_slots(Zero3 *z) {
    for (int k = 0; k < N_POOLS; k++)
        for (int s = 0; s < z->pool[k].n; s++) z->pool[k].slot[s].unit = -1;
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
    for (int k = 0; k < N_POOLS; k++)
        for (int s = 0; s < z->pool[k].n; s++) {
            GradWork *w = &z->pool[k].work[s];
            w->unit = w->pending = w->cross_pending = -1;
        }
}

static int comm_failed(Zero3 *z, const char *what, int unit) {
    ops_set_error(z->o, -1, __FILE__, __LINE__, "%s of unit %d failed: %s", what, unit, comm_error(z->c));
    return -1;
}

// ---- the UnitSource the model reads through -------------------------------------------------------

// The slot of pool `pl` holding unit u, or -1.
static int slot_of(const Pool *pl, int u) {
    for (int s = 0; s < pl->n; s++)
        if (pl->slot[s].unit == u) return s;
    return -1;
}

// Starts the all-gather of unit u into a slot nobody holds (empty first, else least recently used) on the
// communication stream, after the compute queued so far (which may still read the slot's previous unit).
// Returns the slot, -1 when every slot is held (ok_if_busy: a prefetch hint then does nothing), -2 on failure.
static int gather_into_slot(Zero3 *z, int u, int ok_if_busy) {
    Pool *pl = &z->pool[pool_of(z, u)];
    int pick = -1;
    for (int s = 0; s < pl->n; s++) {
        const ParamSlot *c = &pl->slot[s];
        if (c->refs > 0) continue;
        if (pick < 0 || (c->unit < 0 && pl->slot[pick].unit >= 0) ||
            (pl->slot[pick].unit >= 0 && c->unit >= 0 && c->tick < pl->slot[pick].tick))
            pick = s;
    }
    if (pick < 0) {
        if (ok_if_busy) return -1;
        ops_set_error(z->o, -1, __FILE__, __LINE__, "ZeRO-3: more than %d units of unit %d's kind held at once",
                      pl->n, u);
        return -2;
    }
    comm_wait_compute(z->pc);
    if (gather_on(z, z->pc, pl->slot[pick].buf, z->param_shard[u], z->pshard[u], storage_dtype(z)) != 0) {
        comm_failed(z, "all-gather", u);
        return -2;
    }
    pl->slot[pick].unit = u;
    pl->slot[pick].tick = ++z->tick;
    return pick;
}

static const void *src_acquire(void *user, int u) {
    Zero3 *z = user;
    if (z->stage != 3) return z->full[u];
    if (!uses_param_slots(z)) return z->param_shard[u];
    Pool *pl = &z->pool[pool_of(z, u)];
    int s = slot_of(pl, u);
    if (s < 0 && (s = gather_into_slot(z, u, 0)) < 0) return NULL;
    // Compute that reads the slot waits for its gather (issued now or by an earlier prefetch).
    comm_compute_wait(z->pc);
    pl->slot[s].refs++;
    pl->slot[s].tick = ++z->tick;
    return pl->slot[s].buf;
}

static void src_prefetch(void *user, int u) {
    Zero3 *z = user;
    if (!uses_param_slots(z) || !z->overlap || u < 0 || u >= z->n_units) return;
    if (slot_of(&z->pool[pool_of(z, u)], u) >= 0) return;
    gather_into_slot(z, u, 1);
}

static void src_release(void *user, int u) {
    Zero3 *z = user;
    if (!uses_param_slots(z)) return;
    Pool *pl = &z->pool[pool_of(z, u)];
    int s = slot_of(pl, u);
    if (s >= 0 && pl->slot[s].refs > 0) pl->slot[s].refs--;
}

// hpZ: adds a finished reduce-scatter across nodes to this rank's gradient slice, once the compute stream has
// waited for it; from then on `reduced` and `cross` are free again.
static void finish_cross(Zero3 *z, GradWork *w) {
    if (w->cross_pending < 0) return;
    const int u = w->cross_pending;
    w->cross_pending = -1;
    comm_compute_wait(z->xc);
    ops_add_f32(z->o, z->grad_shard[u], w->cross, z->shard[u]);
}

// Once the compute stream has waited for a finished reduce-scatter over pc: adds it to this rank's gradient slice,
// or (hpZ: it is the node-local slice) queues the reduce-scatter across nodes that cuts it down to this rank's
// global slice. That one is added by finish_cross when `reduced` is needed again (the buffer's next unit's
// reduce-scatter, after that unit's backward) or at the optimizer step, so it overlaps that backward. Issued after
// the compute stream has waited for the first, since two communicators are not ordered otherwise.
static void finish_reduce(Zero3 *z, GradWork *w) {
    if (w->pending < 0) return;
    const int u = w->pending;
    w->pending = -1;
    comm_compute_wait(z->pc);
    if (!z->xc) {
        ops_add_f32(z->o, z->grad_shard[u], w->reduced, z->shard[u]);
        return;
    }
    finish_cross(z, w);   // an earlier unit's, if any, still writes `cross`
    comm_wait_compute(z->xc);
    if (reduce_scatter_on(z, z->xc, w->cross, w->reduced, z->shard[u], COMM_F32) != 0) {
        comm_failed(z, "reduce-scatter across nodes", u);
        return;
    }
    w->cross_pending = u;
}

static void finish_all_reduces(Zero3 *z) {
    for (int k = 0; k < N_POOLS; k++)
        for (int s = 0; s < z->pool[k].n; s++) {
            finish_reduce(z, &z->pool[k].work[s]);
            finish_cross(z, &z->pool[k].work[s]);
        }
}

static float *src_grad(void *user, int u) {
    Zero3 *z = user;
    if (z->stage == 1) return z->full_grad[u];
    if (!uses_grad_work(z)) return z->grad_shard[u];
    Pool *pl = &z->pool[pool_of(z, u)];
    int pick = -1;
    for (int s = 0; s < pl->n; s++) {
        if (pl->work[s].unit == u) return pl->work[s].buf;
        // Prefer a buffer with no reduce-scatter in flight; else the first one not open.
        if (pl->work[s].unit < 0 && (pick < 0 || (pl->work[pick].pending >= 0 && pl->work[s].pending < 0))) pick = s;
    }
    if (pick < 0) {
        ops_set_error(z->o, -1, __FILE__, __LINE__, "ZeRO: more than %d unit gradients of unit %d's kind open at once",
                      pl->n, u);
        return NULL;
    }
    GradWork *w = &pl->work[pick];
    finish_reduce(z, w);   // the reduce-scatter still reads buf: the memset below must come after it
    w->unit = u;
    ops_memset_zero(z->o, w->buf, z->padded[u] * 4);
    return w->buf;
}

// Backward is done with unit u: reduce-scatter its gradient on the communication stream; the result is added
// to this rank's slice later (finish_reduce), so the next unit's backward overlaps the transfer (at once when
// overlap is off).
static void src_grad_done(void *user, int u) {
    Zero3 *z = user;
    if (!uses_grad_work(z)) return;
    Pool *pl = &z->pool[pool_of(z, u)];
    for (int s = 0; s < pl->n; s++) {
        GradWork *w = &pl->work[s];
        if (w->unit != u) continue;
        finish_cross(z, w);          // hpZ: the reduce-scatter across nodes of the buffer's last unit reads `reduced`
        comm_wait_compute(z->pc);   // after the backward that wrote buf and any add that read `reduced`
        if (reduce_scatter_on(z, z->pc, w->reduced, w->buf, z->pshard[u], COMM_F32) != 0) {
            comm_failed(z, "reduce-scatter", u);
            return;
        }
        w->unit = -1;
        w->pending = u;
        if (!z->overlap) {
            finish_reduce(z, w);
            finish_cross(z, w);
        }
        return;
    }
}

UnitSource zero3_source(Zero3 *z) {
    return (UnitSource){.acquire = src_acquire, .release = src_release, .grad = src_grad,
                        .grad_done = src_grad_done, .prefetch = src_prefetch, .user = z};
}

// ---- optimizer step -----------------------------------------------------------------------------

// hpZ: every rank wrote the new parameters of its global slice into its place in the node-local slice
// (zero3_param_shard); one all-gather per unit across nodes (in place) completes the node-local slices, once per
// optimizer step. Others: nothing to do.
static int refresh_secondary(Zero3 *z, char *err, size_t err_len) {
    if (!z->xc) return 0;
    comm_wait_compute(z->xc);
    for (int u = 0; u < z->n_units; u++)
        if (gather_on(z, z->xc, z->param_shard[u], zero3_param_shard(z, u), z->shard[u], storage_dtype(z)) != 0) {
            snprintf(err, err_len, "all-gather of unit %d's parameters across nodes failed: %s", u, comm_error(z->xc));
            return -1;
        }
    comm_compute_wait(z->xc);
    return 0;
}

int zero3_step(Zero3 *z, const AdamWParams *p, float lr, int step, float *grad_norm, char *err, size_t err_len) {
    OpsCtx *o = z->o;
    finish_all_reduces(z);
    if (z->stage == 1) {
        comm_wait_compute(z->c);
        for (int u = 0; u < z->n_units; u++)
            if (all_reduce(z, z->full_grad[u], z->padded[u], COMM_F32) != 0) {
                snprintf(err, err_len, "all-reduce of unit %d's gradient failed: %s", u, comm_error(z->c));
                return -1;
            }
        comm_compute_wait(z->c);
    }
    // HSDP: the slices are sums over this node's ranks; one all-reduce per unit across the replicas (one rank per
    // node) makes them sums over every rank. Once per optimizer step, whatever the gradient accumulation.
    if (replicated(z)) {
        comm_wait_compute(z->rc);
        for (int u = 0; u < z->n_units; u++)
            if (all_reduce_on(z, z->rc, z->stage == 1 ? (void *)z->full_grad[u] : (void *)z->grad_shard[u],
                              z->stage == 1 ? z->padded[u] : z->shard[u], COMM_F32) != 0) {
                snprintf(err, err_len, "all-reduce of unit %d's gradient across nodes failed: %s", u, comm_error(z->rc));
                return -1;
            }
        comm_compute_wait(z->rc);
    }
    // Global gradient norm: each rank sums the squares of its slices, then one all-reduce (over the ranks that
    // partition the state: replicas hold the same slices).
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
        void *param_out = (void *)zero3_param_shard(z, u);
        ops_adamw_step(o, z->master[u], z->adam_m[u], z->adam_v[u], grad_slice(z, u), param_out, z->shard[u], lr,
                       p->beta1, p->beta2, p->eps, p->weight_decay, step, scale);
    }
    if (refresh_secondary(z, err, err_len) != 0) return -1;
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
            ops_upload_f32(z->o, (void *)zero3_param_shard(z, u), host, n);
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
    if (refresh_secondary(z, err, err_len) != 0) return -1;
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
