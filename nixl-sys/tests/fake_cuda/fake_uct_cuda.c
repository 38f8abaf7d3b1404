/*
 * A fake UCX cuda_ipc module for the GPU-mapping tests, built as a library
 * that calls the fake driver (libcuda.so.1) and the fake libuct through
 * its relocations, as the real libuct_cuda does. It behaves as UCX's
 * remote-mapping cache does (src/uct/cuda/cuda_ipc/cuda_ipc_cache.c, UCX
 * 1.21 to master; docs/design/gpu-mappings.md):
 * - one cache per {exporter pid, pid namespace, device}, of regions keyed
 *   by the exporter's base address and checked against the allocation's
 *   buffer id: a hit only takes a reference (no driver call); a region at
 *   the same base with another buffer id is closed and mapped afresh;
 * - `uct_cuda_ipc_map_memhandle` and `uct_cuda_ipc_unmap_memhandle` are
 *   exported and called through the PLT (every transfer, and the
 *   reachability check of the rkey unpack, which keeps its reference until
 *   the rkey is released); at reference count 0 a region stays cached
 *   unless `cache_enabled` is 0;
 * - at exit (fake_ucx_exit) every cached region is closed.
 * The "UCP" calls the tests make (fake_ucp_*) unpack and release keys
 * through the fake libuct's relocations, as libucp does.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))
#define UCS_OK 0
#define UCS_ERR_INVALID_PARAM (-5)
#define UCS_ERR_NO_ELEM (-12)
#define HANDLE_TYPE_FABRIC 8
#define MAX_REGIONS 4096

typedef struct {
    char reserved[64];
} ipc_handle;

/* The packed (and unpacked) key: what an rkey carries. */
struct fake_key {
    int32_t vmm;  /* 0 legacy IPC, 1 VMM over a fabric handle */
    int32_t pid;
    uint32_t pid_ns;
    uint32_t pad;
    uint64_t d_bptr;
    uint64_t b_len;
    uint64_t buffer_id;
    ipc_handle handle;
};

struct region {
    int used;
    int32_t pid;
    uint32_t pid_ns;
    int dev;
    uint64_t d_bptr;
    uint64_t b_len;
    uint64_t buffer_id;
    int vmm;
    uint64_t mapped;
    uint64_t refcount;
};

/* The driver (fake_driver.c). */
int cuIpcOpenMemHandle_v2(uint64_t *dptr, ipc_handle handle, unsigned int flags);
int cuIpcCloseMemHandle(uint64_t dptr);
int cuMemImportFromShareableHandle(uint64_t *handle, void *os_handle, int type);
int cuMemAddressReserve(uint64_t *ptr, size_t size, size_t align, uint64_t addr, uint64_t flags);
int cuMemAddressFree(uint64_t ptr, size_t size);
int cuMemMap(uint64_t ptr, size_t size, size_t offset, uint64_t handle, uint64_t flags);
int cuMemSetAccess(uint64_t ptr, size_t size, const void *desc, size_t count);
int cuMemRelease(uint64_t handle);
int cuMemUnmap(uint64_t ptr, size_t size);
int fake_cuda_read(uint64_t addr);

/* libuct (fake_uct.c). */
struct bundle {
    uint64_t rkey;
    void *handle;
    void *type;
};
int uct_rkey_unpack_v2(void *component, const void *buffer, const void *params,
                       struct bundle *out);
int uct_rkey_release(void *component, const struct bundle *b);
void fake_uct_register(int (*unpack)(const void *, uint64_t *, void **),
                       int (*release)(uint64_t, void *));

int uct_cuda_ipc_map_memhandle(struct fake_key *key, int dev, void **mapped_addr, int log_level)
    EXPORT;
void uct_cuda_ipc_unmap_memhandle(int32_t pid, uint32_t pid_ns, uintptr_t d_bptr,
                                  const void *mapped_addr, int dev, int cache_enabled) EXPORT;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct region regions[MAX_REGIONS];
static int cache_enabled = 1;
static int component; /* its address is the component handle */

static int
find(int32_t pid, uint32_t ns, int dev, uint64_t d_bptr) {
    int i;
    for (i = 0; i < MAX_REGIONS; i++) {
        if (regions[i].used && regions[i].pid == pid && regions[i].pid_ns == ns &&
            regions[i].dev == dev && regions[i].d_bptr == d_bptr) {
            return i;
        }
    }
    return -1;
}

static void
close_region(int i) {
    if (regions[i].vmm) {
        if (cuMemUnmap(regions[i].mapped, regions[i].b_len) == 0) {
            cuMemAddressFree(regions[i].mapped, regions[i].b_len);
        }
    } else {
        cuIpcCloseMemHandle(regions[i].mapped);
    }
    regions[i].used = 0;
}

static int
open_region(const struct fake_key *key, uint64_t *mapped) {
    uint64_t h;
    int st;
    if (!key->vmm) {
        return cuIpcOpenMemHandle_v2(mapped, key->handle, 1);
    }
    st = cuMemImportFromShareableHandle(&h, (void *)&key->handle, HANDLE_TYPE_FABRIC);
    if (st != 0) {
        return st;
    }
    st = cuMemAddressReserve(mapped, key->b_len, 0, 0, 0);
    if (st == 0) {
        st = cuMemMap(*mapped, key->b_len, 0, h, 0);
        if (st == 0) {
            st = cuMemSetAccess(*mapped, key->b_len, NULL, 1);
        } else {
            cuMemAddressFree(*mapped, key->b_len);
        }
    }
    cuMemRelease(h);
    return st;
}

