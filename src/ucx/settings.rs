//! The UCX settings that decide how fast a dead peer is noticed, and the
//! resulting worst-case time to release it.
//!
//! [`UcxSettings::read`] takes each value from UCX's own configuration
//! where UCP exposes it (`KEEPALIVE_INTERVAL`, `KEEPALIVE_NUM_EPS`, `TLS`,
//! through `ucp_config_read`), otherwise from the `UCX_*` environment,
//! otherwise UCX's documented default; each [`Setting`] says which. Every
//! value from the environment is checked with UCX's syntax before anything
//! starts ([`SettingsError`] names the variable, the value and the syntax).
//!
//! # The detection model ([`detection_bound`])
//!
//! Three kinds of dead peer, three bounds, each reported on its own (the
//! start-up line, the `nixl_keepalive_detection_bound_{crashed,silent,frozen}_seconds`
//! gauges, the snapshot):
//!
//! - **Crashed** (process gone: killed, segfault, OOM): its kernel closes
//!   its sockets and shared memory peers see it go, so the *first
//!   operation* after the crash fails with REMOTE_DISCONNECT (measured on
//!   loopback: a read in flight or the next heartbeat, 1-70 ms when busy).
//!   Idle, that first operation is the next heartbeat: at most one
//!   heartbeat gap (interval + jitter) plus [`SLACK`], which also covers
//!   the schedule's rounding of each round to the nearest slot boundary
//!   (at most half of [`crate::HEARTBEAT_SLOT`], 10 ms). Only where IB
//!   transports are in use can a dead process look silent until UCX's
//!   timers fire (operators measured about 25 s with defaults on GB200);
//!   there the crashed bound is never reported below keepalive + the IB
//!   transports' timeout + one heartbeat + slack. The TCP timeouts never
//!   enter it: a crashed process's TCP connections are reset by its
//!   kernel (UCX closed them 3-46 ms after SIGKILL, measured).
//! - **Silent** (partition, a NIC that stops answering): UCX must send a
//!   keepalive (`KEEPALIVE_INTERVAL`) and the transport in use must give
//!   up on it: UD after `UD_TIMEOUT`; RC after about
//!   `RC_TIMEOUT * (RC_RETRY_COUNT + 1)`; TCP after `TCP_USER_TIMEOUT`, or
//!   when that is left to the kernel (`auto`, the default), after Linux's
//!   retransmission limit (`tcp_retries2` = 15: about 924.6 s). Not TCP
//!   keepalive: the heartbeats keep data in flight, and Linux sends no
//!   keepalive probe while data is unacknowledged (measured on a real
//!   partition: with `TCP_KEEPIDLE=1s`, `KEEPINTVL=1s`, `KEEPCNT=3` and no
//!   user timeout, nothing was reported in 40 s; with
//!   `UCX_TCP_USER_TIMEOUT=3s`, REMOTE_DISCONNECT after about 3.4 s). The
//!   bound is keepalive + the slowest network transport in use + one
//!   heartbeat + slack, and says which transport that is. Unbounded when
//!   keepalive is `inf` or `KEEPALIVE_NUM_EPS` is 0.
//! - **Frozen** (SIGSTOP, a deadlock, a GPU hang): on shared memory or TCP
//!   its kernel still answers and UCX never reports it (measured: 60 s of
//!   successful notifications). With reads in flight the service's
//!   read-stall check finds it: within 1.25 read-stall bounds plus slack
//!   ([`DetectionBound::with_read_stall`]), or sooner when the runtime
//!   gives a read up as timed out. Frozen and idle, nothing in the service
//!   can tell it from a healthy idle peer: a membership lease or the router
//!   retires it.
//!
//! Transports in use: those `UCX_TLS` enables (`all` by default) among
//! those the host has. IB transports (`ud`, `rc`, `dc`) need an RDMA
//! device: [`UcxSettings::read`] looks for one in `/sys/class/infiniband`
//! ([`UcxSettings::rdma_devices`]), so a host without one is not reported
//! with IB timeouts.
//!
//! Assumed: the engine sends a heartbeat (a NIXL notification) to each
//! peer at most `heartbeat_gap` after the previous one (the service passes
//! its interval plus its jitter), and releases a peer as soon as one
//! heartbeat fails with a disconnect; UCX's worker is progressed
//! continuously; each worker has at most `KEEPALIVE_NUM_EPS` endpoints
//! (else a keepalive round covers only part of them and the keepalive
//! term is that many rounds: [`detection_bound_for`], [`keepalive_rounds`]).

use std::fmt;
use std::time::Duration;

use crate::ucx::time::parse_time;
pub use crate::ucx::time::{TimeField, TimeSyntaxError, TimeSyntaxIssue, UcxTime};

/// Added to every bound: progress-thread and scheduling delays.
pub const SLACK: Duration = Duration::from_secs(1);

/// Linux's default `tcp_keepalive_probes`, what `UCX_TCP_KEEPCNT=auto`
/// leaves in force.
pub const LINUX_TCP_KEEPCNT: u32 = 9;

/// How long Linux retransmits unacknowledged data before it aborts the
/// connection, with its default `tcp_retries2` of 15 and the 200 ms
/// minimum retransmission timeout: `(2^10 - 1) * 0.2 s + 6 * 120 s`. What
/// `UCX_TCP_USER_TIMEOUT=auto` leaves in force for a silent TCP peer.
pub const LINUX_TCP_RETRANSMIT_LIMIT: Duration = Duration::from_millis(924_600);

/// Where a value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Origin {
    /// UCX's own configuration (`ucp_config_read`), which includes the
    /// environment and UCX's config files.
    Ucx,
    /// The `UCX_*` environment variable, checked with UCX's syntax.
    Environment,
    /// UCX's documented default (variable not set).
    Default,
    /// Not a UCX variable: the NIXL UCX backend's behaviour, or what is
    /// assumed when the host was not looked at.
    Assumed,
    /// Looked up on this host (`/sys/class/infiniband`).
    Host,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Origin::Ucx => "ucx",
            Origin::Environment => "env",
            Origin::Default => "default",
            Origin::Assumed => "assumed",
            Origin::Host => "host",
        })
    }
}

/// One setting with its origin.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Setting<T> {
    /// The value.
    pub value: T,
    /// The text it was read from (`2s`, `20000000.00us`, `y`).
    pub raw: String,
    /// Where it came from.
    pub source: Origin,
}

