// trainer/weight_sync.c — the weight-sync transports zmq and nccl, and the push that picks one (see
// trainer/weight_sync.h; transport ipc is trainer/weight_sync_ipc.c).
#include "trainer/weight_sync.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/comm/rendezvous.h"
#include "trainer/lora_train.h"
#include "trainer/weight_sync_internal.h"
#include "trainer/weight_sync_shards.h"
#include "trainer/server_liveness.h"
#include "trainer/trainer.h"

#define WEIGHT_SYNC_ATTEMPTS 3   // NCCL pushes tried per update while members keep going away

void weight_sync_free(WeightSync *ws) {
    weight_sync_close(ws);
    weight_sync_ipc_free(ws->ipc);
    ws->ipc = NULL;
}

void weight_sync_close(WeightSync *ws) {
    comm_destroy_now(ws->comm);   // the servers keep running: a graceful finalize would wait on them
    ws->comm = NULL;
    weight_shards_free(ws->shards);
    ws->shards = NULL;
    ws->n_servers = 0;
}

// Rank 0's verdict, broadcast to every rank over the host communicator.
typedef struct {
    int32_t status;    // 0 go (nccl), 1 use zmq from now on, -1 failed (rank 0 has the message)
    int32_t fresh;     // 1: a new communicator (id below), else reuse the current one
    int32_t n_servers;
    int32_t servers[ROLLOUT_MAX_SERVERS];   // (n_servers) the members W.. as rollout client indices
    int32_t tp[ROLLOUT_MAX_SERVERS];        // (n_servers) members of each (its tensor-parallel shards)
    uint8_t id[COMM_UNIQUE_ID_BYTES];
} NcclPlan;

// The server (index into ws->servers) whose shards include communicator member `member`, or -1 (a trainer rank);
// *shard: which of its shards.
static int server_of_member(const Trainer *t, int member, int *shard) {
    int first = t->world;
    for (int j = 0; j < t->sync.n_servers; first += t->sync.tp[j], j++)
        if (member >= first && member < first + t->sync.tp[j]) return *shard = member - first, j;
    return -1;
}

// The weight-sync communicator's peer watch (comm.h): the members of server servers[j] are gone when its control
// connection dropped (trainer/server_liveness.h); trainer ranks are watched by the trainer's own communicator.
static int64_t member_gone_ms(void *arg, int member) {
    Trainer *t = arg;
    int k, j = server_of_member(t, member, &k);
    return j >= 0 ? rollout_server_gone_ms(t->rollout, t->sync.servers[j]) : 0;
}

static void member_name(void *arg, int member, char *out, size_t len) {
    Trainer *t = arg;
    int k, j = server_of_member(t, member, &k);
    if (j >= 0 && t->sync.tp[j] > 1)
        snprintf(out, len, "rollout server %s (tensor-parallel shard %d)",
                 rollout_server_endpoint(t->rollout, t->sync.servers[j]), k);
    else if (j >= 0)
        snprintf(out, len, "rollout server %s", rollout_server_endpoint(t->rollout, t->sync.servers[j]));
    else
        snprintf(out, len, "trainer rank %d", member);
}

static int host_backend(const Trainer *t) { return ops_backend(t->ops) != OPS_BACKEND_CUDA; }
// What the slices travel as: the storage dtype (bf16 on GPUs, fp32 on the CPU), the servers' own.
static CommDtype storage_dtype(const Trainer *t) { return ops_dtype_size(t->ops) == 2 ? COMM_BF16 : COMM_F32; }
// Transport zmq frames from bf16 ranks carry bf16 too: the masters rounded as the ranks' own forward rounds them
// (round to nearest even, the optimizer's rule), so a server gets the bits NCCL would send, in half the bytes.
static int bf16_frames(const Trainer *t) { return storage_dtype(t) == COMM_BF16; }

