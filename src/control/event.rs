//! `POST /fault_tolerance/event`: the shape proposed in vLLM's review for
//! a router that broadcasts "these prefills are gone" to every decode.
//!
//! Unlike `/v1/peer_gone` (one engine, `404` when it is not registered),
//! a broadcast reaches decodes that never loaded the engine, and may
//! reach one twice: so this route is idempotent and answers `200` for
//! every node it can read, with what each one is here:
//!
//! - `releasing`: registered; told it is gone (its release follows once
//!   its reads end, at once with none in flight);
//! - `released`: not registered any more, released since the server
//!   started (the last [`RECENT`](super::recent::RECENT) releases are
//!   remembered): nothing to do;
//! - `unknown`: neither: nothing to do;
//! - `unresolved` (addresses only): the name did not resolve to one
//!   address here (the lookup failed, or gave several): nothing was done,
//!   and `error` says why.
//!
//! A body this route cannot read (another `event_type`, a field it does
//! not know, an address that is not `host:port`) is refused whole with a
//! `400` naming what is accepted, before anything is done.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;
use serde_json::{json, Value};

use super::routes::{error, gone_mode, malformed, post_body, stopped, Client, Control, Refusal};
use crate::{EngineId, GoneMode, PeerAddr, PeerRef, ResolveError, Snapshot};

/// The event types accepted.
const EVENT_TYPES: &str = r#""peer_gone""#;

const SHAPE: &str = r#"expected {"event_type": "peer_gone", "nodes": {"engine_ids": ["<engine id>", ...]}} or {"event_type": "peer_gone", "nodes": {"addresses": ["host:port", ...]}} (both lists may be given, with at least one node in all), with optional "mode": "drain" | "fail""#;

/// The body of a `peer_gone` event.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PeerGoneEvent {
    /// Read from the JSON first (`event_type`), to pick the shape.
    #[serde(rename = "event_type")]
    _event_type: serde::de::IgnoredAny,
    nodes: Nodes,
    mode: Option<String>,
}

/// The nodes an event names.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Nodes {
    #[serde(default)]
    engine_ids: Vec<String>,
    #[serde(default)]
    addresses: Vec<String>,
}

/// What became of one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Releasing,
    Released,
    Unknown,
    Unresolved,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Releasing => "releasing",
            Outcome::Released => "released",
            Outcome::Unknown => "unknown",
            Outcome::Unresolved => "unresolved",
        }
    }
}

/// An address of the request: resolved, or why not.
enum Address {
    Resolved(PeerAddr),
    Unresolved(String),
}

/// The event's type, read before the rest of the body: another type is
/// refused by name, whatever else its body holds.
fn event_type(body: &Value) -> Result<&str, Refusal> {
    let bad = |why: String| Err((StatusCode::BAD_REQUEST, why));
    let Some(object) = body.as_object() else {
        return bad(format!("the body is not a JSON object; {SHAPE}"));
    };
    match object.get("event_type") {
        None => bad(format!(
            "no \"event_type\"; accepted event types: {EVENT_TYPES}; {SHAPE}"
        )),
        Some(Value::String(t)) if t == "peer_gone" => Ok(t),
        Some(other) => bad(format!(
            "event_type {other} is not accepted; accepted event types: {EVENT_TYPES}"
        )),
    }
}

