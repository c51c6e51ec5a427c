// tests/fuzz/fuzz_rollout_http_request.c — libFuzzer target for tandem-serve's HTTP request bodies: what
// POST /v1/completions, /v1/chat/completions, /generate/ (TRL) and /detokenize do with a body before the engine
// sees it, through the same functions (rollout_server/http_json.h, http_chat.c, http_generate.c).
//
// Input: byte 0 picks the route (% 4: 0 completions, 1 chat completions, 2 TRL generate, 3 detokenize); the rest
// is the body. The server has the fuzz tokenizer (fuzz_testlib.h), the chatml template, and a vocabulary of
// VOCAB rows (more than the tokenizer's ids, as a padded embedding has).
// Checks:
//   - every refusal's answer, as the client receives it (http_error_body), is a JSON object
//     {"error": {"message": non-empty string, "type": string, "param": string or null, "code": the status}};
//   - accepted sampling fields lie in their documented ranges; prompts are non-empty with ids in [0, VOCAB);
//     rendered chat text and detokenized text are valid UTF-8 (they go into JSON answers).
// Built by CMake when configured with CC=clang -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF.
#include <math.h>
#include <stdint.h>

#include "fuzz_testlib.h"
#include "rollout_server/http_internal.h"
#include "shared/tokenizer/chat_template.h"

#define VOCAB 300

static Tokenizer *g_tok;
static ChatTemplate *g_chat;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    char err[512];
    g_tok = fuzz_load_tokenizer();
    if (chat_template_create(&g_chat, NULL, "chatml", "<s>", "</s>", err, sizeof err) != 0) {
        fprintf(stderr, "fuzz setup: %s\n", err);
        __builtin_trap();
    }
    return 0;
}

// The refusal as the client reads it.
static void check_error(const HttpError *e) {
    REQUIRE(e->status == 400 || e->status == 404 || e->status == 500);
    REQUIRE(e->message[0] != '\0');
    size_t len = 0;
    char *body = http_error_body(e, &len);
    REQUIRE(body && len == strlen(body));
    json_error_t je;
    json_t *j = json_loadb(body, len, 0, &je);
    REQUIRE(j);
    json_t *in = json_object_get(j, "error");
    REQUIRE(json_is_object(in) && json_object_size(j) == 1);
    json_t *msg = json_object_get(in, "message"), *param = json_object_get(in, "param");
    REQUIRE(json_is_string(msg) && json_string_length(msg) > 0);
    REQUIRE(json_is_string(json_object_get(in, "type")));
    REQUIRE(json_is_null(param) || (json_is_string(param) && json_string_length(param) > 0));
    REQUIRE(json_integer_value(json_object_get(in, "code")) == e->status);
    json_decref(j);
    free(body);
}

static void check_options(const HttpGenOptions *o) {
    const SamplingParams *sp = &o->sp;
    REQUIRE(sp->n >= 1 && sp->n <= HTTP_MAX_N && sp->max_tokens >= 1);
    REQUIRE(isfinite(sp->temperature) && sp->temperature >= 0);
    REQUIRE(sp->top_p > 0 && sp->top_p <= 1 && sp->min_p >= 0 && sp->min_p <= 1);
    REQUIRE(isfinite(sp->repetition_penalty) && sp->repetition_penalty > 0 && sp->top_k >= -1);
    REQUIRE(sp->n_stop >= 0 && sp->n_stop <= ENGINE_MAX_STOP);
    for (int i = 0; i < sp->n_stop; i++) REQUIRE(strlen(sp->stop[i]) >= 1 && strlen(sp->stop[i]) <= HTTP_MAX_STOP_BYTES);
    REQUIRE(sp->n_stop_token_ids >= 0 && sp->n_stop_token_ids <= ENGINE_MAX_STOP);
    for (int i = 0; i < sp->n_stop_token_ids; i++) REQUIRE(sp->stop_token_ids[i] >= 0 && sp->stop_token_ids[i] < VOCAB);
    REQUIRE(o->logprobs >= -1 && o->logprobs <= ENGINE_MAX_TOP_LOGPROBS);
    REQUIRE(sp->top_logprobs >= 0 && sp->top_logprobs <= ENGINE_MAX_TOP_LOGPROBS);
    REQUIRE(sp->min_tokens >= 0 && sp->n_allowed >= 0 && (sp->n_allowed == 0 || sp->allowed_token_ids));
    for (int i = 0; i < sp->n_allowed; i++) REQUIRE(sp->allowed_token_ids[i] >= 0 && sp->allowed_token_ids[i] < VOCAB);
}

// Tokenizes the prompts as the routes do and checks what the engine would get.
static int tokenize(const HttpPromptList *pl, int add_special, HttpError *e) {
    int32_t **ids = NULL;
    int *lens = NULL;
    if (http_tokenize_prompts(g_tok, pl, add_special, &ids, &lens, e) < 0) return -1;
    for (int i = 0; i < pl->n; i++) {
        REQUIRE(lens[i] >= 1);
        for (int t = 0; t < lens[i]; t++) REQUIRE(ids[i][t] >= 0 && ids[i][t] < VOCAB);
    }
    http_free_ids(ids, lens, pl->n);
    return 0;
}

