// rollout_server/scheduler.h — continuous batching: which sequences run in the next step, and how many of
// their tokens.
//
// A sequence is a list of token ids (prompt, then generated) of which the first n_computed have K/V in the
// cache. A step computes some of the rest; when a sequence's computed tokens reach its length, its last token's
// logits are sampled. So one rule covers a first prefill (in chunks), a decode (one token left), and the
// recompute of a preempted sequence (prompt plus what it had generated).
//
// Each step:
//   1. every running sequence with one token left (a decode), oldest first, while the token budget lasts;
//   2. running sequences with more left (a prefill in progress) get a chunk of what remains of the budget;
//   3. waiting sequences are admitted in FIFO order while the budget, max_num_seqs and the pool allow
//      (prefix-cache hits first, then fresh blocks for the scheduled chunk).
// When a running sequence needs a block and none is free, the newest running sequence is preempted: its blocks
// are released and it goes back to the front of the waiting queue, to be recomputed later. A request is never
// failed for lack of cache; what can never fit is refused at submit.
//
// Sequences are owned by the engine; the scheduler only links them into its lists. Not thread-safe.
#ifndef TANDEM_ROLLOUT_SCHEDULER_H
#define TANDEM_ROLLOUT_SCHEDULER_H

#include <stdint.h>

#include "rollout_server/block_manager.h"

typedef enum { SEQ_NEW = 0, SEQ_WAITING, SEQ_RUNNING, SEQ_DONE } SeqStatus;

typedef struct Sequence {
    int32_t *tokens;          // (cap) prompt, then generated ids
    int n_tokens, n_prompt, cap;
    int n_computed;           // leading tokens whose K/V are in the cache
    BlockTable table;
    SeqStatus status;
    int64_t admitted;         // admission counter value of the latest admission (larger = newer)
    int n_admissions;         // 0 until first admitted
    int cached_at_admission;  // prefix-cache hit tokens of the latest admission
    int no_prefix_match;      // computes its whole prompt at every admission (prompt logprobs need every position)
    // Per step (set by sched_step):
    int sched;                // tokens scheduled in this step (0 = not scheduled)
    int just_admitted;        // admitted in this step
    struct Sequence *prev, *next; // waiting or running list links
} Sequence;

typedef struct {
    Sequence *head, *tail;
    int count;
} SeqList;

typedef struct {
    BlockManager *bm;
    SeqList waiting, running;
    int max_num_seqs, max_num_batched_tokens;
    int64_t admit_counter;
    int64_t preemptions;
    Sequence **step;          // (max_num_seqs) the sequences of the current step, in token order
    int n_step, n_step_tokens;
} Scheduler;

int sched_init(Scheduler *s, BlockManager *bm, int max_num_seqs, int max_num_batched_tokens);
void sched_destroy(Scheduler *s);

// Queues a sequence (status SEQ_WAITING) at the back, or at the front (forked children that did not fit in
// the running set keep their blocks and go first).
void sched_add_waiting(Scheduler *s, Sequence *q, int front);
// Puts a sequence holding a valid table straight into the running set (a forked child), as the newest.
void sched_add_running(Scheduler *s, Sequence *q);
// Takes a sequence out of whichever list holds it and releases its blocks (finished or aborted).
void sched_remove(Scheduler *s, Sequence *q);

// A weight update: every sequence gives its blocks back and will recompute all its tokens (prompt and generated)
// when admitted again. The running ones go to the front of the waiting queue in their running order, ahead of
// those already waiting. Not counted as preemptions.
void sched_requeue_all(Scheduler *s);

// Plans one step: fills s->step / s->n_step with the scheduled sequences (q->sched tokens each) and returns
// the number of tokens (0 when nothing can run). Allocates the blocks those tokens are written to.
int sched_step(Scheduler *s);

// After the step ran: marks each scheduled sequence's tokens computed and registers its full blocks for
// prefix caching.
void sched_commit(Scheduler *s);

#endif
