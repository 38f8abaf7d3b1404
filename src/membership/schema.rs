//! The membership schema: what a record under a prefill's key says, and
//! how a value is checked before anything trusts it.

use serde::{Deserialize, Serialize};

use crate::registration::{Departure, Incarnation};
use crate::text::{check_name, Escaped, NameError};
use crate::transport::{EngineId, PeerAddr};

/// The key prefix prefills register under unless told otherwise.
pub const DEFAULT_PREFIX: &str = "/nixl-keepalive/prefill/";

/// Longest engine id a value may carry (bytes), longest address, and most
/// ranks: the library's bounds, the same for every source.
use crate::text::{MAX_ADDRESS, MAX_ENGINE_ID, MAX_RANKS};

/// The largest value accepted under one key, in bytes. A member's JSON is
/// about 100 bytes with a UUID engine id and under 600 with the longest id
/// and address; the rest is room for fields added later. Checked before
/// the value is parsed, so a megabyte of JSON costs no parsing.
pub const MAX_RECORD: usize = 4096;

/// The longest key accepted, in bytes: a prefix and an engine id.
pub const MAX_KEY: usize = 1024;

/// One prefill engine as the membership plane knows it: the JSON value of
/// its key (see the module docs for the schema).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Member {
    /// The engine id its handshake reports.
    pub engine_id: String,
    /// Its side-channel address, `host:port`.
    pub address: String,
    /// Its ranks (NIXL agents).
    pub ranks: u16,
    /// The incarnation of the process that wrote the record (the one its
    /// handshake reports), when the prefill knows it: a record of a dead
    /// predecessor is then told apart from its successor's. Optional, for
    /// prefills that do not report one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incarnation: Option<u64>,
}

/// A record (key and value) that does not follow the schema. Every text
/// from the record is escaped and cut (it comes from whoever can write to
/// etcd).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SchemaError {
    /// The key is longer than [`MAX_KEY`] bytes.
    #[error("key is {0} bytes long; expected at most {MAX_KEY}")]
    KeyTooLong(usize),
    /// The value is larger than [`MAX_RECORD`] bytes (not parsed).
    #[error("value is {0} bytes long; expected at most {MAX_RECORD}")]
    TooLarge(usize),
    /// Not JSON, or not an object with the three fields of the right types.
    #[error("value is not a member object ({0}); expected {{\"engine_id\": string, \"address\": \"host:port\", \"ranks\": 1..=64}}")]
    Json(String),
    /// `engine_id` empty, longer than [`MAX_ENGINE_ID`] bytes, or holding
    /// a control character.
    #[error("engine_id: {0}")]
    EngineId(NameError),
    /// `address` is not `host:port` (see the module docs for its form).
    #[error("address {shown} is not host:port: {why}; expected a DNS name, an IPv4 address or a bracketed IPv6 address, then ':' and a port from 1 to 65535, at most {MAX_ADDRESS} bytes")]
    Address {
        /// The address, escaped and cut.
        shown: String,
        /// What is wrong with it.
        why: String,
    },
    /// `ranks` outside 1..=[`MAX_RANKS`].
    #[error("ranks must be 1 to {MAX_RANKS}, got {0}")]
    Ranks(u16),
    /// A well-formed record under another key than its engine's own,
    /// `<prefix><engine id>` (a copy of a live prefill's record, a key of
    /// an old version, a hand-written one): only the record under the
    /// engine's own key speaks for it, so this one is a conflict, never a
    /// member, and its removal retires nothing, whatever it names.
    #[error("a record of engine {engine} under another key than its own ({expected}): only the record under <prefix><engine id> speaks for an engine")]
    NotCanonical {
        /// The engine id the record names, escaped and cut.
        engine: String,
        /// The key that would speak for it, escaped and cut.
        expected: String,
    },
}

impl SchemaError {
    /// The reason, as the `reason` label of
    /// `nixl_keepalive_membership_bad_values_total`: `key`, `too_large`,
    /// `json`, `engine_id`, `address`, `ranks` or `not_canonical`.
    pub fn reason(&self) -> &'static str {
        match self {
            SchemaError::KeyTooLong(_) => "key",
            SchemaError::TooLarge(_) => "too_large",
            SchemaError::Json(_) => "json",
            SchemaError::EngineId(_) => "engine_id",
            SchemaError::Address { .. } => "address",
            SchemaError::Ranks(_) => "ranks",
            SchemaError::NotCanonical { .. } => "not_canonical",
        }
    }
}

