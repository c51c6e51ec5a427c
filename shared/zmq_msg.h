// shared/zmq_msg.h — the message codec of the trainer <-> rollout server ZeroMQ channel (docs/protocol-zmq.md).
//
// A message is a list of frames: frame 0 is a JSON object {"type": ..., "id": ..., ...}; the frames after it
// are raw little-endian arrays whose count and byte sizes the header determines (int32 token ids, float32
// logprobs, float32 or bf16 weight slices). The codec knows nothing about sockets: it turns a ZmsgMsg into
// frames (zmsg_build) and frames into a ZmsgMsg (zmsg_parse), so the server, the trainer and the tests share
// one definition. Parsing is strict: an unknown type, an unknown / missing / mistyped field, an out-of-range
// value, or a frame count or byte size that disagrees with the header is refused with a message naming it.
#ifndef TANDEM_SHARED_ZMQ_MSG_H
#define TANDEM_SHARED_ZMQ_MSG_H

#include <stddef.h>
#include <stdint.h>

#define ZMSG_PROTOCOL_VERSION 1
#define ZMSG_MAX_STOP 16            // stop_token_ids per generate (the engine's limit)
#define ZMSG_MAX_PROMPTS 4096       // prompts per generate message
#define ZMSG_MAX_COMPLETIONS 4096   // n per prompt
#define ZMSG_MODEL_ID_MAX 256
#define ZMSG_TEXT_MAX 1024          // error message text
// The largest frame each side takes (ZMQ_MAXMSGSIZE: a peer that sends more is disconnected before the frame is
// read whole). Requests: a weight slice is 4 MiB (1 Mi elements of f32), a prompt at most max_seq_len tokens.
// Replies: a result carries n x max_tokens tokens and as many logprobs (4096 x 16384 x 4 B = 256 MiB).
#define ZMSG_MAX_REQUEST_FRAME_BYTES ((int64_t)64 << 20)
#define ZMSG_MAX_REPLY_FRAME_BYTES ((int64_t)256 << 20)
#define ZMSG_CODE_MAX 32
#define ZMSG_ADAPTER_TARGETS_MAX 128

typedef enum {
    ZMSG_HELLO = 0,
    ZMSG_GENERATE,
    ZMSG_RESULT,          // reply only: one per prompt of a generate
    ZMSG_PAUSE,
    ZMSG_RESUME,
    ZMSG_RESET_CACHE,
    ZMSG_STATS,
    ZMSG_SHUTDOWN,
    ZMSG_WEIGHTS_BEGIN,
    ZMSG_WEIGHTS_SLICE,   // request only: errors are the only reply
    ZMSG_WEIGHTS_END,
    ZMSG_ERROR,           // reply only
    ZMSG_N_TYPES
} ZmsgType;

typedef enum { ZMSG_DIR_REQUEST = 0, ZMSG_DIR_REPLY = 1 } ZmsgDir;   // request: trainer -> server

typedef enum { ZMSG_DTYPE_F32 = 0, ZMSG_DTYPE_BF16 = 1 } ZmsgDtype;
typedef enum { ZMSG_TRANSPORT_ZMQ = 0, ZMSG_TRANSPORT_NCCL = 1, ZMSG_TRANSPORT_IPC = 2 } ZmsgTransport;
typedef enum { ZMSG_COMM_NCCL = 0, ZMSG_COMM_HOST = 1 } ZmsgCommBackend;
#define ZMSG_NCCL_ID_BYTES 128   // = COMM_UNIQUE_ID_BYTES (ncclUniqueId)
// Transport ipc (docs/protocol-zmq.md): the sizes of shared/ipc_region.h, and the shards one reply can describe.
#define ZMSG_IPC_MAX_SHARDS 16
#define ZMSG_IPC_HANDLE_MAX 96
#define ZMSG_IPC_HOST_MAX 64
#define ZMSG_IPC_DEVICE_MAX 48
// One tensor-parallel shard's receive staging in a weights_begin reply with transport ipc.
typedef struct {
    char handle[ZMSG_IPC_HANDLE_MAX];   // "handle": cuda: base64 of the cudaIpcMemHandle_t; shm: the shm_open name
    int64_t bytes;                      // "bytes": the region's size
    char device[ZMSG_IPC_DEVICE_MAX];   // "device" (cuda): the GPU's PCI bus id; "" on the CPU
    char uuid[ZMSG_IPC_DEVICE_MAX];     // "uuid" (cuda): the GPU's UUID; "" on the CPU
} ZmsgIpcShard;
// The weights_begin reply's "ipc" object: where the trainer ranks write the update.
typedef struct {
    int present;
    char host[ZMSG_IPC_HOST_MAX];       // "host": the server host's boot id (shared/ipc_region.h ipc_host_id)
    uint64_t staging_id;                // "staging_id" (16 hex digits): changes when the staging is made anew (a
                                        // restarted server): the ranks then open the handles again
    int64_t pid;                        // "pid": the server process
    int cuda;                           // "memory": "cuda" (CUDA IPC handles) or "shm" (POSIX shared memory)
    int n_shards;                       // "shards": engine 0's tensor-parallel shards, in order
    ZmsgIpcShard shards[ZMSG_IPC_MAX_SHARDS];
} ZmsgIpc;
// What a weight update does with the server's sequences in flight (weights_end "mode"): "keep" (they go on under
// the new weights, their tokens recomputed), "abort" (they start over from their prompt) or "keep_kv" (they go on
// with the K/V the old weights computed), docs/protocol-zmq.md.
typedef enum { ZMSG_UPDATE_KEEP = 0, ZMSG_UPDATE_ABORT = 1, ZMSG_UPDATE_KEEP_KV = 2 } ZmsgUpdateMode;
// A change of policy version inside a completion: its tokens from index `token` on were sampled by `version`.
typedef struct {
    int32_t token;
    int64_t version;
} ZmsgVersionChange;
// Finish reasons of a completion, as the strings "length", "stop", "abort", "error" on the wire.
typedef enum { ZMSG_FINISH_LENGTH = 0, ZMSG_FINISH_STOP, ZMSG_FINISH_ABORT, ZMSG_FINISH_ERROR } ZmsgFinish;

