// trainer/rollout_generate.c — completion groups from the rollout servers (trainer/rollout_client.h): one request
// per prompt, load-balanced, moved to another server when its server goes away or stays silent. A generation is
// sent (rollout_generate_start) and collected (rollout_generate_finish) separately, so the servers can generate
// while the caller trains; meanwhile the same client says hello and pushes weights, and the answers that arrive
// then are kept with their generation (rollout_pending_keep) instead of being dropped. Between the two, the caller
// may take prompts' groups as they complete (rollout_generate_poll: streaming groups, docs/grpo.md).
#include "trainer/rollout_client_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "shared/err.h"

typedef struct {
    int server;         // -1 = not sent (yet, or again after a queue_full / a lost server)
    int epoch;          // the server's socket epoch when sent (Server.epoch)
    int64_t id;
    double sent_ms, retry_at_ms;
    double sent_waited_ms;  // RolloutPending.waited_ms when sent (0: sent before the first wait)
    int done;
} PromptState;

typedef struct {
    int server;
    ZmsgMsg msg;
} KeptAnswer;

struct RolloutPending {
    struct RolloutPending *next;
    int n_prompts, remaining;
    const int32_t *const *prompts;  // (n_prompts) the caller's, alive until finish or cancel
    const int *prompt_lens;         // (n_prompts)
    ZmsgSampling sampling;
    PromptState *st;                // (n_prompts)
    KeptAnswer *kept;               // (n_kept) answers read while the client waited for something else
    int n_kept, cap_kept;
    // A prompt's silence counts only time spent waiting in _poll / _finish: what the caller does between two polls
    // (scoring the groups already in, training) is not the servers' silence.
    double waited_ms;               // summed over the waits so far
    double wait_entered_ms;         // now_ms() when the current wait began
    RolloutGroup *out;              // the caller's groups (n_prompts), cleared at the first wait
    int *done_out, n_done_out;      // the current wait's completed prompts, in completion order
};

// RolloutPending.waited_ms including the current wait up to now.
static double waited_now(const RolloutPending *p) { return p->waited_ms + (now_ms() - p->wait_entered_ms); }

static int pick_server(RolloutClient *c) {
    int best = -1;
    for (int k = 0; k < c->n_servers; k++) {
        int i = (c->next_server + k) % c->n_servers;
        if (!c->servers[i].alive) continue;
        if (best < 0 || c->servers[i].in_flight < c->servers[best].in_flight) best = i;
    }
    if (best >= 0) c->next_server = (best + 1) % c->n_servers;
    return best;
}

// Sends prompt i to server sv: 0 sent, 1 the server was set aside, -1 error.
static int send_prompt_to(RolloutClient *c, RolloutPending *p, int sv, int i, char *err, size_t err_len) {
    const ZmsgSampling *s = &p->sampling;
    ZmsgMsg m;
    zmsg_init(&m, ZMSG_GENERATE, ZMSG_DIR_REQUEST, c->next_id++);
    m.sampling = *s;
    if (s->has_seed) m.sampling.seed = s->seed + (uint64_t)i * (uint64_t)s->n;
    int32_t *one[1] = {(int32_t *)p->prompts[i]};
    int one_len[1] = {p->prompt_lens[i]};
    m.n_prompts = 1;
    m.prompts = one;
    m.prompt_lens = one_len;
    const double t0 = now_ms();
    int gone, r = rollout_send_msg(c, &c->servers[sv], &m, t0, c->timeout_ms, &gone, err, err_len);
    if (r < 0) return -1;
    if (r > 0) {
        rollout_mark_dead(c, &c->servers[sv], gone ? "went away" : "did not take a prompt in time");
        return 1;
    }
    p->st[i] = (PromptState){.server = sv, .epoch = c->servers[sv].epoch, .id = m.id, .sent_ms = t0,
                             .sent_waited_ms = p->wait_entered_ms > 0 ? waited_now(p) : 0};
    c->servers[sv].in_flight++;
    return 0;
}

// Sends prompt i to the least loaded answering server: 0 sent, ROLLOUT_ESERVERS_LOST none answers, -1 error.
static int send_prompt(RolloutClient *c, RolloutPending *p, int i, char *err, size_t err_len) {
    for (;;) {
        int sv = pick_server(c);
        if (sv < 0) {
            snprintf(err, err_len, "no rollout server is answering (all of %d timed out or went away)", c->n_servers);
            return ROLLOUT_ESERVERS_LOST;
        }
        int r = send_prompt_to(c, p, sv, i, err, err_len);
        if (r <= 0) return r;
        // Not taken: the server went away (or its queue stayed full); the prompt goes to another one.
    }
}