int
uct_cuda_ipc_map_memhandle(struct fake_key *key, int dev, void **mapped_addr, int log_level) {
    uint64_t mapped;
    int i;
    (void)log_level;
    pthread_mutex_lock(&lock);
    i = find(key->pid, key->pid_ns, dev, key->d_bptr);
    if (i >= 0) {
        if (regions[i].buffer_id == key->buffer_id) {
            regions[i].refcount++;
            *mapped_addr = (void *)(uintptr_t)regions[i].mapped;
            pthread_mutex_unlock(&lock);
            return UCS_OK;
        }
        /* Same base, another allocation: the old one was freed. */
        close_region(i);
    }
    if (open_region(key, &mapped) != 0) {
        pthread_mutex_unlock(&lock);
        return UCS_ERR_INVALID_PARAM;
    }
    for (i = 0; i < MAX_REGIONS; i++) {
        if (!regions[i].used) {
            regions[i].used = 1;
            regions[i].pid = key->pid;
            regions[i].pid_ns = key->pid_ns;
            regions[i].dev = dev;
            regions[i].d_bptr = key->d_bptr;
            regions[i].b_len = key->b_len;
            regions[i].buffer_id = key->buffer_id;
            regions[i].vmm = key->vmm;
            regions[i].mapped = mapped;
            regions[i].refcount = 1;
            break;
        }
    }
    *mapped_addr = (void *)(uintptr_t)mapped;
    pthread_mutex_unlock(&lock);
    return UCS_OK;
}

void
uct_cuda_ipc_unmap_memhandle(int32_t pid, uint32_t pid_ns, uintptr_t d_bptr,
                             const void *mapped_addr, int dev, int enabled) {
    int i;
    (void)mapped_addr;
    pthread_mutex_lock(&lock);
    i = find(pid, pid_ns, dev, d_bptr);
    if (i >= 0) {
        regions[i].refcount--;
        if (regions[i].refcount == 0 && !enabled) {
            close_region(i);
        }
    }
    pthread_mutex_unlock(&lock);
}

/* The rkey handle: what the reachability check mapped. */
struct rkey_handle {
    uint64_t mapped;
};

static int
component_unpack(const void *buffer, uint64_t *rkey, void **handle) {
    struct fake_key *key = malloc(sizeof(*key));
    struct rkey_handle *h = calloc(1, sizeof(*h));
    void *mapped;
    memcpy(key, buffer, sizeof(*key));
    if (uct_cuda_ipc_map_memhandle(key, 0, &mapped, 0) == UCS_OK) {
        h->mapped = (uint64_t)(uintptr_t)mapped;
    }
    *rkey = (uint64_t)(uintptr_t)key;
    *handle = h;
    return UCS_OK;
}

static int
component_release(uint64_t rkey, void *handle) {
    struct fake_key *key = (struct fake_key *)(uintptr_t)rkey;
    struct rkey_handle *h = handle;
    if (h->mapped) {
        uct_cuda_ipc_unmap_memhandle(key->pid, key->pid_ns, key->d_bptr,
                                     (void *)(uintptr_t)h->mapped, 0, cache_enabled);
    }
    free(h);
    free(key);
    return UCS_OK;
}

__attribute__((constructor)) static void
registered(void) {
    fake_uct_register(component_unpack, component_release);
}

/* ---- what the tests call, as libucp and a transfer would --------------- */

/* An rkey unpack (as ucp_ep_rkey_unpack): the key, to pass to the others;
 * `bundle_out` (three words) is kept by the caller for the release. */
EXPORT uint64_t
fake_ucp_rkey_unpack(const struct fake_key *packed, struct bundle *bundle_out) {
    if (uct_rkey_unpack_v2(&component, packed, NULL, bundle_out) != UCS_OK) {
        return 0;
    }
    return bundle_out->rkey;
}

/* An rkey release (as ucp_rkey_destroy). */
EXPORT void
fake_ucp_rkey_destroy(const struct bundle *bundle) {
    uct_rkey_release(&component, bundle);
}

/* The start of a zero-copy read with `rkey` at `offset` of the remote
 * allocation: maps it (a hit, or a new mapping) and reads through it;
 * returns the mapped address (0 when the map failed) and sets `*cuda` to
 * the read's CUDA status. */
EXPORT uint64_t
fake_ucx_get_begin(uint64_t rkey, uint64_t offset, int *cuda) {
    struct fake_key *key = (struct fake_key *)(uintptr_t)rkey;
    void *mapped;
    if (uct_cuda_ipc_map_memhandle(key, 0, &mapped, 0) != UCS_OK) {
        *cuda = -1;
        return 0;
    }
    *cuda = fake_cuda_read((uint64_t)(uintptr_t)mapped + offset);
    return (uint64_t)(uintptr_t)mapped;
}

/* The end of that read: the completion's unmap. */
EXPORT void
fake_ucx_get_end(uint64_t rkey, uint64_t mapped) {
    struct fake_key *key = (struct fake_key *)(uintptr_t)rkey;
    uct_cuda_ipc_unmap_memhandle(key->pid, key->pid_ns, key->d_bptr, (void *)(uintptr_t)mapped,
                                 0, cache_enabled);
}

/* UCX_CUDA_IPC_CACHE. */
EXPORT void
fake_ucx_set_cache(int on) {
    cache_enabled = on;
}

/* Regions cached now. */
EXPORT int
fake_ucx_cached(void) {
    int i, n = 0;
    pthread_mutex_lock(&lock);
    for (i = 0; i < MAX_REGIONS; i++) {
        n += regions[i].used;
    }
    pthread_mutex_unlock(&lock);
    return n;
}

/* The library's clean-up at exit: every cached region is closed. */
EXPORT void
fake_ucx_exit(void) {
    int i;
    pthread_mutex_lock(&lock);
    for (i = 0; i < MAX_REGIONS; i++) {
        if (regions[i].used) {
            close_region(i);
        }
    }
    pthread_mutex_unlock(&lock);
}
