// shared/comm/comm_env.c — the launch contract from the environment (comm.h: comm_init_from_env,
// comm_rendezvous_port_from_env). Three launchers set it: `tandem-train launch` and people by hand (RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, LOCAL_WORLD_SIZE, NNODES, NODE_RANK), torchrun (the same plus
// GROUP_RANK, GROUP_WORLD_SIZE and TORCHELASTIC_*; its agent holds a TCPStore on MASTER_PORT), and Kubeflow's
// PyTorchJob / JobSet, which gives each pod PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR,
// PET_MASTER_PORT (torchrun's arguments) beside RANK = the pod's index and WORLD_SIZE.
#include "shared/err.h"
#include "shared/comm/comm.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// torchrun sets TORCHELASTIC_RUN_ID for every worker it starts (torch/distributed/run.py, "Environment Variables").
static int under_torchrun(void) { return getenv("TORCHELASTIC_RUN_ID") != NULL; }

// Parses a decimal integer; 0 when it is one.
static int parse_int(const char *v, long *x) {
    char *end = NULL;
    errno = 0;
    *x = strtol(v, &end, 10);
    return *v && !errno && end != v && *end == '\0' ? 0 : -1;
}

// Reads an integer variable; absent -> def. Malformed or out of [lo, hi] -> error naming it.
static int env_int(const char *name, int def, int lo, int hi, int *out, int *present, char *err, size_t len) {
    const char *v = getenv(name);
    *present = v != NULL;
    if (!v) {
        *out = def;
        return 0;
    }
    long x;
    if (parse_int(v, &x))
        return err_fail_code(COMM_ERR_INVALID, err, len, "environment variable %s='%s' is not an integer", name, v);
    if (x < lo || x > hi) return err_fail_code(COMM_ERR_INVALID, err, len, "environment variable %s=%ld is outside %d..%d", name, x, lo, hi);
    *out = (int)x;
    return 0;
}

// One value under several names (ours, torchrun's, PyTorchJob's PET_*), NULL-terminated: two set and different is
// a contradiction naming both. A PET_ value that is not an integer is torchrun's argument syntax ("auto" ranks per
// node, "1:4" nodes for an elastic range), which only torchrun resolves: it is not a count, so it is not read.
// Under torchrun no PET_ name is read: they were its inputs, and its own variables say what it made of them (its
// c10d rendezvous numbers the nodes in the order they join, not by PET_NODE_RANK).
static int env_int_any(const char *const *names, int lo, int hi, int *out, const char **which, char *err,
                       size_t len) {
    *out = -1, *which = NULL;
    for (int i = 0; names[i]; i++) {
        int is_pet = strncmp(names[i], "PET_", 4) == 0;
        const char *v = getenv(names[i]);
        long x;
        if (!v || (is_pet && (under_torchrun() || parse_int(v, &x)))) continue;
        int val, present;
        if (env_int(names[i], -1, lo, hi, &val, &present, err, len)) return COMM_ERR_INVALID;
        if (*which && val != *out)
            return err_fail_code(COMM_ERR_INVALID, err, len, "environment variables %s=%d and %s=%d disagree", *which,
                                 *out, names[i], val);
        if (!*which) *out = val, *which = names[i];
    }
    return 0;
}

// A text variable under two names (ours, PyTorchJob's); both set and different is a contradiction.
static int env_text_either(const char *a, const char *pet, const char **out, const char **which, char *err,
                           size_t len) {
    const char *va = getenv(a), *vb = under_torchrun() ? NULL : getenv(pet);
    if (va && vb && strcmp(va, vb) != 0)
        return err_fail_code(COMM_ERR_INVALID, err, len, "environment variables %s='%s' and %s='%s' disagree", a, va,
                             pet, vb);
    *out = va ? va : vb;
    *which = va ? a : vb ? pet : NULL;
    return 0;
}

static const char *const NAMES_LWS[] = {"LOCAL_WORLD_SIZE", "PET_NPROC_PER_NODE", NULL};
static const char *const NAMES_NNODES[] = {"NNODES", "GROUP_WORLD_SIZE", "PET_NNODES", NULL};
static const char *const NAMES_NODE[] = {"NODE_RANK", "GROUP_RANK", "PET_NODE_RANK", NULL};

