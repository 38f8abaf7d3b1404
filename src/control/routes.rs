//! The routes: what each answers, who may ask, and the one JSON shape of
//! every refusal.

use std::net::IpAddr;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;
use serde_json::json;

use super::recent::Recent;
use super::{ControlToken, MetricsRender, MAX_BODY};
use crate::log_limit::LogLimiter;
use crate::{EngineId, GoneMode, KeepaliveHandle, PeerAddr, PeerRef};

/// Every route, for the messages of the 404 and the 405.
const ROUTES: &str =
    "POST /v1/peer_gone, POST /fault_tolerance/event, GET /v1/snapshot, GET /metrics";

/// Lines about refused requests: one per client and status per period.
static REFUSALS: LazyLock<Mutex<LogLimiter<(IpAddr, u16)>>> = LazyLock::new(Default::default);

/// The client of a request, put there by the connection.
#[derive(Clone, Copy, Debug)]
pub(super) struct Client(pub(super) IpAddr);

/// What the handlers share.
pub(super) struct Control<R> {
    /// The service.
    pub(super) handle: KeepaliveHandle<R>,
    /// The bearer token, when requests need one.
    pub(super) token: Option<ControlToken>,
    /// Whether GETs need the token too (a non-loopback bind).
    pub(super) token_for_reads: bool,
    /// Prometheus rendering, when metrics are on.
    pub(super) metrics: Option<MetricsRender>,
    /// Whether the control routes are served (else `/metrics` alone).
    pub(super) control: bool,
    /// How long a request body may take to arrive.
    pub(super) body_timeout: Duration,
    /// The engines released lately, for the fault-tolerance route.
    pub(super) recent: Arc<Mutex<Recent>>,
}

impl<R> Clone for Control<R> {
    fn clone(&self) -> Self {
        Control {
            handle: self.handle.clone(),
            token: self.token.clone(),
            token_for_reads: self.token_for_reads,
            metrics: self.metrics.clone(),
            control: self.control,
            body_timeout: self.body_timeout,
            recent: self.recent.clone(),
        }
    }
}

/// Counts and logs (once per client and status per period) a refusal.
pub(super) fn refused(client: IpAddr, status: StatusCode, message: &str) {
    metrics::counter!("nixl_keepalive_control_errors_total", "status" => status.as_str().to_string())
        .increment(1);
    let told = REFUSALS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .admit((client, status.as_u16()), tokio::time::Instant::now());
    if let Some(suppressed) = told {
        tracing::info!(%client, status = status.as_u16(), message = %crate::text::Escaped(message), suppressed, "control request refused");
    }
}

/// A refusal: counted, logged (limited), and its JSON body.
pub(super) fn error(client: Client, status: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    refused(client.0, status, &message);
    (status, axum::Json(json!({ "error": message }))).into_response()
}

/// A refused request: its status and the message the JSON error carries.
pub(super) type Refusal = (StatusCode, String);

/// The one answer of every route once the service has stopped.
pub(super) fn stopped() -> Refusal {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        "the keepalive service has stopped: every engine is released or handed back".to_owned(),
    )
}

