//! Lease request ids: what [`crate::KeepaliveHandle::add_leases`] accepts.
//!
//! A request id travels in vLLM's `HB:` notification, where ids are
//! separated by `,`: an id holding a comma would reach the prefill as two
//! ids (renewing one that is not ours, and not renewing this one). It ends
//! up in logs and the snapshot too. So an id is bounded, printable and
//! comma-free, checked where it enters; a refused id is never sent.

use crate::text::{check_name, Escaped, NameError};

/// The `HB:` text the service sends (split so no message passes
/// [`MAX_HEARTBEAT_BYTES`]): for a prefill written against this crate, and
/// for tests that check what goes on the wire.
pub use crate::core::{heartbeat_messages, MAX_HEARTBEAT_BYTES};

/// The longest request id accepted, in bytes. vLLM's ids (`cmpl-<uuid>-0`
/// and the like) are under 100.
pub const MAX_REQUEST_ID: usize = 256;

/// A request id that was refused, with what is accepted. Nothing was
/// added: [`crate::KeepaliveHandle::add_leases`] takes all of its ids or
/// none.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestIdError {
    /// Empty, too long, or holds a control character.
    #[error("lease request id refused: {0}")]
    Name(#[from] NameError),
    /// Holds `,`, the separator of `HB:`'s ids.
    #[error("lease request id {shown} refused: it holds `,` at byte {at}, the separator of HB: ids (it would renew two other ids); expected 1 to {max} bytes of printable text without `,`", max = MAX_REQUEST_ID)]
    Separator {
        /// The id, escaped and cut for printing.
        shown: String,
        /// The comma's byte offset.
        at: usize,
    },
}

/// Why [`crate::KeepaliveHandle::add_leases`] added nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// One of the ids is not a request id the `HB:` text can carry.
    #[error(transparent)]
    RequestId(#[from] RequestIdError),
    /// The service is no longer running: nothing would renew them.
    #[error(transparent)]
    Stopped(#[from] crate::ServiceStopped),
}

/// Checks one request id: 1 to [`MAX_REQUEST_ID`] bytes of printable text
/// without `,`.
pub fn check_request_id(id: &str) -> Result<(), RequestIdError> {
    check_name("lease request id", id, MAX_REQUEST_ID)?;
    if let Some(at) = id.find(',') {
        return Err(RequestIdError::Separator {
            shown: Escaped(id).to_string(),
            at,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_bounded_printable_and_comma_free() {
        assert!(check_request_id("cmpl-8c1e6a52-0").is_ok());
        assert!(check_request_id(&"r".repeat(MAX_REQUEST_ID)).is_ok());
        let e = check_request_id("a,b").unwrap_err();
        assert_eq!(
            e,
            RequestIdError::Separator {
                shown: "a,b".into(),
                at: 1
            }
        );
        assert!(e.to_string().contains("without `,`"), "{e}");
        assert!(matches!(
            check_request_id(&"r".repeat(MAX_REQUEST_ID + 1)),
            Err(RequestIdError::Name(NameError::TooLong { .. }))
        ));
        assert!(matches!(
            check_request_id(""),
            Err(RequestIdError::Name(NameError::Empty { .. }))
        ));
        let e = check_request_id("a\nHB:b").unwrap_err();
        assert!(e.to_string().contains("a\\nHB:b"), "{e}");
    }
}
