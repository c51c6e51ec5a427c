// shared/ipc_region.c — memory shared between processes of one host (see shared/ipc_region.h): POSIX shared memory,
// and in CUDA builds cudaMalloc blocks exported with CUDA IPC handles.
#define _GNU_SOURCE
#include "shared/ipc_region.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "shared/err.h"

#ifdef TANDEM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

int ipc_host_id(char out[IPC_HOST_ID_MAX], char *err, size_t err_len) {
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f) return err_fail(err, err_len, "cannot read /proc/sys/kernel/random/boot_id: %s", strerror(errno));
    const int ok = fgets(out, IPC_HOST_ID_MAX, f) != NULL;
    fclose(f);
    out[ok ? strcspn(out, "\r\n") : 0] = '\0';
    if (!out[0]) return err_fail(err, err_len, "/proc/sys/kernel/random/boot_id is empty");
    return 0;
}

uint64_t ipc_random_id(void) {
    uint64_t v = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &v, sizeof v) != (ssize_t)sizeof v) v = 0;
        close(fd);
    }
    if (v == 0) {   // no /dev/urandom: the clock and the pid still differ between a server and its restart
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        v = ((uint64_t)ts.tv_sec * 1000000007u) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 40);
    }
    return v ? v : 1;
}

// ---- base64 (RFC 4648, with padding) of a CUDA IPC handle ----------------------------------------------------

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

#ifdef TANDEM_HAVE_CUDA
static void b64_encode(const unsigned char *in, size_t n, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        const unsigned v = (unsigned)in[i] << 16 | (i + 1 < n ? (unsigned)in[i + 1] << 8 : 0) |
                           (i + 2 < n ? in[i + 2] : 0);
        out[o++] = B64[v >> 18 & 63];
        out[o++] = B64[v >> 12 & 63];
        out[o++] = i + 1 < n ? B64[v >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? B64[v & 63] : '=';
    }
    out[o] = '\0';
}
#endif

// Decodes exactly n bytes from s (4 * ceil(n / 3) characters). Returns 0, or -1 when s is not that.
static int b64_decode(const char *s, unsigned char *out, size_t n) {
    const size_t want = (n + 2) / 3 * 4;
    if (strlen(s) != want) return -1;
    size_t o = 0;
    for (size_t i = 0; i < want; i += 4) {
        unsigned v = 0;
        for (int k = 0; k < 4; k++) {
            const char *p = s[i + k] == '=' ? NULL : strchr(B64, s[i + k]);
            if (s[i + k] == '\0' || (!p && s[i + k] != '=')) return -1;
            v = v << 6 | (p ? (unsigned)(p - B64) : 0);
        }
        for (int k = 0; k < 3 && o < n; k++) out[o++] = (unsigned char)(v >> (16 - 8 * k));
    }
    return 0;
}

// ---- shm ---------------------------------------------------------------------------------------------------

static int create_shm(IpcRegion *r, const char *tag, size_t bytes, char *err, size_t err_len) {
    snprintf(r->handle, sizeof r->handle, "/tandem-ipc-%ld-%s-%016llx", (long)getpid(), tag,
             (unsigned long long)ipc_random_id());
    int fd = shm_open(r->handle, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return err_fail(err, err_len, "shm_open(%s): %s", r->handle, strerror(errno));
    // posix_fallocate reserves the pages now: a /dev/shm too small for the region (a container's 64 MB default) is
    // this error, not a SIGBUS in whichever process first writes past what the filesystem could give.
    void *p = MAP_FAILED;
    int e = posix_fallocate(fd, 0, (off_t)bytes);
    if (e == 0 && (p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) e = errno;
    close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(r->handle);
        return err_fail(err, err_len, "cannot make %zu MB of shared memory %s (is /dev/shm large enough? df -h "
                        "/dev/shm): %s", bytes >> 20, r->handle, strerror(e));
    }
    r->ptr = p;   // new pages of a shared-memory object read as zeros
    return 0;
}

static int open_shm(IpcRegion *r, const char *name, size_t bytes, char *err, size_t err_len) {
    if (name[0] != '/' || strchr(name + 1, '/') || strlen(name) >= sizeof r->handle)
        return err_fail(err, err_len, "\"%.96s\" is not a shared-memory name", name);
    int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0)
        return err_fail(err, err_len, "shm_open(%s): %s (transport ipc maps the server's /dev/shm: the server must run "
                        "on this host, in a container that shares /dev/shm with this one)", name, strerror(errno));
    struct stat st;
    void *p = MAP_FAILED;
    int e = 0;
    if (fstat(fd, &st) != 0) e = errno;
    else if ((size_t)st.st_size != bytes) e = -1;
    else if ((p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) e = errno;
    close(fd);
    if (e == -1)
        return err_fail(err, err_len, "shared memory %s holds %lld bytes, the server said %zu", name,
                        (long long)st.st_size, bytes);
    if (p == MAP_FAILED) return err_fail(err, err_len, "mapping shared memory %s: %s", name, strerror(e));
    snprintf(r->handle, sizeof r->handle, "%s", name);
    r->ptr = p;
    return 0;
}

// ---- cuda --------------------------------------------------------------------------------------------------

#ifdef TANDEM_HAVE_CUDA
static int create_cuda(IpcRegion *r, int device, size_t bytes, char *err, size_t err_len) {
    cudaError_t e = cudaSetDevice(device);
    void *p = NULL;
    if (e == cudaSuccess) e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess)
        return err_fail(err, err_len, "cudaMalloc of %zu MB on cuda:%d: %s", bytes >> 20, device,
                        cudaGetErrorString(e));
    cudaIpcMemHandle_t h;
    if ((e = cudaMemset(p, 0, bytes)) != cudaSuccess || (e = cudaIpcGetMemHandle(&h, p)) != cudaSuccess) {
        cudaFree(p);
        return err_fail(err, err_len, "exporting %zu MB on cuda:%d (cudaIpcGetMemHandle): %s", bytes >> 20, device,
                        cudaGetErrorString(e));
    }
    b64_encode((const unsigned char *)&h, sizeof h, r->handle);
    r->ptr = p;
    return 0;
}

