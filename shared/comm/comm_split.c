// shared/comm/comm_split.c — nodes and sub-communicators (comm.h "nodes and sub-communicators"): the node map of a
// communicator, comm_split (MPI_Comm_split's rule) on both backends, the node splits of a node-aware layout, and the
// byte counters.
#include "shared/err.h"
#include "shared/comm/comm_internal.h"

#include <stdlib.h>
#include <string.h>

int comm_node(const Comm *c, int member) { return c && member >= 0 && member < c->world ? c->node[member] : -1; }
int comm_node_count(const Comm *c) { return c ? c->nnodes : 0; }

void comm_bytes(const Comm *c, CommBytes *out) {
    if (c) *out = c->bytes;
    else memset(out, 0, sizeof *out);
}

int comm_set_nodes(Comm *c, const int *node) {
    if (!c || !node) return COMM_ERR_INVALID;
    int n = 0;
    for (int m = 0; m < c->world; m++) {
        if (node[m] < 0 || node[m] >= c->world)
            return comm_fail(c, COMM_ERR_INVALID, "comm_set_nodes: member %d's node %d is outside 0..%d", m, node[m],
                             c->world - 1);
        if (node[m] + 1 > n) n = node[m] + 1;
    }
    memcpy(c->node, node, (size_t)c->world * sizeof *node);
    c->nnodes = n;
    return 0;
}

// recv (parent world x bytes, host memory) = every member's `send` (host memory), over the parent whatever its
// backend: an nccl parent exchanges through a device buffer of its compute context.
static int gather_host(Comm *parent, void *recv, const void *send, size_t bytes) {
    if (parent->backend == COMM_BACKEND_HOST) return comm_all_gather(parent, recv, send, bytes, COMM_U8);
    size_t total = bytes * (size_t)parent->world;
    unsigned char *dev = ops_malloc(parent->ops, total);
    if (!dev) return comm_fail(parent, COMM_ERR_SYSTEM, "comm_split: no device memory for %zu bytes: %s", total,
                               ops_error(parent->ops));
    ops_copy_to_device(parent->ops, dev + (size_t)parent->rank * bytes, send, bytes);
    comm_wait_compute(parent);
    int rc = comm_all_gather(parent, dev, dev + (size_t)parent->rank * bytes, bytes, COMM_U8);
    if (rc == 0) rc = comm_synchronize(parent);
    if (rc == 0) {
        ops_copy_to_host(parent->ops, recv, dev, total);
        ops_synchronize(parent->ops);
    }
    ops_free(parent->ops, dev);
    return rc;
}

typedef struct {
    int32_t color, key;
} Entry;

// nccl: the first member of each color makes a unique id; every parent member contributes its own (zeros when it
// makes none) and joins with its color's first member's.
static int split_nccl(Comm *c, Comm *parent, int first, char *err, size_t err_len) {
    uint8_t id[COMM_UNIQUE_ID_BYTES] = {0};
    int rc = 0;
    if (c && parent->rank == first) rc = comm_unique_id(COMM_BACKEND_NCCL, id, err, err_len);
    uint8_t *ids = malloc((size_t)parent->world * COMM_UNIQUE_ID_BYTES);
    if (!ids) return err_fail_code(COMM_ERR_SYSTEM, err, err_len, "comm_split: out of memory");
    // Exchanged even after a failure of this rank's own, so that nobody waits for it.
    if (gather_host(parent, ids, id, COMM_UNIQUE_ID_BYTES) != 0 && rc == 0)
        rc = err_fail_code(COMM_ERR_PEER, err, err_len, "comm_split: exchanging NCCL ids: %s", comm_error(parent));
    if (rc == 0 && c) {
        Comm *joined = NULL;
        rc = comm_create_with_id(&joined, COMM_BACKEND_NCCL, ids + (size_t)first * COMM_UNIQUE_ID_BYTES, c->rank,
                                 c->world, c->timeout_ms, c->ops, err, err_len);
        if (rc == 0) {
            c->impl = joined->impl;   // the backend state moves into c (same rank, world, context)
            joined->impl = NULL;
            free(joined->node);
            free(joined);
        }
    }
    free(ids);
    return rc;
}

