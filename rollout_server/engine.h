// rollout_server/engine.h — the generation engine: one engine thread owns the scheduler and the model runner (the
// model, the paged KV cache: rollout_server/model_runner.h); HTTP handler threads and the ZeroMQ thread only submit
// requests and read their events.
//
// Life of a request: engine_submit() queues it (or refuses: queue full, invalid parameters, too long) and
// returns a handle. The engine thread admits it, prefills its prompt once (chunked, within the step's token
// budget), forks it into `n` sequences that share the prompt's KV blocks (copy-on-write of the last partial
// block), decodes all running sequences together each step (continuous batching), samples, and pushes
// events onto the handle. The submitting thread pops events with engine_request_next() and finally calls
// engine_request_release() — which also aborts the request if it is still running (client went away).
#ifndef TANDEM_ROLLOUT_ENGINE_H
#define TANDEM_ROLLOUT_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ops.h"
#include "rollout_server/request_latency.h"
#include "shared/ipc_region.h"
#include "shared/model.h"
#include "shared/tokenizer/tokenizer.h"

#define ENGINE_MAX_STOP 16          // stop strings and stop token ids per request, each
#define ENGINE_MAX_TOP_LOGPROBS 20
#define ENGINE_MAX_MASK_IDS (1 << 24) // n x (allowed ids + bad words) of one request (SamplingParams masks)

// Error codes returned by engine functions (0 = success).
enum {
    ENGINE_EINVAL = -1,      // bad parameters (message says which): maps to HTTP 400
    ENGINE_ETOOLONG = -2,    // prompt + max_tokens beyond the context or the whole cache: HTTP 400
    ENGINE_EQUEUE_FULL = -3, // --max-queued-requests reached: HTTP 429
    ENGINE_ESHUTDOWN = -4,   // draining or stopped: HTTP 503
    ENGINE_ENOMEM = -5,
    ENGINE_EINTERNAL = -6,   // model / backend failure: HTTP 500
};

typedef struct {
    int n;                      // completions of the prompt (>= 1)
    int max_tokens;             // >= 1; generation also stops at the context limit (finish "length")
    float temperature;          // 0 = greedy; >= 0
    float top_p;                // (0, 1]
    int top_k;                  // 0 or -1 = off
    float min_p;                // [0, 1]
    float repetition_penalty;   // > 0; 1 = off (HF semantics: divides positive logits, multiplies negative)
    int has_seed;
    uint64_t seed;              // completion i draws from the stream of (seed + i); without seed: a random one
    int ignore_eos;
    int32_t stop_token_ids[ENGINE_MAX_STOP];
    int n_stop_token_ids;
    char *stop[ENGINE_MAX_STOP]; // stop strings (owned by the caller until engine_submit returns; copied)
    int n_stop;
    int include_stop_str;       // keep the matched stop string in the text (vLLM include_stop_str_in_output)
    int top_logprobs;           // 0..ENGINE_MAX_TOP_LOGPROBS alternatives per token (the sampled token's own
                                // logprob is always reported)
    int skip_special_tokens;    // for the text of events (default 1)
    int no_text;                // the client reads ids only: events carry no text and the engine does not
                                // detokenise (ignored with stop strings, which need the text) (default 0)
    const char *structured_regex; // structured outputs: every completion is a fullmatch of this regex (Python re
    size_t structured_regex_len;  // syntax, the subset of guided_regex.h); NULL: none. The caller's until
                                  // engine_submit returns (compiled there); not with allowed_token_ids
    int prompt_logprobs;        // -1 (default): none; else each prompt token's logprob under the tokens before it
                                // (temperature 1, raw logits) and this many alternatives, 0..ENGINE_MAX_TOP_LOGPROBS
                                // (engine_request_prompt_logprobs). The prompt is then computed whole (no prefix
                                // cache hits)
    // vLLM's logits processors (rollout_server/sample_mask.h), each a mask on what the next token can be; the
    // reported logprobs stay those of the unmasked distribution (vLLM's default raw_logprobs). Arrays are the
    // caller's until engine_submit returns (copied).
    int min_tokens;             // 0..max_tokens: before this many generated tokens no eos id and no stop token id
                                // can be drawn, and no stop string matches text that ends within them (vLLM)
    const int32_t *allowed_token_ids; // (n_allowed) only these ids can be drawn; n_allowed 0: any id
    int n_allowed;
    const int32_t *bad_words_ids;     // the bad words' token sequences one after the other; word w is
    const int32_t *bad_words_offsets; // bad_words_ids[offsets[w] .. offsets[w + 1]) (n_bad_words + 1 offsets): its
    int n_bad_words;                  // last id cannot be drawn where the generated tokens end with the rest of it
    int adapter;                // 0: the served policy (the base model, plus the trainer's adapter once an adapter
                                // update has come); k >= 1: the k-th --lora adapter (engine_adapter_name)
} SamplingParams;

