// trainer/http_client.c — HTTP/1.1 POST over POSIX sockets (see http_client.h).
#include "trainer/http_client.h"
#include "shared/err.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

// poll of one descriptor until it is ready or deadline_ms passes, ticking wait_log (NULL: none) at least as
// often as it is due: 1 ready, 0 deadline passed, -1 error (errno).
static int poll_until(struct pollfd *pfd, int64_t deadline_ms, WaitLog *wait_log) {
    for (;;) {
        int64_t left = deadline_ms - now_ms();
        if (left <= 0) return 0;
        if (wait_log) {
            int64_t due = (int64_t)(wait_log_due_in(wait_log) * 1000.0) + 1;
            if (due < left) left = due;
        }
        int pr = poll(pfd, 1, left > INT32_MAX ? INT32_MAX : (int)left);
        if (pr > 0) return 1;
        if (pr < 0 && errno != EINTR) return -1;
        if (wait_log) wait_log_tick(wait_log);
    }
}

int http_parse_url(const char *url, HttpUrl *out, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    if (!url || !url[0]) {
        err_fail(err, err_len, "empty URL");
        return HTTP_E_URL;
    }
    if (strncmp(url, "https://", 8) == 0) {
        err_fail(err, err_len, "%s: https:// is not supported (plain http:// only; put a TLS proxy in front)", url);
        return HTTP_E_URL;
    }
    if (strncmp(url, "http://", 7) != 0) {
        err_fail(err, err_len, "%s: the URL must start with http://", url);
        return HTTP_E_URL;
    }
    const char *p = url + 7, *host_b, *host_e;
    if (*p == '[') {  // IPv6 literal
        host_b = p + 1;
        host_e = strchr(host_b, ']');
        if (!host_e) {
            err_fail(err, err_len, "%s: unterminated [IPv6] host", url);
            return HTTP_E_URL;
        }
        p = host_e + 1;
    } else {
        host_b = p;
        while (*p && *p != ':' && *p != '/' && *p != '?') p++;
        host_e = p;
    }
    size_t hl = (size_t)(host_e - host_b);
    if (hl == 0 || hl >= sizeof out->host) {
        err_fail(err, err_len, "%s: missing or too long host name", url);
        return HTTP_E_URL;
    }
    memcpy(out->host, host_b, hl);
    strcpy(out->port, "80");
    if (*p == ':') {
        p++;
        const char *pb = p;
        long port = 0;
        while (isdigit((unsigned char)*p) && port <= 65535) port = port * 10 + (*p++ - '0');
        if (p == pb || port < 1 || port > 65535 || (*p && *p != '/' && *p != '?')) {
            err_fail(err, err_len, "%s: bad port (expected 1..65535)", url);
            return HTTP_E_URL;
        }
        snprintf(out->port, sizeof out->port, "%ld", port);
    } else if (*p && *p != '/' && *p != '?') {
        err_fail(err, err_len, "%s: unexpected character after the host", url);
        return HTTP_E_URL;
    }
    const char *path = *p ? p : "/";
    if (*path == '?') {  // "http://h?x" means path "/?x"
        if (strlen(path) + 1 >= sizeof out->path) goto too_long;
        snprintf(out->path, sizeof out->path, "/%s", path);
    } else {
        if (strlen(path) >= sizeof out->path) goto too_long;
        strcpy(out->path, path);
    }
    for (const char *c = out->path; *c; c++) {
        if ((unsigned char)*c <= ' ' || *c == 0x7f) {
            err_fail(err, err_len, "%s: the path holds a space or control character (percent-encode it)", url);
            return HTTP_E_URL;
        }
    }
    return HTTP_OK;
too_long:
    err_fail(err, err_len, "%s: path too long", url);
    return HTTP_E_URL;
}

