/*
 * nixl-sys endpoint-close interposer: makes NIXL 1.5.1's UCX plugin close a
 * released peer's UCP endpoints for real.
 *
 * Why. NIXL's UCX plugin (1.5.1) disconnects a remote agent with
 * `ucp_ep_close_nbx(ep, {.flags = 0})`, UCX's flush mode, unless UCX has
 * already failed the endpoint. In flush mode UCX keeps an endpoint whose
 * peer is connected (`UCP_EP_FLAG_REMOTE_CONNECTED`) "until the worker is
 * destroyed, to enable remote endpoints keep sending" (ucp_ep.c,
 * `ucp_ep_disconnected`). A decode agent lives as long as the process, so
 * every release of a live prefill left its endpoint, its TCP socket and
 * its shared-memory mappings behind. `UCP_EP_CLOSE_FLAG_FORCE` destroys the
 * endpoint at once (upstream NIXL added the same as the opt-in backend
 * parameter `ucx_ep_close_force`, after 1.5.1).
 *
 * How. This object is loaded with RTLD_GLOBAL before libnixl, so the UCX
 * plugin (loaded later by NIXL with RTLD_LOCAL, without RTLD_DEEPBIND)
 * binds its `ucp_ep_close_nbx` here. Every call is forwarded to the
 * `ucp_ep_close_nbx` of the UCX the *caller* depends on; only inside a
 * scope opened by nixl-sys around its own `invalidateRemoteMD` call, on the
 * same thread, is a flush-mode close turned into a forced one. Nothing
 * else in the process is changed.
 *
 * The two UCX constants used are declared here from UCX's public API
 * (ucp.h): UCP_OP_ATTR_FIELD_FLAGS = bit 4, UCP_EP_CLOSE_FLAG_FORCE = bit 0,
 * and the first two members of ucp_request_param_t (uint32_t op_attr_mask;
 * uint32_t flags). No UCX or NIXL header is included.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "interpose.h"

#define NKS_OP_ATTR_FIELD_FLAGS (1u << 4)
#define NKS_EP_CLOSE_FLAG_FORCE (1u << 0)
#define NKS_UCS_ERR_INVALID_PARAM (-5)
#define NKS_UCS_ERR_NO_ELEM (-12)
#define NKS_UCS_ERR_LAST (-100)

typedef void *(*close_fn)(void *ep, const void *param);

/* The prefix of ucp_request_param_t that this file reads. */
struct param_prefix {
    uint32_t op_attr_mask;
    uint32_t flags;
};

/* What the closes inside one scope did (mirrored in Rust, runtime.rs). */
struct nks_ep_closes {
    uint32_t forced;         /* flush-mode closes turned into forced ones */
    uint32_t already_forced; /* closes the caller forced itself (failed endpoints) */
    uint32_t left_open;      /* closes left in flush mode (not forceable) */
    uint32_t unresolved;     /* calls that found no UCX to forward to */
};

static __thread int scope_depth;
static __thread struct nks_ep_closes scope_counts;

/* The real function per calling object: one UCX in practice; a few slots
 * in case two UCX builds are loaded side by side. */
static struct nks_resolved slots[NKS_SLOTS];
static pthread_mutex_t slots_lock = PTHREAD_MUTEX_INITIALIZER;

void *ucp_ep_close_nbx(void *ep, const void *param) NKS_EXPORT;

struct definer_query {
    const char *symbol;
    const void *self;
    void *fn;
};

static int
definer_cb(struct dl_phdr_info *info, size_t size, void *arg) {
    struct definer_query *q = arg;
    Dl_info where;
    void *h, *fn;
    (void)size;
    if (info->dlpi_name == NULL || info->dlpi_name[0] == '\0') {
        return 0;
    }
    h = dlopen(info->dlpi_name, RTLD_NOLOAD | RTLD_LAZY);
    if (h == NULL) {
        return 0;
    }
    fn = dlsym(h, q->symbol);
    dlclose(h);
    if (fn != NULL && fn != q->self && dladdr(fn, &where) &&
        where.dli_fbase == (void *)info->dlpi_addr) {
        q->fn = fn;
        return 1;
    }
    return 0;
}

/* The first loaded object (other than `self`'s) that defines `symbol`. */
static void *
defined_anywhere(const char *symbol, const void *self) {
    struct definer_query q = {symbol, self, NULL};
    dl_iterate_phdr(definer_cb, &q);
    return q.fn;
}

