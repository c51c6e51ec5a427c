// tests/unit/test_trainer_rollout_liveness.c — the rollout client against servers that die mid-request.
//
// Fake servers (a ROUTER thread each, speaking shared/zmq_msg.h) answer hello, weights_begin/end and generate;
// one told to die closes its socket right after a chosen request, as a killed process's kernel would. With a
// request timeout of 60 s, the client must notice each death within a few seconds (its connection monitor), set
// that server aside and finish the weight push or the generation with the others; a server started again on the
// same endpoint answers as stale (older weights) so that the caller pushes to it before it generates. A generation
// sent ahead (rollout_generate_start) survives a weight push and a hello made while its answers arrive (they are
// kept for it), and one of its servers dying before it is collected. Streaming groups: polled, each prompt's group
// comes back once as it completes, the caller's time between polls is not a server's silence, and a poll that
// finds no server answering keeps the groups in for when the servers are back.
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "check_macros.h"
#include "shared/zmq_msg.h"
#include "trainer/rollout_client.h"

#define LAYOUT_HASH 0x1234abcdULL
#define TIMEOUT_MS 60000   // the request timeout: every death below must be noticed long before it

typedef struct {
    char endpoint[64];     // tcp://127.0.0.1:PORT (PORT 0: pick one, filled in once bound)
    ZmsgType die_after;    // close the socket right after answering (or taking) this request type; -1: never
    int64_t version;       // weights version it holds
    long answer_after_ms;  // generate answers wait this long (the server's thread sleeps): a slow server
    int generates_before_death;  // with die_after ZMSG_GENERATE: generates answered before the one it dies on
    int generates_seen;
    atomic_int ready, stop, died;
    pthread_t thread;
    void *zctx;
} FakeServer;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void reply(void *sock, zmq_msg_t *identity, const ZmsgMsg *m) {
    ZmsgOut out;
    char err[256];
    if (zmsg_build(m, &out, err, sizeof err) != 0) {
        fprintf(stderr, "fake server: %s\n", err);
        return;
    }
    zmq_send(sock, zmq_msg_data(identity), zmq_msg_size(identity), ZMQ_SNDMORE);
    for (int i = 0; i < out.n_frames; i++)
        zmq_send(sock, out.frames[i].data, out.frames[i].size, i + 1 < out.n_frames ? ZMQ_SNDMORE : 0);
    zmsg_out_free(&out);
}

