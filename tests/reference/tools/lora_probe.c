// lora_probe — drives the model core with LoRA adapters for tests/reference/test_lora_vs_peft.py (CPU, fp32).
//
//   lora_probe forward MODEL_DIR ADAPTER_DIR OUT.safetensors   stdin {"sequences": [[ids]], "checkpoint": b,
//                                                                     "dropout": p, "dropout_seed": s}
//       loads the base (frozen: no gradient buffers) and a PEFT adapter folder, runs forward and backward of the
//       mean next-token cross-entropy; writes logits (N, V), logprobs (N), loss (1) and grad.<PEFT tensor name>
//       for every adapter tensor
//   lora_probe init MODEL_DIR OUT_DIR   stdin {"r", "lora_alpha", "target_modules", "init", "use_rslora", "seed"}
//       writes a PEFT adapter folder of tandem's init
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "shared/model.h"
#include "shared/model_lora.h"
#include "shared/safetensors.h"

static char err[1024];

#define DIE(...)                                     \
    do {                                             \
        fprintf(stderr, "lora_probe: " __VA_ARGS__); \
        fputc('\n', stderr);                         \
        exit(1);                                     \
    } while (0)

static json_t *read_stdin_json(void) {
    json_error_t je;
    json_t *j = json_loadf(stdin, 0, &je);
    if (!j) DIE("bad JSON on stdin: %s (line %d)", je.text, je.line);
    return j;
}

static float **host_units(const ModelLora *l) {
    float **h = calloc((size_t)l->n_layers, sizeof *h);
    for (int i = 0; i < l->n_layers; i++) h[i] = calloc(l->unit_numel, sizeof(float));
    return h;
}

static int cmd_forward(const char *model_dir, const char *adapter_dir, const char *out_path) {
    json_t *req = read_stdin_json();
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    if (ops_create(&ops, OPS_BACKEND_CPU, 0, err, sizeof err) != 0) DIE("%s", err);
    if (model_load(&m, &w, ops, model_dir, err, sizeof err) != 0) DIE("%s", err);
    LoraConfig lc;
    ModelLora *lora;
    if (lora_config_read(adapter_dir, &lc, err, sizeof err) != 0) DIE("%s", err);
    // lora_dropout acts in training only, so the folder's config says nothing about this forward's: the request does.
    lc.dropout = (float)json_number_value(json_object_get(req, "dropout"));
    if (model_lora_create(&lora, &m, &lc, 1, err, sizeof err) != 0) DIE("%s", err);
    lora->dropout_seed = (uint64_t)json_integer_value(json_object_get(req, "dropout_seed"));
    float **host = host_units(lora);
    if (model_lora_load(lora, adapter_dir, host, err, sizeof err) != 0) DIE("%s", err);
    m.lora = lora;

    json_t *seqs = json_object_get(req, "sequences");
    const int B = (int)json_array_size(seqs);
    if (B < 1) DIE("\"sequences\" must be a non-empty array");
    int N = 0;
    for (int b = 0; b < B; b++) N += (int)json_array_size(json_array_get(seqs, b));
    int32_t *tok = malloc(N * 4), *tgt = malloc(N * 4), *cu = malloc((B + 1) * 4);
    int n = 0, scored = 0;
    cu[0] = 0;
    for (int b = 0; b < B; b++) {
        json_t *s = json_array_get(seqs, b);
        const int len = (int)json_array_size(s);
        for (int i = 0; i < len; i++) {
            tok[n + i] = (int32_t)json_integer_value(json_array_get(s, i));
            tgt[n + i] = i + 1 < len ? (int32_t)json_integer_value(json_array_get(s, i + 1)) : -1;
            scored += tgt[n + i] >= 0;
        }
        n += len;
        cu[b + 1] = n;
    }
    const int V = m.cfg.vocab_size;
    TrainActs *acts;
    int flags = json_is_true(json_object_get(req, "checkpoint")) ? TRAIN_ACTS_CHECKPOINT : 0;
    if (train_acts_create(&acts, &m, N, B, flags, err, sizeof err) != 0) DIE("%s", err);
    float *logits = malloc((size_t)N * V * 4), *lp = malloc(N * 4), *dlp = malloc(N * 4);
    Batch batch = {.n_seqs = B, .n_tokens = N, .tokens = tok, .targets = tgt, .cu_seqlens = cu};
    // The base is frozen: a source without gradient buffers.
    UnitSource src = resident_source(&w);
    model_lora_zero_grads(lora);
    if (model_forward(&m, acts, &src, &batch, 1.0f, lp, NULL, logits, err, sizeof err) != 0) DIE("%s", err);
    double loss = 0;
    for (int i = 0; i < N; i++) {
        dlp[i] = tgt[i] >= 0 ? -1.0f / (float)scored : 0.0f;
        if (tgt[i] >= 0) loss -= lp[i] / scored;
    }
    if (model_backward(&m, acts, &src, dlp, err, sizeof err) != 0) DIE("%s", err);
    float loss_f = (float)loss;

    StWriter *sw;
    if (st_writer_create(&sw, err, sizeof err) != 0) DIE("%s", err);
    int64_t shape_logits[2] = {N, V}, shape_n[1] = {N}, shape_1[1] = {1};
    st_writer_add(sw, "logits", ST_F32, 2, shape_logits, logits, ST_F32, err, sizeof err);
    st_writer_add(sw, "logprobs", ST_F32, 1, shape_n, lp, ST_F32, err, sizeof err);
    st_writer_add(sw, "loss", ST_F32, 1, shape_1, &loss_f, ST_F32, err, sizeof err);
    char (*names)[LAYOUT_NAME_MAX + 8] = malloc((size_t)lora->n_tensors * sizeof *names);
    for (int i = 0; i < lora->n_tensors; i++) {
        const LayoutTensor *t = &lora->tensors[i];
        snprintf(names[i], sizeof names[i], "grad.%s", t->name);
        if (st_writer_add(sw, names[i], ST_F32, 2, t->shape, lora->grads[t->unit] + t->offset, ST_F32, err,
                          sizeof err) != 0)
            DIE("%s", err);
    }
    char dir_out[4096], file[4200];
    snprintf(dir_out, sizeof dir_out, "%s.d", out_path);
    if (st_writer_write(sw, dir_out, 0, err, sizeof err) != 0) DIE("%s", err);
    snprintf(file, sizeof file, "%s/model.safetensors", dir_out);
    if (rename(file, out_path) != 0) DIE("cannot move %s to %s", file, out_path);
    st_writer_free(sw);
    free(names);
    free(logits), free(lp), free(dlp), free(tok), free(tgt), free(cu);
    for (int i = 0; i < lora->n_layers; i++) free(host[i]);
    free(host);
    train_acts_free(acts, &m);
    model_lora_free(lora);
    resident_free(&w, &m);
    model_free(&m);
    ops_destroy(ops);
    json_decref(req);
    return 0;
}

