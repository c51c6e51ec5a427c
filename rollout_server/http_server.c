// rollout_server/http_server.c — the libmicrohttpd daemon: routing, auth, body limits, replies, streaming,
// drain and stop (see http_server.h). One thread per connection, so a handler may block on engine events.
#define _GNU_SOURCE // POLLRDHUP
#include "rollout_server/http_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "rollout_server/http_conn_deadline.h"
#include "rollout_server/http_internal.h"
#include "shared/tokenizer/chat_template.h"

void serve_log(const char *fmt, ...) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char line[2048];
    int n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ tandem-serve: ", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(line);
    line[len] = '\n';
    fwrite(line, 1, len + 1, stderr); // one write per line keeps lines from different threads whole
}

void http_config_default(HttpConfig *c) {
    memset(c, 0, sizeof *c);
    c->host = "127.0.0.1";
    c->port = 8000;
    c->max_body_bytes = 1 << 20;
    c->max_connections = 1024;
    c->max_connections_per_client = 0;
    c->request_read_timeout_s = 10.0;
}

// ---- routing --------------------------------------------------------------------------------------

enum { M_GET = 1, M_POST = 2 };

typedef struct {
    const char *path;
    HttpRoute route;
    int methods;
    int public_route; // no auth
    void (*handler)(HttpReq *r);
} RouteDef;

static const RouteDef kRoutes[] = {
    {"/health", HTTP_ROUTE_HEALTH, M_GET, 1, http_route_health},
    {"/v1/models", HTTP_ROUTE_MODELS, M_GET, 0, http_route_models}, // kRoutes[1]: find_route's /v1/models/{id}
    {"/v1/completions", HTTP_ROUTE_COMPLETIONS, M_POST, 0, http_route_completions},
    {"/v1/chat/completions", HTTP_ROUTE_CHAT, M_POST, 0, http_route_chat},
    {"/tokenize", HTTP_ROUTE_TOKENIZE, M_POST, 0, http_route_tokenize},
    {"/detokenize", HTTP_ROUTE_DETOKENIZE, M_POST, 0, http_route_detokenize},
    {"/metrics", HTTP_ROUTE_METRICS, M_GET, 0, http_route_metrics},
    {"/health/", HTTP_ROUTE_TRL_HEALTH, M_GET, 1, http_route_trl_health},
    {"/get_world_size/", HTTP_ROUTE_TRL_WORLD_SIZE, M_GET, 0, http_route_trl_world_size},
    {"/generate/", HTTP_ROUTE_TRL_GENERATE, M_POST, 0, http_route_trl_generate},
    {"/get_world_size", HTTP_ROUTE_VLLM_WORLD_SIZE, M_GET, 0, http_route_trl_world_size},
    {"/server_info", HTTP_ROUTE_VLLM_SERVER_INFO, M_GET, 0, http_route_vllm_server_info},
    {"/reset_prefix_cache", HTTP_ROUTE_VLLM_RESET_PREFIX_CACHE, M_POST, 0, http_route_vllm_reset_prefix_cache},
    {"/pause", HTTP_ROUTE_VLLM_PAUSE, M_POST, 0, http_route_vllm_pause},
    {"/resume", HTTP_ROUTE_VLLM_RESUME, M_POST, 0, http_route_vllm_resume},
    {"/is_paused", HTTP_ROUTE_VLLM_IS_PAUSED, M_GET, 0, http_route_vllm_is_paused},
    {"/init_weight_transfer_engine", HTTP_ROUTE_VLLM_INIT_WEIGHT_TRANSFER, M_POST, 0, http_route_vllm_weight_transfer},
    {"/start_weight_update", HTTP_ROUTE_VLLM_START_WEIGHT_UPDATE, M_POST, 0, http_route_vllm_weight_transfer},
    {"/update_weights", HTTP_ROUTE_VLLM_UPDATE_WEIGHTS, M_POST, 0, http_route_vllm_weight_transfer},
    {"/finish_weight_update", HTTP_ROUTE_VLLM_FINISH_WEIGHT_UPDATE, M_POST, 0, http_route_vllm_weight_transfer},
    {"/v1/chat/completions/render", HTTP_ROUTE_VLLM_CHAT_RENDER, M_POST, 0, http_route_vllm_multimodal},
    {"/inference/v1/generate", HTTP_ROUTE_VLLM_INFERENCE_GENERATE, M_POST, 0, http_route_vllm_multimodal},
};

