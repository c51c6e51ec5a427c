// trainer/demo.c — `tandem-train demo` (see trainer/demo.h): options, the phases, the summary.
#define _GNU_SOURCE
#include "trainer/demo.h"
#include "trainer/demo_internal.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/ops.h"
#include "shared/cli.h"
#include "shared/version.h"
#include "trainer/make_dirs.h"
#include "trainer/remove_tree.h"

static const DemoOptions kDefaults = {
    .output_dir = "out/demo", .device = "auto", .seed = 1, .threads = 0, .task = "add", .max_tool_turns = 1,
    .digits = 2, .n_train = 6000, .n_heldout = 500, .n_validation = 500, .n_sft = 6000,
    .hidden = 256, .layers = 2, .heads = 8, .intermediate = 512, .init_std = 0.02,
    .sft_batch = 64, .sft_min_steps = 100, .sft_max_steps = 1000, .sft_check_every = 10, .sft_lr = 1e-3,
    .sft_target = 0.25,
    .grpo_steps = 600, .prompts_per_step = 256, .num_generations = 4, .eval_every = 25,
    .grpo_lr = 5e-4, .temperature = 1.0, .stop_accuracy = 0.95, .stop_patience = 2, .max_staleness = 0,
};

// --task tools: the same options with the tools task's defaults (a 5-digit a + b that the calculator answers).
static const DemoOptions kToolsDefaults = {
    .output_dir = "out/demo-tools", .device = "auto", .seed = 1, .threads = 0, .task = "tools", .max_tool_turns = 1,
    .digits = 5, .n_train = 6000, .n_heldout = 200, .n_validation = 200, .n_sft = 6000,
    .hidden = 256, .layers = 2, .heads = 8, .intermediate = 512, .init_std = 0.02,
    .sft_batch = 32, .sft_min_steps = 30, .sft_max_steps = 400, .sft_check_every = 1, .sft_lr = 1e-3,
    .sft_target = 0.2,
    .grpo_steps = 200, .prompts_per_step = 32, .num_generations = 4, .eval_every = 10,
    .grpo_lr = 5e-4, .temperature = 0.6, .stop_accuracy = 0.9, .stop_patience = 2, .max_staleness = 0,
};

// Option rows: N(flag, field, min, help) is an int of at least min, POS(flag, field, help) a double above 0.
#define OPT(flag_, type_, field, bounds_, lo, hi, lo_excl, help_)                                                 \
    {.flag = flag_, .type = type_, .offset = offsetof(DemoOptions, field), .help = help_, .bounds = bounds_, .min = lo, \
     .max = hi, .min_exclusive = lo_excl}
#define N(flag, field, lo, help) OPT(flag, CLI_INT, field, CLI_BOUND_MIN, lo, 0, 0, help)
#define POS(flag, field, help) OPT(flag, CLI_DOUBLE, field, CLI_BOUND_MIN, 0, 0, 1, help)
static const CliOption kOptions[] = {
    {.flag = "--output-dir", .type = CLI_TEXT, .offset = offsetof(DemoOptions, output_dir), .value_name = "DIR",
     .help = "folder for everything the demo writes (a previous demo there is replaced)"},
    {.flag = "--task", .type = CLI_TEXT, .offset = offsetof(DemoOptions, task), .value_name = "add|tools",
     .help = "add: a + b answered by the model itself; tools: a + b with large operands, answered through the "
             "built-in calculator over multi-turn rollouts (its own defaults: --digits 5, --sft-target 0.2, "
             "--sft-min-steps 30, --sft-check-every 1, --sft-batch-size 32, --sft-max-steps 400, "
             "--prompts-per-step 32, --eval-every 10, --grpo-steps 200, --temperature 0.6, --stop-accuracy 0.9, "
             "200 validation and held-out problems, --output-dir out/demo-tools; given options override them)",
     .choices = "add|tools"},
    N("--max-tool-turns", max_tool_turns, 1, "tools: calculator turns an episode may take (max_tool_calling_iterations)"),
    {.flag = "--device", .type = CLI_TEXT, .offset = offsetof(DemoOptions, device), .value_name = "auto|cpu|cuda",
     .help = "trainer and rollout server (auto = cuda when a GPU is visible)", .choices = "auto|cpu|cuda"},
    OPT("--seed", CLI_LONG, seed, CLI_BOUND_MIN | CLI_BOUND_MAX, 0, 9007199254740992.0, 0,
        "seed of the model init, the data, SFT and GRPO"),
    N("--threads", threads, 0, "CPU threads per process (OpenBLAS); 0 = every core"),
    OPT("--digits", CLI_INT, digits, CLI_BOUND_MIN | CLI_BOUND_MAX, 1, 9, 0,
        "task: a + b with operands of exactly this many digits, every number written least significant digit first"),
    N("--train-size", n_train, 1, "training problems (GRPO prompts)"),
    N("--heldout-size", n_heldout, 1, "held-out problems (none of them is a training problem)"),
    N("--validation-size", n_validation, 1, "validation problems: decide when SFT and GRPO stop (disjoint from the others)"),
    N("--sft-size", n_sft, 1, "training problems with their answers for the SFT warm-up"),
    N("--hidden-size", hidden, 1, "model: hidden size"),
    N("--layers", layers, 1, "model: decoder layers"),
    N("--heads", heads, 1, "model: attention heads"),
    N("--intermediate-size", intermediate, 1, "model: MLP size"),
    POS("--init-std", init_std, "model: std of the random normal init of every matrix"),
    OPT("--sft-target", CLI_DOUBLE, sft_target, CLI_BOUND_MIN | CLI_BOUND_MAX, 0, 1, 0,
        "SFT warm-up stops at the first check where validation accuracy reaches this"),
    N("--sft-min-steps", sft_min_steps, 1, "SFT warm-up: steps before the first check"),
    N("--sft-check-every", sft_check_every, 1, "SFT warm-up: steps between checks (every step once past half the target)"),
    N("--sft-max-steps", sft_max_steps, 1, "SFT warm-up: most steps (stops there whatever the accuracy)"),
    N("--sft-batch-size", sft_batch, 1, "SFT warm-up: sequences per step"),
    POS("--sft-learning-rate", sft_lr, "SFT warm-up: AdamW learning rate (20 warmup steps, then constant)"),
    N("--grpo-steps", grpo_steps, 1, "GRPO: most optimizer steps (the cap when the validation target is not reached)"),
    OPT("--stop-accuracy", CLI_DOUBLE, stop_accuracy, CLI_BOUND_MIN, 0, 0, 0,
        "GRPO stops once validation accuracy is at least this at --stop-patience evaluations in a row (above 1: never)"),
    N("--stop-patience", stop_patience, 1, "GRPO: evaluations in a row at --stop-accuracy that stop it"),
    N("--prompts-per-step", prompts_per_step, 1, "GRPO: prompts per step"),
    N("--num-generations", num_generations, 2, "GRPO: completions per prompt (group size)"),
    POS("--grpo-learning-rate", grpo_lr, "GRPO: peak AdamW learning rate (10 warmup steps, then a cosine towards 0 at --grpo-steps, one level per segment between evaluations)"),
    POS("--temperature", temperature, "GRPO: sampling temperature of the rollouts"),
    N("--eval-every", eval_every, 1, "GRPO: validation and held-out accuracy every k steps (and before)"),
    N("--max-staleness", max_staleness, 0,
      "GRPO: rounds the rollout server generates ahead with the weights it holds while the trainer trains "
      "(tandem-train --max-staleness; above 0 the rollout importance-sampling correction is on)"),
};
#undef OPT
#undef N
#undef POS

