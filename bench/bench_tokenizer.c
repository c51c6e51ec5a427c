// bench/bench_tokenizer.c — single-thread encode throughput of the C tokenizer.
//
//   bench_tokenizer <tokenizer.json | model folder> <text file> [--mode doc|paragraphs] [--repeat N]
//
// doc: the whole file in one encode call; paragraphs: one call per blank-line-separated paragraph (what a
// server sees: many prompts of a few hundred bytes). One untimed warm-up pass fills the word cache, as HF's
// cache is filled in bench_tokenizer.py, then N timed passes. Prints one line:
//   tandem <mode>: <MB/s> MB/s  (<tokens> tokens, <bytes> bytes per pass, <N> passes)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shared/tokenizer.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 20, n = 0, got;
    char *b = malloc(cap);
    while (b && (got = fread(b + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) { cap *= 2; char *p = realloc(b, cap); if (!p) { free(b); b = NULL; } else b = p; }
    }
    fclose(f);
    *len = n;
    return b;
}

// One pass; returns the number of tokens, or -1 on error.
static long long pass(const Tokenizer *t, const char *text, size_t len, int paragraphs) {
    char err[256];
    long long total = 0;
    size_t start = 0;
    while (start < len) {
        size_t end = len;
        if (paragraphs) {
            const char *p = strstr(text + start, "\n\n");   // the file is NUL-free text
            end = p ? (size_t)(p - text) + 2 : len;
        }
        int32_t *ids = NULL;
        size_t n = 0;
        if (tokenizer_encode(t, text + start, end - start, 0, &ids, &n, err, sizeof(err))) {
            fprintf(stderr, "encode failed: %s\n", err);
            return -1;
        }
        free(ids);
        total += (long long)n;
        start = end;
    }
    return total;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s <tokenizer.json|folder> <text file> [--mode doc|paragraphs] [--repeat N]\n", argv[0]);
        return 2;
    }
    int paragraphs = 0, repeat = 3;
    for (int i = 3; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--mode") == 0) paragraphs = strcmp(argv[i + 1], "paragraphs") == 0;
        else if (strcmp(argv[i], "--repeat") == 0) repeat = atoi(argv[i + 1]) > 0 ? atoi(argv[i + 1]) : 1;
    }
    char err[512];
    Tokenizer *t = NULL;
    if (tokenizer_load(&t, argv[1], err, sizeof(err))) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    size_t len = 0;
    char *text = read_all(argv[2], &len);
    if (!text) {
        fprintf(stderr, "cannot read %s\n", argv[2]);
        tokenizer_free(t);
        return 1;
    }
    long long tokens = pass(t, text, len, paragraphs);   // warm-up
    double t0 = now_s();
    for (int r = 0; r < repeat && tokens >= 0; r++) tokens = pass(t, text, len, paragraphs);
    double dt = now_s() - t0;
    if (tokens >= 0)
        printf("tandem %s: %.2f MB/s  (%lld tokens, %zu bytes per pass, %d passes)\n", paragraphs ? "paragraphs" : "doc",
               (double)len * repeat / dt / 1e6, tokens, len, repeat);
    free(text);
    tokenizer_free(t);
    return tokens >= 0 ? 0 : 1;
}
