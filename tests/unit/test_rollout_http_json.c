// tests/unit/test_rollout_http_json.c — the HTTP API's pure parts, without sockets or an engine: request
// JSON -> SamplingParams (defaults per API, every field, every refusal naming its field), prompt shapes, the
// OpenAI error object, logprobs / choices / TRL answers built from engine events, SSE framing, and the
// Prometheus text of /metrics.
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "rollout_server/http_json.h"
#include "rollout_server/http_metrics.h"
#include "rollout_server/http_response.h"
#include "tests/unit/check_macros.h"

#define VOCAB 300

static json_t *parse(const char *text) {
    json_t *j = NULL;
    HttpError e = {0};
    int rc = http_body_parse(text, strlen(text), &j, &e);
    if (rc != 0) fprintf(stderr, "unexpected refusal of %s: %s\n", text, e.message);
    CHECK(rc == 0 && j);
    return j;
}

// Parses a request for `api` and expects success.
static HttpGenOptions gen_ok(HttpApi api, const char *text, json_t **keep) {
    json_t *j = parse(text);
    HttpGenOptions o;
    HttpError e = {0};
    int rc = http_parse_generation(j, api, VOCAB, &o, &e);
    if (rc != 0) fprintf(stderr, "unexpected refusal of %s: %s\n", text, e.message);
    CHECK(rc == 0);
    if (keep) *keep = j; // stop strings point into the JSON
    else json_decref(j);
    return o;
}

// Expects a 400 naming `param` whose message contains `needle`.
static void gen_refused(int line, HttpApi api, const char *text, const char *param, const char *needle) {
    json_t *j = parse(text);
    if (!j) return;
    HttpGenOptions o;
    HttpError e = {0};
    int rc = http_parse_generation(j, api, VOCAB, &o, &e);
    int ok = rc < 0 && e.status == 400 && strcmp(e.param, param) == 0 && (!needle || strstr(e.message, needle));
    if (!ok) {
        fprintf(stderr, "line %d: %s: rc %d status %d param '%s' message '%s' (wanted param '%s', '%s')\n", line, text,
                rc, e.status, e.param, e.message, param, needle ? needle : "");
        failures++;
    }
    http_gen_options_free(&o);
    json_decref(j);
}
#define REFUSED(api, text, param, needle) gen_refused(__LINE__, api, text, param, needle)

static void test_body_parse(void) {
    json_t *j = NULL;
    HttpError e = {0};
    CHECK(http_body_parse("{\"a\": 1", 7, &j, &e) < 0 && e.status == 400 && strstr(e.message, "malformed JSON"));
    CHECK(!j);
    CHECK(http_body_parse("[1, 2]", 6, &j, &e) < 0 && e.status == 400 && strstr(e.message, "JSON object"));
    CHECK(http_body_parse("", 0, &j, &e) < 0 && e.status == 400 && strstr(e.message, "empty"));
    // Python's json.dumps writes NaN / Infinity: refused, and the field is named.
    const char *nan = "{\"n\": 1, \"temperature\": NaN}";
    CHECK(http_body_parse(nan, strlen(nan), &j, &e) < 0 && e.status == 400 && strcmp(e.param, "temperature") == 0);
    const char *inf = "{\"top_p\": -Infinity}";
    CHECK(http_body_parse(inf, strlen(inf), &j, &e) < 0 && strcmp(e.param, "top_p") == 0 &&
          strstr(e.message, "finite"));
    // Every valid JSON number is read (shared/json_read.h): integers beyond int64 as reals, 1e400 as DBL_MAX.
    const char *big = "{\"max_tokens\": 1000000000000000019884624838656, \"temperature\": 1e400}";
    CHECK(http_body_parse(big, strlen(big), &j, &e) == 0 && json_is_real(json_object_get(j, "max_tokens")) &&
          json_real_value(json_object_get(j, "temperature")) == DBL_MAX);
    json_decref(j);
    j = NULL;
    const char *dup = "{\"n\": 1, \"n\": 2}";
    CHECK(http_body_parse(dup, strlen(dup), &j, &e) < 0 && e.status == 400);
    j = parse("{\"prompt\": \"hi\"}");
    CHECK(json_is_object(j));
    json_decref(j);
}

static void test_error_json(void) {
    HttpError e;
    CHECK(http_error_set(&e, 429, NULL, "queue full (%d)", 7) == -1);
    size_t n = 0;
    char *s = http_error_body(&e, &n);
    CHECK(s && n == strlen(s));
    json_t *j = json_loads(s, 0, NULL);
    json_t *in = json_object_get(j, "error");
    CHECK(json_is_object(in));
    CHECK(strcmp(json_string_value(json_object_get(in, "message")), "queue full (7)") == 0);
    CHECK(strcmp(json_string_value(json_object_get(in, "type")), "rate_limit_error") == 0);
    CHECK(json_is_null(json_object_get(in, "param")));
    CHECK(json_integer_value(json_object_get(in, "code")) == 429);
    json_decref(j);
    free(s);
    http_error_set(&e, 400, "top_p", "bad");
    j = http_error_json(&e);
    CHECK(strcmp(json_string_value(json_object_get(json_object_get(j, "error"), "param")), "top_p") == 0);
    CHECK(strcmp(json_string_value(json_object_get(json_object_get(j, "error"), "type")),
                 "invalid_request_error") == 0);
    json_decref(j);
    // A message quoting bytes that are not UTF-8 (jansson's error text quotes a malformed body), or cut inside a
    // character at the end of its buffer, still reaches the client, with U+FFFD in their place; so does a param.
    http_error_set(&e, 400, "k\xc3", "near '\xd5\x8e\x94' and cut \xe6\x97");
    j = http_error_json(&e);
    const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    const char *par = json_string_value(json_object_get(json_object_get(j, "error"), "param"));
    CHECK(msg && strcmp(msg, "near '\xd5\x8e\xef\xbf\xbd' and cut \xef\xbf\xbd") == 0);
    CHECK(par && strcmp(par, "k\xef\xbf\xbd") == 0);
    json_decref(j);
    CHECK(http_status_for_engine(ENGINE_EINVAL) == 400 && http_status_for_engine(ENGINE_ETOOLONG) == 400);
    CHECK(http_status_for_engine(ENGINE_EQUEUE_FULL) == 429 && http_status_for_engine(ENGINE_ESHUTDOWN) == 503);
    CHECK(http_status_for_engine(ENGINE_EINTERNAL) == 500 && http_status_for_engine(ENGINE_ENOMEM) == 500);
}

