// shared/comm/rendezvous.c — rank 0's ZeroMQ rendezvous: registrations in, peer table + blob out (rendezvous.h).
//
// Wire format (one ZeroMQ message each; JSON in frame 0, strict: unknown keys are refused):
//   rank -> 0 : {"type":"register","version":2,"rank":r,"world_size":W,"pid":p,"hostname":h,"endpoint":e,
//                "node":n,"nnodes":K,"local_world_size":L}
//   0 -> rank : {"type":"table","version":2,"world_size":W,"peers":[{rank,pid,hostname,endpoint}...]}
//               + frame 1: rank 0's blob (possibly empty)
//   rank -> 0 : {"type":"barrier","rank":r,"round":k}     0 -> rank : {"type":"barrier_done","round":k}
//   0 -> rank : {"type":"error","message":m}              (any time; the receiver fails with m)
#include "shared/err.h"
#include "shared/comm/rendezvous.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "shared/json_read.h"

#define RDZV_ID_MAX 256               // ZeroMQ routing ids are at most 255 bytes
#define RDZV_IN_MAX (64 << 10)        // rank 0 refuses bigger incoming messages (strangers on the port)
#define RDZV_CLOSE_LINGER_MS 2000     // rank 0 flushes its last answers this long at close
#define RDZV_LIST_MAX 32              // ranks listed by name in one error message

struct Rendezvous {
    void *zctx;
    void *sock;                       // rank 0: ROUTER bound at MASTER_ADDR:MASTER_PORT; others: DEALER
    int rank, world;
    int node, nnodes, local_world_size; // this rank's (rank 0: what every registration must match)
    RdzvPeer *peers;                  // (world)
    unsigned char *blob;
    size_t blob_len;
    unsigned char (*ids)[RDZV_ID_MAX];// rank 0: (world) routing id of each rank's DEALER; [0] unused
    size_t *id_len;                   // (world)
    int round;                        // barriers completed
    int failed;
    char master[RDZV_ENDPOINT_MAX + 16];
};

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int is_ipv6_literal(const char *a) { return strchr(a, ':') != NULL; }

// "tcp://host:port", with brackets around an IPv6 literal. bind: a host name becomes "*", because ZeroMQ
// binds only to numeric addresses or interface names (MASTER_ADDR is often a DNS name in a cluster).
static void master_endpoint(char *out, size_t len, const char *addr, int port, int bind) {
    unsigned char tmp[16];
    if (is_ipv6_literal(addr))
        snprintf(out, len, "tcp://[%s]:%d", addr, port);
    else if (bind && inet_pton(AF_INET, addr, tmp) != 1)
        snprintf(out, len, "tcp://*:%d", port);
    else
        snprintf(out, len, "tcp://%s:%d", addr, port);
}

void rendezvous_endpoint_split(const char *endpoint, char *addr, size_t addr_len, int *port) {
    const char *at = strstr(endpoint, "://");
    at = at ? at + 3 : endpoint;
    const int bracket = *at == '[';
    snprintf(addr, addr_len, "%s", at + bracket);
    char *colon = bracket ? strchr(addr, ']') : strrchr(addr, ':');
    const char *port_text = colon ? (bracket ? strchr(colon, ':') : colon) : NULL;
    *port = port_text ? atoi(port_text + 1) : 0;
    if (colon) *colon = '\0';
}

