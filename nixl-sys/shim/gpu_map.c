/*
 * nixl-sys GPU-mapping ledger: makes a release give a peer's GPU memory
 * back at UCX's default `UCX_CUDA_IPC_CACHE=y`.
 *
 * Why. UCX's cuda_ipc transport maps a peer's GPU allocation into this
 * process at the first zero-copy transfer and keeps the mapping in a
 * process-wide cache (one per exporter pid, pid namespace and device) until
 * the process exits. Nothing a release does (rkey destroy, endpoint close,
 * NIXL's invalidateRemoteMD) reaches that cache, and the mapping alone keeps
 * the peer's memory allocated: a restarted prefill cannot get it back
 * (docs/design/gpu-mappings.md, measured on an H200 in docs/gpu-check.md).
 * Closing the mapping behind UCX's back is not safe: a live peer that comes
 * back with the same process sends an rkey with the same pid, base address
 * and buffer id, UCX's cache *hits* the entry whose mapping is gone, with no
 * driver call to see it, and the next transfer reads an unmapped address.
 *
 * How. Built into the same object as ep_close.c and loaded the same way
 * (RTLD_GLOBAL, before libnixl and so before UCX loads libuct_cuda), so
 * UCX's cuda_ipc module binds here, through its relocations:
 * - its cache's own entry points, `uct_cuda_ipc_map_memhandle` (every
 *   transfer, hit or miss) and `uct_cuda_ipc_unmap_memhandle` (every
 *   transfer's end and every rkey release), which libuct_cuda calls through
 *   its PLT. Their calls mirror UCX's reference count of each cached
 *   region exactly;
 * - the driver calls that make and close a mapping inside them
 *   (`cuIpcOpenMemHandle_v2`/`cuIpcCloseMemHandle`; `cuMemMap`/`cuMemUnmap`
 *   for VMM imports, fabric handles or POSIX fds): the ledger's address,
 *   size, kind and count of opens;
 * - and libucp's `uct_rkey_unpack_v2`/`uct_rkey_unpack`/`uct_rkey_release`,
 *   which hand out and take back the key pointer every later map call
 *   names: keys unpacked inside a load scope (nixl-sys's own loadRemoteMD
 *   and the Python package's) belong to the remote agent that load named.
 *
 * A region UCX would keep cached at reference count 0 keeps one reference
 * that is ours: the unmap call that would bring UCX's count to 0 is not
 * forwarded. At the release of the last agent that used a region, that
 * reference is given back with UCX's own call, `cache_enabled` 0: UCX
 * removes the region from its cache and closes the mapping itself, under
 * its own locks, and only if its count is then 0 (no transfer of any agent
 * holds it). The next lookup of that region, by a peer that comes back with
 * the same process, misses and maps afresh: no stale entry, no close of an
 * address UCX does not also forget, no later close by UCX to neutralise.
 *
 * Nothing is recorded until nixl-sys enables the ledger (a UCX whose two
 * cache entry points have the signatures declared below, 1.21 and later);
 * until then, and for every region it did not see opened, every call is
 * forwarded unchanged. Calls are forwarded with their registers as they came,
 * so a UCX with another signature is passed through intact.
 *
 * From the CUDA driver API (cuda.h), declared here, no header included:
 * CUresult is int, CUdeviceptr 64 bits, CUipcMemHandle 64 bytes passed by
 * value, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1 and _FABRIC 8. From
 * UCX (uct_cuda_ipc_cache.h, uct.h): the two cache entry points' arguments,
 * `uct_rkey_bundle_t` beginning with its `uct_rkey_t rkey`, UCS_OK 0.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "interpose.h"

#define NKS_UCS_OK 0
#define NKS_UCS_ERR_NO_ELEM (-12)
#define NKS_CUDA_SUCCESS 0
#define NKS_CUDA_ERROR_NOT_FOUND 500
#define NKS_HANDLE_TYPE_POSIX_FD 1
#define NKS_HANDLE_TYPE_FABRIC 8

/* Import kinds (mirrored in Rust, gpu.rs). */
#define NKS_GPU_KIND_LEGACY 1
#define NKS_GPU_KIND_VMM_FABRIC 2
#define NKS_GPU_KIND_VMM_POSIX_FD 3
#define NKS_GPU_KIND_VMM_OTHER 4

typedef struct {
    char reserved[64];
} nks_ipc_handle;

typedef int (*map_fn)(void *key, int dev, void **mapped_addr, int log_level);
typedef int (*unmap_fn)(int pid, uint32_t pid_ns, uintptr_t d_bptr, const void *mapped_addr,
                        int dev, int cache_enabled);
typedef int (*rkey_unpack_v2_fn)(void *component, const void *buffer, const void *params,
                                 uint64_t *bundle);
