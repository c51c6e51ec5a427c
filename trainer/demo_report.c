// trainer/demo_report.c — the demo's results: held-out examples in the log, demo_summary.json, demo.svg.
#define _GNU_SOURCE
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer/demo.h"
#include "trainer/demo_internal.h"
#include "trainer/rewards.h"

// Reads the completions of an evaluation's --output file: texts[row] (row from 1), NULL where none.
static char **read_completions(const char *path, int n_rows) {
    char **texts = calloc((size_t)n_rows + 1, sizeof(char *));
    FILE *f = fopen(path, "r");
    char *line = NULL;
    size_t cap = 0;
    while (texts && f && getline(&line, &cap, f) > 0) {
        json_t *j = json_loads(line, 0, NULL);
        int row = (int)json_integer_value(json_object_get(j, "row"));
        json_t *c = json_array_get(json_object_get(j, "completions"), 0);
        if (row >= 1 && row <= n_rows && json_is_string(c) && !texts[row]) texts[row] = strdup(json_string_value(c));
        json_decref(j);
    }
    free(line);
    if (f) fclose(f);
    return texts;
}

static int is_right(const Demo *d, const char *text, const json_t *answer) {
    (void)d;
    return reward_answer_match(text, answer) >= 1;
}

void demo_show_examples(Demo *d) {
    char data[PATH_IN], before[PATH_IN], after[PATH_IN];
    demo_path_in(d, data, sizeof data, "data/heldout.jsonl");
    snprintf(before, sizeof before, "%s/eval/step-%04d.jsonl", d->dir, 0);
    snprintf(after, sizeof after, "%s/eval/step-%04d.jsonl", d->dir, (int)d->eval_step[d->n_evals - 1]);
    char **b = read_completions(before, d->o.n_heldout), **a = read_completions(after, d->o.n_heldout);
    FILE *f = fopen(data, "r");
    char *line = NULL;
    size_t cap = 0;
    int shown = 0;
    // First pass: up to 3 problems GRPO fixed; second: others, for a plain sample (5 lines in all).
    for (int pass = 0; pass < 2 && a && b && f; pass++) {
        rewind(f);
        for (int row = 1; getline(&line, &cap, f) > 0 && shown < 5; row++) {
            if (row > d->o.n_heldout || !a[row] || !b[row]) continue;
            json_t *j = json_loads(line, 0, NULL);
            json_t *ans = json_object_get(j, "answer");
            int rb = is_right(d, b[row], ans), ra = is_right(d, a[row], ans);
            if ((pass == 0) == (!rb && ra)) {
                if (!shown++) demo_say(d, "held-out examples (greedy):");
                const json_t *p = json_object_get(j, "prompt");   // text, or [{"role": "user", "content"}]
                const char *shown_prompt = json_is_string(p) ? json_string_value(p)
                                           : json_string_value(json_object_get(json_array_get(p, 0), "content"));
                demo_say(d, "  %-12s after SFT %-8s %-5s  after GRPO %-8s %s", shown_prompt ? shown_prompt : "?",
                         b[row], rb ? "right" : "wrong", a[row], ra ? "right" : "wrong");
            }
            json_decref(j);
            if (pass == 0 && shown >= 3) break;
        }
    }
    free(line);
    if (f) fclose(f);
    for (int i = 0; i <= d->o.n_heldout; i++) {
        if (a) free(a[i]);
        if (b) free(b[i]);
    }
    free(a), free(b);
}