/// The request read whole, and each address resolved: nothing is done
/// until every part of it is accepted.
async fn parse(body: &[u8]) -> Result<(Nodes, GoneMode, Vec<(String, Address)>), Refusal> {
    let value: Value = serde_json::from_slice(body).map_err(malformed(SHAPE))?;
    event_type(&value)?;
    let event: PeerGoneEvent = serde_json::from_value(value).map_err(malformed(SHAPE))?;
    let mode = gone_mode(event.mode.as_deref())?;
    let nodes = event.nodes;
    if nodes.engine_ids.is_empty() && nodes.addresses.is_empty() {
        return Err((
            StatusCode::BAD_REQUEST,
            format!("\"nodes\" names no node; {SHAPE}"),
        ));
    }
    if let Some(i) = nodes.engine_ids.iter().position(|e| e.is_empty()) {
        return Err((
            StatusCode::BAD_REQUEST,
            format!("engine_ids[{i}] is empty; an engine id is the prefill's own, as its handshake gave it"),
        ));
    }
    let mut addresses = Vec::with_capacity(nodes.addresses.len());
    for (i, given) in nodes.addresses.iter().enumerate() {
        let resolved = match PeerAddr::resolve(given).await {
            Ok(a) => Address::Resolved(a),
            Err(e @ (ResolveError::Form(_) | ResolveError::NumericHost(_))) => {
                let accepted = "accepted: host:port, as the decode reached the prefill";
                return Err((
                    StatusCode::BAD_REQUEST,
                    format!("addresses[{i}]: {e}; {accepted}"),
                ));
            }
            Err(e) => Address::Unresolved(e.to_string()),
        };
        addresses.push((given.clone(), resolved));
    }
    Ok((nodes, mode, addresses))
}

/// `POST /fault_tolerance/event` (see the module docs).
pub(super) async fn fault_tolerance<R: Send + 'static>(
    State(state): State<Control<R>>,
    Extension(client): Extension<Client>,
    method: Method,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let answered = async {
        let body = post_body(&state, &method, &headers, body, SHAPE).await?;
        let (nodes, mode, addresses) = parse(&body).await?;
        act(&state, nodes.engine_ids, addresses, mode).await
    };
    match answered.await {
        Ok(answer) => (StatusCode::OK, axum::Json(answer)).into_response(),
        Err((status, message)) => error(client, status, message),
    }
}

/// Tells the service about each node that is registered, and says what
/// became of each.
async fn act<R: Send + 'static>(
    state: &Control<R>,
    engine_ids: Vec<String>,
    addresses: Vec<(String, Address)>,
    mode: GoneMode,
) -> Result<Value, Refusal> {
    let handle = &state.handle;
    // Only addresses need the table (the registry knows engine ids).
    let snapshot: Option<Snapshot> = if addresses.is_empty() {
        None
    } else {
        Some(handle.snapshot().await.map_err(|_| stopped())?)
    };
    let gone = |peer: PeerRef, what: &dyn std::fmt::Display| {
        tracing::info!(node = %what, mode = mode.as_str(), "router: peer gone (fault_tolerance event)");
        handle.peer_gone(peer, mode).map_err(|_| stopped())
    };
    let mut recent = state.recent.lock().unwrap_or_else(|e| e.into_inner());
    recent.catch_up(handle);
    let mut out = Vec::with_capacity(engine_ids.len() + addresses.len());
    for given in engine_ids {
        let id = EngineId::from(given.as_str());
        let outcome = if handle.engine(&id).is_some() {
            gone(PeerRef::Engine(id), &crate::text::Escaped(&given))?;
            Outcome::Releasing
        } else if recent.engine_released(&id) {
            Outcome::Released
        } else {
            Outcome::Unknown
        };
        out.push(json!({ "engine_id": given, "outcome": outcome.as_str() }));
    }
    for (given, address) in addresses {
        let address = match address {
            Address::Resolved(a) => a,
            Address::Unresolved(why) => {
                out.push(json!({ "address": given, "outcome": Outcome::Unresolved.as_str(), "error": why }));
                continue;
            }
        };
        let here: Vec<&str> = snapshot
            .iter()
            .flat_map(|s| s.engines.iter())
            .filter(|e| e.address == address)
            .map(|e| e.engine.as_str())
            .collect();
        let outcome = if !here.is_empty() {
            gone(PeerRef::Address(address.clone()), &address)?;
            Outcome::Releasing
        } else if recent.address_released(&address) {
            Outcome::Released
        } else {
            Outcome::Unknown
        };
        let mut node = json!({ "address": given, "outcome": outcome.as_str() });
        if !here.is_empty() {
            node["engine_ids"] = json!(here);
        }
        out.push(node);
    }
    Ok(json!({
        "event_type": "peer_gone",
        "mode": mode.as_str(),
        "nodes": out,
    }))
}