typedef int (*rkey_unpack_fn)(void *component, const void *buffer, uint64_t *bundle);
typedef int (*rkey_release_fn)(void *component, const uint64_t *bundle);
typedef int (*ipc_open_fn)(uint64_t *dptr, nks_ipc_handle handle, unsigned int flags);
typedef int (*ipc_close_fn)(uint64_t dptr);
typedef int (*range_fn)(uint64_t *base, size_t *size, uint64_t dptr);
typedef int (*import_fn)(uint64_t *handle, void *os_handle, int type);
typedef int (*mem_map_fn)(uint64_t ptr, size_t size, size_t offset, uint64_t handle,
                          uint64_t flags);
typedef int (*mem_unmap_fn)(uint64_t ptr, size_t size);

/* One mapping UCX's cache holds (mirrored in Rust, gpu.rs, as GpuMapping). */
struct nks_gpu_mapping {
    uint64_t addr;    /* the mapped address in this process */
    uint64_t size;    /* bytes mapped */
    uint64_t d_bptr;  /* the exporter's base address (0 until UCX unmapped once) */
    int64_t refs;     /* UCX's references, ours not counted */
    uint64_t holder;  /* the first agent pair that used it, 0 when none */
    uint32_t kind;    /* NKS_GPU_KIND_* */
    uint32_t opens;   /* driver opens not yet closed */
    uint32_t holders; /* agent pairs that used it and are not released */
    int32_t pid;      /* the exporter's pid (0 until UCX unmapped once) */
    uint8_t held;     /* one reference is ours */
    uint8_t unknown;  /* used by a key no load scope named: never unmapped */
    uint8_t doomed;   /* released while in use: unmapped at its last unmap */
    uint8_t pad;
    uint32_t pad2;
};

/* What one release did (mirrored in Rust, gpu.rs, as GpuReleaseCounts). */
struct nks_gpu_release {
    uint32_t unmapped;      /* regions UCX removed and closed */
    uint32_t kept_shared;   /* still used by another agent pair */
    uint32_t kept_unknown;  /* also used by keys no load named */
    uint32_t deferred;      /* in use now: unmapped when UCX's count reaches 0 */
    uint32_t raced;         /* a transfer mapped it again meanwhile: kept */
    uint32_t failures;      /* the driver refused the close */
    uint64_t bytes;         /* bytes of the regions unmapped */
};

/* Process-wide counts (mirrored in Rust, gpu.rs, as GpuCounts). */
struct nks_gpu_counts {
    uint64_t maps;           /* UCX map calls seen while enabled */
    uint64_t hits;           /* of which found the region cached */
    uint64_t opens;          /* driver opens inside them */
    uint64_t open_failures;  /* driver opens that failed */
    uint64_t closes;         /* driver closes of ledger regions */
    uint64_t close_failures; /* of which failed */
    uint64_t unmapped;       /* regions closed at a release (or deferred one) */
    uint64_t unmapped_bytes; /* their bytes */
    uint64_t regions;        /* regions in the ledger now */
    uint64_t bytes;          /* their bytes */
    uint64_t held;           /* regions holding our reference now */
    uint64_t unknown_keys;   /* map calls by keys no load named */
};

/* ---- a small open-addressing map from a 64-bit key to a 64-bit value --- */

#define NKS_EMPTY 0ull
#define NKS_GONE UINT64_MAX

struct u64map {
    uint64_t *keys;
    uint64_t *vals;
    size_t cap; /* a power of two, or 0 */
    size_t used; /* live + gone slots */
    size_t live;
};

static size_t
slot_of(uint64_t k, size_t cap) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (size_t)k & (cap - 1);
}

static uint64_t *
map_find(struct u64map *m, uint64_t k) {
    size_t i, n;
    if (m->cap == 0 || k == NKS_EMPTY || k == NKS_GONE) {
        return NULL;
    }
    for (i = slot_of(k, m->cap), n = 0; n < m->cap; i = (i + 1) & (m->cap - 1), n++) {
        if (m->keys[i] == NKS_EMPTY) {
            return NULL;
        }
        if (m->keys[i] == k) {
            return &m->vals[i];
        }
    }
    return NULL;
}

static int map_put(struct u64map *m, uint64_t k, uint64_t v);

static int
map_grow(struct u64map *m) {
    struct u64map bigger = {0};
    size_t i;
    bigger.cap = m->cap ? m->cap * 2 : 64;
    /* Only rehash into the same size when mostly tombstones. */
    if (m->cap && m->live * 4 < m->cap) {
        bigger.cap = m->cap;
    }
    bigger.keys = calloc(bigger.cap, sizeof(uint64_t));
    bigger.vals = calloc(bigger.cap, sizeof(uint64_t));
    if (bigger.keys == NULL || bigger.vals == NULL) {
        free(bigger.keys);
        free(bigger.vals);
        return -1;
    }
    for (i = 0; i < m->cap; i++) {
        if (m->keys[i] != NKS_EMPTY && m->keys[i] != NKS_GONE) {
            map_put(&bigger, m->keys[i], m->vals[i]);
        }
    }
    free(m->keys);
    free(m->vals);
    *m = bigger;
    return 0;
}

