// tests/unit/testlib.c — the linked half of the C unit tests' library (testlib.h).
#include "testlib.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "shared/config.h"

int tiny_model_init(Model *m, ResidentWeights *w, OpsCtx *ops, const char *config_json, int with_grads, uint64_t seed,
                    float std, char *err, size_t err_len) {
    ModelConfig cfg;
    if (config_parse(&cfg, config_json, strlen(config_json), err, err_len) != 0) return -1;
    if (model_init(m, &cfg, ops, err, err_len) != 0) return -1;
    if (resident_alloc(w, m, with_grads, err, err_len) != 0) {
        model_free(m);
        return -1;
    }
    model_init_random(m, w, seed, std);
    return 0;
}

void tiny_model_free(Model *m, ResidentWeights *w) {
    resident_free(w, m);
    model_free(m);
}

int tiny_model_completion_logprobs(Model *m, ResidentWeights *w, const int32_t *prompt, int n_prompt,
                                   const int32_t *gen, int n_gen, float *out, char *err, size_t err_len) {
    enum { MAX_TOKENS = 512 };
    const int N = n_prompt + n_gen;
    if (n_prompt < 1 || n_gen < 0 || N > MAX_TOKENS) {
        snprintf(err, err_len, "tiny_model_completion_logprobs: %d + %d tokens (1..%d in all)", n_prompt, n_gen,
                 MAX_TOKENS);
        return -1;
    }
    int32_t tok[MAX_TOKENS], tgt[MAX_TOKENS], cu[2] = {0, N};
    float lp[MAX_TOKENS];
    memcpy(tok, prompt, (size_t)n_prompt * sizeof *tok);
    memcpy(tok + n_prompt, gen, (size_t)n_gen * sizeof *tok);
    // Position i predicts token i + 1: the targets are the completion's tokens, nothing else.
    for (int i = 0; i < N; i++) tgt[i] = (i >= n_prompt - 1 && i < N - 1) ? tok[i + 1] : -1;
    TrainActs *a;
    if (train_acts_create(&a, m, N, 1, 0, err, err_len) != 0) return -1;
    Batch b = {.n_seqs = 1, .n_tokens = N, .tokens = tok, .targets = tgt, .cu_seqlens = cu};
    UnitSource src = resident_source(w);
    int rc = model_forward(m, a, &src, &b, 1.0f, lp, NULL, NULL, err, err_len);
    train_acts_free(a, m);
    if (rc != 0) return -1;
    for (int j = 0; j < n_gen; j++) out[j] = lp[n_prompt - 1 + j];
    return 0;
}

int tiny_model_write(const Model *m, ResidentWeights *w, const char *dir, char *err, size_t err_len) {
    UnitSource src = resident_source(w);
    return model_save(m, &src, dir, 0, 0, err, err_len) != 0 ? -1 : 0;
}

int tiny_model_write_random(const char *dir, const char *config_json, uint64_t seed, float std, char *err,
                            size_t err_len) {
    OpsCtx *ops;
    Model m;
    ResidentWeights w;
    if (ops_create(&ops, OPS_BACKEND_CPU, 0, err, err_len) != 0) return -1;
    int rc = tiny_model_init(&m, &w, ops, config_json, 0, seed, std, err, err_len);
    if (rc == 0) {
        rc = tiny_model_write(&m, &w, dir, err, err_len);
        tiny_model_free(&m, &w);
    }
    ops_destroy(ops);
    return rc;
}

int tiny_tokenizer_write(const char *dir, const char *chars, char *err, size_t err_len) {
    const size_t n = strlen(chars);
    for (size_t i = 0; i < n; i++)
        if (chars[i] < 0x20 || chars[i] > 0x7e) {
            snprintf(err, err_len, "tiny_tokenizer_write: character %zu (0x%02x) is not printable ASCII", i,
                     (unsigned char)chars[i]);
            return -1;
        }
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) {
        snprintf(err, err_len, "cannot write %s", path);
        return -1;
    }
    fputs("{\"version\": \"1.0\", \"added_tokens\": [], \"normalizer\": null, \"pre_tokenizer\": null, "
          "\"post_processor\": null, \"decoder\": {\"type\": \"Fuse\"}, \"model\": {\"type\": \"BPE\", "
          "\"dropout\": null, \"unk_token\": null, \"fuse_unk\": false, \"byte_fallback\": false, \"vocab\": {",
          f);
    for (size_t i = 0; i < n; i++) {
        const char *escape = chars[i] == '"' || chars[i] == '\\' ? "\\" : "";
        fprintf(f, "%s\"%s%c\": %zu", i ? ", " : "", escape, chars[i], i);
    }
    fputs("}, \"merges\": []}}", f);
    int failed = ferror(f);
    if (fclose(f) != 0) failed = 1;
    if (failed) {
        snprintf(err, err_len, "cannot write %s", path);
        return -1;
    }
    return 0;
}

int listen_loopback(int backlog, int *port) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, backlog) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        fprintf(stderr, "FATAL: cannot listen on 127.0.0.1: %s\n", strerror(errno));
        exit(1);
    }
    *port = ntohs(a.sin_port);
    return fd;
}

void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

void write_text_file(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
        fprintf(stderr, "FATAL: cannot write %s\n", path);
        exit(1);
    }
}

int temp_dir_make(const char *prefix, char *out, size_t cap) {
    int n = snprintf(out, cap, "/tmp/%s_", prefix);
    if (n < 0 || (size_t)n + 7 > cap) return -1;
    memset(out + n, 'X', 6);   // mkdtemp replaces the last six characters, which must be X
    out[n + 6] = '\0';
    return mkdtemp(out) ? 0 : -1;
}

char *read_text_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t len = 0, cap = 4096;
    char *text = malloc(cap);
    while (text) {
        len += fread(text + len, 1, cap - 1 - len, f);
        if (len < cap - 1) break;
        char *grown = realloc(text, cap *= 2);
        if (!grown) free(text);
        text = grown;
    }
    fclose(f);
    if (text) text[len] = '\0';
    return text;
}