// Connects to one of the host's addresses within timeout_ms each. Returns the socket or a negative code.
static int connect_host(const HttpUrl *u, const char *url, int timeout_ms, WaitLog *wait_log, char *err,
                        size_t err_len) {
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int gai = getaddrinfo(u->host, u->port, &hints, &res);
    if (gai != 0) {
        err_fail(err, err_len, "%s: cannot resolve host '%s': %s", url, u->host, gai_strerror(gai));
        return HTTP_E_CONNECT;
    }
    int rc = HTTP_E_CONNECT, last_errno = 0, timed_out = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            last_errno = errno;
            continue;
        }
        int fl = fcntl(fd, F_GETFL, 0);
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
        int c = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (c != 0 && errno == EINPROGRESS) {
            struct pollfd pfd = {.fd = fd, .events = POLLOUT};
            int pr = poll_until(&pfd, now_ms() + timeout_ms, wait_log);
            if (pr == 0) {
                timed_out = 1;
                close(fd);
                continue;
            }
            int soerr = 0;
            socklen_t sl = sizeof soerr;
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
            c = soerr ? -1 : 0;
            errno = soerr;
        }
        if (c != 0) {
            last_errno = errno;
            close(fd);
            continue;
        }
        rc = fd;  // stays non-blocking: every read and write below waits with poll under the deadline
        break;
    }
    freeaddrinfo(res);
    if (rc < 0) {
        if (timed_out && !last_errno) {
            err_fail(err, err_len, "%s: connect timed out after %d ms", url, timeout_ms);
            return HTTP_E_TIMEOUT;
        }
        err_fail(err, err_len, "%s: cannot connect to %s:%s: %s", url, u->host, u->port,
                last_errno ? strerror(last_errno) : "no usable address");
    }
    return rc;
}

// Waits until fd is ready for `events` or the deadline passes: 1 ready, 0 timeout, -1 error.
static int wait_fd(int fd, short events, int64_t deadline, WaitLog *wait_log) {
    struct pollfd pfd = {.fd = fd, .events = events};
    return poll_until(&pfd, deadline, wait_log);
}

static int send_all(int fd, const char *p, size_t n, int64_t deadline, const char *url, int timeout_ms,
                    WaitLog *wait_log, char *err, size_t err_len) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w > 0) {
            p += w, n -= (size_t)w;
            continue;
        }
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            int r = wait_fd(fd, POLLOUT, deadline, wait_log);
            if (r == 0) {
                err_fail(err, err_len, "%s: timed out after %d ms while sending the request", url, timeout_ms);
                return HTTP_E_TIMEOUT;
            }
            if (r > 0) continue;
        }
        err_fail(err, err_len, "%s: sending the request failed: %s", url, strerror(errno));
        return HTTP_E_IO;
    }
    return HTTP_OK;
}

// ---- response parsing -------------------------------------------------------------------------------

typedef HttpResponseReader RespState;

static int too_large(const char *url, size_t max_body, const char *how, char *err, size_t err_len) {
    err_fail(err, err_len, "%s: the response body is larger than the limit of %zu bytes (%.6g MiB): %s", url, max_body,
            max_body / 1048576.0, how);
    return HTTP_E_TOO_LARGE;
}

static const char *find_line_end(const char *p, const char *end) {
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    return nl;
}

static int ieq_prefix(const char *line, const char *name) {
    size_t n = strlen(name);
    return strncasecmp(line, name, n) == 0;
}

// Parses the status line and headers once "\r\n\r\n" has arrived. 1 done, 0 need more, <0 error.
static int parse_head(RespState *st, const char *url, char *err, size_t err_len) {
    const char *b = st->buf, *end = st->buf + st->len;
    const char *he = NULL;
    for (const char *p = b; p + 1 < end; p++) {
        if (p[0] == '\n' && p[1] == '\n') { he = p + 2; break; }
        if (p + 3 < end && p[0] == '\r' && p[1] == '\n' && p[2] == '\r' && p[3] == '\n') { he = p + 4; break; }
    }
    if (st->len >= 7 && strncmp(b, "HTTP/1.", 7) != 0) {
        err_fail(err, err_len, "%s: the reply is not HTTP (it starts with \"%.*s\")", url,
                (int)(st->len < 24 ? st->len : 24), b);
        return HTTP_E_PROTOCOL;
    }
    if (!he) {
        if (st->len > 64 * 1024) {
            err_fail(err, err_len, "%s: response header block larger than 64 KiB", url);
            return HTTP_E_PROTOCOL;
        }
        return 0;
    }
    if (st->len < 12 || !isdigit((unsigned char)b[7]) || b[8] != ' ' || !isdigit((unsigned char)b[9]) ||
        !isdigit((unsigned char)b[10]) || !isdigit((unsigned char)b[11])) {
        err_fail(err, err_len, "%s: malformed status line", url);
        return HTTP_E_PROTOCOL;
    }
    st->status = (b[9] - '0') * 100 + (b[10] - '0') * 10 + (b[11] - '0');
    st->chunked = 0;
    st->content_length = -1;
    for (const char *line = find_line_end(b, he) + 1; line < he;) {
        const char *le = find_line_end(line, he);
        if (!le) break;
        if (ieq_prefix(line, "content-length:")) {
            const char *v = line + 15;
            while (*v == ' ' || *v == '\t') v++;
            long long cl = 0;
            const char *d = v;
            while (isdigit((unsigned char)*d) && cl < (1LL << 50)) cl = cl * 10 + (*d++ - '0');
            while (*d == ' ' || *d == '\t' || *d == '\r') d++;
            if (d == v || d != le) {
                err_fail(err, err_len, "%s: bad Content-Length header", url);
                return HTTP_E_PROTOCOL;
            }
            st->content_length = cl;
        } else if (ieq_prefix(line, "transfer-encoding:")) {
            // "chunked" must be the last coding; anything else we cannot decode.
            const char *v = line + 18, *ve = le;
            while (ve > v && (ve[-1] == '\r' || ve[-1] == ' ' || ve[-1] == '\t')) ve--;
            if (ve - v >= 7 && strncasecmp(ve - 7, "chunked", 7) == 0) {
                st->chunked = 1;
            } else {
                err_fail(err, err_len, "%s: unsupported Transfer-Encoding '%.*s'", url, (int)(ve - v), v);
                return HTTP_E_PROTOCOL;
            }
        }
        line = le + 1;
    }
    st->head_end = (size_t)(he - b);
    st->chunk_pos = st->head_end;
    return 1;
}

