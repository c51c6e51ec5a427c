// shared/comm/comm_host.c — the `host` backend of comm.h: CPU processes exchanging data over ZeroMQ TCP sockets.
//
// Sockets of rank r (world N):
//   router     ROUTER bound on an ephemeral port of the address that routes to MASTER_ADDR, published through
//              the rendezvous. r SENDS to peer p through it, addressed to p's routing id "r<p>".
//   dealer[p]  DEALER (routing id "r<r>") connected to p's router. r RECEIVES p's data on it, so every
//              source has its own queue (no reordering buffers) and each queue sits on one TCP connection.
//   mon[p]     PAIR fed by dealer[p]'s socket monitor: the moment p's process goes away, the connection
//              that carries p's data closes, and r fails naming p instead of waiting for the timeout.
//              libzmq delivers everything received before the close first, so a peer that leaves normally
//              after its last collective is not mistaken for a failure.
// Joined by id (comm_create_with_id; the id from comm_host_id.c names rank 0's rendezvous): the same sockets. A
// CommPeerWatch is asked while joining (the rendezvous's cancel hook, the greetings) and, during a call, whenever
// nothing moved (at least every COMM_WATCH_TICK_MS): a member gone for COMM_GONE_GRACE_MS fails the join or the call
// that waits on it, named by the watch, even while its connection stays up (a frozen or cut-off process whose
// heartbeats have not yet run out).
// Messages: [56-byte header | payload of at most HOST_PIECE bytes]. The header repeats the collective (kind,
// dtype, op/root, count) and a per-pair sequence number, so ranks that call different collectives fail with
// a message naming both calls instead of exchanging garbage. Queues hold at most HOST_HWM messages per
// pair and direction; sends never block (ZMQ_DONTWAIT + retry while receiving), so memory stays bounded
// (about 2 x HOST_HWM x HOST_PIECE per pair) and no ordering of sends and receives can deadlock a collective.
// Reductions: rank r reduces its chunk piece by piece, adding contributions in rank order 0..N-1 into an
// accumulator (fp32 for bf16) and rounding once; all_reduce = reduce_scatter + all_gather over chunks of
// ceil(count / N) elements, so every rank ends with the same bits whatever the arrival order.
#include "shared/comm/comm_internal.h"
#include "shared/err.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "shared/dtype.h"
#include "shared/comm/rendezvous.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "comm_host headers and payloads are copied as they are: a big-endian host needs byte swapping"
#endif

#define HOST_PIECE ((size_t)1 << 20)   // payload bytes per message (a multiple of every element size)
#define HOST_HWM 8                     // messages queued per pair and direction, each side
#define HOST_MAGIC 0x314d4354u         // "TCM1"
#define HOST_ID_MAX 16
#define WHO_MAX 640                    // who()'s text: a watch's name, a host name, a pid

enum { K_HELLO = 1, K_ALL_GATHER, K_REDUCE_SCATTER, K_ALL_REDUCE_RS, K_ALL_REDUCE_AG, K_BROADCAST, K_P2P, K_BARRIER };
static const char *const KIND_NAMES[] = {"?", "hello", "all_gather", "reduce_scatter", "all_reduce (reduce phase)",
                                         "all_reduce (gather phase)", "broadcast", "send/recv", "barrier"};

typedef struct {
    uint32_t magic;
    uint8_t kind, dtype;
    uint16_t pad0;
    uint32_t src, world;
    uint32_t arg;       // op (reductions) or root (broadcast)
    uint32_t pad1;
    uint64_t seq;       // messages sent so far from src to this destination
    uint64_t count;     // the call's count argument (elements)
    uint64_t offset;    // byte offset of this piece within the transfer
    uint64_t total;     // bytes of the whole transfer between this pair
} Hdr;
_Static_assert(sizeof(Hdr) == 56, "Hdr is a wire format");

typedef struct {
    void *zctx;
    void *router;
    void **dealer;                 // (world) dealer[p] receives p's data; NULL for this rank
    void **mon;                    // (world)
    char (*id)[HOST_ID_MAX];       // (world) routing id "r<p>"
    uint64_t *tx_seq, *rx_seq;     // (world)
    unsigned char *gone;           // (world) 1 once p's connection closed
    unsigned char *waiting;        // (world) scratch: peers the current call waits on
    RdzvPeer *peers;               // (world) hostnames and pids, for messages
    zmq_pollitem_t *items;         // (2 * world)
    int *item_peer;                // (2 * world)
    unsigned char *acc;            // (2 * HOST_PIECE) accumulator of one piece: fp32 for bf16, else native
    CommPeerWatch watch;           // joined by id: the caller's view of the members; gone_ms NULL: none
    int64_t join_started_ms;       // when comm_host_create began (the watch's rule for joining)
} Host;

typedef struct { int peer; const unsigned char *data; size_t bytes, done; int any; } TxStream;
typedef struct { int peer; unsigned char *dst; size_t bytes, done; int any; } RxStream;
typedef struct {
    const unsigned char *own;      // this rank's contribution (bytes)
    unsigned char *dst;            // result (bytes); may equal own
    size_t bytes, off;             // chunk bytes; offset of the piece being reduced
    int src;                       // next contributor of this piece, 0..world-1
    int any;                       // a piece was finished (zero-byte chunks still exchange one message)
} Reduce;
typedef struct {
    uint8_t kind;
    CommDtype dtype;
    uint32_t arg;
    uint64_t count;
    TxStream *tx;
    int ntx;
    RxStream *rx;
    int nrx;
    Reduce *red;
    CommOp op;
} Xfer;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static const char *kind_name(unsigned k) { return k < sizeof KIND_NAMES / sizeof *KIND_NAMES ? KIND_NAMES[k] : "?"; }
static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

// The peer watch's name of member p ("" without one).
static void watch_name(const Host *h, int p, char *out, size_t len) {
    out[0] = '\0';
    if (h->watch.name) h->watch.name(h->watch.arg, p, out, len);
}

