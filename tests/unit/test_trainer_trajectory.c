// tests/unit/test_trainer_trajectory.c — trajectories_run (trainer/trajectory.h) with a scripted sampler on a
// character tokenizer: the layout of ids, mask, logprobs and versions; an unreadable call answered with its error;
// the completion budget used up exactly (no further sampling); and failures that must come back as errors, not
// hangs or crashes: a failing sampler, a sampler returning more than asked, an environment service that is down.
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "check_macros.h"
#include "testlib.h"
#include "trainer/env_service.h"
#include "trainer/trajectory.h"

typedef struct {
    const char *const *turns;   // the assistant turns, in order (text), for every episode
    int n_turns;
    const Tokenizer *tok;
    int calls;
    int fail;                   // 1: fail; 2: return one token more than asked
} Script;

static int scripted(void *ctx, const TrajectorySampleRequest *req, size_t n, TrajectorySample *out, char *err,
                    size_t err_len) {
    Script *s = ctx;
    s->calls++;
    if (s->fail == 1) {
        snprintf(err, err_len, "sampler: the servers are gone");
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        const char *text = req[i].turn <= s->n_turns ? s->turns[req[i].turn - 1] : "done";
        int32_t *ids = NULL;
        size_t k = 0;
        REQUIRE(tokenizer_encode(s->tok, text, strlen(text), 0, &ids, &k, err, err_len) == 0, "%s", err);
        size_t m = k < req[i].max_new_tokens ? k : req[i].max_new_tokens;
        if (s->fail == 2) m = req[i].max_new_tokens + 1;
        out[i].ids = ids;
        out[i].n = m <= k ? m : k;
        if (s->fail == 2) out[i].n = m;   // (the ids beyond k are never read: the builder refuses first)
        out[i].logprobs = xmalloc((m + 1) * sizeof(float));
        for (size_t j = 0; j < m; j++) out[i].logprobs[j] = -0.5f;
        out[i].version = 40 + req[i].turn;
    }
    return 0;
}

static Tokenizer *char_tokenizer(const char *dir) {
    // printable ASCII and '\n' one id each, the ChatML markers as added tokens.
    char path[512];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "w");
    REQUIRE(f);
    fputs("{\"version\": \"1.0\", \"added_tokens\": [{\"id\": 100, \"content\": \"<|im_start|>\", \"single_word\": "
          "false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}, {\"id\": 101, "
          "\"content\": \"<|im_end|>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": "
          "false, \"special\": true}], \"normalizer\": null, \"pre_tokenizer\": null, \"post_processor\": null, "
          "\"decoder\": {\"type\": \"Fuse\"}, \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
          "\"fuse_unk\": false, \"byte_fallback\": false, \"vocab\": {\"\\n\": 0",
          f);
    for (int c = 0x20; c < 0x7f; c++)
        fprintf(f, ", \"%s%c\": %d", c == '"' || c == '\\' ? "\\" : "", c, c - 0x20 + 1);
    fputs("}, \"merges\": []}}", f);
    fclose(f);
    // eos <|im_end|>: the tool turn starts right after it, with the "\n" the template writes there
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    write_text_file(path, "{\"eos_token\": \"<|im_end|>\"}");
    Tokenizer *tok = NULL;
    char err[512];
    REQUIRE(tokenizer_load(&tok, dir, err, sizeof err) == 0, "%s", err);
    return tok;
}

static char *decode(const Tokenizer *tok, const int32_t *ids, size_t n) {
    char *text = NULL, err[256];
    size_t len;
    REQUIRE(tokenizer_decode(tok, ids, n, 0, &text, &len, err, sizeof err) == 0);
    return text;
}