static int take_result(RolloutGroup *g, const ZmsgMsg *m) {
    int n = m->n_completions, total = 0;
    for (int j = 0; j < n; j++) total += m->completion_lens[j];
    g->n = n;
    g->lens = malloc(n * sizeof(int));
    g->tokens = malloc((total ? total : 1) * sizeof(int32_t));
    g->logprobs = malloc((total ? total : 1) * sizeof(float));
    g->finish = malloc(n * sizeof(ZmsgFinish));
    g->versions = malloc(n * sizeof(int64_t));
    g->versions_end = malloc(n * sizeof(int64_t));
    if (!g->lens || !g->tokens || !g->logprobs || !g->finish || !g->versions || !g->versions_end) return -1;
    memcpy(g->lens, m->completion_lens, n * sizeof(int));
    memcpy(g->tokens, m->tokens, total * sizeof(int32_t));
    memcpy(g->logprobs, m->logprobs, total * sizeof(float));
    memcpy(g->finish, m->finish_reasons, n * sizeof(ZmsgFinish));
    memcpy(g->versions, m->policy_versions, n * sizeof(int64_t));
    memcpy(g->versions_end, m->policy_versions_end, n * sizeof(int64_t));
    return 0;
}

void rollout_groups_free(RolloutGroup *g, int n) {
    for (int i = 0; i < n; i++) {
        free(g[i].lens);
        free(g[i].tokens);
        free(g[i].logprobs);
        free(g[i].finish);
        free(g[i].versions);
        free(g[i].versions_end);
        memset(&g[i], 0, sizeof g[i]);
    }
}

// The prompt of p that request `id` to server k asked for, or -1 (an answer to a prompt already sent elsewhere).
static int find_prompt(const RolloutPending *p, int k, int64_t id) {
    for (int q = 0; q < p->n_prompts; q++)
        if (!p->st[q].done && p->st[q].server == k && p->st[q].id == id) return q;
    return -1;
}

int rollout_pending_keep(RolloutClient *c, int server, ZmsgMsg *m) {
    for (RolloutPending *p = c->pending; p; p = p->next) {
        if (find_prompt(p, server, m->id) < 0) continue;
        if (p->n_kept == p->cap_kept) {
            int cap = p->cap_kept ? 2 * p->cap_kept : 16;
            KeptAnswer *grown = realloc(p->kept, (size_t)cap * sizeof *grown);
            if (!grown) return 0;   // out of memory: the answer is dropped, the prompt is sent again on timeout
            p->kept = grown, p->cap_kept = cap;
        }
        p->kept[p->n_kept++] = (KeptAnswer){.server = server, .msg = *m};
        return 1;
    }
    return 0;
}

static void unlink_pending(RolloutClient *c, RolloutPending *p) {
    for (RolloutPending **at = &c->pending; *at; at = &(*at)->next)
        if (*at == p) {
            *at = p->next;
            return;
        }
}

static void pending_free(RolloutClient *c, RolloutPending *p) {
    unlink_pending(c, p);
    for (int i = 0; i < p->n_kept; i++) zmsg_free(&p->kept[i].msg);
    free(p->kept), free(p->st), free(p);
}

void rollout_generate_cancel(RolloutClient *c, RolloutPending *p) {
    if (!p) return;
    // The servers still work on them; their answers are dropped when they come (nothing waits for those ids).
    for (int i = 0; i < p->n_prompts; i++) {
        const PromptState *st = &p->st[i];
        if (!st->done && st->server >= 0 && c->servers[st->server].epoch == st->epoch)
            c->servers[st->server].in_flight--;
    }
    pending_free(c, p);
}

