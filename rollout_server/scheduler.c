// rollout_server/scheduler.c — the step planner of continuous batching (see scheduler.h).
#include "rollout_server/scheduler.h"

#include <stdlib.h>
#include <string.h>

static void list_unlink(SeqList *l, Sequence *q) {
    if (q->prev) q->prev->next = q->next;
    else l->head = q->next;
    if (q->next) q->next->prev = q->prev;
    else l->tail = q->prev;
    q->prev = q->next = NULL;
    l->count--;
}

static void list_push_back(SeqList *l, Sequence *q) {
    q->next = NULL;
    q->prev = l->tail;
    if (l->tail) l->tail->next = q;
    else l->head = q;
    l->tail = q;
    l->count++;
}

static void list_push_front(SeqList *l, Sequence *q) {
    q->prev = NULL;
    q->next = l->head;
    if (l->head) l->head->prev = q;
    else l->tail = q;
    l->head = q;
    l->count++;
}

int sched_init(Scheduler *s, BlockManager *bm, int max_num_seqs, int max_num_batched_tokens) {
    memset(s, 0, sizeof *s);
    s->bm = bm;
    s->max_num_seqs = max_num_seqs;
    s->max_num_batched_tokens = max_num_batched_tokens;
    s->step = calloc((size_t)max_num_seqs, sizeof *s->step);
    return s->step ? 0 : -1;
}

void sched_destroy(Scheduler *s) {
    free(s->step);
    memset(s, 0, sizeof *s);
}

void sched_add_waiting(Scheduler *s, Sequence *q, int front) {
    q->status = SEQ_WAITING;
    if (front) list_push_front(&s->waiting, q);
    else list_push_back(&s->waiting, q);
}

void sched_add_running(Scheduler *s, Sequence *q) {
    q->status = SEQ_RUNNING;
    q->admitted = ++s->admit_counter;
    q->n_admissions++;
    list_push_back(&s->running, q);
}

void sched_remove(Scheduler *s, Sequence *q) {
    if (q->status == SEQ_WAITING) list_unlink(&s->waiting, q);
    else if (q->status == SEQ_RUNNING) list_unlink(&s->running, q);
    bm_release(s->bm, &q->table);
    q->status = SEQ_DONE;
    q->sched = 0;
}

// Back to the front of the waiting queue with no blocks: it will recompute everything it has (prompt and
// generated tokens) when admitted again. Tokens it had scheduled in this step are given back to the budget.
static void preempt(Scheduler *s, Sequence *q) {
    list_unlink(&s->running, q);
    bm_release(s->bm, &q->table);
    q->n_computed = 0;
    s->n_step_tokens -= q->sched;
    q->sched = 0;
    q->status = SEQ_WAITING;
    list_push_front(&s->waiting, q);
    s->preemptions++;
}

void sched_requeue_all(Scheduler *s) {
    for (Sequence *q = s->waiting.head; q; q = q->next) {
        bm_release(s->bm, &q->table);
        q->n_computed = 0;
    }
    while (s->running.tail) { // newest first to the front: the oldest ends up first
        Sequence *q = s->running.tail;
        list_unlink(&s->running, q);
        bm_release(s->bm, &q->table);
        q->n_computed = 0;
        q->sched = 0;
        q->status = SEQ_WAITING;
        list_push_front(&s->waiting, q);
    }
}