static const CliSpec kSpec = {
    .command = "tandem-train demo",
    .synopsis = "[options]",
    .description =
        "The whole of tandem on a built-in task, with nothing to download: creates a tiny Llama and its\n"
        "tokenizer, writes a + b problems (train, validation and held-out), SFT-warms the model, measures\n"
        "accuracy over HTTP through a rollout server, runs GRPO against that server (weights synced every\n"
        "step) until validation accuracy holds --stop-accuracy for --stop-patience evaluations (at most\n"
        "--grpo-steps), and writes OUTPUT_DIR/metrics.jsonl, demo_summary.json and demo.svg (reward and\n"
        "held-out accuracy per step). The held-out set is only measured: no decision looks at it.",
    .options = kOptions,
    .n_options = sizeof kOptions / sizeof kOptions[0],
};

// CLI_OK, CLI_HELP, CLI_VERSION, or CLI_ERROR after printing why.
static int parse_args(DemoOptions *o, int argc, char **argv) {
    *o = kDefaults;
    // The task picks the defaults the other options start from.
    for (int i = 1; i < argc; i++)
        if ((!strcmp(argv[i], "--task") && i + 1 < argc && !strcmp(argv[i + 1], "tools")) ||
            !strcmp(argv[i], "--task=tools"))
            *o = kToolsDefaults;
    char err[512];
    int rc = cli_parse(&kSpec, o, argc, argv, NULL, err, sizeof err);
    if (rc == CLI_OK && o->sft_max_steps < o->sft_min_steps) {
        snprintf(err, sizeof err, "tandem-train demo: --sft-max-steps %d is below --sft-min-steps %d", o->sft_max_steps,
                 o->sft_min_steps);
        rc = CLI_ERROR;
    }
    if (rc == CLI_ERROR) fprintf(stderr, "%s\n", err);
    return rc;
}

// ---- the run ---------------------------------------------------------------------------------------------

void demo_path_in(const Demo *d, char *out, size_t len, const char *rel) { snprintf(out, len, "%s/%s", d->dir, rel); }

