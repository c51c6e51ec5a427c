// trainer/reward_service.h — an external reward service (--reward-url), for rewards written in any language.
//
// Request: POST <url> with Content-Type application/json and a JSON array, one object per completion:
//     [{"prompt": <the dataset's prompt: a string or a list of {"role","content"} messages>,
//       "completion": "<generated text>",
//       <every other column of the dataset row, with its JSON value>}, ...]
//   A dataset column named "prompt" or "completion" is not sent (those two keys are tandem's).
// Response: status 200 and a JSON object in one of two forms:
//     {"scores": [s0, s1, ...]}                      one reward function, named "reward_service"
//     {"rewards": {"name_a": [..], "name_b": [..]}}  several named reward functions
//   Each list has exactly one entry per completion, in request order: a number, or null for "no score"
//   (NaN here, left out of the group statistics like TRL's None). Anything else is an error naming the URL
//   and what is wrong. The first successful response fixes the set of function names; later responses must
//   return the same names (in any order).
// Failures: connection errors, timeouts, HTTP 5xx and 429 are retried up to max_retries times, waiting
// backoff_s, then twice that, and so on (capped at 30 s). Other statuses and malformed bodies are not
// retried: they would fail the same way again; so is an answer larger than max_response_bytes (the whole
// answer is held in memory). The final error names the URL, the status and the start of the body.
#ifndef TANDEM_TRAINER_REWARD_SERVICE_H
#define TANDEM_TRAINER_REWARD_SERVICE_H

#include <stddef.h>

#include "trainer/rewards.h"

typedef struct {
    const char *url;            // http://host:port/path
    double timeout_s;           // per attempt, after connecting: send the batch and receive the scores (> 0)
    double connect_timeout_s;   // per attempt (> 0)
    int max_retries;            // extra attempts after the first (>= 0)
    double backoff_s;           // wait before the first retry (>= 0), doubled for each further one
    size_t max_response_bytes;  // a larger answer is refused, not retried (0: HTTP_DEFAULT_MAX_RESPONSE_BYTES,
                                // 64 MiB); --reward-max-response-mb sets it
} RewardServiceOptions;

void reward_service_options_default(RewardServiceOptions *o);

typedef struct RewardService RewardService;

int reward_service_create(RewardService **out, const RewardServiceOptions *o, char *err, size_t err_len);
void reward_service_free(RewardService *rs);

// The reward functions the service returns: 0 until the first successful reward_service_score.
size_t reward_service_count(const RewardService *rs);
const char *reward_service_name(const RewardService *rs, size_t i);

// Sends the batch and fills scores[i * ld + f] for sample i and service function f (ld >= count, so the
// caller can place these columns after the built-ins: pass scores + n_builtin). max_funcs is the number of
// columns the caller has room for; a service returning more functions is an error. On success
// *n_funcs = reward_service_count(rs).
int reward_service_score(RewardService *rs, const RewardSample *samples, size_t n, double *scores, size_t ld,
                         size_t max_funcs, size_t *n_funcs, char *err, size_t err_len);

// What reward_service_score does with an answer of status 200 for n samples: parses body, checks it against the
// names the first answer fixed (the first answer fixes them) and fills scores as reward_service_score does.
// 0, or -1 with a message naming the URL, the problem and the start of the body.
int reward_service_take_response(RewardService *rs, const char *body, size_t body_len, size_t n, double *scores,
                                 size_t ld, size_t max_funcs, size_t *n_funcs, char *err, size_t err_len);

// The request body for a batch (malloc'd JSON text) — what reward_service_score sends.
char *reward_service_request_json(const RewardSample *samples, size_t n);
// Parses a response body against n samples into a (n_funcs, n) matrix: *names and *scores malloc'd
// (free each name, then the arrays). 0, or -1 with a message naming the problem.
int reward_service_parse_response(const char *body, size_t body_len, size_t n, char ***names, size_t *n_funcs,
                                  double **scores, char *err, size_t err_len);

#endif
