// trainer/eval.c — `tandem-train eval` (see trainer/eval.h).
//
// Rows: {"prompt": "text"} go to POST /v1/completions, {"prompt" or "messages": [chat messages]} to
// POST /v1/chat/completions, so the server applies its own chat template; other keys are the reward columns.
// Each row asks for n completions; every completion is scored by every selected reward. pass@k uses the first
// reward (a completion passes when it scores >= 1) with the unbiased estimator 1 - C(n - c, k) / C(n, k).
// Row r (from 0) sends "seed": seed + r * n, so that on tandem-serve its completion c draws from stream
// seed + r * n + c: the same command gives the same completions at any temperature and concurrency.
#include "trainer/eval.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shared/cli.h"
#include "shared/json_read.h"
#include "shared/version.h"
#include "trainer/http_client.h"
#include "trainer/rewards.h"

typedef struct {
    const char *url, *data, *model_name, *output, *rewards_csv;
    const char *api_key;     // --api-key, else OPENAI_API_KEY (as the openai client reads it)
    const char *format_mode; // --format-regex-mode: full or search
    const char *auth_header; // "Authorization: Bearer KEY\r\n", or NULL without a key
    int n, k, max_tokens, concurrency, timeout_s;
    double temperature, top_p;
    long long seed;          // row r asks for seed + r * n
    RewardOptions ro;
} EvalOptions;

typedef struct {
    json_t *row;             // the JSONL object
    int n_done;              // completions received (n on success)
    char **texts;            // (n)
    int tokens_each;         // usage.completion_tokens / n (for the length rewards)
    double *scores;          // (n, F)
    char err[512];           // non-empty when the request failed
} EvalRow;

typedef struct {
    EvalOptions *o;
    EvalRow *rows;
    int n_rows, next, finished;
    const Rewards *rewards;
    pthread_mutex_t mu;
} EvalJob;

// Seeds stay below 2^53: every JSON reader keeps them exact, and seed + row * n cannot overflow.
#define SEED_MAX 9007199254740992.0

#define TEXT(flag_, field, value, help_) \
    {.flag = flag_, .type = CLI_TEXT, .offset = offsetof(EvalOptions, field), .value_name = value, .help = help_}
#define N(flag_, field, help_)                                                                                      \
    {.flag = flag_, .type = CLI_INT, .offset = offsetof(EvalOptions, field), .help = help_, .bounds = CLI_BOUND_MIN, \
     .min = 1}
static const CliOption kOptions[] = {
    {.flag = "--url", .type = CLI_TEXT, .offset = offsetof(EvalOptions, url), .value_name = "URL",
     .help = "server base URL (http://HOST:PORT)", .required = 1},
    {.flag = "--data", .type = CLI_TEXT, .offset = offsetof(EvalOptions, data), .value_name = "FILE",
     .help = "JSONL: \"prompt\" (text or chat messages) or \"messages\", plus reward columns", .required = 1},
    TEXT("--model-name", model_name, "NAME", "the request's \"model\" field"),
    {.flag = "--api-key", .type = CLI_TEXT, .offset = offsetof(EvalOptions, api_key), .value_name = "KEY",
     .help = "sent as 'Authorization: Bearer KEY'", .default_note = "env OPENAI_API_KEY, else none"},
    TEXT("--rewards", rewards_csv, "LIST", "comma-separated built-in rewards"),
    TEXT("--answer-column", ro.answer_column, "NAME", "the column answer_match reads"),
    TEXT("--format-regex", ro.format_regex, "RE", "pattern of regex_format"),
    {.flag = "--format-regex-mode", .type = CLI_TEXT, .offset = offsetof(EvalOptions, format_mode),
     .value_name = "full|search", .help = "regex_format matches the whole completion or searches it",
     .choices = "full|search"},
    N("--n", n, "completions per prompt"),
    N("--k", k, "pass@k (at most n)"),
    N("--max-tokens", max_tokens, "tokens per completion at most"),
    {.flag = "--temperature", .type = CLI_DOUBLE, .offset = offsetof(EvalOptions, temperature),
     .help = "sampling temperature (0 = greedy)", .bounds = CLI_BOUND_MIN, .min = 0},
    {.flag = "--top-p", .type = CLI_DOUBLE, .offset = offsetof(EvalOptions, top_p), .help = "nucleus sampling",
     .bounds = CLI_BOUND_MIN | CLI_BOUND_MAX, .min = 0, .max = 1, .min_exclusive = 1},
    {.flag = "--seed", .type = CLI_LONG, .offset = offsetof(EvalOptions, seed),
     .help = "sampling seed: row r (from 0) asks for seed + r * n, so a run at temperature > 0 gives the same "
             "completions when repeated",
     .bounds = CLI_BOUND_MIN | CLI_BOUND_MAX, .min = 0, .max = SEED_MAX},
    N("--concurrency", concurrency, "requests in flight"),
    N("--timeout", timeout_s, "seconds per request"),
    TEXT("--output", output, "FILE", "per-row results of the rows scored, as JSONL; not written when no row was scored"),
};
#undef TEXT
#undef N

