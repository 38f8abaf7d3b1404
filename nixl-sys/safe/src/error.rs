//! Typed errors. Every status from NIXL becomes a [`NixlError`] in one
//! place ([`check`]); the raw code is never lost.

use std::fmt;

use nixl_sys::{NixlStatus, StatusSource};

/// A NIXL call that did not succeed.
///
/// `status` holds the C++ `nixl_status_t` numbering whatever API the call
/// went through (see [`StatusSource`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NixlError {
    /// The NIXL operation, e.g. `"genNotif"`.
    pub operation: &'static str,
    /// The status NIXL returned.
    pub status: NixlStatus,
    /// Where the status came from.
    pub source: StatusSource,
    /// Extra context (e.g. the remote agent), if any.
    pub detail: Option<String>,
    /// Why this crate refused the call itself (`source` is then
    /// [`StatusSource::Crate`]), when it was for a reason callers may want
    /// to tell apart.
    pub refusal: Option<Refusal>,
}

/// A call this crate refused before it reached NIXL (or whose result it
/// refused to hand on).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// An agent name that cannot cross into NIXL intact. NIXL's C API
    /// passes agent names as NUL-terminated strings, so a name with a NUL
    /// byte would be cut there: `victim-rank0\0zz` would address the live
    /// agent `victim-rank0`, and a release of it would invalidate the
    /// victim's metadata. A name that is not UTF-8 cannot be named back
    /// exactly from Rust either.
    AgentName {
        /// The name's bytes, as given or as NIXL returned them.
        name: Vec<u8>,
        /// What is wrong with it.
        problem: AgentNameProblem,
    },
}

/// What makes an agent name unusable with NIXL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentNameProblem {
    /// A NUL byte at this offset: NIXL's C strings end there.
    Nul {
        /// Offset of the first NUL byte.
        at: usize,
    },
    /// Not UTF-8.
    NotUtf8,
}

/// Checks that `name` can be handed to NIXL and named back exactly: UTF-8
/// without a NUL byte. Every place an agent name crosses into or out of
/// NIXL in this crate goes through it.
pub fn check_agent_name(name: &[u8]) -> Result<&str, AgentNameProblem> {
    if let Some(at) = name.iter().position(|&b| b == 0) {
        return Err(AgentNameProblem::Nul { at });
    }
    std::str::from_utf8(name).map_err(|_| AgentNameProblem::NotUtf8)
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::AgentName { name, problem } => {
                let shown = name.escape_ascii();
                match problem {
                    AgentNameProblem::Nul { at } => write!(
                        f,
                        "agent name \"{shown}\" has a NUL byte at offset {at}: NIXL would cut \
                         it to \"{}\", another agent's name",
                        name[..*at].escape_ascii()
                    ),
                    AgentNameProblem::NotUtf8 => {
                        write!(f, "agent name \"{shown}\" is not UTF-8")
                    }
                }
            }
        }
    }
}

impl NixlError {
    /// The raw status code (C++ numbering).
    pub fn raw_code(&self) -> i32 {
        self.status.raw()
    }

    /// The peer's endpoint has failed (`NIXL_ERR_REMOTE_DISCONNECT`).
    pub fn is_remote_disconnect(&self) -> bool {
        self.status.is_remote_disconnect()
    }

    /// NIXL does not know the agent or handle (`NIXL_ERR_NOT_FOUND`); for
    /// releases this means "already released".
    pub fn is_not_found(&self) -> bool {
        self.status == NixlStatus::ERR_NOT_FOUND
    }

    /// This crate refused an agent name NIXL would cut or that cannot be
    /// named back exactly (see [`Refusal::AgentName`]).
    pub fn is_refused_agent_name(&self) -> bool {
        matches!(self.refusal, Some(Refusal::AgentName { .. }))
    }

    /// The error for an agent name refused in `operation`.
    pub(crate) fn agent_name(
        operation: &'static str,
        name: &[u8],
        problem: AgentNameProblem,
    ) -> NixlError {
        let refusal = Refusal::AgentName {
            name: name.to_vec(),
            problem,
        };
        NixlError {
            operation,
            status: NixlStatus::ERR_INVALID_PARAM,
            source: StatusSource::Crate,
            detail: Some(refusal.to_string()),
            refusal: Some(refusal),
        }
    }
}

