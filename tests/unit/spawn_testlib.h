// tests/unit/spawn_testlib.h — forked ranks for the multi-process communicator tests (test_comm_nccl*.c):
// spawn (fork n children, bounded wall time), report (their exit codes against the wanted ones), gpu_count (in CUDA
// builds, for a test that includes cuda_runtime.h first: the devices NCCL can use, asked in a child). Include once,
// in the test's .c file, after the system headers it needs.
#ifndef TANDEM_TESTS_SPAWN_TESTLIB_H
#define TANDEM_TESTS_SPAWN_TESTLIB_H

#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check_macros.h"   // CHECK and failures: in a child its failures (its exit code), in the parent the total

static inline int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

// A port the kernel just handed out on 127.0.0.1 (free now; every scenario takes a new one).
static inline int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        perror("free_port");
        exit(2);
    }
    close(fd);
    return ntohs(a.sin_port);
}

typedef int (*ChildFn)(int idx, int port, void *arg);   // runs in a child; returns its exit code

// Forks n children running fn(idx) (before any CUDA call in this process: CUDA does not survive fork), waits
// at most wall_ms (then kills them: a hang is a failure). Once child 0 has exited the others get linger_ms
// more, then are killed (sleepers). codes[i]: exit code, -1 when killed or crashed.
static inline void spawn(int n, ChildFn fn, void *arg, int wall_ms, int linger_ms, int *codes) {
    int port = free_port();
    pid_t pid[8];
    int done[8] = {0}, left = n;
    fflush(stdout);
    fflush(stderr);
    for (int i = 0; i < n; i++) {
        codes[i] = -1;
        pid[i] = fork();
        if (pid[i] == 0) {
            failures = 0;
            int rc = fn(i, port, arg);
            fflush(stdout);
            fflush(stderr);
            _exit(rc);
        }
    }
    int64_t deadline = now_ms() + wall_ms;
    while (left > 0) {
        for (int i = 0; i < n; i++) {
            int st;
            if (done[i] || waitpid(pid[i], &st, WNOHANG) != pid[i]) continue;
            done[i] = 1;
            left--;
            codes[i] = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
            if (i == 0 && linger_ms >= 0 && now_ms() + linger_ms < deadline) deadline = now_ms() + linger_ms;
        }
        if (left > 0 && now_ms() > deadline) {
            for (int i = 0; i < n; i++)
                if (!done[i]) {
                    if (i == 0 || linger_ms < 0) fprintf(stderr, "spawn: child %d still running after the limit: killed (a hang)\n", i);
                    kill(pid[i], SIGKILL);
                    waitpid(pid[i], NULL, 0);
                    done[i] = 1;
                }
            left = 0;
        }
        if (left > 0) usleep(2000);
    }
}

static inline int report(const char *name, int n, const int *codes, const int *want) {
    int bad = 0;
    for (int i = 0; i < n; i++)
        if (codes[i] != want[i]) {
            fprintf(stderr, "%s: process %d ended with %d (want %d)\n", name, i, codes[i], want[i]);
            bad++;
        }
    printf("%-8s %s\n", name, bad ? "FAILED" : "ok");
    fflush(stdout);
    failures += bad;
    return bad;
}

#if defined(TANDEM_HAVE_CUDA) && defined(__CUDA_RUNTIME_H__)
// Devices NCCL can use, asked in a child: CUDA must not start in this process before the forks.
static inline int gpu_count(void) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        int n = 0;
        if (!comm_backend_available(COMM_BACKEND_NCCL) || cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
        _exit(n > 100 ? 100 : n);
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st)) return 0;
    return WEXITSTATUS(st);
}
#endif

#endif
