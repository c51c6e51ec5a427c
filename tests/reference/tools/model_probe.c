// model_probe — drives the model core for the Python reference tests (tests/reference/test_model_*.py).
//
//   model_probe forward  MODEL_DIR OUT.safetensors   stdin {"sequences": [[ids]], "temperature": t, "checkpoint": b,
//                                                           "entropy_weight": w}
//       writes logits (N, V), logprobs (N), entropy (N), loss (1) = mean next-token cross-entropy
//       + w * mean entropy over the scored positions, and grad.<tensor name> for every parameter
//   model_probe adamw    MODEL_DIR                   stdin {"sequences", "steps", "lr", "beta1", "beta2", "eps",
//                                                           "weight_decay"}  prints {"losses": [...]}
//   model_probe generate MODEL_DIR                   stdin {"prompts": [[ids]], "max_new_tokens": n}
//                                                    prints {"tokens": [[ids]]} (greedy, no eos)
//   model_probe save     MODEL_DIR OUT_DIR [--bf16] [--max-shard-bytes N]
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "shared/model.h"
#include "shared/safetensors.h"

static char err[1024];

#define DIE(...)                                  \
    do {                                          \
        fprintf(stderr, "model_probe: " __VA_ARGS__); \
        fputc('\n', stderr);                      \
        exit(1);                                  \
    } while (0)

typedef struct {
    int B, N;
    int32_t *tokens, *targets, *cu;
} PackedBatch;

// Packs the JSON sequences; the target of each position is the next token of its sequence (-1 at the end).
static PackedBatch pack(json_t *seqs) {
    PackedBatch p = {0};
    if (!json_is_array(seqs) || json_array_size(seqs) == 0) DIE("\"sequences\" must be a non-empty array");
    p.B = (int)json_array_size(seqs);
    for (int b = 0; b < p.B; b++) p.N += (int)json_array_size(json_array_get(seqs, b));
    p.tokens = malloc(p.N * 4);
    p.targets = malloc(p.N * 4);
    p.cu = malloc((p.B + 1) * 4);
    int n = 0;
    p.cu[0] = 0;
    for (int b = 0; b < p.B; b++) {
        json_t *s = json_array_get(seqs, b);
        int len = (int)json_array_size(s);
        for (int i = 0; i < len; i++) {
            p.tokens[n + i] = (int32_t)json_integer_value(json_array_get(s, i));
            p.targets[n + i] = i + 1 < len ? (int32_t)json_integer_value(json_array_get(s, i + 1)) : -1;
        }
        n += len;
        p.cu[b + 1] = n;
    }
    return p;
}

static void packed_free(PackedBatch *p) {
    free(p->tokens);
    free(p->targets);
    free(p->cu);
}

// Frees what load() made.
static void unload(OpsCtx *ops, Model *m, ResidentWeights *w) {
    resident_free(w, m);
    model_free(m);
    ops_destroy(ops);
}

static Batch as_batch(const PackedBatch *p) {
    return (Batch){.n_seqs = p->B, .n_tokens = p->N, .tokens = p->tokens, .targets = p->targets,
                   .cu_seqlens = p->cu, .positions = NULL};
}

// Mean cross-entropy over scored tokens and its gradient with respect to each token's logprob.
static float ce_loss(const PackedBatch *p, const float *logprobs, float *dlogprobs) {
    int count = 0;
    double sum = 0;
    for (int i = 0; i < p->N; i++)
        if (p->targets[i] >= 0) { sum -= logprobs[i]; count++; }
    for (int i = 0; i < p->N; i++) dlogprobs[i] = p->targets[i] >= 0 ? -1.0f / (float)count : 0.0f;
    return (float)(sum / count);
}

static json_t *read_stdin_json(void) {
    json_error_t je;
    json_t *j = json_loadf(stdin, 0, &je);
    if (!j) DIE("bad JSON on stdin: %s (line %d)", je.text, je.line);
    return j;
}

static void load(OpsCtx **ops, Model *m, ResidentWeights *w, const char *dir, int with_grads) {
    if (ops_create(ops, OPS_BACKEND_CPU, 0, err, sizeof err) != 0) DIE("%s", err);
    if (model_load(m, w, *ops, dir, err, sizeof err) != 0) DIE("%s", err);
    if (with_grads) {
        ResidentWeights g;
        if (resident_alloc(&g, m, 1, err, sizeof err) != 0) DIE("%s", err);
        for (int u = 0; u < g.n_units; u++) {
            ops_free(*ops, g.params[u]);
            g.params[u] = w->params[u];
        }
        free(w->params);
        *w = g;
    }
}

