// tests/unit/test_rollout_zmq_msg.c — the ZeroMQ message codec (shared/zmq_msg.h) without sockets or engine:
// every message type round-trips build -> frames -> parse in its direction(s), frames survive being unaligned,
// and every refusal (bad JSON, unknown type / field, missing or mistyped fields, out-of-range values, frame
// counts and byte sizes that disagree with the header) comes back as an error naming the culprit.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/dtype.h"
#include "shared/zmq_msg.h"
#include "tests/unit/check_macros.h"

// Encodes m, copies every frame to an odd address (ZeroMQ gives no alignment), parses it back into *back.
static int round_trip(const ZmsgMsg *m, ZmsgMsg *back) {
    ZmsgOut o;
    char err[512] = "";
    if (zmsg_build(m, &o, err, sizeof err)) {
        fprintf(stderr, "build of %s failed: %s\n", zmsg_type_name(m->type), err);
        failures++;
        return -1;
    }
    ZmsgFrame *fr = calloc((size_t)o.n_frames, sizeof *fr);
    char **bufs = calloc((size_t)o.n_frames, sizeof *bufs);
    for (int i = 0; i < o.n_frames; i++) {
        bufs[i] = malloc(o.frames[i].size + 1);
        memcpy(bufs[i] + 1, o.frames[i].data, o.frames[i].size);
        fr[i] = (ZmsgFrame){bufs[i] + 1, o.frames[i].size};
    }
    int rc = zmsg_parse(back, m->dir, fr, o.n_frames, err, sizeof err);
    if (rc) {
        fprintf(stderr, "parse of built %s failed: %s\n  header: %s\n", zmsg_type_name(m->type), err, o.header);
        failures++;
    }
    // A weights_slice keeps pointing into the frames: compare its data before they go.
    if (rc == 0 && m->type == ZMSG_WEIGHTS_SLICE)
        CHECK(!memcmp(back->slice_data, m->slice_data, (size_t)m->count * zmsg_dtype_size(m->dtype)));
    for (int i = 0; i < o.n_frames; i++) free(bufs[i]);
    free(bufs);
    free(fr);
    zmsg_out_free(&o);
    return rc;
}

// Parses a header text plus data frames in direction dir; expects a refusal whose message holds needle (and
// needle2 when given), and that the header's id (or -1) is reported.
static void refuse_frames(int line, ZmsgDir dir, const char *header, const ZmsgFrame *data, int n_data,
                          const char *needle, const char *needle2, int64_t want_id) {
    ZmsgFrame fr[8];
    fr[0] = (ZmsgFrame){header, strlen(header)};
    for (int i = 0; i < n_data; i++) fr[1 + i] = data[i];
    ZmsgMsg m;
    char err[512] = "";
    int rc = zmsg_parse(&m, dir, fr, 1 + n_data, err, sizeof err);
    int ok = rc < 0 && strstr(err, needle) && (!needle2 || strstr(err, needle2)) && m.id == want_id;
    if (!ok) {
        fprintf(stderr, "line %d: expected refusal with '%s' '%s' id %lld; got rc=%d id=%lld err='%s'\n  header: %s\n",
                line, needle, needle2 ? needle2 : "", (long long)want_id, rc, (long long)m.id, err, header);
        failures++;
    }
    if (rc == 0) zmsg_free(&m);
}
#define REFUSE(dir, hdr, data, nd, needle, needle2, id) refuse_frames(__LINE__, dir, hdr, data, nd, needle, needle2, id)
#define REQ ZMSG_DIR_REQUEST
#define REP ZMSG_DIR_REPLY

static void test_names_and_hash(void) {
    CHECK(!strcmp(zmsg_type_name(ZMSG_WEIGHTS_SLICE), "weights_slice"));
    CHECK(zmsg_type_name(ZMSG_N_TYPES) == NULL);
    CHECK(!strcmp(zmsg_finish_name(ZMSG_FINISH_ABORT), "abort"));
    CHECK(zmsg_dtype_size(ZMSG_DTYPE_BF16) == 2 && zmsg_dtype_size(ZMSG_DTYPE_F32) == 4);
    char hex[17];
    uint64_t h = 0;
    zmsg_hash_to_hex(0x00a1b2c3d4e5f607ull, hex);
    CHECK(!strcmp(hex, "00a1b2c3d4e5f607"));
    CHECK(zmsg_hash_from_hex(hex, &h) == 0 && h == 0x00a1b2c3d4e5f607ull);
    CHECK(zmsg_hash_from_hex("00A1B2C3D4E5F607", &h) < 0);   // uppercase refused: one spelling only
    CHECK(zmsg_hash_from_hex("0xa1b2c3d4e5f607", &h) < 0);
    CHECK(zmsg_hash_from_hex("a1b2", &h) < 0);
    CHECK(zmsg_hash_from_hex(NULL, &h) < 0);
}

static void test_hello(void) {
    ZmsgMsg m, b;
    zmsg_init(&m, ZMSG_HELLO, REQ, 0);
    if (round_trip(&m, &b) == 0) {
        CHECK(b.type == ZMSG_HELLO && b.id == 0 && b.protocol_version == 0);
        zmsg_free(&b);
    }
    m.protocol_version = 1;
    m.id = 123456789012345ll;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.protocol_version == 1 && b.id == 123456789012345ll);
        zmsg_free(&b);
    }
    int64_t numel[4] = {13504, 24640, 24640, 13568};
    zmsg_init(&m, ZMSG_HELLO, REP, 7);
    m.protocol_version = ZMSG_PROTOCOL_VERSION;
    snprintf(m.model_id, sizeof m.model_id, "tiny-llama");
    m.layout_hash = 0xfedcba9876543210ull;
    m.n_units = 4;
    m.unit_numel = numel;
    m.policy_version = -3;
    m.max_seq_len = 256;
    m.vocab_size = 211;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.id == 7 && b.protocol_version == ZMSG_PROTOCOL_VERSION && !strcmp(b.model_id, "tiny-llama"));
        CHECK(b.layout_hash == 0xfedcba9876543210ull && b.n_units == 4 && b.policy_version == -3);
        CHECK(b.max_seq_len == 256 && b.vocab_size == 211 && b.tensor_parallel_size == 1);
        for (int u = 0; u < 4; u++) CHECK(b.unit_numel[u] == numel[u]);
        zmsg_free(&b);
    }
    m.tensor_parallel_size = 4;   // a tensor-parallel server says its shards
    if (round_trip(&m, &b) == 0) {
        CHECK(b.tensor_parallel_size == 4);
        zmsg_free(&b);
    }
    m.tensor_parallel_size = 0;
    m.unit_numel = NULL;
    ZmsgOut o;
    char err[256];
    CHECK(zmsg_build(&m, &o, err, sizeof err) < 0 && strstr(err, "unit_numel"));
}

