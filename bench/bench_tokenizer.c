// bench/bench_tokenizer.c — single-thread encode throughput of the C tokenizer, and streaming decode cost.
//
//   bench_tokenizer <tokenizer.json | model folder> <text file> [--mode doc|paragraphs|stream] [--repeat N]
//                   [--streams S]
//
// doc: the whole file in one encode call; paragraphs: one call per blank-line-separated paragraph (what a
// server sees: many prompts of a few hundred bytes). One untimed warm-up pass fills the word cache, as HF's
// cache is filled in bench_tokenizer.py, then N timed passes. Prints one line:
//   tandem <mode>: <MB/s> MB/s  (<tokens> tokens, <bytes> bytes per pass, <N> passes)
//
// stream: what the rollout server's engine thread does per step. The paragraphs are encoded (untimed), then
// S streams (default 512) decode them as a server would: each engine step feeds every live stream its next
// id, a stream that runs out of ids is flushed and takes the next paragraph. Timed N times with the streams
// tokenizer_stream_create picks (the ByteLevel fast path when the decoder allows it) and with the reference
// path (tokenizer_decode per step, as HF's DecodeStream); the two outputs must be byte-identical. Prints:
//   tandem stream: <us> us/token (<path>), reference <us> us/token, <x>x  (<tokens> tokens, S streams)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "shared/tokenizer/tokenizer.h"
#include "shared/tokenizer/tokenizer_internal.h"

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

// The ids of each paragraph, back to back: para_off[p] .. para_off[p + 1] in ids.
typedef struct { int32_t *ids; size_t *para_off; size_t n_para; } Paragraphs;

static int encode_paragraphs(const Tokenizer *t, const char *text, size_t len, Paragraphs *out) {
    char err[256];
    size_t cap_ids = 0, cap_para = 0, n_ids = 0, start = 0;
    memset(out, 0, sizeof(*out));
    while (start < len) {
        const char *p = strstr(text + start, "\n\n");
        size_t end = p ? (size_t)(p - text) + 2 : len;
        int32_t *ids = NULL;
        size_t n = 0;
        if (tokenizer_encode(t, text + start, end - start, 0, &ids, &n, err, sizeof(err))) {
            fprintf(stderr, "encode failed: %s\n", err);
            return -1;
        }
        start = end;
        if (n == 0) { free(ids); continue; }
        if (n_ids + n > cap_ids) {
            cap_ids = 2 * (n_ids + n);
            int32_t *q = realloc(out->ids, cap_ids * sizeof(int32_t));
            if (!q) { free(ids); return -1; }
            out->ids = q;
        }
        if (out->n_para + 2 > cap_para) {
            cap_para = 2 * (out->n_para + 2);
            size_t *q = realloc(out->para_off, cap_para * sizeof(size_t));
            if (!q) { free(ids); return -1; }
            out->para_off = q;
        }
        memcpy(out->ids + n_ids, ids, n * sizeof(int32_t));
        free(ids);
        out->para_off[out->n_para++] = n_ids;
        n_ids += n;
        out->para_off[out->n_para] = n_ids;
    }
    return out->n_para ? 0 : -1;
}

// FNV-1a over everything the streams hand out, in the order handed out, to check both paths agree.
static uint64_t fnv(uint64_t h, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 0x100000001B3ull;
    return h;
}

