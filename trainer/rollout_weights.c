// trainer/rollout_weights.c — weight pushes to the rollout servers over the control channel (see
// trainer/rollout_client.h: transport zmq slices, and the weights_begin / weights_end of transport nccl).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/dtype.h"
#include "trainer/rollout_client_internal.h"

int64_t rollout_server_gone_ms(RolloutClient *c, int server) { return server_liveness_gone_ms(c->live, server); }

const char *rollout_server_endpoint(const RolloutClient *c, int server) { return c->servers[server].endpoint; }
int rollout_server_tp(const RolloutClient *c, int server) {
    const int n = c->servers[server].tensor_parallel_size;
    return n > 1 ? n : 1;
}

// A member of the update in flight that is still counted on: alive and not gone since the update began.
static int push_member(RolloutClient *c, Server *s) {
    if (!s->in_push || !s->alive) return 0;
    if (rollout_gone_since(c, s, c->push_since_ms)) {
        rollout_mark_dead(c, s, "went away during a weight push");
        return 0;
    }
    return 1;
}

// Sends request m (`what`) to s and waits for its answer (up to the request timeout, less if the server goes
// away since the update began). Returns 1 (answer in *rep), 0 (the server is set aside), -1 error.
static int push_call(RolloutClient *c, Server *s, ZmsgMsg *m, const char *what, ZmsgMsg *rep, char *err,
                     size_t err_len) {
    int gone, r = rollout_send_msg(c, s, m, c->push_since_ms, c->timeout_ms, &gone, err, err_len);
    if (r == 0) r = rollout_wait_reply(c, s, m->id, what, c->push_since_ms, rep, c->timeout_ms, &gone, err, err_len);
    else if (r > 0) r = 0;
    if (r == 0) {
        char why[128];
        snprintf(why, sizeof why, gone ? "went away during %s" : "did not answer %s in time", what);
        rollout_mark_dead(c, s, why);
    }
    return r;
}

int rollout_weights_lost_members(RolloutClient *c) {
    int lost = 0;
    for (int k = 0; k < c->n_servers; k++) {
        Server *s = &c->servers[k];
        if (s->in_push && !push_member(c, s)) lost++;
    }
    return lost;
}

void rollout_weights_set_members(RolloutClient *c, const int *servers, int n) {
    c->push_since_ms = now_ms();
    for (int k = 0; k < c->n_servers; k++) c->servers[k].in_push = 0;
    for (int j = 0; j < n; j++) c->servers[servers[j]].in_push = 1;
}

// A weights_begin's "adapter" (the update carries LoRA adapters alone), or nothing for whole weights (adapter NULL).
static void describe_adapter(ZmsgMsg *m, const LoraConfig *adapter) {
    if (!adapter) return;
    m->has_adapter = 1;
    m->adapter_r = adapter->r;
    m->adapter_alpha = adapter->alpha;
    m->adapter_rslora = adapter->use_rslora;
    lora_targets_text(adapter->targets, m->adapter_targets, sizeof m->adapter_targets);
}

// weights_begin (zmq) to every answering server, for whole weights (adapter NULL) or LoRA adapters.
static int begin_zmq(RolloutClient *c, int64_t version, const LoraConfig *adapter, int *members, int *n_members,
                     char *err, size_t err_len) {
    int alive[MAX_SERVERS], n_alive = rollout_alive_servers(c, alive);
    rollout_weights_set_members(c, alive, n_alive);
    *n_members = 0;
    for (int j = 0; j < n_alive; j++) {
        Server *s = &c->servers[alive[j]];
        ZmsgMsg m, rep;
        zmsg_init(&m, ZMSG_WEIGHTS_BEGIN, ZMSG_DIR_REQUEST, c->next_id++);
        m.version = version;
        m.transport = ZMSG_TRANSPORT_ZMQ;
        m.layout_hash = c->layout_hash;
        describe_adapter(&m, adapter);
        int r = push_call(c, s, &m, "weights_begin", &rep, err, err_len);
        if (r < 0) return -1;
        if (r == 0) continue;
        zmsg_free(&rep);
        members[(*n_members)++] = alive[j];
    }
    // With no server answering, nothing is pushed now: rollout_client_refresh finds the servers that come back
    // with older weights and the caller pushes again then.
    if (*n_members == 0)
        fprintf(stderr, "tandem-train: weight update %lld reached no rollout server\n", (long long)version);
    return 0;
}

