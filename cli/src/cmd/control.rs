//! `decode`'s HTTP server (axum on hyper): the router's control endpoint
//! and the Prometheus metrics.
//!
//! - `POST /v1/peer_gone` with `{"engine": ID}` or `{"address": "host:port"}`
//!   and an optional `"mode": "drain" | "fail"` (default `drain`): the
//!   router says a prefill is gone. `202` when the engine is registered;
//!   `404` when it is not.
//! - `GET /v1/snapshot`: the service's table as JSON.
//! - `GET /metrics`: Prometheus text.
//!
//! Loopback by default. With `--control-token-file`, every POST needs
//! `Authorization: Bearer <token>`; a bind that is not loopback needs a
//! token, and then every request needs it, `/metrics` included (a
//! `--metrics-addr` that is not loopback too, unless `--metrics-public`
//! says it serves metrics to anyone). Every error is an HTTP status with a
//! JSON body `{"error": "..."}` that says what was wrong and what is
//! accepted, the ones the server writes before a request reaches a route
//! (408, 431, 400) included.
//!
//! Nothing a client does holds the server's resources for long
//! ([`LIMITS`]): a request's line and headers must arrive whole within
//! 5 s and in 8 KiB, its body within 5 s, and a connection lives 30 s at
//! most and carries one request. At most 64 connections are open at once;
//! when all are taken, the oldest one still waiting for its request head
//! is closed to make room (slow-loris and idle connections cannot lock the
//! router out); when every one is answering a request, the next waits in
//! the kernel's accept queue until one is done. A connection is accepted
//! only with a place for it, so the server never holds more than 65
//! descriptors (64 and the listener), whatever is thrown at it. Each refusal is counted
//! (`nixl_keepalive_control_errors_total{status}`, and connections closed
//! early in `nixl_keepalive_control_connections_closed_total{reason}`) and
//! logged once per client and status per 10 s, with the count it stands
//! for.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use metrics_exporter_prometheus::PrometheusHandle;
use nixl_keepalive::log_limit::LogLimiter;
use nixl_keepalive::transport::nixl::RemoteDlists;
use nixl_keepalive::{EngineId, GoneMode, KeepaliveHandle, PeerAddr, PeerRef, Snapshot};
use serde::Deserialize;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Largest request body accepted.
pub(crate) const MAX_BODY: usize = 16 * 1024;

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

/// Lines about refused requests: one per client and status per period.
static REFUSALS: LazyLock<Mutex<LogLimiter<(IpAddr, u16)>>> = LazyLock::new(Default::default);

/// The client of a request, put there by the connection.
#[derive(Clone, Copy, Debug)]
struct Client(IpAddr);

/// What the handlers share.
#[derive(Clone)]
pub(crate) struct Control {
    /// The service.
    pub(crate) handle: KeepaliveHandle<RemoteDlists>,
    /// The bearer token, when configured.
    pub(crate) token: Option<Arc<str>>,
    /// Whether GETs need the token too (a non-loopback bind).
    pub(crate) token_for_reads: bool,
    /// Prometheus rendering, when metrics are on.
    pub(crate) metrics: Option<PrometheusHandle>,
    /// Whether the control routes are served (`--control-addr`); a
    /// `--metrics-addr` server serves `/metrics` only.
    pub(crate) control: bool,
    /// How long a request body may take to arrive.
    pub(crate) body_timeout: Duration,
}

/// A start-up problem with the control flags.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ControlConfigError {
    /// A non-loopback bind without a token.
    #[error("--control-addr {0} is not a loopback address: give --control-token-file too (every request must then carry the token)")]
    TokenRequired(SocketAddr),
    /// The token file cannot be read.
    #[error("cannot read --control-token-file {path}: {source}")]
    TokenFile {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The token file is empty or has characters a header cannot carry.
    #[error("--control-token-file {0}: the token must be 1 to 4096 visible ASCII characters (surrounding whitespace is trimmed)")]
    BadToken(String),
    /// A non-loopback metrics bind without a token or `--metrics-public`.
    #[error("--metrics-addr {0} is not a loopback address: give --control-token-file (every scrape must then carry the token), or --metrics-public to serve metrics to anyone who can reach it")]
    MetricsTokenRequired(SocketAddr),
}

