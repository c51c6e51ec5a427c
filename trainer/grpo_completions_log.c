// trainer/grpo_completions_log.c — log_completions: what each trained completion was and what the loss used for
// it (trainer/grpo_round.h), one JSON row per completion in OUTPUT_DIR/completions.jsonl.
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>

#include "shared/err.h"
#include "trainer/grpo_round.h"

static json_t *int_list(const int32_t *v, int n) {
    json_t *a = json_array();
    for (int i = 0; a && i < n; i++) json_array_append_new(a, json_integer(v[i]));
    return a;
}

static json_t *float_list(const float *v, int n) {
    json_t *a = json_array();
    for (int i = 0; a && i < n; i++) json_array_append_new(a, json_real(v[i]));
    return a;
}

int grpo_log_completions(Trainer *t, const GrpoRound *r, long step, const int *idx, int B, int T, const float *old,
                         const float *is_ratio, int ratio_per_token, char *err, size_t err_len) {
    if (!t->completions) return 0;
    const int G = t->cfg->grpo.num_generations;
    for (int b = 0; b < B; b++) {
        const int i = idx[b], L = r->comp_len[i];
        const DataRow *row = &r->rows[i / G];
        json_t *o = json_object();
        if (!o) return err_fail(err, err_len, "out of memory for a completions.jsonl row");
        json_object_set_new(o, "step", json_integer(step));
        json_object_set_new(o, "prompt_ids", int_list(row->ids, (int)row->n_ids));
        json_object_set_new(o, "completion_ids", int_list(r->comp[i], L));
        json_object_set_new(o, "version", json_integer(r->versions[i]));
        json_object_set_new(o, "version_end", json_integer(r->groups[i / G].versions_end[i % G]));
        json_object_set_new(o, "staleness", json_integer(r->train_version - r->versions[i]));
        json_object_set_new(o, "kept", json_boolean(r->keep[i]));
        json_object_set_new(o, "truncated", json_boolean(r->truncated[i]));
        json_object_set_new(o, "advantage", json_real(r->advantages[i]));
        json_object_set_new(o, "sampling_logps", float_list(r->sampling_logps[i], L));
        if (r->tool_mask && r->tool_mask[i]) {   // multi-turn: 1 the policy's tokens, 0 tool turns (not trained on)
            json_t *tm = json_array();
            for (int k = 0; tm && k < L; k++) json_array_append_new(tm, json_integer(r->tool_mask[i][k]));
            json_object_set_new(o, "tool_mask", tm);
            json_object_set_new(o, "tool_calls", json_integer(r->traj[i].n_tool_calls));
            json_object_set_new(o, "turns", json_integer(r->traj[i].n_assistant_turns));
        }
        if (old) json_object_set_new(o, "old_logps", float_list(old + (size_t)b * T, L));
        if (is_ratio)
            json_object_set_new(o, "importance_sampling_ratio",
                                ratio_per_token ? float_list(is_ratio + (size_t)b * T, L) : json_real(is_ratio[b]));
        // 9 significant digits: every float32 value reads back as the same float.
        char *line = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(9));
        json_decref(o);
        if (!line) return err_fail(err, err_len, "out of memory for a completions.jsonl row");
        int bad = fprintf(t->completions, "%s\n", line) < 0;
        free(line);
        if (bad) return err_fail(err, err_len, "writing completions.jsonl failed");
    }
    return fflush(t->completions) == 0 ? 0 : err_fail(err, err_len, "writing completions.jsonl failed");
}
