/*
 * A fake CUDA driver for the GPU-mapping tests (built by build.rs as
 * `libcuda.so.1`): no GPU, no CUDA. It models what the ledger's tests
 * need of the real driver, as documented in cuda.h and measured in
 * docs/gpu-check.md:
 * - exporters' allocations, alive while their exporter lives or while any
 *   importer mapping of them exists (a mapping alone keeps the memory);
 * - legacy IPC: cuIpcOpenMemHandle_v2 maps an allocation once per process
 *   and counts further opens of the same handle (same address);
 *   cuIpcCloseMemHandle drops one open;
 * - VMM: cuMemImportFromShareableHandle (fabric: the 64 handle bytes),
 *   cuMemAddressReserve, cuMemMap, cuMemSetAccess, cuMemRelease,
 *   cuMemUnmap, cuMemAddressFree;
 * - cuMemGetAddressRange_v2 of a mapped address;
 * - reads through a mapping (fake_cuda_read): an address not mapped fails
 *   with CUDA_ERROR_ILLEGAL_ADDRESS and the context is lost for good, as a
 *   kernel or copy fault is on a real GPU;
 * - addresses come back to be reused, lowest first, so that a stale close
 *   of a reused address is seen.
 * Every other symbol libuct_cuda imports is here too, answering
 * CUDA_ERROR_NO_DEVICE, so that the real libuct_cuda loads against it.
 * Failures of the open and close calls can be injected.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_ALREADY_MAPPED 208
#define CUDA_ERROR_ILLEGAL_ADDRESS 700
#define MAX_ALLOCS 4096
#define MAX_MAPS 4096
#define MAX_HANDLES 4096
#define VA_BASE 0x7f0000000000ull
#define VA_ALIGN (2ull << 20)

typedef struct {
    char reserved[64];
} ipc_handle;

struct alloc {
    int used;
    uint64_t id;
    uint64_t size;
    int exporter_alive;
    uint32_t refs; /* mappings and imported handles */
};

struct mapping {
    int used;
    uint64_t addr;
    uint64_t size;
    uint32_t alloc;
    uint32_t opens; /* legacy opens */
    int vmm;
};

struct va {
    int used;
    uint64_t addr;
    uint64_t size;
};

/* Counts the tests read (mirrored in the tests). */
struct fake_cuda_stats {
    uint64_t opens;       /* successful legacy opens and VMM maps */
    uint64_t closes;      /* successful legacy closes and VMM unmaps */
    uint64_t bad_closes;  /* closes of an address that was not mapped */
    uint64_t live_maps;   /* mappings now */
    uint64_t allocated;   /* bytes of allocations not freed */
    uint64_t context_lost; /* 1 once a read faulted */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct alloc allocs[MAX_ALLOCS];
static struct mapping maps[MAX_MAPS];
static struct va vas[MAX_MAPS];
static uint32_t handles[MAX_HANDLES]; /* imported generic handle -> alloc index + 1 */
static uint64_t next_id = 1;
static struct fake_cuda_stats stats;
static int fail_open, fail_open_times, fail_close, fail_close_times;

static void
handle_of(uint64_t id, ipc_handle *h) {
    memset(h, 0, sizeof(*h));
    memcpy(h->reserved, "FAKECUDA", 8);
    memcpy(h->reserved + 8, &id, sizeof(id));
}

static int
alloc_of(const void *handle_bytes) {
    uint64_t id;
    int i;
    if (memcmp(handle_bytes, "FAKECUDA", 8) != 0) {
        return -1;
    }
    memcpy(&id, (const char *)handle_bytes + 8, sizeof(id));
    for (i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].used && allocs[i].id == id) {
            return i;
        }
    }
    return -1;
}

static void
maybe_free(int a) {
    if (!allocs[a].exporter_alive && allocs[a].refs == 0) {
        stats.allocated -= allocs[a].size;
        allocs[a].used = 0;
    }
}

static uint64_t next_va = VA_BASE;