static int cmd_init(const char *model_dir, const char *out_dir) {
    json_t *req = read_stdin_json();
    ModelConfig cfg;
    if (config_load(&cfg, model_dir, err, sizeof err) != 0) DIE("%s", err);
    OpsCtx *ops;
    Model m;
    if (ops_create(&ops, OPS_BACKEND_CPU, 0, err, sizeof err) != 0) DIE("%s", err);
    if (model_init(&m, &cfg, ops, err, sizeof err) != 0) DIE("%s", err);
    LoraConfig lc = {.r = (int)json_integer_value(json_object_get(req, "r")),
                     .alpha = (float)json_number_value(json_object_get(req, "lora_alpha")),
                     .use_rslora = json_is_true(json_object_get(req, "use_rslora"))};
    const char *targets = json_string_value(json_object_get(req, "target_modules"));
    const char *init = json_string_value(json_object_get(req, "init"));
    if (lora_parse_targets(targets ? targets : "", &lc.targets, err, sizeof err) != 0 ||
        lora_parse_init(init ? init : "default", &lc.init, err, sizeof err) != 0)
        DIE("%s", err);
    ModelLora *lora;
    if (model_lora_create(&lora, &m, &lc, 0, err, sizeof err) != 0) DIE("%s", err);
    float **host = host_units(lora);
    const uint64_t seed = (uint64_t)json_integer_value(json_object_get(req, "seed"));
    for (int l = 0; l < lora->n_layers; l++) model_lora_init_unit(lora, seed, l, host[l]);
    if (model_lora_save(lora, host, out_dir, model_dir, err, sizeof err) != 0) DIE("%s", err);
    for (int i = 0; i < lora->n_layers; i++) free(host[i]);
    free(host);
    model_lora_free(lora);
    model_free(&m);
    ops_destroy(ops);
    json_decref(req);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 5 && strcmp(argv[1], "forward") == 0) return cmd_forward(argv[2], argv[3], argv[4]);
    if (argc >= 4 && strcmp(argv[1], "init") == 0) return cmd_init(argv[2], argv[3]);
    fprintf(stderr, "usage: lora_probe forward MODEL_DIR ADAPTER_DIR OUT | init MODEL_DIR OUT_DIR (see the header)\n");
    return 2;
}
