// shared/model_lora.h — LoRA adapters beside the decoder's projections (PEFT's LoRA: Hu et al. 2021), for training
// adapters on a frozen base and for reading and writing PEFT adapter folders (docs/architecture.md "LoRA").
//
// A targeted projection y = x W^T (+ b) becomes y = x W^T (+ b) + s * (x A^T) B^T with A (r, in), B (out, r) and
// s = alpha / r (alpha / sqrt(r) with rsLoRA). The model runs it as two extra GEMMs beside the base one and never
// materialises W + s B A. q/k/v and gate/up are one fused GEMM in the base model (shared/layout.h): each of their
// adapters is still its own PEFT module with its own A and B, and its low-rank output is added into its columns of
// the fused output.
//
// Adapter parameters live in their own units, one per decoder layer ("adapter unit", flat, storage dtype for the
// GEMMs; fp32 gradients of the same shape), each module's A then B at LAYOUT_ALIGN-aligned offsets. The table of
// tensors carries PEFT's names: base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight (r, in) and
// ...lora_B.weight (out, r); mlp.gate_proj / up_proj / down_proj likewise.
#ifndef TANDEM_SHARED_MODEL_LORA_H
#define TANDEM_SHARED_MODEL_LORA_H

#include <stddef.h>
#include <stdint.h>

#include "shared/layout.h"
#include "shared/model.h"

// The modules PEFT can target in tandem's decoder, in the order their tensors sit in an adapter unit.
enum { LORA_Q_PROJ, LORA_K_PROJ, LORA_V_PROJ, LORA_O_PROJ, LORA_GATE_PROJ, LORA_UP_PROJ, LORA_DOWN_PROJ,
       LORA_N_MODULES };
#define LORA_ALL_TARGETS ((1u << LORA_N_MODULES) - 1)

// PEFT's module name of m ("q_proj", ...).
const char *lora_module_name(int module);

typedef enum {
    LORA_INIT_DEFAULT = 0,  // PEFT's init_lora_weights=True: A kaiming-uniform(a = sqrt(5)), U(+-1/sqrt(in))
    LORA_INIT_GAUSSIAN = 1, // init_lora_weights="gaussian": A normal(0, std 1/r). Both: B = 0.
} LoraInit;

typedef struct LoraConfig {
    int r;               // rank, >= 1
    float alpha;         // lora_alpha
    float dropout;       // lora_dropout in [0, 1): inverted dropout on each adapter's input (training forward)
    int use_rslora;      // scale alpha / sqrt(r) instead of alpha / r
    unsigned targets;    // bit (1u << LORA_*) per targeted module
    LoraInit init;
} LoraConfig;

// target_modules as TRL / PEFT take it on a command line: comma-separated PEFT names (q_proj,k_proj,v_proj,o_proj,
// gate_proj,up_proj,down_proj) or "all-linear" (every one of them: PEFT's all-linear leaves out only the lm_head).
int lora_parse_targets(const char *text, unsigned *targets, char *err, size_t err_len);
// "q_proj,v_proj" from bits (buffer of at least 96 bytes).
void lora_targets_text(unsigned targets, char *out, size_t len);
// "default" / "gaussian" (also PEFT's "true") -> LoraInit.
int lora_parse_init(const char *text, LoraInit *out, char *err, size_t err_len);
// r >= 1, alpha > 0, 0 <= dropout < 1, at least one target. Errors name the PEFT key and what to do.
int lora_config_check(const LoraConfig *c, char *err, size_t err_len);
float lora_scale(const LoraConfig *c);

