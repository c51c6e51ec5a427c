// tests/unit/zero3_testlib.h — the ZeRO equivalence harness shared by test_trainer_zero3.c (host backend, CPU,
// fp32) and test_trainer_zero3_cuda.c (NCCL backend, one GPU per rank, bf16).
//
// run_world forks N rank processes on 127.0.0.1 (the parent must not have run a kernel or touched CUDA: neither
// OpenMP's thread pool nor a CUDA context survives fork()). Each rank trains the case's random model for
// Z3_STEPS AdamW steps with clipping; the global batch of n_seq sequences is split across ranks and every rank's
// dL/dlogprob is -1/(global scored tokens), so the sum over ranks is the full batch's mean cross-entropy.
// Rank 0 writes the losses (summed over ranks with an all-reduce) and the final weights (gathered) to a file.
#ifndef TANDEM_TESTS_ZERO3_TESTLIB_H
#define TANDEM_TESTS_ZERO3_TESTLIB_H

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/ops.h"
#include "shared/comm/comm.h"
#include "shared/model.h"
#include "trainer/zero3.h"

#define Z3_STEPS 5

typedef struct {
    const char *config;           // config.json text of the model
    int vocab, n_seq;             // the global batch: n_seq sequences of tokens below vocab
    int base_len, len_spread;     // sequence s has base_len + (s * 5) % len_spread tokens
    OpsBackend ops;
    CommBackend comm;
    AdamWParams hp;
    float init_std;               // std of the random initial weights
    int nodes;                    // the ranks stand for this many nodes (LOCAL_WORLD_SIZE = world / nodes); 0: one
    int hybrid;                   // HSDP: state partitioned within each node, replicated across nodes
    int hpz;                      // hpZ (stage 3): parameters partitioned within each node, the rest over all ranks
    int serialised;               // overlap_comm false: collectives serialised with compute (zero3_set_overlap)
} Z3Case;

static int z3_seq_len(const Z3Case *c, int s) { return c->base_len + (s * 5) % c->len_spread; }
static int32_t z3_tok(const Z3Case *c, int s, int i) { return (int32_t)((s * 17 + i * 7 + 3) % c->vocab); }

static int z3_global_scored(const Z3Case *c) {
    int n = 0;
    for (int s = 0; s < c->n_seq; s++) n += z3_seq_len(c, s) - 1;
    return n;
}

static int z3_tokens(const Z3Case *c, int s0, int s1) {
    int n = 0;
    for (int s = s0; s < s1; s++) n += z3_seq_len(c, s);
    return n;
}

// Packs sequences [s0, s1) into a batch with next-token targets (arrays sized by z3_tokens / n_seq + 1).
static Batch z3_make_batch(const Z3Case *c, int s0, int s1, int32_t *tok, int32_t *tgt, int32_t *cu, float *dlp) {
    int n = 0, b = 0;
    cu[0] = 0;
    for (int s = s0; s < s1; s++) {
        for (int i = 0; i < z3_seq_len(c, s); i++, n++) {
            tok[n] = z3_tok(c, s, i);
            tgt[n] = i + 1 < z3_seq_len(c, s) ? z3_tok(c, s, i + 1) : -1;
            dlp[n] = tgt[n] >= 0 ? -1.0f / (float)z3_global_scored(c) : 0.0f;
        }
        cu[++b] = n;
    }
    return (Batch){.n_seqs = s1 - s0, .n_tokens = n, .tokens = tok, .targets = tgt, .cu_seqlens = cu};
}

static double z3_local_loss(const Z3Case *c, const Batch *b, const float *lp) {
    double l = 0;
    for (int i = 0; i < b->n_tokens; i++)
        if (b->targets[i] >= 0) l -= lp[i];
    return l / z3_global_scored(c);
}

#define Z3_FAIL(...) do { fprintf(stderr, "rank %d: ", rank); fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); _exit(1); } while (0)

