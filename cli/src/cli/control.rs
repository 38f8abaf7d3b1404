//! `decode`'s HTTP server (axum): the router's control endpoint and the
//! Prometheus metrics, from one server.
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
//! token, and then every request needs it. Every error is a 4xx with a
//! JSON body `{"error": "..."}` that says what was wrong and what is
//! accepted.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use nixl_keepalive::nixl_transport::RemoteDlists;
use nixl_keepalive::{EngineId, GoneMode, KeepaliveHandle, PeerAddr, PeerRef, Snapshot};
use serde::Deserialize;
use serde_json::json;

/// Largest request body accepted.
pub(crate) const MAX_BODY: usize = 16 * 1024;

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
}

/// Reads the token file and checks the bind against it.
pub(crate) fn load_token(
    addr: SocketAddr,
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
    if token.is_none() && !addr.ip().is_loopback() {
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

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    metrics::counter!("nixl_keepalive_control_errors_total", "status" => status.as_str().to_string())
        .increment(1);
    tracing::info!(status = status.as_u16(), %message, "control request refused");
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
    let given = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !same(given.as_bytes(), token.as_bytes()) {
        return Err((
            StatusCode::UNAUTHORIZED,
            "bad token: 'Authorization: Bearer <token>' does not match --control-token-file",
        ));
    }
    Ok(())
}

/// Compares without stopping at the first difference (no timing hint
/// about how much of the token matched).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(method: Method, uri: axum::http::Uri) -> Response {
    error(
        StatusCode::NOT_FOUND,
        format!(
            "no route {method} {}; routes: POST /v1/peer_gone, GET /v1/snapshot, GET /metrics",
            uri.path()
        ),
    )
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> Response {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not accepted on {}; routes: POST /v1/peer_gone, GET /v1/snapshot, GET /metrics", uri.path()),
    )
}

async fn metrics(State(state): State<Control>, method: Method, headers: HeaderMap) -> Response {
    if let Err((status, message)) = authorize(&state, &method, &headers) {
        return error(status, message);
    }
    match &state.metrics {
        Some(m) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            m.render(),
        )
            .into_response(),
        None => error(StatusCode::NOT_FOUND, "metrics are off"),
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
    method: Method,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if let Err((status, message)) = authorize(&state, &method, &headers) {
        return error(status, message);
    }
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY).await else {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("body over {MAX_BODY} bytes (or cut short); {PEER_GONE_SHAPE}"),
        );
    };
    let request: PeerGoneRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("malformed JSON body ({e}); {PEER_GONE_SHAPE}"),
            )
        }
    };
    let mode = match request.mode.as_deref() {
        None | Some("drain") => GoneMode::Drain,
        Some("fail") => GoneMode::Fail,
        Some(other) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("mode {other:?} is not one of \"drain\", \"fail\""),
            )
        }
    };
    let mode_name = match mode {
        GoneMode::Drain => "drain",
        GoneMode::Fail => "fail",
    };
    let (peer, engine) = match (request.engine, request.address) {
        (Some(engine), None) => {
            let id = EngineId::from(engine.as_str());
            if state.handle.engine(&id).is_none() {
                return error(
                    StatusCode::NOT_FOUND,
                    format!("no engine {engine:?} is registered"),
                );
            }
            (PeerRef::Engine(id), engine)
        }
        (None, Some(address)) => {
            let snapshot = match state.handle.snapshot().await {
                Ok(s) => s,
                Err(_) => return error(StatusCode::SERVICE_UNAVAILABLE, "the service has stopped"),
            };
            let Some(e) = snapshot
                .engines
                .iter()
                .find(|e| e.address.as_str() == address)
            else {
                return error(
                    StatusCode::NOT_FOUND,
                    format!("no engine is registered at {address:?}"),
                );
            };
            (
                PeerRef::Address(PeerAddr::from(address.as_str())),
                e.engine.to_string(),
            )
        }
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("give exactly one of \"engine\" and \"address\"; {PEER_GONE_SHAPE}"),
            )
        }
    };
    tracing::info!(%engine, mode = mode_name, "router: peer gone");
    state.handle.peer_gone(peer, mode);
    (
        StatusCode::ACCEPTED,
        axum::Json(json!({ "accepted": true, "engine": engine, "mode": mode_name })),
    )
        .into_response()
}

async fn snapshot(State(state): State<Control>, method: Method, headers: HeaderMap) -> Response {
    if let Err((status, message)) = authorize(&state, &method, &headers) {
        return error(status, message);
    }
    match state.handle.snapshot().await {
        Ok(s) => axum::Json(snapshot_json(&s)).into_response(),
        Err(_) => error(StatusCode::SERVICE_UNAVAILABLE, "the service has stopped"),
    }
}

/// The snapshot as JSON (durations in milliseconds).
pub(crate) fn snapshot_json(s: &Snapshot) -> serde_json::Value {
    let ms = |d: std::time::Duration| d.as_millis() as u64;
    json!({
        "engines": s.engines.iter().map(|e| json!({
            "engine": e.engine.as_str(),
            "address": e.address.as_str(),
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
    })
}

/// Serves `router` on `listener` until `shutdown`.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: tokio_util::sync::CancellationToken,
) {
    if let Err(e) = axum::serve(listener, router)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
    {
        tracing::warn!(error = %e, "HTTP server stopped");
    }
}