static int
map_put(struct u64map *m, uint64_t k, uint64_t v) {
    uint64_t *have;
    size_t i;
    if (k == NKS_EMPTY || k == NKS_GONE) {
        return -1;
    }
    have = map_find(m, k);
    if (have != NULL) {
        *have = v;
        return 0;
    }
    if ((m->used + 1) * 4 > m->cap * 3 && map_grow(m) != 0) {
        return -1;
    }
    for (i = slot_of(k, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == NKS_EMPTY || m->keys[i] == NKS_GONE) {
            if (m->keys[i] == NKS_EMPTY) {
                m->used++;
            }
            m->keys[i] = k;
            m->vals[i] = v;
            m->live++;
            return 0;
        }
    }
}

static void
map_del(struct u64map *m, uint64_t k) {
    uint64_t *have = map_find(m, k);
    if (have != NULL) {
        size_t i = (size_t)(have - m->vals);
        m->keys[i] = NKS_GONE;
        m->vals[i] = 0;
        m->live--;
    }
}

/* ---- the ledger ---------------------------------------------------------- */

struct region {
    struct nks_gpu_mapping pub;
    /* Unique per region made: an address the driver hands out again is
     * another region. */
    uint64_t serial;
    /* The arguments of UCX's last unmap of it: what giving our reference
     * back passes, and the function that takes it. */
    uint32_t pid_ns;
    int32_t dev;
    unmap_fn real_unmap;
    /* Agent pairs that used it and are not released (a small set). */
    uint64_t *pairs;
    uint32_t npairs, cappairs;
};

static pthread_mutex_t ledger_lock = PTHREAD_MUTEX_INITIALIZER;
static int enabled;
static struct u64map regions;  /* mapped address -> struct region * */
static struct u64map keys;     /* UCT rkey (the cuda_ipc key pointer) -> pair */
static struct nks_gpu_counts totals;
static uint64_t serials;

/* This thread is inside UCX's map call: the driver opens it makes are
 * mappings of UCX's cache. */
static __thread int in_map;
static __thread int import_type;

/* This thread is inside a load scope: keys unpacked and regions mapped
 * meanwhile belong to the agent the load names. */
struct scope_list {
    uint64_t *items;
    size_t len, cap;
};
static __thread int scope_depth;
static __thread struct scope_list scope_keys;
static __thread struct scope_list scope_regions;

/* What this thread's own closes did while it gave references back. */
static __thread int in_release;
static __thread uint32_t release_closed, release_failed;
static __thread uint64_t release_bytes;

static void
list_push(struct scope_list *l, uint64_t v) {
    size_t i;
    for (i = 0; i < l->len; i++) {
        if (l->items[i] == v) {
            return;
        }
    }
    if (l->len == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        uint64_t *p = realloc(l->items, cap * sizeof(uint64_t));
        if (p == NULL) {
            return;
        }
        l->items = p;
        l->cap = cap;
    }
    l->items[l->len++] = v;
}

static struct region *
region_at(uint64_t addr) {
    uint64_t *v = map_find(&regions, addr);
    return v ? (struct region *)(uintptr_t)*v : NULL;
}

static void
add_pair(struct region *r, uint64_t pair) {
    uint32_t i;
    for (i = 0; i < r->npairs; i++) {
        if (r->pairs[i] == pair) {
            return;
        }
    }
    if (r->npairs == r->cappairs) {
        uint32_t cap = r->cappairs ? r->cappairs * 2 : 4;
        uint64_t *p = realloc(r->pairs, cap * sizeof(uint64_t));
        if (p == NULL) {
            /* Cannot record who uses it: never unmap it. */
            r->pub.unknown = 1;
            return;
        }
        r->pairs = p;
        r->cappairs = cap;
    }
    r->pairs[r->npairs++] = pair;
    r->pub.holders = r->npairs;
    if (r->pub.holder == 0) {
        r->pub.holder = pair;
    }
}

static int
remove_pair(struct region *r, uint64_t pair) {
    uint32_t i;
    for (i = 0; i < r->npairs; i++) {
        if (r->pairs[i] == pair) {
            r->pairs[i] = r->pairs[--r->npairs];
            r->pub.holders = r->npairs;
            r->pub.holder = r->npairs ? r->pairs[0] : 0;
            return 1;
        }
    }
    return 0;
}

/* A driver open inside UCX's map call: a new mapping of its cache, or one
 * more open of an address already mapped. Called with the lock held. */
static void
opened(uint64_t addr, uint64_t size, uint32_t kind) {
    struct region *r = region_at(addr);
    totals.opens++;
    if (r == NULL) {
        r = calloc(1, sizeof(*r));
        if (r == NULL || map_put(&regions, addr, (uint64_t)(uintptr_t)r) != 0) {
            free(r);
            return;
        }
        r->serial = ++serials;
        r->pub.addr = addr;
        r->pub.size = size;
        r->pub.kind = kind;
        totals.regions++;
        totals.bytes += size;
    }
    r->pub.opens++;
}

/* A driver close of a ledger address; `ok` whether the driver closed it.
 * Called with the lock held. */
