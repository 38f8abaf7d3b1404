//! What the service tells the decoder runtime, so that it can fail
//! requests instead of letting them hang.

use std::time::Duration;

use crate::error::Conflict;
use crate::names::{EngineId, PeerAddr};
use crate::registration::RegistrationId;
use crate::NixlStatus;

/// Where a status came from. One classifier judges every status
/// whatever its source; the source only says where it was seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Source {
    /// A heartbeat notification (`genNotif`).
    Heartbeat,
    /// A transfer's result (`postXferReq` / `getXferStatus`), reported by
    /// the runtime through its read guard or engine reference.
    Transfer,
}

impl Source {
    /// A short lowercase name, used in logs and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Heartbeat => "heartbeat",
            Source::Transfer => "transfer",
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an engine was released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReleaseReason {
    /// A heartbeat or transfer returned REMOTE_DISCONNECT.
    Unreachable,
    /// A new engine id registered at its address.
    Replaced,
    /// The same engine id registered again (a pinned id came back).
    Reregistered,
    /// The router or orchestrator said the peer is gone.
    PeerGone,
    /// The service shut down.
    Shutdown,
    /// Its reads in flight stopped completing (a hung peer).
    Stalled,
    /// A transfer or notification to one of its own agents answered
    /// NOT_FOUND: NIXL no longer holds its metadata (invalidated or
    /// re-registered under it). Released and connected again, never kept
    /// as if healthy.
    MetadataLost,
}

impl ReleaseReason {
    /// A short lowercase name, used in logs and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::Unreachable => "unreachable",
            ReleaseReason::Replaced => "replaced",
            ReleaseReason::Reregistered => "reregistered",
            ReleaseReason::PeerGone => "peer_gone",
            ReleaseReason::Shutdown => "shutdown",
            ReleaseReason::Stalled => "stalled",
            ReleaseReason::MetadataLost => "metadata_lost",
        }
    }
}

/// What a release waited for between the engine being marked and its NIXL
/// state being handed to the transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct WaitedFor {
    /// From the mark to the start of the release.
    pub duration: Duration,
    /// Reads that were in flight when the engine was marked.
    pub reads_in_flight_at_mark: u64,
    /// Whether a handshake at the engine's address held the release back.
    pub handshake: bool,
}