static void test_completion_fields(void) {
    SamplingParams d;
    sampling_params_default(&d);
    HttpGenOptions o = gen_ok(HTTP_API_COMPLETIONS, "{\"prompt\": \"x\"}", NULL);
    CHECK(o.sp.n == d.n && o.sp.max_tokens == d.max_tokens && o.sp.temperature == d.temperature);
    CHECK(o.sp.top_p == d.top_p && o.sp.top_k == d.top_k && o.sp.min_p == d.min_p && !o.sp.has_seed);
    CHECK(o.logprobs == -1 && o.sp.top_logprobs == 0 && !o.stream && !o.echo && o.add_special_tokens == 1);
    CHECK(!o.max_tokens_given);

    json_t *keep = NULL;
    o = gen_ok(HTTP_API_COMPLETIONS,
               "{\"n\": 3, \"max_tokens\": 5, \"temperature\": 0.5, \"top_p\": 0.9, \"top_k\": 7, \"min_p\": 0.1,"
               " \"repetition_penalty\": 1.2, \"seed\": -3, \"stop\": [\"ab\", \"\\n\"], \"stop_token_ids\": [1, 299],"
               " \"ignore_eos\": true, \"logprobs\": 4, \"stream\": true,"
               " \"stream_options\": {\"include_usage\": true},"
               " \"return_token_ids\": true, \"include_stop_str_in_output\": true, \"skip_special_tokens\": false,"
               " \"frequency_penalty\": 0, \"user\": \"someone\", \"best_of\": 3}",
               &keep);
    CHECK(o.sp.n == 3 && o.sp.max_tokens == 5 && o.max_tokens_given && fabsf(o.sp.temperature - 0.5f) < 1e-7f);
    CHECK(fabsf(o.sp.top_p - 0.9f) < 1e-7f && o.sp.top_k == 7 && fabsf(o.sp.min_p - 0.1f) < 1e-7f);
    CHECK(fabsf(o.sp.repetition_penalty - 1.2f) < 1e-7f && o.sp.has_seed && o.sp.seed == (uint64_t)(int64_t)-3);
    CHECK(o.sp.n_stop == 2 && strcmp(o.sp.stop[0], "ab") == 0 && strcmp(o.sp.stop[1], "\n") == 0);
    CHECK(o.sp.n_stop_token_ids == 2 && o.sp.stop_token_ids[0] == 1 && o.sp.stop_token_ids[1] == 299);
    CHECK(o.sp.ignore_eos && o.logprobs == 4 && o.sp.top_logprobs == 4 && o.stream && o.include_usage);
    CHECK(o.return_token_ids && o.sp.include_stop_str && !o.sp.skip_special_tokens);
    json_decref(keep);
    o = gen_ok(HTTP_API_COMPLETIONS, "{\"stop\": \"END\", \"logprobs\": 0, \"temperature\": 0, \"max_tokens\": 4.0}",
               &keep);
    CHECK(o.sp.n_stop == 1 && strcmp(o.sp.stop[0], "END") == 0 && o.logprobs == 0 && o.sp.top_logprobs == 0);
    CHECK(o.sp.temperature == 0.0f && o.sp.max_tokens == 4);
    json_decref(keep);
    o = gen_ok(HTTP_API_COMPLETIONS, "{\"top_k\": -1, \"n\": null, \"stop\": null, \"echo\": true}", NULL);
    CHECK(o.sp.top_k == -1 && o.sp.n == 1 && o.sp.n_stop == 0 && o.echo);

    REFUSED(HTTP_API_COMPLETIONS, "{\"n\": 0}", "n", "[1, 1024]");
    REFUSED(HTTP_API_COMPLETIONS, "{\"n\": -2}", "n", "got -2");
    REFUSED(HTTP_API_COMPLETIONS, "{\"n\": \"2\"}", "n", "must be an integer");
    REFUSED(HTTP_API_COMPLETIONS, "{\"n\": 1.5}", "n", "must be an integer");
    REFUSED(HTTP_API_COMPLETIONS, "{\"max_tokens\": 99999999999999999999}", "max_tokens", "must be in [1, 2147483647]");
    REFUSED(HTTP_API_COMPLETIONS, "{\"seed\": -99999999999999999999}", "seed", "must be in");
    REFUSED(HTTP_API_COMPLETIONS, "{\"n\": true}", "n", "must be an integer");
    REFUSED(HTTP_API_COMPLETIONS, "{\"max_tokens\": 0}", "max_tokens", NULL);
    REFUSED(HTTP_API_COMPLETIONS, "{\"max_tokens\": -1}", "max_tokens", NULL);
    REFUSED(HTTP_API_COMPLETIONS, "{\"temperature\": -0.1}", "temperature", ">= 0");
    REFUSED(HTTP_API_COMPLETIONS, "{\"temperature\": \"hot\"}", "temperature", "must be a number");
    REFUSED(HTTP_API_COMPLETIONS, "{\"top_p\": 0}", "top_p", "(0, 1]");
    REFUSED(HTTP_API_COMPLETIONS, "{\"top_p\": 1.01}", "top_p", "(0, 1]");
    REFUSED(HTTP_API_COMPLETIONS, "{\"top_k\": -2}", "top_k", NULL);
    REFUSED(HTTP_API_COMPLETIONS, "{\"min_p\": 1.5}", "min_p", "[0, 1]");
    REFUSED(HTTP_API_COMPLETIONS, "{\"repetition_penalty\": 0}", "repetition_penalty", "> 0");
    // The engine's floats: beyond FLT_MAX would be inf, a positive value below the smallest float 0.
    REFUSED(HTTP_API_COMPLETIONS, "{\"temperature\": 1e39}", "temperature", "at most");
    REFUSED(HTTP_API_COMPLETIONS, "{\"repetition_penalty\": 1e39}", "repetition_penalty", "at most");
    REFUSED(HTTP_API_COMPLETIONS, "{\"repetition_penalty\": 1e-50}", "repetition_penalty", "> 0");
    REFUSED(HTTP_API_COMPLETIONS, "{\"top_p\": 1e-50}", "top_p", "(0, 1]");
    REFUSED(HTTP_API_COMPLETIONS, "{\"seed\": \"7\"}", "seed", "integer");
    REFUSED(HTTP_API_COMPLETIONS, "{\"stop\": 5}", "stop", "string or a list");
    REFUSED(HTTP_API_COMPLETIONS, "{\"stop\": [\"a\", 3]}", "stop", "[1]");
    REFUSED(HTTP_API_COMPLETIONS, "{\"stop\": \"\"}", "stop", "empty");
    REFUSED(HTTP_API_COMPLETIONS,
            "{\"stop\": [\"a\",\"b\",\"c\",\"d\",\"e\",\"f\",\"g\",\"h\",\"i\",\"j\",\"k\",\"l\",\"m\",\"n\",\"o\","
            "\"p\",\"q\"]}", "stop", "at most 16");
    REFUSED(HTTP_API_COMPLETIONS, "{\"stop_token_ids\": [1, 300]}", "stop_token_ids", "vocabulary size 300");
    REFUSED(HTTP_API_COMPLETIONS, "{\"stop_token_ids\": [-1]}", "stop_token_ids", NULL);
    REFUSED(HTTP_API_COMPLETIONS, "{\"stop_token_ids\": 5}", "stop_token_ids", "list of token ids");
    REFUSED(HTTP_API_COMPLETIONS, "{\"ignore_eos\": \"yes\"}", "ignore_eos", "boolean");
    REFUSED(HTTP_API_COMPLETIONS, "{\"logprobs\": 21}", "logprobs", "[0, 20]");
    REFUSED(HTTP_API_COMPLETIONS, "{\"logprobs\": true}", "logprobs", "integer");
    REFUSED(HTTP_API_COMPLETIONS, "{\"stream\": 1}", "stream", "boolean");
    REFUSED(HTTP_API_COMPLETIONS, "{\"stream_options\": {\"include_usage\": true}}", "stream_options", "stream=true");
    // Prompt scoring: echo with logprobs scores the prompt with as many alternatives; not while streaming.
    o = gen_ok(HTTP_API_COMPLETIONS, "{\"echo\": true, \"logprobs\": 3}", NULL);
    CHECK(o.echo && o.logprobs == 3 && o.sp.prompt_logprobs == 3 && o.prompt_logprobs == -1);
    o = gen_ok(HTTP_API_COMPLETIONS, "{\"prompt_logprobs\": 5, \"echo\": true, \"logprobs\": 2}", NULL);
    CHECK(o.sp.prompt_logprobs == 5 && o.prompt_logprobs == 5 && o.logprobs == 2);
    o = gen_ok(HTTP_API_COMPLETIONS, "{\"prompt_logprobs\": 0}", NULL);
    CHECK(o.sp.prompt_logprobs == 0 && o.prompt_logprobs == 0 && !o.echo);
    REFUSED(HTTP_API_COMPLETIONS, "{\"echo\": true, \"logprobs\": 1, \"stream\": true}", "echo", "streaming");
    REFUSED(HTTP_API_COMPLETIONS, "{\"prompt_logprobs\": 21}", "prompt_logprobs", "");
    REFUSED(HTTP_API_CHAT, "{\"prompt_logprobs\": 1}", "prompt_logprobs", "/v1/completions only");
    REFUSED(HTTP_API_COMPLETIONS, "{\"frequency_penalty\": 0.5}", "frequency_penalty", "not supported");
    REFUSED(HTTP_API_COMPLETIONS, "{\"logit_bias\": {\"5\": 1}}", "logit_bias", "not supported");
    REFUSED(HTTP_API_COMPLETIONS, "{\"suffix\": \"x\"}", "suffix", "not supported");
    REFUSED(HTTP_API_COMPLETIONS, "{\"n\": 2, \"best_of\": 3}", "best_of", NULL);
    REFUSED(HTTP_API_COMPLETIONS, "{\"return_token_ids\": \"true\"}", "return_token_ids", "boolean");
    // vLLM fields that change the output and are not implemented: refused by name, passed when neutral.
    o = gen_ok(HTTP_API_COMPLETIONS, "{\"min_tokens\": 0, \"bad_words\": [], \"allowed_token_ids\": null, "
               "\"structured_outputs\": null, \"prompt_logprobs\": null, \"truncate_prompt_tokens\": null, "
               "\"return_tokens_as_token_ids\": true}", NULL);
    CHECK(o.return_tokens_as_token_ids == 1);
    // vLLM's token masks: read into SamplingParams (bad_words as the request's strings until encoded).
    keep = NULL;
    o = gen_ok(HTTP_API_COMPLETIONS, "{\"min_tokens\": 3, \"max_tokens\": 5, \"allowed_token_ids\": [1, 299, 1], "
               "\"bad_words\": [\" x\", \"yz\"]}", &keep);
    CHECK(o.sp.min_tokens == 3 && o.sp.n_allowed == 3 && o.sp.allowed_token_ids[1] == 299 &&
          json_array_size(o.bad_words) == 2 && o.sp.n_bad_words == 0);
    http_gen_options_free(&o);
    json_decref(keep);
    o = gen_ok(HTTP_API_CHAT, "{\"min_tokens\": 100}", NULL); // chat's max_tokens comes later (the context left)
    CHECK(o.sp.min_tokens == 100);
    REFUSED(HTTP_API_COMPLETIONS, "{\"min_tokens\": 17}", "min_tokens", "max_tokens (16)");
    REFUSED(HTTP_API_CHAT, "{\"min_tokens\": 4, \"max_completion_tokens\": 3}", "min_tokens", "max_tokens (3)");
    REFUSED(HTTP_API_COMPLETIONS, "{\"min_tokens\": -1}", "min_tokens", NULL);
    REFUSED(HTTP_API_COMPLETIONS, "{\"min_tokens\": \"3\"}", "min_tokens", NULL);
    REFUSED(HTTP_API_COMPLETIONS, "{\"allowed_token_ids\": [1, 300]}", "allowed_token_ids", "vocabulary size 300");
    REFUSED(HTTP_API_COMPLETIONS, "{\"allowed_token_ids\": []}", "allowed_token_ids", "at least one");
    REFUSED(HTTP_API_COMPLETIONS, "{\"allowed_token_ids\": [\"a\"]}", "allowed_token_ids", "integer");
    REFUSED(HTTP_API_COMPLETIONS, "{\"bad_words\": \"x\"}", "bad_words", "list of strings");
    REFUSED(HTTP_API_COMPLETIONS, "{\"bad_words\": [\"x\", 3]}", "bad_words", "string");
    REFUSED(HTTP_API_COMPLETIONS, "{\"bad_words\": [\" \\t\"]}", "bad_words", "not only whitespace");
    // Structured outputs: a regex, a choice made into one (escaped), or refused by name.
    HttpGenOptions so = gen_ok(HTTP_API_COMPLETIONS, "{\"structured_outputs\": {\"regex\": \"a+\"}}", NULL);
    CHECK(so.sp.structured_regex && so.sp.structured_regex_len == 2 && !memcmp(so.sp.structured_regex, "a+", 2));
    http_gen_options_free(&so);
    so = gen_ok(HTTP_API_COMPLETIONS, "{\"guided_choice\": [\"a.\", \"b\"]}", NULL);
    CHECK(so.sp.structured_regex && !strcmp(so.sp.structured_regex, "a\\.|b"), "choice regex '%s'",
          so.sp.structured_regex ? so.sp.structured_regex : "(null)");
    http_gen_options_free(&so);
    REFUSED(HTTP_API_COMPLETIONS, "{\"structured_outputs\": {\"json\": {}}}", "structured_outputs", "needs 'type'");
    REFUSED(HTTP_API_COMPLETIONS, "{\"structured_outputs\": {\"grammar\": \"a\"}}", "structured_outputs",
            "not supported");
    REFUSED(HTTP_API_COMPLETIONS, "{\"structured_outputs\": {\"regex\": \"a\", \"choice\": [\"b\"]}}",
            "structured_outputs", "one of regex, choice and json");
    REFUSED(HTTP_API_COMPLETIONS, "{\"guided_regex\": \"a\", \"guided_choice\": [\"b\"]}", "guided_choice",
            "cannot be given");
    REFUSED(HTTP_API_COMPLETIONS, "{\"guided_choice\": [\"a\", 3]}", "guided_choice", "non-empty string");
    REFUSED(HTTP_API_COMPLETIONS, "{\"guided_regex\": \"a\", \"allowed_token_ids\": [1]}", "guided_regex",
            "allowed_token_ids");
    REFUSED(HTTP_API_COMPLETIONS, "{\"truncate_prompt_tokens\": 0}", "truncate_prompt_tokens", "not supported");
    REFUSED(HTTP_API_COMPLETIONS, "{\"truncate_prompt_tokens\": 8}", "truncate_prompt_tokens", "not supported");
    REFUSED(HTTP_API_COMPLETIONS, "{\"response_format\": {\"type\": \"json_object\"}}", "response_format", NULL);
    REFUSED(HTTP_API_COMPLETIONS, "{\"return_tokens_as_token_ids\": 1}", "return_tokens_as_token_ids", "boolean");
}

