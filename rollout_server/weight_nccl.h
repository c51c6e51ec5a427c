// rollout_server/weight_nccl.h — the receiving end of a weight update over NCCL (docs/architecture.md "Weight sync",
// transport nccl; docs/protocol-zmq.md).
//
// weights_begin {transport "nccl", nccl_id, nccl_world, nccl_rank, trainer_ranks, tensor_parallel_size,
// comm_backend} starts a receive thread: it joins the weight-sync communicator (or keeps the one it has when the id
// is the same), then receives from each of the trainer_ranks senders its slice of every unit — slice r of unit u is
// elements [r * s, min((r + 1) * s, numel)) with s = layout_padded_unit_numel(u, trainer_ranks) / trainer_ranks, in
// the storage dtype (bf16; fp32 on the CPU) — straight into the engine's device staging copy, in the sender's
// bucket order, and waits for completion under the communication timeout. A tensor-parallel engine of N shards is N
// members (nccl_rank + k for shard k), each joining and receiving on a thread of its own: from every slice only the
// parts the shard holds (shared/model.h model_shard_parts), straight into their places in the shard's own staging —
// no whole copy anywhere. The engine keeps generating with its current weights meanwhile. weights_end waits for
// the thread; the engine then swaps staging and live weights between two steps. A server of several engines
// (--devices) is one member (or N) of the communicator: engine 0 receives, then the receive thread copies engine
// 0's staging device to device into every other engine's (engine_group_spread_device_staging), and weights_end
// swaps all of them. A failed or abandoned receive leaves the live weights as they were; the communicator is dropped
// and the next update makes a new one. comm_backend "host" (CPU trainer ranks and a CPU server: the CPU twin of
// this transport) runs the same over shared/comm's host backend.
//
// One control thread calls these.
#ifndef TANDEM_ROLLOUT_WEIGHT_NCCL_H
#define TANDEM_ROLLOUT_WEIGHT_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include "rollout_server/engine_group.h"
#include "shared/zmq_msg.h"

typedef struct WeightNccl WeightNccl;

// timeout_ms bounds joining the communicator and each receive. Returns 0 or -1 (out of memory).
int weight_nccl_create(WeightNccl **out, EngineGroup *g, int timeout_ms, char *err, size_t err_len);
// Frees; waits for a receive in flight to end (it ends by the timeout at the latest).
void weight_nccl_free(WeightNccl *w);
// Whether this server can take transport nccl over backend `backend` (nccl: a CUDA engine with bf16 weights, NCCL
// present; host: a CPU engine); else a message saying why not.
int weight_nccl_supported(const WeightNccl *w, ZmsgCommBackend backend, char *why, size_t why_len);
// Starts receiving update q->version (a weights_begin request with transport nccl). A receive still in flight
// is waited for first. A tensor-parallel size other than this server's is refused, naming both. adapter_numel > 0
// (not into a tensor-parallel server): an adapter update (weights_begin with "adapter"): layer l's adapter unit
// (adapter_numel bf16 elements) comes from trainer rank l % trainer_ranks into engine 0's adapter staging
// (engine_adapter_device_staging, made by the caller), all layers in one NCCL group; engine_group_commit_adapter
// copies it to the other engines. Returns 0, or WEIGHT_NCCL_ESHARDS (another tensor-parallel size) or -1 (bad
// membership, no staging memory) with a message.
#define WEIGHT_NCCL_ESHARDS (-2)
int weight_nccl_begin(WeightNccl *w, const ZmsgMsg *q, size_t adapter_numel, char *err, size_t err_len);
// The update that weights_begin opened for `version` has been received completely: waits for the receive
// thread, returns 0 with *seconds (weights_begin to received), or -1 with the failure.
int weight_nccl_finish(WeightNccl *w, int64_t version, double *seconds, char *err, size_t err_len);
// An update is open (begun, not finished); an adapter update is open.
int weight_nccl_active(const WeightNccl *w);
int weight_nccl_adapter(const WeightNccl *w);
// Forgets the open update without waiting (a weights_begin with transport zmq came instead: the trainer fell
// back). A receive still running ends by itself (at the latest by the timeout) and is joined later.
void weight_nccl_abandon(WeightNccl *w);
// A new update begins: the open one is forgotten (logged), and a receive still running gives up (within ~2 s) and is
// waited for, so that afterwards nothing writes into the staging it received into (adapter updates over either
// transport reuse the adapter staging). weight_nccl_begin starts with it.
void weight_nccl_stop(WeightNccl *w);

#endif
