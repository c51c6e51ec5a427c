// trainer/reward_service.c — batch scoring through an HTTP reward service (schema in reward_service.h).
#include "trainer/reward_service.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shared/json_read.h"
#include "shared/tokenizer/tokenizer.h"
#include "trainer/http_client.h"
#include "trainer/wait_log.h"
#include "shared/err.h"

#define SERVICE_SINGLE_NAME "reward_service"
#define BACKOFF_CAP_S 30.0

struct RewardService {
    RewardServiceOptions opt;
    char *url;            // owned copy of opt.url
    char **names;         // fixed by the first successful response
    size_t n_names;
};

void reward_service_options_default(RewardServiceOptions *o) {
    memset(o, 0, sizeof *o);
    o->timeout_s = 60.0;
    o->connect_timeout_s = 10.0;
    o->max_retries = 3;
    o->backoff_s = 1.0;
}

int reward_service_create(RewardService **out, const RewardServiceOptions *o, char *err, size_t err_len) {
    *out = NULL;
    HttpUrl u;
    char uerr[512];
    if (!o || http_parse_url(o->url, &u, uerr, sizeof uerr) != 0) {
        err_fail(err, err_len, "reward_url: %s", o ? uerr : "no options");
        return -1;
    }
    if (!(o->timeout_s > 0) || !(o->connect_timeout_s > 0) || o->max_retries < 0 || !(o->backoff_s >= 0)) {
        err_fail(err, err_len, "reward service %s: timeouts must be > 0, retries and backoff >= 0", o->url);
        return -1;
    }
    RewardService *rs = calloc(1, sizeof *rs);
    if (!rs || !(rs->url = strdup(o->url))) {
        free(rs);
        err_fail(err, err_len, "reward service: out of memory");
        return -1;
    }
    rs->opt = *o;
    rs->opt.url = rs->url;
    *out = rs;
    return 0;
}

static void free_names(char **names, size_t n) {
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
}

void reward_service_free(RewardService *rs) {
    if (!rs) return;
    free_names(rs->names, rs->n_names);
    free(rs->url);
    free(rs);
}

size_t reward_service_count(const RewardService *rs) { return rs ? rs->n_names : 0; }

const char *reward_service_name(const RewardService *rs, size_t i) {
    return (rs && i < rs->n_names) ? rs->names[i] : NULL;
}

char *reward_service_request_json(const RewardSample *samples, size_t n) {
    json_t *arr = json_array();
    if (!arr) return NULL;
    for (size_t i = 0; i < n; i++) {
        const RewardSample *s = &samples[i];
        json_t *o = json_object();
        if (!o || json_array_append_new(arr, o) != 0) goto oom;
        json_t *prompt = s->prompt ? json_deep_copy(s->prompt) : json_string("");
        const char *c = s->completion ? s->completion : "";
        json_t *comp = json_stringn(c, strlen(c));
        if (!comp) {  // invalid UTF-8 (a completion cut inside a character): repaired as Python would decode it
            size_t rl = 0;
            char *fixed = tokenizer_utf8_repair(c, strlen(c), &rl);
            if (!fixed) {
                json_decref(prompt);
                goto oom;
            }
            comp = json_stringn(fixed, rl);
            free(fixed);
        }
        if (json_object_set_new(o, "prompt", prompt) != 0 || json_object_set_new(o, "completion", comp) != 0)
            goto oom;
        if (s->columns && json_is_object(s->columns)) {
            const char *key;
            json_t *val;
            json_object_foreach((json_t *)s->columns, key, val) {
                if (strcmp(key, "prompt") == 0 || strcmp(key, "completion") == 0) continue;
                if (json_object_set(o, key, val) != 0) goto oom;
            }
        }
    }
    // JSON_ENSURE_ASCII is off: UTF-8 goes through as is. Completions decoded by the tokenizer are valid
    // UTF-8; json_dumps escapes control characters.
    char *txt = json_dumps(arr, JSON_COMPACT);
    json_decref(arr);
    return txt;
oom:
    json_decref(arr);
    return NULL;
}

