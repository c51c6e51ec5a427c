// rollout_server/sampler.h — picks the next token from one row of fp32 logits, on the host.
//
// The engine samples on the backend instead, with ops_sample_rows (kernels/ops.h: the same semantics, held to
// this file token for token by tests/unit/test_rollout_sampler_ops.c), so only 8 bytes a token leave the device.
// This file stays as that op's reference, and the engine takes sampler_uniform (the draw of each (stream,
// position)) and sampler_logprob (tokens asking for top logprobs) from it.
//
// Order of operations (vLLM's, which TRL's GRPO generation runs on):
//   1. reported logprobs: log_softmax(logits / T)[token], T = temperature (1 when greedy), computed on the raw
//      logits before any penalty or filter — the quantity the trainer recomputes. Top logprobs come from the
//      same distribution (best first, ties by lower id).
//   2. repetition penalty over every distinct token of the history (prompt + generated), Hugging Face
//      semantics: a positive logit is divided by the penalty, a negative one multiplied.
//   3. temperature below SAMPLER_GREEDY_BELOW (vLLM's epsilon; logits / T would overflow): greedy argmax of the
//      penalised logits (ties by lower id), logprobs at T = 1. Otherwise logits / T, then
//      min-p (drop tokens whose probability is below min_p * the top probability), then top-k (keep the k
//      largest, plus any tied with the k-th), then top-p (keep a token while the probability of the tokens
//      ranked above it is below top_p; the top token always stays), each on the renormalised survivors.
//   4. the draw: inverse CDF (tokens in id order) of one uniform u in [0, 1) that depends only on
//      (stream, position): the same request gives the same tokens whatever else is batched with it and
//      whether or not it was preempted and recomputed.
#ifndef TANDEM_ROLLOUT_SAMPLER_H
#define TANDEM_ROLLOUT_SAMPLER_H

#include <stdint.h>

#include "rollout_server/engine.h"

#define SAMPLER_GREEDY_BELOW OPS_SAMPLE_GREEDY_BELOW // 1e-5 (kernels/ops.h)

typedef struct Sampler Sampler;

// Scratch for rows of V logits. Returns 0 or -1 (out of memory).
int sampler_create(Sampler **out, int V);
void sampler_free(Sampler *s);

// The uniform in [0, 1) of random stream `stream` (= request seed + completion index) at output position `pos`.
double sampler_uniform(uint64_t stream, uint64_t pos);

// Samples from logits (V) under p (temperature, top_k, top_p, min_p, repetition_penalty, top_logprobs) with
// history (n_history ids: prompt then generated) for the repetition penalty. Writes the token's logprob and,
// when p->top_logprobs > 0, that many alternatives into top. Returns the token id.
int32_t sampler_sample(Sampler *s, const float *logits, const SamplingParams *p, const int32_t *history,
                       int n_history, uint64_t stream, uint64_t pos, float *logprob, TokenLogprob *top);

// log_softmax(logits * inv_temperature) of one id, and the k best (id, logprob) pairs (best first, ties by lower
// id) when top != NULL. Exposed for the tests and for the engine's bookkeeping.
float sampler_logprob(const float *logits, int V, float inv_temperature, int32_t id, int k, TokenLogprob *top);

#endif
