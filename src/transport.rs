//! The boundary between the service and NIXL.
//!
//! Everything the service asks of NIXL goes through [`Transport`]: send a
//! notification to an agent, and give back what was loaded and prepared for
//! an engine. Both calls are blocking FFI in the real transport, so the
//! service only ever calls them from blocking threads, one call per thread,
//! never from a tokio worker: a hung call to one engine holds one thread and
//! nothing else.

use std::fmt;
use std::sync::Arc;

use nixl_agent::NixlStatus;

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
    /// A prefill engine's id: a fresh UUID per start unless the operator
    /// pins it. The peer table is keyed by it.
    EngineId
}

name_type! {
    /// A NIXL agent name: unique per engine and rank. Notifications and
    /// remote metadata are addressed by it.
    AgentName
}

name_type! {
    /// A prefill engine's side-channel address, `host:port`, where it
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

/// Whether `host` is made of numbers only (decimal or `0x` hex parts
/// between dots) without being a standard dotted-quad IPv4 literal: the
/// forms `inet_aton` reads its own way (octal, hex, fewer parts).
fn is_nonstandard_numeric_host(host: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host);
    let numeric_part = |part: &str| {
        let part = part.to_ascii_lowercase();
        match part.strip_prefix("0x") {
            Some(hex) => hex.bytes().all(|b| b.is_ascii_hexdigit()),
            None => !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()),
        }
    };
    !host.is_empty()
        && host.split('.').all(numeric_part)
        && host.parse::<std::net::Ipv4Addr>().is_err()
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

impl PeerAddr {
    /// Resolves a `host:port` to the one socket address it names, in its
    /// canonical form: aliases of one prefill (`localhost:5600`,
    /// `127.0.0.1:5600`) become one address, so the service sees one
    /// peer. A name that resolves to several addresses is refused
    /// ([`ResolveError::Ambiguous`]), never guessed. IP literals are not
    /// looked up.
    ///
    /// A host made only of numbers (and dots, or `0x` parts) that is not a
    /// standard IPv4 literal is refused ([`ResolveError::NumericHost`]):
    /// the lookup would hand it to the C resolver, which reads `010` as
    /// octal and `2130706433` as one 32-bit number. The port is decimal
    /// digits only (`05600` is `5600`; a sign is refused).
    pub async fn resolve(address: &str) -> Result<PeerAddr, ResolveError> {
        let form = || ResolveError::Form(crate::text::Escaped(address).to_string());
        let (host, port) = address.rsplit_once(':').ok_or_else(form)?;
        if host.is_empty()
            || port.is_empty()
            || !port.bytes().all(|b| b.is_ascii_digit())
            || port.parse::<u16>().is_err()
        {
            return Err(form());
        }
        if is_nonstandard_numeric_host(host) {
            return Err(ResolveError::NumericHost(
                crate::text::Escaped(address).to_string(),
            ));
        }
        let port: u16 = port.parse().map_err(|_| form())?;
        let literal = PeerAddr::new(format!("{host}:{port}"));
        if literal.as_str().parse::<std::net::SocketAddr>().is_ok() {
            return Ok(literal);
        }
        let mut resolved: Vec<std::net::SocketAddr> = tokio::net::lookup_host(address)
            .await
            .map_err(|source| ResolveError::Lookup {
                address: address.to_string(),
                source,
            })?
            .collect();
        resolved.sort();
        resolved.dedup();
        match resolved.as_slice() {
            [one] => Ok(PeerAddr::new(one.to_string())),
            [] => Err(ResolveError::Lookup {
                address: address.to_string(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no address"),
            }),
            _ => Err(ResolveError::Ambiguous {
                address: address.to_string(),
                resolved,
            }),
        }
    }
}

/// A NIXL call that did not succeed, with the raw status it returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{operation} returned {status}")]
#[non_exhaustive]
pub struct TransportError {
    /// What was called (`genNotif`, `invalidateRemoteMD`, ...).
    pub operation: &'static str,
    /// The raw status NIXL returned, never collapsed.
    pub status: NixlStatus,
}

impl TransportError {
    /// An error from `operation` with `status`.
    pub fn new(operation: &'static str, status: NixlStatus) -> Self {
        Self { operation, status }
    }
}

/// What the service knows, when it releases an engine, of the transfers
/// that ran with it: whether the peer may still be sending to this
/// process. It decides whether the release may cut the engine's
/// connections ([`Transport::release_with`]).
///
/// A read given up at a frozen prefill is still on the prefill's side: when
/// the prefill resumes, its UCX sends the data. Measured with NIXL 1.5.1
/// over TCP: shutting the connection down under that send made UCX in the
/// prefill abort the whole process (`Fatal: unexpected error: Endpoint
/// timeout`, `cli/tests/real_buffer.rs`). A release must never harm a
/// live peer, so only an engine whose every transfer ended here with
/// `SUCCESS` has its connections cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transfers {
    /// Every transfer of the registration ended on this side with
    /// `SUCCESS` (or none ran): nothing of them is still on its way.
    Ended,
    /// A transfer was given up, or ended with an error status: the peer
    /// may still be sending for it.
    MayBeRunning,
}