// /v1/completions, /v1/chat/completions and /generate/ up to engine_submit (routes_openai.c gencall_start,
// routes_misc.c http_route_trl_generate).
static int generation(const json_t *req, HttpApi api, HttpError *e) {
    HttpGenOptions o;
    if (http_parse_generation(req, api, VOCAB, &o, e) < 0) {
        http_gen_options_free(&o);
        return -1;
    }
    check_options(&o);
    HttpPromptList pl = {0};
    char *rendered = NULL;
    int rc = -1;
    if (http_encode_bad_words(g_tok, &o, e) < 0) goto done;
    for (int w = 0; w < o.sp.n_bad_words; w++) {
        REQUIRE(o.sp.bad_words_offsets[w + 1] > o.sp.bad_words_offsets[w]);
        for (int k = o.sp.bad_words_offsets[w]; k < o.sp.bad_words_offsets[w + 1]; k++)
            REQUIRE(o.sp.bad_words_ids[k] >= 0 && o.sp.bad_words_ids[k] < VOCAB);
    }
    if (api == HTTP_API_CHAT) {
        HttpChatMessages cm;
        if (http_parse_messages(req, &cm, e) < 0) goto done;
        size_t len = 0;
        char msg[512] = "";
        int r = chat_render_ex(g_chat, cm.items, cm.n, o.add_generation_prompt, &cm.opt, &rendered, &len, msg,
                               sizeof msg);
        http_chat_messages_free(&cm);
        if (r != 0) {
            REQUIRE(msg[0] != '\0');
            http_error_set(e, 400, "messages", "chat template (chatml): %s", msg);
            goto done;
        }
        REQUIRE(fuzz_valid_utf8(rendered, len));
        if (!(pl.items = calloc(1, sizeof *pl.items))) goto done;
        pl.n = 1;
        pl.items[0] = (HttpPrompt){.text = rendered, .text_len = len};
    } else if (http_parse_prompts(json_object_get(req, api == HTTP_API_TRL ? "prompts" : "prompt"),
                                  api == HTTP_API_TRL ? "prompts" : "prompt", VOCAB, api != HTTP_API_TRL, &pl,
                                  e) < 0) {
        goto done;
    }
    REQUIRE(pl.n >= 1 && pl.n <= HTTP_MAX_PROMPTS);
    for (int i = 0; i < pl.n; i++) {
        const HttpPrompt *p = &pl.items[i];
        REQUIRE(p->ids ? (p->n_ids >= 1 && !p->text) : (p->text && p->text_len >= 1));
        for (int t = 0; p->ids && t < p->n_ids; t++) REQUIRE(p->ids[t] >= 0 && p->ids[t] < VOCAB);
    }
    if ((long)pl.n * o.sp.n > HTTP_MAX_COMPLETIONS) {
        http_error_set(e, 400, "n", "%d prompts x n=%d completions is over the limit of %d per request", pl.n, o.sp.n,
                       HTTP_MAX_COMPLETIONS);
        goto done;
    }
    rc = tokenize(&pl, api == HTTP_API_TRL ? 1 : o.add_special_tokens, e);
done:
    if (api == HTTP_API_CHAT && pl.items) pl.items[0].text = NULL;   // rendered is freed below
    http_prompts_free(&pl);
    http_gen_options_free(&o);
    free(rendered);
    if (rc < 0 && e->status == 0) http_error_set(e, 500, NULL, "out of memory");
    return rc;
}

// /detokenize (routes_misc.c http_route_detokenize).
static int detokenize(const json_t *req, HttpError *e) {
    const json_t *t = json_object_get(req, "tokens");
    if (!t || json_is_null(t)) return http_error_set(e, 400, "tokens", "'tokens' is required");
    int32_t *ids = NULL;
    int n = 0;
    if (http_parse_id_list(t, "tokens", VOCAB, &ids, &n, e) < 0) return -1;
    char *text = NULL, msg[256] = "";
    size_t len = 0;
    int rc = tokenizer_decode(g_tok, ids, (size_t)n, 0, &text, &len, msg, sizeof msg);
    if (rc == 0) REQUIRE(fuzz_valid_utf8(text, len));
    else http_error_set(e, 400, "tokens", "cannot decode: %s", msg);
    free(text);
    free(ids);
    return rc == 0 ? 0 : -1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    // An exact-size heap copy of the body, as the server holds it, so that a read past it is an ASan report.
    size_t len = size - 1;
    char *body = malloc(len ? len : 1);
    REQUIRE(body);
    memcpy(body, data + 1, len);
    HttpError e = {0};
    json_t *req = NULL;
    int rc = http_body_parse(body, len, &req, &e);
    if (rc == 0) {
        REQUIRE(json_is_object(req));
        switch (data[0] % 4) {
        case 0: rc = generation(req, HTTP_API_COMPLETIONS, &e); break;
        case 1: rc = generation(req, HTTP_API_CHAT, &e); break;
        case 2: rc = generation(req, HTTP_API_TRL, &e); break;
        default: rc = detokenize(req, &e); break;
        }
    }
    if (rc < 0) check_error(&e);
    json_decref(req);
    free(body);
    return 0;
}
