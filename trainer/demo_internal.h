// trainer/demo_internal.h — what the demo's own files share (trainer/demo.c runs the phases, trainer/demo_report.c
// writes the results): the options, the run's state and a few helpers.
#ifndef TANDEM_TRAINER_DEMO_INTERNAL_H
#define TANDEM_TRAINER_DEMO_INTERNAL_H

#include <stddef.h>
#include <string.h>
#include <sys/types.h>

typedef struct {
    const char *output_dir, *device;
    const char *task;                                     // "add" (the default) or "tools"
    int max_tool_turns;                                   // tools: calculator turns per episode
    long long seed;
    int threads;
    int digits, n_train, n_heldout, n_validation, n_sft; // task
    int hidden, layers, heads, intermediate;              // model
    double init_std;
    int sft_batch, sft_min_steps, sft_max_steps, sft_check_every;  // SFT warm-up
    double sft_lr, sft_target;
    int grpo_steps, prompts_per_step, num_generations;   // GRPO (grpo_steps: the cap)
    int eval_every, stop_patience;
    int max_staleness;                                    // GRPO rounds generated ahead (0: synchronous)
    double grpo_lr, temperature, stop_accuracy;
} DemoOptions;

// Tokens of a complete answer: the sum (digits + 1, zero-padded, least significant digit first) and <eos>.
static inline int completion_tokens(const DemoOptions *o) { return o->digits + 2; }

static inline int demo_is_tools(const DemoOptions *o) { return o->task && !strcmp(o->task, "tools"); }

// The tools task's completion budget (assistant and tool tokens, max_completion_length): per calculator turn the
// call (<tool_call> prefix a+b suffix </tool_call> <|im_end|>: 2 d + 6) and the tool turn ("\n<|im_start|>tool\n"
// sum "<|im_end|>\n<|im_start|>assistant\n": at most d + 10), then the answer (sum, <|im_end|>: at most d + 3),
// and 4 spare tokens.
static inline int tools_completion_tokens(const DemoOptions *o) {
    return (o->max_tool_turns > 0 ? o->max_tool_turns : 1) * (3 * o->digits + 16) + o->digits + 3 + 4;
}

// Folders (the output folder, this binary's) are at most DIR_MAX - 1 characters, so every path built inside them
// fits PATH_IN and every message naming one fits the error buffers.
enum { DIR_MAX = 1024, PATH_IN = DIR_MAX + 96 };

typedef struct {
    DemoOptions o;
    char dir[DIR_MAX], bin_dir[DIR_MAX], train_bin[DIR_MAX + 16], serve_bin[DIR_MAX + 16];
    char device[8];
    int threads;
    char env_buf[2][48];
    char *env[3];
    double t0;
    // Results.
    int n_evals;
    double eval_step[256], eval_acc[256], eval_form[256];   // held-out: measured, never used to decide
    double eval_val[256];    // validation accuracy at the same steps: decides when GRPO stops
    double eval_exact[256];  // tools: held-out final answers that are the sum's digits alone
    int grpo_done;           // GRPO steps run (<= grpo_steps)
    const char *stop_reason; // why GRPO stopped, for the summary
    double *reward;          // (grpo_steps) mean reward of each step, NaN until logged
    double t_sft, t_grpo, t_eval;
    int sft_steps, n_checks;
    double check_step[64], check_acc[64];
    // The rollout server.
    pid_t server;
    int http_port, control_port;
} Demo;

// The tools task's evaluation (trainer/demo_eval_tools.c): greedy multi-turn episodes of a JSONL with the built-in
// calculator through the server on port; *acc the share solved (answer_match on the final answer), *call_rate the
// share with at least one calculator call that ran, *exact_rate (may be NULL) the share whose final answer is the
// sum's digits alone; out (may be NULL): one JSON line per row {"row", "completions": [final answer], "trajectory",
// "tool_calls", "tool_failures", "turns", "solved", "exact"}.
int demo_eval_tools(Demo *d, int port, const char *data, const char *out, double *acc, double *call_rate,
                    double *exact_rate, char *err, size_t err_len);

// OUTPUT_DIR/rel into out.
void demo_path_in(const Demo *d, char *out, size_t len, const char *rel);
// One log line on stderr, stamped with the time since the start.
void demo_say(const Demo *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Prints a few held-out problems with the answers after SFT and after GRPO (from OUTPUT_DIR/eval), those GRPO
// fixed first.
void demo_show_examples(Demo *d);
// Writes OUTPUT_DIR/demo_summary.json and OUTPUT_DIR/demo.svg. 0, or -1 with a message.
int demo_write_results(Demo *d, size_t n_params, char *err, size_t err_len);

#endif
