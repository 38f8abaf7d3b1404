//! NIXL's and UCX's raw status tables, as plain values.
//!
//! A status is what the keepalive's rules judge (a heartbeat's
//! `REMOTE_DISCONNECT` marks a peer), so the tables live here, in a crate
//! with no dependency and no build script, rather than in the bindings
//! that produce them: `nixl-sys` compiles a C++ shim, and the sans-IO core
//! of `nixl-keepalive` must build, test and fuzz without it. `nixl-sys`
//! (and through it `nixl-agent`) re-exports [`NixlStatus`], `ucx-sys`
//! re-exports [`UcsStatus`]: one table of each in the workspace.

#![forbid(unsafe_code)]
#![deny(missing_docs, unreachable_pub)]

mod nixl;
mod ucs;

pub use nixl::NixlStatus;
pub use ucs::UcsStatus;

/// The status table of a raw status newtype over an integer: a named
/// constant per code, `ALL`, and `known_name`. Both tables here have the
/// same shape, so it is written once.
#[doc(hidden)]
#[macro_export]
macro_rules! status_table {
    ($ty:ident, $prefix:literal, { $($name:ident = $code:expr),* $(,)? }) => {
        impl $ty {
            $(
                #[doc = concat!("`", $prefix, stringify!($name), "` (", stringify!($code), ").")]
                pub const $name: $ty = $ty($code);
            )*

            /// Every named status, in table order.
            pub const ALL: &'static [$ty] = &[$($ty::$name),*];

            /// The status's own name, with its prefix (`UCS_`, `NIXL_`), or
            /// `None` for a code without a name of its own.
            pub const fn known_name(self) -> Option<&'static str> {
                match self.0 {
                    $($code => Some(concat!($prefix, stringify!($name))),)*
                    _ => None,
                }
            }
        }
    };
}