/// Whether a bind is reachable from other hosts only.
fn exposed(addr: SocketAddr) -> bool {
    !addr.ip().is_loopback()
}

/// The token a `--metrics-addr` server asks for: the control token when
/// the bind is not loopback (required then, unless `public`), none on
/// loopback or when `public`.
pub(crate) fn metrics_token(
    addr: SocketAddr,
    token: Option<&Arc<str>>,
    public: bool,
) -> Result<Option<Arc<str>>, ControlConfigError> {
    if !exposed(addr) || public {
        return Ok(None);
    }
    match token {
        Some(t) => Ok(Some(t.clone())),
        None => Err(ControlConfigError::MetricsTokenRequired(addr)),
    }
}

/// Reads the token file and checks the control bind (if any) against it.
pub(crate) fn load_token(
    addr: Option<SocketAddr>,
    file: Option<&std::path::Path>,
) -> Result<Option<Arc<str>>, ControlConfigError> {
    let token = match file {
        None => None,
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|source| ControlConfigError::TokenFile {
                    path: path.display().to_string(),
                    source,
                })?;
            let t = text.trim();
            if t.is_empty() || t.len() > 4096 || !t.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(ControlConfigError::BadToken(path.display().to_string()));
            }
            Some(Arc::from(t))
        }
    };
    if let Some(addr) = addr.filter(|a| token.is_none() && exposed(*a)) {
        return Err(ControlConfigError::TokenRequired(addr));
    }
    Ok(token)
}

/// The routes.
pub(crate) fn router(state: Control) -> Router {
    let mut r = Router::new().route("/metrics", get(metrics));
    if state.control {
        r = r
            .route("/v1/peer_gone", post(peer_gone))
            .route("/v1/snapshot", get(snapshot));
    }
    r.fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Counts and logs (once per client and status per period) a refusal.
fn refused(client: IpAddr, status: StatusCode, message: &str) {
    metrics::counter!("nixl_keepalive_control_errors_total", "status" => status.as_str().to_string())
        .increment(1);
    let told = REFUSALS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .admit((client, status.as_u16()), tokio::time::Instant::now());
    if let Some(suppressed) = told {
        tracing::info!(%client, status = status.as_u16(), message = %nixl_keepalive::text::Escaped(message), suppressed, "control request refused");
    }
}

fn error(client: Client, status: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    refused(client.0, status, &message);
    (status, axum::Json(json!({ "error": message }))).into_response()
}

/// Checks the bearer token when this request needs one; the refusal is
/// the status and the message for [`error`].
fn authorize(
    state: &Control,
    method: &Method,
    headers: &HeaderMap,
) -> Result<(), (StatusCode, &'static str)> {
    let Some(token) = &state.token else {
        return Ok(());
    };
    if *method == Method::GET && !state.token_for_reads {
        return Ok(());
    }
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Err((
            StatusCode::UNAUTHORIZED,
            "missing token: send the header 'Authorization: Bearer <token>' with the token of --control-token-file",
        ));
    };
    let given = value.to_str().ok().and_then(bearer_token).unwrap_or("");
    if !same(given.as_bytes(), token.as_bytes()) {
        return Err((
            StatusCode::UNAUTHORIZED,
            "bad token: 'Authorization: Bearer <token>' does not match --control-token-file",
        ));
    }
    Ok(())
}

/// The token of an `Authorization` value in the `Bearer` scheme: the
/// scheme name in any case (auth schemes are case-insensitive, RFC 7235
/// section 2.1; `bearer` from a client was refused before), then spaces,
/// then the token (surrounding spaces trimmed). `None` for another scheme.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, rest) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| rest.trim_matches(' '))
}

