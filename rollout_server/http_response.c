// rollout_server/http_response.c — response building for the HTTP API (see http_response.h).
#include "rollout_server/http_response.h"

#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

void http_buf_append(HttpBuf *b, const void *p, size_t n) {
    if (b->oom || n == 0) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d) {
            b->oom = 1;
            return;
        }
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
}

void http_buf_appendf(HttpBuf *b, const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof line) {
        http_buf_append(b, line, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);   // a line longer than the stack buffer: format it again at its length
    if (!big) {
        b->oom = 1;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    http_buf_append(b, big, (size_t)n);
    free(big);
}

void http_buf_free(HttpBuf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

void http_choice_init(HttpChoice *c, int n_top) {
    memset(c, 0, sizeof *c);
    c->n_top = n_top;
    c->stop_token = -1;
}

void http_choice_free(HttpChoice *c) {
    free(c->tokens);
    free(c->logprobs);
    free(c->top);
    free(c->text);
    free(c->stop_str);
    free(c->versions);
    memset(c, 0, sizeof *c);
}

int http_choice_append(HttpChoice *c, const EngineEvent *ev) {
    if (ev->restarted) {
        c->n_tokens = 0;
        c->text_len = 0;
        if (c->text) c->text[0] = 0;
    }
    if (c->n_tokens + ev->n_tokens > c->cap) {
        int cap = c->cap ? c->cap : 32;
        while (cap < c->n_tokens + ev->n_tokens) cap *= 2;
        int32_t *t = realloc(c->tokens, (size_t)cap * sizeof *t);
        if (!t) return -1;
        c->tokens = t;
        float *l = realloc(c->logprobs, (size_t)cap * sizeof *l);
        if (!l) return -1;
        c->logprobs = l;
        int64_t *v = realloc(c->versions, (size_t)cap * sizeof *v);
        if (!v) return -1;
        c->versions = v;
        if (c->n_top > 0) {
            TokenLogprob *tp = realloc(c->top, (size_t)cap * c->n_top * sizeof *tp);
            if (!tp) return -1;
            c->top = tp;
        }
        c->cap = cap;
    }
    if (ev->n_tokens > 0) {
        memcpy(c->tokens + c->n_tokens, ev->tokens, (size_t)ev->n_tokens * sizeof *ev->tokens);
        memcpy(c->logprobs + c->n_tokens, ev->logprobs, (size_t)ev->n_tokens * sizeof *ev->logprobs);
        for (int i = 0; i < ev->n_tokens; i++) c->versions[c->n_tokens + i] = ev->policy_version;
        if (c->n_top > 0) {
            TokenLogprob *dst = c->top + (size_t)c->n_tokens * c->n_top;
            if (ev->top) {
                memcpy(dst, ev->top, (size_t)ev->n_tokens * c->n_top * sizeof *dst);
            } else { // the engine gave no alternatives: mark the slots empty rather than leave garbage
                for (size_t i = 0; i < (size_t)ev->n_tokens * c->n_top; i++) dst[i] = (TokenLogprob){-1, -INFINITY};
            }
        }
        c->n_tokens += ev->n_tokens;
    }
    if (ev->text_len > 0) {
        if (c->text_len + ev->text_len + 1 > c->text_cap) {
            size_t cap = c->text_cap ? c->text_cap : 128;
            while (cap < c->text_len + ev->text_len + 1) cap *= 2;
            char *t = realloc(c->text, cap);
            if (!t) return -1;
            c->text = t;
            c->text_cap = cap;
        }
        memcpy(c->text + c->text_len, ev->text, ev->text_len);
        c->text_len += ev->text_len;
        c->text[c->text_len] = 0;
    }
    if (ev->finish != FINISH_NONE) {
        c->finish = ev->finish;
        c->stop_token = ev->stop_token;
        if (ev->stop_reason) {
            free(c->stop_str);
            c->stop_str = strdup(ev->stop_reason);
            if (!c->stop_str) return -1;
        }
    }
    return 0;
}

json_t *http_finish_json(FinishReason r) {
    switch (r) {
    case FINISH_LENGTH: return json_string("length");
    case FINISH_STOP: return json_string("stop");
    case FINISH_ABORT: return json_string("abort");
    case FINISH_ERROR: return json_string("error");
    default: return json_null();
    }
}

json_t *http_stop_reason_json(const HttpChoice *c, const SamplingParams *sp) {
    if (c->finish != FINISH_STOP) return json_null();
    if (c->stop_str) return json_string(c->stop_str);
    for (int i = 0; sp && i < sp->n_stop_token_ids; i++)
        if (sp->stop_token_ids[i] == c->stop_token) return json_integer(c->stop_token);
    return json_null();
}

static size_t utf8_codepoints(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

int http_merge_top(const TokenLogprob *top, int n_top, int32_t sampled, float sampled_lp, TokenLogprob *out) {
    int k = 0, have = 0;
    for (int j = 0; j < n_top; j++) {
        if (top[j].id < 0) continue;
        if (top[j].id == sampled) have = 1;
        out[k++] = top[j];
    }
    if (!have) { // insert where its logprob ranks (ties: after the alternatives, as they were ranked first)
        int pos = k;
        while (pos > 0 && out[pos - 1].logprob < sampled_lp) pos--;
        memmove(out + pos + 1, out + pos, (size_t)(k - pos) * sizeof *out);
        out[pos] = (TokenLogprob){sampled, sampled_lp};
        k++;
    }
    return k;
}

// JSON numbers cannot hold -inf / NaN: a logprob of -inf (a filtered-out alternative) becomes null.
static json_t *lp_json(float lp) { return isfinite(lp) ? json_real(lp) : json_null(); }

json_t *http_completion_logprobs(const HttpChoice *c, int from, int count, const HttpTokenText *tt, size_t *offset) {
    json_t *tokens = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    TokenLogprob merged[ENGINE_MAX_TOP_LOGPROBS + 1];
    for (int i = from; i < from + count && i < c->n_tokens; i++) {
        size_t len = 0;
        char *s = tt->text(tt->user, c->tokens[i], &len);
        json_array_append_new(tokens, json_stringn(s ? s : "", s ? len : 0));
        json_array_append_new(lps, lp_json(c->logprobs[i]));
        json_array_append_new(offs, json_integer((json_int_t)*offset));
        *offset += s ? utf8_codepoints(s, len) : 0;
        free(s);
        int k = http_merge_top(c->n_top ? c->top + (size_t)i * c->n_top : NULL, c->n_top, c->tokens[i], c->logprobs[i],
                               merged);
        json_t *d = json_object();
        for (int j = 0; j < k; j++) {
            size_t tl = 0;
            char *ts = tt->text(tt->user, merged[j].id, &tl);
            char key[256];
            size_t kl = ts ? (tl < sizeof key - 1 ? tl : sizeof key - 1) : 0;
            if (ts) memcpy(key, ts, kl);
            key[kl] = 0;
            free(ts);
            // Ids with one text (the pieces of a multi-byte character all read U+FFFD) share a key: merged is best
            // first, so the key keeps the most likely one's logprob.
            if (!json_object_get(d, key)) json_object_set_new(d, key, lp_json(merged[j].logprob));
        }
        json_array_append_new(tops, d);
    }
    json_t *o = json_object();
    json_object_set_new(o, "tokens", tokens);
    json_object_set_new(o, "token_logprobs", lps);
    json_object_set_new(o, "top_logprobs", tops);
    json_object_set_new(o, "text_offset", offs);
    return o;
}

static json_t *bytes_json(const char *s, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_integer((unsigned char)s[i]));
    return a;
}

static json_t *chat_token_entry(const HttpTokenText *tt, int32_t id, float lp) {
    size_t len = 0;
    char *s = tt->text(tt->user, id, &len);
    json_t *e = json_object();
    json_object_set_new(e, "token", json_stringn(s ? s : "", s ? len : 0));
    json_object_set_new(e, "logprob", isfinite(lp) ? json_real(lp) : json_real(-9999.0)); // OpenAI's floor value
    json_object_set_new(e, "bytes", bytes_json(s ? s : "", s ? len : 0));
    free(s);
    return e;
}

json_t *http_chat_logprobs(const HttpChoice *c, int from, int count, const HttpTokenText *tt) {
    json_t *content = json_array();
    for (int i = from; i < from + count && i < c->n_tokens; i++) {
        json_t *e = chat_token_entry(tt, c->tokens[i], c->logprobs[i]);
        json_t *tops = json_array();
        for (int j = 0; j < c->n_top; j++) {
            const TokenLogprob *t = &c->top[(size_t)i * c->n_top + j];
            if (t->id >= 0) json_array_append_new(tops, chat_token_entry(tt, t->id, t->logprob));
        }
        json_object_set_new(e, "top_logprobs", tops);
        json_array_append_new(content, e);
    }
    json_t *o = json_object();
    json_object_set_new(o, "content", content);
    return o;
}

json_t *http_usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
    json_t *u = json_object();
    json_object_set_new(u, "prompt_tokens", json_integer(prompt_tokens));
    json_object_set_new(u, "completion_tokens", json_integer(completion_tokens));
    json_object_set_new(u, "total_tokens", json_integer(prompt_tokens + completion_tokens));
    json_t *d = json_object();
    json_object_set_new(d, "cached_tokens", json_integer(cached_tokens));
    json_object_set_new(u, "prompt_tokens_details", d);
    return u;
}

char *http_sse_format(const json_t *obj, size_t *len) {
    char *js = json_dumps(obj, JSON_COMPACT);
    if (!js) return NULL;
    size_t n = strlen(js);
    char *s = malloc(n + 9);
    if (s) {
        memcpy(s, "data: ", 6);
        memcpy(s + 6, js, n);
        memcpy(s + 6 + n, "\n\n", 3);
        if (len) *len = n + 8;
    }
    free(js);
    return s;
}

json_t *http_envelope(const char *id, const char *object, int64_t created, const char *model, json_t *choices) {
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(id));
    json_object_set_new(o, "object", json_string(object));
    json_object_set_new(o, "created", json_integer(created));
    json_object_set_new(o, "model", json_string(model));
    json_object_set_new(o, "choices", choices);
    return o;
}

