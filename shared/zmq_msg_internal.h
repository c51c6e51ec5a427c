// shared/zmq_msg_internal.h — what the codec's two halves share: shared/zmq_msg.c (names, encoding) and
// shared/zmq_msg_parse.c (decoding). Not part of the API: see shared/zmq_msg.h.
#ifndef TANDEM_SHARED_ZMQ_MSG_INTERNAL_H
#define TANDEM_SHARED_ZMQ_MSG_INTERNAL_H

#include <stddef.h>

#include "shared/zmq_msg.h"

// The header keys type t may carry in direction d besides "type" and "id", space-separated, '?' before an optional
// one; NULL when t does not travel in that direction (or is not a type).
const char *zmsg_keys_(ZmsgType t, ZmsgDir d);

// Copies src into dst (cap bytes with the NUL). A text too long is cut before the UTF-8 character that does not fit
// whole: cut inside one, valid UTF-8 would become invalid, and zmsg_build would replace the whole text.
void zmsg_copy_text_(char *dst, size_t cap, const char *src);

#endif