/// Compares without stopping at the first difference (no timing hint
/// about how much of the token matched).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(
    Extension(client): Extension<Client>,
    method: Method,
    uri: axum::http::Uri,
) -> Response {
    error(
        client,
        StatusCode::NOT_FOUND,
        format!(
            "no route {method} {}; routes: POST /v1/peer_gone, GET /v1/snapshot, GET /metrics",
            uri.path()
        ),
    )
}

async fn method_not_allowed(
    Extension(client): Extension<Client>,
    method: Method,
    uri: axum::http::Uri,
) -> Response {
    error(
        client,
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not accepted on {}; routes: POST /v1/peer_gone, GET /v1/snapshot, GET /metrics", uri.path()),
    )
}

async fn metrics(
    State(state): State<Control>,
    Extension(client): Extension<Client>,
    method: Method,
    headers: HeaderMap,
) -> Response {
    if let Err((status, message)) = authorize(&state, &method, &headers) {
        return error(client, status, message);
    }
    match &state.metrics {
        Some(m) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            m.render(),
        )
            .into_response(),
        None => error(client, StatusCode::NOT_FOUND, "metrics are off"),
    }
}

/// The body of `POST /v1/peer_gone`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PeerGoneRequest {
    engine: Option<String>,
    address: Option<String>,
    mode: Option<String>,
}

const PEER_GONE_SHAPE: &str = r#"expected {"engine": "<engine id>"} or {"address": "host:port"}, with optional "mode": "drain" | "fail""#;

async fn peer_gone(
    State(state): State<Control>,
    Extension(client): Extension<Client>,
    method: Method,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let asked = async {
        // The steps, each refusing with its status and message.
        authorize(&state, &method, &headers).map_err(|(status, m)| (status, m.to_owned()))?;
        let body = read_body(&state, body).await?;
        let (request, mode) = parse_peer_gone(&body)?;
        let (peer, engine) = find_peer(&state, request).await?;
        Ok((peer, engine, mode))
    };
    let (peer, engine, mode) = match asked.await {
        Ok(asked) => asked,
        Err((status, message)) => return error(client, status, message),
    };
    let mode_name = mode.as_str();
    tracing::info!(%engine, mode = mode_name, "router: peer gone");
    if state.handle.peer_gone(peer, mode).is_err() {
        return error(
            client,
            StatusCode::SERVICE_UNAVAILABLE,
            "the keepalive service has stopped: every engine is released or handed back",
        );
    }
    (
        StatusCode::ACCEPTED,
        axum::Json(json!({ "accepted": true, "engine": engine, "mode": mode_name })),
    )
        .into_response()
}

/// A refused request: its status and the message the JSON error carries.
type Refusal = (StatusCode, String);

/// The request's body, at most `MAX_BODY` bytes within the body timeout.
async fn read_body(state: &Control, body: Body) -> Result<axum::body::Bytes, Refusal> {
    match tokio::time::timeout(state.body_timeout, axum::body::to_bytes(body, MAX_BODY)).await {
        Ok(Ok(body)) => Ok(body),
        Ok(Err(_)) => Err((
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("body over {MAX_BODY} bytes (or cut short); {PEER_GONE_SHAPE}"),
        )),
        Err(_) => Err((
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the body did not arrive within {:?}; send it with the request; {PEER_GONE_SHAPE}",
                state.body_timeout
            ),
        )),
    }
}

/// The request and its mode (`drain` when not given).
fn parse_peer_gone(body: &[u8]) -> Result<(PeerGoneRequest, GoneMode), Refusal> {
    let request: PeerGoneRequest = serde_json::from_slice(body).map_err(|e| {
        (
            StatusCode::BAD_REQUEST,
            format!("malformed JSON body ({e}); {PEER_GONE_SHAPE}"),
        )
    })?;
    let mode = match request.mode.as_deref() {
        None | Some("drain") => GoneMode::Drain,
        Some("fail") => GoneMode::Fail,
        Some(other) => {
            return Err((
                StatusCode::BAD_REQUEST,
                format!("mode {other:?} is not one of \"drain\", \"fail\""),
            ))
        }
    };
    Ok((request, mode))
}