// Reads one list of n scores into dst (stride 1). 0, or -1 with a message.
static int read_scores(const json_t *list, const char *name, size_t n, double *dst, char *err, size_t err_len) {
    if (!json_is_array(list)) {
        err_fail(err, err_len, "\"%s\" must be a list of numbers (or null)", name);
        return -1;
    }
    if (json_array_size(list) != n) {
        err_fail(err, err_len, "\"%s\" has %zu scores for %zu completions", name, json_array_size(list), n);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(list, i);
        if (json_is_null(v)) {
            dst[i] = NAN;
        } else if (json_is_number(v)) {
            dst[i] = json_number_value(v);
        } else {
            err_fail(err, err_len, "\"%s\"[%zu] is not a number or null", name, i);
            return -1;
        }
    }
    return 0;
}

int reward_service_parse_response(const char *body, size_t body_len, size_t n, char ***names_out, size_t *n_funcs,
                                  double **scores_out, char *err, size_t err_len) {
    *names_out = NULL, *n_funcs = 0, *scores_out = NULL;
    json_error_t je;
    json_t *root = json_read_buffer(body, body_len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        err_fail(err, err_len, "the body is not valid JSON (%s at line %d column %d)", je.text, je.line, je.column);
        return -1;
    }
    int rc = -1;
    char **names = NULL;
    double *scores = NULL;
    size_t k = 0;
    const json_t *single = json_is_object(root) ? json_object_get(root, "scores") : NULL;
    const json_t *multi = json_is_object(root) ? json_object_get(root, "rewards") : NULL;
    if (!json_is_object(root) || (!single && !multi) || (single && multi)) {
        err_fail(err, err_len, "expected {\"scores\": [...]} or {\"rewards\": {\"name\": [...], ...}}");
        goto out;
    }
    if (single) {
        k = 1;
    } else {
        if (!json_is_object(multi) || json_object_size(multi) == 0) {
            err_fail(err, err_len, "\"rewards\" must be a non-empty object of name -> list of scores");
            goto out;
        }
        k = json_object_size(multi);
    }
    names = calloc(k, sizeof *names);
    scores = malloc((k * n + 1) * sizeof *scores);
    if (!names || !scores) {
        err_fail(err, err_len, "out of memory");
        goto out;
    }
    if (single) {
        if (!(names[0] = strdup(SERVICE_SINGLE_NAME))) goto oom;
        if (read_scores(single, "scores", n, scores, err, err_len) != 0) goto out;
    } else {
        size_t f = 0;
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)multi, key, val) {
            if (!key[0]) {
                err_fail(err, err_len, "\"rewards\" has a function with an empty name");
                goto out;
            }
            if (!(names[f] = strdup(key))) goto oom;
            if (read_scores(val, key, n, scores + f * n, err, err_len) != 0) goto out;
            f++;
        }
    }
    *names_out = names, *n_funcs = k, *scores_out = scores;
    names = NULL, scores = NULL;
    rc = 0;
    goto out;
oom:
    err_fail(err, err_len, "out of memory");
out:
    if (names) free_names(names, k);
    free(scores);
    json_decref(root);
    return rc;
}


// The pause before a retry, saying about every WAIT_LOG_INTERVAL_S that it is still waiting.
static void sleep_before_retry(const RewardService *rs, double seconds, int attempt) {
    WaitLog w;
    wait_log_start(&w, seconds, "--reward-backoff, doubled for each retry", "reward service %s: attempt %d of %d",
                   rs->url, attempt + 1, rs->opt.max_retries + 1);
    for (double left = seconds; left > 0; left = seconds - wait_log_elapsed(&w)) {
        double due = wait_log_due_in(&w);
        http_sleep_seconds(fmin(left, fmax(due, 0.001)));
        wait_log_tick(&w);
    }
}



