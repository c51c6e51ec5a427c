// trainer/launch.c — `tandem-train launch` (see trainer/launch.h).
//
//   tandem-train launch --model DIR [--ranks N] [--servers K] [--server-device cpu|cuda] [--server-arg ARG]...
//                       [--master-port P] [--control-port P] [--log-dir DIR] -- [tandem-train options]
#include "trainer/launch.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_PROCS 256
#define MAX_ARGS 512

typedef struct {
    pid_t pid;
    int is_server, index;   // server index or rank
    char log[PATH_MAX];     // "" = inherits the launcher's stdout/stderr (rank 0)
    int done, status;
} Child;

static Child children[MAX_PROCS];
static int n_children;
static volatile sig_atomic_t interrupted;

static void on_signal(int sig) { interrupted = sig; }

static void usage(FILE *f) {
    fprintf(f,
            "usage: tandem-train launch --model DIR [options] -- [tandem-train options]\n\n"
            "Starts the rollout servers and the trainer ranks of one run on this machine; stops them all when one\n"
            "fails or on Ctrl-C. Rank 0's output streams here; the others' go to --log-dir.\n\n"
            "  --model DIR            model folder, given to the servers and the ranks (required)\n"
            "  --ranks N              trainer ranks (default 1)\n"
            "  --servers K            rollout servers (default 1; 0 for --mode sft)\n"
            "  --server-device D      cpu or cuda[:N] for the servers (default cpu)\n"
            "  --server-arg ARG       one more tandem-serve argument (repeatable), e.g. --server-arg=--kv-cache-memory=2G\n"
            "  --master-port P        rendezvous port of rank 0 (default 29500)\n"
            "  --control-port P       ZeroMQ control port of server 0; server i uses P + i (default 5555)\n"
            "  --log-dir DIR          logs of the servers and of ranks > 0 (default launch-logs)\n"
            "  --help                 this text\n");
}

static void exe_dir(char *out, size_t len) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        snprintf(out, len, ".");
        return;
    }
    self[n] = 0;
    char *slash = strrchr(self, '/');
    if (slash) *slash = 0;
    snprintf(out, len, "%s", self);
}

// Starts argv with extra environment (NAME=VALUE, NULL-terminated); output to log (or inherited when "").
static pid_t spawn(char *const *argv, char *const *env, const char *log) {
    pid_t pid = fork();
    if (pid != 0) return pid;
    // Child: die with the launcher, whatever kills it.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    if (getppid() == 1) _exit(127);
    if (log[0]) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, STDOUT_FILENO);
            dup2(fd, STDERR_FILENO);
            close(fd);
        }
    }
    for (int i = 0; env && env[i]; i++) putenv(env[i]);
    execv(argv[0], argv);
    fprintf(stderr, "tandem-train launch: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

static const char *describe(const Child *c, char *buf, size_t len) {
    if (c->is_server) snprintf(buf, len, "rollout server %d (pid %d)", c->index, (int)c->pid);
    else snprintf(buf, len, "rank %d (pid %d)", c->index, (int)c->pid);
    return buf;
}

static void print_tail(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return;
    char lines[8][512];
    int n = 0;
    while (fgets(lines[n % 8], sizeof lines[0], f)) n++;
    fclose(f);
    for (int i = n > 8 ? n - 8 : 0; i < n; i++) fprintf(stderr, "    | %s", lines[i % 8]);
}

// SIGTERM to every live child, then SIGKILL to whoever is left after grace_s seconds.
static void stop_all(double grace_s) {
    for (int i = 0; i < n_children; i++)
        if (!children[i].done) kill(children[i].pid, SIGTERM);
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        int live = 0;
        for (int i = 0; i < n_children; i++) {
            if (children[i].done) continue;
            if (waitpid(children[i].pid, &children[i].status, WNOHANG) == children[i].pid) children[i].done = 1;
            else live++;
        }
        if (!live) return;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec - start.tv_sec + (now.tv_nsec - start.tv_nsec) * 1e-9 > grace_s) break;
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    for (int i = 0; i < n_children; i++)
        if (!children[i].done) {
            kill(children[i].pid, SIGKILL);
            waitpid(children[i].pid, &children[i].status, 0);
            children[i].done = 1;
        }
}

