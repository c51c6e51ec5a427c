// trainer/grpo_round.h — one GRPO generation round of a rank: the generate, rewards and advantages phases of a
// GRPO step (docs/architecture.md "One GRPO step"). The micro-step, optimizer and log phases are in
// trainer/grpo_train.c. A round's arrays are allocated once per run (every round has the same number of
// completions) and its reward buffers grow to the widest round seen, so a step allocates only what the rollout
// client returns and the decoded completion texts.
#ifndef TANDEM_TRAINER_GRPO_ROUND_H
#define TANDEM_TRAINER_GRPO_ROUND_H

#include <jansson.h>
#include <stdint.h>

#include "trainer/trainer.h"

// Completion i of prompt p sits at i = p * G + j (G = num_generations), n = n_prompts * G on this rank.
typedef struct {
    int n_prompts, n;
    DataRow *rows;              // (n_prompts)
    RolloutGroup *groups;       // (n_prompts) what the servers returned; owns the completion ids and logprobs
    int have_groups;            // groups hold this round's completions (freed by grpo_round_clear)
    int32_t **comp;             // (n) completion ids (into groups)
    int *comp_len;              // (n)
    float **sampling_logps;     // (n) the servers' logprobs (into groups)
    uint8_t *truncated;         // (n) no EOS: finish reason "length"
    float *advantages;          // (n)
    size_t *off;                // (n + 1) prefix sums of comp_len: completion i's slice of the flat logps below
    float *old_logps;           // (off[n]) trainer logprobs before this round's updates, when needed
    float *ref_logps;           // (off[n]) the reference model's logprobs, beta > 0
    size_t logps_cap;           // floats each of old_logps / ref_logps hold
    // The rewards phase's buffers, grown to the widest round seen (F reward functions).
    const int32_t **prompts;    // (n_prompts)
    int *prompt_lens;           // (n_prompts)
    RewardSample *samples;      // (n)
    char **texts;               // (n) decoded completions
    double *service_scores;     // (n * GRPO_SERVICE_MAX_FUNCS) the reward service's columns
    double *scores;             // (n * F)
    float *local;               // (n * F) this rank's scores
    float *all;                 // (world * n * F) every rank's, in rank order
    float *adv_all;             // (world * n)
    double *fmean, *fstd;       // (F)
    float *weights;             // (F) reward_weights, when set
    int cap_f;                  // F the buffers above hold
    double len_sum, clipped;    // completion tokens and completions cut at max length (this rank)
    double generate_seconds, reward_seconds;
} GrpoRound;

// Room for the reward service's columns: a service returning more functions is an error.
#define GRPO_SERVICE_MAX_FUNCS 64

// Allocates a round of n_prompts prompts x G completions for `world` ranks.
int grpo_round_init(GrpoRound *r, int n_prompts, int G, int world, char *err, size_t err_len);
// Drops the round's rows, completions and texts; keeps the arrays for the next round.
void grpo_round_clear(GrpoRound *r);
void grpo_round_free(GrpoRound *r);

// Phase 1, generate: the next n_prompts rows of this rank's shard, G completions each from the rollout servers
// (retried together by every rank when servers went away mid-round, after a weight push).
int grpo_round_generate(Trainer *t, GrpoRound *r, char *err, size_t err_len);
// Phase 2, rewards: the built-in rewards and the reward service's, per completion and function.
int grpo_round_rewards(Trainer *t, GrpoRound *r, int *n_funcs, char *err, size_t err_len);
// Phase 3, advantages over the whole generation batch (every rank's rewards), and the round's metrics (TRL's
// names) into m.
int grpo_round_advantages(Trainer *t, GrpoRound *r, int n_funcs, json_t *m, char *err, size_t err_len);
// Room for the old / reference logprobs of every completion of the round (off[n] floats each).
int grpo_round_reserve_logps(GrpoRound *r, int old, int ref, char *err, size_t err_len);

#endif