static void test_chat_fields(void) {
    HttpGenOptions o = gen_ok(HTTP_API_CHAT, "{\"messages\": []}", NULL);
    CHECK(o.logprobs == -1 && o.add_generation_prompt == 1 && o.add_special_tokens == 0 && !o.max_tokens_given);
    o = gen_ok(HTTP_API_CHAT, "{\"logprobs\": true, \"top_logprobs\": 3, \"max_completion_tokens\": 9}", NULL);
    CHECK(o.logprobs == 3 && o.sp.top_logprobs == 3 && o.sp.max_tokens == 9 && o.max_tokens_given);
    o = gen_ok(HTTP_API_CHAT, "{\"logprobs\": true, \"add_generation_prompt\": false}", NULL);
    CHECK(o.logprobs == 0 && o.sp.top_logprobs == 0 && o.add_generation_prompt == 0);
    o = gen_ok(HTTP_API_CHAT, "{\"logprobs\": false, \"response_format\": {\"type\": \"text\"}}", NULL);
    CHECK(o.logprobs == -1);
    REFUSED(HTTP_API_CHAT, "{\"top_logprobs\": 2}", "top_logprobs", "logprobs");
    REFUSED(HTTP_API_CHAT, "{\"logprobs\": 2}", "logprobs", "boolean");
    REFUSED(HTTP_API_CHAT, "{\"logprobs\": true, \"top_logprobs\": 40}", "top_logprobs", NULL);
    REFUSED(HTTP_API_CHAT, "{\"max_completion_tokens\": 0}", "max_completion_tokens", NULL);
    REFUSED(HTTP_API_CHAT, "{\"response_format\": {\"type\": \"json_object\"}}", "response_format", NULL);
    REFUSED(HTTP_API_CHAT, "{\"tools\": [{\"type\": \"function\"}]}", "tools", "must be {");
    REFUSED(HTTP_API_CHAT, "{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}], "
            "\"tool_choice\": \"required\"}", "tool_choice", "\"auto\" or \"none\"");
    REFUSED(HTTP_API_COMPLETIONS, "{\"tools\": []}", "tools", "chat/completions only");
    HttpGenOptions tl = gen_ok(HTTP_API_CHAT, "{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": "
                               "\"f\", \"parameters\": {}}}], \"tool_choice\": \"none\"}", NULL);
    CHECK(tl.tools == 1 && tl.tool_choice_none == 1);
    http_gen_options_free(&tl);
    REFUSED(HTTP_API_CHAT, "{\"continue_final_message\": true}", "continue_final_message", NULL);
}

