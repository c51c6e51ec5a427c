// rollout_server/zmq_weights.c — weight updates on the control channel (zmq_control.h): weights_begin,
// weights_slice and weights_end with transport "zmq" (slices received into the engines' host staging,
// rollout_server/weight_recv.h), "nccl" (a receive thread filling the engines' device staging,
// rollout_server/weight_nccl.h) or "ipc" (trainer ranks of this host writing into mapped staging,
// rollout_server/weight_ipc.h), then the commit to every engine. Runs on the socket thread.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_server/zmq_control_internal.h"
#include "shared/model_lora.h"

static void *staging_of(void *user, int unit, int *bf16) {
    *bf16 = engine_group_weights_staging_bf16((EngineGroup *)user);
    return engine_group_weights_staging((EngineGroup *)user, unit);
}

// The mode weights_end asks for, else the server's --weight-update-mode.
static EngineUpdateMode update_mode(const ZmqControl *z, const ZmsgMsg *q) {
    if (!q->has_update_mode) return z->update_mode;
    switch (q->update_mode) {
    case ZMSG_UPDATE_ABORT: return ENGINE_UPDATE_ABORT;
    case ZMSG_UPDATE_KEEP_KV: return ENGINE_UPDATE_KEEP_KV;
    default: return ENGINE_UPDATE_KEEP;
    }
}

// The weights_end reply. A request that named its mode also gets what the update did to the sequences in flight
// (the fields are left out for clients that predate them).
static void reply_end(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q, double seconds,
                      double commit_seconds, const EngineCommitReport *rep) {
    ZmsgMsg m;
    zmsg_init(&m, ZMSG_WEIGHTS_END, ZMSG_DIR_REPLY, q->id);
    m.version = q->version;
    m.seconds = seconds;
    m.commit_seconds = commit_seconds;
    m.has_update_report = q->has_update_mode;
    m.sequences_kept = rep->sequences_kept;
    m.sequences_requeued = rep->sequences_requeued;
    zc_send_msg(z->router, rid, rl, &m);
}

// The weights_begin reply: the update is open.
static void reply_begin(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    ZmsgMsg m;
    zmsg_init(&m, ZMSG_WEIGHTS_BEGIN, ZMSG_DIR_REPLY, q->id);
    m.version = q->version;
    zc_send_msg(z->router, rid, rl, &m);
}

// A weights_begin for another model's layout gets a layout_mismatch error naming both hashes: 1, else 0.
static int refuse_layout(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q, const char *what) {
    if (q->layout_hash == z->wr.layout_hash) return 0;
    char a[17], b[17];
    zmsg_hash_to_hex(q->layout_hash, a);
    zmsg_hash_to_hex(z->wr.layout_hash, b);
    zc_send_error(z->router, rid, rl, q->id, "layout_mismatch", "weights_begin: %s %s, this server's model has %s",
                  what, a, b);
    return 1;
}

// Transport nccl (rollout_server/weight_nccl.h): checks, then the receive runs on its own thread; the reply goes
// out at once so that the trainer ranks can start sending.
static void begin_nccl(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    char err[768];
    if (!weight_nccl_supported(z->wn, q->comm_backend, err, sizeof err)) {
        zc_send_error(z->router, rid, rl, q->id, "unsupported", "weights_begin: transport \"nccl\": %s; use transport "
                      "\"zmq\"", err);
        return;
    }
    if (refuse_layout(z, rid, rl, q, "layout hash")) return;
    weight_recv_reset(&z->wr);   // a zmq update still open is abandoned, as by any weights_begin
    int bad_engine, bad_shard, bad_unit;
    if (engine_group_device_staging_ready(z->g, &bad_engine, &bad_shard, &bad_unit) != 0) {
        zc_send_error(z->router, rid, rl, q->id, "out_of_memory", "weights_begin: no GPU memory on %s (tensor-parallel "
                      "shard %d) for the second copy of the weights that an NCCL update is received into (unit %d); "
                      "lower --kv-cache-memory", engine_group_device_name(z->g, bad_engine), bad_shard, bad_unit);
        return;
    }
    const int rc = weight_nccl_begin(z->wn, q, 0, err, sizeof err);
    if (rc != 0) {
        zc_send_error(z->router, rid, rl, q->id, rc == WEIGHT_NCCL_ESHARDS ? "layout_mismatch" : "internal",
                      "weights_begin: %s", err);
        return;
    }
    reply_begin(z, rid, rl, q);
}