int rendezvous_local_address(const char *master_addr, int master_port, char *out, size_t out_len, char *err,
                             size_t err_len) {
    if (!master_addr || !*master_addr) return err_fail(err, err_len, "MASTER_ADDR is empty");
    char port[16];
    snprintf(port, sizeof port, "%d", master_port);
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    int rc = getaddrinfo(master_addr, port, &hints, &res);
    if (rc != 0) return err_fail(err, err_len, "cannot resolve MASTER_ADDR '%s': %s", master_addr, gai_strerror(rc));
    // A connected UDP socket makes the kernel pick the route and source address; no packet is sent.
    int fd = socket(res->ai_family, SOCK_DGRAM, 0);
    if (fd < 0 || connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
        int e = errno;
        if (fd >= 0) close(fd);
        freeaddrinfo(res);
        return err_fail(err, err_len, "no route to MASTER_ADDR '%s': %s", master_addr, strerror(e));
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    rc = getsockname(fd, (struct sockaddr *)&ss, &sl);
    close(fd);
    freeaddrinfo(res);
    if (rc != 0) return err_fail(err, err_len, "getsockname: %s", strerror(errno));
    const void *a = ss.ss_family == AF_INET6 ? (const void *)&((struct sockaddr_in6 *)&ss)->sin6_addr
                                             : (const void *)&((struct sockaddr_in *)&ss)->sin_addr;
    if (!inet_ntop(ss.ss_family, a, out, (socklen_t)out_len))
        return err_fail(err, err_len, "inet_ntop: %s", strerror(errno));
    return 0;
}

// The caller's cancel hook (RdzvConfig.cancelled): 1 with err set when it says to give up.
static int cancelled(const Rendezvous *r, const RdzvConfig *cfg, char *err, size_t err_len) {
    char why[768] = "";
    if (!cfg || !cfg->cancelled || !cfg->cancelled(cfg->cancel_arg, why, sizeof why)) return 0;
    err_fail(err, err_len, "rendezvous at %s: %s", r->master, why[0] ? why : "cancelled by the caller");
    return 1;
}

// How long one wait may last: `left`, at most until the next progress line, at most a cancel tick with a hook.
static long poll_slice(const RdzvConfig *cfg, int64_t now, int64_t next_progress, int64_t left) {
    int64_t slice = cfg && cfg->progress && next_progress - now < left ? next_progress - now : left;
    if (cfg && cfg->cancelled && slice > RDZV_CANCEL_TICK_MS) slice = RDZV_CANCEL_TICK_MS;
    return (long)(slice > 0 ? slice : 0);
}

// Appends "a, b, c" of the ranks r with flag[r] == want (at most RDZV_LIST_MAX named).
static void rank_list(char *out, size_t len, const unsigned char *flag, int world, int want) {
    size_t used = 0;
    int listed = 0, more = 0;
    out[0] = '\0';
    for (int r = 0; r < world; r++) {
        if ((flag[r] != 0) != (want != 0)) continue;
        if (listed == RDZV_LIST_MAX) { more++; continue; }
        int n = snprintf(out + used, len - used, "%s%d", listed ? ", " : "", r);
        if (n < 0 || (size_t)n >= len - used) break;
        used += (size_t)n;
        listed++;
    }
    if (more) snprintf(out + used, len - used, " and %d more", more);
    if (!listed) snprintf(out, len, "none");
}

// Sends [id] json [blob] without blocking (control messages are small; a full queue is an error).
static int send_json(void *sock, const unsigned char *id, size_t id_len, json_t *j, const void *blob,
                     size_t blob_len, int with_blob) {
    char *text = json_dumps(j, JSON_COMPACT);
    if (!text) return -1;
    int rc = 0;
    if (id && zmq_send(sock, id, id_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) rc = -1;
    if (rc == 0 && zmq_send(sock, text, strlen(text), (with_blob ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT) < 0) rc = -1;
    if (rc == 0 && with_blob && zmq_send(sock, blob_len ? blob : "", blob_len, ZMQ_DONTWAIT) < 0) rc = -1;
    free(text);
    return rc;
}

static void send_error_to(void *sock, const unsigned char *id, size_t id_len, const char *msg) {
    json_t *j = json_pack("{s:s, s:s}", "type", "error", "message", msg);
    if (j) send_json(sock, id, id_len, j, NULL, 0, 0);   // best effort: the receiver may be gone already
    json_decref(j);
}

// Rank 0: tells every rank that has arrived (have[r]) about a failure; extra = the offending sender.
static void broadcast_error(Rendezvous *r, const unsigned char *have, const unsigned char *extra,
                            size_t extra_len, const char *msg) {
    for (int k = 1; k < r->world; k++)
        if (have[k]) send_error_to(r->sock, r->ids[k], r->id_len[k], msg);
    if (extra) send_error_to(r->sock, extra, extra_len, msg);
}

// Receives one whole message: up to max_frames frames into f (initialised here), *n = count. Extra frames
// are dropped and reported as n = max_frames + 1.
static int recv_frames(void *sock, zmq_msg_t *f, int max_frames, int *n) {
    *n = 0;
    int more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            for (int i = 0; i < *n && i < max_frames; i++) zmq_msg_close(&f[i]);
            return -1;
        }
        more = zmq_msg_more(&m);
        if (*n < max_frames) f[*n] = m;
        else zmq_msg_close(&m);
        (*n)++;
    }
    if (*n > max_frames) *n = max_frames + 1;
    return 0;
}

static void close_frames(zmq_msg_t *f, int n, int max_frames) {
    for (int i = 0; i < n && i < max_frames; i++) zmq_msg_close(&f[i]);
}

static json_t *parse_json(zmq_msg_t *m) {
    json_error_t je;
    return json_read_buffer(zmq_msg_data(m), zmq_msg_size(m), JSON_REJECT_DUPLICATES, &je);
}

// Rank 0: one incoming register. Returns 1 accepted, 0 refused without harm (a stranger or a garbled
// message: it gets an error reply), -1 fatal for the group (err set, everyone told).
static int handle_register(Rendezvous *r, unsigned char *have, const unsigned char *id, size_t id_len,
                           zmq_msg_t *body, char *err, size_t err_len) {
    json_t *j = parse_json(body);
    const char *type = "", *host = "", *ep = "";
    json_int_t ver = 0, rank = -1, world = 0, pid = 0, node = -1, nnodes = 0, lws = 0;
    json_error_t je;
    // The version first: a rank of another build is named as such, whatever else its message holds.
    int ok = j && json_unpack_ex(j, &je, 0, "{s:s, s:I}", "type", &type, "version", &ver) == 0 &&
             strcmp(type, "register") == 0;
    if (ok && ver == RDZV_PROTOCOL_VERSION)
        ok = json_unpack_ex(j, &je, JSON_STRICT, "{s:s, s:I, s:I, s:I, s:I, s:s, s:s, s:I, s:I, s:I}", "type", &type,
                            "version", &ver, "rank", &rank, "world_size", &world, "pid", &pid, "hostname", &host,
                            "endpoint", &ep, "node", &node, "nnodes", &nnodes, "local_world_size", &lws) == 0;
    else if (ok)
        json_unpack_ex(j, &je, 0, "{s?I, s?I, s?s}", "rank", &rank, "pid", &pid, "hostname", &host);
    if (!ok || strlen(host) >= RDZV_HOST_MAX || strlen(ep) >= RDZV_ENDPOINT_MAX) {
        send_error_to(r->sock, id, id_len,
                      "rendezvous: expected a register message {type, version, rank, world_size, pid, hostname, "
                      "endpoint, node, nnodes, local_world_size} with hostname and endpoint under 256 bytes");
        json_decref(j);
        return 0;
    }
    int rc = 1;
    if (ver != RDZV_PROTOCOL_VERSION) {
        err_fail(err, err_len, "rendezvous: rank %lld (host %s, pid %lld) speaks protocol version %lld, rank 0 speaks %d "
             "(mixed builds?)", (long long)rank, host, (long long)pid, (long long)ver, RDZV_PROTOCOL_VERSION);
        rc = -1;
    } else if (world != r->world) {
        err_fail(err, err_len, "rendezvous: rank %lld (host %s, pid %lld) has WORLD_SIZE %lld but rank 0 has WORLD_SIZE %d",
             (long long)rank, host, (long long)pid, (long long)world, r->world);
        rc = -1;
    } else if (rank < 0 || rank >= r->world) {
        err_fail(err, err_len, "rendezvous: rank %lld (host %s, pid %lld) is outside WORLD_SIZE %d", (long long)rank,
             host, (long long)pid, r->world);
        rc = -1;
    } else if (nnodes != r->nnodes || lws != r->local_world_size || node != rank / r->local_world_size) {
        err_fail(err, err_len, "rendezvous: rank %lld (host %s, pid %lld) is on node %lld of NNODES %lld with "
                 "LOCAL_WORLD_SIZE %lld, but rank 0 has NNODES %d and LOCAL_WORLD_SIZE %d, which put rank %lld on node "
                 "%lld (ranks are numbered node by node)", (long long)rank, host, (long long)pid, (long long)node,
                 (long long)nnodes, (long long)lws, r->nnodes, r->local_world_size, (long long)rank,
                 (long long)(rank / r->local_world_size));
        rc = -1;
    } else if (have[rank]) {
        const RdzvPeer *p = &r->peers[rank];
        err_fail(err, err_len, "rendezvous: rank %lld registered twice (host %s, pid %d and host %s, pid %lld): "
             "duplicate RANK", (long long)rank, p->hostname, p->pid, host, (long long)pid);
        rc = -1;
    }
    if (rc < 0) {
        broadcast_error(r, have, id, id_len, err);
    } else {
        RdzvPeer *p = &r->peers[rank];
        p->rank = (int)rank;
        p->pid = (int)pid;
        snprintf(p->hostname, sizeof p->hostname, "%s", host);
        snprintf(p->endpoint, sizeof p->endpoint, "%s", ep);
        memcpy(r->ids[rank], id, id_len);
        r->id_len[rank] = id_len;
        have[rank] = 1;
    }
    json_decref(j);
    return rc;
}

static json_t *table_json(const Rendezvous *r) {
    json_t *peers = json_array();
    for (int k = 0; k < r->world; k++)
        json_array_append_new(peers, json_pack("{s:i, s:i, s:s, s:s}", "rank", k, "pid", r->peers[k].pid,
                                               "hostname", r->peers[k].hostname, "endpoint", r->peers[k].endpoint));
    return json_pack("{s:s, s:i, s:i, s:o}", "type", "table", "version", RDZV_PROTOCOL_VERSION, "world_size",
                     r->world, "peers", peers);
}

// "node map: node 0 (host a): ranks 0-1; node 1 (host b): ranks 2-3", through the progress function. A node
// whose ranks report different host names lists them all (one host per node is what the launch contract
// promises; containers may name themselves apart).
static void say_node_map(const Rendezvous *r, const RdzvConfig *cfg) {
    size_t cap = 64 + (size_t)r->nnodes * (2 * RDZV_HOST_MAX + 64);
    char *line = malloc(cap);
    if (!line) return;
    size_t n = (size_t)snprintf(line, cap, "node map (%d node%s of %d rank%s):", r->nnodes, r->nnodes > 1 ? "s" : "",
                                r->local_world_size, r->local_world_size > 1 ? "s" : "");
    for (int k = 0; k < r->nnodes && n < cap; k++) {
        int first = k * r->local_world_size, last = first + r->local_world_size - 1;
        const char *host = r->peers[first].hostname, *other = NULL;
        for (int q = first + 1; q <= last; q++)
            if (strcmp(r->peers[q].hostname, host) != 0) other = r->peers[q].hostname;
        n += (size_t)snprintf(line + n, cap - n, "%s node %d (host %s%s%s): rank%s %d", k ? ";" : "", k, host,
                              other ? ", " : "", other ? other : "", first == last ? "" : "s", first);
        if (last > first && n < cap) n += (size_t)snprintf(line + n, cap - n, "-%d", last);
    }
    cfg->progress(cfg->progress_arg, line);
    free(line);
}

static int run_rank0(Rendezvous *r, const RdzvConfig *cfg, char *err, size_t err_len) {
    char bind_ep[RDZV_ENDPOINT_MAX + 16];
    master_endpoint(bind_ep, sizeof bind_ep, cfg->master_addr, cfg->master_port, 1);
    r->sock = zmq_socket(r->zctx, ZMQ_ROUTER);
    if (!r->sock) return err_fail(err, err_len, "rendezvous: zmq_socket: %s", zmq_strerror(zmq_errno()));
    int one = 1, linger = RDZV_CLOSE_LINGER_MS;
    int64_t maxsz = RDZV_IN_MAX;
    zmq_setsockopt(r->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    zmq_setsockopt(r->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(r->sock, ZMQ_MAXMSGSIZE, &maxsz, sizeof maxsz);
    if (is_ipv6_literal(cfg->master_addr)) zmq_setsockopt(r->sock, ZMQ_IPV6, &one, sizeof one);
    if (zmq_bind(r->sock, bind_ep) != 0)
        return err_fail(err, err_len, "rendezvous: rank 0 cannot bind %s (MASTER_ADDR/%s): %s", bind_ep,
                        cfg->port_source ? cfg->port_source : "MASTER_PORT", zmq_strerror(zmq_errno()));

    unsigned char *have = calloc((size_t)r->world, 1);
    if (!have) return err_fail(err, err_len, "rendezvous: out of memory");
    have[0] = 1;
    int n_have = 1, rc = 0;
    const int every = cfg->progress_ms > 0 ? cfg->progress_ms : RDZV_PROGRESS_MS;
    int64_t start = now_ms(), deadline = start + cfg->timeout_ms, next_progress = start + every;
    while (n_have < r->world) {
        int64_t now = now_ms(), left = deadline - now;
        if (cfg->progress && now >= next_progress && left > 0) {
            char missing[512], arrived[512], line[1400];
            rank_list(missing, sizeof missing, have, r->world, 0);
            rank_list(arrived, sizeof arrived, have, r->world, 1);
            snprintf(line, sizeof line, "rendezvous at %s: waiting for rank%s %s of WORLD_SIZE %d (arrived: %s): "
                     "%lld s of at most %d s", r->master, r->world - n_have > 1 ? "s" : "", missing, r->world, arrived,
                     (long long)((now - start) / 1000), cfg->timeout_ms / 1000);
            cfg->progress(cfg->progress_arg, line);
            while (next_progress <= now) next_progress += every;
        }
        if (cancelled(r, cfg, err, err_len)) {
            broadcast_error(r, have, NULL, 0, err);
            rc = -1;
            break;
        }
        if (left <= 0) {
            char missing[512], arrived[512];
            rank_list(missing, sizeof missing, have, r->world, 0);
            rank_list(arrived, sizeof arrived, have, r->world, 1);
            err_fail(err, err_len, "rendezvous at %s: rank%s %s of WORLD_SIZE %d did not arrive within %d ms "
                 "(arrived: %s)", r->master, r->world - n_have > 1 ? "s" : "", missing, r->world, cfg->timeout_ms,
                 arrived);
            broadcast_error(r, have, NULL, 0, err);
            rc = -1;
            break;
        }
        zmq_pollitem_t it = {r->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, poll_slice(cfg, now, next_progress, left)) < 0 && zmq_errno() != EINTR) {
            rc = err_fail(err, err_len, "rendezvous: zmq_poll: %s", zmq_strerror(zmq_errno()));
            break;
        }
        if (!(it.revents & ZMQ_POLLIN)) continue;
        zmq_msg_t f[2];
        int n = 0;
        if (recv_frames(r->sock, f, 2, &n) != 0) continue;
        if (n == 2 && zmq_msg_size(&f[0]) < RDZV_ID_MAX) {
            int h = handle_register(r, have, zmq_msg_data(&f[0]), zmq_msg_size(&f[0]), &f[1], err, err_len);
            n_have += h > 0;
            if (h < 0) rc = -1;
        } else if (n >= 1 && zmq_msg_size(&f[0]) < RDZV_ID_MAX) {
            send_error_to(r->sock, zmq_msg_data(&f[0]), zmq_msg_size(&f[0]), "rendezvous: expected one JSON frame");
        }
        close_frames(f, n, 2);
        if (rc < 0) break;
    }
    if (rc == 0) {
        json_t *t = table_json(r);
        for (int k = 1; k < r->world && rc == 0; k++)
            if (!t || send_json(r->sock, r->ids[k], r->id_len[k], t, r->blob, r->blob_len, 1) != 0) {
                err_fail(err, err_len, "rendezvous: rank %d (host %s, pid %d) went away after registering: %s", k,
                     r->peers[k].hostname, r->peers[k].pid, zmq_strerror(zmq_errno()));
                broadcast_error(r, have, NULL, 0, err);
                rc = -1;
            }
        json_decref(t);
    }
    if (rc == 0 && cfg->progress) say_node_map(r, cfg);
    free(have);
    return rc;
}

// Other ranks: parses rank 0's answer (table + blob, or an error).
static int parse_answer(Rendezvous *r, zmq_msg_t *f, int n, char *err, size_t err_len) {
    json_t *j = parse_json(&f[0]);
    json_error_t je;
    const char *type = "", *msg = "";
    json_t *peers = NULL;
    json_int_t ver = 0, world = 0;
    int rc = -1;
    if (j && json_unpack_ex(j, &je, 0, "{s:s}", "type", &type) == 0 && strcmp(type, "error") == 0 &&
        json_unpack_ex(j, &je, JSON_STRICT, "{s:s, s:s}", "type", &type, "message", &msg) == 0) {
        err_fail(err, err_len, "%s (reported by rank 0 at %s)", msg, r->master);
    } else if (!j || n != 2 ||
               json_unpack_ex(j, &je, JSON_STRICT, "{s:s, s:I, s:I, s:o}", "type", &type, "version", &ver,
                              "world_size", &world, "peers", &peers) != 0 || strcmp(type, "table") != 0) {
        err_fail(err, err_len, "rendezvous: rank 0 at %s sent a malformed answer (expected a peer table)", r->master);
    } else if (ver != RDZV_PROTOCOL_VERSION || world != r->world || !json_is_array(peers) ||
               json_array_size(peers) != (size_t)r->world || zmq_msg_size(&f[1]) > RDZV_BLOB_MAX) {
        err_fail(err, err_len, "rendezvous: rank 0's table (version %lld, WORLD_SIZE %lld) does not match this rank "
             "(version %d, WORLD_SIZE %d)", (long long)ver, (long long)world, RDZV_PROTOCOL_VERSION, r->world);
    } else {
        rc = 0;
        for (int k = 0; k < r->world && rc == 0; k++) {
            json_int_t pr = -1, pid = 0;
            const char *host = "", *ep = "";
            if (json_unpack_ex(json_array_get(peers, (size_t)k), &je, JSON_STRICT, "{s:I, s:I, s:s, s:s}", "rank",
                               &pr, "pid", &pid, "hostname", &host, "endpoint", &ep) != 0 || pr != k ||
                strlen(host) >= RDZV_HOST_MAX || strlen(ep) >= RDZV_ENDPOINT_MAX) {
                rc = err_fail(err, err_len, "rendezvous: entry %d of rank 0's peer table is malformed", k);
                break;
            }
            r->peers[k].rank = k;
            r->peers[k].pid = (int)pid;
            snprintf(r->peers[k].hostname, RDZV_HOST_MAX, "%s", host);
            snprintf(r->peers[k].endpoint, RDZV_ENDPOINT_MAX, "%s", ep);
        }
        size_t bl = zmq_msg_size(&f[1]);
        if (rc == 0 && bl) {
            r->blob = malloc(bl);
            if (!r->blob) rc = err_fail(err, err_len, "rendezvous: out of memory");
            else memcpy(r->blob, zmq_msg_data(&f[1]), bl), r->blob_len = bl;
        }
    }
    json_decref(j);
    return rc;
}

// Other ranks: waits up to wait_ms for rank 0's answer to what was just sent. frames: 1 (barrier) or 2.
static int await_answer(Rendezvous *r, int wait_ms, zmq_msg_t *f, int *n, const char *what,
                        const RdzvConfig *cfg, char *err, size_t err_len) {
    const int every = cfg && cfg->progress_ms > 0 ? cfg->progress_ms : RDZV_PROGRESS_MS;
    int64_t start = now_ms(), deadline = start + wait_ms, next_progress = start + every;
    for (;;) {
        int64_t now = now_ms(), left = deadline - now;
        if (cancelled(r, cfg, err, err_len)) return -1;
        if (left <= 0)
            return err_fail(err, err_len, "rendezvous: no answer from rank 0 at %s to the %s within %d ms (is rank 0 "
                        "running, and are MASTER_ADDR/%s right?)", r->master, what, wait_ms,
                            cfg && cfg->port_source ? cfg->port_source : "MASTER_PORT");
        if (cfg && cfg->progress && now >= next_progress) {
            char line[700];
            snprintf(line, sizeof line, "rendezvous: rank %d waiting for rank 0 at %s to answer the %s (it answers "
                     "once all %d ranks have registered): %lld s of at most %d s", r->rank, r->master, what, r->world,
                     (long long)((now - start) / 1000), wait_ms / 1000);
            cfg->progress(cfg->progress_arg, line);
            while (next_progress <= now) next_progress += every;
        }
        zmq_pollitem_t it = {r->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, poll_slice(cfg, now, next_progress, left)) < 0 && zmq_errno() != EINTR)
            return err_fail(err, err_len, "rendezvous: zmq_poll: %s", zmq_strerror(zmq_errno()));
        if ((it.revents & ZMQ_POLLIN) && recv_frames(r->sock, f, 2, n) == 0) {
            if (*n <= 2) return 0;
            close_frames(f, *n, 2);
        }
    }
}

static int run_other(Rendezvous *r, const RdzvConfig *cfg, char *err, size_t err_len) {
    r->sock = zmq_socket(r->zctx, ZMQ_DEALER);
    if (!r->sock) return err_fail(err, err_len, "rendezvous: zmq_socket: %s", zmq_strerror(zmq_errno()));
    int one = 1, zero = 0;
    zmq_setsockopt(r->sock, ZMQ_LINGER, &zero, sizeof zero);   // we wait for answers; nothing to flush at close
    if (is_ipv6_literal(cfg->master_addr)) zmq_setsockopt(r->sock, ZMQ_IPV6, &one, sizeof one);
    // Connecting before rank 0 has bound is fine: ZeroMQ retries and delivers the queued register.
    if (zmq_connect(r->sock, r->master) != 0)
        return err_fail(err, err_len, "rendezvous: cannot connect to %s: %s", r->master, zmq_strerror(zmq_errno()));
    const RdzvPeer *me = &r->peers[r->rank];
    json_t *j = json_pack("{s:s, s:i, s:i, s:i, s:i, s:s, s:s, s:i, s:i, s:i}", "type", "register", "version",
                          RDZV_PROTOCOL_VERSION, "rank", r->rank, "world_size", r->world, "pid", me->pid,
                          "hostname", me->hostname, "endpoint", me->endpoint, "node", r->node, "nnodes", r->nnodes,
                          "local_world_size", r->local_world_size);
    int rc = j ? send_json(r->sock, NULL, 0, j, NULL, 0, 0) : -1;
    json_decref(j);
    if (rc != 0) return err_fail(err, err_len, "rendezvous: cannot send the registration: %s", zmq_strerror(zmq_errno()));
    zmq_msg_t f[2];
    int n = 0;
    int64_t wait = 2 * (int64_t)cfg->timeout_ms;
    if (await_answer(r, wait > INT32_MAX ? INT32_MAX : (int)wait, f, &n, "registration", cfg, err, err_len) != 0)
        return -1;
    rc = parse_answer(r, f, n, err, err_len);
    close_frames(f, n, 2);
    return rc;
}

int rendezvous_run(Rendezvous **out, const RdzvConfig *cfg, const void *blob, size_t blob_len, char *err,
                   size_t err_len) {
    if (!out || !cfg) return err_fail(err, err_len, "rendezvous_run: NULL argument");
    *out = NULL;
    if (cfg->world_size < 1) return err_fail(err, err_len, "rendezvous: WORLD_SIZE %d must be >= 1", cfg->world_size);
    if (cfg->rank < 0 || cfg->rank >= cfg->world_size)
        return err_fail(err, err_len, "rendezvous: RANK %d is outside WORLD_SIZE %d", cfg->rank, cfg->world_size);
    if (!cfg->master_addr || !*cfg->master_addr || strlen(cfg->master_addr) >= RDZV_ENDPOINT_MAX)
        return err_fail(err, err_len, "rendezvous: MASTER_ADDR is empty or longer than %d bytes", RDZV_ENDPOINT_MAX - 1);
    if (cfg->master_port < 1 || cfg->master_port > 65535)
        return err_fail(err, err_len, "rendezvous: MASTER_PORT %d is outside 1..65535", cfg->master_port);
    if (cfg->timeout_ms <= 0) return err_fail(err, err_len, "rendezvous: timeout %d ms must be > 0", cfg->timeout_ms);
    if (cfg->endpoint && strlen(cfg->endpoint) >= RDZV_ENDPOINT_MAX)
        return err_fail(err, err_len, "rendezvous: endpoint longer than %d bytes", RDZV_ENDPOINT_MAX - 1);
    int nnodes = cfg->nnodes > 0 ? cfg->nnodes : 1, lws = cfg->nnodes > 0 ? cfg->local_world_size : cfg->world_size;
    int node = cfg->nnodes > 0 ? cfg->node : 0;
    if (lws < 1 || nnodes * lws != cfg->world_size || node < 0 || node >= nnodes || node != cfg->rank / lws)
        return err_fail(err, err_len, "rendezvous: rank %d on node %d of %d nodes x LOCAL_WORLD_SIZE %d does not fit "
                        "WORLD_SIZE %d (ranks are numbered node by node)", cfg->rank, node, nnodes, lws,
                        cfg->world_size);
    if (cfg->rank == 0 && blob_len > RDZV_BLOB_MAX)
        return err_fail(err, err_len, "rendezvous: blob of %zu bytes exceeds %u", blob_len, RDZV_BLOB_MAX);
    if (cfg->rank == 0 && blob_len && !blob) return err_fail(err, err_len, "rendezvous: blob is NULL");

    Rendezvous *r = calloc(1, sizeof *r);
    if (!r) return err_fail(err, err_len, "rendezvous: out of memory");
    r->rank = cfg->rank;
    r->world = cfg->world_size;
    r->node = node, r->nnodes = nnodes, r->local_world_size = lws;
    r->peers = calloc((size_t)r->world, sizeof *r->peers);
    r->ids = calloc((size_t)r->world, sizeof *r->ids);
    r->id_len = calloc((size_t)r->world, sizeof *r->id_len);
    r->zctx = zmq_ctx_new();
    master_endpoint(r->master, sizeof r->master, cfg->master_addr, cfg->master_port, 0);
    int rc = 0;
    if (!r->peers || !r->ids || !r->id_len || !r->zctx) rc = err_fail(err, err_len, "rendezvous: out of memory");
    if (rc == 0) {
        RdzvPeer *me = &r->peers[r->rank];
        me->rank = r->rank;
        me->pid = (int)getpid();
        if (gethostname(me->hostname, sizeof me->hostname) != 0) snprintf(me->hostname, sizeof me->hostname, "?");
        me->hostname[sizeof me->hostname - 1] = '\0';
        snprintf(me->endpoint, sizeof me->endpoint, "%s", cfg->endpoint ? cfg->endpoint : "");
        if (r->rank == 0 && blob_len) {
            r->blob = malloc(blob_len);
            if (!r->blob) rc = err_fail(err, err_len, "rendezvous: out of memory");
            else memcpy(r->blob, blob, blob_len), r->blob_len = blob_len;
        }
    }
    if (rc == 0) rc = r->rank == 0 ? run_rank0(r, cfg, err, err_len) : run_other(r, cfg, err, err_len);
    if (rc != 0) {
        rendezvous_close(r);
        return -1;
    }
    *out = r;
    return 0;
}

int rendezvous_world_size(const Rendezvous *r) { return r ? r->world : 0; }
const RdzvPeer *rendezvous_peers(const Rendezvous *r) { return r ? r->peers : NULL; }
const void *rendezvous_blob(const Rendezvous *r, size_t *len) {
    if (len) *len = r ? r->blob_len : 0;
    return r ? r->blob : NULL;
}

static int barrier_rank0(Rendezvous *r, int timeout_ms, char *err, size_t err_len) {
    unsigned char *have = calloc((size_t)r->world, 1);
    if (!have) return err_fail(err, err_len, "rendezvous: out of memory");
    have[0] = 1;
    int n_have = 1, rc = 0;
    int64_t deadline = now_ms() + timeout_ms;
    while (n_have < r->world && rc == 0) {
        int64_t left = deadline - now_ms();
        if (left <= 0) {
            char missing[512];
            rank_list(missing, sizeof missing, have, r->world, 0);
            rc = err_fail(err, err_len, "rendezvous barrier %d: rank%s %s did not arrive within %d ms", r->round,
                      r->world - n_have > 1 ? "s" : "", missing, timeout_ms);
            broadcast_error(r, have, NULL, 0, err);
            break;
        }
        zmq_pollitem_t it = {r->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, (long)left) < 0 && zmq_errno() != EINTR) {
            rc = err_fail(err, err_len, "rendezvous: zmq_poll: %s", zmq_strerror(zmq_errno()));
            break;
        }
        if (!(it.revents & ZMQ_POLLIN)) continue;
        zmq_msg_t f[2];
        int n = 0;
        if (recv_frames(r->sock, f, 2, &n) != 0) continue;
        json_t *j = n == 2 ? parse_json(&f[1]) : NULL;
        json_error_t je;
        const char *type = "";
        json_int_t k = -1, round = -1;
        const void *id = n >= 1 ? zmq_msg_data(&f[0]) : NULL;
        size_t id_len = n >= 1 ? zmq_msg_size(&f[0]) : 0;
        int ok = j && json_unpack_ex(j, &je, JSON_STRICT, "{s:s, s:I, s:I}", "type", &type, "rank", &k, "round",
                                     &round) == 0 && strcmp(type, "barrier") == 0 && k > 0 && k < r->world &&
                 r->id_len[k] == id_len && memcmp(r->ids[k], id, id_len) == 0;
        if (!ok) {
            if (id && id_len < RDZV_ID_MAX)
                send_error_to(r->sock, id, id_len, "rendezvous: expected a barrier message from a registered rank");
        } else if (round != r->round || have[k]) {
            rc = err_fail(err, err_len, "rendezvous barrier %d: rank %lld is at barrier %lld (ranks out of step)",
                      r->round, (long long)k, (long long)round);
            broadcast_error(r, have, id, id_len, err);
        } else {
            have[k] = 1;
            n_have++;
        }
        json_decref(j);
        close_frames(f, n, 2);
    }
    if (rc == 0) {
        json_t *d = json_pack("{s:s, s:i}", "type", "barrier_done", "round", r->round);
        for (int k = 1; k < r->world; k++)
            if (!d || send_json(r->sock, r->ids[k], r->id_len[k], d, NULL, 0, 0) != 0) {
                rc = err_fail(err, err_len, "rendezvous barrier %d: rank %d went away", r->round, k);
                break;
            }
        json_decref(d);
    }
    free(have);
    return rc;
}