static uint64_t
va_take(uint64_t size) {
    int i, spare = -1;
    size = (size + VA_ALIGN - 1) & ~(VA_ALIGN - 1);
    /* A freed range that fits first, lowest address first: freed
     * addresses come back, as a driver's do. */
    for (i = 0; i < MAX_MAPS; i++) {
        if (!vas[i].used && vas[i].addr != 0 && vas[i].size >= size &&
            (spare < 0 || vas[i].addr < vas[spare].addr)) {
            spare = i;
        }
    }
    if (spare >= 0) {
        vas[spare].used = 1;
        return vas[spare].addr;
    }
    for (i = 0; i < MAX_MAPS; i++) {
        if (!vas[i].used && vas[i].addr == 0) {
            vas[i].used = 1;
            vas[i].addr = next_va;
            vas[i].size = size;
            next_va += size;
            return vas[i].addr;
        }
    }
    return 0;
}

static void
va_give(uint64_t addr) {
    int i;
    for (i = 0; i < MAX_MAPS; i++) {
        if (vas[i].used && vas[i].addr == addr) {
            vas[i].used = 0;
        }
    }
}

static int
map_at(uint64_t addr) {
    int i;
    for (i = 0; i < MAX_MAPS; i++) {
        if (maps[i].used && maps[i].addr == addr) {
            return i;
        }
    }
    return -1;
}

static int
new_map(uint64_t addr, uint64_t size, int a, int vmm) {
    int i;
    for (i = 0; i < MAX_MAPS; i++) {
        if (!maps[i].used) {
            maps[i].used = 1;
            maps[i].addr = addr;
            maps[i].size = size;
            maps[i].alloc = (uint32_t)a;
            maps[i].opens = 1;
            maps[i].vmm = vmm;
            allocs[a].refs++;
            stats.live_maps++;
            stats.opens++;
            return i;
        }
    }
    return -1;
}

static void
drop_map(int m) {
    int a = (int)maps[m].alloc;
    maps[m].used = 0;
    stats.live_maps--;
    allocs[a].refs--;
    maybe_free(a);
}

static int
injected(int *which, int *times) {
    if (*times > 0) {
        (*times)--;
        return *which;
    }
    return 0;
}

/* ---- the test's side ---------------------------------------------------- */

/* A new exporter allocation of `size` bytes; its IPC (or fabric) handle. */
EXPORT void
fake_cuda_export(uint64_t size, void *handle_out) {
    int i;
    pthread_mutex_lock(&lock);
    for (i = 0; i < MAX_ALLOCS; i++) {
        if (!allocs[i].used) {
            allocs[i].used = 1;
            allocs[i].id = next_id++;
            allocs[i].size = size;
            allocs[i].exporter_alive = 1;
            allocs[i].refs = 0;
            stats.allocated += size;
            handle_of(allocs[i].id, handle_out);
            break;
        }
    }
    pthread_mutex_unlock(&lock);
}

/* The exporter exits (or frees the allocation): the memory stays while a
 * mapping of it exists. */
EXPORT void
fake_cuda_exporter_exit(const void *handle) {
    int a;
    pthread_mutex_lock(&lock);
    a = alloc_of(handle);
    if (a >= 0) {
        allocs[a].exporter_alive = 0;
        maybe_free(a);
    }
    pthread_mutex_unlock(&lock);
}

/* A read through this process's mapping at `addr`. */
EXPORT int
fake_cuda_read(uint64_t addr) {
    int i, st = CUDA_ERROR_ILLEGAL_ADDRESS;
    pthread_mutex_lock(&lock);
    if (stats.context_lost) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    for (i = 0; i < MAX_MAPS; i++) {
        if (maps[i].used && addr >= maps[i].addr && addr < maps[i].addr + maps[i].size) {
            st = CUDA_SUCCESS;
            break;
        }
    }
    if (st != CUDA_SUCCESS) {
        stats.context_lost = 1;
    }
    pthread_mutex_unlock(&lock);
    return st;
}

/* A new context: the tests' control case loses the old one on purpose. */
EXPORT void
fake_cuda_reset_context(void) {
    pthread_mutex_lock(&lock);
    stats.context_lost = 0;
    pthread_mutex_unlock(&lock);
}