// A new communicator's id. host: a rendezvous on this rank's address toward the first server (the one its
// rendezvous must be reachable from; servers of one run share a network).
static int new_id(Trainer *t, int server, uint8_t id[COMM_UNIQUE_ID_BYTES], char *err, size_t err_len) {
    if (!host_backend(t)) return comm_unique_id(COMM_BACKEND_NCCL, id, err, err_len);
    char host[256], addr[128];
    int port;
    rendezvous_endpoint_split(rollout_server_endpoint(t->rollout, server), host, sizeof host, &port);
    if (rendezvous_local_address(host, port > 0 ? port : 1, addr, sizeof addr, err, err_len) != 0) return -1;
    return comm_unique_id_host(addr, id, err, err_len);
}

// The elements of unit u that this rank owns and the unit really has (its slice may run into the padding). With
// LoRA (t->lora) every rank holds the whole merged model and sends the slice ZeRO would have given it.
size_t weight_sync_owned_count(const Trainer *t, int u, size_t *off) {
    const Layout *L = &t->model.layout;
    size_t n = t->lora ? layout_padded_unit_numel(L, u, t->world) / (size_t)t->world : zero3_shard_count(t->policy, u);
    *off = t->lora ? (size_t)t->rank * n : zero3_shard_offset(t->policy, u);
    if (*off >= L->unit_numel[u]) return 0;
    return L->unit_numel[u] - *off < n ? L->unit_numel[u] - *off : n;
}

// Rank 0: decides the members and opens the update on the servers. With a communicator they have joined before,
// the weights_begin answers are not awaited here (*pending = 1, their ids in req_ids): the sends are queued while
// the answers travel, and rank 0 checks them before waiting for the sends (push_nccl).
static void plan_nccl(Trainer *t, int64_t version, const LoraConfig *adapter, NcclPlan *plan, int64_t *req_ids,
                      int *pending, char *err, size_t err_len) {
    WeightSync *ws = &t->sync;
    int servers[ROLLOUT_MAX_SERVERS];
    int n = rollout_alive_servers(t->rollout, servers);
    memset(plan, 0, sizeof *plan);
    plan->n_servers = n;
    for (int j = 0; j < n; j++) plan->servers[j] = servers[j], plan->tp[j] = rollout_server_tp(t->rollout, servers[j]);
    if (n == 0) {
        fprintf(stderr, "tandem-train: weight update %lld reached no rollout server\n", (long long)version);
        return;
    }
    int same = ws->comm && ws->n_servers == n && !memcmp(ws->servers, servers, (size_t)n * sizeof *servers);
    for (int j = 0; same && j < n; j++) same = ws->tp[j] == plan->tp[j];
    // A member whose connection dropped since the communicator was made (it restarted, even at the same place in
    // the list) is not in it any more: a fresh process cannot join an old id, so the group is made again.
    for (int j = 0; same && j < n; j++)
        if (rollout_server_gone_ms(t->rollout, servers[j]) >= ws->joined_ms) same = 0;
    if (!same) {
        if (new_id(t, servers[0], plan->id, err, err_len) != 0) {
            plan->status = -1;
            return;
        }
        plan->fresh = 1;
    } else {
        memcpy(plan->id, ws->id, sizeof plan->id);
    }
    const RolloutNcclGroup grp = {.id = plan->id, .trainer_ranks = t->world, .tp = plan->tp, .host = host_backend(t)};
    if (!plan->fresh) {
        if (rollout_weights_begin_nccl_send(t->rollout, version, adapter, &grp, servers, n, req_ids, err, err_len)) {
            plan->status = -1;
            return;
        }
        *pending = 1;
        return;
    }
    int rc = rollout_weights_begin_nccl(t->rollout, version, adapter, &grp, servers, n, err, err_len);
    if (rc == ROLLOUT_EUNSUPPORTED && t->cfg->weight_sync_transport == WEIGHT_SYNC_AUTO) {
        fprintf(stderr, "tandem-train: %s\n", err);
        plan->status = 1;
        return;
    }
    if (rc != 0) {
        plan->status = -1;
        return;
    }
    memcpy(ws->servers, servers, (size_t)n * sizeof *servers);
}

