// tests/fuzz/fuzz_zmq_msg.c — libFuzzer target for the ZeroMQ control channel's codec (shared/zmq_msg.h): the
// messages a rollout server reads from a trainer (requests) and a trainer reads from a server (replies).
//
// Input: byte 0 bit 0 picks the direction (0 request, 1 reply); the rest is the message's frames, separated by
// the 4 bytes FF FF FF FF (bytes a JSON header never holds), frame 0 the JSON header.
// Checks:
//   - a refusal comes with a message, and leaves nothing to free (LeakSanitizer sees the rest);
//   - an accepted message encodes (zmsg_build), and its frames decode to the same message: every field and
//     every array equal (round trip encode -> decode), so the two sides of the channel agree on every message
//     either accepts; a second encoding gives the same header bytes.
// Built by CMake when configured with CC=clang -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF.
#define _GNU_SOURCE   // memmem
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/zmq_msg.h"

#define REQUIRE(c) do { if (!(c)) { fprintf(stderr, "invariant failed: %s\n", #c); __builtin_trap(); } } while (0)

#define MAX_FRAMES 4100   // a generate of ZMSG_MAX_PROMPTS prompts, and a few more to be refused
static const unsigned char SEP[4] = {0xff, 0xff, 0xff, 0xff};

// The scalar fields of a message: the message with its array pointers cleared (both messages were zeroed by
// zmsg_parse before any field was set, so the padding compares equal too).
static ZmsgMsg scalars(const ZmsgMsg *m) {
    ZmsgMsg s = *m;
    s.unit_numel = NULL;
    s.prompts = NULL;
    s.prompt_lens = NULL;
    s.completion_lens = NULL;
    s.finish_reasons = NULL;
    s.policy_versions = NULL;
    s.policy_versions_end = NULL;
    s.n_version_changes = NULL;
    s.version_changes = NULL;
    s.tokens = NULL;
    s.logprobs = NULL;
    s.slice_data = NULL;
    return s;
}

static int same_bytes(const void *a, const void *b, size_t n) {
    if (n == 0) return 1;
    return a && b && memcmp(a, b, n) == 0;
}

// Version changes of a result: an all-empty "policy_version_changes" reads back as none (the builder leaves it out).
static size_t count_changes(const ZmsgMsg *m) {
    size_t k = 0;
    for (int i = 0; m->n_version_changes && i < m->n_completions; i++) k += (size_t)m->n_version_changes[i];
    return k;
}

static int same_changes(const ZmsgMsg *a, const ZmsgMsg *b) {
    const size_t k = count_changes(a);
    if (k != count_changes(b)) return 0;
    if (k == 0) return 1;
    for (int i = 0; i < a->n_completions; i++)
        if (a->n_version_changes[i] != b->n_version_changes[i]) return 0;
    for (size_t j = 0; j < k; j++)
        if (a->version_changes[j].token != b->version_changes[j].token ||
            a->version_changes[j].version != b->version_changes[j].version)
            return 0;
    return 1;
}

static int same_message(const ZmsgMsg *a, const ZmsgMsg *b) {
    ZmsgMsg sa = scalars(a), sb = scalars(b);
    if (memcmp(&sa, &sb, sizeof sa) != 0) return 0;
    if (!same_bytes(a->unit_numel, b->unit_numel, (size_t)a->n_units * sizeof *a->unit_numel)) return 0;
    if (a->type == ZMSG_GENERATE) {
        if (!same_bytes(a->prompt_lens, b->prompt_lens, (size_t)a->n_prompts * sizeof *a->prompt_lens)) return 0;
        for (int i = 0; i < a->n_prompts; i++)
            if (!same_bytes(a->prompts[i], b->prompts[i], (size_t)a->prompt_lens[i] * 4)) return 0;
    }
    if (a->type == ZMSG_RESULT) {
        size_t n = (size_t)a->n_completions, total = 0;
        for (size_t i = 0; i < n; i++) total += (size_t)a->completion_lens[i];
        if (!same_bytes(a->completion_lens, b->completion_lens, n * sizeof *a->completion_lens) ||
            !same_bytes(a->finish_reasons, b->finish_reasons, n * sizeof *a->finish_reasons) ||
            !same_bytes(a->policy_versions, b->policy_versions, n * sizeof *a->policy_versions) ||
            !same_bytes(a->policy_versions_end, b->policy_versions_end, n * sizeof *a->policy_versions_end) ||
            !same_bytes(a->tokens, b->tokens, total * 4) || !same_bytes(a->logprobs, b->logprobs, total * 4) ||
            !same_changes(a, b))
            return 0;
    }
    if (a->type == ZMSG_WEIGHTS_SLICE &&
        !same_bytes(a->slice_data, b->slice_data, (size_t)a->count * zmsg_dtype_size(a->dtype)))
        return 0;
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const ZmsgDir dir = (data[0] & 1) ? ZMSG_DIR_REPLY : ZMSG_DIR_REQUEST;
    static ZmsgFrame frames[MAX_FRAMES];
    int nf = 0;
    const uint8_t *p = data + 1, *end = data + size;
    for (;;) {
        const uint8_t *s = memmem(p, (size_t)(end - p), SEP, sizeof SEP);
        if (nf == MAX_FRAMES) return 0;
        frames[nf++] = (ZmsgFrame){p, (size_t)((s ? s : end) - p)};
        if (!s) break;
        p = s + sizeof SEP;
    }
    // Exact-size heap copies, so that a read one byte past a frame is an ASan report.
    unsigned char **copies = calloc((size_t)nf, sizeof *copies);
    REQUIRE(copies);
    for (int i = 0; i < nf; i++) {
        REQUIRE(copies[i] = malloc(frames[i].size ? frames[i].size : 1));
        if (frames[i].size) memcpy(copies[i], frames[i].data, frames[i].size);
        frames[i].data = copies[i];
    }

    ZmsgMsg m, again;
    char err[ZMSG_TEXT_MAX] = "";
    if (zmsg_parse(&m, dir, frames, nf, err, sizeof err) != 0) {
        REQUIRE(err[0] != '\0');
    } else {
        REQUIRE(m.type >= 0 && m.type < ZMSG_N_TYPES && m.dir == dir);
        ZmsgOut out, out2;
        REQUIRE(zmsg_build(&m, &out, err, sizeof err) == 0);
        REQUIRE(zmsg_parse(&again, dir, out.frames, out.n_frames, err, sizeof err) == 0);
        REQUIRE(same_message(&m, &again));
        REQUIRE(zmsg_build(&again, &out2, err, sizeof err) == 0);
        REQUIRE(out2.n_frames == out.n_frames && out2.header_len == out.header_len &&
                memcmp(out2.header, out.header, out.header_len) == 0);
        zmsg_out_free(&out2);
        zmsg_free(&again);
        zmsg_out_free(&out);
        zmsg_free(&m);
    }
    for (int i = 0; i < nf; i++) free(copies[i]);
    free(copies);
    return 0;
}
