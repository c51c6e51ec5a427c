// trainer/zero3.h — the ZeRO engine: every unit of the policy sharded across ranks (docs/architecture.md
// "Trainer: ZeRO-3").
//
// Rank r of N owns slice r of every unit, the unit padded to layout_padded_unit_numel(unit, N):
//   fp32 master weights, Adam m and v, fp32 gradient (stages 1-3), and the storage-dtype parameters (stage 3).
// Stage 3: a unit's parameters exist in full only while the model uses them (all-gathered on acquire, dropped
//          on release); each unit's gradient is reduce-scattered as soon as backward finishes it.
// Stage 2: full parameters resident on every rank; gradients reduce-scattered per unit as in stage 3.
// Stage 1: full parameters and full gradients resident; gradients all-reduced after backward.
// In every stage the optimizer updates only the local slice and the new parameters are all-gathered (1, 2) or
// stay sharded (3). The model reaches all of this through zero3_source() — a UnitSource.
// HSDP (zero3_create_sharded with a replica communicator; PyTorch FSDP's HYBRID_SHARD): "the ranks" above are one
// node's ranks, so every collective of forward and backward stays inside the node; each node holds a full replica,
// and once per optimizer step the gradient slices are all-reduced across nodes (one rank per node, the ranks with
// the same slice) before the norm and AdamW, so every replica takes the same step.
#ifndef TANDEM_TRAINER_ZERO3_H
#define TANDEM_TRAINER_ZERO3_H

#include <stddef.h>
#include <stdint.h>

#include "shared/comm/comm.h"
#include "shared/model.h"

typedef struct {
    float lr, beta1, beta2, eps, weight_decay;
    float max_grad_norm;   // <= 0: no clipping
} AdamWParams;

typedef struct {
    size_t param_shard_bytes, master_bytes, adam_bytes, grad_bytes; // per rank
    size_t gathered_bytes;   // full-unit parameter slots (stage 3) or resident full parameters (1, 2)
    size_t grad_work_bytes;  // full-unit gradient buffers used during backward
    size_t state_arena_bytes, work_arena_bytes; // the two allocations all of the above live in (with alignment)
} Zero3Memory;

typedef struct Zero3 Zero3;

// Allocates this rank's state for model m (its config/layout/ops) over communicator c.
int zero3_create(Zero3 **out, Model *m, Comm *c, int stage, char *err, size_t err_len);
// The state partitioned over `shard` (HSDP: this node's ranks, comm_split_nodes' intra) and replicated over
// `replicas` (the ranks holding the same slices: comm_split_nodes' inter; NULL = none, as zero3_create). Both must
// outlive the engine. Rank r of `shard` owns slice r (zero3_shard_offset).
int zero3_create_sharded(Zero3 **out, Model *m, Comm *shard, Comm *replicas, int stage, char *err, size_t err_len);
// hpZ (DeepSpeed ZeRO++'s hierarchical partitioning), stage 3: the fp32 master, Adam moments and gradient slices
// partitioned over all ranks (as zero3_create over `all`), the storage-dtype parameters that forward and backward
// gather partitioned over `node` only (a secondary copy: padded / G per rank), so those all-gathers stay inside the
// node. Gradients: reduce-scatter over `node`, then over `cross` (the ranks with this LOCAL_RANK, ranked by node)
// down to the global slice; after the optimizer step one all-gather over `cross` refreshes the secondary copy.
// node and cross: comm_split_nodes(all). This rank's global slice is number local_rank x nodes + node
// (zero3_shard_offset).
int zero3_create_hpz(Zero3 **out, Model *m, Comm *all, Comm *node, Comm *cross, char *err, size_t err_len);
// Overlap of the collectives with compute (overlap_comm, on when created): the next unit's all-gather prefetched
// during this one's compute, each gradient reduce-scatter finished while the next backward runs. Off serialises them
// (the same results). Set before the first step.
void zero3_set_overlap(Zero3 *z, int on);
// How the slices are cut, recorded in checkpoints because a rank's slices are only meaningful under the same cut
// (hpZ's rank r does not own flat ZeRO's slice r, with the same slice sizes): "full_shard", "hybrid_shard:G" or
// "hpz:G" (G = ranks per node); on one node all three cut alike and say "full_shard".
void zero3_slicing(const Zero3 *z, char *out, size_t len);
// Replicas of this rank's state (1 unless HSDP).
int zero3_replicas(const Zero3 *z);
// Bytes this rank sent in the collectives of this engine, split by whether the receiver is on its node (comm.h
// comm_bytes), since it was created.
void zero3_comm_bytes(const Zero3 *z, CommBytes *out);
void zero3_destroy(Zero3 *z);
// Loads an HF folder: every rank reads each unit and keeps its slice (fp32 master + parameters).
int zero3_load(Zero3 *z, const char *model_dir, char *err, size_t err_len);
// Deterministic random init (same on every rank count): model_init_random's values, sliced.
int zero3_init_random(Zero3 *z, uint64_t seed, float std, char *err, size_t err_len);
void zero3_memory(const Zero3 *z, Zero3Memory *mem);
// The ZeRO stage the state was created with (1, 2 or 3): checkpoints record it.
int zero3_stage(const Zero3 *z);

UnitSource zero3_source(Zero3 *z);
// Gradients are accumulated across backward passes until zero3_step (gradient accumulation).
void zero3_zero_grad(Zero3 *z);
// After the last backward of a step: finishes the gradient reduction (stage 1), computes the global gradient
// norm (reported before clipping, as torch's clip_grad_norm_), clips, applies AdamW with this step's lr to
// the local slices, republishes parameters, zeroes gradients. step counts from 1.
int zero3_step(Zero3 *z, const AdamWParams *p, float lr, int step, float *grad_norm, char *err, size_t err_len);

// Per-rank view for checkpoints and the weight sync: unit u's slice [offset, offset + count) of the padded unit.
size_t zero3_shard_offset(const Zero3 *z, int unit);
size_t zero3_shard_count(const Zero3 *z, int unit);
float *zero3_master_shard(Zero3 *z, int unit);     // fp32 (count)
float *zero3_adam_m_shard(Zero3 *z, int unit);
float *zero3_adam_v_shard(Zero3 *z, int unit);
// This rank's slice of unit u's parameters in the storage dtype (backend memory, shard count elements), as the
// model reads them: what the weight sync sends over NCCL.
const void *zero3_param_shard(Zero3 *z, int unit);
// Restores this rank's slice of unit u from host fp32 arrays (shard count each; m and v may be NULL = zeros),
// e.g. from a checkpoint; call zero3_republish once every unit is restored.
int zero3_restore_shard(Zero3 *z, int unit, const float *master, const float *m, const float *v);
// All ranks: makes the parameters the model reads equal the master weights again (stage 3: this rank's slices;
// stages 1-2: slices all-gathered into the resident full units).
int zero3_republish(Zero3 *z, char *err, size_t err_len);
// All ranks call it together: gathers unit u's parameters as fp32 into host (padded unit numel) on every rank.
int zero3_gather_unit_f32(Zero3 *z, int unit, float *host, char *err, size_t err_len);

#endif
