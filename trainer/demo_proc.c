// trainer/demo_proc.c — child processes, ports, clocks and folder removal for the demo (see trainer/demo.h).
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "trainer/demo.h"

volatile int demo_interrupted;

static void on_signal(int sig) { demo_interrupted = sig; }

void demo_install_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

pid_t demo_spawn(char *const *argv, char *const *env, const char *log, char *err, size_t err_len) {
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) {
        snprintf(err, err_len, "cannot open %s: %s", log, strerror(errno));
        return -1;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(err, err_len, "cannot start %s: %s", argv[0], strerror(errno));
        close(fd);
        return -1;
    }
    if (pid == 0) {
        // The child dies with the demo, whatever ends it (Ctrl-C, kill, a crash): no orphaned server.
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) _exit(127);
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        signal(SIGPIPE, SIG_DFL);
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        close(fd);
        for (int i = 0; env && env[i]; i++) putenv(env[i]);
        execv(argv[0], argv);
        fprintf(stderr, "cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(fd);
    return pid;
}

void demo_print_tail(const char *path, int n) {
    FILE *f = fopen(path, "r");
    if (!f) return;
    enum { MAXN = 32 };
    static char lines[MAXN][512];
    if (n > MAXN) n = MAXN;
    int k = 0;
    while (fgets(lines[k % n], sizeof lines[0], f)) k++;
    fclose(f);
    fprintf(stderr, "  last lines of %s:\n", path);
    for (int i = k > n ? k - n : 0; i < k; i++) {
        const char *s = lines[i % n];
        fprintf(stderr, "    | %s%s", s, s[0] && s[strlen(s) - 1] == '\n' ? "" : "\n");
    }
}

int demo_stop(pid_t pid, double grace_s) {
    int status = 0;
    if (pid <= 0) return 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    kill(pid, SIGTERM);
    double deadline = demo_now() + grace_s;
    while (demo_now() < deadline) {
        if (waitpid(pid, &status, WNOHANG) == pid) return status;
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return status;
}

// Whether port can be bound on 127.0.0.1 now (port 0: the kernel's pick, returned through *port).
static int try_bind(int *port) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return 0;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t)*port);
    socklen_t len = sizeof a;
    int ok = bind(s, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(s, (struct sockaddr *)&a, &len) == 0;
    if (ok) *port = ntohs(a.sin_port);
    close(s);
    return ok;
}

// The first port of the kernel's ephemeral range (ip_local_port_range; 32768 where it cannot be read).
static int ephemeral_low(void) {
    int low = 32768, high = 0;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f) {
        if (fscanf(f, "%d %d", &low, &high) != 2) low = 32768;
        fclose(f);
    }
    return low;
}

// From below the ephemeral range: the kernel hands ports of that range to outgoing connections, and one made
// between this check and the server's bind could take a port it picked (tests/e2e/server_fixtures.py free_port,
// where CI met exactly that). The kernel's pick stands in when no port below the range is free.
int demo_free_port(void) {
    const int high = ephemeral_low();
    unsigned seed = (unsigned)getpid() ^ (unsigned)time(NULL);
    for (int i = 0; high > 10001 && i < 500; i++) {
        int port = 10000 + (int)(rand_r(&seed) % (unsigned)(high - 10000));
        if (try_bind(&port)) return port;
    }
    int port = 0;
    return try_bind(&port) ? port : -1;
}

double demo_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}
