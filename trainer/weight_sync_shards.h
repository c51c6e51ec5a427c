// trainer/weight_sync_shards.h — an NCCL weight update sent straight into a rollout server's tensor-parallel shards
// (docs/architecture.md "Weight sync"): a server of N shards is N members of the weight-sync communicator, and each
// trainer rank sends each shard only the parts of its own slice of a unit that the shard holds
// (shared/model.h model_shard_parts: q/k/v and gate/up rows, o and down columns, vocabulary rows, replicated
// norms) — no gather on any trainer rank, no whole copy on any shard. Parts that are whole rows of the unit go
// straight from the slice; column blocks (o_proj, down_proj) are packed first into one buffer per bucket
// (ops_copy_2d), which servers of the same size share. The server receives every part straight into its place in
// the shard's own staging unit (rollout_server/weight_nccl.c).
//
// Order (the server receives in the same order): per bucket, per unit, per server, per shard, parts in the shard
// unit's order.
#ifndef TANDEM_TRAINER_WEIGHT_SYNC_SHARDS_H
#define TANDEM_TRAINER_WEIGHT_SYNC_SHARDS_H

#include <stddef.h>

#include "shared/comm/comm.h"
#include "shared/model.h"

#define WEIGHT_SHARDS_MAX_SIZES 4   // different tensor-parallel sizes among the servers of one run

// This rank's slice of one unit: elements [off, off + count) of the whole unit, at src (backend memory, storage
// dtype).
typedef struct {
    const void *src;
    size_t off, count;
} WeightSlice;

typedef struct WeightShards WeightShards;

// Before a bucket's sends (units u0 .. u1 - 1, slices[u - u0] this rank's slice of unit u) to n_servers servers of
// tp[j] shards: makes *ws on first use, the shard layouts of every size > 1, and packs the column blocks those
// shards need into the pack buffer on the compute stream, after the communicator's earlier sends (which read the
// buffer) — the sends must then wait for compute (comm_wait_compute). Returns 0, or -1 with a message (a model
// that does not split into a server's size, no device memory).
int weight_shards_pack(WeightShards **ws, OpsCtx *ops, Comm *c, const Model *m, const int *tp, int n_servers, int u0,
                       int u1, const WeightSlice *slices, char *err, size_t err_len);
// Queues the sends of unit u's slice to a server of tp shards, members first .. first + tp - 1, inside the caller's
// group; adds the bytes sent to *bytes. After weight_shards_pack for the bucket holding u. Returns 0 or -1.
int weight_shards_send(WeightShards *ws, Comm *c, const Model *m, int u, const WeightSlice *slice, int tp, int first,
                       CommDtype dtype, double *bytes, char *err, size_t err_len);
void weight_shards_free(WeightShards *ws);

// For transports that write the shards' memory themselves (ipc, trainer/weight_sync_ipc.c), the same cut:
// shard k's layout for a server of tp shards (*ws made on first use), or NULL with a message (a model that does not
// split so)...
const Layout *weight_shards_layout(WeightShards **ws, OpsCtx *ops, const Model *m, int tp, int k, char *err,
                                   size_t err_len);
// ... the parts of elements [off, off + count) of unit u that shard k holds (shared/model.h model_shard_parts;
// *parts points into ws, valid until the next call), their count or -1 with a message ...
int weight_shards_parts(WeightShards *ws, const Model *m, int tp, int k, int u, size_t off, size_t count,
                        const ModelShardPart **parts, char *err, size_t err_len);
// ... and whether a part is a column block (rows of cols elements at a pitch of full_cols in the unit, contiguous in
// the shard), else contiguous on both sides.
int weight_shards_part_strided(const ModelShardPart *p);

#endif
