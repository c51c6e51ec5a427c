// trainer/rank_watch.c — see trainer/rank_watch.h.
#include "trainer/rank_watch.h"

#include <stdio.h>
#include <stdlib.h>
#include <zmq.h>

#include "trainer/server_liveness.h"

struct RankWatch {
    const Comm *host;
    int rank, world;
    void *zctx;
    ServerLiveness *live;   // one slot per rank (this rank's stays empty)
    void **socks;           // (world) DEALERs to the other ranks' host endpoints
};

static int64_t rank_gone_ms(void *arg, int member) {
    RankWatch *w = arg;
    return member == w->rank || member < 0 || member >= w->world ? 0 : server_liveness_gone_ms(w->live, member);
}

static void rank_name(void *arg, int member, char *out, size_t len) {
    RankWatch *w = arg;
    const char *ep = comm_peer_endpoint(w->host, member);
    snprintf(out, len, "rank %d, %s", member, ep ? ep : "?");
}

void rank_watch_destroy(RankWatch *w) {
    if (!w) return;
    server_liveness_destroy(w->live);
    for (int p = 0; w->socks && p < w->world; p++)
        if (w->socks[p]) zmq_close(w->socks[p]);
    free(w->socks);
    if (w->zctx) zmq_ctx_term(w->zctx);
    free(w);
}

int rank_watch_create(RankWatch **out, const Comm *host, int rank, int world, char *err, size_t err_len) {
    *out = NULL;
    RankWatch *w = calloc(1, sizeof *w);
    if (!w || !(w->socks = calloc((size_t)world, sizeof *w->socks)) || !(w->zctx = zmq_ctx_new())) {
        snprintf(err, err_len, "out of memory for the ranks' liveness watch");
        rank_watch_destroy(w);
        return -1;
    }
    w->host = host;
    w->rank = rank;
    w->world = world;
    if (server_liveness_create(&w->live, w->zctx, world, err, err_len) != 0) goto fail;
    for (int p = 0; p < world; p++) {
        if (p == rank) continue;
        const char *ep = comm_peer_endpoint(host, p);
        int zero = 0;
        if (!ep || !(w->socks[p] = zmq_socket(w->zctx, ZMQ_DEALER)) ||
            zmq_setsockopt(w->socks[p], ZMQ_LINGER, &zero, sizeof zero) != 0) {
            snprintf(err, err_len, "cannot watch rank %d (endpoint %s): %s", p, ep ? ep : "unknown",
                     zmq_strerror(zmq_errno()));
            goto fail;
        }
        if (server_liveness_watch(w->live, p, w->socks[p], err, err_len) != 0) goto fail;
        if (zmq_connect(w->socks[p], ep) != 0) {
            snprintf(err, err_len, "cannot watch rank %d at %s: %s", p, ep, zmq_strerror(zmq_errno()));
            goto fail;
        }
    }
    *out = w;
    return 0;
fail:
    rank_watch_destroy(w);
    return -1;
}

CommPeerWatch rank_watch_peer_watch(RankWatch *w) {
    return (CommPeerWatch){.gone_ms = rank_gone_ms, .name = rank_name, .arg = w};
}
