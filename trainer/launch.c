// trainer/launch.c — `tandem-train launch` (see trainer/launch.h).
//
//   tandem-train launch --model DIR [--nnodes N --node-rank R --master-addr HOST] [--ranks N] [--servers K]
//                       [--server-device cpu|cuda] [--server-arg ARG]... [--master-port P] [--control-port P]
//                       [--log-dir DIR] [--dns-timeout S] [--control-keys DIR | --control-insecure]
//                       -- [tandem-train options]
//
// Several nodes: the same command on every node, only --node-rank differs (torchrun's model). Node R starts
// ranks R * ranks ... R * ranks + ranks - 1. Rollout servers started by the launcher run on node 0 only and
// listen on every interface there; every node's ranks reach them at MASTER_ADDR. External servers (Kubernetes:
// their own pods) are --servers 0 plus the trainer's --rollout-servers after "--".
// The control channel is authenticated with CURVE (trainer/control_keygen.h): one node makes a fresh key folder
// per run in --log-dir; several nodes need the same folder on each (--control-keys).
#define _GNU_SOURCE  // sched_getaffinity, CPU_COUNT
#include "trainer/launch.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/ops.h"
#include "shared/cli.h"
#include "shared/comm/comm.h"
#include "shared/version.h"
#include "trainer/control_keygen.h"
#include "trainer/make_dirs.h"

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

typedef struct {
    const char *model, *server_device, *log_dir, *control_keys;
    const char *nnodes, *node_rank, *master_addr, *master_port;   // flag or environment, checked after parsing
    int ranks, servers, server_tp, control_port, dns_timeout, control_insecure;
    CliList server_args;
} LaunchOptions;

#define TEXT(flag_, field, value, help_, note)                                                                     \
    {.flag = flag_, .type = CLI_TEXT, .offset = offsetof(LaunchOptions, field), .value_name = value, .help = help_, \
     .default_note = note}
#define INT(flag_, field, lo, hi, help_)                                                                            \
    {.flag = flag_, .type = CLI_INT, .offset = offsetof(LaunchOptions, field), .help = help_,                       \
     .bounds = CLI_BOUND_MIN | CLI_BOUND_MAX, .min = lo, .max = hi}
