// trainer/grpo_multiturn.c — multi-turn trajectories inside a GRPO round (grpo_multiturn.h).
#include "trainer/grpo_multiturn.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"
#include "shared/json_read.h"
#include "trainer/env_service.h"
#include "trainer/grpo_loss.h"
#include "trainer/tool_builtin.h"
#include "trainer/trajectory_rollout.h"

int trainer_open_tools(Trainer *t, const TrainConfig *cfg, char *err, size_t err_len) {
    if (!t->chat)
        return err_fail(err, err_len, "tools: multi-turn tool use renders tool turns with the model's chat template, "
                        "and %s has none that tandem recognises (set --chat-template)", cfg->model);
    if (tool_turn_style(&t->tool_style, t->chat, t->tok, 1, err, err_len) != 0) return -1;
    if (cfg->tool_call_format) {
        if (tool_call_format_from_name(cfg->tool_call_format, &t->tool_format, err, err_len) != 0) return -1;
    } else {
        t->tool_format = tool_call_format_of_family(chat_template_family(t->chat));
    }
    if (cfg->env_url) {
        EnvServiceOptions so;
        env_service_options_default(&so);
        so.url = cfg->env_url;
        so.timeout_s = cfg->env_timeout;
        so.connect_timeout_s = cfg->env_connect_timeout;
        so.max_retries = cfg->env_retries;
        so.backoff_s = cfg->env_backoff;
        if (env_service_create(&t->env, &so, err, err_len) != 0 || env_service_fetch_tools(t->env, err, err_len) != 0)
            return -1;
        return tool_prompt_init(&t->tool_prompt, t->env, t->chat, err, err_len);
    }
    json_t *table = NULL;
    if (cfg->tool_lookup_file) {
        json_error_t je;
        table = json_read_file(cfg->tool_lookup_file, 0, &je);
        if (!json_is_object(table)) {
            json_decref(table);
            return err_fail(err, err_len, "tool_lookup_file %s: %s", cfg->tool_lookup_file,
                            table ? "must hold a JSON object of key -> value" : je.text);
        }
    }
    ToolBox *tb = NULL;
    int rc = toolbox_create(&tb, table, err, err_len);
    json_decref(table);
    if (rc != 0) return -1;
    if (env_builtin_create(&t->env, tb, err, err_len) != 0) return -1;
    return tool_prompt_init(&t->tool_prompt, t->env, t->chat, err, err_len);
}

// The first turn of each trajectory is the group's completion the stream took; later turns come from the servers.
typedef struct {
    const GrpoRound *r;
    int first;                        // round index of the group's first completion (p * G)
    TrajectoryRolloutSampler rollout;
} GroupSampler;

static int group_sample(void *ctx, const TrajectorySampleRequest *req, size_t n, TrajectorySample *out, char *err,
                        size_t err_len) {
    GroupSampler *g = ctx;
    memset(out, 0, n * sizeof *out);
    TrajectorySampleRequest *later = calloc(n + 1, sizeof *later);
    size_t *where = calloc(n + 1, sizeof *where);
    TrajectorySample *got = calloc(n + 1, sizeof *got);
    int rc = (later && where && got) ? 0 : err_fail(err, err_len, "trajectory sampler: out of memory");
    size_t k = 0;
    for (size_t i = 0; rc == 0 && i < n; i++) {
        if (req[i].turn > 1) {
            later[k] = req[i], where[k++] = i;
            continue;
        }
        const int c = g->first + (int)req[i].episode;
        size_t len = (size_t)g->r->comp_len[c];
        if (len > req[i].max_new_tokens) len = req[i].max_new_tokens;
        out[i].ids = malloc((len + 1) * sizeof *out[i].ids);
        out[i].logprobs = malloc((len + 1) * sizeof *out[i].logprobs);
        if (!out[i].ids || !out[i].logprobs) {
            rc = err_fail(err, err_len, "trajectory sampler: out of memory");
            break;
        }
        if (len) memcpy(out[i].ids, g->r->comp[c], len * sizeof *out[i].ids);
        if (len) memcpy(out[i].logprobs, g->r->sampling_logps[c], len * sizeof *out[i].logprobs);
        out[i].n = len;
        out[i].version = g->r->versions[c];
    }
    if (rc == 0 && k) rc = trajectory_rollout_sample(&g->rollout, later, k, got, err, err_len) != 0 ? -1 : 0;
    for (size_t j = 0; rc == 0 && j < k; j++) out[where[j]] = got[j];
    if (rc != 0)
        for (size_t i = 0; i < n; i++) {
            free(out[i].ids), free(out[i].logprobs);
            out[i].ids = NULL, out[i].logprobs = NULL;
        }
    free(later), free(where), free(got);
    return rc;
}

static int fit_round(GrpoRound *r, char *err, size_t err_len) {
    if (r->traj) return 0;
    const size_t n = (size_t)(r->n ? r->n : 1);
    r->traj = calloc(n, sizeof *r->traj);
    r->tool_mask = calloc(n, sizeof *r->tool_mask);
    r->answer_off = calloc(n, sizeof *r->answer_off);
    if (!r->traj || !r->tool_mask || !r->answer_off) {
        free(r->traj), free(r->tool_mask), free(r->answer_off);
        r->traj = NULL, r->tool_mask = NULL, r->answer_off = NULL;
        return err_fail(err, err_len, "out of memory for the round's trajectories");
    }
    return 0;
}

