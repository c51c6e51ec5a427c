// trainer/trajectory.h — a multi-turn rollout as token ids: prompt -> assistant turn -> environment turn ->
// assistant turn ... until the policy answers without a tool call, the environment ends the episode, or a budget
// is hit.
//
// Layout of one trajectory (n = n_ids - prompt_len completion positions):
//   ids[0 .. prompt_len)        the prompt, as given
//   ids[prompt_len .. n_ids)    the completion: each assistant turn's sampled ids exactly as sampled (never
//                               re-tokenised) and, between turns, the environment's answers rendered through the
//                               chat template (tool_turn_render.h) and encoded
//   mask[k]                     1 on assistant tokens, 0 on environment tokens (out of the loss)
//   logprobs[k]                 the sampling logprob of an assistant token; 0 on environment tokens
//   versions[k]                 the policy version that sampled an assistant token; -1 on environment tokens
// This is what TRL's GRPOTrainer._tool_call_loop builds as completion_ids, tool_mask and logprobs
// (tests/reference/test_trajectory_vs_trl.py runs TRL's loop on the same turns). Every assistant turn after the
// first is sampled from ids[0 .. n_ids) as they stand, so a prefix cache reuses the whole history's KV and only
// the environment's new tokens are prefilled.
//
// Budgets, as TRL: the completion (assistant and environment tokens) never exceeds max_completion_length: a turn
// is sampled with at most the tokens left, and an environment answer that would pass the budget, or make the
// sequence reach max_model_len, is dropped and the episode ends there (end = TRAJECTORY_END_LENGTH). At most
// max_tool_calling_iterations environment turns run (TRL's name; < 0: no limit).
#ifndef TANDEM_TRAINER_TRAJECTORY_H
#define TANDEM_TRAINER_TRAJECTORY_H

#include <stddef.h>
#include <stdint.h>

#include "shared/tokenizer/tokenizer.h"
#include "shared/tool_calls.h"
#include "trainer/environment.h"
#include "trainer/tool_turn_render.h"

typedef enum {
    TRAJECTORY_END_ANSWER = 1,     // the policy answered without a tool call
    TRAJECTORY_END_DONE,           // the environment ended the episode
    TRAJECTORY_END_MAX_TURNS,      // max_tool_calling_iterations environment turns ran
    TRAJECTORY_END_LENGTH,         // the token budget ran out
} TrajectoryEnd;

const char *trajectory_end_name(TrajectoryEnd e);

typedef struct {
    int32_t *ids;
    size_t n_ids, cap;
    size_t prompt_len;
    uint8_t *mask;          // n_ids - prompt_len entries (completion positions)
    float *logprobs;
    int64_t *versions;
    int n_assistant_turns;
    size_t last_turn_start; // completion position where the last assistant turn starts (the final answer)
    int n_tool_calls;       // calls the assistant turns made: those read and run, and one per turn with an
                            // unreadable call
    int n_tool_failures;    // calls answered with an error, and unreadable calls
    double env_reward;      // the last reward the environment gave (NAN: none)
    double env_seconds;     // time spent waiting for the environment
    TrajectoryEnd end;
} Trajectory;

// Starts a trajectory at a prompt (copied). 0, or -1 when out of memory.
int trajectory_init(Trajectory *t, const int32_t *prompt, size_t n);
void trajectory_free(Trajectory *t);
size_t trajectory_completion_len(const Trajectory *t);
int trajectory_append_assistant(Trajectory *t, const int32_t *ids, const float *logprobs, size_t n, int64_t version);
int trajectory_append_environment(Trajectory *t, const int32_t *ids, size_t n);

// One assistant turn to sample for a trajectory of the batch.
typedef struct {
    size_t episode;           // index in the batch
    int turn;                 // the assistant turn to sample, 1 for the first
    const int32_t *ids;       // the whole history: prompt and completion so far
    size_t n_ids;
    size_t max_new_tokens;    // > 0
} TrajectorySampleRequest;

typedef struct {
    int32_t *ids;             // malloc'd by the sampler, freed by the builder: the sampled ids (end-of-turn
    float *logprobs;          // token included when sampled), and their sampling logprobs
    size_t n;                 // <= max_new_tokens
    int64_t version;          // the policy version that sampled them
} TrajectorySample;

// Samples one assistant turn for each of n requests (all of a round at once, so a server batches them).
// 0, or -1 with a message.
typedef int (*TrajectorySampleFn)(void *ctx, const TrajectorySampleRequest *req, size_t n, TrajectorySample *out,
                                  char *err, size_t err_len);

typedef struct {
    int max_tool_calling_iterations;   // < 0: no limit
    size_t max_completion_length;      // > 0
    size_t max_model_len;              // 0: no limit
    ToolCallFormat format;
} TrajectoryOptions;

typedef struct {
    TrajectoryOptions opt;
    const Tokenizer *tok;
    ToolTurnStyle style;
    Environment *env;
    TrajectorySampleFn sample;
    void *sample_ctx;
} TrajectoryBuilder;

// Runs n episodes to their end. t[i] must be trajectory_init'ed at its prompt and episode_ids[i] already reset in
// the environment (env_reset: the caller renders the prompt, which a reset observation changes). 0, or -1 with a
// message (a sampler or environment failure, a chat template that cannot render a tool turn).
int trajectories_run(const TrajectoryBuilder *b, Trajectory *t, const char *const *episode_ids, size_t n, char *err,
                     size_t err_len);

#endif