static const CliOption kOptions[] = {
    {.flag = "--model", .type = CLI_TEXT, .offset = offsetof(LaunchOptions, model), .value_name = "DIR",
     .help = "model folder, given to the servers and the ranks", .required = 1},
    {.flag = "--ranks", .type = CLI_INT, .offset = offsetof(LaunchOptions, ranks), .help = "trainer ranks on this node",
     .bounds = CLI_BOUND_MIN | CLI_BOUND_MAX, .min = 1, .max = 128,
     .default_note = "env PET_NPROC_PER_NODE (Kubeflow PyTorchJob), else 1"},
    TEXT("--nnodes", nnodes, "N", "nodes in the run", "env NNODES or PET_NNODES, else 1"),
    TEXT("--node-rank", node_rank, "R", "this node's index, 0 .. nnodes-1",
         "env NODE_RANK or PET_NODE_RANK, else JOB_COMPLETION_INDEX (Kubernetes indexed Job), else 0"),
    TEXT("--master-addr", master_addr, "HOST", "node 0's host name or IP address",
         "env MASTER_ADDR or PET_MASTER_ADDR, else 127.0.0.1"),
    TEXT("--master-port", master_port, "P",
         "MASTER_PORT of the run; rank 0's rendezvous binds it, or TANDEM_RENDEZVOUS_PORT when that is set",
         "env MASTER_PORT or PET_MASTER_PORT, else 29500"),
    INT("--servers", servers, 0, 64,
        "rollout servers, started on node 0 (0 for --mode sft or for servers of your own, given as --rollout-servers "
        "after --)"),
    TEXT("--server-device", server_device, "D",
         "the servers' devices: cpu, cuda:N, a comma list with one entry per server (cuda:7,cuda:6; with --server-tp "
         "each entry is the first GPU of that server's group), or cuda: the GPUs after the trainer ranks' (local rank r "
         "uses GPU r, so server i takes GPUs ranks + i * T .. ranks + i * T + T - 1 for --server-tp T) when this node "
         "has that many, else GPU 0 for all (--server-tp 1 only)", NULL),
    INT("--server-tp", server_tp, 1, 64,
        "each rollout server splits the model over this many GPUs (tandem-serve --tensor-parallel-size; cpu: as many "
        "compute contexts)"),
    {.flag = "--server-arg", .type = CLI_LIST, .offset = offsetof(LaunchOptions, server_args), .value_name = "ARG",
     .help = "one more tandem-serve argument, e.g. --server-arg=--kv-cache-memory=2G"},
    {.flag = "--control-port", .type = CLI_INT, .offset = offsetof(LaunchOptions, control_port), .value_name = "P",
     .help = "ZeroMQ control port of server 0; server i uses P + i. With --nnodes > 1 the servers listen on every "
             "interface of node 0",
     .bounds = CLI_BOUND_MIN | CLI_BOUND_MAX, .min = 1, .max = 65535},
    TEXT("--log-dir", log_dir, "DIR", "logs of the servers and of local ranks > 0", NULL),
    INT("--dns-timeout", dns_timeout, 0, 86400,
        "with WORLD_SIZE > 1, seconds to wait for --master-addr to resolve before starting the ranks (a pod's DNS "
        "name appears shortly after it starts)"),
    TEXT("--control-keys", control_keys, "DIR",
         "CURVE keys of the control channel, a folder made by tandem-train keygen DIR, the same on every node: "
         "servers admit only the ranks' key",
         "one node makes a fresh folder for each run, --log-dir/control-keys; several nodes need this option or "
         "--control-insecure"),
    {.flag = "--control-insecure", .type = CLI_SWITCH, .offset = offsetof(LaunchOptions, control_insecure),
     .help = "no keys on the control channel: with --nnodes > 1 anyone who reaches node 0 can control its servers; "
             "on one node any local process can, and weight pushes over zmq skip CURVE's encryption (about 10x the "
             "bandwidth)"},
};
#undef TEXT
#undef INT

static const CliSpec kSpec = {
    .command = "tandem-train launch",
    .synopsis = "--model DIR [options] -- [tandem-train options]",
    .description =
        "Starts the rollout servers and the trainer ranks of one run on this node; stops them all when one\n"
        "fails or on Ctrl-C. Local rank 0's output streams here; the others' go to --log-dir.\n"
        "Several nodes: run the same command on each, with its own --node-rank. Each rank gets RANK =\n"
        "node_rank * ranks + local rank, WORLD_SIZE = nnodes * ranks, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,\n"
        "and its node: LOCAL_WORLD_SIZE = ranks, NNODES, NODE_RANK (and torchrun's GROUP_RANK, GROUP_WORLD_SIZE;\n"
        "PyTorchJob's PET_* variables, where set, are given the same values).",
    .epilog =
        "Options after -- go to the trainer ranks (tandem-train's own options).\n"
        "CPU threads: every server and rank started here gets OPENBLAS_NUM_THREADS and OMP_NUM_THREADS =\n"
        "this node's cores / processes started here (at least 1), so that they do not all take every core;\n"
        "a variable you set yourself is passed on as it is. The start-up line says which values were used.",
    .options = kOptions,
    .n_options = sizeof kOptions / sizeof kOptions[0],
};

// Server s's --device: entry s of a comma list (or the only entry); "cuda" places server s on GPU ranks + s
// (the trainer's local rank r uses GPU r) when the node has that many GPUs, else on GPU 0 beside the ranks.
static int server_device_of(const char *spec, int s, int ranks, int servers, int tp, char *out, size_t len) {
    int n = 1;
    for (const char *p = spec; *p; p++) n += *p == ',';
    if (n > 1) {
        const char *p = spec;
        for (int i = 0; i < s && i < n - 1; i++) p = strchr(p, ',') + 1;
        size_t k = strcspn(p, ",");
        snprintf(out, len, "%.*s", (int)k, p);
        return 0;
    }
    if (strcmp(spec, "cuda") != 0) {
        snprintf(out, len, "%s", spec);
        return 0;
    }
    int gpus = ops_cuda_device_count();
    if (gpus >= ranks + servers * tp) snprintf(out, len, "cuda:%d", ranks + s * tp);
    else if (tp == 1) snprintf(out, len, "cuda:0");
    else return -1;   // the shards of a tensor-parallel server need GPUs of their own
    return 0;
}

