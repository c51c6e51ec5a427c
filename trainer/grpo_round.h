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
#include "trainer/trajectory.h"

// The staleness of a round's completions when its training starts: staleness = the trainer's policy version
// minus the sample's version (0 when the sample is newer, which a restarted server can make).
#define GRPO_STALENESS_BINS 16      // histogram bins 0 .. 15; the last counts 15 and more
typedef struct {
    int64_t kept, dropped;          // completions trained on / dropped as too old
    int64_t sum, max;               // of the kept completions' staleness
    int64_t hist[GRPO_STALENESS_BINS];  // kept completions per staleness
} GrpoStaleness;

// keep[i] = 1 when versions[i] >= policy_version - max_staleness (each of n completions), with the counts in *st.
void grpo_staleness_filter(int n, const int64_t *versions, int64_t policy_version, int max_staleness,
                           uint8_t *keep, GrpoStaleness *st);

// Streaming groups (trainer/grpo_stream.c): which of a round's groups have come back and been scored. The prefix
// decides which micro-batches of completions (the first prefix x G) this rank holds.
typedef struct {
    int n_groups, n_scored;
    int prefix;                 // groups 0 .. prefix - 1 are all scored (their completions are in)
    uint8_t *scored;            // (n_groups) 1 once group g's rewards are computed
} GroupProgress;

int group_progress_init(GroupProgress *g, int n_groups, char *err, size_t err_len);
void group_progress_reset(GroupProgress *g);
// Marks `group` scored: 0, or -1 when it is out of range or already scored (a group is taken once per attempt).
int group_progress_mark(GroupProgress *g, int group);
void group_progress_free(GroupProgress *g);

// Work on a round's completions that may start before the whole round is in: run(ctx, r, k) for the completions
// [k * chunk, min((k + 1) * chunk, n)), k = 0, 1, ... in order, called by every rank at the same point once every
// rank holds those completions (a collective call may run in it). A round generated again starts over at k = 0.
typedef struct GrpoRound GrpoRound;
typedef struct {
    int chunk;
    int (*run)(void *ctx, GrpoRound *r, int k, char *err, size_t err_len);
    void *ctx;
} GrpoStreamWork;

// Completion i of prompt p sits at i = p * G + j (G = num_generations), n = n_prompts * G on this rank.
struct GrpoRound {
    int n_prompts, n;
    DataRow *rows;              // (n_prompts)
    RolloutGroup *groups;       // (n_prompts) what the servers returned; owns the completion ids and logprobs (freed
                                // by grpo_round_clear; a group not in yet is zeroed)
    // Sent and not yet collected (grpo_round_issue): the servers generate it while the trainer does other work.
    RolloutPending *pending;
    RolloutClient *client;      // the client `pending` belongs to
    ZmsgSampling sampling;      // the round's sampling parameters and seed (sent again when servers were lost)
    long first_step;            // optimizer step the round's training starts from (its seeds follow it)
    double issued_at;           // trainer_now() when the round was sent
    uint64_t data_epoch_end;    // the data reader's position after the round's prompts: a checkpoint taken while
    size_t data_pos_end;        // training this round resumes there, whatever was read ahead for later rounds
    int32_t **comp;             // (n) completion ids (into groups)
    int *comp_len;              // (n)
    float **sampling_logps;     // (n) the servers' logprobs (into groups)
    uint8_t *truncated;         // (n) no EOS: finish reason "length"
    int64_t *versions;          // (n) policy version of each completion's first (oldest) token, as the server says
    uint8_t *keep;              // (n) 0: dropped, sampled more than max_staleness versions before training
    GrpoStaleness staleness;    // of this rank's completions when the round's training starts
    int64_t train_version;      // the trainer's policy version then
    float *advantages;          // (n)
    float *streamed_adv;        // (n) advantages computed group by group for micro-steps run while the round came in
    size_t *off;                // (n + 1) prefix sums of comp_len: completion i's slice of the flat logps below
    float *old_logps;           // (off[n]) trainer logprobs before this round's updates, when needed
    float *ref_logps;           // (off[n]) the reference model's logprobs, beta > 0
    size_t logps_cap;           // floats each of old_logps / ref_logps hold
    // The rewards phase's buffers, grown to the widest round seen (F reward functions).
    const int32_t **prompts;    // (n_prompts)
    int *prompt_lens;           // (n_prompts)
    GroupProgress progress;     // the groups scored so far while the round streams in
    int *progress_arrived;      // (n_prompts) the groups one wait returned
    RewardSample *samples;      // (n)
    char **texts;               // (n) decoded completions
    double *builtin_scores;     // (n * F_builtin) the built-ins' columns, filled group by group
    double *service_scores;     // (n * GRPO_SERVICE_MAX_FUNCS) the reward service's columns
    RewardSample *call_samples; // (n) one reward service call's samples (the groups that arrived together) ...
    double *call_scores;        // (n * GRPO_SERVICE_MAX_FUNCS) ... and its answer
    int n_service_funcs;        // functions the service returned
    double *scores;             // (n * F)
    float *local;               // (n * F) this rank's scores
    float *all;                 // (world * n * F) every rank's, in rank order
    float *adv_all;             // (world * n)
    double *fmean, *fstd;       // (F)
    float *weights;             // (F) reward_weights, when set
    int cap_f;                  // F the buffers above hold
    // Multi-turn tool use (t->env; trainer/grpo_multiturn.h): completion i is trajectory i, continued from the
    // group's first turn, and comp, comp_len, sampling_logps point into it. NULL without tools.
    Trajectory *traj;           // (n)
    const uint8_t **tool_mask;  // (n) per completion token: 1 the policy's, 0 a tool turn's (out of the loss)
    int *answer_off;            // (n) where the last assistant turn (the final answer, what rewards read) starts
    double generate_seconds;    // sending the round to collecting it (overlapping training when issued ahead)
    double reward_seconds;      // decoding and scoring (groups while they stream in, then the round's columns)
    double stream_seconds;      // of reward_seconds: the part done inside grpo_round_collect
    double overlap_seconds;     // of stream_seconds: the part done while groups of the round were still generating
    int chunks_done;            // chunks of the stream work run (GrpoStreamWork): the rest is the caller's
};