// GET /v1/models/{id}: the model route with an id (which may hold slashes, "org/name"); http_route_models answers
// for the one id or with a 404.
#define MODELS_PREFIX "/v1/models/"

static const RouteDef *find_route(const char *path) {
    for (size_t i = 0; i < sizeof kRoutes / sizeof kRoutes[0]; i++)
        if (strcmp(kRoutes[i].path, path) == 0) return &kRoutes[i];
    if (strncmp(path, MODELS_PREFIX, strlen(MODELS_PREFIX)) == 0 && path[strlen(MODELS_PREFIX)])
        return &kRoutes[1];
    return NULL;
}

static int method_bit(const char *m) {
    if (strcmp(m, "GET") == 0 || strcmp(m, "HEAD") == 0) return M_GET;
    if (strcmp(m, "POST") == 0) return M_POST;
    return 0;
}

// ---- replies --------------------------------------------------------------------------------------

static void finish_reply(HttpReq *r, int status, struct MHD_Response *resp, const char *content_type) {
    if (!resp) { // out of memory building the response: nothing sensible left but dropping the connection
        r->status = 500;
        return;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    if (status == 401) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (status == 405) {
        const RouteDef *rd = find_route(r->path);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, rd && rd->methods == M_POST ? "POST" : "GET, HEAD");
    }
    // Close the connection on errors caught before the body was read and while draining, so a client does
    // not reuse a connection whose request body may still be in flight, or one that is about to go away.
    if (r->early.status || atomic_load(&r->srv->draining))
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    if (MHD_queue_response(r->conn, (unsigned)status, resp) == MHD_YES) r->status = status;
    MHD_destroy_response(resp);
}

void http_reply_data(HttpReq *r, int status, const char *content_type, char *data, size_t len) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(
        len, data ? data : (char *)"", data ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!resp) free(data);
    finish_reply(r, status, resp, content_type);
}

void http_reply_json(HttpReq *r, int status, json_t *body) {
    char *s = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    if (!s) {
        HttpError e;
        http_error_set(&e, 500, NULL, "out of memory serialising the answer");
        size_t n = 0;
        char *t = http_error_body(&e, &n);
        http_reply_data(r, 500, "application/json", t, t ? n : 0);
        return;
    }
    http_reply_data(r, status, "application/json", s, strlen(s));
}

void http_reply_error(HttpReq *r, const HttpError *e) {
    if (e->status == 499) { // client gone: nobody to answer; the handler returns MHD_NO and the socket closes
        r->gone = 1;
        return;
    }
    size_t n = 0;
    char *s = http_error_body(e, &n);
    http_reply_data(r, e->status, "application/json", s, s ? n : 0);
}

typedef struct {
    HttpStreamOps ops;
    HttpBuf out;
    size_t off;
    int done;
} StreamCtx;

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    StreamCtx *st = cls;
    while (st->off >= st->out.len) {
        if (st->done) return MHD_CONTENT_READER_END_OF_STREAM;
        st->out.len = 0;
        st->off = 0;
        int rc = st->ops.fill(st->ops.user, &st->out);
        if (rc < 0 || st->out.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (rc > 0) st->done = 1;
    }
    size_t n = st->out.len - st->off;
    if (n > max) n = max;
    memcpy(buf, st->out.data + st->off, n);
    st->off += n;
    return (ssize_t)n;
}

static void stream_free(void *cls) {
    StreamCtx *st = cls;
    if (st->ops.destroy) st->ops.destroy(st->ops.user);
    http_buf_free(&st->out);
    free(st);
}

void http_reply_stream(HttpReq *r, const HttpStreamOps *ops) {
    StreamCtx *st = calloc(1, sizeof *st);
    if (!st) {
        if (ops->destroy) ops->destroy(ops->user);
        HttpError e;
        http_error_set(&e, 500, NULL, "out of memory starting the stream");
        http_reply_error(r, &e);
        return;
    }
    st->ops = *ops;
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_read, st,
                                                                  stream_free);
    if (!resp) {
        stream_free(st);
        return;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    finish_reply(r, 200, resp, "text/event-stream");
}

