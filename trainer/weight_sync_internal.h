// trainer/weight_sync_internal.h — what the weight-sync transports share (trainer/weight_sync.c: zmq and nccl;
// trainer/weight_sync_ipc.c: ipc). Not an API: trainer/weight_sync.h is.
#ifndef TANDEM_TRAINER_WEIGHT_SYNC_INTERNAL_H
#define TANDEM_TRAINER_WEIGHT_SYNC_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "trainer/trainer.h"

// The elements of unit u that this rank sends: [*off, *off + count) of the whole unit (its ZeRO slice, cut short
// where the slice runs into the padding; with LoRA the slice ZeRO would have given it of the merged unit).
size_t weight_sync_owned_count(const Trainer *t, int u, size_t *off);
// Every rank learns whether every rank's sending went well (rc: this rank's). 0, or -1 with a message.
int weight_sync_agree(Trainer *t, int rc, char *err, size_t err_len);
// Rank 0 closes the update (weights_end; end_ids: those already sent, else NULL) and tells every rank how it went.
int weight_sync_finish(Trainer *t, int64_t version, int rc, const int64_t *end_ids, char *err, size_t err_len);

// Transport ipc (trainer/weight_sync_ipc.c): the whole push of update `version`, every rank together.
int weight_sync_push_ipc(Trainer *t, int64_t version, char *err, size_t err_len);
// Unmaps every server staging this rank mapped.
void weight_sync_ipc_free(struct WeightSyncIpc *ipc);

#endif