int rollout_weights_begin(RolloutClient *c, int64_t version, int *members, int *n_members, char *err,
                          size_t err_len) {
    return begin_zmq(c, version, NULL, members, n_members, err, err_len);
}

int rollout_weights_begin_adapter(RolloutClient *c, int64_t version, const LoraConfig *adapter, int *members,
                                  int *n_members, char *err, size_t err_len) {
    return begin_zmq(c, version, adapter, members, n_members, err, err_len);
}

int rollout_alive_servers(const RolloutClient *c, int *servers) {
    int n = 0;
    for (int k = 0; k < c->n_servers; k++)
        if (c->servers[k].alive) servers[n++] = k;
    return n;
}

// weights_begin (nccl) to server servers[j], not waiting for the answer; *id receives the request's id (-1: the
// server went away and was set aside).
// Members: the trainer ranks, then every server's grp->tp[j] shards in list order.
static int begin_nccl_send(RolloutClient *c, int64_t version, const LoraConfig *adapter, const RolloutNcclGroup *grp,
                           const int *servers, int n, int j, int64_t *req_id, char *err, size_t err_len) {
    Server *s = &c->servers[servers[j]];
    ZmsgMsg m;
    zmsg_init(&m, ZMSG_WEIGHTS_BEGIN, ZMSG_DIR_REQUEST, c->next_id++);
    m.version = version;
    m.transport = ZMSG_TRANSPORT_NCCL;
    m.layout_hash = c->layout_hash;
    memcpy(m.nccl_id, grp->id, ZMSG_NCCL_ID_BYTES);
    m.trainer_ranks = grp->trainer_ranks;
    m.nccl_world = grp->trainer_ranks;
    for (int i = 0; i < n; i++) {
        if (i == j) m.nccl_rank = m.nccl_world;
        m.nccl_world += grp->tp[i];
    }
    m.tensor_parallel_size = grp->tp[j];
    m.comm_backend = grp->host ? ZMSG_COMM_HOST : ZMSG_COMM_NCCL;
    describe_adapter(&m, adapter);
    *req_id = m.id;
    int gone, r = rollout_send_msg(c, s, &m, c->push_since_ms, c->timeout_ms, &gone, err, err_len);
    if (r > 0) {
        rollout_mark_dead(c, s, gone ? "went away during weights_begin" : "did not take weights_begin in time");
        *req_id = -1;
    }
    return r < 0 ? -1 : 0;
}

// The answer to weights_begin request req_id: 0 accepted, else as rollout_weights_begin_nccl.
static int begin_nccl_wait(RolloutClient *c, Server *s, int64_t req_id, char *err, size_t err_len) {
    ZmsgMsg rep;
    int gone = 0, r = req_id < 0 ? 0 : rollout_wait_reply(c, s, req_id, "weights_begin", c->push_since_ms, &rep, c->timeout_ms,
                                                  &gone, err, err_len);
    if (r < 0) return strstr(err, "[unsupported]") ? ROLLOUT_EUNSUPPORTED : -1;
    if (r == 0) {
        // Members are fixed once told: a lost server fails this push, and the next one leaves it out.
        if (req_id >= 0) rollout_mark_dead(c, s, gone ? "went away during weights_begin" : "did not acknowledge weights_begin");
        snprintf(err, err_len, "rollout server %s %s weights_begin (nccl)", s->endpoint,
                 gone || req_id < 0 ? "went away during" : "did not acknowledge");
        return ROLLOUT_ESERVERS_LOST;
    }
    zmsg_free(&rep);
    return 0;
}

