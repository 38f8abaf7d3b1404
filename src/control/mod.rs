//! The control server (feature `control`): the router's endpoint, the
//! service's table and Prometheus metrics over HTTP/1.1, served beside the
//! service by the decoder runtime that embeds it.
//!
//! A router that sees a prefill go (its own health checks, a scale-down)
//! knows before UCX does; this is where it says so. The CLI's `decode
//! --control-addr` and the Python package's `Keepalive(control=...)`
//! serve it; a Rust runtime calls [`serve`]:
//!
//! ```no_run
//! # async fn example(keepalive: nixl_keepalive::KeepaliveHandle<()>, shutdown: tokio_util::sync::CancellationToken) -> Result<(), nixl_keepalive::control::ControlError> {
//! use nixl_keepalive::control::{self, ControlConfig, ControlToken};
//! let token = ControlToken::from_file("/etc/nixl-keepalive/token".as_ref())?;
//! let config = ControlConfig::new("10.0.0.3:9091".parse().unwrap()).token(Some(token));
//! let bound = control::serve(keepalive.clone(), config, shutdown.child_token()).await?;
//! println!("control on http://{bound}/");
//! # Ok(()) }
//! ```
//!
//! # Routes
//!
//! - `POST /v1/peer_gone` with `{"engine": ID}` or `{"address":
//!   "host:port"}` and an optional `"mode": "drain" | "fail"` (default
//!   `drain`): one prefill is gone. `202` when the engine is registered;
//!   `404` when it is not (this route's callers expect to be told).
//! - `POST /fault_tolerance/event` with `{"event_type": "peer_gone",
//!   "nodes": {"engine_ids": [...]}}` or `{..., "nodes": {"addresses":
//!   ["host:port", ...]}}` (both lists may be given) and the same optional
//!   `mode`: the shape proposed in vLLM's review, which a router
//!   broadcasts to every decode. Idempotent: `200` whatever each node is
//!   here, with each node's outcome in the body (`releasing`, `released`,
//!   `unknown`, `unresolved`), a no-op for the unknown ones: a decode that
//!   never loaded a prefill is not an error for a broadcast.
//! - `GET /v1/snapshot`: the service's table as JSON, its one rendering
//!   (`Snapshot`'s `Serialize`, what the Python package's
//!   `Keepalive.snapshot()` returns too).
//! - `GET /metrics`: Prometheus text, when the runtime hands a renderer
//!   ([`ControlConfig::metrics`]: the CLI's `decode` and the Python
//!   package's `Keepalive(control=...)` do); else `404`.
//!
//! Every error is an HTTP status with a JSON body `{"error": "..."}` that
//! says what was wrong and what is accepted, the ones the server writes
//! before a request reaches a route (408, 431, 400) included.
//!
//! # Who may ask
//!
//! Loopback by default. With a [`ControlToken`], every POST needs
//! `Authorization: Bearer <token>`; a bind that is not loopback needs a
//! token ([`ControlError::TokenRequired`]), and then every request needs
//! it, `/metrics` included. A metrics-only server
//! ([`ControlConfig::metrics_only`]) off loopback asks every scrape for
//! the token, unless made public.
//!
//! # What a client can hold
//!
//! Nothing a client does holds the server's resources for long: a
//! request's line and headers must arrive whole within 5 s and in 8 KiB,
//! its body within 5 s and in 16 KiB, and a connection lives 30 s at most
//! and carries one request. At most 64 connections are open at once; when
//! all are taken, the oldest one still waiting for its request head is
//! closed to make room (slow-loris and idle connections cannot lock the
//! router out); when every one is answering a request, the next waits in
//! the kernel's accept queue until one is done. A connection is accepted
//! only with a place for it, so the server never holds more than 65
//! descriptors (64 and the listener), whatever is thrown at it. Each
//! refusal is counted (`nixl_keepalive_control_errors_total{status}`, and
//! connections closed early in
//! `nixl_keepalive_control_connections_closed_total{reason}`) and logged
//! once per client and status per 10 s, with the count it stands for.

mod event;
mod recent;
mod routes;
mod server;

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::KeepaliveHandle;