// An adapter update: the adapter unit of every layer this rank holds the master of (l % world == rank: the same
// values on every rank, spread so that the ranks' links share the bytes), bf16 as the forward uses it, to every
// server, in one group (rollout_server/weight_nccl.h receives them so).
static int send_adapters(Trainer *t, Comm *c, int S) {
    const ModelLora *l = lora_train_adapters(t->lora);
    const CommDtype dt = storage_dtype(t);
    if (comm_group_start(c) != 0) return -1;
    for (int layer = t->rank; layer < l->n_layers; layer += t->world)
        for (int j = 0, first = t->world; j < S; first += t->sync.tp[j], j++) {
            if (comm_send(c, l->params[layer], l->unit_numel, dt, first) != 0) {
                comm_group_end(c);
                return -1;
            }
            t->sync.bytes += (double)l->unit_numel * (double)comm_dtype_size(dt);
        }
    return comm_group_end(c);
}

// Every rank: joins the communicator if it is new, then queues the sends of its slice of every unit (or, adapter
// updates, its layers' adapter units) to every server (wait_sends waits for them).
static int send_nccl(Trainer *t, const NcclPlan *plan, int adapter, char *err, size_t err_len) {
    WeightSync *ws = &t->sync;
    const int W = t->world, S = plan->n_servers;
    if (plan->fresh) {
        weight_sync_close(ws);
        int world = W;
        for (int j = 0; j < S; j++) ws->servers[j] = plan->servers[j], ws->tp[j] = plan->tp[j], world += plan->tp[j];
        ws->n_servers = S;
        const CommPeerWatch watch = {.gone_ms = member_gone_ms, .name = member_name, .arg = t};
        if (comm_create_with_id_watched(&ws->comm, host_backend(t) ? COMM_BACKEND_HOST : COMM_BACKEND_NCCL, plan->id,
                                        t->rank, world, (int)(t->cfg->comm_timeout * 1000), &watch, t->ops, err,
                                        err_len) != 0) {
            ws->comm = NULL;
            ws->n_servers = 0;
            return -1;
        }
        memcpy(ws->id, plan->id, sizeof ws->id);
        ws->joined_ms = server_liveness_now_ms();
    }
    const Layout *L = &t->model.layout;
    const size_t es = ops_dtype_size(t->ops);
    const CommDtype dt = storage_dtype(t);
    Comm *c = ws->comm;
    int any_tp = 0;
    for (int j = 0; j < S; j++) any_tp |= ws->tp[j] > 1;
    WeightSlice *slices = NULL;
    ws->bytes = 0;
    comm_wait_compute(c);   // the optimizer step that wrote the slices was queued on the compute stream
    ws->send_start = trainer_now();
    if (adapter && send_adapters(t, c, S) != 0) goto fail;
    if (!adapter && !(slices = malloc((size_t)L->n_units * sizeof *slices))) {
        snprintf(err, err_len, "out of memory for the weight sync's slice table");
        goto drop;
    }
    for (int u0 = 0; u0 < L->n_units && !adapter;) {
        // One NCCL group per bucket: many sends progress together, none waits for its own round trip.
        size_t bucket = 0;
        int u1 = u0;
        while (u1 < L->n_units && (u1 == u0 || bucket < WEIGHT_SYNC_BUCKET_BYTES)) {
            WeightSlice *sl = &slices[u1 - u0];
            sl->count = weight_sync_owned_count(t, u1, &sl->off);
            sl->src = t->lora ? (const char *)lora_train_merged_unit(t->lora, u1) + sl->off * es
                              : zero3_param_shard(t->policy, u1);
            bucket += sl->count * es;
            u1++;
        }
        if (any_tp) {
            if (weight_shards_pack(&ws->shards, t->ops, c, &t->model, ws->tp, S, u0, u1, slices, err, err_len) != 0)
                goto drop;
            comm_wait_compute(c);   // the packing copies
        }
        if (comm_group_start(c) != 0) goto fail;
        for (int u = u0; u < u1; u++) {
            const WeightSlice *sl = &slices[u - u0];
            for (int j = 0, first = W; j < S && sl->count > 0; first += ws->tp[j], j++) {
                if (ws->tp[j] > 1 && weight_shards_send(ws->shards, c, &t->model, u, sl, ws->tp[j], first, dt,
                                                        &ws->bytes, err, err_len) != 0) {
                    comm_group_end(c);
                    goto drop;   // its message says why
                }
                if (ws->tp[j] > 1) continue;
                if (comm_send(c, sl->src, sl->count, dt, first) != 0) {
                    comm_group_end(c);
                    goto fail;
                }
                ws->bytes += (double)sl->count * (double)es;
            }
        }
        if (comm_group_end(c) != 0) goto fail;
        u0 = u1;
    }
    free(slices);
    return 0;
fail:
    snprintf(err, err_len, "weight sync over NCCL: %s", comm_error(c));
drop:
    free(slices);
    weight_sync_close(ws);
    return -1;
}