// "rank 2 (host node-b, pid 4242)", or with a peer watch that names it "member 2 (<name>; host node-b, pid 4242)",
// into a caller buffer (WHO_MAX).
static const char *who(const Host *h, int p, char *buf, size_t len) {
    char name[256];
    watch_name(h, p, name, sizeof name);
    if (name[0]) snprintf(buf, len, "member %d (%s; host %s, pid %d)", p, name, h->peers[p].hostname, h->peers[p].pid);
    else snprintf(buf, len, "rank %d (host %s, pid %d)", p, h->peers[p].hostname, h->peers[p].pid);
    return buf;
}

// Joining with a peer watch: a member gone at or after the join started, for COMM_GONE_GRACE_MS (comm.h
// CommPeerWatch), is not coming. 1 with why = a sentence naming it; 0 otherwise (or without a watch).
static int join_watch_gone(const Comm *c, const Host *h, char *why, size_t len) {
    if (!h->watch.gone_ms) return 0;
    int64_t now = now_ms();
    for (int p = 0; p < c->world; p++) {
        if (p == c->rank) continue;
        int64_t at = h->watch.gone_ms(h->watch.arg, p);
        if (!at || at < h->join_started_ms || now - at < COMM_GONE_GRACE_MS) continue;
        char name[256];
        watch_name(h, p, name, sizeof name);
        snprintf(why, len, "rank %d gave up joining the host communicator of %d members: member %d%s%s%s went away "
                 "%lld ms ago (as its peer watch says)", c->rank, c->world, p, name[0] ? " (" : "", name,
                 name[0] ? ")" : "", (long long)(now - at));
        return 1;
    }
    return 0;
}

// A call with a peer watch: a member the call waits on (h->waiting) that is gone, while the call has been held up
// for the grace since both it started and the member went (comm.h CommPeerWatch). The member, or -1.
static int call_watch_gone(const Comm *c, const Host *h, int64_t started, int64_t now, int64_t *gone_at) {
    if (!h->watch.gone_ms) return -1;
    int64_t grace = c->timeout_ms < COMM_GONE_GRACE_MS ? c->timeout_ms : COMM_GONE_GRACE_MS;
    for (int p = 0; p < c->world; p++) {
        if (p == c->rank || !h->waiting[p]) continue;
        int64_t at = h->watch.gone_ms(h->watch.arg, p), since = at > started ? at : started;
        if (at && now - since >= grace) {
            *gone_at = at;
            return p;
        }
    }
    return -1;
}

// "reduce_scatter(count 5, f32, sum)" / "broadcast(count 5, f32, root 1)" / "all_gather(count 5, f32)".
static void describe(char *out, size_t len, unsigned kind, unsigned dtype, uint32_t arg, uint64_t count) {
    const char *dt = dtype <= COMM_F64 ? comm_dtype_name((CommDtype)dtype) : "?";
    int n = snprintf(out, len, "%s(count %llu, %s", kind_name(kind), (unsigned long long)count, dt);
    if (n < 0 || (size_t)n >= len) return;
    if (kind == K_REDUCE_SCATTER || kind == K_ALL_REDUCE_RS)
        snprintf(out + n, len - (size_t)n, ", %s)", arg == COMM_SUM ? "sum" : arg == COMM_MAX ? "max" : "op ?");
    else if (kind == K_BROADCAST)
        snprintf(out + n, len - (size_t)n, ", root %u)", arg);
    else
        snprintf(out + n, len - (size_t)n, ")");
}

// ---- reductions of one piece (n elements) -----------------------------------------------------

static void fold_first(unsigned char *acc, const unsigned char *x, size_t n, CommDtype dt) {
    if (dt == COMM_BF16) dtype_bf16_to_f32_n((float *)acc, x, n);
    else memcpy(acc, x, n * comm_dtype_size(dt));
}

// acc = op(acc, x), elementwise. x may be unaligned (message payloads), hence the memcpy loads.
// Max propagates NaN: once acc is NaN, `v > a` stays false; a NaN v replaces acc.
#define FOLD_FLOAT(T, LOAD)                                                                \
    do {                                                                                   \
        T *a = (T *)acc;                                                                   \
        if (op == COMM_SUM) for (size_t i = 0; i < n; i++) { T v = LOAD; a[i] += v; }      \
        else for (size_t i = 0; i < n; i++) { T v = LOAD; if (v != v || v > a[i]) a[i] = v; } \
    } while (0)

static inline float load_f32(const unsigned char *p) { float v; memcpy(&v, p, 4); return v; }
static inline double load_f64(const unsigned char *p) { double v; memcpy(&v, p, 8); return v; }
static inline float load_bf16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return dtype_bf16_to_f32(v); }
static inline uint32_t load_u32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static void fold(unsigned char *acc, const unsigned char *x, size_t n, CommDtype dt, CommOp op) {
    switch (dt) {
    case COMM_F32: FOLD_FLOAT(float, load_f32(x + 4 * i)); break;
    case COMM_BF16: FOLD_FLOAT(float, load_bf16(x + 2 * i)); break;
    case COMM_F64: FOLD_FLOAT(double, load_f64(x + 8 * i)); break;
    case COMM_I32: {
        uint32_t *a = (uint32_t *)acc;   // sums wrap (two's complement), as NCCL's do
        if (op == COMM_SUM) for (size_t i = 0; i < n; i++) a[i] += load_u32(x + 4 * i);
        else for (size_t i = 0; i < n; i++) { int32_t v = (int32_t)load_u32(x + 4 * i); if (v > (int32_t)a[i]) a[i] = (uint32_t)v; }
        break;
    }
    case COMM_U8:
        if (op == COMM_SUM) for (size_t i = 0; i < n; i++) acc[i] = (unsigned char)(acc[i] + x[i]);
        else for (size_t i = 0; i < n; i++) if (x[i] > acc[i]) acc[i] = x[i];
        break;
    }
}

static void fold_finish(unsigned char *dst, const unsigned char *acc, size_t n, CommDtype dt) {
    if (dt == COMM_BF16) dtype_f32_to_bf16_n(dst, (const float *)acc, n);   // the one rounding
    else memcpy(dst, acc, n * comm_dtype_size(dt));
}

