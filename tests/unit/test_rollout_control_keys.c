// tests/unit/test_rollout_control_keys.c — the control channel's key files (shared/control_keys.h) and which
// --control endpoints may go without keys (rollout_server/zmq_control_auth.h).
//
// Key files: a written key pair reads back; files are mode 0600 even over a wider file and with umask 0; a bare
// secret key yields its public key; a key with ':' in it (a Z85 digit) reads, bare or labelled; a public line that
// is not the secret's, a malformed key, a secret key in an authorized-keys file and an empty authorized-keys file
// are refused, each message naming the file (and line).
// Endpoints: loopback, ipc and inproc are local; 0.0.0.0, *, other addresses, host names and "127.x" host names
// are not.
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "check_macros.h"
#include "rollout_server/zmq_control_auth.h"
#include "shared/control_keys.h"

static char dir[] = "/tmp/tandem-control-keys-XXXXXX";

static void path_of(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", dir, name); }

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    REQUIRE(f != NULL, "cannot write %s", path);
    fputs(text, f);
    fclose(f);
}

static int mode_of(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (int)(st.st_mode & 0777) : -1;
}

static void test_keypair_files(void) {
    char err[1024], pair[512], pub[512], bare[512], text[512];
    ControlKeyPair kp, back;
    REQUIRE(control_keypair_generate(&kp, err, sizeof err) == 0, "%s", err);
    CHECK(control_key_is_valid(kp.public_key) && control_key_is_valid(kp.secret_key), "generated keys invalid");

    path_of(pair, sizeof pair, "pair.key");
    write_text(pair, "wide open\n");
    chmod(pair, 0644);
    mode_t old = umask(0);
    CHECK(control_keypair_write(pair, &kp, err, sizeof err) == 0, "%s", err);
    umask(old);
    CHECK(mode_of(pair) == 0600, "key pair file mode %o, want 600", mode_of(pair));
    CHECK(control_keypair_read(pair, &back, err, sizeof err) == 0, "%s", err);
    CHECK(!strcmp(back.public_key, kp.public_key) && !strcmp(back.secret_key, kp.secret_key), "pair round trip");
    ControlKey only_pub;
    CHECK(control_public_key_read(pair, only_pub, err, sizeof err) == 0 && !strcmp(only_pub, kp.public_key),
          "the public key of a key-pair file: %s", err);

    path_of(pub, sizeof pub, "server.pub");
    CHECK(control_public_key_write(pub, kp.public_key, err, sizeof err) == 0, "%s", err);
    CHECK(mode_of(pub) == 0600, "public key file mode %o", mode_of(pub));
    CHECK(control_public_key_read(pub, only_pub, err, sizeof err) == 0 && !strcmp(only_pub, kp.public_key), "%s", err);

    // A bare secret key: the public key is derived.
    path_of(bare, sizeof bare, "bare.key");
    snprintf(text, sizeof text, "# comment\n\n  %s  \n", kp.secret_key);
    write_text(bare, text);
    CHECK(control_keypair_read(bare, &back, err, sizeof err) == 0 && !strcmp(back.public_key, kp.public_key),
          "bare secret: %s", err);

    // Another pair's public line beside this secret.
    ControlKeyPair other;
    control_keypair_generate(&other, err, sizeof err);
    snprintf(text, sizeof text, "public-key: %s\nsecret-key: %s\n", other.public_key, kp.secret_key);
    write_text(bare, text);
    CHECK(control_keypair_read(bare, &back, err, sizeof err) != 0 && strstr(err, "does not belong") &&
          strstr(err, bare), "mismatched pair accepted or badly named: %s", err);

    write_text(bare, "secret-key: not-a-key\n");
    CHECK(control_keypair_read(bare, &back, err, sizeof err) != 0 && strstr(err, "line 1") &&
          strstr(err, "not a CURVE key"), "malformed key: %s", err);
    write_text(bare, "private: abc\n");
    CHECK(control_keypair_read(bare, &back, err, sizeof err) != 0 && strstr(err, "line 1"), "unknown label: %s", err);
    path_of(text, sizeof text, "missing.key");
    CHECK(control_keypair_read(text, &back, err, sizeof err) != 0 && strstr(err, "missing.key"), "missing: %s", err);
    unlink(pair);
    unlink(pub);
    unlink(bare);
}

static void test_authorized_keys(void) {
    char err[1024], path[512], text[512];
    ControlKeyPair a, b;
    control_keypair_generate(&a, err, sizeof err);
    control_keypair_generate(&b, err, sizeof err);
    static ControlKey keys[CONTROL_MAX_AUTHORIZED_KEYS];
    int n = 0;
    path_of(path, sizeof path, "authorized_keys");
    snprintf(text, sizeof text, "# the trainer\n%s\npublic-key: %s\n", a.public_key, b.public_key);
    write_text(path, text);
    CHECK(control_authorized_keys_read(path, keys, &n, err, sizeof err) == 0 && n == 2 &&
          !strcmp(keys[0], a.public_key) && !strcmp(keys[1], b.public_key), "two keys: %s", err);
    // Z85 has ':' among its characters: a key that starts with one is still a bare key, labelled or not.
    uint8_t raw[32] = {0xC7, 0x21, 0x6B, 0x40};   // 64 * 85^4: Z85 digit 64 is ':'
    ControlKey colon;
    REQUIRE(zmq_z85_encode(colon, raw, 32) != NULL && colon[0] == ':', "crafting a key that starts with ':'");
    snprintf(text, sizeof text, "%s\npublic-key:%s\n", colon, colon);
    write_text(path, text);
    CHECK(control_authorized_keys_read(path, keys, &n, err, sizeof err) == 0 && n == 2 && !strcmp(keys[0], colon) &&
          !strcmp(keys[1], colon), "a key with ':' in it: %s", err);
    snprintf(text, sizeof text, "secret-key: %s\n", a.secret_key);
    write_text(path, text);
    CHECK(control_authorized_keys_read(path, keys, &n, err, sizeof err) != 0 && strstr(err, "secret key"),
          "a secret key in authorized_keys: %s", err);
    write_text(path, "# nobody\n");
    CHECK(control_authorized_keys_read(path, keys, &n, err, sizeof err) != 0 && strstr(err, "holds no key"),
          "empty authorized_keys: %s", err);
    unlink(path);
}

static void test_local_endpoints(void) {
    const char *local[] = {"tcp://127.0.0.1:5555", "tcp://127.1.2.3:1", "tcp://localhost:5555", "tcp://[::1]:5555",
                           "ipc:///tmp/x", "inproc://x"};
    const char *reachable[] = {"tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.5:5555", "tcp://eth0:5555",
                               "tcp://127.evil.example:5555", "tcp://[::]:5555", "tcp://host:5555"};
    for (size_t i = 0; i < sizeof local / sizeof local[0]; i++)
        CHECK(zmq_control_endpoint_is_local(local[i]), "%s should be local", local[i]);
    for (size_t i = 0; i < sizeof reachable / sizeof reachable[0]; i++)
        CHECK(!zmq_control_endpoint_is_local(reachable[i]), "%s should count as reachable", reachable[i]);
}

int main(void) {
    REQUIRE(mkdtemp(dir) != NULL, "mkdtemp");
    test_keypair_files();
    test_authorized_keys();
    test_local_endpoints();
    rmdir(dir);
    if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
    else printf("test_rollout_control_keys: ok\n");
    return failures ? 1 : 0;
}
