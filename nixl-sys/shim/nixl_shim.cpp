// nixl-sys C++ shim: reaches the few nixlAgent members whose status the
// NIXL 1.5.x C API collapses, and returns their raw nixl_status_t.
//
// This file declares its own minimal view of NIXL: opaque classes only, no
// NIXL header is included and nothing here links against libnixl. The Rust
// side resolves each member by its Itanium-mangled name in the dlopen'd
// libnixl.so and passes the address in. On x86-64 (Itanium C++ ABI) a
// non-virtual member function is an ordinary function whose first argument
// is `this`, so each member is called through a plain function pointer
// whose first parameter is the object pointer.
//
// Every entry point catches all C++ exceptions: nothing unwinds into Rust.

#include <dlfcn.h>
#include <link.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <vector>

// libnixl.so takes libstdc++'s std::string and std::vector: a shim built
// against another standard library (zig c++ and clang default to libc++)
// would hand it objects of another layout. The ABI macro alone proves
// nothing, since build.rs defines it on the command line.
#if !defined(__GLIBCXX__)
#error "nixl-sys shim must be built against libstdc++ (libnixl.so's std::string); with zig c++ or clang, point it at GCC's headers (scripts/build-wheel.sh does)"
#endif
#if !defined(_GLIBCXX_USE_CXX11_ABI) || !_GLIBCXX_USE_CXX11_ABI
#error "nixl-sys shim must be built with the cxx11 std::string ABI (as libnixl.so is)"
#endif

namespace {

// Opaque NIXL types. Only pointers and references to them cross this file.
class Agent;         // nixlAgent
class XferReqH;      // nixlXferReqH
class DlistH;        // nixlDlistH
class OptionalArgs;  // nixlAgentOptionalArgs
class XferDescList;  // nixlDescList<nixlBasicDesc> (nixl_xfer_dlist_t)

// nixl_status_t and nixl_xfer_op_t are plain int-sized enums.
using status_t = int;
using xfer_op_t = int;

// Returned when a C++ exception escaped a NIXL member. Outside the range
// of nixl_status_t; the Rust side knows this value.
constexpr status_t kException = -1000;

// nixlAgent::genNotif(const std::string&, const nixl_blob_t&, const nixl_opt_args_t*) const
using gen_notif_fn = status_t (*)(const Agent *, const std::string &, const std::string &,
                                  const OptionalArgs *);
// nixlAgent::postXferReq(nixlXferReqH*, const nixl_opt_args_t*) const
using post_xfer_fn = status_t (*)(const Agent *, XferReqH *, const OptionalArgs *);
// nixlAgent::getXferStatus(nixlXferReqH*) const
using xfer_status_fn = status_t (*)(const Agent *, XferReqH *);
// nixlAgent::releaseXferReq(nixlXferReqH*) const
using release_xfer_fn = status_t (*)(const Agent *, XferReqH *);
// nixlAgent::invalidateRemoteMD(const std::string&)
using invalidate_fn = status_t (*)(Agent *, const std::string &);
// nixlAgent::releasedDlistH(nixlDlistH*) const
using release_dlist_fn = status_t (*)(const Agent *, DlistH *);
// nixlAgent::getLocalMD(nixl_blob_t&) const
using get_local_md_fn = status_t (*)(const Agent *, std::string &);
// nixlAgent::loadRemoteMD(const nixl_blob_t&, std::string&)
using load_md_fn = status_t (*)(Agent *, const std::string &, std::string &);
// nixlAgent::prepXferDlist(const nixl_xfer_dlist_t&, nixlDlistH*&, const nixl_opt_args_t*) const
using prep_local_fn = status_t (*)(const Agent *, const XferDescList &, DlistH *&,
                                   const OptionalArgs *);
// nixlAgent::prepXferDlist(const std::string&, const nixl_xfer_dlist_t&, nixlDlistH*&,
//                          const nixl_opt_args_t*) const
using prep_remote_fn = status_t (*)(const Agent *, const std::string &, const XferDescList &,
                                    DlistH *&, const OptionalArgs *);
// nixlAgent::makeXferReq(const nixl_xfer_op_t&, const nixlDlistH*, const std::vector<int>&,
//                        const nixlDlistH*, const std::vector<int>&, nixlXferReqH*&,
//                        const nixl_opt_args_t*) const
using make_xfer_fn = status_t (*)(const Agent *, const xfer_op_t &, const DlistH *,
                                  const std::vector<int> &, const DlistH *,
                                  const std::vector<int> &, XferReqH *&, const OptionalArgs *);

// A member's address, resolved in libnixl.so, as the function pointer it
// is called through (a cast from `const void *` would cast away a
// qualifier, which clang refuses).
template <typename Fn>
Fn
member(const void *fn) noexcept {
    return reinterpret_cast<Fn>(const_cast<void *>(fn));
}

template <typename F>
status_t guarded(F &&f) noexcept {
    try {
        return f();
    }
    catch (...) {
        return kException;
    }
}

} // namespace