int grpo_round_group_trajectories(Trainer *t, GrpoRound *r, int p, char *err, size_t err_len) {
    const TrainConfig *c = t->cfg;
    const int G = c->grpo.num_generations, first = p * G;
    if (fit_round(r, err, err_len) != 0) return -1;
    char names[G][64];
    const char *ids[G];
    EnvResetRequest reset[G];
    EnvResetResult reset_out[G];
    for (int j = 0; j < G; j++) {
        snprintf(names[j], sizeof names[j], "s%ld-r%d-p%d-g%d", r->first_step, t->rank, p, j);
        ids[j] = names[j];
        reset[j] = (EnvResetRequest){.episode_id = names[j], .row = r->rows[p].columns,
                                     .seed = trajectory_turn_seed(r->sampling.seed + (uint64_t)first, (size_t)j, 0)};
        if (trajectory_init(&r->traj[first + j], r->prompts[p], (size_t)r->prompt_lens[p]) != 0)
            return err_fail(err, err_len, "out of memory for a trajectory");
    }
    if (env_reset(t->env, reset, (size_t)G, reset_out, err, err_len) != 0) return -1;
    int said = 0;
    for (int j = 0; j < G; j++) {
        said |= reset_out[j].observation != NULL;
        env_reset_result_free(&reset_out[j]);
    }
    if (said)
        return err_fail(err, err_len, "the %s environment answered reset with an observation for the prompt, but "
                        "GRPO sends prompts before episodes start: reset observations are not supported here",
                        t->env->kind);
    GroupSampler gs = {.r = r, .first = first,
                       .rollout = {.client = t->rollout, .sampling = r->sampling,
                                   .seed = r->sampling.seed + (uint64_t)first}};
    gs.rollout.sampling.n = 1;
    TrajectoryBuilder b = {.opt = {.max_tool_calling_iterations = c->max_tool_calling_iterations,
                                   .max_completion_length = (size_t)c->grpo.max_completion_length,
                                   .max_model_len = (size_t)rollout_client_max_seq_len(t->rollout),
                                   .format = t->tool_format},
                           .tok = t->tok, .style = t->tool_style, .env = t->env, .sample = group_sample,
                           .sample_ctx = &gs};
    if (trajectories_run(&b, r->traj + first, ids, (size_t)G, err, err_len) != 0) return -1;
    int32_t eos[16];
    int n_eos = (int)tokenizer_eos_ids(t->tok, eos, 16);
    for (int j = 0; j < G; j++) {
        const int i = first + j;
        Trajectory *tr = &r->traj[i];
        r->comp[i] = tr->ids + tr->prompt_len;
        r->comp_len[i] = (int)trajectory_completion_len(tr);
        r->sampling_logps[i] = tr->logprobs;
        r->tool_mask[i] = tr->mask;
        r->answer_off[i] = (int)tr->last_turn_start;
        r->truncated[i] = grpo_completion_is_truncated(r->comp[i], r->comp_len[i], eos, n_eos,
                                                       tokenizer_pad_id(t->tok));
    }
    return 0;
}

int grpo_env_reward_column(const Trainer *t) { return t->env && strcmp(t->env->kind, "service") == 0; }

int grpo_round_tool_metrics(Trainer *t, const GrpoRound *r, json_t *m, char *err, size_t err_len) {
    enum { CALLS, FAILS, TURNS, N, N_SUMS };
    const int G = t->cfg->grpo.num_generations;
    double sums[N_SUMS] = {0}, env_seconds = 0, group_seconds = 0;
    for (int i = 0; r->traj && i < r->n; i++) {
        sums[CALLS] += r->traj[i].n_tool_calls;
        sums[FAILS] += r->traj[i].n_tool_failures;
        sums[TURNS] += r->traj[i].n_assistant_turns;
        sums[N] += 1;
        // A group's trajectories wait for the environment together (one call per round of turns): the group's
        // wait is its longest trajectory's; groups run one after another, so the rank's wait is their sum.
        if (r->traj[i].env_seconds > group_seconds) group_seconds = r->traj[i].env_seconds;
        if ((i + 1) % G == 0) env_seconds += group_seconds, group_seconds = 0;
    }
    if (comm_all_reduce(t->comm, sums, N_SUMS, COMM_F64, COMM_SUM) != 0 ||
        comm_all_reduce(t->comm, &env_seconds, 1, COMM_F64, COMM_MAX) != 0)
        return err_fail(err, err_len, "reducing tool metrics: %s", comm_error(t->comm));
    const double n = sums[N] > 0 ? sums[N] : 1;
    json_object_set_new(m, "tools/call_frequency", json_real(sums[CALLS] / n));
    json_object_set_new(m, "tools/failure_frequency", json_real(sums[CALLS] > 0 ? sums[FAILS] / sums[CALLS] : 0.0));
    json_object_set_new(m, "tools/turns_mean", json_real(sums[TURNS] / n));
    json_object_set_new(m, "tools/environment_time", json_real(env_seconds));
    return 0;
}
