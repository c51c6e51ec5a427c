// trainer/trajectory.c — multi-turn rollouts as token ids (trajectory.h).
#include "trainer/trajectory.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shared/err.h"
#include "trainer/tool_builtin.h"

const char *trajectory_end_name(TrajectoryEnd e) {
    switch (e) {
    case TRAJECTORY_END_ANSWER: return "answer";
    case TRAJECTORY_END_DONE: return "done";
    case TRAJECTORY_END_MAX_TURNS: return "max_turns";
    case TRAJECTORY_END_LENGTH: return "length";
    }
    return "running";
}

static int reserve(Trajectory *t, size_t extra) {
    size_t need = t->n_ids + extra;
    if (need <= t->cap) return 0;
    size_t cap = t->cap ? t->cap : 64;
    while (cap < need) cap *= 2;
    size_t ccap = cap - t->prompt_len;   // completion positions
    int32_t *ids = realloc(t->ids, cap * sizeof *ids);
    if (!ids) return -1;
    t->ids = ids;
    uint8_t *mask = realloc(t->mask, ccap * sizeof *mask);
    if (!mask) return -1;
    t->mask = mask;
    float *lp = realloc(t->logprobs, ccap * sizeof *lp);
    if (!lp) return -1;
    t->logprobs = lp;
    int64_t *v = realloc(t->versions, ccap * sizeof *v);
    if (!v) return -1;
    t->versions = v;
    t->cap = cap;
    return 0;
}

int trajectory_init(Trajectory *t, const int32_t *prompt, size_t n) {
    memset(t, 0, sizeof *t);
    t->env_reward = NAN;
    t->prompt_len = n;
    if (reserve(t, n + 1) != 0) {
        trajectory_free(t);
        return -1;
    }
    if (n) memcpy(t->ids, prompt, n * sizeof *prompt);
    t->n_ids = n;
    return 0;
}

void trajectory_free(Trajectory *t) {
    if (!t) return;
    free(t->ids);
    free(t->mask);
    free(t->logprobs);
    free(t->versions);
    memset(t, 0, sizeof *t);
}

size_t trajectory_completion_len(const Trajectory *t) { return t->n_ids - t->prompt_len; }

int trajectory_append_assistant(Trajectory *t, const int32_t *ids, const float *logprobs, size_t n, int64_t version) {
    if (reserve(t, n) != 0) return -1;
    size_t c = trajectory_completion_len(t);
    t->last_turn_start = c;
    for (size_t i = 0; i < n; i++) {
        t->ids[t->n_ids + i] = ids[i];
        t->mask[c + i] = 1;
        t->logprobs[c + i] = logprobs ? logprobs[i] : 0.0f;
        t->versions[c + i] = version;
    }
    t->n_ids += n;
    t->n_assistant_turns++;
    return 0;
}

