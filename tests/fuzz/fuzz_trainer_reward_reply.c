// tests/fuzz/fuzz_trainer_reward_reply.c — libFuzzer target for a reward service's answers (trainer/reward_service.h):
// reward_service_take_response, what reward_service_score does with a status-200 body, on a sequence of answers
// to one service (the first accepted answer fixes the reward names; later ones must return the same).
//
// Input: byte 0 = the batch: n = 1 + (bits 0-2) completions, room for (bits 3-5) reward columns; the rest is up
// to MAX_ANSWERS bodies separated by the 4 bytes FF FF FF FF (bytes a JSON text never holds).
// Checks: a refusal comes with a message; an accepted answer gives 1..room functions with non-empty, distinct
// names, the same names as the first accepted answer, a score or NaN (JSON null) in each of its columns, and
// leaves the columns after them alone.
// Built by CMake when configured with CC=clang -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF.
#define _GNU_SOURCE   // memmem
#include <math.h>
#include <stdint.h>

#include "fuzz_testlib.h"
#include "trainer/reward_service.h"

#define MAX_ANSWERS 3
#define LD 8                  // columns per sample in the caller's matrix
#define UNTOUCHED (-INFINITY) // what the columns beyond the answer's must still hold (JSON has no infinity)

static const unsigned char SEP[4] = {0xff, 0xff, 0xff, 0xff};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const size_t n = 1 + (data[0] & 7), room = (data[0] >> 3) & 7;
    RewardServiceOptions o;
    reward_service_options_default(&o);
    o.url = "http://127.0.0.1:9/score";
    RewardService *rs = NULL;
    char err[1024] = "";
    REQUIRE(reward_service_create(&rs, &o, err, sizeof err) == 0);
    char **first = NULL;   // the names of the first accepted answer, in its order
    size_t n_first = 0;
    const uint8_t *p = data + 1, *end = data + size;
    for (int a = 0; a < MAX_ANSWERS && p <= end; a++) {
        const uint8_t *s = memmem(p, (size_t)(end - p), SEP, sizeof SEP);
        size_t len = (size_t)((s ? s : end) - p);
        // An exact-size heap copy, NUL-terminated as an HTTP response body is (http_client.h).
        char *body = malloc(len + 1);
        REQUIRE(body);
        memcpy(body, p, len);
        body[len] = '\0';
        double scores[8 * LD];
        for (size_t i = 0; i < n * LD; i++) scores[i] = UNTOUCHED;
        size_t k = 99;
        err[0] = '\0';
        int rc = reward_service_take_response(rs, body, len, n, scores, LD, room, &k, err, sizeof err);
        if (rc != 0) {
            REQUIRE(err[0] != '\0' && k == 0 && reward_service_count(rs) == n_first);
        } else {
            REQUIRE(k >= 1 && k <= room && k == reward_service_count(rs));
            if (!first) {
                REQUIRE(first = calloc(k, sizeof *first));
                n_first = k;
                for (size_t f = 0; f < k; f++) REQUIRE(first[f] = strdup(reward_service_name(rs, f)));
            }
            REQUIRE(k == n_first);
            for (size_t f = 0; f < k; f++) {
                const char *name = reward_service_name(rs, f);
                REQUIRE(name && name[0] && strcmp(name, first[f]) == 0);
                for (size_t g = 0; g < f; g++) REQUIRE(strcmp(name, reward_service_name(rs, g)) != 0);
            }
            for (size_t i = 0; i < n; i++)
                for (size_t c = 0; c < LD; c++) {
                    double v = scores[i * LD + c];
                    if (c < k) REQUIRE(isnan(v) || isfinite(v));
                    else REQUIRE(v == UNTOUCHED);
                }
        }
        free(body);
        if (!s) break;
        p = s + sizeof SEP;
    }
    for (size_t f = 0; f < n_first; f++) free(first[f]);
    free(first);
    reward_service_free(rs);
    return 0;
}
