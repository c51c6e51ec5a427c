// trainer/lora_train.c — the frozen base and the LoRA adapters' optimizer (trainer/lora_train.h).
#include "trainer/lora_train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct LoraTrain {
    Model *m;                // not owned; m->lora points at `lora` while the state lives
    Comm *c;                 // not owned
    OpsCtx *ops;
    ResidentWeights base;    // the frozen base: params only
    ModelLora *lora;         // adapter units and their fp32 gradients
    float **master, **adam_m, **adam_v; // (n_layers) fp32 backend memory, unit_numel each
    float *sumsq;            // one fp32 in backend memory
};

static int fail_ops(LoraTrain *lt, const char *what, char *err, size_t err_len) {
    snprintf(err, err_len, "%s: %s", what, ops_error(lt->ops));
    return -1;
}

int lora_train_create(LoraTrain **out, Model *m, Comm *c, const LoraConfig *lc, const char *model_dir, uint64_t seed,
                      char *err, size_t err_len) {
    *out = NULL;
    LoraTrain *lt = calloc(1, sizeof *lt);
    if (!lt) {
        snprintf(err, err_len, "out of memory for the LoRA state");
        return -1;
    }
    lt->m = m;
    lt->c = c;
    lt->ops = m->ops;
    if (resident_alloc(&lt->base, m, 0, err, err_len) != 0 || model_load_weights(m, &lt->base, model_dir, err, err_len) != 0 ||
        model_lora_create(&lt->lora, m, lc, 1, err, err_len) != 0)
        goto fail;
    const int L = lt->lora->n_layers;
    const size_t n = lt->lora->unit_numel;
    lt->master = calloc((size_t)L, sizeof(float *));
    lt->adam_m = calloc((size_t)L, sizeof(float *));
    lt->adam_v = calloc((size_t)L, sizeof(float *));
    float *host = malloc(n * sizeof(float));
    if (!lt->master || !lt->adam_m || !lt->adam_v || !host) {
        free(host);
        snprintf(err, err_len, "out of memory for the LoRA optimizer state");
        goto fail;
    }
    // The fp32 master is the init itself; the adapter units (storage dtype) are its rounding.
    for (int l = 0; l < L; l++) {
        lt->master[l] = ops_malloc(lt->ops, n * sizeof(float));
        lt->adam_m[l] = ops_malloc(lt->ops, n * sizeof(float));
        lt->adam_v[l] = ops_malloc(lt->ops, n * sizeof(float));
        if (!lt->master[l] || !lt->adam_m[l] || !lt->adam_v[l]) break;
        model_lora_init_unit(lt->lora, seed, l, host);
        ops_copy_to_device(lt->ops, lt->master[l], host, n * sizeof(float));
        ops_upload_f32(lt->ops, lt->lora->params[l], host, n);
    }
    ops_synchronize(lt->ops);
    free(host);
    lt->sumsq = ops_malloc(lt->ops, sizeof(float));
    if (ops_status(lt->ops) || !lt->sumsq) {
        fail_ops(lt, "LoRA optimizer state", err, err_len);
        goto fail;
    }
    model_lora_zero_grads(lt->lora);
    m->lora = lt->lora;
    *out = lt;
    return 0;
fail:
    lora_train_destroy(lt);
    return -1;
}

void lora_train_destroy(LoraTrain *lt) {
    if (!lt) return;
    if (lt->m && lt->m->lora == lt->lora) lt->m->lora = NULL;
    for (int l = 0; lt->lora && l < lt->lora->n_layers; l++) {
        if (lt->master) ops_free(lt->ops, lt->master[l]);
        if (lt->adam_m) ops_free(lt->ops, lt->adam_m[l]);
        if (lt->adam_v) ops_free(lt->ops, lt->adam_v[l]);
    }
    free(lt->master);
    free(lt->adam_m);
    free(lt->adam_v);
    if (lt->sumsq) ops_free(lt->ops, lt->sumsq);
    model_lora_free(lt->lora);
    if (lt->base.params) resident_free(&lt->base, lt->m);
    free(lt);
}