// The node part of the launch contract (comm.h, comm_init_from_env), after RANK, WORLD_SIZE and LOCAL_RANK.
static int node_from_env(CommInit *ci, int has_local, char *err, size_t len) {
    int lws, nnodes, node;
    const char *lws_name, *nn_name, *node_name;
    if (env_int_any(NAMES_LWS, 1, 1 << 20, &lws, &lws_name, err, len) ||
        env_int_any(NAMES_NNODES, 1, 1 << 20, &nnodes, &nn_name, err, len) ||
        env_int_any(NAMES_NODE, 0, (1 << 20) - 1, &node, &node_name, err, len))
        return COMM_ERR_INVALID;
    const int world = ci->world_size, has_lws = lws_name != NULL;
    // PyTorchJob's RANK is the pod's index, meant for torchrun to turn into its workers' ranks: a pod of several
    // ranks whose process got no LOCAL_RANK was started as one rank where a launcher should have started them all.
    if (has_lws && lws > 1 && !has_local && strcmp(lws_name, "PET_NPROC_PER_NODE") == 0)
        return err_fail_code(COMM_ERR_INVALID, err, len, "PET_NPROC_PER_NODE=%d asks for %d ranks in this pod but "
                             "LOCAL_RANK is not set, and RANK=%d is the pod's index (PyTorchJob): start the pod's ranks "
                             "with tandem-train launch (it reads PET_*) or torchrun --no-python", lws, lws, ci->rank);
    if (!has_lws && !nn_name) {
        lws = world, nnodes = 1;
    } else if (!has_lws) {
        if (world % nnodes)
            return err_fail_code(COMM_ERR_INVALID, err, len, "WORLD_SIZE %d is not a multiple of %s=%d (and "
                                 "LOCAL_WORLD_SIZE is not set)", world, nn_name, nnodes);
        lws = world / nnodes;
        lws_name = "LOCAL_WORLD_SIZE";
    } else if (!nn_name) {
        if (world % lws)
            return err_fail_code(COMM_ERR_INVALID, err, len, "WORLD_SIZE %d is not a multiple of %s=%d "
                                 "(and NNODES is not set)", world, lws_name, lws);
        nnodes = world / lws;
    } else if (nnodes * lws != world) {
        return err_fail_code(COMM_ERR_INVALID, err, len, "WORLD_SIZE %d is not %s=%d x %s=%d", world, nn_name, nnodes,
                             lws_name, lws);
    }
    if (!lws_name) lws_name = "LOCAL_WORLD_SIZE";
    if (!has_local) ci->local_rank = ci->rank % lws;
    if (ci->local_rank >= lws)
        return err_fail_code(COMM_ERR_INVALID, err, len, "LOCAL_RANK %d is outside %s %d%s", ci->local_rank, lws_name,
                             lws, has_lws ? "" : " (LOCAL_WORLD_SIZE is not set: WORLD_SIZE / nodes)");
    if (!node_name) node = ci->rank / lws;
    if (node >= nnodes)
        return err_fail_code(COMM_ERR_INVALID, err, len, "%s=%d is outside %d node%s%s", node_name, node, nnodes,
                             nnodes > 1 ? "s" : "", nn_name ? "" : " (NNODES is not set: WORLD_SIZE / LOCAL_WORLD_SIZE)");
    if (ci->rank != node * lws + ci->local_rank && !has_lws && !nn_name && !node_name)
        return err_fail_code(COMM_ERR_INVALID, err, len, "LOCAL_RANK %d with RANK %d means several nodes, but none of "
                             "LOCAL_WORLD_SIZE, NNODES, NODE_RANK is set: set LOCAL_WORLD_SIZE (ranks per node) as "
                             "torchrun and tandem-train launch do", ci->local_rank, ci->rank);
    if (ci->rank != node * lws + ci->local_rank)
        return err_fail_code(COMM_ERR_INVALID, err, len, "RANK %d is not %s=%d x %s=%d + LOCAL_RANK=%d (ranks are "
                             "numbered node by node)", ci->rank, node_name ? node_name : "node", node, lws_name, lws,
                             ci->local_rank);
    ci->node = node, ci->nnodes = nnodes, ci->local_world_size = lws;
    return 0;
}