static int open_cuda(IpcRegion *r, const char *handle, int device, char *err, size_t err_len) {
    cudaIpcMemHandle_t h;
    if (b64_decode(handle, (unsigned char *)&h, sizeof h) != 0)
        return err_fail(err, err_len, "\"%.96s\" is not base64 of a %zu-byte CUDA IPC handle", handle, sizeof h);
    void *p = NULL;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        cudaGetLastError();   // not sticky: clear it for the caller's next CUDA call
        return err_fail(err, err_len, "cudaIpcOpenMemHandle on cuda:%d: %s (the server's GPU must be on this host and "
                        "reachable from this one peer to peer, in a container that shares the host's IPC namespace)",
                        device, cudaGetErrorString(e));
    }
    snprintf(r->handle, sizeof r->handle, "%s", handle);
    r->ptr = p;
    return 0;
}

int ipc_cuda_device_ids(int device, char pci[IPC_DEVICE_ID_MAX], char uuid[IPC_DEVICE_ID_MAX]) {
    pci[0] = uuid[0] = '\0';
    struct cudaDeviceProp prop;
    if (cudaDeviceGetPCIBusId(pci, IPC_DEVICE_ID_MAX, device) != cudaSuccess ||
        cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    const unsigned char *b = (const unsigned char *)prop.uuid.bytes;
    snprintf(uuid, IPC_DEVICE_ID_MAX, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    return 0;
}
#else
static const char NO_CUDA[] = "CUDA IPC needs a CUDA build (cmake -DTANDEM_CUDA=ON); this build runs on the CPU only";

static int create_cuda(IpcRegion *r, int device, size_t bytes, char *err, size_t err_len) {
    (void)r, (void)device, (void)bytes;
    return err_fail(err, err_len, "%s", NO_CUDA);
}

static int open_cuda(IpcRegion *r, const char *handle, int device, char *err, size_t err_len) {
    (void)r, (void)device;
    unsigned char h[IPC_CUDA_HANDLE_BYTES];
    if (b64_decode(handle, h, sizeof h) != 0)
        return err_fail(err, err_len, "\"%.96s\" is not base64 of a %d-byte CUDA IPC handle", handle,
                        IPC_CUDA_HANDLE_BYTES);
    return err_fail(err, err_len, "%s", NO_CUDA);
}

int ipc_cuda_device_ids(int device, char pci[IPC_DEVICE_ID_MAX], char uuid[IPC_DEVICE_ID_MAX]) {
    (void)device;
    pci[0] = uuid[0] = '\0';
    return -1;
}
#endif

int ipc_region_create(IpcRegion *r, IpcKind kind, int device, const char *tag, size_t bytes, char *err,
                      size_t err_len) {
    memset(r, 0, sizeof *r);
    if (bytes == 0) return err_fail(err, err_len, "a shared region of 0 bytes");
    int rc = kind == IPC_KIND_CUDA ? create_cuda(r, device, bytes, err, err_len)
                                   : create_shm(r, tag, bytes, err, err_len);
    if (rc != 0) return -1;
    r->kind = kind;
    r->bytes = bytes;
    r->device = device;
    r->owner = 1;
    return 0;
}

int ipc_region_open(IpcRegion *r, IpcKind kind, const char *handle, size_t bytes, int device, char *err,
                    size_t err_len) {
    memset(r, 0, sizeof *r);
    int rc = kind == IPC_KIND_CUDA ? open_cuda(r, handle, device, err, err_len)
                                   : open_shm(r, handle, bytes, err, err_len);
    if (rc != 0) return -1;
    r->kind = kind;
    r->bytes = bytes;
    r->device = device;
    return 0;
}

void ipc_region_close(IpcRegion *r) {
    if (!r->ptr) return;
    if (r->kind == IPC_KIND_SHM) {
        munmap(r->ptr, r->bytes);
        if (r->owner) shm_unlink(r->handle);
    }
#ifdef TANDEM_HAVE_CUDA
    else {
        cudaSetDevice(r->device);
        if (r->owner) cudaFree(r->ptr);
        else cudaIpcCloseMemHandle(r->ptr);
        cudaGetLastError();
    }
#endif
    memset(r, 0, sizeof *r);
}

size_t ipc_unit_offsets(const Layout *layout, size_t elem_size, size_t *offsets) {
    size_t at = 0;
    for (int u = 0; u < layout->n_units; u++) {
        offsets[u] = at;
        at += (layout->unit_numel[u] * elem_size + IPC_UNIT_ALIGN - 1) / IPC_UNIT_ALIGN * IPC_UNIT_ALIGN;
    }
    return at;
}
