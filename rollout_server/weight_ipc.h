// rollout_server/weight_ipc.h — the receiving end of a weight update over transport ipc (docs/architecture.md
// "Weight sync"; docs/protocol-zmq.md), for trainer ranks on this server's host.
//
// Engine 0's device staging for each tensor-parallel shard (the second copy of the weights that transport nccl
// receives into) is placed in memory that another process can map (rollout_server/model_runner.h
// runner_weights_ipc_staging; shared/ipc_region.h): on CUDA a cudaMalloc block on the shard's GPU exported as a CUDA
// IPC handle (bf16), on the CPU backend POSIX shared memory (fp32), holding every unit of the shard's layout at
// ipc_unit_offsets. Two such regions per shard take turns: the update is written into the one that does not hold
// the live weights, and the commit's swap makes it live, so a shard holds two copies of its weights as with nccl.
// The regions last as long as the server; the trainer ranks map each once, and the staging_id (random, new with
// every server process) tells a rank that it must map them again. weights_begin answers with the current staging's
// handles; the trainer ranks copy their own ZeRO slices (to a tensor-parallel server: the parts each shard holds,
// shared/model.h model_shard_parts) straight into it; weights_end copies engine 0's staging to the other engines
// (--devices) and the caller commits as for nccl: a swap of staging and live weights between two engine steps.
//
// Nothing here reads the staging before weights_end: the trainer ranks agree they are done before it is sent.
//
// One control thread calls these.
#ifndef TANDEM_ROLLOUT_WEIGHT_IPC_H
#define TANDEM_ROLLOUT_WEIGHT_IPC_H

#include <stddef.h>
#include <stdint.h>

#include "rollout_server/engine_group.h"
#include "shared/zmq_msg.h"

typedef struct WeightIpc WeightIpc;

#define WEIGHT_IPC_EUNSUPPORTED (-2)   // the trainer is on another host: it must use transport nccl or zmq
#define WEIGHT_IPC_ESHARDS (-3)        // the trainer cut the units for another tensor-parallel size
#define WEIGHT_IPC_ENOMEM (-4)         // no memory for a region or the other engines' staging

int weight_ipc_create(WeightIpc **out, EngineGroup *g, char *err, size_t err_len);
// Frees it (the regions belong to the engines' runners, which free them with the weights).
void weight_ipc_free(WeightIpc *w);
// Opens update q->version (a weights_begin with transport ipc): checks the sender's host and tensor-parallel size,
// places engine 0's staging in its regions (made on first use; the other engines' staging is made too), and fills
// *reply (the weights_begin reply's "ipc"). Returns 0, or one of the WEIGHT_IPC_E* codes with a message.
int weight_ipc_begin(WeightIpc *w, const ZmsgMsg *q, ZmsgIpc *reply, char *err, size_t err_len);
// An update is open (begun, not finished).
int weight_ipc_active(const WeightIpc *w);
// Forgets the open update (another weights_begin came).
void weight_ipc_abandon(WeightIpc *w);
// weights_end(version): copies engine 0's staging to the other engines' (when there are); returns 0 with *seconds
// (weights_begin to ready for the swap), or -1 with a message (no update open for that version, a failed copy).
int weight_ipc_finish(WeightIpc *w, int64_t version, double *seconds, char *err, size_t err_len);

#endif