/// One thing that happened to a peer. Subscribe with
/// [`crate::KeepaliveHandle::subscribe`]. Every event about an engine names
/// the registration it is about: the unit of an engine's lifecycle (see
/// [`crate::EngineRef::registration`], [`crate::EngineRef::released`]).
///
/// New kinds of event and new fields of a kind may come in any release
/// (both are `#[non_exhaustive]`): match the ones you act on and end with
/// `_ => {}`, and name fields with `..`. Its `Display` is the one text form
/// of an event, `<kind> key=value ...` (what `nixl-keepalive decode`
/// prints after `event: `); with the `serde` feature it serializes as a
/// map of the same fields under `"event": <kind>`. Both walk
/// [`Event::each_field`], as the Python package's event dicts do.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// An engine registered after its handshake.
    #[non_exhaustive]
    Registered {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// Its side-channel address.
        address: PeerAddr,
    },
    /// A heartbeat or transfer returned REMOTE_DISCONNECT.
    #[non_exhaustive]
    Unreachable {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// The raw status that said so.
        status: NixlStatus,
        /// Where it was seen.
        source: Source,
    },
    /// A new engine id registered at a known address (or the same id again:
    /// then `old == new`).
    #[non_exhaustive]
    Replaced {
        /// The engine that was at the address.
        old: EngineId,
        /// Its registration, which is released once idle.
        old_registration: RegistrationId,
        /// The engine there now.
        new: EngineId,
        /// The address.
        address: PeerAddr,
    },
    /// The router or orchestrator said the engine is gone.
    #[non_exhaustive]
    Retiring {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// Whether its reads were failed at once.
        fail_reads: bool,
    },
    /// An engine's reads stopped completing while the decoder's other
    /// reads went on: for the read-stall bound, or a read the runtime gave
    /// up as timed out got no answer. The peer is alive to UCX but hung
    /// (frozen, deadlocked, NIC gone). With the `fail` action its reads are
    /// failed and it is released once they end; with `report` it is only
    /// reported (once per stall).
    #[non_exhaustive]
    Stalled {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// Reads in flight when it was found stalled.
        reads_in_flight: u64,
        /// How long at least it has had a read outstanding and no read
        /// completed (from when the service first saw it: the stall began
        /// at most one check period earlier).
        stalled_for: Duration,
        /// Reads the runtime gave up as timed out, unanswered, since the
        /// engine's last completion (the runtime's verdict; 0 when the
        /// read-stall bound decided).
        given_up: u64,
        /// Whether its reads were failed (action `fail`).
        failed: bool,
    },
    /// Reads in flight from an engine were failed (unreachable, or gone in
    /// `fail` mode); their guards report `is_failed()`.
    #[non_exhaustive]
    ReadsFailed {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// How many reads were in flight.
        count: u64,
    },
    /// An error that is not a disconnect: counted, logged, never a release.
    #[non_exhaustive]
    TransientError {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// The raw status.
        status: NixlStatus,
        /// Where it was seen.
        source: Source,
    },
    /// The engine's NIXL state was given back.
    #[non_exhaustive]
    Released {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// Why.
        reason: ReleaseReason,
        /// What the release waited for.
        waited_for: WaitedFor,
        /// Release steps that failed with something other than NOT_FOUND.
        failed_steps: usize,
        /// The transport panicked while releasing: what it had done is
        /// unknown, and nothing is retried (its resources were consumed).
        panicked: bool,
        /// UCX endpoints the release could not close (NIXL's own close
        /// mode keeps a live peer's endpoint, and its socket, until the
        /// agent is destroyed; see `docs/design/releases.md` in the
        /// repository). 0 when every endpoint was closed or none was
        /// observed.
        endpoints_left_open: u32,
    },
    /// Two sources claimed one identity (see [`Conflict`]): the newcomer
    /// was refused, the registered engine kept. Published once per
    /// conflict (both sides the same); repeats are only counted.
    #[non_exhaustive]
    Conflict {
        /// What collided.
        conflict: Conflict,
    },
    /// A transport call panicked. Not a disconnect: the engine is kept
    /// (a heartbeat) or counted as released (a release, see
    /// [`Event::Released::panicked`]).
    #[non_exhaustive]
    TransportPanicked {
        /// The engine the call was for.
        engine: EngineId,
        /// Its registration.
        registration: RegistrationId,
        /// The call: `genNotif` or `release`.
        call: &'static str,
        /// The panic's message, when it was text.
        message: String,
    },
}

impl Event {
    /// The registration the event is about: for [`Event::Replaced`] the
    /// old one (the registration that goes); `None` for a
    /// [`Event::Conflict`], which is refused before any registration
    /// exists. Lets a caller follow one registration's lifecycle without
    /// matching every variant.
    pub fn registration(&self) -> Option<RegistrationId> {
        match self {
            Event::Registered { registration, .. }
            | Event::Unreachable { registration, .. }
            | Event::Retiring { registration, .. }
            | Event::Stalled { registration, .. }
            | Event::ReadsFailed { registration, .. }
            | Event::TransientError { registration, .. }
            | Event::Released { registration, .. }
            | Event::TransportPanicked { registration, .. } => Some(*registration),
            Event::Replaced {
                old_registration, ..
            } => Some(*old_registration),
            Event::Conflict { .. } => None,
        }
    }
}