static int cmd_forward(const char *dir, const char *out_path) {
    json_t *req = read_stdin_json();
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    load(&ops, &m, &w, dir, 1);
    PackedBatch p = pack(json_object_get(req, "sequences"));
    json_t *jt = json_object_get(req, "temperature");
    float temperature = jt ? (float)json_number_value(jt) : 1.0f;
    int checkpoint = json_is_true(json_object_get(req, "checkpoint"));
    float entropy_weight = (float)json_number_value(json_object_get(req, "entropy_weight")); // 0 when absent
    const int V = m.cfg.vocab_size;
    TrainActs *acts;
    if (train_acts_create(&acts, &m, p.N, p.B, checkpoint, err, sizeof err) != 0) DIE("%s", err);
    float *logits = malloc((size_t)p.N * V * 4), *lp = malloc(p.N * 4), *ent = malloc(p.N * 4),
          *dlp = malloc(p.N * 4);
    Batch b = as_batch(&p);
    UnitSource src = resident_source(&w);
    if (model_forward(&m, acts, &src, &b, 1.0f / temperature, lp, ent, logits, err, sizeof err) != 0) DIE("%s", err);
    float loss = ce_loss(&p, lp, dlp);
    float *dent = calloc(p.N, 4);
    int scored = 0;
    for (int i = 0; i < p.N; i++) scored += p.targets[i] >= 0;
    for (int i = 0; i < p.N; i++)
        if (p.targets[i] >= 0) {
            loss += entropy_weight * ent[i] / (float)scored;
            dent[i] = entropy_weight / (float)scored;
        }
    resident_zero_grads(&w, &m);
    if (model_backward_entropy(&m, acts, &src, dlp, entropy_weight != 0 ? dent : NULL, err, sizeof err) != 0)
        DIE("%s", err);
    free(dent);

    StWriter *sw;
    if (st_writer_create(&sw, err, sizeof err) != 0) DIE("%s", err);
    int64_t shape_logits[2] = {p.N, V}, shape_n[1] = {p.N}, shape_1[1] = {1};
    st_writer_add(sw, "logits", ST_F32, 2, shape_logits, logits, ST_F32, err, sizeof err);
    st_writer_add(sw, "logprobs", ST_F32, 1, shape_n, lp, ST_F32, err, sizeof err);
    st_writer_add(sw, "entropy", ST_F32, 1, shape_n, ent, ST_F32, err, sizeof err);
    st_writer_add(sw, "loss", ST_F32, 1, shape_1, &loss, ST_F32, err, sizeof err);
    char (*names)[LAYOUT_NAME_MAX + 8] = malloc((size_t)m.layout.n_tensors * sizeof *names);
    for (int i = 0; i < m.layout.n_tensors; i++) {
        const LayoutTensor *t = &m.layout.tensors[i];
        snprintf(names[i], sizeof names[i], "grad.%s", t->name);
        if (st_writer_add(sw, names[i], ST_F32, t->ndim, t->shape, w.grads[t->unit] + t->offset, ST_F32, err,
                          sizeof err) != 0)
            DIE("%s", err);
    }
    // The writer makes a folder; the test wants one file: write into OUT.d and move model.safetensors.
    char dir_out[4096], file[4200];
    snprintf(dir_out, sizeof dir_out, "%s.d", out_path);
    if (st_writer_write(sw, dir_out, 0, err, sizeof err) != 0) DIE("%s", err);
    snprintf(file, sizeof file, "%s/model.safetensors", dir_out);
    if (rename(file, out_path) != 0) DIE("cannot move %s to %s", file, out_path);
    st_writer_free(sw);
    free(names);
    free(logits);
    free(lp);
    free(ent);
    free(dlp);
    packed_free(&p);
    train_acts_free(acts, &m);
    unload(ops, &m, &w);
    json_decref(req);
    return 0;
}

