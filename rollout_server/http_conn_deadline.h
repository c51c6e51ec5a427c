// rollout_server/http_conn_deadline.h — the request read deadline (--request-read-timeout) and the bound on
// kept-alive connections, against clients that send a byte every few seconds: libmicrohttpd's own timeout
// only counts inactivity, so such a client would hold its connection (and its thread) for ever.
//
// Every connection is tracked from libmicrohttpd's connect notification to its close notification, in one of
// three phases:
//   reading  — from the connect (first request) or the request line (later requests on a kept-alive
//              connection) until the request, headers and body, is in; its deadline is start + read timeout;
//   handling — the request is in and being answered: no deadline (generation may take minutes);
//   idle     — answered, waiting for the next request line; bounded by the idle timeout, so a client trickling
//              the next request line is cut when a silent one would be.
// A sweep thread closes connections past their deadline by a grace period (shutdown(2) on the socket: the
// connection's thread sees the end of the stream and libmicrohttpd closes it). The access handler checks the
// deadline itself whenever it gets control, so a request whose headers or body end past the deadline gets a
// 408 where libmicrohttpd can still answer (headers just in, or body complete) and is cut where it cannot
// (libmicrohttpd 0.9 queues no answer while a body is arriving).
#ifndef TANDEM_ROLLOUT_HTTP_CONN_DEADLINE_H
#define TANDEM_ROLLOUT_HTTP_CONN_DEADLINE_H

#include <stddef.h>
#include <sys/socket.h>

typedef struct HttpConnTracker HttpConnTracker;
// One per connection. NULL (out of memory when it opened) means untracked: every call below accepts it.
typedef struct HttpConn HttpConn;

// read_timeout_s: 0 = no read deadline (kept-alive connections are still bounded by idle_timeout_s). Starts
// the sweep thread. Returns 0, or -1 with err set.
int http_conn_tracker_start(HttpConnTracker **out, double read_timeout_s, unsigned idle_timeout_s, char *err,
                            size_t err_len);
// Stops the sweep (call before stopping the daemon); the tracker stays usable for close notifications.
void http_conn_tracker_stop_sweep(HttpConnTracker *t);
// Frees the tracker and any connection still tracked (after the daemon stopped).
void http_conn_tracker_free(HttpConnTracker *t);

// libmicrohttpd's connect notification: fd is the client socket, addr its address (for the log).
HttpConn *http_conn_opened(HttpConnTracker *t, int fd, const struct sockaddr *addr);
// libmicrohttpd's close notification, before it closes the socket: the sweep no longer touches fd.
void http_conn_closed(HttpConnTracker *t, HttpConn *c);
// A request line arrived (libmicrohttpd's URI log callback): a kept-alive connection starts reading again.
void http_conn_request_line(HttpConnTracker *t, HttpConn *c);
// 1 when the request being read is past its deadline.
int http_conn_request_late(HttpConnTracker *t, HttpConn *c);
// The request is in (headers and body): no deadline while it is answered.
void http_conn_request_in(HttpConnTracker *t, HttpConn *c);
// The request is answered: the connection idles until its next request line.
void http_conn_request_done(HttpConnTracker *t, HttpConn *c);
// 1 when the sweep closed this connection for being past its deadline.
int http_conn_was_cut(HttpConnTracker *t, HttpConn *c);

#endif
