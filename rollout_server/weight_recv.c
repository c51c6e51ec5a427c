// rollout_server/weight_recv.c — validate weight slices, write them into staging, track per-unit coverage.
#include "rollout_server/weight_recv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shared/dtype.h"
#include "shared/err.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int weight_recv_init(WeightRecv *w, const Layout *layout, char *err, size_t err_len) {
    return weight_recv_init_units(w, layout->n_units, layout->unit_numel, layout->hash, err, err_len);
}

int weight_recv_init_units(WeightRecv *w, int n_units, const size_t *unit_numel, uint64_t layout_hash, char *err,
                           size_t err_len) {
    memset(w, 0, sizeof *w);
    w->n_units = n_units;
    w->unit_numel = unit_numel;
    w->layout_hash = layout_hash;
    w->version = -1;
    if (!(w->cov = calloc((size_t)w->n_units, sizeof *w->cov)))
        return err_fail(err, err_len, "weight receiver: out of memory");
    return 0;
}

void weight_recv_reset(WeightRecv *w) {
    for (int u = 0; w->cov && u < w->n_units; u++) w->cov[u].n = 0;
    w->active = 0;
    w->owner_len = 0;
    w->slices = 0;
    w->version = -1;
}

void weight_recv_free(WeightRecv *w) {
    for (int u = 0; w->cov && u < w->n_units; u++) free(w->cov[u].iv);
    free(w->cov);
    memset(w, 0, sizeof *w);
}

int weight_recv_begin(WeightRecv *w, int64_t version, uint64_t layout_hash, const void *owner, size_t owner_len,
                      int64_t *abandoned, char *err, size_t err_len) {
    *abandoned = w->active ? w->version : -1;
    if (layout_hash != w->layout_hash) {
        char a[17], b[17];
        zmsg_hash_to_hex(layout_hash, a);
        zmsg_hash_to_hex(w->layout_hash, b);
        return err_fail(err, err_len,
                    "weights_begin: layout hash mismatch: the sender's layout is %s but this server's model has "
                    "layout %s (different model config or architecture); refusing the update", a, b);
    }
    if (owner_len > WEIGHT_RECV_OWNER_MAX) owner_len = WEIGHT_RECV_OWNER_MAX;
    weight_recv_reset(w);
    w->active = 1;
    w->version = version;
    w->t_begin = now_s();
    memcpy(w->owner, owner, owner_len);
    w->owner_len = owner_len;
    return 0;
}

static int same_owner(const WeightRecv *w, const void *owner, size_t owner_len) {
    if (owner_len > WEIGHT_RECV_OWNER_MAX) owner_len = WEIGHT_RECV_OWNER_MAX;
    return owner_len == w->owner_len && !memcmp(owner, w->owner, owner_len);
}

// Adds [a, b) to the unit's sorted list of disjoint, non-adjacent intervals, merging what it touches.
static int coverage_add(WeightCoverage *c, int64_t a, int64_t b) {
    int i = 0;
    while (i < c->n && c->iv[2 * i + 1] < a) i++;              // first interval ending at or after a
    int j = i;
    while (j < c->n && c->iv[2 * j] <= b) j++;                 // intervals i..j-1 overlap or touch [a, b)
    if (j > i) {
        int64_t lo = c->iv[2 * i] < a ? c->iv[2 * i] : a;
        int64_t hi = c->iv[2 * (j - 1) + 1] > b ? c->iv[2 * (j - 1) + 1] : b;
        c->iv[2 * i] = lo;
        c->iv[2 * i + 1] = hi;
        memmove(&c->iv[2 * (i + 1)], &c->iv[2 * j], sizeof(int64_t) * 2 * (size_t)(c->n - j));
        c->n -= j - i - 1;
        return 0;
    }
    if (c->n == c->cap) {
        int cap = c->cap ? 2 * c->cap : 8;
        int64_t *iv = realloc(c->iv, sizeof(int64_t) * 2 * (size_t)cap);
        if (!iv) return -1;
        c->iv = iv;
        c->cap = cap;
    }
    memmove(&c->iv[2 * (i + 1)], &c->iv[2 * i], sizeof(int64_t) * 2 * (size_t)(c->n - i));
    c->iv[2 * i] = a;
    c->iv[2 * i + 1] = b;
    c->n++;
    return 0;
}