// ---- messages ---------------------------------------------------------------------------------

static void hdr_fill(Hdr *hd, const Comm *c, const Xfer *x, uint64_t seq, size_t off, size_t total) {
    memset(hd, 0, sizeof *hd);
    hd->magic = HOST_MAGIC;
    hd->kind = x->kind;
    hd->dtype = (uint8_t)x->dtype;
    hd->src = (uint32_t)c->rank;
    hd->world = (uint32_t)c->world;
    hd->arg = x->arg;
    hd->seq = seq;
    hd->count = x->count;
    hd->offset = off;
    hd->total = total;
}

// Sends the next pieces of t until its queue is full. Returns 1 if something went, 0 if not, < 0 failed.
static int tx_step(Comm *c, Host *h, const Xfer *x, TxStream *t) {
    int moved = 0;
    char wb[WHO_MAX];
    while (!(t->any && t->done == t->bytes)) {
        size_t n = min_sz(HOST_PIECE, t->bytes - t->done);
        zmq_msg_t m;
        if (zmq_msg_init_size(&m, sizeof(Hdr) + n) != 0)
            return comm_fail(c, COMM_ERR_SYSTEM, "comm %s: out of memory for a %zu-byte message", kind_name(x->kind), n);
        if (zmq_send(h->router, h->id[t->peer], strlen(h->id[t->peer]), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
            int e = zmq_errno();
            zmq_msg_close(&m);
            if (e == EAGAIN || e == EINTR) return moved;   // queue full: retried after receiving
            if (e == EHOSTUNREACH)
                return comm_fail(c, COMM_ERR_PEER, "comm %s (call #%llu): %s went away (no connection to send to)",
                                 kind_name(x->kind), (unsigned long long)c->calls, who(h, t->peer, wb, sizeof wb));
            return comm_fail(c, COMM_ERR_SYSTEM, "comm %s: send to rank %d: %s", kind_name(x->kind), t->peer,
                             zmq_strerror(e));
        }
        Hdr hd;
        hdr_fill(&hd, c, x, h->tx_seq[t->peer], t->done, t->bytes);
        memcpy(zmq_msg_data(&m), &hd, sizeof hd);
        if (n) memcpy((unsigned char *)zmq_msg_data(&m) + sizeof hd, t->data + t->done, n);
        // The routing frame was accepted, so the pipe has room: this part cannot meet a full queue.
        if (zmq_msg_send(&m, h->router, ZMQ_DONTWAIT) < 0) {
            int e = zmq_errno();
            zmq_msg_close(&m);
            return comm_fail(c, COMM_ERR_PEER, "comm %s: send to %s failed: %s", kind_name(x->kind),
                             who(h, t->peer, wb, sizeof wb), zmq_strerror(e));
        }
        h->tx_seq[t->peer]++;
        t->done += n;
        t->any = 1;
        moved = 1;
    }
    return moved;
}

// Receives one message from peer p if one is queued: 1 with m holding it (header checked against x, the
// expected offset and transfer size), 0 if none, < 0 failed.
static int rx_one(Comm *c, Host *h, const Xfer *x, int p, size_t off, size_t total, zmq_msg_t *m) {
    char wb[WHO_MAX];
    zmq_msg_init(m);
    if (zmq_msg_recv(m, h->dealer[p], ZMQ_DONTWAIT) < 0) {
        int e = zmq_errno();
        zmq_msg_close(m);
        if (e == EAGAIN || e == EINTR) return 0;
        return comm_fail(c, COMM_ERR_SYSTEM, "comm %s: receive from rank %d: %s", kind_name(x->kind), p, zmq_strerror(e));
    }
    Hdr hd;
    size_t size = zmq_msg_size(m);
    if (size >= sizeof hd) memcpy(&hd, zmq_msg_data(m), sizeof hd);
    const char *bad = NULL;
    if (size < sizeof hd || hd.magic != HOST_MAGIC || hd.src != (uint32_t)p || hd.world != (uint32_t)c->world)
        bad = "a message that is not from this group";
    else if (hd.seq != h->rx_seq[p])
        bad = "a message out of sequence";
    if (bad) {
        zmq_msg_close(m);
        return comm_fail(c, COMM_ERR_PEER, "comm %s (call #%llu): %s sent %s", kind_name(x->kind),
                         (unsigned long long)c->calls, who(h, p, wb, sizeof wb), bad);
    }
    if (hd.kind != x->kind || hd.dtype != (uint8_t)x->dtype || hd.arg != x->arg || hd.count != x->count ||
        hd.total != total) {
        char theirs[96], mine[96];
        describe(theirs, sizeof theirs, hd.kind, hd.dtype, hd.arg, hd.count);
        describe(mine, sizeof mine, x->kind, (unsigned)x->dtype, x->arg, x->count);
        zmq_msg_close(m);
        return comm_fail(c, COMM_ERR_PEER, "comm: %s is in %s while this rank (%d) is in %s (call #%llu on this "
                         "communicator): every rank must call the same collectives in the same order with the same "
                         "arguments", who(h, p, wb, sizeof wb), theirs, c->rank, mine, (unsigned long long)c->calls);
    }
    if (hd.offset != off || size - sizeof hd != min_sz(HOST_PIECE, total - off)) {
        zmq_msg_close(m);
        return comm_fail(c, COMM_ERR_PEER, "comm %s: %s sent a piece at offset %llu of %zu bytes, expected offset %zu",
                         kind_name(x->kind), who(h, p, wb, sizeof wb), (unsigned long long)hd.offset,
                         size - sizeof hd, off);
    }
    h->rx_seq[p]++;
    return 1;
}

static int rx_step(Comm *c, Host *h, const Xfer *x, RxStream *r) {
    int moved = 0;
    while (!(r->any && r->done == r->bytes)) {
        zmq_msg_t m;
        int rc = rx_one(c, h, x, r->peer, r->done, r->bytes, &m);
        if (rc <= 0) return rc < 0 ? rc : moved;
        size_t n = zmq_msg_size(&m) - sizeof(Hdr);
        if (n) memcpy(r->dst + r->done, (unsigned char *)zmq_msg_data(&m) + sizeof(Hdr), n);
        zmq_msg_close(&m);
        r->done += n;
        r->any = 1;
        moved = 1;
    }
    return moved;
}

// Folds contributions in rank order as they become available; waits (returns) at the first missing one.
static int red_step(Comm *c, Host *h, const Xfer *x, Reduce *d) {
    size_t esz = comm_dtype_size(x->dtype);
    int moved = 0;
    while (!(d->any && d->off >= d->bytes)) {
        size_t n = min_sz(HOST_PIECE, d->bytes - d->off);
        if (d->src == c->rank) {
            if (d->src == 0) fold_first(h->acc, d->own + d->off, n / esz, x->dtype);
            else fold(h->acc, d->own + d->off, n / esz, x->dtype, x->op);
        } else {
            zmq_msg_t m;
            int rc = rx_one(c, h, x, d->src, d->off, d->bytes, &m);
            if (rc <= 0) return rc < 0 ? rc : moved;
            const unsigned char *v = (const unsigned char *)zmq_msg_data(&m) + sizeof(Hdr);
            if (d->src == 0) fold_first(h->acc, v, n / esz, x->dtype);
            else fold(h->acc, v, n / esz, x->dtype, x->op);
            zmq_msg_close(&m);
        }
        moved = 1;
        if (++d->src == c->world) {
            fold_finish(d->dst + d->off, h->acc, n / esz, x->dtype);
            d->off += n;
            d->src = 0;
            d->any = 1;
        }
    }
    return moved;
}

// Reads pending monitor events: any event on mon[p] means p's connection closed.
static void drain_monitor(Host *h, int p) {
    zmq_msg_t m;
    for (;;) {
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, h->mon[p], ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return;
        }
        if (zmq_msg_size(&m) >= 2) {
            uint16_t ev;
            memcpy(&ev, zmq_msg_data(&m), 2);
            if (ev & ZMQ_EVENT_DISCONNECTED) h->gone[p] = 1;
        }
        zmq_msg_close(&m);
    }
}