static const CliSpec kSpec = {
    .command = "tandem-train eval",
    .synopsis = "--url http://HOST:PORT --data FILE.jsonl [options]",
    .description = "Scores a held-out JSONL through an OpenAI-compatible server (tandem-serve, vLLM, ...) with the\n"
                   "built-in rewards: the mean of every reward and pass@k of the first one.",
    .epilog = "Prints a table and, last, one JSON line with the figures.",
    .options = kOptions,
    .n_options = sizeof kOptions / sizeof kOptions[0],
};

// Builds the request for row `index` (from 0) and returns the endpoint path ("/v1/completions" or
// "/v1/chat/completions").
static const char *build_request(const EvalOptions *o, json_t *row, int index, char **body) {
    json_t *prompt = json_object_get(row, "prompt"), *messages = json_object_get(row, "messages");
    json_t *req = json_object();
    const char *path;
    if (json_is_string(prompt)) {
        json_object_set(req, "prompt", prompt);
        path = "/v1/completions";
    } else {
        json_object_set(req, "messages", json_is_array(prompt) ? prompt : messages);
        path = "/v1/chat/completions";
    }
    if (o->model_name) json_object_set_new(req, "model", json_string(o->model_name));
    json_object_set_new(req, "n", json_integer(o->n));
    json_object_set_new(req, "max_tokens", json_integer(o->max_tokens));
    json_object_set_new(req, "temperature", json_real(o->temperature));
    json_object_set_new(req, "top_p", json_real(o->top_p));
    json_object_set_new(req, "seed", json_integer((json_int_t)(o->seed + (int64_t)index * o->n)));
    *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    return path;
}

int eval_read_answer(const char *url, int status, const char *body, size_t body_len, int n, char **texts,
                     int *completion_tokens, char *err, size_t err_len) {
    *completion_tokens = 0;
    json_error_t je;
    // JSON_ALLOW_NUL: a completion may hold U+0000 (a sampled byte token); the rewards see the text before it.
    json_t *ans = json_read_buffer(body, body_len, JSON_ALLOW_NUL, &je);
    if (status != 200 || !ans) {
        snprintf(err, err_len, "%.150s answered %d: %.300s", url, status, body ? body : "");
        json_decref(ans);
        return -1;
    }
    json_t *choices = json_object_get(ans, "choices");
    // A count the server got wrong (negative, beyond int) must not become a negative length for the rewards.
    json_int_t tokens = json_integer_value(json_object_get(json_object_get(ans, "usage"), "completion_tokens"));
    *completion_tokens = tokens < 0 ? 0 : tokens > INT_MAX ? INT_MAX : (int)tokens;
    int got = 0;
    for (size_t i = 0; i < json_array_size(choices); i++) {
        json_t *c = json_array_get(choices, i);
        json_t *ji = json_object_get(c, "index");
        json_int_t idx = json_is_integer(ji) ? json_integer_value(ji) : (json_int_t)i;
        json_t *t = json_object_get(c, "text");
        if (!t) t = json_object_get(json_object_get(c, "message"), "content");
        if (idx < 0 || idx >= n || !json_is_string(t) || texts[idx]) continue;
        if (!(texts[idx] = strdup(json_string_value(t)))) {
            snprintf(err, err_len, "out of memory");
            json_decref(ans);
            return -1;
        }
        got++;
    }
    json_decref(ans);
    return got;
}

