// rollout_server/sampler.h — the host side of the server's sampling: the uniform each draw uses, and the logprobs of
// a host logits row that top logprobs are reported from.
//
// The choice of the token itself is ops_sample_rows' (kernels/ops.h states the semantics: reported logprobs,
// repetition penalty, greedy, min-p / top-k / top-p, the inverse-CDF draw); kernels/cpu/cpu_sample.c is its host
// reference and the CUDA kernel is held to it. The engine draws with sampler_uniform, and the model runner
// computes top logprobs with sampler_logprob from the host copy of a logits row.
#ifndef TANDEM_ROLLOUT_SAMPLER_H
#define TANDEM_ROLLOUT_SAMPLER_H

#include <stdint.h>

#include "rollout_server/engine.h"

#define SAMPLER_GREEDY_BELOW OPS_SAMPLE_GREEDY_BELOW // 1e-5 (kernels/ops.h)

// The uniform in [0, 1) of random stream `stream` (= request seed + completion index) at output position `pos`: a
// pure function of the two, so a completion draws the same tokens whatever else is batched with it and whether or
// not it was preempted and recomputed.
double sampler_uniform(uint64_t stream, uint64_t pos);

// log_softmax(logits * inv_temperature) of one id over V logits, and the k best (id, logprob) pairs (best first,
// ties by lower id; fewer than k ids pad with id -1, logprob -inf) when top != NULL. The same distribution as the
// logprobs ops_sample_rows reports.
float sampler_logprob(const float *logits, int V, float inv_temperature, int32_t id, int k, TokenLogprob *top);

#endif