static int body_append(RespState *st, const char *p, size_t n) {
    if (st->body_len + n + 1 > st->body_cap) {
        size_t cap = st->body_cap ? st->body_cap : 4096;
        while (cap < st->body_len + n + 1) cap *= 2;
        char *nb = realloc(st->body, cap);
        if (!nb) return -1;
        st->body = nb, st->body_cap = cap;
    }
    memcpy(st->body + st->body_len, p, n);
    st->body_len += n;
    st->body[st->body_len] = '\0';
    return 0;
}

// Decodes whatever complete chunks have arrived. 1 done (last chunk and trailers seen), 0 need more, <0 error.
static int advance_chunks(RespState *st, const char *url, char *err, size_t err_len) {
    const char *end = st->buf + st->len;
    for (;;) {
        const char *p = st->buf + st->chunk_pos;
        const char *le = find_line_end(p, end);
        if (!le) return 0;
        unsigned long long size = 0;
        const char *d = p;
        while (isxdigit((unsigned char)*d) && size < (1ULL << 40)) {
            int c = tolower((unsigned char)*d++);
            size = size * 16 + (unsigned)(isdigit(c) ? c - '0' : c - 'a' + 10);
        }
        if (d == p || (*d != ';' && *d != '\r' && *d != '\n' && *d != ' ')) {
            err_fail(err, err_len, "%s: malformed chunk size line in a chunked response", url);
            return HTTP_E_PROTOCOL;
        }
        if (size > st->max_body - st->body_len) {
            char how[96];
            snprintf(how, sizeof how, "a chunk of %llu bytes after %zu", size, st->body_len);
            return too_large(url, st->max_body, how, err, err_len);
        }
        const char *data = le + 1;
        if (size == 0) {
            // Trailer lines until an empty line.
            for (const char *t = data;;) {
                const char *te = find_line_end(t, end);
                if (!te) return 0;
                if (te == t || (te == t + 1 && *t == '\r')) return 1;
                t = te + 1;
            }
        }
        if ((size_t)(end - data) < size + 1) return 0;
        const char *after = data + size;
        size_t crlf = (after[0] == '\r') ? 2 : 1;
        if ((size_t)(end - after) < crlf) return 0;
        if ((crlf == 2 && after[1] != '\n') || (crlf == 1 && after[0] != '\n')) {
            err_fail(err, err_len, "%s: chunk data not followed by CRLF in a chunked response", url);
            return HTTP_E_PROTOCOL;
        }
        if (body_append(st, data, (size_t)size) != 0) {
            err_fail(err, err_len, "%s: out of memory", url);
            return HTTP_E_NOMEM;
        }
        st->chunk_pos = (size_t)(after + crlf - st->buf);
    }
}

