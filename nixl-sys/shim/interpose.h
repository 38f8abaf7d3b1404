/*
 * What ep_close.c and ep_watch.c share: finding the real UCX function
 * behind an interposed one.
 */
#ifndef NKS_INTERPOSE_H
#define NKS_INTERPOSE_H

#include <pthread.h>

#define NKS_EXPORT __attribute__((visibility("default")))

/* Calling objects remembered per interposed function: one UCX in
 * practice; a few in case two UCX builds are loaded side by side. */
#define NKS_SLOTS 8

struct nks_resolved {
    void *caller_base;
    void *fn;
};

/*
 * The `symbol` of the UCX that the object containing `caller_addr`
 * depends on (its own dependency tree first, then the next object in the
 * search order after this one), never `self` (the interposer's own);
 * remembered in `table` (NKS_SLOTS entries, guarded by `lock`). NULL when
 * there is none.
 */
void *nks_resolve(struct nks_resolved *table, pthread_mutex_t *lock, void *caller_addr,
                  const char *symbol, const void *self);

/*
 * How the loaded object named `name` (its base name, or a prefix of it with
 * `prefix`) binds `symbol`: 1 to `target`, 2 not yet (lazy) but a lookup
 * will find `target`, 0 elsewhere, -1 not imported, -2 no such object
 * (ep_close.c).
 */
int nks_reloc_bound(const char *name, int prefix, const char *symbol, const void *target);

#endif