// One pass of S interleaved streams over all paragraphs; returns the tokens stepped (or -1), *hash the output.
static long long stream_pass(const Tokenizer *t, const Paragraphs *pg, int n_streams, int reference, uint64_t *hash) {
    char err[256];
    TokenizerStream **st = calloc((size_t)n_streams, sizeof(*st));
    size_t *para = calloc((size_t)n_streams, sizeof(size_t)), *pos = calloc((size_t)n_streams, sizeof(size_t));
    long long tokens = 0;
    size_t next_para = 0;
    int live = 0, rc = 0;
    *hash = 0xCBF29CE484222325ull;
    if (!st || !para || !pos) rc = -1;
    for (int s = 0; s < n_streams && !rc && next_para < pg->n_para; s++, live++) {
        rc = reference ? tok_stream_create_reference(&st[s], t, 1, err, sizeof(err))
                       : tokenizer_stream_create(&st[s], t, 1, err, sizeof(err));
        para[s] = next_para++;
        pos[s] = pg->para_off[para[s]];
    }
    while (live > 0 && !rc) {   // one engine step: every live stream gets its next id
        for (int s = 0; s < n_streams && !rc; s++) {
            if (!st[s]) continue;
            char *chunk = NULL;
            size_t cl = 0;
            rc = tokenizer_stream_step(st[s], pg->ids[pos[s]++], &chunk, &cl, err, sizeof(err));
            tokens++;
            if (chunk) *hash = fnv(*hash, chunk, cl);
            free(chunk);
            if (rc || pos[s] < pg->para_off[para[s] + 1]) continue;
            chunk = NULL;
            rc = tokenizer_stream_flush(st[s], &chunk, &cl, err, sizeof(err));
            if (chunk) *hash = fnv(*hash, chunk, cl);
            free(chunk);
            if (next_para < pg->n_para) {   // the stream takes the next request
                para[s] = next_para++;
                pos[s] = pg->para_off[para[s]];
            } else {
                tokenizer_stream_free(st[s]);
                st[s] = NULL;
                live--;
            }
        }
    }
    if (rc) fprintf(stderr, "stream failed: %s\n", err);
    for (int s = 0; st && s < n_streams; s++) tokenizer_stream_free(st[s]);
    free(st);
    free(para);
    free(pos);
    return rc ? -1 : tokens;
}

static int bench_stream(const Tokenizer *t, const char *text, size_t len, int repeat, int n_streams) {
    Paragraphs pg;
    if (encode_paragraphs(t, text, len, &pg)) { free(pg.ids); free(pg.para_off); return 1; }
    double us[2];
    uint64_t hash[2];
    long long tokens = 0;
    for (int reference = 0; reference < 2; reference++) {
        tokens = stream_pass(t, &pg, n_streams, reference, &hash[reference]);   // warm-up
        double t0 = bench_now_s();
        for (int r = 0; r < repeat && tokens >= 0; r++) tokens = stream_pass(t, &pg, n_streams, reference, &hash[reference]);
        us[reference] = (bench_now_s() - t0) * 1e6 / ((double)tokens * repeat);
        if (tokens < 0) break;
    }
    TokenizerStream *probe = NULL;
    char err[256];
    int fast = tokenizer_stream_create(&probe, t, 1, err, sizeof(err)) == 0 && tok_stream_is_fast(probe);
    tokenizer_stream_free(probe);
    free(pg.ids);
    free(pg.para_off);
    if (tokens < 0) return 1;
    if (hash[0] != hash[1]) {
        fprintf(stderr, "stream: the default and reference paths produced different text\n");
        return 1;
    }
    printf("tandem stream: %.3f us/token (%s), reference %.3f us/token, %.1fx  (%lld tokens, %d streams, identical "
           "output)\n", us[0], fast ? "ByteLevel fast path" : "reference path", us[1], us[1] / us[0], tokens, n_streams);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s <tokenizer.json|folder> <text file> [--mode doc|paragraphs|stream] [--repeat N] "
                        "[--streams S]\n", argv[0]);
        return 2;
    }
    int paragraphs = 0, stream = 0, repeat = 3, n_streams = 512;
    for (int i = 3; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--mode") == 0) {
            paragraphs = strcmp(argv[i + 1], "paragraphs") == 0;
            stream = strcmp(argv[i + 1], "stream") == 0;
        } else if (strcmp(argv[i], "--repeat") == 0) {
            repeat = atoi(argv[i + 1]) > 0 ? atoi(argv[i + 1]) : 1;
        } else if (strcmp(argv[i], "--streams") == 0) {
            n_streams = atoi(argv[i + 1]) > 0 ? atoi(argv[i + 1]) : 1;
        }
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
    if (stream) {
        int rc = bench_stream(t, text, len, repeat, n_streams);
        free(text);
        tokenizer_free(t);
        return rc;
    }
    long long tokens = pass(t, text, len, paragraphs);   // warm-up
    double t0 = bench_now_s();
    for (int r = 0; r < repeat && tokens >= 0; r++) tokens = pass(t, text, len, paragraphs);
    double dt = bench_now_s() - t0;
    if (tokens >= 0)
        printf("tandem %s: %.2f MB/s  (%lld tokens, %zu bytes per pass, %d passes)\n", paragraphs ? "paragraphs" : "doc",
               (double)len * repeat / dt / 1e6, tokens, len, repeat);
    free(text);
    tokenizer_free(t);
    return tokens >= 0 ? 0 : 1;
}
