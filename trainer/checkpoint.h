// trainer/checkpoint.h — checkpoints: a consolidated Hugging Face folder (loads in transformers and tandem-serve)
// plus the sharded trainer state each rank needs to resume exactly.
//
//   OUTPUT_DIR/checkpoint-STEP/
//     config.json, model.safetensors (or shards + index), tokenizer files copied from the base model
//     trainer_state.json                       step, epoch, data position, RNG, world size, ZeRO stage,
//                                              layout hash
//     trainer_state/rank-00000/optimizer.safetensors   rank 0's master weights and Adam moments, per unit
//     (rank-00001, ...: the rank with five digits, one folder per rank)
//
// Durability (a crash or power loss at any point leaves the newest complete checkpoint loadable):
//   1. rank 0 makes checkpoint-STEP.tmp; every rank writes its part and fsyncs its files and its rank folder;
//   2. once all ranks have, rank 0 fsyncs the rest, writes trainer_state.json last (a folder without it is not a
//      complete checkpoint) and fsyncs it and the folder;
//   3. an existing checkpoint-STEP (a run resumed from an earlier step saves the same step again) is renamed to
//      checkpoint-STEP.old, never deleted first; checkpoint-STEP.tmp is renamed to checkpoint-STEP; the output
//      folder is fsynced; then checkpoint-STEP.old is removed;
//   4. only then are the checkpoints beyond the newest save_total_limit removed (each renamed to .old first).
// What a stopped run leaves (.tmp and .old folders) is settled by rank 0 at the next save or resume, with a log
// line: a .old beside a complete .tmp without checkpoint-STEP was a replacement stopped between its renames, and
// the .tmp becomes checkpoint-STEP; every other .tmp and .old is removed. --resume latest takes the highest
// complete checkpoint-STEP.
#ifndef TANDEM_TRAINER_CHECKPOINT_H
#define TANDEM_TRAINER_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "shared/comm/comm.h"
#include "shared/model.h"
#include "shared/safetensors.h"
#include "trainer/zero3.h"

typedef struct {
    int64_t step;            // optimizer steps done
    int64_t epoch;
    int64_t data_position;   // prompts consumed in this epoch (per rank)
    uint64_t rng[2];         // the trainer's random state
    int64_t policy_version;  // weights version last pushed to the servers
    int64_t num_input_tokens_seen;  // prompt + completion tokens trained on so far, every rank (TRL's num_tokens)
} TrainProgress;

// The points checkpoint_save passes, in order, for phase_hook. A test stops the process at each one to check
// that whatever it leaves behind still resumes from a complete checkpoint.
typedef enum {
    CHECKPOINT_PHASE_TMP_CREATED,    // rank 0: checkpoint-STEP.tmp made (leftovers of a stopped run settled)
    CHECKPOINT_PHASE_MODEL_WRITTEN,  // rank 0: model and tokenizer files written, not yet flushed
    CHECKPOINT_PHASE_RANK_WRITTEN,   // every rank: its optimizer state written and flushed
    CHECKPOINT_PHASE_COMPLETE,       // rank 0: trainer_state.json written, the .tmp folder flushed
    CHECKPOINT_PHASE_OLD_ASIDE,      // rank 0: an existing checkpoint-STEP renamed to checkpoint-STEP.old
    CHECKPOINT_PHASE_RENAMED,        // rank 0: checkpoint-STEP.tmp renamed to checkpoint-STEP
    CHECKPOINT_PHASE_DURABLE,        // rank 0: the output folder flushed: the rename survives a power loss
    CHECKPOINT_PHASE_OLD_REMOVED,    // rank 0: checkpoint-STEP.old removed
    CHECKPOINT_PHASE_PRUNE_ASIDE,    // rank 0: a checkpoint beyond keep_last renamed to .old (step: that one's)
    CHECKPOINT_PHASE_PRUNED,         // rank 0: the checkpoints beyond keep_last removed
} CheckpointPhase;

typedef struct {
    const char *output_dir;
    const char *base_model_dir;  // tokenizer files are copied from here
    int save_bf16;               // model tensors as bf16 (else fp32)
    size_t max_shard_bytes;      // 0 = one model.safetensors
    int keep_last;               // save_total_limit: 0 = keep all
    // checkpoint_load: 1 when each rank's data order depends on the number of ranks (shuffle_dataset: a permutation
    // per rank's shard), so that a resume on another number of ranks cannot continue an epoch's order.
    int data_order_per_rank;
    // NULL, or called at each CheckpointPhase checkpoint_save passes (step: the checkpoint's, or for
    // PRUNE_ASIDE the pruned one's) with phase_arg.
    void (*phase_hook)(CheckpointPhase phase, long long step, void *phase_arg);
    void *phase_arg;
} CheckpointOptions;

// Copies the base model's tokenizer files (those that exist) into dir.
int checkpoint_copy_tokenizer(const char *base_model_dir, const char *dir, char *err, size_t err_len);
// All ranks call together. *saved_dir (optional, PATH_MAX) receives the final folder.
int checkpoint_save(Zero3 *z, Model *m, Comm *c, const CheckpointOptions *o, const TrainProgress *p, char *saved_dir,
                    char *err, size_t err_len);