int trajectory_append_environment(Trajectory *t, const int32_t *ids, size_t n) {
    if (reserve(t, n) != 0) return -1;
    size_t c = trajectory_completion_len(t);
    for (size_t i = 0; i < n; i++) {
        t->ids[t->n_ids + i] = ids[i];
        t->mask[c + i] = 0;
        t->logprobs[c + i] = 0.0f;
        t->versions[c + i] = -1;
    }
    t->n_ids += n;
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Everything one round (one assistant turn of every active episode) holds.
typedef struct {
    size_t *active;             // episode indices still running
    size_t n_active;
    TrajectorySampleRequest *sreq;
    TrajectorySample *samples;
    char **texts;
    ToolCallParse *parses;
    EnvStepRequest *steps;
    EnvStepResult *results;
} Round;

static void round_clear(Round *r, size_t n) {
    for (size_t i = 0; i < n; i++) {
        free(r->samples[i].ids);
        free(r->samples[i].logprobs);
        free(r->texts[i]);
        tool_call_parse_free(&r->parses[i]);
        env_step_result_free(&r->results[i]);
    }
    memset(r->samples, 0, n * sizeof *r->samples);
    memset(r->texts, 0, n * sizeof *r->texts);
}

// The environment's turn for episode e: its answers, then the error of an unreadable call, rendered and encoded.
// *ids NULL with *n 0 when there is nothing to say. 0, or -1 with a message.
static int environment_turn(const TrajectoryBuilder *b, const ToolCallParse *p, EnvStepResult *res, int32_t **ids,
                            size_t *n, char *err, size_t err_len) {
    *ids = NULL, *n = 0;
    size_t k = res->n_messages + (p->error ? 1 : 0);
    if (k == 0) return 0;
    ToolMessage *msgs = calloc(k, sizeof *msgs);
    char *error_text = p->error ? tool_error_text(p->error) : NULL;
    if (!msgs || (p->error && !error_text)) {
        free(msgs), free(error_text);
        return err_fail(err, err_len, "trajectory: out of memory");
    }
    for (size_t i = 0; i < res->n_messages; i++) {
        msgs[i] = res->messages[i];
        if (!msgs[i].call_id && i < p->n_calls) msgs[i].call_id = p->calls[i].id;  // borrowed, for Mistral
    }
    if (p->error) msgs[k - 1] = (ToolMessage){.name = "", .content = error_text, .call_id = NULL};
    char *text = NULL;
    int rc = tool_turn_render(&b->style, msgs, k, &text, err, err_len);
    free(msgs);
    free(error_text);
    if (rc != 0) return -1;
    rc = tokenizer_encode(b->tok, text, strlen(text), 0, ids, n, err, err_len);
    free(text);
    return rc == 0 ? 0 : -1;
}

int trajectories_run(const TrajectoryBuilder *b, Trajectory *t, const char *const *episode_ids, size_t n, char *err,
                     size_t err_len) {
    if (n == 0) return 0;
    if (b->opt.max_completion_length == 0) return err_fail(err, err_len, "max_completion_length must be > 0");
    Round r = {0};
    r.active = calloc(n, sizeof *r.active);
    r.sreq = calloc(n, sizeof *r.sreq);
    r.samples = calloc(n, sizeof *r.samples);
    r.texts = calloc(n, sizeof *r.texts);
    r.parses = calloc(n, sizeof *r.parses);
    r.steps = calloc(n, sizeof *r.steps);
    r.results = calloc(n, sizeof *r.results);
    int rc = -1;
    if (!r.active || !r.sreq || !r.samples || !r.texts || !r.parses || !r.steps || !r.results) {
        err_fail(err, err_len, "trajectory: out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        t[i].end = 0;
        r.active[r.n_active++] = i;
    }
    for (int iteration = 0; r.n_active > 0; iteration++) {
        // Sample one assistant turn for every running episode, from its whole history.
        size_t m = 0;
        for (size_t a = 0; a < r.n_active; a++) {
            Trajectory *tr = &t[r.active[a]];
            size_t left = b->opt.max_completion_length - trajectory_completion_len(tr);
            if (left == 0) {
                tr->end = TRAJECTORY_END_LENGTH;
                continue;
            }
            r.active[m++] = r.active[a];
        }
        r.n_active = m;
        if (m == 0) break;
        for (size_t a = 0; a < m; a++) {
            Trajectory *tr = &t[r.active[a]];
            r.sreq[a] = (TrajectorySampleRequest){.episode = r.active[a], .turn = tr->n_assistant_turns + 1,
                                                  .ids = tr->ids, .n_ids = tr->n_ids,
                                                  .max_new_tokens = b->opt.max_completion_length -
                                                                    trajectory_completion_len(tr)};
        }
        if (b->sample(b->sample_ctx, r.sreq, m, r.samples, err, err_len) != 0) goto out;
        for (size_t a = 0; a < m; a++) {
            Trajectory *tr = &t[r.active[a]];
            TrajectorySample *s = &r.samples[a];
            if (s->n > r.sreq[a].max_new_tokens) {
                err_fail(err, err_len, "the sampler returned %zu tokens for episode %s; at most %zu were asked for",
                         s->n, episode_ids[r.active[a]], r.sreq[a].max_new_tokens);
                goto out;
            }
            if (trajectory_append_assistant(tr, s->ids, s->logprobs, s->n, s->version) != 0) goto oom;
            size_t len = 0;
            if (tokenizer_decode(b->tok, s->ids, s->n, 0, &r.texts[a], &len, err, err_len) != 0) goto out;
            if (tool_calls_parse(b->opt.format, r.texts[a], len, &r.parses[a], err, err_len) != 0) goto out;
            r.steps[a] = (EnvStepRequest){.episode_id = episode_ids[r.active[a]], .turn = tr->n_assistant_turns,
                                          .message = r.texts[a], .parse = &r.parses[a]};
        }
        // Every assistant turn goes to the environment (the final answer too: it may score it).
        double t0 = now_s();
        if (env_step(b->env, r.steps, m, r.results, err, err_len) != 0) goto out;
        double waited = now_s() - t0;
        size_t still = 0;
        for (size_t a = 0; a < m; a++) {
            size_t e = r.active[a];
            Trajectory *tr = &t[e];
            const ToolCallParse *p = &r.parses[a];
            EnvStepResult *res = &r.results[a];
            tr->env_seconds += waited;
            tr->n_tool_calls += (int)p->n_calls + (p->error ? 1 : 0);
            tr->n_tool_failures += res->n_tool_failures + (p->error ? 1 : 0);
            if (!isnan(res->reward)) tr->env_reward = res->reward;
            if (res->done) {
                tr->end = TRAJECTORY_END_DONE;
                continue;
            }
            if (p->n_calls == 0 && !p->error) {
                tr->end = TRAJECTORY_END_ANSWER;
                continue;
            }
            if (b->opt.max_tool_calling_iterations >= 0 && iteration >= b->opt.max_tool_calling_iterations) {
                tr->end = TRAJECTORY_END_MAX_TURNS;
                continue;
            }
            int32_t *ids = NULL;
            size_t k = 0;
            if (environment_turn(b, p, res, &ids, &k, err, err_len) != 0) goto out;
            if (k == 0) {
                err_fail(err, err_len, "the %s environment answered the tool calls of episode %s with nothing",
                         b->env->kind, episode_ids[e]);
                goto out;
            }
            size_t c = trajectory_completion_len(tr);
            if (c + k > b->opt.max_completion_length ||
                (b->opt.max_model_len && tr->n_ids + k >= b->opt.max_model_len)) {
                free(ids);
                tr->end = TRAJECTORY_END_LENGTH;   // the answer would not fit: dropped, as TRL drops it
                continue;
            }
            int arc = trajectory_append_environment(tr, ids, k);
            free(ids);
            if (arc != 0) goto oom;
            r.active[still++] = e;
        }
        round_clear(&r, m);
        r.n_active = still;
    }
    rc = 0;
    goto out;
oom:
    err_fail(err, err_len, "trajectory: out of memory");
out:
    if (r.samples) round_clear(&r, n);
    free(r.active), free(r.sreq), free(r.samples), free(r.texts), free(r.parses), free(r.steps), free(r.results);
    return rc;
}
