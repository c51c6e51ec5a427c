// trainer/grpo_micro.h — a GRPO micro-batch on the trainer's model: the logprobs of a chunk of a round's completions
// (old or reference), and a micro-step (forward, GRPO loss, backward). Both are collective under ZeRO-3: every rank
// runs the same ones in the same order. The buffers live in one workspace that grows to the largest micro-batch
// seen, so a steady-state step allocates nothing here.
#ifndef TANDEM_TRAINER_GRPO_MICRO_H
#define TANDEM_TRAINER_GRPO_MICRO_H

#include <stddef.h>
#include <stdint.h>

#include "trainer/grpo_loss.h"
#include "trainer/grpo_round.h"
#include "trainer/trainer.h"

// A micro-batch's buffers: B completions of at most T tokens, N packed prompt + completion tokens.
typedef struct {
    size_t cap_bt, cap_b, cap_n;
    int *idx;                             // (B) completion indices
    float *logps, *entropies;             // (B, T) the forward's, on the completion tokens
    float *old, *ref, *sampling;          // (B, T)
    float *grad, *grad_entropy;           // (B, T) dL/dlogprob, dL/dentropy
    float *is_ratio;                      // (B, T) or (B): grpo_rollout_is_ratio_len
    float *advantages;                    // (B)
    uint8_t *mask, *truncated;            // (B, T), (B)
    int32_t *tokens, *targets, *cu;       // (N), (N), (B + 1) the packed batch
    float *packed_logps, *packed_entropies; // (N)
    float *dlogps, *dentropies;           // (N) gradients at the packed positions
} GrpoMicroBuffers;

void grpo_micro_buffers_free(GrpoMicroBuffers *w);

// One optimizer step's micro-batch metrics (TRL's names). TRL appends one value per micro-batch (its all-rank
// value: a sum over every rank's tokens over their count, or a min / max over every rank's sequences) and its log
// averages them; so each micro-step keeps its own sums here, reduced over ranks and averaged when logged.
enum {
    GRPO_MICRO_KL, GRPO_MICRO_KL_N, GRPO_MICRO_ENT, GRPO_MICRO_ENT_N, GRPO_MICRO_LOW, GRPO_MICRO_HIGH,
    GRPO_MICRO_REGION, GRPO_MICRO_CLIP_N, GRPO_MICRO_SUMS
};
typedef struct {
    double loss;
    double (*micro)[GRPO_MICRO_SUMS];   // (cap) sums of each micro-step, this rank's
    double *low_min, *high_max;         // (cap) this rank's nanmin / nanmax of the sequences' clip fractions
    int n, cap;                         // micro-steps kept; cap = gradient_accumulation_steps
} GrpoStepSums;

// Room for cap micro-steps. 0, or -1 with a message.
int grpo_step_sums_init(GrpoStepSums *s, int cap, char *err, size_t err_len);
void grpo_step_sums_reset(GrpoStepSums *s);   // the next optimizer step: no micro-step yet
void grpo_step_sums_free(GrpoStepSums *s);

// The per-token logprobs of `src` (no gradient) of completions [s, s + B) of the round into out (r->off slices):
// the old or the reference logprobs.
int grpo_score_chunk(Trainer *t, UnitSource *src, GrpoRound *r, GrpoMicroBuffers *w, float *out, int s, int B,
                     char *err, size_t err_len);

// Micro-batch s of the round (completions [s * B, (s + 1) * B), B = per_device_train_batch_size): forward, GRPO
// loss, backward (gradients accumulate in the ZeRO state), its metric sums added to acc. need_old: old logprobs
// are in r->old_logps; off_policy: the loss uses them as its ratio's denominator; active: num_items_in_batch.
int grpo_micro_step(Trainer *t, UnitSource *policy, const GrpoRound *r, GrpoMicroBuffers *w, int s, int need_old,
                    int off_policy, double active, GrpoEntropyControl *ec, GrpoStepSums *acc, char *err,
                    size_t err_len);

#endif
