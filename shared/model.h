// shared/model.h — the decoder model (Llama / Qwen2 / Qwen3 / Mistral), written once against kernels/ops.h and
// used by the trainer (training forward/backward, ZeRO-3) and the rollout server (decode with a KV cache).
//
// The model never owns the parameters directly: it asks a UnitSource for each unit when it needs it, so the
// same code runs with resident weights (server, single rank) and with ZeRO-3 gathered units (trainer).
#ifndef TANDEM_SHARED_MODEL_H
#define TANDEM_SHARED_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ops.h"
#include "shared/config.h"
#include "shared/layout.h"

// Tensor parallelism (Megatron-style, inference only): a model of `size` shards, each a Model whose config is the
// shard's (model_shard_config): its query heads, KV heads, MLP columns and vocabulary rows. q/k/v and gate/up are
// column-parallel (each shard computes its heads / columns), o_proj and down_proj row-parallel (each shard's partial
// sums are added over the shards by all_reduce), the embedding and lm_head split over the vocabulary (each shard
// looks up its rows, zero elsewhere, then all_reduce; each computes its logits columns, then all_gather). Norms and
// q/k norms are replicated. size 1 is the plain model (no collective is called).
typedef struct {
    int rank, size;
    int vocab_total;       // the whole model's V (the shard's cfg.vocab_size is its rows, ceil(V / size))
    int vocab_begin;       // first vocabulary row of this shard; rows past vocab_total are zero padding
    int q_head_begin;      // first query head of this shard (cfg.num_heads of them)
    int kv_head_begin;     // first KV head (cfg.num_kv_heads of them; shards share a head when size > the model's)
    // The shards' communicator (size members, member i = shard i, on this shard's compute context; not owned): every
    // shard makes the same collectives in the same order, ordered against its compute stream (shared/comm/comm.h).
    struct Comm *comm;
    // The same shards' peer group (kernels/ops.h ops_peer_all_reduce; not owned), NULL for none: sums of at most its
    // capacity elements go through it instead of comm (one kernel on the compute stream, no collective library).
    struct OpsPeerGroup *peers;
    int failed;            // a collective failed during the current step (model_decode_step* report it)
} ModelShard;

typedef struct {
    ModelConfig cfg;
    Layout layout;
    OpsCtx *ops;           // not owned
    float *inv_freq;       // (D/2) fp32, backend memory: rotary inverse frequencies (rope scaling applied)
    float attn_scale;      // 1 / sqrt(D)
    ModelShard shard;      // {rank 0, size 1} unless made by model_init_shard
    // LoRA adapters beside the projections of the training forward and backward (shared/model_lora.h; not owned),
    // NULL for none. The inference paths (paged attention) do not run them.
    struct ModelLora *lora;
    // Adapters of the rows of the inference steps (paged attention), each row range its own adapter or none
    // (shared/model_lora.h ModelLoraRows; not owned), NULL or no ranges for the base model alone.
    struct ModelLoraRows *lora_rows;
} Model;

// Where parameters and gradients come from. acquire/release bracket every read of a unit's parameters
// (storage dtype, layout->unit_numel[unit] elements); grad returns the unit's fp32 gradient buffer
// (same numel) to accumulate into; grad_done says backward will not touch that unit's gradient again
// in this pass (ZeRO-3 reduce-scatters it then). Any callback may be NULL when unused.
// acquire returns NULL on failure (the source records why in the ops context or its own state).
// prefetch is a hint that `unit` will be acquired next: ZeRO-3 starts its all-gather on the communication
// stream so it overlaps the compute the model queues before that acquire. It may do nothing.
typedef struct {
    const void *(*acquire)(void *user, int unit);
    void (*release)(void *user, int unit);
    float *(*grad)(void *user, int unit);
    void (*grad_done)(void *user, int unit);
    void (*prefetch)(void *user, int unit);
    void *user;
} UnitSource;

// Resident parameters and (optionally) gradients: every unit allocated in backend memory.
typedef struct {
    void **params;   // (n_units) storage dtype
    float **grads;   // (n_units) fp32, NULL unless allocated with grads
    int n_units;
} ResidentWeights;

// A packed batch of sequences (no padding). All arrays are host memory.
typedef struct {
    int n_seqs;                 // B
    int n_tokens;               // N = cu_seqlens[B]
    const int32_t *tokens;      // (N) input ids
    const int32_t *targets;     // (N) id whose logprob is wanted at each position, -1 = not scored
    const int32_t *cu_seqlens;  // (B+1) sequence b = tokens [cu_seqlens[b], cu_seqlens[b+1])
    const int32_t *positions;   // (N) rotary positions, NULL = 0..len-1 within each sequence
} Batch;