/// One field's value, as [`Event::each_field`] gives it: what it is
/// decides how a rendering writes it. New kinds of value may come in any
/// release: end a match with a fallback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventField<'a> {
    /// A name from a peer (engine id, address): escaped in the line, a
    /// string as it is when serialized.
    Name(&'a str),
    /// Free text (a conflict's detail, a panic's message): quoted in the
    /// line, so it stays one field whatever it holds.
    Text(&'a str),
    /// A fixed lowercase word of ours (a reason, a source).
    Word(&'static str),
    /// A count or a registration id.
    Number(u64),
    /// Yes or no.
    Flag(bool),
    /// A raw NIXL status: `NAME (raw)` in the line; the raw number, and
    /// its name under `<key>_name`, when serialized.
    Status(NixlStatus),
    /// A time in whole milliseconds (the key says `_ms`), the one unit of
    /// every rendering.
    Millis(u64),
}

impl Event {
    /// The kind, as the first word of the line (`registered`,
    /// `unreachable`, `replaced`, `retiring`, `stalled`, `reads_failed`,
    /// `transient_error`, `released`, `conflict`, `transport_panicked`).
    pub fn kind(&self) -> &'static str {
        match self {
            Event::Registered { .. } => "registered",
            Event::Unreachable { .. } => "unreachable",
            Event::Replaced { .. } => "replaced",
            Event::Retiring { .. } => "retiring",
            Event::Stalled { .. } => "stalled",
            Event::ReadsFailed { .. } => "reads_failed",
            Event::TransientError { .. } => "transient_error",
            Event::Released { .. } => "released",
            Event::Conflict { .. } => "conflict",
            Event::TransportPanicked { .. } => "transport_panicked",
        }
    }

    /// Every field of the event with its key, in the order the line shows
    /// them, stopping at the first error `f` returns. The one walk every
    /// rendering of an event makes: `Display`, `Serialize` and the Python
    /// package's event dicts, so that they cannot disagree on a key, a
    /// unit or an order (they did, when each had its own list). A
    /// rendering of its own should walk it too, writing the kind
    /// ([`Event::kind`]) first.
    ///
    /// The keys are the line's: `reads`, `stalled_ms` and `given_up` for
    /// [`Event::Stalled`]; `waited_ms`, `reads_at_mark` and `handshake`
    /// (the [`WaitedFor`], flat) for [`Event::Released`]; `old`,
    /// `old_registration`, `new` and `address` for [`Event::Replaced`];
    /// `kind` (what collided, [`Conflict::kind`]), `engine` and `detail`
    /// for [`Event::Conflict`].
    pub fn each_field<E>(
        &self,
        mut f: impl FnMut(&'static str, EventField<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        use EventField::*;
        let id = |r: &RegistrationId| Number(r.get());
        let ms = |d: &Duration| Millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        match self {
            Event::Registered {
                engine,
                registration,
                address,
            } => {
                f("engine", Name(engine.as_str()))?;
                f("registration", id(registration))?;
                f("address", Name(address.as_str()))
            }
            Event::Unreachable {
                engine,
                registration,
                status,
                source,
            }
            | Event::TransientError {
                engine,
                registration,
                status,
                source,
            } => {
                f("engine", Name(engine.as_str()))?;
                f("registration", id(registration))?;
                f("status", Status(*status))?;
                f("source", Word(source.as_str()))
            }
            Event::Replaced {
                old,
                old_registration,
                new,
                address,
            } => {
                f("old", Name(old.as_str()))?;
                f("old_registration", id(old_registration))?;
                f("new", Name(new.as_str()))?;
                f("address", Name(address.as_str()))
            }
            Event::Retiring {
                engine,
                registration,
                fail_reads,
            } => {
                f("engine", Name(engine.as_str()))?;
                f("registration", id(registration))?;
                f("fail_reads", Flag(*fail_reads))
            }
            Event::Stalled {
                engine,
                registration,
                reads_in_flight,
                stalled_for,
                given_up,
                failed,
            } => {
                f("engine", Name(engine.as_str()))?;
                f("registration", id(registration))?;
                f("reads", Number(*reads_in_flight))?;
                f("stalled_ms", ms(stalled_for))?;
                f("given_up", Number(*given_up))?;
                f("failed", Flag(*failed))
            }
            Event::ReadsFailed {
                engine,
                registration,
                count,
            } => {
                f("engine", Name(engine.as_str()))?;
                f("registration", id(registration))?;
                f("count", Number(*count))
            }
            Event::Released {
                engine,
                registration,
                reason,
                waited_for,
                failed_steps,
                panicked,
                endpoints_left_open,
            } => {
                f("engine", Name(engine.as_str()))?;
                f("registration", id(registration))?;
                f("reason", Word(reason.as_str()))?;
                f("waited_ms", ms(&waited_for.duration))?;
                f("reads_at_mark", Number(waited_for.reads_in_flight_at_mark))?;
                f("handshake", Flag(waited_for.handshake))?;
                f("failed_steps", Number(*failed_steps as u64))?;
                f("panicked", Flag(*panicked))?;
                f(
                    "endpoints_left_open",
                    Number(u64::from(*endpoints_left_open)),
                )
            }
            Event::Conflict { conflict } => {
                f("kind", Word(conflict.kind()))?;
                f("engine", Name(conflict.engine().as_str()))?;
                f("detail", Text(&conflict.to_string()))
            }
            Event::TransportPanicked {
                engine,
                registration,
                call,
                message,
            } => {
                f("engine", Name(engine.as_str()))?;
                f("registration", id(registration))?;
                f("call", Word(call))?;
                f("message", Text(message))
            }
        }
    }
}

/// `<kind> key=value ...`, one line whatever a peer sent: names escaped,
/// free text quoted, times in milliseconds. What `nixl-keepalive decode`
/// prints after `event: `, and what the demo's log shows.
impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.kind())?;
        self.each_field(|key, value| {
            write!(f, " {key}=")?;
            match value {
                EventField::Name(name) => crate::text::write_escaped_uncut(f, name),
                EventField::Text(text) => write!(f, "{text:?}"),
                EventField::Word(word) => f.write_str(word),
                EventField::Number(n) => write!(f, "{n}"),
                EventField::Flag(b) => write!(f, "{b}"),
                EventField::Status(status) => write!(f, "{status}"),
                EventField::Millis(ms) => write!(f, "{ms}"),
            }
        })
    }
}