int http_client_gone(int fd) {
    if (fd < 0) return 0;
    struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return 0;
    if (p.revents & (POLLHUP | POLLERR | POLLNVAL | POLLRDHUP)) return 1;
    if (p.revents & POLLIN) {
        char c;
        ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0) return 1;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return 1;
    }
    return 0;
}

// ---- the access handler -----------------------------------------------------------------------------

static void read_timeout_error(HttpReq *r) {
    char secs[32];
    snprintf(secs, sizeof secs, "%g", r->srv->cfg.request_read_timeout_s);
    http_error_set(&r->early, 408, NULL, "the request did not arrive in full within %s s (--request-read-timeout); "
                   "send the headers and body at once", secs);
}

// Whether to keep reading a refused request's body (so the client reads our answer instead of a reset)
// or answer at once: bodies beyond this are not worth reading.
#define DISCARD_LIMIT ((size_t)64 << 20)

static void decide_early(HttpReq *r, const RouteDef *rd, const char *method) {
    HttpServer *s = r->srv;
    HttpError *e = &r->early;
    if (!rd) {
        http_error_set(e, 404, NULL, "no route %s %s (see docs/http-api.md for the routes)", method, r->path);
        return;
    }
    if (s->api_key && !rd->public_route) {
        const char *auth = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
        size_t kl = strlen(s->api_key);
        int ok = auth && strncmp(auth, "Bearer ", 7) == 0 && strlen(auth + 7) == kl;
        // Compare every byte whatever the first difference, so timing does not reveal the key.
        unsigned char diff = 0;
        for (size_t i = 0; ok && i < kl; i++) diff |= (unsigned char)(auth[7 + i] ^ s->api_key[i]);
        if (!ok || diff) {
            http_error_set(e, 401, NULL, "missing or wrong API key: send 'Authorization: Bearer <key>'");
            return;
        }
    }
    if (!(method_bit(method) & rd->methods)) {
        http_error_set(e, 405, NULL, "method %s is not allowed on %s (use %s)", method, r->path,
                       rd->methods == M_POST ? "POST" : "GET");
        return;
    }
    if (atomic_load(&s->draining)) {
        http_error_set(e, 503, NULL, "the server is shutting down");
        return;
    }
    const char *cl = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        unsigned long long n = strtoull(cl, NULL, 10);
        if (n > s->cfg.max_body_bytes)
            http_error_set(e, 413, NULL, "request body of %llu bytes is over the limit of %zu bytes (--max-body-bytes)",
                           n, s->cfg.max_body_bytes);
    }
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
    HttpServer *s = cls;
    HttpReq *r = *con_cls;
    if (!r) { // first call: headers only
        r = calloc(1, sizeof *r);
        if (!r) return MHD_NO;
        *con_cls = r;
        r->srv = s;
        r->conn = conn;
        clock_gettime(CLOCK_MONOTONIC, &r->t0);
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        r->fd = ci ? ci->connect_fd : -1;
        snprintf(r->method, sizeof r->method, "%s", method);
        snprintf(r->path, sizeof r->path, "%s", url);
        const RouteDef *rd = find_route(url);
        r->route = rd ? rd->route : HTTP_ROUTE_OTHER;
        atomic_fetch_add(&s->metrics.in_flight, 1);
        const union MHD_ConnectionInfo *sc = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        r->tracked = sc ? sc->socket_context : NULL;
        const char *length = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        unsigned long long declared = length ? strtoull(length, NULL, 10) : 0;
        r->content_length = !length ? -1 : declared > LLONG_MAX ? LLONG_MAX : (long long)declared;
        if (http_conn_request_late(s->conns, r->tracked)) { // headers came in past the deadline: say so
            read_timeout_error(r);
            http_reply_error(r, &r->early);
            return r->status ? MHD_YES : MHD_NO;
        }
        decide_early(r, rd, method);
        if (r->early.status) {
            // Answer before the body when the client waits for "100 Continue" (it then never sends the body),
            // or when the body is too large to be worth discarding (the client may see a reset instead).
            const char *ex = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
            if ((ex && strcasecmp(ex, "100-continue") == 0) || r->content_length > (long long)DISCARD_LIMIT) {
                http_reply_error(r, &r->early);
                return r->status ? MHD_YES : MHD_NO;
            }
        }
        return MHD_YES;
    }
    if (*upload_data_size > 0) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        r->body_seen += n;
        if (http_conn_request_late(s->conns, r->tracked)) {
            // The body's last bytes: the final call answers 408. Any earlier: libmicrohttpd cannot answer while
            // the body is arriving, so the connection closes.
            if (r->content_length >= 0 && r->body_seen >= (unsigned long long)r->content_length) return MHD_YES;
            r->read_timed_out = 1;
            return MHD_NO;
        }
        if (r->status) return MHD_YES; // already answered
        if (r->early.status) {
            if (r->body_seen > DISCARD_LIMIT) {
                http_reply_error(r, &r->early);
                return r->status ? MHD_YES : MHD_NO;
            }
            return MHD_YES;
        }
        if (r->body_seen > r->srv->cfg.max_body_bytes) { // chunked upload without a Content-Length
            http_error_set(&r->early, 413, NULL, "request body is over the limit of %zu bytes (--max-body-bytes)",
                           r->srv->cfg.max_body_bytes);
            http_buf_free(&r->body);
            return MHD_YES;
        }
        http_buf_append(&r->body, upload_data, n);
        return MHD_YES;
    }
    if (!r->status && !r->early.status && http_conn_request_late(s->conns, r->tracked))
        read_timeout_error(r); // the body's last bytes came in past the deadline
    http_conn_request_in(s->conns, r->tracked);
    if (r->status) return MHD_YES; // answered during the upload
    if (r->early.status) {
        http_reply_error(r, &r->early);
        return r->status ? MHD_YES : MHD_NO;
    }
    if (r->body.oom) {
        HttpError e;
        http_error_set(&e, 500, NULL, "out of memory reading the request body");
        http_reply_error(r, &e);
        return r->status ? MHD_YES : MHD_NO;
    }
    const RouteDef *rd = find_route(r->path);
    rd->handler(r);
    if (!r->status) return MHD_NO; // client gone, server stopping or out of memory: drop the connection
    return MHD_YES;
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls, enum MHD_RequestTerminationCode toe) {
    HttpServer *s = cls;
    HttpReq *r = *con_cls;
    if (!r) return;
    *con_cls = NULL;
    if (http_conn_was_cut(s->conns, r->tracked)) r->read_timed_out = 1;
    http_conn_request_done(s->conns, r->tracked);
    int status = r->status ? r->status : r->read_timed_out ? 408 : 499;
    http_metrics_count(&s->metrics, r->route, status);
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ms = (double)(t1.tv_sec - r->t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - r->t0.tv_nsec) / 1e6;
    const char *how = r->read_timed_out && !r->status ? " (not in full within --request-read-timeout: closed)" :
                      toe == MHD_REQUEST_TERMINATED_COMPLETED_OK ? "" :
                      toe == MHD_REQUEST_TERMINATED_CLIENT_ABORT || toe == MHD_REQUEST_TERMINATED_READ_ERROR ?
                                                                 " (client went away)" :
                      toe == MHD_REQUEST_TERMINATED_DAEMON_SHUTDOWN ? " (server stopped)" : " (connection closed)";
    if (r->prompt_tokens || r->completion_tokens)
        serve_log("%s %s %d %.1f ms prompt_tokens=%lld completion_tokens=%lld%s", r->method, r->path, status, ms,
                  (long long)r->prompt_tokens, (long long)r->completion_tokens, how);
    else
        serve_log("%s %s %d %.1f ms%s", r->method, r->path, status, ms, how);
    http_buf_free(&r->body);
    free(r);
    pthread_mutex_lock(&s->mu);
    if (atomic_fetch_sub(&s->metrics.in_flight, 1) == 1) pthread_cond_broadcast(&s->idle);
    pthread_mutex_unlock(&s->mu);
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    HttpServer *s = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *fd = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        const union MHD_ConnectionInfo *addr = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        *socket_context = fd ? http_conn_opened(s->conns, fd->connect_fd, addr ? addr->client_addr : NULL) : NULL;
    } else {
        http_conn_closed(s->conns, *socket_context);
        *socket_context = NULL;
    }
}

