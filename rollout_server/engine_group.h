// rollout_server/engine_group.h — the engines of one tandem-serve process (`--devices`): one engine per listed
// device, each with its own copy of the model, KV pool, scheduler and engine thread (data parallel). The HTTP
// and ZeroMQ layers talk to the group, never to one engine; a server without --devices is a group of one.
//
// Routing: each new request (one prompt and its n completions) goes to the engine with the fewest outstanding
// sequences — completions submitted through the group and not yet released — ties to the lowest index. The n
// completions of a prompt stay on one engine (they share the prompt's KV blocks). A request's handle belongs to
// its engine, so events, abort and release reach the right one without the group.
//
// Weights: every engine holds the same version. A zmq update is received into engine 0's host staging; a commit
// pauses the engines, uploads the staged weights into each (one extra host copy at a time), swaps them in,
// and resumes. An nccl update is received into engine 0's device staging (each tensor-parallel shard's own);
// engine_group_spread_device_staging copies it device to device into the other engines' staging, shard k to shard
// k (ops_copy_peer), and the commit swaps every engine, paused together, so that no engine generates with the new
// weights while another still has the old.
#ifndef TANDEM_ROLLOUT_ENGINE_GROUP_H
#define TANDEM_ROLLOUT_ENGINE_GROUP_H

#include <stddef.h>
#include <stdint.h>

#include "rollout_server/engine.h"

#define ENGINE_GROUP_MAX 64

typedef struct {
    OpsBackend backend;
    int device;       // CUDA device index (0 on the CPU)
} EngineDevice;

// "cpu", "cuda:1", ... (cap >= 16).
void engine_device_name(const EngineDevice *d, char *out, size_t cap);

// Parses a --devices list: comma-separated entries "cpu", "cuda", "cuda:N" or "N" (CUDA device N), all CPU or all
// CUDA, at most ENGINE_GROUP_MAX. Returns the number of entries, or -1 with a message.
int engine_devices_parse(const char *list, EngineDevice *out, int max, char *err, size_t err_len);

typedef struct EngineGroup EngineGroup;

// Creates one engine per device from cfg (whose backend and device are replaced by each entry's), one after the
// other so that each engine's --gpu-memory-utilization budget sees what the ones before it took. A device that
// fails stops the start-up: the engines already made are destroyed and the message names the device.
int engine_group_create(EngineGroup **out, const EngineConfig *cfg, const EngineDevice *devs, int n_devs, char *err,
                        size_t err_len);
void engine_group_destroy(EngineGroup *g, int drain_timeout_ms);

int engine_group_size(const EngineGroup *g);
Engine *engine_group_engine(EngineGroup *g, int i);
const char *engine_group_device_name(const EngineGroup *g, int i);
// Every engine loaded the same folder: these are engine 0's.
const Model *engine_group_model(const EngineGroup *g);
const Tokenizer *engine_group_tokenizer(const EngineGroup *g);
const char *engine_group_model_id(const EngineGroup *g);
// The --lora adapters every engine serves: how many, and adapter k's name (1..count, else NULL).
int engine_group_adapter_count(const EngineGroup *g);
const char *engine_group_adapter_name(const EngineGroup *g, int k);
// The lowest policy version among the engines (they agree except for the moment of a commit).
int64_t engine_group_policy_version(const EngineGroup *g);

// Routes and submits one request (engine_submit's contract). *engine receives the index of the engine that took
// it: pass it to engine_group_release. An engine that refuses for want of room (queue full, prompt beyond its KV
// pool) is passed over for the next least loaded; the first refusal's message is returned when all refuse.
int engine_group_submit(EngineGroup *g, const int32_t *prompt, int prompt_len, const SamplingParams *p,
                        EngineRequest **out, int *engine, char *err, size_t err_len);
// engine_request_release, and the request's n completions stop counting against engine `engine`.
void engine_group_release(EngineGroup *g, EngineRequest *r, int engine, int n);

// ---- control: each applies to every engine ----------------------------------------------------------
void engine_group_pause(EngineGroup *g);
void engine_group_resume(EngineGroup *g);
void engine_group_reset_prefix_cache(EngineGroup *g);
void engine_group_abort_requests(EngineGroup *g);
// 1 once every engine is idle (engine_wait_idle), each given up to timeout_ms; 0 when one was not.
int engine_group_wait_idle(EngineGroup *g, int timeout_ms);

// Transport zmq: the host staging that a weight update is received into (engine 0's, see
// engine_weights_staging), and the commit of that update to every engine. Returns 0 or a negative engine code
// with a message naming the engine.
// `mode` and *rep (may be NULL) as for engine_commit_weights; *rep sums the engines' counts.
void *engine_group_weights_staging(EngineGroup *g, int unit);
int engine_group_weights_staging_bf16(const EngineGroup *g);
int engine_group_commit_weights(EngineGroup *g, int64_t version, EngineUpdateMode mode, EngineCommitReport *rep,
                                char *err, size_t err_len);
// Adapter update: every engine's policy becomes the base plus adapter config c with the host fp32 units (one per
// decoder layer) or, units NULL, engine 0's device staging (engine_adapter_device_staging; copied into the other
// engines' first), as engine_commit_adapter; the same version, mode and report as engine_group_commit_weights.
int engine_group_commit_adapter(EngineGroup *g, int64_t version, const struct LoraConfig *c, float *const *units,
                                EngineUpdateMode mode, EngineCommitReport *rep, char *err, size_t err_len);
// Transport nccl: makes every engine's device staging, every shard's (engine_weights_device_staging). Returns 0, or
// -1 with *engine, *shard and *unit naming the first that could not be made (out of device memory).
int engine_group_device_staging_ready(EngineGroup *g, int *engine, int *shard, int *unit);
// Copies engine 0's device staging (filled by the NCCL receiver) into every other engine's. Safe on a thread
// other than the engines' own while they generate: it touches only the staging copies. Returns 0 or -1 with err.
int engine_group_spread_device_staging(EngineGroup *g, char *err, size_t err_len);
// Swaps every engine's device staging in (engine_commit_device_weights), the engines paused together.
int engine_group_commit_device_weights(EngineGroup *g, int64_t version, EngineUpdateMode mode,
                                       EngineCommitReport *rep, char *err, size_t err_len);

// ---- statistics ---------------------------------------------------------------------------------------
typedef struct {
    EngineStats stats;
    int64_t requests_routed;    // requests the group sent to this engine
    int64_t outstanding;        // completions submitted there and not yet released (the routing load)
} EngineMemberStats;

// Sums over the engines (counters, gauges, histogram buckets: a weight update counts once per engine); policy_version is the lowest, paused is 1 when
// any engine is paused. per (n entries, may be NULL) receives each engine's own.
void engine_group_stats(EngineGroup *g, EngineStats *total, EngineMemberStats *per);

#endif
