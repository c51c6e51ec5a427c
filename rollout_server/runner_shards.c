// rollout_server/runner_shards.c — the tensor-parallel shards of a runner, driven in lock-step
// (model_runner_internal.h): one thread per shard 1..N-1 waiting for the next job, the shards' communicator, and the
// run of one job on every shard at once.
#include <stdio.h>

#include "rollout_server/model_runner_internal.h"

// Decode steps of up to this many sequences sum over the peer group.
#define RUNNER_PEER_ROWS 64

// Joins shard k to the shards' communicator.
static int shard_join(ModelRunner *r, int k) {
    RunnerShard *s = &r->shards[k];
    // On CUDA the shards' communicator is blocking (comm_create_local_group): its calls can be recorded in graphs.
    if (comm_create_local_group(&s->comm, r->comm_backend, r->comm_id, k, r->tp, r->comm_timeout_ms, s->ops, s->err,
                                sizeof s->err) != 0)
        return -1;
    s->m.shard.comm = s->comm;
    return 0;
}

static int shard_run(ModelRunner *r, int k, ShardJob job) {
    RunnerShard *s = &r->shards[k];
    s->err[0] = '\0';
    switch (job) {
    case SHARD_JOB_JOIN: return shard_join(r, k);
    case SHARD_JOB_STEP: return runner_shard_step(r, k);
    case SHARD_JOB_SCORE: return runner_shard_score(r, k);
    default: return 0;
    }
}

static void *shard_thread(void *arg) {
    ModelRunner *r = ((RunnerShard *)arg)->runner;
    const int k = ((RunnerShard *)arg)->index;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        while (r->job_seq == seen) pthread_cond_wait(&r->go, &r->mu);
        seen = r->job_seq;
        const ShardJob job = r->job;
        pthread_mutex_unlock(&r->mu);
        if (job == SHARD_JOB_EXIT) return NULL;
        const int rc = shard_run(r, k, job);
        pthread_mutex_lock(&r->mu);
        r->shards[k].rc = rc;
        if (--r->pending == 0) pthread_cond_signal(&r->done);
        pthread_mutex_unlock(&r->mu);
    }
}

int runner_shards_run(ModelRunner *r, ShardJob job, char *err, size_t err_len) {
    if (r->tp == 1) {
        if (shard_run(r, 0, job) == 0) return 0;
        snprintf(err, err_len, "%s", r->shards[0].err);
        return -1;
    }
    pthread_mutex_lock(&r->mu);
    r->job = job;
    r->pending = r->tp - 1;
    r->job_seq++;
    pthread_cond_broadcast(&r->go);
    pthread_mutex_unlock(&r->mu);
    r->shards[0].rc = shard_run(r, 0, job);
    pthread_mutex_lock(&r->mu);
    while (r->pending > 0) pthread_cond_wait(&r->done, &r->mu);
    pthread_mutex_unlock(&r->mu);
    for (int k = 0; k < r->tp; k++)
        if (r->shards[k].rc != 0) {
            snprintf(err, err_len, "tensor-parallel shard %d of %d: %s", k, r->tp,
                     r->shards[k].err[0] ? r->shards[k].err : "failed");
            return -1;
        }
    return 0;
}

int runner_shards_start(ModelRunner *r, char *err, size_t err_len) {
    if (r->tp == 1) return 0;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->go, NULL);
    pthread_cond_init(&r->done, NULL);
    r->have_sync = 1;
    // Every shard joins within the minute (they are threads of this process); afterwards a collective that waits
    // two minutes for another shard means that shard's device is wedged: the step fails instead of hanging.
    r->comm_timeout_ms = 60000;
    // The shards are threads of this process: the host backend's rendezvous (shard 0's) is on the loopback.
    if ((r->comm_backend == COMM_BACKEND_NCCL ? comm_unique_id(COMM_BACKEND_NCCL, r->comm_id, err, err_len)
                                              : comm_unique_id_host("127.0.0.1", r->comm_id, err, err_len)) != 0)
        return ENGINE_EINTERNAL;
    for (int k = 1; k < r->tp; k++) {
        r->shards[k].runner = r;
        r->shards[k].index = k;
        if (pthread_create(&r->shards[k].thread, NULL, shard_thread, &r->shards[k]) != 0) {
            snprintf(err, err_len, "cannot start the thread of tensor-parallel shard %d", k);
            return ENGINE_EINTERNAL;
        }
        r->shards[k].have_thread = 1;
    }
    char msg[1024];
    if (runner_shards_run(r, SHARD_JOB_JOIN, msg, sizeof msg) != 0) {
        snprintf(err, err_len, "joining the %d tensor-parallel shards: %s", r->tp, msg);
        return ENGINE_EINTERNAL;
    }
    for (int k = 0; k < r->tp; k++) comm_set_timeout(r->shards[k].comm, 120000);
    // The sums of a decode step (a few rows of hidden_size) go through a peer group: one kernel each on the shard's
    // stream instead of a collective call (kernels/ops.h). Up to RUNNER_PEER_ROWS rows; prefill's larger sums stay
    // on the communicator, whose ring uses the links better for them. Without peer access between the devices all
    // sums stay there.
    OpsCtx *ctxs[OPS_PEER_MAX];
    for (int k = 0; k < r->tp; k++) ctxs[k] = r->shards[k].ops;
    if (r->tp <= OPS_PEER_MAX &&
        ops_peer_group_create(&r->peers, ctxs, r->tp, (size_t)RUNNER_PEER_ROWS * r->whole.cfg.hidden_size, 120.0, msg,
                              sizeof msg) == 0) {
        for (int k = 0; k < r->tp; k++) r->shards[k].m.shard.peers = r->peers;
        fprintf(stderr, "tandem-serve: the %d tensor-parallel shards sum up to %d rows a step through each other's "
                "memory, more over the communicator\n", r->tp, RUNNER_PEER_ROWS);
    } else {
        fprintf(stderr, "tandem-serve: the %d tensor-parallel shards sum over the communicator alone: %s\n", r->tp,
                r->tp <= OPS_PEER_MAX ? msg : "more shards than a peer group holds");
    }
    return 0;
}

void runner_shards_stop(ModelRunner *r) {
    if (!r->have_sync) return;
    for (int k = 0; k < r->tp; k++) r->shards[k].m.shard.peers = NULL;
    ops_peer_group_destroy(r->peers);
    r->peers = NULL;
    pthread_mutex_lock(&r->mu);
    r->job = SHARD_JOB_EXIT;
    r->job_seq++;
    pthread_cond_broadcast(&r->go);
    pthread_mutex_unlock(&r->mu);
    for (int k = 1; k < r->tp; k++)
        if (r->shards[k].have_thread) pthread_join(r->shards[k].thread, NULL);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->go);
    pthread_cond_destroy(&r->done);
    r->have_sync = 0;
}
