// trainer/rollout_client.h — the trainer's side of the ZeroMQ control channel (docs/protocol-zmq.md):
// completion groups from the rollout servers, load-balanced, and weight pushes with transport `zmq`.
#ifndef TANDEM_TRAINER_ROLLOUT_CLIENT_H
#define TANDEM_TRAINER_ROLLOUT_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "shared/model_lora.h"
#include "shared/zmq_msg.h"

// One prompt's completions.
typedef struct {
    int n;
    int *lens;              // (n) tokens of each completion
    int32_t *tokens;        // (sum lens) completion 0's tokens, then completion 1's, ...
    float *logprobs;        // (sum lens) the server's logprob of each token (log-softmax(logits / T))
    ZmsgFinish *finish;     // (n)
    int64_t *versions;      // (n) policy version of each completion's first token
    int64_t *versions_end;  // (n) ... and of its last token
} RolloutGroup;

typedef struct RolloutClient RolloutClient;

// rollout_generate's code when every server stopped answering mid-round: retry after rollout_client_refresh
// (and a weight push to the servers that come back). Other failures are -1.
#define ROLLOUT_ESERVERS_LOST (-2)

// Connects to every endpoint (comma-separated tcp://host:port list) and checks each server's layout hash
// against the trainer's. A server that does not answer is waited for (a log line every few seconds) up to
// timeout_ms; then the error names it. server_key_path (the servers' public key) and client_key_path (this
// client's key pair; shared/control_keys.h formats) make every socket a CURVE client; a NULL path is taken from
// TANDEM_CONTROL_SERVER_KEY / TANDEM_CONTROL_CLIENT_KEY, and with neither given the sockets are plain.
int rollout_client_create(RolloutClient **out, const char *endpoints, uint64_t layout_hash, int timeout_ms,
                          const char *server_key_path, const char *client_key_path, char *err, size_t err_len);
void rollout_client_destroy(RolloutClient *c);
int rollout_client_max_seq_len(const RolloutClient *c);

// Generates s->n completions for each prompt, spread over the servers (one request per prompt; prompt i
// samples with seed s->seed + i * s->n when s->has_seed, so results do not depend on which server runs it).
// A server that stays silent for the request timeout loses its prompts to another server; a full queue is
// retried with backoff. out (n_prompts) is filled; free with rollout_groups_free.
int rollout_generate(RolloutClient *c, int n_prompts, const int32_t *const *prompts, const int *prompt_lens,
                     const ZmsgSampling *s, RolloutGroup *out, char *err, size_t err_len);
void rollout_groups_free(RolloutGroup *groups, int n);

// The same in two halves (trainer/rollout_generate.c), so that the servers generate while the caller does other
// work: _start sends every prompt and returns; _finish waits for the answers (a prompt's timeout counts from the
// later of its sending and the call) and fills out (n_prompts) as rollout_generate does. In between, the client
// may say hello, push weights and run other generations: answers that arrive meanwhile are kept for this one. A
// generation whose sending found no server answering is reported by _finish (ROLLOUT_ESERVERS_LOST). prompts and
// prompt_lens must stay valid until _finish or _cancel, which free the handle; _cancel drops a generation not
// collected (its late answers are discarded).
typedef struct RolloutPending RolloutPending;
int rollout_generate_start(RolloutClient *c, int n_prompts, const int32_t *const *prompts, const int *prompt_lens,
                           const ZmsgSampling *s, RolloutPending **out, char *err, size_t err_len);
