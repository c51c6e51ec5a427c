// shared/control_keys.h — the CURVE keys that authenticate the ZeroMQ control channel (docs/protocol-zmq.md,
// "Authentication"): key generation, the key files both binaries read, and the client side of a socket.
//
// Keys are ZeroMQ CURVE keys in Z85 text: 40 characters for 32 bytes. Files are text, one entry a line, blank
// lines and lines starting with '#' ignored:
//   key-pair file (a secret: mode 0600)   "public-key: <Z85>" and "secret-key: <Z85>" lines; a file holding
//                                         only one bare Z85 key is read as a secret key (its public key is
//                                         derived from it)
//   public-key file                       "public-key: <Z85>" or one bare Z85 key; a key-pair file works too
//                                         (only its public line is read)
//   authorized-keys file                  one client public key a line (bare Z85, or "public-key: <Z85>")
// Every function returns 0 or -1 with a message naming the file and line; none exits.
#ifndef TANDEM_SHARED_CONTROL_KEYS_H
#define TANDEM_SHARED_CONTROL_KEYS_H

#include <stddef.h>

#define CONTROL_KEY_Z85_LEN 40
#define CONTROL_MAX_AUTHORIZED_KEYS 256

typedef char ControlKey[CONTROL_KEY_Z85_LEN + 1];   // Z85 text, NUL-terminated

typedef struct {
    ControlKey public_key;
    ControlKey secret_key;
} ControlKeyPair;

// 1 when text is 40 Z85 characters that decode to a 32-byte key.
int control_key_is_valid(const char *text);

// A fresh key pair (zmq_curve_keypair). Fails only when libzmq was built without CURVE.
int control_keypair_generate(ControlKeyPair *kp, char *err, size_t err_len);

int control_keypair_read(const char *path, ControlKeyPair *kp, char *err, size_t err_len);
int control_public_key_read(const char *path, ControlKey out, char *err, size_t err_len);
// keys (CONTROL_MAX_AUTHORIZED_KEYS) receives the keys, *n their count; a file with none is refused.
int control_authorized_keys_read(const char *path, ControlKey *keys, int *n, char *err, size_t err_len);

// Files are created (or replaced) with mode 0600, whatever the umask, and written whole.
int control_keypair_write(const char *path, const ControlKeyPair *kp, char *err, size_t err_len);
int control_public_key_write(const char *path, const ControlKey key, char *err, size_t err_len);

// Makes sock (not yet connected) a CURVE client of the server whose public key is server_public, with the
// client's key pair: ZMQ_CURVE_SERVERKEY, ZMQ_CURVE_PUBLICKEY, ZMQ_CURVE_SECRETKEY.
int control_client_secure(void *sock, const ControlKey server_public, const ControlKeyPair *client, char *err,
                          size_t err_len);

#endif
