//! The accept loop: a connection only with a place for it, its request
//! head read and checked within the limits before hyper sees it, one
//! request per connection, every refusal of ours a JSON error (see the
//! module docs of `control` for the numbers).

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use axum::{Extension, Router};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::routes::{refused, Client};
use super::Limits;
use crate::log_limit::LogLimiter;

/// Serves `router` on `listener` until `shutdown`, within `limits` (see
/// the module docs).
///
/// Cancel safety: stop it with `shutdown`; connections still open are
/// closed.
pub(super) async fn accept_loop(
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

    use crate::control::recent::Recent;
    use crate::control::routes::Control;
    use crate::control::{router, ControlToken};
    use crate::{
        AgentName, Config, EngineId, Keepalive, ReleaseStep, Transfers, Transport, TransportError,
    };

    use super::*;

    /// The service needs a transport; no engine is ever registered here.
    struct NoTransport;

    impl Transport for NoTransport {
        type Resources = ();
        fn notify(&self, _: &AgentName, _: &[u8]) -> Result<(), TransportError> {
            Ok(())
        }
        fn release_with(
            &self,
            _: &EngineId,
            _: &[AgentName],
            _: (),
            _: Transfers,
        ) -> Vec<ReleaseStep> {
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
            recent: Arc::new(Mutex::new(Recent::new(&handle))),
            handle,
            token: token.map(|t| ControlToken::new(t).unwrap()),
            token_for_reads,
            metrics: None,
            control: true,
            body_timeout: TEST_LIMITS.body_timeout,
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(accept_loop(
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