int comm_split(Comm **out, Comm *parent, int color, int key, char *err, size_t err_len) {
    if (!out) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_split: out is NULL");
    *out = NULL;
    if (!parent) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_split: parent is NULL");
    if (parent->failed) return err_fail_code(COMM_ERR_FAILED, err, err_len, "comm_split: %s", parent->err);
    const int W = parent->world;
    Entry me = {color < 0 ? -1 : color, key}, *all = malloc((size_t)W * sizeof *all);
    int *members = malloc((size_t)W * sizeof *members);
    if (!all || !members) {
        free(all), free(members);
        return err_fail_code(COMM_ERR_SYSTEM, err, err_len, "comm_split: out of memory");
    }
    int rc = gather_host(parent, all, &me, sizeof me);
    if (rc) {
        free(all), free(members);
        return err_fail_code(rc, err, err_len, "comm_split: exchanging colors: %s", comm_error(parent));
    }
    // Members of this color by (key, parent rank): an insertion sort, stable in parent rank.
    int n = 0, my = -1;
    for (int p = 0; p < W && color >= 0; p++) {
        if (all[p].color != me.color) continue;
        int i = n++;
        while (i > 0 && all[members[i - 1]].key > all[p].key) members[i] = members[i - 1], i--;
        members[i] = p;
    }
    for (int i = 0; i < n; i++)
        if (members[i] == parent->rank) my = i;
    Comm *c = NULL;
    if (color >= 0) {
        c = calloc(1, sizeof *c);
        int *node = malloc((size_t)n * sizeof *node);
        if (!c || !node) {
            free(c), free(node);
            c = NULL;
            rc = err_fail_code(COMM_ERR_SYSTEM, err, err_len, "comm_split: out of memory");
        } else {
            c->backend = parent->backend;
            c->rank = my;
            c->world = n;
            c->timeout_ms = parent->timeout_ms;
            c->ops = parent->ops;
            c->node = node;
            // Nodes renumbered 0.. in order of first appearance, so that comm_node_count counts this group's nodes.
            for (int i = 0; i < n; i++) {
                int pn = parent->node[members[i]], k = 0;
                while (k < i && parent->node[members[k]] != pn) k++;
                node[i] = k < i ? node[k] : c->nnodes++;
            }
        }
    }
    // Every parent member takes part in the backend's exchange, even one that failed above (with no group).
    int brc = parent->backend == COMM_BACKEND_HOST ? comm_host_split(rc ? NULL : c, parent, members, err, err_len)
                                                   : split_nccl(rc ? NULL : c, parent, n ? members[0] : -1, err, err_len);
    if (rc == 0) rc = brc;
    free(all);
    free(members);
    if (rc != 0) {
        if (c) free(c->node), free(c);
        return rc;
    }
    *out = c;
    return 0;
}

int comm_split_nodes(Comm *parent, Comm **intra, Comm **inter, char *err, size_t err_len) {
    if (!parent || !intra || !inter) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_split_nodes: NULL argument");
    *intra = *inter = NULL;
    // This rank's index within its node, and the node's size; every node must have the same size.
    int node = parent->node[parent->rank], local = 0, per_node = 0;
    for (int m = 0; m < parent->world; m++)
        if (parent->node[m] == node) local += m < parent->rank, per_node++;
    for (int k = 0; k < parent->nnodes; k++) {
        int n = 0;
        for (int m = 0; m < parent->world; m++) n += parent->node[m] == k;
        if (n != per_node)
            return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_split_nodes: node %d has %d members, node %d "
                                 "has %d: node-aware layouts need the same number on every node", node, per_node, k, n);
    }
    int rc = comm_split(intra, parent, node, parent->rank, err, err_len);
    if (rc == 0) rc = comm_split(inter, parent, local, node, err, err_len);
    if (rc != 0) {
        comm_destroy(*intra);
        *intra = NULL;
    }
    return rc;
}