int launch_main(int argc, char **argv) {
    const char *model = NULL, *server_device = "cpu", *log_dir = "launch-logs";
    int ranks = 1, servers = 1, master_port = 29500, control_port = 5555, n_server_args = 0, train_start = argc;
    const char *server_args[64];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--")) {
            train_start = i + 1;
            break;
        }
        if (!strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (!strncmp(a, "--server-arg=", 13)) {
            if (n_server_args < 64) server_args[n_server_args++] = a + 13;
            continue;
        }
        if (!v) {
            fprintf(stderr, "tandem-train launch: %s needs a value (see tandem-train launch --help)\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--ranks")) ranks = atoi(v);
        else if (!strcmp(a, "--servers")) servers = atoi(v);
        else if (!strcmp(a, "--server-device")) server_device = v;
        else if (!strcmp(a, "--server-arg")) { if (n_server_args < 64) server_args[n_server_args++] = v; }
        else if (!strcmp(a, "--master-port")) master_port = atoi(v);
        else if (!strcmp(a, "--control-port")) control_port = atoi(v);
        else if (!strcmp(a, "--log-dir")) log_dir = v;
        else {
            fprintf(stderr, "tandem-train launch: unknown option %s (tandem-train options go after --)\n", a);
            return 2;
        }
    }
    if (!model || ranks < 1 || ranks > 128 || servers < 0 || servers > 64 || master_port < 1 || master_port > 65535 ||
        control_port < 1 || control_port + servers > 65535) {
        fprintf(stderr, "tandem-train launch: need --model, 1 <= --ranks <= 128, 0 <= --servers <= 64 and valid ports "
                        "(see --help)\n");
        return 2;
    }
    if (mkdir(log_dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "tandem-train launch: cannot create --log-dir %s: %s\n", log_dir, strerror(errno));
        return 1;
    }
    char dir[PATH_MAX], serve_bin[PATH_MAX + 16], train_bin[PATH_MAX + 16];
    exe_dir(dir, sizeof dir);
    snprintf(serve_bin, sizeof serve_bin, "%s/tandem-serve", dir);
    snprintf(train_bin, sizeof train_bin, "%s/tandem-train", dir);
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    char endpoints[64 * 32] = "";
    for (int s = 0; s < servers; s++) {
        char ctl[64], *args[MAX_ARGS];
        snprintf(ctl, sizeof ctl, "tcp://127.0.0.1:%d", control_port + s);
        snprintf(endpoints + strlen(endpoints), sizeof endpoints - strlen(endpoints), "%s%s", s ? "," : "", ctl);
        int k = 0;
        args[k++] = serve_bin;
        args[k++] = "--model", args[k++] = (char *)model;
        args[k++] = "--control", args[k++] = strdup(ctl);
        args[k++] = "--port", args[k++] = "0";
        args[k++] = "--device", args[k++] = (char *)server_device;
        for (int j = 0; j < n_server_args; j++) args[k++] = (char *)server_args[j];
        args[k] = NULL;
        Child *c = &children[n_children++];
        *c = (Child){.is_server = 1, .index = s};
        snprintf(c->log, sizeof c->log, "%s/server%d.log", log_dir, s);
        c->pid = spawn(args, NULL, c->log);
        fprintf(stderr, "tandem-train launch: rollout server %d (pid %d) on %s, log %s\n", s, (int)c->pid, ctl, c->log);
    }
    for (int r = 0; r < ranks; r++) {
        char *args[MAX_ARGS], *env[8], buf[6][64];
        int k = 0;
        args[k++] = train_bin;
        args[k++] = "--model", args[k++] = (char *)model;
        if (servers > 0) args[k++] = "--rollout-servers", args[k++] = endpoints;
        for (int j = train_start; j < argc && k < MAX_ARGS - 1; j++) args[k++] = argv[j];
        args[k] = NULL;
        snprintf(buf[0], 64, "RANK=%d", r);
        snprintf(buf[1], 64, "WORLD_SIZE=%d", ranks);
        snprintf(buf[2], 64, "LOCAL_RANK=%d", r);
        snprintf(buf[3], 64, "MASTER_ADDR=127.0.0.1");
        snprintf(buf[4], 64, "MASTER_PORT=%d", master_port);
        snprintf(buf[5], 64, "NCCL_NVLS_ENABLE=0");
        for (int j = 0; j < 6; j++) env[j] = buf[j];
        env[6] = NULL;
        Child *c = &children[n_children++];
        *c = (Child){.is_server = 0, .index = r};
        if (r > 0) snprintf(c->log, sizeof c->log, "%s/rank%d.log", log_dir, r);
        c->pid = spawn(args, env, c->log);
        if (r > 0) fprintf(stderr, "tandem-train launch: rank %d (pid %d), log %s\n", r, (int)c->pid, c->log);
    }
    // Wait: success when every rank exits 0; anything else stops the run.
    int ranks_left = ranks, rc = 0;
    while (ranks_left > 0) {
        int status;
        pid_t pid = waitpid(-1, &status, 0);
        if (pid < 0) {
            if (errno == EINTR && interrupted) {
                fprintf(stderr, "tandem-train launch: %s: stopping every process\n",
                        interrupted == SIGINT ? "interrupted (Ctrl-C)" : "terminated");
                stop_all(30);
                return 130;
            }
            if (errno == EINTR) continue;
            break;
        }
        Child *c = NULL;
        for (int i = 0; i < n_children; i++)
            if (children[i].pid == pid) c = &children[i];
        if (!c) continue;
        c->done = 1;
        c->status = status;
        char who[64];
        describe(c, who, sizeof who);
        int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!c->is_server && ok) {
            ranks_left--;
            continue;
        }
        if (WIFEXITED(status))
            fprintf(stderr, "tandem-train launch: %s exited with code %d%s; stopping the others\n", who,
                    WEXITSTATUS(status), c->is_server ? " before training finished" : "");
        else
            fprintf(stderr, "tandem-train launch: %s was killed by signal %d (%s); stopping the others\n", who,
                    WTERMSIG(status), strsignal(WTERMSIG(status)));
        if (c->log[0]) {
            fprintf(stderr, "  last lines of %s:\n", c->log);
            print_tail(c->log);
        }
        rc = 1;
        break;
    }
    // Training is over (or failed): the servers drain and exit.
    stop_all(rc == 0 ? 60 : 30);
    if (rc == 0) fprintf(stderr, "tandem-train launch: every rank finished; servers stopped\n");
    return rc;
}