int rollout_weights_begin_nccl(RolloutClient *c, int64_t version, const LoraConfig *adapter,
                               const RolloutNcclGroup *grp, const int *servers, int n, char *err, size_t err_len) {
    rollout_weights_set_members(c, servers, n);
    for (int j = 0; j < n; j++) {
        Server *s = &c->servers[servers[j]];
        int64_t req_id;
        if (begin_nccl_send(c, version, adapter, grp, servers, n, j, &req_id, err, err_len) != 0) return -1;
        int rc = begin_nccl_wait(c, s, req_id, err, err_len);
        if (rc != 0) return rc;
    }
    return 0;
}

int rollout_weights_begin_nccl_send(RolloutClient *c, int64_t version, const LoraConfig *adapter,
                                    const RolloutNcclGroup *grp, const int *servers, int n, int64_t *req_ids,
                                    char *err, size_t err_len) {
    rollout_weights_set_members(c, servers, n);
    for (int j = 0; j < n; j++)
        if (begin_nccl_send(c, version, adapter, grp, servers, n, j, &req_ids[j], err, err_len) != 0)
            return -1;
    return 0;
}

int rollout_weights_begin_nccl_wait(RolloutClient *c, const int *servers, int n, const int64_t *req_ids, char *err,
                                    size_t err_len) {
    for (int j = 0; j < n; j++) {
        int rc = begin_nccl_wait(c, &c->servers[servers[j]], req_ids[j], err, err_len);
        if (rc != 0) return rc;
    }
    return 0;
}

int rollout_weights_send_slice(RolloutClient *c, int64_t version, int unit, int64_t offset, const void *values,
                               ZmsgDtype dtype, int64_t count, int send_bf16, char *err, size_t err_len) {
    uint16_t *bf = NULL;
    const size_t es = zmsg_dtype_size(dtype);
    if (dtype == ZMSG_DTYPE_F32 && send_bf16 &&
        !(bf = malloc((size_t)(count < SLICE_ELEMS ? count : SLICE_ELEMS) * 2 + 2))) {
        snprintf(err, err_len, "out of memory converting unit %d to bf16", unit);
        return -1;
    }
    int rc = 0;
    for (int64_t off = 0; off < count && rc == 0; off += SLICE_ELEMS) {
        int64_t n = count - off < SLICE_ELEMS ? count - off : SLICE_ELEMS;
        if (bf) dtype_f32_to_bf16_n(bf, (const float *)values + off, (size_t)n);
        for (int k = 0; k < c->n_servers && rc == 0; k++) {
            Server *s = &c->servers[k];
            if (!push_member(c, s)) continue;
            ZmsgMsg m;
            zmsg_init(&m, ZMSG_WEIGHTS_SLICE, ZMSG_DIR_REQUEST, c->next_id++);
            m.unit = unit;
            m.offset = offset + off;
            m.count = n;
            m.dtype = bf ? ZMSG_DTYPE_BF16 : dtype;
            m.slice_data = bf ? (const void *)bf : (const void *)((const char *)values + (size_t)off * es);
            m.has_version = 1; // lets every rank send its own slices of the update rank 0 opened
            m.version = version;
            int gone;
            rc = rollout_send_msg(c, s, &m, c->push_since_ms, c->timeout_ms, &gone, err, err_len);
            if (rc > 0) {
                rollout_mark_dead(c, s, gone ? "went away during a weight push" : "did not take a weight slice in time");
                rc = 0;
            }
        }
    }
    free(bf);
    return rc;
}

int rollout_client_flush(RolloutClient *c, char *err, size_t err_len) {
    for (int k = 0; k < c->n_servers; k++) {
        Server *s = &c->servers[k];
        if (!push_member(c, s)) continue;
        // A server handles one peer's messages in order: its answer to this hello means every slice sent before
        // it has been applied (a refused slice would have come back as an error first).
        int r = rollout_hello(c, s, c->timeout_ms, err, err_len);
        if (r < 0) return -1;
        if (r == 0)
            rollout_mark_dead(c, s, rollout_gone_since(c, s, c->push_since_ms) ? "went away during a weight push"
                                                               : "did not answer after a weight push");
    }
    return 0;
}