int rollout_generate_finish(RolloutClient *c, RolloutPending *p, RolloutGroup *out, char *err, size_t err_len);
void rollout_generate_cancel(RolloutClient *c, RolloutPending *p);
// Streaming groups: waits up to wait_ms (less once a prompt completes) and fills out[i] of each prompt i whose group
// completed meanwhile, listing those in done[0..*n_done) (done holds n_prompts) in the order they completed; a
// prompt's silence counts only the time spent waiting in _poll and _finish. out must be the same array at every
// call (cleared at the first); rollout_generate_remaining says how many prompts are still out, and _finish (with
// the same out) waits for those and frees the handle. On an error (-1), _poll frees the groups in out and the
// handle; on ROLLOUT_ESERVERS_LOST (no server answering) it keeps both, with the groups completed before the loss
// in done, so that after rollout_client_refresh the next _poll sends the prompts still out again and the groups
// already in stay (_finish frees both on either).
int rollout_generate_poll(RolloutClient *c, RolloutPending *p, RolloutGroup *out, int wait_ms, int *done,
                          int *n_done, char *err, size_t err_len);
int rollout_generate_remaining(const RolloutPending *p);

// Says hello to every server (timeout_ms each): a server that answers again is used again, one that does not is
// set aside (and retried next time); *stale = 1 when an answering server holds another weights version than
// `version` (it restarted, or missed a push), so the caller pushes the weights before generating. While no server
// answers it keeps asking (a log line each time) for up to six request timeouts; then, or when a server serves
// another layout, an error.
int rollout_client_refresh(RolloutClient *c, int64_t version, int timeout_ms, int *stale, char *err, size_t err_len);

// The engine seconds the answering servers have spent in engine steps since they started (stats' step_seconds_sum,
// summed; a server of several engines counts each engine's) into *step_seconds, and how many answered within
// timeout_ms each into *n_answered. A server that does not answer is skipped, not set aside.
int rollout_client_step_seconds(RolloutClient *c, int timeout_ms, double *step_seconds, int *n_answered, char *err,
                                size_t err_len);

// Weight push, transport zmq, to every server that answers (one that does not is set aside, as above): rank 0
// begins (each server checks version and layout) and lists the servers that took it in members (n_members);
// every rank makes them the update's members (rollout_weights_set_members), sends its slices
// (rollout_weights_send_slice) and flushes; then rank 0 ends, which waits for every member's acknowledgement;
// *seconds receives the slowest server's begin-to-swap time. A member whose connection drops during the update
// (it died, restarted or stopped answering heartbeats: trainer/server_liveness.h) is set aside at once, and the
// update goes on with the others; it is given the weights when it answers again (rollout_client_refresh).
int rollout_weights_begin(RolloutClient *c, int64_t version, int *members, int *n_members, char *err,
                          size_t err_len);
// The same for an update of LoRA adapters alone (adapter-only weight sync): the servers' policy becomes their base
// weights plus these adapters; the update's units are the decoder layers' adapter units (shared/model_lora.h), and
// the slices carry them as rollout_weights_send_slice does.
int rollout_weights_begin_adapter(RolloutClient *c, int64_t version, const LoraConfig *adapter, int *members,
                                  int *n_members, char *err, size_t err_len);
// The servers (indices, n) that the update beginning now goes to; the other calls of the update address them.
void rollout_weights_set_members(RolloutClient *c, const int *servers, int n);
// After a failed update: sets aside the members that went away during it; returns how many members are gone.
int rollout_weights_lost_members(RolloutClient *c);
// Sends elements [offset, offset + count) of unit `unit` to every answering server as slices of update `version`:
// values in `dtype` on the host (bf16 as it is; fp32 as it is, or converted to bf16 when send_bf16, halving the
// bytes). Any rank may send its own slices of the update that rank 0 opened with rollout_weights_begin.
int rollout_weights_send_slice(RolloutClient *c, int64_t version, int unit, int64_t offset, const void *values,
                               ZmsgDtype dtype, int64_t count, int send_bf16, char *err, size_t err_len);
// Returns once every answering server has processed what this client sent before (a hello round trip).
int rollout_client_flush(RolloutClient *c, char *err, size_t err_len);
int rollout_weights_end(RolloutClient *c, int64_t version, double *seconds, double *commit_seconds, char *err,
                        size_t err_len);