/// The registered engine the request names, by id or by address, and its
/// id for the reply.
async fn find_peer(
    state: &Control,
    request: PeerGoneRequest,
) -> Result<(PeerRef, String), Refusal> {
    match (request.engine, request.address) {
        (Some(engine), None) => {
            let id = EngineId::from(engine.as_str());
            if state.handle.engine(&id).is_none() {
                return Err((
                    StatusCode::NOT_FOUND,
                    format!("no engine {engine:?} is registered"),
                ));
            }
            Ok((PeerRef::Engine(id), engine))
        }
        (None, Some(address)) => {
            let snapshot = state.handle.snapshot().await.map_err(|_| {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the service has stopped".to_owned(),
                )
            })?;
            let Some(e) = snapshot
                .engines
                .iter()
                .find(|e| e.address.as_str() == address)
            else {
                return Err((
                    StatusCode::NOT_FOUND,
                    format!("no engine is registered at {address:?}"),
                ));
            };
            Ok((
                PeerRef::Address(PeerAddr::from(address.as_str())),
                e.engine.to_string(),
            ))
        }
        _ => Err((
            StatusCode::BAD_REQUEST,
            format!("give exactly one of \"engine\" and \"address\"; {PEER_GONE_SHAPE}"),
        )),
    }
}

async fn snapshot(
    State(state): State<Control>,
    Extension(client): Extension<Client>,
    method: Method,
    headers: HeaderMap,
) -> Response {
    if let Err((status, message)) = authorize(&state, &method, &headers) {
        return error(client, status, message);
    }
    match state.handle.snapshot().await {
        Ok(s) => axum::Json(snapshot_json(&s)).into_response(),
        Err(_) => error(
            client,
            StatusCode::SERVICE_UNAVAILABLE,
            "the service has stopped",
        ),
    }
}

/// The snapshot as JSON (durations in milliseconds).
pub(crate) fn snapshot_json(s: &Snapshot) -> serde_json::Value {
    let ms = |d: std::time::Duration| d.as_millis() as u64;
    json!({
        "engines": s.engines.iter().map(|e| json!({
            "engine": e.engine.as_str(),
            "address": e.address.as_str(),
            // The process start the registration is of (a restart at the
            // same address is a new one), as its handshake sent it: a
            // decimal u64 (JSON numbers lose precision above 2^53), or null
            // when the handshake carried none.
            "incarnation": e.incarnation.map(|i| i.0.to_string()),
            "agents": e.agents.iter().map(|a| a.as_str()).collect::<Vec<_>>(),
            "state": e.state.as_str(),
            "reads_in_flight": e.reads_in_flight,
            "leases": e.leases,
            "last_heartbeat": e.last_heartbeat.as_ref().map(|h| json!({
                "ago_ms": ms(h.ago),
                "status": h.status.to_string(),
            })),
            "next_heartbeat_in_ms": e.next_heartbeat_in.map(ms),
            "transient_errors": e.transient_errors,
            "why": e.why,
        })).collect::<Vec<_>>(),
        "handshakes_pending": s.handshakes_pending.iter().map(|(a, n)| json!({"address": a.as_str(), "count": n})).collect::<Vec<_>>(),
        "waiting_for_reload": s.waiting_for_reload.iter().map(|e| e.as_str()).collect::<Vec<_>>(),
        "silent_peer_note": s.silent_peer_note,
        "limiter_keys": s.limiter_keys,
        "heartbeat_timers": s.heartbeat_timers,
        "detection_bound_ms": s.detection_bound.map(|d| json!({
            "crashed": d.crashed.map(ms),
            "silent": d.silent.map(ms),
        })),
        "transport": json!({
            "threads": s.transport.threads,
            "idle": s.transport.idle,
            "cap": s.transport.cap,
            "queued": s.transport.queued,
            "hung_total": s.transport.hung_total,
            "in_flight": s.transport.in_flight.iter().map(|c| json!({
                "engine": c.engine.as_str(),
                "call": c.call,
                "age_ms": ms(c.age),
                "hung": c.hung,
            })).collect::<Vec<_>>(),
        }),
    })
}