/// A count that UCX also accepts as `inf` (`UCX_KEEPALIVE_NUM_EPS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Count {
    /// A number.
    Finite(u32),
    /// `inf` (UINT_MAX in UCX).
    Infinite,
}

/// `UCX_TCP_KEEPCNT`: a number or `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeepCount {
    /// A number of probes.
    Probes(u32),
    /// `auto`: the kernel's default.
    Auto,
}

/// The endpoint error-handling mode NIXL asks UCX for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorHandling {
    /// `UCP_ERR_HANDLING_MODE_PEER`: failures are reported and keepalive
    /// runs (NIXL's UCX backend default).
    Peer,
    /// `UCP_ERR_HANDLING_MODE_NONE`: no failure reporting, no keepalive.
    None,
}

/// How UCX's `rc_gda` transport (GPU-initiated RDMA, `libuct_ib_mlx5_gda`)
/// gives an endpoint its channel: `UCX_RC_GDA_EP_ALLOC_MODE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GdaEpAllocMode {
    /// `pool` (UCX's default): from pooled chunks. A new endpoint can get a
    /// channel still connected to a dead peer, and its connection to that
    /// peer's replacement fails (`INIT2RTR`, seen on GB200).
    Pool,
    /// `direct`: a channel per endpoint.
    Direct,
}

/// The UCX settings in force.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct UcxSettings {
    /// `UCX_KEEPALIVE_INTERVAL` (TIME_UNITS, default 20s).
    pub keepalive_interval: Setting<UcxTime>,
    /// `UCX_KEEPALIVE_NUM_EPS` (default 128; 0 disables keepalive).
    pub keepalive_num_eps: Setting<Count>,
    /// `UCX_UD_TIMEOUT` (TIME, default 30s).
    pub ud_timeout: Setting<Duration>,
    /// `UCX_RC_TIMEOUT` (TIME, default 1s).
    pub rc_timeout: Setting<Duration>,
    /// `UCX_RC_RETRY_COUNT` (default 7).
    pub rc_retry_count: Setting<u32>,
    /// `UCX_TCP_KEEPIDLE` (TIME_UNITS, default 10s).
    pub tcp_keepidle: Setting<UcxTime>,
    /// `UCX_TCP_KEEPINTVL` (TIME_UNITS, default 2s).
    pub tcp_keepintvl: Setting<UcxTime>,
    /// `UCX_TCP_KEEPCNT` (default auto).
    pub tcp_keepcnt: Setting<KeepCount>,
    /// `UCX_TCP_USER_TIMEOUT` (TIME_UNITS, default auto): how long sent
    /// data may stay unacknowledged before the kernel aborts the
    /// connection. What bounds a silent peer over TCP.
    pub tcp_user_timeout: Setting<UcxTime>,
    /// `UCX_CUDA_IPC_CACHE` (default y).
    pub cuda_ipc_cache: Setting<bool>,
    /// `UCX_RC_GDA_EP_ALLOC_MODE` (default pool).
    pub rc_gda_ep_alloc_mode: Setting<GdaEpAllocMode>,
    /// `UCX_TLS` (default `all`), as a list.
    pub tls: Setting<Vec<String>>,
    /// Not a UCX variable: NIXL's UCX backend uses `peer`.
    pub error_handling: Setting<ErrorHandling>,
    /// Not a UCX variable: whether this host has an RDMA device, without
    /// which no IB transport (`ud`, `rc`, `dc`) is in use whatever
    /// `UCX_TLS` says. [`UcxSettings::read`] looks in
    /// `/sys/class/infiniband`; [`UcxSettings::from_lookup`] assumes one
    /// (the longer bounds).
    pub rdma_devices: Setting<bool>,
}

/// A UCX variable with a value that is not UCX syntax.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SettingsError {
    /// A time variable.
    #[error("{var}: {source}")]
    Time {
        /// The variable (`UCX_UD_TIMEOUT`).
        var: &'static str,
        /// What is wrong.
        source: TimeSyntaxError,
    },
    /// Any other variable.
    #[error("invalid {var} value `{value}`; expected {expected}")]
    Value {
        /// The variable.
        var: &'static str,
        /// The value as given.
        value: String,
        /// The accepted syntax.
        expected: &'static str,
    },
    /// UCX itself refused its configuration.
    #[error("ucp_config_read failed: {0}")]
    Ucx(nixl_status::UcsStatus),
}

/// What [`UcxSettings::from_lookup`] reads from UCX's own configuration.
pub type UcxLookup<'a> = &'a dyn Fn(&str) -> Option<String>;