// The most tokens q can take this step without needing more than the free blocks (copy-on-write included).
static int tokens_that_fit(const Scheduler *s, const Sequence *q, int want) {
    int lo = 0, hi = want;
    // needed blocks grow monotonically with the count: binary search the largest count that fits.
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        if (bm_blocks_needed(s->bm, &q->table, q->n_computed, q->n_computed + mid) <= bm_num_free(s->bm)) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// Schedules `want` tokens of running sequence q (want <= its remaining tokens and the budget), or with
// allow_partial as many of them as fit, preempting the newest running sequences while not even that fits.
// Returns 0 when scheduled, -1 when q itself had to be preempted.
static int schedule_running(Scheduler *s, Sequence *q, int want, int allow_partial, int *preempted) {
    for (;;) {
        int take = tokens_that_fit(s, q, want);
        if (take == want || (allow_partial && take > 0)) {
            bm_ensure(s->bm, &q->table, q->n_computed, q->n_computed + take);
            q->sched = take;
            s->n_step_tokens += take;
            return 0;
        }
        Sequence *victim = s->running.tail;
        preempt(s, victim);
        *preempted = 1;
        if (victim == q) return -1;
    }
}

// Releases the blocks of waiting sequences (newest in the queue first) until `needed` blocks are free or none
// is left: only when nothing runs, so a queue of forked children holding blocks can never starve the head.
static void release_waiting_blocks(Scheduler *s, Sequence *keep, int needed) {
    for (Sequence *w = s->waiting.tail; w && bm_num_free(s->bm) < needed; w = w->prev) {
        if (w == keep || w->table.n == 0) continue;
        bm_release(s->bm, &w->table);
        w->n_computed = 0;
    }
}

int sched_step(Scheduler *s) {
    s->n_step = 0;
    s->n_step_tokens = 0;
    for (Sequence *q = s->running.head; q; q = q->next) {
        q->sched = 0;
        q->just_admitted = 0;
    }
    const int max_tokens = s->max_num_batched_tokens;
    int preempted = 0;

    // 1. Decodes, oldest first. A victim is always newer than q (or q itself), so it was not scheduled yet.
    for (Sequence *q = s->running.head; q && s->n_step_tokens < max_tokens; q = q->next)
        if (q->n_tokens - q->n_computed == 1 && schedule_running(s, q, 1, 0, &preempted) < 0) break;
    // 2. Prefills in progress get chunks of the remaining budget (as much of the chunk as fits in the pool).
    for (Sequence *q = s->running.head; q && s->n_step_tokens < max_tokens;) {
        const int left = q->n_tokens - q->n_computed;
        if (q->sched == 0 && left > 1) {
            const int budget = max_tokens - s->n_step_tokens;
            if (schedule_running(s, q, left < budget ? left : budget, 1, &preempted) < 0) break;
        }
        q = q->next;
    }
    // 3. Admissions in FIFO order; none in a step that had to preempt (the pool is already short).
    while (!preempted && s->waiting.head && s->running.count < s->max_num_seqs && s->n_step_tokens < max_tokens) {
        Sequence *q = s->waiting.head;
        int cached = 0;
        if (q->table.n == 0 && !q->no_prefix_match) {
            cached = bm_match_prefix(s->bm, &q->table, q->tokens, q->n_tokens);
            q->n_computed = cached;
        }
        const int left = q->n_tokens - q->n_computed, budget = max_tokens - s->n_step_tokens;
        const int want = left < budget ? left : budget;
        int take = tokens_that_fit(s, q, want);
        if (take == 0 && s->running.count == 0) {
            release_waiting_blocks(s, q, bm_blocks_needed(s->bm, &q->table, q->n_computed, q->n_computed + want));
            take = tokens_that_fit(s, q, want);
        }
        if (take == 0) {
            if (cached) { // give the prefix hits back; they are matched again next time
                bm_release(s->bm, &q->table);
                q->n_computed = 0;
            }
            break;
        }
        bm_ensure(s->bm, &q->table, q->n_computed, q->n_computed + take);
        list_unlink(&s->waiting, q);
        sched_add_running(s, q);
        q->cached_at_admission = cached;
        q->just_admitted = 1;
        q->sched = take;
        s->n_step_tokens += take;
    }
    for (Sequence *q = s->running.head; q; q = q->next)
        if (q->sched > 0) s->step[s->n_step++] = q;
    return s->n_step_tokens;
}

void sched_commit(Scheduler *s) {
    for (int i = 0; i < s->n_step; i++) {
        Sequence *q = s->step[i];
        q->n_computed += q->sched;
        bm_commit(s->bm, &q->table, q->tokens, q->n_computed);
    }
}