// Called when a request line is in, before its headers; what it returns becomes the access handler's
// *con_cls, which must stay NULL for on_request to see its first call.
static void *on_request_line(void *cls, const char *uri, struct MHD_Connection *conn) {
    (void)uri;
    HttpServer *s = cls;
    const union MHD_ConnectionInfo *sc = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    http_conn_request_line(s->conns, sc ? sc->socket_context : NULL);
    return NULL;
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    HttpServer *s = cls;
    char msg[1024];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = 0;
    // libmicrohttpd says this when it turns a connection away: its address is over its share, or every slot
    // is taken.
    if (strncmp(msg, "Server reached connection limit", 31) == 0)
        serve_log("libmicrohttpd: %s (a client address holds --max-connections-per-client %d connections, or "
                  "the server --max-connections %d; if a trainer is turned away, raise them: "
                  "docs/troubleshooting.md)", msg, s->cfg.max_connections_per_client, s->cfg.max_connections);
    else
        serve_log("libmicrohttpd: %s", msg);
}

// ---- lifecycle ------------------------------------------------------------------------------------

static void free_server(HttpServer *s) {
    if (!s) return;
    http_conn_tracker_free(s->conns);
    free(s->host);
    free(s->api_key);
    free(s->model_name);
    free(s->chat_template);
    chat_template_free(s->chat);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->idle);
    free(s);
}