int rollout_generate_start(RolloutClient *c, int n_prompts, const int32_t *const *prompts, const int *prompt_lens,
                           const ZmsgSampling *s, RolloutPending **out, char *err, size_t err_len) {
    *out = NULL;
    RolloutPending *p = calloc(1, sizeof *p);
    if (!p || !(p->st = calloc((size_t)(n_prompts ? n_prompts : 1), sizeof *p->st))) {
        free(p);
        return err_fail(err, err_len, "out of memory for %d prompts", n_prompts);
    }
    *p = (RolloutPending){.next = c->pending, .n_prompts = n_prompts, .remaining = n_prompts, .prompts = prompts,
                          .prompt_lens = prompt_lens, .sampling = *s, .st = p->st};
    c->pending = p;
    for (int i = 0; i < n_prompts; i++) p->st[i] = (PromptState){.server = -1};
    for (int i = 0; i < n_prompts; i++) {
        int r = send_prompt(c, p, i, err, err_len);
        if (r == -1) {
            rollout_generate_cancel(c, p);
            return -1;
        }
        // No server answers: the rest stay unsent; rollout_generate_finish tries again and reports the loss.
        if (r == ROLLOUT_ESERVERS_LOST) break;
    }
    *out = p;
    return 0;
}

// One answer from server k at time t: a result fills out[i]; queue_full sends the prompt again after a pause;
// shutting_down sets the server aside (*replaced = 1: its socket is new, stop reading the old one).
static int on_answer(RolloutClient *c, RolloutPending *p, int k, ZmsgMsg *m, double t, RolloutGroup *out,
                     int *replaced, char *err, size_t err_len) {
    *replaced = 0;
    int i = find_prompt(p, k, m->id);
    if (i < 0) return 0;
    if (c->servers[k].epoch == p->st[i].epoch) c->servers[k].in_flight--;
    if (m->type == ZMSG_ERROR) {
        if (strcmp(m->code, "queue_full") == 0) {
            // Back off and send again (possibly to another server).
            p->st[i].server = -1;
            p->st[i].retry_at_ms = t + 200;
            return 0;
        }
        if (strcmp(m->code, "shutting_down") == 0) {
            // A draining server (SIGTERM, a node drain) is a lost server: its prompts move now (a new epoch).
            p->st[i].server = -1;
            p->st[i].retry_at_ms = t;
            rollout_mark_dead(c, &c->servers[k], "is shutting down");
            *replaced = 1;
            return 0;
        }
        return err_fail(err, err_len, "rollout server %s refused prompt %d: [%s] %s", c->servers[k].endpoint, i,
                        m->code, m->message);
    }
    if (m->type != ZMSG_RESULT || take_result(&out[i], m) != 0)
        return err_fail(err, err_len, "rollout server %s answered prompt %d with %s", c->servers[k].endpoint, i,
                        zmsg_type_name(m->type));
    p->st[i].done = 1;
    p->remaining--;
    if (p->done_out) p->done_out[p->n_done_out++] = i;
    return 0;
}

// Reads every answer waiting on server k's socket: this generation's are taken, another's are kept for it.
static int read_server(RolloutClient *c, RolloutPending *p, int k, RolloutGroup *out, char *err, size_t err_len) {
    for (;;) {
        ZmsgMsg m;
        zmq_msg_t parts[8];
        int n_parts;
        int r = rollout_recv_msg(&c->servers[k], &m, parts, &n_parts, err, err_len);
        rollout_close_parts(parts, n_parts);
        if (r <= 0) return r;
        if (find_prompt(p, k, m.id) < 0) {
            if (!rollout_pending_keep(c, k, &m)) zmsg_free(&m);   // else: a late answer to something abandoned
            continue;
        }
        int replaced;
        r = on_answer(c, p, k, &m, now_ms(), out, &replaced, err, err_len);
        zmsg_free(&m);
        if (r != 0) return -1;
        if (replaced) return 0;
    }
}