impl UcxSettings {
    /// The settings from an environment (`UCX_*` names) and, optionally,
    /// UCX's printed configuration (names without `UCX_`).
    pub fn from_lookup(
        env: UcxLookup<'_>,
        ucx: Option<UcxLookup<'_>>,
    ) -> Result<UcxSettings, SettingsError> {
        let pick = |var: &'static str, ucx_name: Option<&str>, default: &str| {
            if let (Some(u), Some(n)) = (ucx, ucx_name) {
                if let Some(v) = u(n) {
                    return (v, Origin::Ucx);
                }
            }
            match env(var) {
                Some(v) => (v, Origin::Environment),
                None => (default.to_owned(), Origin::Default),
            }
        };
        let time = |var: &'static str, ucx_name, default, field| {
            let (raw, source) = pick(var, ucx_name, default);
            let value =
                parse_time(&raw, field).map_err(|e| SettingsError::Time { var, source: e })?;
            Ok::<_, SettingsError>(Setting { value, raw, source })
        };
        let plain = |var, default| {
            let s = time(var, None, default, TimeField::Time)?;
            Ok::<_, SettingsError>(Setting {
                value: s.value.finite().unwrap_or(Duration::ZERO),
                raw: s.raw,
                source: s.source,
            })
        };

        let (raw, source) = pick("UCX_KEEPALIVE_NUM_EPS", Some("KEEPALIVE_NUM_EPS"), "128");
        let keepalive_num_eps = Setting {
            value: parse_count(&raw).ok_or_else(|| SettingsError::Value {
                var: "UCX_KEEPALIVE_NUM_EPS",
                value: raw.clone(),
                expected: "an unsigned integer or `inf`",
            })?,
            raw,
            source,
        };
        let (raw, source) = pick("UCX_RC_RETRY_COUNT", None, "7");
        let rc_retry_count = Setting {
            value: raw.parse().map_err(|_| SettingsError::Value {
                var: "UCX_RC_RETRY_COUNT",
                value: raw.clone(),
                expected: "an unsigned integer",
            })?,
            raw,
            source,
        };
        let (raw, source) = pick("UCX_TCP_KEEPCNT", None, "auto");
        let tcp_keepcnt = Setting {
            value: if raw == "auto" {
                KeepCount::Auto
            } else {
                KeepCount::Probes(raw.parse().map_err(|_| SettingsError::Value {
                    var: "UCX_TCP_KEEPCNT",
                    value: raw.clone(),
                    expected: "an unsigned integer or `auto`",
                })?)
            },
            raw,
            source,
        };
        let (raw, source) = pick("UCX_CUDA_IPC_CACHE", None, "y");
        let cuda_ipc_cache = Setting {
            value: parse_bool(&raw).ok_or_else(|| SettingsError::Value {
                var: "UCX_CUDA_IPC_CACHE",
                value: raw.clone(),
                expected: "y, yes, on, 1, n, no, off or 0",
            })?,
            raw,
            source,
        };
        let (raw, source) = pick("UCX_RC_GDA_EP_ALLOC_MODE", None, "pool");
        let rc_gda_ep_alloc_mode = Setting {
            // UCX reads its enum values without regard to case.
            value: match raw.to_ascii_lowercase().as_str() {
                "pool" => GdaEpAllocMode::Pool,
                "direct" => GdaEpAllocMode::Direct,
                _ => {
                    return Err(SettingsError::Value {
                        var: "UCX_RC_GDA_EP_ALLOC_MODE",
                        value: raw.clone(),
                        expected: "pool or direct",
                    })
                }
            },
            raw,
            source,
        };
        let (raw, source) = pick("UCX_TLS", Some("TLS"), "all");
        let tls = Setting {
            value: raw
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
            raw,
            source,
        };

        Ok(UcxSettings {
            keepalive_interval: time(
                "UCX_KEEPALIVE_INTERVAL",
                Some("KEEPALIVE_INTERVAL"),
                "20s",
                TimeField::TimeUnits,
            )?,
            keepalive_num_eps,
            ud_timeout: plain("UCX_UD_TIMEOUT", "30s")?,
            rc_timeout: plain("UCX_RC_TIMEOUT", "1s")?,
            rc_retry_count,
            tcp_keepidle: time("UCX_TCP_KEEPIDLE", None, "10s", TimeField::TimeUnits)?,
            tcp_keepintvl: time("UCX_TCP_KEEPINTVL", None, "2s", TimeField::TimeUnits)?,
            tcp_keepcnt,
            tcp_user_timeout: time("UCX_TCP_USER_TIMEOUT", None, "auto", TimeField::TimeUnits)?,
            cuda_ipc_cache,
            rc_gda_ep_alloc_mode,
            tls,
            error_handling: Setting {
                value: ErrorHandling::Peer,
                raw: "peer".into(),
                source: Origin::Assumed,
            },
            rdma_devices: Setting {
                value: true,
                raw: "assumed".into(),
                source: Origin::Assumed,
            },
        })
    }

    /// UCX's defaults, as if no variable were set.
    pub fn defaults() -> UcxSettings {
        UcxSettings::from_lookup(&|_| None, None).expect("UCX defaults are valid")
    }

    /// Whether UCX keepalive runs at all.
    pub fn keepalive_enabled(&self) -> bool {
        self.error_handling.value == ErrorHandling::Peer
            && self.keepalive_interval.value != UcxTime::Infinite
            && self.keepalive_num_eps.value != Count::Finite(0)
    }

    /// One `name=value(source)` list of the values, for a log line.
    pub fn summary(&self) -> String {
        format!(
            "KEEPALIVE_INTERVAL={}({}) KEEPALIVE_NUM_EPS={}({}) UD_TIMEOUT={}({}) \
             RC_TIMEOUT={}({}) RC_RETRY_COUNT={}({}) TCP_KEEPIDLE={}({}) \
             TCP_KEEPINTVL={}({}) TCP_KEEPCNT={}({}) TCP_USER_TIMEOUT={}({}) \
             CUDA_IPC_CACHE={}({}) RC_GDA_EP_ALLOC_MODE={}({}) TLS={}({}) \
             ERR_MODE={}({}) RDMA_DEVICES={}({})",
            self.keepalive_interval.value,
            self.keepalive_interval.source,
            self.keepalive_num_eps.raw,
            self.keepalive_num_eps.source,
            UcxTime::Finite(self.ud_timeout.value),
            self.ud_timeout.source,
            UcxTime::Finite(self.rc_timeout.value),
            self.rc_timeout.source,
            self.rc_retry_count.value,
            self.rc_retry_count.source,
            self.tcp_keepidle.value,
            self.tcp_keepidle.source,
            self.tcp_keepintvl.value,
            self.tcp_keepintvl.source,
            self.tcp_keepcnt.raw,
            self.tcp_keepcnt.source,
            self.tcp_user_timeout.value,
            self.tcp_user_timeout.source,
            if self.cuda_ipc_cache.value { "y" } else { "n" },
            self.cuda_ipc_cache.source,
            match self.rc_gda_ep_alloc_mode.value {
                GdaEpAllocMode::Pool => "pool",
                GdaEpAllocMode::Direct => "direct",
            },
            self.rc_gda_ep_alloc_mode.source,
            self.tls.raw,
            self.tls.source,
            match self.error_handling.value {
                ErrorHandling::Peer => "peer",
                ErrorHandling::None => "none",
            },
            self.error_handling.source,
            self.rdma_devices.raw,
            self.rdma_devices.source,
        )
    }

    /// Whether any IB transport (`ud`, `rc`, `dc`, or `ib`) is in use:
    /// enabled by `UCX_TLS` and an RDMA device present.
    pub fn ib_in_use(&self) -> bool {
        self.rdma_devices.value && self.tl_enabled(IB_TRANSPORTS)
    }

    /// Whether the GPU-initiated RDMA transport `rc_gda` may be in use:
    /// enabled by `UCX_TLS` (`all`, or named) and an RDMA device present.
    pub fn gda_in_use(&self) -> bool {
        self.rdma_devices.value && self.tl_enabled(&["rc_gda", "gda"])
    }

    /// Whether TCP is in use (enabled by `UCX_TLS`).
    pub fn tcp_in_use(&self) -> bool {
        self.tl_enabled(&["tcp"])
    }

    fn tl_enabled(&self, names: &[&str]) -> bool {
        let list = &self.tls.value;
        let negated = list.first().is_some_and(|t| t.starts_with('^'));
        let mentions = |n: &str| {
            list.iter()
                .map(|t| t.trim_start_matches(['^', '\\']))
                .any(|t| {
                    t == n || t.starts_with(&format!("{n}_")) || t.starts_with(&format!("{n}:"))
                })
        };
        if list.iter().any(|t| t == "all") {
            return true;
        }
        let any = names.iter().any(|n| mentions(n));
        if negated {
            !any
        } else {
            any
        }
    }
}