int reward_service_score(RewardService *rs, const RewardSample *samples, size_t n, double *scores, size_t ld,
                         size_t max_funcs, size_t *n_funcs, char *err, size_t err_len) {
    *n_funcs = 0;
    if (n == 0) {
        *n_funcs = rs->n_names;
        return 0;
    }
    char *req = reward_service_request_json(samples, n);
    if (!req) {
        err_fail(err, err_len, "reward service %s: out of memory building the request", rs->url);
        return -1;
    }
    HttpOptions ho = {.connect_timeout_ms = http_timeout_ms(rs->opt.connect_timeout_s),
                      .timeout_ms = http_timeout_ms(rs->opt.timeout_s),
                      .max_response_bytes = rs->opt.max_response_bytes};
    HttpResponse resp = {0};
    char msg[1024] = "";
    double wait = fmin(rs->opt.backoff_s, BACKOFF_CAP_S);
    int ok = 0, attempts = 0;
    for (int attempt = 0; attempt <= rs->opt.max_retries; attempt++) {
        attempts++;
        if (attempt > 0) {
            // msg names the URL (every failure's message does).
            fprintf(stderr, "tandem-train: reward service: %s; attempt %d of %d in %.3g s\n", msg, attempt + 1,
                    rs->opt.max_retries + 1, wait);
            sleep_before_retry(rs, wait, attempt);
            wait = fmin(wait * 2.0, BACKOFF_CAP_S);
        }
        http_response_free(&resp);
        WaitLog answer;
        wait_log_start(&answer, rs->opt.connect_timeout_s + rs->opt.timeout_s,
                       "--reward-connect-timeout + --reward-timeout", "reward service %s (%zu completions)", rs->url, n);
        ho.wait_log = &answer;
        int hrc = http_post(rs->url, "application/json", req, strlen(req), &ho, &resp, msg, sizeof msg);
        if (hrc == HTTP_E_CONNECT || hrc == HTTP_E_TIMEOUT || hrc == HTTP_E_IO) continue;  // worth another try
        if (hrc == HTTP_E_TOO_LARGE) {
            size_t used = strlen(msg);
            snprintf(msg + used, sizeof msg - used, " (raise --reward-max-response-mb if such answers are expected)");
        }
        if (hrc != HTTP_OK) break;
        if (resp.status == 200) {
            ok = 1;
            break;
        }
        char ex[201];
        http_body_excerpt(resp.body, resp.body_len, ex, sizeof ex);
        snprintf(msg, sizeof msg, "%s: HTTP status %d: %s", rs->url, resp.status, ex);
        if (resp.status < 500 && resp.status != 429) break;  // the request itself is refused: no retry
    }
    free(req);
    if (!ok) {
        err_fail(err, err_len, "reward service failed after %d attempt(s): %s", attempts, msg);
        http_response_free(&resp);
        return -1;
    }

    int rc = reward_service_take_response(rs, resp.body, resp.body_len, n, scores, ld, max_funcs, n_funcs, err,
                                          err_len);
    http_response_free(&resp);
    return rc;
}

int reward_service_take_response(RewardService *rs, const char *body, size_t body_len, size_t n, double *scores,
                                 size_t ld, size_t max_funcs, size_t *n_funcs, char *err, size_t err_len) {
    *n_funcs = 0;
    char **names = NULL;
    double *got = NULL;  // (k, n)
    size_t k = 0;
    char perr[512];
    if (reward_service_parse_response(body, body_len, n, &names, &k, &got, perr, sizeof perr) != 0) {
        char ex[161];
        http_body_excerpt(body, body_len, ex, sizeof ex);
        err_fail(err, err_len, "reward service %s: bad response (status 200): %s; body starts: %s", rs->url, perr, ex);
        return -1;
    }
    int rc = -1;
    if (k > max_funcs || k > ld) {
        err_fail(err, err_len, "reward service %s returned %zu reward functions; room for %zu", rs->url, k,
                max_funcs < ld ? max_funcs : ld);
        goto out;
    }
    if (rs->n_names == 0) {  // first answer fixes the names and their order
        rs->names = names, rs->n_names = k;
        names = NULL;
        for (size_t f = 0; f < k; f++)
            for (size_t i = 0; i < n; i++) scores[i * ld + f] = got[f * n + i];
    } else {
        if (k != rs->n_names) {
            err_fail(err, err_len, "reward service %s returned %zu reward functions, earlier %zu", rs->url, k,
                    rs->n_names);
            goto out;
        }
        for (size_t f = 0; f < rs->n_names; f++) {
            size_t g = 0;
            while (g < k && strcmp(names[g], rs->names[f]) != 0) g++;
            if (g == k) {
                err_fail(err, err_len, "reward service %s no longer returns reward '%s'", rs->url, rs->names[f]);
                goto out;
            }
            for (size_t i = 0; i < n; i++) scores[i * ld + f] = got[g * n + i];
        }
    }
    *n_funcs = rs->n_names;
    rc = 0;
out:
    if (names) free_names(names, k);
    free(got);
    return rc;
}
