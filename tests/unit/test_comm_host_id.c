// tests/unit/test_comm_host_id.c — the host backend joined by id (comm.h comm_unique_id_host, comm_create_with_id,
// comm_create_with_id_watched): members are threads of this process, as the tensor-parallel shards of a rollout
// server are, meeting at the rendezvous the id names.
//
// Proves:
//   - join: 3 members on one id (IPv4 literal) exchange send/recv between every ordered pair, and all_reduce (sum,
//     max), all_gather and broadcast give the values computed here; ids on a host name and on an IPv6 literal join
//     too;
//   - ids: comm_unique_id_host writes "tandem-host-id 1 ADDR PORT" padded with NULs; bad addresses (empty,
//     bracketed, too long, not resolvable, not this machine's) and malformed or foreign ids (zeros, an NCCL id's
//     bytes, another version, a bad port, trailing text or bytes) are refused at once with COMM_ERR_INVALID and a
//     message; a host id offered to the nccl backend is refused as such;
//   - watched join: member 2 never comes and its watch reports it gone: members 0 and 1 give up in about 2 s (timeout
//     60 s) with COMM_ERR_PEER naming it through the watch; a gone time from before the join is not news (the join
//     then ends by its timeout, not the watch);
//   - watched call: a recv from a member that is alive but silent, which the watch then reports gone, fails in about
//     2 s (timeout 60 s) naming it, and the communicator stays failed; a member reported gone that the call does not
//     wait on does not fail it;
//   - no watch: the same recv fails by the timeout (1.5 s).
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shared/comm/comm.h"
#include "shared/comm/comm_internal.h"   // COMM_ERR_MAX, COMM_GONE_GRACE_MS

#include "check_macros.h"

#define MAX_MEMBERS 4
#define LONG_TIMEOUT_MS 60000

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

// ---- the peer watch: a table the test writes, as a trainer's control connections would -----------------------

static int64_t gone_at[MAX_MEMBERS];   // CLOCK_MONOTONIC ms, 0: not gone (atomics: members read it from threads)

static void mark_gone(int m, int64_t at) { __atomic_store_n(&gone_at[m], at, __ATOMIC_RELEASE); }
static void clear_gone(void) {
    for (int m = 0; m < MAX_MEMBERS; m++) mark_gone(m, 0);
}
static int64_t watch_gone_ms(void *arg, int member) {
    (void)arg;
    return member >= 0 && member < MAX_MEMBERS ? __atomic_load_n(&gone_at[member], __ATOMIC_ACQUIRE) : 0;
}
static void watch_name(void *arg, int member, char *out, size_t len) {
    (void)arg;
    snprintf(out, len, "test peer %d", member);
}
static const CommPeerWatch WATCH = {.gone_ms = watch_gone_ms, .name = watch_name};

// ---- members as threads -----------------------------------------------------------------------------------

// What one member thread does and what came of it. CHECK is not thread-safe: threads record, main checks.
typedef struct Member Member;
typedef void (*MemberFn)(Member *m);
struct Member {
    int rank, world, timeout_ms;
    const uint8_t *id;
    const CommPeerWatch *watch;
    MemberFn body;                  // after a successful join (NULL: none)
    void *arg;
    int join_rc;
    int64_t join_ms;                // how long the join took
    int bad;                        // wrong values seen by body
    char what[512];                 // the first wrong value
    char err[COMM_ERR_MAX];
    Comm *c;
    pthread_t thread;
};

static void member_bad(Member *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void member_bad(Member *m, const char *fmt, ...) {
    if (!m->bad++) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(m->what, sizeof m->what, fmt, ap);
        va_end(ap);
    }
}

static void *member_main(void *arg) {
    Member *m = arg;
    int64_t t0 = now_ms();
    m->join_rc = comm_create_with_id_watched(&m->c, COMM_BACKEND_HOST, m->id, m->rank, m->world, m->timeout_ms,
                                             m->watch, NULL, m->err, sizeof m->err);
    m->join_ms = now_ms() - t0;
    if (m->join_rc == 0 && m->body) m->body(m);
    return NULL;
}

static void start_members(Member *ms, int n) {
    for (int k = 0; k < n; k++)
        if (pthread_create(&ms[k].thread, NULL, member_main, &ms[k]) != 0) {
            fprintf(stderr, "pthread_create failed\n");
            exit(1);
        }
}