// The cores this process may run on (its affinity mask: taskset, a container's cpuset), else the online ones.
static int cores_available(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

// The thread pools of the CPU backend: OpenBLAS for the GEMMs, OpenMP for the tiled kernels (kernels/cpu).
static const char *const THREAD_VARS[] = {"OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"};
#define N_THREAD_VARS (sizeof THREAD_VARS / sizeof *THREAD_VARS)

// Each pool sizes itself to every core by default, so P processes on C cores would run P x C threads. Every
// child gets a fair share, max(1, C / P), in each variable the user has not set (one set is passed on as it
// is). Fills env (NAME=VALUE strings in bufs, NULL-terminated, at most N_THREAD_VARS) and says what it chose.
static void thread_share_env(int processes, char bufs[][48], char **env) {
    int cores = cores_available(), share = cores / (processes > 0 ? processes : 1), k = 0;
    if (share < 1) share = 1;
    char said[256] = "";
    for (size_t i = 0; i < N_THREAD_VARS; i++) {
        const char *user = getenv(THREAD_VARS[i]);
        size_t used = strlen(said);
        if (user) {
            snprintf(said + used, sizeof said - used, "%s%s=%s (yours)", i ? ", " : "", THREAD_VARS[i], user);
            continue;
        }
        snprintf(bufs[k], sizeof bufs[0], "%s=%d", THREAD_VARS[i], share);
        snprintf(said + used, sizeof said - used, "%s%s", i ? ", " : "", bufs[k]);
        env[k] = bufs[k];
        k++;
    }
    env[k] = NULL;
    fprintf(stderr, "tandem-train launch: %d CPU core(s) for %d process(es) here; each runs with %s%s\n", cores,
            processes, said, k ? " (set the variable yourself to choose another value)" : "");
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

// Parses a decimal integer in [lo, hi]; `what` names the flag or variable in the error.
static int parse_int(const char *what, const char *text, int lo, int hi, int *out) {
    char *end = NULL;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (!*text || errno || *end || v < lo || v > hi) {
        fprintf(stderr, "tandem-train launch: %s '%s' must be an integer in %d..%d (see --help)\n", what, text, lo, hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

// The flag's value when given, else the first environment variable of envs that is set (*what names the source;
// NULL when none is). Two of envs set to different values contradict each other (ours and PyTorchJob's PET_ name
// of one value): -1 after saying so, even with the flag given, since the environment describes another run.
static int flag_or_env(const char *flag_val, const char *flag, const char *const *envs, const char **what,
                       const char **val) {
    *what = flag, *val = flag_val;
    const char *first = NULL, *first_name = NULL;
    for (int i = 0; envs[i]; i++) {
        const char *v = getenv(envs[i]);
        if (!v) continue;
        if (first && strcmp(first, v) != 0) {
            fprintf(stderr, "tandem-train launch: environment variables %s='%s' and %s='%s' disagree\n", first_name,
                    first, envs[i], v);
            return -1;
        }
        if (!first) first = v, first_name = envs[i];
    }
    if (!flag_val && first) *what = first_name, *val = first;
    return 0;
}

// A pod's DNS name (the headless Service's record) appears a few seconds after the pod starts, and a rank
// that cannot resolve MASTER_ADDR fails at once: wait for it here, where waiting is cheap.
static int wait_resolvable(const char *host, int timeout_s) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int said = 0;; said = 1) {
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
        int rc = getaddrinfo(host, NULL, &hints, &res);
        if (rc == 0) {
            freeaddrinfo(res);
            if (said) fprintf(stderr, "tandem-train launch: MASTER_ADDR %s resolves now\n", host);
            return 0;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (interrupted || now.tv_sec - start.tv_sec >= timeout_s) {
            fprintf(stderr, "tandem-train launch: MASTER_ADDR %s does not resolve (%s)%s\n", host, gai_strerror(rc),
                    interrupted ? "" : " within --dns-timeout");
            return -1;
        }
        if (!said)
            fprintf(stderr, "tandem-train launch: waiting up to %d s for MASTER_ADDR %s to resolve (%s)\n", timeout_s,
                    host, gai_strerror(rc));
        struct timespec ts = {1, 0};
        nanosleep(&ts, NULL);
    }
}

// Which key folder the run uses (keys_dir, "" for none). One node: a fresh one in log_dir/control-keys unless told
// otherwise. Several nodes: the servers listen on every interface of node 0, so the keys must be given (one
// folder copied to every node: a key made here would not reach the other nodes) or refused explicitly.
// Returns 0, or after printing why 2 (a usage error) or 1 (the folder is incomplete or cannot be written).
static int resolve_control_keys(const char *keys_arg, int insecure, int servers, int nnodes, const char *log_dir,
                                char *keys_dir, size_t cap) {
    char err[PATH_MAX + 256];
    if (keys_arg && insecure) {
        fprintf(stderr, "tandem-train launch: --control-keys and --control-insecure contradict each other: drop "
                        "one\n");
        return 2;
    }
    if (keys_arg) {
        snprintf(keys_dir, cap, "%s", keys_arg);
        if (!control_keygen_dir_complete(keys_dir, err, sizeof err)) {
            fprintf(stderr, "tandem-train launch: --control-keys: %s\n", err);
            return 1;
        }
        fprintf(stderr, "tandem-train launch: control channel authenticated with the CURVE keys in %s\n", keys_dir);
        return 0;
    }
    if (insecure || servers == 0) return 0;   // --servers 0: the user's servers, the user's keys (after "--")
    if (nnodes > 1) {
        fprintf(stderr, "tandem-train launch: with --nnodes %d the rollout servers listen on every interface of node "
                        "0, so their control channel needs keys: run tandem-train keygen DIR once, give every node "
                        "the same DIR (a shared folder, a copy, or a Kubernetes Secret) and pass --control-keys "
                        "DIR; or --control-insecure on a network you trust\n", nnodes);
        return 2;
    }
    snprintf(keys_dir, cap, "%s/control-keys", log_dir);
    if (control_keygen_write_dir(keys_dir, 1, err, sizeof err) != 0) {
        fprintf(stderr, "tandem-train launch: cannot write this run's control keys: %s\n", err);
        return 1;
    }
    fprintf(stderr, "tandem-train launch: control channel authenticated with fresh CURVE keys in %s (mode 0600)\n",
            keys_dir);
    return 0;
}

int launch_main(int argc, char **argv) {
    LaunchOptions o = {.server_device = "cpu", .log_dir = "launch-logs", .ranks = 0, .servers = 1, .server_tp = 1,
                       .control_port = 5555, .dns_timeout = 300};
    const LaunchOptions defaults = o;
    int train_start = argc;
    char cli_err[512];
    int pr = cli_parse(&kSpec, &o, argc, argv, &train_start, cli_err, sizeof cli_err);
    if (pr == CLI_HELP) cli_usage(&kSpec, &defaults, stdout);
    if (pr == CLI_VERSION) tandem_print_version(stdout, "tandem-train");
    if (pr == CLI_ERROR)
        fprintf(stderr, "%s%s\n", cli_err, strstr(cli_err, "unknown option") ? " (tandem-train options go after --)" : "");
    if (pr != CLI_OK) return pr == CLI_ERROR ? 2 : 0;
    const char *model = o.model, *server_device = o.server_device, *log_dir = o.log_dir;
    const char *nnodes_arg = o.nnodes, *node_rank_arg = o.node_rank, *master_addr_arg = o.master_addr;
    const char *master_port_arg = o.master_port, *control_keys_arg = o.control_keys;
    int ranks = o.ranks, servers = o.servers, master_port = 29500, control_port = o.control_port;
    int dns_timeout = o.dns_timeout, control_insecure = o.control_insecure, n_server_args = o.server_args.n;
    const char *const *server_args = o.server_args.items;
    // Flags win over the environment; NODE_RANK (or PyTorchJob's PET_NODE_RANK) over JOB_COMPLETION_INDEX (set by
    // a Kubernetes indexed Job).
    static const char *const env_nnodes[] = {"NNODES", "PET_NNODES", NULL},
                             *const env_node[] = {"NODE_RANK", "PET_NODE_RANK", NULL},
                             *const env_index[] = {"JOB_COMPLETION_INDEX", NULL},
                             *const env_addr[] = {"MASTER_ADDR", "PET_MASTER_ADDR", NULL},
                             *const env_port[] = {"MASTER_PORT", "PET_MASTER_PORT", NULL},
                             *const env_ranks[] = {"PET_NPROC_PER_NODE", NULL};
    const char *what, *val;
    int nnodes = 1, node_rank = 0;
    if (!ranks) {
        if (flag_or_env(NULL, "--ranks", env_ranks, &what, &val) || (val && parse_int(what, val, 1, 128, &ranks)))
            return 2;
        if (!val) ranks = 1;
    }
    if (flag_or_env(nnodes_arg, "--nnodes", env_nnodes, &what, &val) || (val && parse_int(what, val, 1, 4096, &nnodes)))
        return 2;
    if (flag_or_env(node_rank_arg, "--node-rank", env_node, &what, &val)) return 2;
    if (!val && flag_or_env(NULL, "--node-rank", env_index, &what, &val)) return 2;
    if (val && parse_int(what, val, 0, nnodes - 1, &node_rank)) return 2;
    const char *port_what;
    if (flag_or_env(master_port_arg, "--master-port", env_port, &port_what, &val) ||
        (val && parse_int(port_what, val, 1, 65535, &master_port)))
        return 2;
    // The port rank 0's rendezvous binds, by the ranks' own rule (comm.h), so that what is said here is what they do.
    int rdzv_port;
    char rdzv_source[96], perr[256];
    if (comm_rendezvous_port_from_env(master_port, val ? port_what : "MASTER_PORT", &rdzv_port, rdzv_source,
                                      sizeof rdzv_source, perr, sizeof perr)) {
        fprintf(stderr, "tandem-train launch: %s\n", perr);
        return 2;
    }
    const char *master_addr;
    if (flag_or_env(master_addr_arg, "--master-addr", env_addr, &what, &master_addr)) return 2;
    if (!master_addr) master_addr = "127.0.0.1";
    int addr_ok = *master_addr && strlen(master_addr) < 256;
    for (const char *p = master_addr; *p; p++) addr_ok &= *p > ' ' && *p != '/' && *p != '[' && *p != ']';
    if (!addr_ok) {
        fprintf(stderr, "tandem-train launch: %s '%s' is not a host name or IP address\n", what, master_addr);
        return 2;
    }
    if (control_port + servers > 65535) {
        fprintf(stderr, "tandem-train launch: --control-port %d + --servers %d runs past port 65535\n", control_port,
                servers);
        return 2;
    }
    int world = nnodes * ranks, first_rank = node_rank * ranks;
    char derr[PATH_MAX + 64];
    if (make_dirs(log_dir, derr, sizeof derr) != 0) {
        fprintf(stderr, "tandem-train launch: --log-dir: %s\n", derr);
        return 1;
    }
    char keys_dir[PATH_MAX] = "";
    int keys_rc = resolve_control_keys(control_keys_arg, control_insecure, servers, nnodes, log_dir, keys_dir,
                                       sizeof keys_dir);
    if (keys_rc != 0) return keys_rc;
    char server_key_path[PATH_MAX + 32], authorized_path[PATH_MAX + 32], server_pub_path[PATH_MAX + 32],
        client_key_path[PATH_MAX + 32];
    snprintf(server_key_path, sizeof server_key_path, "%s/%s", keys_dir, CONTROL_KEYS_SERVER_KEY);
    snprintf(authorized_path, sizeof authorized_path, "%s/%s", keys_dir, CONTROL_KEYS_AUTHORIZED);
    snprintf(server_pub_path, sizeof server_pub_path, "%s/%s", keys_dir, CONTROL_KEYS_SERVER_PUB);
    snprintf(client_key_path, sizeof client_key_path, "%s/%s", keys_dir, CONTROL_KEYS_CLIENT_KEY);
    char dir[PATH_MAX], serve_bin[PATH_MAX + 16], train_bin[PATH_MAX + 16];
    exe_dir(dir, sizeof dir);
    snprintf(serve_bin, sizeof serve_bin, "%s/tandem-serve", dir);
    snprintf(train_bin, sizeof train_bin, "%s/tandem-train", dir);
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    if (nnodes > 1)
        fprintf(stderr, "tandem-train launch: node %d of %d: ranks %d..%d of WORLD_SIZE %d, MASTER_ADDR %s:%d "
                "(rendezvous port from %s)\n", node_rank, nnodes, first_rank, first_rank + ranks - 1, world,
                master_addr, rdzv_port, rdzv_source);
    if (world > 1 && wait_resolvable(master_addr, dns_timeout) != 0) return interrupted ? 130 : 1;
    char thread_bufs[N_THREAD_VARS][48], *thread_env[N_THREAD_VARS + 1];
    thread_share_env(ranks + (node_rank == 0 ? servers * o.server_tp : 0), thread_bufs, thread_env);

    // Servers live on node 0. One node: loopback only, as before. Several: every interface of node 0, and the
    // other nodes' ranks reach them at MASTER_ADDR (an IPv6 literal in brackets, as ZeroMQ spells it).
    int v6 = strchr(master_addr, ':') != NULL;
    char endpoints[64 * 300] = "";
    for (int s = 0; s < servers; s++) {
        char ep[300];
        if (node_rank == 0) snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", control_port + s);
        else snprintf(ep, sizeof ep, "tcp://%s%s%s:%d", v6 ? "[" : "", master_addr, v6 ? "]" : "", control_port + s);
        snprintf(endpoints + strlen(endpoints), sizeof endpoints - strlen(endpoints), "%s%s", s ? "," : "", ep);
        if (node_rank != 0) continue;
        char ctl[64], *args[MAX_ARGS];
        // An IPv6 MASTER_ADDR: the other nodes connect over IPv6, which 0.0.0.0 (IPv4 only) would not accept.
        snprintf(ctl, sizeof ctl, "tcp://%s:%d", nnodes == 1 ? "127.0.0.1" : v6 ? "[::]" : "0.0.0.0",
                 control_port + s);
        int k = 0;
        args[k++] = serve_bin;
        args[k++] = "--model", args[k++] = (char *)model;
        args[k++] = "--control", args[k++] = ctl;   // spawn() forks before this loop reuses it
        args[k++] = "--port", args[k++] = "0";
        char dev[64], tp[16];
        if (server_device_of(server_device, s, ranks, servers, o.server_tp, dev, sizeof dev) != 0) {
            fprintf(stderr, "tandem-train launch: --server-device cuda with --servers %d --server-tp %d needs %d GPUs "
                            "after the %d trainer ranks' on this node, which has %d: lower --server-tp or --ranks, or "
                            "name the servers' first GPUs in --server-device\n", servers, o.server_tp,
                    servers * o.server_tp, ranks, ops_cuda_device_count());
            stop_all(30);
            return 1;
        }
        args[k++] = "--device", args[k++] = dev;
        snprintf(tp, sizeof tp, "%d", o.server_tp);
        if (o.server_tp > 1) args[k++] = "--tensor-parallel-size", args[k++] = tp;
        if (keys_dir[0]) {
            args[k++] = "--control-key-file", args[k++] = server_key_path;
            args[k++] = "--control-authorized-keys", args[k++] = authorized_path;
        } else if (nnodes > 1) {
            args[k++] = "--control-insecure";
        }
        for (int j = 0; j < n_server_args; j++) args[k++] = (char *)server_args[j];
        args[k] = NULL;
        Child *c = &children[n_children++];
        *c = (Child){.is_server = 1, .index = s};
        snprintf(c->log, sizeof c->log, "%s/server%d.log", log_dir, s);
        c->pid = spawn(args, thread_env, c->log);
        fprintf(stderr, "tandem-train launch: rollout server %d (pid %d) on %s, device %s, log %s\n", s, (int)c->pid,
                ctl, dev, c->log);
    }
    for (int lr = 0; lr < ranks; lr++) {
        int r = first_rank + lr;
        enum { N_CONTRACT = 11, N_PET = 5 };
        char *args[MAX_ARGS], *env[N_CONTRACT + N_PET + N_THREAD_VARS + 1], buf[N_CONTRACT + N_PET][320];
        int k = 0;
        args[k++] = train_bin;
        args[k++] = "--model", args[k++] = (char *)model;
        if (servers > 0) args[k++] = "--rollout-servers", args[k++] = endpoints;
        // Before the user's options, so that keys given after "--" win (their flags come later).
        if (keys_dir[0]) {
            args[k++] = "--control-server-key", args[k++] = server_pub_path;
            args[k++] = "--control-client-key", args[k++] = client_key_path;
        }
        for (int j = train_start; j < argc && k < MAX_ARGS - 1; j++) args[k++] = argv[j];
        args[k] = NULL;
        snprintf(buf[0], sizeof buf[0], "RANK=%d", r);
        snprintf(buf[1], sizeof buf[1], "WORLD_SIZE=%d", world);
        snprintf(buf[2], sizeof buf[2], "LOCAL_RANK=%d", lr);
        snprintf(buf[3], sizeof buf[3], "MASTER_ADDR=%s", master_addr);
        snprintf(buf[4], sizeof buf[4], "MASTER_PORT=%d", master_port);
        snprintf(buf[5], sizeof buf[5], "NCCL_NVLS_ENABLE=0");
        // The node, under both names (ours and torchrun's), so that neither an inherited value contradicts it.
        snprintf(buf[6], sizeof buf[6], "LOCAL_WORLD_SIZE=%d", ranks);
        snprintf(buf[7], sizeof buf[7], "NNODES=%d", nnodes);
        snprintf(buf[8], sizeof buf[8], "GROUP_WORLD_SIZE=%d", nnodes);
        snprintf(buf[9], sizeof buf[9], "NODE_RANK=%d", node_rank);
        snprintf(buf[10], sizeof buf[10], "GROUP_RANK=%d", node_rank);
        int n_env = 0;
        for (int j = 0; j < N_CONTRACT; j++) env[n_env++] = buf[j];
        // A pod's PET_* variables (PyTorchJob) are further names of these (comm.h): each set one is given the value
        // chosen here, so that a flag that won over it does not leave the ranks a contradiction.
        const char *pet_name[N_PET] = {"PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR",
                                       "PET_MASTER_PORT"};
        for (int j = 0; j < N_PET; j++) {
            if (!getenv(pet_name[j])) continue;
            char *b = buf[N_CONTRACT + j];
            if (j == 0) snprintf(b, sizeof buf[0], "%s=%d", pet_name[j], nnodes);
            if (j == 1) snprintf(b, sizeof buf[0], "%s=%d", pet_name[j], node_rank);
            if (j == 2) snprintf(b, sizeof buf[0], "%s=%d", pet_name[j], ranks);
            if (j == 3) snprintf(b, sizeof buf[0], "%s=%s", pet_name[j], master_addr);
            if (j == 4) snprintf(b, sizeof buf[0], "%s=%d", pet_name[j], master_port);
            env[n_env++] = b;
        }
        for (int j = 0; thread_env[j]; j++) env[n_env++] = thread_env[j];
        env[n_env] = NULL;
        Child *c = &children[n_children++];
        *c = (Child){.is_server = 0, .index = r};
        if (lr > 0) snprintf(c->log, sizeof c->log, "%s/rank%d.log", log_dir, r);
        c->pid = spawn(args, env, c->log);
        if (lr > 0) fprintf(stderr, "tandem-train launch: rank %d (pid %d), log %s\n", r, (int)c->pid, c->log);
        else if (nnodes > 1) fprintf(stderr, "tandem-train launch: rank %d (pid %d) streams here\n", r, (int)c->pid);
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
    if (rc == 0 && nnodes == 1) fprintf(stderr, "tandem-train launch: every rank finished; servers stopped\n");
    else if (rc == 0)
        fprintf(stderr, "tandem-train launch: every rank of node %d finished%s\n", node_rank,
                node_rank == 0 && servers > 0 ? "; servers stopped" : "");
    return rc;
}
