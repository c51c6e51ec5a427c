// trainer/checkpoint_reslice.c — a ZeRO checkpoint's optimizer state re-sliced for another number of ranks or another
// cut (trainer/checkpoint.h, checkpoint_reslice_open / checkpoint_read_resliced_unit).
//
// Every cut zero3.c makes is a flat cut of K slices with an owner per slice (zero3_slicing names it; G = ranks per
// node, N = ranks, M = N / G nodes, rank r on node r / G as index r % G there: comm.c's node map):
//   full_shard      K = N, slice k in rank k's file;
//   hybrid_shard:G  K = G, slice k on rank k of every node (replicas: node 0's file, rank k, is read);
//   hpz:G           K = N, rank r owns slice (r % G) M + r / G, so slice k is in rank (k % M) G + k / M's file.
// Unit u, padded to layout_padded_unit_numel(u, K) = K x c_K elements, has slice k = [k c_K, (k + 1) c_K). The
// elements past layout.unit_numel[u] are padding (no parameter: zero gradient, so master and moments stay zero). A
// rank of the new run wants [off, off + n) of its own cut: it reads the old slices that overlap that range and copies
// the overlap; what lies past unit_numel[u] is padding again and is zero. Nothing else is converted: the values are
// the same floats.
#include "trainer/checkpoint.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct CheckpointReslice {
    int old_world;
    int slices;              // K of the old cut
    int hpz_nodes;           // M for an hpz cut, else 0
    char dir[PATH_MAX];
    SafetensorsSet **sets;   // (old_world) opened when first needed
    float *buf[3];           // one old slice of master, adam_m, adam_v
    size_t buf_cap;
};

// The old cut (zero3_slicing's text) of old_world ranks: r->slices and r->hpz_nodes. 0, or -1 with a message.
static int parse_cut(CheckpointReslice *r, const char *cut, int old_world, char *err, size_t err_len) {
    int g = 0, used = 0;
    r->slices = old_world;
    r->hpz_nodes = 0;
    if (strcmp(cut, "full_shard") == 0) return 0;
    const int hybrid = sscanf(cut, "hybrid_shard:%d%n", &g, &used) == 1, hpz = !hybrid && sscanf(cut, "hpz:%d%n", &g, &used) == 1;
    if ((!hybrid && !hpz) || cut[used] != '\0' || g < 1 || old_world % g != 0) {
        snprintf(err, err_len, "zero_slicing \"%s\" of %d ranks is not a cut tandem makes (full_shard, hybrid_shard:G or "
                 "hpz:G with G dividing the ranks)", cut, old_world);
        return -1;
    }
    if (hybrid) r->slices = g;
    else r->hpz_nodes = old_world / g;
    return 0;
}

// The old rank whose file holds slice k.
static int file_of(const CheckpointReslice *r, int k) {
    if (!r->hpz_nodes) return k;
    const int M = r->hpz_nodes, G = r->old_world / M;
    return (k % M) * G + k / M;
}

int checkpoint_reslice_open(CheckpointReslice **out, const char *dir, int old_world, const char *old_cut, char *err,
                            size_t err_len) {
    *out = NULL;
    CheckpointReslice *r = calloc(1, sizeof *r);
    if (r) r->sets = calloc((size_t)old_world, sizeof *r->sets);
    if (!r || !r->sets) {
        free(r);
        snprintf(err, err_len, "out of memory re-slicing %s", dir);
        return -1;
    }
    r->old_world = old_world;
    snprintf(r->dir, sizeof r->dir, "%s", dir);
    if (parse_cut(r, old_cut, old_world, err, err_len) != 0) {
        checkpoint_reslice_close(r);
        return -1;
    }
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
    const size_t old_n = layout_padded_unit_numel(layout, unit, r->slices) / (size_t)r->slices;
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
        const int f = file_of(r, (int)k);
        char path[PATH_MAX + 64];
        snprintf(path, sizeof path, "%s/trainer_state/rank-%05d/optimizer.safetensors", r->dir, f);
        if (!r->sets[f] && st_open(&r->sets[f], path, err, err_len) != 0) return -1;
        if (checkpoint_read_unit_state(r->sets[f], path, unit, old_n, r->buf[0], r->buf[1], r->buf[2], err,
                                       err_len) != 0)
            return -1;
        // The overlap of old slice k, [k old_n, (k + 1) old_n), with [off, end).
        size_t lo = k * old_n > off ? k * old_n : off, hi = (k + 1) * old_n < end ? (k + 1) * old_n : end;
        for (int i = 0; i < 3; i++) memcpy(dst[i] + (lo - off), r->buf[i] + (lo - k * old_n), (hi - lo) * sizeof(float));
    }
    return 0;
}
