// trainer/lora_train.h — the policy when tandem-train trains LoRA adapters (use_peft): a frozen base and the
// adapters' optimizer (docs/architecture.md "LoRA").
//
// Every rank holds the whole base model resident in the storage dtype (bf16 on a GPU), never gathered, never
// given gradients (the model runs none of its weight-gradient GEMMs: shared/model.h model_backward), and the whole
// set of adapters (shared/model_lora.h): their storage-dtype units for the GEMMs, fp32 gradients, and the fp32
// master weights and Adam moments. The adapters are small (r (in + out) per module and layer), so they are
// replicated, not sharded: after the last backward of a step the adapter gradients are all-reduced (summed) over
// the ranks; ZeRO over the adapters: layer l's fp32 master and Adam moments live on rank l % world only, which
// takes the AdamW step of that layer and broadcasts the layer's new adapter unit, so the ranks' adapters stay
// identical (and equal a single rank's, bit for bit).
// GRPO: the rollout servers get the adapters alone (lora_sync adapter: lora_train_gather) or the base with them
// merged in (lora_sync merged: lora_train_refresh_merged); the reference model is the base with the adapters
// detached (trainer.h lora_ref).
#ifndef TANDEM_TRAINER_LORA_TRAIN_H
#define TANDEM_TRAINER_LORA_TRAIN_H

#include <stddef.h>
#include <stdint.h>

#include "shared/comm/comm.h"
#include "shared/model.h"
#include "shared/model_lora.h"
#include "trainer/zero3.h"

typedef struct LoraTrain LoraTrain;

typedef struct {
    size_t base_bytes;       // the frozen base's resident parameters
    size_t adapter_bytes;    // adapter units (storage dtype)
    size_t state_bytes;      // fp32 gradients, master weights, Adam m and v of the adapters
    size_t n_adapter_params; // trainable parameters
} LoraTrainMemory;

// Loads the base from model_dir into resident weights, makes the adapters (c) initialised from seed, and attaches
// them to m (m->lora). c: the collectives over the training ranks (backend memory); it must outlive the state.
int lora_train_create(LoraTrain **out, Model *m, Comm *c, const LoraConfig *lc, const char *model_dir, uint64_t seed,
                      char *err, size_t err_len);
// Detaches the adapters from the model and frees everything.
void lora_train_destroy(LoraTrain *lt);
// The frozen base as the model reads it: resident units, no gradient buffers.
UnitSource lora_train_source(LoraTrain *lt);
// The adapters' training activations for batches of up to max_tokens tokens (model_lora_reserve).
int lora_train_reserve(LoraTrain *lt, int max_tokens, char *err, size_t err_len);
void lora_train_memory(const LoraTrain *lt, LoraTrainMemory *mem);
// After the last backward of a step: sums the adapter gradients over the ranks, computes the global gradient norm
// (reported before clipping), clips as torch's clip_grad_norm_, applies AdamW to the master weights and writes the
// new adapter units, zeroes the gradients. step counts from 1.
int lora_train_step(LoraTrain *lt, const AdamWParams *p, float lr, int step, float *grad_norm, char *err,
                    size_t err_len);
// Layer l is this rank's to step (its master and Adam moments are here): l % world == rank.
int lora_train_owns(const LoraTrain *lt, int layer);
// Every rank calls it, for the same layer and state (which: 0 master, 1 Adam m, 2 Adam v): the owner's fp32 copy
// is broadcast and, where host is not NULL, copied into host (unit_numel floats). Returns 0 or -1 with a message.
int lora_train_gather(LoraTrain *lt, int layer, int which, float *host, char *err, size_t err_len);
// Every rank calls it before a checkpoint: rank 0 then holds host copies of every layer's master and Adam moments,
// which lora_train_save and lora_train_save_merged read; lora_train_release frees them.
int lora_train_collect(LoraTrain *lt, char *err, size_t err_len);
void lora_train_release(LoraTrain *lt);
// Rank 0, after lora_train_collect: writes the adapters (from the fp32 master weights) as a PEFT adapter folder into dir (adapter_config.json,
// adapter_model.safetensors; base_model_name_or_path = base_model), and their optimizer state into
// dir/trainer_state/adapter_optimizer.safetensors (per layer l: master.l, adam_m.l, adam_v.l, fp32, the adapter unit's
// elements).
int lora_train_save(LoraTrain *lt, const char *dir, const char *base_model, char *err, size_t err_len);
// Rank 0's export (after lora_train_collect) of the merged model (PEFT's merge_and_unload): the base with s B A added to every adapted weight,
// in fp32 on the host, written as a Hugging Face folder into dir (config.json, model.safetensors; bf16 when the
// base is held in bf16, else fp32). The whole model passes through host memory (4 bytes a parameter).
int lora_train_save_merged(LoraTrain *lt, const char *dir, char *err, size_t err_len);
// Lora_sync merged: the weights the rollout servers get (every rank calls it; no collective): the base with s B A
// added to every adapted weight, in the storage dtype, for the weight sync to send slices of. refresh recomputes the
// decoder-layer units from the current adapter units (a working copy of those units, made on first use: the base's
// layer units once more in memory; one GEMM per adapted module adding (s B) A into the weight, rounded once:
// model_lora_merge_layer); merged_unit is unit u of it (the base's own buffer for the embedding and final units, which
// adapters do not touch).
int lora_train_refresh_merged(LoraTrain *lt, char *err, size_t err_len);
// The adapters (config, layout): what an adapter-only weight push describes (its values: lora_train_gather).
const ModelLora *lora_train_adapters(const LoraTrain *lt);
const void *lora_train_merged_unit(const LoraTrain *lt, int unit);
// Restores what lora_train_save wrote: the master weights (and the adapter units from them) and Adam moments.
// Refuses a folder whose adapter_config.json describes other adapters (r, lora_alpha, use_rslora, target_modules),
// naming both.
int lora_train_load(LoraTrain *lt, const char *dir, char *err, size_t err_len);

#endif