/// Serves `router` on `listener` until `shutdown`, within `limits` (see
/// the module docs).
///
/// Cancel safety: stop it with `shutdown`; connections still open are
/// closed.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
    limits: Limits,
) {
    let slots = Arc::new(Mutex::new(Slots::default()));
    // One permit per connection, taken before the accept: the server never
    // holds more descriptors than this (plus the listener's).
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let mut accept_log: LogLimiter<&'static str> = LogLimiter::standard();
    loop {
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // Full: the oldest connection still waiting for its head is
                // closed to make room (its task gives its permit back as it
                // ends); when every one is answering, the next to finish
                // makes room.
                if lock(&slots).evict_oldest_waiting() {
                    closed_early("evicted");
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
                }
            }
        };
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors, most likely: the process's other
                // work comes first; try again shortly.
                if let Some(suppressed) = accept_log.admit("accept", tokio::time::Instant::now()) {
                    tracing::warn!(error = %e, suppressed, "HTTP server: accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (id, stop) = lock(&slots).admit();
        let router = router.clone();
        let slots = slots.clone();
        tokio::spawn(async move {
            connection(stream, peer, router, &slots, id, stop, limits).await;
            lock(&slots).close(id);
            // The stream is closed: the place is free.
            drop(permit);
        });
    }
    lock(&slots).close_all();
}

/// One connection: its request head within the limits (else an error of
/// ours), then hyper and the routes, one request, for at most the
/// connection timeout.
async fn connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    slots: &Mutex<Slots>,
    id: u64,
    stop: CancellationToken,
    limits: Limits,
) {
    let client = peer.ip();
    let head = tokio::select! {
        _ = stop.cancelled() => return,
        head = tokio::time::timeout(limits.head_timeout, read_head(&mut stream, limits.max_head)) => head,
    };
    let head = match head {
        Ok(Ok(head)) => head,
        Ok(Err(HeadError::Closed)) => return,
        Ok(Err(HeadError::TooLarge)) => {
            closed_early("head_too_large");
            let message = format!(
                "the request line and headers are over {} bytes; send at most that",
                limits.max_head
            );
            return answer(
                &mut stream,
                client,
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                &message,
            )
            .await;
        }
        Ok(Err(HeadError::Malformed(why))) => {
            closed_early("malformed");
            let message = format!("not an HTTP/1.1 request ({why})");
            return answer(&mut stream, client, StatusCode::BAD_REQUEST, &message).await;
        }
        Err(_) => {
            closed_early("head_timeout");
            let message = format!(
                "the request line and headers did not arrive within {:?}; send them at once",
                limits.head_timeout
            );
            return answer(&mut stream, client, StatusCode::REQUEST_TIMEOUT, &message).await;
        }
    };
    lock(slots).answering(id);
    let io = TokioIo::new(Replay {
        head,
        at: 0,
        stream,
    });
    let service = TowerToHyperService::new(router.layer(Extension(Client(client))));
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        // The head was checked already; hyper's own bound stays above it.
        .max_buf_size((limits.max_head * 2).max(8192))
        .serve_connection(io, service);
    tokio::select! {
        _ = stop.cancelled() => {}
        served = tokio::time::timeout(limits.connection_timeout, conn) => {
            if served.is_err() {
                closed_early("lifetime");
            }
        }
    }
}

fn lock(slots: &Mutex<Slots>) -> std::sync::MutexGuard<'_, Slots> {
    slots.lock().unwrap_or_else(|e| e.into_inner())
}

fn closed_early(reason: &'static str) {
    metrics::counter!("nixl_keepalive_control_connections_closed_total", "reason" => reason)
        .increment(1);
}