UnitSource lora_train_source(LoraTrain *lt) {
    UnitSource s = resident_source(&lt->base);
    s.grad = NULL;  // frozen: the model skips the base's weight gradients
    return s;
}

void lora_train_memory(const LoraTrain *lt, LoraTrainMemory *mem) {
    const ModelLora *l = lt->lora;
    const size_t es = ops_dtype_size(lt->ops), units = (size_t)l->n_layers * l->unit_numel;
    mem->base_bytes = lt->m->layout.total_numel * es;
    mem->adapter_bytes = units * es;
    mem->state_bytes = units * 4 * sizeof(float);
    mem->n_adapter_params = 0;
    for (int i = 0; i < l->n_tensors; i++) mem->n_adapter_params += l->tensors[i].numel;
}

int lora_train_step(LoraTrain *lt, const AdamWParams *p, float lr, int step, float *grad_norm, char *err,
                    size_t err_len) {
    ModelLora *l = lt->lora;
    OpsCtx *o = lt->ops;
    const size_t n = l->unit_numel;
    // Data parallelism: each rank's gradient is its share of the global loss's (the loss is normalised over every
    // rank's tokens), so the sum over the ranks is the global gradient.
    if (comm_world_size(lt->c) > 1) {
        comm_wait_compute(lt->c);
        for (int layer = 0; layer < l->n_layers; layer++)
            if (comm_all_reduce(lt->c, l->grads[layer], n, COMM_F32, COMM_SUM) != 0) {
                snprintf(err, err_len, "all-reduce of layer %d's adapter gradients failed: %s", layer,
                         comm_error(lt->c));
                return -1;
            }
        comm_compute_wait(lt->c);
    }
    ops_memset_zero(o, lt->sumsq, sizeof(float));
    for (int layer = 0; layer < l->n_layers; layer++) ops_sum_squares(o, lt->sumsq, l->grads[layer], n);
    float sumsq = 0;
    ops_copy_to_host(o, &sumsq, lt->sumsq, sizeof sumsq);
    const float norm = sqrtf(sumsq);
    if (grad_norm) *grad_norm = norm;
    // torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1.
    float scale = 1.0f;
    if (p->max_grad_norm > 0) {
        const float coef = p->max_grad_norm / (norm + 1e-6f);
        scale = coef < 1.0f ? coef : 1.0f;
    }
    // The padding between tensors has zero gradients and zero masters: AdamW leaves it zero.
    for (int layer = 0; layer < l->n_layers; layer++)
        ops_adamw_step(o, lt->master[layer], lt->adam_m[layer], lt->adam_v[layer], l->grads[layer], l->params[layer],
                       n, lr, p->beta1, p->beta2, p->eps, p->weight_decay, step, scale);
    model_lora_zero_grads(l);
    ops_synchronize(o);
    if (ops_status(o)) {
        snprintf(err, err_len, "LoRA optimizer step %d: %s", step, ops_error(o));
        return -1;
    }
    return 0;
}

int lora_train_save(LoraTrain *lt, const char *dir, const char *base_model, char *err, size_t err_len) {
    ModelLora *l = lt->lora;
    float **host = calloc((size_t)l->n_layers, sizeof *host);
    int rc = host ? 0 : -1;
    for (int layer = 0; rc == 0 && layer < l->n_layers; layer++) {
        if (!(host[layer] = malloc(l->unit_numel * sizeof(float)))) rc = -1;
        else ops_copy_to_host(lt->ops, host[layer], lt->master[layer], l->unit_numel * sizeof(float));
    }
    if (rc != 0) snprintf(err, err_len, "out of host memory for the adapter checkpoint");
    if (rc == 0) rc = model_lora_save(l, host, dir, base_model, err, err_len);
    for (int layer = 0; host && layer < l->n_layers; layer++) free(host[layer]);
    free(host);
    return rc;
}