// One rank: writes the losses then every parameter (rank 0 only) to out_path; with mem_path, every rank
// appends "rank bytes_model_state bytes_gathered bytes_grad_work params" (zero3_memory).
static void z3_run_rank(const Z3Case *c, int rank, int world, int port, int stage, const char *out_path) {
    char err[1024], buf[32];
    setenv("RANK", (snprintf(buf, sizeof buf, "%d", rank), buf), 1);
    setenv("WORLD_SIZE", (snprintf(buf, sizeof buf, "%d", world), buf), 1);
    const int per_node = world / (c->nodes > 1 ? c->nodes : 1);
    setenv("LOCAL_RANK", (snprintf(buf, sizeof buf, "%d", rank % per_node), buf), 1);
    setenv("LOCAL_WORLD_SIZE", (snprintf(buf, sizeof buf, "%d", per_node), buf), 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", (snprintf(buf, sizeof buf, "%d", port), buf), 1);
    CommInit ci;
    Comm *comm, *intra = NULL, *inter = NULL;
    OpsCtx *ops;
    ModelConfig cfg;
    Model m;
    Zero3 *z;
    if (comm_init_from_env(&ci, 60000, err, sizeof err) != 0 ||
        ops_create(&ops, c->ops, ci.local_rank, err, sizeof err) != 0 ||
        comm_create(&comm, c->comm, &ci, ops, err, sizeof err) != 0 ||
        ((c->hybrid || c->hpz) && comm_split_nodes(comm, &intra, &inter, err, sizeof err) != 0))
        Z3_FAIL("%s", err);
    if (config_parse(&cfg, c->config, strlen(c->config), err, sizeof err) != 0 ||
        model_init(&m, &cfg, ops, err, sizeof err) != 0 ||
        (c->hpz ? zero3_create_hpz(&z, &m, comm, intra, inter, err, sizeof err)
                : zero3_create_sharded(&z, &m, c->hybrid ? intra : comm, inter, stage, err, sizeof err)) != 0 ||
        zero3_init_random(z, 99, c->init_std, err, sizeof err) != 0)
        Z3_FAIL("%s", err);
    zero3_set_overlap(z, !c->serialised);
    int per = c->n_seq / world, s0 = rank * per, s1 = s0 + per;
    int nt = z3_tokens(c, s0, s1);
    int32_t *tok = malloc(nt * 4), *tgt = malloc(nt * 4), *cu = malloc((c->n_seq + 1) * 4);
    float *lp = malloc(nt * 4), *dlp = malloc(nt * 4);
    Batch b = z3_make_batch(c, s0, s1, tok, tgt, cu, dlp);
    TrainActs *acts;
    if (train_acts_create(&acts, &m, b.n_tokens, b.n_seqs, stage == 3, err, sizeof err) != 0) Z3_FAIL("%s", err);
    UnitSource src = zero3_source(z);
    double losses[Z3_STEPS], norms[Z3_STEPS];
    for (int step = 1; step <= Z3_STEPS; step++) {
        if (model_forward(&m, acts, &src, &b, 1.0f, lp, NULL, NULL, err, sizeof err) != 0 ||
            model_backward(&m, acts, &src, dlp, err, sizeof err) != 0)
            Z3_FAIL("step %d: %s", step, err);
        double l = z3_local_loss(c, &b, lp);
        double *dl = c->comm == COMM_BACKEND_HOST ? &l : ops_malloc(ops, sizeof l);
        if (dl != &l) ops_copy_to_device(ops, dl, &l, sizeof l);
        comm_wait_compute(comm);
        if (comm_all_reduce(comm, dl, 1, COMM_F64, COMM_SUM) != 0 || comm_synchronize(comm) != 0)
            Z3_FAIL("%s", comm_error(comm));
        if (dl != &l) {
            ops_copy_to_host(ops, &l, dl, sizeof l);
            ops_free(ops, dl);
        }
        losses[step - 1] = l;
        float norm;
        if (zero3_step(z, &c->hp, c->hp.lr, step, &norm, err, sizeof err) != 0) Z3_FAIL("%s", err);
        norms[step - 1] = norm;
    }
    FILE *f = rank == 0 ? fopen(out_path, "w") : NULL;
    if (rank == 0 && !f) Z3_FAIL("cannot write %s", out_path);
    if (f) {
        Zero3Memory mem;
        zero3_memory(z, &mem);
        // Model state this rank keeps for the whole run, and the transient full units.
        CommBytes bytes;
        zero3_comm_bytes(z, &bytes);
        fprintf(f, "%zu\n%zu\n%zu\n%zu\n%llu\n%llu\n",
                mem.param_shard_bytes + mem.master_bytes + mem.adam_bytes + mem.grad_bytes, mem.gathered_bytes,
                mem.grad_work_bytes, m.layout.n_params, (unsigned long long)bytes.intra_node,
                (unsigned long long)bytes.inter_node);
        for (int i = 0; i < Z3_STEPS; i++) fprintf(f, "%.9g\n", losses[i]);
        for (int i = 0; i < Z3_STEPS; i++) fprintf(f, "%.9g\n", norms[i]);
    }
    for (int u = 0; u < m.layout.n_units; u++) {
        size_t padded = zero3_shard_count(z, u) * world;
        float *host = malloc(padded * 4);
        if (zero3_gather_unit_f32(z, u, host, err, sizeof err) != 0) Z3_FAIL("%s", err);
        if (f)
            for (size_t i = 0; i < m.layout.unit_numel[u]; i++) fprintf(f, "%.9g\n", host[i]);
        free(host);
    }
    if (f) fclose(f);
    if (comm_barrier(comm) != 0 || comm_synchronize(comm) != 0) Z3_FAIL("%s", comm_error(comm));
    train_acts_free(acts, &m);
    zero3_destroy(z);
    comm_destroy(intra);
    comm_destroy(inter);
    comm_destroy(comm);
    _exit(0);
}

// A rendezvous port the kernel just handed out on 127.0.0.1 (free now). A port picked from a formula could fall in the
// ephemeral range, where the ranks' own data sockets of an earlier run may still hold it.
static int z3_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        perror("z3_free_port");
        exit(2);
    }
    close(fd);
    return ntohs(a.sin_port);
}