static int cmd_adamw(const char *dir) {
    json_t *req = read_stdin_json();
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    load(&ops, &m, &w, dir, 1);
    PackedBatch p = pack(json_object_get(req, "sequences"));
    int steps = (int)json_integer_value(json_object_get(req, "steps"));
    float lr = (float)json_number_value(json_object_get(req, "lr"));
    float b1 = (float)json_number_value(json_object_get(req, "beta1"));
    float b2 = (float)json_number_value(json_object_get(req, "beta2"));
    float eps = (float)json_number_value(json_object_get(req, "eps"));
    float wd = (float)json_number_value(json_object_get(req, "weight_decay"));
    TrainActs *acts;
    if (train_acts_create(&acts, &m, p.N, p.B, 0, err, sizeof err) != 0) DIE("%s", err);
    int U = m.layout.n_units;
    float **master = calloc(U, sizeof(float *)), **mom = calloc(U, sizeof(float *)), **var = calloc(U, sizeof(float *));
    for (int u = 0; u < U; u++) {
        size_t n = m.layout.unit_numel[u];
        master[u] = ops_malloc(ops, n * 4);
        mom[u] = ops_malloc(ops, n * 4);
        var[u] = ops_malloc(ops, n * 4);
        ops_download_f32(ops, master[u], w.params[u], n);
    }
    float *lp = malloc(p.N * 4), *dlp = malloc(p.N * 4);
    Batch b = as_batch(&p);
    UnitSource src = resident_source(&w);
    json_t *losses = json_array();
    for (int s = 1; s <= steps; s++) {
        resident_zero_grads(&w, &m);
        if (model_forward(&m, acts, &src, &b, 1.0f, lp, NULL, NULL, err, sizeof err) != 0) DIE("%s", err);
        json_array_append_new(losses, json_real(ce_loss(&p, lp, dlp)));
        if (model_backward(&m, acts, &src, dlp, err, sizeof err) != 0) DIE("%s", err);
        for (int u = 0; u < U; u++)
            ops_adamw_step(ops, master[u], mom[u], var[u], w.grads[u], w.params[u], m.layout.unit_numel[u], lr, b1, b2,
                           eps, wd, s, 1.0f);
        if (ops_status(ops)) DIE("adamw: %s", ops_error(ops));
    }
    json_t *out = json_object();
    json_object_set_new(out, "losses", losses);
    json_dumpf(out, stdout, JSON_REAL_PRECISION(9));
    putchar('\n');
    json_decref(out);
    free(lp);
    free(dlp);
    for (int u = 0; u < U; u++) ops_free(ops, master[u]), ops_free(ops, mom[u]), ops_free(ops, var[u]);
    free(master);
    free(mom);
    free(var);
    packed_free(&p);
    train_acts_free(acts, &m);
    unload(ops, &m, &w);
    json_decref(req);
    return 0;
}

static int cmd_generate(const char *dir) {
    json_t *req = read_stdin_json();
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    load(&ops, &m, &w, dir, 0);
    json_t *prompts = json_object_get(req, "prompts");
    int B = (int)json_array_size(prompts), max_new = (int)json_integer_value(json_object_get(req, "max_new_tokens"));
    if (B < 1 || max_new < 1) DIE("need prompts and max_new_tokens >= 1");
    int32_t **pr = calloc(B, sizeof(int32_t *));
    int *lens = calloc(B, sizeof(int));
    for (int b = 0; b < B; b++) {
        json_t *s = json_array_get(prompts, b);
        lens[b] = (int)json_array_size(s);
        pr[b] = malloc((lens[b] + 1) * 4);
        for (int i = 0; i < lens[b]; i++) pr[b][i] = (int32_t)json_integer_value(json_array_get(s, i));
    }
    int32_t *out = malloc((size_t)B * max_new * 4);
    UnitSource src = resident_source(&w);
    if (model_generate_greedy(&m, &src, B, (const int32_t *const *)pr, lens, max_new, NULL, 0, out, err, sizeof err) != 0)
        DIE("%s", err);
    json_t *rows = json_array();
    for (int b = 0; b < B; b++) {
        json_t *row = json_array();
        for (int i = 0; i < max_new && out[b * max_new + i] >= 0; i++) json_array_append_new(row, json_integer(out[b * max_new + i]));
        json_array_append_new(rows, row);
    }
    json_t *res = json_object();
    json_object_set_new(res, "tokens", rows);
    json_dumpf(res, stdout, 0);
    putchar('\n');
    json_decref(res);
    free(out);
    for (int b = 0; b < B; b++) free(pr[b]);
    free(pr);
    free(lens);
    unload(ops, &m, &w);
    json_decref(req);
    return 0;
}

static int cmd_save(int argc, char **argv) {
    const char *dir = argv[2], *out_dir = argv[3];
    int bf16 = 0;
    size_t shard = 0;
    for (int i = 4; i < argc; i++) {
        if (strcmp(argv[i], "--bf16") == 0) bf16 = 1;
        else if (strcmp(argv[i], "--max-shard-bytes") == 0 && i + 1 < argc) shard = strtoull(argv[++i], NULL, 10);
        else DIE("unknown option %s", argv[i]);
    }
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    load(&ops, &m, &w, dir, 0);
    UnitSource src = resident_source(&w);
    if (model_save(&m, &src, out_dir, bf16, shard, err, sizeof err) != 0) DIE("%s", err);
    unload(ops, &m, &w);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 4 && strcmp(argv[1], "forward") == 0) return cmd_forward(argv[2], argv[3]);
    if (argc >= 3 && strcmp(argv[1], "adamw") == 0) return cmd_adamw(argv[2]);
    if (argc >= 3 && strcmp(argv[1], "generate") == 0) return cmd_generate(argv[2]);
    if (argc >= 4 && strcmp(argv[1], "save") == 0) return cmd_save(argc, argv);
    fprintf(stderr, "usage: model_probe forward|adamw|generate|save MODEL_DIR [...]  (see the header comment)\n");
    return 2;
}