// One wait of up to wait_ms for p's answers (returning sooner once a prompt completes, or all are in): sends what
// is due, reads every readable socket, moves the prompts of silent servers. 0, ROLLOUT_ESERVERS_LOST or -1.
static int wait_once(RolloutClient *c, RolloutPending *p, double wait_ms, char *err, size_t err_len) {
    const int n_prompts = p->n_prompts;
    const double until = now_ms() + wait_ms;
    for (int j = 0; j < p->n_kept; j++) {
        int replaced;
        int r = on_answer(c, p, p->kept[j].server, &p->kept[j].msg, now_ms(), p->out, &replaced, err, err_len);
        zmsg_free(&p->kept[j].msg);
        if (r != 0) {
            for (int q = j + 1; q < p->n_kept; q++) zmsg_free(&p->kept[q].msg);
            p->n_kept = 0;
            return -1;
        }
    }
    p->n_kept = 0;
    zmq_pollitem_t items[MAX_SERVERS];
    for (;;) {
        // Prompts not sent, sent again after a pause, or sent on a socket that has been replaced since.
        double t = now_ms();
        for (int i = 0; i < n_prompts; i++) {
            PromptState *st = &p->st[i];
            if (st->done) continue;
            if (st->server >= 0 && c->servers[st->server].epoch != st->epoch) st->server = -1, st->retry_at_ms = t;
            if (st->server < 0 && t >= st->retry_at_ms) {
                int r = send_prompt(c, p, i, err, err_len);
                if (r != 0) return r;
            }
        }
        if (p->remaining == 0 || p->n_done_out > 0 || t >= until) return 0;
        for (int k = 0; k < c->n_servers; k++) items[k] = (zmq_pollitem_t){c->servers[k].sock, 0, ZMQ_POLLIN, 0};
        double left = until - t;
        if (zmq_poll(items, c->n_servers, left < 200 ? (long)left + 1 : 200) < 0) {
            snprintf(err, err_len, "polling the rollout servers: %s", zmq_strerror(zmq_errno()));
            return -1;
        }
        for (int k = 0; k < c->n_servers; k++)
            if ((items[k].revents & ZMQ_POLLIN) && read_server(c, p, k, p->out, err, err_len) != 0) return -1;
        // Timeouts: a server silent on a prompt for the whole timeout (of waiting: since it was sent or the first
        // wait began) is considered gone; its prompts move (the sweep above sends them again, its socket being new).
        t = now_ms();
        const double waited = waited_now(p);
        for (int i = 0; i < n_prompts; i++) {
            PromptState *st = &p->st[i];
            if (st->done || st->server < 0 || c->servers[st->server].epoch != st->epoch) continue;
            Server *sv = &c->servers[st->server];
            int gone = rollout_gone_since(c, sv, st->sent_ms);
            if (gone || waited - st->sent_waited_ms > c->timeout_ms) {
                rollout_mark_dead(c, sv, gone ? "went away during generation" : "did not answer a prompt in time");
                st->server = -1, st->retry_at_ms = t;
            }
        }
    }
}

// Runs one wait with the caller's groups and completed-prompt list; on an error (-1), or on any failure when
// free_on_loss, frees the groups and the handle.
static int wait_bound(RolloutClient *c, RolloutPending *p, RolloutGroup *out, double wait_ms, int *done,
                      int free_on_loss, char *err, size_t err_len) {
    if (!p->out) memset(out, 0, (size_t)p->n_prompts * sizeof *out);
    p->out = out;
    p->done_out = done, p->n_done_out = 0;
    p->wait_entered_ms = now_ms();
    int rc = wait_once(c, p, wait_ms, err, err_len);
    p->waited_ms += now_ms() - p->wait_entered_ms;
    p->done_out = NULL;
    if (rc == -1 || (rc != 0 && free_on_loss)) {
        rollout_groups_free(out, p->n_prompts);
        rollout_generate_cancel(c, p);
    }
    return rc;
}

int rollout_generate_poll(RolloutClient *c, RolloutPending *p, RolloutGroup *out, int wait_ms, int *done,
                          int *n_done, char *err, size_t err_len) {
    *n_done = 0;
    int rc = wait_bound(c, p, out, wait_ms, done, 0, err, err_len);
    if (rc != -1) *n_done = p->n_done_out;   // a wait that ends in a loss may have taken groups before it
    return rc;
}

int rollout_generate_remaining(const RolloutPending *p) { return p->remaining; }

int rollout_generate_finish(RolloutClient *c, RolloutPending *p, RolloutGroup *out, char *err, size_t err_len) {
    while (p->remaining > 0) {
        int rc = wait_bound(c, p, out, 1e9, NULL, 1, err, err_len);
        if (rc != 0) return rc;
    }
    if (!p->out) memset(out, 0, (size_t)p->n_prompts * sizeof *out);
    pending_free(c, p);
    return 0;
}

int rollout_generate(RolloutClient *c, int n_prompts, const int32_t *const *prompts, const int *prompt_lens,
                     const ZmsgSampling *s, RolloutGroup *out, char *err, size_t err_len) {
    RolloutPending *p;
    if (rollout_generate_start(c, n_prompts, prompts, prompt_lens, s, &p, err, err_len) != 0) {
        memset(out, 0, (size_t)n_prompts * sizeof *out);
        return -1;
    }
    return rollout_generate_finish(c, p, out, err, err_len);
}