typedef struct {
    const void *data;
    size_t size;
} ZmsgFrame;

// Sampling parameters of a generate, with vLLM / TRL names and vLLM defaults.
typedef struct {
    int n;                       // completions per prompt, >= 1 (default 1)
    int max_tokens;              // >= 1 (default 16)
    float temperature;           // >= 0, 0 = greedy (default 1)
    float top_p;                 // (0, 1] (default 1)
    int top_k;                   // -1 or 0 = off, else >= 1 (default -1)
    float min_p;                 // [0, 1] (default 0)
    float repetition_penalty;    // > 0 (default 1)
    int has_seed;                // "seed": null or absent -> 0
    uint64_t seed;               // [0, 2^63)
    int32_t stop_token_ids[ZMSG_MAX_STOP];
    int n_stop_token_ids;
    int ignore_eos;
} ZmsgSampling;

// Engine counters of a stats reply (rollout_server/engine.h EngineStats, plus the control channel's own).
typedef struct {
    int64_t requests_waiting, requests_running, sequences_running;
    int64_t kv_blocks_total, kv_blocks_used, kv_blocks_cached;
    int64_t prompt_tokens_total, generation_tokens_total, cached_prompt_tokens_total;
    int64_t preemptions_total, steps_total;
    double step_seconds_sum;
    int64_t policy_version;
    int paused;
    int64_t prompts_in_flight;   // generate prompts the control channel is waiting on
} ZmsgStats;

