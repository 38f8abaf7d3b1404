//! The one place a NIXL status is judged, whatever call returned it.

use nixl_agent::NixlStatus;

/// What a status means for the engine it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Success (or still in progress): nothing to do.
    Fine,
    /// REMOTE_DISCONNECT: UCX has failed the endpoint. Deterministic: the
    /// engine is marked unreachable and its reads in flight are failed.
    Disconnect,
    /// NOT_FOUND: NIXL holds no metadata for the agent any more (it was
    /// invalidated, or dropped by NIXL after a REMOTE_DISCONNECT, or
    /// loaded over and invalidated by someone else). For a live engine it
    /// is never transient: nothing to it can succeed until it is released
    /// and loaded again (NIXL logs "remote agent ... was invalidated or
    /// re-registered").
    MetadataGone,
    /// Any other error: counted and logged, never a release.
    Transient,
}

/// Judges `status`.
pub(crate) fn classify(status: NixlStatus) -> Verdict {
    if status.is_remote_disconnect() {
        Verdict::Disconnect
    } else if status == NixlStatus::ERR_NOT_FOUND {
        Verdict::MetadataGone
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
    fn only_remote_disconnect_is_a_disconnect_and_not_found_means_the_metadata_is_gone() {
        for raw in -20..=2 {
            let status = NixlStatus::from_raw(raw);
            let verdict = classify(status);
            if raw == NixlStatus::ERR_REMOTE_DISCONNECT.raw() {
                assert_eq!(verdict, Verdict::Disconnect);
            } else if raw == NixlStatus::ERR_NOT_FOUND.raw() {
                assert_eq!(verdict, Verdict::MetadataGone);
            } else if status.is_ok() {
                assert_eq!(verdict, Verdict::Fine, "{status}");
            } else {
                assert_eq!(verdict, Verdict::Transient, "{status}");
            }
        }
    }
}
