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

crate::status_table! { NixlStatus, "NIXL_", {
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
}}

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
            None => match self.0 {
                -1003 => "NIXL_CAPI_ERROR_INVALID_STATE",
                -1000 => "NIXL_EXCEPTION",
                _ => "NIXL_UNKNOWN_STATUS",
            },
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

    /// The C API said `NIXL_CAPI_ERROR_INVALID_STATE` (-3), which has no
    /// C++ `nixl_status_t` counterpart. Kept outside the C++ range.
    pub const CAPI_INVALID_STATE: NixlStatus = NixlStatus(-1003);

    /// A C++ exception escaped NIXL (the C API's
    /// `NIXL_CAPI_ERROR_EXCEPTION`, -4, or one caught by this crate's shim).
    /// No C++ `nixl_status_t` counterpart. Kept outside the C++ range.
    pub const EXCEPTION: NixlStatus = NixlStatus(-1000);

    /// Translates a status from the released (1.5.x) C API, which
    /// **collapses** statuses: `REMOTE_DISCONNECT`, `CANCELED`,
    /// `NOT_ALLOWED` and every other failure come back as
    /// `NIXL_CAPI_ERROR_BACKEND` (-2), so a result of [`Self::ERR_BACKEND`]
    /// from this function means "some failure", not "a backend failure".
    ///
    /// 1.5.x codes: SUCCESS=0, IN_PROG=1, INVALID_PARAM=-1, BACKEND=-2,
    /// INVALID_STATE=-3, EXCEPTION=-4, NO_TELEMETRY=-5, NOT_FOUND=-6.
    /// Unknown codes are kept, negated past -2000 (`-2000 + raw`), so they
    /// never alias a C++ code.
    pub const fn from_capi_collapsed(raw: i32) -> Self {
        match raw {
            0 => Self::SUCCESS,
            1 => Self::IN_PROG,
            -1 => Self::ERR_INVALID_PARAM,
            -2 => Self::ERR_BACKEND,
            -3 => Self::CAPI_INVALID_STATE,
            -4 => Self::EXCEPTION,
            -5 => Self::ERR_NO_TELEMETRY,
            -6 => Self::ERR_NOT_FOUND,
            other => NixlStatus(-2000 + other),
        }
    }

    /// Translates a status from the newer 1:1 C API (the one that exports
    /// `nixl_capi_get_version`). Its codes 0..-6 are those of the 1.5.x C
    /// API, then NOT_POSTED=-7, MISMATCH=-8, NOT_ALLOWED=-9,
    /// REPOST_ACTIVE=-10, UNKNOWN=-11, NOT_SUPPORTED=-12,
    /// REMOTE_DISCONNECT=-13, CANCELED=-14. Unknown codes as in
    /// [`Self::from_capi_collapsed`].
    pub const fn from_capi_v1(raw: i32) -> Self {
        match raw {
            -7 => Self::ERR_NOT_POSTED,
            -8 => Self::ERR_MISMATCH,
            -9 => Self::ERR_NOT_ALLOWED,
            -10 => Self::ERR_REPOST_ACTIVE,
            -11 => Self::ERR_UNKNOWN,
            -12 => Self::ERR_NOT_SUPPORTED,
            -13 => Self::ERR_REMOTE_DISCONNECT,
            -14 => Self::ERR_CANCELED,
            other => Self::from_capi_collapsed(other),
        }
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
        assert_eq!(
            NixlStatus::from_raw(-10).name(),
            "NIXL_ERR_REMOTE_DISCONNECT"
        );
        assert_eq!(NixlStatus::from_raw(1).name(), "NIXL_IN_PROG");
        assert_eq!(NixlStatus::from_raw(-99).name(), "NIXL_UNKNOWN_STATUS");
        assert_eq!(NixlStatus::from_raw(-99).raw(), -99);
        assert_eq!(NixlStatus::ALL.len(), 14);
    }

    #[test]
    fn collapsed_capi_codes_never_say_remote_disconnect() {
        assert_eq!(NixlStatus::from_capi_collapsed(-2), NixlStatus::ERR_BACKEND);
        assert_eq!(
            NixlStatus::from_capi_collapsed(-6),
            NixlStatus::ERR_NOT_FOUND
        );
        assert_eq!(
            NixlStatus::from_capi_collapsed(-1),
            NixlStatus::ERR_INVALID_PARAM
        );
        assert_eq!(NixlStatus::from_capi_collapsed(1), NixlStatus::IN_PROG);
        assert_eq!(NixlStatus::from_capi_collapsed(-4).name(), "NIXL_EXCEPTION");
        assert_eq!(
            NixlStatus::from_capi_collapsed(-3).name(),
            "NIXL_CAPI_ERROR_INVALID_STATE"
        );
        assert_eq!(NixlStatus::from_capi_collapsed(-13).raw(), -2013);
    }

    #[test]
    fn v1_capi_codes_map_one_to_one() {
        assert_eq!(
            NixlStatus::from_capi_v1(-13),
            NixlStatus::ERR_REMOTE_DISCONNECT
        );
        assert_eq!(NixlStatus::from_capi_v1(-14), NixlStatus::ERR_CANCELED);
        assert_eq!(NixlStatus::from_capi_v1(-9), NixlStatus::ERR_NOT_ALLOWED);
        assert_eq!(NixlStatus::from_capi_v1(-7), NixlStatus::ERR_NOT_POSTED);
        assert_eq!(NixlStatus::from_capi_v1(-6), NixlStatus::ERR_NOT_FOUND);
        assert_eq!(NixlStatus::from_capi_v1(0), NixlStatus::SUCCESS);
    }

    #[test]
    fn only_remote_disconnect_is_a_disconnect() {
        for s in NixlStatus::ALL {
            assert_eq!(s.is_remote_disconnect(), s.raw() == -10, "{s}");
        }
    }
}
