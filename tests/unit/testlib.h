// tests/unit/testlib.h — the linked half of the C unit tests' library (tests/unit/testlib.c, linked into every
// unit test; the checks are the header-only check_macros.h): a tiny random model, in memory or written to a model
// folder with the one-character-per-id tokenizer such a folder may need, and the small text files tests write and
// read back.
#ifndef TANDEM_TESTS_TESTLIB_H
#define TANDEM_TESTS_TESTLIB_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ops.h"
#include "shared/model.h"

// Parses config_json, makes *m on ops (the caller's; it outlives the model) with resident weights *w (and gradient
// buffers when with_grads), then model_init_random(seed, std). 0, or -1 with the reason in err.
int tiny_model_init(Model *m, ResidentWeights *w, OpsCtx *ops, const char *config_json, int with_grads, uint64_t seed,
                    float std, char *err, size_t err_len);
void tiny_model_free(Model *m, ResidentWeights *w);

// Logprobs (temperature 1) of gen[0..n_gen) after prompt[0..n_prompt) through the training forward of m with
// weights w: what the trainer computes for a completion. n_prompt + n_gen <= 512. 0, or -1 with the reason in err.
int tiny_model_completion_logprobs(Model *m, ResidentWeights *w, const int32_t *prompt, int n_prompt,
                                   const int32_t *gen, int n_gen, float *out, char *err, size_t err_len);

// Writes the model as a folder into dir (made when missing; its parent must exist): config.json and one fp32
// model.safetensors (model_save).
int tiny_model_write(const Model *m, ResidentWeights *w, const char *dir, char *err, size_t err_len);

// The model folder of config_json with the random weights of (seed, std), made on a CPU context of its own and
// written into dir as tiny_model_write does: model_load of dir on the CPU gives the weights tiny_model_init(seed,
// std) gives there.
int tiny_model_write_random(const char *dir, const char *config_json, uint64_t seed, float std, char *err,
                            size_t err_len);

// Writes dir/tokenizer.json: a BPE model with one id per character of chars (id i is chars[i], printable ASCII),
// no merges, no normalizer or pre-tokenizer, a Fuse decoder (decode concatenates the characters).
int tiny_tokenizer_write(const char *dir, const char *chars, char *err, size_t err_len);

// A TCP socket listening on 127.0.0.1 at a port the kernel picks (*port); a socket that cannot listen ends the
// test (exit 1).
int listen_loopback(int backlog, int *port);

// malloc of n bytes (at least 1); running out of memory ends the test (exit 2).
void *xmalloc(size_t n);

// Makes a fresh, empty folder /tmp/PREFIX_ plus six random characters (mkdtemp) and writes its path into out.
// 0, or -1 (out too small, or mkdtemp failed: errno says why).
int temp_dir_make(const char *prefix, char *out, size_t cap);

// Writes text to path (created or truncated); a file that cannot be written ends the test (exit 1).
void write_text_file(const char *path, const char *text);
// The whole file as a NUL-terminated string (the caller frees it), or NULL when it cannot be read.
char *read_text_file(const char *path);

#endif
