// rollout_server/engine_internal.h — the engine's private structures, shared by engine.c (set-up, engine thread),
// engine_control.c (submission, control, stats) and engine_request.c (request handles and their event queues).
// Not part of the API: see engine.h.
#ifndef TANDEM_ROLLOUT_ENGINE_INTERNAL_H
#define TANDEM_ROLLOUT_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "rollout_server/block_manager.h"
#include "rollout_server/detok.h"
#include "rollout_server/engine.h"
#include "rollout_server/sampler.h"
#include "rollout_server/scheduler.h"

// One completion as the engine thread sees it. `s` first: the scheduler's Sequence* is an EngSeq*.
typedef struct {
    Sequence s;
    struct EngineRequest *req;
    int index;         // completion index 0..n-1
    Detok detok;
    int finished;      // its finish event has been queued (or the client is gone)
} EngSeq;

// Tokens, logprobs and text of one completion waiting for the client. Consecutive steps of a completion are
// coalesced into one slot while the client has not popped it (and the policy version is the same).
typedef struct EvSlot {
    int index;
    int32_t *tokens;       // (cap)
    float *logprobs;       // (cap)
    TokenLogprob *top;     // (cap, top_logprobs) or NULL
    int n, cap;
    TextBuf text;
    FinishReason finish;
    const char *stop_reason;
    int32_t stop_token;
    int64_t version;
    struct EvSlot *next_free;
} EvSlot;

struct EngineRequest {
    struct Engine *e;
    SamplingParams p;          // stop strings are owned copies
    uint64_t seed;             // completion i draws from stream seed + i
    int n, prompt_len, max_len;
    EngSeq *seqs;              // (n) completion 0 prefills the prompt; 1..n-1 are forked from it
    struct EngineRequest *next_in;    // incoming list (under the engine mutex)
    struct EngineRequest *next_abort; // abort list (under the engine mutex): a queued request may be on both
    // engine thread only
    int forked, admitted, n_live, in_abort_list_done;
    int wake_slot;             // its index in Engine.wake_reqs while a wake is pending for the step, else -1
    // under mu
    pthread_mutex_t mu;
    pthread_cond_t cv;
    EvSlot **queue;            // ring of slots ready for the client
    int q_head, q_len, q_cap;
    EvSlot **open;             // (n) the queued slot each completion still appends to, or NULL
    EvSlot *free_slots;
    EvSlot *current;           // the slot the last engine_request_next handed out
    int n_finish_delivered;
    int cached_tokens;
    int wake_on_finish;        // the client waits for finish events only (engine_request_wake_on_finish)
    int engine_done;           // the engine thread let go of it
    int released;              // the client let go of it
    int abort_pending;         // on the engine's abort list: only the engine thread frees it
};

#define ENGINE_MAX_EOS 16

struct Engine {
    EngineConfig cfg;
    char model_id[256];
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    int have_model;
    UnitSource src;
    KVCache kv;
    DecodeBufs *bufs;
    Tokenizer *tok;                 // NULL: the model folder has no tokenizer.json
    int32_t eos[ENGINE_MAX_EOS];
    int n_eos;
    BlockManager *bm;
    Scheduler sched;
    int n_blocks, max_blocks, V;
    // Step arrays (host): one entry per token of the step, max_num_batched_tokens of them ...
    int32_t *tok_ids, *tok_seq, *tok_pos, *slots;
    int32_t *tables;                // (max_num_seqs, max_blocks) room for the block tables of the step's sequences,
                                    // filled as (n_step, the step's longest table) (run_step)
    int32_t *rows;                  // (max_num_seqs) step token index of each logits row
    int *row_of;                    // (max_num_seqs) logits row of each step sequence, -1 = none
    float *logits;                  // (max_num_seqs, V) host copies of the logits rows that top logprobs need
    // Sampling on the backend (ops_sample_rows, engine.c): one sample per completion that gets a token in the
    // step. Arrays grow on demand: samp_cap samples, hist_cap history ids.
    int n_samp, samp_cap, hist_cap;
    EngSeq **samp_seq;              // (samp_cap) host: the completion each sample is for
    OpsSampleParams *samp_params;   // (samp_cap) host
    int32_t *samp_off;              // (samp_cap + 1) host: history offsets (histories of penalised samples only)
    int32_t *samp_hist;             // (hist_cap) host
    int32_t *samp_tok;              // (samp_cap) host: sampled ids
    float *samp_lp;                 // (samp_cap) host: their logprobs
    OpsSampleParams *d_params;      // backend copies of the above
    int32_t *d_off, *d_hist, *d_tok;
    float *d_lp;
    EngineRequest **scratch_reqs;   // (max_num_seqs)
    EngineRequest **wake_reqs;      // (max_num_seqs) requests whose client is woken once at the end of the step
    int n_wake;
    TokenLogprob top[ENGINE_MAX_TOP_LOGPROBS];
    TextBuf text;                   // one token's new text
    float **commit_units;           // (n_units) staging buffers taken by a commit
    EngineStats live;               // engine thread's counters, copied to `stats` under the mutex
    int64_t graph_logged;           // decode graph recordings + failures already logged (log_graphs)
    int n_requests_running;
    // Shared, under mu.
    pthread_t thread;
    int thread_started;
    pthread_mutex_t mu;
    pthread_cond_t wake;            // the engine thread waits here for work and control requests
    pthread_cond_t ack;             // callers wait here for the engine thread
    EngineRequest *in_head, *in_tail, *aborts;
    int n_queued;                   // submitted and not yet admitted (engine_submit's queue limit)
    int accepting, abort_all, exited, idle;
    int paused, pause_ack;
    int64_t reset_req, reset_done, commit_req, commit_done;
    int64_t commit_version;
    int commit_rc;
    char commit_err[512];
    float **staging;                // (n_units) host fp32 copies being received, NULL until asked for
    void **dstaging;                // (n_units) transport nccl: second copies in backend memory (storage dtype)
    int commit_device;              // the pending commit swaps dstaging in (else uploads staging)
    uint64_t n_submitted;
    int64_t version;
    EngineStats stats;
};

// engine.c: puts a released request on the abort list (the engine thread drops and frees it).
void engine_post_abort(Engine *e, EngineRequest *r);

// engine_request.c
int request_alloc(EngineRequest **out, struct Engine *e, const int32_t *prompt, int prompt_len,
                  const SamplingParams *p, int max_blocks, const Tokenizer *tok, const int32_t *eos, int n_eos,
                  char *err, size_t err_len);
void request_free(EngineRequest *r);
// Appends one token (or a bare finish when tok < 0) of completion `index` to the client's queue. Wakes nobody:
// *wake says whether the client wants waking for it (request_wake, once per step; request_engine_done always wakes).
// Returns 0 or -1 (out of memory: the event is dropped and the completion is marked finished with an error).
int request_push(EngineRequest *r, int index, int32_t tok, float logprob, const TokenLogprob *top,
                 const char *text, size_t text_len, FinishReason finish, const char *stop_reason, int32_t stop_token,
                 int64_t version, int *wake);
// Wakes a client waiting in engine_request_next.
void request_wake(EngineRequest *r);
// The engine thread is done with r: frees it when the client has released it (and it is not on the abort list).
void request_engine_done(EngineRequest *r);

#endif