/// A map of the line's fields under `"event": <kind>`: names and text as
/// strings, counts as numbers, a status as its raw number with its name
/// beside it (`"status": -10, "status_name": "NIXL_ERR_REMOTE_DISCONNECT"`),
/// times in whole milliseconds.
#[cfg(feature = "serde")]
impl serde::Serialize for Event {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("event", self.kind())?;
        self.each_field(|key, value| match value {
            EventField::Name(s) | EventField::Text(s) => map.serialize_entry(key, s),
            EventField::Word(word) => map.serialize_entry(key, word),
            EventField::Number(n) => map.serialize_entry(key, &n),
            EventField::Flag(b) => map.serialize_entry(key, &b),
            EventField::Status(status) => {
                map.serialize_entry(key, &status.raw())?;
                map.serialize_entry(&format!("{key}_name"), status.name())
            }
            EventField::Millis(ms) => map.serialize_entry(key, &ms),
        })?;
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn released() -> Event {
        Event::Released {
            engine: EngineId::from("p-1"),
            registration: RegistrationId(7),
            reason: ReleaseReason::Unreachable,
            waited_for: WaitedFor {
                duration: Duration::from_micros(2_500),
                reads_in_flight_at_mark: 1,
                handshake: false,
            },
            failed_steps: 0,
            panicked: false,
            endpoints_left_open: 0,
        }
    }

    #[test]
    fn the_line_is_the_kind_then_every_field_in_order() {
        assert_eq!(
            released().to_string(),
            "released engine=p-1 registration=7 reason=unreachable waited_ms=2 reads_at_mark=1 \
             handshake=false failed_steps=0 panicked=false endpoints_left_open=0"
        );
        let unreachable = Event::Unreachable {
            engine: EngineId::from("p-1"),
            registration: RegistrationId(7),
            status: NixlStatus::ERR_REMOTE_DISCONNECT,
            source: Source::Transfer,
        };
        assert_eq!(
            unreachable.to_string(),
            "unreachable engine=p-1 registration=7 status=NIXL_ERR_REMOTE_DISCONNECT (-10) source=transfer"
        );
    }

    #[test]
    fn a_peer_s_name_or_text_cannot_forge_a_second_line() {
        let forged = Event::TransportPanicked {
            engine: EngineId::from("p\nevent: released engine=victim"),
            registration: RegistrationId(1),
            call: "genNotif",
            message: "boom\nevent: released".into(),
        };
        let line = forged.to_string();
        assert!(!line.contains('\n'), "{line}");
        assert!(line.starts_with("transport_panicked engine=p\\n"), "{line}");
        assert!(
            line.ends_with("message=\"boom\\nevent: released\""),
            "{line}"
        );
    }

