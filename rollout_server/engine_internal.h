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
#include "rollout_server/guided_cache.h"
#include "rollout_server/model_runner.h"
#include "shared/model_lora.h"
#include "rollout_server/scheduler.h"

// One completion as the engine thread sees it. `s` first: the scheduler's Sequence* is an EngSeq*. Its state is
// s.status: SEQ_DONE once its finish event is queued, or its request was dropped.
typedef struct {
    Sequence s;
    struct EngineRequest *req;
    int index;         // completion index 0..n-1
    Detok detok;
    double last_token_at; // latency_clock() at its last token event, 0 before the first (engine thread)
} EngSeq;

// Where a request is in the engine (docs/architecture.md, "A request in the engine"). Only the engine thread
// changes it, always under the request's mu: the engine thread reads it without the lock, other threads with it.
typedef enum {
    REQ_QUEUED = 0, // submitted, not yet admitted: on the incoming list, then completion 0 waits in the scheduler
                    // (counted in Engine.n_queued)
    REQ_PREFILL,    // admitted: completion 0 computes the prompt, in chunks; preempted, it waits again and recomputes
                    // (counted in Engine.n_requests_running from here on)
    REQ_DECODE,     // forked: each of the n completions got its first token; the unfinished ones decode (n_live)
    REQ_DONE,       // the engine thread let go of it: every completion finished, or the request was ended
                    // (shutdown, a failed step) or dropped (released by its client)
} ReqState;

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
    int restarted;         // the first slot of its completion after a re-queue (EngineEvent.restarted)
    struct EvSlot *next_free;
} EvSlot;

struct EngineRequest {
    struct Engine *e;
    SamplingParams p;          // stop strings, allowed ids and bad words are owned copies (the mask_* below)
    int32_t *mask_allowed;     // (p.n_allowed) owned copy of p.allowed_token_ids
    int32_t *mask_bad_ids;     // owned copies of p.bad_words_ids and p.bad_words_offsets
    int32_t *mask_bad_offsets;
    int mask_cap;              // sample_mask_cap of p: ids one of its samples' masks can take
    struct Guide *guide;       // structured outputs (guided_regex.h), NULL: none
    uint64_t seed;             // completion i draws from stream seed + i
    int n, prompt_len, max_len;
    double submitted_at;       // latency_clock() when engine_submit queued it: where TTFT and e2e latency start
    EngSeq *seqs;              // (n) completion 0 prefills the prompt; 1..n-1 are forked from it
    struct EngineRequest *next_in;    // incoming list (under the engine mutex)
    struct EngineRequest *next_abort; // abort list (under the engine mutex): a queued request may be on both
    ReqState state;            // written by the engine thread under mu (see ReqState)
    // engine thread only
    int n_live;                // completions not finished yet
    int wake_slot;             // its index in Engine.wake_reqs while a wake is pending for the step, else -1
    // under mu
    pthread_mutex_t mu;
    pthread_cond_t cv;
    EvSlot **queue;            // ring of slots ready for the client
    int q_head, q_len, q_cap;
    EvSlot **open;             // (n) the queued slot each completion still appends to, or NULL
    unsigned char *restart_next; // (n) the next slot opened for this completion says `restarted`
    EvSlot *free_slots;
    EvSlot *current;           // the slot the last engine_request_next handed out
    int n_finish_delivered;
    int cached_tokens;
    int wake_on_finish;        // the client waits for finish events only (engine_request_wake_on_finish)
    int restartable;           // the client takes restarts (engine_request_allow_restart)
    float *prompt_lp;          // (prompt_len) prompt logprobs, written by the runner as the prompt is computed
    TokenLogprob *prompt_top;  // (prompt_len, p.prompt_logprobs) their alternatives
    int32_t *prompt_rank;      // (prompt_len) each prompt token's rank
    int released;              // the client let go of it: freed then if state is REQ_DONE, else it went on the
                               // engine's abort list and the engine thread frees it
};

#define ENGINE_MAX_EOS 16

struct Engine {
    EngineConfig cfg;
    char model_id[256];
    ModelRunner *runner;            // the device side: model, weights, KV pool, step workspace, sampling
    const Model *m;                 // runner_model(runner)
    Tokenizer *tok;                 // NULL: the model folder has no tokenizer.json
    int32_t eos[ENGINE_MAX_EOS];
    int n_eos;
    BlockManager *bm;
    Scheduler sched;
    GuideCache guides;              // structured outputs' compiled patterns, shared by the requests
    int n_blocks, V;
    // The step as the runner gets it: run_seqs (max_num_seqs) in the scheduler's step order, then each sampled
    // sequence's samples (a request's first logits row is sampled by each of its n completions, any other row by
    // its own completion); the runner's results stay in `out` until the next step.
    RunnerSeq *run_seqs;
    RunnerSample *samples;          // (samples_cap), grown on demand
    int samples_cap;
    int32_t *mask_ids;              // (mask_cap) the step's samples' mask ids one after the other (sample_mask.h)
    int64_t mask_cap;
    RunnerOutput out;
    EngineRequest **scratch_reqs;   // (max_num_seqs)
    EngineRequest **wake_reqs;      // (max_num_seqs) requests whose client is woken once at the end of the step
    int n_wake;
    TextBuf text;                   // one token's new text
    void **commit_units;            // (n_units) staging buffers taken by a commit
    EngineStats live;               // engine thread's counters, copied to `stats` under the mutex
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
    int64_t abort_req, abort_done; // engine_abort_requests handshake
    int64_t commit_version;
    EngineUpdateMode commit_mode;
    EngineCommitReport commit_report; // what the last commit did (set with commit_done)
    int commit_rc;
    char commit_err[512];
    // Weight-update pause accounting (engine thread): when the engine stopped stepping for a pause that took effect,
    // and, after a commit, since when generation has been stopped for it (closed at the next step or idle wait).
    double paused_since;
    double update_pause_from;
    int update_pause_open;
    void **staging;                 // (n_units) host copies being received (engine_weights_staging), NULL until asked
    int commit_device;              // the pending commit swaps the runner's device staging in (else uploads staging)
    const struct LoraConfig *commit_lora; // the pending commit installs this policy adapter (engine_commit_adapter)
    float *const *commit_lora_units;      //   from these host units (the caller's until the commit returns)
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
// Completion `index` of r was re-queued by a weight update (ENGINE_UPDATE_ABORT): its open slot is closed, and
// the next one says `restarted`, so that the client drops what it received of it before.
void request_restart(EngineRequest *r, int index);
// 1 when r's client takes restarts (engine_request_allow_restart).
int request_restartable(EngineRequest *r);
// Wakes a client waiting in engine_request_next.
void request_wake(EngineRequest *r);
// The engine thread is done with r: state REQ_DONE, and its client is woken. A client that released r before
// this put it on the abort list, where the engine thread frees it; one that releases it later frees it.
void request_engine_done(EngineRequest *r);
// Moves r to `state` (engine thread).
void request_set_state(EngineRequest *r, ReqState state);

#endif
