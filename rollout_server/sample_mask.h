// rollout_server/sample_mask.h — what the next token of one completion may be: vLLM's min_tokens, bad_words and
// allowed_token_ids processors as the mask ops_sample_rows applies (kernels/ops.h, OpsSampleParams.mask).
//
//   min_tokens: while fewer than p->min_tokens tokens were generated, the eos ids and p->stop_token_ids are banned
//     (vLLM bans them with ignore_eos too: a stop id that does not stop is still no content);
//   bad_words: word w (ids b_1 .. b_L) bans b_L where the generated tokens end with b_1 .. b_{L-1} (L = 1: always).
//     Only generated tokens count, never the prompt (vLLM);
//   allowed_token_ids: only those ids may be drawn; with bans as well, the allowed ids less the banned ones;
//   structured outputs (a Guide, guided_regex.h): the ids the guide allows after the generated tokens take the place
//     of allowed_token_ids (the two are not combined: the HTTP layer refuses both at once).
// The result depends on the completion's own tokens only, so a seeded completion draws the same tokens whatever
// else is batched with it.
#ifndef TANDEM_ROLLOUT_SAMPLE_MASK_H
#define TANDEM_ROLLOUT_SAMPLE_MASK_H

#include <stdint.h>

#include "rollout_server/engine.h"
#include "rollout_server/guided_regex.h"

// Room (ids) the mask of a request with p (and guide, NULL: none) needs for any of its tokens; 0 when it asks for
// no mask.
int sample_mask_cap(const SamplingParams *p, const Guide *guide, int n_eos);

// The mask for the next token after the generated ids gen (n_gen). Writes at most sample_mask_cap ids to out and
// returns how many, with *mode an OPS_SAMPLE_MASK_* (OPS_SAMPLE_MASK_NONE and 0 when nothing is masked).
int sample_mask_build(const SamplingParams *p, const Guide *guide, const int32_t *eos, int n_eos, const int32_t *gen,
                      int n_gen, int32_t *out, int32_t *mode);

#endif
