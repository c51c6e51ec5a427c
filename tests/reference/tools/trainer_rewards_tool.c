// tests/reference/tools/trainer_rewards_tool.c — scores completions with tandem's built-in rewards for the
// Python reference tests (tests/reference/test_rewards_vs_trl.py).
//   stdin:  {"rewards": ["think_format", ...],
//            "options": {"max_completion_length": 100, "soft_punish_cache": 20, "format_regex": "...",
//                        "format_regex_search": false, "answer_column": "answer",
//                        "length_penalty_coef": 1.0, "length_penalty_target": 0},
//            "samples": [{"completion": "...", "completion_tokens": 12, "columns": {...}}, ...]}
//   stdout: {"scores": [[r0 of sample 0, r1 of sample 0, ...], ...]} with null for NaN (no score),
//           numbers printed with 17 significant digits so doubles round-trip exactly.
// Exit status 1 with the message on stderr when the input or rewards_create is refused.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "trainer/rewards.h"

static int fail(const char *msg) {
    fprintf(stderr, "trainer_rewards_tool: %s\n", msg);
    return 1;
}

int main(void) {
    json_error_t je;
    json_t *in = json_loadf(stdin, 0, &je);
    if (!in) return fail(je.text);
    json_t *names_j = json_object_get(in, "rewards"), *opts = json_object_get(in, "options");
    json_t *samples_j = json_object_get(in, "samples");
    if (!json_is_array(names_j) || !json_is_array(samples_j)) return fail("need \"rewards\" and \"samples\" lists");

    RewardOptions o;
    reward_options_default(&o);
    json_t *v;
    if ((v = json_object_get(opts, "max_completion_length"))) o.max_completion_length = (int)json_integer_value(v);
    if ((v = json_object_get(opts, "soft_punish_cache"))) o.soft_punish_cache = (int)json_integer_value(v);
    if ((v = json_object_get(opts, "format_regex"))) o.format_regex = json_string_value(v);
    if ((v = json_object_get(opts, "format_regex_search"))) o.format_regex_search = json_is_true(v);
    if ((v = json_object_get(opts, "answer_column"))) o.answer_column = json_string_value(v);
    if ((v = json_object_get(opts, "length_penalty_coef"))) o.length_penalty_coef = json_number_value(v);
    if ((v = json_object_get(opts, "length_penalty_target"))) o.length_penalty_target = (int)json_integer_value(v);

    size_t nf = json_array_size(names_j), n = json_array_size(samples_j);
    const char **names = calloc(nf + 1, sizeof *names);
    RewardSample *s = calloc(n + 1, sizeof *s);
    double *scores = malloc((n * nf + 1) * sizeof *scores);
    if (!names || !s || !scores) return fail("out of memory");
    for (size_t f = 0; f < nf; f++) names[f] = json_string_value(json_array_get(names_j, f));
    for (size_t i = 0; i < n; i++) {
        json_t *sj = json_array_get(samples_j, i);
        s[i].completion = json_string_value(json_object_get(sj, "completion"));
        s[i].completion_tokens = (int)json_integer_value(json_object_get(sj, "completion_tokens"));
        s[i].columns = json_object_get(sj, "columns");
        if (!s[i].completion) return fail("a sample has no \"completion\" string");
    }
    char err[1024];
    Rewards *r = NULL;
    if (rewards_create(&r, names, nf, &o, err, sizeof err) != 0) return fail(err);
    if (rewards_score(r, s, n, scores, nf, err, sizeof err) != 0) return fail(err);

    fputs("{\"scores\": [", stdout);
    for (size_t i = 0; i < n; i++) {
        fputs(i ? ", [" : "[", stdout);
        for (size_t f = 0; f < nf; f++) {
            double x = scores[i * nf + f];
            if (isnan(x)) printf("%snull", f ? ", " : "");
            else printf("%s%.17g", f ? ", " : "", x);
        }
        fputs("]", stdout);
    }
    fputs("]}\n", stdout);
    rewards_free(r);
    free(names);
    free(s);
    free(scores);
    json_decref(in);
    return 0;
}