extern "C" {

int
nks_gen_notif(const void *fn, const void *agent, const char *remote, size_t remote_len,
              const char *msg, size_t msg_len, const void *opt_args) {
    return guarded([&] {
        const std::string r(remote, remote_len);
        const std::string m(msg, msg_len);
        return member<gen_notif_fn>(fn)(static_cast<const Agent *>(agent), r, m,
                                        static_cast<const OptionalArgs *>(opt_args));
    });
}

int
nks_post_xfer_req(const void *fn, const void *agent, void *req, const void *opt_args) {
    return guarded([&] {
        return member<post_xfer_fn>(fn)(static_cast<const Agent *>(agent),
                                        static_cast<XferReqH *>(req),
                                        static_cast<const OptionalArgs *>(opt_args));
    });
}

int
nks_get_xfer_status(const void *fn, const void *agent, void *req) {
    return guarded([&] {
        return member<xfer_status_fn>(fn)(static_cast<const Agent *>(agent),
                                          static_cast<XferReqH *>(req));
    });
}

int
nks_release_xfer_req(const void *fn, const void *agent, void *req) {
    return guarded([&] {
        return member<release_xfer_fn>(fn)(static_cast<const Agent *>(agent),
                                           static_cast<XferReqH *>(req));
    });
}

int
nks_invalidate_remote_md(const void *fn, void *agent, const char *remote, size_t remote_len) {
    return guarded([&] {
        const std::string r(remote, remote_len);
        return member<invalidate_fn>(fn)(static_cast<Agent *>(agent), r);
    });
}

int
nks_release_dlist_handle(const void *fn, const void *agent, void *dlist) {
    return guarded([&] {
        return member<release_dlist_fn>(fn)(static_cast<const Agent *>(agent),
                                            static_cast<DlistH *>(dlist));
    });
}

// On success *name_out is a malloc'd, NUL-terminated copy of the remote
// agent's name (free it with nks_free) and *name_len its length.
int
nks_load_remote_md(const void *fn, void *agent, const void *md, size_t md_len, char **name_out,
                   size_t *name_len) {
    *name_out = nullptr;
    *name_len = 0;
    return guarded([&] {
        const std::string blob(static_cast<const char *>(md), md_len);
        std::string name;
        status_t st = member<load_md_fn>(fn)(static_cast<Agent *>(agent), blob, name);
        if (st == 0) {
            char *copy = static_cast<char *>(std::malloc(name.size() + 1));
            if (!copy) throw std::bad_alloc();
            std::memcpy(copy, name.data(), name.size());
            copy[name.size()] = '\0';
            *name_out = copy;
            *name_len = name.size();
        }
        return st;
    });
}

// The agent's own metadata through the C++ member: compared with the C
// API's answer for the same handle, it proves that the handle's first
// member is the nixlAgent the shim takes it for.
int
nks_get_local_md(const void *fn, const void *agent, char **out, size_t *len) {
    *out = nullptr;
    *len = 0;
    return guarded([&] {
        std::string md;
        status_t st = member<get_local_md_fn>(fn)(static_cast<const Agent *>(agent), md);
        if (st == 0) {
            char *copy = static_cast<char *>(std::malloc(md.size() + 1));
            if (!copy) throw std::bad_alloc();
            std::memcpy(copy, md.data(), md.size());
            *out = copy;
            *len = md.size();
        }
        return st;
    });
}

// `descs` is the nixl_xfer_dlist_t* held by a C API xfer dlist.
int
nks_prep_local_dlist(const void *fn, const void *agent, const void *descs, void **dlist_out,
                     const void *opt_args) {
    *dlist_out = nullptr;
    return guarded([&] {
        DlistH *h = nullptr;
        status_t st = member<prep_local_fn>(fn)(
            static_cast<const Agent *>(agent), *static_cast<const XferDescList *>(descs), h,
            static_cast<const OptionalArgs *>(opt_args));
        *dlist_out = h;
        return st;
    });
}

int
nks_prep_remote_dlist(const void *fn, const void *agent, const char *remote, size_t remote_len,
                      const void *descs, void **dlist_out, const void *opt_args) {
    *dlist_out = nullptr;
    return guarded([&] {
        const std::string r(remote, remote_len);
        DlistH *h = nullptr;
        status_t st = member<prep_remote_fn>(fn)(
            static_cast<const Agent *>(agent), r, *static_cast<const XferDescList *>(descs), h,
            static_cast<const OptionalArgs *>(opt_args));
        *dlist_out = h;
        return st;
    });
}

int
nks_make_xfer_req(const void *fn, const void *agent, int op, const void *local,
                  const int *local_idx, size_t local_count, const void *remote,
                  const int *remote_idx, size_t remote_count, void **req_out,
                  const void *opt_args) {
    *req_out = nullptr;
    return guarded([&] {
        const std::vector<int> li(local_idx, local_idx + local_count);
        const std::vector<int> ri(remote_idx, remote_idx + remote_count);
        const xfer_op_t o = op;
        XferReqH *req = nullptr;
        status_t st = member<make_xfer_fn>(fn)(
            static_cast<const Agent *>(agent), o, static_cast<const DlistH *>(local), li,
            static_cast<const DlistH *>(remote), ri, req,
            static_cast<const OptionalArgs *>(opt_args));
        *req_out = req;
        return st;
    });
}

void
nks_free(void *p) {
    std::free(p);
}

// --- UCX's own introspection (UCS VFS), in process -----------------------
//
// UCX registers every context, worker and endpoint in an in-process tree
// (UCS VFS, on by default: UCX_VFS_ENABLE=y), the same tree its `ucx_vfs`
// daemon serves: /ucp/context/<name>/worker/<name>/ep/<address>/...,
// /ucp/context/<name>/worker/<name>/counters/ep_creations, ... libucs
// exports the walkers. They are reached in the libucs already loaded in
// the process (the one NIXL's UCX plugin uses), found by name, never
// loaded here.
//
// ucs_string_buffer_t is a ucs_array of char: { char *buffer; size_t
// length; size_t capacity; }, 24 bytes; 64 bytes are reserved for it.

} // extern "C"