int rollout_weights_end_send(RolloutClient *c, int64_t version, int64_t *req_ids, char *err, size_t err_len) {
    for (int k = 0; k < c->n_servers; k++) {
        Server *s = &c->servers[k];
        req_ids[k] = -1;
        if (!push_member(c, s)) continue;
        ZmsgMsg m;
        zmsg_init(&m, ZMSG_WEIGHTS_END, ZMSG_DIR_REQUEST, c->next_id++);
        m.version = version;
        int gone, r = rollout_send_msg(c, s, &m, c->push_since_ms, c->timeout_ms, &gone, err, err_len);
        if (r < 0) return -1;
        if (r > 0) {
            rollout_mark_dead(c, s, gone ? "went away during weights_end" : "did not take weights_end in time");
            continue;
        }
        req_ids[k] = m.id;
    }
    return 0;
}

int rollout_weights_end_wait(RolloutClient *c, int64_t version, const int64_t *req_ids, double *seconds,
                             double *commit_seconds, char *err, size_t err_len) {
    double slowest = 0, slowest_commit = 0;
    for (int k = 0; k < c->n_servers; k++) {
        Server *s = &c->servers[k];
        if (req_ids[k] < 0 || !s->alive) continue;
        ZmsgMsg rep;
        // Slices are answered only when refused: such an error arrives before this reply and fails the push.
        int gone, r = rollout_wait_reply(c, s, req_ids[k], "weights_end", c->push_since_ms, &rep, c->timeout_ms, &gone, err,
                                 err_len);
        if (r < 0) return -1;
        if (r == 0) {
            rollout_mark_dead(c, s, gone ? "went away during weights_end" : "did not acknowledge weights_end");
            continue;
        }
        s->policy_version = version;
        if (rep.seconds > slowest) slowest = rep.seconds;
        if (rep.commit_seconds > slowest_commit) slowest_commit = rep.commit_seconds;
        zmsg_free(&rep);
    }
    if (seconds) *seconds = slowest;
    if (commit_seconds) *commit_seconds = slowest_commit;
    return 0;
}

int rollout_weights_end(RolloutClient *c, int64_t version, double *seconds, double *commit_seconds, char *err,
                        size_t err_len) {
    int64_t req_ids[MAX_SERVERS];
    if (rollout_weights_end_send(c, version, req_ids, err, err_len) != 0) return -1;
    return rollout_weights_end_wait(c, version, req_ids, seconds, commit_seconds, err, err_len);
}

int rollout_weights_begin_ipc(RolloutClient *c, int64_t version, const char *host, int *members, int *n_members,
                              ZmsgIpc *ipc, char *err, size_t err_len) {
    int alive[MAX_SERVERS], n_alive = rollout_alive_servers(c, alive);
    rollout_weights_set_members(c, alive, n_alive);
    *n_members = 0;
    for (int j = 0; j < n_alive; j++) {
        Server *s = &c->servers[alive[j]];
        const int tp = rollout_server_tp(c, alive[j]);
        ZmsgMsg m, rep;
        zmsg_init(&m, ZMSG_WEIGHTS_BEGIN, ZMSG_DIR_REQUEST, c->next_id++);
        m.version = version;
        m.transport = ZMSG_TRANSPORT_IPC;
        m.layout_hash = c->layout_hash;
        snprintf(m.ipc_host, sizeof m.ipc_host, "%s", host);
        m.tensor_parallel_size = tp;
        int r = push_call(c, s, &m, "weights_begin", &rep, err, err_len);
        if (r < 0) return -1;
        if (r == 0) continue;   // set aside: it gets the weights when it answers again
        const int ok = rep.ipc.present && rep.ipc.n_shards == tp;
        if (ok) ipc[*n_members] = rep.ipc;
        zmsg_free(&rep);
        if (!ok) {
            snprintf(err, err_len, "rollout server %s answered weights_begin (ipc) without the staging of its %d "
                     "shard(s) (a server that predates transport ipc?); use --weight-sync-transport nccl or zmq",
                     s->endpoint, tp);
            return -1;
        }
        members[(*n_members)++] = alive[j];
    }
    rollout_weights_set_members(c, members, *n_members);
    if (*n_members == 0)
        fprintf(stderr, "tandem-train: weight update %lld reached no rollout server\n", (long long)version);
    return 0;
}
