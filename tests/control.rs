//! The control server's routes through its public API
//! (`nixl_keepalive::control`), over real loopback sockets, against the
//! service on the fake UCX: what a router's broadcast
//! (`POST /fault_tolerance/event`) does to engines that are registered,
//! released, or never were, and what it refuses.
//!
//! Real sockets run on the wall clock (a paused clock would jump the
//! server's head timeout while a socket waits): nothing here waits for
//! time to pass, only for the service's events, each with a deadline.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nixl_keepalive::control::{self, ControlConfig, ControlError, ControlServer, ControlToken};
use nixl_keepalive::fake::{FakeConfig, FakeResources, FakeUcx};
use nixl_keepalive::{
    Config, EngineId, EngineRef, EngineState, Event, GiveUp, KeepaliveHandle, NixlStatus,
};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

mod common;

use common::addr;

const ROUTE: &str = "/fault_tolerance/event";

/// The service on the fake, its control server, and its events.
struct Decode {
    ucx: FakeUcx,
    handle: KeepaliveHandle<FakeResources>,
    events: broadcast::Receiver<Event>,
    control: SocketAddr,
    token: Option<String>,
    shutdown: CancellationToken,
}

async fn decode(token: Option<&str>) -> Decode {
    decode_with(token, Config::default(), None).await
}

async fn decode_with(
    token: Option<&str>,
    config: Config,
    metrics: Option<control::MetricsRender>,
) -> Decode {
    let ucx = FakeUcx::new(FakeConfig::default());
    let shutdown = CancellationToken::new();
    let (handle, _task) = nixl_keepalive::spawn(Arc::new(ucx.clone()), config, shutdown.clone());
    let events = handle.subscribe();
    let mut config = ControlConfig::new("127.0.0.1:0".parse().unwrap())
        .token(token.map(|t| ControlToken::new(t).unwrap()));
    if let Some(render) = metrics {
        config = config.metrics(render);
    }
    let control = control::serve(handle.clone(), config, shutdown.child_token())
        .await
        .expect("binds");
    Decode {
        ucx,
        handle,
        events,
        control,
        token: token.map(str::to_owned),
        shutdown,
    }
}

impl Decode {
    /// A prefill at `10.0.0.n:5600`, registered.
    async fn prefill(&self, n: u8) -> (EngineId, EngineRef) {
        let id = self.ucx.spawn_prefill(addr(n), 1);
        let engine = self.ucx.connect(&self.handle, &addr(n)).await.unwrap();
        (id, engine)
    }

    /// POSTs `body` to `path` (with the token, if any); the status and
    /// the JSON answer.
    async fn post(&self, path: &str, body: &str) -> (u16, Value) {
        let auth = match &self.token {
            Some(t) => format!("Authorization: Bearer {t}\r\n"),
            None => String::new(),
        };
        request(self.control, path, &auth, body).await
    }

    async fn broadcast(&self, event: Value) -> Value {
        let (status, answer) = self.post(ROUTE, &event.to_string()).await;
        assert_eq!(status, 200, "{answer}");
        answer
    }

    async fn released(&mut self, engine: &EngineId) {
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match self.events.recv().await.expect("events flow") {
                    Event::Released { engine: e, .. } if &e == engine => return,
                    _ => {}
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{engine} not released within 10 s"));
    }
}

impl Drop for Decode {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// One HTTP/1.1 POST over a fresh connection; the server closes it after
/// its answer.
async fn request(to: SocketAddr, path: &str, headers: &str, body: &str) -> (u16, Value) {
    let mut stream = TcpStream::connect(to).await.unwrap();
    let raw = format!(
        "POST {path} HTTP/1.1\r\nHost: decode\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(raw.as_bytes()).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut answer))
        .await
        .expect("answered within 10 s")
        .unwrap();
    let (head, json) = answer.split_once("\r\n\r\n").expect("a whole response");
    let status = head[9..12].parse().expect("a status line");
    (status, serde_json::from_str(json).expect("a JSON body"))
}

/// One HTTP/1.1 GET over a fresh connection: the status, the content
/// type and the body.
async fn get(to: SocketAddr, path: &str) -> (u16, String, String) {
    let mut stream = TcpStream::connect(to).await.unwrap();
    let raw = format!("GET {path} HTTP/1.1\r\nHost: decode\r\n\r\n");
    stream.write_all(raw.as_bytes()).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut answer))
        .await
        .expect("answered within 10 s")
        .unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("a whole response");
    let status = head[9..12].parse().expect("a status line");
    let kind = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-type")
                .then(|| value.trim().to_owned())
        })
        .unwrap_or_default();
    (status, kind, body.to_owned())
}

