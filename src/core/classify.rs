//! The one place a NIXL status is judged, whatever call returned it.

use crate::NixlStatus;

/// What a status means for the engine it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Success (or still in progress): nothing to do.
    Fine,
    /// REMOTE_DISCONNECT: UCX has failed the endpoint. Deterministic: the
    /// engine is marked unreachable and its reads in flight are failed.
    Disconnect,
    /// Any other error: counted and logged, never a release. NOT_FOUND is
    /// one (NIXL may drop a dead agent's metadata by itself after a
    /// transfer's REMOTE_DISCONNECT, which has marked the engine already).
    Transient,
}

/// Judges `status`.
pub(crate) fn classify(status: NixlStatus) -> Verdict {
    if status.is_remote_disconnect() {
        Verdict::Disconnect
    } else if status.is_ok() {
        Verdict::Fine
    } else {
        Verdict::Transient
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_remote_disconnect_is_a_disconnect() {
        for raw in -20..=2 {
            let status = NixlStatus::from_raw(raw);
            let verdict = classify(status);
            if raw == NixlStatus::ERR_REMOTE_DISCONNECT.raw() {
                assert_eq!(verdict, Verdict::Disconnect);
            } else if status.is_ok() {
                assert_eq!(verdict, Verdict::Fine, "{status}");
            } else {
                assert_eq!(verdict, Verdict::Transient, "{status}");
            }
        }
    }
}
