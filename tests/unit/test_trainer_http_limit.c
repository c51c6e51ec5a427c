// test_trainer_http_limit.c — the trainer's HTTP client refuses a response body over its limit (issue 22: a
// 200 MB reward-service answer was read whole, under a 256 MiB cap that counted header bytes too).
//
// A forked server on 127.0.0.1 answers by request path:
//   /huge-length   Content-Length: 200 MiB, then (2 s later) zeros until the client hangs up
//   /big-chunk     one chunk announced as 256 MiB, then (2 s later) zeros until the client hangs up
//   /many-chunks   2 MiB in 1-byte chunks (six raw bytes per body byte)
//   /close-2mb     2 MiB with no length, ended by closing the connection
//   /at-limit      a body of exactly 1 MiB (Content-Length); /at-limit-chunked the same in 4 KiB chunks
//   /score-huge    {"scores": [...]} announced as 200 MiB
// With a 1 MiB limit every over-limit body is refused with HTTP_E_TOO_LARGE and a message naming the URL and
// the limit, the announced ones at once (well under the 2 s before their body starts);
// bodies of exactly the limit are read whole. The default limit is 64 MiB. Through the reward service the
// refusal is not retried and names --reward-max-response-mb, which the option table maps to the client.
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check_macros.h"
#include "testlib.h"
#include "trainer/http_client.h"
#include "trainer/reward_service.h"
#include "trainer/train_config.h"

#define MIB ((size_t)1 << 20)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Writes all of p; 0, or -1 once the client has gone.
static int send_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n > 0) {
        ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        c += w, n -= (size_t)w;
    }
    return 0;
}

static int send_text(int fd, const char *s) { return send_all(fd, s, strlen(s)); }

static void zeros_until_hangup(int fd) {
    static char block[65536];
    memset(block, '0', sizeof block);
    while (send_all(fd, block, sizeof block) == 0) {}
}

// Reads the request (header and Content-Length body) into req; returns its path.
static const char *read_request(int fd, char *req, size_t cap) {
    size_t len = 0;
    char *end = NULL;
    while (!end && len + 1 < cap) {
        ssize_t r = recv(fd, req + len, cap - 1 - len, 0);
        if (r <= 0) return NULL;
        len += (size_t)r;
        req[len] = '\0';
        end = strstr(req, "\r\n\r\n");
    }
    if (!end) return NULL;
    const char *cl = strstr(req, "Content-Length: ");
    size_t body = cl ? strtoul(cl + 16, NULL, 10) : 0, have = len - (size_t)(end + 4 - req);
    char sink[4096];
    while (have < body) {
        ssize_t r = recv(fd, sink, sizeof sink, 0);
        if (r <= 0) break;
        have += (size_t)r;
    }
    char *path = strchr(req, ' ');
    if (!path) return NULL;
    *strchr(++path, ' ') = '\0';
    return path;
}

