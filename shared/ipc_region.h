// shared/ipc_region.h — memory that one process allocates and another process on the same host maps: the rollout
// server's receive staging for weight-sync transport ipc (docs/architecture.md "Weight sync"), which trainer ranks
// write into directly.
//
// Two kinds:
// - cuda: one cudaMalloc block on a device, exported with cudaIpcGetMemHandle; its handle travels as base64 of the
//   64-byte cudaIpcMemHandle_t. Another process maps it with cudaIpcOpenMemHandle on its own current device (the
//   driver then reaches the block peer to peer, or on the same GPU directly). The driver frees the block when the
//   exporting process exits, however it ends.
// - shm: POSIX shared memory (shm_open + mmap), named "/tandem-ipc-<pid>-<tag>-<random>"; the creator unlinks the
//   name when it closes the region. A process that dies without closing leaves the object in /dev/shm until it is
//   removed by hand (rm /dev/shm/tandem-ipc-<pid>-*) or the host reboots.
//
// Library code: errors are returned with a message; nothing exits.
#ifndef TANDEM_SHARED_IPC_REGION_H
#define TANDEM_SHARED_IPC_REGION_H

#include <stddef.h>
#include <stdint.h>

#include "shared/layout.h"

#define IPC_HANDLE_MAX 96      // base64 of a 64-byte cudaIpcMemHandle_t is 88 characters; shm names are shorter
#define IPC_HOST_ID_MAX 64     // a boot id is 36 characters
#define IPC_DEVICE_ID_MAX 48   // "GPU-" + a 36-character UUID; a PCI bus id is 12
#define IPC_CUDA_HANDLE_BYTES 64
#define IPC_UNIT_ALIGN 256     // bytes: where each unit starts inside a staging region

typedef enum { IPC_KIND_SHM = 0, IPC_KIND_CUDA = 1 } IpcKind;

typedef struct {
    IpcKind kind;
    void *ptr;                    // NULL: not open
    size_t bytes;
    int device;                   // cuda: the device it lives on (creator) or is mapped from (opener)
    int owner;                    // 1: this process made it (close frees / unlinks), 0: mapped from another
    char handle[IPC_HANDLE_MAX];  // what another process opens it by
} IpcRegion;

// This host's identity: the kernel's boot id (/proc/sys/kernel/random/boot_id), the same for every process (and
// container) on one running machine. Returns 0, or -1 with a message.
int ipc_host_id(char out[IPC_HOST_ID_MAX], char *err, size_t err_len);
// A random 64-bit value (never 0), for telling one server's staging from a restarted one's.
uint64_t ipc_random_id(void);

// Creates a zero-filled region of `bytes`: shm (named with this pid, `tag` and a random part) or cuda on `device`.
int ipc_region_create(IpcRegion *r, IpcKind kind, int device, const char *tag, size_t bytes, char *err,
                      size_t err_len);
// Maps a region that another process created: kind and handle as it gave them, `bytes` its size (checked against
// the shm object's), cuda: mapped on `device` (this process's device). Returns 0, or -1 with a message that says why.
int ipc_region_open(IpcRegion *r, IpcKind kind, const char *handle, size_t bytes, int device, char *err,
                    size_t err_len);
// Unmaps (opener) or frees and unlinks (creator); a closed or zeroed region is left alone.
void ipc_region_close(IpcRegion *r);
// cuda: the PCI bus id and the UUID ("GPU-...") of `device`; a CPU build fills "" and returns -1.
int ipc_cuda_device_ids(int device, char pci[IPC_DEVICE_ID_MAX], char uuid[IPC_DEVICE_ID_MAX]);

// Where each unit of `layout` starts inside a staging region holding all of them in `elem_size`-byte elements
// (offsets[u], bytes; each a multiple of IPC_UNIT_ALIGN), and the region's size. Both the server (which makes it)
// and the trainer ranks (which write into it) place the units so.
size_t ipc_unit_offsets(const Layout *layout, size_t elem_size, size_t *offsets);

#endif