static void test_generate(void) {
    int32_t p0[3] = {1, 2, 3}, p1[1] = {77}, p2[5] = {5, 4, 3, 2, 1};
    int32_t *prompts[3] = {p0, p1, p2};
    int lens[3] = {3, 1, 5};
    ZmsgMsg m, b;
    zmsg_init(&m, ZMSG_GENERATE, REQ, 42);
    m.n_prompts = 3;
    m.prompts = prompts;
    m.prompt_lens = lens;
    ZmsgSampling *s = &m.sampling;
    s->n = 8;
    s->max_tokens = 100;
    s->temperature = 0.7f;
    s->top_p = 0.95f;
    s->top_k = 50;
    s->min_p = 0.05f;
    s->repetition_penalty = 1.1f;
    s->has_seed = 1;
    s->seed = 9007199254740993ull;   // above 2^53: must not pass through a double
    s->stop_token_ids[0] = 2;
    s->stop_token_ids[1] = 151643;
    s->n_stop_token_ids = 2;
    s->ignore_eos = 1;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.id == 42 && b.n_prompts == 3);
        for (int i = 0; i < 3; i++) {
            CHECK(b.prompt_lens[i] == lens[i]);
            CHECK(!memcmp(b.prompts[i], prompts[i], sizeof(int32_t) * (size_t)lens[i]));
        }
        ZmsgSampling *t = &b.sampling;
        CHECK(t->n == 8 && t->max_tokens == 100 && t->temperature == 0.7f && t->top_p == 0.95f && t->top_k == 50);
        CHECK(t->min_p == 0.05f && t->repetition_penalty == 1.1f && t->has_seed && t->seed == 9007199254740993ull);
        CHECK(t->n_stop_token_ids == 2 && t->stop_token_ids[1] == 151643 && t->ignore_eos == 1);
        zmsg_free(&b);
    }
    // No seed -> null -> has_seed 0.
    s->has_seed = 0;
    if (round_trip(&m, &b) == 0) {
        CHECK(!b.sampling.has_seed);
        zmsg_free(&b);
    }
    // A minimal header takes vLLM's defaults; integers are accepted for float fields.
    const char *h = "{\"type\":\"generate\",\"id\":1,\"n_prompts\":1,\"temperature\":0}";
    ZmsgFrame fr[2] = {{h, strlen(h)}, {p0, 12}};
    char err[512];
    if (zmsg_parse(&b, REQ, fr, 2, err, sizeof err) == 0) {
        ZmsgSampling d;
        zmsg_sampling_default(&d);
        d.temperature = 0;
        CHECK(!memcmp(&b.sampling, &d, sizeof d));
        CHECK(b.sampling.n == 1 && b.sampling.max_tokens == 16 && b.sampling.top_k == -1);
        zmsg_free(&b);
    } else {
        fprintf(stderr, "minimal generate refused: %s\n", err);
        failures++;
    }
    // Build refusals.
    ZmsgOut o;
    m.n_prompts = 0;
    CHECK(zmsg_build(&m, &o, err, sizeof err) < 0 && strstr(err, "prompts"));
    m.n_prompts = 3;
    lens[1] = 0;
    CHECK(zmsg_build(&m, &o, err, sizeof err) < 0 && strstr(err, "prompt 1"));
    lens[1] = 1;
    s->n_stop_token_ids = ZMSG_MAX_STOP + 1;
    CHECK(zmsg_build(&m, &o, err, sizeof err) < 0 && strstr(err, "stop_token_ids"));
    m.dir = REP;
    CHECK(zmsg_build(&m, &o, err, sizeof err) < 0 && strstr(err, "not valid as a reply"));
}

