// trainer/checkpoint_reslice.c — a flat ZeRO checkpoint's optimizer state re-sliced for another number of ranks
// (trainer/checkpoint.h, checkpoint_reslice_open / checkpoint_read_resliced_unit).
//
// Flat ZeRO (full_shard) cuts unit u, padded to layout_padded_unit_numel(u, N) = N x c_N elements, into N equal
// slices: rank k of N holds elements [k c_N, (k + 1) c_N). The elements past layout.unit_numel[u] are padding
// (no parameter: zero gradient, so master and moments stay zero). A rank of M ranks wants [r c_M, (r + 1) c_M):
// it reads the slices of the old ranks that overlap that range and copies the overlap; what lies past
// unit_numel[u] is padding again and is zero. Nothing else is converted: the values are the same floats.
#include "trainer/checkpoint.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct CheckpointReslice {
    int old_world;
    char dir[PATH_MAX];
    SafetensorsSet **sets;   // (old_world) opened when first needed
    float *buf[3];           // one old slice of master, adam_m, adam_v
    size_t buf_cap;
};

int checkpoint_reslice_open(CheckpointReslice **out, const char *dir, int old_world, char *err, size_t err_len) {
    CheckpointReslice *r = calloc(1, sizeof *r);
    if (r) r->sets = calloc((size_t)old_world, sizeof *r->sets);
    if (!r || !r->sets) {
        free(r);
        snprintf(err, err_len, "out of memory re-slicing %s", dir);
        return -1;
    }
    r->old_world = old_world;
    snprintf(r->dir, sizeof r->dir, "%s", dir);
    *out = r;
    return 0;
}

void checkpoint_reslice_close(CheckpointReslice *r) {
    if (!r) return;
    for (int k = 0; k < r->old_world; k++)
        if (r->sets[k]) st_close(r->sets[k]);
    for (int i = 0; i < 3; i++) free(r->buf[i]);
    free(r->sets);
    free(r);
}

int checkpoint_read_resliced_unit(CheckpointReslice *r, const Layout *layout, int unit, size_t off, size_t n,
                                  float *master, float *adam_m, float *adam_v, char *err, size_t err_len) {
    const size_t numel = layout->unit_numel[unit];
    const size_t old_n = layout_padded_unit_numel(layout, unit, r->old_world) / (size_t)r->old_world;
    float *dst[3] = {master, adam_m, adam_v};
    for (int i = 0; i < 3; i++) memset(dst[i], 0, n * sizeof(float));   // padding stays zero
    const size_t end = off + n < numel ? off + n : numel;              // the parameters of [off, off + n)
    if (off >= end) return 0;
    if (old_n > r->buf_cap) {
        for (int i = 0; i < 3; i++) {
            float *g = realloc(r->buf[i], old_n * sizeof(float));
            if (!g) {
                snprintf(err, err_len, "out of memory re-slicing unit %d of %s", unit, r->dir);
                return -1;
            }
            r->buf[i] = g;
        }
        r->buf_cap = old_n;
    }
    for (size_t k = off / old_n; k * old_n < end; k++) {
        char path[PATH_MAX + 64];
        snprintf(path, sizeof path, "%s/trainer_state/rank-%05zu/optimizer.safetensors", r->dir, k);
        if (!r->sets[k] && st_open(&r->sets[k], path, err, err_len) != 0) return -1;
        if (checkpoint_read_unit_state(r->sets[k], path, unit, old_n, r->buf[0], r->buf[1], r->buf[2], err,
                                       err_len) != 0)
            return -1;
        // The overlap of old slice k, [k old_n, (k + 1) old_n), with [off, end).
        size_t lo = k * old_n > off ? k * old_n : off, hi = (k + 1) * old_n < end ? (k + 1) * old_n : end;
        for (int i = 0; i < 3; i++) memcpy(dst[i] + (lo - off), r->buf[i] + (lo - k * old_n), (hi - lo) * sizeof(float));
    }
    return 0;
}