void demo_say(const Demo *d, const char *fmt, ...) {
    double t = demo_now() - d->t0;
    fprintf(stderr, "[demo %2dm%02ds] ", (int)t / 60, (int)t % 60);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

// A previous demo's folder is cleared (only what a demo writes); any other non-empty folder is refused.
static int prepare_dir(Demo *d, char *err, size_t err_len) {
    char marker[PATH_IN];
    demo_path_in(d, marker, sizeof marker, ".tandem-demo");
    DIR *dp = opendir(d->dir);
    if (dp) {
        int others = 0;
        struct dirent *e;
        while ((e = readdir(dp)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) others++;
        closedir(dp);
        if (others && access(marker, F_OK) != 0) {
            snprintf(err, err_len, "%s is not empty and holds no earlier demo: choose another --output-dir", d->dir);
            return -1;
        }
        static const char *const mine[] = {"model", "data", "sft", "logs", "eval", "metrics.jsonl",
                                           "demo_summary.json", "demo.svg", ".tandem-demo"};
        for (size_t i = 0; i < sizeof mine / sizeof *mine; i++) {
            char p[PATH_IN];
            demo_path_in(d, p, sizeof p, mine[i]);
            if (remove_tree(p, err, err_len) != 0) return -1;
        }
        if ((dp = opendir(d->dir))) {
            while ((e = readdir(dp))) {
                if (strncmp(e->d_name, "checkpoint-", 11)) continue;
                char p[DIR_MAX + 300];
                snprintf(p, sizeof p, "%s/%s", d->dir, e->d_name);
                if (remove_tree(p, err, err_len) != 0) {
                    closedir(dp);
                    return -1;
                }
            }
            closedir(dp);
        }
    } else if (make_dirs(d->dir, err, err_len) != 0) {
        return -1;
    }
    FILE *f = fopen(marker, "w");
    if (!f) {
        snprintf(err, err_len, "cannot write in %s: %s", d->dir, strerror(errno));
        return -1;
    }
    fputs("written by tandem-train demo; a later demo with this --output-dir replaces this folder's demo files\n", f);
    fclose(f);
    char logs[PATH_IN], ev[PATH_IN];
    demo_path_in(d, logs, sizeof logs, "logs");
    demo_path_in(d, ev, sizeof ev, "eval");
    if ((mkdir(logs, 0755) != 0 && errno != EEXIST) || (mkdir(ev, 0755) != 0 && errno != EEXIST)) {
        snprintf(err, err_len, "cannot create folders in %s: %s", d->dir, strerror(errno));
        return -1;
    }
    return 0;
}

// Reads the complete lines of a growing JSONL file past *off and hands each parsed object to fn.
typedef void (*LineFn)(Demo *d, json_t *row, void *user);
static void follow(Demo *d, const char *path, long *off, LineFn fn, void *user) {
    FILE *f = fopen(path, "r");
    if (!f) return;
    if (fseek(f, *off, SEEK_SET) != 0) {
        fclose(f);
        return;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, f)) > 0) {
        if (line[n - 1] != '\n') break; // written halfway: read it next time
        *off += n;
        json_t *row = json_loads(line, 0, NULL);
        if (row && fn) fn(d, row, user);
        json_decref(row);
    }
    free(line);
    fclose(f);
}

// Runs a child to its end, following its metrics file (when given). 0 when it exits 0; else -1 with a message
// (its log's tail is printed).
static int run_child(Demo *d, char **argv, const char *name, const char *metrics, long *off, LineFn fn, void *user,
                     char *err, size_t err_len) {
    char log[PATH_IN];
    snprintf(log, sizeof log, "%s/logs/%s.log", d->dir, name);
    pid_t pid = demo_spawn(argv, d->env, log, err, err_len);
    if (pid < 0) return -1;
    int status = 0;
    for (;;) {
        if (metrics) follow(d, metrics, off, fn, user);
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid) break;
        if (demo_interrupted) {
            demo_stop(pid, 10);
            snprintf(err, err_len, "interrupted by %s: stopped every process", strsignal(demo_interrupted));
            return -1;
        }
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (metrics) follow(d, metrics, off, fn, user);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;
    if (WIFEXITED(status)) snprintf(err, err_len, "%s exited with code %d (log: %s)", name, WEXITSTATUS(status), log);
    else snprintf(err, err_len, "%s was killed by signal %d (log: %s)", name, WTERMSIG(status), log);
    demo_print_tail(log, 12);
    return -1;
}

// ---- phases ---------------------------------------------------------------------------------------------