void sampling_params_default(SamplingParams *p); // n 1, max_tokens 16, temperature 1, top_p 1, top_k 0,
                                                 // min_p 0, repetition_penalty 1, skip_special_tokens 1

typedef enum { FINISH_NONE = 0, FINISH_LENGTH, FINISH_STOP, FINISH_ABORT, FINISH_ERROR } FinishReason;
const char *finish_reason_name(FinishReason r); // "length", "stop", "abort", "error"

typedef struct {
    int32_t id;
    float logprob;
} TokenLogprob;

// One step's output for one completion. Pointers stay valid until the next engine_request_next call on the
// same handle (or its release).
typedef struct {
    int index;                  // which completion (0..n-1)
    int n_tokens;               // new tokens (0 on a bare finish event)
    const int32_t *tokens;      // (n_tokens)
    const float *logprobs;      // (n_tokens) log-softmax(logits / T)[token], T = temperature or 1 when greedy,
                                // before penalties and top-k/top-p/min-p filtering (what the trainer computes)
    const TokenLogprob *top;    // (n_tokens, top_logprobs) alternatives, best first; NULL when not asked
    const char *text;           // UTF-8 text these tokens complete (held back while it might be a stop string
                                // or an incomplete character); never NULL, may be ""
    size_t text_len;
    FinishReason finish;        // FINISH_NONE until this completion's last event
    const char *stop_reason;    // the matched stop string, or NULL (set with FINISH_STOP on a string match)
    int32_t stop_token;         // the matched stop/eos token id, or -1
    int64_t policy_version;     // weights version that produced these tokens
    int restarted;              // a weight update re-queued this completion (ENGINE_UPDATE_ABORT): every token of
                                // its earlier events is void; its output starts again with this event's tokens
} EngineEvent;

// What a weight commit does with the sequences in flight (tandem-serve --weight-update-mode; weights_end "mode").
// Every mode empties the prefix cache, so no later request matches K/V of the old weights. In modes keep and abort
// the sequences in flight do not use it again either: each admitted sequence gives its KV blocks back and
// recomputes under the new weights what it keeps; mode keep_kv spares that recompute.
typedef enum {
    ENGINE_UPDATE_KEEP = 0,  // completions keep their tokens: prompt and generated tokens are recomputed, and the
                             // remaining tokens are sampled by the new version (vLLM's pause mode "keep" with
                             // clear_cache); each event carries the version of its tokens
    ENGINE_UPDATE_ABORT,     // completions of requests that take restarts (engine_request_allow_restart) drop their
                             // generated tokens and start again from the prompt under the new weights, as a fresh
                             // request would (same seed stream); their next event says `restarted`. Completions of
                             // other requests (an HTTP stream cannot take back what it sent) are kept as above
    ENGINE_UPDATE_KEEP_KV,   // completions keep their tokens and their K/V, computed under the old weights (vLLM's
                             // pause "keep" without clear_cache; partial rollouts): no recompute, so no stall, but
                             // the tokens after the update are sampled by the new weights attending to old K/V
} EngineUpdateMode;

const char *engine_update_mode_name(EngineUpdateMode m);        // "keep", "abort", "keep_kv"
int engine_update_mode_parse(const char *s, EngineUpdateMode *m); // 0, or -1 for any other text

