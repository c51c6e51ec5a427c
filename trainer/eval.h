// trainer/eval.h — `tandem-train eval`: a held-out JSONL scored through any OpenAI-compatible server with the
// built-in rewards; prints the mean of every reward and pass@k, with progress.
#ifndef TANDEM_TRAINER_EVAL_H
#define TANDEM_TRAINER_EVAL_H

#include <stddef.h>

// argv[0] is "eval". Returns the process exit code.
int eval_main(int argc, char **argv);

// Reads a server's answer to one row's request (POST /v1/completions or /v1/chat/completions, n choices): the text
// of choice k (its "index", else its place) into texts[k] (malloc'd; the caller passes n NULLs and frees them; a
// choice without a string text, with an index outside [0, n) or repeated is not usable) and usage.completion_tokens
// (0 when absent, clamped to [0, INT_MAX]). Returns the number of usable choices, or -1 when the status is not 200
// or the body not JSON, with a message naming url, the status and the start of the body.
int eval_read_answer(const char *url, int status, const char *body, size_t body_len, int n, char **texts,
                     int *completion_tokens, char *err, size_t err_len);

#endif
