// tests/unit/test_comm_nodes.c — nodes and sub-communicators of shared/comm/comm.h on the host backend: real
// processes (fork) on 127.0.0.1, standing for 2 nodes x 2 ranks.
//
// Proves: the node part of the launch contract from the environment (torchrun's, tandem-train launch's and
// Kubeflow PyTorchJob's PET_* names; the rendezvous port under torchrun and TANDEM_RENDEZVOUS_PORT;
// defaults, each contradiction an error naming the variables); the rendezvous's node map line and its refusal of a
// rank whose layout differs from rank 0's; comm_split_nodes: inside the intra-node and the inter-node
// communicators all_reduce / all_gather / reduce_scatter give the sums and concatenations of exactly their members
// (never the other node's ranks); comm_split orders by key and leaves out color -1; the byte counters split by
// node as comm.h says (the intra-node communicator sends nothing across, the inter-node one nothing inside, the
// flat one both in the proportion of its peers).
#include <string.h>
#include <sys/mman.h>

#include "shared/comm/comm.h"

#include "spawn_testlib.h"

#define N 1001   // elements per rank (odd: uneven all_reduce chunks)

static int join(Comm **c, int rank, int port, RdzvProgressFn progress, void *arg, char *err, size_t len) {
    CommInit ci = {.rank = rank, .world_size = 4, .local_rank = rank % 2, .node = rank / 2, .nnodes = 2,
                   .local_world_size = 2, .master_port = port, .timeout_ms = 10000, .progress = progress,
                   .progress_arg = arg};
    snprintf(ci.master_addr, sizeof ci.master_addr, "127.0.0.1");
    return comm_create(c, COMM_BACKEND_HOST, &ci, NULL, err, len);
}

// Element i of parent rank r: small integers, so float sums are exact whatever the order.
static float val(int r, size_t i) { return (float)((int)(i % 97) + 1000 * (r + 1)); }

static void save_line(void *arg, const char *line) {
    if (strstr(line, "node map")) snprintf(arg, 512, "%s", line);
}

// The collectives of sub-communicator s, whose member m is parent rank members[m].
static void check_group(Comm *s, const int *members, int me, const char *what) {
    int w = comm_world_size(s), r = comm_rank(s);
    CHECK(w == 2 && members[r] == me, "%s: world %d, rank %d of parent rank %d", what, w, r, me);
    float *buf = malloc(N * 2 * sizeof(float)), *out = malloc(N * 2 * sizeof(float));
    for (size_t i = 0; i < N; i++) buf[i] = val(me, i);
    CHECK(comm_all_reduce(s, buf, N, COMM_F32, COMM_SUM) == 0, "%s all_reduce: %s", what, comm_error(s));
    int bad = 0;
    for (size_t i = 0; i < N; i++) bad += buf[i] != val(members[0], i) + val(members[1], i);
    CHECK(bad == 0, "%s: all_reduce sums %d elements wrong (another node's rank in it?)", what, bad);
    for (size_t i = 0; i < N; i++) buf[i] = val(me, i);
    CHECK(comm_all_gather(s, out, buf, N, COMM_F32) == 0, "%s all_gather: %s", what, comm_error(s));
    bad = 0;
    for (int m = 0; m < 2; m++)
        for (size_t i = 0; i < N; i++) bad += out[m * N + i] != val(members[m], i);
    CHECK(bad == 0, "%s: all_gather has %d elements wrong", what, bad);
    for (size_t i = 0; i < 2 * N; i++) buf[i] = val(me, i);
    CHECK(comm_reduce_scatter(s, out, buf, N, COMM_F32, COMM_SUM) == 0, "%s reduce_scatter: %s", what, comm_error(s));
    bad = 0;
    for (size_t i = 0; i < N; i++) bad += out[i] != val(members[0], r * N + i) + val(members[1], r * N + i);
    CHECK(bad == 0, "%s: reduce_scatter has %d elements wrong", what, bad);
    free(buf);
    free(out);
}