static int wait_sends(Trainer *t, char *err, size_t err_len) {
    WeightSync *ws = &t->sync;
    if (comm_synchronize(ws->comm) != 0) {
        snprintf(err, err_len, "weight sync over NCCL: %s", comm_error(ws->comm));
        weight_sync_close(ws);
        return -1;
    }
    ws->transfer_seconds = trainer_now() - ws->send_start;
    return 0;
}

// Transport zmq: every rank sends its own master slices (no gather; bf16 from GPU ranks: bf16_frames), waits until
// the servers have applied them; rank 0 opened the update before and closes it after.
static int send_zmq(Trainer *t, int64_t version, char *err, size_t err_len) {
    const Layout *L = &t->model.layout;
    void *host = NULL;
    size_t cap = 0;
    // GPU ranks send the bf16 units their forward reads, as they are (the masters rounded by the optimizer's rule,
    // the bits a conversion of the masters gives, at half the bytes to download and no conversion). Hybrid layouts
    // keep their forward copy cut otherwise than their master slices: those send the masters, converted.
    const int raw_bf16 = bf16_frames(t) && (t->lora || !train_config_hybrid_layout(t->cfg));
    const size_t es = raw_bf16 ? 2 : 4;
    int rc = 0, servers[ROLLOUT_MAX_SERVERS];
    const int n_servers = rollout_alive_servers(t->rollout, servers);
    t->sync.bytes = 0;
    const double t0 = trainer_now();
    // HSDP: every node holds the whole model in its ranks' slices; node 0's ranks send it (the replicas hold the same
    // values). hpZ: each rank's master slice is its own part of the model, at its offset, as flat ZeRO's.
    const int replica = t->policy && zero3_replicas(t->policy) > 1 ? comm_rank(t->replica_comm) : 0;
    for (int u = 0; u < L->n_units && rc == 0 && replica == 0; u++) {
        size_t off, count = weight_sync_owned_count(t, u, &off);
        if (count == 0) continue;
        if (count > cap) {
            free(host);
            cap = count;
            if (!(host = malloc(cap * es))) {
                snprintf(err, err_len, "out of memory for a weight slice of %zu elements", cap);
                return -1;
            }
        }
        if (raw_bf16)
            ops_copy_to_host(t->ops, host, t->lora ? (const char *)lora_train_merged_unit(t->lora, u) + off * 2
                                                   : zero3_param_shard(t->policy, u), count * 2);
        else if (t->lora)
            ops_download_f32(t->ops, host,
                             (const char *)lora_train_merged_unit(t->lora, u) + off * ops_dtype_size(t->ops), count);
        else
            ops_copy_to_host(t->ops, host, zero3_master_shard(t->policy, u), count * sizeof(float));
        rc = rollout_weights_send_slice(t->rollout, version, u, (int64_t)off, host,
                                        raw_bf16 ? ZMSG_DTYPE_BF16 : ZMSG_DTYPE_F32, (int64_t)count, bf16_frames(t),
                                        err, err_len);
        t->sync.bytes += (double)count * (bf16_frames(t) ? 2 : 4) * n_servers;
    }
    free(host);
    if (rc == 0) rc = rollout_client_flush(t->rollout, err, err_len);
    t->sync.transfer_seconds = trainer_now() - t0;
    return rc;
}