// Runs a transfer to completion: sends, receives, reduction, interleaved, never blocking on one peer.
// Fails when a peer it waits on went away, or when nothing moved for timeout_ms.
static int xfer_run(Comm *c, Host *h, Xfer *x) {
    char wb[WHO_MAX];
    int64_t last = now_ms(), started = last;
    for (;;) {
        int moved = 0, rc;
        memset(h->waiting, 0, (size_t)c->world);
        int blocked_tx = 0;
        for (int i = 0; i < x->ntx; i++) {
            TxStream *t = &x->tx[i];
            if ((rc = tx_step(c, h, x, t)) < 0) return rc;
            moved |= rc;
            if (!(t->any && t->done == t->bytes)) h->waiting[t->peer] = 2, blocked_tx = 1;
        }
        for (int i = 0; i < x->nrx; i++) {
            RxStream *r = &x->rx[i];
            if ((rc = rx_step(c, h, x, r)) < 0) return rc;
            moved |= rc;
            if (!(r->any && r->done == r->bytes)) h->waiting[r->peer] = 1;
        }
        if (x->red) {
            if ((rc = red_step(c, h, x, x->red)) < 0) return rc;
            moved |= rc;
            if (!(x->red->any && x->red->off >= x->red->bytes)) h->waiting[x->red->src] = 1;
        }
        int pending = 0;
        for (int p = 0; p < c->world; p++) pending |= h->waiting[p];
        if (!pending) return 0;
        int64_t now = now_ms();
        if (moved) {
            last = now;
            continue;
        }
        // Nothing moved, and every queue was just read: a peer we wait on that went away is not coming back.
        for (int p = 0; p < c->world; p++)
            if (h->waiting[p] && h->gone[p])
                return comm_fail(c, COMM_ERR_PEER, "comm %s (call #%llu): %s went away (its connection closed: "
                                 "the process exited, or stopped answering heartbeats for %d s)",
                                 kind_name(x->kind), (unsigned long long)c->calls, who(h, p, wb, sizeof wb),
                                 COMM_HEARTBEAT_TIMEOUT_MS / 1000);
        // A member the caller's peer watch saw go: its process may live on (frozen, cut off) with the connection up.
        int64_t gone_at = 0;
        int gone = call_watch_gone(c, h, started, now, &gone_at);
        if (gone >= 0)
            return comm_fail(c, COMM_ERR_PEER, "comm %s (call #%llu): %s went away %lld ms ago (as its peer watch "
                             "says) while this call waited on it (%s) for %lld ms",
                             kind_name(x->kind), (unsigned long long)c->calls, who(h, gone, wb, sizeof wb),
                             (long long)(now - gone_at), h->waiting[gone] == 2 ? "not taking data" : "no data",
                             (long long)(now - started));
        if (now - last >= c->timeout_ms) {
            char list[512] = "";
            size_t used = 0;
            for (int p = 0; p < c->world && used < sizeof list - 80; p++)
                if (h->waiting[p]) {
                    int k = snprintf(list + used, sizeof list - used, "%s%s (%s)", used ? ", " : "",
                                     who(h, p, wb, sizeof wb), h->waiting[p] == 2 ? "not taking data" : "no data");
                    if (k > 0) used += (size_t)k;
                }
            return comm_fail(c, COMM_ERR_TIMEOUT, "comm %s (call #%llu): nothing from %s for %d ms (comm timeout)",
                             kind_name(x->kind), (unsigned long long)c->calls, list, c->timeout_ms);
        }
        int ni = 0;
        for (int p = 0; p < c->world; p++) {
            if (p == c->rank) continue;
            if (h->waiting[p] == 1) h->items[ni] = (zmq_pollitem_t){h->dealer[p], 0, ZMQ_POLLIN, 0}, h->item_peer[ni++] = -1;
            h->items[ni] = (zmq_pollitem_t){h->mon[p], 0, ZMQ_POLLIN, 0}, h->item_peer[ni++] = p;
        }
        // A full send queue has no precise wake-up (ROUTER's POLLOUT means "some peer has room"): retry every ms.
        long wait = (long)(last + c->timeout_ms - now);
        if (blocked_tx && wait > 1) wait = 1;
        if (h->watch.gone_ms && wait > COMM_WATCH_TICK_MS) wait = COMM_WATCH_TICK_MS;   // the watch is asked, not heard
        if (zmq_poll(h->items, ni, wait) < 0 && zmq_errno() != EINTR)
            return comm_fail(c, COMM_ERR_SYSTEM, "comm %s: zmq_poll: %s", kind_name(x->kind), zmq_strerror(zmq_errno()));
        for (int i = 0; i < ni; i++)
            if (h->item_peer[i] >= 0 && (h->items[i].revents & ZMQ_POLLIN)) drain_monitor(h, h->item_peer[i]);
    }
}

