// rollout_server/stop_request.c — SIGTERM / SIGINT through a pipe to a watcher thread, and ZeroMQ shutdowns: the
// one place tandem-serve learns it must stop (stop_request.h).
#include "rollout_server/stop_request.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "rollout_server/http_server.h"

static int g_pipe[2] = {-1, -1}; // [0] read by the watcher, [1] written by the handler (non-blocking)

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_requested_cv = PTHREAD_COND_INITIALIZER;
static int g_serving;   // stop_request_serving() was called
static int g_requested; // a stop was requested ...
static int g_signal;    // ... by this signal (0: a ZeroMQ shutdown)

// Runs on whichever thread the kernel picked: only write(2), which is async-signal-safe.
static void on_stop_signal(int sig) {
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    ssize_t ignored = write(g_pipe[1], &b, 1); // a full pipe already holds stops enough
    (void)ignored;
    errno = saved;
}

static const char *signal_name(int sig) { return sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "a signal"; }

static void request(int sig) {
    if (g_requested) return;
    g_requested = 1;
    g_signal = sig;
    pthread_cond_broadcast(&g_requested_cv);
}

static void *watch_signals(void *unused) {
    (void)unused;
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGTERM);
    sigaddset(&stop_signals, SIGINT);
    pthread_sigmask(SIG_UNBLOCK, &stop_signals, NULL);
    for (;;) {
        unsigned char b;
        if (read(g_pipe[0], &b, 1) != 1) continue; // EINTR: the handler ran on this thread; its byte comes next
        int sig = b;
        pthread_mutex_lock(&g_mu);
        if (!g_serving) {
            serve_log("start-up interrupted by %s (while loading the model or opening the HTTP / ZeroMQ endpoints): "
                      "exiting with status %d without serving",
                      signal_name(sig), 128 + sig);
            _exit(128 + sig);
        }
        if (g_requested) serve_log("received %s: already stopping, the drain goes on", signal_name(sig));
        request(sig);
        pthread_mutex_unlock(&g_mu);
    }
    return NULL;
}

int stop_request_init(char *err, size_t err_len) {
    if (pipe(g_pipe) != 0) {
        snprintf(err, err_len, "cannot create the signal pipe: %s", strerror(errno));
        return -1;
    }
    fcntl(g_pipe[0], F_SETFD, FD_CLOEXEC);
    fcntl(g_pipe[1], F_SETFD, FD_CLOEXEC);
    fcntl(g_pipe[1], F_SETFL, O_NONBLOCK);
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGTERM);
    sigaddset(&stop_signals, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stop_signals, NULL); // inherited by every thread created from here on
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    pthread_t watcher;
    int rc = pthread_create(&watcher, NULL, watch_signals, NULL);
    if (rc != 0) {
        snprintf(err, err_len, "cannot start the signal watcher thread: %s", strerror(rc));
        return -1;
    }
    pthread_detach(watcher);
    return 0;
}

void stop_request_serving(void) {
    pthread_mutex_lock(&g_mu);
    g_serving = 1;
    pthread_mutex_unlock(&g_mu);
}

int stop_request_wait(void) {
    pthread_mutex_lock(&g_mu);
    while (!g_requested) pthread_cond_wait(&g_requested_cv, &g_mu);
    int sig = g_signal;
    pthread_mutex_unlock(&g_mu);
    return sig;
}

void stop_request_shutdown(void *user) {
    (void)user;
    pthread_mutex_lock(&g_mu);
    request(0);
    pthread_mutex_unlock(&g_mu);
}