impl Transfers {
    /// `ended` or `may_be_running`, for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Transfers::Ended => "ended",
            Transfers::MayBeRunning => "may_be_running",
        }
    }
}

/// One step of a release and what NIXL said to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReleaseStep {
    /// What was released.
    pub target: ReleaseTarget,
    /// The raw status of the call. `SUCCESS` and `NOT_FOUND` (NIXL had
    /// already dropped it) both count as released.
    pub status: NixlStatus,
}

impl ReleaseStep {
    /// UCX endpoints this step left open (see [`EndpointClose::LeftOpen`]):
    /// they keep their sockets and mappings until the decode's agent is
    /// destroyed. 0 for every other step.
    pub fn endpoints_left_open(&self) -> u32 {
        match &self.target {
            ReleaseTarget::Endpoints {
                close: EndpointClose::LeftOpen { left_open, .. },
                ..
            } => *left_open,
            _ => 0,
        }
    }
}

/// What one release step gave back.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReleaseTarget {
    /// A prepped descriptor-list handle (`releasedDlistH`), by its index in
    /// the engine's resources.
    DlistHandle(usize),
    /// An agent's loaded remote metadata (`invalidateRemoteMD`).
    RemoteMetadata(AgentName),
    /// The UCX endpoints to an agent, which its `invalidateRemoteMD`
    /// closes: reported right after that agent's
    /// [`ReleaseTarget::RemoteMetadata`] step when the invalidation
    /// succeeded, with the same status. What happened to them is in
    /// `close`; an endpoint left open is not a failed step (NIXL said
    /// SUCCESS) but is counted in
    /// `nixl_keepalive_release_endpoints_total{outcome="left_open"}`.
    Endpoints {
        /// The remote agent.
        agent: AgentName,
        /// What the invalidation did to its endpoints.
        close: EndpointClose,
    },
}

/// What an agent's invalidation did to its UCX endpoints (one per UCX
/// worker of the decode's agent).
///
/// Measured with NIXL 1.5.1 (loopback): NIXL closes a live peer's endpoint
/// in UCX's flush mode, which keeps it, its TCP socket and its
/// shared-memory mappings until the decode's agent is destroyed; only a
/// peer UCX had already failed (killed) was closed for real. `nixl-sys`
/// forces the close (see `nixl_agent::endpoints`), so both are
/// [`EndpointClose::Closed`]. The TCP connection UCX shares between both
/// directions then closes on the prefill's side, at its next UCX
/// keepalive round (`UCX_KEEPALIVE_INTERVAL` of the prefill, 20 s by
/// default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EndpointClose {
    /// Every endpoint closed at once: destroyed with its transports.
    Closed {
        /// How many.
        endpoints: u32,
    },
    /// Some endpoints were closed in UCX's flush mode and stay open, with
    /// their sockets and mappings, until the decode's agent is destroyed.
    LeftOpen {
        /// Endpoints closed for real.
        closed: u32,
        /// Endpoints left open.
        left_open: u32,
    },
    /// No endpoint was closed: NIXL held no connection to the agent any
    /// more, or a handle made from it (a transfer request, a dlist) still
    /// holds it and it closes when that goes.
    NoneClosed,
    /// The transport cannot see endpoint closes (the process runs NIXL's
    /// own close mode, or the transport does not observe them).
    NotObserved,
}

impl EndpointClose {
    /// A short name, used as the `outcome` metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            EndpointClose::Closed { .. } => "closed",
            EndpointClose::LeftOpen { .. } => "left_open",
            EndpointClose::NoneClosed => "none_closed",
            EndpointClose::NotObserved => "not_observed",
        }
    }
}

