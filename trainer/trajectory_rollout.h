// trainer/trajectory_rollout.h — assistant turns of trajectories sampled by the rollout servers (the
// TrajectorySampleFn of trainer/trajectory.h over trainer/rollout_client.h).
//
// Each turn is one generate of one completion whose prompt is the trajectory's whole history as ids, so a server's
// prefix cache finds the history's KV blocks from the turn before and prefills only the environment's tokens.
// Every turn of a round is sent before any answer is awaited (the servers batch them). A turn samples with its own
// seed, fixed by (seed, episode, turn), so results do not depend on which episodes share a round or a server.
#ifndef TANDEM_TRAINER_TRAJECTORY_ROLLOUT_H
#define TANDEM_TRAINER_TRAJECTORY_ROLLOUT_H

#include <stdint.h>

#include "shared/zmq_msg.h"
#include "trainer/rollout_client.h"
#include "trainer/trajectory.h"

typedef struct {
    RolloutClient *client;
    ZmsgSampling sampling;   // temperature, top_p, ...; n and max_tokens are set per turn, seed per (episode, turn)
    uint64_t seed;
} TrajectoryRolloutSampler;

// The seed of an episode's turn: a mix of the three, below 2^63 as the protocol requires.
uint64_t trajectory_turn_seed(uint64_t seed, size_t episode, int turn);

// A TrajectorySampleFn; ctx is a TrajectoryRolloutSampler. A sample's version is the policy version of the turn's
// first token.
int trajectory_rollout_sample(void *ctx, const TrajectorySampleRequest *req, size_t n, TrajectorySample *out,
                              char *err, size_t err_len);

#endif