// ---- set-up and tear-down ---------------------------------------------------------------------

static int sys_fail(char *err, size_t len, const char *what) {
    snprintf(err, len, "comm host: %s: %s", what, zmq_strerror(zmq_errno()));
    return COMM_ERR_SYSTEM;
}

// Every rank's dealer greets the peer's router; a router that has heard from every peer can route to all.
static int hello_exchange(Comm *c, Host *h, char *err, size_t err_len) {
    Xfer hx = {.kind = K_HELLO, .dtype = COMM_U8};
    for (int p = 0; p < c->world; p++) {
        if (p == c->rank) continue;
        Hdr hd;
        hdr_fill(&hd, c, &hx, 0, 0, 0);
        if (zmq_send(h->dealer[p], &hd, sizeof hd, ZMQ_DONTWAIT) < 0) return sys_fail(err, err_len, "hello");
    }
    unsigned char *got = h->waiting;
    memset(got, 0, (size_t)c->world);
    got[c->rank] = 1;
    int n = 1;
    int64_t deadline = now_ms() + c->timeout_ms;
    while (n < c->world) {
        int64_t left = deadline - now_ms();
        char why[768];
        if (join_watch_gone(c, h, why, sizeof why)) {
            snprintf(err, err_len, "comm host: %s", why);
            return COMM_ERR_PEER;
        }
        if (left <= 0) {
            char list[512] = "";
            size_t used = 0;
            for (int p = 0; p < c->world && used < sizeof list - 32; p++)
                if (!got[p]) {
                    int k = snprintf(list + used, sizeof list - used, "%s%d", used ? ", " : "", p);
                    if (k > 0) used += (size_t)k;
                }
            snprintf(err, err_len, "comm host: no connection from rank(s) %s within %d ms after the rendezvous "
                     "(firewall, or a data address they cannot reach? this rank listens on %s)", list,
                     c->timeout_ms, h->peers[c->rank].endpoint);
            return COMM_ERR_TIMEOUT;
        }
        zmq_pollitem_t it = {h->router, 0, ZMQ_POLLIN, 0};
        if (h->watch.gone_ms && left > COMM_WATCH_TICK_MS) left = COMM_WATCH_TICK_MS;
        if (zmq_poll(&it, 1, (long)left) < 0 && zmq_errno() != EINTR) return sys_fail(err, err_len, "zmq_poll");
        if (!(it.revents & ZMQ_POLLIN)) continue;
        char id[HOST_ID_MAX] = "";
        int idn = zmq_recv(h->router, id, sizeof id - 1, ZMQ_DONTWAIT);
        Hdr hd;
        int more = 0;
        size_t ml = sizeof more;
        zmq_getsockopt(h->router, ZMQ_RCVMORE, &more, &ml);
        int bn = more ? zmq_recv(h->router, &hd, sizeof hd, ZMQ_DONTWAIT) : -1;
        for (more = 1; more;) {   // drop any further frames of a malformed message
            zmq_getsockopt(h->router, ZMQ_RCVMORE, &more, &ml);
            zmq_msg_t extra;
            zmq_msg_init(&extra);
            if (more && zmq_msg_recv(&extra, h->router, ZMQ_DONTWAIT) < 0) more = 0;
            zmq_msg_close(&extra);
        }
        if (idn < 0 || idn >= (int)sizeof id || bn != (int)sizeof hd) continue;
        id[idn] = '\0';
        int p = (int)hd.src;
        if (hd.magic != HOST_MAGIC || hd.kind != K_HELLO || hd.src >= (uint32_t)c->world || p == c->rank ||
            hd.world != (uint32_t)c->world || strcmp(id, h->id[p]) != 0 || got[p]) {
            snprintf(err, err_len, "comm host: unexpected greeting on %s (routing id '%s', rank %u, world %u)",
                     h->peers[c->rank].endpoint, id, hd.src, hd.world);
            return COMM_ERR_PEER;
        }
        got[p] = 1;
        n++;
    }
    return 0;
}

static int host_alloc(Comm *c, Host *h) {
    size_t w = (size_t)c->world;
    h->dealer = calloc(w, sizeof *h->dealer);
    h->mon = calloc(w, sizeof *h->mon);
    h->id = calloc(w, sizeof *h->id);
    h->tx_seq = calloc(w, sizeof *h->tx_seq);
    h->rx_seq = calloc(w, sizeof *h->rx_seq);
    h->gone = calloc(w, 1);
    h->waiting = calloc(w, 1);
    h->peers = calloc(w, sizeof *h->peers);
    h->items = calloc(2 * w, sizeof *h->items);
    h->item_peer = calloc(2 * w, sizeof *h->item_peer);
    h->acc = malloc(2 * HOST_PIECE);
    if (!h->dealer || !h->mon || !h->id || !h->tx_seq || !h->rx_seq || !h->gone || !h->waiting || !h->peers ||
        !h->items || !h->item_peer || !h->acc)
        return -1;
    for (int p = 0; p < c->world; p++) snprintf(h->id[p], HOST_ID_MAX, "r%d", p);
    return 0;
}