static int nodes_child(int idx, int port, void *arg) {
    (void)arg;
    char err[1024] = "", map[512] = "";
    Comm *c = NULL, *intra = NULL, *inter = NULL, *odd = NULL;
    if (join(&c, idx, port, save_line, map, err, sizeof err) != 0) {
        fprintf(stderr, "rank %d: %s\n", idx, err);
        return 1;
    }
    CHECK(comm_node_count(c) == 2 && comm_node(c, 0) == 0 && comm_node(c, 1) == 0 && comm_node(c, 2) == 1 &&
          comm_node(c, 3) == 1 && comm_node(c, 4) == -1);
    if (idx == 0) {
        char host[256] = "", want[700];
        gethostname(host, sizeof host);
        snprintf(want, sizeof want, "node 0 (host %s): ranks 0-1; node 1 (host %s): ranks 2-3", host, host);
        CHECK(strstr(map, want) != NULL, "node map line '%s' lacks '%s'", map, want);
    } else {
        CHECK(map[0] == '\0', "rank %d said the node map: %s", idx, map);
    }
    REQUIRE(comm_split_nodes(c, &intra, &inter, err, sizeof err) == 0, "rank %d: %s", idx, err);
    CommBytes b0, b1;
    comm_bytes(intra, &b0);
    int node = idx / 2, local = idx % 2;
    const int intra_members[2] = {2 * node, 2 * node + 1}, inter_members[2] = {local, 2 + local};
    check_group(intra, intra_members, idx, "intra-node");
    check_group(inter, inter_members, idx, "inter-node");
    CHECK(comm_node_count(intra) == 1 && comm_node_count(inter) == 2 && comm_node(inter, 1) == 1);
    // Per group: all_reduce 2 x ceil(N / 2) + all_gather N + reduce_scatter N floats to the one peer.
    const uint64_t per_group = (2 * ((N + 1) / 2) + N + N) * 4;
    comm_bytes(intra, &b1);
    CHECK(b1.intra_node - b0.intra_node == per_group && b1.inter_node == 0, "intra bytes %llu / %llu",
          (unsigned long long)b1.intra_node, (unsigned long long)b1.inter_node);
    comm_bytes(inter, &b1);
    CHECK(b1.inter_node == per_group && b1.intra_node == 0, "inter bytes %llu / %llu",
          (unsigned long long)b1.intra_node, (unsigned long long)b1.inter_node);
    // The flat all_gather sends its block to 1 peer on this node and 2 on the other.
    float *blk = calloc(4 * N, sizeof(float));
    comm_bytes(c, &b0);
    CHECK(comm_all_gather(c, blk, blk + idx * N, N, COMM_F32) == 0);
    comm_bytes(c, &b1);
    CHECK(b1.intra_node - b0.intra_node == N * 4 && b1.inter_node - b0.inter_node == 2 * N * 4);
    free(blk);
    // comm_split: ranks 0, 1, 3 by descending key (3 first); rank 2 joins none.
    REQUIRE(comm_split(&odd, c, idx == 2 ? -1 : 7, -idx, err, sizeof err) == 0, "rank %d: %s", idx, err);
    if (idx == 2) {
        CHECK(odd == NULL);
    } else {
        CHECK(comm_world_size(odd) == 3 && comm_rank(odd) == (idx == 3 ? 0 : idx == 1 ? 1 : 2));
        int32_t x = idx, sum = 0;
        int32_t got[3];
        CHECK(comm_all_gather(odd, got, &x, 1, COMM_I32) == 0 && got[0] == 3 && got[1] == 1 && got[2] == 0);
        sum = x;
        CHECK(comm_all_reduce(odd, &sum, 1, COMM_I32, COMM_SUM) == 0 && sum == 4);
        CHECK(comm_node_count(odd) == 2);
    }
    CHECK(comm_barrier(c) == 0);
    comm_destroy(odd);
    comm_destroy(intra);
    comm_destroy(inter);
    comm_destroy(c);
    return failures ? 1 : 0;
}