static void test_generate_refusals(void) {
    int32_t ok[2] = {4, 5}, neg[2] = {4, -1};
    ZmsgFrame one[1] = {{ok, 8}};
    ZmsgFrame two[2] = {{ok, 8}, {ok, 8}};
#define G(extra) "{\"type\":\"generate\",\"id\":5,\"n_prompts\":1" extra "}"
    REFUSE(REQ, "{\"type\":\"generate\",\"id\":5}", one, 1, "missing field \"n_prompts\"", NULL, 5);
    REFUSE(REQ, "{\"type\":\"generate\",\"id\":5,\"n_prompts\":0}", NULL, 0, "\"n_prompts\" is 0", NULL, 5);
    REFUSE(REQ, "{\"type\":\"generate\",\"id\":5,\"n_prompts\":5000}", one, 1, "n_prompts", "4096", 5);
    REFUSE(REQ, "{\"type\":\"generate\",\"id\":5,\"n_prompts\":\"1\"}", one, 1, "\"n_prompts\" must be an integer",
           NULL, 5);
    REFUSE(REQ, G(",\"n\":0"), one, 1, "\"n\" is 0", NULL, 5);
    REFUSE(REQ, G(",\"n\":1.5"), one, 1, "\"n\" must be an integer", NULL, 5);
    REFUSE(REQ, G(",\"n\":true"), one, 1, "\"n\" must be an integer", NULL, 5);
    REFUSE(REQ, G(",\"max_tokens\":0"), one, 1, "\"max_tokens\" is 0", NULL, 5);
    REFUSE(REQ, G(",\"temperature\":-0.5"), one, 1, "\"temperature\" must be >= 0", NULL, 5);
    REFUSE(REQ, G(",\"temperature\":\"hot\""), one, 1, "\"temperature\" must be a number", NULL, 5);
    REFUSE(REQ, G(",\"top_p\":0"), one, 1, "\"top_p\" must be in (0, 1]", NULL, 5);
    REFUSE(REQ, G(",\"top_p\":1.5"), one, 1, "\"top_p\"", NULL, 5);
    REFUSE(REQ, G(",\"top_k\":-2"), one, 1, "\"top_k\" is -2", NULL, 5);
    REFUSE(REQ, G(",\"min_p\":1.01"), one, 1, "\"min_p\" must be in [0, 1]", NULL, 5);
    REFUSE(REQ, G(",\"repetition_penalty\":0"), one, 1, "\"repetition_penalty\" must be > 0", NULL, 5);
    // The engine's floats: beyond FLT_MAX would be inf, a positive value below the smallest float 0.
    REFUSE(REQ, G(",\"temperature\":1e39"), one, 1, "\"temperature\" must be at most", NULL, 5);
    REFUSE(REQ, G(",\"repetition_penalty\":1e39"), one, 1, "\"repetition_penalty\" must be at most", NULL, 5);
    REFUSE(REQ, G(",\"repetition_penalty\":1e-50"), one, 1, "\"repetition_penalty\" must be > 0", NULL, 5);
    REFUSE(REQ, G(",\"top_p\":1e-50"), one, 1, "\"top_p\" must be in (0, 1]", NULL, 5);
    REFUSE(REQ, G(",\"seed\":-1"), one, 1, "\"seed\" is -1", NULL, 5);
    REFUSE(REQ, G(",\"seed\":\"7\""), one, 1, "\"seed\" must be an integer", NULL, 5);
    REFUSE(REQ, G(",\"stop_token_ids\":3"), one, 1, "\"stop_token_ids\" must be an array", NULL, 5);
    REFUSE(REQ, G(",\"stop_token_ids\":[1,-3]"), one, 1, "\"stop_token_ids\"[1]", NULL, 5);
    REFUSE(REQ, G(",\"stop_token_ids\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]"), one, 1, "stop_token_ids",
           "at most 16", 5);
    REFUSE(REQ, G(",\"ignore_eos\":1"), one, 1, "\"ignore_eos\" must be true or false", NULL, 5);
    REFUSE(REQ, G(",\"max_token\":10"), one, 1, "unknown field \"max_token\"", NULL, 5);
    REFUSE(REQ, G(",\"n\":2,\"n\":3"), one, 1, "not valid JSON", "duplicate", -1);
    // Frames that disagree with the header.
    REFUSE(REQ, G(""), NULL, 0, "n_prompts 1", "got 1", 5);
    REFUSE(REQ, G(""), two, 2, "2 frames are expected, got 3", NULL, 5);
    ZmsgFrame odd[1] = {{ok, 7}}, empty[1] = {{ok, 0}}, negf[1] = {{neg, 8}};
    REFUSE(REQ, G(""), odd, 1, "frame 1 (prompt 0) has 7 bytes", "multiple of 4", 5);
    REFUSE(REQ, G(""), empty, 1, "frame 1 (prompt 0) has 0 bytes", NULL, 5);
    REFUSE(REQ, G(""), negf, 1, "prompt 0 token 1 is -1", NULL, 5);
#undef G
}

static void test_result(void) {
    int lens[3] = {2, 0, 3};
    ZmsgFinish fin[3] = {ZMSG_FINISH_STOP, ZMSG_FINISH_ABORT, ZMSG_FINISH_LENGTH};
    int64_t v0[3] = {4, 4, 4}, v1[3] = {4, 4, 5};
    int32_t tok[5] = {10, 2, 11, 12, 13};
    float lp[5] = {-0.5f, -1.25f, -0.001f, -7.5f, -0.0f};
    ZmsgMsg m, b;
    zmsg_init(&m, ZMSG_RESULT, REP, 9);
    m.prompt_index = 1;
    m.n_prompts = 2;
    m.n_completions = 3;
    m.completion_lens = lens;
    m.finish_reasons = fin;
    m.policy_versions = v0;
    m.policy_versions_end = v1;
    m.tokens = tok;
    m.logprobs = lp;
    m.prompt_tokens = 12;
    m.cached_tokens = 8;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.id == 9 && b.prompt_index == 1 && b.n_prompts == 2 && b.n_completions == 3);
        CHECK(b.prompt_tokens == 12 && b.cached_tokens == 8);
        for (int i = 0; i < 3; i++)
            CHECK(b.completion_lens[i] == lens[i] && b.finish_reasons[i] == fin[i] && b.policy_versions[i] == v0[i] &&
                  b.policy_versions_end[i] == v1[i]);
        CHECK(!memcmp(b.tokens, tok, sizeof tok) && !memcmp(b.logprobs, lp, sizeof lp));   // bit-exact floats
        zmsg_free(&b);
    }
    // All completions empty: frames of 0 bytes.
    int zl[1] = {0};
    m.n_completions = 1;
    m.completion_lens = zl;
    m.tokens = NULL;
    m.logprobs = NULL;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.completion_lens[0] == 0);
        zmsg_free(&b);
    }
    ZmsgOut o;
    char err[256];
    m.dir = REQ;
    CHECK(zmsg_build(&m, &o, err, sizeof err) < 0 && strstr(err, "not valid as a request"));
    m.dir = REP;
    m.completion_lens = lens;
    m.n_completions = 3;
    CHECK(zmsg_build(&m, &o, err, sizeof err) < 0 && strstr(err, "no token"));

#define R(lens, fin, extra)                                                                                     \
    "{\"type\":\"result\",\"id\":3,\"prompt_index\":0,\"n_prompts\":1,\"n\":2,\"completion_lens\":" lens          \
    ",\"finish_reasons\":" fin ",\"policy_versions\":[1,1],\"policy_versions_end\":[1,1],\"prompt_tokens\":4,"   \
    "\"cached_tokens\":0" extra "}"
    int32_t t3[3] = {1, 2, 3};
    float l3[3] = {0, 0, 0};
    ZmsgFrame good[2] = {{t3, 12}, {l3, 12}}, short_lp[2] = {{t3, 12}, {l3, 8}}, short_tok[2] = {{t3, 8}, {l3, 12}};
    REFUSE(REP, R("[1,2]", "[\"stop\",\"length\"]", ""), short_lp, 2, "frame 2 (float32 logprobs) has 8 bytes",
           "expected 12", 3);
    REFUSE(REP, R("[1,2]", "[\"stop\",\"length\"]", ""), short_tok, 2, "frame 1 (int32 completion tokens) has 8",
           NULL, 3);
    REFUSE(REP, R("[1,2]", "[\"stop\",\"length\"]", ""), good, 1, "expected 3 frames", NULL, 3);
    REFUSE(REP, R("[1,2]", "[\"stop\",\"finished\"]", ""), good, 2, "\"finish_reasons\"[1]", NULL, 3);
    REFUSE(REP, R("[3]", "[\"stop\",\"length\"]", ""), good, 2, "\"completion_lens\" has 1 elements, expected 2", NULL,
           3);
    REFUSE(REP, R("[1,-2]", "[\"stop\",\"length\"]", ""), good, 2, "\"completion_lens\"[1]", NULL, 3);
    REFUSE(REP, R("[1,2]", "[\"stop\",\"length\"]", ",\"extra\":1"), good, 2, "unknown field \"extra\"", NULL, 3);
    REFUSE(REQ, R("[1,2]", "[\"stop\",\"length\"]", ""), good, 2, "\"result\" is not valid as a request", NULL, 3);