// Adapters of a model, their activations for training, and the table of their tensors.
typedef struct ModelLora {
    LoraConfig cfg;
    float scale;
    int n_layers;
    int in[LORA_N_MODULES], out[LORA_N_MODULES];
    size_t a_off[LORA_N_MODULES], b_off[LORA_N_MODULES]; // in an adapter unit; SIZE_MAX when not targeted
    size_t unit_numel;                                   // elements of one adapter unit (a multiple of LAYOUT_ALIGN)
    LayoutTensor *tensors;                               // (n_tensors): unit = layer index, PEFT names
    int n_tensors;
    OpsCtx *ops;                                         // not owned
    void **params;        // (n_layers) adapter units, storage dtype, backend memory
    float **grads;        // (n_layers) fp32 gradients (+=), NULL when made without gradients
    // Training activations for up to max_tokens rows: t (per layer and module, (N, r)) = s * x A^T from the forward,
    // kept for the backward; scratch for one module's output or output gradient, the fused group's sum, and dt.
    int max_tokens;
    void *act_block;
    void *tmp, *sum, *dt;
    void *xd, *dxd;       // cfg.dropout > 0: a module's dropped-out input and its gradient (N, largest in)
    int layer;            // the decoder layer being run (set by the model's training loops)
    // Dropout masks (cfg.dropout > 0) are functions of this seed, the layer, the module and the element (ops_dropout),
    // so the backward and a checkpoint recompute regenerate the forward's: set it before each model_forward
    // (lora_dropout_seed) and leave it until that forward's backward is done.
    uint64_t dropout_seed;
    int no_dropout;       // 1: forwards that only score (GRPO's old logprobs) run without dropout
    // The server's copy (model_lora_serve_from), per layer: for each projection group (q|k|v, o, gate|up, down) its
    // targeted modules' A stacked, (m r, in), and one B (width, m r) that holds module j's s B in the module's output
    // columns and in columns j r .. (j + 1) r, zeros elsewhere. So a group's adapters are two GEMMs and an add,
    // however many of its modules are targeted. NULL until made.
    void **serve;                          // (n_layers) storage dtype, backend memory
    size_t serve_numel;
    size_t serve_a[4], serve_b[4];         // offsets per LORA_GROUP_*; SIZE_MAX: the group has no targeted module
    int serve_m[4];                        // targeted modules per group
} ModelLora;

// The dropout seed of one micro-batch: a mix of the run's seed, the optimizer step, the micro-batch within it and
// the rank (each rank trains on other rows: its masks are its own), so a resumed run draws the same masks.
uint64_t lora_dropout_seed(uint64_t seed, int64_t step, int micro, int rank);
// The seed of module `module` of layer `layer` within a micro-batch's seed: ops_dropout's seed for that adapter's
// input, z = splitmix64 finaliser of seed + (layer * LORA_N_MODULES + module + 1) * 0xD1B54A32D192ED03.
uint64_t lora_module_dropout_seed(uint64_t seed, int layer, int module);

// Makes the server's copy (ModelLora.serve) from adapter units: units[l] in l->ops' memory and storage dtype (what
// the trainer computes with and sends over NCCL), queued on l->ops; or host fp32 units (host[l], unit_numel each),
// rounded to the storage dtype first, and waited for. Both only copy and scale by s, so a host unit and its
// rounding give the same copy when s is a power of two. Returns 0 or -1 with a message (out of memory).
int model_lora_serve_from_units(ModelLora *l, const void *const *units, char *err, size_t err_len);
int model_lora_serve_from(ModelLora *l, float *const *host, char *err, size_t err_len);
// Elements of one adapter unit of config c on a model of config cfg (what model_lora_create's unit_numel will be).
size_t model_lora_unit_numel(const ModelConfig *cfg, const LoraConfig *c);
// Builds the layout for model m and allocates the adapter units (zeroed) and, with_grads, their gradients.
int model_lora_create(ModelLora **out, const Model *m, const LoraConfig *c, int with_grads, char *err,
                      size_t err_len);
void model_lora_free(ModelLora *l);
// Training activations for batches of up to max_tokens tokens (grows; never shrinks).
int model_lora_reserve(ModelLora *l, int max_tokens, char *err, size_t err_len);
void model_lora_zero_grads(ModelLora *l);
// PEFT's init of layer `layer`'s adapter unit into host fp32 (unit_numel elements, padding zero): A per cfg.init
// from a deterministic stream of (seed, layer, module), B zero.
void model_lora_init_unit(const ModelLora *l, uint64_t seed, int layer, float *host);
// Every layer's unit initialised and uploaded to params.
int model_lora_init(ModelLora *l, uint64_t seed, char *err, size_t err_len);