static void answer(FakeServer *f, void *sock, zmq_msg_t *identity, const ZmsgMsg *q) {
    ZmsgMsg r;
    int64_t numel[1] = {4};
    zmsg_init(&r, q->type, ZMSG_DIR_REPLY, q->id);
    switch (q->type) {
    case ZMSG_HELLO:
        r.protocol_version = ZMSG_PROTOCOL_VERSION;
        snprintf(r.model_id, sizeof r.model_id, "fake");
        r.layout_hash = LAYOUT_HASH;
        r.n_units = 1;
        r.unit_numel = numel;
        r.policy_version = f->version;
        r.max_seq_len = 64;
        r.vocab_size = 16;
        reply(sock, identity, &r);
        break;
    case ZMSG_WEIGHTS_BEGIN:
        r.version = q->version;
        reply(sock, identity, &r);
        break;
    case ZMSG_WEIGHTS_END:
        f->version = q->version;
        r.version = q->version;
        reply(sock, identity, &r);
        break;
    case ZMSG_GENERATE: {
        int n = q->sampling.n;
        int comp_lens[16];
        ZmsgFinish fin[16];
        int64_t ver[16];
        int32_t tok[16];
        float lp[16];
        for (int j = 0; j < n; j++) comp_lens[j] = 1, fin[j] = ZMSG_FINISH_LENGTH, ver[j] = f->version, tok[j] = 7,
                                     lp[j] = -0.5f;
        zmsg_init(&r, ZMSG_RESULT, ZMSG_DIR_REPLY, q->id);
        r.n_prompts = 1;
        r.n_completions = n;
        r.completion_lens = comp_lens;
        r.finish_reasons = fin;
        r.policy_versions = ver;
        r.policy_versions_end = ver;
        r.tokens = tok;
        r.logprobs = lp;
        r.prompt_tokens = q->prompt_lens[0];
        if (f->answer_after_ms > 0) {
            struct timespec ts = {f->answer_after_ms / 1000, (f->answer_after_ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        }
        if (f->die_after != ZMSG_GENERATE || f->generates_seen < f->generates_before_death) reply(sock, identity, &r);
        break;
    }
    default:
        break;   // weights_slice: answered only when refused
    }
}

static void *server_main(void *arg) {
    FakeServer *f = arg;
    void *sock = zmq_socket(f->zctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_bind(sock, f->endpoint) != 0) {
        fprintf(stderr, "fake server: bind %s: %s\n", f->endpoint, zmq_strerror(zmq_errno()));
        zmq_close(sock);
        atomic_store(&f->ready, -1);
        return NULL;
    }
    size_t len = sizeof f->endpoint;
    zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, f->endpoint, &len);
    atomic_store(&f->ready, 1);
    while (!atomic_load(&f->stop)) {
        zmq_pollitem_t item = {sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, 20) <= 0) continue;
        zmq_msg_t parts[9];
        int n = 0, more = 1;
        while (more && n < 9) {
            zmq_msg_init(&parts[n]);
            if (zmq_msg_recv(&parts[n], sock, 0) < 0) break;
            more = zmq_msg_more(&parts[n++]);
        }
        ZmsgFrame frames[8];
        for (int i = 1; i < n; i++) frames[i - 1] = (ZmsgFrame){zmq_msg_data(&parts[i]), zmq_msg_size(&parts[i])};
        ZmsgMsg q;
        char err[256];
        int dead = 0;
        if (n > 1 && zmsg_parse(&q, ZMSG_DIR_REQUEST, frames, n - 1, err, sizeof err) == 0) {
            answer(f, sock, &parts[0], &q);
            dead = q.type == f->die_after &&
                   (q.type != ZMSG_GENERATE || f->generates_seen++ >= f->generates_before_death);
            zmsg_free(&q);
        }
        for (int i = 0; i < n; i++) zmq_msg_close(&parts[i]);
        if (dead) break;
    }
    zmq_close(sock);   // a killed process: its kernel closes the connection
    atomic_store(&f->died, 1);
    return NULL;
}

static void server_start(FakeServer *f, void *zctx, const char *endpoint, int die_after, int64_t version) {
    memset(f, 0, sizeof *f);
    snprintf(f->endpoint, sizeof f->endpoint, "%s", endpoint);
    f->die_after = (ZmsgType)die_after;
    f->version = version;
    f->zctx = zctx;
    REQUIRE(pthread_create(&f->thread, NULL, server_main, f) == 0, "pthread_create");
    while (!atomic_load(&f->ready)) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    REQUIRE(atomic_load(&f->ready) == 1, "fake server did not start");
}

static void server_stop(FakeServer *f) {
    atomic_store(&f->stop, 1);
    pthread_join(f->thread, NULL);
}

static RolloutClient *connect_to(FakeServer *a, FakeServer *b) {
    char endpoints[160], err[512];
    snprintf(endpoints, sizeof endpoints, "%s%s%s", a->endpoint, b ? "," : "", b ? b->endpoint : "");
    RolloutClient *c = NULL;
    REQUIRE(rollout_client_create(&c, endpoints, LAYOUT_HASH, TIMEOUT_MS, NULL, NULL, err, sizeof err) == 0, "%s",
            err);
    return c;
}