#undef R
    REFUSE(REP, "{\"type\":\"result\",\"id\":3,\"prompt_index\":1,\"n_prompts\":1,\"n\":1}", NULL, 0,
           "\"prompt_index\" is 1, outside [0, 0]", NULL, 3);
    REFUSE(REP, "{\"type\":\"result\",\"id\":3,\"prompt_index\":0,\"n_prompts\":1,\"n\":1,\"prompt_tokens\":4,"
                "\"cached_tokens\":5}", NULL, 0, "\"cached_tokens\" is 5", NULL, 3);
}

// In-flight weight updates (issue 24): where a completion's version changed travels only when it did, and is
// checked against the lengths and the first / last versions.
static void test_result_version_changes(void) {
    int lens[3] = {4, 2, 5};
    ZmsgFinish fin[3] = {ZMSG_FINISH_LENGTH, ZMSG_FINISH_STOP, ZMSG_FINISH_LENGTH};
    int64_t v0[3] = {3, 4, 3}, v1[3] = {4, 4, 5};
    int n_chg[3] = {1, 0, 2};
    ZmsgVersionChange chg[3] = {{2, 4}, {1, 4}, {3, 5}};
    int32_t tok[11] = {0};
    float lp[11] = {0};
    ZmsgMsg m, b;
    zmsg_init(&m, ZMSG_RESULT, REP, 9);
    m.n_prompts = 1;
    m.n_completions = 3;
    m.completion_lens = lens;
    m.finish_reasons = fin;
    m.policy_versions = v0;
    m.policy_versions_end = v1;
    m.n_version_changes = n_chg;
    m.version_changes = chg;
    m.tokens = tok;
    m.logprobs = lp;
    m.prompt_tokens = 3;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.n_version_changes && b.n_version_changes[0] == 1 && b.n_version_changes[1] == 0 &&
              b.n_version_changes[2] == 2);
        CHECK(b.version_changes && b.version_changes[0].token == 2 && b.version_changes[0].version == 4 &&
              b.version_changes[1].token == 1 &&
              b.version_changes[1].version == 4 && b.version_changes[2].token == 3 && b.version_changes[2].version == 5);
        zmsg_free(&b);
    }
    ZmsgOut o;
    char err[256];
    int none[3] = {0, 0, 0};
    m.n_version_changes = none; // no change anywhere: the field is left out, as servers before it sent results
    if (zmsg_build(&m, &o, err, sizeof err) == 0) {
        CHECK(!strstr(o.header, "policy_version_changes"), "header %s", o.header);
        zmsg_out_free(&o);
    }
    if (round_trip(&m, &b) == 0) {
        CHECK(b.n_version_changes == NULL && b.version_changes == NULL);
        zmsg_free(&b);
    }
#define R(changes)                                                                                              \
    "{\"type\":\"result\",\"id\":3,\"prompt_index\":0,\"n_prompts\":1,\"n\":2,\"completion_lens\":[3,2],"       \
    "\"finish_reasons\":[\"length\",\"length\"],\"policy_versions\":[1,1],\"policy_versions_end\":[2,1],"           \
    "\"prompt_tokens\":4,\"cached_tokens\":0,\"policy_version_changes\":" changes "}"
    int32_t t5[5] = {0};
    float l5[5] = {0};
    ZmsgFrame good[2] = {{t5, 20}, {l5, 20}};
    ZmsgFrame fr[3] = {{R("[[[1,2]],[]]"), strlen(R("[[[1,2]],[]]"))}, good[0], good[1]};
    ZmsgMsg ok;
    CHECK(zmsg_parse(&ok, REP, fr, 3, err, sizeof err) == 0 && ok.n_version_changes[0] == 1 &&
              ok.version_changes[0].token == 1 && ok.version_changes[0].version == 2 && ok.n_version_changes[1] == 0,
          "a valid change list: %s", err);
    zmsg_free(&ok);
    REFUSE(REP, R("[[[1,2]]]"), good, 2, "\"policy_version_changes\" has 1 elements, expected 2", NULL, 3);
    REFUSE(REP, R("[[[0,2]],[]]"), good, 2, "\"policy_version_changes\"[0][0][0]", NULL, 3);   // token 0: no change
    REFUSE(REP, R("[[[3,2]],[]]"), good, 2, "\"policy_version_changes\"[0][0][0]", NULL, 3);   // past the last token
    REFUSE(REP, R("[[[1,1]],[]]"), good, 2, "must differ from the version before it (1)", NULL, 3);
    REFUSE(REP, R("[[[1,3]],[]]"), good, 2, "ends with version 3, but policy_versions_end says 2", NULL, 3);
    REFUSE(REP, R("[[[2,3],[1,2]],[]]"), good, 2, "\"policy_version_changes\"[0][1][0]", NULL, 3); // not increasing
    REFUSE(REP, R("[[[1]],[]]"), good, 2, "must be a [token, version] pair", NULL, 3);
    REFUSE(REP, R("[{},[]]"), good, 2, "must be an array of [token, version] pairs", NULL, 3);
#undef R
}