/// Checks the bearer token when this request needs one.
fn authorize<R>(state: &Control<R>, method: &Method, headers: &HeaderMap) -> Result<(), Refusal> {
    let Some(token) = &state.token else {
        return Ok(());
    };
    if *method == Method::GET && !state.token_for_reads {
        return Ok(());
    }
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Err((
            StatusCode::UNAUTHORIZED,
            "missing token: send the header 'Authorization: Bearer <token>' with the control token"
                .to_owned(),
        ));
    };
    let given = value.to_str().ok().and_then(bearer_token).unwrap_or("");
    if !same(given.as_bytes(), token.as_str().as_bytes()) {
        return Err((
            StatusCode::UNAUTHORIZED,
            "bad token: 'Authorization: Bearer <token>' does not match the control token"
                .to_owned(),
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

pub(super) async fn not_found(
    Extension(client): Extension<Client>,
    method: Method,
    uri: axum::http::Uri,
) -> Response {
    let what = format!("no route {method} {}", uri.path());
    unrouted(client, StatusCode::NOT_FOUND, what)
}

pub(super) async fn method_not_allowed(
    Extension(client): Extension<Client>,
    method: Method,
    uri: axum::http::Uri,
) -> Response {
    let what = format!("{method} is not accepted on {}", uri.path());
    unrouted(client, StatusCode::METHOD_NOT_ALLOWED, what)
}

/// A request no route takes: what was wrong, and every route.
fn unrouted(client: Client, status: StatusCode, what: String) -> Response {
    error(client, status, format!("{what}; routes: {ROUTES}"))
}

pub(super) async fn metrics<R>(
    State(state): State<Control<R>>,
    Extension(client): Extension<Client>,
    method: Method,
    headers: HeaderMap,
) -> Response {
    if let Err((status, message)) = authorize(&state, &method, &headers) {
        return error(client, status, message);
    }
    match &state.metrics {
        Some(render) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            render(),
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

pub(super) async fn peer_gone<R: Send + 'static>(
    State(state): State<Control<R>>,
    Extension(client): Extension<Client>,
    method: Method,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let asked = async {
        // The steps, each refusing with its status and message.
        let body = post_body(&state, &method, &headers, body, PEER_GONE_SHAPE).await?;
        let request: PeerGoneRequest =
            serde_json::from_slice(&body).map_err(malformed(PEER_GONE_SHAPE))?;
        let mode = gone_mode(request.mode.as_deref())?;
        let (peer, engine) = find_peer(&state, request.engine, request.address).await?;
        Ok((peer, engine, mode))
    };
    let (peer, engine, mode) = match asked.await {
        Ok(asked) => asked,
        Err((status, message)) => return error(client, status, message),
    };
    let mode_name = mode.as_str();
    tracing::info!(%engine, mode = mode_name, "router: peer gone");
    if state.handle.peer_gone(peer, mode).is_err() {
        let (status, message) = stopped();
        return error(client, status, message);
    }
    (
        StatusCode::ACCEPTED,
        axum::Json(json!({ "accepted": true, "engine": engine, "mode": mode_name })),
    )
        .into_response()
}

/// A POST's body, once its token is checked: at most `MAX_BODY` bytes
/// within the body timeout. `shape` is what the route accepts, for the
/// refusals.
pub(super) async fn post_body<R>(
    state: &Control<R>,
    method: &Method,
    headers: &HeaderMap,
    body: Body,
    shape: &str,
) -> Result<axum::body::Bytes, Refusal> {
    authorize(state, method, headers)?;
    match tokio::time::timeout(state.body_timeout, axum::body::to_bytes(body, MAX_BODY)).await {
        Ok(Ok(body)) => Ok(body),
        Ok(Err(_)) => Err((
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("body over {MAX_BODY} bytes (or cut short); {shape}"),
        )),
        Err(_) => Err((
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the body did not arrive within {:?}; send it with the request; {shape}",
                state.body_timeout
            ),
        )),
    }
}

/// The refusal of a body that is not the JSON a route accepts: `400`
/// with serde's words and the route's `shape`.
pub(super) fn malformed(shape: &str) -> impl Fn(serde_json::Error) -> Refusal + '_ {
    move |e| {
        (
            StatusCode::BAD_REQUEST,
            format!("malformed JSON body ({e}); {shape}"),
        )
    }
}

/// A request's `mode`: `drain` when not given.
pub(super) fn gone_mode(mode: Option<&str>) -> Result<GoneMode, Refusal> {
    match mode {
        None | Some("drain") => Ok(GoneMode::Drain),
        Some("fail") => Ok(GoneMode::Fail),
        Some(other) => Err((
            StatusCode::BAD_REQUEST,
            format!("mode {other:?} is not one of \"drain\", \"fail\""),
        )),
    }
}

/// The registered engine `/v1/peer_gone` names, by id or by address, and
/// its id for the reply; `404` when none is.
async fn find_peer<R: Send + 'static>(
    state: &Control<R>,
    engine: Option<String>,
    address: Option<String>,
) -> Result<(PeerRef, String), Refusal> {
    match (engine, address) {
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
            let snapshot = state.handle.snapshot().await.map_err(|_| stopped())?;
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

pub(super) async fn snapshot<R: Send + 'static>(
    State(state): State<Control<R>>,
    Extension(client): Extension<Client>,
    method: Method,
    headers: HeaderMap,
) -> Response {
    if let Err((status, message)) = authorize(&state, &method, &headers) {
        return error(client, status, message);
    }
    match state.handle.snapshot().await {
        // The table's one rendering (`Snapshot`'s `Serialize`), the one
        // the Python package's `Keepalive.snapshot()` returns too.
        Ok(s) => axum::Json(s).into_response(),
        Err(_) => {
            let (status, message) = stopped();
            error(client, status, message)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::bearer_token;

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
}
