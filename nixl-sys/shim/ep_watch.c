/*
 * nixl-sys endpoint-failure watch: tells nixl-sys the moment UCX fails one
 * of NIXL's endpoints, instead of at the next call that happens to touch it.
 *
 * Why. NIXL 1.5.1's UCX plugin creates every endpoint with an error handler
 * (`nixlUcxEp::err_cb`) that only marks the endpoint FAILED; nobody is
 * told. UCX runs that handler inside worker progress as soon as a TCP lane
 * reads its peer's FIN or RST (a killed process's kernel closes its sockets
 * within milliseconds), so the information exists long before the next
 * heartbeat asks for it (docs/design/event-detection.md).
 *
 * How. Built into the same object as ep_close.c and loaded the same way
 * (RTLD_GLOBAL, before libnixl), so the UCX plugin binds its
 * `ucp_ep_create` here. A create whose parameters name an error handler,
 * and nothing this file does not know, is forwarded with the handler
 * replaced by `watched_err_cb`, which records the endpoint, wakes the
 * eventfd nixl-sys gave it, then calls the original handler with its
 * original argument. Nothing else is changed: the argument, the mode and
 * every other member stay the caller's. Endpoints created inside a scope
 * opened on the same thread (around nixl-sys's own loadRemoteMD) are
 * listed, so nixl-sys can name the remote agent of a failed endpoint.
 *
 * The recording runs on whatever thread progresses the worker, inside
 * UCX's worker lock: it takes one short mutex, copies 16 bytes and writes
 * 8 bytes to an eventfd. It never calls into UCX or NIXL.
 *
 * From UCX's public API (ucp.h, ucp_def.h), declared here, no header
 * included: ucp_ep_params_t begins with uint64_t field_mask, const
 * ucp_address_t *address, ucp_err_handling_mode_t err_mode (an enum),
 * ucp_err_handler_t err_handler { cb, arg }, void *user_data; the mask
 * bits REMOTE_ADDRESS 1<<0, ERR_HANDLING_MODE 1<<1, ERR_HANDLER 1<<2,
 * USER_DATA 1<<3; the handler is void (*)(void *arg, ucp_ep_h ep,
 * ucs_status_t status).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "interpose.h"

#define NKS_EP_PARAM_REMOTE_ADDRESS (1ull << 0)
#define NKS_EP_PARAM_ERR_HANDLING_MODE (1ull << 1)
#define NKS_EP_PARAM_ERR_HANDLER (1ull << 2)
#define NKS_EP_PARAM_USER_DATA (1ull << 3)
#define NKS_EP_PARAMS_KNOWN                                                              \
    (NKS_EP_PARAM_REMOTE_ADDRESS | NKS_EP_PARAM_ERR_HANDLING_MODE |                      \
     NKS_EP_PARAM_ERR_HANDLER | NKS_EP_PARAM_USER_DATA)
#define NKS_UCS_OK 0
#define NKS_UCS_ERR_NO_ELEM (-12)

typedef void (*err_cb_fn)(void *arg, void *ep, int status);
typedef int (*create_fn)(void *worker, const void *params, void **ep_p);

/* The prefix of ucp_ep_params_t that this file reads and rebuilds. */
struct ep_params_prefix {
    uint64_t field_mask;
    const void *address;
    int32_t err_mode;
    err_cb_fn err_cb;
    void *err_arg;
    void *user_data;
};

/* One failure, as handed to nixl-sys (mirrored in Rust, endpoints.rs). */
struct nks_ep_failure {
    uint64_t ep;       /* the ucp_ep_h, as an integer */
    int64_t status;    /* the ucs_status_t UCX gave the handler */
    uint64_t at_ns;    /* CLOCK_MONOTONIC when the handler ran */
};

/* Counts since the object was loaded (mirrored in Rust, endpoints.rs). */
struct nks_ep_watch_counts {
    uint64_t watched;   /* creates whose error handler was wrapped */
    uint64_t unwatched; /* creates with a handler this file left alone */
    uint64_t failures;  /* wrapped handlers UCX ran */
    uint64_t lost;      /* failures dropped: the queue was full */
};

/* The one handler wrapped: NIXL's (one function for every endpoint). A
 * second, different handler is passed through untouched (counted). */
static err_cb_fn original_cb;
static int wake_fd = -1;

#define NKS_QUEUE 1024
static struct nks_ep_failure queue[NKS_QUEUE];
static size_t queue_len;
static struct nks_ep_watch_counts counts;
static pthread_mutex_t watch_lock = PTHREAD_MUTEX_INITIALIZER;

/* Endpoints created inside this thread's scope. */
#define NKS_SCOPE_EPS 64
static __thread int scope_depth;
static __thread uint64_t scope_eps[NKS_SCOPE_EPS];
static __thread size_t scope_len;
static __thread size_t scope_overflow;

