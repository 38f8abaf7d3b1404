/*
 * A fake libuct for the GPU-mapping tests: `uct_rkey_unpack_v2` and
 * `uct_rkey_release`, which libucp calls through its relocations, each
 * dispatched to the component that registered (fake_uct_cuda.c), as UCX's
 * libuct dispatches to a component's rkey_unpack and rkey_release.
 */
#include <stddef.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))

typedef int (*unpack_fn)(const void *buffer, uint64_t *rkey, void **handle);
typedef int (*release_fn)(uint64_t rkey, void *handle);

static unpack_fn component_unpack;
static release_fn component_release;

EXPORT void
fake_uct_register(unpack_fn unpack, release_fn release) {
    component_unpack = unpack;
    component_release = release;
}

/* uct_rkey_bundle_t: rkey, handle, type. */
struct bundle {
    uint64_t rkey;
    void *handle;
    void *type;
};

EXPORT int
uct_rkey_unpack_v2(void *component, const void *buffer, const void *params,
                   struct bundle *out) {
    (void)params;
    out->type = component;
    return component_unpack(buffer, &out->rkey, &out->handle);
}

EXPORT int
uct_rkey_release(void *component, const struct bundle *b) {
    (void)component;
    return component_release(b->rkey, b->handle);
}