// Rank 0 closes the update (waits for every server's swap) and tells every rank how it went.
// end_ids: the weights_end requests rank 0 has already sent (their answers are awaited), or NULL: send them now.
int weight_sync_finish(Trainer *t, int64_t version, int rc, const int64_t *end_ids, char *err, size_t err_len) {
    WeightSync *ws = &t->sync;
    ws->end_seconds = ws->commit_seconds = 0;
    if (t->rank == 0 && rc == 0) {
        const double t0 = trainer_now();
        rc = end_ids ? rollout_weights_end_wait(t->rollout, version, end_ids, NULL, &ws->commit_seconds, err, err_len)
                     : rollout_weights_end(t->rollout, version, NULL, &ws->commit_seconds, err, err_len);
        ws->end_seconds = trainer_now() - t0;
    }
    int32_t ok = rc == 0;
    if (comm_broadcast(t->comm, &ok, 1, COMM_I32, 0) != 0 || !ok) {
        if (rc == 0) snprintf(err, err_len, "weight sync: %s", ok ? comm_error(t->comm) : "rank 0 failed to finish it");
        return -1;
    }
    return 0;
}

// Every rank learns whether every rank's sending went well.
int weight_sync_agree(Trainer *t, int rc, char *err, size_t err_len) {
    int32_t failed = rc != 0;
    if (comm_all_reduce(t->comm, &failed, 1, COMM_I32, COMM_MAX) != 0 || failed) {
        if (rc == 0) snprintf(err, err_len, "weight sync: %s", failed ? "another rank failed to send its slices"
                                                                      : comm_error(t->comm));
        return -1;
    }
    return 0;
}

// Transport nccl, for whole weights or (adapter not NULL) the LoRA adapters alone. Returns 0 (done), 1 (use zmq
// instead: a server cannot take nccl) or -1.
static int push_nccl(Trainer *t, int64_t version, const LoraConfig *adapter, char *err, size_t err_len) {
    NcclPlan plan = {0};
    int64_t req_ids[ROLLOUT_MAX_SERVERS];
    int pending = 0;
    const double t0 = trainer_now();
    if (t->rank == 0) plan_nccl(t, version, adapter, &plan, req_ids, &pending, err, err_len);
    if (comm_broadcast(t->comm, &plan, sizeof plan, COMM_U8, 0) != 0) {
        snprintf(err, err_len, "weight sync: %s", comm_error(t->comm));
        return -1;
    }
    t->sync.begin_seconds = t->rank == 0 ? trainer_now() - t0 : 0;
    if (plan.status < 0) {
        if (t->rank != 0) snprintf(err, err_len, "weight sync: rank 0 could not start it");
        return -1;
    }
    if (plan.status == 1) return 1;
    if (plan.n_servers == 0) return 0;
    if (t->rank != 0) rollout_weights_set_members(t->rollout, plan.servers, plan.n_servers);
    int rc = send_nccl(t, &plan, adapter != NULL, err, err_len);
    if (pending) {
        // Queued sends cannot finish without a server's receive: a refusal (or silence) aborts the communicator,
        // which ends them; the other ranks' sends then fail by the communicator's timeout.
        char berr[512];
        int brc = rollout_weights_begin_nccl_wait(t->rollout, t->sync.servers, plan.n_servers, req_ids, berr,
                                                  sizeof berr);
        if (brc != 0 && rc == 0) {
            snprintf(err, err_len, "weight sync: %s", berr);
            weight_sync_close(&t->sync);
            rc = -1;
        }
    }
    // weights_end goes out while the sends are in flight: a server answers it once its receive has finished and
    // the new weights are swapped in, so the round trip overlaps the transfer.
    int64_t end_ids[ROLLOUT_MAX_SERVERS];
    int end_sent = 0;
    if (t->rank == 0 && rc == 0) {
        if (rollout_weights_end_send(t->rollout, version, end_ids, err, err_len) != 0) {
            weight_sync_close(&t->sync);
            rc = -1;
        } else {
            end_sent = 1;
        }
    }
    if (rc == 0) rc = wait_sends(t, err, err_len);
    if (weight_sync_agree(t, rc, err, err_len) != 0) {
        weight_sync_close(&t->sync);
        return -1;   // an answer to a weights_end sent above is an error, or comes late and is discarded
    }
    return weight_sync_finish(t, version, 0, end_sent ? end_ids : NULL, err, err_len);
}

