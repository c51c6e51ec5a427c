// rollout_server/stop_request.h — how tandem-serve learns that it must stop: SIGTERM or SIGINT at any moment, or a
// ZeroMQ `shutdown` once it serves.
//
// The signal handler only writes the signal number to a pipe (async-signal-safe); a watcher thread reads it.
//   - While the server starts (model load, HTTP and ZeroMQ start-up), the watcher logs that start-up was
//     interrupted and ends the process at once with exit status 128 + signal (143 for SIGTERM, 130 for SIGINT):
//     nothing was served, so nothing needs draining, and a supervisor sees the usual "ended by a signal" status.
//   - Once stop_request_serving() was called, the first signal wakes stop_request_wait() (the caller drains);
//     a signal repeated during the drain is logged and otherwise ignored.
// stop_request_init blocks both signals in the calling thread, and every thread created after it inherits that
// mask, so the signals land either on the watcher or on threads that libraries started before main (OpenBLAS's
// pool): the same handler runs there, so no signal is lost, wherever it lands.
#ifndef TANDEM_ROLLOUT_STOP_REQUEST_H
#define TANDEM_ROLLOUT_STOP_REQUEST_H

#include <stddef.h>

// First thing in main, before any thread is created. -1 with err set when the pipe or the thread cannot be made.
int stop_request_init(char *err, size_t err_len);
// Start-up is over: from now on a signal asks for a drain instead of ending the process.
void stop_request_serving(void);
// Blocks until a stop is requested; returns the signal number, or 0 for a ZeroMQ shutdown request.
int stop_request_wait(void);
// A ZeroMQ shutdown was acknowledged (the shape of zmq_control_on_shutdown's callback; user is unused).
void stop_request_shutdown(void *user);

#endif