    #[cfg(all(feature = "serde", feature = "membership"))]
    #[test]
    fn serialized_it_is_the_line_s_fields_under_event() {
        let json = serde_json::to_value(released()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "event": "released", "engine": "p-1", "registration": 7,
                "reason": "unreachable", "waited_ms": 2, "reads_at_mark": 1,
                "handshake": false, "failed_steps": 0, "panicked": false,
                "endpoints_left_open": 0,
            })
        );
        let conflict = Event::Conflict {
            conflict: Conflict::EngineInUse {
                engine: EngineId::from("p-1"),
                address: PeerAddr::from("10.0.0.1:5600"),
            },
        };
        let json = serde_json::to_value(&conflict).unwrap();
        assert_eq!(json["event"], "conflict");
        assert_eq!(json["kind"], "engine_in_use");
        assert_eq!(json["detail"], conflict_detail(&conflict));
        let unreachable = Event::Unreachable {
            engine: EngineId::from("p-1"),
            registration: RegistrationId(7),
            status: NixlStatus::ERR_REMOTE_DISCONNECT,
            source: Source::Heartbeat,
        };
        let json = serde_json::to_value(unreachable).unwrap();
        assert_eq!(json["status"], -10);
        assert_eq!(json["status_name"], "NIXL_ERR_REMOTE_DISCONNECT");
    }

    /// The keys of every kind, pinned: the Python package's event dicts
    /// are made of them too, so a change here is a breaking change there
    /// (CHANGELOG).
    #[test]
    fn the_walk_s_keys_of_every_kind() {
        let engine = || EngineId::from("p-1");
        let reg = RegistrationId(7);
        let addr = || PeerAddr::from("10.0.0.1:5600");
        let events = [
            Event::Registered {
                engine: engine(),
                registration: reg,
                address: addr(),
            },
            Event::Unreachable {
                engine: engine(),
                registration: reg,
                status: NixlStatus::ERR_REMOTE_DISCONNECT,
                source: Source::Heartbeat,
            },
            Event::Replaced {
                old: engine(),
                old_registration: reg,
                new: EngineId::from("p-2"),
                address: addr(),
            },
            Event::Retiring {
                engine: engine(),
                registration: reg,
                fail_reads: true,
            },
            Event::Stalled {
                engine: engine(),
                registration: reg,
                reads_in_flight: 2,
                stalled_for: Duration::from_millis(1_500),
                given_up: 1,
                failed: true,
            },
            Event::ReadsFailed {
                engine: engine(),
                registration: reg,
                count: 2,
            },
            Event::TransientError {
                engine: engine(),
                registration: reg,
                status: NixlStatus::ERR_BACKEND,
                source: Source::Transfer,
            },
            released(),
            Event::Conflict {
                conflict: Conflict::EngineInUse {
                    engine: engine(),
                    address: addr(),
                },
            },
            Event::TransportPanicked {
                engine: engine(),
                registration: reg,
                call: "genNotif",
                message: "boom".into(),
            },
        ];
        let keys: Vec<(&str, Vec<&str>)> = events
            .iter()
            .map(|e| {
                let mut keys = Vec::new();
                e.each_field(|key, _| {
                    keys.push(key);
                    Ok::<_, ()>(())
                })
                .unwrap();
                (e.kind(), keys)
            })
            .collect();
        let base = ["engine", "registration"];
        let with = |rest: &[&'static str]| [&base[..], rest].concat();
        assert_eq!(
            keys,
            vec![
                ("registered", with(&["address"])),
                ("unreachable", with(&["status", "source"])),
                (
                    "replaced",
                    vec!["old", "old_registration", "new", "address"]
                ),
                ("retiring", with(&["fail_reads"])),
                (
                    "stalled",
                    with(&["reads", "stalled_ms", "given_up", "failed"])
                ),
                ("reads_failed", with(&["count"])),
                ("transient_error", with(&["status", "source"])),
                (
                    "released",
                    with(&[
                        "reason",
                        "waited_ms",
                        "reads_at_mark",
                        "handshake",
                        "failed_steps",
                        "panicked",
                        "endpoints_left_open"
                    ])
                ),
                ("conflict", vec!["kind", "engine", "detail"]),
                ("transport_panicked", with(&["call", "message"])),
            ]
        );
        let stalled = events[4].to_string();
        assert!(stalled.contains(" stalled_ms=1500 "), "{stalled}");
    }

    #[cfg(all(feature = "serde", feature = "membership"))]
    fn conflict_detail(event: &Event) -> String {
        match event {
            Event::Conflict { conflict } => conflict.to_string(),
            _ => unreachable!(),
        }
    }
}