static char *dup_or_null(const char *x) { return x && x[0] ? strdup(x) : NULL; }

int http_server_start(HttpServer **out, EngineGroup *g, const HttpConfig *cfg, char *err, size_t err_len) {
    *out = NULL;
    if (cfg->port < 0 || cfg->port > 65535) {
        snprintf(err, err_len, "--port %d is not a TCP port (0..65535)", cfg->port);
        return -1;
    }
    if (cfg->max_body_bytes == 0) {
        snprintf(err, err_len, "--max-body-bytes must be > 0");
        return -1;
    }
    if (cfg->max_connections < 1 || cfg->max_connections_per_client < 0) {
        snprintf(err, err_len, "--max-connections must be >= 1 and --max-connections-per-client >= 0");
        return -1;
    }
    if (!(cfg->request_read_timeout_s >= 0)) {
        snprintf(err, err_len, "--request-read-timeout must be >= 0 seconds");
        return -1;
    }
    HttpServer *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->idle, NULL);
    s->engines = g;
    s->cfg = *cfg;
    s->host = strdup(cfg->host ? cfg->host : "127.0.0.1");
    s->api_key = dup_or_null(cfg->api_key);
    s->model_name = strdup(cfg->served_model_name && cfg->served_model_name[0] ? cfg->served_model_name
                                                                               : engine_group_model_id(g));
    s->chat_template = dup_or_null(cfg->chat_template);
    http_metrics_init(&s->metrics);
    if (!s->host || !s->model_name || (cfg->api_key && cfg->api_key[0] && !s->api_key)) {
        free_server(s);
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    s->cfg.host = s->host;
    s->cfg.api_key = s->api_key;
    s->cfg.served_model_name = s->model_name;
    s->cfg.chat_template = s->chat_template;
    if (s->cfg.max_connections_per_client == 0 || s->cfg.max_connections_per_client > s->cfg.max_connections)
        s->cfg.max_connections_per_client = s->cfg.max_connections;
    const Model *model = engine_group_model(g);
    s->vocab_size = model->cfg.vocab_size;
    s->started = (int64_t)time(NULL);
    s->max_model_len = model->cfg.max_seq_len;
    // An explicitly forced template that does not work is a start-up error; a model whose own template is
    // missing or unknown still serves completions, and chat requests say why they cannot be served.
    char cerr[400];
    cerr[0] = 0;
    if (!engine_group_tokenizer(g)) { // no tokenizer.json: main.c says what is off, chat requests say why
        if (s->chat_template) {
            snprintf(err, err_len, "--chat-template %s needs a tokenizer, and the model folder has no "
                     "tokenizer.json", s->chat_template);
            free_server(s);
            return -1;
        }
    } else if (chat_template_from_tokenizer(&s->chat, engine_group_tokenizer(g), s->chat_template, cerr,
                                            sizeof cerr) != 0) {
        s->chat = NULL;
        if (s->chat_template) {
            snprintf(err, err_len, "--chat-template %s: %s", s->chat_template, cerr);
            free_server(s);
            return -1;
        }
        snprintf(s->chat_err, sizeof s->chat_err, "%s", cerr[0] ? cerr : "the model folder has no chat template");
        serve_log("chat template: none usable (%s); /v1/chat/completions will answer 400", s->chat_err);
    } else {
        serve_log("chat template: %s%s", chat_family_name(chat_template_family(s->chat)),
                  s->chat_template ? " (forced by --chat-template)" : "");
    }

    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *ai = NULL;
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", cfg->port);
    int gai = getaddrinfo(s->host, port_s, &hints, &ai);
    if (gai != 0 || !ai) {
        snprintf(err, err_len, "--host %s: cannot resolve: %s", s->host, gai_strerror(gai));
        free_server(s);
        return -1;
    }
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL | MHD_USE_ITC |
                     MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    if (http_conn_tracker_start(&s->conns, s->cfg.request_read_timeout_s, HTTP_IDLE_TIMEOUT_S, err, err_len) != 0) {
        freeaddrinfo(ai);
        free_server(s);
        return -1;
    }
    // A connection over the cap, or over its client address's share, is accepted and closed at once (with one
    // thread per connection, libmicrohttpd keeps polling the listening socket at the cap).
    int max_conn = s->cfg.max_connections;
    s->daemon = MHD_start_daemon(flags, (uint16_t)cfg->port, NULL, NULL, on_request, s,
                                 MHD_OPTION_EXTERNAL_LOGGER, mhd_log, s, // first, so it sees every message
                                 MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                                 MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                                 MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
                                 MHD_OPTION_URI_LOG_CALLBACK, on_request_line, s,
                                 MHD_OPTION_CONNECTION_LIMIT, (unsigned)max_conn,
                                 MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)s->cfg.max_connections_per_client,
                                 MHD_OPTION_LISTEN_BACKLOG_SIZE, (unsigned)(max_conn > 128 ? max_conn : 128),
                                 MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_IDLE_TIMEOUT_S,
                                 MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(64 * 1024),
                                 MHD_OPTION_THREAD_STACK_SIZE, (size_t)(2 << 20),
                                 MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->daemon) {
        snprintf(err, err_len, "cannot listen on %s:%d (address in use, or not an address of this machine?)",
                 s->host, cfg->port);
        free_server(s);
        return -1;
    }
    char read_limit[64];
    if (s->cfg.request_read_timeout_s > 0)
        snprintf(read_limit, sizeof read_limit, "within %g s", s->cfg.request_read_timeout_s);
    else
        snprintf(read_limit, sizeof read_limit, "without a time limit");
    serve_log("HTTP connections: at most %d (--max-connections), %d per client address "
              "(--max-connections-per-client); each request must arrive in full %s (--request-read-timeout); "
              "kept-alive connections close after %d s without a request",
              s->cfg.max_connections, s->cfg.max_connections_per_client, read_limit, HTTP_IDLE_TIMEOUT_S);
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : cfg->port;
    *out = s;
    return 0;
}