static void serve(int fd) {
    static char req[65536];
    const char *path = read_request(fd, req, sizeof req);
    if (!path) return;
    char head[256];
    if (!strcmp(path, "/huge-length") || !strcmp(path, "/score-huge")) {
        snprintf(head, sizeof head, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                 200 * MIB);
        if (send_text(fd, head) != 0 || send_text(fd, "{\"scores\": [") != 0) return;
        sleep(2);  // a client that waits for the body it was told about takes this long
        zeros_until_hangup(fd);
    } else if (!strcmp(path, "/big-chunk")) {
        if (send_text(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10000000\r\n") != 0) return;
        sleep(2);
        zeros_until_hangup(fd);
    } else if (!strcmp(path, "/many-chunks")) {
        if (send_text(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n") != 0) return;
        static char chunks[6 * 4096];
        for (int i = 0; i < 4096; i++) memcpy(chunks + 6 * i, "1\r\nx\r\n", 6);
        for (size_t sent = 0; sent < 2 * MIB; sent += 4096)
            if (send_all(fd, chunks, sizeof chunks) != 0) return;
        send_text(fd, "0\r\n\r\n");
    } else if (!strcmp(path, "/close-2mb")) {
        if (send_text(fd, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n") != 0) return;
        static char block[65536];
        memset(block, 'y', sizeof block);
        for (size_t sent = 0; sent < 2 * MIB; sent += sizeof block)
            if (send_all(fd, block, sizeof block) != 0) return;
    } else if (!strcmp(path, "/at-limit")) {
        snprintf(head, sizeof head, "HTTP/1.1 200 OK\r\nContent-Length: %zu\r\n\r\n", MIB);
        static char block[1 << 20];
        memset(block, 'z', sizeof block);
        if (send_text(fd, head) == 0) send_all(fd, block, sizeof block);
    } else if (!strcmp(path, "/at-limit-chunked")) {
        if (send_text(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n") != 0) return;
        static char chunk[4096 + 16];
        int n = snprintf(chunk, sizeof chunk, "1000\r\n");
        memset(chunk + n, 'w', 4096);
        memcpy(chunk + n + 4096, "\r\n", 2);
        for (size_t sent = 0; sent < MIB; sent += 4096)
            if (send_all(fd, chunk, (size_t)n + 4098) != 0) return;
        send_text(fd, "0\r\n\r\n");
    } else {
        send_text(fd, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
    }
}

static pid_t start_server(int *port) {
    const int lfd = listen_loopback(8, port);
    pid_t pid = fork();
    REQUIRE(pid >= 0, "fork");
    if (pid == 0) {
        // One process per connection: a client that hung up on a sleeping answer must not delay the next one.
        // Each ends by itself once its answer is sent or its client has gone (SIG_IGN reaps them).
        signal(SIGCHLD, SIG_IGN);
        for (;;) {
            int fd = accept(lfd, NULL, NULL);
            if (fd < 0) continue;
            if (fork() == 0) {
                serve(fd);
                _exit(0);
            }
            close(fd);
        }
    }
    close(lfd);
    return pid;
}

static char base[64];

static int post(const char *path, size_t limit, HttpResponse *resp, char *url, char *err, size_t err_len) {
    snprintf(url, 128, "%s%s", base, path);
    HttpOptions o = {.connect_timeout_ms = 5000, .timeout_ms = 30000, .max_response_bytes = limit};
    return http_post(url, "application/json", "{}", 2, &o, resp, err, err_len);
}

static void expect_refused(const char *path, int announced) {
    char url[128], err[1024] = "";
    HttpResponse resp;
    double t0 = now_s();
    int rc = post(path, MIB, &resp, url, err, sizeof err);
    double secs = now_s() - t0;
    CHECK(rc == HTTP_E_TOO_LARGE, "%s: rc %d (%s), want HTTP_E_TOO_LARGE", path, rc, err);
    CHECK(strstr(err, url) && strstr(err, "limit of 1048576 bytes"), "%s: the message names neither the URL nor "
          "the limit: %s", path, err);
    if (announced) CHECK(secs < 1.0, "%s: refused after %.2f s: the announced body was read", path, secs);
    http_response_free(&resp);
}

static void expect_whole(const char *path, char fill) {
    char url[128], err[1024] = "";
    HttpResponse resp;
    int rc = post(path, MIB, &resp, url, err, sizeof err);
    CHECK(rc == HTTP_OK && resp.status == 200 && resp.body_len == MIB, "%s: rc %d (%s), %zu bytes", path, rc, err,
          resp.body_len);
    if (rc == HTTP_OK) {
        size_t bad = 0;
        for (size_t i = 0; i < resp.body_len; i++) bad += resp.body[i] != fill;
        CHECK(bad == 0, "%s: %zu bytes of the body are not '%c'", path, bad, fill);
    }
    http_response_free(&resp);
}

// The option reaches the client: default 64 MiB, --reward-max-response-mb N is N MiB, 0 is refused by name.
static void test_option(void) {
    char *argv[] = {"tandem-train", "--model", "/m", "--train-file", "/d.jsonl", "--rollout-servers", "tcp://h:1",
                    "--reward-url", "http://h:1/score", "--reward-max-response-mb", "3"};
    int argc = (int)(sizeof argv / sizeof *argv);
    char err[1024] = "";
    TrainConfig c;
    RewardServiceOptions so;
    train_config_default(&c);
    CHECK(train_config_parse_args(&c, argc - 2, argv, err, sizeof err) == 0 && train_config_finalize(&c, 1, err, sizeof err) == 0,
          "default config: %s", err);
    train_config_reward_service_options(&c, &so);
    CHECK(so.max_response_bytes == 64 * MIB && HTTP_DEFAULT_MAX_RESPONSE_BYTES == 64 * MIB, "default limit %zu",
          so.max_response_bytes);
    train_config_free(&c);
    train_config_default(&c);
    CHECK(train_config_parse_args(&c, argc, argv, err, sizeof err) == 0 && train_config_finalize(&c, 1, err, sizeof err) == 0,
          "--reward-max-response-mb 3: %s", err);
    train_config_reward_service_options(&c, &so);
    CHECK(so.max_response_bytes == 3 * MIB, "--reward-max-response-mb 3 gives %zu bytes", so.max_response_bytes);
    train_config_free(&c);
    argv[argc - 1] = "0";
    train_config_default(&c);
    int rc = train_config_parse_args(&c, argc, argv, err, sizeof err);
    if (rc == 0) rc = train_config_finalize(&c, 1, err, sizeof err);
    CHECK(rc != 0 && strstr(err, "reward_max_response_mb"), "--reward-max-response-mb 0 accepted (%s)", err);
    train_config_free(&c);
}

// The reward service does not retry an answer over the limit and says which option raises it.
static void test_reward_service(void) {
    RewardServiceOptions o;
    reward_service_options_default(&o);
    char url[128];
    snprintf(url, sizeof url, "%s/score-huge", base);
    o.url = url;
    o.max_retries = 3;
    o.backoff_s = 5;  // a retry would show as seconds of waiting
    o.max_response_bytes = MIB;
    RewardService *rs = NULL;
    char err[2048] = "";
    REQUIRE(reward_service_create(&rs, &o, err, sizeof err) == 0, "%s", err);
    RewardSample s = {.completion = "42"};
    double scores[4];
    size_t k = 0;
    double t0 = now_s();
    int rc = reward_service_score(rs, &s, 1, scores, 4, 4, &k, err, sizeof err);
    CHECK(rc != 0 && now_s() - t0 < 2.0, "reward service: rc %d after %.1f s", rc, now_s() - t0);
    CHECK(strstr(err, url) && strstr(err, "limit of 1048576 bytes") && strstr(err, "--reward-max-response-mb") &&
              strstr(err, "after 1 attempt(s)"),
          "reward service message: %s", err);
    reward_service_free(rs);
}

int main(void) {
    int port;
    pid_t server = start_server(&port);
    snprintf(base, sizeof base, "http://127.0.0.1:%d", port);
    expect_refused("/huge-length", 1);
    expect_refused("/big-chunk", 1);
    expect_refused("/many-chunks", 0);
    expect_refused("/close-2mb", 0);
    expect_whole("/at-limit", 'z');
    expect_whole("/at-limit-chunked", 'w');
    test_reward_service();
    test_option();
    kill(server, SIGTERM);
    waitpid(server, NULL, 0);
    return check_exit_code("test_trainer_http_limit");
}