static void test_weights_end_mode(void) {
    ZmsgMsg m, b;
    zmsg_init(&m, ZMSG_WEIGHTS_END, REQ, 22);
    m.version = 5;
    m.has_update_mode = 1;
    m.update_mode = ZMSG_UPDATE_ABORT;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.version == 5 && b.has_update_mode && b.update_mode == ZMSG_UPDATE_ABORT);
        zmsg_free(&b);
    }
    m.update_mode = ZMSG_UPDATE_KEEP;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.has_update_mode && b.update_mode == ZMSG_UPDATE_KEEP);
        zmsg_free(&b);
    }
    m.update_mode = ZMSG_UPDATE_KEEP_KV;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.has_update_mode && b.update_mode == ZMSG_UPDATE_KEEP_KV);
        zmsg_free(&b);
    }
    CHECK(!strcmp(zmsg_update_mode_name(ZMSG_UPDATE_KEEP_KV), "keep_kv") &&
          !strcmp(zmsg_update_mode_name(ZMSG_UPDATE_ABORT), "abort"));
    zmsg_init(&m, ZMSG_WEIGHTS_END, REP, 22);
    m.version = 5;
    m.has_update_report = 1;
    m.sequences_kept = 12;
    m.sequences_requeued = 3;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.has_update_report && b.sequences_kept == 12 && b.sequences_requeued == 3);
        zmsg_free(&b);
    }
    m.has_update_report = 0;
    if (round_trip(&m, &b) == 0) {
        CHECK(!b.has_update_report && b.sequences_kept == 0);
        zmsg_free(&b);
    }
    REFUSE(REQ, "{\"type\":\"weights_end\",\"id\":32,\"version\":1,\"mode\":\"wait\"}", NULL, 0,
           "must be \"keep\", \"abort\" or \"keep_kv\", got \"wait\"", NULL, 32);
    REFUSE(REQ, "{\"type\":\"weights_end\",\"id\":32,\"version\":1,\"mode\":1}", NULL, 0, "\"mode\"", NULL, 32);
    REFUSE(REP, "{\"type\":\"weights_end\",\"id\":32,\"version\":1,\"seconds\":1,\"commit_seconds\":0,"
                "\"sequences_kept\":1}", NULL, 0, "come together", NULL, 32);
    REFUSE(REP, "{\"type\":\"weights_end\",\"id\":32,\"version\":1,\"seconds\":1,\"commit_seconds\":0,"
                "\"sequences_kept\":-1,\"sequences_requeued\":0}", NULL, 0, "\"sequences_kept\"", NULL, 32);
    REFUSE(REP, "{\"type\":\"weights_end\",\"id\":32,\"version\":1,\"seconds\":1,\"commit_seconds\":0,"
                "\"mode\":\"keep\"}", NULL, 0, "unknown field \"mode\"", NULL, 32);
}

static void test_simple_and_stats(void) {
    ZmsgType simple[5] = {ZMSG_PAUSE, ZMSG_RESUME, ZMSG_RESET_CACHE, ZMSG_SHUTDOWN, ZMSG_STATS};
    for (int i = 0; i < 5; i++)
        for (int d = 0; d < 2; d++) {
            if (simple[i] == ZMSG_STATS && d == REP) continue;
            ZmsgMsg m, b;
            zmsg_init(&m, simple[i], (ZmsgDir)d, 1000 + i);
            if (round_trip(&m, &b) == 0) {
                CHECK(b.type == simple[i] && b.id == 1000 + i && b.dir == (ZmsgDir)d);
                zmsg_free(&b);
            }
        }
    ZmsgMsg m, b;
    zmsg_init(&m, ZMSG_STATS, REP, 3);
    ZmsgStats *s = &m.stats;
    s->requests_waiting = 1;
    s->requests_running = 2;
    s->sequences_running = 16;
    s->kv_blocks_total = 1024;
    s->kv_blocks_used = 100;
    s->kv_blocks_cached = 7;
    s->prompt_tokens_total = 5000;
    s->generation_tokens_total = 123456;
    s->cached_prompt_tokens_total = 64;
    s->preemptions_total = 3;
    s->steps_total = 999;
    s->step_seconds_sum = 12.5;
    s->policy_version = 11;
    s->paused = 1;
    s->prompts_in_flight = 4;
    if (round_trip(&m, &b) == 0) {
        CHECK(!memcmp(&b.stats, s, sizeof *s));
        zmsg_free(&b);
    }
    int32_t t[1] = {1};
    ZmsgFrame extra[1] = {{t, 4}};
    REFUSE(REQ, "{\"type\":\"pause\",\"id\":8}", extra, 1, "pause: expected 1 frame", "got 2", 8);
    REFUSE(REQ, "{\"type\":\"resume\",\"id\":8,\"now\":true}", NULL, 0, "resume: unknown field \"now\"", NULL, 8);
    REFUSE(REP, "{\"type\":\"stats\",\"id\":8,\"requests_waiting\":1}", NULL, 0, "stats: missing field", NULL, 8);
}