int http_server_port(const HttpServer *s) { return s->port; }

void http_server_stop_accepting(HttpServer *s) {
    if (atomic_exchange(&s->draining, 1)) return;
    MHD_socket fd = MHD_quiesce_daemon(s->daemon);
    if (fd != MHD_INVALID_SOCKET) close(fd);
}

int http_server_drain(HttpServer *s, int timeout_ms) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    if (timeout_ms >= 0) {
        deadline.tv_sec += timeout_ms / 1000;
        deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec++, deadline.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&s->mu);
    while (atomic_load(&s->metrics.in_flight) > 0) {
        if (timeout_ms < 0) pthread_cond_wait(&s->idle, &s->mu);
        else if (pthread_cond_timedwait(&s->idle, &s->mu, &deadline) == ETIMEDOUT) break;
    }
    int left = (int)atomic_load(&s->metrics.in_flight);
    pthread_mutex_unlock(&s->mu);
    return left;
}

void http_server_stop(HttpServer *s) {
    if (!s) return;
    http_server_stop_accepting(s);
    atomic_store(&s->aborting, 1); // waiting handlers and streams release their engine requests and return
    http_conn_tracker_stop_sweep(s->conns); // no shutdown(2) on sockets the daemon is closing
    MHD_stop_daemon(s->daemon);   // closes every connection and joins their threads
    free_server(s);
}
