//! One identity per prefill, with real processes on the real NIXL runtime:
//! a hostile prefill replaying a healthy prefill's handshake reply next to
//! it, a prefill listed twice and under an alias, and two prefills started
//! with one engine id. In each, the healthy prefill's reads stay verified
//! the whole time, it is never released, and the newcomer is refused with
//! one log line and a counter.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::decode::{DecodeProc, SUMMARY_PERIOD};
use common::wait::MARGIN;
use common::{report, serial, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;

/// The decode's log level here: its WARN lines are what is counted.
const ENV: &[(&str, &str)] = &[("RUST_LOG", "warn")];

/// `decode` asks a conflicting address again after this pause
/// (`CONFLICT_PAUSE` in `cli/src/pd/decode/reader.rs`), so a retry is within it
/// plus one handshake.
const CONFLICT_RETRY: Duration = Duration::from_secs(12);

/// Waits until the conflicting address was refused again (a retry, after
/// the pause): the window over which "logged once, published once" is
/// judged.
fn wait_for_a_second_refusal(decode: &DecodeProc, kind: &str) -> f64 {
    decode.wait_metric(
        &format!("nixl_keepalive_identity_conflicts_total{{kind=\"{kind}\"}}"),
        CONFLICT_RETRY + MARGIN,
        |v| v >= 2.0,
    )
}

/// Waits until two read summaries were printed after `since` (one every
/// [`SUMMARY_PERIOD`]): the healthy engine's reads are then judged over
/// them.
fn wait_for_two_summaries(decode: &mut DecodeProc, since: Instant) {
    decode.wait_until(
        "two read summaries after the registration",
        SUMMARY_PERIOD * 2 + MARGIN,
        |d| summaries(d, since).len() >= 2,
    );
}

/// One frame of the side channel: a 4-byte big-endian length, the bytes.
fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut payload)?;
    Ok(payload)
}

fn write_frame(s: &mut TcpStream, payload: &[u8]) -> std::io::Result<()> {
    s.write_all(&(payload.len() as u32).to_be_bytes())?;
    s.write_all(payload)
}

/// The healthy prefill's reply, byte for byte, as a decoder got it.
fn capture_reply(prefill: &PrefillProc) -> Vec<u8> {
    let mut s = TcpStream::connect(prefill.addr.as_str()).expect("connect to the prefill");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write_frame(&mut s, &nixl_keepalive_cli::pd::wire::encode_request()).unwrap();
    read_frame(&mut s).expect("the prefill's reply")
}

/// A hostile side channel that answers every handshake with `reply` once
/// `armed` is set (before, it closes every connection unanswered: the
/// healthy prefill registers first, as it would in production, where the
/// replay comes later).
fn replay(reply: Vec<u8>, armed: Arc<AtomicBool>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { continue };
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            if armed.load(Ordering::SeqCst) && read_frame(&mut s).is_ok() {
                let _ = write_frame(&mut s, &reply);
            }
        }
    });
    addr
}

/// The read summaries (`reads: verified=N corrupt=N failed=N ...`)
/// printed after `since`.
fn summaries(decode: &DecodeProc, since: Instant) -> Vec<(u64, u64, u64)> {
    decode
        .matching(&["reads: verified="])
        .iter()
        .filter(|(at, _)| *at > since)
        .map(|(_, l)| {
            let field = |k: &str| -> u64 {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(k))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("no {k} in {l}"))
            };
            (field("verified="), field("corrupt="), field("failed="))
        })
        .collect()
}

