// rollout_server/http_server.h — tandem-serve's HTTP front end (libmicrohttpd, one thread per connection).
//
// Handler threads parse and validate requests, tokenize, submit to the engines (each prompt routed on its own,
// engine_group_submit) and wait on their events; they never touch the model. Routes: docs/http-api.md. Shutdown is three calls: http_server_stop_accepting
// (close the listening socket; requests arriving on open connections get 503), http_server_drain (wait for
// the requests in flight), http_server_stop (abort what is left — releasing its engine requests — join the
// threads, free). The engines must outlive the server.
#ifndef TANDEM_ROLLOUT_HTTP_SERVER_H
#define TANDEM_ROLLOUT_HTTP_SERVER_H

#include <stddef.h>

#include "rollout_server/engine_group.h"

typedef struct {
    const char *host;               // address to bind ("127.0.0.1", "0.0.0.0", "::1", or a host name)
    int port;                       // 0 = any free port (http_server_port says which)
    size_t max_body_bytes;          // larger request bodies get 413
    const char *api_key;            // NULL or "": no auth; else "Authorization: Bearer <key>" on all but /health(/)
    const char *served_model_name;  // NULL: engine_group_model_id()
    const char *chat_template;      // NULL: the model's own template; else a template family forced by name
    int max_connections;            // concurrent connections (one thread each); more are closed at once
    int max_connections_per_client; // concurrent connections from one client address; more are closed at once;
                                    // 0 = max_connections
    double request_read_timeout_s;  // a request's headers and body must arrive within this many seconds of the
                                    // connect (or of its request line on a kept-alive connection); 0 = no limit
} HttpConfig;

// Kept-alive connections with no request for this long are closed (also one whose next request line trickles).
#define HTTP_IDLE_TIMEOUT_S 120

// 127.0.0.1:8000, 1 MiB bodies, no key, 1024 connections, as many per client, 10 s to read a request.
void http_config_default(HttpConfig *c);

typedef struct HttpServer HttpServer;

int http_server_start(HttpServer **out, EngineGroup *g, const HttpConfig *cfg, char *err, size_t err_len);
int http_server_port(const HttpServer *s);
void http_server_stop_accepting(HttpServer *s);
// Waits until no request is in flight or timeout_ms passed (-1 = no limit). Returns how many are left.
int http_server_drain(HttpServer *s, int timeout_ms);
void http_server_stop(HttpServer *s);

// One line on stderr with a UTC timestamp: "2025-01-01T00:00:00.123Z tandem-serve: <message>".
void serve_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