static void run_row(EvalJob *j, int index) {
    const EvalOptions *o = j->o;
    EvalRow *r = &j->rows[index];
    char *body = NULL, url[4096];
    const char *path = build_request(o, r->row, index, &body);
    snprintf(url, sizeof url, "%s%s", o->url, path);
    HttpOptions ho = {.connect_timeout_ms = 10000, .timeout_ms = o->timeout_s * 1000, .headers = o->auth_header};
    HttpResponse resp = {0};
    if (!body) {
        snprintf(r->err, sizeof r->err, "out of memory");
        return;
    }
    if (http_post(url, "application/json", body, strlen(body), &ho, &resp, r->err, sizeof r->err) != 0) {
        free(body);
        return;
    }
    free(body);
    int usage_tokens = 0;
    if (!(r->texts = calloc(o->n, sizeof(char *)))) {
        snprintf(r->err, sizeof r->err, "out of memory");
        http_response_free(&resp);
        return;
    }
    int got = eval_read_answer(url, resp.status, resp.body, resp.body_len, o->n, r->texts, &usage_tokens, r->err,
                               sizeof r->err);
    http_response_free(&resp);
    if (got < 0) return;
    r->n_done = got;
    if (r->n_done != o->n) {
        snprintf(r->err, sizeof r->err, "%.400s returned %d usable choices for n = %d", url, r->n_done, o->n);
        return;
    }
    r->tokens_each = o->n ? usage_tokens / o->n : 0;
    size_t F = rewards_count(j->rewards);
    RewardSample *s = calloc(o->n, sizeof *s);
    r->scores = malloc((size_t)o->n * (F ? F : 1) * sizeof(double));
    for (int i = 0; i < o->n; i++)
        s[i] = (RewardSample){.completion = r->texts[i], .completion_tokens = r->tokens_each,
                              .prompt = json_object_get(r->row, "prompt"), .columns = r->row};
    if (rewards_score(j->rewards, s, o->n, r->scores, F, r->err, sizeof r->err) != 0) r->n_done = 0;
    free(s);
}

static void progress(EvalJob *j) {
    if (!isatty(STDERR_FILENO)) return;
    int w = 30, fill = j->n_rows ? w * j->finished / j->n_rows : w;
    char bar[64];
    for (int i = 0; i < w; i++) bar[i] = i < fill ? '#' : '.';
    bar[w] = 0;
    fprintf(stderr, "\r[%s] %d/%d prompts", bar, j->finished, j->n_rows);
    fflush(stderr);
}

static void *worker(void *arg) {
    EvalJob *j = arg;
    for (;;) {
        pthread_mutex_lock(&j->mu);
        int i = j->next < j->n_rows ? j->next++ : -1;
        pthread_mutex_unlock(&j->mu);
        if (i < 0) return NULL;
        run_row(j, i);
        pthread_mutex_lock(&j->mu);
        j->finished++;
        progress(j);
        pthread_mutex_unlock(&j->mu);
    }
}

static int row_failed(const EvalOptions *o, const EvalRow *r) { return r->err[0] || r->n_done != o->n; }

// Prints every distinct error once, with how many rows it stopped and the first of them: a server that is
// down fails every row with the same message. Returns the number of failed rows.
#define ERROR_ROWS_NAMED 5
typedef struct {
    const char *err;              // the rows' message (points into the first row's EvalRow.err)
    long count;                   // rows that failed with it
    int rows[ERROR_ROWS_NAMED];   // the first of them, 1-based
} ErrorGroup;

