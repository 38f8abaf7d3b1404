//! How NIXL's UCX backend turns a UCX status into a NIXL status.

use nixl_status::NixlStatus;
use nixl_status::UcsStatus;

/// The NIXL status NIXL's UCX backend reports for a UCX status.
///
/// | UCX | NIXL |
/// |---|---|
/// | `UCS_OK` | `SUCCESS` |
/// | `UCS_INPROGRESS`, `UCS_ERR_BUSY` | `IN_PROG` |
/// | `UCS_ERR_NOT_CONNECTED`, `UCS_ERR_CONNECTION_RESET`, `UCS_ERR_ENDPOINT_TIMEOUT`, `UCS_ERR_CANCELED` | `ERR_REMOTE_DISCONNECT` |
/// | every other code | `ERR_BACKEND` |
///
/// `UCS_ERR_CANCELED` counts as a disconnect from NIXL 1.2 on. A
/// notification (`genNotif`) that ends `IN_PROG` is reported as `SUCCESS`
/// by NIXL; this function does not know the operation and keeps `IN_PROG`.
pub fn nixl_status_from_ucs(status: UcsStatus) -> NixlStatus {
    match status {
        UcsStatus::OK => NixlStatus::SUCCESS,
        UcsStatus::INPROGRESS | UcsStatus::ERR_BUSY => NixlStatus::IN_PROG,
        UcsStatus::ERR_NOT_CONNECTED
        | UcsStatus::ERR_CONNECTION_RESET
        | UcsStatus::ERR_ENDPOINT_TIMEOUT
        | UcsStatus::ERR_CANCELED => NixlStatus::ERR_REMOTE_DISCONNECT,
        _ => NixlStatus::ERR_BACKEND,
    }
}