int main(void) {
    char dir[256], err[1024];
    REQUIRE(temp_dir_make("tandem_trajectory", dir, sizeof dir) == 0);
    Tokenizer *tok = char_tokenizer(dir);
    ChatTemplate *ct = NULL;
    REQUIRE(chat_template_create(&ct, NULL, "chatml", NULL, NULL, err, sizeof err) == 0, "%s", err);
    TrajectoryBuilder b = {.opt = {.max_tool_calling_iterations = -1, .max_completion_length = 400,
                                   .format = TOOL_FORMAT_HERMES},
                           .tok = tok, .sample = scripted};
    REQUIRE(tool_turn_style(&b.style, ct, tok, 1, err, sizeof err) == 0, "%s", err);
    ToolBox *tb = NULL;
    REQUIRE(toolbox_create(&tb, NULL, err, sizeof err) == 0);
    REQUIRE(env_builtin_create(&b.env, tb, err, sizeof err) == 0);
    const int32_t prompt[3] = {5, 6, 7};
    const char *ids[2] = {"a", "b"};

    // A call, an unreadable call (answered with its error), then the answer.
    const char *turns[] = {("<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"6*7\"}}"
                            "</tool_call><|im_end|>"),
                           "<tool_call>{\"name\": </tool_call><|im_end|>", "It is 42.<|im_end|>"};
    Script s = {.turns = turns, .n_turns = 3, .tok = tok};
    b.sample_ctx = &s;
    Trajectory t[2];
    for (int e = 0; e < 2; e++) REQUIRE(trajectory_init(&t[e], prompt, 3) == 0);
    REQUIRE(trajectories_run(&b, t, ids, 2, err, sizeof err) == 0, "%s", err);
    CHECK(s.calls == 3, "%d sampler calls", s.calls);   // both episodes in each of the 3 rounds
    for (int e = 0; e < 2; e++) {
        CHECK(t[e].end == TRAJECTORY_END_ANSWER && t[e].n_assistant_turns == 3);
        CHECK(t[e].n_tool_calls == 2 && t[e].n_tool_failures == 1, "%d %d", t[e].n_tool_calls, t[e].n_tool_failures);
        CHECK(memcmp(t[e].ids, prompt, sizeof prompt) == 0);
        size_t c = trajectory_completion_len(&t[e]);
        char *all = decode(tok, t[e].ids + 3, c);
        CHECK(strstr(all, "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n<tool_call>"), "%s",
              all);
        CHECK(strstr(all, "<|im_start|>tool\n{\"error\":\"tool call 1 is not valid JSON"), "%s", all);
        CHECK(strstr(all, "It is 42.<|im_end|>") && t[e].last_turn_start < c);
        char *last = decode(tok, t[e].ids + 3 + t[e].last_turn_start, c - t[e].last_turn_start);
        CHECK(strcmp(last, "It is 42.<|im_end|>") == 0, "%s", last);
        size_t ones = 0;
        for (size_t k = 0; k < c; k++) {
            if (t[e].mask[k]) {
                ones++;
                CHECK(t[e].logprobs[k] == -0.5f && t[e].versions[k] >= 41 && t[e].versions[k] <= 43);
            } else {
                CHECK(t[e].logprobs[k] == 0.0f && t[e].versions[k] == -1);
            }
        }
        int32_t *want = NULL;
        size_t nw = 0, total = 0;
        for (int k = 0; k < 3; k++) {
            REQUIRE(tokenizer_encode(tok, turns[k], strlen(turns[k]), 0, &want, &nw, err, sizeof err) == 0);
            total += nw;
            free(want);
        }
        CHECK(ones == total, "%zu policy tokens, want %zu", ones, total);
        free(all), free(last);
        trajectory_free(&t[e]);
    }

    // The budget used up exactly by the first turn plus a tool turn: the episode ends without sampling again.
    int32_t *first = NULL;
    size_t n_first = 0;
    REQUIRE(tokenizer_encode(tok, turns[0], strlen(turns[0]), 0, &first, &n_first, err, sizeof err) == 0);
    free(first);
    const char *tool_turn = "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n";
    int32_t *tt = NULL;
    size_t n_tt = 0;
    REQUIRE(tokenizer_encode(tok, tool_turn, strlen(tool_turn), 0, &tt, &n_tt, err, sizeof err) == 0);
    free(tt);
    b.opt.max_completion_length = n_first + n_tt;
    s.calls = 0;
    REQUIRE(trajectory_init(&t[0], prompt, 3) == 0);
    REQUIRE(trajectories_run(&b, t, ids, 1, err, sizeof err) == 0, "%s", err);
    CHECK(t[0].end == TRAJECTORY_END_LENGTH && s.calls == 1 && trajectory_completion_len(&t[0]) == n_first + n_tt,
          "end %s, %d calls, %zu tokens", trajectory_end_name(t[0].end), s.calls, trajectory_completion_len(&t[0]));
    trajectory_free(&t[0]);
    // One token less: the tool turn does not fit and is dropped.
    b.opt.max_completion_length = n_first + n_tt - 1;
    REQUIRE(trajectory_init(&t[0], prompt, 3) == 0);
    REQUIRE(trajectories_run(&b, t, ids, 1, err, sizeof err) == 0, "%s", err);
    CHECK(t[0].end == TRAJECTORY_END_LENGTH && trajectory_completion_len(&t[0]) == n_first);
    trajectory_free(&t[0]);
    // max_tool_calling_iterations 0: the first turn's call is not answered.
    b.opt.max_completion_length = 400;
    b.opt.max_tool_calling_iterations = 0;
    REQUIRE(trajectory_init(&t[0], prompt, 3) == 0);
    REQUIRE(trajectories_run(&b, t, ids, 1, err, sizeof err) == 0, "%s", err);
    CHECK(t[0].end == TRAJECTORY_END_MAX_TURNS && trajectory_completion_len(&t[0]) == n_first);
    trajectory_free(&t[0]);
    b.opt.max_tool_calling_iterations = -1;

    // Failures come back as errors.
    s.fail = 1;
    REQUIRE(trajectory_init(&t[0], prompt, 3) == 0);
    CHECK(trajectories_run(&b, t, ids, 1, err, sizeof err) == -1 && strstr(err, "the servers are gone"), "%s", err);
    trajectory_free(&t[0]);
    s.fail = 2;
    REQUIRE(trajectory_init(&t[0], prompt, 3) == 0);
    CHECK(trajectories_run(&b, t, ids, 1, err, sizeof err) == -1 && strstr(err, "at most"), "%s", err);
    trajectory_free(&t[0]);
    s.fail = 0;
    env_free(b.env);
    int port;
    int fd = listen_loopback(1, &port);
    close(fd);   // nothing listens there now
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    EnvServiceOptions so;
    env_service_options_default(&so);
    so.url = url, so.max_retries = 1, so.backoff_s = 0.01, so.timeout_s = 1, so.connect_timeout_s = 1;
    REQUIRE(env_service_create(&b.env, &so, err, sizeof err) == 0, "%s", err);
    REQUIRE(trajectory_init(&t[0], prompt, 3) == 0);
    CHECK(trajectories_run(&b, t, ids, 1, err, sizeof err) == -1 && strstr(err, url) && strstr(err, "/step"), "%s",
          err);
    trajectory_free(&t[0]);
    env_free(b.env);

    chat_template_free(ct);
    tokenizer_free(tok);
    return check_exit_code("test_trainer_trajectory");
}