/// An error the server writes itself (before hyper has the connection):
/// counted, logged (limited), JSON, and the connection closed.
async fn answer(stream: &mut TcpStream, client: IpAddr, status: StatusCode, message: &str) {
    refused(client, status, message);
    let bytes = raw_error(status, message);
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(&bytes).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

/// A whole HTTP/1.1 error response with the JSON body every error has.
fn raw_error(status: StatusCode, message: &str) -> Vec<u8> {
    let body = json!({ "error": message }).to_string();
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes()
}

/// Why a request head was not read.
#[derive(Debug)]
enum HeadError {
    /// The client closed (or the connection failed) first.
    Closed,
    /// Over the limit before its end.
    TooLarge,
    /// Not an HTTP/1 request head.
    Malformed(String),
}

/// Reads until the end of the request head (`\r\n\r\n`), at most `max`
/// bytes of it; returns everything read (a body's first bytes may follow
/// the head). The head is parsed once here, so that every request hyper
/// sees is one it parses, and every refusal has our JSON body.
async fn read_head(stream: &mut TcpStream, max: usize) -> Result<Vec<u8>, HeadError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|_| HeadError::Closed)?;
        if n == 0 {
            return Err(HeadError::Closed);
        }
        let searched = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf[searched..].windows(4).position(|w| w == b"\r\n\r\n") {
            let end = searched + end + 4;
            if end > max {
                return Err(HeadError::TooLarge);
            }
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut request = httparse::Request::new(&mut headers);
            return match request.parse(&buf[..end]) {
                Ok(httparse::Status::Complete(_)) => Ok(buf),
                Ok(httparse::Status::Partial) => {
                    Err(HeadError::Malformed("incomplete head".into()))
                }
                Err(e) => Err(HeadError::Malformed(e.to_string())),
            };
        }
        if buf.len() > max {
            return Err(HeadError::TooLarge);
        }
    }
}

/// The stream with the head already read put back in front.
struct Replay {
    head: Vec<u8>,
    at: usize,
    stream: TcpStream,
}