// Rank 1 of 2 says it is alone on node 1 of 2 nodes; rank 0 says one node holds both: rank 0 refuses it, naming it.
static int layout_child(int idx, int port, void *arg) {
    (void)arg;
    char err[1024] = "";
    CommInit ci = {.rank = idx, .world_size = 2, .node = idx, .nnodes = idx ? 2 : 1, .local_world_size = idx ? 1 : 2,
                   .master_port = port, .timeout_ms = 3000};
    snprintf(ci.master_addr, sizeof ci.master_addr, "127.0.0.1");
    if (idx == 0) ci.node = 0;
    Comm *c = NULL;
    int rc = comm_create(&c, COMM_BACKEND_HOST, &ci, NULL, err, sizeof err);
    CHECK(rc != 0 && c == NULL && strstr(err, "rank 1 ") && strstr(err, "NNODES 2") && strstr(err, "LOCAL_WORLD_SIZE 2"),
          "rank %d: rc %d: %s", idx, rc, err);
    return failures ? 1 : 0;
}

static const char *const VARS[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NNODES",
                                   "GROUP_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                                   "PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR",
                                   "PET_MASTER_PORT", "TORCHELASTIC_RUN_ID", "TANDEM_RENDEZVOUS_PORT"};
#define N_VARS (sizeof VARS / sizeof *VARS)

static void clear_env(void) {
    for (size_t i = 0; i < N_VARS; i++) unsetenv(VARS[i]);
}

// Sets "NAME=VALUE ..." pairs after clearing every variable of the contract.
static void set_env(const char *spec) {
    clear_env();
    char buf[512];
    snprintf(buf, sizeof buf, "%s", spec);
    for (char *save = NULL, *kv = strtok_r(buf, " ", &save); kv; kv = strtok_r(NULL, " ", &save)) {
        char *eq = strchr(kv, '=');
        *eq = '\0';
        setenv(kv, eq + 1, 1);
    }
}

static void expect_env(const char *spec, int node, int nnodes, int lws, int local_rank) {
    set_env(spec);
    CommInit ci;
    char err[512] = "";
    int rc = comm_init_from_env(&ci, 1000, err, sizeof err);
    CHECK(rc == 0 && ci.node == node && ci.nnodes == nnodes && ci.local_world_size == lws && ci.local_rank == local_rank,
          "'%s': rc %d (%s), node %d of %d x %d, local rank %d; want node %d of %d x %d, local rank %d", spec, rc, err,
          ci.node, ci.nnodes, ci.local_world_size, ci.local_rank, node, nnodes, lws, local_rank);
}

static void expect_env_error(const char *spec, const char *needle1, const char *needle2) {
    set_env(spec);
    CommInit ci;
    char err[512] = "";
    int rc = comm_init_from_env(&ci, 1000, err, sizeof err);
    CHECK(rc == COMM_ERR_INVALID && strstr(err, needle1) && strstr(err, needle2), "'%s': rc %d: '%s' (want '%s', '%s')",
          spec, rc, err, needle1, needle2);
}

