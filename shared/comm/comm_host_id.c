// shared/comm/comm_host_id.c — the host backend's communicator id (comm.h comm_unique_id_host): the address of a
// rendezvous that rank 0 will run, as text, so that members who meet by other means (an id sent over ZeroMQ) can
// join the host backend the way they join NCCL.
//
// Layout (COMM_UNIQUE_ID_BYTES = 128): "tandem-host-id 1 ADDR PORT" followed by NULs up to byte 128. ADDR is the
// caller's address (IPv4/IPv6 literal without brackets, or a host name; no spaces), PORT 1..65535. The version
// (1) lets a later layout be refused by name instead of misread.
#include "shared/comm/comm_internal.h"
#include "shared/err.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define HOST_ID_MAGIC "tandem-host-id "
#define HOST_ID_VERSION 1

// A port of `family` that nothing is bound to now at sa (whose port is 0): bind port 0, read what the kernel
// picked, close. The rendezvous binds it moments later; a process that takes it in between makes rank 0's join fail
// with a message naming the port. Returns the port, or -1 with errno set.
static int free_port_at(const struct sockaddr *sa, socklen_t sa_len) {
    int fd = socket(sa->sa_family, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_storage got;
    socklen_t len = sizeof got;
    if (bind(fd, sa, sa_len) != 0 || getsockname(fd, (struct sockaddr *)&got, &len) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    close(fd);
    return ntohs(got.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&got)->sin6_port
                                           : ((struct sockaddr_in *)&got)->sin_port);
}

// The address as the rendezvous will bind it (rendezvous.c master_endpoint): a literal as it is; a host name as
// every IPv4 interface ("tcp://*:PORT"), after checking that the name is an address of this machine.
static int pick_port(const char *addr, int *port, char *err, size_t err_len) {
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICHOST}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    int numeric = getaddrinfo(addr, "0", &hints, &res) == 0;
    if (!numeric) {
        hints.ai_flags = 0;
        hints.ai_family = AF_INET;   // ZeroMQ, without ZMQ_IPV6, resolves a name to IPv4 only
        int rc = getaddrinfo(addr, "0", &hints, &res);
        if (rc != 0)
            return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_unique_id_host: cannot resolve addr '%s' to an "
                                 "IPv4 address: %s", addr, gai_strerror(rc));
    }
    int p = free_port_at(res->ai_addr, res->ai_addrlen);
    int e = errno;
    if (p >= 0 && !numeric) {   // the name is ours; the rendezvous binds every interface
        struct sockaddr_in any = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY)};
        p = free_port_at((const struct sockaddr *)&any, sizeof any);
        e = errno;
    }
    freeaddrinfo(res);
    if (p < 0 && (e == EADDRNOTAVAIL || e == EAFNOSUPPORT))
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_unique_id_host: addr '%s' is not an address of this "
                             "machine (%s): the member that joins as rank 0 runs the rendezvous there, so make the id "
                             "on that member's machine with one of its addresses", addr, strerror(e));
    if (p < 0)
        return err_fail_code(COMM_ERR_SYSTEM, err, err_len, "comm_unique_id_host: no free TCP port on '%s': %s", addr,
                             strerror(e));
    *port = p;
    return 0;
}

int comm_unique_id_host(const char *addr, uint8_t id[COMM_UNIQUE_ID_BYTES], char *err, size_t err_len) {
    if (!id) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_unique_id_host: id is NULL");
    if (!addr || !*addr) return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_unique_id_host: addr is empty");
    size_t n = strlen(addr);
    if (n > COMM_HOST_ID_ADDR_MAX)
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_unique_id_host: addr is %zu bytes, at most %d fit "
                             "in the id", n, COMM_HOST_ID_ADDR_MAX);
    if (strpbrk(addr, " \t\r\n\v\f[]/"))
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_unique_id_host: addr '%s' must be a bare IPv4/IPv6 "
                             "literal or host name (no brackets, spaces, scheme or port)", addr);
    int port = 0, rc = pick_port(addr, &port, err, err_len);
    if (rc) return rc;
    memset(id, 0, COMM_UNIQUE_ID_BYTES);
    snprintf((char *)id, COMM_UNIQUE_ID_BYTES, HOST_ID_MAGIC "%d %s %d", HOST_ID_VERSION, addr, port);
    return 0;
}

int comm_host_id_is(const uint8_t id[COMM_UNIQUE_ID_BYTES]) {
    return memcmp(id, HOST_ID_MAGIC, strlen(HOST_ID_MAGIC)) == 0;
}

int comm_host_id_parse(const uint8_t id[COMM_UNIQUE_ID_BYTES], char *addr, size_t addr_len, int *port, char *err,
                       size_t err_len) {
    static const char WHAT[] = "comm_create_with_id: the id is not a host backend id (made by comm_unique_id_host: "
                               "\"tandem-host-id 1 ADDR PORT\" padded with NULs to 128 bytes)";
    const char *text = (const char *)id;
    const void *nul = memchr(id, '\0', COMM_UNIQUE_ID_BYTES);
    if (!comm_host_id_is(id) || !nul)
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "%s; an NCCL id (comm_unique_id) joins only the nccl "
                             "backend", WHAT);
    size_t len = (size_t)((const uint8_t *)nul - id);
    for (size_t i = len; i < COMM_UNIQUE_ID_BYTES; i++)
        if (id[i]) return err_fail_code(COMM_ERR_INVALID, err, err_len, "%s: byte %zu after its text is not NUL", WHAT, i);
    int version = 0, a0 = 0, a1 = 0, used = 0;
    long p = 0;
    // "%n" marks where ADDR starts and ends; `used` is set only when the whole text was read.
    if (sscanf(text + strlen(HOST_ID_MAGIC), "%d %n%*s%n %ld%n", &version, &a0, &a1, &p, &used) < 2 ||
        version != HOST_ID_VERSION) {
        if (version > 0 && version != HOST_ID_VERSION)
            return err_fail_code(COMM_ERR_INVALID, err, err_len, "comm_create_with_id: host id version %d, this build "
                                 "reads version %d (members of different builds?)", version, HOST_ID_VERSION);
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "%s: '%.*s'", WHAT, (int)len, text);
    }
    size_t alen = (size_t)(a1 - a0);
    if (!used || strlen(HOST_ID_MAGIC) + (size_t)used != len || alen == 0 || alen >= addr_len || p < 1 || p > 65535)
        return err_fail_code(COMM_ERR_INVALID, err, err_len, "%s: '%.*s' (ADDR without spaces, PORT 1..65535, nothing "
                             "after)", WHAT, (int)len, text);
    memcpy(addr, text + strlen(HOST_ID_MAGIC) + a0, alen);
    addr[alen] = '\0';
    *port = (int)p;
    return 0;
}
