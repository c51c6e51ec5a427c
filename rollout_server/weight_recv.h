// rollout_server/weight_recv.h — the receiving end of a weight update (docs/architecture.md "Weight sync",
// transport zmq).
//
// An update is weights_begin -> slices -> weights_end. Each slice (unit, offset, count) is written into the
// engine's staging copy of that unit; coverage is tracked per unit as a sorted list of disjoint element
// intervals (slices may arrive in any order, split any way, even overlap), so weights_end can refuse an update
// that left any element of any unit unwritten — naming the unit — and the engine commits only complete updates.
// Nothing here touches the live weights: an update that is abandoned (peer gone, a new weights_begin) leaves the
// engine on its current version.
//
// Single-threaded: only the control thread calls these.
#ifndef TANDEM_ROLLOUT_WEIGHT_RECV_H
#define TANDEM_ROLLOUT_WEIGHT_RECV_H

#include <stddef.h>
#include <stdint.h>

#include "shared/layout.h"
#include "shared/zmq_msg.h"

#define WEIGHT_RECV_OWNER_MAX 256   // ZeroMQ routing ids are at most 255 bytes

typedef struct {
    int64_t *iv;   // (2 * n) [start, end) pairs, sorted, disjoint and non-adjacent
    int n, cap;
} WeightCoverage;

typedef struct {
    int n_units;
    const size_t *unit_numel;    // (n_units) borrowed from the layout
    uint64_t layout_hash;
    int active;                  // an update is open
    int64_t version;
    double t_begin;              // monotonic seconds at weights_begin
    unsigned char owner[WEIGHT_RECV_OWNER_MAX];   // routing id of the peer that opened it
    size_t owner_len;
    WeightCoverage *cov;         // (n_units)
    int64_t slices;              // slices applied in this update
} WeightRecv;

// staging(user, unit, &bf16) returns the buffer of unit `unit` (unit_numel[unit] elements) to write into: fp32
// values, or with *bf16 set bf16 bits (a server whose weights are bf16 keeps its staging in bf16, half the host
// memory; fp32 slices are rounded on arrival by the rule the upload to the device would apply).
typedef void *(*WeightStagingFn)(void *user, int unit, int *bf16);

int weight_recv_init(WeightRecv *w, const Layout *layout, char *err, size_t err_len);
// The same for units that are not a model layout's (an adapter update's: one per decoder layer); unit_numel
// (n_units) is borrowed and must outlive w.
int weight_recv_init_units(WeightRecv *w, int n_units, const size_t *unit_numel, uint64_t layout_hash, char *err,
                           size_t err_len);
void weight_recv_free(WeightRecv *w);

// Opens an update. Refuses a layout hash other than this model's (naming both). An update already open is
// abandoned (*abandoned = its version, else -1). Returns 0 or -1 with a message.
int weight_recv_begin(WeightRecv *w, int64_t version, uint64_t layout_hash, const void *owner, size_t owner_len,
                      int64_t *abandoned, char *err, size_t err_len);
// Validates a slice against the open update and the layout, converts it to the staging buffer's dtype into it and
// records its coverage. A slice comes from the peer that opened the update, or from any peer when it names the
// open update's version (has_version): several trainer ranks each send their own slices of one update.
// Returns 0 or -1 with a message (nothing is written then).
int weight_recv_slice(WeightRecv *w, const void *owner, size_t owner_len, int has_version, int64_t version, int unit,
                      int64_t offset, int64_t count,
                      ZmsgDtype dtype, const void *data, WeightStagingFn staging, void *user, char *err,
                      size_t err_len);
// Checks that weights_end(version) may commit: an update is open, from this peer, for this version, and every
// unit is fully covered (else the message names the first incomplete unit and its covered element count).
int weight_recv_ready(const WeightRecv *w, const void *owner, size_t owner_len, int64_t version, char *err,
                      size_t err_len);
// Closes the update (after a commit, or to drop it).
void weight_recv_reset(WeightRecv *w);
// Elements of `unit` covered so far in the open update.
int64_t weight_recv_covered(const WeightRecv *w, int unit);

#endif