static void join_members(Member *ms, int n) {
    for (int k = 0; k < n; k++) pthread_join(ms[k].thread, NULL);
}

static void destroy_members(Member *ms, int n) {
    for (int k = 0; k < n; k++) comm_destroy(ms[k].c), ms[k].c = NULL;
}

// Every member thread's join and body went right; prints what went wrong otherwise.
static void check_members(const char *test, Member *ms, int n) {
    for (int k = 0; k < n; k++) {
        CHECK(ms[k].join_rc == 0, "%s: member %d join: %d: %s", test, k, ms[k].join_rc, ms[k].err);
        CHECK(ms[k].bad == 0, "%s: member %d: %d wrong values, first: %s", test, k, ms[k].bad, ms[k].what);
    }
}

static void make_id(const char *addr, uint8_t id[COMM_UNIQUE_ID_BYTES]) {
    char err[COMM_ERR_MAX];
    int rc = comm_unique_id_host(addr, id, err, sizeof err);
    REQUIRE(rc == 0, "comm_unique_id_host(%s): %d: %s", addr, rc, err);
}

// ---- (a) three members: every pair, every collective ------------------------------------------------------

static void collectives_body(Member *m) {
    Comm *c = m->c;
    const int me = m->rank, w = m->world;
    if (comm_rank(c) != me || comm_world_size(c) != w) member_bad(m, "rank %d world %d", comm_rank(c), comm_world_size(c));
    // send/recv between every ordered pair, in one order every member follows (small sends never block).
    for (int i = 0; i < w; i++)
        for (int j = 0; j < w; j++) {
            if (i == j || (me != i && me != j)) continue;
            int32_t msg[4] = {100 * i + j, i, j, 7}, got[4] = {-1, -1, -1, -1};
            int rc = me == i ? comm_send(c, msg, 4, COMM_I32, j) : comm_recv(c, got, 4, COMM_I32, i);
            if (rc != 0) member_bad(m, "%s %d->%d: %d: %s", me == i ? "send" : "recv", i, j, rc, comm_error(c));
            else if (me == j && memcmp(got, msg, sizeof msg) != 0)
                member_bad(m, "recv %d->%d: got %d %d %d %d", i, j, got[0], got[1], got[2], got[3]);
        }
    // all_reduce: member k holds (k + 1) * (i + 1) - 2 * k; sum over k and max over k.
    float sum[5], mx[5];
    for (int i = 0; i < 5; i++) sum[i] = mx[i] = (float)((me + 1) * (i + 1) - 2 * me);
    int rc = comm_all_reduce(c, sum, 5, COMM_F32, COMM_SUM);
    if (rc == 0) rc = comm_all_reduce(c, mx, 5, COMM_F32, COMM_MAX);
    if (rc != 0) member_bad(m, "all_reduce: %d: %s", rc, comm_error(c));
    for (int i = 0; i < 5 && rc == 0; i++) {
        float want_sum = 0, want_max = -1e30f;
        for (int k = 0; k < w; k++) {
            float v = (float)((k + 1) * (i + 1) - 2 * k);
            want_sum += v;
            if (v > want_max) want_max = v;
        }
        if (sum[i] != want_sum || mx[i] != want_max)
            member_bad(m, "all_reduce[%d]: sum %g (want %g), max %g (want %g)", i, sum[i], want_sum, mx[i], want_max);
    }
    // all_gather: member k sends {10k, 10k + 1}.
    int32_t mine[2] = {10 * me, 10 * me + 1}, all[2 * MAX_MEMBERS];
    memset(all, 0xff, sizeof all);
    if ((rc = comm_all_gather(c, all, mine, 2, COMM_I32)) != 0) member_bad(m, "all_gather: %d: %s", rc, comm_error(c));
    for (int k = 0; k < w && rc == 0; k++)
        if (all[2 * k] != 10 * k || all[2 * k + 1] != 10 * k + 1)
            member_bad(m, "all_gather block %d: %d %d", k, all[2 * k], all[2 * k + 1]);
    // broadcast from the last member, then a barrier.
    double b[3] = {me, me, me};
    if (me == w - 1) b[0] = 1.5, b[1] = -2.25, b[2] = 1e300;
    if ((rc = comm_broadcast(c, b, 3, COMM_F64, w - 1)) != 0) member_bad(m, "broadcast: %d: %s", rc, comm_error(c));
    else if (b[0] != 1.5 || b[1] != -2.25 || b[2] != 1e300) member_bad(m, "broadcast: %g %g %g", b[0], b[1], b[2]);
    if ((rc = comm_barrier(c)) != 0) member_bad(m, "barrier: %d: %s", rc, comm_error(c));
}