// The same in two halves (transport nccl sends weights_end while its sends are still in flight: a server answers
// it once its receive has finished and the new weights are swapped in). req_ids has one entry per server
// (ROLLOUT_MAX_SERVERS at most); -1 where none was sent.
int rollout_weights_end_send(RolloutClient *c, int64_t version, int64_t *req_ids, char *err, size_t err_len);
int rollout_weights_end_wait(RolloutClient *c, int64_t version, const int64_t *req_ids, double *seconds,
                             double *commit_seconds, char *err, size_t err_len);

// Weight push, transport nccl (rank 0 only). rollout_alive_servers lists the answering servers (indices, in
// endpoint order, at most ROLLOUT_MAX_SERVERS) — the members of the weight-sync communicator after the
// trainer ranks. rollout_weights_begin_nccl opens update `version` on those n servers (whole weights, or the LoRA
// adapters alone when adapter is not NULL), telling server servers[j] to join communicator grp->id (the same id as
// before: reuse it) with its grp->tp[j] shards as members first .. first + tp[j] - 1 (see RolloutNcclGroup). A
// server that cannot take it (another backend) makes it return ROLLOUT_EUNSUPPORTED (the caller then falls
// back to transport ipc or zmq); a silent one ROLLOUT_ESERVERS_LOST (it is set aside). Then every rank sends over the
// communicator, and rank 0 ends with rollout_weights_end as for zmq.
#define ROLLOUT_MAX_SERVERS 64
#define ROLLOUT_EUNSUPPORTED (-3)
int rollout_alive_servers(const RolloutClient *c, int *servers);
// When server k's control connection last dropped (monotonic ms, trainer/server_liveness.h; 0: never), and its
// endpoint. Thread-safe: the NCCL watchdog of the weight-sync communicator asks while a push is on the GPU.
int64_t rollout_server_gone_ms(RolloutClient *c, int server);
const char *rollout_server_endpoint(const RolloutClient *c, int server);
// Server `server`'s tensor-parallel shards as its last hello said (1 before one came): it takes an NCCL weight
// update as that many members, each shard receiving its own parts.
int rollout_server_tp(const RolloutClient *c, int server);
// The weight-sync communicator that a weights_begin names: its id, the trainer ranks (members 0 .. trainer_ranks -
// 1), the members of each server (tp[j], its tensor-parallel shards as the plan took them from rollout_server_tp;
// server j's first member follows those of servers 0 .. j-1), and its backend (host: CPU ranks and servers over
// shared/comm's host backend, else NCCL).
typedef struct {
    const uint8_t *id;   // ZMSG_NCCL_ID_BYTES
    int trainer_ranks;
    const int32_t *tp;   // (n servers)
    int host;
} RolloutNcclGroup;
int rollout_weights_begin_nccl(RolloutClient *c, int64_t version, const LoraConfig *adapter,
                               const RolloutNcclGroup *grp, const int *servers, int n, char *err, size_t err_len);
// The same in two halves, so that the sending can be queued while the answers travel (a communicator that the
// servers have already joined): _send sends the n requests (req_ids (n) receives their ids), _wait collects the
// answers with rollout_weights_begin_nccl's results.
int rollout_weights_begin_nccl_send(RolloutClient *c, int64_t version, const LoraConfig *adapter,
                                    const RolloutNcclGroup *grp, const int *servers, int n, int64_t *req_ids,
                                    char *err, size_t err_len);
// Weight push, transport ipc (rank 0 only): opens update `version` on every answering server, telling it this
// host's identity (`host`, shared/ipc_region.h ipc_host_id); members (n_members) receive the servers that took it
// and ipc[j] member j's staging (ZmsgIpc: the handles of its shards' regions, their sizes and identity). A server
// that does not answer is set aside (it gets the weights when it answers again); one that refuses (another host,
// another tensor-parallel size) fails it with the server's message.
int rollout_weights_begin_ipc(RolloutClient *c, int64_t version, const char *host, int *members, int *n_members,
                              ZmsgIpc *ipc, char *err, size_t err_len);
int rollout_weights_begin_nccl_wait(RolloutClient *c, const int *servers, int n, const int64_t *req_ids, char *err,
                                    size_t err_len);

#endif
