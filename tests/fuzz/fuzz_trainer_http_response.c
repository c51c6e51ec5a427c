// tests/fuzz/fuzz_trainer_http_response.c — libFuzzer target for what tandem-train reads from HTTP servers: the
// response parser of trainer/http_client.c (HttpResponseReader, the one http_post feeds from its socket) and,
// on a whole response, tandem-train eval's reading of the answer (eval_read_answer). The reward service's
// reading of a body is fuzz_trainer_reward_reply's.
//
// Input: byte 0 = bits 0-3: the body limit (0: the default 64 MiB, else 2^bits bytes), bits 4-5: n - 1 choices for
// eval; byte 1 seeds how the bytes are split; the rest is what the server sends before closing the connection.
// Checks:
//   - the response is read the same whatever pieces the bytes arrive in: all at once, and in pieces of 1 to 64
//     bytes, give the same outcome (the same error class, or the same status and body);
//   - a refusal comes with a message naming the URL; an accepted body is NUL-terminated and within the limit;
//   - eval_read_answer gives -1 with a message or 0..n usable choices, one text for each, and a token count >= 0.
// Built by CMake when configured with CC=clang -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF.
#include <stdint.h>

#include "fuzz_testlib.h"
#include "trainer/eval.h"
#include "trainer/http_client.h"

#define URL "http://127.0.0.1:9/v1/completions"

typedef struct {
    int rc;
    HttpResponse resp;
    char err[512];
} Outcome;

// Feeds bytes in pieces (piece_seed 0: all at once), then the end of the connection if the response is not
// whole by then.
static void read_response(const char *bytes, size_t len, size_t max_body, uint32_t piece_seed, Outcome *out) {
    memset(out, 0, sizeof *out);
    HttpResponseReader r;
    http_response_reader_init(&r, max_body);
    int rc = 0;
    uint32_t x = piece_seed;
    for (size_t at = 0; at < len && rc == 0;) {
        size_t piece = len - at;
        if (piece_seed) {
            x ^= x << 13, x ^= x >> 17, x ^= x << 5;   // xorshift32
            size_t want = 1 + x % 64;
            if (want < piece) piece = want;
        }
        // Each piece in its own exact-size buffer, as a recv gives it, so that a read past it is an ASan report.
        char *p = malloc(piece);
        REQUIRE(p);
        memcpy(p, bytes + at, piece);
        rc = http_response_reader_feed(&r, p, piece, 0, URL, out->err, sizeof out->err);
        free(p);
        at += piece;
    }
    if (rc == 0) rc = http_response_reader_feed(&r, NULL, 0, 1, URL, out->err, sizeof out->err);
    REQUIRE(rc != 0);   // at the end of the connection the response is whole or refused
    if (rc == 1) rc = http_response_reader_take(&r, &out->resp, URL, out->err, sizeof out->err);
    out->rc = rc;
    http_response_reader_free(&r);
}

static void check_answer(const HttpResponse *resp, int n) {
    char *texts[4] = {0}, err[1024] = "";
    int tokens = -1;
    int got = eval_read_answer(URL, resp->status, resp->body, resp->body_len, n, texts, &tokens, err, sizeof err);
    REQUIRE(got >= -1 && got <= n && tokens >= 0);
    if (got < 0) REQUIRE(strstr(err, URL));
    int have = 0;
    for (int k = 0; k < 4; k++) {
        REQUIRE(k < n || !texts[k]);
        have += texts[k] != NULL;
        free(texts[k]);
    }
    REQUIRE(have == (got < 0 ? have : got));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    const size_t max_body = (data[0] & 15) ? (size_t)1 << (data[0] & 15) : 0;
    const int n = 1 + ((data[0] >> 4) & 3);
    const char *bytes = (const char *)data + 2;
    const size_t len = size - 2;
    Outcome whole, pieces;
    read_response(bytes, len, max_body, 0, &whole);
    read_response(bytes, len, max_body, 0x9E3779B9u ^ (uint32_t)data[1] * 2654435761u, &pieces);
    REQUIRE(whole.rc == pieces.rc);
    if (whole.rc == HTTP_OK) {
        const HttpResponse *a = &whole.resp, *b = &pieces.resp;
        REQUIRE(a->status == b->status && a->body_len == b->body_len && memcmp(a->body, b->body, a->body_len) == 0);
        REQUIRE(a->body[a->body_len] == '\0' && b->body[b->body_len] == '\0');
        REQUIRE(a->body_len <= (max_body ? max_body : HTTP_DEFAULT_MAX_RESPONSE_BYTES));
        check_answer(a, n);
    } else {
        REQUIRE(strstr(whole.err, URL) && strstr(pieces.err, URL));
    }
    http_response_free(&whole.resp);
    http_response_free(&pieces.resp);
    return 0;
}