// C++ linkage: the helpers return a struct, which C linkage cannot.
namespace {

using vfs_list_cb = void (*)(const char *name, void *arg);
using vfs_list_fn = int (*)(const char *path, vfs_list_cb cb, void *arg);
using vfs_read_fn = int (*)(const char *path, void *strb);
using strb_init_fn = void (*)(void *strb);
using strb_cstr_fn = const char *(*)(const void *strb);
using strb_cleanup_fn = void (*)(void *strb);

struct Vfs {
    vfs_list_fn list = nullptr;
    vfs_read_fn read = nullptr;
    strb_init_fn init = nullptr;
    strb_cstr_fn cstr = nullptr;
    strb_cleanup_fn cleanup = nullptr;
};

// Finds the first loaded libucs by its file name. Only reads the loader's
// list: nothing is opened while dl_iterate_phdr holds its lock (a dlopen
// from inside the callback deadlocks wherever dlopen itself walks the list,
// as heap profilers that wrap dlopen do).
int
find_libucs(struct dl_phdr_info *info, size_t, void *arg) {
    if (info->dlpi_name == nullptr) return 0;
    const char *slash = std::strrchr(info->dlpi_name, '/');
    const char *base = slash ? slash + 1 : info->dlpi_name;
    if (std::strncmp(base, "libucs", 6) != 0) return 0;
    *static_cast<std::string *>(arg) = info->dlpi_name;
    return 1;
}

Vfs
load_vfs() {
    std::string path;
    dl_iterate_phdr(find_libucs, &path);
    Vfs found;
    if (path.empty()) return found;
    void *h = dlopen(path.c_str(), RTLD_NOLOAD | RTLD_LAZY);
    if (h == nullptr) return found;
    found.list = reinterpret_cast<vfs_list_fn>(dlsym(h, "ucs_vfs_path_list_dir"));
    found.read = reinterpret_cast<vfs_read_fn>(dlsym(h, "ucs_vfs_path_read_file"));
    found.init = reinterpret_cast<strb_init_fn>(dlsym(h, "ucs_string_buffer_init"));
    found.cstr = reinterpret_cast<strb_cstr_fn>(dlsym(h, "ucs_string_buffer_cstr"));
    found.cleanup = reinterpret_cast<strb_cleanup_fn>(dlsym(h, "ucs_string_buffer_cleanup"));
    // libucs stays loaded: NIXL's plugin depends on it and is never unloaded.
    dlclose(h);
    if (!(found.list && found.read && found.init && found.cstr && found.cleanup)) {
        return Vfs{};
    }
    return found;
}

// The walkers, found once libucs is in the process (looked for again until
// then).
Vfs
vfs() {
    static std::mutex lock;
    static Vfs cached;
    std::lock_guard<std::mutex> guard(lock);
    if (cached.list == nullptr) cached = load_vfs();
    return cached;
}

} // namespace

extern "C" {

// Calls `cb(name, arg)` for each child of the VFS directory `path`.
// Returns 0 (UCS_OK) or UCX's status; -12 (UCS_ERR_NO_ELEM) when no libucs
// with VFS is loaded.
int
nks_ucx_vfs_list(const char *path, void (*cb)(const char *, void *), void *arg) {
    try {
        Vfs v = vfs();
        if (v.list == nullptr) return -12;
        return v.list(path, cb, arg);
    }
    catch (...) {
        return kException;
    }
}

// Reads the VFS file `path` and hands its text to `cb(text, arg)`.
int
nks_ucx_vfs_read(const char *path, void (*cb)(const char *, void *), void *arg) {
    try {
        Vfs v = vfs();
        if (v.read == nullptr) return -12;
        alignas(16) unsigned char strb[64] = {};
        v.init(strb);
        int st = v.read(path, strb);
        if (st == 0) cb(v.cstr(strb), arg);
        v.cleanup(strb);
        return st;
    }
    catch (...) {
        return kException;
    }
}

} // extern "C"
