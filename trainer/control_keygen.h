// trainer/control_keygen.h — `tandem-train keygen DIR` and the key folder `launch` makes for each run: the CURVE
// keys of the ZeroMQ control channel (docs/protocol-zmq.md, "Authentication"), one folder for a whole run.
//
// The folder (every file mode 0600; shared/control_keys.h formats):
//   server.key        the servers' key pair        -> tandem-serve --control-key-file
//   authorized_keys   the trainer's public key     -> tandem-serve --control-authorized-keys
//   server.pub        the servers' public key      -> tandem-train --control-server-key
//   client.key        the trainer's key pair       -> tandem-train --control-client-key
// Every server of a run shares one key pair and every rank one client pair: they are one trust domain, and one
// folder (or one Kubernetes Secret) is all a multi-node run has to copy.
#ifndef TANDEM_TRAINER_CONTROL_KEYGEN_H
#define TANDEM_TRAINER_CONTROL_KEYGEN_H

#include <stddef.h>

#define CONTROL_KEYS_SERVER_KEY "server.key"
#define CONTROL_KEYS_SERVER_PUB "server.pub"
#define CONTROL_KEYS_CLIENT_KEY "client.key"
#define CONTROL_KEYS_AUTHORIZED "authorized_keys"

// Generates both key pairs and writes the four files into dir (created with its parents, mode 0700 when made
// here). replace = 0 refuses a folder that already holds a server.key. Returns 0 or -1 with a message.
int control_keygen_write_dir(const char *dir, int replace, char *err, size_t err_len);

// 1 when dir holds the four files (readable); else 0 with a message naming the first missing one.
int control_keygen_dir_complete(const char *dir, char *err, size_t err_len);

// `tandem-train keygen [--force] DIR`: argv[0] is "keygen". Returns the exit status.
int control_keygen_main(int argc, char **argv);

#endif
