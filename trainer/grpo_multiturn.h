// trainer/grpo_multiturn.h — GRPO over multi-turn tool-use trajectories (--tools; docs/environments.md).
//
// A round's prompts are generated as usual (G first turns per prompt, streamed back group by group); when a group
// comes back, each of its G completions becomes a trajectory (trainer/trajectory.h) that is continued right there
// — tool calls run, tool turns rendered, further assistant turns sampled by the rollout servers from the whole
// history — until it ends, while the servers still generate the other groups. The round's completion i is then
// trajectory i: its ids, sampling logprobs and a tool mask that keeps tool-turn tokens out of the loss (as TRL's
// tool_mask); rewards score the final assistant turn; advantages are per group of G trajectories, as for single
// turns.
#ifndef TANDEM_TRAINER_GRPO_MULTITURN_H
#define TANDEM_TRAINER_GRPO_MULTITURN_H

#include <stddef.h>

#include "trainer/grpo_round.h"
#include "trainer/train_config.h"
#include "trainer/trainer.h"

// Sets up t->env (the built-in tools of --tools, or the service of --env-url, asked for its tools' definitions),
// t->tool_style and t->tool_format (the trainer's chat template renders tool turns) and t->tool_prompt (the
// definitions in message prompts).
int trainer_open_tools(Trainer *t, const TrainConfig *cfg, char *err, size_t err_len);

// Continues group p's G first turns (taken into r by the stream) into trajectories and points the round's
// completion arrays at them. 0, or -1 with a message (a sampler or environment failure).
int grpo_round_group_trajectories(Trainer *t, GrpoRound *r, int p, char *err, size_t err_len);

// The round's tool metrics (TRL's names where TRL has them), summed over every rank, into m: tools/call_frequency
// (calls per completion), tools/failure_frequency (failed calls per call), tools/turns_mean (assistant turns per
// trajectory), tools/environment_time (seconds a rank waited for the environment in the round, the slowest
// rank's).
int grpo_round_tool_metrics(Trainer *t, const GrpoRound *r, json_t *m, char *err, size_t err_len);

// 1 when the round's rewards have the environment's column (an environment service: its last reward of each
// trajectory, NaN where it gave none), after the built-ins' and the reward service's; its name.
int grpo_env_reward_column(const Trainer *t);
#define GRPO_ENV_REWARD_NAME "environment"

#endif
