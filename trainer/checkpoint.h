// trainer/checkpoint.h — checkpoints: a consolidated Hugging Face folder (loads in transformers and tandem-serve)
// plus the sharded trainer state each rank needs to resume exactly.
//
//   OUTPUT_DIR/checkpoint-STEP/
//     config.json, model.safetensors (or shards + index), tokenizer files copied from the base model
//     trainer_state.json                       step, epoch, data position, RNG, world size, ZeRO stage,
//                                              layout hash
//     trainer_state/rank-00000/optimizer.safetensors   rank 0's master weights and Adam moments, per unit
//     (rank-00001, ...: the rank with five digits, one folder per rank)
// Written under checkpoint-STEP.tmp and renamed once every rank has finished; only the last K are kept.
#ifndef TANDEM_TRAINER_CHECKPOINT_H
#define TANDEM_TRAINER_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "shared/comm.h"
#include "shared/model.h"
#include "trainer/zero3.h"

typedef struct {
    int64_t step;            // optimizer steps done
    int64_t epoch;
    int64_t data_position;   // prompts consumed in this epoch (per rank)
    uint64_t rng[2];         // the trainer's random state
    int64_t policy_version;  // weights version last pushed to the servers
} TrainProgress;

typedef struct {
    const char *output_dir;
    const char *base_model_dir;  // tokenizer files are copied from here
    int save_bf16;               // model tensors as bf16 (else fp32)
    size_t max_shard_bytes;      // 0 = one model.safetensors
    int keep_last;               // save_total_limit: 0 = keep all
} CheckpointOptions;

// All ranks call together. *saved_dir (optional, PATH_MAX) receives the final folder.
int checkpoint_save(Zero3 *z, Model *m, Comm *c, const CheckpointOptions *o, const TrainProgress *p, char *saved_dir,
                    char *err, size_t err_len);
// All ranks call together: restores master weights, Adam moments and progress from dir (a checkpoint-STEP
// folder, or "latest" = the highest step under o->output_dir). Refuses another world size or model layout,
// naming both values. Another ZeRO stage is fine: every stage keeps the same slices (trainer/zero3.h).
int checkpoint_load(Zero3 *z, Model *m, Comm *c, const CheckpointOptions *o, const char *dir, TrainProgress *p,
                    char *loaded_dir, char *err, size_t err_len);

#endif