static void test_env(void) {
    expect_env("", 0, 1, 1, 0);
    expect_env("RANK=3 WORLD_SIZE=4", 0, 1, 4, 3);   // no node variables: one node (LOCAL_RANK then = RANK)
    expect_env("RANK=3 WORLD_SIZE=4 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2", 1, 2, 2, 1);
    expect_env("RANK=2 WORLD_SIZE=4 NNODES=2", 1, 2, 2, 0);                                 // tandem-train launch
    expect_env("RANK=5 WORLD_SIZE=8 LOCAL_RANK=1 LOCAL_WORLD_SIZE=4 GROUP_RANK=1", 1, 2, 4, 1);   // torchrun
    expect_env("RANK=5 WORLD_SIZE=8 LOCAL_WORLD_SIZE=4 NODE_RANK=1 GROUP_RANK=1 GROUP_WORLD_SIZE=2 NNODES=2", 1, 2, 4,
               1);
    expect_env_error("RANK=0 WORLD_SIZE=4 NNODES=2 GROUP_WORLD_SIZE=4", "NNODES=2", "GROUP_WORLD_SIZE=4");
    expect_env_error("RANK=0 WORLD_SIZE=4 NODE_RANK=0 GROUP_RANK=1", "NODE_RANK=0", "GROUP_RANK=1");
    expect_env_error("RANK=0 WORLD_SIZE=4 NNODES=2 LOCAL_WORLD_SIZE=4", "WORLD_SIZE 4", "NNODES=2 x LOCAL_WORLD_SIZE=4");
    expect_env_error("RANK=0 WORLD_SIZE=5 LOCAL_WORLD_SIZE=2", "WORLD_SIZE 5", "LOCAL_WORLD_SIZE=2");
    expect_env_error("RANK=0 WORLD_SIZE=6 NNODES=4", "WORLD_SIZE 6", "NNODES=4");
    expect_env_error("RANK=3 WORLD_SIZE=4 LOCAL_RANK=2 LOCAL_WORLD_SIZE=2", "LOCAL_RANK 2", "LOCAL_WORLD_SIZE 2");
    expect_env_error("RANK=1 WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 NODE_RANK=2", "NODE_RANK=2", "2 nodes");
    expect_env_error("RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 GROUP_RANK=1", "RANK 1",
                     "GROUP_RANK=1 x LOCAL_WORLD_SIZE=2 + LOCAL_RANK=1");
    clear_env();
}

// The rendezvous port and address each launcher's variables lead to.
static void expect_master(const char *spec, const char *addr, int port, const char *source) {
    set_env(spec);
    CommInit ci;
    char err[512] = "";
    int rc = comm_init_from_env(&ci, 1000, err, sizeof err);
    CHECK(rc == 0 && strcmp(ci.master_addr, addr) == 0 && ci.master_port == port && strstr(ci.port_source, source),
          "'%s': rc %d (%s): %s:%d from '%s'; want %s:%d from '%s'", spec, rc, err, ci.master_addr, ci.master_port,
          ci.port_source, addr, port, source);
}