int model_init(Model *m, const ModelConfig *cfg, OpsCtx *ops, char *err, size_t err_len);
void model_free(Model *m);

// ---- tensor-parallel shards (shared/model_shard.c) ----
// The config of shard `rank` of `size` and its place in the whole model (shard: everything but the collectives).
// Needs num_heads and intermediate_size divisible by size, and num_kv_heads divisible by size or size by
// num_kv_heads (KV heads are then replicated: size / num_kv_heads shards hold each). Errors name the numbers.
int model_shard_config(const ModelConfig *full, int rank, int size, ModelConfig *out, ModelShard *shard, char *err,
                       size_t err_len);
// model_init for shard `rank` of `size` (m->shard.comm unset: set it before a step when size > 1).
int model_init_shard(Model *m, const ModelConfig *full, int rank, int size, OpsCtx *ops, char *err, size_t err_len);
// The shard's slice of unit `unit`: full_unit (host memory, the whole model's layout: full->layout.unit_numel[unit]
// elements of elem bytes, fp32 or bf16) -> shard_unit (shard->layout.unit_numel[unit] of them; padding and vocabulary
// rows past V zeroed).
void model_shard_unit(const Model *full, const Model *shard, int unit, const void *full_unit, void *shard_unit,
                      size_t elem);
// One part of a whole unit that a shard holds, for a weight update sent straight to the shards: rows x cols
// elements, row i at element full_at + i * full_cols of the whole unit, landing contiguous at element shard_at of
// the shard's unit (rows == 1 or cols == full_cols: contiguous in the whole unit too).
typedef struct {
    size_t full_at, shard_at;
    size_t rows, cols, full_cols;
} ModelShardPart;
// The parts of shard s (config shard_cfg, layout shard; full: the whole model's layout) that elements [begin, end)
// of the whole unit `unit` hold, in the order of the shard's unit (at most 3 per tensor: a partial row, whole rows,
// a partial row). Every element of the shard's unit that the whole unit has is in the parts of exactly one range
// of a partition of the whole unit; vocabulary padding rows and alignment gaps are in none. Returns the count, or
// -1 when more than cap. MODEL_SHARD_MAX_PARTS is ample: a unit holds at most 14 tensors (a decoder layer), 42 parts.
#define MODEL_SHARD_MAX_PARTS 96
int model_shard_parts(const Layout *full, const Layout *shard, const ModelConfig *shard_cfg, const ModelShard *s,
                      int unit, size_t begin, size_t end, ModelShardPart *parts, int cap);
// Random weights without weight files (tandem-serve --load-format random, for benchmarks of shapes whose files
// would not fit the disk): m's units (w: its resident weights; m a shard, or the whole model with full its own
// layout) get the whole model's values at their indices (ops_fill_hashed_uniform over model_shard_parts: uniform in
// +-0.02 sqrt(3), the std of transformers' initializer_range 0.02), norms 1, so every tensor-parallel size serves
// the same model. Queued on m's context. Returns 0, or -1 with a message.
int model_fill_random(const Model *m, const Layout *full, ResidentWeights *w, uint64_t seed, char *err, size_t err_len);
// Loads a Hugging Face model folder into n shards' resident weights (shards[k] with w[k], made by model_init_shard
// and resident_alloc): each unit is read once (whole: the whole model's Model, for its layout) and each shard gets
// its slice. Returns 0, or -1 with a message.
int model_load_shard_weights(const Model *whole, Model *const *shards, ResidentWeights *const *w, int n,
                             const char *model_dir, char *err, size_t err_len);
// The shards' collectives as the model code calls them, on storage-dtype backend memory: buf (count) = residual
// (count; NULL: nothing) + its sum over the shards, in place; recv (size * count) = every shard's send (count) in rank
// order. No-ops at size 1; a failure marks m->shard.failed (the step then fails) and later calls of the step do
// nothing. A sum that fits the peer group is one kernel that also adds the residual, every shard the same bits
// (kernels/ops.h); a larger one is the communicator's all-reduce, then the residual added.
void model_shard_reduce(Model *m, void *buf, const void *residual, size_t count);
void model_shard_gather(Model *m, void *recv, const void *send, size_t count);

int resident_alloc(ResidentWeights *w, const Model *m, int with_grads, char *err, size_t err_len);
void resident_free(ResidentWeights *w, const Model *m);
UnitSource resident_source(ResidentWeights *w);
// Zeroes every gradient buffer.
void resident_zero_grads(ResidentWeights *w, const Model *m);