// What one commit did to the sequences in flight (completions of admitted requests not finished at the commit).
typedef struct {
    int64_t sequences_kept;      // carried across with their tokens
    int64_t sequences_requeued;  // started again from their prompt (mode abort)
} EngineCommitReport;

typedef struct {
    const char *model_dir;
    OpsBackend backend;
    int device;
    int tensor_parallel_size;   // the model split over this many devices (cuda: device .. device + N - 1; cpu: N
                                // compute contexts), Megatron-style (model_runner_internal.h); 0 or 1: one device
    OpsSettings ops;            // the compute context's settings (kernels/cuda/README.md); zeroed: the defaults
    size_t kv_cache_bytes;      // KV pool size (--kv-cache-memory), per device
    double gpu_memory_utilization; // > 0 (cuda): size the KV pool so that the device's use stays within this
                                // fraction of its memory, counting weights, workspace and what others use;
                                // replaces kv_cache_bytes (--gpu-memory-utilization)
    int reserve_weight_copy;    // count a second copy of the weights (NCCL weight updates) in that budget
    int block_size;             // tokens per KV block (16)
    int max_num_seqs;           // running sequences per step
    int max_num_batched_tokens; // tokens per step (decodes + chunked prefill)
    int max_queued_requests;    // beyond this engine_submit returns ENGINE_EQUEUE_FULL
    int enable_prefix_caching;
    uint64_t seed;              // seeds requests that carry none
    int load_random;            // --load-format random: random weights (model_fill_random), no weight files read
    int enforce_eager;          // cuda: decode-only steps run their ops one by one instead of replaying CUDA graphs
                                // (still at the padded batch sizes: the same kernels and shapes) (--enforce-eager)
    // LoRA adapters served beside the base model (--lora NAME=DIR: PEFT adapter folders, loaded at start):
    // SamplingParams.adapter k in 1..n_loras runs through lora_dirs[k - 1], known to clients as lora_names[k - 1].
    // Not with tensor_parallel_size > 1.
    const char *const *lora_names;
    const char *const *lora_dirs;
    int n_loras;
    int adapter_updates_lowrank; // adapter updates (engine_commit_adapter) run as a low-rank path beside the base
                                // weights; 0: merged into the served weights, a copy of the base's decoder layers
                                // kept to merge the next one from (low-rank when that copy does not fit)
                                // (--adapter-update-mode)
    int cuda_graph_max_batch;   // cuda: decode-only steps of up to this many sequences are padded to the ladder of
                                // batch sizes and replayed as CUDA graphs; larger ones, and any step with prompt
                                // tokens, run eagerly unpadded; 0 = never pad (--cuda-graph-max-batch, 512)
} EngineConfig;

void engine_config_default(EngineConfig *c);

typedef struct Engine Engine;
typedef struct EngineRequest EngineRequest;
struct LoraConfig;   // shared/model_lora.h

// Loads the model (config, weights, tokenizer from cfg->model_dir), sizes the KV pool, starts the engine
// thread. On failure returns a negative code and a message that says what to change.
int engine_create(Engine **out, const EngineConfig *cfg, char *err, size_t err_len);
// Stops accepting, lets running requests finish for up to drain_timeout_ms, aborts what is left, joins the
// thread and frees everything.
void engine_destroy(Engine *e, int drain_timeout_ms);

const Model *engine_model(const Engine *e);
const Tokenizer *engine_tokenizer(const Engine *e);
const char *engine_model_id(const Engine *e);   // the model folder's base name
// The --lora adapters: how many, and the name of adapter k (1..count; NULL otherwise).
int engine_adapter_count(const Engine *e);
const char *engine_adapter_name(const Engine *e, int k);
int64_t engine_policy_version(const Engine *e);

// Queues a request for one prompt of token ids. On success *out is the handle (release it exactly once).
int engine_submit(Engine *e, const int32_t *prompt, int prompt_len, const SamplingParams *p, EngineRequest **out,
                  char *err, size_t err_len);
