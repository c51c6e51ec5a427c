// shared/control_keys.c — CURVE key files and the client side of a control socket (control_keys.h).
#include "shared/control_keys.h"
#include "shared/err.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#define LINE_MAX_CHARS 512
#define KEY_FILE_MAX_ENTRIES 4   // a key-pair or public-key file: two lines at most, with room to name a third

int control_key_is_valid(const char *text) {
    if (!text || strlen(text) != CONTROL_KEY_Z85_LEN) return 0;
    uint8_t raw[32];
    return zmq_z85_decode(raw, text) != NULL;
}

int control_keypair_generate(ControlKeyPair *kp, char *err, size_t err_len) {
    if (zmq_curve_keypair(kp->public_key, kp->secret_key) != 0)
        return err_fail(err, err_len, "cannot generate a CURVE key pair: %s (libzmq must be built with libsodium)",
                    zmq_strerror(zmq_errno()));
    return 0;
}

// One entry of a key file: its label ("public-key", "secret-key", or "" for a bare key) and the key.
typedef struct {
    char label[16];
    ControlKey key;
} KeyLine;

// Reads every entry of path into lines (cap). Returns the count, or -1 with a message naming the line.
static int read_key_lines(const char *path, KeyLine *lines, int cap, char *err, size_t err_len) {
    FILE *f = fopen(path, "r");
    if (!f) return err_fail(err, err_len, "cannot open key file %s: %s", path, strerror(errno));
    char buf[LINE_MAX_CHARS];
    int n = 0, line_no = 0, rc = 0;
    while (fgets(buf, sizeof buf, f)) {
        line_no++;
        char *p = buf;
        while (*p == ' ' || *p == '\t') p++;
        size_t len = strlen(p);
        while (len > 0 && (p[len - 1] == '\n' || p[len - 1] == '\r' || p[len - 1] == ' ' || p[len - 1] == '\t'))
            p[--len] = '\0';
        // Z85 uses '#' and ':' too, so a line that is exactly one key is a bare key before anything else.
        KeyLine kl = {{0}, {0}};
        if (!control_key_is_valid(p)) {
            if (len == 0 || p[0] == '#') continue;
            size_t llen = strcspn(p, ": \t");
            char *rest = p + llen;
            while (*rest == ' ' || *rest == '\t') rest++;
            int labelled = llen == strlen("public-key") &&
                           (!strncmp(p, "public-key", llen) || !strncmp(p, "secret-key", llen)) && *rest == ':';
            if (!labelled) {
                rc = err_fail(err, err_len, "%s line %d: expected \"public-key: KEY\", \"secret-key: KEY\" or a bare "
                          "40-character Z85 key", path, line_no);
                break;
            }
            memcpy(kl.label, p, llen);
            p = rest + 1;
            while (*p == ' ' || *p == '\t') p++;
            if (!control_key_is_valid(p)) {
                rc = err_fail(err, err_len, "%s line %d: not a CURVE key (expected 40 Z85 characters, as written by "
                          "tandem-train keygen)", path, line_no);
                break;
            }
        }
        if (n == cap) {
            rc = err_fail(err, err_len, "%s: more than %d keys", path, cap);
            break;
        }
        memcpy(kl.key, p, CONTROL_KEY_Z85_LEN + 1);
        lines[n++] = kl;
    }
    if (rc == 0 && ferror(f)) rc = err_fail(err, err_len, "cannot read key file %s: %s", path, strerror(errno));
    fclose(f);
    return rc < 0 ? -1 : n;
}

int control_keypair_read(const char *path, ControlKeyPair *kp, char *err, size_t err_len) {
    KeyLine lines[KEY_FILE_MAX_ENTRIES];
    int n = read_key_lines(path, lines, KEY_FILE_MAX_ENTRIES, err, err_len);
    if (n < 0 || n > KEY_FILE_MAX_ENTRIES) return -1;
    const char *pub = NULL, *sec = NULL;
    for (int i = 0; i < n; i++) {
        if (!strcmp(lines[i].label, "public-key")) pub = lines[i].key;
        else sec = lines[i].key;   // "secret-key: KEY" or a bare key
    }
    if (!sec || n > 2)
        return err_fail(err, err_len, "%s: expected a secret key (a \"secret-key:\" line or one bare key), with at most "
                    "its \"public-key:\" line; make one with tandem-train keygen", path);
    memcpy(kp->secret_key, sec, sizeof kp->secret_key);
    if (zmq_curve_public(kp->public_key, kp->secret_key) != 0)
        return err_fail(err, err_len, "%s: cannot derive the public key: %s", path, zmq_strerror(zmq_errno()));
    if (pub && strcmp(pub, kp->public_key) != 0)
        return err_fail(err, err_len, "%s: its public-key line does not belong to its secret key (the public key of "
                    "that secret is %s)", path, kp->public_key);
    return 0;
}