// Transport ipc (rollout_server/weight_ipc.h): the reply carries the handles of the staging the trainer ranks write.
static void begin_ipc(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    char err[768];
    if (refuse_layout(z, rid, rl, q, "layout hash")) return;
    weight_recv_reset(&z->wr);   // a zmq update still open is abandoned, as by any weights_begin
    weight_nccl_stop(z->wn);     // an NCCL receive still running writes the device staging that ipc places
    ZmsgMsg m;
    zmsg_init(&m, ZMSG_WEIGHTS_BEGIN, ZMSG_DIR_REPLY, q->id);
    m.version = q->version;
    const int rc = weight_ipc_begin(z->wi, q, &m.ipc, err, sizeof err);
    if (rc != 0) {
        zc_send_error(z->router, rid, rl, q->id,
                      rc == WEIGHT_IPC_EUNSUPPORTED ? "unsupported"
                      : rc == WEIGHT_IPC_ESHARDS    ? "layout_mismatch"
                      : rc == WEIGHT_IPC_ENOMEM     ? "out_of_memory"
                                                    : "internal",
                      "weights_begin: %s", err);
        return;
    }
    zc_send_msg(z->router, rid, rl, &m);
}

// weights_end of an update received into the engines' device staging: over NCCL (the receive thread is waited for)
// or ipc (the trainer ranks have written engine 0's staging; it is spread to the other engines), then the commit.
static void end_device(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    char err[768];
    double received;
    const int ipc = weight_ipc_active(z->wi), adapter = !ipc && weight_nccl_adapter(z->wn);
    if ((ipc ? weight_ipc_finish(z->wi, q->version, &received, err, sizeof err)
             : weight_nccl_finish(z->wn, q->version, &received, err, sizeof err)) != 0) {
        fprintf(stderr, "tandem-serve: weight update to version %lld over %s failed; serving the previous "
                        "weights: %s\n", (long long)q->version, ipc ? "ipc" : "NCCL", err);
        zc_send_error(z->router, rid, rl, q->id, "internal", "weights_end: %s", err);
        return;
    }
    double t0 = zc_now();
    EngineCommitReport rep;
    int rc = adapter ? engine_group_commit_adapter(z->g, q->version, z->adapter_cfg, NULL, update_mode(z, q), &rep, err,
                                                   sizeof err)
                     : engine_group_commit_device_weights(z->g, q->version, update_mode(z, q), &rep, err, sizeof err);
    double t1 = zc_now();
    if (rc) {
        zc_send_error(z->router, rid, rl, q->id, zc_engine_code(rc), "weights_end: commit failed: %s", err);
        return;
    }
    reply_end(z, rid, rl, q, received + (t1 - t0), t1 - t0, &rep);
}

// ---- adapter updates (weights_begin with "adapter") ------------------------------------------------------------

void zc_adapter_free(ZmqControl *z) {
    weight_recv_free(&z->wa);
    for (int l = 0; z->adapter_units && l < z->adapter_layers; l++) free(z->adapter_units[l]);
    free(z->adapter_units);
    free(z->adapter_numel);
    free(z->adapter_cfg);
    z->adapter_units = NULL;
    z->adapter_numel = NULL;
    z->adapter_cfg = NULL;
    z->adapter_layers = 0;
    z->adapter_open = 0;
}

static void *adapter_staging_of(void *user, int unit, int *bf16) {
    ZmqControl *z = user;
    *bf16 = 0;   // adapter units stay fp32: they are merged into the weights on the host
    return unit >= 0 && unit < z->adapter_layers ? z->adapter_units[unit] : NULL;
}

// Keeps the adapters' config of the update being opened. Returns 0, or -1 after answering out_of_memory.
static int keep_adapter_cfg(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q, const LoraConfig *lc) {
    if (!z->adapter_cfg && !(z->adapter_cfg = malloc(sizeof *z->adapter_cfg))) {
        zc_send_error(z->router, rid, rl, q->id, "out_of_memory", "weights_begin: out of host memory");
        return -1;
    }
    *z->adapter_cfg = *lc;
    return 0;
}