static void
closed(uint64_t addr, int ok) {
    struct region *r = region_at(addr);
    if (r == NULL) {
        return;
    }
    totals.closes++;
    if (!ok) {
        totals.close_failures++;
        if (in_release) {
            release_failed++;
        }
    } else if (r->pub.opens > 1) {
        r->pub.opens--;
        return;
    }
    /* Gone from UCX's cache (UCX drops a region whose close failed too). */
    if (ok && in_release) {
        release_closed++;
        release_bytes += r->pub.size;
    }
    if (r->pub.held) {
        totals.held--;
    }
    totals.regions--;
    totals.bytes -= r->pub.size;
    map_del(&regions, addr);
    free(r->pairs);
    free(r);
}

/* ---- UCX's cache entry points ------------------------------------------ */

static pthread_mutex_t resolve_lock = PTHREAD_MUTEX_INITIALIZER;
static struct nks_resolved map_slots[NKS_SLOTS], unmap_slots[NKS_SLOTS];
static struct nks_resolved unpack2_slots[NKS_SLOTS], unpack_slots[NKS_SLOTS];
static struct nks_resolved release_slots[NKS_SLOTS];
static struct nks_resolved open_slots[NKS_SLOTS], close_slots[NKS_SLOTS];
static struct nks_resolved range_slots[NKS_SLOTS], import_slots[NKS_SLOTS];
static struct nks_resolved mmap_slots[NKS_SLOTS], munmap_slots[NKS_SLOTS];

int uct_cuda_ipc_map_memhandle(void *key, int dev, void **mapped_addr, int log_level) NKS_EXPORT;
int uct_cuda_ipc_unmap_memhandle(int pid, uint32_t pid_ns, uintptr_t d_bptr,
                                 const void *mapped_addr, int dev, int cache_enabled) NKS_EXPORT;
int uct_rkey_unpack_v2(void *component, const void *buffer, const void *params,
                       uint64_t *bundle) NKS_EXPORT;
int uct_rkey_unpack(void *component, const void *buffer, uint64_t *bundle) NKS_EXPORT;
int uct_rkey_release(void *component, const uint64_t *bundle) NKS_EXPORT;
int cuIpcOpenMemHandle_v2(uint64_t *dptr, nks_ipc_handle handle, unsigned int flags) NKS_EXPORT;
int cuIpcCloseMemHandle(uint64_t dptr) NKS_EXPORT;
int cuMemImportFromShareableHandle(uint64_t *handle, void *os_handle, int type) NKS_EXPORT;
int cuMemMap(uint64_t ptr, size_t size, size_t offset, uint64_t handle, uint64_t flags) NKS_EXPORT;
int cuMemUnmap(uint64_t ptr, size_t size) NKS_EXPORT;