/// Largest request body accepted.
pub(crate) const MAX_BODY: usize = 16 * 1024;

/// Longest token accepted, in bytes.
const MAX_TOKEN: usize = 4096;

/// What the server lets a client hold.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Connections open at once (each holds a file descriptor).
    pub(crate) max_connections: usize,
    /// Bytes of the request line and headers.
    pub(crate) max_head: usize,
    /// Time for the request line and headers to arrive, from the accept.
    pub(crate) head_timeout: Duration,
    /// Time for the body to arrive, once the head has.
    pub(crate) body_timeout: Duration,
    /// A connection's whole life: its request, its answer.
    pub(crate) connection_timeout: Duration,
}

/// The server's limits (see the module docs).
pub(crate) const LIMITS: Limits = Limits {
    max_connections: 64,
    max_head: 8 * 1024,
    head_timeout: Duration::from_secs(5),
    body_timeout: Duration::from_secs(5),
    connection_timeout: Duration::from_secs(30),
};

/// A problem with a control server's configuration, or its bind. Each
/// says what was wrong and what is accepted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// A control server on an address that is not loopback, without a
    /// token: anyone who can reach it could retire engines.
    #[error("control address {addr} is not a loopback address: give a token too (every request must then carry it), or bind to loopback (127.0.0.1, [::1])")]
    TokenRequired {
        /// The address.
        addr: SocketAddr,
    },
    /// A metrics-only server on an address that is not loopback, without
    /// a token and not made public.
    #[error("metrics address {addr} is not a loopback address: give a token (every scrape must then carry it), or make the metrics public to serve them to anyone who can reach it")]
    MetricsTokenRequired {
        /// The address.
        addr: SocketAddr,
    },
    /// The token file cannot be read.
    #[error("cannot read the token file {}: {source}", path.display())]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The token is empty, too long, or has characters a header cannot
    /// carry.
    #[error("{from}: the token must be 1 to 4096 visible ASCII characters (surrounding whitespace is trimmed)")]
    BadToken {
        /// Where the token came from: `the token`, or the file's name.
        from: String,
    },
    /// The address cannot be listened on (in use, not this host's).
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// The bearer token the server asks for. Its `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct ControlToken(Arc<str>);

impl ControlToken {
    /// The token `text`, surrounding whitespace trimmed: 1 to 4096 visible
    /// ASCII characters (what an `Authorization` header carries as it is),
    /// else [`ControlError::BadToken`].
    pub fn new(text: &str) -> Result<ControlToken, ControlError> {
        Self::parse(text, || "the token".to_owned())
    }

    /// The token in the file at `path` (as [`ControlToken::new`] takes
    /// it: a trailing newline is fine).
    pub fn from_file(path: &Path) -> Result<ControlToken, ControlError> {
        let text = std::fs::read_to_string(path).map_err(|source| ControlError::TokenFile {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, || format!("token file {}", path.display()))
    }

    fn parse(text: &str, from: impl FnOnce() -> String) -> Result<ControlToken, ControlError> {
        let t = text.trim();
        if t.is_empty() || t.len() > MAX_TOKEN || !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ControlError::BadToken { from: from() });
        }
        Ok(ControlToken(Arc::from(t)))
    }

    /// The token, for a client to send.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ControlToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ControlToken(..)")
    }
}

/// Renders the process's metrics as Prometheus text (a
/// `metrics-exporter-prometheus` handle's `render`, for one): the server
/// names no recorder of its own, so the runtime keeps its choice.
pub type MetricsRender = Arc<dyn Fn() -> String + Send + Sync>;

/// Where a control server listens and what it serves. Built with
/// [`ControlConfig::new`] (every route) or [`ControlConfig::metrics_only`],
/// then the setters; checked by [`ControlConfig::check`], which
/// [`ControlServer::bind`] calls first.
#[derive(Clone)]
pub struct ControlConfig {
    addr: SocketAddr,
    token: Option<ControlToken>,
    metrics: Option<MetricsRender>,
    /// The control routes are served (else `/metrics` alone).
    control: bool,
    /// A metrics-only server off loopback serves anyone.
    metrics_public: bool,
    limits: Limits,
}

