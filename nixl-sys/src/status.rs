//! `nixl_status_t`, kept raw.
//!
//! NIXL's C++ API returns a small signed enum. Its released C API (1.5.x)
//! folds most failures into one generic code, which loses the one signal a
//! keepalive service lives on: `REMOTE_DISCONNECT`. This type always holds
//! the C++ numbering, whatever API the value came through, so a status read
//! from the C++ shim, from the newer 1:1 C API, or made up by a fake
//! transport means the same thing everywhere.

use std::fmt;

/// A raw NIXL status in the C++ `nixl_status_t` numbering.
///
/// Unknown codes are kept as they came (never mapped to a catch-all), so a
/// newer runtime's status still reaches logs and metrics intact.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NixlStatus(i32);

macro_rules! statuses {
    ($($name:ident = $code:expr),* $(,)?) => {
        impl NixlStatus {
            $(
                #[doc = concat!("`NIXL_", stringify!($name), "` (", stringify!($code), ").")]
                pub const $name: NixlStatus = NixlStatus($code);
            )*

            /// Every status this crate knows, in table order.
            pub const ALL: &'static [NixlStatus] = &[$(NixlStatus::$name),*];

            /// The name NIXL gives this status, with its `NIXL_` prefix,
            /// or `None` for a code this table does not know.
            pub const fn known_name(self) -> Option<&'static str> {
                match self.0 {
                    $($code => Some(concat!("NIXL_", stringify!($name))),)*
                    _ => None,
                }
            }
        }
    };
}

statuses! {
    IN_PROG = 1,
    SUCCESS = 0,
    ERR_NOT_POSTED = -1,
    ERR_INVALID_PARAM = -2,
    ERR_BACKEND = -3,
    ERR_NOT_FOUND = -4,
    ERR_MISMATCH = -5,
    ERR_NOT_ALLOWED = -6,
    ERR_REPOST_ACTIVE = -7,
    ERR_UNKNOWN = -8,
    ERR_NOT_SUPPORTED = -9,
    ERR_REMOTE_DISCONNECT = -10,
    ERR_CANCELED = -11,
    ERR_NO_TELEMETRY = -12,
}

impl NixlStatus {
    /// Wraps a raw C++ `nixl_status_t` value.
    pub const fn from_raw(raw: i32) -> Self {
        NixlStatus(raw)
    }

    /// The raw C++ `nixl_status_t` value.
    pub const fn raw(self) -> i32 {
        self.0
    }

    /// The status name (`NIXL_ERR_REMOTE_DISCONNECT`), or
    /// `NIXL_UNKNOWN_STATUS` for a code this table does not know (the raw
    /// code is still available through [`NixlStatus::raw`]).
    pub const fn name(self) -> &'static str {
        match self.known_name() {
            Some(n) => n,
            None => "NIXL_UNKNOWN_STATUS",
        }
    }

    /// `SUCCESS` or `IN_PROG`: not an error.
    pub const fn is_ok(self) -> bool {
        self.0 >= 0
    }

    /// The peer is gone as far as UCX knows: the endpoint has failed.
    pub const fn is_remote_disconnect(self) -> bool {
        self.0 == Self::ERR_REMOTE_DISCONNECT.0
    }
}

impl fmt::Debug for NixlStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.name(), self.0)
    }
}

impl fmt::Display for NixlStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_cpp_table() {
        assert_eq!(NixlStatus::from_raw(-10).name(), "NIXL_ERR_REMOTE_DISCONNECT");
        assert_eq!(NixlStatus::from_raw(1).name(), "NIXL_IN_PROG");
        assert_eq!(NixlStatus::from_raw(-99).name(), "NIXL_UNKNOWN_STATUS");
        assert_eq!(NixlStatus::from_raw(-99).raw(), -99);
        assert_eq!(NixlStatus::ALL.len(), 14);
    }

    #[test]
    fn only_remote_disconnect_is_a_disconnect() {
        for s in NixlStatus::ALL {
            assert_eq!(s.is_remote_disconnect(), s.raw() == -10, "{s}");
        }
    }
}