/// Every name of an IB transport `UCX_TLS` may use.
const IB_TRANSPORTS: &[&str] = &[
    "ib", "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5",
    "dc", "dc_x", "dc_mlx5",
];

fn parse_count(s: &str) -> Option<Count> {
    if s.eq_ignore_ascii_case("inf") {
        Some(Count::Infinite)
    } else {
        s.parse().ok().map(Count::Finite)
    }
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.to_ascii_lowercase().as_str() {
        "y" | "yes" | "on" | "1" => Some(true),
        "n" | "no" | "off" | "0" => Some(false),
        _ => None,
    }
}

/// Worst-case times from a peer's death to its release, one per kind of
/// death (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DetectionBound {
    /// Process gone (killed, crashed): the first operation after it sees
    /// it; idle, the next heartbeat.
    pub crashed: Duration,
    /// What the crashed bound is made of, e.g.
    /// `first operation; idle: heartbeat 5.5s + slack 1s`.
    pub crashed_terms: String,
    /// Silent on the network (partition); `None` when unbounded.
    pub silent: Option<Duration>,
    /// What the silent bound is made of, e.g.
    /// `keepalive 20s + tcp user timeout 10s + heartbeat 5.5s + slack 1s`.
    pub silent_terms: String,
    /// Frozen with reads in flight: the read-stall check's bound; `None`
    /// when that check is off (or not given: see
    /// [`DetectionBound::with_read_stall`]).
    pub frozen: Option<Duration>,
    /// What the frozen bound is made of (empty when not given).
    pub frozen_terms: String,
}

impl DetectionBound {
    /// Adds the frozen bound of the read-stall check with `bound`
    /// (`NIXL_KEEPALIVE_READ_STALL`; `None`: off): an engine's stall is
    /// seen within one check period (a quarter bound) and judged one bound
    /// later, plus [`SLACK`]; sooner when the runtime gives a read up as
    /// timed out.
    pub fn with_read_stall(mut self, bound: Option<Duration>) -> Self {
        match bound {
            Some(b) => {
                self.frozen = Some(b + b / 4 + SLACK);
                self.frozen_terms = format!(
                    "read stall {} x 1.25 + slack {}; sooner when the runtime gives a read up as timed out",
                    secs_text(b),
                    secs_text(SLACK)
                );
            }
            None => {
                self.frozen = None;
                self.frozen_terms =
                    "the read-stall check is off (NIXL_KEEPALIVE_READ_STALL=inf)".to_owned();
            }
        }
        self
    }
}

impl fmt::Display for DetectionBound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dead peer released within {} if crashed ({}); ",
            secs_text(self.crashed),
            self.crashed_terms
        )?;
        match self.silent {
            Some(d) => write!(f, "{} if silent ({}); ", secs_text(d), self.silent_terms)?,
            None => write!(f, "never if silent ({}); ", self.silent_terms)?,
        }
        match self.frozen {
            // Not given: nothing to say.
            None if self.frozen_terms.is_empty() => {}
            Some(d) => write!(
                f,
                "{} if frozen with reads in flight ({}); ",
                secs_text(d),
                self.frozen_terms
            )?,
            None => write!(
                f,
                "never if frozen with reads in flight ({}); ",
                self.frozen_terms
            )?,
        }
        f.write_str("frozen and idle: only membership or the router retire it (UCX never reports a frozen peer on shm/tcp)")
    }
}

/// `53.2s`, `2s`, `0.5s`: seconds, rounded up to 0.1 s (what a person
/// reads; never `20000000.00us`).
pub fn secs_text(d: Duration) -> String {
    let tenths = d.as_nanos().div_ceil(100_000_000);
    if tenths % 10 == 0 {
        format!("{}s", tenths / 10)
    } else {
        format!("{}.{}s", tenths / 10, tenths % 10)
    }
}

/// The worst-case times to release a crashed and a silent peer with these
/// settings and longest gap between two heartbeats to one peer (the
/// frozen bound is added by [`DetectionBound::with_read_stall`]). See the
/// module docs for the model.
///
/// It assumes each UCX worker has at most `UCX_KEEPALIVE_NUM_EPS`
/// endpoints (128 by default), and says so in the silent bound's terms;
/// [`detection_bound_for`] gives the bound for a worker with more.
pub fn detection_bound(settings: &UcxSettings, heartbeat_gap: Duration) -> DetectionBound {
    detection_bound_for(settings, heartbeat_gap, 0)
}

/// How many keepalive intervals UCX takes to check every one of a
/// worker's `endpoints` endpoints: each keepalive interval UCX checks at
/// most `UCX_KEEPALIVE_NUM_EPS` of them, going on from where the previous
/// round stopped (`ucp_worker_keepalive_progress`, UCX 1.23), so with
/// 1,000 endpoints and the default 128 an endpoint is checked every 8th
/// interval. At least 1.
pub fn keepalive_rounds(settings: &UcxSettings, endpoints: usize) -> u32 {
    match settings.keepalive_num_eps.value {
        Count::Finite(n) if n > 0 => {
            u32::try_from(endpoints.div_ceil(n as usize).max(1)).unwrap_or(u32::MAX)
        }
        _ => 1,
    }
}