static void test_trl_fields(void) {
    // TRL's client sends every field, with None for the unused ones.
    json_t *keep = NULL;
    HttpGenOptions o = gen_ok(HTTP_API_TRL,
                              "{\"prompts\": [\"a\"], \"images\": null, \"n\": 4, \"repetition_penalty\": 1.0,"
                              " \"temperature\": 0.9, \"top_p\": 1.0, \"top_k\": 0, \"min_p\": 0.0, \"max_tokens\": 8,"
                              " \"logprobs\": 0, \"structured_outputs_regex\": null, \"generation_kwargs\": {}}",
                              &keep);
    CHECK(o.sp.n == 4 && o.sp.max_tokens == 8 && o.sp.top_k == 0 && o.logprobs == 0 && o.sp.top_logprobs == 0);
    json_decref(keep);
    o = gen_ok(HTTP_API_TRL, "{\"prompts\": [\"a\"]}", NULL);
    CHECK(o.sp.top_k == -1 && o.logprobs == 0 && o.sp.max_tokens == 16 && o.sp.n == 1);
    o = gen_ok(HTTP_API_TRL, "{\"prompts\": [\"a\"], \"logprobs\": null}", NULL);
    CHECK(o.logprobs == -1);
    o = gen_ok(HTTP_API_TRL, "{\"logprobs\": 2, \"images\": [null, null], \"generation_kwargs\": {\"seed\": 11,"
               " \"temperature\": 0.0, \"stop\": [\"x\"], \"max_tokens\": 3}}", &keep);
    CHECK(o.logprobs == 2 && o.sp.top_logprobs == 2 && o.sp.has_seed && o.sp.seed == 11 && o.sp.temperature == 0.0f);
    CHECK(o.sp.n_stop == 1 && strcmp(o.sp.stop[0], "x") == 0 && o.sp.max_tokens == 3);
    json_decref(keep);
    REFUSED(HTTP_API_TRL, "{\"generation_kwargs\": {\"frequency_penalty\": 1}}", "generation_kwargs.frequency_penalty",
            "not supported");
    REFUSED(HTTP_API_TRL, "{\"generation_kwargs\": {\"temperature\": -1}}", "generation_kwargs.temperature", ">= 0");
    REFUSED(HTTP_API_TRL, "{\"generation_kwargs\": [1]}", "generation_kwargs", "object");
    REFUSED(HTTP_API_TRL, "{\"images\": [[\"aGk=\"]]}", "images", "not supported");
    HttpGenOptions trl_so = gen_ok(HTTP_API_TRL, "{\"structured_outputs_regex\": \"a+\"}", NULL);
    CHECK(trl_so.sp.structured_regex && trl_so.sp.structured_regex_len == 2);
    http_gen_options_free(&trl_so);
    REFUSED(HTTP_API_TRL, "{\"structured_outputs_regex\": 3}", "structured_outputs_regex", "non-empty string");
    REFUSED(HTTP_API_TRL, "{\"logprobs\": -1}", "logprobs", NULL);
    REFUSED(HTTP_API_TRL, "{\"n\": 0}", "n", NULL);
}

