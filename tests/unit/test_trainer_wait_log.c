// test_trainer_wait_log.c — a long wait says what it waits for about once per interval, never more often
// (issue 22: a wait loop printed the same line 249 times in 2 s; the reward service's waits said nothing at all).
//
//   - WaitLog ticked in a tight loop for 1.05 s with a 0.2 s interval prints at most 5 lines (at least 3 on a
//     busy machine), each with what is awaited, the seconds so far, the limit and the option that sets it.
//   - http_post to a server that takes the connection and never answers ticks its WaitLog while it waits: with
//     a 0.2 s interval and a 1 s timeout, 3 to 5 lines, then the timeout.
//   - The reward service says why it retries and which attempt comes next, once per retry.
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check_macros.h"
#include "testlib.h"
#include "trainer/http_client.h"
#include "trainer/reward_service.h"
#include "trainer/wait_log.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int count_lines(const char *text, const char *needle) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

// stderr goes to a temporary file between capture_start and capture_end, which returns what was written.
static int saved_stderr = -1;
static char capture_path[] = "/tmp/tandem_wait_log_XXXXXX";

static void capture_start(void) {
    int fd = mkstemp(capture_path);
    REQUIRE(fd >= 0, "mkstemp");
    fflush(stderr);
    saved_stderr = dup(STDERR_FILENO);
    dup2(fd, STDERR_FILENO);
    close(fd);
}

static char *capture_end(void) {
    static char text[65536];
    fflush(stderr);
    dup2(saved_stderr, STDERR_FILENO);
    close(saved_stderr);
    FILE *f = fopen(capture_path, "rb");
    size_t n = f ? fread(text, 1, sizeof text - 1, f) : 0;
    if (f) fclose(f);
    text[n] = '\0';
    unlink(capture_path);
    strcpy(capture_path, "/tmp/tandem_wait_log_XXXXXX");
    return text;
}

static void test_tight_loop(void) {
    capture_start();
    WaitLog w;
    wait_log_start(&w, 30, "--some-timeout", "the thing %d", 7);
    w.interval_s = 0.2;
    long ticks = 0;
    for (double t0 = now_s(); now_s() - t0 < 1.05;) ticks += wait_log_tick(&w) >= 0;
    char *text = capture_end();
    int lines = count_lines(text, "tandem-train: still waiting for the thing 7: ");
    CHECK(lines >= 3 && lines <= 5, "%ld ticks in 1.05 s with a 0.2 s interval printed %d lines:\n%s", ticks, lines,
          text);
    CHECK(count_lines(text, "\n") == lines, "other lines printed:\n%s", text);
    CHECK(strstr(text, "of at most 30 s (--some-timeout)"), "the line does not give the limit:\n%s", text);
}

// A listening socket that is never accepted from: the kernel takes the connection, nobody answers.
static int silent_server(int *port) { return listen_loopback(4, port); }

static void test_http_wait(void) {
    int port, lfd = silent_server(&port);
    char url[64], err[512] = "";
    snprintf(url, sizeof url, "http://127.0.0.1:%d/score", port);
    WaitLog w;
    wait_log_start(&w, 1, "--reward-timeout", "the answer of %s", url);
    w.interval_s = 0.2;
    HttpOptions o = {.connect_timeout_ms = 1000, .timeout_ms = 1000, .wait_log = &w};
    HttpResponse resp;
    capture_start();
    int rc = http_post(url, "application/json", "[]", 2, &o, &resp, err, sizeof err);
    char *text = capture_end();
    CHECK(rc == HTTP_E_TIMEOUT, "rc %d (%s), want a timeout", rc, err);
    int lines = count_lines(text, "still waiting for the answer of http://127.0.0.1:");
    CHECK(lines >= 3 && lines <= 5, "a 1 s wait with a 0.2 s interval printed %d lines:\n%s", lines, text);
    close(lfd);
}

static void test_reward_service_retry(void) {
    int port, lfd = silent_server(&port);
    close(lfd);  // nothing listens there now: every connect is refused at once
    char url[64], err[1024] = "";
    snprintf(url, sizeof url, "http://127.0.0.1:%d/score", port);
    RewardServiceOptions o;
    reward_service_options_default(&o);
    o.url = url;
    o.max_retries = 2;
    o.backoff_s = 0.05;
    RewardService *rs = NULL;
    REQUIRE(reward_service_create(&rs, &o, err, sizeof err) == 0, "%s", err);
    RewardSample s = {.completion = "x"};
    double scores[2];
    size_t k;
    capture_start();
    int rc = reward_service_score(rs, &s, 1, scores, 2, 2, &k, err, sizeof err);
    char *text = capture_end();
    CHECK(rc != 0 && strstr(err, "after 3 attempt(s)"), "rc %d: %s", rc, err);
    CHECK(count_lines(text, "cannot connect") == 2 && strstr(text, "attempt 2 of 3 in 0.05 s") &&
              strstr(text, "attempt 3 of 3 in 0.1 s") && count_lines(text, "\n") == 2,
          "the retries are not said once each, with the failure and the next attempt:\n%s", text);
    reward_service_free(rs);
}

int main(void) {
    test_tight_loop();
    test_http_wait();
    test_reward_service_retry();
    return check_exit_code("test_trainer_wait_log");
}