// Binds this rank's ROUTER on an ephemeral port of addr (numeric); ep receives the endpoint to publish.
static int bind_router(Host *h, const char *addr, char *ep, size_t ep_len, char *err, size_t err_len) {
    char bind_ep[96];
    int v6 = strchr(addr, ':') != NULL, one = 1, zero = 0, hwm = HOST_HWM;
    snprintf(bind_ep, sizeof bind_ep, v6 ? "tcp://[%s]:*" : "tcp://%s:*", addr);
    h->router = zmq_socket(h->zctx, ZMQ_ROUTER);
    if (!h->router) return sys_fail(err, err_len, "ROUTER socket");
    zmq_setsockopt(h->router, ZMQ_ROUTER_MANDATORY, &one, sizeof one);   // full queue -> EAGAIN, not a drop
    zmq_setsockopt(h->router, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(h->router, ZMQ_LINGER, &zero, sizeof zero);
    if (v6) zmq_setsockopt(h->router, ZMQ_IPV6, &one, sizeof one);
    if (zmq_bind(h->router, bind_ep) != 0) return sys_fail(err, err_len, bind_ep);
    if (zmq_getsockopt(h->router, ZMQ_LAST_ENDPOINT, ep, &ep_len) != 0) return sys_fail(err, err_len, "ZMQ_LAST_ENDPOINT");
    return 0;
}

// With h->peers filled in: a DEALER (and its monitor) to every peer's router, then the greetings.
static int connect_peers(Comm *c, Host *h, char *err, size_t err_len) {
    int one = 1, zero = 0, hwm = HOST_HWM;
    for (int p = 0; p < c->world; p++) {
        if (p == c->rank) continue;
        char mon_ep[64];
        snprintf(mon_ep, sizeof mon_ep, "inproc://comm-host-monitor-%d", p);
        h->dealer[p] = zmq_socket(h->zctx, ZMQ_DEALER);
        h->mon[p] = zmq_socket(h->zctx, ZMQ_PAIR);
        if (!h->dealer[p] || !h->mon[p]) return sys_fail(err, err_len, "DEALER socket");
        zmq_setsockopt(h->dealer[p], ZMQ_ROUTING_ID, h->id[c->rank], strlen(h->id[c->rank]));
        zmq_setsockopt(h->dealer[p], ZMQ_RCVHWM, &hwm, sizeof hwm);
        zmq_setsockopt(h->dealer[p], ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(h->mon[p], ZMQ_LINGER, &zero, sizeof zero);
        if (comm_set_heartbeats(h->dealer[p]) != 0) return sys_fail(err, err_len, "heartbeats");
        if (strchr(h->peers[p].endpoint, '[')) zmq_setsockopt(h->dealer[p], ZMQ_IPV6, &one, sizeof one);
        // The monitor is attached before connecting so that no close can slip by unseen.
        if (zmq_socket_monitor(h->dealer[p], mon_ep, ZMQ_EVENT_DISCONNECTED) != 0 || zmq_connect(h->mon[p], mon_ep) != 0)
            return sys_fail(err, err_len, "socket monitor");
        if (zmq_connect(h->dealer[p], h->peers[p].endpoint) != 0) {
            snprintf(err, err_len, "comm host: cannot connect to rank %d's endpoint '%s': %s", p, h->peers[p].endpoint,
                     zmq_strerror(zmq_errno()));
            return COMM_ERR_PEER;
        }
    }
    return hello_exchange(c, h, err, err_len);
}

typedef struct { const Comm *c; const Host *h; } JoinWatch;

static int rdzv_cancelled(void *arg, char *why, size_t len) {
    const JoinWatch *j = arg;
    return join_watch_gone(j->c, j->h, why, len);
}

static int open_sockets(Comm *c, Host *h, const CommInit *ci, char *err, size_t err_len) {
    char addr[INET6_ADDRSTRLEN], ep[RDZV_ENDPOINT_MAX];
    if (rendezvous_local_address(ci->master_addr, ci->master_port, addr, sizeof addr, err, err_len) != 0)
        return COMM_ERR_INVALID;
    int rc = bind_router(h, addr, ep, sizeof ep, err, err_len);
    if (rc) return rc;
    RdzvConfig rc_cfg = {.rank = c->rank, .world_size = c->world, .master_addr = ci->master_addr,
                         .master_port = ci->master_port, .port_source = ci->port_source[0] ? ci->port_source : NULL,
                         .timeout_ms = c->timeout_ms, .endpoint = ep,
                         .node = ci->node, .nnodes = ci->nnodes, .local_world_size = ci->local_world_size,
                         .progress = ci->progress, .progress_arg = ci->progress_arg};
    JoinWatch jw = {c, h};
    if (h->watch.gone_ms) rc_cfg.cancelled = rdzv_cancelled, rc_cfg.cancel_arg = &jw;
    Rendezvous *rz = NULL;
    if (rendezvous_run(&rz, &rc_cfg, NULL, 0, err, err_len) != 0) return COMM_ERR_PEER;
    memcpy(h->peers, rendezvous_peers(rz), (size_t)c->world * sizeof *h->peers);
    rendezvous_close(rz);
    return connect_peers(c, h, err, err_len);
}

static void host_free(Comm *c, Host *h, int linger_ms) {
    if (h->router) {
        zmq_setsockopt(h->router, ZMQ_LINGER, &linger_ms, sizeof linger_ms);
        zmq_close(h->router);
    }
    for (int p = 0; h->dealer && p < c->world; p++) {
        if (h->dealer[p]) {
            zmq_socket_monitor(h->dealer[p], NULL, 0);
            zmq_close(h->dealer[p]);
        }
        if (h->mon && h->mon[p]) zmq_close(h->mon[p]);
    }
    // Waits (at most linger_ms) until what this rank sent last has left, so that peers still reading it
    // get it all; then the connections close and peers see this rank leave.
    if (h->zctx) zmq_ctx_term(h->zctx);
    free(h->dealer);
    free(h->mon);
    free(h->id);
    free(h->tx_seq);
    free(h->rx_seq);
    free(h->gone);
    free(h->waiting);
    free(h->peers);
    free(h->items);
    free(h->item_peer);
    free(h->acc);
    free(h);
}

int comm_host_create(Comm *c, const CommInit *ci, const CommPeerWatch *watch, char *err, size_t err_len) {
    if (c->world == 1) return 0;   // nothing to talk to: every collective is a local copy
    int64_t started = now_ms();
    Host *h = calloc(1, sizeof *h);
    if (!h || host_alloc(c, h) != 0) {
        if (h) host_free(c, h, 0);
        snprintf(err, err_len, "comm host: out of memory");
        return COMM_ERR_SYSTEM;
    }
    if (watch) h->watch = *watch;
    h->join_started_ms = started;
    h->zctx = zmq_ctx_new();
    int rc = h->zctx ? open_sockets(c, h, ci, err, err_len) : sys_fail(err, err_len, "zmq_ctx_new");
    if (rc != 0) {
        host_free(c, h, 0);
        return rc;
    }
    c->impl = h;
    return 0;
}

// The parent's endpoints say which address routes to the peers: the split binds its router on the same one.
// Every member of the parent contributes its RdzvPeer entry (an empty endpoint when it joins no new
// communicator), so the exchange is one all_gather over the parent.
int comm_host_split(Comm *c, Comm *parent, const int *members, char *err, size_t err_len) {
    if (parent->world == 1) return 0;   // c is the one member: nothing to talk to
    const Host *ph = parent->impl;
    Host *h = NULL;
    RdzvPeer *all = calloc((size_t)parent->world, sizeof *all);
    RdzvPeer me = ph->peers[parent->rank];
    me.endpoint[0] = '\0';
    int rc = 0;
    if (!all) rc = err_fail_code(COMM_ERR_SYSTEM, err, err_len, "comm host: out of memory");
    if (rc == 0 && c && c->world > 1) {
        h = calloc(1, sizeof *h);
        if (!h || host_alloc(c, h) != 0 || !(h->zctx = zmq_ctx_new())) {
            rc = err_fail_code(COMM_ERR_SYSTEM, err, err_len, "comm host: out of memory");
        } else {
            char addr[RDZV_ENDPOINT_MAX];
            int port;
            rendezvous_endpoint_split(ph->peers[parent->rank].endpoint, addr, sizeof addr, &port);
            rc = bind_router(h, addr, me.endpoint, sizeof me.endpoint, err, err_len);
            if (rc) me.endpoint[0] = '\0';
        }
    }
    // Every parent member takes part, even after a failure of its own (an empty endpoint then tells the others),
    // so that nobody waits for it until the timeout.
    if (all && comm_all_gather(parent, all, &me, sizeof me, COMM_U8) != 0 && rc == 0)
        rc = err_fail_code(COMM_ERR_PEER, err, err_len, "comm host: exchanging endpoints for a split: %s",
                           comm_error(parent));
    for (int i = 0; rc == 0 && c && c->world > 1 && i < c->world; i++) {
        h->peers[i] = all[members[i]];
        h->peers[i].rank = i;
        if (!h->peers[i].endpoint[0])
            rc = err_fail_code(COMM_ERR_PEER, err, err_len, "comm host: rank %d of the parent (host %s, pid %d) "
                               "published no endpoint for the split (it failed, or named another color)", members[i],
                               all[members[i]].hostname, all[members[i]].pid);
    }
    if (rc == 0 && h) rc = connect_peers(c, h, err, err_len);
    if (rc == 0 && h) c->impl = h;
    else if (h) host_free(c, h, 0);
    free(all);
    return rc;
}

// Healthy: up to the timeout to deliver the last collective's data to peers still reading it. Failed: a
// short while, so that live peers still get what was sent (their own error then names the real cause).
void comm_host_destroy(Comm *c) {
    if (c->impl) host_free(c, c->impl, c->failed ? (c->timeout_ms < 500 ? c->timeout_ms : 500) : c->timeout_ms);
    c->impl = NULL;
}

// ---- collectives ------------------------------------------------------------------------------

// Starts a call: world 1 never gets here. Streams are allocated per call (2 x world entries at most).
static int xfer_begin(Comm *c, Xfer *x, uint8_t kind, CommDtype dtype, uint32_t arg, size_t count, int ntx, int nrx) {
    memset(x, 0, sizeof *x);
    x->kind = kind;
    x->dtype = dtype;
    x->arg = arg;
    x->op = (CommOp)arg;
    x->count = count;
    x->tx = ntx ? calloc((size_t)ntx, sizeof *x->tx) : NULL;
    x->rx = nrx ? calloc((size_t)nrx, sizeof *x->rx) : NULL;
    if ((ntx && !x->tx) || (nrx && !x->rx)) {
        free(x->tx);
        free(x->rx);
        return comm_fail(c, COMM_ERR_SYSTEM, "comm %s: out of memory", kind_name(kind));
    }
    return 0;
}

static int xfer_end(Comm *c, Xfer *x) {
    int rc = xfer_run(c, c->impl, x);
    free(x->tx);
    free(x->rx);
    return rc;
}

static void add_tx(Xfer *x, int peer, const void *data, size_t bytes) {
    x->tx[x->ntx++] = (TxStream){peer, data, bytes, 0, 0};
}
static void add_rx(Xfer *x, int peer, void *dst, size_t bytes) { x->rx[x->nrx++] = (RxStream){peer, dst, bytes, 0, 0}; }

// all_gather over a partition: rank p's block is [lo[p], lo[p] + len[p]) bytes of recv; own block from `own`.
static int gather_blocks(Comm *c, uint8_t kind, unsigned char *recv, const unsigned char *own, const size_t *lo,
                         const size_t *len, size_t count, CommDtype dtype) {
    Xfer x;
    int rc = xfer_begin(c, &x, kind, dtype, 0, count, c->world - 1, c->world - 1);
    if (rc) return rc;
    if (own != recv + lo[c->rank]) memcpy(recv + lo[c->rank], own, len[c->rank]);
    for (int p = 0; p < c->world; p++)
        if (p != c->rank) {
            add_tx(&x, p, recv + lo[c->rank], len[c->rank]);
            add_rx(&x, p, recv + lo[p], len[p]);
        }
    return xfer_end(c, &x);
}

// reduce_scatter over a partition: send rank p the bytes [lo[p], lo[p] + len[p]) of src; reduce own block
// into dst.
static int reduce_blocks(Comm *c, uint8_t kind, unsigned char *dst, const unsigned char *src, const size_t *lo,
                         const size_t *len, size_t count, CommDtype dtype, CommOp op) {
    Xfer x;
    int rc = xfer_begin(c, &x, kind, dtype, (uint32_t)op, count, c->world - 1, 0);
    if (rc) return rc;
    Reduce d = {.own = src + lo[c->rank], .dst = dst, .bytes = len[c->rank]};
    x.red = &d;
    for (int p = 0; p < c->world; p++)
        if (p != c->rank) add_tx(&x, p, src + lo[p], len[p]);
    return xfer_end(c, &x);
}

// Block offsets and sizes in bytes: (world) each; uniform = count elements per rank, else ceil(count / world).
static int partition(Comm *c, size_t count, CommDtype dtype, int uniform, size_t **lo, size_t **len) {
    size_t esz = comm_dtype_size(dtype), w = (size_t)c->world, chunk = uniform ? count : (count + w - 1) / w;
    *lo = malloc(w * sizeof **lo);
    *len = malloc(w * sizeof **len);
    if (!*lo || !*len) {
        free(*lo), free(*len);
        return comm_fail(c, COMM_ERR_SYSTEM, "comm: out of memory");
    }
    for (size_t p = 0; p < w; p++) {
        size_t a = uniform ? p * chunk : min_sz(p * chunk, count), b = uniform ? a + chunk : min_sz(a + chunk, count);
        (*lo)[p] = a * esz;
        (*len)[p] = (b - a) * esz;
    }
    return 0;
}

int comm_host_all_gather(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype) {
    size_t bytes = count * comm_dtype_size(dtype);
    if (c->world == 1) {
        memmove(recv, send, bytes);
        return 0;
    }
    size_t *lo, *len;
    int rc = partition(c, count, dtype, 1, &lo, &len);
    if (rc == 0) rc = gather_blocks(c, K_ALL_GATHER, recv, send, lo, len, count, dtype);
    if (lo) free(lo), free(len);
    return rc;
}

int comm_host_reduce_scatter(Comm *c, void *recv, const void *send, size_t count, CommDtype dtype, CommOp op) {
    size_t bytes = count * comm_dtype_size(dtype);
    if (c->world == 1) {
        memmove(recv, send, bytes);
        return 0;
    }
    size_t *lo, *len;
    int rc = partition(c, count, dtype, 1, &lo, &len);
    if (rc == 0) rc = reduce_blocks(c, K_REDUCE_SCATTER, recv, send, lo, len, count, dtype, op);
    if (lo) free(lo), free(len);
    return rc;
}

int comm_host_all_reduce(Comm *c, void *buf, size_t count, CommDtype dtype, CommOp op) {
    if (c->world == 1) return 0;
    unsigned char *b = buf;
    size_t *lo, *len;
    int rc = partition(c, count, dtype, 0, &lo, &len);
    if (rc) return rc;
    // Phase 1 reduces block r in place (its own contribution is read before each piece is written);
    // phase 2 overwrites the other blocks, which phase 1 has finished sending (sends copy into messages).
    rc = reduce_blocks(c, K_ALL_REDUCE_RS, b + lo[c->rank], b, lo, len, count, dtype, op);
    if (rc == 0) rc = gather_blocks(c, K_ALL_REDUCE_AG, b, b + lo[c->rank], lo, len, count, dtype);
    free(lo);
    free(len);
    return rc;
}

int comm_host_broadcast(Comm *c, void *buf, size_t count, CommDtype dtype, int root) {
    if (c->world == 1) return 0;
    size_t bytes = count * comm_dtype_size(dtype);
    int me = c->rank == root;
    Xfer x;
    int rc = xfer_begin(c, &x, K_BROADCAST, dtype, (uint32_t)root, count, me ? c->world - 1 : 0, me ? 0 : 1);
    if (rc) return rc;
    if (me) {
        for (int p = 0; p < c->world; p++)
            if (p != root) add_tx(&x, p, buf, bytes);
    } else {
        add_rx(&x, root, buf, bytes);
    }
    return xfer_end(c, &x);
}

int comm_host_send(Comm *c, const void *buf, size_t count, CommDtype dtype, int peer) {
    Xfer x;
    int rc = xfer_begin(c, &x, K_P2P, dtype, 0, count, 1, 0);
    if (rc) return rc;
    add_tx(&x, peer, buf, count * comm_dtype_size(dtype));
    return xfer_end(c, &x);
}

int comm_host_recv(Comm *c, void *buf, size_t count, CommDtype dtype, int peer) {
    Xfer x;
    int rc = xfer_begin(c, &x, K_P2P, dtype, 0, count, 0, 1);
    if (rc) return rc;
    add_rx(&x, peer, buf, count * comm_dtype_size(dtype));
    return xfer_end(c, &x);
}

int comm_host_barrier(Comm *c) {
    if (c->world == 1) return 0;
    Xfer x;
    int rc = xfer_begin(c, &x, K_BARRIER, COMM_U8, 0, 0, c->world - 1, c->world - 1);
    if (rc) return rc;
    for (int p = 0; p < c->world; p++)
        if (p != c->rank) {
            add_tx(&x, p, NULL, 0);
            add_rx(&x, p, NULL, 0);
        }
    return xfer_end(c, &x);
}

const char *comm_host_peer_endpoint(const Comm *c, int peer) {
    const Host *h = c->impl;
    return h && h->peers ? h->peers[peer].endpoint : NULL;
}
