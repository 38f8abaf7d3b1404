//! The decode side of the side channel against hostile or broken fake
//! prefills on loopback (no NIXL needed): every way a handshake fails is
//! refused with its own error and counted under its own reason.

use std::time::Duration;

use nixl_keepalive::PeerAddr;
use nixl_keepalive_cli::pd::decode::{fetch, HandshakeError};
use nixl_keepalive_cli::pd::wire::{self, HandshakeReply, RankInfo, WireError};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

/// A fake prefill that answers one connection with `answer`.
async fn fake(
    answer: impl FnOnce(tokio::net::TcpStream) -> tokio::task::JoinHandle<()> + Send + 'static,
) -> PeerAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = PeerAddr::from(l.local_addr().unwrap().to_string().as_str());
    tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        let _ = answer(s).await;
    });
    addr
}

fn reply(agents: &[&str]) -> HandshakeReply {
    HandshakeReply {
        engine: "victim".into(),
        incarnation: 1,
        block_size: 4096,
        blocks: 4,
        ranks: agents
            .iter()
            .enumerate()
            .map(|(i, a)| RankInfo {
                agent: (*a).into(),
                base: 0x10000 * (i as u64 + 1),
                metadata: vec![7; 16],
            })
            .collect(),
    }
}

async fn answer_with(payload: Vec<u8>) -> PeerAddr {
    fake(move |mut s| {
        tokio::spawn(async move {
            let _ = wire::read_frame(&mut s, wire::MAX_REQUEST, Duration::from_secs(5)).await;
            let _ = wire::write_frame(&mut s, &payload).await;
        })
    })
    .await
}

#[tokio::test]
async fn a_reply_naming_one_agent_for_two_ranks_is_refused_naming_both_ranks() {
    let addr = answer_with(wire::encode_reply(&reply(&[
        "victim-rank0",
        "victim-rank0",
    ])))
    .await;
    let e = fetch(&addr, Duration::from_secs(5)).await.unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(
            &e,
            HandshakeError::Wire {
                source: WireError::Field { field: "agent", .. },
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        text.contains("ranks 0 and 1") && text.contains("victim-rank0"),
        "{text}"
    );
    assert_eq!(e.reason(), "bad_frame");
    // The same reply with distinct agents is fine (the check is not blanket).
    let addr = answer_with(wire::encode_reply(&reply(&[
        "victim-rank0",
        "victim-rank1",
    ])))
    .await;
    fetch(&addr, Duration::from_secs(5))
        .await
        .expect("distinct agents");
}

#[tokio::test]
async fn early_eof_io_timeout_and_refused_connects_each_get_their_reason() {
    // Closed after the request, before any reply byte.
    let addr = fake(|mut s| {
        tokio::spawn(async move {
            let _ = wire::read_frame(&mut s, wire::MAX_REQUEST, Duration::from_secs(5)).await;
            let _ = s.shutdown().await;
        })
    })
    .await;
    let e = fetch(&addr, Duration::from_secs(5)).await.unwrap_err();
    assert_eq!(e.reason(), "eof", "{e:?}");
    // Half a reply, then close.
    let addr = fake(|mut s| {
        tokio::spawn(async move {
            let _ = wire::read_frame(&mut s, wire::MAX_REQUEST, Duration::from_secs(5)).await;
            let _ = s.write_all(&100u32.to_be_bytes()).await;
            let _ = s.write_all(b"NKPD").await;
        })
    })
    .await;
    let e = fetch(&addr, Duration::from_secs(5)).await.unwrap_err();
    assert_eq!(e.reason(), "eof", "{e:?}");
    // Accepts and never answers.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let addr = fake(move |s| {
        tokio::spawn(async move {
            let _ = rx.await;
            drop(s);
        })
    })
    .await;
    let e = fetch(&addr, Duration::from_millis(200)).await.unwrap_err();
    assert_eq!(e.reason(), "timeout", "{e:?}");
    drop(tx);
    // Reset by the peer: an I/O error (or EOF, if the reset loses the race).
    let addr = fake(|s| {
        tokio::spawn(async move {
            let std = s.into_std().unwrap();
            close_with_reset(std);
        })
    })
    .await;
    let e = fetch(&addr, Duration::from_secs(5)).await.unwrap_err();
    assert!(matches!(e.reason(), "io" | "eof"), "{e:?}");
    // Nobody listening.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = fetch(
        &PeerAddr::from(format!("127.0.0.1:{port}").as_str()),
        Duration::from_secs(5),
    )
    .await
    .unwrap_err();
    assert_eq!(e.reason(), "connect", "{e:?}");
    // A malformed reply.
    let addr = answer_with(b"XXXX\x01\x02".to_vec()).await;
    let e = fetch(&addr, Duration::from_secs(5)).await.unwrap_err();
    assert_eq!(e.reason(), "bad_frame", "{e:?}");
}

/// Closes `s` with unread data in its receive buffer (the decoder's
/// request), which makes Linux reset the connection instead of closing it.
fn close_with_reset(s: std::net::TcpStream) {
    std::thread::sleep(Duration::from_millis(50));
    drop(s);
}