// Room for the reward service's columns: a service returning more functions is an error.
#define GRPO_SERVICE_MAX_FUNCS 64

// Allocates a round of n_prompts prompts x G completions for `world` ranks.
int grpo_round_init(GrpoRound *r, int n_prompts, int G, int world, char *err, size_t err_len);
// Drops the round's rows, completions and texts; keeps the arrays for the next round.
void grpo_round_clear(GrpoRound *r);
void grpo_round_free(GrpoRound *r);

// Phase 1, generate: the next n_prompts rows of this rank's shard, G completions each from the rollout servers
// (when servers went away mid-round, every rank waits for them and pushes the weights, then the prompts still out
// are sent again; the groups already in stay); the round's seeds
// follow first_step. In two halves: grpo_round_issue sends the round, grpo_round_collect waits for it (a
// synchronous round is collected right after it is sent; asynchronous GRPO sends rounds ahead and collects each
// when its training is due). Collecting is collective (every rank agrees whether the servers answered); sending
// is not.
int grpo_round_issue(Trainer *t, GrpoRound *r, long first_step, char *err, size_t err_len);
// Collecting streams the round (grpo_round_stream); work (NULL: none) runs on the chunks the ranks hold meanwhile.
int grpo_round_collect(Trainer *t, GrpoRound *r, const GrpoStreamWork *work, char *err, size_t err_len);
// Collecting the round sent (r->pending), streaming (trainer/grpo_stream.c): _begin once per round, then
// grpo_round_stream until every rank has its round: each group is decoded and scored as it comes back, and work's
// chunks run as every rank holds them (r->chunks_done). Collective: 0 when every rank has its round (r->pending
// NULL); ROLLOUT_ESERVERS_LOST on every rank when one lost its servers (every rank keeps the groups it has, its
// generation and its chunks: after the servers are back, grpo_round_stream goes on from there); -1 on an error,
// with the groups freed and nothing pending.
int grpo_round_stream_begin(Trainer *t, GrpoRound *r, char *err, size_t err_len);
int grpo_round_stream(Trainer *t, GrpoRound *r, const GrpoStreamWork *work, char *err, size_t err_len);
// Drops (keep = 0) the completions sampled more than max_staleness versions before the trainer's policy version
// now, counting them in r->staleness.
void grpo_round_filter_stale(Trainer *t, GrpoRound *r);
// Phase 2, rewards: the built-in rewards and the reward service's, per completion and function, from the scores
// grpo_round_collect computed group by group as the round came in.
int grpo_round_rewards(Trainer *t, GrpoRound *r, int *n_funcs, char *err, size_t err_len);
// Streaming groups: group g's advantages from its own rewards (its staleness filter first), into advantages and
// streamed_adv — with scale_rewards group / none and sum_then_normalize the numbers grpo_round_advantages gives it.
int grpo_round_group_advantages(Trainer *t, GrpoRound *r, int g, char *err, size_t err_len);
// Phase 3, advantages over the whole generation batch (every rank's rewards), and the round's metrics (TRL's
// names) into m.
int grpo_round_advantages(Trainer *t, GrpoRound *r, int n_funcs, json_t *m, char *err, size_t err_len);
// log_completions (trainer/grpo_completions_log.c): one OUTPUT_DIR/completions.jsonl row (t->completions) per
// completion idx[0..B) of a micro-batch that feeds optimizer step `step`: "step", "prompt_ids", "completion_ids",
// "version" (and "version_end", its last token's), "staleness", "kept", "truncated", "advantage",
// "sampling_logps" (the servers'), with tools "tool_mask", "tool_calls" and "turns", "old_logps" (old (B, T), when
// computed) and "importance_sampling_ratio"
// (is_ratio when the correction is on: one number per sequence, or a list per token when ratio_per_token; (B) or
// (B, T)). T = the micro-batch's longest completion.
int grpo_log_completions(Trainer *t, const GrpoRound *r, long step, const int *idx, int B, int T, const float *old,
                         const float *is_ratio, int ratio_per_token, char *err, size_t err_len);
// Tokens of completion i the loss sees before any masking by options: all, or the policy's own with tools.
int grpo_round_policy_tokens(const GrpoRound *r, int i);
// Room for the old / reference logprobs of every completion of the round: `need` floats each (at least off[n]).
int grpo_round_reserve_logps(GrpoRound *r, int old, int ref, size_t need, char *err, size_t err_len);

#endif