int64_t weight_recv_covered(const WeightRecv *w, int unit) {
    if (unit < 0 || unit >= w->n_units) return 0;
    int64_t s = 0;
    for (int i = 0; i < w->cov[unit].n; i++) s += w->cov[unit].iv[2 * i + 1] - w->cov[unit].iv[2 * i];
    return s;
}

int weight_recv_slice(WeightRecv *w, const void *owner, size_t owner_len, int has_version, int64_t version, int unit,
                      int64_t offset, int64_t count,
                      ZmsgDtype dtype, const void *data, WeightStagingFn staging, void *user, char *err,
                      size_t err_len) {
    if (!w->active) return err_fail(err, err_len, "weights_slice: no weight update is open (send weights_begin first)");
    if (!same_owner(w, owner, owner_len) && !(has_version && version == w->version))
        return err_fail(err, err_len,
                    "weights_slice: the weight update in progress (version %lld) was opened by another peer; send "
                    "weights_begin first, or give the slice that update's \"version\" (%s)", (long long)w->version,
                    has_version ? "this slice names another version" : "this slice names none");
    if (unit < 0 || unit >= w->n_units)
        return err_fail(err, err_len, "weights_slice: unit %d out of range: the layout has units 0..%d", unit,
                    w->n_units - 1);
    int64_t numel = (int64_t)w->unit_numel[unit];
    if (offset < 0 || count < 1 || offset > numel || count > numel - offset)
        return err_fail(err, err_len,
                    "weights_slice: elements [%lld, %lld) are outside unit %d, which has %lld elements",
                    (long long)offset, (long long)offset + (long long)count, unit, (long long)numel);
    int bf16 = 0;
    void *dst = staging(user, unit, &bf16);
    if (!dst) return err_fail(err, err_len, "weights_slice: the engine has no staging buffer for unit %d", unit);
    // Record coverage first: if it cannot grow (out of memory) nothing was written and the slice is refused.
    if (coverage_add(&w->cov[unit], offset, offset + count))
        return err_fail(err, err_len, "weights_slice: out of memory tracking unit %d", unit);
    // (count) elements, little-endian, possibly unaligned in the frame: both paths copy bytewise-safe.
    if (bf16 && dtype == ZMSG_DTYPE_BF16) {
        memcpy((uint16_t *)dst + offset, data, (size_t)count * sizeof(uint16_t));
    } else if (bf16) {
        uint16_t *d = (uint16_t *)dst + offset;
        for (int64_t i = 0; i < count; i++) {
            float f;
            memcpy(&f, (const char *)data + i * (int64_t)sizeof f, sizeof f);
            d[i] = dtype_f32_to_bf16(f);
        }
    } else if (dtype == ZMSG_DTYPE_BF16) {
        dtype_bf16_to_f32_n((float *)dst + offset, data, (size_t)count);
    } else {
        memcpy((float *)dst + offset, data, (size_t)count * sizeof(float));
    }
    w->slices++;
    return 0;
}

int weight_recv_ready(const WeightRecv *w, const void *owner, size_t owner_len, int64_t version, char *err,
                      size_t err_len) {
    if (!w->active) return err_fail(err, err_len, "weights_end: no weight update is open (send weights_begin first)");
    if (!same_owner(w, owner, owner_len))
        return err_fail(err, err_len, "weights_end: the weight update in progress (version %lld) was opened by another "
                    "peer", (long long)w->version);
    if (version != w->version)
        return err_fail(err, err_len, "weights_end: version %lld does not match weights_begin's version %lld",
                    (long long)version, (long long)w->version);
    for (int u = 0; u < w->n_units; u++) {
        int64_t numel = (int64_t)w->unit_numel[u];
        const WeightCoverage *c = &w->cov[u];
        if (!(c->n == 1 && c->iv[0] == 0 && c->iv[1] == numel)) {
            int64_t first_gap = (c->n == 0 || c->iv[0] > 0) ? 0 : c->iv[1];
            return err_fail(err, err_len,
                        "weights_end: unit %d is incomplete: %lld of its %lld elements received (first missing "
                        "element %lld); send the missing slices, then weights_end again", u,
                        (long long)weight_recv_covered(w, u), (long long)numel, (long long)first_gap);
        }
    }
    return 0;
}
