// trainer/demo.h — `tandem-train demo`: the whole of tandem on a built-in task with no downloads.
//
// One command creates a tiny Llama and its tokenizer (trainer/demo_files.c), writes train, validation and held-out
// JSONL of a verifiable task (a + b, exact answers), SFT-warms the model with `tandem-train --mode sft` until it
// answers a first share of the validation problems, starts a rollout server (`tandem-serve --control`) on the
// warmed checkpoint, measures accuracy over HTTP with `tandem-train eval`, runs GRPO against that server in
// segments (validation and held-out accuracy measured between them, while the trainer is stopped, so every figure
// belongs to one policy version) until validation accuracy holds a target for a few evaluations in a row or a step
// cap is reached (the held-out set decides nothing), and writes demo_summary.json and an SVG plot of reward and
// accuracy per step
// (trainer/demo_plot.c, trainer/demo_report.c). The children are spawned from this binary's folder
// (trainer/demo_proc.c); their logs go to OUTPUT_DIR/logs.
#ifndef TANDEM_TRAINER_DEMO_H
#define TANDEM_TRAINER_DEMO_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

// argv[0] is "demo". Returns the process exit code.
int demo_main(int argc, char **argv);

// ---- files (trainer/demo_files.c) ---------------------------------------------------------------------

// The tools task's calculator call is <tool_call> DEMO_CALL_PREFIX a+b DEMO_CALL_SUFFIX </tool_call> (Hermes
// format; the prefix and suffix are one token each in its tokenizer).
#define DEMO_CALL_PREFIX "{\"name\": \"calculator\", \"arguments\": {\"expression\": \""
#define DEMO_CALL_SUFFIX "\"}}"

typedef struct {
    int tools;                                 // 1: the tools task's tokenizer (ChatML, tool-call tokens) and context
    int hidden, layers, heads, intermediate;   // Llama sizes (vocab and context are fixed by the task)
    float init_std;                            // normal(0, std) for every matrix
    uint64_t seed;
} DemoModelSpec;

// Writes a Hugging Face model folder: config.json + model.safetensors (random init through shared/model.h),
// tokenizer.json (one token per character of the task's alphabet, plus <pad> and <eos>), tokenizer_config.json,
// special_tokens_map.json and generation_config.json; *n_params = its parameter count. 0, or -1 with a message.
int demo_write_model(const char *dir, const DemoModelSpec *spec, size_t *n_params, char *err, size_t err_len);

typedef struct {
    int tools;           // 1: the tools task (below)
    int digits;          // operands are uniform among the numbers of exactly this many digits
    int n_train, n_heldout, n_validation, n_sft;
    uint64_t seed;
} DemoDataSpec;

// Writes, in dir, distinct problems "a+b=" split four ways: heldout.jsonl and validation.jsonl
// ({"prompt", "answer"}), train.jsonl (the same form; GRPO's prompts) and sft.jsonl (the first n_sft training
// problems as {"prompt", "completion"}). Every number is written least significant digit first, zero-padded: the
// operands to `digits` digits, the sum to digits + 1 ("21+43=" is 12 + 34, its answer "460" is 064), and the
// answer is that string. No problem is in two of held-out, validation and training. The tools task writes
// {"prompt": [{"role": "user", "content": "a+b"}], "answer": "<sum>"} (plain decimal numbers; operands from
// 5 * 10^(digits-1), so every sum has digits + 1 digits: one answer length) and SFT rows whose
// completion is the transcript [assistant: <tool_call>...a+b...</tool_call>, tool: <sum>, assistant: <sum>].
// 0, or -1 with a message.
int demo_write_data(const char *dir, const DemoDataSpec *spec, char *err, size_t err_len);

// ---- processes (trainer/demo_proc.c) ------------------------------------------------------------------

// Starts argv (argv[0] a path) with stdout and stderr appended to log; extra environment NAME=VALUE entries
// (NULL-terminated, may be NULL). The child dies with this process. Returns the pid, or -1 with a message.
pid_t demo_spawn(char *const *argv, char *const *env, const char *log, char *err, size_t err_len);
// Prints the last n lines of a log to stderr, indented.
void demo_print_tail(const char *path, int n);
// SIGTERM, then SIGKILL after grace_s seconds; reaps the child. Returns its wait status.
int demo_stop(pid_t pid, double grace_s);
// A TCP port on 127.0.0.1 that is free now, from below the ephemeral range where one is; -1 when none is.
int demo_free_port(void);
// Seconds on a monotonic clock.
double demo_now(void);
// Set by SIGINT / SIGTERM once demo_install_signals ran.
extern volatile int demo_interrupted;
void demo_install_signals(void);

// ---- plot (trainer/demo_plot.c) -----------------------------------------------------------------------

typedef struct {
    int n;
    const double *x, *y;
} DemoSeries;

// An SVG line chart of mean training reward per GRPO step and held-out accuracy per evaluation point (both in
// [0, 1], x = GRPO step), with axes, ticks, labels, a title and a legend. 0, or -1 with a message.
int demo_write_svg(const char *path, const char *title, const DemoSeries *reward, const DemoSeries *accuracy,
                   int max_step, char *err, size_t err_len);

#endif