static int barrier_other(Rendezvous *r, int timeout_ms, char *err, size_t err_len) {
    json_t *j = json_pack("{s:s, s:i, s:i}", "type", "barrier", "rank", r->rank, "round", r->round);
    int rc = j ? send_json(r->sock, NULL, 0, j, NULL, 0, 0) : -1;
    json_decref(j);
    if (rc != 0) return err_fail(err, err_len, "rendezvous: cannot send barrier: %s", zmq_strerror(zmq_errno()));
    zmq_msg_t f[2];
    int n = 0;
    int64_t wait = 2 * (int64_t)timeout_ms;
    if (await_answer(r, wait > INT32_MAX ? INT32_MAX : (int)wait, f, &n, "barrier", NULL, err, err_len) != 0) return -1;
    json_t *a = parse_json(&f[0]);
    json_error_t je;
    const char *type = "", *msg = "";
    json_int_t round = -1;
    rc = -1;
    if (a && json_unpack_ex(a, &je, JSON_STRICT, "{s:s, s:I}", "type", &type, "round", &round) == 0 &&
        strcmp(type, "barrier_done") == 0 && round == r->round && n == 1)
        rc = 0;
    else if (a && json_unpack_ex(a, &je, JSON_STRICT, "{s:s, s:s}", "type", &type, "message", &msg) == 0 &&
             strcmp(type, "error") == 0)
        err_fail(err, err_len, "%s (reported by rank 0 at %s)", msg, r->master);
    else
        err_fail(err, err_len, "rendezvous barrier %d: malformed answer from rank 0 at %s", r->round, r->master);
    json_decref(a);
    close_frames(f, n, 2);
    return rc;
}

int rendezvous_barrier(Rendezvous *r, int timeout_ms, char *err, size_t err_len) {
    if (!r) return err_fail(err, err_len, "rendezvous_barrier: NULL handle");
    if (r->failed) return err_fail(err, err_len, "rendezvous_barrier: the rendezvous failed earlier");
    if (timeout_ms <= 0) return err_fail(err, err_len, "rendezvous_barrier: timeout %d ms must be > 0", timeout_ms);
    int rc = 0;
    if (r->world > 1) rc = r->rank == 0 ? barrier_rank0(r, timeout_ms, err, err_len) : barrier_other(r, timeout_ms, err, err_len);
    if (rc != 0) r->failed = 1;
    else r->round++;
    return rc;
}

void rendezvous_close(Rendezvous *r) {
    if (!r) return;
    if (r->sock) zmq_close(r->sock);
    if (r->zctx) zmq_ctx_term(r->zctx);   // rank 0: flushes its last answers (bounded by its linger)
    free(r->peers);
    free(r->ids);
    free(r->id_len);
    free(r->blob);
    free(r);
}