// Loads a Hugging Face model folder (config.json + safetensors) into resident weights: every tensor is checked
// against the layout (missing, unexpected, wrong shape) and converted to the storage dtype.
int model_load(Model *m, ResidentWeights *w, OpsCtx *ops, const char *model_dir, char *err, size_t err_len);
// Loads only the tensors into already-initialised resident weights (model and layout from this config).
int model_load_weights(const Model *m, ResidentWeights *w, const char *model_dir, char *err, size_t err_len);
// Pieces of model_load_weights for loaders that place units themselves (ZeRO-3 keeps one slice per rank):
// refuse tensors the layout has no place for; read unit `unit` (all its tensors, checked) into host fp32
// (layout->unit_numel[unit] elements, padding zeroed).
struct SafetensorsSet;
int model_check_tensors(const Model *m, const struct SafetensorsSet *set, char *err, size_t err_len);
int model_read_unit(const Model *m, const struct SafetensorsSet *set, int unit, float *host, char *err,
                    size_t err_len);
// Writes an HF-loadable folder: config.json plus safetensors (sharded above max_shard_bytes; 0 = never).
// `units` yields each unit's parameters (fp32 host copies are made per unit). dtype_bf16 selects BF16 tensors.
int model_save(const Model *m, UnitSource *units, const char *out_dir, int dtype_bf16, size_t max_shard_bytes,
               char *err, size_t err_len);
// The same from host fp32 copies of every unit (units[u] holds at least unit_numel[u] elements).
int model_save_host(const Model *m, float *const *units, const char *out_dir, int dtype_bf16, size_t max_shard_bytes,
                    char *err, size_t err_len);
// Fills resident weights with a deterministic random init (normal(0, std) matrices, ones for norms, zero bias).
void model_init_random(const Model *m, ResidentWeights *w, uint64_t seed, float std);
// The same values for one unit, into host fp32 (unit_numel elements).
void model_random_unit_f32(const Model *m, uint64_t seed, float std, int unit, float *host);

// ---- training -----------------------------------------------------------------------------------

typedef struct TrainActs TrainActs;
// train_acts_create flags.
enum {
    // Keep only each layer's input, attention output and log-sum-exp, and recompute the rest of the layer (but not
    // the attention) during backward (activation checkpointing).
    TRAIN_ACTS_CHECKPOINT = 1,
    // Keep the forward's lm_head logits of the whole batch (max_tokens x vocab, storage dtype) for the backward
    // instead of recomputing them chunk by chunk: one lm_head GEMM fewer per step for that memory. The backward
    // turns them into their gradient in place, so each model_forward allows one backward.
    TRAIN_ACTS_KEEP_LOGITS = 2,
};
// Activation memory for batches of up to max_tokens tokens and max_seqs sequences; flags: TRAIN_ACTS_* or'ed
// (0 = every layer's intermediates kept, logits recomputed in backward).
int train_acts_create(TrainActs **out, const Model *m, int max_tokens, int max_seqs, int flags, char *err,
                      size_t err_len);
void train_acts_free(TrainActs *a, const Model *m);
// Backend memory the buffers hold, all of it; of which, with checkpointing, what each layer keeps across the
// recompute (attention output and log-sum-exp; without q/k norms also q, k, v and xmid), 0 without.
size_t train_acts_bytes(const TrainActs *a);
size_t train_acts_kept_bytes(const TrainActs *a);
// Of train_acts_bytes, the whole batch's logits kept for the backward (TRAIN_ACTS_KEEP_LOGITS), 0 without.
size_t train_acts_logits_bytes(const TrainActs *a);

// Forward over a batch: per-token logprobs (N) of batch->targets under softmax(logits * inv_temperature), and
// optionally per-token entropy (N) and the full logits (N, V) — all host fp32 outputs, NULL to skip.
// Keeps what model_backward needs in `a`. Returns 0 or a negative code (message in err).
int model_forward(Model *m, TrainActs *a, UnitSource *src, const Batch *batch, float inv_temperature,
                  float *logprobs, float *entropy, float *logits, char *err, size_t err_len);
// Backward of sum_n dlogprobs[n] * logprobs[n] for the batch of the last model_forward: gradients are
// accumulated (+=) into src->grad(unit) for every unit. dlogprobs (N) host fp32. With LoRA adapters (m->lora) their
// gradients are accumulated into m->lora->grads, and a source without gradients (src->grad NULL, or returning NULL)
// is a frozen base: none of the base model's weight-gradient GEMMs run.
int model_backward(Model *m, TrainActs *a, UnitSource *src, const float *dlogprobs, char *err, size_t err_len);
// The same for sum_n dlogprobs[n] * logprobs[n] + dentropy[n] * entropy[n] (entropy of softmax(logits *
// inv_temperature), as model_forward reports it); dentropy (N) host fp32, NULL = no entropy term. With an
// entropy term the preceding model_forward must have been asked for entropy.
int model_backward_entropy(Model *m, TrainActs *a, UnitSource *src, const float *dlogprobs, const float *dentropy,
                           char *err, size_t err_len);

