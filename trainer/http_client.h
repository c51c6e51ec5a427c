// trainer/http_client.h — a minimal HTTP/1.1 client over POSIX sockets (no HTTP library is among tandem's
// dependencies). One request per connection ("Connection: close"); http:// URLs only (host name, IPv4, or
// [IPv6] literal; optional port, default 80; optional path, default "/").
// Responses: a Content-Length body, a chunked body (chunk extensions and trailers skipped), or a body that
// ends when the server closes the connection. Interim 1xx responses are skipped.
// Timeouts: connect_timeout_ms bounds the TCP connect (per resolved address); timeout_ms bounds everything
// after it (sending the request and receiving the whole response).
#ifndef TANDEM_TRAINER_HTTP_CLIENT_H
#define TANDEM_TRAINER_HTTP_CLIENT_H

#include <stddef.h>

#include "trainer/wait_log.h"

// Failure classes, so that a caller can decide what is worth a retry.
enum {
    HTTP_OK = 0,
    HTTP_E_URL = -1,        // the URL is malformed or not http://
    HTTP_E_CONNECT = -2,    // name resolution or TCP connect failed (refused, unreachable)
    HTTP_E_TIMEOUT = -3,    // connect or exchange ran past its timeout
    HTTP_E_IO = -4,         // the connection broke mid-exchange (reset, closed before the response was whole)
    HTTP_E_PROTOCOL = -5,   // the peer's bytes are not a valid HTTP/1.x response
    HTTP_E_TOO_LARGE = -6,  // the response body is larger than max_response_bytes
    HTTP_E_NOMEM = -7,
};

// A reply is held in memory whole: a body larger than the limit is refused as soon as that is known (from
// Content-Length before the body is read, from a chunk's size line, or once the bytes received pass it).
#define HTTP_DEFAULT_MAX_RESPONSE_BYTES ((size_t)64 << 20)

typedef struct {
    int connect_timeout_ms;       // > 0
    int timeout_ms;               // > 0
    size_t max_response_bytes;    // largest body accepted; 0: HTTP_DEFAULT_MAX_RESPONSE_BYTES
    const char *headers;          // NULL, or extra header lines, each ending in "\r\n" (e.g. "Authorization: ...")
    WaitLog *wait_log;            // NULL, or ticked while the request waits (connecting, sending, the answer):
                                  // a long wait says so about every WAIT_LOG_INTERVAL_S
} HttpOptions;

typedef struct {
    int status;           // e.g. 200
    char *body;           // malloc'd, NUL-terminated (the body may hold NULs itself; body_len is exact)
    size_t body_len;
} HttpResponse;

typedef struct {
    char host[256];       // without brackets for IPv6
    char port[8];
    char path[2048];
} HttpUrl;

// Parses an http:// URL. 0, or HTTP_E_URL with a message saying what is wrong.
int http_parse_url(const char *url, HttpUrl *out, char *err, size_t err_len);

// The response side of http_post without the socket: it is fed the connection's bytes as they arrive, in pieces
// of any size, so tests and fuzz targets drive the same parser with any split of a response.
typedef struct {
    char *buf;                 // raw bytes received and not yet decoded, NUL-terminated (len bytes)
    size_t len, cap;
    size_t head_end;           // offset of the first body byte (0 until the header block is complete)
    int status;
    int chunked;
    long long content_length;  // -1 when absent
    size_t chunk_pos;          // chunked: offset of the next chunk-size line
    char *body;                // chunked: decoded bytes so far
    size_t body_len, body_cap;
    size_t max_body;           // the largest body accepted
} HttpResponseReader;

void http_response_reader_init(HttpResponseReader *r, size_t max_body);   // 0: HTTP_DEFAULT_MAX_RESPONSE_BYTES
// Takes n more bytes; eof: the peer closed the connection (n may be 0). Returns 1 when the response is whole
// (call http_response_reader_take), 0 when more bytes are needed, or a negative HTTP_E_* (PROTOCOL, TOO_LARGE,
// IO for a response cut short, NOMEM) with a message naming url.
int http_response_reader_feed(HttpResponseReader *r, const char *bytes, size_t n, int eof, const char *url, char *err,
                              size_t err_len);
// After feed returned 1: the status and the body (malloc'd, NUL-terminated) into resp. HTTP_OK or HTTP_E_NOMEM.
int http_response_reader_take(HttpResponseReader *r, HttpResponse *resp, const char *url, char *err, size_t err_len);
void http_response_reader_free(HttpResponseReader *r);

// POSTs body (body_len bytes) with the given Content-Type. Any HTTP status is a success at this level
// (resp->status tells); the message of a failure names the URL. The caller frees resp->body.
int http_post(const char *url, const char *content_type, const char *body, size_t body_len, const HttpOptions *opt,
              HttpResponse *resp, char *err, size_t err_len);
void http_response_free(HttpResponse *resp);

// Helpers of the services' clients (rewards, environments): a timeout in whole milliseconds (rounded up, capped at
// INT_MAX), the printable start of a body for an error message (control bytes as '.'; out NUL-terminated, cap > 0),
// and a pause of s seconds (none when s <= 0; a signal does not cut it short).
int http_timeout_ms(double seconds);
void http_body_excerpt(const char *body, size_t len, char *out, size_t cap);
void http_sleep_seconds(double s);

#endif