impl fmt::Debug for ControlConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ControlConfig")
            .field("addr", &self.addr)
            .field("token", &self.token)
            .field("metrics", &self.metrics.is_some())
            .field("control", &self.control)
            .field("metrics_public", &self.metrics_public)
            .finish()
    }
}

impl ControlConfig {
    /// Every route on `addr` (port 0: one the system picks; the bound
    /// address is what [`ControlServer::local_addr`] and [`serve`]
    /// return). No token, no metrics renderer.
    pub fn new(addr: SocketAddr) -> ControlConfig {
        ControlConfig {
            addr,
            token: None,
            metrics: None,
            control: true,
            metrics_public: false,
            limits: LIMITS,
        }
    }

    /// `/metrics` alone on `addr`: never the control routes. Off
    /// loopback, every scrape needs the token unless
    /// [`ControlConfig::metrics_public`]; on loopback none does.
    pub fn metrics_only(addr: SocketAddr) -> ControlConfig {
        ControlConfig {
            control: false,
            ..ControlConfig::new(addr)
        }
    }

    /// The bearer token (see the module docs for who must carry it).
    pub fn token(mut self, token: Option<ControlToken>) -> ControlConfig {
        self.token = token;
        self
    }

    /// What `GET /metrics` answers with.
    pub fn metrics(mut self, render: MetricsRender) -> ControlConfig {
        self.metrics = Some(render);
        self
    }

    /// A metrics-only server off loopback serves anyone who can reach it,
    /// without a token. No effect on a control server.
    pub fn metrics_public(mut self, public: bool) -> ControlConfig {
        self.metrics_public = public;
        self
    }

    /// The address to listen on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Refuses a control server off loopback without a token
    /// ([`ControlError::TokenRequired`]), and a metrics-only one off
    /// loopback without a token unless public
    /// ([`ControlError::MetricsTokenRequired`]). Runs nothing: call it
    /// where the configuration is read, before anything starts.
    pub fn check(&self) -> Result<(), ControlError> {
        if !exposed(self.addr) || self.token.is_some() {
            return Ok(());
        }
        match (self.control, self.metrics_public) {
            (true, _) => Err(ControlError::TokenRequired { addr: self.addr }),
            (false, false) => Err(ControlError::MetricsTokenRequired { addr: self.addr }),
            (false, true) => Ok(()),
        }
    }

    /// The token requests must carry: none for a metrics-only server on
    /// loopback or made public.
    fn effective_token(&self) -> Option<ControlToken> {
        if !self.control && (!exposed(self.addr) || self.metrics_public) {
            return None;
        }
        self.token.clone()
    }
}

/// Whether a bind is reachable from other hosts.
fn exposed(addr: SocketAddr) -> bool {
    !addr.ip().is_loopback()
}

/// A control server bound to its address, not serving yet: bind first
/// (a refused configuration or a port in use stops start-up before the
/// service runs), then [`ControlServer::run`] with the service's handle.
#[derive(Debug)]
pub struct ControlServer {
    listener: TcpListener,
    local: SocketAddr,
    config: ControlConfig,
}

impl ControlServer {
    /// Checks `config` ([`ControlConfig::check`]) and listens on its
    /// address. Needs a tokio runtime with I/O enabled.
    pub async fn bind(config: ControlConfig) -> Result<ControlServer, ControlError> {
        config.check()?;
        let listener =
            TcpListener::bind(config.addr)
                .await
                .map_err(|source| ControlError::Bind {
                    addr: config.addr,
                    source,
                })?;
        let local = listener.local_addr().unwrap_or(config.addr);
        Ok(ControlServer {
            listener,
            local,
            config,
        })
    }