// ---- inference with a KV cache --------------------------------------------------------------------

// Per-layer K and V pools of n_blocks * block_size token slots: k[l], v[l] (n_slots, Hkv, D) storage dtype.
typedef struct {
    int n_layers, n_blocks, block_size;
    void **k, **v;
} KVCache;

int kv_cache_create(KVCache *kv, const Model *m, int n_blocks, int block_size, char *err, size_t err_len);
void kv_cache_free(KVCache *kv, const Model *m);
size_t kv_cache_bytes_per_block(const Model *m, int block_size);

typedef struct DecodeBufs DecodeBufs;
// Scratch for one inference step of up to max_tokens tokens over up to max_seqs sequences with block tables of
// max_blocks entries, returning logits for up to max_logit_rows tokens.
int decode_bufs_create(DecodeBufs **out, const Model *m, int max_tokens, int max_seqs, int max_blocks,
                       int max_logit_rows, char *err, size_t err_len);
void decode_bufs_free(DecodeBufs *b, const Model *m);
// The last step's logits in backend memory: (max_logit_rows, V) storage dtype, the step's n_logit_rows rows first.
// Valid until the next model_decode_step on these buffers.
const void *decode_bufs_logits(const DecodeBufs *b);

// One step over N tokens (prefill chunks and decodes mixed): token i has id tokens[i], belongs to sequence
// token_seq[i] at position token_pos[i], and its k/v are written to slot_mapping[i]. block_tables (n_seqs,
// max_blocks), max_blocks at most the buffers' (narrower rows, covering the step's positions, upload less).
// Writes logits (n_logit_rows, V) host fp32 for the tokens listed in logit_rows (indices into 0..N-1); with
// logits NULL they stay in backend memory (decode_bufs_logits) and the step returns without waiting for the
// device, for ops that consume them there (the rollout server samples with ops_sample_rows).
// All inputs are host arrays. Rows in a range of m->lora_rows run through that range's LoRA adapter.
int model_decode_step(Model *m, DecodeBufs *b, UnitSource *src, KVCache *kv, int N, const int32_t *tokens,
                      const int32_t *token_seq, const int32_t *token_pos, const int32_t *slot_mapping,
                      const int32_t *block_tables, int n_seqs, int max_blocks, const int32_t *logit_rows,
                      int n_logit_rows, float *logits, char *err, size_t err_len);

// More logits rows of the last model_decode_step on b (its final hidden states are kept until the next step on b):
// decode_bufs_logits (n_rows, V) = the logits of the step's tokens rows[0..n_rows), n_rows <= the buffers'
// max_logit_rows, replacing the step's own logits; with logits not NULL also host fp32 (waiting for the device).
// For scoring prompt tokens (prompt logprobs), whose rows outnumber the sampled ones: called in chunks. Returns 0,
// or -1 with a message (no unpadded step before it, a row outside the step, a backend failure).
int model_decode_more_logits(Model *m, DecodeBufs *b, UnitSource *src, const int32_t *rows, int n_rows,
                             float *logits, char *err, size_t err_len);

// ---- decode-only steps: padded batch sizes, CUDA graphs ----
//
// A decode-only step gives each of n sequences its next token (one token per sequence). It runs at the padded
// size P = the smallest rung >= n of a ladder of batch sizes (decode_ladder), with P - n padding rows that store
// nothing and whose outputs are dropped. Where the backend has graphs (ops_graph_supported) the ops of a step of
// size P are recorded once into a CUDA graph and replayed from then on with one launch: the per-step inputs
// are copied into fixed buffers first, and every kernel takes its sizes from P or from backend memory (sequence
// positions), never from host values that change between steps. Graph replay and eager runs of a padded step
// queue the same kernels on the same shapes and buffers, so their logits are the same bits; padding never changes
// a real row's numbers (every op is row-independent). A step of n sequences through model_decode_step (unpadded,
// other GEMM shapes) may differ from the padded one in the last bits.
// Graphs are recorded lazily, on the first step of each size: that step runs eagerly (which also creates the
// GEMM plans the recording needs) and the graph is recorded right after it. A graph freezes the pointers it was
// recorded with: each step compares every parameter unit's pointer (as src->acquire returns it), each layer's KV
// pools and the rotary table with those of the size's graphs, replays the one that matches, and otherwise (a
// weight swap that exchanges buffers) runs eagerly and records a graph for the new pointers. Two graphs are kept
// per size, the least recently used one being recorded over (its executable graph updated in place when it can):
// the NCCL weight update alternates between two buffer sets, so after the first two updates it costs no recording.
// Parameters changed in place (same pointers, new values) need nothing: a replay reads the memory as it is.
// A recording that fails leaves its step's eager results standing; a size whose recording failed 3 times runs
// eagerly from then on (decode_bufs_graph_stats says why).

