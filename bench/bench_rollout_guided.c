// bench_rollout_guided — what structured outputs cost on the CPU of a server: compiling a pattern (guide_create: the
// byte automaton, then every state's token mask over the vocabulary), and, per step, finding a completion's mask
// (guided state from its generated ids, as sample_mask_build does). The vocabulary is synthetic and byte-level, of V
// tokens (random strings of 1 to 10 bytes drawn from letters, digits, spaces and JSON punctuation, as a BPE
// vocabulary's pieces are), since the box has no real tokenizer of that size; a real one has the same count of
// byte-run steps per state.
//   bench_rollout_guided [--vocab 151646] [--repeat 3]
// One line per pattern: automaton states, compile ms (best of --repeat), the largest mask, and the mask lookup cost
// after 64 generated ids (microseconds). Threads: one (the HTTP thread that compiles).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rollout_server/guided_json.h"
#include "rollout_server/guided_regex.h"
#include "shared/tokenizer/tokenizer_internal.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

// A byte-level tokenizer.json of the 256 bytes plus V - 257 random multi-byte pieces and one special end token.
static char *synthetic_vocab(int V, int *eos) {
    static const char alphabet[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789    {}[]\":,.-_";
    const size_t cap = (size_t)V * 40 + 65536;
    char *buf = malloc(cap), *w = buf;
    *eos = V - 1;
    w += sprintf(w, "{\"version\":\"1.0\",\"added_tokens\":[{\"id\":%d,\"content\":\"<eos>\",\"single_word\":false,"
                    "\"lstrip\":false,\"rstrip\":false,\"normalized\":false,\"special\":true}],\"normalizer\":null,"
                    "\"pre_tokenizer\":null,\"post_processor\":null,\"decoder\":{\"type\":\"ByteLevel\"},"
                    "\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,\"vocab\":{", *eos);
    uint64_t x = 88172645463325252ull;
    for (int id = 0; id < V - 1; id++) {
        char piece[16];
        int n = 0;
        if (id < 256) {
            piece[n++] = (char)id;
        } else {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            const int len = 2 + (int)(x % 9);
            for (int k = 0; k < len; k++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                piece[n++] = alphabet[x % (sizeof alphabet - 1)];
            }
            piece[n++] = (char)('a' + id % 26);   // ids past the alphabet's reach stay distinct
            n += sprintf(piece + n, "%d", id % 10);
        }
        *w++ = '"';
        for (int k = 0; k < n; k++) {   // each byte as its byte-level character
            const unsigned cp = tok_bytelevel_char[(unsigned char)piece[k]];
            if (cp == '"' || cp == '\\') *w++ = '\\';
            if (cp < 0x80) *w++ = (char)cp;
            else *w++ = (char)(0xC0 | (cp >> 6)), *w++ = (char)(0x80 | (cp & 0x3F));
        }
        w += sprintf(w, "\":%d,", id);
    }
    w[-1] = '}';
    w += sprintf(w, ",\"merges\":[]}}");
    return buf;
}

int main(int argc, char **argv) {
    int V = 151646, repeat = 3;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--vocab")) V = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--repeat")) repeat = atoi(argv[i + 1]);
    }
    int eos;
    char *json = synthetic_vocab(V, &eos);
    Tokenizer *tok;
    char err[512];
    if (tokenizer_load_json(&tok, json, strlen(json), err, sizeof err) != 0) {
        fprintf(stderr, "bench_rollout_guided: %s\n", err);
        return 1;
    }
    free(json);
    const char *schema_text = "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\", \"maxLength\": "
                              "20}, \"age\": {\"type\": \"integer\"}, \"tags\": {\"type\": \"array\", \"items\": "
                              "{\"enum\": [\"a\", \"b\", \"c\"]}, \"maxItems\": 3}}}";
    json_t *schema = json_loads(schema_text, 0, NULL);
    size_t slen;
    char *schema_re = guide_json_schema_regex(schema, &slen, err, sizeof err);
    json_decref(schema);
    const char *patterns[][2] = {{"digits [0-9]{3}", "[0-9]{3}"},
                                 {"choice of 4", "yes|no|maybe so|it depends"},
                                 {"answer format", "<answer>-?[0-9]{1,6}</answer>"},
                                 {"free text .{0,200}", ".{0,200}"},
                                 {"json schema (3 fields)", schema_re}};
    printf("vocabulary %d byte-level tokens, one thread\n", V);
    printf("%-24s %8s %12s %10s %14s\n", "pattern", "states", "compile ms", "max mask", "lookup us@64");
    for (size_t p = 0; p < sizeof patterns / sizeof patterns[0]; p++) {
        double best = 1e30;
        Guide *g = NULL;
        for (int r = 0; r < repeat; r++) {
            guide_free(g);
            const double t0 = now_s();
            if (guide_create(&g, patterns[p][1], strlen(patterns[p][1]), tok, V, &eos, 1, err, sizeof err) != 0) {
                fprintf(stderr, "bench_rollout_guided: %s: %s\n", patterns[p][0], err);
                return 1;
            }
            const double dt = now_s() - t0;
            if (dt < best) best = dt;
        }
        // A 64-token completion the guide allows: each step takes the first allowed id (or stops).
        int32_t gen[64];
        int n = 0;
        for (int s = guide_start(g); n < 64 && s >= 0; n++) {
            const int32_t *ids;
            int k, ban;
            guide_mask(g, s, &ids, &k, &ban);
            int32_t pick = -1;
            for (int32_t id = 0; id < V && pick < 0; id++) {
                int in = 0;
                for (int j = 0; j < k && !in; j++) in = ids[j] == id;
                if (in != ban && id != eos) pick = id;
            }
            if (pick < 0) break;
            gen[n] = pick;
            s = guide_advance(g, s, pick);
        }
        const double t0 = now_s();
        int sink = 0;
        for (int r = 0; r < 1000; r++) sink += guide_state_after(g, gen, n);
        const double lookup = (now_s() - t0) / 1000;
        printf("%-24s %8d %12.1f %10d %14.2f%s\n", patterns[p][0], guide_num_states(g), best * 1e3, guide_max_mask(g),
               lookup * 1e6, sink == -12345 ? " " : "");
        guide_free(g);
    }
    free(schema_re);
    tokenizer_free(tok);
    return 0;
}