static void test_prompts(void) {
    HttpPromptList l;
    HttpError e = {0};
    json_t *j = json_loads("\"hello\"", JSON_DECODE_ANY, NULL);
    CHECK(http_parse_prompts(j, "prompt", VOCAB, 1, &l, &e) == 0 && l.n == 1 && !l.is_ids && l.items[0].text_len == 5);
    http_prompts_free(&l);
    CHECK(http_parse_prompts(j, "prompts", VOCAB, 0, &l, &e) < 0 && e.status == 400 && strcmp(e.param, "prompts") == 0);
    json_decref(j);
    j = json_loads("[\"a\", \"bc\"]", 0, NULL);
    CHECK(http_parse_prompts(j, "prompt", VOCAB, 1, &l, &e) == 0 && l.n == 2 && l.items[1].text_len == 2);
    http_prompts_free(&l);
    json_decref(j);
    j = json_loads("[5, 6, 7]", 0, NULL);
    CHECK(http_parse_prompts(j, "prompt", VOCAB, 1, &l, &e) == 0 && l.n == 1 && l.is_ids && l.items[0].n_ids == 3 &&
          l.items[0].ids[2] == 7);
    http_prompts_free(&l);
    json_decref(j);
    j = json_loads("[[1], [2, 3]]", 0, NULL);
    CHECK(http_parse_prompts(j, "prompts", VOCAB, 0, &l, &e) == 0 && l.n == 2 && l.is_ids && l.items[1].n_ids == 2);
    http_prompts_free(&l);
    json_decref(j);
    static const char *const bad[] = {"[]", "\"\"", "[[]]", "[[1], \"a\"]", "[\"a\", [1]]", "[1, \"a\"]", "[[300]]",
                                      "[-1]", "5", "{\"a\": 1}", "[\"a\", \"\"]", "[true]"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        j = json_loads(bad[i], JSON_DECODE_ANY, NULL);
        memset(&e, 0, sizeof e);
        int rc = http_parse_prompts(j, "prompt", VOCAB, 1, &l, &e);
        if (!(rc < 0 && e.status == 400 && strcmp(e.param, "prompt") == 0)) {
            fprintf(stderr, "prompt %s: rc %d status %d param '%s'\n", bad[i], rc, e.status, e.param);
            failures++;
        }
        json_decref(j);
    }
    CHECK(http_parse_prompts(NULL, "prompt", VOCAB, 1, &l, &e) < 0 && strstr(e.message, "required"));
}

// Token text for the tests: id 7 is "é" (2 bytes, 1 code point), others "t<id>".
static char *fake_text(void *user, int32_t id, size_t *len) {
    char *s = malloc(16);
    if (id == 7) strcpy(s, "\xc3\xa9");
    else snprintf(s, 16, "t%d", id);
    *len = strlen(s);
    return s;
}

static HttpChoice two_event_choice(void) {
    HttpChoice c;
    http_choice_init(&c, 2);
    int32_t t1[2] = {7, 9};
    float l1[2] = {-0.5f, -1.0f};
    TokenLogprob top1[4] = {{7, -0.5f}, {3, -1.5f}, {4, -0.2f}, {5, -0.9f}}; // token 9 not among its alternatives
    EngineEvent ev = {.index = 0, .n_tokens = 2, .tokens = t1, .logprobs = l1, .top = top1, .text = "\xc3\xa9t9",
                      .text_len = 4, .finish = FINISH_NONE, .stop_token = -1, .policy_version = 3};
    CHECK(http_choice_append(&c, &ev) == 0);
    int32_t t2[1] = {2};
    float l2[1] = {-2.0f};
    TokenLogprob top2[2] = {{1, -0.1f}, {2, -2.0f}};
    EngineEvent fin = {.index = 0, .n_tokens = 1, .tokens = t2, .logprobs = l2, .top = top2, .text = "", .text_len = 0,
                       .finish = FINISH_STOP, .stop_reason = NULL, .stop_token = 2, .policy_version = 4};
    CHECK(http_choice_append(&c, &fin) == 0);
    return c;
}