impl AsyncRead for Replay {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.at < this.head.len() {
            let n = buf.remaining().min(this.head.len() - this.at);
            buf.put_slice(&this.head[this.at..this.at + n]);
            this.at += n;
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Replay {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The connections open, oldest first.
#[derive(Default)]
struct Slots {
    next: u64,
    open: VecDeque<Slot>,
}

/// One connection's place.
struct Slot {
    id: u64,
    stop: CancellationToken,
    /// Still waiting for its request head: may be closed to make room.
    waiting: bool,
}

impl Slots {
    /// A place for a new connection (the caller holds its permit).
    fn admit(&mut self) -> (u64, CancellationToken) {
        let id = self.next;
        self.next += 1;
        let stop = CancellationToken::new();
        self.open.push_back(Slot {
            id,
            stop: stop.clone(),
            waiting: true,
        });
        (id, stop)
    }

    /// Closes the oldest connection still waiting for its request head,
    /// if any.
    fn evict_oldest_waiting(&mut self) -> bool {
        let Some(oldest) = self.open.iter().position(|s| s.waiting) else {
            return false;
        };
        let slot = self.open.remove(oldest).expect("found above");
        slot.stop.cancel();
        true
    }

    fn answering(&mut self, id: u64) {
        if let Some(s) = self.open.iter_mut().find(|s| s.id == id) {
            s.waiting = false;
        }
    }

    fn close(&mut self, id: u64) {
        self.open.retain(|s| s.id != id);
    }

    fn close_all(&mut self) {
        for s in self.open.drain(..) {
            s.stop.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    //! The server against hostile clients, in process (real sockets, real
    //! time, limits shortened): what it answers and what it holds.

    use std::time::Instant;

    use nixl_keepalive::{AgentName, Config, Keepalive, ReleaseStep, Transport, TransportError};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// The service needs a transport; no engine is ever registered here.
    struct NoTransport;

    impl Transport for NoTransport {
        type Resources = RemoteDlists;
        fn notify(&self, _: &AgentName, _: &[u8]) -> Result<(), TransportError> {
            Ok(())
        }
        fn release(&self, _: &EngineId, _: &[AgentName], _: RemoteDlists) -> Vec<ReleaseStep> {
            Vec::new()
        }
    }

    const TEST_LIMITS: Limits = Limits {
        max_connections: 8,
        max_head: 1024,
        head_timeout: Duration::from_millis(300),
        body_timeout: Duration::from_millis(300),
        connection_timeout: Duration::from_secs(5),
    };

    /// A control server on a free loopback port.
    async fn server(token: Option<&str>, token_for_reads: bool) -> (SocketAddr, CancellationToken) {
        let shutdown = CancellationToken::new();
        let (service, handle) = Keepalive::new(Arc::new(NoTransport), Config::default());
        tokio::spawn(service.run(shutdown.child_token()));
        let state = Control {
            handle,
            token: token.map(Arc::from),
            token_for_reads,
            metrics: None,
            control: true,
            body_timeout: TEST_LIMITS.body_timeout,
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(
            listener,
            router(state),
            shutdown.clone(),
            TEST_LIMITS,
        ));
        (addr, shutdown)
    }

    /// Everything the server sends until it closes (at most 5 s).
    async fn read_all(stream: &mut TcpStream) -> String {
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Status code and JSON body of a whole response.
    fn parse(response: &str) -> (u16, serde_json::Value) {
        let status = response
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line: {response:?}"));
        let body = response.split("\r\n\r\n").nth(1).unwrap_or("");
        let json = serde_json::from_str(body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {response:?}"));
        (status, json)
    }

    async fn send(addr: SocketAddr, raw: &[u8]) -> (u16, serde_json::Value) {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(raw).await.unwrap();
        parse(&read_all(&mut s).await)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slow_loris_connections_get_a_json_408_within_the_head_timeout() {
        let (addr, _stop) = server(None, false).await;
        let start = Instant::now();
        let mut drips = Vec::new();
        for _ in 0..4 {
            drips.push(tokio::spawn(async move {
                let mut s = TcpStream::connect(addr).await.unwrap();
                s.write_all(b"GET /v1/snapshot HTTP/1.1\r\n").await.unwrap();
                // One header byte every 50 ms, never the end of the head.
                let mut answer = Vec::new();
                loop {
                    tokio::select! {
                        n = s.read_buf(&mut answer) => if n.unwrap_or(0) == 0 { break },
                        _ = tokio::time::sleep(Duration::from_millis(50)) => {
                            if s.write_all(b"X").await.is_err() { break }
                        }
                    }
                    assert!(start.elapsed() < Duration::from_secs(10), "held for 10 s");
                }
                String::from_utf8_lossy(&answer).into_owned()
            }));
        }
        for d in drips {
            let (status, json) = parse(&d.await.unwrap());
            assert_eq!(status, 408);
            assert!(
                json["error"].as_str().unwrap().contains("did not arrive"),
                "{json}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_flood_past_the_cap_is_closed_oldest_first_and_a_request_still_gets_through() {
        let (addr, _stop) = server(None, false).await;
        let mut idle = Vec::new();
        for _ in 0..40 {
            idle.push(TcpStream::connect(addr).await.unwrap());
            // Each is accepted (and the oldest closed) before the next.
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let (status, json) = send(addr, b"GET /v1/snapshot HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert_eq!(status, 200, "{json}");
        assert!(json["engines"].is_array(), "{json}");
        // The server held at most its cap: the rest were closed.
        let mut closed = 0;
        for s in &mut idle {
            let mut b = [0u8; 1];
            if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(20), s.read(&mut b)).await
            {
                closed += 1;
            }
        }
        assert!(
            closed >= 40 - TEST_LIMITS.max_connections,
            "only {closed} of 40 closed"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn oversize_heads_malformed_heads_and_missing_bodies_get_json_errors() {
        let (addr, _stop) = server(None, false).await;
        let big = format!(
            "GET /v1/snapshot HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
            "a".repeat(2000)
        );
        let (status, json) = send(addr, big.as_bytes()).await;
        assert_eq!(status, 431);
        assert!(
            json["error"].as_str().unwrap().contains("1024 bytes"),
            "{json}"
        );
        // Over the limit without ever ending the head.
        let (status, _) = send(addr, "G".repeat(5000).as_bytes()).await;
        assert_eq!(status, 431);
        let (status, json) = send(addr, b"HELLO THERE\x01\r\n\r\n").await;
        assert_eq!(status, 400);
        assert!(
            json["error"].as_str().unwrap().contains("not an HTTP"),
            "{json}"
        );
        // A body announced and never sent.
        let (status, json) = send(
            addr,
            b"POST /v1/peer_gone HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
        )
        .await;
        assert_eq!(status, 408);
        assert!(json["error"].as_str().unwrap().contains("body"), "{json}");
        // The routes' own errors are JSON as before.
        let (status, _) = send(addr, b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert_eq!(status, 404);
    }

    #[test]
    fn the_bearer_scheme_is_accepted_in_any_case_and_other_schemes_are_not() {
        for v in [
            "Bearer s3cret",
            "bearer s3cret",
            "BEARER s3cret",
            "bEaReR  s3cret ",
        ] {
            assert_eq!(bearer_token(v), Some("s3cret"), "{v:?}");
        }
        for v in ["Basic s3cret", "Bearers3cret", "s3cret", "Bearer"] {
            assert_eq!(bearer_token(v), None, "{v:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lower_case_bearer_scheme_passes_the_token_check() {
        let (addr, _stop) = server(Some("s3cret"), true).await;
        for scheme in ["bearer", "BEARER"] {
            let raw = format!(
                "GET /v1/snapshot HTTP/1.1\r\nHost: x\r\nAuthorization: {scheme} s3cret\r\n\r\n"
            );
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(raw.as_bytes()).await.unwrap();
            let answer = read_all(&mut s).await;
            assert!(!answer.starts_with("HTTP/1.1 401"), "{scheme}: {answer}");
        }
        let raw = "GET /v1/snapshot HTTP/1.1\r\nHost: x\r\nAuthorization: bearer wrong\r\n\r\n";
        let (status, _) = send(addr, raw.as_bytes()).await;
        assert_eq!(status, 401, "a wrong token is still refused");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn off_loopback_every_route_asks_for_the_token_metrics_included() {
        let (addr, _stop) = server(Some("s3cret"), true).await;
        for path in ["/metrics", "/v1/snapshot"] {
            let raw = format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
            let (status, json) = send(addr, raw.as_bytes()).await;
            assert_eq!(status, 401, "{path}: {json}");
            let raw =
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n\r\n");
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(raw.as_bytes()).await.unwrap();
            let answer = read_all(&mut s).await;
            // Metrics are off in this server: 404, but past the token.
            assert!(!answer.starts_with("HTTP/1.1 401"), "{path}: {answer}");
        }
        let exposed: SocketAddr = "10.1.2.3:9090".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:9090".parse().unwrap();
        let token: Arc<str> = Arc::from("t");
        assert!(matches!(
            metrics_token(exposed, None, false),
            Err(ControlConfigError::MetricsTokenRequired(_))
        ));
        assert_eq!(
            metrics_token(exposed, Some(&token), false).unwrap(),
            Some(token.clone())
        );
        assert_eq!(metrics_token(exposed, None, true).unwrap(), None);
        assert_eq!(metrics_token(local, Some(&token), false).unwrap(), None);
    }

    #[test]
    fn to_make_room_the_oldest_connection_still_waiting_goes_never_one_answering() {
        let mut slots = Slots::default();
        let (a, a_stop) = slots.admit();
        let (_b, b_stop) = slots.admit();
        let (c, c_stop) = slots.admit();
        slots.answering(a);
        assert!(slots.evict_oldest_waiting());
        assert!(b_stop.is_cancelled() && !a_stop.is_cancelled() && !c_stop.is_cancelled());
        slots.answering(c);
        assert!(!slots.evict_oldest_waiting(), "every one left is answering");
        slots.close(a);
        slots.close(c);
        assert!(slots.open.is_empty());
    }
}
