// rollout_server/http_generate.c — the HTTP side of a generation: tokenized prompts go to the engines (each prompt
// routed on its own), events come back; a client that goes away or a server that stops releases the engine
// requests (which aborts them).
#include <stdlib.h>
#include <string.h>

#include "rollout_server/http_internal.h"

// How long one wait on the engine lasts before looking at the socket and the stop flag again.
#define WAIT_SLICE_MS 50

char *http_token_text(void *tokenizer, int32_t id, size_t *len) {
    char *text = NULL;
    size_t n = 0;
    if (tokenizer_decode((const Tokenizer *)tokenizer, &id, 1, 0, &text, &n, NULL, 0) != 0) {
        free(text);
        text = NULL;
        n = 0;
    }
    *len = n;
    return text;
}

char *http_token_id_text(void *unused, int32_t id, size_t *len) {
    (void)unused;
    char buf[32];
    int n = snprintf(buf, sizeof buf, "token_id:%d", (int)id);
    *len = (size_t)n;
    return strdup(buf);
}

int http_need_tokenizer(const Tokenizer *tok, const char *param, const char *cannot, HttpError *err) {
    if (tok) return 0;
    return http_error_set(err, 400, param, "this server has no tokenizer (its model folder has no tokenizer.json), "
                          "so it cannot %s; it serves token ids: prompts as lists of token ids, answers with "
                          "return_token_ids (their text is empty)", cannot);
}

int http_tokenize_prompts(const Tokenizer *tok, const HttpPromptList *l, int add_special_tokens, int32_t ***ids_out,
                          int **lens_out, HttpError *err) {
    for (int i = 0; i < l->n; i++)
        if (!l->items[i].ids && http_need_tokenizer(tok, "prompt", "take text prompts", err) < 0) return -1;
    int32_t **ids = calloc((size_t)l->n, sizeof *ids);
    int *lens = calloc((size_t)l->n, sizeof *lens);
    if (!ids || !lens) {
        free(ids);
        free(lens);
        return http_error_set(err, 500, NULL, "out of memory");
    }
    for (int i = 0; i < l->n; i++) {
        const HttpPrompt *p = &l->items[i];
        if (p->ids) {
            ids[i] = malloc((size_t)(p->n_ids ? p->n_ids : 1) * sizeof **ids);
            if (!ids[i]) goto oom;
            memcpy(ids[i], p->ids, (size_t)p->n_ids * sizeof **ids);
            lens[i] = p->n_ids;
            continue;
        }
        size_t n = 0;
        char msg[256];
        if (tokenizer_encode(tok, p->text, p->text_len, add_special_tokens, &ids[i], &n, msg, sizeof msg) != 0) {
            http_free_ids(ids, lens, l->n);
            return http_error_set(err, 400, "prompt", "prompt %d cannot be tokenized: %s", i, msg);
        }
        lens[i] = (int)n;
        if (n == 0) {
            http_free_ids(ids, lens, l->n);
            return http_error_set(err, 400, "prompt", "prompt %d tokenizes to no tokens", i);
        }
    }
    *ids_out = ids;
    *lens_out = lens;
    return 0;
oom:
    http_free_ids(ids, lens, l->n);
    return http_error_set(err, 500, NULL, "out of memory");
}

void http_free_ids(int32_t **ids, int *lens, int n) {
    for (int i = 0; ids && i < n; i++) free(ids[i]);
    free(ids);
    free(lens);
}

void http_gen_release(HttpGen *g) {
    for (int i = 0; g->reqs && i < g->n_reqs; i++)
        if (g->reqs[i]) engine_group_release(g->srv->engines, g->reqs[i], g->engine_of[i], g->n);
    for (int i = 0; g->choices && i < g->n_reqs * g->n; i++) http_choice_free(&g->choices[i]);
    free(g->reqs);
    free(g->engine_of);
    free(g->choices);
    free(g->req_done);
    memset(g, 0, sizeof *g);
}

int http_gen_submit(HttpGen *g, HttpServer *srv, int fd, int32_t *const *prompts, const int *lens, int n_prompts,
                    const SamplingParams *sp, HttpError *err) {
    memset(g, 0, sizeof *g);
    g->srv = srv;
    g->fd = fd;
    g->n = sp->n;
    g->reqs = calloc((size_t)n_prompts, sizeof *g->reqs);
    g->engine_of = calloc((size_t)n_prompts, sizeof *g->engine_of);
    g->choices = calloc((size_t)n_prompts * (size_t)sp->n, sizeof *g->choices);
    g->req_done = calloc((size_t)n_prompts, 1);
    if (!g->reqs || !g->engine_of || !g->choices || !g->req_done) {
        http_gen_release(g);
        return http_error_set(err, 500, NULL, "out of memory");
    }
    g->n_reqs = n_prompts;
    for (int i = 0; i < n_prompts * sp->n; i++) http_choice_init(&g->choices[i], sp->top_logprobs);
    for (int i = 0; i < n_prompts; i++) {
        char msg[400];
        msg[0] = 0;
        int rc = engine_group_submit(srv->engines, prompts[i], lens[i], sp, &g->reqs[i], &g->engine_of[i], msg,
                                     sizeof msg);
        if (rc != 0) {
            g->reqs[i] = NULL;
            http_gen_release(g);
            int status = http_status_for_engine(rc);
            const char *param = rc == ENGINE_ETOOLONG                         ? (n_prompts > 1 ? "prompt" : "max_tokens")
                                : !strncmp(msg, "structured_outputs:", 19) ? "structured_outputs"
                                                                           : NULL;
            if (n_prompts > 1) return http_error_set(err, status, param, "prompt %d: %s", i, msg[0] ? msg : "refused");
            return http_error_set(err, status, param, "%s", msg[0] ? msg : "the engine refused the request");
        }
    }
    g->n_left = n_prompts;
    return 0;
}