#define NKS_REAL(type, table, name, caller)                                                 \
    ((type)nks_resolve(table, &resolve_lock, caller, #name, (const void *)name))

int
uct_cuda_ipc_map_memhandle(void *key, int dev, void **mapped_addr, int log_level) {
    map_fn real = NKS_REAL(map_fn, map_slots, uct_cuda_ipc_map_memhandle,
                           __builtin_return_address(0));
    uint64_t addr, *pair;
    struct region *r;
    int st, was_open;

    if (real == NULL) {
        return NKS_UCS_ERR_NO_ELEM;
    }
    if (!__atomic_load_n(&enabled, __ATOMIC_ACQUIRE)) {
        return real(key, dev, mapped_addr, log_level);
    }
    in_map++;
    was_open = 0;
    st = real(key, dev, mapped_addr, log_level);
    in_map--;
    if (st != NKS_UCS_OK || mapped_addr == NULL) {
        return st;
    }
    addr = (uint64_t)(uintptr_t)*mapped_addr;
    pthread_mutex_lock(&ledger_lock);
    totals.maps++;
    r = region_at(addr);
    if (r != NULL) {
        /* A region UCX opened under our eyes: one more reference. */
        was_open = r->pub.refs > 0 || r->pub.held;
        r->pub.refs++;
        if (was_open) {
            totals.hits++;
        }
        pair = map_find(&keys, (uint64_t)(uintptr_t)key);
        if (pair != NULL) {
            add_pair(r, *pair);
        } else if (scope_depth > 0) {
            list_push(&scope_regions, addr);
        } else {
            r->pub.unknown = 1;
            totals.unknown_keys++;
        }
    }
    /* Anything else (UCX's own-process shortcut, a region mapped before
     * the ledger was enabled, a memory-pool import) is only forwarded. */
    pthread_mutex_unlock(&ledger_lock);
    return st;
}

/* Gives one reference back with UCX's own call; the closes it makes are
 * counted on this thread. */
static void
give_back(unmap_fn real, int pid, uint32_t pid_ns, uintptr_t d_bptr, uint64_t addr, int dev,
          int cache_enabled) {
    in_release++;
    real(pid, pid_ns, d_bptr, (const void *)(uintptr_t)addr, dev, cache_enabled);
    in_release--;
}

int
uct_cuda_ipc_unmap_memhandle(int pid, uint32_t pid_ns, uintptr_t d_bptr, const void *mapped_addr,
                             int dev, int cache_enabled) {
    unmap_fn real = NKS_REAL(unmap_fn, unmap_slots, uct_cuda_ipc_unmap_memhandle,
                             __builtin_return_address(0));
    uint64_t addr = (uint64_t)(uintptr_t)mapped_addr;
    struct region *r;
    int extra = 0;

    if (real == NULL) {
        return NKS_UCS_OK;
    }
    if (!__atomic_load_n(&enabled, __ATOMIC_ACQUIRE)) {
        return real(pid, pid_ns, d_bptr, mapped_addr, dev, cache_enabled);
    }
    pthread_mutex_lock(&ledger_lock);
    r = region_at(addr);
    if (r == NULL || r->pub.refs <= 0) {
        /* Not a region we saw mapped: UCX's alone. */
        pthread_mutex_unlock(&ledger_lock);
        return real(pid, pid_ns, d_bptr, mapped_addr, dev, cache_enabled);
    }
    r->pub.refs--;
    r->pub.pid = pid;
    r->pub.d_bptr = d_bptr;
    r->pid_ns = pid_ns;
    r->dev = dev;
    r->real_unmap = real;
    if (r->pub.refs > 0 || !cache_enabled) {
        /* In use still, or UCX's cache is off (UCX closes it itself at 0). */
        pthread_mutex_unlock(&ledger_lock);
        return real(pid, pid_ns, d_bptr, mapped_addr, dev, cache_enabled);
    }
    if (r->pub.doomed) {
        /* Released while in use: this was the last use. UCX's count is 1
         * (this call) plus ours if held: both go back, the last one with
         * the cache off, so that UCX removes and closes the region. */
        r->pub.doomed = 0;
        extra = r->pub.held;
        if (r->pub.held) {
            r->pub.held = 0;
            totals.held--;
        }
        pthread_mutex_unlock(&ledger_lock);
        if (extra) {
            real(pid, pid_ns, d_bptr, mapped_addr, dev, cache_enabled);
        }
        give_back(real, pid, pid_ns, d_bptr, addr, dev, 0);
        pthread_mutex_lock(&ledger_lock);
        totals.unmapped += release_closed;
        totals.unmapped_bytes += release_bytes;
        release_closed = release_failed = 0;
        release_bytes = 0;
        pthread_mutex_unlock(&ledger_lock);
        return NKS_UCS_OK;
    }
    if (r->pub.held) {
        pthread_mutex_unlock(&ledger_lock);
        return real(pid, pid_ns, d_bptr, mapped_addr, dev, cache_enabled);
    }
    /* The reference that would take UCX's count to 0 stays: ours. */
    r->pub.held = 1;
    totals.held++;
    pthread_mutex_unlock(&ledger_lock);
    return NKS_UCS_OK;
}

/* ---- libucp's key unpacks and releases -------------------------------- */

static void
unpacked(int st, const uint64_t *bundle) {
    if (st != NKS_UCS_OK || bundle == NULL || bundle[0] == 0 || scope_depth == 0) {
        return;
    }
    list_push(&scope_keys, bundle[0]);
}

int
uct_rkey_unpack_v2(void *component, const void *buffer, const void *params, uint64_t *bundle) {
    rkey_unpack_v2_fn real = NKS_REAL(rkey_unpack_v2_fn, unpack2_slots, uct_rkey_unpack_v2,
                                      __builtin_return_address(0));
    int st;
    if (real == NULL) {
        return NKS_UCS_ERR_NO_ELEM;
    }
    st = real(component, buffer, params, bundle);
    unpacked(st, bundle);
    return st;
}

int
uct_rkey_unpack(void *component, const void *buffer, uint64_t *bundle) {
    rkey_unpack_fn real = NKS_REAL(rkey_unpack_fn, unpack_slots, uct_rkey_unpack,
                                   __builtin_return_address(0));
    int st;
    if (real == NULL) {
        return NKS_UCS_ERR_NO_ELEM;
    }
    st = real(component, buffer, bundle);
    unpacked(st, bundle);
    return st;
}

int
uct_rkey_release(void *component, const uint64_t *bundle) {
    rkey_release_fn real = NKS_REAL(rkey_release_fn, release_slots, uct_rkey_release,
                                    __builtin_return_address(0));
    if (real == NULL) {
        return NKS_UCS_ERR_NO_ELEM;
    }
    if (bundle != NULL && bundle[0] != 0) {
        /* The key's memory is freed by this call and may come back as
         * another agent's key. */
        pthread_mutex_lock(&ledger_lock);
        map_del(&keys, bundle[0]);
        pthread_mutex_unlock(&ledger_lock);
    }
    return real(component, bundle);
}

/* ---- the driver calls inside UCX's map and close ----------------------- */

int
cuIpcOpenMemHandle_v2(uint64_t *dptr, nks_ipc_handle handle, unsigned int flags) {
    void *caller = __builtin_return_address(0);
    ipc_open_fn real = NKS_REAL(ipc_open_fn, open_slots, cuIpcOpenMemHandle_v2, caller);
    range_fn range;
    uint64_t base = 0;
    size_t size = 0;
    int st;

    if (real == NULL) {
        return NKS_CUDA_ERROR_NOT_FOUND;
    }
    st = real(dptr, handle, flags);
    if (!in_map || !__atomic_load_n(&enabled, __ATOMIC_ACQUIRE)) {
        return st;
    }
    if (st != NKS_CUDA_SUCCESS || dptr == NULL) {
        pthread_mutex_lock(&ledger_lock);
        totals.open_failures++;
        pthread_mutex_unlock(&ledger_lock);
        return st;
    }
    /* The size of what was mapped: the whole exporter allocation. UCX
     * made the device's context current around this call. */
    range = (range_fn)nks_resolve(range_slots, &resolve_lock, caller, "cuMemGetAddressRange_v2",
                                  NULL);
    if (range == NULL || range(&base, &size, *dptr) != NKS_CUDA_SUCCESS) {
        size = 0;
    }
    pthread_mutex_lock(&ledger_lock);
    opened(*dptr, size, NKS_GPU_KIND_LEGACY);
    pthread_mutex_unlock(&ledger_lock);
    return st;
}

int
cuIpcCloseMemHandle(uint64_t dptr) {
    ipc_close_fn real = NKS_REAL(ipc_close_fn, close_slots, cuIpcCloseMemHandle,
                                 __builtin_return_address(0));
    int st;
    if (real == NULL) {
        return NKS_CUDA_ERROR_NOT_FOUND;
    }
    st = real(dptr);
    if (__atomic_load_n(&enabled, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&ledger_lock);
        closed(dptr, st == NKS_CUDA_SUCCESS);
        pthread_mutex_unlock(&ledger_lock);
    }
    return st;
}

int
cuMemImportFromShareableHandle(uint64_t *handle, void *os_handle, int type) {
    import_fn real = NKS_REAL(import_fn, import_slots, cuMemImportFromShareableHandle,
                              __builtin_return_address(0));
    if (real == NULL) {
        return NKS_CUDA_ERROR_NOT_FOUND;
    }
    if (in_map) {
        import_type = type;
    }
    return real(handle, os_handle, type);
}

int
cuMemMap(uint64_t ptr, size_t size, size_t offset, uint64_t handle, uint64_t flags) {
    mem_map_fn real = NKS_REAL(mem_map_fn, mmap_slots, cuMemMap, __builtin_return_address(0));
    uint32_t kind;
    int st;
    if (real == NULL) {
        return NKS_CUDA_ERROR_NOT_FOUND;
    }
    st = real(ptr, size, offset, handle, flags);
    if (!in_map || !__atomic_load_n(&enabled, __ATOMIC_ACQUIRE)) {
        return st;
    }
    kind = import_type == NKS_HANDLE_TYPE_FABRIC     ? NKS_GPU_KIND_VMM_FABRIC
           : import_type == NKS_HANDLE_TYPE_POSIX_FD ? NKS_GPU_KIND_VMM_POSIX_FD
                                                     : NKS_GPU_KIND_VMM_OTHER;
    pthread_mutex_lock(&ledger_lock);
    if (st == NKS_CUDA_SUCCESS) {
        opened(ptr, size, kind);
    } else {
        totals.open_failures++;
    }
    pthread_mutex_unlock(&ledger_lock);
    return st;
}

int
cuMemUnmap(uint64_t ptr, size_t size) {
    mem_unmap_fn real = NKS_REAL(mem_unmap_fn, munmap_slots, cuMemUnmap,
                                 __builtin_return_address(0));
    int st;
    if (real == NULL) {
        return NKS_CUDA_ERROR_NOT_FOUND;
    }
    st = real(ptr, size);
    /* Inside UCX's own map call a VMM import that failed half-way unmaps
     * what it mapped: the same close. */
    if (__atomic_load_n(&enabled, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&ledger_lock);
        closed(ptr, st == NKS_CUDA_SUCCESS);
        pthread_mutex_unlock(&ledger_lock);
    }
    return st;
}

/* ---- nixl-sys's side ---------------------------------------------------- */

/*
 * Turns the ledger on (1) or off (0); already so, nothing happens. Off
 * gives back every reference the ledger holds (UCX then keeps those regions cached as it would have) and
 * forgets the ledger; UCX's calls are forwarded unchanged from then on.
 */
NKS_EXPORT void
nks_gpu_enable(int on) {
    struct region **back = NULL;
    size_t n = 0, i;
    pthread_mutex_lock(&ledger_lock);
    if (!on == !enabled) {
        /* Already so: nothing to give back, nothing to forget. */
        pthread_mutex_unlock(&ledger_lock);
        return;
    }
    if (on) {
        __atomic_store_n(&enabled, 1, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&ledger_lock);
        return;
    }
    __atomic_store_n(&enabled, 0, __ATOMIC_RELEASE);
    back = calloc(regions.live ? regions.live : 1, sizeof(*back));
    for (i = 0; i < regions.cap; i++) {
        struct region *r;
        if (regions.keys[i] == NKS_EMPTY || regions.keys[i] == NKS_GONE) {
            continue;
        }
        r = (struct region *)(uintptr_t)regions.vals[i];
        map_del(&regions, r->pub.addr);
        if (r->pub.held && r->real_unmap != NULL && back != NULL) {
            back[n++] = r;
        } else {
            free(r->pairs);
            free(r);
        }
    }
    memset(&totals, 0, sizeof(totals));
    pthread_mutex_unlock(&ledger_lock);
    for (i = 0; i < n; i++) {
        struct region *r = back[i];
        r->real_unmap(r->pub.pid, r->pid_ns, r->pub.d_bptr, (const void *)(uintptr_t)r->pub.addr,
                      r->dev, 1);
        free(r->pairs);
        free(r);
    }
    free(back);
}

/* Whether the ledger is on. */
NKS_EXPORT int
nks_gpu_enabled(void) {
    return __atomic_load_n(&enabled, __ATOMIC_ACQUIRE);
}

/* Opens a load scope on this thread (nested scopes are one). */
NKS_EXPORT void
nks_gpu_scope_begin(void) {
    if (scope_depth++ == 0) {
        scope_keys.len = 0;
        scope_regions.len = 0;
    }
}

/*
 * Closes the scope; what it saw becomes a batch, named at once: its keys
 * and regions belong to the returned batch number (0: it saw nothing)
 * until nks_gpu_assign renames it. A transfer that maps in between finds
 * its key named.
 */
NKS_EXPORT uint64_t
nks_gpu_scope_end(void) {
    static uint64_t batches;
    uint64_t batch;
    size_t i;
    if (scope_depth == 0 || --scope_depth > 0) {
        return 0;
    }
    if (scope_keys.len == 0 && scope_regions.len == 0) {
        return 0;
    }
    pthread_mutex_lock(&ledger_lock);
    batch = (1ull << 63) | ++batches;
    for (i = 0; i < scope_keys.len; i++) {
        map_put(&keys, scope_keys.items[i], batch);
    }
    for (i = 0; i < scope_regions.len; i++) {
        struct region *r = region_at(scope_regions.items[i]);
        if (r != NULL) {
            add_pair(r, batch);
        }
    }
    pthread_mutex_unlock(&ledger_lock);
    scope_keys.len = 0;
    scope_regions.len = 0;
    return batch;
}

/*
 * Renames `batch` to `pair` (nixl-sys's number for the load's local and
 * remote agent). `pair` 0: the load failed; its keys are forgotten and a
 * region it leaves with no user is never unmapped by a release.
 */
NKS_EXPORT void
nks_gpu_assign(uint64_t batch, uint64_t pair) {
    size_t i;
    if (batch == 0) {
        return;
    }
    pthread_mutex_lock(&ledger_lock);
    for (i = 0; i < keys.cap; i++) {
        if (keys.keys[i] != NKS_EMPTY && keys.keys[i] != NKS_GONE && keys.vals[i] == batch) {
            if (pair != 0) {
                keys.vals[i] = pair;
            } else {
                keys.keys[i] = NKS_GONE;
                keys.vals[i] = 0;
                keys.live--;
            }
        }
    }
    for (i = 0; i < regions.cap; i++) {
        struct region *r;
        if (regions.keys[i] == NKS_EMPTY || regions.keys[i] == NKS_GONE) {
            continue;
        }
        r = (struct region *)(uintptr_t)regions.vals[i];
        if (remove_pair(r, batch)) {
            if (pair != 0) {
                add_pair(r, pair);
            } else if (r->npairs == 0) {
                r->pub.unknown = 1;
            }
        }
    }
    pthread_mutex_unlock(&ledger_lock);
}

/*
 * The release of `pair`: call it after its rkeys were released (NIXL's
 * invalidateRemoteMD) and when none of its transfers is in flight. Each
 * region the pair used and no other pair uses (nor a key no load named)
 * gets our reference back with UCX's own unmap, cache off: UCX removes it
 * from its cache and closes it, unless a transfer holds it (then it is
 * closed at that transfer's end).
 */
NKS_EXPORT void
nks_gpu_release(uint64_t pair, struct nks_gpu_release *out) {
    struct nks_gpu_release res = {0};
    struct evict {
        uint64_t addr, serial;
    } *evict = NULL;
    size_t n = 0, i;

    pthread_mutex_lock(&ledger_lock);
    for (i = 0; i < keys.cap; i++) {
        if (keys.keys[i] != NKS_EMPTY && keys.keys[i] != NKS_GONE && keys.vals[i] == pair) {
            keys.keys[i] = NKS_GONE;
            keys.vals[i] = 0;
            keys.live--;
        }
    }
    evict = calloc(regions.live ? regions.live : 1, sizeof(*evict));
    for (i = 0; i < regions.cap; i++) {
        struct region *r;
        if (regions.keys[i] == NKS_EMPTY || regions.keys[i] == NKS_GONE) {
            continue;
        }
        r = (struct region *)(uintptr_t)regions.vals[i];
        if (!remove_pair(r, pair)) {
            continue;
        }
        if (r->npairs > 0) {
            res.kept_shared++;
        } else if (r->pub.unknown) {
            res.kept_unknown++;
        } else if (r->pub.refs == 0 && r->pub.held && r->real_unmap != NULL && evict != NULL) {
            /* Ours to give back: from here on no other path does. */
            r->pub.held = 0;
            totals.held--;
            evict[n].addr = r->pub.addr;
            evict[n].serial = r->serial;
            n++;
        } else if (r->pub.refs > 0) {
            r->pub.doomed = 1;
            res.deferred++;
        }
        /* Otherwise UCX holds no reference and keeps nothing of ours:
         * its cache is off, it closes the region itself. */
    }
    pthread_mutex_unlock(&ledger_lock);

    for (i = 0; i < n; i++) {
        struct region *r;
        unmap_fn real;
        int pid, dev;
        uint32_t ns;
        uintptr_t d_bptr;

        pthread_mutex_lock(&ledger_lock);
        r = region_at(evict[i].addr);
        if (r == NULL || r->serial != evict[i].serial) {
            /* UCX closed it meanwhile (a collision, its clean-up): the
             * reference went with it. */
            pthread_mutex_unlock(&ledger_lock);
            continue;
        }
        real = r->real_unmap;
        pid = r->pub.pid;
        ns = r->pid_ns;
        d_bptr = r->pub.d_bptr;
        dev = r->dev;
        pthread_mutex_unlock(&ledger_lock);

        release_closed = release_failed = 0;
        release_bytes = 0;
        give_back(real, pid, ns, d_bptr, evict[i].addr, dev, 0);
        pthread_mutex_lock(&ledger_lock);
        if (release_closed > 0) {
            res.unmapped += release_closed;
            res.bytes += release_bytes;
            totals.unmapped += release_closed;
            totals.unmapped_bytes += release_bytes;
        } else if (release_failed > 0) {
            res.failures += release_failed;
        } else if (region_at(evict[i].addr) != NULL) {
            /* A transfer mapped it again between the decision and the
             * call: UCX kept it, the transfer holds it. */
            res.raced++;
        }
        pthread_mutex_unlock(&ledger_lock);
    }
    release_closed = release_failed = 0;
    release_bytes = 0;
    free(evict);
    if (out != NULL) {
        *out = res;
    }
}

NKS_EXPORT void
nks_gpu_counts(struct nks_gpu_counts *out) {
    pthread_mutex_lock(&ledger_lock);
    *out = totals;
    pthread_mutex_unlock(&ledger_lock);
}

/* Copies up to `cap` ledger entries into `out`; returns how many exist. */
NKS_EXPORT size_t
nks_gpu_ledger(struct nks_gpu_mapping *out, size_t cap) {
    size_t i, n = 0;
    pthread_mutex_lock(&ledger_lock);
    for (i = 0; i < regions.cap; i++) {
        if (regions.keys[i] == NKS_EMPTY || regions.keys[i] == NKS_GONE) {
            continue;
        }
        if (n < cap) {
            out[n] = ((struct region *)(uintptr_t)regions.vals[i])->pub;
        }
        n++;
    }
    pthread_mutex_unlock(&ledger_lock);
    return n;
}

/* The symbols this file interposes, for the binding check. */
NKS_EXPORT const void *
nks_gpu_symbol(const char *name) {
    static const struct {
        const char *name;
        const void *fn;
    } table[] = {
        {"uct_cuda_ipc_map_memhandle", (const void *)uct_cuda_ipc_map_memhandle},
        {"uct_cuda_ipc_unmap_memhandle", (const void *)uct_cuda_ipc_unmap_memhandle},
        {"uct_rkey_unpack_v2", (const void *)uct_rkey_unpack_v2},
        {"uct_rkey_unpack", (const void *)uct_rkey_unpack},
        {"uct_rkey_release", (const void *)uct_rkey_release},
        {"cuIpcOpenMemHandle_v2", (const void *)cuIpcOpenMemHandle_v2},
        {"cuIpcCloseMemHandle", (const void *)cuIpcCloseMemHandle},
        {"cuMemImportFromShareableHandle", (const void *)cuMemImportFromShareableHandle},
        {"cuMemMap", (const void *)cuMemMap},
        {"cuMemUnmap", (const void *)cuMemUnmap},
    };
    size_t i;
    for (i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        if (strcmp(table[i].name, name) == 0) {
            return table[i].fn;
        }
    }
    return NULL;
}

/*
 * How the loaded object whose base name is `name` (a prefix of it with
 * `prefix`: UCX's libraries carry a hash) binds `symbol`, one of this
 * file's: as nks_reloc_bound (1 bound here, 2 will bind here at its first
 * call, 0 elsewhere, -1 not imported, -2 not loaded), -3 not one of ours.
 */
NKS_EXPORT int
nks_gpu_bound(const char *name, int prefix, const char *symbol) {
    const void *target = nks_gpu_symbol(symbol);
    if (target == NULL) {
        return -3;
    }
    return nks_reloc_bound(name, prefix, symbol, target);
}