static struct nks_resolved slots[NKS_SLOTS];

int ucp_ep_create(void *worker, const void *params, void **ep_p) NKS_EXPORT;

static create_fn
resolve(void *caller_addr) {
    return (create_fn)nks_resolve(slots, &watch_lock, caller_addr, "ucp_ep_create",
                                  (const void *)ucp_ep_create);
}

static uint64_t
monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void
watched_err_cb(void *arg, void *ep, int status) {
    uint64_t one = 1;
    int fd;
    pthread_mutex_lock(&watch_lock);
    counts.failures++;
    if (queue_len < NKS_QUEUE) {
        queue[queue_len].ep = (uint64_t)(uintptr_t)ep;
        queue[queue_len].status = status;
        queue[queue_len].at_ns = monotonic_ns();
        queue_len++;
    } else {
        counts.lost++;
    }
    fd = wake_fd;
    pthread_mutex_unlock(&watch_lock);
    if (fd >= 0) {
        /* An eventfd write fails only when its counter would overflow,
         * which a reader that drains it never lets happen. */
        ssize_t r = write(fd, &one, sizeof(one));
        (void)r;
    }
    original_cb(arg, ep, status);
}

int
ucp_ep_create(void *worker, const void *params, void **ep_p) {
    create_fn real = resolve(__builtin_return_address(0));
    const struct ep_params_prefix *in = params;
    /* Large and zeroed: UCX reads only the members field_mask names. */
    uint64_t rebuilt[64];
    struct ep_params_prefix *out = (struct ep_params_prefix *)rebuilt;
    const void *use = params;
    int wrapped = 0;
    int st;

    if (real == NULL) {
        return NKS_UCS_ERR_NO_ELEM;
    }
    if (in != NULL && (in->field_mask & NKS_EP_PARAM_ERR_HANDLER) && in->err_cb != NULL) {
        pthread_mutex_lock(&watch_lock);
        if (original_cb == NULL) {
            original_cb = in->err_cb;
        }
        /* Only parameters made of the members above are rebuilt: the
         * struct's size differs between UCX versions, so nothing this
         * file does not know is ever copied. */
        wrapped = original_cb == in->err_cb && (in->field_mask & ~NKS_EP_PARAMS_KNOWN) == 0;
        if (wrapped) {
            counts.watched++;
        } else {
            counts.unwatched++;
        }
        pthread_mutex_unlock(&watch_lock);
    }
    if (wrapped) {
        memset(rebuilt, 0, sizeof(rebuilt));
        *out = *in;
        out->err_cb = watched_err_cb;
        use = out;
    }
    st = real(worker, use, ep_p);
    if (st == NKS_UCS_OK && scope_depth > 0 && ep_p != NULL && *ep_p != NULL) {
        if (scope_len < NKS_SCOPE_EPS) {
            scope_eps[scope_len++] = (uint64_t)(uintptr_t)*ep_p;
        } else {
            scope_overflow++;
        }
    }
    return st;
}

/* Gives the watch the eventfd it wakes on each failure (-1: none). */
NKS_EXPORT void
nks_ep_watch_set_fd(int fd) {
    pthread_mutex_lock(&watch_lock);
    wake_fd = fd;
    pthread_mutex_unlock(&watch_lock);
}

/* Moves up to `cap` queued failures into `out`, oldest first; returns how
 * many. The rest stay queued for the next call. */
NKS_EXPORT size_t
nks_ep_watch_drain(struct nks_ep_failure *out, size_t cap) {
    size_t n;
    pthread_mutex_lock(&watch_lock);
    n = queue_len < cap ? queue_len : cap;
    memcpy(out, queue, n * sizeof(*out));
    memmove(queue, queue + n, (queue_len - n) * sizeof(*out));
    queue_len -= n;
    pthread_mutex_unlock(&watch_lock);
    return n;
}

/* The counts so far. */
NKS_EXPORT void
nks_ep_watch_counts(struct nks_ep_watch_counts *out) {
    pthread_mutex_lock(&watch_lock);
    *out = counts;
    pthread_mutex_unlock(&watch_lock);
}

/* Opens a scope on this thread: endpoints created in it are listed. */
NKS_EXPORT void
nks_ep_watch_scope_begin(void) {
    if (scope_depth++ == 0) {
        scope_len = 0;
        scope_overflow = 0;
    }
}

/* Closes the scope: copies up to `cap` of its endpoints into `out` and
 * returns how many were created in all (more than `cap`: some missed). */
NKS_EXPORT size_t
nks_ep_watch_scope_end(uint64_t *out, size_t cap) {
    size_t n = scope_len < cap ? scope_len : cap;
    if (scope_depth > 0) {
        scope_depth--;
    }
    if (out != NULL) {
        memcpy(out, scope_eps, n * sizeof(*out));
    }
    return scope_len + scope_overflow;
}