void http_make_id(char *buf, size_t cap, const char *prefix) {
    // getrandom draws from the kernel; a counter keeps ids unique even if it were to fail.
    static atomic_ulong counter;
    unsigned char r[16] = {0};
    if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r) {
        unsigned long k = atomic_fetch_add(&counter, 1) + 1;
        uint64_t t = (uint64_t)time(NULL);
        memcpy(r, &k, sizeof k < 8 ? sizeof k : 8);
        memcpy(r + 8, &t, 8);
    }
    int n = snprintf(buf, cap, "%s-", prefix);
    for (int i = 0; i < 16 && n + 2 < (int)cap; i++) n += snprintf(buf + n, cap - (size_t)n, "%02x", r[i]);
}

static json_t *ids_json(const int32_t *ids, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

json_t *http_trl_response(const int32_t *const *prompt_ids, const int *prompt_lens, int n_prompts, int n,
                          const HttpChoice *choices, int logprobs,
                          int with_versions) {
    json_t *o = json_object();
    json_t *pids = json_array(), *cids = json_array();
    for (int p = 0; p < n_prompts; p++) json_array_append_new(pids, ids_json(prompt_ids[p], prompt_lens[p]));
    for (int k = 0; k < n_prompts * n; k++)
        json_array_append_new(cids, ids_json(choices[k].tokens, choices[k].n_tokens));
    json_object_set_new(o, "prompt_ids", pids);
    json_object_set_new(o, "completion_ids", cids);
    if (with_versions) {
        json_t *vers = json_array();
        for (int k = 0; k < n_prompts * n; k++) {
            json_t *seq = json_array();
            for (int i = 0; i < choices[k].n_tokens; i++) json_array_append_new(seq, json_integer(choices[k].versions[i]));
            json_array_append_new(vers, seq);
        }
        json_object_set_new(o, "policy_versions", vers);
    }
    if (logprobs < 0) {
        json_object_set_new(o, "logprobs", json_null());
        json_object_set_new(o, "logprob_token_ids", json_null());
        return o;
    }
    json_t *lps = json_array(), *lids = json_array();
    TokenLogprob merged[ENGINE_MAX_TOP_LOGPROBS + 1];
    for (int k = 0; k < n_prompts * n; k++) {
        const HttpChoice *c = &choices[k];
        json_t *seq_lp = json_array(), *seq_id = json_array();
        for (int i = 0; i < c->n_tokens; i++) {
            int use = logprobs < c->n_top ? logprobs : c->n_top;
            int m = http_merge_top(use ? c->top + (size_t)i * c->n_top : NULL, use, c->tokens[i], c->logprobs[i],
                                   merged);
            json_t *tl = json_array(), *ti = json_array();
            for (int j = 0; j < m; j++) {
                json_array_append_new(tl, lp_json(merged[j].logprob));
                json_array_append_new(ti, json_integer(merged[j].id));
            }
            json_array_append_new(seq_lp, tl);
            json_array_append_new(seq_id, ti);
        }
        json_array_append_new(lps, seq_lp);
        json_array_append_new(lids, seq_id);
    }
    json_object_set_new(o, "logprobs", lps);
    json_object_set_new(o, "logprob_token_ids", lids);
    return o;
}

json_t *http_echo_logprobs(const int32_t *prompt, int n_prompt, const float *prompt_lp, const TokenLogprob *prompt_top,
                           int stride, int k, const HttpChoice *completion, const HttpTokenText *tt) {
    // The prompt as a choice of its own: the same entries as generated tokens, then the first one's emptied.
    TokenLogprob *top = k > 0 ? malloc((size_t)n_prompt * k * sizeof *top) : NULL;
    if (k > 0 && !top) return json_null();
    for (int i = 0; i < n_prompt && top; i++)
        memcpy(top + (size_t)i * k, prompt_top + (size_t)i * stride, (size_t)k * sizeof *top);
    HttpChoice p = {.tokens = (int32_t *)prompt, .logprobs = (float *)prompt_lp, .top = top, .n_tokens = n_prompt,
                    .n_top = k};
    size_t offset = 0;
    json_t *out = http_completion_logprobs(&p, 0, n_prompt, tt, &offset);
    json_array_set_new(json_object_get(out, "token_logprobs"), 0, json_null());
    json_array_set_new(json_object_get(out, "top_logprobs"), 0, json_null());
    json_t *gen = http_completion_logprobs(completion, 0, completion->n_tokens, tt, &offset);
    static const char *const keys[] = {"tokens", "token_logprobs", "top_logprobs", "text_offset"};
    for (int i = 0; i < 4; i++) json_array_extend(json_object_get(out, keys[i]), json_object_get(gen, keys[i]));
    json_decref(gen);
    free(top);
    return out;
}

json_t *http_prompt_logprobs_json(const int32_t *prompt, int n_prompt, const float *lp, const TokenLogprob *top,
                                  int stride, int k, const int32_t *rank, const HttpTokenText *tt) {
    json_t *out = json_array();
    json_array_append_new(out, json_null());
    for (int i = 1; i < n_prompt; i++) {
        json_t *d = json_object();
        for (int j = -1; j < k; j++) {   // the prompt's own token first, then the alternatives best first
            const int32_t id = j < 0 ? prompt[i] : top[(size_t)i * stride + j].id;
            const float v = j < 0 ? lp[i] : top[(size_t)i * stride + j].logprob;
            char key[16];
            snprintf(key, sizeof key, "%d", id);
            if (j >= 0 && json_object_get(d, key)) continue;
            size_t len = 0;
            char *s = tt->text(tt->user, id, &len);
            json_t *e = json_object();
            json_object_set_new(e, "logprob", isfinite(v) ? json_real(v) : json_real(-9999.0));
            json_object_set_new(e, "rank", json_integer(j < 0 ? rank[i] : j + 1));
            json_object_set_new(e, "decoded_token", json_stringn(s ? s : "", s ? len : 0));
            free(s);
            json_object_set_new(d, key, e);
        }
        json_array_append_new(out, d);
    }
    return out;
}