// One message. Fields are grouped by the types that use them; the others stay zero. Arrays in a message
// returned by zmsg_parse are owned by it (zmsg_free) except slice_data, which points into the frames that
// were parsed. A message given to zmsg_build only lends its arrays.
typedef struct {
    ZmsgType type;
    ZmsgDir dir;
    int64_t id;                  // >= 0, echoed in the replies; -1 only in an error reply whose request had
                                 // no readable id (JSON null)

    // hello: request protocol_version (0 = not given); reply: all of these
    int protocol_version;
    char model_id[ZMSG_MODEL_ID_MAX];
    uint64_t layout_hash;        // also weights_begin; on the wire 16 lowercase hex digits
    int n_units;
    int64_t *unit_numel;         // (n_units) elements per unit
    int64_t policy_version;      // hello reply
    int max_seq_len;
    int vocab_size;
    // hello reply (sent when > 1; parsed as 1 when absent): the server's tensor-parallel shards. weights_begin with
    // transport nccl (sent when > 1): the shards the trainer cut every unit for; the server's shards are members
    // nccl_rank .. nccl_rank + tensor_parallel_size - 1, shard k receiving its own parts (shared/model.h
    // model_shard_parts). Messages made by zmsg_init carry 0, which means 1.
    int tensor_parallel_size;

    // generate request: sampling and n_prompts prompts of token ids (one frame each)
    ZmsgSampling sampling;
    int n_prompts;               // also result
    int32_t **prompts;           // (n_prompts) -> (prompt_lens[i]) int32
    int *prompt_lens;            // (n_prompts)

    // result reply: one prompt's n completions; frames: tokens (sum lens) int32, logprobs (sum lens) float32
    int prompt_index;            // 0..n_prompts-1 within its generate
    int n_completions;
    int *completion_lens;        // (n_completions)
    ZmsgFinish *finish_reasons;  // (n_completions)
    int64_t *policy_versions;    // (n_completions) weights version of each completion's first token
    int64_t *policy_versions_end;// (n_completions) ... and of its last token (differs if an update landed)
    // Where the version changed inside each completion ("policy_version_changes", sent only when some completion
    // of the prompt has a change): NULL, or (n_completions) counts with version_changes holding completion 0's
    // changes, then completion 1's, ...; a completion without changes has the one version policy_versions[i].
    int *n_version_changes;
    ZmsgVersionChange *version_changes;
    int32_t *tokens;             // (sum completion_lens) completion 0's tokens, then completion 1's, ...
    float *logprobs;             // (sum completion_lens)
    int prompt_tokens;           // prompt tokens the engine used
    int cached_tokens;           // of which prefix-cache hits

    // stats reply
    ZmsgStats stats;

    // weights_begin (version, transport, layout_hash), weights_slice, weights_end (version; reply: seconds)
    int64_t version;             // also the replies of weights_begin / weights_end
    ZmsgTransport transport;
    int unit;
    int64_t offset, count;       // elements
    int has_version;             // weights_slice: "version" given (a slice from a peer other than the opener)
    ZmsgDtype dtype;
    const void *slice_data;      // (count) f32 or bf16, little-endian, not necessarily aligned
    double seconds;              // weights_end reply: weights_begin to commit done
    double commit_seconds;       // weights_end reply: the engine's swap alone
    int has_update_mode;         // weights_end request: "mode" given (else the server's --weight-update-mode)
    ZmsgUpdateMode update_mode;
    int has_update_report;       // weights_end reply: sequences_kept / sequences_requeued present (sent when the
                                 // request gave "mode")
    int64_t sequences_kept, sequences_requeued; // in-flight completions carried across / restarted by the update
    // weights_begin with transport nccl: the weight-sync communicator (trainer ranks 0..trainer_ranks-1, then
    // the servers). nccl_id travels as 256 lowercase hex digits; the same id as last time means "reuse it".
    uint8_t nccl_id[ZMSG_NCCL_ID_BYTES];
    int nccl_world, nccl_rank, trainer_ranks;
    ZmsgCommBackend comm_backend;   // "comm_backend": the communicator's backend, "nccl" (default) or "host" (CPU
                                    // ranks and servers: shared/comm's host backend, the id from comm_unique_id_host)
    // weights_begin with transport ipc: "ipc_host", the sender's host (boot id), which the server compares with its
    // own; tensor_parallel_size as for nccl. The reply carries "ipc" (ZmsgIpc).
    char ipc_host[ZMSG_IPC_HOST_MAX];
    ZmsgIpc ipc;
    // weights_begin with "adapter" {r, lora_alpha, use_rslora, target_modules}: the update carries LoRA adapters
    // alone (the policy is the base weights plus them); its units are the decoder layers' adapter units
    // (shared/model_lora.h), slices address those. Transport zmq only.
    int has_adapter;
    int adapter_r;
    double adapter_alpha;
    int adapter_rslora;
    char adapter_targets[ZMSG_ADAPTER_TARGETS_MAX];   // PEFT module names, comma-separated

    // error reply
    char code[ZMSG_CODE_MAX];    // short machine-readable reason, e.g. "bad_message", "queue_full"
    char message[ZMSG_TEXT_MAX];

    int owned_;                  // internal: arrays were allocated by zmsg_parse
} ZmsgMsg;

// Encoded message: frames[0] is the JSON header (owned), frames[1..] borrow the ZmsgMsg's arrays.
typedef struct {
    char *header;
    size_t header_len;
    ZmsgFrame *frames;           // (n_frames)
    int n_frames;
} ZmsgOut;

const char *zmsg_type_name(ZmsgType t);         // "hello", "generate", ..., NULL for an invalid value
const char *zmsg_finish_name(ZmsgFinish f);     // "length", "stop", "abort", "error"
const char *zmsg_dtype_name(ZmsgDtype d);       // "f32", "bf16"
const char *zmsg_transport_name(ZmsgTransport t); // "zmq", "nccl", "ipc"
size_t zmsg_dtype_size(ZmsgDtype d);            // 4, 2
const char *zmsg_update_mode_name(ZmsgUpdateMode u); // "keep", "abort", "keep_kv"

// Fills the defaults above (type and id left to the caller).
void zmsg_sampling_default(ZmsgSampling *s);
// Zeroes a message and sets its type, direction and id (generate: default sampling).
void zmsg_init(ZmsgMsg *m, ZmsgType type, ZmsgDir dir, int64_t id);

// Encodes m. Returns 0, or a negative code when m is inconsistent (a type that has no such direction, a
// missing array, a count out of range) with a message naming the field. Release with zmsg_out_free.
int zmsg_build(const ZmsgMsg *m, ZmsgOut *out, char *err, size_t err_len);
void zmsg_out_free(ZmsgOut *out);

// Decodes frames travelling in direction dir. Returns 0 with *m filled (release it with zmsg_free), or a
// negative code with a message naming the offending field or frame; then *m needs no zmsg_free, and m->id
// holds the header's id when one was readable (else -1) so that the error reply can carry it.
int zmsg_parse(ZmsgMsg *m, ZmsgDir dir, const ZmsgFrame *frames, int n_frames, char *err, size_t err_len);
void zmsg_free(ZmsgMsg *m);

// Builds the error reply for request id (-1 = unknown): code and message are copied, a text too long cut before
// the first UTF-8 character that does not fit whole (zmsg_parse cuts model_id, code and message the same way).
void zmsg_error(ZmsgMsg *m, int64_t id, const char *code, const char *message);

// 16 lowercase hex digits; parse accepts exactly that (returns 0) or returns -1.
void zmsg_hash_to_hex(uint64_t h, char out[17]);
int zmsg_hash_from_hex(const char *s, uint64_t *h);

#endif
