// trainer/lora_train.h — the policy when tandem-train trains LoRA adapters (use_peft): a frozen base and the
// adapters' optimizer (docs/architecture.md "LoRA").
//
// Every rank holds the whole base model resident in the storage dtype (bf16 on a GPU), never gathered, never
// given gradients (the model runs none of its weight-gradient GEMMs: shared/model.h model_backward), and the whole
// set of adapters (shared/model_lora.h): their storage-dtype units for the GEMMs, fp32 gradients, and the fp32
// master weights and Adam moments. The adapters are small (r (in + out) per module and layer), so they are
// replicated, not sharded: after the last backward of a step the adapter gradients are all-reduced (summed) over
// the ranks, and every rank takes the same AdamW step, so the ranks' adapters stay identical.
// GRPO: the rollout servers get the base with the adapters merged in (lora_train_refresh_merged); the reference
// model is the base with the adapters detached (trainer.h lora_ref).
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
// Writes the adapters (from the fp32 master weights) as a PEFT adapter folder into dir (adapter_config.json,
// adapter_model.safetensors; base_model_name_or_path = base_model), and their optimizer state into
// dir/trainer_state/adapter_optimizer.safetensors (per layer l: master.l, adam_m.l, adam_v.l, fp32, the adapter unit's
// elements).
int lora_train_save(LoraTrain *lt, const char *dir, const char *base_model, char *err, size_t err_len);
// Rank 0's export of the merged model (PEFT's merge_and_unload): the base with s B A added to every adapted weight,
// in fp32 on the host, written as a Hugging Face folder into dir (config.json, model.safetensors; bf16 when the
// base is held in bf16, else fp32). The whole model passes through host memory (4 bytes a parameter).
int lora_train_save_merged(LoraTrain *lt, const char *dir, char *err, size_t err_len);
// The weights the rollout servers get (GRPO): the base with s B A added to every adapted weight, in the storage
// dtype, for the weight sync to send slices of. refresh recomputes the decoder-layer units from the current adapters
// (a working copy of those units, made on first use: the base's layer units once more in memory; on the device, one
// GEMM per adapted module, s B A rounded to the storage dtype before it is added); merged_unit is unit u of it
// (the base's own buffer for the embedding and final units, which adapters do not touch).
int lora_train_refresh_merged(LoraTrain *lt, char *err, size_t err_len);
// The adapters (config, layout) and the fp32 master of layer `layer`'s adapter unit (backend memory, unit_numel
// elements): what an adapter-only weight push sends.
const ModelLora *lora_train_adapters(const LoraTrain *lt);
const float *lora_train_master(const LoraTrain *lt, int layer);
const void *lora_train_merged_unit(const LoraTrain *lt, int unit);
// Restores what lora_train_save wrote: the master weights (and the adapter units from them) and Adam moments.
// Refuses a folder whose adapter_config.json describes other adapters (r, lora_alpha, use_rslora, target_modules),
// naming both.
int lora_train_load(LoraTrain *lt, const char *dir, char *err, size_t err_len);

#endif
