//! Names that come from peers, checked once and printed safely.
//!
//! Engine ids, agent names and addresses arrive from prefills (handshake
//! replies), from the membership plane (etcd values) and from routers. They
//! end up in log lines, events, metric labels and the `decode` binary's
//! greppable stdout. A newline in an engine id would forge a log line; an
//! escape sequence would rewrite a terminal; a megabyte would flood one
//! line. So every such name is bounded and printable where it enters
//! ([`check_name`]), and everything printed from a peer goes through
//! [`Escaped`] (the name types' `Display` does this itself).

use std::fmt;

/// The longest engine id accepted from any source, in bytes.
pub const MAX_ENGINE_ID: usize = 256;
/// The longest agent name accepted from any source, in bytes.
pub const MAX_AGENT_NAME: usize = 256;
/// The longest side-channel address (`host:port`) accepted, in bytes: a
/// DNS name is at most 253 bytes, plus `:` and a port.
pub const MAX_ADDRESS: usize = 262;
/// The most ranks (NIXL agents) one engine may have.
pub const MAX_RANKS: u16 = 64;
/// Characters of a peer's text printed before it is cut (with a note of
/// how much was left out).
pub const PRINT_LIMIT: usize = 128;

/// A name that breaks the rules of [`check_name`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// Empty.
    #[error("{what} is empty; expected 1 to {max} bytes of printable text")]
    Empty {
        /// What the name is (`engine id`, `agent name`, ...).
        what: &'static str,
        /// The longest accepted.
        max: usize,
    },
    /// Longer than accepted.
    #[error("{what} is {len} bytes long; expected at most {max}")]
    TooLong {
        /// What the name is.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The longest accepted.
        max: usize,
    },
    /// Holds a control character (newline, NUL, ESC, ...).
    #[error("{what} {shown} holds a control character (U+{code:04X}) at byte {at}; expected printable text")]
    Control {
        /// What the name is.
        what: &'static str,
        /// The name, escaped and cut for printing.
        shown: String,
        /// The character's code point.
        code: u32,
        /// Its byte offset.
        at: usize,
    },
}

/// Checks a name from a peer: 1 to `max` bytes, no control characters.
/// `what` names it in the error (`"engine id"`, `"agent name"`).
pub fn check_name(what: &'static str, name: &str, max: usize) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty { what, max });
    }
    if name.len() > max {
        return Err(NameError::TooLong {
            what,
            len: name.len(),
            max,
        });
    }
    if let Some((at, c)) = name.char_indices().find(|(_, c)| c.is_control()) {
        return Err(NameError::Control {
            what,
            shown: Escaped(name).to_string(),
            code: c as u32,
            at,
        });
    }
    Ok(())
}

/// Prints a peer's text safely: control characters escaped (`\n`,
/// `\u{1b}`), and cut after [`PRINT_LIMIT`] characters with a note of how
/// many bytes were left out. Printable text prints as it is.
#[derive(Clone, Copy)]
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_escaped(f, self.0)
    }
}

impl fmt::Debug for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"")?;
        write_escaped(f, self.0)?;
        f.write_str("\"")
    }
}

fn write_escaped(f: &mut impl fmt::Write, s: &str) -> fmt::Result {
    for (n, (at, c)) in s.char_indices().enumerate() {
        if n == PRINT_LIMIT {
            return write!(f, "...(+{} bytes)", s.len() - at);
        }
        write_char_escaped(f, c)?;
    }
    Ok(())
}

/// Escapes control characters only, and cuts nothing: the `Display` of
/// the name types (whose length is bounded where they enter).
pub(crate) fn write_escaped_uncut(f: &mut impl fmt::Write, s: &str) -> fmt::Result {
    if !s.chars().any(char::is_control) {
        return f.write_str(s);
    }
    s.chars().try_for_each(|c| {
        if c.is_control() {
            c.escape_default().try_for_each(|e| f.write_char(e))
        } else {
            f.write_char(c)
        }
    })
}

fn write_char_escaped(f: &mut impl fmt::Write, c: char) -> fmt::Result {
    if c.is_control() || c == '"' || c == '\\' {
        c.escape_default().try_for_each(|e| f.write_char(e))
    } else {
        f.write_char(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newline_cannot_forge_a_line_and_a_megabyte_is_cut() {
        assert_eq!(
            Escaped("p\nevent: released engine=q").to_string(),
            "p\\nevent: released engine=q"
        );
        assert_eq!(Escaped("a\u{1b}[2Jb\0").to_string(), "a\\u{1b}[2Jb\\u{0}");
        let big = "x".repeat(1 << 20);
        let shown = Escaped(&big).to_string();
        assert!(shown.len() < 200, "{}", shown.len());
        assert!(shown.ends_with(&format!("...(+{} bytes)", (1 << 20) - PRINT_LIMIT)));
        assert_eq!(Escaped("plain-id_1.2:3").to_string(), "plain-id_1.2:3");
    }

    #[test]
    fn names_are_bounded_and_printable() {
        assert!(check_name("engine id", "8c1e-uuid", MAX_ENGINE_ID).is_ok());
        assert_eq!(
            check_name("engine id", "", MAX_ENGINE_ID),
            Err(NameError::Empty {
                what: "engine id",
                max: MAX_ENGINE_ID
            })
        );
        assert!(matches!(
            check_name("engine id", &"e".repeat(257), MAX_ENGINE_ID),
            Err(NameError::TooLong { len: 257, .. })
        ));
        let e = check_name("agent name", "a\nb", MAX_AGENT_NAME).unwrap_err();
        assert!(matches!(
            e,
            NameError::Control {
                code: 10,
                at: 1,
                ..
            }
        ));
        assert!(e.to_string().contains("a\\nb"), "{e}");
    }
}