// Values rank 0 wrote: Z3_HEAD figures (model state bytes, gathered bytes, gradient work bytes, parameters, ZeRO
// bytes sent inside the node, across nodes), Z3_STEPS losses, Z3_STEPS gradient norms (before clipping), then
// every parameter (Z3_PARAMS onwards).
typedef struct {
    double *v;
    size_t n;
} Z3Result;
#define Z3_HEAD 6
#define Z3_NORMS (Z3_HEAD + Z3_STEPS)
#define Z3_PARAMS (Z3_HEAD + 2 * Z3_STEPS)

// Runs N ranks; returns 0 and rank 0's values, or -1.
static int z3_run_world(const Z3Case *c, int world, int stage, Z3Result *out) {
    char path[256];
    snprintf(path, sizeof path, "/tmp/tandem_zero3_%d_%d_%d_%d_%d_%d.txt", (int)getpid(), world, stage, c->nodes,
             c->hybrid, c->hpz);
    int port = z3_free_port();
    pid_t pids[8];
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        if (pids[r] == 0) z3_run_rank(c, r, world, port, stage, path);
    }
    int ok = 1;
    for (int r = 0; r < world; r++) {
        int st;
        waitpid(pids[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ok = 0;
    }
    if (!ok) {
        fprintf(stderr, "world %d stage %d: a rank failed\n", world, stage);
        remove(path);
        return -1;
    }
    FILE *f = fopen(path, "r");
    size_t cap = 1 << 16, cnt = 0;
    double *v = malloc(cap * sizeof *v);
    while (f && fscanf(f, "%lf", &v[cnt]) == 1) {
        if (++cnt == cap) v = realloc(v, (cap *= 2) * sizeof *v);
    }
    if (f) fclose(f);
    remove(path);
    out->v = v;
    out->n = cnt;
    return cnt > Z3_PARAMS ? 0 : -1;
}

// Worst relative difference of `many` against `one` over values [from, to): each relative to itself
// (losses, norms), or to the largest |value| of the range (weights: relative_to_max).
static inline double z3_worst_in(const Z3Result *one, const Z3Result *many, size_t from, size_t to, int relative_to_max) {
    double worst = 0, scale = 0;
    for (size_t i = from; i < to; i++) scale = fmax(scale, fabs(one->v[i]));
    for (size_t i = from; i < to; i++) {
        double ref = relative_to_max ? scale : fabs(one->v[i]);
        worst = fmax(worst, fabs(many->v[i] - one->v[i]) / (ref > 0 ? ref : 1));
    }
    return worst;
}

// Worst over losses, norms and weights.
static inline double z3_worst(const Z3Result *one, const Z3Result *many) {
    return fmax(z3_worst_in(one, many, Z3_HEAD, Z3_PARAMS, 0), z3_worst_in(one, many, Z3_PARAMS, one->n, 1));
}

#endif
