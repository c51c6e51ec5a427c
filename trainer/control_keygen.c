// trainer/control_keygen.c — the key folder of a run and `tandem-train keygen` (control_keygen.h).
#include "trainer/control_keygen.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shared/control_keys.h"
#include "shared/version.h"
#include "trainer/make_dirs.h"

static const char *const kFiles[] = {CONTROL_KEYS_SERVER_KEY, CONTROL_KEYS_AUTHORIZED, CONTROL_KEYS_SERVER_PUB,
                                     CONTROL_KEYS_CLIENT_KEY};

int control_keygen_write_dir(const char *dir, int replace, char *err, size_t err_len) {
    char path[PATH_MAX];
    struct stat st;
    int existed = stat(dir, &st) == 0;
    if (make_dirs(dir, err, err_len) != 0) return -1;
    // A folder made here holds secrets only: nobody else needs to list it.
    if (!existed && chmod(dir, 0700) != 0) {
        snprintf(err, err_len, "cannot restrict %s to its owner: %s", dir, strerror(errno));
        return -1;
    }
    snprintf(path, sizeof path, "%s/%s", dir, CONTROL_KEYS_SERVER_KEY);
    if (!replace && access(path, F_OK) == 0) {
        snprintf(err, err_len, "%s already holds keys (%s): servers and trainers may be using them; pick another "
                 "folder, or pass --force to replace them", dir, path);
        return -1;
    }
    ControlKeyPair server, client;
    if (control_keypair_generate(&server, err, err_len) != 0 || control_keypair_generate(&client, err, err_len) != 0)
        return -1;
    snprintf(path, sizeof path, "%s/%s", dir, CONTROL_KEYS_SERVER_KEY);
    if (control_keypair_write(path, &server, err, err_len) != 0) return -1;
    snprintf(path, sizeof path, "%s/%s", dir, CONTROL_KEYS_AUTHORIZED);
    if (control_public_key_write(path, client.public_key, err, err_len) != 0) return -1;
    snprintf(path, sizeof path, "%s/%s", dir, CONTROL_KEYS_SERVER_PUB);
    if (control_public_key_write(path, server.public_key, err, err_len) != 0) return -1;
    snprintf(path, sizeof path, "%s/%s", dir, CONTROL_KEYS_CLIENT_KEY);
    if (control_keypair_write(path, &client, err, err_len) != 0) return -1;
    return 0;
}

int control_keygen_dir_complete(const char *dir, char *err, size_t err_len) {
    char path[PATH_MAX];
    for (size_t i = 0; i < sizeof kFiles / sizeof kFiles[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, kFiles[i]);
        if (access(path, R_OK) != 0) {
            snprintf(err, err_len, "%s: %s (make the folder with tandem-train keygen %s, and copy it whole to "
                     "every node)", path, strerror(errno), dir);
            return 0;
        }
    }
    return 1;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: tandem-train keygen [--force] DIR\n\n"
            "Writes a fresh pair of CURVE key pairs for the ZeroMQ control channel into DIR (created with its\n"
            "parents; DIR itself mode 0700 when made here, every file mode 0600):\n"
            "  DIR/" CONTROL_KEYS_SERVER_KEY "        tandem-serve --control-key-file\n"
            "  DIR/" CONTROL_KEYS_AUTHORIZED "   tandem-serve --control-authorized-keys\n"
            "  DIR/" CONTROL_KEYS_SERVER_PUB "        tandem-train --control-server-key\n"
            "  DIR/" CONTROL_KEYS_CLIENT_KEY "        tandem-train --control-client-key\n"
            "Give DIR to every node of a run (tandem-train launch --control-keys DIR), or make a Kubernetes\n"
            "Secret of it: kubectl create secret generic tandem-control-keys --from-file=DIR\n\n"
            "  --force     replace the keys DIR already holds (default: refuse)\n"
            "  --version   the version of tandem-train\n"
            "  -h, --help  this text\n");
}

int control_keygen_main(int argc, char **argv) {
    const char *dir = NULL;
    int force = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--version")) {
            tandem_print_version(stdout, "tandem-train");
            return 0;
        }
        if (!strcmp(argv[i], "--force")) force = 1;
        else if (argv[i][0] == '-' || dir) {
            fprintf(stderr, "tandem-train keygen: unexpected argument %s (see tandem-train keygen --help)\n", argv[i]);
            return 2;
        } else {
            dir = argv[i];
        }
    }
    if (!dir) {
        fprintf(stderr, "tandem-train keygen: give the folder to write the keys into (see tandem-train keygen "
                        "--help)\n");
        return 2;
    }
    char err[PATH_MAX + 256];
    if (control_keygen_write_dir(dir, force, err, sizeof err) != 0) {
        fprintf(stderr, "tandem-train keygen: %s\n", err);
        return 1;
    }
    printf("wrote %s/{%s,%s,%s,%s}: start tandem-serve with --control-key-file %s/%s --control-authorized-keys "
           "%s/%s, and tandem-train with --control-server-key %s/%s --control-client-key %s/%s\n",
           dir, CONTROL_KEYS_SERVER_KEY, CONTROL_KEYS_AUTHORIZED, CONTROL_KEYS_SERVER_PUB, CONTROL_KEYS_CLIENT_KEY,
           dir, CONTROL_KEYS_SERVER_KEY, dir, CONTROL_KEYS_AUTHORIZED, dir, CONTROL_KEYS_SERVER_PUB, dir,
           CONTROL_KEYS_CLIENT_KEY);
    return 0;
}