// A weight push (transport zmq, one rank) in which server b dies right after taking weights_begin.
static void push_with_a_death(void *zctx) {
    FakeServer a, b;
    server_start(&a, zctx, "tcp://127.0.0.1:*", -1, 0);
    server_start(&b, zctx, "tcp://127.0.0.1:*", ZMSG_WEIGHTS_BEGIN, 0);
    RolloutClient *c = connect_to(&a, &b);
    char err[512];
    int members[ROLLOUT_MAX_SERVERS], n_members = 0;
    float values[4] = {1, 2, 3, 4};
    double t0 = now_s();
    CHECK(rollout_weights_begin(c, 5, members, &n_members, err, sizeof err) == 0, "begin: %s", err);
    CHECK(n_members == 2, "both servers took weights_begin (%d)", n_members);
    while (!atomic_load(&b.died)) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    // Slices, the flush and the end go on while b is gone: none may wait for the 60 s timeout.
    CHECK(rollout_weights_send_slice(c, 5, 0, 0, values, ZMSG_DTYPE_F32, 4, 0, err, sizeof err) == 0, "slice: %s", err);
    CHECK(rollout_client_flush(c, err, sizeof err) == 0, "flush: %s", err);
    double seconds = 0;
    CHECK(rollout_weights_end(c, 5, &seconds, NULL, err, sizeof err) == 0, "end: %s", err);
    double took = now_s() - t0;
    CHECK(took < 8.0, "a push that lost a server took %.1f s (request timeout %d ms)", took, TIMEOUT_MS);
    CHECK(a.version == 5, "the surviving server holds version %lld", (long long)a.version);
    int alive[ROLLOUT_MAX_SERVERS];
    int n_alive = rollout_alive_servers(c, alive);
    CHECK(n_alive == 1 && alive[0] == 0, "only the surviving server is counted on (%d alive)", n_alive);
    CHECK(rollout_server_gone_ms(c, 1) > 0 && rollout_server_gone_ms(c, 0) == 0, "the monitor saw b's connection drop");

    // b restarts on its endpoint with the base weights: it answers again, as stale, before it takes rollouts.
    FakeServer b2;
    char b_endpoint[64];
    snprintf(b_endpoint, sizeof b_endpoint, "%s", b.endpoint);
    pthread_join(b.thread, NULL);
    server_start(&b2, zctx, b_endpoint, -1, 0);
    int stale = 0;
    CHECK(rollout_client_refresh(c, 5, 2000, &stale, err, sizeof err) == 0, "refresh: %s", err);
    CHECK(stale == 1, "the restarted server is stale");
    n_alive = rollout_alive_servers(c, alive);
    CHECK(n_alive == 2, "the restarted server is counted on again (%d alive)", n_alive);
    // The next push reaches both.
    CHECK(rollout_weights_begin(c, 6, members, &n_members, err, sizeof err) == 0 && n_members == 2, "begin 6: %s", err);
    CHECK(rollout_weights_send_slice(c, 6, 0, 0, values, ZMSG_DTYPE_F32, 4, 0, err, sizeof err) == 0, "slice 6: %s", err);
    CHECK(rollout_client_flush(c, err, sizeof err) == 0, "flush 6: %s", err);
    CHECK(rollout_weights_end(c, 6, &seconds, NULL, err, sizeof err) == 0, "end 6: %s", err);
    CHECK(a.version == 6 && b2.version == 6, "versions after the next push: %lld, %lld", (long long)a.version,
          (long long)b2.version);
    rollout_client_destroy(c);
    server_stop(&a);
    server_stop(&b2);
}