// Is the response whole? 1 yes, 0 need more, <0 error. eof: the peer closed the connection.
static int response_complete(RespState *st, int eof, const char *url, char *err, size_t err_len) {
    for (;;) {
        if (!st->head_end) {
            int r = parse_head(st, url, err, err_len);
            if (r <= 0) {
                if (r == 0 && eof) {
                    err_fail(err, err_len, st->len ? "%s: connection closed inside the response header"
                                                  : "%s: connection closed without a response", url);
                    return st->len ? HTTP_E_PROTOCOL : HTTP_E_IO;
                }
                return r;
            }
            if (st->status >= 100 && st->status < 200) {  // interim response: drop it and read the next one
                memmove(st->buf, st->buf + st->head_end, st->len - st->head_end);
                st->len -= st->head_end;
                st->buf[st->len] = '\0';
                st->head_end = 0;
                continue;
            }
        }
        if (st->status == 204 || st->status == 304) return 1;
        if (!st->chunked && st->content_length > 0 && (unsigned long long)st->content_length > st->max_body) {
            char how[64];
            snprintf(how, sizeof how, "Content-Length is %lld", st->content_length);
            return too_large(url, st->max_body, how, err, err_len);
        }
        if (st->chunked) {
            int r = advance_chunks(st, url, err, err_len);
            if (r == 0 && eof) {
                err_fail(err, err_len, "%s: connection closed in the middle of a chunked body", url);
                return HTTP_E_IO;
            }
            return r;
        }
        size_t have = st->len - st->head_end;
        if (st->content_length >= 0) {
            if (have >= (unsigned long long)st->content_length) return 1;
            if (eof) {
                err_fail(err, err_len, "%s: connection closed after %zu of %lld body bytes", url, have,
                        st->content_length);
                return HTTP_E_IO;
            }
            return 0;
        }
        if (have > st->max_body) return too_large(url, st->max_body, "the body ends with the connection", err, err_len);
        return eof ? 1 : 0;  // no length: the body ends with the connection
    }
}

void http_response_reader_init(HttpResponseReader *r, size_t max_body) {
    memset(r, 0, sizeof *r);
    r->max_body = max_body ? max_body : HTTP_DEFAULT_MAX_RESPONSE_BYTES;
}

void http_response_reader_free(HttpResponseReader *r) {
    if (!r) return;
    free(r->buf);
    free(r->body);
    memset(r, 0, sizeof *r);
}

int http_response_reader_feed(HttpResponseReader *st, const char *bytes, size_t n, int eof, const char *url, char *err,
                              size_t err_len) {
    if (st->len + n + 1 > st->cap) {
        size_t cap = st->cap ? st->cap : 65536 * 2;
        while (cap < st->len + n + 1) cap *= 2;
        char *nb = realloc(st->buf, cap);
        if (!nb) {
            err_fail(err, err_len, "%s: out of memory", url);
            return HTTP_E_NOMEM;
        }
        st->buf = nb, st->cap = cap;
    }
    if (n) memcpy(st->buf + st->len, bytes, n);
    st->len += n;
    st->buf[st->len] = '\0';  // the header parsers stop at a NUL as well as at the end
    int c = response_complete(st, eof, url, err, err_len);
    if (c != 0) return c;
    if (st->chunked && st->head_end && st->chunk_pos > st->head_end) {
        // Decoded chunks are in st->body: drop their raw bytes, so that the buffer holds one partial chunk.
        memmove(st->buf + st->head_end, st->buf + st->chunk_pos, st->len - st->chunk_pos);
        st->len -= st->chunk_pos - st->head_end;
        st->chunk_pos = st->head_end;
        st->buf[st->len] = '\0';
    }
    // Bytes past the header beyond the body limit and room for one chunk's framing (a size line that never
    // ends, more than Content-Length announced): refused whatever they are.
    if (st->head_end && st->len - st->head_end > st->max_body + 65536)
        return too_large(url, st->max_body, "more bytes arrived than the body may hold", err, err_len);
    return 0;
}

int http_response_reader_take(HttpResponseReader *st, HttpResponse *resp, const char *url, char *err, size_t err_len) {
    memset(resp, 0, sizeof *resp);
    resp->status = st->status;
    if (st->chunked) {
        resp->body = st->body ? st->body : calloc(1, 1);
        resp->body_len = st->body_len;
        st->body = NULL;
    } else {
        size_t n = st->len - st->head_end;
        if (st->content_length >= 0 && (unsigned long long)n > (unsigned long long)st->content_length)
            n = (size_t)st->content_length;
        if (st->status == 204 || st->status == 304) n = 0;
        resp->body = malloc(n + 1);
        if (resp->body) {
            memcpy(resp->body, st->buf + st->head_end, n);
            resp->body[n] = '\0';
        }
        resp->body_len = n;
    }
    if (!resp->body) {
        err_fail(err, err_len, "%s: out of memory", url);
        return HTTP_E_NOMEM;
    }
    return HTTP_OK;
}