void *
nks_resolve(struct nks_resolved *table, pthread_mutex_t *lock, void *caller_addr,
            const char *symbol, const void *self) {
    Dl_info info;
    void *base = NULL;
    void *fn = NULL;
    int i;

    if (dladdr(caller_addr, &info) && info.dli_fbase != NULL) {
        base = info.dli_fbase;
    }
    pthread_mutex_lock(lock);
    for (i = 0; i < NKS_SLOTS; i++) {
        if (table[i].fn != NULL && table[i].caller_base == base) {
            fn = table[i].fn;
            break;
        }
    }
    pthread_mutex_unlock(lock);
    if (fn != NULL) {
        return fn;
    }
    /* Look the symbol up in the caller's own dependency tree: dlsym on an
     * object's handle searches that object and its dependencies, never the
     * global scope this file sits in. */
    if (base != NULL && info.dli_fname != NULL && info.dli_fname[0] != '\0') {
        void *h = dlopen(info.dli_fname, RTLD_NOLOAD | RTLD_LAZY);
        if (h != NULL) {
            fn = dlsym(h, symbol);
            dlclose(h);
        }
    }
    if (fn == NULL || fn == self) {
        fn = dlsym(RTLD_NEXT, symbol);
    }
    if (fn == NULL || fn == self) {
        /* The caller's own tree has none: a tail call made the return
         * address another object's (a caller of the caller), or the
         * definition sits in a local scope. The one loaded object that
         * defines the symbol itself. */
        fn = defined_anywhere(symbol, self);
    }
    if (fn == NULL || fn == self) {
        return NULL;
    }
    pthread_mutex_lock(lock);
    for (i = 0; i < NKS_SLOTS; i++) {
        if (table[i].fn == NULL) {
            table[i].caller_base = base;
            table[i].fn = fn;
            break;
        }
    }
    pthread_mutex_unlock(lock);
    return fn;
}

static close_fn
resolve(void *caller_addr) {
    return (close_fn)nks_resolve(slots, &slots_lock, caller_addr, "ucp_ep_close_nbx",
                                 (const void *)ucp_ep_close_nbx);
}

static int
is_err(void *p) {
    return (uintptr_t)p >= (uintptr_t)(intptr_t)NKS_UCS_ERR_LAST;
}

void *
ucp_ep_close_nbx(void *ep, const void *param) {
    close_fn real = resolve(__builtin_return_address(0));
    const struct param_prefix *in = param;
    /* Large and zeroed: UCX reads only the members op_attr_mask names. */
    uint64_t forced_param[32];
    struct param_prefix *out = (struct param_prefix *)forced_param;
    void *ret;

    if (real == NULL) {
        if (scope_depth > 0) {
            scope_counts.unresolved++;
        }
        return (void *)(intptr_t)NKS_UCS_ERR_NO_ELEM;
    }
    if (scope_depth == 0 || in == NULL) {
        return real(ep, param);
    }
    if ((in->op_attr_mask & NKS_OP_ATTR_FIELD_FLAGS) &&
        (in->flags & NKS_EP_CLOSE_FLAG_FORCE)) {
        scope_counts.already_forced++;
        return real(ep, param);
    }
    /* Only a parameter that carries nothing but flags is rebuilt: its size
     * differs between UCX versions, so other members are never copied. */
    if ((in->op_attr_mask & ~NKS_OP_ATTR_FIELD_FLAGS) != 0) {
        scope_counts.left_open++;
        return real(ep, param);
    }
    memset(forced_param, 0, sizeof(forced_param));
    out->op_attr_mask = NKS_OP_ATTR_FIELD_FLAGS;
    out->flags = ((in->op_attr_mask & NKS_OP_ATTR_FIELD_FLAGS) ? in->flags : 0) |
        NKS_EP_CLOSE_FLAG_FORCE;
    ret = real(ep, forced_param);
    if (is_err(ret) && (intptr_t)ret == NKS_UCS_ERR_INVALID_PARAM) {
        /* UCX refuses a forced close of an endpoint without peer error
         * handling, before touching it: close it the caller's way. */
        scope_counts.left_open++;
        return real(ep, param);
    }
    scope_counts.forced++;
    return ret;
}

/* Opens a scope on this thread: flush-mode closes become forced ones. */
NKS_EXPORT void
nks_ep_close_scope_begin(void) {
    if (scope_depth++ == 0) {
        memset(&scope_counts, 0, sizeof(scope_counts));
    }
}

/* Closes the scope and reports what its closes did. */
NKS_EXPORT void
nks_ep_close_scope_end(struct nks_ep_closes *out) {
    if (scope_depth > 0) {
        scope_depth--;
    }
    if (out != NULL) {
        *out = scope_counts;
    }
}

/* --- Is the UCX plugin bound to this file's ucp_ep_close_nbx? ---------- */

struct bound_query {
    const char *suffix;
    const char *symbol;
    const void *target;
    int found;
    int bound;
    int prefix; /* `suffix` is a prefix of the base name (hashed UCX names) */
};