// Waits up to timeout_ms (-1 = forever) for the next event. Returns 1 with *ev filled, 0 on timeout, and -1
// once every completion has delivered its finish event (nothing more will come).
int engine_request_next(EngineRequest *r, EngineEvent *ev, int timeout_ms);
// For clients that only collect the final result: from now on a waiting engine_request_next is woken only when a
// completion finishes (or the engine lets go of the request), not at every step. Events still queue (a completion's
// consecutive tokens coalesce into one event) and are returned as before: at once by a call that finds them
// queued, or when a timed wait runs out. Saves the engine thread a wake-up per request and step.
void engine_request_wake_on_finish(EngineRequest *r);
// A request's prompt logprobs (SamplingParams.prompt_logprobs >= 0), ready once its first event has come: lp
// (prompt_tokens) with lp[0] = NAN (the first token has no context), top (prompt_tokens, k) alternatives best first,
// rank (prompt_tokens) each token's rank among all ids (1 = the most likely; 0 for position 0). Returns k, or -1
// when the request asked for none. Valid until the handle is released.
int engine_request_prompt_logprobs(const EngineRequest *r, const float **lp, const TokenLogprob **top,
                                   const int32_t **rank);
// Number of prompt tokens (after any truncation) and of cached prompt tokens (prefix cache hits).
int engine_request_prompt_tokens(const EngineRequest *r);
int engine_request_cached_tokens(const EngineRequest *r);
// The client collects whole results and can take a restart (EngineEvent.restarted): with ENGINE_UPDATE_ABORT a
// weight update re-queues this request's unfinished completions instead of keeping them. Call it right after
// engine_submit (a commit the engine applies before the call keeps the completions).
void engine_request_allow_restart(EngineRequest *r);
// Aborts the request if still running, and frees the handle once the engine thread has let go of it.
void engine_request_release(EngineRequest *r);

// ---- control (the ZeroMQ thread) ----------------------------------------------------------------
// pause: finish the current step and run no more until resume (queued requests wait).
void engine_pause(Engine *e);
void engine_resume(Engine *e);
// Drops every cached prefix block (requests in flight keep their own blocks).
void engine_reset_prefix_cache(Engine *e);
// Ends every request submitted before the call with FINISH_ABORT (their clients get a last event saying so);
// later ones run as usual (vLLM's pause mode "abort"). Works paused too.
void engine_abort_requests(Engine *e);
// Waits up to timeout_ms for the engine to have nothing queued or running (or to be paused, or stopping):
// 1 when it has, 0 on timeout. Requests submitted meanwhile are waited for too (vLLM's pause mode "wait").
int engine_wait_idle(Engine *e, int timeout_ms);
// Weight update: returns the staging copy of unit `unit` (host memory, layout->unit_numel[unit] elements: bf16 bits
// when engine_weights_staging_bf16, the engine's weights being bf16, else fp32) that the receiver fills;
// engine_commit_weights then swaps all staged units in between two steps, bumps the policy version to `version`,
// re-queues the sequences in flight as `mode` says (no drain: running sequences go on under the new weights) and
// resets the prefix cache. *rep (may be NULL) says what happened to them.
// Returns 0 or a negative code.
void *engine_weights_staging(Engine *e, int unit);
int engine_weights_staging_bf16(const Engine *e);
int engine_commit_weights(Engine *e, int64_t version, EngineUpdateMode mode, EngineCommitReport *rep, char *err,
                          size_t err_len);
// Adapter update (the policy trained as LoRA adapters): in between two steps the policy becomes the base weights
// plus adapter config c with the units of each decoder layer (model_lora_unit_numel elements) from host fp32 units
// (transport zmq; read before the call returns) or, with units NULL, from the device staging
// (engine_adapter_device_staging, filled over NCCL), replacing any previous adapter, then as engine_commit_weights
// (version, mode, prefix cache). A whole-weights commit afterwards drops the adapter. Returns 0 or a negative code.
int engine_commit_adapter(Engine *e, int64_t version, const struct LoraConfig *c, float *const *units,
                          EngineUpdateMode mode, EngineCommitReport *rep, char *err, size_t err_len);