int http_post(const char *url, const char *content_type, const char *body, size_t body_len, const HttpOptions *opt,
              HttpResponse *resp, char *err, size_t err_len) {
    memset(resp, 0, sizeof *resp);
    HttpUrl u;
    int rc = http_parse_url(url, &u, err, err_len);
    if (rc) return rc;
    int cto = opt && opt->connect_timeout_ms > 0 ? opt->connect_timeout_ms : 10000;
    int to = opt && opt->timeout_ms > 0 ? opt->timeout_ms : 60000;
    size_t max_bytes = opt && opt->max_response_bytes ? opt->max_response_bytes : HTTP_DEFAULT_MAX_RESPONSE_BYTES;

    WaitLog *wait_log = opt ? opt->wait_log : NULL;
    int fd = connect_host(&u, url, cto, wait_log, err, err_len);
    if (fd < 0) return fd;
    int64_t deadline = now_ms() + to;

    char head[2600 + 300 + 4096];
    int ipv6 = strchr(u.host, ':') != NULL;
    int hn = snprintf(head, sizeof head,
                      "POST %s HTTP/1.1\r\nHost: %s%s%s%s%s\r\nUser-Agent: tandem-train\r\n"
                      "Content-Type: %s\r\nContent-Length: %zu\r\nAccept: application/json\r\n%s"
                      "Connection: close\r\n\r\n",
                      u.path, ipv6 ? "[" : "", u.host, ipv6 ? "]" : "", strcmp(u.port, "80") ? ":" : "",
                      strcmp(u.port, "80") ? u.port : "", content_type ? content_type : "application/octet-stream",
                      body_len, opt && opt->headers ? opt->headers : "");
    HttpResponseReader st;
    http_response_reader_init(&st, max_bytes);
    char *chunk = NULL;   // one recv's bytes
    if (hn < 0 || (size_t)hn >= sizeof head) {
        err_fail(err, err_len, "%s: request header too long", url);
        rc = HTTP_E_URL;
        goto done;
    }
    rc = send_all(fd, head, (size_t)hn, deadline, url, to, wait_log, err, err_len);
    if (rc == HTTP_OK && body_len) rc = send_all(fd, body, body_len, deadline, url, to, wait_log, err, err_len);
    if (rc) goto done;

    enum { RECV_BYTES = 65536 };
    if (!(chunk = malloc(RECV_BYTES))) {
        err_fail(err, err_len, "%s: out of memory", url);
        rc = HTTP_E_NOMEM;
        goto done;
    }
    for (;;) {
        ssize_t r = recv(fd, chunk, RECV_BYTES, 0);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            int w = wait_fd(fd, POLLIN, deadline, wait_log);
            if (w == 0) {
                err_fail(err, err_len, "%s: no complete response within %d ms (%zu bytes received)", url, to, st.len);
                rc = HTTP_E_TIMEOUT;
                goto done;
            }
            if (w > 0) continue;
            err_fail(err, err_len, "%s: waiting for the response failed: %s", url, strerror(errno));
            rc = HTTP_E_IO;
            goto done;
        }
        if (r < 0) {
            err_fail(err, err_len, "%s: receiving the response failed: %s", url, strerror(errno));
            rc = HTTP_E_IO;
            goto done;
        }
        int c = http_response_reader_feed(&st, chunk, (size_t)r, r == 0, url, err, err_len);
        if (c < 0) {
            rc = c;
            goto done;
        }
        if (c == 1) break;
    }
    rc = http_response_reader_take(&st, resp, url, err, err_len);
done:
    close(fd);
    free(chunk);
    http_response_reader_free(&st);
    return rc;
}

void http_response_free(HttpResponse *resp) {
    if (!resp) return;
    free(resp->body);
    resp->body = NULL;
    resp->body_len = 0;
}

int http_timeout_ms(double seconds) {
    const double ms = ceil(seconds * 1000.0);
    return ms >= (double)INT_MAX ? INT_MAX : (int)ms;
}

void http_body_excerpt(const char *body, size_t len, char *out, size_t cap) {
    const size_t n = len < cap - 1 ? len : cap - 1;
    for (size_t i = 0; i < n; i++) out[i] = ((unsigned char)body[i] < 0x20) ? '.' : body[i];
    out[n] = '\0';
}

void http_sleep_seconds(double s) {
    if (s <= 0) return;
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) {}
}