// Kubeflow PyTorchJob / JobSet (PET_*) and torchrun: which run a rank joins, and the contradictions between them.
static void test_launcher_conventions(void) {
    // A pod of one rank started directly: RANK is the pod's index, PET_* the node.
    expect_env("RANK=1 WORLD_SIZE=2 PET_NNODES=2 PET_NODE_RANK=1 PET_NPROC_PER_NODE=1 MASTER_ADDR=job-master-0 "
               "MASTER_PORT=23456 PET_MASTER_ADDR=job-master-0 PET_MASTER_PORT=23456", 1, 2, 1, 0);
    // A rank that tandem-train launch started in a pod of 2 (it gives the PET_* the values it chose).
    expect_env("RANK=3 WORLD_SIZE=4 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 NNODES=2 NODE_RANK=1 PET_NNODES=2 PET_NODE_RANK=1 "
               "PET_NPROC_PER_NODE=2", 1, 2, 2, 1);
    // PET_* alone give the node; torchrun's argument syntax ("auto", "1:4") is not a count and is not read.
    expect_env("RANK=3 WORLD_SIZE=4 LOCAL_RANK=1 PET_NNODES=2 PET_NODE_RANK=1", 1, 2, 2, 1);
    expect_env("RANK=3 WORLD_SIZE=4 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 PET_NNODES=1:4 PET_NPROC_PER_NODE=auto", 1, 2, 2, 1);
    // Under torchrun its variables win: its c10d rendezvous numbers nodes by arrival, not by PET_NODE_RANK.
    expect_env("RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 GROUP_WORLD_SIZE=2 PET_NODE_RANK=1 "
               "PET_NNODES=2 TORCHELASTIC_RUN_ID=x", 0, 2, 2, 1);
    expect_env_error("RANK=0 WORLD_SIZE=4 LOCAL_RANK=0 NNODES=2 PET_NNODES=4", "NNODES=2", "PET_NNODES=4");
    expect_env_error("RANK=2 WORLD_SIZE=4 LOCAL_RANK=0 GROUP_RANK=1 PET_NODE_RANK=0", "GROUP_RANK=1", "PET_NODE_RANK=0");
    expect_env_error("RANK=0 WORLD_SIZE=4 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 PET_NPROC_PER_NODE=4", "LOCAL_WORLD_SIZE=2",
                     "PET_NPROC_PER_NODE=4");
    expect_env_error("RANK=0 WORLD_SIZE=6 LOCAL_RANK=0 PET_NNODES=2 PET_NPROC_PER_NODE=2", "WORLD_SIZE 6",
                     "PET_NNODES=2 x PET_NPROC_PER_NODE=2");
    expect_env_error("RANK=4 WORLD_SIZE=4 PET_NNODES=2 PET_NPROC_PER_NODE=2", "RANK 4", "WORLD_SIZE 4");
    expect_env_error("RANK=1 WORLD_SIZE=4 PET_NNODES=2 PET_NODE_RANK=1 PET_NPROC_PER_NODE=2",
                     "PET_NPROC_PER_NODE=2 asks for 2 ranks in this pod", "RANK=1 is the pod's index");
    expect_env_error("RANK=0 MASTER_ADDR=a PET_MASTER_ADDR=b", "MASTER_ADDR='a'", "PET_MASTER_ADDR='b'");
    expect_env_error("RANK=0 MASTER_PORT=1234 PET_MASTER_PORT=1235", "MASTER_PORT=1234", "PET_MASTER_PORT=1235");
    expect_env_error("TORCHELASTIC_RUN_ID=x MASTER_PORT=65535", "MASTER_PORT=65535", "TANDEM_RENDEZVOUS_PORT");
    expect_env_error("TANDEM_RENDEZVOUS_PORT=0", "TANDEM_RENDEZVOUS_PORT=0", "1..65535");
    // The rendezvous port: MASTER_PORT, + 1 under torchrun (its agent's TCPStore holds MASTER_PORT), or
    // TANDEM_RENDEZVOUS_PORT; PET_MASTER_* when only they are set.
    expect_master("", "127.0.0.1", 29500, "MASTER_PORT");
    expect_master("MASTER_ADDR=h MASTER_PORT=4000", "h", 4000, "MASTER_PORT");
    expect_master("PET_MASTER_ADDR=p PET_MASTER_PORT=4100", "p", 4100, "PET_MASTER_PORT");
    expect_master("MASTER_PORT=4000 TORCHELASTIC_RUN_ID=x", "127.0.0.1", 4001, "MASTER_PORT+1");
    expect_master("MASTER_PORT=4000 TORCHELASTIC_RUN_ID=x PET_MASTER_PORT=23456", "127.0.0.1", 4001, "MASTER_PORT+1");
    expect_master("MASTER_PORT=4000 TORCHELASTIC_RUN_ID=x TANDEM_RENDEZVOUS_PORT=4444", "127.0.0.1", 4444,
                  "TANDEM_RENDEZVOUS_PORT");
    expect_master("MASTER_PORT=4000 TANDEM_RENDEZVOUS_PORT=4444", "127.0.0.1", 4444, "TANDEM_RENDEZVOUS_PORT");
    clear_env();
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    test_env();
    printf("launch contract: nodes from the environment: %s\n", failures ? "FAIL" : "ok");
    int f_env = failures;
    test_launcher_conventions();
    printf("launch contract: torchrun and PyTorchJob (PET_*) variables, rendezvous port: %s\n",
           failures > f_env ? "FAIL" : "ok");
    int codes[4], f0 = failures;
    int64_t t0 = now_ms();
    spawn(4, nodes_child, NULL, 60000, -1, codes);
    for (int i = 0; i < 4; i++) failures += codes[i] != 0;
    printf("2 nodes x 2 ranks: node map, intra / inter-node collectives, split, byte counters: %s (%lld ms)\n",
           failures > f0 ? "FAIL" : "ok", (long long)(now_ms() - t0));
    f0 = failures;
    spawn(2, layout_child, NULL, 20000, -1, codes);
    for (int i = 0; i < 2; i++) failures += codes[i] != 0;
    printf("rendezvous refuses a rank with another node layout: %s\n", failures > f0 ? "FAIL" : "ok");
    return check_exit_code("test_comm_nodes");
}