static void run_group(const char *test, const char *addr, int world, MemberFn body) {
    uint8_t id[COMM_UNIQUE_ID_BYTES];
    make_id(addr, id);
    Member ms[MAX_MEMBERS];
    memset(ms, 0, sizeof ms);
    for (int k = 0; k < world; k++)
        ms[k] = (Member){.rank = k, .world = world, .timeout_ms = 20000, .id = id, .body = body};
    start_members(ms, world);
    join_members(ms, world);
    check_members(test, ms, world);
    destroy_members(ms, world);
}

static void test_join(void) {
    int before = failures;
    run_group("ipv4", "127.0.0.1", 3, collectives_body);
    run_group("name", "localhost", 2, collectives_body);
    run_group("ipv6", "::1", 2, collectives_body);
    // World 1: nothing to meet, the calls are local.
    run_group("world1", "127.0.0.1", 1, collectives_body);
    printf("%-12s %s\n", "join", failures == before ? "ok" : "FAILED");
}

// ---- (b) ids ---------------------------------------------------------------------------------------------

static void id_text(uint8_t id[COMM_UNIQUE_ID_BYTES], const char *text) {
    memset(id, 0, COMM_UNIQUE_ID_BYTES);
    memcpy(id, text, strlen(text));
}

// comm_create_with_id on host refuses id at once with COMM_ERR_INVALID and a message holding `needle`.
static void expect_refused(const char *what, const uint8_t id[COMM_UNIQUE_ID_BYTES], const char *needle) {
    char err[COMM_ERR_MAX] = "";
    static char not_null;
    Comm *c = (Comm *)&not_null;   // must come back NULL
    int64_t t0 = now_ms();
    int rc = comm_create_with_id(&c, COMM_BACKEND_HOST, id, 0, 2, LONG_TIMEOUT_MS, NULL, err, sizeof err);
    int64_t ms = now_ms() - t0;
    CHECK(rc == COMM_ERR_INVALID && c == NULL && strstr(err, needle) && ms < 1000,
          "%s: rc %d after %lld ms, err '%s' (want COMM_ERR_INVALID naming '%s')", what, rc, (long long)ms, err, needle);
}