int comm_rendezvous_port_from_env(int master_port, const char *master_port_name, int *port, char *source,
                                  size_t source_len, char *err, size_t err_len) {
    int own = 0, has_own = 0;
    if (env_int("TANDEM_RENDEZVOUS_PORT", 0, 1, 65535, &own, &has_own, err, err_len)) return COMM_ERR_INVALID;
    if (has_own) {
        *port = own;
        snprintf(source, source_len, "TANDEM_RENDEZVOUS_PORT");
    } else if (under_torchrun()) {
        if (master_port >= 65535)
            return err_fail_code(COMM_ERR_INVALID, err, err_len, "under torchrun tandem's rendezvous uses MASTER_PORT "
                                 "+ 1 (torchrun's agent holds MASTER_PORT=%d), past 65535: set TANDEM_RENDEZVOUS_PORT",
                                 master_port);
        *port = master_port + 1;
        snprintf(source, source_len, "%s+1 (torchrun's agent holds %s)", master_port_name, master_port_name);
    } else {
        *port = master_port;
        snprintf(source, source_len, "%s", master_port_name);
    }
    return 0;
}

int comm_init_from_env(CommInit *ci, int timeout_ms, char *err, size_t err_len) {
    if (!ci) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_init_from_env: ci is NULL");
    memset(ci, 0, sizeof *ci);
    if (timeout_ms <= 0) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm timeout %d ms must be > 0", timeout_ms);
    ci->timeout_ms = timeout_ms;
    int has_rank, has_world, has_local, master_port;
    const char *port_name;
    static const char *const NAMES_PORT[] = {"MASTER_PORT", "PET_MASTER_PORT", NULL};
    if (env_int("WORLD_SIZE", 1, 1, 1 << 20, &ci->world_size, &has_world, err, err_len) ||
        env_int("RANK", 0, 0, (1 << 20) - 1, &ci->rank, &has_rank, err, err_len) ||
        env_int("LOCAL_RANK", 0, 0, (1 << 20) - 1, &ci->local_rank, &has_local, err, err_len) ||
        env_int_any(NAMES_PORT, 1, 65535, &master_port, &port_name, err, err_len))
        return COMM_ERR_INVALID;
    if (!port_name) master_port = 29500, port_name = "MASTER_PORT";
    if (comm_rendezvous_port_from_env(master_port, port_name, &ci->master_port, ci->port_source,
                                      sizeof ci->port_source, err, err_len))
        return COMM_ERR_INVALID;
    if (ci->world_size > 1 && !has_rank)
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "WORLD_SIZE is %d but RANK is not set", ci->world_size);
    if (ci->rank >= ci->world_size)
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "RANK %d is outside WORLD_SIZE %d%s", ci->rank, ci->world_size,
                       has_world ? "" : " (WORLD_SIZE is not set)");
    const char *addr = NULL, *addr_name = NULL;
    if (env_text_either("MASTER_ADDR", "PET_MASTER_ADDR", &addr, &addr_name, err, err_len)) return COMM_ERR_INVALID;
    if (!addr) addr = "127.0.0.1", addr_name = "MASTER_ADDR";
    if (!*addr) return err_fail_code(COMM_ERR_INVALID, err, err_len, "environment variable %s is empty", addr_name);
    if (strlen(addr) >= sizeof ci->master_addr)
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "environment variable %s is longer than %zu bytes",
                             addr_name, sizeof ci->master_addr - 1);
    for (const char *p = addr; *p; p++)
        if (*p <= ' ' || *p == '/' || *p == '[' || *p == ']')
            return err_fail_code(COMM_ERR_INVALID, err, err_len, "environment variable %s='%s' is not a host name or IP "
                                 "address", addr_name, addr);
    snprintf(ci->master_addr, sizeof ci->master_addr, "%s", addr);
    return node_from_env(ci, has_local, err, err_len);
}