static int push_zmq(Trainer *t, int64_t version, char *err, size_t err_len) {
    int rc = 0;
    const double t0 = trainer_now();
    // Rank 0's verdict and the servers that took weights_begin: every rank sends its slices to those.
    int32_t head[2 + ROLLOUT_MAX_SERVERS] = {0};
    int members[ROLLOUT_MAX_SERVERS], n_members = 0;
    if (t->rank == 0) rc = rollout_weights_begin(t->rollout, version, members, &n_members, err, err_len);
    t->sync.begin_seconds = t->rank == 0 ? trainer_now() - t0 : 0;
    head[0] = rc == 0;
    head[1] = n_members;
    for (int j = 0; j < n_members; j++) head[2 + j] = members[j];
    if (comm_broadcast(t->comm, head, 2 + ROLLOUT_MAX_SERVERS, COMM_I32, 0) != 0 || !head[0]) {
        if (rc == 0)
            snprintf(err, err_len, "weight sync: %s", head[0] ? comm_error(t->comm) : "rank 0 could not start it");
        return -1;
    }
    if (t->rank != 0) {
        n_members = head[1];
        for (int j = 0; j < n_members; j++) members[j] = head[2 + j];
        rollout_weights_set_members(t->rollout, members, n_members);
    }
    rc = send_zmq(t, version, err, err_len);
    if (weight_sync_agree(t, rc, err, err_len) != 0) return -1;
    return weight_sync_finish(t, version, 0, NULL, err, err_len);
}

// lora_sync adapter over ZeroMQ: the adapters alone. Every rank holds the same adapters, so rank 0 sends them all
// (their masters, bf16 from GPU ranks as bf16_frames says, one unit per decoder layer); the servers run them beside
// their base weights. The other ranks learn rank 0's verdict in finish.
static int push_adapter(Trainer *t, int64_t version, char *err, size_t err_len) {
    const ModelLora *l = lora_train_adapters(t->lora);
    int rc = 0, n_members = 0;
    t->sync.bytes = t->sync.begin_seconds = t->sync.transfer_seconds = 0;
    const double t0 = trainer_now();
    if (t->rank == 0) {
        int members[ROLLOUT_MAX_SERVERS];
        rc = rollout_weights_begin_adapter(t->rollout, version, &l->cfg, members, &n_members, err, err_len);
        t->sync.begin_seconds = trainer_now() - t0;
    }
    // Whether rank 0 sends: every rank then takes part in each layer's broadcast from the rank that holds its master
    // (ZeRO over the adapters), rank 0 sending what it receives.
    int32_t go = rc == 0 && n_members > 0;
    if (comm_broadcast(t->comm, &go, 1, COMM_I32, 0) != 0) {
        if (rc == 0) snprintf(err, err_len, "weight sync: %s", comm_error(t->comm));
        return -1;
    }
    const double t1 = trainer_now();
    float *host = go && t->rank == 0 ? malloc(l->unit_numel * sizeof(float)) : NULL;
    if (go && t->rank == 0 && !host) rc = -1, snprintf(err, err_len, "out of memory for an adapter unit");
    for (int layer = 0; go && layer < l->n_layers; layer++) {
        int grc = lora_train_gather(t->lora, layer, 0, host, err, err_len);
        if (grc != 0) {
            rc = -1;
            break;
        }
        if (!host || rc != 0) continue;   // rank 0 out of memory or its sending failed: it still joins the broadcasts
        rc = rollout_weights_send_slice(t->rollout, version, layer, 0, host, ZMSG_DTYPE_F32, (int64_t)l->unit_numel,
                                        bf16_frames(t), err, err_len);
        t->sync.bytes += (double)l->unit_numel * (bf16_frames(t) ? 2 : 4) * n_members;
    }
    free(host);
    if (go && t->rank == 0 && rc == 0) rc = rollout_client_flush(t->rollout, err, err_len);
    t->sync.transfer_seconds = trainer_now() - t1;
    const int done = weight_sync_finish(t, version, rc, NULL, err, err_len);
    return rc != 0 ? -1 : done;   // a rank whose broadcast failed fails whatever rank 0 saw
}