// An adapter update over NCCL: the layers' adapter units go straight into engine 0's device staging (made here, so
// that a missing GPU memory is answered now), received by the NCCL thread; weights_end commits them from there.
static void begin_adapter_nccl(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q, const LoraConfig *lc) {
    char err[768];
    weight_recv_reset(&z->wr);   // whatever update was open is abandoned, as by any weights_begin
    weight_recv_reset(&z->wa);
    z->adapter_open = 0;
    weight_nccl_stop(z->wn);     // before the staging is (re)made: a receive still running writes into it
    const Model *m = engine_group_model(z->g);
    const size_t numel = model_lora_unit_numel(&m->cfg, lc);
    for (int k = 0; k < engine_group_size(z->g); k++)
        for (int layer = 0; layer < m->cfg.num_layers; layer++)
            if (!engine_adapter_device_staging(engine_group_engine(z->g, k), numel, layer)) {
                zc_send_error(z->router, rid, rl, q->id, "out_of_memory", "weights_begin: no GPU memory on %s for the "
                              "adapter units of layer %d (%zu MB in all); lower --kv-cache-memory",
                              engine_group_device_name(z->g, k), layer,
                              (size_t)m->cfg.num_layers * numel * 2 / 1000000);
                return;
            }
    if (keep_adapter_cfg(z, rid, rl, q, lc) != 0) return;
    if (weight_nccl_begin(z->wn, q, numel, err, sizeof err) != 0) {
        zc_send_error(z->router, rid, rl, q->id, "internal", "weights_begin: %s", err);
        return;
    }
    reply_begin(z, rid, rl, q);
}

// Opens an adapter update: the adapters' config from the message, a receiver over one unit per decoder layer and
// their host staging (kept from the previous adapter update when the size is the same).
static void begin_adapter(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    char err[768];
    if (q->transport == ZMSG_TRANSPORT_IPC) {
        zc_send_error(z->router, rid, rl, q->id, "unsupported", "weights_begin: adapter updates over transport \"ipc\" "
                      "are not supported; push merged weights (tandem-train --lora-sync merged) or use transport "
                      "\"nccl\" or \"zmq\"");
        return;
    }
    weight_ipc_abandon(z->wi);
    if (q->transport == ZMSG_TRANSPORT_NCCL && !weight_nccl_supported(z->wn, q->comm_backend, err, sizeof err)) {
        zc_send_error(z->router, rid, rl, q->id, "unsupported", "weights_begin: transport \"nccl\": %s; use transport "
                      "\"zmq\"", err);
        return;
    }
    if (refuse_layout(z, rid, rl, q, "adapters for base layout")) return;
    LoraConfig lc = {.r = q->adapter_r, .alpha = (float)q->adapter_alpha, .use_rslora = q->adapter_rslora};
    if (lora_parse_targets(q->adapter_targets, &lc.targets, err, sizeof err) != 0 ||
        lora_config_check(&lc, err, sizeof err) != 0) {
        zc_send_error(z->router, rid, rl, q->id, "bad_message", "weights_begin: adapter: %s", err);
        return;
    }
    if (q->transport == ZMSG_TRANSPORT_NCCL) {
        begin_adapter_nccl(z, rid, rl, q, &lc);
        return;
    }
    // Whatever update was open is abandoned, as by any weights_begin.
    weight_recv_reset(&z->wr);
    weight_nccl_stop(z->wn);   // an NCCL receive still running may write the adapter staging
    const Model *m = engine_group_model(z->g);
    const int L = m->cfg.num_layers;
    const size_t numel = model_lora_unit_numel(&m->cfg, &lc);
    if (!z->adapter_units || z->adapter_layers != L || z->adapter_numel[0] != numel) {
        zc_adapter_free(z);
        z->adapter_layers = L;
        z->adapter_units = calloc((size_t)L, sizeof *z->adapter_units);
        z->adapter_numel = malloc((size_t)L * sizeof *z->adapter_numel);
        int ok = z->adapter_units && z->adapter_numel;
        for (int l = 0; ok && l < L; l++) {
            z->adapter_numel[l] = numel;
            ok = (z->adapter_units[l] = calloc(numel, sizeof(float))) != NULL;
        }
        if (!ok || weight_recv_init_units(&z->wa, L, z->adapter_numel, z->wr.layout_hash, err, sizeof err) != 0) {
            zc_adapter_free(z);
            zc_send_error(z->router, rid, rl, q->id, "out_of_memory", "weights_begin: no host memory for the adapters "
                          "(%d layers of %zu values)", L, numel);
            return;
        }
    }
    if (keep_adapter_cfg(z, rid, rl, q, &lc) != 0) return;
    int64_t abandoned;
    if (weight_recv_begin(&z->wa, q->version, q->layout_hash, rid, rl, &abandoned, err, sizeof err) != 0) {
        zc_send_error(z->router, rid, rl, q->id, "layout_mismatch", "%s", err);
        return;
    }
    z->adapter_open = 1;
    reply_begin(z, rid, rl, q);
}