static long report_failures(const EvalJob *j) {
    enum { GROUPS = 8, ROWS_NAMED = ERROR_ROWS_NAMED };
    ErrorGroup g[GROUPS];
    int n_groups = 0;
    long failed = 0, others = 0;
    for (int i = 0; i < j->n_rows; i++) {
        const EvalRow *r = &j->rows[i];
        if (!row_failed(j->o, r)) continue;
        failed++;
        const char *err = r->err[0] ? r->err : "the server's answer had fewer completions than --n";
        int k = 0;
        while (k < n_groups && strcmp(g[k].err, err) != 0) k++;
        if (k == n_groups) {
            if (n_groups == GROUPS) {
                others++;
                continue;
            }
            g[n_groups++] = (ErrorGroup){.err = err};
        }
        if (g[k].count < ROWS_NAMED) g[k].rows[g[k].count] = i + 1;
        g[k].count++;
    }
    for (int k = 0; k < n_groups; k++) {
        char rows[96] = "";
        size_t used = 0;
        for (int q = 0; q < g[k].count && q < ROWS_NAMED; q++)
            used += (size_t)snprintf(rows + used, sizeof rows - used, "%s%d", q ? ", " : "", g[k].rows[q]);
        if (g[k].count > ROWS_NAMED) snprintf(rows + used, sizeof rows - used, ", ...");
        fprintf(stderr, "tandem-train eval: %ld row%s failed (row%s %s): %s\n", g[k].count, g[k].count == 1 ? "" : "s",
                g[k].count == 1 ? "" : "s", rows, g[k].err);
    }
    if (others) fprintf(stderr, "tandem-train eval: %ld more row%s failed with other errors\n", others, others == 1 ? "" : "s");
    return failed;
}

static double pass_at_k(int n, int c, int k) {
    if (n - c < k) return 1.0;
    double p = 1.0; // C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i)
    for (int i = n - c + 1; i <= n; i++) p *= 1.0 - (double)k / i;
    return 1.0 - p;
}

