// test_trainer_reward_service.c — reading a reward service's answer (reward_service_parse_response): every
// valid JSON number is a score (shared/json_read.h: an integer literal beyond int64 is its nearest double, a
// real beyond the double range is +-DBL_MAX; jansson alone called such an answer invalid JSON), null is no
// score, and a malformed answer is still an error that says what is wrong.
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_macros.h"
#include "trainer/reward_service.h"

static void free_answer(char **names, size_t n_funcs, double *scores) {
    for (size_t i = 0; i < n_funcs; i++) free(names[i]);
    free(names);
    free(scores);
}

static void test_every_json_number(void) {
    const char *body = "{\"scores\": [1, 100000000000000000000, -1e400, null, 0.25]}";
    char **names = NULL, err[512] = "";
    size_t n_funcs = 0;
    double *scores = NULL;
    int rc = reward_service_parse_response(body, strlen(body), 5, &names, &n_funcs, &scores, err, sizeof err);
    CHECK(rc == 0, "parse: %s", err);
    if (rc != 0) return;
    CHECK(n_funcs == 1 && strcmp(names[0], "reward_service") == 0, "one function named reward_service");
    CHECK(scores[0] == 1 && scores[1] == 1e20 && scores[2] == -DBL_MAX && isnan(scores[3]) && scores[4] == 0.25,
          "scores %g %g %g %g %g", scores[0], scores[1], scores[2], scores[3], scores[4]);
    free_answer(names, n_funcs, scores);
}

static void test_malformed_answers(void) {
    const struct {
        const char *body, *needle;
    } cases[] = {
        {"{\"scores\": [1, 2]", "not valid JSON"},
        {"{\"scores\": [1, \"2\", 3]}", "is not a number or null"},
        {"{\"scores\": [1, 2]}", "has 2 scores for 3 completions"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char **names = NULL, err[512] = "";
        size_t n_funcs = 0;
        double *scores = NULL;
        int rc = reward_service_parse_response(cases[i].body, strlen(cases[i].body), 3, &names, &n_funcs, &scores,
                                               err, sizeof err);
        CHECK(rc != 0 && strstr(err, cases[i].needle), "%s: rc %d, '%s'", cases[i].body, rc, err);
        if (rc == 0) free_answer(names, n_funcs, scores);
    }
}

int main(void) {
    test_every_json_number();
    test_malformed_answers();
    return check_exit_code("test_trainer_reward_service");
}
