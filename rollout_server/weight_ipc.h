// rollout_server/weight_ipc.h — the receiving end of a weight update over transport ipc (docs/architecture.md
// "Weight sync"; docs/protocol-zmq.md), for trainer ranks on this server's host.
//
// The server keeps, per tensor-parallel shard of engine 0, one region of memory that another process can map
// (shared/ipc_region.h): on CUDA a cudaMalloc block on the shard's GPU exported as a CUDA IPC handle (bf16), on the
// CPU backend POSIX shared memory (fp32). It holds every unit of the shard's layout in the storage dtype, unit u at
// ipc_unit_offsets(u). The regions are made at the first weights_begin with transport ipc and kept for the server's
// life, so trainer ranks map them once; their staging_id (random, new with every server process) tells a rank that
// it must map them again. weights_begin answers with the handles; the trainer ranks copy their own ZeRO slices (to a
// tensor-parallel server: the parts each shard holds, shared/model.h model_shard_parts) straight into the regions;
// weights_end copies each region into every engine's device staging for that shard (the staging transport nccl
// receives into, on the same GPU: a device-local copy) and the caller commits it as the NCCL path does (a swap of
// staging and live weights between two engine steps). The live weights are never written by the trainer.
//
// Nothing here reads the regions before weights_end: a trainer rank that writes after its weights_end was sent (it
// cannot: ranks agree they are done first) would race the copy.
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
#define WEIGHT_IPC_ENOMEM (-4)         // no memory for the regions

int weight_ipc_create(WeightIpc **out, EngineGroup *g, char *err, size_t err_len);
// Frees the regions (shm: unlinks their names).
void weight_ipc_free(WeightIpc *w);
// Opens update q->version (a weights_begin with transport ipc): checks the sender's host and tensor-parallel size,
// makes the regions on first use, and fills *reply (the weights_begin reply's "ipc"). Returns 0, or one of the
// WEIGHT_IPC_E* codes (or -1) with a message.
int weight_ipc_begin(WeightIpc *w, const ZmsgMsg *q, ZmsgIpc *reply, char *err, size_t err_len);
// An update is open (begun, not finished).
int weight_ipc_active(const WeightIpc *w);
// Forgets the open update (another weights_begin came).
void weight_ipc_abandon(WeightIpc *w);
// weights_end(version): copies every shard's region into every engine's device staging of that shard; returns 0
// with *seconds (weights_begin to copied), or -1 with a message (no update open for that version, no device staging).
int weight_ipc_finish(WeightIpc *w, int64_t version, double *seconds, char *err, size_t err_len);

#endif
