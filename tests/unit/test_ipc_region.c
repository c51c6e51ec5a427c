// tests/unit/test_ipc_region.c — shared/ipc_region.h on the CPU: a shared-memory region made by one process is
// mapped by another (a forked child writes, the parent reads), sizes and names are checked on opening, the creator's
// close removes the name, unit offsets are 256-byte aligned, and a malformed CUDA handle is refused by name.
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shared/ipc_region.h"
#include "tests/unit/check_macros.h"

static void test_host_id(void) {
    char a[IPC_HOST_ID_MAX], b[IPC_HOST_ID_MAX], err[256];
    CHECK(ipc_host_id(a, err, sizeof err) == 0, "%s", err);
    CHECK(ipc_host_id(b, err, sizeof err) == 0 && !strcmp(a, b) && strlen(a) == 36, "boot id '%s'", a);
    CHECK(ipc_random_id() != 0 && ipc_random_id() != ipc_random_id());
}

static void test_shm_between_processes(void) {
    IpcRegion made, mapped;
    char err[512];
    const size_t bytes = 3 * 4096 + 12;
    if (ipc_region_create(&made, IPC_KIND_SHM, -1, "s0", bytes, err, sizeof err) != 0) {
        CHECK(0, "create: %s", err);
        return;
    }
    char pid[32];
    snprintf(pid, sizeof pid, "/tandem-ipc-%ld-s0-", (long)getpid());
    CHECK(!strncmp(made.handle, pid, strlen(pid)) && made.owner, "name %s", made.handle);
    const unsigned char *p = made.ptr;
    size_t nonzero = 0;
    for (size_t i = 0; i < bytes; i++) nonzero += p[i] != 0;
    CHECK(nonzero == 0, "a new region reads as zeros (%zu bytes not)", nonzero);
    // Another process maps it by name and writes a pattern; this one sees it.
    pid_t child = fork();
    if (child == 0) {
        IpcRegion r;
        char e[512];
        if (ipc_region_open(&r, IPC_KIND_SHM, made.handle, bytes, -1, e, sizeof e) != 0) _exit(2);
        for (size_t i = 0; i < bytes; i++) ((unsigned char *)r.ptr)[i] = (unsigned char)(i * 7 + 3);
        ipc_region_close(&r);   // an opener's close leaves the name
        _exit(0);
    }
    int status = -1;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %d", status);
    size_t wrong = 0;
    for (size_t i = 0; i < bytes; i++) wrong += p[i] != (unsigned char)(i * 7 + 3);
    CHECK(wrong == 0, "%zu bytes differ from what the other process wrote", wrong);
    // Opening with another size, or a name that is not one, says so.
    CHECK(ipc_region_open(&mapped, IPC_KIND_SHM, made.handle, bytes + 1, -1, err, sizeof err) != 0 &&
          strstr(err, "the server said"), "%s", err);
    CHECK(ipc_region_open(&mapped, IPC_KIND_SHM, "no-slash", 8, -1, err, sizeof err) != 0 &&
          strstr(err, "is not a shared-memory name"), "%s", err);
    char name[IPC_HANDLE_MAX];
    snprintf(name, sizeof name, "%s", made.handle);
    ipc_region_close(&made);
    CHECK(made.ptr == NULL);
    CHECK(ipc_region_open(&mapped, IPC_KIND_SHM, name, bytes, -1, err, sizeof err) != 0 &&
          strstr(err, "No such file") && strstr(err, "this host"), "after the creator's close: %s", err);
    ipc_region_close(&made);   // closing twice is harmless
}

static void test_cuda_handle_refused(void) {
    IpcRegion r;
    char err[512];
    CHECK(ipc_region_open(&r, IPC_KIND_CUDA, "not base64!", 64, 0, err, sizeof err) != 0 &&
          strstr(err, "not base64 of a"), "%s", err);
    CHECK(ipc_region_open(&r, IPC_KIND_CUDA, "QUJD", 64, 0, err, sizeof err) != 0 && strstr(err, "not base64 of a"),
          "a handle of 3 bytes: %s", err);
}

static void test_unit_offsets(void) {
    size_t numel[3] = {10, 64, 1}, offsets[3];
    Layout L = {0};
    L.n_units = 3;
    L.unit_numel = numel;
    CHECK_EQ(ipc_unit_offsets(&L, 2, offsets), 3 * 256);
    CHECK(offsets[0] == 0 && offsets[1] == 256 && offsets[2] == 512);
    CHECK_EQ(ipc_unit_offsets(&L, 4, offsets), 256 + 256 + 256);
    numel[1] = 65;   // 260 bytes of fp32: the next unit starts 512 bytes on
    CHECK_EQ(ipc_unit_offsets(&L, 4, offsets), 256 + 512 + 256);
    CHECK(offsets[2] == 768);
}

int main(void) {
    test_host_id();
    test_shm_between_processes();
    test_cuda_handle_refused();
    test_unit_offsets();
    return check_exit_code("test_ipc_region");
}