static const char *
base_name(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

static uintptr_t
dyn_ptr(const struct dl_phdr_info *info, uintptr_t p) {
    /* ld.so relocates some dynamic entries in place; others stay offsets. */
    return p < (uintptr_t)info->dlpi_addr ? p + (uintptr_t)info->dlpi_addr : p;
}

static int
in_object(const struct dl_phdr_info *info, const void *p) {
    int i;
    for (i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t lo = (uintptr_t)info->dlpi_addr + ph->p_vaddr;
        if (ph->p_type == PT_LOAD && (uintptr_t)p >= lo && (uintptr_t)p < lo + ph->p_memsz) {
            return 1;
        }
    }
    return 0;
}

static int
scan_relocs(const struct dl_phdr_info *info, const ElfW(Rela) * rela, size_t size,
            const ElfW(Sym) * symtab, const char *strtab, const struct bound_query *q) {
    size_t n = size / sizeof(ElfW(Rela));
    size_t i;
    for (i = 0; i < n; i++) {
        size_t sym = ELF64_R_SYM(rela[i].r_info);
        if (sym == 0) {
            continue;
        }
        if (strcmp(strtab + symtab[sym].st_name, q->symbol) == 0) {
            void **slot = (void **)(info->dlpi_addr + rela[i].r_offset);
            if (*slot == q->target) {
                return 1;
            }
            /* Lazy binding not done yet: the slot still points into the
             * object's own PLT. */
            return in_object(info, *slot) ? 2 : 0;
        }
    }
    return -1;
}

static int
bound_cb(struct dl_phdr_info *info, size_t size, void *arg) {
    struct bound_query *q = arg;
    const ElfW(Dyn) *dyn = NULL;
    const ElfW(Rela) *rela = NULL, *jmprel = NULL;
    size_t relasz = 0, pltrelsz = 0;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    int i, r;
    (void)size;

    if (info->dlpi_name == NULL ||
        (q->prefix ? strncmp(base_name(info->dlpi_name), q->suffix, strlen(q->suffix))
                   : strcmp(base_name(info->dlpi_name), q->suffix)) != 0) {
        return 0;
    }
    q->found = 1;
    for (i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) {
            dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
        }
    }
    if (dyn == NULL) {
        return 1;
    }
    for (; dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_RELA:
            rela = (const ElfW(Rela) *)dyn_ptr(info, dyn->d_un.d_ptr);
            break;
        case DT_RELASZ:
            relasz = dyn->d_un.d_val;
            break;
        case DT_JMPREL:
            jmprel = (const ElfW(Rela) *)dyn_ptr(info, dyn->d_un.d_ptr);
            break;
        case DT_PLTRELSZ:
            pltrelsz = dyn->d_un.d_val;
            break;
        case DT_SYMTAB:
            symtab = (const ElfW(Sym) *)dyn_ptr(info, dyn->d_un.d_ptr);
            break;
        case DT_STRTAB:
            strtab = (const char *)dyn_ptr(info, dyn->d_un.d_ptr);
            break;
        }
    }
    if (symtab == NULL || strtab == NULL) {
        return 1;
    }
    r = jmprel ? scan_relocs(info, jmprel, pltrelsz, symtab, strtab, q) : -1;
    if (r < 0 && rela) {
        r = scan_relocs(info, rela, relasz, symtab, strtab, q);
    }
    q->bound = r;
    return 1;
}

/*
 * Whether the loaded object whose base name is `name` (or starts with it,
 * with `prefix`) calls `target` for `symbol`: 1 bound; 2 not resolved yet
 * (lazy binding), and the first definition in the global scope, where a
 * lazy lookup from an object loaded without RTLD_DEEPBIND starts, is
 * `target`; 0 bound elsewhere; -1 it does not import the symbol; -2 no
 * such object is loaded.
 */
int
nks_reloc_bound(const char *name, int prefix, const char *symbol, const void *target) {
    struct bound_query q = {name, symbol, target, 0, -1, prefix};
    dl_iterate_phdr(bound_cb, &q);
    if (!q.found) {
        return -2;
    }
    if (q.bound == 2) {
        return dlsym(RTLD_DEFAULT, symbol) == target ? 2 : 0;
    }
    return q.bound;
}

/*
 * Whether the loaded object named `file_name` (its base name, e.g.
 * "libplugin_UCX.so") calls this file's ucp_ep_close_nbx: 1 bound, 0 bound
 * elsewhere (loaded before this file, or with RTLD_DEEPBIND), -1 it does
 * not import the symbol, -2 no such object is loaded.
 */
NKS_EXPORT int
nks_ep_close_bound(const char *file_name) {
    int r = nks_reloc_bound(file_name, 0, "ucp_ep_close_nbx", (const void *)ucp_ep_close_nbx);
    return r == 2 ? 1 : r;
}

/* The same for ep_watch.c's ucp_ep_create. */
int ucp_ep_create(void *worker, const void *params, void **ep_p);

NKS_EXPORT int
nks_ep_create_bound(const char *file_name) {
    int r = nks_reloc_bound(file_name, 0, "ucp_ep_create", (const void *)ucp_ep_create);
    return r == 2 ? 1 : r;
}