EXPORT void
fake_cuda_stats(struct fake_cuda_stats *out) {
    pthread_mutex_lock(&lock);
    *out = stats;
    pthread_mutex_unlock(&lock);
}

/* The next `times` opens (`close` 0) or closes (`close` 1) fail with `code`. */
EXPORT void
fake_cuda_fail_next(int close, int code, int times) {
    pthread_mutex_lock(&lock);
    if (close) {
        fail_close = code;
        fail_close_times = times;
    } else {
        fail_open = code;
        fail_open_times = times;
    }
    pthread_mutex_unlock(&lock);
}

/* ---- the driver API ------------------------------------------------------ */

EXPORT int
cuIpcOpenMemHandle_v2(uint64_t *dptr, ipc_handle handle, unsigned int flags) {
    int a, i, err;
    (void)flags;
    pthread_mutex_lock(&lock);
    if ((err = injected(&fail_open, &fail_open_times)) != 0) {
        pthread_mutex_unlock(&lock);
        return err;
    }
    a = alloc_of(handle.reserved);
    if (a < 0) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (i = 0; i < MAX_MAPS; i++) {
        if (maps[i].used && !maps[i].vmm && (int)maps[i].alloc == a) {
            maps[i].opens++;
            stats.opens++;
            *dptr = maps[i].addr;
            pthread_mutex_unlock(&lock);
            return CUDA_SUCCESS;
        }
    }
    *dptr = va_take(allocs[a].size);
    new_map(*dptr, allocs[a].size, a, 0);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* The start of a close of `addr` (a legacy one, or a VMM unmap with
 * `vmm`), with the lock held: its mapping, or -1 with the status in
 * `*err` (an injected failure, or a close of what is not mapped so). */
static int
closing(uint64_t addr, int vmm, int *err) {
    int m;
    *err = injected(&fail_close, &fail_close_times);
    if (*err) {
        return -1;
    }
    m = map_at(addr);
    if (m < 0 || maps[m].vmm != vmm) {
        stats.bad_closes++;
        *err = CUDA_ERROR_INVALID_VALUE;
        return -1;
    }
    stats.closes++;
    return m;
}

EXPORT int
cuIpcCloseMemHandle(uint64_t dptr) {
    int m, err;
    pthread_mutex_lock(&lock);
    m = closing(dptr, 0, &err);
    if (m >= 0 && --maps[m].opens == 0) {
        va_give(dptr);
        drop_map(m);
    }
    pthread_mutex_unlock(&lock);
    return m < 0 ? err : CUDA_SUCCESS;
}

EXPORT int
cuMemGetAddressRange_v2(uint64_t *base, size_t *size, uint64_t dptr) {
    int i;
    pthread_mutex_lock(&lock);
    for (i = 0; i < MAX_MAPS; i++) {
        if (maps[i].used && dptr >= maps[i].addr && dptr < maps[i].addr + maps[i].size) {
            if (base) {
                *base = maps[i].addr;
            }
            if (size) {
                *size = maps[i].size;
            }
            pthread_mutex_unlock(&lock);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT int
cuMemImportFromShareableHandle(uint64_t *handle, void *os_handle, int type) {
    int a, i;
    (void)type;
    pthread_mutex_lock(&lock);
    a = alloc_of(os_handle);
    if (a < 0) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (i = 0; i < MAX_HANDLES; i++) {
        if (handles[i] == 0) {
            handles[i] = (uint32_t)a + 1;
            allocs[a].refs++;
            *handle = (uint64_t)i + 1;
            pthread_mutex_unlock(&lock);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT int
cuMemRelease(uint64_t handle) {
    int a;
    pthread_mutex_lock(&lock);
    if (handle == 0 || handle > MAX_HANDLES || handles[handle - 1] == 0) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    a = (int)handles[handle - 1] - 1;
    handles[handle - 1] = 0;
    allocs[a].refs--;
    maybe_free(a);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT int
cuMemAddressReserve(uint64_t *ptr, size_t size, size_t align, uint64_t addr, uint64_t flags) {
    (void)align;
    (void)addr;
    (void)flags;
    pthread_mutex_lock(&lock);
    *ptr = va_take(size);
    pthread_mutex_unlock(&lock);
    return *ptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT int
cuMemAddressFree(uint64_t ptr, size_t size) {
    (void)size;
    pthread_mutex_lock(&lock);
    va_give(ptr);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT int
cuMemMap(uint64_t ptr, size_t size, size_t offset, uint64_t handle, uint64_t flags) {
    int err;
    (void)offset;
    (void)flags;
    pthread_mutex_lock(&lock);
    if ((err = injected(&fail_open, &fail_open_times)) != 0) {
        pthread_mutex_unlock(&lock);
        return err;
    }
    if (handle == 0 || handle > MAX_HANDLES || handles[handle - 1] == 0) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    new_map(ptr, size, (int)handles[handle - 1] - 1, 1);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT int
cuMemSetAccess(uint64_t ptr, size_t size, const void *desc, size_t count) {
    (void)ptr;
    (void)size;
    (void)desc;
    (void)count;
    return CUDA_SUCCESS;
}

EXPORT int
cuMemUnmap(uint64_t ptr, size_t size) {
    int m, err;
    (void)size;
    pthread_mutex_lock(&lock);
    m = closing(ptr, 1, &err);
    if (m >= 0) {
        drop_map(m);
    }
    pthread_mutex_unlock(&lock);
    return m < 0 ? err : CUDA_SUCCESS;
}

/* Every other entry point libuct_cuda imports: no device here. */
#define NO_DEVICE(name)                                                                  \
    EXPORT int name(void) {                                                              \
        return CUDA_ERROR_NO_DEVICE;                                                     \
    }
NO_DEVICE(cuCtxGetCurrent)
NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuCtxGetFlags)
NO_DEVICE(cuCtxGetId)
NO_DEVICE(cuCtxPopCurrent_v2)
NO_DEVICE(cuCtxPushCurrent_v2)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuDeviceGetName)
NO_DEVICE(cuDeviceGetUuid)
NO_DEVICE(cuDevicePrimaryCtxGetState)
NO_DEVICE(cuDevicePrimaryCtxRelease_v2)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuDeviceTotalMem_v2)
NO_DEVICE(cuEventCreate)
NO_DEVICE(cuEventDestroy_v2)
NO_DEVICE(cuEventQuery)
NO_DEVICE(cuEventRecord)
NO_DEVICE(cuGetErrorString)
NO_DEVICE(cuGetProcAddress_v2)
NO_DEVICE(cuInit)
NO_DEVICE(cuIpcGetMemHandle)
NO_DEVICE(cuMemAllocManaged)
NO_DEVICE(cuMemAlloc_v2)
NO_DEVICE(cuMemCreate)
NO_DEVICE(cuMemExportToShareableHandle)
NO_DEVICE(cuMemFree_v2)
NO_DEVICE(cuMemGetAllocationGranularity)
NO_DEVICE(cuMemGetAllocationPropertiesFromHandle)
NO_DEVICE(cuMemHostRegister_v2)
NO_DEVICE(cuMemHostUnregister)
NO_DEVICE(cuMemPoolDestroy)
NO_DEVICE(cuMemPoolExportPointer)
NO_DEVICE(cuMemPoolExportToShareableHandle)
NO_DEVICE(cuMemPoolImportFromShareableHandle)
NO_DEVICE(cuMemPoolImportPointer)
NO_DEVICE(cuMemPoolSetAccess)
NO_DEVICE(cuMemRangeGetAttribute)
NO_DEVICE(cuMemRetainAllocationHandle)
NO_DEVICE(cuMemcpyAsync)
NO_DEVICE(cuMemcpyDtoDAsync_v2)
NO_DEVICE(cuMemcpyHtoD_v2)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuPointerGetAttributes)
NO_DEVICE(cuPointerSetAttribute)
NO_DEVICE(cuStreamAddCallback)
NO_DEVICE(cuStreamCreate)
NO_DEVICE(cuStreamDestroy_v2)
NO_DEVICE(cuStreamSynchronize)