int control_public_key_read(const char *path, ControlKey out, char *err, size_t err_len) {
    KeyLine lines[KEY_FILE_MAX_ENTRIES];
    int n = read_key_lines(path, lines, KEY_FILE_MAX_ENTRIES, err, err_len);
    if (n < 0 || n > KEY_FILE_MAX_ENTRIES) return -1;
    int found = -1, bare = 0;
    for (int i = 0; i < n; i++) {
        if (!strcmp(lines[i].label, "public-key")) found = i;
        else if (!lines[i].label[0]) bare++, found = found < 0 ? i : found;
    }
    if (found < 0 || (bare > 0 && n > 1))
        return err_fail(err, err_len, "%s: expected one public key (a \"public-key:\" line or one bare key)", path);
    memcpy(out, lines[found].key, sizeof(ControlKey));
    return 0;
}

int control_authorized_keys_read(const char *path, ControlKey *keys, int *n, char *err, size_t err_len) {
    KeyLine lines[CONTROL_MAX_AUTHORIZED_KEYS];
    int count = read_key_lines(path, lines, CONTROL_MAX_AUTHORIZED_KEYS, err, err_len);
    if (count < 0) return -1;
    if (count == 0) return err_fail(err, err_len, "%s holds no key: it must list the public key of every client "
                                "allowed on the control channel, one a line", path);
    for (int i = 0; i < count; i++) {
        if (!strcmp(lines[i].label, "secret-key"))
            return err_fail(err, err_len, "%s: holds a secret key; an authorized-keys file lists public keys only", path);
        memcpy(keys[i], lines[i].key, sizeof(ControlKey));
    }
    *n = count;
    return 0;
}

// Creates path with mode 0600 (fchmod: a file that already existed keeps no wider mode) and writes text.
static int write_secret_text(const char *path, const char *text, char *err, size_t err_len) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return err_fail(err, err_len, "cannot create %s: %s", path, strerror(errno));
    size_t len = strlen(text), done = 0;
    int rc = fchmod(fd, 0600);
    while (rc == 0 && done < len) {
        ssize_t w = write(fd, text + done, len - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) rc = -1;
        else done += (size_t)w;
    }
    if (rc != 0) {
        int e = errno;
        close(fd);
        return err_fail(err, err_len, "cannot write %s: %s", path, strerror(e));
    }
    if (close(fd) != 0) return err_fail(err, err_len, "cannot write %s: %s", path, strerror(errno));
    return 0;
}

int control_keypair_write(const char *path, const ControlKeyPair *kp, char *err, size_t err_len) {
    char text[256];
    snprintf(text, sizeof text,
             "# tandem control channel key pair (ZeroMQ CURVE, Z85): keep it secret\n"
             "public-key: %s\nsecret-key: %s\n",
             kp->public_key, kp->secret_key);
    return write_secret_text(path, text, err, err_len);
}

int control_public_key_write(const char *path, const ControlKey key, char *err, size_t err_len) {
    char text[128];
    snprintf(text, sizeof text, "public-key: %s\n", key);
    return write_secret_text(path, text, err, err_len);
}

int control_client_secure(void *sock, const ControlKey server_public, const ControlKeyPair *client, char *err,
                          size_t err_len) {
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server_public, CONTROL_KEY_Z85_LEN + 1) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, client->public_key, CONTROL_KEY_Z85_LEN + 1) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, client->secret_key, CONTROL_KEY_Z85_LEN + 1) != 0)
        return err_fail(err, err_len, "cannot set the CURVE keys on a control socket: %s", zmq_strerror(zmq_errno()));
    return 0;
}