// PEFT's merge_and_unload for one layer: W += s B A for every targeted module, into the layer's base unit `unit`
// (host fp32, m->layout.unit_numel of decoder layer `layer`) from its adapter unit `adapter` (host fp32), with the
// fp32 GEMM of `cpu` (a CPU ops context, whose memory is host memory). Returns 0, or -1 with a message.
int model_lora_merge_unit(const ModelLora *l, const Model *m, OpsCtx *cpu, const float *adapter, float *unit,
                          char *err, size_t err_len);

// PEFT's merge for one decoder layer on the backend of o (the model's, or a CPU context): dst (the layer's unit,
// storage dtype, o's memory) = base + s B A for every targeted module, A and B from the adapter unit `adapter`
// (unit_numel elements, storage dtype, o's memory); dst may be base (merged in place). Each module is one GEMM that
// adds (s B) A into its weight, rounded once (s B rounded first: exact for a power-of-two s). scratch:
// model_lora_merge_scratch_bytes(l, o) of o's memory. Queues the work on o and returns without waiting for it (a
// failure is o's error, ops_status).
size_t model_lora_merge_scratch_bytes(const ModelLora *l, OpsCtx *o);
void model_lora_merge_layer(const ModelLora *l, const Model *m, OpsCtx *o, const void *adapter, const void *base,
                            void *dst, void *scratch);

// ---- adapters in inference steps (tandem-serve: --lora, adapter-only weight updates) --------------------------
//
// A step's rows come in ranges, each run through one adapter (several adapters in one step: vLLM's multi-LoRA);
// rows in no range see the base model alone. Per range and projection group, with the adapter's server copy
// (ModelLora.serve): t (rows, m r) = x A_g^T, then the group's output (rows, width) += t B_g^T, with the
// batch-invariant GEMM of the rollout server's steps: a row's numbers depend only on its own input and adapter,
// never on which rows share the step.
typedef struct {
    int row0, rows;            // rows [row0, row0 + rows) of the step
    const ModelLora *lora;     // made without gradients; params read, nothing else
} LoraRowRange;

typedef struct ModelLoraRows {
    LoraRowRange *ranges;      // (n_ranges) ascending, disjoint; set before each step
    int n_ranges, cap_ranges;
    int layer;                 // the decoder layer being run (set by the inference loops)
    // Scratch for up to max_tokens rows and rank max_r: t (N, 3 r) and a group's output (N, width).
    int max_tokens, max_r;
    OpsCtx *ops;               // not owned
    void *block, *t, *sum;
} ModelLoraRows;

// Scratch for steps of up to max_tokens rows through adapters of rank up to max_r on model m (grows, never
// shrinks), and room for as many ranges. Returns 0 or -1 with a message.
int model_lora_rows_reserve(ModelLoraRows *lr, const Model *m, int max_tokens, int max_r, char *err, size_t err_len);
void model_lora_rows_free(ModelLoraRows *lr);   // frees what reserve made (lr itself is the caller's)

// PEFT folders. Reads adapter_config.json into c (r, lora_alpha, lora_dropout, use_rslora, target_modules,
// init_lora_weights), refusing what tandem cannot run (DoRA, bias, rank/alpha patterns, fan_in_fan_out, layer
// selections, modules it has no place for), naming the key.
int lora_config_read(const char *dir, LoraConfig *c, char *err, size_t err_len);
// Reads the adapter tensors of dir/adapter_model.safetensors into host fp32 units (host[l], unit_numel each;
// every tensor of the layout present with its shape, nothing else) and uploads them to params.
int model_lora_load(ModelLora *l, const char *dir, float *const *host, char *err, size_t err_len);
// Writes dir/adapter_config.json (PEFT's keys; base_model_name_or_path = base_model, may be NULL) and
// dir/adapter_model.safetensors (fp32) from host fp32 units (host[l]). Files are written under temporary names and
// renamed into place.
int model_lora_save(const ModelLora *l, float *const *host, const char *dir, const char *base_model, char *err,
                    size_t err_len);

#endif