// A generation in which server b dies holding a prompt: the prompt moves to a within seconds.
static void generate_with_a_death(void *zctx) {
    FakeServer a, b;
    server_start(&a, zctx, "tcp://127.0.0.1:*", -1, 0);
    server_start(&b, zctx, "tcp://127.0.0.1:*", ZMSG_GENERATE, 0);
    RolloutClient *c = connect_to(&a, &b);
    char err[512];
    int32_t p0[3] = {1, 2, 3}, p1[3] = {4, 5, 6};
    const int32_t *prompts[2] = {p0, p1};
    int lens[2] = {3, 3};
    ZmsgSampling s;
    zmsg_sampling_default(&s);
    s.n = 2;
    s.max_tokens = 1;
    RolloutGroup groups[2];
    double t0 = now_s();
    int rc = rollout_generate(c, 2, prompts, lens, &s, groups, err, sizeof err);
    double took = now_s() - t0;
    CHECK(rc == 0, "generate: %s", err);
    CHECK(took < 8.0, "a generation that lost a server took %.1f s (request timeout %d ms)", took, TIMEOUT_MS);
    if (rc == 0) {
        CHECK(groups[0].n == 2 && groups[1].n == 2 && groups[0].tokens[0] == 7, "both prompts answered");
        rollout_groups_free(groups, 2);
    }
    rollout_client_destroy(c);
    server_stop(&a);
    pthread_join(b.thread, NULL);
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

// Asynchronous GRPO's pattern: a generation is sent, its answers arrive while the client pushes weights and says
// hello (both read the sockets), then it is collected: every answer was kept, sampled by the weights before the
// push. A second generation sent and cancelled leaves nothing behind (its late answers are dropped).
static void generate_across_a_push(void *zctx) {
    FakeServer a, b;
    server_start(&a, zctx, "tcp://127.0.0.1:*", -1, 0);
    server_start(&b, zctx, "tcp://127.0.0.1:*", -1, 0);
    RolloutClient *c = connect_to(&a, &b);
    char err[512];
    int32_t p[4][2] = {{1, 2}, {3, 4}, {5, 6}, {7, 8}};
    const int32_t *prompts[4] = {p[0], p[1], p[2], p[3]};
    int lens[4] = {2, 2, 2, 2};
    ZmsgSampling s;
    zmsg_sampling_default(&s);
    s.n = 2;
    s.max_tokens = 1;
    RolloutPending *pending = NULL, *cancelled = NULL;
    CHECK(rollout_generate_start(c, 4, prompts, lens, &s, &pending, err, sizeof err) == 0, "start: %s", err);
    sleep_ms(200);   // the fake servers answer at once: the answers wait in the client's sockets
    int members[ROLLOUT_MAX_SERVERS], n_members = 0, stale = 1;
    float values[4] = {1, 2, 3, 4};
    double seconds = 0;
    CHECK(rollout_weights_begin(c, 3, members, &n_members, err, sizeof err) == 0 && n_members == 2, "begin: %s", err);
    CHECK(rollout_weights_send_slice(c, 3, 0, 0, values, ZMSG_DTYPE_F32, 4, 0, err, sizeof err) == 0, "slice: %s", err);
    CHECK(rollout_client_flush(c, err, sizeof err) == 0, "flush: %s", err);
    CHECK(rollout_weights_end(c, 3, &seconds, NULL, err, sizeof err) == 0, "end: %s", err);
    CHECK(rollout_generate_start(c, 4, prompts, lens, &s, &cancelled, err, sizeof err) == 0, "start 2: %s", err);
    sleep_ms(100);
    CHECK(rollout_client_refresh(c, 3, 2000, &stale, err, sizeof err) == 0 && stale == 0, "refresh: %s", err);
    rollout_generate_cancel(c, cancelled);
    RolloutGroup groups[4];
    double t0 = now_s();
    int rc = pending ? rollout_generate_finish(c, pending, groups, err, sizeof err) : -1;
    double took = now_s() - t0;
    CHECK(rc == 0, "finish: %s", err);
    CHECK(took < 1.0, "collecting answers that had arrived took %.1f s: they were dropped and sent again", took);
    if (rc == 0) {
        for (int i = 0; i < 4; i++)
            CHECK(groups[i].n == 2 && groups[i].versions[0] == 0 && groups[i].versions[1] == 0,
                  "prompt %d: %d completions, versions %lld", i, groups[i].n, (long long)groups[i].versions[0]);
        rollout_groups_free(groups, 4);
    }
    // The client goes on: a synchronous generation now samples the pushed version.
    rc = rollout_generate(c, 4, prompts, lens, &s, groups, err, sizeof err);
    CHECK(rc == 0, "generate: %s", err);
    if (rc == 0) {
        CHECK(groups[0].versions[0] == 3, "after the push: version %lld", (long long)groups[0].versions[0]);
        rollout_groups_free(groups, 4);
    }
    rollout_client_destroy(c);
    server_stop(&a);
    server_stop(&b);
}

// A generation sent ahead whose server b dies holding its prompts before it is collected: collecting moves them
// to a within seconds.
static void generate_ahead_with_a_death(void *zctx) {
    FakeServer a, b;
    server_start(&a, zctx, "tcp://127.0.0.1:*", -1, 0);
    server_start(&b, zctx, "tcp://127.0.0.1:*", ZMSG_GENERATE, 0);
    RolloutClient *c = connect_to(&a, &b);
    char err[512];
    int32_t p0[2] = {1, 2}, p1[2] = {3, 4};
    const int32_t *prompts[2] = {p0, p1};
    int lens[2] = {2, 2};
    ZmsgSampling s;
    zmsg_sampling_default(&s);
    s.n = 2;
    s.max_tokens = 1;
    RolloutPending *pending = NULL;
    CHECK(rollout_generate_start(c, 2, prompts, lens, &s, &pending, err, sizeof err) == 0, "start: %s", err);
    while (!atomic_load(&b.died)) sleep_ms(1);
    RolloutGroup groups[2];
    double t0 = now_s();
    int rc = pending ? rollout_generate_finish(c, pending, groups, err, sizeof err) : -1;
    double took = now_s() - t0;
    CHECK(rc == 0, "finish: %s", err);
    CHECK(took < 8.0, "collecting a generation that lost a server took %.1f s", took);
    if (rc == 0) rollout_groups_free(groups, 2);
    rollout_client_destroy(c);
    server_stop(&a);
    pthread_join(b.thread, NULL);
}

// Streaming groups: a fast server a and a slow one b (each answer 1 s after it took the request: 1 s and 2 s) share 4
// prompts. Polls return each prompt's group once, as it comes back: a's first, while b's are still out; then the
// caller works for 1.7 s, longer than the request timeout (1.5 s here), before it polls again: that is not b's
// silence (counted from the first wait, b would be set aside at 1.7 s and its last prompt moved to a).
static void generate_streamed(void *zctx) {
    FakeServer a, b;
    server_start(&a, zctx, "tcp://127.0.0.1:*", -1, 0);
    server_start(&b, zctx, "tcp://127.0.0.1:*", -1, 0);
    char endpoints[160], err[512];
    snprintf(endpoints, sizeof endpoints, "%s,%s", a.endpoint, b.endpoint);
    RolloutClient *c = NULL;
    REQUIRE(rollout_client_create(&c, endpoints, LAYOUT_HASH, 1500, NULL, NULL, err, sizeof err) == 0, "%s", err);
    b.answer_after_ms = 1000;
    int32_t p[4][2] = {{1, 2}, {3, 4}, {5, 6}, {7, 8}};
    const int32_t *prompts[4] = {p[0], p[1], p[2], p[3]};
    int lens[4] = {2, 2, 2, 2};
    ZmsgSampling s;
    zmsg_sampling_default(&s);
    s.n = 3;
    s.max_tokens = 1;
    RolloutPending *pending = NULL;
    REQUIRE(rollout_generate_start(c, 4, prompts, lens, &s, &pending, err, sizeof err) == 0, "start: %s", err);
    RolloutGroup groups[4];
    int done[4], seen[4] = {0}, n_done = 0, total = 0, polls = 0, first_remaining = -1;
    double t0 = now_s();
    while (pending && rollout_generate_remaining(pending) > 0 && polls++ < 50) {
        int rc = rollout_generate_poll(c, pending, groups, 5000, done, &n_done, err, sizeof err);
        if (rc != 0) {
            CHECK(0, "poll %d: %s", polls, err);
            pending = NULL;
            break;
        }
        if (first_remaining < 0) {
            first_remaining = rollout_generate_remaining(pending);
            CHECK(now_s() - t0 < 0.3, "the fast server's groups came back after %.2f s", now_s() - t0);
            sleep_ms(1700);   // scoring them, say: longer than the request timeout
        }
        for (int q = 0; q < n_done; q++) {
            CHECK(done[q] >= 0 && done[q] < 4 && !seen[done[q]], "prompt %d reported twice or out of range", done[q]);
            if (done[q] >= 0 && done[q] < 4) {
                seen[done[q]]++;
                CHECK(groups[done[q]].n == 3, "prompt %d's group holds %d completions", done[q], groups[done[q]].n);
            }
        }
        total += n_done;
    }
    CHECK(first_remaining >= 2, "after the first poll %d prompts were out (b's 2 at least)", first_remaining);
    CHECK(total == 4, "%d groups came back", total);
    int alive[ROLLOUT_MAX_SERVERS];
    CHECK(rollout_alive_servers(c, alive) == 2, "the slow server was set aside for the caller's own work");
    if (pending) {
        CHECK(rollout_generate_finish(c, pending, groups, err, sizeof err) == 0, "finish: %s", err);
        rollout_groups_free(groups, 4);
    }
    rollout_client_destroy(c);
    server_stop(&a);
    server_stop(&b);
}

// Streaming groups when every server goes away mid-round: the only server answers 2 of 4 prompts and dies on the
// third. A poll reports the loss (ROLLOUT_ESERVERS_LOST) keeping the 2 groups in and the handle; the server comes
// back on its endpoint, the client says hello, and the next polls send the 2 prompts still out: 4 groups, the first
// 2 the ones taken before the loss.
static void stream_through_a_loss(void *zctx) {
    FakeServer a;
    server_start(&a, zctx, "tcp://127.0.0.1:*", ZMSG_GENERATE, 0);
    a.generates_before_death = 2;
    RolloutClient *c = connect_to(&a, NULL);
    char err[512];
    int32_t p[4][2] = {{1, 2}, {3, 4}, {5, 6}, {7, 8}};
    const int32_t *prompts[4] = {p[0], p[1], p[2], p[3]};
    int lens[4] = {2, 2, 2, 2};
    ZmsgSampling s;
    zmsg_sampling_default(&s);
    s.n = 2;
    s.max_tokens = 1;
    RolloutPending *pending = NULL;
    REQUIRE(rollout_generate_start(c, 4, prompts, lens, &s, &pending, err, sizeof err) == 0, "start: %s", err);
    RolloutGroup groups[4];
    int done[4], n_done = 0, seen[4] = {0}, rc = 0, polls = 0;
    double t0 = now_s();
    while (rc == 0 && rollout_generate_remaining(pending) > 0 && polls++ < 40) {
        rc = rollout_generate_poll(c, pending, groups, 1000, done, &n_done, err, sizeof err);
        for (int q = 0; q < n_done; q++) seen[done[q]]++;
    }
    CHECK(rc == ROLLOUT_ESERVERS_LOST, "the loss is reported (rc %d: %s)", rc, err);
    CHECK(now_s() - t0 < 8.0, "noticing the loss took %.1f s", now_s() - t0);
    CHECK(seen[0] == 1 && seen[1] == 1 && seen[2] == 0 && seen[3] == 0, "groups before the loss: %d %d %d %d",
          seen[0], seen[1], seen[2], seen[3]);
    CHECK(rollout_generate_remaining(pending) == 2, "%d prompts out", rollout_generate_remaining(pending));
    FakeServer a2;
    char endpoint[64];
    snprintf(endpoint, sizeof endpoint, "%s", a.endpoint);
    pthread_join(a.thread, NULL);
    server_start(&a2, zctx, endpoint, -1, 0);
    int stale = 1;
    CHECK(rollout_client_refresh(c, 0, 2000, &stale, err, sizeof err) == 0, "refresh: %s", err);
    rc = 0;
    polls = 0;
    while (rc == 0 && rollout_generate_remaining(pending) > 0 && polls++ < 40) {
        rc = rollout_generate_poll(c, pending, groups, 1000, done, &n_done, err, sizeof err);
        for (int q = 0; rc == 0 && q < n_done; q++) seen[done[q]]++;
    }
    CHECK(rc == 0, "after the server came back: %s", err);
    if (rc == 0) {
        CHECK(seen[0] == 1 && seen[1] == 1 && seen[2] == 1 && seen[3] == 1, "each group once: %d %d %d %d", seen[0],
              seen[1], seen[2], seen[3]);
        for (int i = 0; i < 4; i++)
            CHECK(groups[i].n == 2 && groups[i].tokens[0] == 7, "prompt %d's group (%d completions)", i, groups[i].n);
        CHECK(rollout_generate_finish(c, pending, groups, err, sizeof err) == 0, "finish: %s", err);
        rollout_groups_free(groups, 4);
    }
    rollout_client_destroy(c);
    server_stop(&a2);
}

int main(void) {
    void *zctx = zmq_ctx_new();
    push_with_a_death(zctx);
    generate_with_a_death(zctx);
    generate_across_a_push(zctx);
    generate_ahead_with_a_death(zctx);
    generate_streamed(zctx);
    stream_through_a_loss(zctx);
    zmq_ctx_term(zctx);
    return check_exit_code("test_trainer_rollout_liveness");
}