int eval_main(int argc, char **argv) {
    EvalOptions o = {.n = 1, .k = 1, .max_tokens = 256, .concurrency = 8, .timeout_s = 600, .temperature = 0,
                     .top_p = 1, .rewards_csv = "answer_match", .format_mode = "full"};
    reward_options_default(&o.ro);
    const EvalOptions defaults = o;
    char cli_err[512];
    int pr = cli_parse(&kSpec, &o, argc, argv, NULL, cli_err, sizeof cli_err);
    if (pr == CLI_HELP) cli_usage(&kSpec, &defaults, stdout);
    if (pr == CLI_VERSION) tandem_print_version(stdout, "tandem-train");
    if (pr == CLI_ERROR) fprintf(stderr, "%s\n", cli_err);
    if (pr != CLI_OK) return pr == CLI_ERROR ? 2 : 0;
    if (o.k > o.n) {
        fprintf(stderr, "tandem-train eval: --k %d is above --n %d (pass@k needs k <= n)\n", o.k, o.n);
        return 2;
    }
    o.ro.format_regex_search = !strcmp(o.format_mode, "search");
    const char *api_key = o.api_key ? o.api_key : getenv("OPENAI_API_KEY");
    if (api_key && *api_key) {
        // A key is one header value: control characters would end the header and inject others.
        for (const char *p = api_key; *p; p++)
            if ((unsigned char)*p < 0x20 || *p == 0x7f) {
                fprintf(stderr, "tandem-train eval: the API key holds a control character (a stray newline?)\n");
                return 2;
            }
        if (strlen(api_key) > 2048) {
            fprintf(stderr, "tandem-train eval: the API key is longer than 2048 characters\n");
            return 2;
        }
    }
    o.ro.max_completion_length = o.max_tokens;
    if (o.ro.soft_punish_cache > o.max_tokens) o.ro.soft_punish_cache = o.max_tokens;
    if (o.ro.length_penalty_target >= o.max_tokens) o.ro.length_penalty_target = o.max_tokens - 1;
    // Rewards.
    char *names_buf = strdup(o.rewards_csv), *names[16];
    size_t n_names = 0;
    for (char *tok = strtok(names_buf, ","); tok && n_names < 16; tok = strtok(NULL, ",")) names[n_names++] = tok;
    char err[1024];
    Rewards *rw = NULL;
    if (n_names == 0 || rewards_create(&rw, (const char *const *)names, n_names, &o.ro, err, sizeof err) != 0) {
        fprintf(stderr, "tandem-train eval: --rewards: %s\n", n_names ? err : "give at least one reward");
        free(names_buf);
        return 2;
    }
    // Rows.
    FILE *f = fopen(o.data, "r");
    if (!f) {
        fprintf(stderr, "tandem-train eval: cannot read %s\n", o.data);
        rewards_free(rw);
        free(names_buf);
        return 1;
    }
    char auth[2048 + 32];
    if (api_key && *api_key) {
        snprintf(auth, sizeof auth, "Authorization: Bearer %s\r\n", api_key);
        o.auth_header = auth;
    }
    EvalJob job = {.o = &o, .rewards = rw};
    pthread_mutex_init(&job.mu, NULL);
    char *line = NULL;
    size_t cap = 0;
    int lineno = 0, rc = 0, cap_rows = 0;
    while (getline(&line, &cap, f) > 0) {
        lineno++;
        if (strspn(line, " \t\r\n") == strlen(line)) continue;
        json_error_t je;
        json_t *row = json_read_buffer(line, strlen(line), 0, &je);
        json_t *p = row ? json_object_get(row, "prompt") : NULL, *msgs = row ? json_object_get(row, "messages") : NULL;
        if (!json_is_object(row) || !(json_is_string(p) || json_is_array(p) || json_is_array(msgs))) {
            fprintf(stderr, "tandem-train eval: %s:%d: %s\n", o.data, lineno,
                    row ? "needs \"prompt\" (text or messages) or \"messages\"" : je.text);
            json_decref(row);
            rc = 1;
            break;
        }
        if (job.n_rows == cap_rows) {
            cap_rows = cap_rows ? 2 * cap_rows : 64;
            job.rows = realloc(job.rows, cap_rows * sizeof *job.rows);
        }
        job.rows[job.n_rows++] = (EvalRow){.row = row};
    }
    free(line);
    fclose(f);
    if (rc == 0 && job.n_rows == 0) {
        fprintf(stderr, "tandem-train eval: %s has no rows\n", o.data);
        rc = 1;
    }
    if (rc == 0) {
        int nt = o.concurrency < job.n_rows ? o.concurrency : job.n_rows;
        pthread_t *th = calloc(nt, sizeof *th);
        for (int i = 0; i < nt; i++) pthread_create(&th[i], NULL, worker, &job);
        for (int i = 0; i < nt; i++) pthread_join(th[i], NULL);
        free(th);
        if (isatty(STDERR_FILENO)) fputc('\n', stderr);
        // Figures.
        size_t F = rewards_count(rw);
        double *sum = calloc(F, sizeof(double)), pass_sum = 0;
        long *cnt = calloc(F, sizeof(long)), pass_rows = 0, failed = report_failures(&job);
        // The output file holds the rows scored; it is created with the first one, so a run that scored
        // nothing leaves no empty file that looks like a result.
        FILE *out = NULL;
        int out_failed = 0;
        for (int i = 0; i < job.n_rows; i++) {
            EvalRow *r = &job.rows[i];
            if (row_failed(&o, r)) continue;
            int correct = 0, scored = 0;
            for (int c = 0; c < o.n; c++) {
                for (size_t fn = 0; fn < F; fn++) {
                    double s = r->scores[(size_t)c * F + fn];
                    if (isnan(s)) continue;
                    sum[fn] += s;
                    cnt[fn]++;
                }
                double s0 = r->scores[(size_t)c * F];
                if (!isnan(s0)) {
                    scored++;
                    correct += s0 >= 1.0 - 1e-9;
                }
            }
            if (scored == o.n) {
                pass_sum += pass_at_k(o.n, correct, o.k);
                pass_rows++;
            }
            if (o.output && !out && !out_failed && !(out = fopen(o.output, "w"))) {
                fprintf(stderr, "tandem-train eval: cannot write --output %s: %s (the figures below are complete)\n",
                        o.output, strerror(errno));
                out_failed = 1;
            }
            if (out) {
                json_t *res = json_object(), *comp = json_array(), *sc = json_array();
                for (int c = 0; c < o.n; c++) {
                    json_array_append_new(comp, json_string(r->texts[c]));
                    json_t *per = json_object();
                    for (size_t fn = 0; fn < F; fn++) {
                        double s = r->scores[(size_t)c * F + fn];
                        json_object_set_new(per, rewards_name(rw, fn), isnan(s) ? json_null() : json_real(s));
                    }
                    json_array_append_new(sc, per);
                }
                json_object_set_new(res, "row", json_integer(i + 1));
                json_object_set_new(res, "completions", comp);
                json_object_set_new(res, "scores", sc);
                char *txt = json_dumps(res, JSON_COMPACT);
                fprintf(out, "%s\n", txt);
                free(txt);
                json_decref(res);
            }
        }
        if (out && fclose(out) != 0) {
            fprintf(stderr, "tandem-train eval: writing --output %s failed: %s\n", o.output, strerror(errno));
            out_failed = 1;
        } else if (o.output && !out && !out_failed) {
            fprintf(stderr, "tandem-train eval: no row was scored, so --output %s was not written%s\n", o.output,
                    access(o.output, F_OK) == 0 ? " (the file there is from an earlier run)" : "");
        }
        if (out_failed) rc = 1;
        json_t *summary = json_object();
        json_object_set_new(summary, "rows", json_integer(job.n_rows));
        json_object_set_new(summary, "failed_rows", json_integer(failed));
        json_object_set_new(summary, "n", json_integer(o.n));
        printf("%-28s %10s %8s\n", "metric", "value", "count");
        for (size_t fn = 0; fn < F; fn++) {
            char key[96];
            snprintf(key, sizeof key, "rewards/%s/mean", rewards_name(rw, fn));
            double m = cnt[fn] ? sum[fn] / cnt[fn] : NAN;
            printf("%-28s %10.4f %8ld\n", key, m, cnt[fn]);
            json_object_set_new(summary, key, cnt[fn] ? json_real(m) : json_null());
        }
        char key[64];
        snprintf(key, sizeof key, "pass@%d", o.k);
        double pk = pass_rows ? pass_sum / pass_rows : NAN;
        printf("%-28s %10.4f %8ld\n", key, pk, pass_rows);
        json_object_set_new(summary, key, pass_rows ? json_real(pk) : json_null());
        char *txt = json_dumps(summary, JSON_COMPACT | JSON_REAL_PRECISION(9));
        printf("%s\n", txt);
        free(txt);
        json_decref(summary);
        free(sum);
        free(cnt);
        if (failed) {
            if (failed == job.n_rows)
                fprintf(stderr, "tandem-train eval: %ld of %d rows failed (errors above): nothing was scored\n", failed,
                        job.n_rows);
            else
                fprintf(stderr, "tandem-train eval: %ld of %d rows failed (errors above); the figures cover the %ld "
                        "rows scored\n", failed, job.n_rows, job.n_rows - failed);
            rc = 1;
        }
    }
    for (int i = 0; i < job.n_rows; i++) {
        EvalRow *r = &job.rows[i];
        json_decref(r->row);
        if (r->texts)
            for (int c = 0; c < o.n; c++) free(r->texts[c]);
        free(r->texts);
        free(r->scores);
    }
    free(job.rows);
    pthread_mutex_destroy(&job.mu);
    rewards_free(rw);
    free(names_buf);
    return rc;
}