/// The outcome of each node, in order.
fn outcomes(answer: &Value) -> Vec<&str> {
    answer["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| n["outcome"].as_str().expect("an outcome"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_ids_known_and_unknown_are_answered_per_node_and_only_the_known_released() {
    let mut d = decode(None).await;
    let (a, _) = d.prefill(1).await;
    let (b, eb) = d.prefill(2).await;
    let answer = d
        .broadcast(
            json!({"event_type": "peer_gone", "nodes": {"engine_ids": [a.as_str(), "nobody"]}}),
        )
        .await;
    assert_eq!(outcomes(&answer), ["releasing", "unknown"], "{answer}");
    assert_eq!(answer["mode"], "drain");
    assert_eq!(answer["nodes"][0]["engine_id"], a.as_str());
    d.released(&a).await;
    // Twice: idempotent, and now says so.
    let again = d
        .broadcast(
            json!({"event_type": "peer_gone", "nodes": {"engine_ids": [a.as_str(), "nobody"]}}),
        )
        .await;
    assert_eq!(outcomes(&again), ["released", "unknown"], "{again}");
    assert_eq!(eb.state(), EngineState::Live, "{b} was not named");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_release_the_engine_there_and_fail_mode_fails_its_reads_at_once() {
    let mut d = decode(None).await;
    let (a, ea) = d.prefill(1).await;
    let read = ea.begin_read().unwrap();
    let event = json!({
        "event_type": "peer_gone",
        "mode": "fail",
        "nodes": {"addresses": ["10.0.0.1:5600", "10.9.9.9:1"]},
    });
    let answer = d.broadcast(event.clone()).await;
    assert_eq!(outcomes(&answer), ["releasing", "unknown"], "{answer}");
    assert_eq!(answer["nodes"][0]["engine_ids"], json!([a.as_str()]));
    assert_eq!(answer["mode"], "fail");
    tokio::time::timeout(Duration::from_secs(10), read.failed())
        .await
        .expect("the read is failed at once");
    drop(read);
    d.released(&a).await;
    let again = d.broadcast(event).await;
    assert_eq!(outcomes(&again), ["released", "unknown"], "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_still_draining_is_releasing_each_time_until_its_read_ends() {
    let mut d = decode(None).await;
    let (a, ea) = d.prefill(1).await;
    let read = ea.begin_read().unwrap();
    // Both kinds of node in one body, naming the same engine.
    let event = json!({
        "event_type": "peer_gone",
        "nodes": {"engine_ids": [a.as_str()], "addresses": ["10.0.0.1:5600"]},
    });
    for _ in 0..2 {
        let answer = d.broadcast(event.clone()).await;
        assert_eq!(outcomes(&answer), ["releasing"; 2], "{answer}");
    }
    assert_eq!(ea.state(), EngineState::Retiring);
    assert!(!read.is_failed(), "drain lets the read finish");
    read.finish(NixlStatus::SUCCESS);
    d.released(&a).await;
    let answer = d.broadcast(event).await;
    assert_eq!(outcomes(&answer), ["released"; 2], "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_released_on_its_own_before_the_broadcast_is_released_not_unknown() {
    let mut d = decode(None).await;
    let (a, ea) = d.prefill(1).await;
    // The prefill dies; a read says REMOTE_DISCONNECT: released by the
    // service itself, before the router's word.
    d.ucx.crash(&a);
    let read = ea.begin_read().unwrap();
    read.finish(d.ucx.read(&a));
    d.released(&a).await;
    let answer = d
        .broadcast(json!({"event_type": "peer_gone", "nodes": {"engine_ids": [a.as_str()], "addresses": ["10.0.0.1:5600"]}}))
        .await;
    assert_eq!(outcomes(&answer), ["released", "released"], "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_event_type_and_bad_bodies_are_refused_whole_naming_what_is_accepted() {
    let d = decode(None).await;
    let (a, ea) = d.prefill(1).await;
    let cases: &[(&str, &[&str])] = &[
        (
            r#"{"event_type": "node_joined", "nodes": {"engine_ids": ["x"]}}"#,
            &["\"node_joined\" is not accepted", "\"peer_gone\""],
        ),
        (
            r#"{"nodes": {"engine_ids": ["x"]}}"#,
            &["no \"event_type\"", "\"peer_gone\""],
        ),
        (r#"{"event_type": 7}"#, &["7 is not accepted"]),
        (r#"["peer_gone"]"#, &["not a JSON object", "engine_ids"]),
        ("not json", &["malformed JSON", "engine_ids", "addresses"]),
        (
            r#"{"event_type": "peer_gone", "nodes": {"engine_id": ["x"]}}"#,
            &["unknown field `engine_id`", "engine_ids"],
        ),
        (
            r#"{"event_type": "peer_gone", "nodes": {"engine_ids": ["x"]}, "node": 1}"#,
            &["unknown field `node`"],
        ),
        (r#"{"event_type": "peer_gone"}"#, &["missing field `nodes`"]),
        (
            r#"{"event_type": "peer_gone", "nodes": {"engine_ids": []}}"#,
            &["names no node"],
        ),
        (
            r#"{"event_type": "peer_gone", "nodes": {"engine_ids": [""]}}"#,
            &["engine_ids[0] is empty"],
        ),
        (
            r#"{"event_type": "peer_gone", "nodes": {"engine_ids": ["x"]}, "mode": "now"}"#,
            &["\"now\" is not one of \"drain\", \"fail\""],
        ),
    ];
    for (body, needles) in cases {
        let (status, answer) = d.post(ROUTE, body).await;
        assert_eq!(status, 400, "{body}: {answer}");
        let message = answer["error"].as_str().expect("a JSON error");
        for needle in *needles {
            assert!(message.contains(needle), "{body}: {message}");
        }
    }
    // An address that is not host:port refuses the whole body: the
    // engine named beside it is not touched.
    let body = json!({"event_type": "peer_gone", "nodes": {"engine_ids": [a.as_str()], "addresses": ["10.0.0.1"]}});
    let (status, answer) = d.post(ROUTE, &body.to_string()).await;
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"].as_str().unwrap().contains("addresses[0]"),
        "{answer}"
    );
    assert_eq!(ea.state(), EngineState::Live);
    let (status, _) = request(d.control, ROUTE, "", "").await;
    assert_eq!(status, 400, "an empty body is no event either");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_the_event_needs_it_and_off_loopback_a_server_without_one_does_not_start() {
    let d = decode(Some("s3cret")).await;
    let (a, _) = d.prefill(1).await;
    let body =
        json!({"event_type": "peer_gone", "nodes": {"engine_ids": [a.as_str()]}}).to_string();
    let (status, answer) = request(d.control, ROUTE, "", &body).await;
    assert_eq!(status, 401, "{answer}");
    assert!(answer["error"].as_str().unwrap().contains("missing token"));
    let (status, _) = request(d.control, ROUTE, "Authorization: Bearer wrong\r\n", &body).await;
    assert_eq!(status, 401);
    assert_eq!(
        d.handle.engine(&a).map(|e| e.state()),
        Some(EngineState::Live),
        "a refused request retires nothing"
    );
    let (status, answer) = d.post(ROUTE, &body).await;
    assert_eq!(
        (status, outcomes(&answer)),
        (200, vec!["releasing"]),
        "{answer}"
    );

    let everywhere = ControlConfig::new("0.0.0.0:0".parse().unwrap());
    match ControlServer::bind(everywhere).await {
        Err(e @ ControlError::TokenRequired { .. }) => {
            assert!(e.to_string().contains("not a loopback address"), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_v1_route_still_answers_404_for_an_engine_that_is_not_registered() {
    let d = decode(None).await;
    let (a, _) = d.prefill(1).await;
    let (status, answer) = d.post("/v1/peer_gone", r#"{"engine": "nobody"}"#).await;
    assert_eq!(status, 404, "{answer}");
    let (status, answer) = d
        .post("/v1/peer_gone", &json!({"engine": a.as_str()}).to_string())
        .await;
    assert_eq!(status, 202, "{answer}");
    assert_eq!(answer["engine"], a.as_str());
}

/// Where two renderings of the table differ: keys anywhere, values
/// anywhere but a time, which may be `slack_ms` apart (a number under an
/// `_ms` key, or a duration in a `why` sentence).
fn differences(a: &Value, b: &Value, slack_ms: u64, at: &str, out: &mut Vec<String>) {
    let masked = |s: &str| {
        // A `Duration`'s `Debug` (`12.5ms`, `3µs`, `1s`) as `<t>`.
        let mut out = String::new();
        let mut rest = s;
        while let Some(i) = rest.find(|c: char| c.is_ascii_digit()) {
            out.push_str(&rest[..i]);
            let tail = &rest[i..];
            let n = tail
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .unwrap_or(tail.len());
            let unit = ["ns", "µs", "ms", "s"]
                .into_iter()
                .find(|u| tail[n..].starts_with(u));
            match unit {
                Some(_) => out.push_str("<t>"),
                None => out.push_str(&tail[..n]),
            }
            rest = &tail[n + unit.map_or(0, str::len)..];
        }
        out + rest
    };
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys = |m: &serde_json::Map<String, Value>| m.keys().cloned().collect::<Vec<_>>();
            if keys(x) != keys(y) {
                out.push(format!("{at}: keys {:?} vs {:?}", keys(x), keys(y)));
                return;
            }
            for (k, v) in x {
                let w = &y[k];
                let here = format!("{at}.{k}");
                match (v, w) {
                    (Value::Number(p), Value::Number(q)) if k.ends_with("_ms") => {
                        let (p, q) = (p.as_u64().unwrap(), q.as_u64().unwrap());
                        if p.abs_diff(q) > slack_ms {
                            out.push(format!("{here}: {p} vs {q}, over {slack_ms} ms apart"));
                        }
                    }
                    (Value::String(p), Value::String(q)) if k == "why" => {
                        if masked(p) != masked(q) {
                            out.push(format!("{here}: {p:?} vs {q:?}"));
                        }
                    }
                    _ => differences(v, w, slack_ms, &here, out),
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (v, w)) in x.iter().zip(y).enumerate() {
                differences(v, w, slack_ms, &format!("{at}[{i}]"), out);
            }
        }
        _ if a == b => {}
        _ => out.push(format!("{at}: {a} vs {b}")),
    }
}

/// Heartbeats off: between two looks at the table only the time moves.
fn still() -> Config {
    Config::builder().heartbeat_interval(None).build().unwrap()
}

/// A read of `engine` given up as timed out, holding 3 blocks; returns
/// once the engine is stalled.
async fn stall_with_a_given_up_read(
    d: &mut Decode,
    id: &EngineId,
    engine: &EngineRef,
) -> nixl_keepalive::GivenUpRead {
    let given = engine
        .begin_read()
        .unwrap()
        .give_up_holding(GiveUp::TimedOut, 3);
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match d.events.recv().await.expect("events flow") {
                Event::Stalled { engine: e, .. } if &e == id => return,
                _ => {}
            }
        }
    })
    .await
    .expect("stalled within 10 s");
    given
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_route_answers_the_table_s_one_rendering_given_up_transfers_included() {
    let mut d = decode_with(None, still(), None).await;
    let (id, engine) = d.prefill(1).await;
    let _given = stall_with_a_given_up_read(&mut d, &id, &engine).await;
    let started = std::time::Instant::now();
    let ours = serde_json::to_value(d.handle.snapshot().await.unwrap()).unwrap();
    let (status, kind, body) = get(d.control, "/v1/snapshot").await;
    let slack_ms = started.elapsed().as_millis() as u64 + 1;
    assert_eq!((status, kind.as_str()), (200, "application/json"), "{body}");
    let served: Value = serde_json::from_str(&body).unwrap();
    let mut found = Vec::new();
    differences(&ours, &served, slack_ms, "", &mut found);
    assert!(found.is_empty(), "{found:#?}");
    let e = &served["engines"][0];
    assert_eq!(e["state"], "stalled", "{e}");
    assert_eq!(e["given_up"][0]["blocks"], 3, "{e}");
    assert!(e["given_up"][0]["held_for_ms"].is_u64(), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_what_the_runtime_s_renderer_gives_and_404_without_one() {
    let d = decode(None).await;
    let (status, _, body) = get(d.control, "/metrics").await;
    assert_eq!(status, 404, "{body}");
    let d = decode_with(None, still(), Some(Arc::new(|| "m 1\n".to_owned()))).await;
    let (status, kind, body) = get(d.control, "/metrics").await;
    assert_eq!(
        (status, kind.as_str(), body.as_str()),
        (200, "text/plain; version=0.0.4", "m 1\n")
    );
}