// `resume: auto` (a restarted Kubernetes run, docs/kubernetes.md): settles what a stopped run left in output_dir
// as a resume does, then looks for its latest complete checkpoint-N. 1 with that folder in path, 0 when there is
// none (no folder yet, or nothing complete in it), -1 when output_dir cannot be read (err says why). Rank 0 only.
int checkpoint_find_latest(const char *output_dir, char *path, size_t path_len, char *err, size_t err_len);

// LoRA (use_peft) checkpoints: OUTPUT_DIR/checkpoint-STEP/ with what `write` puts into the folder it is given (the
// PEFT adapter folder: adapter_config.json, adapter_model.safetensors; and the adapters' optimizer state), the base
// model's tokenizer files and trainer_state.json (as above, zero_slicing "lora", plus "peft_adapter": true); no base
// weights. Rank 0 writes (the adapters are the same on every rank), with the durability and save_total_limit
// rotation of checkpoint_save. All ranks call together.
int checkpoint_save_adapter(Comm *c, const CheckpointOptions *o, const TrainProgress *p, const Model *m,
                            int (*write)(const char *dir, void *arg, char *err, size_t err_len), void *arg,
                            char *saved_dir, char *err, size_t err_len);
// Its resume, all ranks together: dir as checkpoint_load's (a folder, or "latest"); refuses a full-model checkpoint
// (and checkpoint_load refuses an adapter one) and another model layout; then every rank calls `read` on the folder
// and gets the progress. Another number of ranks is fine (the adapters' state is saved whole), with data_position
// rescaled and refused as checkpoint_load does.
int checkpoint_load_adapter(Comm *c, const CheckpointOptions *o, const char *dir, const Model *m,
                            int (*read)(const char *dir, void *arg, char *err, size_t err_len), void *arg,
                            TrainProgress *p, char *loaded_dir, char *err, size_t err_len);
// All ranks call together: restores master weights, Adam moments and progress from dir (a checkpoint-STEP
// folder, or "latest" = the highest complete checkpoint-STEP under o->output_dir, after rank 0 has settled what a
// stopped run left there, as checkpoint_save does). Refuses another model layout, naming both values. Another
// ZeRO stage is fine: every stage keeps the same slices (trainer/zero3.h). Another number of ranks or another cut
// (full_shard, hybrid_shard:G, hpz:G, on any node layout) is fine too: the state is re-sliced
// (checkpoint_reslice.c), and with another number of ranks data_position, counted per rank, becomes data_position x
// old ranks / new ranks (the ranks' records interleave, data.h, so with the same global batch the same records come
// next); refused, naming both sides, for a position that does not divide or a shuffled epoch under way
// (o->data_order_per_rank and data_position > 0).
int checkpoint_load(Zero3 *z, Model *m, Comm *c, const CheckpointOptions *o, const char *dir, TrainProgress *p,
                    char *loaded_dir, char *err, size_t err_len);

// What trainer_state.json holds: {"global_step", "epoch", "data_position", "rng": [hex, hex], "policy_version",
// "world_size", "zero_stage", "zero_slicing", "layout_hash": hex} (hex: 16 lowercase hex digits of a 64-bit value).
typedef struct {
    TrainProgress progress;
    int world_size;
    int zero_stage;              // recorded only: any stage resumes (0 when the file has none)
    char zero_slicing[32];       // zero3_slicing: a resume needs the same ("full_shard" when the file has none)
    uint64_t layout_hash;
} CheckpointState;

json_t *checkpoint_state_to_json(const CheckpointState *st);   // a new reference, NULL on out of memory
// Reads trainer_state.json's JSON (name: the file, for messages) as checkpoint_load does. Refuses a missing or
// mistyped field, a negative step, epoch or data position, world_size < 1, and rng / layout_hash that are not
// 16 lowercase hex digits. 0, or -1 with a message naming the file.
int checkpoint_state_from_json(const json_t *j, const char *name, CheckpointState *st, char *err, size_t err_len);
// Reads unit's optimizer slices (n floats each: "master.<unit>", "adam_m.<unit>", "adam_v.<unit>") from a rank's
// optimizer.safetensors (path: the file, for messages), as checkpoint_load does. 0, or -1 with a message.
int checkpoint_read_unit_state(const SafetensorsSet *set, const char *path, int unit, size_t n, float *master,
                               float *adam_m, float *adam_v, char *err, size_t err_len);

// A ZeRO checkpoint written by old_world ranks under the cut old_cut (its zero_slicing: full_shard, hybrid_shard:G,
// hpz:G), read by a run of another number of ranks or another cut (trainer/checkpoint_reslice.c): each of the new
// slices is cut from the old slices that overlap it. Refuses a cut text zero3_slicing does not write.
typedef struct CheckpointReslice CheckpointReslice;
int checkpoint_reslice_open(CheckpointReslice **out, const char *dir, int old_world, const char *old_cut, char *err,
                            size_t err_len);
void checkpoint_reslice_close(CheckpointReslice *r);
// Elements [off, off + n) of unit (padded for this run's ranks) of master, adam_m, adam_v: the old ranks' values
// for the unit's layout.unit_numel[unit] elements, zero for the padding past them. 0, or -1 naming the file.
int checkpoint_read_resliced_unit(CheckpointReslice *r, const Layout *layout, int unit, size_t off, size_t n,
                                  float *master, float *adam_m, float *adam_v, char *err, size_t err_len);

#endif