// After a failed NCCL push (every rank calls it): 1 when rank 0 saw a member server go away during it and a
// new attempt with the others may begin (attempts left), else 0.
static int retry_without_lost(Trainer *t, int64_t version, int attempt, const char *why) {
    int32_t lost = t->rank == 0 && rollout_weights_lost_members(t->rollout) > 0;
    if (comm_broadcast(t->comm, &lost, 1, COMM_I32, 0) != 0 || !lost || attempt >= WEIGHT_SYNC_ATTEMPTS) return 0;
    if (t->rank == 0)
        fprintf(stderr, "tandem-train: weight update %lld lost a rollout server (%s); pushing it again to the others "
                "(attempt %d of %d); the lost server gets the weights when it answers again\n", (long long)version, why,
                attempt + 1, WEIGHT_SYNC_ATTEMPTS);
    return 1;
}

// Whether transport ipc can carry this run's updates, as train_config_check.c allows it: whole weights (not adapters)
// from a layout where rank r holds slice r of every unit (no HSDP, no hpZ).
static int ipc_can_carry(const Trainer *t, const LoraConfig *adapter) {
    return !adapter && !train_config_hybrid_layout(t->cfg);
}

int weight_sync_push(Trainer *t, double *seconds, char *err, size_t err_len) {
    int64_t version = t->progress.step;
    double t0 = trainer_now();
    WeightSync *ws = &t->sync;
    // lora_sync adapter: the adapters alone; lora_sync merged: the base with this step's adapters merged in, as
    // whole weights.
    const LoraConfig *adapter =
        t->lora && t->cfg->lora_sync == LORA_SYNC_ADAPTER ? &lora_train_adapters(t->lora)->cfg : NULL;
    if (t->lora && !adapter && lora_train_refresh_merged(t->lora, err, err_len) != 0) return -1;
    // train_config_check.c refuses adapter updates over ipc
    if (ws->use_ipc && weight_sync_push_ipc(t, version, err, err_len) != 0) return -1;
    if (!ws->use_ipc && ws->use_nccl) {
        int rc;
        for (int attempt = 1;; attempt++) {
            rc = push_nccl(t, version, adapter, err, err_len);
            if (rc >= 0 || !retry_without_lost(t, version, attempt, err)) break;
            weight_sync_close(ws);
        }
        if (rc == 0) ws->nccl_worked = 1;
        // `auto` tries NCCL; if it never worked in this run (e.g. a server on this rank's own GPU, which one NCCL
        // communicator cannot hold, or a CPU server), ipc carries the weights from now on when the servers are on
        // this host and take it (the copies go straight into their memory), else zmq.
        if (rc != 0 && t->cfg->weight_sync_transport == WEIGHT_SYNC_AUTO && !ws->nccl_worked) {
            char why[2304];
            snprintf(why, sizeof why, "%.1024s", rc > 0 ? "is not possible with these rollout servers" : err);
            ws->use_nccl = 0;
            weight_sync_close(ws);
            if (ipc_can_carry(t, adapter)) {
                char ipc_err[1024];
                ws->use_ipc = weight_sync_push_ipc(t, version, ipc_err, sizeof ipc_err) == 0;
                if (!ws->use_ipc) snprintf(why + strlen(why), sizeof why - strlen(why), "; over ipc: %.1024s", ipc_err);
            }
            if (t->rank == 0)
                fprintf(stderr, "tandem-train: weight sync over NCCL %s; using transport %s from now on\n", why,
                        ws->use_ipc ? "ipc (the servers' memory on this host)" : "zmq");
        } else if (rc != 0) {
            return -1;
        }
    }
    if (!ws->use_nccl && !ws->use_ipc &&
        (adapter ? push_adapter(t, version, err, err_len) : push_zmq(t, version, err, err_len)) != 0)
        return -1;
    t->progress.policy_version = version;
    *seconds = trainer_now() - t0;
    return 0;
}