static void test_weights(void) {
    ZmsgMsg m, b;
    zmsg_init(&m, ZMSG_WEIGHTS_BEGIN, REQ, 20);
    m.version = 5;
    m.transport = ZMSG_TRANSPORT_NCCL;
    m.layout_hash = 0x0123456789abcdefull;
    for (int i = 0; i < ZMSG_NCCL_ID_BYTES; i++) m.nccl_id[i] = (uint8_t)(i * 37 + 11);
    m.trainer_ranks = 7, m.nccl_world = 9, m.nccl_rank = 8;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.version == 5 && b.transport == ZMSG_TRANSPORT_NCCL && b.layout_hash == 0x0123456789abcdefull);
        CHECK(!memcmp(b.nccl_id, m.nccl_id, ZMSG_NCCL_ID_BYTES) && b.trainer_ranks == 7 && b.nccl_world == 9 &&
              b.nccl_rank == 8);
        CHECK(b.tensor_parallel_size == 1 && b.comm_backend == ZMSG_COMM_NCCL);
        zmsg_free(&b);
    }
    // A server of 2 shards over the host backend: members 7 and 8.
    m.nccl_rank = 7, m.tensor_parallel_size = 2, m.comm_backend = ZMSG_COMM_HOST;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.nccl_rank == 7 && b.tensor_parallel_size == 2 && b.comm_backend == ZMSG_COMM_HOST);
        zmsg_free(&b);
    }
    // Its shards must fit in the world.
    m.nccl_rank = 8;
    {
        ZmsgOut o;
        char err[512];
        CHECK(zmsg_build(&m, &o, err, sizeof err) == 0);
        CHECK(zmsg_parse(&b, REQ, o.frames, o.n_frames, err, sizeof err) != 0 && strstr(err, "tensor_parallel_size"),
              "%s", err);
        zmsg_out_free(&o);
    }
    m.tensor_parallel_size = 0, m.comm_backend = ZMSG_COMM_NCCL;
    // The nccl membership must be consistent: a server's rank lies after the trainer ranks, inside the world.
    m.nccl_rank = 3;
    {
        ZmsgOut o;
        char err[512];
        CHECK(zmsg_build(&m, &o, err, sizeof err) == 0);
        CHECK(zmsg_parse(&b, REQ, o.frames, o.n_frames, err, sizeof err) != 0 && strstr(err, "nccl_rank"));
        zmsg_out_free(&o);
    }
    m.nccl_rank = 8;
    m.transport = ZMSG_TRANSPORT_ZMQ;
    zmsg_init(&m, ZMSG_WEIGHTS_BEGIN, REP, 20);
    m.version = 5;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.version == 5);
        zmsg_free(&b);
    }
    float w[5] = {1.5f, -2.25f, 3e-8f, 0.0f, 65504.0f};
    uint16_t wb[5];
    dtype_f32_to_bf16_n(wb, w, 5);
    for (int dt = 0; dt < 2; dt++) {
        zmsg_init(&m, ZMSG_WEIGHTS_SLICE, REQ, 21);
        m.unit = 3;
        m.offset = 4096;
        m.count = 5;
        m.dtype = (ZmsgDtype)dt;
        m.slice_data = dt ? (const void *)wb : (const void *)w;
        if (round_trip(&m, &b) == 0) {
            CHECK(b.unit == 3 && b.offset == 4096 && b.count == 5 && b.dtype == (ZmsgDtype)dt && !b.has_version);
            zmsg_free(&b);
        }
        // With the update's version (a slice from a ZeRO rank other than the opener).
        m.has_version = 1;
        m.version = 9;
        if (round_trip(&m, &b) == 0) {
            CHECK(b.has_version && b.version == 9 && b.unit == 3 && b.count == 5);
            zmsg_free(&b);
        }
    }
    zmsg_init(&m, ZMSG_WEIGHTS_END, REQ, 22);
    m.version = 5;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.version == 5);
        zmsg_free(&b);
    }
    zmsg_init(&m, ZMSG_WEIGHTS_END, REP, 22);
    m.version = 5;
    m.seconds = 1.75;
    m.commit_seconds = 0.125;
    if (round_trip(&m, &b) == 0) {
        CHECK(b.version == 5 && b.seconds == 1.75 && b.commit_seconds == 0.125);
        zmsg_free(&b);
    }
    ZmsgOut o;
    char err[256];
    zmsg_init(&m, ZMSG_WEIGHTS_SLICE, REQ, 21);
    m.slice_data = w;
    CHECK(zmsg_build(&m, &o, err, sizeof err) < 0 && strstr(err, "count >= 1"));
    m.dir = REP;
    CHECK(zmsg_build(&m, &o, err, sizeof err) < 0 && strstr(err, "not valid as a reply"));

    ZmsgFrame f12[1] = {{w, 12}}, f6[1] = {{w, 6}}, f8[1] = {{w, 8}};
#define S(extra) "{\"type\":\"weights_slice\",\"id\":30," extra "}"
    REFUSE(REQ, S("\"unit\":0,\"offset\":0,\"count\":3,\"dtype\":\"f16\""), f12, 1, "\"dtype\" must be \"f32\" or "
           "\"bf16\"", NULL, 30);
    REFUSE(REQ, S("\"unit\":0,\"offset\":0,\"count\":0,\"dtype\":\"f32\""), f12, 1, "\"count\" is 0", NULL, 30);
    REFUSE(REQ, S("\"unit\":0,\"offset\":-4,\"count\":3,\"dtype\":\"f32\""), f12, 1, "\"offset\" is -4", NULL, 30);
    REFUSE(REQ, S("\"unit\":-1,\"offset\":0,\"count\":3,\"dtype\":\"f32\""), f12, 1, "\"unit\" is -1", NULL, 30);
    REFUSE(REQ, S("\"offset\":0,\"count\":3,\"dtype\":\"f32\""), f12, 1, "missing field \"unit\"", NULL, 30);
    REFUSE(REQ, S("\"unit\":0,\"offset\":0,\"count\":3,\"dtype\":\"f32\""), f6, 1,
           "frame 1 (f32 slice data) has 6 bytes, expected 12", NULL, 30);
    REFUSE(REQ, S("\"unit\":0,\"offset\":0,\"count\":3,\"dtype\":\"bf16\""), f8, 1,
           "frame 1 (bf16 slice data) has 8 bytes, expected 6", NULL, 30);
    REFUSE(REQ, S("\"unit\":0,\"offset\":0,\"count\":3,\"dtype\":\"f32\""), NULL, 0, "expected 2 frames", NULL, 30);
    REFUSE(REP, S("\"unit\":0,\"offset\":0,\"count\":3,\"dtype\":\"f32\""), f12, 1, "not valid as a reply", NULL, 30);
#undef S
    REFUSE(REQ, "{\"type\":\"weights_begin\",\"id\":31,\"version\":2,\"transport\":\"tcp\",\"layout_hash\":"
                "\"0123456789abcdef\"}", NULL, 0, "\"transport\" must be \"zmq\", \"nccl\" or \"ipc\"", NULL, 31);
    REFUSE(REQ, "{\"type\":\"weights_begin\",\"id\":31,\"version\":2,\"transport\":\"zmq\"}", NULL, 0,
           "missing field \"layout_hash\"", NULL, 31);
    REFUSE(REQ, "{\"type\":\"weights_begin\",\"id\":31,\"version\":2,\"transport\":\"zmq\",\"layout_hash\":"
                "\"0123456789ABCDEF\"}", NULL, 0, "\"layout_hash\" must be 16 lowercase hex digits", NULL, 31);
    REFUSE(REQ, "{\"type\":\"weights_begin\",\"id\":31,\"version\":2.5,\"transport\":\"zmq\",\"layout_hash\":"
                "\"0123456789abcdef\"}", NULL, 0, "\"version\" must be an integer", NULL, 31);
    REFUSE(REQ, "{\"type\":\"weights_end\",\"id\":32}", NULL, 0, "missing field \"version\"", NULL, 32);
    REFUSE(REQ, "{\"type\":\"weights_end\",\"id\":32,\"version\":1}", f12, 1, "expected 1 frame", NULL, 32);
}

