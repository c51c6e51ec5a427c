// trainer/trainer.h — one rank of tandem-train: everything a run holds, and the loops that drive it.
//
// GRPO round (trainer/grpo_train.c): each rank takes its prompts from its data shard, asks the rollout servers
// for num_generations completions each, scores them, computes advantages over the whole generation batch (all
// ranks), then runs steps_per_generation x num_iterations micro-batches of per_device_train_batch_size
// completions through forward, the GRPO loss (trainer/grpo_loss.h) and backward, stepping the optimizer every
// gradient_accumulation_steps micro-batches, pushing weights to the servers every weight_sync_steps steps.
// SFT (trainer/sft_train.c): the same engine with cross-entropy on the completion tokens.
#ifndef TANDEM_TRAINER_TRAINER_H
#define TANDEM_TRAINER_TRAINER_H

#include <stdio.h>

#include "shared/tokenizer/chat_template.h"
#include "shared/comm/comm.h"
#include "shared/model.h"
#include "shared/tokenizer/tokenizer.h"
#include "trainer/environment.h"
#include "trainer/tool_prompt.h"
#include "trainer/tool_turn_render.h"
#include "trainer/checkpoint.h"
#include "trainer/data.h"
#include "trainer/reward_service.h"
#include "trainer/rewards.h"
#include "trainer/rollout_client.h"
#include "trainer/train_config.h"
#include "trainer/weight_sync.h"
#include "trainer/zero3.h"

typedef struct Trainer {
    TrainConfig *cfg;
    int rank, world;
    Comm *comm;                 // host collectives on host memory: rewards, metrics, flags (ZeroMQ)
    Comm *dcomm;                // the ZeRO state's collectives on backend memory: NCCL for several CUDA ranks,
                                // else the same communicator as comm
    struct RankWatch *rank_watch; // the other ranks' liveness for dcomm when it is NCCL (trainer/rank_watch.h)
    Comm *node_comm, *replica_comm; // sharding_strategy hybrid_shard: dcomm split into this node's ranks and the
                                    // ranks with this LOCAL_RANK across nodes (comm_split_nodes); else NULL
    CommBytes logged_bytes;     // the ZeRO engines' byte counters at the last metrics row (trainer_log)
    WeightSync sync;            // the weight push to the rollout servers
    OpsCtx *ops;
    Model model;
    Zero3 *policy;              // NULL when training LoRA adapters (use_peft)
    struct LoraTrain *lora;     // use_peft: the frozen base and the adapters' optimizer (trainer/lora_train.h)
    Zero3 *ref;                 // frozen reference (beta > 0, full fine-tuning), else NULL
    int lora_ref;               // use_peft with beta > 0: the reference is the frozen base with the adapters off
    Tokenizer *tok;
    ChatTemplate *chat;         // NULL when the tokenizer has no recognised template
    DataReader *data;
    Rewards *rewards;
    RewardService *reward_service;  // NULL without --reward-url
    RolloutClient *rollout;     // rank 0 and every rank (each rank sends its own prompts)
    Environment *env;           // multi-turn tool use: the built-in tools (--tools) or an environment service
                                // (--env-url, whose rewards are a reward column); NULL: single turn
    ToolTurnStyle tool_style;   // how the chat template renders tool turns (with env)
    ToolCallFormat tool_format; // how the policy writes tool calls (with env)
    ToolPrompt tool_prompt;     // the tools' definitions in message prompts (with env; trainer/tool_prompt.h)
    TrainActs *acts;
    int acts_tokens, acts_seqs; // capacity of acts
    TrainProgress progress;
    long total_steps;
    long steps_per_epoch;           // optimizer steps of one pass over the data (the logged epoch's unit)
    long save_every;                // a checkpoint every k optimizer steps (save_strategy); 0: the final one only
    FILE *metrics;              // rank 0: OUTPUT_DIR/metrics.jsonl
    FILE *completions;          // rank 0 with log_completions (grpo): OUTPUT_DIR/completions.jsonl
    double t_start;
} Trainer;

// Sets everything up from the config (rank/world from the launch contract). Logs memory per rank.
int trainer_open(Trainer *t, TrainConfig *cfg, char *err, size_t err_len);
void trainer_close(Trainer *t);
// Runs to max_steps (or the epochs), saving checkpoints as configured. Returns 0 or a negative code.
int trainer_run_grpo(Trainer *t, char *err, size_t err_len);
int trainer_run_sft(Trainer *t, char *err, size_t err_len);

// Shared pieces (trainer/trainer.c).
double trainer_now(void);
// Grows t->acts to hold n_tokens tokens in n_seqs sequences.
int trainer_ensure_acts(Trainer *t, int n_tokens, int n_seqs, char *err, size_t err_len);
// The policy's parameters as the model reads them: the ZeRO engine's units, or with use_peft the frozen base
// (the adapters ride along on t->model.lora).
UnitSource trainer_policy_source(Trainer *t);
// Whether GRPO has a reference model (beta > 0): its own ZeRO engine, or with use_peft the base without adapters.
static inline int trainer_has_ref(const Trainer *t) { return t->ref != NULL || t->lora_ref; }
// Optimizer step with this step's learning rate; fills *grad_norm and *lr.
int trainer_optimizer_step(Trainer *t, float *grad_norm, double *lr, char *err, size_t err_len);
// 1 when optimizer step `step` gets a metrics.jsonl row: every logging_steps, the last and, with
// logging_first_step, the first.
int trainer_logs_step(const Trainer *t, long step);
// 1 when a checkpoint is saved after optimizer step `step` (save_strategy, save_steps); the final one is the run's.
int trainer_saves_step(const Trainer *t, long step);
// Saves a checkpoint of the current step (all ranks); a resumed run reads the data from where the reader is now,
// or, with trainer_save_at, from (data_epoch, data_position) (rounds generated ahead have read further).
int trainer_save(Trainer *t, char *err, size_t err_len);
int trainer_save_at(Trainer *t, uint64_t data_epoch, size_t data_position, char *err, size_t err_len);
// Next prompt row of this rank's shard, wrapping to the next epoch. 1 = row, negative = error.
int trainer_next_row(Trainer *t, DataRow *row, char *err, size_t err_len);
// rank 0, when stderr is a terminal: redraws the progress bar (step, elapsed, ETA).
void trainer_progress(Trainer *t);
// rank 0: appends one JSON line to metrics.jsonl and prints the log line.
void trainer_log(Trainer *t, json_t *metrics);

#endif