static void test_ids(void) {
    int before = failures;
    char err[COMM_ERR_MAX] = "";
    uint8_t id[COMM_UNIQUE_ID_BYTES];

    // The text, and a fresh port each time (the kernel's pick, released).
    make_id("127.0.0.1", id);
    int port = 0, used = 0;
    CHECK(sscanf((const char *)id, "tandem-host-id 1 127.0.0.1 %d%n", &port, &used) == 1 && port > 0 && port < 65536 &&
          (size_t)used == strlen((const char *)id), "id text '%s'", (const char *)id);
    for (size_t i = strlen((const char *)id); i < COMM_UNIQUE_ID_BYTES; i++) CHECK(id[i] == 0, "byte %zu not NUL", i);

    // Addresses comm_unique_id_host refuses.
    struct { const char *addr, *needle; int code; } bad_addr[] = {
        {"", "addr is empty", COMM_ERR_INVALID},
        {"[::1]", "no brackets", COMM_ERR_INVALID},
        {"127.0.0.1:5000", "cannot resolve", COMM_ERR_INVALID},   // a port glued on: not a literal, not a name
        {"tcp://127.0.0.1", "no brackets, spaces, scheme", COMM_ERR_INVALID},
        {"no-such-host.invalid", "cannot resolve", COMM_ERR_INVALID},
        {"192.0.2.1", "not an address of this machine", COMM_ERR_INVALID},        // TEST-NET-1: nobody's
    };
    for (size_t i = 0; i < sizeof bad_addr / sizeof *bad_addr; i++) {
        err[0] = '\0';
        int rc = comm_unique_id_host(bad_addr[i].addr, id, err, sizeof err);
        CHECK(rc == bad_addr[i].code && strstr(err, bad_addr[i].needle), "addr '%s': %d '%s' (want %d naming '%s')",
              bad_addr[i].addr, rc, err, bad_addr[i].code, bad_addr[i].needle);
    }
    char longname[COMM_HOST_ID_ADDR_MAX + 2];
    memset(longname, 'a', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    err[0] = '\0';
    CHECK(comm_unique_id_host(longname, id, err, sizeof err) == COMM_ERR_INVALID && strstr(err, "at most"), "%s", err);
    CHECK(comm_unique_id_host(NULL, id, err, sizeof err) == COMM_ERR_INVALID);
    CHECK(comm_unique_id_host("127.0.0.1", NULL, err, sizeof err) == COMM_ERR_INVALID);
    // comm_unique_id has no host id of its own, and says where to get one.
    err[0] = '\0';
    CHECK(comm_unique_id(COMM_BACKEND_HOST, id, err, sizeof err) == COMM_ERR_UNSUPPORTED &&
          strstr(err, "comm_unique_id_host"), "%s", err);

    // Ids comm_create_with_id refuses.
    memset(id, 0, sizeof id);
    expect_refused("zeros", id, "not a host backend id");
    // An NCCL id: a socket address (family AF_INET, port, address) and a random magic, zero padded.
    memset(id, 0, sizeof id);
    const uint8_t nccl_like[] = {0x02, 0x00, 0xa4, 0x1f, 0x0a, 0x00, 0x00, 0x09, 0x5e, 0x3c, 0x91, 0x07, 0xd2, 0x44};
    memcpy(id, nccl_like, sizeof nccl_like);
    expect_refused("nccl id", id, "an NCCL id (comm_unique_id) joins only the nccl backend");
    id_text(id, "tandem-host-id 2 127.0.0.1 5000");
    expect_refused("version 2", id, "host id version 2, this build reads version 1");
    id_text(id, "tandem-host-id 1 127.0.0.1 0");
    expect_refused("port 0", id, "PORT 1..65535");
    id_text(id, "tandem-host-id 1 127.0.0.1 70000");
    expect_refused("port 70000", id, "PORT 1..65535");
    id_text(id, "tandem-host-id 1 127.0.0.1");
    expect_refused("no port", id, "not a host backend id");
    id_text(id, "tandem-host-id 1 127.0.0.1 5000 x");
    expect_refused("trailing text", id, "nothing after");
    id_text(id, "tandem-host-id 1 127.0.0.1 5000");
    id[COMM_UNIQUE_ID_BYTES - 1] = 7;
    expect_refused("trailing byte", id, "byte 127 after its text is not NUL");
    memset(id, 'x', sizeof id);
    memcpy(id, "tandem-host-id ", 15);
    expect_refused("no NUL", id, "not a host backend id");
    // A host id is not an NCCL id (refused before any backend is asked, in every build).
    make_id("127.0.0.1", id);
    Comm *c = NULL;
    err[0] = '\0';
    CHECK(comm_create_with_id(&c, COMM_BACKEND_NCCL, id, 0, 2, 1000, NULL, err, sizeof err) == COMM_ERR_INVALID &&
          c == NULL && strstr(err, "host backend id"), "%s", err);
    // The other arguments are checked as for nccl.
    err[0] = '\0';
    CHECK(comm_create_with_id(&c, COMM_BACKEND_HOST, id, 2, 2, 1000, NULL, err, sizeof err) == COMM_ERR_INVALID &&
          strstr(err, "rank 2"), "%s", err);
    err[0] = '\0';
    CHECK(comm_create_with_id_watched(&c, COMM_BACKEND_HOST, id, 0, 2, 1000, &(CommPeerWatch){0}, NULL, err,
                                      sizeof err) == COMM_ERR_INVALID && strstr(err, "gone_ms"), "%s", err);
    printf("%-12s %s\n", "ids", failures == before ? "ok" : "FAILED");
}

// ---- (c) a watched join: member 2 never comes -------------------------------------------------------------

// Members 0 and 1 of 3 join; member 2 is marked gone mark_ms after they start (mark_ms < 0: -mark_ms before they
// start). Each member's rc, time and message come back in ms.
static void watched_join(Member *ms, int timeout_ms, int mark_ms) {
    static uint8_t id[COMM_UNIQUE_ID_BYTES];
    make_id("127.0.0.1", id);
    clear_gone();
    memset(ms, 0, 2 * sizeof *ms);
    for (int k = 0; k < 2; k++)
        ms[k] = (Member){.rank = k, .world = 3, .timeout_ms = timeout_ms, .id = id, .watch = &WATCH};
    if (mark_ms < 0) {
        mark_gone(2, now_ms());
        sleep_ms(-mark_ms);
    }
    start_members(ms, 2);
    if (mark_ms >= 0) {
        sleep_ms(mark_ms);
        mark_gone(2, now_ms());
    }
    join_members(ms, 2);
    destroy_members(ms, 2);
}

static void test_watched_join(void) {
    int before = failures;
    Member ms[2];
    watched_join(ms, LONG_TIMEOUT_MS, 300);
    for (int k = 0; k < 2; k++) {
        printf("  join, member 2 gone: member %d -> %d after %lld ms: %s\n", k, ms[k].join_rc,
               (long long)ms[k].join_ms, ms[k].err);
        CHECK(ms[k].join_rc == COMM_ERR_PEER && strstr(ms[k].err, "member 2 (test peer 2) went away"),
              "member %d: %d %s", k, ms[k].join_rc, ms[k].err);
        // The grace is honoured (300 ms + 2 s), and far from the 60 s timeout.
        CHECK(ms[k].join_ms >= 300 + COMM_GONE_GRACE_MS - 50 && ms[k].join_ms < 4000, "member %d took %lld ms", k,
              (long long)ms[k].join_ms);
    }
    // Gone before the join started: old news. The join ends by its timeout (rank 0 names the missing rank).
    watched_join(ms, 1500, -(COMM_GONE_GRACE_MS + 200));
    for (int k = 0; k < 2; k++) {
        printf("  join, member 2 gone before: member %d -> %d after %lld ms: %s\n", k, ms[k].join_rc,
               (long long)ms[k].join_ms, ms[k].err);
        CHECK(ms[k].join_rc == COMM_ERR_PEER && strstr(ms[k].err, "rank 2 of WORLD_SIZE 3 did not arrive within 1500 ms")
              && !strstr(ms[k].err, "went away"), "member %d: %d %s", k, ms[k].join_rc, ms[k].err);
        CHECK(ms[k].join_ms >= 1450 && ms[k].join_ms < 6000, "member %d took %lld ms", k, (long long)ms[k].join_ms);
    }
    printf("%-12s %s\n", "watched join", failures == before ? "ok" : "FAILED");
}

// ---- (d, e) a recv from a member that is alive but silent -------------------------------------------------

typedef struct {
    int silent;                 // the member that never sends
    int source;                 // member 0 receives from it
    int delay_ms;               // the source sends after this long (silent: never)
    int mark;                   // mark the silent member gone mark_ms after member 0's recv starts (-1: never)
    int mark_ms;
    int64_t recv_started;       // set by member 0
    int64_t release;            // set by main: the silent member may leave
    int rc;                     // member 0's recv
    int64_t recv_ms;
    int after;                  // member 0's next call
    char err[COMM_ERR_MAX];
} Silent;

static void silent_body(Member *m) {
    Silent *s = m->arg;
    Comm *c = m->c;
    // One exchange that works first: the watch has said nothing yet.
    int32_t v = 41 + m->rank, sum = v;
    int rc = comm_all_reduce(c, &sum, 1, COMM_I32, COMM_SUM);
    if (rc != 0 || sum != 41 * m->world + m->world * (m->world - 1) / 2)
        member_bad(m, "first all_reduce: %d %d: %s", rc, sum, comm_error(c));
    if (m->rank == 0) {
        int32_t got[3] = {0};
        __atomic_store_n(&s->recv_started, now_ms(), __ATOMIC_RELEASE);
        int64_t t0 = now_ms();
        s->rc = comm_recv(c, got, 3, COMM_I32, s->source);
        s->recv_ms = now_ms() - t0;
        snprintf(s->err, sizeof s->err, "%s", comm_error(c));
        if (s->rc == 0 && (got[0] != 1 || got[1] != 2 || got[2] != 3)) member_bad(m, "recv got %d %d %d", got[0], got[1], got[2]);
        s->after = s->rc == 0 ? 0 : comm_barrier(c);
        return;
    } else if (m->rank == s->source && m->rank != s->silent) {
        sleep_ms(s->delay_ms);
        int32_t msg[3] = {1, 2, 3};
        if ((rc = comm_send(c, msg, 3, COMM_I32, 0)) != 0) member_bad(m, "send: %d: %s", rc, comm_error(c));
    }
    // Alive and taking no further part until main says so (the silent member never calls again).
    while (!__atomic_load_n(&s->release, __ATOMIC_ACQUIRE)) sleep_ms(5);
}

static void run_silent(Silent *s, int world, int timeout_ms, const CommPeerWatch *watch) {
    uint8_t id[COMM_UNIQUE_ID_BYTES];
    make_id("127.0.0.1", id);
    clear_gone();
    Member ms[MAX_MEMBERS];
    memset(ms, 0, sizeof ms);
    for (int k = 0; k < world; k++)
        ms[k] = (Member){.rank = k, .world = world, .timeout_ms = timeout_ms, .id = id, .watch = watch,
                         .body = silent_body, .arg = s};
    start_members(ms, world);
    if (s->mark >= 0) {
        int64_t t0 = now_ms();
        while (!__atomic_load_n(&s->recv_started, __ATOMIC_ACQUIRE) && now_ms() - t0 < 20000) sleep_ms(1);
        sleep_ms(s->mark_ms);
        mark_gone(s->mark, now_ms());
    }
    join_members(ms, 1);   // member 0 has its answer
    __atomic_store_n(&s->release, 1, __ATOMIC_RELEASE);
    join_members(ms + 1, world - 1);
    check_members("silent", ms, world);
    destroy_members(ms, world);
}

static void test_watched_call(void) {
    int before = failures;
    // (d) member 1 of 2 silent; the watch reports it gone 300 ms into member 0's recv.
    Silent s = {.silent = 1, .source = 1, .mark = 1, .mark_ms = 300};
    run_silent(&s, 2, LONG_TIMEOUT_MS, &WATCH);
    printf("  recv, member 1 silent and gone: %d after %lld ms: %s\n", s.rc, (long long)s.recv_ms, s.err);
    CHECK(s.rc == COMM_ERR_PEER && strstr(s.err, "member 1 (test peer 1;") && strstr(s.err, "went away") &&
          strstr(s.err, "comm send/recv"), "%d %s", s.rc, s.err);
    CHECK(s.recv_ms >= 300 + COMM_GONE_GRACE_MS - 50 && s.recv_ms < 4000, "recv took %lld ms", (long long)s.recv_ms);
    CHECK(s.after == COMM_ERR_FAILED, "the next call: %d", s.after);
    // Member 2 of 3 reported gone (at once) while member 0 waits on member 1, which sends after 2.5 s: the call
    // does not wait on member 2, so it completes.
    Silent t = {.silent = 2, .source = 1, .delay_ms = COMM_GONE_GRACE_MS + 500, .mark = 2, .mark_ms = 0};
    run_silent(&t, 3, LONG_TIMEOUT_MS, &WATCH);
    printf("  recv from member 1, member 2 gone: %d after %lld ms\n", t.rc, (long long)t.recv_ms);
    CHECK(t.rc == 0 && t.recv_ms >= COMM_GONE_GRACE_MS + 400, "%d after %lld ms: %s", t.rc, (long long)t.recv_ms, t.err);
    printf("%-12s %s\n", "watched call", failures == before ? "ok" : "FAILED");
}

static void test_unwatched_call(void) {
    int before = failures;
    // (e) no watch: the silent member is found by the timeout only.
    Silent s = {.silent = 1, .source = 1, .mark = -1};
    run_silent(&s, 2, 1500, NULL);
    printf("  recv, member 1 silent, no watch: %d after %lld ms: %s\n", s.rc, (long long)s.recv_ms, s.err);
    CHECK(s.rc == COMM_ERR_TIMEOUT && strstr(s.err, "rank 1 (host") && strstr(s.err, "1500 ms"), "%d %s", s.rc, s.err);
    CHECK(s.recv_ms >= 1450 && s.recv_ms < 3500, "recv took %lld ms", (long long)s.recv_ms);
    printf("%-12s %s\n", "no watch", failures == before ? "ok" : "FAILED");
}

int main(void) {
    test_ids();
    test_join();
    test_watched_join();
    test_watched_call();
    test_unwatched_call();
    return check_exit_code("test_comm_host_id");
}