// A weight update in mode abort started the completion over: what the choice held is dropped.
static void test_choice_restart(void) {
    HttpChoice c = two_event_choice();
    int32_t t[2] = {5, 6};
    float l[2] = {-0.25f, -0.75f};
    TokenLogprob top[4] = {{5, -0.25f}, {1, -2.0f}, {6, -0.75f}, {1, -1.0f}};
    EngineEvent ev = {.index = 0, .n_tokens = 2, .tokens = t, .logprobs = l, .top = top, .text = "ab", .text_len = 2,
                      .finish = FINISH_LENGTH, .stop_token = -1, .policy_version = 9, .restarted = 1};
    CHECK(http_choice_append(&c, &ev) == 0);
    CHECK(c.n_tokens == 2 && c.tokens[0] == 5 && c.tokens[1] == 6 && c.logprobs[1] == -0.75f && c.versions[0] == 9 &&
              c.versions[1] == 9 && c.text_len == 2 && strcmp(c.text, "ab") == 0 && c.finish == FINISH_LENGTH &&
              c.top[2].id == 6,
          "a restarted event replaces the choice: %d tokens, text '%s'", c.n_tokens, c.text);
    http_choice_free(&c);
}

static void test_choice_and_logprobs(void) {
    HttpChoice c = two_event_choice();
    CHECK(c.n_tokens == 3 && c.tokens[2] == 2 && c.text_len == 4 && strcmp(c.text, "\xc3\xa9t9") == 0);
    CHECK(c.finish == FINISH_STOP && c.stop_token == 2 && !c.stop_str);
    CHECK(c.versions && c.versions[0] == 3 && c.versions[1] == 3 && c.versions[2] == 4, "each token's version");
    HttpTokenText tt = {fake_text, NULL};
    size_t off = 0;
    json_t *lp = http_completion_logprobs(&c, 0, 3, &tt, &off);
    json_t *toks = json_object_get(lp, "tokens"), *tl = json_object_get(lp, "token_logprobs");
    json_t *top = json_object_get(lp, "top_logprobs"), *to = json_object_get(lp, "text_offset");
    CHECK(json_array_size(toks) == 3 && strcmp(json_string_value(json_array_get(toks, 1)), "t9") == 0);
    CHECK(fabs(json_real_value(json_array_get(tl, 1)) + 1.0) < 1e-6);
    // Offsets count code points: "é" is one.
    CHECK(json_integer_value(json_array_get(to, 0)) == 0 && json_integer_value(json_array_get(to, 1)) == 1 &&
          json_integer_value(json_array_get(to, 2)) == 3 && off == 5);
    // Token 1: its 2 alternatives plus the sampled token 9, which was not among them.
    json_t *d1 = json_array_get(top, 1);
    CHECK(json_object_size(d1) == 3 && json_object_get(d1, "t9") && json_object_get(d1, "t4"));
    // Token 0: the sampled token is among the alternatives, so 2 entries.
    CHECK(json_object_size(json_array_get(top, 0)) == 2);
    json_decref(lp);
    // A stream chunk continues the offsets.
    off = 5;
    lp = http_completion_logprobs(&c, 2, 1, &tt, &off);
    CHECK(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 0)) == 5 && off == 7);
    json_decref(lp);

    json_t *cl = http_chat_logprobs(&c, 0, 2, &tt);
    json_t *content = json_object_get(cl, "content");
    CHECK(json_array_size(content) == 2);
    json_t *e0 = json_array_get(content, 0);
    CHECK(strcmp(json_string_value(json_object_get(e0, "token")), "\xc3\xa9") == 0);
    json_t *bytes = json_object_get(e0, "bytes");
    CHECK(json_array_size(bytes) == 2 && json_integer_value(json_array_get(bytes, 0)) == 0xc3);
    CHECK(json_array_size(json_object_get(e0, "top_logprobs")) == 2); // OpenAI chat: exactly the alternatives
    json_decref(cl);

    SamplingParams sp;
    sampling_params_default(&sp);
    json_t *sr = http_stop_reason_json(&c, &sp);
    CHECK(json_is_null(sr)); // stopped by eos (not one of the request's stop ids)
    json_decref(sr);
    sp.stop_token_ids[0] = 2;
    sp.n_stop_token_ids = 1;
    sr = http_stop_reason_json(&c, &sp);
    CHECK(json_integer_value(sr) == 2);
    json_decref(sr);
    json_t *fr = http_finish_json(c.finish);
    CHECK(strcmp(json_string_value(fr), "stop") == 0);
    json_decref(fr);
    fr = http_finish_json(FINISH_LENGTH);
    CHECK(strcmp(json_string_value(fr), "length") == 0);
    json_decref(fr);
    fr = http_finish_json(FINISH_NONE);
    CHECK(json_is_null(fr));
    json_decref(fr);
    http_choice_free(&c);

    TokenLogprob alts[3] = {{4, -0.2f}, {7, -0.5f}, {3, -1.5f}}, out[4];
    CHECK(http_merge_top(alts, 3, 7, -0.5f, out) == 3 && out[1].id == 7);
    CHECK(http_merge_top(alts, 3, 9, -1.0f, out) == 4 && out[0].id == 4 && out[1].id == 7 && out[2].id == 9 &&
          out[3].id == 3);
    CHECK(http_merge_top(alts, 0, 9, -1.0f, out) == 1 && out[0].id == 9);
}