    /// The address it listens on (the system's port when port 0 was
    /// asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Serves the routes for the service behind `handle` until
    /// `shutdown` is cancelled; connections still open are then closed
    /// and the listener with them. The events the fault-tolerance route
    /// reports `released` from are the service's from this call on.
    ///
    /// Cancel safety: stop it with `shutdown`; dropping the future also
    /// stops accepting, but leaves the connections already accepted to
    /// their own (bounded) ends.
    pub fn run<R: Send + 'static>(
        self,
        handle: KeepaliveHandle<R>,
        shutdown: CancellationToken,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let state = routes::Control {
            // Subscribed now, not when the future is first polled.
            recent: Arc::new(std::sync::Mutex::new(recent::Recent::new(&handle))),
            handle,
            // Off loopback, every request carries the token (the bind was
            // refused without one, unless metrics are public).
            token_for_reads: exposed(self.local),
            token: self.config.effective_token(),
            metrics: self.config.metrics.clone(),
            control: self.config.control,
            body_timeout: self.config.limits.body_timeout,
        };
        let router = router(state);
        server::accept_loop(self.listener, router, shutdown, self.config.limits)
    }
}

/// The routes.
fn router<R: Send + 'static>(state: routes::Control<R>) -> Router {
    let mut r = Router::new().route("/metrics", get(routes::metrics::<R>));
    if state.control {
        r = r
            .route("/v1/peer_gone", post(routes::peer_gone::<R>))
            .route("/fault_tolerance/event", post(event::fault_tolerance::<R>))
            .route("/v1/snapshot", get(routes::snapshot::<R>));
    }
    r.fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .with_state(state)
}

/// Binds `config`'s address ([`ControlServer::bind`]) and serves the
/// routes for `handle` on a task of the current runtime until `shutdown`;
/// returns the bound address.
pub async fn serve<R: Send + 'static>(
    handle: KeepaliveHandle<R>,
    config: ControlConfig,
    shutdown: CancellationToken,
) -> Result<SocketAddr, ControlError> {
    let server = ControlServer::bind(config).await?;
    let local = server.local_addr();
    tokio::spawn(server.run(handle, shutdown));
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_loopback_a_control_server_needs_a_token_and_a_metrics_one_a_token_or_public() {
        let exposed: SocketAddr = "10.1.2.3:9090".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:9090".parse().unwrap();
        let token = ControlToken::new("t").unwrap();
        assert!(matches!(
            ControlConfig::new(exposed).check(),
            Err(ControlError::TokenRequired { .. })
        ));
        ControlConfig::new(exposed)
            .token(Some(token.clone()))
            .check()
            .unwrap();
        ControlConfig::new(local).check().unwrap();
        assert!(matches!(
            ControlConfig::metrics_only(exposed).check(),
            Err(ControlError::MetricsTokenRequired { .. })
        ));
        let only = |addr, token: Option<ControlToken>, public| {
            let c = ControlConfig::metrics_only(addr)
                .token(token)
                .metrics_public(public);
            c.check().map(|()| c.effective_token())
        };
        assert_eq!(
            only(exposed, Some(token.clone()), false).unwrap(),
            Some(token.clone())
        );
        assert_eq!(only(exposed, None, true).unwrap(), None);
        assert_eq!(only(local, Some(token.clone()), false).unwrap(), None);
        // A control server keeps its token on loopback: POSTs need it.
        assert_eq!(
            ControlConfig::new(local)
                .token(Some(token.clone()))
                .effective_token(),
            Some(token)
        );
    }

    #[test]
    fn a_token_is_trimmed_and_one_a_header_cannot_carry_is_refused_naming_where_it_came_from() {
        assert_eq!(ControlToken::new("  s3cret\n").unwrap().as_str(), "s3cret");
        for bad in ["", "  \n", "two words", "caf\u{e9}", &"a".repeat(4097)] {
            let e = ControlToken::new(bad).unwrap_err();
            assert!(e.to_string().starts_with("the token: "), "{e}");
        }
        assert_eq!(
            format!("{:?}", ControlToken::new("s3cret").unwrap()),
            "ControlToken(..)"
        );
        let missing = Path::new("/nonexistent/nixl-keepalive-token");
        let e = ControlToken::from_file(missing).unwrap_err();
        assert!(matches!(e, ControlError::TokenFile { .. }), "{e}");
        assert!(
            e.to_string().contains("/nonexistent/nixl-keepalive-token"),
            "{e}"
        );
    }
}
