// tests/reference/tools/trainer_reward_service_tool.c — calls an external reward service through
// trainer/reward_service.c for tests/reference/test_reward_service.py.
//   usage: trainer_reward_service_tool URL TIMEOUT_S CONNECT_TIMEOUT_S RETRIES BACKOFF_S REPEAT < samples.json
//   samples.json: [{"prompt": <string or messages>, "completion": "...", "columns": {...}}, ...]
//   stdout: one line per call (REPEAT calls on one RewardService, so the name checks across calls run):
//           {"names": [...], "scores": [[f0 of sample 0, f1 of sample 0, ...], ...]} with null for NaN.
//   A failing call prints its message on stderr and exits 1 (lines of earlier calls stay on stdout).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <jansson.h>

#include "trainer/reward_service.h"

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s URL TIMEOUT_S CONNECT_TIMEOUT_S RETRIES BACKOFF_S REPEAT < samples.json\n",
                argv[0]);
        return 2;
    }
    json_error_t je;
    json_t *in = json_loadf(stdin, 0, &je);
    if (!json_is_array(in)) {
        fprintf(stderr, "stdin: expected a JSON list of samples (%s)\n", je.text);
        return 2;
    }
    size_t n = json_array_size(in);
    RewardSample *s = calloc(n + 1, sizeof *s);
    for (size_t i = 0; i < n; i++) {
        json_t *o = json_array_get(in, i);
        s[i].prompt = json_object_get(o, "prompt");
        s[i].completion = json_string_value(json_object_get(o, "completion"));
        s[i].columns = json_object_get(o, "columns");
    }
    RewardServiceOptions opt;
    reward_service_options_default(&opt);
    opt.url = argv[1];
    opt.timeout_s = atof(argv[2]);
    opt.connect_timeout_s = atof(argv[3]);
    opt.max_retries = atoi(argv[4]);
    opt.backoff_s = atof(argv[5]);
    int repeat = atoi(argv[6]);
    char err[2048];
    RewardService *rs = NULL;
    if (reward_service_create(&rs, &opt, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    enum { MAX_FUNCS = 8 };
    double *scores = malloc((n * MAX_FUNCS + 1) * sizeof *scores);
    int rc = 0;
    for (int r = 0; r < repeat && rc == 0; r++) {
        size_t k = 0;
        if (reward_service_score(rs, s, n, scores, MAX_FUNCS, MAX_FUNCS, &k, err, sizeof err) != 0) {
            fprintf(stderr, "%s\n", err);
            rc = 1;
            break;
        }
        printf("{\"names\": [");
        for (size_t f = 0; f < k; f++) printf("%s\"%s\"", f ? ", " : "", reward_service_name(rs, f));
        printf("], \"scores\": [");
        for (size_t i = 0; i < n; i++) {
            printf("%s[", i ? ", " : "");
            for (size_t f = 0; f < k; f++) {
                double x = scores[i * MAX_FUNCS + f];
                if (isnan(x)) printf("%snull", f ? ", " : "");
                else printf("%s%.17g", f ? ", " : "", x);
            }
            printf("]");
        }
        printf("]}\n");
        fflush(stdout);
    }
    reward_service_free(rs);
    free(scores);
    free(s);
    json_decref(in);
    return rc;
}