static void test_trl_response(void) {
    // 2 prompts x n = 2: completion_ids flattened prompt-major, logprobs per token.
    HttpChoice ch[4];
    for (int k = 0; k < 4; k++) {
        http_choice_init(&ch[k], 2);
        int32_t toks[2] = {10 + k, 20 + k};
        float lps[2] = {-0.25f * (k + 1), -0.5f};
        TokenLogprob top[4] = {{10 + k, lps[0]}, {99, -3.0f}, {98, -0.01f}, {97, -0.3f}};
        EngineEvent ev = {.index = k % 2, .n_tokens = 1 + (k % 2), .tokens = toks, .logprobs = lps, .top = top,
                          .text = "", .finish = FINISH_LENGTH, .stop_token = -1, .policy_version = 5 + k};
        CHECK(http_choice_append(&ch[k], &ev) == 0);
    }
    int32_t p0[2] = {1, 2}, p1[1] = {3};
    const int32_t *pids[2] = {p0, p1};
    int plens[2] = {2, 1};
    json_t *r = http_trl_response(pids, plens, 2, 2, ch, 0, 0);
    json_t *pi = json_object_get(r, "prompt_ids"), *ci = json_object_get(r, "completion_ids");
    CHECK(json_array_size(pi) == 2 && json_array_size(json_array_get(pi, 0)) == 2);
    CHECK(json_integer_value(json_array_get(json_array_get(pi, 1), 0)) == 3);
    CHECK(json_array_size(ci) == 4 && json_array_size(json_array_get(ci, 1)) == 2 &&
          json_integer_value(json_array_get(json_array_get(ci, 2), 0)) == 12);
    json_t *lp = json_object_get(r, "logprobs"), *li = json_object_get(r, "logprob_token_ids");
    CHECK(json_array_size(lp) == 4 && json_array_size(json_array_get(lp, 1)) == 2);
    json_t *tok0 = json_array_get(json_array_get(lp, 2), 0);
    CHECK(json_array_size(tok0) == 1 && fabs(json_real_value(json_array_get(tok0, 0)) + 0.75) < 1e-6);
    CHECK(json_integer_value(json_array_get(json_array_get(json_array_get(li, 2), 0), 0)) == 12);
    CHECK(json_object_size(r) == 4 && !json_object_get(r, "policy_versions"), "TRL's answer, no more keys");
    json_decref(r);
    // return_policy_versions: each token's version, shaped as completion_ids.
    r = http_trl_response(pids, plens, 2, 2, ch, 0, 1);
    json_t *pv = json_object_get(r, "policy_versions");
    CHECK(json_array_size(pv) == 4 && json_array_size(json_array_get(pv, 1)) == 2 &&
              json_integer_value(json_array_get(json_array_get(pv, 1), 1)) == 6 &&
              json_integer_value(json_array_get(json_array_get(pv, 2), 0)) == 7,
          "policy_versions");
    json_decref(r);
    // logprobs = 2: the 2 best alternatives plus the sampled token when it is not among them, best first
    // (completion 1, token 1: alternatives 98 (-0.01), 97 (-0.3), sampled 21 (-0.5)).
    r = http_trl_response(pids, plens, 2, 2, ch, 2, 0);
    json_t *t = json_array_get(json_array_get(json_object_get(r, "logprob_token_ids"), 1), 1);
    json_t *v = json_array_get(json_array_get(json_object_get(r, "logprobs"), 1), 1);
    CHECK(json_array_size(t) == 3 && json_integer_value(json_array_get(t, 0)) == 98 &&
          json_integer_value(json_array_get(t, 1)) == 97 && json_integer_value(json_array_get(t, 2)) == 21);
    CHECK(json_real_value(json_array_get(v, 0)) >= json_real_value(json_array_get(v, 1)) &&
          json_real_value(json_array_get(v, 1)) >= json_real_value(json_array_get(v, 2)));
    json_decref(r);
    r = http_trl_response(pids, plens, 2, 2, ch, -1, 0);
    CHECK(json_is_null(json_object_get(r, "logprobs")) && json_is_null(json_object_get(r, "logprob_token_ids")));
    CHECK(json_array_size(json_object_get(r, "completion_ids")) == 4);
    json_decref(r);
    for (int k = 0; k < 4; k++) http_choice_free(&ch[k]);
}

