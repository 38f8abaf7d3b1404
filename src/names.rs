//! The names a peer is known by: its engine id, its agents' names, its
//! side-channel address (compared in one canonical form). Plain values:
//! the core keys its tables by them, so nothing here does I/O (resolving
//! an address is [`PeerAddr::resolve`], in `transport/resolve.rs`). Kept
//! out of `transport/` so that what the core imports names no transport
//! (`tests/layout.rs` walks it); `transport` re-exports them.

use std::fmt;
use std::sync::Arc;

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident) => {
        name_type!($(#[$doc])* $name, |name: Arc<str>| name);
    };
    ($(#[$doc:meta])* $name:ident, $normalize:expr) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            /// Wraps a name.
            pub fn new(name: impl Into<Arc<str>>) -> Self {
                Self(($normalize)(name.into()))
            }

            /// The name as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        /// Printable text as it is; control characters escaped (`\n`,
        /// `\u{1b}`), so a name from a peer can never forge a log line.
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                crate::text::write_escaped_uncut(f, &self.0)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self::new(s)
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                Self::new(s)
            }
        }
    };
}

name_type! {
    /// A peer engine's id (a prefill's in pull mode, a decode's in push
    /// mode): a fresh UUID per start unless the operator
    /// pins it. The peer table is keyed by it.
    EngineId
}

name_type! {
    /// A NIXL agent name: unique per engine and rank. Notifications and
    /// remote metadata are addressed by it.
    AgentName
}

name_type! {
    /// A peer engine's side-channel address (a prefill's in pull mode, a
    /// decode's in push mode), `host:port`, where it
    /// answers handshakes. A new engine id seen at a known address means the
    /// engine there was replaced.
    ///
    /// Addresses are compared as written once made canonical: an IP
    /// literal is written the one way the standard library writes it
    /// (`[0:0::1]:80` is `[::1]:80`), a host name in lower case. A name is
    /// not resolved here; [`PeerAddr::resolve`] resolves it to the one
    /// address it names, so that `localhost:5600` and `127.0.0.1:5600` are
    /// one peer, and refuses a host of numbers that is not a standard IPv4
    /// literal (`010.0.0.1:5600`, `127.000.0.1:5600`, `2130706433:5600`):
    /// the standard parser refuses it and the C resolver would read it
    /// another way (`010` as octal 8), so it could name two hosts.
    PeerAddr,
    canonical_address
}

/// The canonical form of a `host:port` (see [`PeerAddr`]); anything else
/// is kept as written.
fn canonical_address(raw: Arc<str>) -> Arc<str> {
    let canonical = if let Ok(socket) = raw.parse::<std::net::SocketAddr>() {
        socket.to_string()
    } else if let Some((host, port)) = raw.rsplit_once(':') {
        match port.parse::<u16>() {
            Ok(port) => format!("{}:{port}", host.to_ascii_lowercase()),
            Err(_) => return raw,
        }
    } else {
        return raw;
    };
    if *canonical == *raw {
        raw
    } else {
        canonical.into()
    }
}

/// A `host:port` that could not be made one address.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResolveError {
    /// Not `host:port` with a port number.
    #[error("{0:?} is not host:port (a host name or IP address, a colon, a port 0-65535)")]
    Form(String),
    /// The host is made of numbers but is not a standard IPv4 literal
    /// (leading zeros, hex, fewer than four parts): a C resolver would read
    /// it as another address than it seems to say.
    #[error("{0:?} is refused: its host is numbers but not a standard IPv4 address (four decimal parts 0-255 without leading zeros), and a C resolver would read it another way (010 as octal 8); write it as, e.g., 10.0.0.1:5600")]
    NumericHost(String),
    /// The name did not resolve.
    #[error("{address} does not resolve: {source}")]
    Lookup {
        /// The address as given.
        address: String,
        /// What the resolver said.
        source: std::io::Error,
    },
    /// The name resolves to several addresses: which one the prefill
    /// listens on is not known here, so it is refused rather than guessed.
    #[error("{address} is ambiguous: it resolves to {} addresses ({}); name one of them", .resolved.len(), .resolved.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", "))]
    Ambiguous {
        /// The address as given.
        address: String,
        /// Every address it resolves to.
        resolved: Vec<std::net::SocketAddr>,
    },
}