// The ladder up to cap: 1, 2, 4, 8, then 2^k and 3 * 2^(k-1) (16, 24, 32, 48, 64, 96, ...) below cap, then cap
// itself. Writes up to max_sizes ascending sizes; returns how many (0 when cap < 1).
int decode_ladder(int cap, int *sizes, int max_sizes);
// Sets b up for padded steps of up to max_batch sequences (lowered to what b holds: max_tokens, max_seqs,
// max_logit_rows). use_graphs 1 records and replays graphs where the backend supports them, 0 runs every padded
// step eagerly (the same numbers). Calling it again with the same size only switches use_graphs (keeping the
// graphs made so far). Returns the largest padded batch (0: max_batch < 1, padded steps off) or -1 with a message.
int decode_bufs_enable_padded(DecodeBufs *b, const Model *m, int max_batch, int use_graphs, char *err,
                              size_t err_len);
// The padded size a decode-only step of n sequences runs at, or 0 when n is beyond the ladder (or padded steps
// are off): run such a step through model_decode_step, as every step with LoRA adapter rows (m->lora_rows) but
// those whose rows all run through one adapter (one range over the n rows: it then covers the padding rows too, and
// the adapter's units and scratch are part of the graph's key).
int decode_bufs_padded_size(const DecodeBufs *b, int n);
// The largest padded size (the ladder's top), 0 when padded steps are not set up.
int decode_bufs_padded_max(const DecodeBufs *b);
// 1 when padded steps replay graphs (enabled with use_graphs and supported by the backend).
int decode_bufs_graphs_on(const DecodeBufs *b);

typedef struct {
    int graphs;               // executable graphs held (one per batch size used so far)
    int64_t recordings;       // graphs recorded: first use of a size, and again after new pointers
    int64_t replays;          // padded steps run by replaying a graph
    int64_t eager_steps;      // padded steps run eagerly (before each recording, graphs off, failed sizes)
    int64_t failures;         // recordings that failed (that size then runs eagerly; its step is not affected)
    double record_seconds;    // host time spent recording and instantiating, all graphs
    int last_batch;           // padded size of the latest recording or failure
    int last_failed;          // the latest recording failed (last_error says why)
    int last_gave_up;         // ... for the last time: that size runs eagerly from now on
    int last_again;           // the latest recording was for a size that had a graph (for other pointers)
    double last_seconds;      // its host time
    int64_t last_bytes;       // device memory it took (free memory before - after; 0 when the driver had room)
    char last_error[256];     // the latest failure's message
} DecodeGraphStats;
void decode_bufs_graph_stats(const DecodeBufs *b, DecodeGraphStats *s);

// A decode-only step of n sequences: sequence i (its row in block_tables (n, max_blocks), max_blocks as above) has
// the next token tokens[i] at position token_pos[i], its k/v going to slot_mapping[i]. Logits (n, V) of every
// sequence, first in decode_bufs_logits (backend memory); with logits not NULL also as host fp32 (and the step
// waits for the device). src must keep each unit at the pointer acquire returns until release (resident
// weights): all units are acquired for the whole step. All inputs are host arrays. Returns 0, or -1 with a
// message (n beyond the ladder included).
int model_decode_step_padded(Model *m, DecodeBufs *b, UnitSource *src, KVCache *kv, int n, const int32_t *tokens,
                             const int32_t *token_pos, const int32_t *slot_mapping, const int32_t *block_tables,
                             int max_blocks, float *logits, char *err, size_t err_len);

// Greedy generation for B prompts with a contiguous cache (sequence b owns blocks [b*max_blocks, (b+1)*max_blocks)).
// out_tokens (B, max_new) receives generated ids; generation of a row stops after an id in eos_ids (it is
// kept) and the rest of the row is -1.
int model_generate_greedy(Model *m, UnitSource *src, int B, const int32_t *const *prompts, const int *prompt_lens,
                          int max_new, const int32_t *eos_ids, int n_eos, int32_t *out_tokens, char *err,
                          size_t err_len);

#endif