impl Member {
    /// A member.
    pub fn new(engine_id: impl Into<String>, address: impl Into<String>, ranks: u16) -> Self {
        Member {
            engine_id: engine_id.into(),
            address: address.into(),
            ranks,
            incarnation: None,
        }
    }

    /// The same member, naming the incarnation of its process.
    pub fn with_incarnation(mut self, incarnation: u64) -> Self {
        self.incarnation = Some(incarnation);
        self
    }

    /// What the record says of its engine, for the service to judge
    /// against the engine's registration when the record goes away
    /// ([`KeepaliveHandle::member_gone`](crate::KeepaliveHandle::member_gone)); `address` is the record's
    /// address as resolved when it was announced.
    pub fn departure(&self, address: PeerAddr) -> Departure {
        Departure {
            engine: self.engine(),
            incarnation: self.incarnation.map(Incarnation),
            address,
        }
    }

    /// Whether `other` can be a record of the same process at the same
    /// address: the same engine id and address, and the same incarnation
    /// where both name one.
    pub(super) fn same_process(&self, other: &Member) -> bool {
        self.engine_id == other.engine_id
            && self.address == other.address
            && (self.incarnation.is_none()
                || other.incarnation.is_none()
                || self.incarnation == other.incarnation)
    }

    /// Parses and checks a key's value: its size first, then its JSON,
    /// then the schema's rules.
    pub fn from_json(bytes: &[u8]) -> Result<Member, SchemaError> {
        if bytes.len() > MAX_RECORD {
            return Err(SchemaError::TooLarge(bytes.len()));
        }
        let m: Member = serde_json::from_slice(bytes)
            .map_err(|e| SchemaError::Json(Escaped(&e.to_string()).to_string()))?;
        m.check()?;
        Ok(m)
    }

    /// Parses and checks a record: its key's length, then its value (see
    /// [`Member::from_json`]).
    pub fn from_record(key: &str, value: &[u8]) -> Result<Member, SchemaError> {
        if key.len() > MAX_KEY {
            return Err(SchemaError::KeyTooLong(key.len()));
        }
        Member::from_json(value)
    }

    /// The value to store under the key.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a member serializes")
    }

    /// Checks the schema's rules.
    pub fn check(&self) -> Result<(), SchemaError> {
        check_name("engine id", &self.engine_id, MAX_ENGINE_ID).map_err(SchemaError::EngineId)?;
        check_address(&self.address).map_err(|why| SchemaError::Address {
            shown: Escaped(&self.address).to_string(),
            why,
        })?;
        if self.ranks == 0 || self.ranks > MAX_RANKS {
            return Err(SchemaError::Ranks(self.ranks));
        }
        Ok(())
    }

    /// The engine id, typed.
    pub fn engine(&self) -> EngineId {
        EngineId::from(self.engine_id.as_str())
    }

    /// The side-channel address, typed.
    pub fn peer_addr(&self) -> PeerAddr {
        PeerAddr::from(self.address.as_str())
    }
}

/// The address rules: bounded and printable ([`check_name`]), then
/// `host:port` with a host a decoder can connect to.
fn check_address(address: &str) -> Result<(), String> {
    check_name("address", address, MAX_ADDRESS).map_err(|e| match e {
        // The address is shown once, by the caller.
        NameError::Control { code, at, .. } => {
            format!("it holds a control character (U+{code:04X}) at byte {at}")
        }
        other => other.to_string(),
    })?;
    let Some((host, port)) = address.rsplit_once(':') else {
        return Err("no ':port'".into());
    };
    if port.is_empty()
        || !port.bytes().all(|b| b.is_ascii_digit())
        || !port.parse::<u16>().is_ok_and(|p| p > 0)
    {
        return Err("the port is not a number from 1 to 65535".into());
    }
    if let Some(v6) = host.strip_prefix('[') {
        let ok = v6
            .strip_suffix(']')
            .is_some_and(|v6| v6.parse::<std::net::Ipv6Addr>().is_ok());
        return if ok {
            Ok(())
        } else {
            Err("the bracketed host is not an IPv6 address".into())
        };
    }
    if host.is_empty() {
        return Err("the host is empty".into());
    }
    if !host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
    {
        return Err(
            "the host holds characters other than letters, digits, '.', '-' and '_'".into(),
        );
    }
    Ok(())
}