static void test_sse_usage_envelope(void) {
    json_t *o = json_object();
    json_object_set_new(o, "a", json_integer(1));
    size_t n = 0;
    char *s = http_sse_format(o, &n);
    CHECK(s && strcmp(s, "data: {\"a\":1}\n\n") == 0 && n == strlen(s));
    free(s);
    json_decref(o);
    CHECK(strcmp(HTTP_SSE_DONE, "data: [DONE]\n\n") == 0);
    json_t *u = http_usage_json(5, 7, 2);
    CHECK(json_integer_value(json_object_get(u, "total_tokens")) == 12);
    CHECK(json_integer_value(json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens")) == 2);
    json_decref(u);
    char id1[64], id2[64];
    http_make_id(id1, sizeof id1, "cmpl");
    http_make_id(id2, sizeof id2, "cmpl");
    CHECK(strncmp(id1, "cmpl-", 5) == 0 && strlen(id1) == 37 && strcmp(id1, id2) != 0);
    json_t *env = http_envelope(id1, "text_completion", 42, "m", json_array());
    CHECK(json_integer_value(json_object_get(env, "created")) == 42 && json_is_array(json_object_get(env, "choices")));
    json_decref(env);
}

static void test_metrics(void) {
    HttpMetrics m;
    http_metrics_init(&m);
    http_metrics_count(&m, HTTP_ROUTE_COMPLETIONS, 200);
    http_metrics_count(&m, HTTP_ROUTE_COMPLETIONS, 200);
    http_metrics_count(&m, HTTP_ROUTE_COMPLETIONS, 429);
    http_metrics_count(&m, HTTP_ROUTE_OTHER, 404);
    http_metrics_count(&m, HTTP_ROUTE_CHAT, 418);
    CHECK(http_metrics_get(&m, HTTP_ROUTE_COMPLETIONS, 200) == 2 &&
          http_metrics_get(&m, HTTP_ROUTE_COMPLETIONS, 429) == 1);
    EngineStats s;
    memset(&s, 0, sizeof s);
    s.requests_waiting = 3;
    s.kv_blocks_total = 100;
    s.kv_blocks_used = 40;
    s.steps_total = 9;
    s.step_seconds_sum = 0.125;
    for (int i = 0; i < 12; i++) s.step_seconds_buckets[i] = i < 3 ? 2 * i : 9; // cumulative
    s.policy_version = 4;
    s.weight_updates_total = 2;
    s.weight_update_sequences_kept_total = 17;
    s.weight_update_sequences_requeued_total = 3;
    s.weight_update_pause_seconds_sum = 0.75;
    for (int i = 0; i < 11; i++) s.weight_update_pause_buckets[i] = i < 4 ? 0 : i < 6 ? 1 : 2; // cumulative
    size_t len = 0;
    // Two engines (--devices): their own series, labelled by index and device.
    EngineMemberStats per[2];
    memset(per, 0, sizeof per);
    per[0].stats.generation_tokens_total = 7;
    per[1].stats.generation_tokens_total = 5;
    per[1].requests_routed = 3;
    per[1].outstanding = 2;
    per[0].stats.policy_version = per[1].stats.policy_version = 4;
    const char *devices[2] = {"cuda:0", "cuda:1"};
    char *t = http_metrics_render(&m, &s, per, devices, 2, "tiny\"m", &len);
    CHECK(t && len == strlen(t));
    CHECK(strstr(t, "# TYPE tandem_engine_requests_routed_total counter\n"));
    CHECK(strstr(t, "tandem_engine_requests_routed_total{model_name=\"tiny\\\"m\",engine=\"1\",device=\"cuda:1\"} 3\n"));
    CHECK(strstr(t, "tandem_engine_outstanding_sequences{model_name=\"tiny\\\"m\",engine=\"1\",device=\"cuda:1\"} 2\n"));
    CHECK(strstr(t, "tandem_engine_generation_tokens_total{model_name=\"tiny\\\"m\",engine=\"0\",device=\"cuda:0\"} 7\n"));
    CHECK(strstr(t, "tandem_engine_policy_version{model_name=\"tiny\\\"m\",engine=\"0\",device=\"cuda:0\"} 4\n"));
    CHECK(strstr(t, "tandem_http_requests_total{route=\"/v1/completions\",status=\"200\"} 2\n"));
    CHECK(strstr(t, "tandem_http_requests_total{route=\"/v1/completions\",status=\"429\"} 1\n"));
    CHECK(strstr(t, "tandem_http_requests_total{route=\"other\",status=\"404\"} 1\n"));
    CHECK(strstr(t, "tandem_http_requests_total{route=\"/v1/chat/completions\",status=\"other\"} 1\n"));
    CHECK(strstr(t, "tandem_requests_waiting{model_name=\"tiny\\\"m\"} 3\n"));
    CHECK(strstr(t, "tandem_kv_blocks_free{model_name=\"tiny\\\"m\"} 60\n"));
    CHECK(strstr(t, "tandem_policy_version{model_name=\"tiny\\\"m\"} 4\n"));
    CHECK(strstr(t, "# TYPE tandem_engine_step_seconds histogram\n"));
    CHECK(strstr(t, "tandem_engine_step_seconds_bucket{model_name=\"tiny\\\"m\",le=\"0.001\"} 0\n"));
    CHECK(strstr(t, "tandem_engine_step_seconds_bucket{model_name=\"tiny\\\"m\",le=\"0.005\"} 4\n"));
    CHECK(strstr(t, "tandem_engine_step_seconds_bucket{model_name=\"tiny\\\"m\",le=\"+Inf\"} 9\n"));
    CHECK(strstr(t, "tandem_engine_step_seconds_count{model_name=\"tiny\\\"m\"} 9\n"));
    CHECK(strstr(t, "tandem_engine_step_seconds_sum{model_name=\"tiny\\\"m\"} 0.125\n"));
    CHECK(strstr(t, "tandem_weight_updates_total{model_name=\"tiny\\\"m\"} 2\n"));
    CHECK(strstr(t, "# TYPE tandem_weight_update_sequences_kept_total counter\n"));
    CHECK(strstr(t, "tandem_weight_update_sequences_kept_total{model_name=\"tiny\\\"m\"} 17\n"));
    CHECK(strstr(t, "tandem_weight_update_sequences_requeued_total{model_name=\"tiny\\\"m\"} 3\n"));
    CHECK(strstr(t, "# TYPE tandem_weight_update_pause_seconds histogram\n"));
    CHECK(strstr(t, "tandem_weight_update_pause_seconds_bucket{model_name=\"tiny\\\"m\",le=\"0.05\"} 0\n"));
    CHECK(strstr(t, "tandem_weight_update_pause_seconds_bucket{model_name=\"tiny\\\"m\",le=\"0.1\"} 1\n"));
    CHECK(strstr(t, "tandem_weight_update_pause_seconds_bucket{model_name=\"tiny\\\"m\",le=\"60\"} 2\n"));
    CHECK(strstr(t, "tandem_weight_update_pause_seconds_bucket{model_name=\"tiny\\\"m\",le=\"+Inf\"} 2\n"));
    CHECK(strstr(t, "tandem_weight_update_pause_seconds_sum{model_name=\"tiny\\\"m\"} 0.75\n"));
    CHECK(strstr(t, "tandem_weight_update_pause_seconds_count{model_name=\"tiny\\\"m\"} 2\n"));
    // Every non-comment line is "name{labels} value".
    int lines = 0, bad = 0;
    for (char *p = t; *p;) {
        char *nl = strchr(p, '\n');
        if (!nl) {
            bad++;
            break;
        }
        if (*p != '#') {
            lines++;
            char *brace = memchr(p, '{', (size_t)(nl - p)), *close = memchr(p, '}', (size_t)(nl - p));
            if (!brace || !close || close[1] != ' ' || close + 2 >= nl) bad++;
        }
        p = nl + 1;
    }
    CHECK(lines > 20 && bad == 0);
    free(t);
}

int main(void) {
    test_body_parse();
    test_error_json();
    test_completion_fields();
    test_chat_fields();
    test_trl_fields();
    test_prompts();
    test_choice_and_logprobs();
    test_choice_restart();
    test_trl_response();
    test_sse_usage_envelope();
    test_metrics();
    if (failures) {
        fprintf(stderr, "test_rollout_http_json: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_rollout_http_json: all checks passed\n");
    return 0;
}