/// [`detection_bound`] for a UCX worker with `endpoints` endpoints (a
/// decode's remote agents, one endpoint each per worker): the silent
/// bound's keepalive term is [`keepalive_rounds`] intervals, not one.
pub fn detection_bound_for(
    settings: &UcxSettings,
    heartbeat_gap: Duration,
    endpoints: usize,
) -> DetectionBound {
    let heartbeat = heartbeat_gap;
    let ms = secs_text;

    // Slowest network transport in use to give up on an unanswered
    // message; the IB ones separately (they alone can make a crash look
    // silent).
    let mut transport = Duration::ZERO;
    let mut transport_term = String::from("no network transport in use");
    let mut ib_transport = Duration::ZERO;
    let mut ib_term = String::new();
    let mut consider = |d: Duration, name: String, ib: bool| {
        if ib && d >= ib_transport {
            ib_transport = d;
            ib_term = name.clone();
        }
        if d >= transport {
            transport = d;
            transport_term = name;
        }
    };
    let ib = settings.ib_in_use();
    if ib && settings.tl_enabled(&["ib", "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5"]) {
        consider(
            settings.ud_timeout.value,
            format!("ud {}", ms(settings.ud_timeout.value)),
            true,
        );
    }
    if ib
        && settings.tl_enabled(&[
            "ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5",
        ])
    {
        let rc = settings
            .rc_timeout
            .value
            .saturating_mul(settings.rc_retry_count.value.saturating_add(1));
        consider(rc, format!("rc {}", ms(rc)), true);
    }
    if settings.tcp_in_use() {
        // Heartbeats keep data in flight: once the peer is silent, the next
        // one stays unacknowledged, and Linux sends no keepalive probe while
        // data is unacknowledged. The connection is aborted after the user
        // timeout, or the kernel's retransmission limit. (TCP keepalive can
        // only end it sooner, between heartbeats: not a bound.)
        match settings.tcp_user_timeout.value {
            UcxTime::Finite(d) if !d.is_zero() => {
                consider(d, format!("tcp user timeout {}", ms(d)), false)
            }
            _ => consider(
                LINUX_TCP_RETRANSMIT_LIMIT,
                format!(
                    "tcp retransmission limit {} (UCX_TCP_USER_TIMEOUT={})",
                    ms(LINUX_TCP_RETRANSMIT_LIMIT),
                    settings.tcp_user_timeout.value
                ),
                false,
            ),
        }
    }

    let keepalive = match (
        settings.keepalive_enabled(),
        settings.keepalive_interval.value,
    ) {
        (false, _) => None,
        (true, UcxTime::Finite(d)) => Some(d),
        // `auto`: UCX's default.
        (true, _) => Some(Duration::from_secs(20)),
    };

    let (silent, silent_terms) = match keepalive {
        None => (
            None,
            if settings.error_handling.value == ErrorHandling::None {
                "error handling mode none".to_owned()
            } else {
                "UCX keepalive disabled".to_owned()
            },
        ),
        Some(_) if transport == Duration::MAX => (None, transport_term.clone()),
        Some(k) => {
            let rounds = keepalive_rounds(settings, endpoints);
            let per_round = match settings.keepalive_num_eps.value {
                Count::Finite(n) => n.to_string(),
                Count::Infinite => "every".to_owned(),
            };
            let keepalive_term = if endpoints == 0 {
                format!(
                    "keepalive {} (for at most {per_round} endpoints per UCX worker; each further {per_round} add {})",
                    ms(k),
                    ms(k)
                )
            } else {
                format!(
                    "keepalive {} x {rounds} rounds ({endpoints} endpoints, {per_round} per round)",
                    ms(k)
                )
            };
            (
                Some(k.saturating_mul(rounds) + transport + heartbeat + SLACK),
                format!(
                    "{keepalive_term} + {} + heartbeat {} + slack {}",
                    transport_term,
                    ms(heartbeat),
                    ms(SLACK)
                ),
            )
        }
    };

    let mut crashed = heartbeat + SLACK;
    let mut crashed_terms = format!(
        "the first operation after the crash; idle: heartbeat {} + slack {}",
        ms(heartbeat),
        ms(SLACK)
    );
    if let (Some(k), true) = (keepalive, ib && !ib_term.is_empty()) {
        // On InfiniBand a dead process can look silent until UCX's timers
        // fire; keepalive must be on for that too.
        let k = k.saturating_mul(keepalive_rounds(settings, endpoints));
        let via_ib = k + ib_transport.min(Duration::from_secs(1 << 40)) + heartbeat + SLACK;
        if via_ib > crashed {
            crashed = via_ib;
            crashed_terms = format!(
                "IB in use, a dead process may look silent: keepalive {} + {ib_term} + heartbeat {} + slack {}",
                ms(k),
                ms(heartbeat),
                ms(SLACK)
            );
        }
    }

    DetectionBound {
        crashed,
        crashed_terms,
        silent,
        silent_terms,
        frozen: None,
        frozen_terms: String::new(),
    }
}

/// The first words of the [`warnings`] line about `UCX_CUDA_IPC_CACHE`,
/// which the service leaves out where releases give UCX's cached GPU
/// mappings back ([`crate::GpuMappings::memory_comes_back`]).
const CUDA_IPC_CACHE_WARNING: &str = "UCX_CUDA_IPC_CACHE=";

/// Whether `warning` (one of [`warnings`]) is the `UCX_CUDA_IPC_CACHE` one.
pub fn is_cuda_ipc_cache_warning(warning: &str) -> bool {
    warning.starts_with(CUDA_IPC_CACHE_WARNING)
}