static void end_adapter(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    char err[768];
    if (weight_recv_ready(&z->wa, rid, rl, q->version, err, sizeof err)) {
        zc_send_error(z->router, rid, rl, q->id, "weights_incomplete", "%s", err);
        return;
    }
    const double t0 = zc_now();
    EngineCommitReport rep;
    const int rc = engine_group_commit_adapter(z->g, q->version, z->adapter_cfg, z->adapter_units, update_mode(z, q),
                                               &rep, err, sizeof err);
    const double t1 = zc_now(), total = t1 - z->wa.t_begin;
    weight_recv_reset(&z->wa);
    z->adapter_open = 0;
    if (rc) {
        zc_send_error(z->router, rid, rl, q->id, zc_engine_code(rc), "weights_end: commit failed: %s", err);
        return;
    }
    reply_end(z, rid, rl, q, total, t1 - t0, &rep);
}

void zc_weights(ZmqControl *z, const void *rid, size_t rl, const ZmsgMsg *q) {
    char err[768];
    if (q->type == ZMSG_WEIGHTS_BEGIN && q->has_adapter) {
        begin_adapter(z, rid, rl, q);
        return;
    }
    if (q->type == ZMSG_WEIGHTS_BEGIN) {   // a whole-weights update abandons an adapter update still open
        weight_recv_reset(&z->wa);
        z->adapter_open = 0;
    }
    if (z->adapter_open && q->type == ZMSG_WEIGHTS_SLICE) {
        if (weight_recv_slice(&z->wa, rid, rl, q->has_version, q->version, q->unit, q->offset, q->count, q->dtype,
                              q->slice_data, adapter_staging_of, z, err, sizeof err))
            zc_send_error(z->router, rid, rl, q->id, "bad_slice", "adapter update: %s", err);
        return;
    }
    if (z->adapter_open && q->type == ZMSG_WEIGHTS_END) {
        end_adapter(z, rid, rl, q);
        return;
    }
    if (q->type == ZMSG_WEIGHTS_BEGIN) {
        if (q->transport == ZMSG_TRANSPORT_IPC) {
            begin_ipc(z, rid, rl, q);
            return;
        }
        weight_ipc_abandon(z->wi);
        if (q->transport == ZMSG_TRANSPORT_NCCL) {
            begin_nccl(z, rid, rl, q);
            return;
        }
        weight_nccl_abandon(z->wn);
        int64_t abandoned;
        if (weight_recv_begin(&z->wr, q->version, q->layout_hash, rid, rl, &abandoned, err, sizeof err)) {
            zc_send_error(z->router, rid, rl, q->id, "layout_mismatch", "%s", err);
            return;
        }
        if (abandoned >= 0)
            fprintf(stderr, "zmq_control: weight update to version %lld abandoned by a new weights_begin\n",
                    (long long)abandoned);
        reply_begin(z, rid, rl, q);
    } else if (q->type == ZMSG_WEIGHTS_SLICE) {
        if (weight_recv_slice(&z->wr, rid, rl, q->has_version, q->version, q->unit, q->offset, q->count, q->dtype,
                              q->slice_data, staging_of, z->g, err, sizeof err))
            zc_send_error(z->router, rid, rl, q->id, "bad_slice", "%s", err);
    } else if (weight_ipc_active(z->wi) || weight_nccl_active(z->wn)) {
        end_device(z, rid, rl, q);
    } else {
        if (weight_recv_ready(&z->wr, rid, rl, q->version, err, sizeof err)) {
            zc_send_error(z->router, rid, rl, q->id, "weights_incomplete", "%s", err);
            return;
        }
        double t0 = zc_now();
        EngineCommitReport rep;
        int rc = engine_group_commit_weights(z->g, q->version, update_mode(z, q), &rep, err, sizeof err);
        double t1 = zc_now();
        double total = t1 - z->wr.t_begin;
        weight_recv_reset(&z->wr);
        if (rc) {
            zc_send_error(z->router, rid, rl, q->id, zc_engine_code(rc), "weights_end: commit failed: %s", err);
            return;
        }
        reply_end(z, rid, rl, q, total, t1 - t0, &rep);
    }
}