/// The service's view of NIXL.
///
/// Implementations must be callable from several threads at once (the real
/// one creates its agent with a thread-safe sync mode). Every method may
/// block; the service calls them only from blocking threads.
pub trait Transport: Send + Sync + 'static {
    /// What a decoder runtime handed over at registration and what must be
    /// freed at release: the prepped dlist handles of the engine's ranks and
    /// anything else the transport tracks per engine. Opaque to the service.
    type Resources: Send + 'static;

    /// Sends one notification (`genNotif`) to one remote agent.
    ///
    /// Fire-and-forget as in NIXL: `Ok` means it was queued, not delivered.
    /// `Err` carries the raw status; `REMOTE_DISCONNECT` means UCX has
    /// already failed the endpoint.
    fn notify(&self, agent: &AgentName, message: &[u8]) -> Result<(), TransportError>;

    /// Gives back everything held for one engine: releases each prepped
    /// dlist handle in `resources`, then invalidates the remote metadata of
    /// each agent in `agents`, closing its UCX endpoints. Every step is
    /// attempted even when an earlier one fails; the report lists each step
    /// with its raw status, and after each successful invalidation what
    /// became of the agent's endpoints ([`ReleaseTarget::Endpoints`]).
    fn release(
        &self,
        engine: &EngineId,
        agents: &[AgentName],
        resources: Self::Resources,
    ) -> Vec<ReleaseStep>;

    /// [`Transport::release`], told what the service knows of the engine's
    /// transfers: the service calls this one. With
    /// [`Transfers::Ended`] a transport may cut the engine's connections
    /// at once (the NIXL transport shuts down the TCP connections UCX
    /// keeps for a released peer until the peer's keepalive round); with
    /// [`Transfers::MayBeRunning`] it must leave them to UCX. The default
    /// ignores `transfers`.
    fn release_with(
        &self,
        engine: &EngineId,
        agents: &[AgentName],
        resources: Self::Resources,
        transfers: Transfers,
    ) -> Vec<ReleaseStep> {
        let _ = transfers;
        self.release(engine, agents, resources)
    }

    /// Whether [`Transport::release`] ends every transfer still running to
    /// the engine (it closes the engine's endpoints, so no byte of a
    /// transfer given up before can land after it returns). The service
    /// then tells the runtime that the destination buffers of the engine's
    /// given-up reads may be reused ([`crate::Destination::Reusable`]);
    /// otherwise they must be retired.
    ///
    /// `false` unless the implementation has proved it on the real thing:
    /// with NIXL 1.5.1 over TCP, a READ given up with `releaseXferReq`
    /// still wrote its destination when the prefill resumed, after
    /// `invalidateRemoteMD` had returned SUCCESS
    /// (`cli/tests/real_buffer.rs`).
    fn release_ends_transfers(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod resolve_tests {
    use super::{PeerAddr, ResolveError};

    #[tokio::test]
    async fn a_numeric_host_that_is_not_a_standard_ipv4_literal_is_refused_naming_the_form() {
        for address in [
            "010.000.000.001:5600",
            "010.0.0.1:5600",
            "127.000.0.1:5600",
            "2130706433:5600",
            "127.1:5600",
            "0x7f.0.0.1:5600",
            "1.2.3.4.5:5600",
        ] {
            match PeerAddr::resolve(address).await {
                Err(ResolveError::NumericHost(shown)) => {
                    assert_eq!(shown, address);
                    let text = ResolveError::NumericHost(shown).to_string();
                    assert!(text.contains("standard IPv4"), "{text}");
                }
                other => panic!("{address}: {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn standard_literals_are_kept_and_the_port_is_written_canonically() {
        let ok = |a: &str| a.to_string();
        assert_eq!(
            PeerAddr::resolve("10.0.0.1:5600").await.unwrap().as_str(),
            ok("10.0.0.1:5600")
        );
        assert_eq!(
            PeerAddr::resolve("127.0.0.1:05600").await.unwrap().as_str(),
            ok("127.0.0.1:5600")
        );
        assert_eq!(
            PeerAddr::resolve("[0:0::1]:80").await.unwrap().as_str(),
            ok("[::1]:80")
        );
    }

    #[tokio::test]
    async fn a_port_with_a_sign_or_no_port_is_not_host_port() {
        for address in [
            "10.0.0.1:+80",
            "10.0.0.1:",
            "not-an-address",
            ":80",
            "10.0.0.1:65536",
        ] {
            assert!(
                matches!(PeerAddr::resolve(address).await, Err(ResolveError::Form(_))),
                "{address}"
            );
        }
    }
}
