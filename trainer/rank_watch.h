// trainer/rank_watch.h — whether the other ranks' processes live, for the ZeRO communicator on GPUs.
//
// That NCCL communicator is joined by id (its id travels over the host communicator), so it has no side channel
// of its own: a rank that crashed or froze would hold a collective until --comm-timeout. Each rank keeps a
// heartbeat-carrying DEALER to every other rank's host-backend endpoint (trainer/server_liveness.h watches them)
// and hands the communicator a CommPeerWatch over them: the watchdog names the rank within seconds.
#ifndef TANDEM_TRAINER_RANK_WATCH_H
#define TANDEM_TRAINER_RANK_WATCH_H

#include <stddef.h>

#include "shared/comm/comm.h"

typedef struct RankWatch RankWatch;

// host: the host communicator of this run (its peers' endpoints); rank, world: this rank's place.
int rank_watch_create(RankWatch **out, const Comm *host, int rank, int world, char *err, size_t err_len);
void rank_watch_destroy(RankWatch *w);
// The watch for comm_create_with_id_watched (valid while w lives).
CommPeerWatch rank_watch_peer_watch(RankWatch *w);

#endif