// Transport ipc: the request's ipc_host, the reply's staging description (docs/protocol-zmq.md), both directions.
static void test_weights_ipc(void) {
    ZmsgMsg m, b;
    zmsg_init(&m, ZMSG_WEIGHTS_BEGIN, REQ, 40);
    m.version = 3;
    m.transport = ZMSG_TRANSPORT_IPC;
    m.layout_hash = 0x0123456789abcdefULL;
    m.tensor_parallel_size = 2;
    snprintf(m.ipc_host, sizeof m.ipc_host, "6a1c1d34-2f7e-4a8e-9a37-4c1f7b3e2d10");
    if (round_trip(&m, &b) == 0) {
        CHECK(b.transport == ZMSG_TRANSPORT_IPC && b.tensor_parallel_size == 2 && !strcmp(b.ipc_host, m.ipc_host));
        zmsg_free(&b);
    }
    zmsg_init(&m, ZMSG_WEIGHTS_BEGIN, REP, 40);
    m.version = 3;
    ZmsgIpc *ipc = &m.ipc;
    ipc->present = ipc->cuda = 1;
    snprintf(ipc->host, sizeof ipc->host, "6a1c1d34-2f7e-4a8e-9a37-4c1f7b3e2d10");
    ipc->staging_id = 0xfedcba9876543210ULL;
    ipc->pid = 4242;
    ipc->n_shards = 2;
    for (int k = 0; k < 2; k++) {
        memset(ipc->shards[k].handle, 'A', 86);   // the shape of base64 of a 64-byte CUDA IPC handle
        ipc->shards[k].handle[86] = (char)('A' + k);
        snprintf(ipc->shards[k].handle + 87, sizeof ipc->shards[k].handle - 87, "=");
        ipc->shards[k].bytes = 1000 + k;
        snprintf(ipc->shards[k].device, sizeof ipc->shards[k].device, "0000:%02x:00.0", 0x18 + k);
        snprintf(ipc->shards[k].uuid, sizeof ipc->shards[k].uuid, "GPU-%d", k);
    }
    if (round_trip(&m, &b) == 0) {
        CHECK(b.ipc.present && b.ipc.cuda && b.ipc.staging_id == ipc->staging_id && b.ipc.pid == 4242);
        CHECK(b.ipc.n_shards == 2 && !strcmp(b.ipc.host, ipc->host));
        for (int k = 0; k < 2; k++)
            CHECK(!strcmp(b.ipc.shards[k].handle, ipc->shards[k].handle) && b.ipc.shards[k].bytes == 1000 + k &&
                  !strcmp(b.ipc.shards[k].device, ipc->shards[k].device) &&
                  !strcmp(b.ipc.shards[k].uuid, ipc->shards[k].uuid));
        zmsg_free(&b);
    }
    ipc->n_shards = 0;   // a reply that describes no shard is not built
    ZmsgOut o;
    char err[256];
    CHECK(zmsg_build(&m, &o, err, sizeof err) != 0 && strstr(err, "\"ipc\""));
    // Plain replies (transports zmq and nccl) carry no "ipc".
    zmsg_init(&m, ZMSG_WEIGHTS_BEGIN, REP, 41);
    if (round_trip(&m, &b) == 0) {
        CHECK(!b.ipc.present);
        zmsg_free(&b);
    }
#define B(extra) "{\"type\":\"weights_begin\",\"id\":42,\"version\":2,\"transport\":\"ipc\"," \
                 "\"layout_hash\":\"0123456789abcdef\"" extra "}"
    REFUSE(REQ, B(""), NULL, 0, "missing field \"ipc_host\"", NULL, 42);
    REFUSE(REQ, B(",\"ipc_host\":\"\""), NULL, 0, "\"ipc_host\" must be a string of 1 to 63 bytes", NULL, 42);
    REFUSE(REQ, B(",\"ipc_host\":[1]"), NULL, 0, "\"ipc_host\" must be a string", NULL, 42);
    REFUSE(REQ, B(",\"ipc_host\":\"h\",\"tensor_parallel_size\":17"), NULL, 0, "\"tensor_parallel_size\"", NULL, 42);
    REFUSE(REQ, B(",\"ipc_host\":\"h\",\"ipc\":{}"), NULL, 0, "unknown field \"ipc\"", NULL, 42);
#undef B
    REFUSE(REQ, "{\"type\":\"weights_begin\",\"id\":42,\"version\":2,\"transport\":\"nccl\",\"layout_hash\":"
                "\"0123456789abcdef\",\"ipc_host\":\"h\"}", NULL, 0, "belongs to transport \"ipc\"", NULL, 42);
#define R(ipc) "{\"type\":\"weights_begin\",\"id\":43,\"version\":2,\"ipc\":" ipc "}"
#define OK_HEAD "\"host\":\"h\",\"staging_id\":\"0123456789abcdef\",\"pid\":7,"
    REFUSE(REP, R("{" OK_HEAD "\"memory\":\"gpu\",\"shards\":[]}"), NULL, 0,
           "\"ipc.memory\" must be \"cuda\" or \"shm\"", NULL, 43);
    REFUSE(REP, R("{" OK_HEAD "\"memory\":\"shm\",\"shards\":[]}"), NULL, 0, "names no shard", NULL, 43);
    REFUSE(REP, R("{" OK_HEAD "\"memory\":\"shm\",\"shards\":[{\"handle\":\"/x\",\"bytes\":0}]}"), NULL, 0,
           "\"ipc.shards[0].bytes\" is 0", NULL, 43);
    REFUSE(REP, R("{" OK_HEAD "\"memory\":\"cuda\",\"shards\":[{\"handle\":\"x\",\"bytes\":8}]}"), NULL, 0,
           "missing field \"ipc.shards[0].device\"", NULL, 43);
    REFUSE(REP, R("{" OK_HEAD "\"memory\":\"shm\",\"shards\":[7]}"), NULL, 0, "element 0 is an integer", NULL, 43);
    REFUSE(REP, R("{\"host\":\"h\",\"staging_id\":\"xyz\",\"pid\":7,\"memory\":\"shm\",\"shards\":[]}"), NULL, 0,
           "\"ipc.staging_id\" must be 16 lowercase hex digits", NULL, 43);
    REFUSE(REP, R("{" OK_HEAD "\"memory\":\"shm\",\"shards\":[{\"handle\":\"/x\",\"bytes\":8}],\"extra\":1}"), NULL,
           0, "unknown field \"extra\"", NULL, 43);
#undef OK_HEAD
#undef R
}

