// trainer/weight_sync.h — pushing the policy's weights to the rollout servers (docs/architecture.md "Weight sync").
//
// Transport zmq: rank 0 opens the update, every rank sends its own master slices as ZeroMQ frames to every
// server (fp32 from CPU ranks, bf16 from GPU ranks: what their forward computes with), rank 0 closes it
// (docs/protocol-zmq.md).
// Transport nccl: trainer ranks (members 0..W-1) and the answering servers (then each server's tensor-parallel
// shards, one member per shard) share one NCCL communicator, made once and reused while the set of servers stays
// the same (its 128-byte id travels in weights_begin). Every rank sends its own storage-dtype (bf16) slice of every
// unit straight from the ZeRO state to every server — to a tensor-parallel server, each shard only the parts of the
// slice it holds (trainer/weight_sync_shards.h) — units grouped into buckets of about WEIGHT_SYNC_BUCKET_BYTES per
// NCCL group: no gather, no per-tensor round trip. Rank 0's weights_end returns once each server has swapped.
// CPU ranks (the CPU twin, CI) run transport nccl over shared/comm's host backend with fp32 slices, to CPU servers.
// Transport ipc (trainer/weight_sync_ipc.c): ranks and servers on one host. weights_begin's reply names each server
// shard's staging (CUDA IPC handles, or POSIX shared memory on the CPU); every rank maps it once and copies its own
// slice of every unit straight into it (to a tensor-parallel server each shard's parts, as for nccl), then the ranks
// agree they are done and rank 0's weights_end has the servers commit.
// `auto` takes nccl when this rank computes on CUDA and NCCL is there. When a server cannot take nccl or the first
// NCCL push fails (a server on a trainer rank's own GPU: one NCCL communicator cannot hold the same GPU twice), it
// falls back for the rest of the run (with one log line) to ipc when the servers are on this host and the update is
// whole weights from a layout ipc carries, else to zmq.
#ifndef TANDEM_TRAINER_WEIGHT_SYNC_H
#define TANDEM_TRAINER_WEIGHT_SYNC_H

#include <stddef.h>
#include <stdint.h>

#include "shared/comm/comm.h"
#include "trainer/rollout_client.h"

#define WEIGHT_SYNC_BUCKET_BYTES ((size_t)1 << 30)

typedef struct {
    int use_nccl;                     // resolved transport: 1 nccl, 0 zmq (or ipc, use_ipc)
    int use_ipc;                      // transport ipc (weight_sync_transport ipc, or auto's fallback from nccl)
    struct WeightSyncIpc *ipc;        // ipc: the servers' staging this rank has mapped (trainer/weight_sync_ipc.c)
    Comm *comm;                       // nccl: the weight-sync communicator, NULL until the first push
    uint8_t id[COMM_UNIQUE_ID_BYTES]; // its id (rank 0 made it)
    int servers[ROLLOUT_MAX_SERVERS]; // its server members (rollout client indices)
    int tp[ROLLOUT_MAX_SERVERS];      // their tensor-parallel shards: server j is members first_j .. first_j +
                                      // tp[j] - 1 (first_0 = the trainer ranks, first_j+1 = first_j + tp[j])
    int n_servers;
    struct WeightShards *shards;      // shard layouts and the pack buffer for servers of tp > 1 (weight_sync_shards.h)
    int nccl_worked;                  // a push over NCCL succeeded in this run
    double bytes;                     // bytes this rank sent in the last push (to all servers together)
    double transfer_seconds;          // of the last push: this rank's sending alone (nccl: first send until the
                                      // communicator's stream is done; zmq: slices sent and flushed), without the
                                      // control round trips and the servers' swap that the whole push includes
    // Rank 0's view of the last push's other parts (0 on other ranks), so that a slow push can be placed:
    double begin_seconds;             // weights_begin to every server, answered (nccl: also the plan broadcast)
    double end_seconds;               // weights_end to every server, answered: the wait for the servers' receive
                                      // to finish plus their swap
    double commit_seconds;            // the servers' swap alone, as they report it (the largest)
    int64_t joined_ms;                // when this rank joined the communicator (server_liveness_now_ms's clock)
    double send_start;                // when this rank began queuing the last push's sends (trainer_now)
} WeightSync;

struct Trainer;
// All ranks call it together. *seconds: the whole push as rank 0 saw it.
int weight_sync_push(struct Trainer *t, double *seconds, char *err, size_t err_len);
// Drops the NCCL communicator (a failed push; the next one makes a new one).
void weight_sync_close(WeightSync *ws);
// At the end of the run: the communicator and transport ipc's mappings.
void weight_sync_free(WeightSync *ws);

#endif