int demo_write_results(Demo *d, size_t n_params, char *err, size_t err_len) {
    double wall = demo_now() - d->t0;
    int n = d->grpo_done, nr = 0;
    double *rx = malloc(n * sizeof(double)), *ry = malloc(n * sizeof(double));
    json_t *rewards = json_array(), *evals = json_array();
    // The second figure of an evaluation: well-formed answers, or (tools) episodes with a calculator call that ran.
    const int tools = demo_is_tools(&d->o);
    const char *form_key = tools ? "calculator_calls" : "well_formed";
    for (int s = 0; s < n; s++) {
        json_array_append_new(rewards, isnan(d->reward[s]) ? json_null() : json_real(d->reward[s]));
        if (!isnan(d->reward[s])) rx[nr] = s + 1, ry[nr] = d->reward[s], nr++;
    }
    for (int i = 0; i < d->n_evals; i++)
        json_array_append_new(evals, json_pack("{s:i, s:f, s:f, s:f}", "step", (int)d->eval_step[i], "accuracy",
                                               d->eval_acc[i], form_key, d->eval_form[i], "validation_accuracy",
                                               d->eval_val[i]));
    json_t *checks = json_array();
    for (int i = 0; i < d->n_checks; i++)
        json_array_append_new(checks, json_pack("{s:i, s:f}", "step", (int)d->check_step[i], "validation_accuracy",
                                                d->check_acc[i]));
    char task[160];
    if (demo_is_tools(&d->o))
        snprintf(task, sizeof task, "tools: a+b, %d-digit operands, via the calculator", d->o.digits);
    else
        snprintf(task, sizeof task, "a+b, %d-digit operands, least significant digit first", d->o.digits);
    json_t *sum = json_object();
    json_object_set_new(sum, "task", json_string(task));
    json_object_set_new(sum, "accuracy_before", json_real(d->eval_acc[0]));
    json_object_set_new(sum, "accuracy_after", json_real(d->eval_acc[d->n_evals - 1]));
    if (tools) {   // answer_match counts a number with a leading zero ("085938") too; exact does not
        json_object_set_new(sum, "exact_before", json_real(d->eval_exact[0]));
        json_object_set_new(sum, "exact_after", json_real(d->eval_exact[d->n_evals - 1]));
    }
    json_object_set_new(sum, tools ? "calculator_calls_before" : "well_formed_before", json_real(d->eval_form[0]));
    json_object_set_new(sum, tools ? "calculator_calls_after" : "well_formed_after",
                        json_real(d->eval_form[d->n_evals - 1]));
    json_object_set_new(sum, "evaluations", evals);
    json_object_set_new(sum, "reward_per_step", rewards);
    json_object_set_new(sum, "wall_time_s", json_real(wall));
    json_object_set_new(sum, "phase_time_s", json_pack("{s:f, s:f, s:f}", "sft", d->t_sft, "grpo_training", d->t_grpo,
                                                       "evaluation", d->t_eval));
    json_object_set_new(sum, "device", json_string(d->device));
    json_object_set_new(sum, "threads", json_integer(d->threads));
    json_object_set_new(sum, "seed", json_integer(d->o.seed));
    json_object_set_new(sum, "data", json_pack("{s:i, s:i, s:i, s:i}", "train", d->o.n_train, "sft", d->o.n_sft,
                                               "validation", d->o.n_validation, "heldout", d->o.n_heldout));
    json_object_set_new(sum, "model", json_pack("{s:s, s:i, s:i, s:i, s:i, s:I, s:f}", "architecture",
                                                "LlamaForCausalLM", "hidden_size", d->o.hidden, "layers", d->o.layers,
                                                "heads", d->o.heads, "intermediate_size", d->o.intermediate,
                                                "parameters", (json_int_t)n_params, "init_std", d->o.init_std));
    json_object_set_new(sum, "sft", json_pack("{s:i, s:i, s:f, s:f, s:o}", "steps", d->sft_steps, "batch_size",
                                              d->o.sft_batch, "learning_rate", d->o.sft_lr, "target_validation_accuracy",
                                              d->o.sft_target, "checks", checks));
    json_object_set_new(sum, "grpo", json_pack("{s:i, s:i, s:s, s:f, s:i, s:i, s:i, s:i, s:f, s:s, s:f, s:f, s:s, s:i, s:i}",
                                               "steps", d->grpo_done, "max_steps", d->o.grpo_steps, "stopped_by",
                                               d->stop_reason ? d->stop_reason : "", "stop_validation_accuracy",
                                               d->o.stop_accuracy, "stop_patience", d->o.stop_patience,
                                               "prompts_per_step", d->o.prompts_per_step,
                                               "num_generations", d->o.num_generations, "max_completion_length",
                                               tools ? tools_completion_tokens(&d->o) : completion_tokens(&d->o),
                                               "learning_rate", d->o.grpo_lr,
                                               "lr_schedule", "10 warmup steps, then cosine towards 0 at max_steps (one level per segment)",
                                               "temperature", d->o.temperature, "beta", 0.0, "reward",
                                               tools ? "0.8 answer_match + 0.2 regex_format =[0-9]+" : "answer_match",
                                               "eval_every", d->o.eval_every, "max_staleness", d->o.max_staleness));
    char path[PATH_IN];
    demo_path_in(d, path, sizeof path, "demo_summary.json");
    int rc = 0;
    if (!sum || json_dump_file(sum, path, JSON_INDENT(1) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(6)) != 0) {
        snprintf(err, err_len, "cannot write %s", path);
        rc = -1;
    }
    json_decref(sum);
    if (rc == 0) {
        char title[320];
        snprintf(title, sizeof title, "tandem demo: %s, %zu-parameter Llama, %s", task, n_params, d->device);
        DemoSeries rs = {.n = nr, .x = rx, .y = ry}, as = {.n = d->n_evals, .x = d->eval_step, .y = d->eval_acc};
        demo_path_in(d, path, sizeof path, "demo.svg");
        rc = demo_write_svg(path, title, &rs, &as, n, err, err_len);
    }
    free(rx), free(ry);
    return rc;
}