static void test_error_and_envelope(void) {
    ZmsgMsg m, b;
    zmsg_error(&m, -1, "bad_message", "frame 0 is not valid JSON");
    if (round_trip(&m, &b) == 0) {
        CHECK(b.id == -1 && !strcmp(b.code, "bad_message") && !strcmp(b.message, "frame 0 is not valid JSON"));
        zmsg_free(&b);
    }
    char bad_utf8[4] = {'a', (char)0xff, 'b', 0};
    zmsg_error(&m, 17, "x", bad_utf8);   // text quoting a peer's bytes still encodes
    if (round_trip(&m, &b) == 0) {
        CHECK(b.id == 17 && strstr(b.message, "UTF-8"));
        zmsg_free(&b);
    }
    // A message too long for the field is cut before the character that does not fit whole ("é" is 2 bytes
    // and would straddle the last byte), so it stays valid UTF-8 and keeps its text.
    char long_msg[ZMSG_TEXT_MAX + 8];
    memset(long_msg, 'a', ZMSG_TEXT_MAX - 2);
    strcpy(long_msg + ZMSG_TEXT_MAX - 2, "\xc3\xa9zz");
    zmsg_error(&m, 18, "x", long_msg);
    CHECK(strlen(m.message) == ZMSG_TEXT_MAX - 2);
    if (round_trip(&m, &b) == 0) {
        CHECK(b.id == 18 && strlen(b.message) == ZMSG_TEXT_MAX - 2 && b.message[0] == 'a');
        zmsg_free(&b);
    }
    REFUSE(REP, "{\"type\":\"error\",\"id\":null,\"code\":\"x\"}", NULL, 0, "missing field \"message\"", NULL, -1);
    REFUSE(REQ, "{\"type\":\"error\",\"id\":1,\"code\":\"x\",\"message\":\"m\"}", NULL, 0, "not valid as a request",
           NULL, 1);

    ZmsgMsg q;
    char err[512];
    CHECK(zmsg_parse(&q, REQ, NULL, 0, err, sizeof err) < 0 && strstr(err, "empty message"));
    char *big = malloc((1u << 20) + 2);
    memset(big, ' ', (1u << 20) + 1);
    big[(1u << 20) + 1] = 0;
    ZmsgFrame bf[1] = {{big, (1u << 20) + 1}};
    CHECK(zmsg_parse(&q, REQ, bf, 1, err, sizeof err) < 0 && strstr(err, "more than"));
    free(big);
    REFUSE(REQ, "{\"type\":\"hello\",", NULL, 0, "not valid JSON", NULL, -1);
    REFUSE(REQ, "", NULL, 0, "not valid JSON", NULL, -1);
    REFUSE(REQ, "[1,2]", NULL, 0, "must be a JSON object", NULL, -1);
    REFUSE(REQ, "{\"id\":4}", NULL, 0, "\"type\" is missing", NULL, 4);
    REFUSE(REQ, "{\"type\":7,\"id\":4}", NULL, 0, "\"type\" must be a string", NULL, 4);
    REFUSE(REQ, "{\"type\":\"helo\",\"id\":4}", NULL, 0, "unknown message type \"helo\"", NULL, 4);
    REFUSE(REQ, "{\"type\":\"hello\"}", NULL, 0, "hello: field \"id\" is missing", NULL, -1);
    REFUSE(REQ, "{\"type\":\"hello\",\"id\":-2}", NULL, 0, "\"id\" must be an integer >= 0", NULL, -1);
    REFUSE(REQ, "{\"type\":\"hello\",\"id\":\"a\"}", NULL, 0, "\"id\" must be an integer >= 0", NULL, -1);
    REFUSE(REQ, "{\"type\":\"hello\",\"id\":null}", NULL, 0, "\"id\" must be an integer >= 0", NULL, -1);
    REFUSE(REQ, "{\"type\":\"hello\",\"id\":4,\"protocol_version\":\"1\"}", NULL, 0, "\"protocol_version\" must be",
           NULL, 4);
    // A header with an embedded NUL is not JSON text.
    static const char nul_hdr[] = "{\"type\":\"hello\",\"id\":1}\0x";
    ZmsgFrame nf[1] = {{nul_hdr, sizeof nul_hdr - 1}};
    CHECK(zmsg_parse(&q, REQ, nf, 1, err, sizeof err) < 0 && strstr(err, "not valid JSON"));
    // Hello reply refusals.
    REFUSE(REP, "{\"type\":\"hello\",\"id\":1,\"protocol_version\":1,\"model_id\":\"m\",\"layout_hash\":\"12\","
                "\"n_units\":1,\"unit_numel\":[64],\"policy_version\":0,\"max_seq_len\":8,\"vocab_size\":9}",
           NULL, 0, "\"layout_hash\" must be 16 lowercase hex digits", NULL, 1);
    REFUSE(REP, "{\"type\":\"hello\",\"id\":1,\"protocol_version\":1,\"model_id\":\"m\",\"layout_hash\":"
                "\"0000000000000012\",\"n_units\":2,\"unit_numel\":[64],\"policy_version\":0,\"max_seq_len\":8,"
                "\"vocab_size\":9}", NULL, 0, "\"unit_numel\" has 1 elements, expected 2", NULL, 1);
    ZmsgOut o;
    zmsg_init(&m, (ZmsgType)99, REQ, 1);
    CHECK(zmsg_build(&m, &o, err, sizeof err) < 0 && strstr(err, "invalid message type"));
    zmsg_init(&m, ZMSG_HELLO, REQ, -5);
    CHECK(zmsg_build(&m, &o, err, sizeof err) < 0 && strstr(err, "id must be >= 0"));
}

int main(void) {
    test_names_and_hash();
    test_weights_ipc();
    test_hello();
    test_generate();
    test_generate_refusals();
    test_result();
    test_result_version_changes();
    test_weights_end_mode();
    test_simple_and_stats();
    test_weights();
    test_error_and_envelope();
    if (failures) {
        fprintf(stderr, "test_rollout_zmq_msg: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_rollout_zmq_msg: all checks passed\n");
    return 0;
}