/// Settings that defeat detection, one warning each (log them once).
pub fn warnings(settings: &UcxSettings) -> Vec<String> {
    let mut w = Vec::new();
    if settings.keepalive_interval.value == UcxTime::Infinite {
        w.push(format!(
            "UCX_KEEPALIVE_INTERVAL=inf ({}): UCX keepalive is off, a silent peer is never reported",
            settings.keepalive_interval.source
        ));
    }
    if settings.keepalive_num_eps.value == Count::Finite(0) {
        w.push(format!(
            "UCX_KEEPALIVE_NUM_EPS=0 ({}): UCX keepalive is off, a silent peer is never reported",
            settings.keepalive_num_eps.source
        ));
    }
    if settings.error_handling.value == ErrorHandling::None {
        w.push(
            "UCX error handling mode is none: UCX reports no endpoint failures and runs no keepalive"
                .to_owned(),
        );
    }
    if settings.tl_enabled(&["tcp"])
        && !matches!(settings.tcp_user_timeout.value, UcxTime::Finite(d) if !d.is_zero())
    {
        w.push(format!(
            "UCX_TCP_USER_TIMEOUT={} ({}): a partitioned peer reached over TCP is reported only \
             after the kernel's retransmission limit (about {}; TCP keepalive sends no probe \
             while heartbeats are unacknowledged); set UCX_TCP_USER_TIMEOUT, e.g. 10s",
            settings.tcp_user_timeout.value,
            settings.tcp_user_timeout.source,
            secs_text(LINUX_TCP_RETRANSMIT_LIMIT)
        ));
    }
    if settings.cuda_ipc_cache.value {
        w.push(format!(
            "{CUDA_IPC_CACHE_WARNING}{} ({}): UCX keeps its cached CUDA IPC / MNNVL mappings of \
             a dead peer's GPU memory after the peer is released, until this process exits (so \
             a restarted peer cannot get that memory back; measured, docs/gpu-check.md), and \
             releases cannot give them back here (see the GPU mappings line); set \
             UCX_CUDA_IPC_CACHE=n for a release to give it back",
            settings.cuda_ipc_cache.raw, settings.cuda_ipc_cache.source
        ));
    }
    if settings.gda_in_use() && settings.rc_gda_ep_alloc_mode.value == GdaEpAllocMode::Pool {
        w.push(format!(
            "UCX_RC_GDA_EP_ALLOC_MODE={} ({}): the rc_gda transport hands a new endpoint a pooled \
             channel that may still be connected to a dead peer, and the connection to its \
             replacement then fails (INIT2RTR, seen on GB200); set UCX_RC_GDA_EP_ALLOC_MODE=direct",
            settings.rc_gda_ep_alloc_mode.raw, settings.rc_gda_ep_alloc_mode.source
        ));
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with_env(vars: &[(&str, &str)]) -> Result<UcxSettings, SettingsError> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        UcxSettings::from_lookup(&|n| m.get(n).cloned(), None)
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn a_worker_with_more_endpoints_than_one_keepalive_round_checks_has_a_longer_silent_bound() {
        // Issue 32: 1,000 remote agents with UCX's default 128 endpoints
        // per round: each endpoint is checked every 8th interval.
        let s = with_env(&[("UCX_TLS", "tcp,sm,self"), ("UCX_TCP_USER_TIMEOUT", "10s")]).unwrap();
        let gap = secs(1.1);
        let alone = detection_bound(&s, gap);
        assert_eq!(alone.silent, Some(secs(20.0 + 10.0 + 1.1 + 1.0)));
        assert!(
            alone
                .silent_terms
                .contains("at most 128 endpoints per UCX worker"),
            "{}",
            alone.silent_terms
        );
        for (endpoints, rounds) in [(1, 1), (128, 1), (129, 2), (1_000, 8), (1_024, 8)] {
            assert_eq!(keepalive_rounds(&s, endpoints), rounds, "{endpoints}");
            let b = detection_bound_for(&s, gap, endpoints);
            assert_eq!(
                b.silent,
                Some(secs(20.0 * f64::from(rounds) + 10.0 + 1.1 + 1.0)),
                "{endpoints}: {}",
                b.silent_terms
            );
            assert!(b.silent_terms.contains(&format!("x {rounds} rounds")));
            // A crash is seen by the next operation, whatever the count.
            assert_eq!(b.crashed, alone.crashed);
        }
        let more = with_env(&[("UCX_TLS", "tcp"), ("UCX_KEEPALIVE_NUM_EPS", "inf")]).unwrap();
        assert_eq!(keepalive_rounds(&more, 100_000), 1);
        let off = with_env(&[("UCX_KEEPALIVE_NUM_EPS", "0")]).unwrap();
        assert_eq!(detection_bound_for(&off, gap, 1_000).silent, None);
    }

    #[test]
    fn defaults_are_ucx_documented_defaults() {
        let s = UcxSettings::defaults();
        assert_eq!(s.keepalive_interval.value, UcxTime::Finite(secs(20.0)));
        assert_eq!(s.keepalive_num_eps.value, Count::Finite(128));
        assert_eq!(s.ud_timeout.value, secs(30.0));
        assert_eq!(s.rc_timeout.value, secs(1.0));
        assert_eq!(s.rc_retry_count.value, 7);
        assert_eq!(s.tcp_keepidle.value, UcxTime::Finite(secs(10.0)));
        assert_eq!(s.tcp_keepintvl.value, UcxTime::Finite(secs(2.0)));
        assert_eq!(s.tcp_keepcnt.value, KeepCount::Auto);
        assert!(s.cuda_ipc_cache.value);
        assert_eq!(s.tls.value, vec!["all".to_string()]);
        assert_eq!(s.ud_timeout.source, Origin::Default);
    }

    #[test]
    fn environment_values_are_read_and_labelled() {
        let s = with_env(&[("UCX_KEEPALIVE_INTERVAL", "2s"), ("UCX_UD_TIMEOUT", "5s")]).unwrap();
        assert_eq!(s.keepalive_interval.value, UcxTime::Finite(secs(2.0)));
        assert_eq!(s.keepalive_interval.source, Origin::Environment);
        assert_eq!(s.ud_timeout.value, secs(5.0));
    }

    #[test]
    fn ucx_config_wins_over_the_environment() {
        let ucx = |n: &str| (n == "KEEPALIVE_INTERVAL").then(|| "3000000.00us".to_string());
        let s = UcxSettings::from_lookup(&|_| Some("9s".into()), Some(&ucx));
        // The env lookup answers "9s" for every variable; some of those are
        // not valid for non-time fields, so build a cleaner env.
        assert!(s.is_err());
        let env = |n: &str| (n == "UCX_KEEPALIVE_INTERVAL").then(|| "9s".to_string());
        let s = UcxSettings::from_lookup(&env, Some(&ucx)).unwrap();
        assert_eq!(s.keepalive_interval.value, UcxTime::Finite(secs(3.0)));
        assert_eq!(s.keepalive_interval.source, Origin::Ucx);
    }

    #[test]
    fn bad_values_name_variable_value_and_syntax() {
        let e = with_env(&[("UCX_UD_TIMEOUT", "5 s")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("UCX_UD_TIMEOUT") && e.contains("`5 s`") && e.contains("ms"),
            "{e}"
        );
        let e = with_env(&[("UCX_UD_TIMEOUT", "inf")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("not allowed"), "{e}");
        let e = with_env(&[("UCX_CUDA_IPC_CACHE", "maybe")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("UCX_CUDA_IPC_CACHE") && e.contains("`maybe`"),
            "{e}"
        );
        assert!(with_env(&[("UCX_KEEPALIVE_NUM_EPS", "-1")]).is_err());
    }

    #[test]
    fn crashed_peer_on_tcp_and_shm_is_one_heartbeat_away() {
        let s = with_env(&[("UCX_TLS", "tcp,sm,self")]).unwrap();
        // A 2s interval with 0.2s of jitter: the longest gap is 2.2s.
        let b = detection_bound(&s, secs(2.2));
        assert_eq!(b.crashed, secs(2.2) + SLACK);
    }

    #[test]
    fn silent_peer_bound_follows_keepalive_and_the_slowest_transport() {
        let s = with_env(&[("UCX_TLS", "tcp,sm,self")]).unwrap();
        let b = detection_bound(&s, secs(2.2));
        // 20s keepalive + Linux's retransmission limit (no user timeout)
        // + heartbeat 2.2s + 1s; TCP keepalive does not bound it.
        assert_eq!(b.silent, Some(secs(20.0 + 924.6 + 2.2 + 1.0)));
        assert!(
            b.silent_terms
                .contains("tcp retransmission limit 924.6s (UCX_TCP_USER_TIMEOUT=auto)"),
            "{}",
            b.silent_terms
        );
        // Keepalive probes tuned down change nothing while data is in
        // flight.
        let tuned = with_env(&[
            ("UCX_TLS", "tcp"),
            ("UCX_TCP_KEEPIDLE", "1s"),
            ("UCX_TCP_KEEPINTVL", "1s"),
            ("UCX_TCP_KEEPCNT", "3"),
        ])
        .unwrap();
        assert_eq!(detection_bound(&tuned, secs(2.2)).silent, b.silent);
        // The user timeout is what bounds it (the partition test's
        // settings).
        let s = with_env(&[
            ("UCX_TLS", "tcp"),
            ("UCX_KEEPALIVE_INTERVAL", "1s"),
            ("UCX_TCP_USER_TIMEOUT", "3s"),
        ])
        .unwrap();
        let b = detection_bound(&s, secs(0.55));
        assert_eq!(b.silent, Some(secs(1.0 + 3.0 + 0.55 + 1.0)));
        assert!(
            b.silent_terms.contains("tcp user timeout 3s"),
            "{}",
            b.silent_terms
        );
        // `inf` and 0 leave it to the kernel, as `auto` does.
        for v in ["inf", "0"] {
            let s = with_env(&[("UCX_TLS", "tcp"), ("UCX_TCP_USER_TIMEOUT", v)]).unwrap();
            let b = detection_bound(&s, secs(1.0));
            assert!(
                b.silent_terms.contains("retransmission limit"),
                "{v}: {}",
                b.silent_terms
            );
        }
        assert!(with_env(&[("UCX_TCP_USER_TIMEOUT", "3h")]).is_err());

        // The GB200 tuning: keepalive 2s, UD 5s, on IB.
        let s = with_env(&[
            ("UCX_TLS", "rc,ud,cuda"),
            ("UCX_KEEPALIVE_INTERVAL", "2s"),
            ("UCX_UD_TIMEOUT", "5s"),
        ])
        .unwrap();
        let b = detection_bound(&s, secs(1.1));
        // rc 1s * 8 = 8s beats ud 5s.
        assert_eq!(b.silent, Some(secs(2.0 + 8.0 + 1.1 + 1.0)));
        assert_eq!(b.crashed, b.silent.unwrap());
    }

    #[test]
    fn a_crashed_peer_is_bounded_by_one_heartbeat_not_by_tcp_timeouts() {
        // The defaults (`UCX_TLS=all`) on a host without an RDMA device:
        // what used to say "crashed within 946 s".
        let mut s = UcxSettings::defaults();
        s.rdma_devices.value = false;
        let b = detection_bound(&s, secs(5.5));
        assert_eq!(b.crashed, secs(5.5) + SLACK);
        assert!(
            b.crashed_terms.contains("first operation"),
            "{}",
            b.crashed_terms
        );
        // The TCP timeout bounds the silent peer only, and is named.
        assert_eq!(b.silent, Some(secs(20.0 + 924.6 + 5.5 + 1.0)));
        assert!(
            b.silent_terms.contains("tcp retransmission limit"),
            "{}",
            b.silent_terms
        );
        // With an RDMA device, IB transports are in use: a dead process may
        // look silent there, bounded by the IB timeouts, still not TCP's.
        s.rdma_devices.value = true;
        let b = detection_bound(&s, secs(5.5));
        assert_eq!(
            b.crashed,
            secs(20.0 + 30.0 + 5.5 + 1.0),
            "keepalive + ud 30s"
        );
        assert!(b.crashed_terms.contains("ud 30s"), "{}", b.crashed_terms);
        // IB named in UCX_TLS but no device: not in use.
        let mut s = with_env(&[("UCX_TLS", "rc,ud,tcp")]).unwrap();
        s.rdma_devices.value = false;
        assert!(!s.ib_in_use());
        assert_eq!(detection_bound(&s, secs(1.0)).crashed, secs(1.0) + SLACK);
    }

    #[test]
    fn the_frozen_bound_is_a_quarter_more_than_the_read_stall_bound_and_printed_in_seconds() {
        let b = detection_bound(&UcxSettings::defaults(), secs(5.5));
        assert!(!b.to_string().contains("frozen with reads"), "not given");
        let b = b.with_read_stall(Some(secs(10.0)));
        assert_eq!(b.frozen, Some(secs(13.5)));
        let line = b.to_string();
        assert!(
            line.contains("13.5s if frozen with reads in flight (read stall 10s x 1.25 + slack 1s"),
            "{line}"
        );
        assert!(
            line.contains("frozen and idle: only membership or the router"),
            "{line}"
        );
        let off = b.with_read_stall(None);
        assert_eq!(off.frozen, None);
        assert!(off
            .to_string()
            .contains("never if frozen with reads in flight (the read-stall check is off"));
        assert_eq!(secs_text(secs(20.0)), "20s");
        assert_eq!(secs_text(Duration::from_micros(20_000_000)), "20s");
    }

    #[test]
    fn keepalive_off_makes_silent_peers_unbounded_and_warns() {
        for env in [
            ("UCX_KEEPALIVE_INTERVAL", "inf"),
            ("UCX_KEEPALIVE_NUM_EPS", "0"),
        ] {
            let s = with_env(&[
                env,
                ("UCX_CUDA_IPC_CACHE", "n"),
                ("UCX_TCP_USER_TIMEOUT", "10s"),
                ("UCX_RC_GDA_EP_ALLOC_MODE", "direct"),
            ])
            .unwrap();
            let b = detection_bound(&s, secs(2.0));
            assert_eq!(b.silent, None);
            assert!(b.to_string().contains("never if silent"), "{b}");
            let w = warnings(&s);
            assert_eq!(w.len(), 1, "{w:?}");
            assert!(w[0].contains(env.0), "{w:?}");
        }
    }

    #[test]
    fn error_mode_none_and_cuda_ipc_cache_warn() {
        let mut s = UcxSettings::defaults();
        s.error_handling.value = ErrorHandling::None;
        let w = warnings(&s);
        assert_eq!(w.len(), 4, "{w:?}");
        assert!(w.iter().any(|l| l.contains("mode is none")));
        assert!(w.iter().any(|l| l.contains("UCX_CUDA_IPC_CACHE=y")));
        assert!(w.iter().any(|l| l.contains("UCX_TCP_USER_TIMEOUT=auto")));
        assert!(w
            .iter()
            .any(|l| l.contains("UCX_RC_GDA_EP_ALLOC_MODE=pool")));
        assert_eq!(detection_bound(&s, secs(1.0)).silent, None);
        assert!(warnings(
            &with_env(&[
                ("UCX_CUDA_IPC_CACHE", "no"),
                ("UCX_TCP_USER_TIMEOUT", "10s"),
                ("UCX_RC_GDA_EP_ALLOC_MODE", "direct"),
            ])
            .unwrap()
        )
        .is_empty());
    }

    #[test]
    fn tcp_without_a_user_timeout_warns_that_partitions_take_minutes() {
        let quiet = [("UCX_CUDA_IPC_CACHE", "n")];
        for v in ["auto", "inf", "0"] {
            let s = with_env(&[quiet[0], ("UCX_TLS", "tcp"), ("UCX_TCP_USER_TIMEOUT", v)]).unwrap();
            let w = warnings(&s);
            assert_eq!(w.len(), 1, "{v}: {w:?}");
            assert!(
                w[0].contains("924.6s") && w[0].contains("set UCX_TCP_USER_TIMEOUT"),
                "{w:?}"
            );
        }
        // Set, or TCP not in use: nothing to say.
        let s = with_env(&[
            quiet[0],
            ("UCX_TLS", "tcp"),
            ("UCX_TCP_USER_TIMEOUT", "10s"),
        ])
        .unwrap();
        assert!(warnings(&s).is_empty());
        let s = with_env(&[quiet[0], ("UCX_TLS", "rc,ud,sm")]).unwrap();
        assert!(warnings(&s).is_empty());
    }

    #[test]
    fn the_rc_gda_pool_warns_where_that_transport_can_run_and_a_bad_value_is_refused() {
        let quiet = [("UCX_CUDA_IPC_CACHE", "n"), ("UCX_TCP_USER_TIMEOUT", "10s")];
        for (tls, mode, warned) in [
            ("all", "pool", true),
            ("all", "POOL", true),
            ("rc_gda,tcp", "pool", true),
            ("^tcp", "pool", true),
            ("all", "direct", false),
            ("rc,ud,tcp", "pool", false),
            ("^rc_gda", "pool", false),
        ] {
            let s = with_env(&[
                quiet[0],
                quiet[1],
                ("UCX_TLS", tls),
                ("UCX_RC_GDA_EP_ALLOC_MODE", mode),
            ])
            .unwrap();
            let w = warnings(&s);
            assert_eq!(!w.is_empty(), warned, "{tls} {mode}: {w:?}");
            if warned {
                assert!(
                    w[0].contains("set UCX_RC_GDA_EP_ALLOC_MODE=direct"),
                    "{w:?}"
                );
            }
        }
        // No RDMA device on this host: rc_gda cannot run.
        let mut s = with_env(&[quiet[0], quiet[1]]).unwrap();
        s.rdma_devices.value = false;
        assert!(warnings(&s).is_empty(), "{:?}", warnings(&s));
        let e = with_env(&[("UCX_RC_GDA_EP_ALLOC_MODE", "pooled")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("UCX_RC_GDA_EP_ALLOC_MODE") && e.contains("pool or direct"),
            "{e}"
        );
        assert!(UcxSettings::defaults()
            .summary()
            .contains("RC_GDA_EP_ALLOC_MODE=pool(default)"));
    }

    #[test]
    fn display_is_one_line() {
        let b = detection_bound(&UcxSettings::defaults(), secs(2.0));
        let line = b.to_string();
        assert!(!line.contains('\n'));
        assert!(line.starts_with("dead peer released within "), "{line}");
        let s = UcxSettings::defaults().summary();
        assert!(s.contains("KEEPALIVE_INTERVAL=20s(default)"), "{s}");
    }

    #[test]
    fn the_largest_values_ucx_syntax_allows_do_not_overflow_the_bound() {
        // Every time at the parser's maximum (10^9 s), the retry count at
        // u32::MAX, every transport on, and the longest heartbeat gap the
        // configuration allows (two days): the sums stay far inside
        // `Duration` (rc: 10^9 s * 2^32 is about 4.3 * 10^18 s < 1.8 * 10^19).
        let max = "1000000000s";
        let s = with_env(&[
            ("UCX_TLS", "all"),
            ("UCX_KEEPALIVE_INTERVAL", max),
            ("UCX_UD_TIMEOUT", max),
            ("UCX_RC_TIMEOUT", max),
            ("UCX_RC_RETRY_COUNT", "4294967295"),
            ("UCX_TCP_USER_TIMEOUT", max),
            ("UCX_TCP_KEEPIDLE", max),
            ("UCX_TCP_KEEPINTVL", max),
            ("UCX_TCP_KEEPCNT", "4294967295"),
        ])
        .unwrap();
        let gap = crate::config::MAX_TIME_KNOB * 2;
        let b = detection_bound(&s, gap);
        // retries + 1 saturates at u32::MAX.
        let rc = Duration::from_secs(1_000_000_000) * 4_294_967_295;
        assert_eq!(
            b.silent,
            Some(Duration::from_secs(1_000_000_000) + rc + gap + SLACK)
        );
        assert!(b.crashed >= gap + SLACK);
        assert!(!b.to_string().is_empty());
        // One more second is refused by the parser, before any sum.
        assert!(with_env(&[("UCX_UD_TIMEOUT", "1000000001s")]).is_err());
    }

    #[test]
    fn negated_tls_lists_exclude_transports() {
        let s = with_env(&[("UCX_TLS", "^ib,rc,ud,dc")]).unwrap();
        assert!(!s.tl_enabled(&["ud"]));
        assert!(s.tl_enabled(&["tcp"]));
    }
}