/// The healthy engine was read the whole time since its registration
/// (`registered`), every byte right, and never released.
fn assert_healthy_kept(decode: &DecodeProc, engine: &str, registered: Instant) {
    let sums = summaries(decode, registered);
    assert!(sums.len() >= 2, "read summaries: {sums:?}");
    for pair in sums.windows(2) {
        assert!(pair[1].0 > pair[0].0, "reads went on: {sums:?}");
    }
    let last = sums.last().unwrap();
    assert_eq!(
        (last.1, last.2),
        (0, 0),
        "no corrupt or failed read: {sums:?}"
    );
    let released = decode.matching(&[&format!("event: released engine={engine}")]);
    assert!(
        released.is_empty(),
        "the healthy engine was released: {released:?}"
    );
    let registered = decode.matching(&[&format!("event: registered engine={engine}")]);
    assert_eq!(registered.len(), 1, "registered once, never reloaded");
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_hostile_prefill_replaying_a_healthy_reply_is_refused_and_the_healthy_one_keeps_reading() {
    let _rt = real_runtime();
    let _serial = serial();
    let healthy = PrefillProc::start(&PrefillSpec::default());
    let armed = Arc::new(AtomicBool::new(false));
    let hostile = replay(capture_reply(&healthy), armed.clone());
    let mut decode = DecodeProc::start(
        &["--prefill", healthy.addr.as_str(), "--prefill", &hostile],
        ENV,
        MARGIN,
    );
    let (registered, _) = decode.wait_line(
        &format!("event: registered engine={}", healthy.engine),
        MARGIN,
    );
    armed.store(true, Ordering::SeqCst);
    // The hostile address is asked again within one retry pause (4 s).
    decode.wait_line("event: conflict kind=engine_elsewhere", MARGIN);
    // The replay refused again (the reader retries it after a pause), and
    // two read summaries of the healthy engine.
    let conflicts = wait_for_a_second_refusal(&decode, "engine_elsewhere");
    wait_for_two_summaries(&mut decode, registered);
    assert_healthy_kept(&decode, &healthy.engine, registered);
    decode.wait_metric(
        "nixl_keepalive_pd_handshake_failures_total{reason=\"conflict\"}",
        MARGIN,
        |v| v >= 1.0,
    );
    let log = decode.log_text();
    let warned = log.matches("identity conflict").count();
    assert_eq!(warned, 1, "one WARN line for the conflict:\n{log}");
    assert_eq!(decode.matching(&["event: conflict"]).len(), 1);
    report(&format!(
        "hostile replay next to a healthy prefill: refused {conflicts} time(s), one WARN, healthy reads {:?}",
        summaries(&decode, registered).last()
    ));
    decode.stop();
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn one_prefill_listed_twice_and_under_an_alias_gets_one_reader_and_one_warning_per_duplicate() {
    let _rt = real_runtime();
    let _serial = serial();
    let p = PrefillProc::start(&PrefillSpec::default());
    let port = p.addr.as_str().rsplit_once(':').unwrap().1.to_string();
    let alias = format!("localhost:{port}");
    let mut decode = DecodeProc::start(
        &[
            "--prefill",
            p.addr.as_str(),
            "--prefill",
            &alias,
            "--prefill",
            p.addr.as_str(),
        ],
        ENV,
        MARGIN,
    );
    // Printed at start-up, before the first handshake.
    let (registered, _) =
        decode.wait_line(&format!("event: registered engine={}", p.engine), MARGIN);
    assert_eq!(
        decode.matching(&["warning: --prefill"]).len(),
        2,
        "one warning per duplicate: {:#?}",
        decode.tail(20)
    );
    wait_for_two_summaries(&mut decode, registered);
    assert_healthy_kept(&decode, &p.engine, registered);
    assert!(decode.matching(&["event: conflict"]).is_empty());
    decode.stop();
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn two_prefills_started_with_one_engine_id_do_not_churn_and_the_first_keeps_reading() {
    let _rt = real_runtime();
    let _serial = serial();
    let id = common::unique("pinned");
    let spec = PrefillSpec {
        engine_id: Some(id.clone()),
        ..Default::default()
    };
    let first = PrefillProc::start(&spec);
    let second = PrefillProc::start(&spec);
    // Whichever handshakes first is kept; the other is the conflict.
    let mut decode = DecodeProc::start(
        &[
            "--prefill",
            first.addr.as_str(),
            "--prefill",
            second.addr.as_str(),
        ],
        ENV,
        MARGIN,
    );
    let (registered, _) = decode.wait_line(&format!("event: registered engine={id}"), MARGIN);
    decode.wait_line("event: conflict kind=engine_elsewhere", MARGIN);
    wait_for_a_second_refusal(&decode, "engine_elsewhere");
    wait_for_two_summaries(&mut decode, registered);
    assert_healthy_kept(&decode, &id, registered);
    assert_eq!(decode.matching(&["event: conflict"]).len(), 1);
    let log = decode.log_text();
    assert_eq!(log.matches("identity conflict").count(), 1, "{log}");
    decode.stop();
}

/// Issue 30, item 8: a prefill that conflicts at an address (the engine
/// id of a healthy prefill registered elsewhere) earns a back-off there;
/// an honest prefill that starts at that address after it (a new engine
/// id) must not inherit it. Before, the reader slept the whole conflict
/// pause (10 s) whoever came next; now the back-off is per claimant, and
/// a reader waiting out a conflict asks the address every retry step and
/// ends the wait as soon as another claimant (or nobody) answers.
#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn an_honest_prefill_starting_where_a_conflicting_one_was_is_registered_without_its_back_off() {
    let _rt = real_runtime();
    let _serial = serial();
    let id = common::unique("pinned");
    let healthy = PrefillProc::start(&PrefillSpec {
        engine_id: Some(id.clone()),
        ..Default::default()
    });
    let listen = common::listen_outside_ephemeral();
    let mut decode = DecodeProc::start(
        &["--prefill", healthy.addr.as_str(), "--prefill", &listen],
        ENV,
        MARGIN,
    );
    decode.wait_line(&format!("event: registered engine={id}"), MARGIN);
    // The same engine id at the other address: refused, twice (the second
    // refusal of one claimant is what earns the long pause).
    let mut conflicting = PrefillProc::start(&PrefillSpec {
        engine_id: Some(id.clone()),
        listen: Some(listen.clone()),
        ..Default::default()
    });
    wait_for_a_second_refusal(&decode, "engine_elsewhere");
    let killed = conflicting.kill();
    let honest = PrefillProc::start(&PrefillSpec {
        listen: Some(listen.clone()),
        ..Default::default()
    });
    let (registered, _) = decode.wait_line(
        &format!("event: registered engine={}", honest.engine),
        CONFLICT_RETRY + MARGIN,
    );
    let waited = registered - killed;
    assert!(
        waited < Duration::from_secs(5),
        "the honest prefill waited {waited:?} after the conflicting one was killed (the conflict pause is 10 s)"
    );
    report(&format!(
        "conflicting prefill killed -> honest prefill at its address registered {} later (conflict pause 10 s)",
        common::ms(waited)
    ));
    decode.stop();
}