// Transport nccl, adapter updates: layer `layer`'s adapter unit of unit_numel elements in backend memory (storage
// dtype), made on first use (NULL when out of memory or out of range), that the NCCL receiver fills.
void *engine_adapter_device_staging(Engine *e, size_t unit_numel, int layer);
// Transport nccl: the second copy of tensor-parallel shard `shard`'s unit `unit` on its device (storage dtype, the
// shard's unit_numel elements; shard 0 of 1: the whole unit), made on first use (NULL when out of memory), that
// the shard's NCCL receiver fills; engine_commit_device_weights swaps every unit of every shard with its copy in
// between two steps (pointers only), then as engine_commit_weights.
void *engine_weights_device_staging(Engine *e, int shard, int unit);
// Transport ipc: places shard `shard`'s device staging (above) in a region of memory that the trainer ranks of this
// host map, and returns it (NULL with a message when it cannot be made): model_runner.h runner_weights_ipc_staging.
const IpcRegion *engine_weights_ipc_staging(Engine *e, int shard, char *err, size_t err_len);
int engine_commit_device_weights(Engine *e, int64_t version, EngineUpdateMode mode, EngineCommitReport *rep,
                                 char *err, size_t err_len);
// The engine's compute context (shard 0's), its tensor-parallel shards (1: none), shard k's model (config, layout,
// place in the whole model) and compute context: what the NCCL receivers need.
OpsCtx *engine_ops(Engine *e);
int engine_tp(const Engine *e);
const Model *engine_shard_model(const Engine *e, int shard);
OpsCtx *engine_shard_ops(Engine *e, int shard);

// Kinds of engine step: decode-only steps replayed from a CUDA graph, decode-only steps run op by op (graphs off
// or not recorded yet, the CPU backend, sizes past the ladder), and steps with prompt tokens (prefill chunks).
enum { ENGINE_STEP_DECODE_GRAPH = 0, ENGINE_STEP_DECODE_EAGER = 1, ENGINE_STEP_PREFILL = 2 };

typedef struct {
    int64_t requests_waiting, requests_running, sequences_running;
    int64_t kv_blocks_total, kv_blocks_used, kv_blocks_cached;
    int64_t prompt_tokens_total, generation_tokens_total, cached_prompt_tokens_total;
    int64_t preemptions_total, steps_total;
    double step_seconds_sum;
    double step_compute_seconds_sum;  // of that, in the model and sampling calls (backend work and issuing it); the
                                      // rest is the engine's bookkeeping (scheduling, step arrays, events)
    int64_t step_seconds_buckets[12]; // cumulative counts of steps <= 1,2,5,10,20,50,100,200,500,1000,2000 ms, +Inf
    // Steps and their model + sampling seconds by kind (ENGINE_STEP_*): where the compute time of a load goes.
    int64_t steps_by_kind[3];
    double compute_seconds_by_kind[3];
    int64_t policy_version;
    int paused;
    // Weight updates applied, what they did to the sequences in flight (EngineCommitReport), and how long each
    // stopped generation: from the end of the engine's last step before it (or from the moment a pause that the
    // commit found took effect) to its next step. Cumulative bucket counts at 1, 5, 10, 50, 100, 500 ms, 1, 5, 10,
    // 60 s, +Inf.
    int64_t weight_updates_total;
    int64_t weight_update_sequences_kept_total, weight_update_sequences_requeued_total;
    double weight_update_pause_seconds_sum;
    int64_t weight_update_pause_buckets[11];
    // Completions: time to first token, between tokens and to the finish (request_latency.h), and how many finished
    // by FinishReason (index FINISH_NONE unused).
    LatencyHist latency[LATENCY_KINDS];
    int64_t completions_finished[FINISH_ERROR + 1];
} EngineStats;

#define ENGINE_UPDATE_PAUSE_BOUNDS_MS {1, 5, 10, 50, 100, 500, 1000, 5000, 10000, 60000}

void engine_stats(Engine *e, EngineStats *s);

#endif