// 1 client gone, 2 server stopping, 0 carry on.
static int interrupted(HttpGen *g) {
    if (atomic_load(&g->srv->aborting)) return 2;
    if (http_client_gone(g->fd)) return 1;
    return 0;
}

int http_gen_next(HttpGen *g, EngineEvent *ev, int *choice) {
    for (;;) {
        if (g->n_left == 0) return 0;
        if ((g->interrupted = interrupted(g)) != 0) return -1;
        if (g->n_reqs == 1) {
            int rc = engine_request_next(g->reqs[0], ev, WAIT_SLICE_MS);
            if (rc == 1) {
                *choice = ev->index;
                return 1;
            }
            if (rc < 0) g->req_done[0] = 1, g->n_left = 0;
            continue;
        }
        // Several prompts: take whatever is ready, round robin, then wait briefly on one of them.
        for (int k = 0; k < g->n_reqs; k++) {
            int i = (g->cursor + k) % g->n_reqs;
            if (g->req_done[i]) continue;
            int rc = engine_request_next(g->reqs[i], ev, 0);
            if (rc == 1) {
                g->cursor = (i + 1) % g->n_reqs;
                *choice = i * g->n + ev->index;
                return 1;
            }
            if (rc < 0) g->req_done[i] = 1, g->n_left--;
        }
        if (g->n_left == 0) return 0;
        for (int k = 0; k < g->n_reqs; k++) {
            int i = (g->cursor + k) % g->n_reqs;
            if (g->req_done[i]) continue;
            int rc = engine_request_next(g->reqs[i], ev, 5);
            if (rc == 1) {
                g->cursor = (i + 1) % g->n_reqs;
                *choice = i * g->n + ev->index;
                return 1;
            }
            if (rc < 0) g->req_done[i] = 1, g->n_left--;
            g->cursor = (i + 1) % g->n_reqs;
            break;
        }
    }
}

int http_gen_collect(HttpGen *g, HttpError *err) {
    EngineEvent ev;
    int choice, rc;
    // The answer goes out whole: wake this thread for finishes only (a timed wait still collects what queued), and a
    // weight update in mode abort may start a completion over (http_choice_append drops what it had).
    for (int i = 0; i < g->n_reqs; i++) {
        engine_request_wake_on_finish(g->reqs[i]);
        engine_request_allow_restart(g->reqs[i]);
    }
    while ((rc = http_gen_next(g, &ev, &choice)) == 1) {
        if (choice < 0 || choice >= g->n_reqs * g->n)
            return http_error_set(err, 500, NULL, "engine event for completion %d of %d", choice, g->n_reqs * g->n);
        if (http_choice_append(&g->choices[choice], &ev) != 0)
            return http_error_set(err, 500, NULL, "out of memory collecting the completion");
    }
    if (rc < 0) {
        if (g->interrupted == 1) return http_error_set(err, 499, NULL, "client went away");
        return http_error_set(err, 503, NULL, "the server is shutting down; the request was aborted");
    }
    for (int i = 0; i < g->n_reqs * g->n; i++) {
        if (g->choices[i].finish == FINISH_ERROR)
            return http_error_set(err, 500, NULL, "generation failed in the engine (completion %d); the server "
                                  "log has the details", i);
        // /pause?mode=abort, and the drain timeout where the answer can say so, end completions as vLLM does: the
        // answer carries what they had, with finish_reason "abort". An answer without finish reasons (TRL's ids)
        // would pass a cut completion off as whole: a 503 instead.
        if (g->choices[i].finish == FINISH_ABORT && atomic_load(&g->srv->draining) && !g->answers_abort)
            return http_error_set(err, 503, NULL, "the request was aborted by the server (shutting down)");
    }
    return 0;
}

int64_t http_gen_prompt_tokens(const HttpGen *g) {
    int64_t t = 0;
    for (int i = 0; i < g->n_reqs; i++) t += engine_request_prompt_tokens(g->reqs[i]);
    return t;
}

int64_t http_gen_cached_tokens(const HttpGen *g) {
    int64_t t = 0;
    for (int i = 0; i < g->n_reqs; i++) t += engine_request_cached_tokens(g->reqs[i]);
    return t;
}

int64_t http_gen_completion_tokens(const HttpGen *g) {
    int64_t t = 0;
    for (int i = 0; i < g->n_reqs * g->n; i++) t += g->choices[i].n_tokens;
    return t;
}