// Starts tandem-serve on a model folder (with a ZeroMQ control endpoint when control is not NULL) and waits for
// its "listening on" line, which carries the HTTP port it picked.
static int start_server(Demo *d, const char *model, const char *control, const char *log, pid_t *pid, int *port,
                        char *err, size_t err_len) {
    char seed[24];
    snprintf(seed, sizeof seed, "%lld", d->o.seed);
    char *argv[32] = {d->serve_bin, "--model", (char *)model, "--port", "0", "--device", d->device,
                      "--kv-cache-memory", "64M", "--max-num-seqs", "512", "--seed", seed, NULL};
    if (control) argv[13] = "--control", argv[14] = (char *)control, argv[15] = NULL;
    *port = 0;
    *pid = demo_spawn(argv, d->env, log, err, err_len);
    if (*pid < 0) return -1;
    double deadline = demo_now() + 300;
    while (demo_now() < deadline && !demo_interrupted) {
        int status;
        if (waitpid(*pid, &status, WNOHANG) == *pid) {
            *pid = 0;
            snprintf(err, err_len, "tandem-serve exited during start (log: %s)", log);
            demo_print_tail(log, 12);
            return -1;
        }
        FILE *f = fopen(log, "r");
        char line[1024];
        while (f && fgets(line, sizeof line, f)) {
            const char *p = strstr(line, "listening on http://");
            const char *colon = p ? strrchr(p, ':') : NULL;
            if (colon) *port = atoi(colon + 1);
        }
        if (f) fclose(f);
        if (*port > 0) return 0;
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (demo_interrupted) snprintf(err, err_len, "interrupted by %s: stopped every process", strsignal(demo_interrupted));
    else snprintf(err, err_len, "tandem-serve did not start within 300 s (log: %s)", log);
    return -1;
}

// Greedy exact-answer accuracy and well-formed rate of a JSONL through a server's OpenAI API: `tandem-train eval`.
// What an evaluation's second figure counts.
static const char *form_label(const Demo *d) {
    return demo_is_tools(&d->o) ? "episodes with a calculator call" : "well-formed answers";
}

// The tools task: multi-turn episodes with the calculator (trainer/demo_eval_tools.c); *form is then the share of
// episodes with a calculator call that ran.
static int eval_file(Demo *d, int port, const char *data, const char *name, const char *out, double *acc,
                     double *form, double *exact, char *err, size_t err_len) {
    if (demo_is_tools(&d->o)) return demo_eval_tools(d, port, data, out, acc, form, exact, err, err_len);
    char url[64], tokens[16], log[PATH_IN], form_regex[32];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    snprintf(log, sizeof log, "%s/logs/%s.log", d->dir, name);
    snprintf(tokens, sizeof tokens, "%d", completion_tokens(&d->o) + 1);
    // Well-formed: exactly the sum's width. answer_match compares numbers, so a completion that dropped a leading
    // "0" (the units digit, written first) would still count; the width check makes that visible.
    snprintf(form_regex, sizeof form_regex, "[0-9]{%d}", d->o.digits + 1);
    char *argv[24] = {d->train_bin, "eval", "--url", url, "--data", (char *)data, "--rewards",
                      "answer_match,regex_format", "--format-regex", form_regex, "--max-tokens", tokens,
                      "--temperature", "0", "--concurrency", "64", NULL};
    if (out) argv[16] = "--output", argv[17] = (char *)out, argv[18] = NULL;
    double t = demo_now();
    if (run_child(d, argv, name, NULL, NULL, NULL, NULL, err, err_len) != 0) return -1;
    d->t_eval += demo_now() - t;
    // Its last JSON line holds the figures.
    FILE *f = fopen(log, "r");
    char *line = NULL;
    size_t cap = 0;
    json_t *sum = NULL;
    while (f && getline(&line, &cap, f) > 0) {
        if (line[0] != '{') continue;
        json_t *j = json_loads(line, 0, NULL);
        if (j && json_object_get(j, "rows")) json_decref(sum), sum = j;
        else json_decref(j);
    }
    free(line);
    if (f) fclose(f);
    json_t *a = sum ? json_object_get(sum, "rewards/answer_match/mean") : NULL;
    json_t *w = sum ? json_object_get(sum, "rewards/regex_format/mean") : NULL;
    int ok = json_is_number(a) && json_is_number(w) && json_integer_value(json_object_get(sum, "failed_rows")) == 0;
    if (ok) *acc = json_number_value(a), *form = json_number_value(w);
    else snprintf(err, err_len, "%s gave no figures (log: %s)", name, log);
    json_decref(sum);
    return ok ? 0 : -1;
}

static void sft_line(Demo *d, json_t *row, void *user) {
    long long step = json_integer_value(json_object_get(row, "step"));
    if (step % 25 == 0)
        demo_say(d, "  sft  step %4lld  loss %.4f", step, json_number_value(json_object_get(row, "loss")));
}

// SFT warm-up until the model answers a first share of the validation problems exactly: segments of
// sft_check_every steps (each resumes the last one exactly), a check after each through a server on the new
// checkpoint. The held-out problems play no part in when it stops.
static int run_sft(Demo *d, char *ckpt, size_t ckpt_len, char *err, size_t err_len) {
    char model[PATH_IN], data[PATH_IN], val[PATH_IN], out[PATH_IN], metrics[PATH_IN];
    demo_path_in(d, model, sizeof model, "model");
    demo_path_in(d, data, sizeof data, "data/sft.jsonl");
    demo_path_in(d, val, sizeof val, "data/validation.jsonl");
    demo_path_in(d, out, sizeof out, "sft");
    demo_path_in(d, metrics, sizeof metrics, "sft/metrics.jsonl");
    char steps[16], batch[16], lr[32], seed[24];
    snprintf(batch, sizeof batch, "%d", d->o.sft_batch);
    snprintf(lr, sizeof lr, "%g", d->o.sft_lr);
    snprintf(seed, sizeof seed, "%lld", d->o.seed);
    demo_say(d, "SFT warm-up: %d sequences a step, learning rate %g (20 warmup steps, then constant), until %.0f %% of the "
           "%d validation problems are answered exactly (checked every %d steps from step %d, every step past half of it; at most %d steps)",
        d->o.sft_batch, d->o.sft_lr, 100 * d->o.sft_target, d->o.n_validation, d->o.sft_check_every,
        d->o.sft_min_steps, d->o.sft_max_steps);
    double t = demo_now();
    long off = 0;
    int done = 0, every = d->o.sft_check_every;
    while (done < d->o.sft_max_steps) {
        int target = done == 0 ? d->o.sft_min_steps : done + every;
        if (target > d->o.sft_max_steps) target = d->o.sft_max_steps;
        snprintf(steps, sizeof steps, "%d", target);
        char name[32];
        snprintf(name, sizeof name, "sft-to-step-%04d", target);
        char *argv[48] = {d->train_bin, "--mode", "sft", "--model", model, "--train-file", data, "--output-dir", out,
                          "--per-device-train-batch-size", batch, "--max-steps", steps, "--learning-rate", lr,
                          "--lr-scheduler-type", "constant_with_warmup", "--warmup-steps", "20", "--weight-decay", "0",
                          "--save-steps", "0", "--save-total-limit", "1", "--logging-steps", "1", "--seed", seed,
                          "--device", d->device, "--max-prompt-length", "0", "--gradient-checkpointing", "false", NULL};
        if (done > 0) {
            int k = 0;
            while (argv[k]) k++;
            argv[k++] = "--resume", argv[k++] = "latest", argv[k] = NULL;
        }
        if (run_child(d, argv, name, metrics, &off, sft_line, NULL, err, err_len) != 0) return -1;
        done = target;
        snprintf(ckpt, ckpt_len, "%s/sft/checkpoint-%d", d->dir, done);
        // The check: a plain server (no control channel) on the new checkpoint.
        char log[PATH_IN], ename[32];
        snprintf(log, sizeof log, "%s/logs/sft-check-%04d-server.log", d->dir, done);
        snprintf(ename, sizeof ename, "sft-check-%04d", done);
        pid_t pid;
        int port;
        double acc = 0, form = 0;
        if (start_server(d, ckpt, NULL, log, &pid, &port, err, err_len) != 0) return -1;
        int rc = eval_file(d, port, val, ename, NULL, &acc, &form, NULL, err, err_len);
        demo_stop(pid, 5);
        if (rc != 0) return -1;
        if (d->n_checks < 64) d->check_step[d->n_checks] = done, d->check_acc[d->n_checks++] = acc;
        demo_say(d, "  sft  step %4d  validation accuracy %.1f %% (%s %.1f %%)", done, 100 * acc, form_label(d), 100 * form);
        if (acc >= d->o.sft_target) break;
        // Accuracy climbs in a sudden jump once it starts (over 20 points in 5 steps at the default size): past
        // half the target every step is checked, so the start of GRPO stays close to the target.
        if (acc >= 0.5 * d->o.sft_target) every = 1;
        if (done >= d->o.sft_max_steps)
            demo_say(d, "  sft  stopped at --sft-max-steps %d below the target of %.0f %%", done, 100 * d->o.sft_target);
    }
    d->sft_steps = done;
    d->t_sft = demo_now() - t;
    demo_say(d, "SFT done in %.1f s after %d steps: %s", d->t_sft, d->sft_steps, ckpt);
    return 0;
}

// Validation and held-out accuracy at a GRPO step, through the rollout server. Validation decides when GRPO
// stops; the held-out figure is only recorded (summary, plot), so the reported accuracy is not selected on.
static int evaluate(Demo *d, int step, char *err, size_t err_len) {
    char heldout[PATH_IN], val[PATH_IN], out[PATH_IN], name[32], vname[40];
    demo_path_in(d, heldout, sizeof heldout, "data/heldout.jsonl");
    demo_path_in(d, val, sizeof val, "data/validation.jsonl");
    snprintf(out, sizeof out, "%s/eval/step-%04d.jsonl", d->dir, step);
    snprintf(name, sizeof name, "eval-step-%04d", step);
    snprintf(vname, sizeof vname, "validation-step-%04d", step);
    if (d->n_evals == 256) {
        snprintf(err, err_len, "more than 256 evaluations: raise --eval-every");
        return -1;
    }
    int i = d->n_evals;
    double vform = 0;
    if (eval_file(d, d->http_port, val, vname, NULL, &d->eval_val[i], &vform, NULL, err, err_len) != 0) return -1;
    if (eval_file(d, d->http_port, heldout, name, out, &d->eval_acc[i], &d->eval_form[i], &d->eval_exact[i], err,
                  err_len) != 0)
        return -1;
    d->eval_step[i] = step;
    d->n_evals++;
    demo_say(d, "GRPO step %d: validation accuracy %.1f %%, held-out accuracy %.1f %% (%d problems each, greedy; "
             "held-out: %s %.1f %%)", step, 100 * d->eval_val[i], 100 * d->eval_acc[i],
             d->o.n_heldout, form_label(d), 100 * d->eval_form[i]);
    if (demo_is_tools(&d->o))
        demo_say(d, "  held-out final answers written exactly as taught (\"=\" and the sum's digits, nothing else): %.1f %%",
                 100 * d->eval_exact[i]);
    return 0;
}

// Progress of GRPO: one line every 10 steps with the mean training reward over them.
typedef struct {
    double t_last, sum;
    int n;
} GrpoFollow;

static void grpo_line(Demo *d, json_t *row, void *user) {
    GrpoFollow *g = user;
    long long step = json_integer_value(json_object_get(row, "step"));
    double r = json_number_value(json_object_get(row, "reward"));
    if (step >= 1 && step <= d->o.grpo_steps) d->reward[step - 1] = r;
    g->sum += r, g->n++;
    if (step % 10 != 0) return;
    double now = demo_now();
    demo_say(d, "  grpo step %4lld (at most %d)  mean reward %.3f over the last %d steps  (%.2f s/step)", step, d->o.grpo_steps,
        g->sum / g->n, g->n, (now - g->t_last) / g->n);
    g->t_last = now, g->sum = 0, g->n = 0;
}

// Whether validation accuracy has been at least --stop-accuracy at the last --stop-patience evaluations after
// GRPO steps (the one before GRPO does not count).
static int reached_target(const Demo *d) {
    int n = d->o.stop_patience;
    if (d->n_evals - 1 < n) return 0;
    for (int i = d->n_evals - n; i < d->n_evals; i++)
        if (d->eval_val[i] < d->o.stop_accuracy) return 0;
    return 1;
}

// Learning rate of the GRPO segment that ends at `target`: a cosine from the peak towards 0 at --grpo-steps (the
// cap), taken at the segment's middle step (one level per segment: each segment is its own trainer run, whose own
// schedule would restart with its --max-steps). A run that reaches the validation target early stops near the
// peak; one that hovers just below it gets smaller steps, which is what lets it settle above the target.
static double segment_lr(const DemoOptions *o, int done, int target) {
    double mid = 0.5 * (done + target);
    return o->grpo_lr * 0.5 * (1.0 + cos(M_PI * mid / o->grpo_steps));
}

// GRPO in segments of eval_every steps: each segment resumes the last one's checkpoint (exactly: same data order,
// optimizer state and sampling seeds), then validation and held-out sets are scored while no trainer runs. It
// stops once validation accuracy holds the target for --stop-patience evaluations, or at --grpo-steps.
static int run_grpo(Demo *d, const char *model, char *err, size_t err_len) {
    char data[PATH_IN], metrics[PATH_IN], control[64];
    demo_path_in(d, data, sizeof data, "data/train.jsonl");
    demo_path_in(d, metrics, sizeof metrics, "metrics.jsonl");
    snprintf(control, sizeof control, "tcp://127.0.0.1:%d", d->control_port);
    char gens[16], batch[16], lr[32], temp[32], seed[24], comp[16], steps[16], staleness[16], turns[16];
    snprintf(turns, sizeof turns, "%d", d->o.max_tool_turns);
    snprintf(gens, sizeof gens, "%d", d->o.num_generations);
    snprintf(batch, sizeof batch, "%d", d->o.num_generations * d->o.prompts_per_step);
    snprintf(temp, sizeof temp, "%g", d->o.temperature);
    snprintf(seed, sizeof seed, "%lld", d->o.seed);
    snprintf(comp, sizeof comp, "%d", demo_is_tools(&d->o) ? tools_completion_tokens(&d->o) : completion_tokens(&d->o));
    snprintf(staleness, sizeof staleness, "%d", d->o.max_staleness);
    if (d->o.max_staleness > 0)
        demo_say(d, "GRPO asynchronous: the rollout server generates up to %d round%s ahead with the weights it holds "
                 "(max_staleness %d), the rollout importance-sampling correction on", d->o.max_staleness,
                 d->o.max_staleness == 1 ? "" : "s", d->o.max_staleness);
    demo_say(d, "GRPO: %d prompts x %d completions a step (temperature %g), reward %s, beta 0, "
             "learning rate %g (10 warmup steps, then a cosine towards 0 at step %d, one level per segment), weights "
             "pushed to the rollout server after every "
             "step; stops once validation accuracy is at least %.0f %% at %d evaluations in a row (every %d steps), "
             "or after %d steps", d->o.prompts_per_step, d->o.num_generations, d->o.temperature,
             demo_is_tools(&d->o) ? "on the final answer (below)" : "answer_match (exact answer)", d->o.grpo_lr,
             d->o.grpo_steps, 100 * d->o.stop_accuracy, d->o.stop_patience, d->o.eval_every, d->o.grpo_steps);
    if (demo_is_tools(&d->o))
        demo_say(d, "GRPO with tools: each completion is a multi-turn episode (--tools calculator, at most %d "
                 "calculator turn%s, %s completion tokens with the tool turns, which are masked out of the loss); the reward "
                 "scores the final answer: 0.8 answer_match (the number in it equals the sum) + 0.2 regex_format "
                 "(it is \"=\" and digits, nothing else)",
                 d->o.max_tool_turns, d->o.max_tool_turns == 1 ? "" : "s", comp);
    long off = 0;
    GrpoFollow g = {.t_last = demo_now()};
    double t = demo_now();
    d->stop_reason = "step cap (--grpo-steps)";
    for (int done = 0; done < d->o.grpo_steps;) {
        int target = done + d->o.eval_every < d->o.grpo_steps ? done + d->o.eval_every : d->o.grpo_steps;
        snprintf(steps, sizeof steps, "%d", target);
        snprintf(lr, sizeof lr, "%.6g", segment_lr(&d->o, done, target));
        char name[32];
        snprintf(name, sizeof name, "grpo-to-step-%04d", target);
        // Two trainer defaults are turned off because they only cost time here: activation checkpointing (the
        // model is tiny) and the rollout importance-sampling correction (trainer and server compute the same
        // logprobs on the CPU; on a GPU their bf16 differences are small next to the learning rate's steps).
        // With rounds generated ahead (--max-staleness above 0) a completion may come from weights a step or more
        // older than the trainer's: the importance-sampling correction is what weighs it for that, so it is on.
        char *argv[64] = {d->train_bin, "--model", (char *)model, "--train-file", data, "--output-dir", d->dir,
                          "--rollout-servers", control, "--rewards", "answer_match", "--num-generations", gens,
                          "--per-device-train-batch-size", batch, "--max-completion-length", comp,
                          "--learning-rate", lr, "--lr-scheduler-type", "constant_with_warmup", "--warmup-steps", "10",
                          "--beta", "0", "--temperature", temp, "--max-steps", steps, "--logging-steps", "1",
                          "--save-steps", "0", "--save-total-limit", "1", "--seed", seed, "--device", d->device,
                          "--weight-sync-transport", "zmq", "--max-prompt-length", "0",
                          "--gradient-checkpointing", "false", "--vllm-importance-sampling-correction",
                          d->o.max_staleness > 0 ? "true" : "false", "--max-staleness", staleness, NULL};
        int k = 0;
        while (argv[k]) k++;
        if (demo_is_tools(&d->o)) {   // multi-turn rollouts: the built-in calculator answers the policy's calls
            argv[k++] = "--tools", argv[k++] = "calculator", argv[k++] = "--max-tool-calling-iterations",
            argv[k++] = turns;
            // The final answer as the warm-up wrote it, "=" and the digits with nothing after: answer_match alone
            // lets a trailing '"}}</tool_call>' (the call's ending) drift in unpunished. Its weight is small, so an
            // answer without the calculator's help earns little.
            argv[k++] = "--rewards", argv[k++] = "answer_match,regex_format", argv[k++] = "--format-regex",
            argv[k++] = "=[0-9]+", argv[k++] = "--reward-weights", argv[k++] = "0.8,0.2", argv[k] = NULL;
        }
        if (done > 0) argv[k++] = "--resume", argv[k++] = "latest", argv[k] = NULL;
        double t_seg = demo_now();
        if (run_child(d, argv, name, metrics, &off, grpo_line, &g, err, err_len) != 0) return -1;
        d->t_grpo += demo_now() - t_seg;
        done = d->grpo_done = target;
        double t_ev = demo_now();
        if (evaluate(d, done, err, err_len) != 0) return -1;
        g.t_last += demo_now() - t_ev;
        if (reached_target(d)) {
            d->stop_reason = "validation target reached";
            demo_say(d, "validation accuracy at least %.0f %% at %d evaluations in a row: GRPO stops at step %d",
                     100 * d->o.stop_accuracy, d->o.stop_patience, done);
            break;
        }
    }
    if (!strcmp(d->stop_reason, "step cap (--grpo-steps)"))
        demo_say(d, "GRPO stopped at --grpo-steps %d before validation accuracy held %.0f %%", d->grpo_done,
                 100 * d->o.stop_accuracy);
    demo_say(d, "GRPO done in %.1f s (%.1f s training, %.1f s evaluation)", demo_now() - t, d->t_grpo, d->t_eval);
    return 0;
}

static void fmt_duration(double s, char *buf, size_t len) {
    int t = (int)(s + 0.5);
    snprintf(buf, len, "%dm%02ds", t / 60, t % 60);
}

int demo_main(int argc, char **argv) {
    Demo *d = calloc(1, sizeof *d);
    if (!d) return 1;
    int pr = parse_args(&d->o, argc, argv);
    if (pr != CLI_OK) {
        if (pr == CLI_HELP) cli_usage(&kSpec, &kDefaults, stdout);
        if (pr == CLI_VERSION) tandem_print_version(stdout, "tandem-train demo");
        free(d);
        return pr == CLI_ERROR ? 2 : 0;
    }
    d->t0 = demo_now();
    char err[2048] = "";
    int rc = 1;
    size_t n_params = 0;
    // The demo is one single-process run: a launch contract in the environment is not meant for its children.
    static const char *const contract[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};
    for (size_t i = 0; i < sizeof contract / sizeof *contract; i++) unsetenv(contract[i]);
    demo_install_signals();
    if (!strcmp(d->o.device, "auto")) snprintf(d->device, sizeof d->device, "%s", ops_backend_available(OPS_BACKEND_CUDA) ? "cuda" : "cpu");
    else snprintf(d->device, sizeof d->device, "%s", d->o.device);
    if (!strcmp(d->device, "cuda") && !ops_backend_available(OPS_BACKEND_CUDA)) {
        fprintf(stderr, "tandem-train demo: --device cuda, but this build has no CUDA backend or no GPU is visible\n");
        free(d);
        return 2;
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    d->threads = d->o.threads > 0 ? d->o.threads : cores > 0 ? (int)cores : 1;
    snprintf(d->env_buf[0], sizeof d->env_buf[0], "OPENBLAS_NUM_THREADS=%d", d->threads);
    snprintf(d->env_buf[1], sizeof d->env_buf[1], "OMP_NUM_THREADS=%d", d->threads);
    d->env[0] = d->env_buf[0], d->env[1] = d->env_buf[1], d->env[2] = NULL;
    d->reward = malloc((size_t)d->o.grpo_steps * sizeof(double));
    for (int s = 0; d->reward && s < d->o.grpo_steps; s++) d->reward[s] = NAN;
    // Children come from this binary's folder.
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    self[n > 0 ? n : 0] = 0;
    char *slash = strrchr(self, '/');
    if (slash) *slash = 0;
    if (n <= 0 || strlen(self) >= DIR_MAX) snprintf(self, sizeof self, ".");
    memcpy(d->bin_dir, self, strlen(self) + 1);
    snprintf(d->train_bin, sizeof d->train_bin, "%s/tandem-train", d->bin_dir);
    snprintf(d->serve_bin, sizeof d->serve_bin, "%s/tandem-serve", d->bin_dir);
    if (strlen(d->o.output_dir) >= sizeof d->dir) {
        snprintf(err, sizeof err, "--output-dir is longer than %zu characters", sizeof d->dir - 1);
        goto out;
    }
    snprintf(d->dir, sizeof d->dir, "%s", d->o.output_dir);
    if (access(d->serve_bin, X_OK) != 0) {
        snprintf(err, sizeof err, "%s is missing: build the tandem-serve target too", d->serve_bin);
        goto out;
    }
    if (!d->reward || prepare_dir(d, err, sizeof err) != 0) goto out;
    demo_say(d, "tandem demo in %s: device %s, %d CPU thread%s per process", d->dir, d->device, d->threads,
        d->threads == 1 ? "" : "s");
    // 1. The model, created here.
    char model[PATH_IN], data[PATH_IN], ckpt[PATH_IN];
    demo_path_in(d, model, sizeof model, "model");
    DemoModelSpec ms = {.tools = demo_is_tools(&d->o), .hidden = d->o.hidden, .layers = d->o.layers, .heads = d->o.heads,
                        .intermediate = d->o.intermediate, .init_std = (float)d->o.init_std, .seed = (uint64_t)d->o.seed};
    if (demo_write_model(model, &ms, &n_params, err, sizeof err) != 0) goto out;
    demo_say(d, "model: random Llama, %d layers, hidden %d, %d heads, MLP %d: %zu parameters -> %s", d->o.layers,
        d->o.hidden, d->o.heads, d->o.intermediate, n_params, model);
    // 2. The task.
    demo_path_in(d, data, sizeof data, "data");
    DemoDataSpec ds = {.tools = demo_is_tools(&d->o), .digits = d->o.digits, .n_train = d->o.n_train, .n_heldout = d->o.n_heldout,
                       .n_validation = d->o.n_validation, .n_sft = d->o.n_sft < d->o.n_train ? d->o.n_sft : d->o.n_train, .seed = (uint64_t)d->o.seed};
    if (demo_write_data(data, &ds, err, sizeof err) != 0) goto out;
    if (demo_is_tools(&d->o))
        demo_say(d, "task: the user message \"a+b\" with %d-digit operands (too large for this model to add itself), "
                 "answered through the built-in calculator: a Hermes <tool_call>, the tool's answer, then the sum "
                 "(reward answer_match on the final answer); %d training, %d validation and %d held-out problems, "
                 "no problem in two sets -> %s", d->o.digits, d->o.n_train, d->o.n_validation, d->o.n_heldout, data);
    else
        demo_say(d, "task: \"a+b=\" with %d-digit operands, every number least significant digit first (\"21+43=460\" "
                 "is 12 + 34 = 064), the sum checked exactly (reward answer_match); %d training, %d "
                 "validation and %d held-out problems, no problem in two sets -> %s", d->o.digits, d->o.n_train,
                 d->o.n_validation, d->o.n_heldout, data);
    // 3. SFT warm-up; 4. the rollout server and accuracy before GRPO; 5-6. GRPO with accuracy along the way.
    if (run_sft(d, ckpt, sizeof ckpt, err, sizeof err) != 0) goto out;
    d->control_port = demo_free_port();
    if (d->control_port < 0) {
        snprintf(err, sizeof err, "no free TCP port on 127.0.0.1 for the server's control channel: check that the "
                 "loopback interface is up");
        goto out;
    }
    char control[64], slog[PATH_IN];
    snprintf(control, sizeof control, "tcp://127.0.0.1:%d", d->control_port);
    demo_path_in(d, slog, sizeof slog, "logs/server.log");
    if (start_server(d, ckpt, control, slog, &d->server, &d->http_port, err, sizeof err) != 0) goto out;
    demo_say(d, "rollout server on the SFT checkpoint: http://127.0.0.1:%d (OpenAI API), %s (trainer control), log %s",
        d->http_port, control, slog);
    if (evaluate(d, 0, err, sizeof err) != 0) goto out;
    if (run_grpo(d, ckpt, err, sizeof err) != 0) goto out;
    // 7. Results.
    demo_show_examples(d);
    if (demo_write_results(d, n_params, err, sizeof err) != 0) goto out;
    char took[32];
    fmt_duration(demo_now() - d->t0, took, sizeof took);
    double before = d->eval_acc[0], after = d->eval_acc[d->n_evals - 1];
    demo_say(d, "wrote %s/metrics.jsonl, %s/demo_summary.json, %s/demo.svg", d->dir, d->dir, d->dir);
    if (!strcmp(d->device, "cpu"))
        printf("held-out accuracy %.1f %% -> %.1f %% in %s (cpu, %d thread%s)\n", 100 * before, 100 * after, took,
               d->threads, d->threads == 1 ? "" : "s");
    else
        printf("held-out accuracy %.1f %% -> %.1f %% in %s (%s)\n", 100 * before, 100 * after, took, d->device);
    fflush(stdout);
    rc = 0;
out:
    if (d->server > 0) demo_stop(d->server, 5);
    if (rc != 0) fprintf(stderr, "tandem-train demo: %s\n", err[0] ? err : "failed");
    free(d->reward);
    free(d);
    return rc;
}
