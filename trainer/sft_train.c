// trainer/sft_train.c — supervised fine-tuning with the GRPO engine's machinery: TRL SFTTrainer's "nll" loss,
// cross-entropy on each row's target tokens (DataRow.loss_start on: a prompt/completion row's completion, or every
// token of a language-modelling row; trainer/data.h), averaged over every target token of the optimizer step on
// every rank.
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/model_lora.h"
#include "trainer/trainer.h"

int trainer_run_sft(Trainer *t, char *err, size_t err_len) {
    TrainConfig *c = t->cfg;
    const int B = c->per_device_train_batch_size, GA = c->gradient_accumulation_steps;
    UnitSource policy = trainer_policy_source(t);
    DataRow *rows = calloc((size_t)B * GA, sizeof *rows);
    if (!rows) {
        snprintf(err, err_len, "out of memory for a batch");
        return -1;
    }
    int rc = 0;
    while (rc == 0 && t->progress.step < t->total_steps) {
        double t0 = trainer_now();
        // The whole step's rows first: the loss is normalised by the step's target tokens on every rank
        // (num_items_in_batch); num_tokens counts every token of the rows, TRL's cumulative count.
        double counts[2] = {0, 0};
        for (int i = 0; i < B * GA && rc == 0; i++) {
            if (trainer_next_row(t, &rows[i], err, err_len) < 0) rc = -1;
            else {
                counts[0] += (double)(rows[i].n_ids - (rows[i].loss_start > 0 ? rows[i].loss_start : 1));
                counts[1] += (double)rows[i].n_ids;
            }
        }
        if (rc == 0 && comm_all_reduce(t->comm, counts, 2, COMM_F64, COMM_SUM) != 0) {
            snprintf(err, err_len, "%s", comm_error(t->comm));
            rc = -1;
        }
        const double tokens = counts[0];
        t->progress.num_input_tokens_seen += (int64_t)counts[1];
        double loss = 0;
        for (int g = 0; g < GA && rc == 0; g++) {
            DataRow *mb = rows + g * B;
            int N = 0;
            for (int b = 0; b < B; b++) N += (int)mb[b].n_ids;
            if (trainer_ensure_acts(t, N, B, err, err_len) != 0) {
                rc = -1;
                break;
            }
            int32_t *tok = malloc(N * 4), *tgt = malloc(N * 4), *cu = malloc((B + 1) * 4);
            float *lp = malloc(N * 4), *dlp = malloc(N * 4);
            int n = 0;
            cu[0] = 0;
            for (int b = 0; b < B; b++) {
                int L = (int)mb[b].n_ids, P = (int)mb[b].loss_start;
                for (int j = 0; j < L; j++) {
                    tok[n + j] = mb[b].ids[j];
                    tgt[n + j] = (j + 1 >= P && j + 1 < L) ? mb[b].ids[j + 1] : -1;
                    dlp[n + j] = tgt[n + j] >= 0 ? (float)(-1.0 / tokens) : 0.0f;
                }
                n += L;
                cu[b + 1] = n;
            }
            Batch batch = {.n_seqs = B, .n_tokens = N, .tokens = tok, .targets = tgt, .cu_seqlens = cu};
            if (t->model.lora)  // this micro-batch's adapter dropout masks (resumed runs draw the same)
                t->model.lora->dropout_seed = lora_dropout_seed((uint64_t)c->seed, t->progress.step, g, t->rank);
            if (model_forward(&t->model, t->acts, &policy, &batch, 1.0f, lp, NULL, NULL, err, err_len) != 0 ||
                model_backward(&t->model, t->acts, &policy, dlp, err, err_len) != 0)
                rc = -1;
            for (int i = 0; i < N && rc == 0; i++)
                if (tgt[i] >= 0) loss -= lp[i] / tokens;
            free(tok), free(tgt), free(cu), free(lp), free(dlp);
        }
        for (int i = 0; i < B * GA; i++) data_row_clear(&rows[i]);
        if (rc != 0) break;
        if (comm_all_reduce(t->comm, &loss, 1, COMM_F64, COMM_SUM) != 0) {
            snprintf(err, err_len, "%s", comm_error(t->comm));
            rc = -1;
            break;
        }
        float gn;
        double lr;
        if (trainer_optimizer_step(t, &gn, &lr, err, err_len) != 0) {
            rc = -1;
            break;
        }
        if (trainer_logs_step(t, t->progress.step)) {
            json_t *m = json_pack("{s:f, s:f, s:f, s:f, s:f, s:f, s:I}", "loss", loss, "grad_norm", (double)gn,
                                  "learning_rate", lr, "num_tokens", (double)t->progress.num_input_tokens_seen,
                                  "num_items_in_batch", tokens, "step_time", trainer_now() - t0, "prompts_skipped",
                                  (json_int_t)data_skipped(t->data));
            trainer_log(t, m);
        }
        if (trainer_saves_step(t, t->progress.step) && trainer_save(t, err, err_len) != 0) rc = -1;
        trainer_progress(t);
    }
    free(rows);
    if (rc == 0 && !trainer_saves_step(t, t->progress.step)) rc = trainer_save(t, err, err_len);
    return rc;
}