impl fmt::Display for NixlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NIXL {} failed: {}", self.operation, self.status)?;
        if self.source == StatusSource::CapiCollapsed && self.status == NixlStatus::ERR_BACKEND {
            write!(
                f,
                " (from the 1.5.x C API, which collapses failures into BACKEND)"
            )?;
        }
        if let Some(d) = &self.detail {
            write!(f, ": {d}")?;
        }
        Ok(())
    }
}

impl std::error::Error for NixlError {}

/// The one place where statuses become errors: `SUCCESS` and `IN_PROG`
/// pass through, everything else is a [`NixlError`] that keeps the code.
pub(crate) fn check(
    operation: &'static str,
    status: NixlStatus,
    source: StatusSource,
) -> Result<NixlStatus, NixlError> {
    if status.is_ok() {
        Ok(status)
    } else {
        Err(NixlError {
            operation,
            status,
            source,
            detail: None,
            refusal: None,
        })
    }
}

/// Adds context to an error on its way out.
pub(crate) trait WithDetail<T> {
    fn detail(self, f: impl FnOnce() -> String) -> Result<T, NixlError>;
}

impl<T> WithDetail<T> for Result<T, NixlError> {
    fn detail(self, f: impl FnOnce() -> String) -> Result<T, NixlError> {
        self.map_err(|mut e| {
            // A refusal's detail already says what was refused.
            if e.refusal.is_none() {
                e.detail = Some(f());
            }
            e
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_names_that_nixl_would_cut_or_that_are_not_utf8_are_refused() {
        assert_eq!(check_agent_name(b"prefill-a-rank0"), Ok("prefill-a-rank0"));
        assert_eq!(check_agent_name(b""), Ok(""));
        assert_eq!(
            check_agent_name(b"victim-rank0\0zz"),
            Err(AgentNameProblem::Nul { at: 12 })
        );
        assert_eq!(
            check_agent_name(b"\0"),
            Err(AgentNameProblem::Nul { at: 0 })
        );
        assert_eq!(
            check_agent_name(b"tail\0"),
            Err(AgentNameProblem::Nul { at: 4 })
        );
        // The first NUL is the one NIXL cuts at.
        assert_eq!(
            check_agent_name(b"a\0b\0"),
            Err(AgentNameProblem::Nul { at: 1 })
        );
        assert_eq!(check_agent_name(b"caf\xe9"), Err(AgentNameProblem::NotUtf8));
        // A NUL is reported before bad UTF-8: it is the dangerous one.
        assert_eq!(
            check_agent_name(b"\xff\0"),
            Err(AgentNameProblem::Nul { at: 1 })
        );
    }

    #[test]
    fn a_refused_name_says_what_nixl_would_have_made_of_it() {
        let name = b"victim-rank0\0zz";
        let e = NixlError::agent_name("loadRemoteMD", name, AgentNameProblem::Nul { at: 12 });
        assert!(e.is_refused_agent_name());
        assert_eq!(e.source, StatusSource::Crate);
        assert_eq!(e.status, NixlStatus::ERR_INVALID_PARAM);
        let text = e.to_string();
        assert!(text.contains("loadRemoteMD"), "{text}");
        assert!(text.contains(r#""victim-rank0\x00zz""#), "{text}");
        assert!(text.contains(r#"cut it to "victim-rank0""#), "{text}");
        // Context added on the way out does not hide the refusal.
        let e: Result<(), NixlError> = Err(e);
        let e = e.detail(|| "agent victim-rank0".into()).unwrap_err();
        assert!(e.to_string().contains("NUL byte at offset 12"), "{e}");
        // Ordinary failures are not refusals.
        let plain = check("genNotif", NixlStatus::ERR_NOT_FOUND, StatusSource::Cpp).unwrap_err();
        assert!(!plain.is_refused_agent_name());
    }
}
