//! The service's knobs, in UCX's own language.
//!
//! Operators already tune failure detection with `UCX_KEEPALIVE_INTERVAL`
//! and friends, so ours read the same way: `NIXL_KEEPALIVE_*` environment
//! variables whose time values use UCX's syntax (`2s`, `500ms`, `1m`, a bare
//! number of seconds, `inf` where disabling makes sense). A bad value stops
//! start-up with an error that names the variable, the value, the reason
//! and what is accepted; when several values are wrong, every one of them
//! is reported at once ([`ConfigErrors`]). Nothing runs on a guess.
//!
//! Every knob is bounded to what the service can honour (see
//! [`MIN_PERIOD`], [`MAX_TIME_KNOB`], [`MAX_RATE_BURST`],
//! [`MAX_EVENT_CAPACITY`]): a value that parses but would panic a timer,
//! abort on allocation or spin a core is refused at start-up, with the
//! bound in the error.
//!
//! The jitter and the rate period derive from the interval when they are
//! not set (10% of it, and the interval capped at 1 s), so setting only
//! `NIXL_KEEPALIVE_INTERVAL` is always consistent.

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use crate::ucx::time::{parse_time, TimeField, UcxTime};

/// Prefix of every environment variable the service reads.
pub const ENV_PREFIX: &str = "NIXL_KEEPALIVE_";

/// The shortest period a periodic knob (interval, rate period, metrics
/// period) accepts. tokio's timers tick in whole
/// milliseconds, and every heartbeat round is a trip through the blocking
/// offload: below 10 ms a period is mostly timer rounding, and a 1 ns
/// period would keep a core busy doing nothing useful.
pub const MIN_PERIOD: Duration = Duration::from_millis(10);

/// The shortest read-stall bound: below it, a read that is merely slow
/// (a large KV block over TCP) would be taken for a hung peer.
pub const MIN_READ_STALL: Duration = Duration::from_millis(100);

/// The longest finite value any time knob accepts: one day. A heartbeat
/// less often than daily detects nothing worth the name (use `inf` to turn
/// it off), no shutdown should wait a day for a read, and deadlines stay
/// far inside what tokio's timers hold.
pub const MAX_TIME_KNOB: Duration = Duration::from_secs(24 * 60 * 60);

/// The largest burst of the per-engine rate cap. governor keeps the burst
/// as `period * burst` nanoseconds in a `u64` (about 584 years): with the
/// one-day period bound, 1000 stays far inside it, and far above any burst
/// a heartbeat schedule needs.
pub const MAX_RATE_BURST: u32 = 1000;

/// The most events buffered per subscriber. tokio's broadcast channel
/// allocates every slot up front (rounded up to a power of two), so the
/// capacity is memory taken at start-up: 2^20 slots of an event (about a
/// hundred bytes each) is on the order of 100 MiB, the most a keepalive
/// should ever take for a buffer; 4294967295 aborted on allocation.
pub const MAX_EVENT_CAPACITY: usize = 1 << 20;

/// The rate period derived when none is set: the interval, but at most
/// this. It keeps the documented 1 s for the default 5 s interval, so that
/// lease renewals the runtime asks for between heartbeats still get
/// rounds; at or under 1 s it is the interval itself.
pub(crate) const DERIVED_RATE_PERIOD_CAP: Duration = Duration::from_secs(1);

/// The jitter derived when none is set: the interval divided by this
/// (10%).
pub(crate) const DERIVED_JITTER_DIVISOR: u32 = 10;

/// One knob: its environment name, default, syntax and meaning. The
/// README's knob table is this list (`tests/readme.rs` checks it).
///
/// Hidden: the table the workspace's own readers share (the Python
/// binding's keywords, the README test), not an embedding API; embedders
/// read [`Config`]'s accessors and the documented table.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct Knob {
    /// Environment variable.
    pub env: &'static str,
    /// Default value: as it would be written in the environment, or, for a
    /// default derived from another knob, how it is derived.
    pub default: &'static str,
    /// Accepted syntax and range.
    pub syntax: &'static str,
    /// What it does.
    pub meaning: &'static str,
    /// How its value is written: readers other than the environment's
    /// (the Python binding's keywords) take its values by this.
    pub kind: KnobKind,
}

/// How a knob's value is written. Hidden for the reason [`Knob`] is.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KnobKind {
    /// A UCX time (`250ms`; `inf` where the knob's syntax allows it).
    Time,
    /// A whole number.
    Count,
    /// One of the words its syntax lists.
    Word,
    /// `on` or `off`.
    Switch,
}

impl KnobKind {
    /// The kind's name, as the Python binding's `knobs()` lists it.
    pub fn as_str(self) -> &'static str {
        match self {
            KnobKind::Time => "time",
            KnobKind::Count => "count",
            KnobKind::Word => "word",
            KnobKind::Switch => "switch",
        }
    }
}

/// `NIXL_KEEPALIVE_*` variables read by other parts of the project: the
/// test harness (`REQUIRE_REAL`: a missing NIXL runtime fails the real
/// tests instead of skipping them; `BIN`: the prefill binary the Python
/// tests start; `FREEZE_CYCLES`: how many freeze cycles the real
/// given-up tests run; the rest: sizes and roles of the Python tests' child
/// processes), the UCX loader (`UCX_LIB`: an explicit `libucp` to load) and
/// the Python package's SGLang and vLLM plugins (`SGLANG`, `VLLM`: their
/// on/off switches).
/// Hidden for the reason [`Knob`] is.
#[doc(hidden)]
pub const NOT_SERVICE_KNOBS: &[&str] = &[
    "NIXL_KEEPALIVE_REQUIRE_REAL",
    "NIXL_KEEPALIVE_UCX_LIB",
    "NIXL_KEEPALIVE_BIN",
    "NIXL_KEEPALIVE_PY_RELEASES",
    "NIXL_KEEPALIVE_PY_CYCLES",
    "NIXL_KEEPALIVE_FREEZE_CYCLES",
    "NIXL_KEEPALIVE_FROZEN_CHILD",
    "NIXL_KEEPALIVE_BUFFER_CHILD",
    "NIXL_KEEPALIVE_SGLANG",
    "NIXL_KEEPALIVE_VLLM",
];

const INTERVAL: &str = "NIXL_KEEPALIVE_INTERVAL";
const JITTER: &str = "NIXL_KEEPALIVE_JITTER";
const RATE_PERIOD: &str = "NIXL_KEEPALIVE_RATE_PERIOD";
const RATE_BURST: &str = "NIXL_KEEPALIVE_RATE_BURST";
const EVENT_CAPACITY: &str = "NIXL_KEEPALIVE_EVENT_CAPACITY";
const SHUTDOWN_DRAIN: &str = "NIXL_KEEPALIVE_SHUTDOWN_DRAIN";
const METRICS_PERIOD: &str = "NIXL_KEEPALIVE_METRICS_PERIOD";
const READ_STALL: &str = "NIXL_KEEPALIVE_READ_STALL";
const READ_STALL_ACTION: &str = "NIXL_KEEPALIVE_READ_STALL_ACTION";
const ENDPOINT_EVENTS: &str = "NIXL_KEEPALIVE_ENDPOINT_EVENTS";
const GPU_UNMAP: &str = "NIXL_KEEPALIVE_GPU_UNMAP";

/// Every knob the service reads from the environment. Hidden for the
/// reason [`Knob`] is.
#[doc(hidden)]
pub const KNOBS: &[Knob] = &[
    Knob {
        env: INTERVAL,
        default: "5s",
        syntax: "UCX time (TIME_UNITS), 10ms to 1 day (86400s); `inf` disables periodic heartbeats",
        meaning: "How often every known prefill engine gets a heartbeat (`HB:` + lease ids). \
                  The crash-detection bound follows it.",
        kind: KnobKind::Time,
    },
    Knob {
        env: JITTER,
        default: "interval / 10",
        syntax: "UCX time (TIME), 0 up to (not including) the interval",
        meaning: "Each engine's next heartbeat is drawn uniformly within +/- this of the \
                  interval, so engines registered together do not beat together.",
        kind: KnobKind::Time,
    },
    Knob {
        env: RATE_PERIOD,
        default: "min(interval, 1s)",
        syntax: "UCX time (TIME), 10ms up to the interval (1 day at most)",
        meaning: "Per-engine rate cap: on average at most one notification round per period \
                  to one engine, heartbeats and runtime-requested lease renewals together.",
        kind: KnobKind::Time,
    },
    Knob {
        env: RATE_BURST,
        default: "2",
        syntax: "integer, 1 to 1000",
        meaning: "How many rounds one engine may get back to back before the rate cap applies.",
        kind: KnobKind::Count,
    },
    Knob {
        env: EVENT_CAPACITY,
        default: "1024",
        syntax: "integer, 1 to 1048576 (2^20)",
        meaning: "Events buffered per subscriber; a slower subscriber skips the oldest and is \
                  told how many it missed.",
        kind: KnobKind::Count,
    },
    Knob {
        env: SHUTDOWN_DRAIN,
        default: "5s",
        syntax: "UCX time (TIME), 0 to 1 day (86400s)",
        meaning: "At shutdown, how long reads in flight may go on: every engine is marked at \
                  once (no new reads), each is released as its reads end, and what still has \
                  reads after this is handed back unreleased.",
        kind: KnobKind::Time,
    },
    Knob {
        env: METRICS_PERIOD,
        default: "1s",
        syntax: "UCX time (TIME_UNITS), 10ms to 1 day (86400s); `inf` disables",
        meaning: "How often the engines-by-state and reads-in-flight gauges are refreshed.",
        kind: KnobKind::Time,
    },
    Knob {
        env: READ_STALL,
        default: "10s",
        syntax: "UCX time (TIME_UNITS), 100ms to 1 day (86400s); `inf` disables",
        meaning: "An engine whose reads in flight have not completed for this long, while the \
                  decoder's other reads still complete, is hung (frozen, deadlocked, lost its \
                  NIC: UCX reports none of these on shm/tcp). 10s: far above a KV read's \
                  time, twice the default heartbeat interval, and no later than a 5s decode \
                  read timeout twice over. Checked four times per bound.",
        kind: KnobKind::Time,
    },
    Knob {
        env: READ_STALL_ACTION,
        default: "fail",
        syntax: "`fail` or `report`",
        meaning: "What a stall does: `fail` marks the engine stalled, fails its reads (their \
                  guards say `is_failed`) and releases it once they end; `report` only emits \
                  the event, the metric and a log line, once per stall.",
        kind: KnobKind::Word,
    },
    Knob {
        env: ENDPOINT_EVENTS,
        default: "on",
        syntax: "`on` or `off`",
        meaning: "`on`: when UCX fails an endpoint of the decode's agent (a peer's TCP \
                  connection closed: a killed process, milliseconds after its death), that \
                  engine gets a heartbeat at once instead of at its next round; only that \
                  heartbeat's REMOTE_DISCONNECT marks it. `off`: heartbeats alone.",
        kind: KnobKind::Switch,
    },
    Knob {
        env: GPU_UNMAP,
        default: "on",
        syntax: "`on` or `off`",
        meaning: "`on`: a release gives back the GPU mappings UCX's CUDA IPC cache keeps of \
                  the engine's memory (UCX_CUDA_IPC_CACHE=y, UCX's default, otherwise keeps \
                  them until the decode exits, and a restarted prefill cannot get its memory \
                  back), once no transfer holds them; a peer that comes back maps afresh. \
                  `off`: left to UCX. Read once per process, before UCX maps anything \
                  (docs/design/gpu-mappings.md).",
        kind: KnobKind::Switch,
    },
];

/// The service's configuration. Build it with [`Config::builder`] or read
/// it with [`Config::from_env`]; both validate, and there is no other way
/// to make one: its fields are private, so every `Config` the service is
/// given is within the bounds of the knob table (no value can panic a timer,
/// abort an allocation or spin the driver). Read the values with the
/// accessors; change them with [`Config::to_builder`].
///
/// ```compile_fail
/// // A field cannot be set around the validation.
/// let mut config = nixl_keepalive::Config::default();
/// config.event_capacity = 0;
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Heartbeat period per engine; `None` disables periodic heartbeats
    /// (lease renewals requested by the runtime still go out).
    pub(crate) heartbeat_interval: Option<Duration>,
    /// Uniform jitter applied to each engine's next heartbeat.
    pub(crate) jitter: Duration,
    /// Per-engine rate cap: one notification round per period on average.
    pub(crate) rate_period: Duration,
    /// Per-engine rate cap: rounds allowed back to back.
    pub(crate) rate_burst: u32,
    /// Events buffered per subscriber.
    pub(crate) event_capacity: usize,
    /// Gauge refresh period; `None` disables the refresh.
    pub(crate) metrics_period: Option<Duration>,
    /// At shutdown, how long reads in flight may go on before the engines
    /// that still have reads are handed back unreleased.
    pub(crate) shutdown_drain: Duration,
    /// A registration whose reads in flight have not completed for this
    /// long, while the decoder's other reads go on, is stalled (a hung
    /// peer); `None` disables the check.
    pub(crate) read_stall: Option<Duration>,
    /// What a stall does: fail the engine's reads and release it, or only
    /// report it.
    pub(crate) stall_action: StallAction,
    /// Seed for the heartbeat jitter; `None` seeds from the OS. Tests and
    /// the demo fix it so that runs repeat.
    pub(crate) seed: Option<u64>,
    /// Whether the transport's endpoint failures send an engine a
    /// heartbeat at once ([`crate::Transport::watch_failures`]).
    pub(crate) endpoint_events: bool,
    /// Whether releases give the engine's GPU mappings back
    /// ([`crate::Transport::gpu_mappings`]).
    pub(crate) gpu_unmap: bool,
}

impl Config {
    /// Heartbeat period per engine; `None`: periodic heartbeats are off
    /// (lease renewals requested by the runtime still go out).
    pub fn heartbeat_interval(&self) -> Option<Duration> {
        self.heartbeat_interval
    }

    /// Uniform jitter applied to each engine's next heartbeat.
    pub fn jitter(&self) -> Duration {
        self.jitter
    }

    /// Per-engine rate cap: one notification round per this period on
    /// average.
    pub fn rate_period(&self) -> Duration {
        self.rate_period
    }

    /// Per-engine rate cap: rounds allowed back to back.
    pub fn rate_burst(&self) -> u32 {
        self.rate_burst
    }

    /// Events buffered per subscriber.
    pub fn event_capacity(&self) -> usize {
        self.event_capacity
    }

    /// Gauge refresh period; `None`: no refresh.
    pub fn metrics_period(&self) -> Option<Duration> {
        self.metrics_period
    }

    /// At shutdown, how long reads in flight may go on.
    pub fn shutdown_drain(&self) -> Duration {
        self.shutdown_drain
    }

    /// The read-stall bound; `None`: the check is off.
    pub fn read_stall(&self) -> Option<Duration> {
        self.read_stall
    }

    /// What a stall does.
    pub fn stall_action(&self) -> StallAction {
        self.stall_action
    }

    /// The jitter's random seed, when fixed.
    pub fn seed(&self) -> Option<u64> {
        self.seed
    }

    /// Whether an endpoint failure the transport reports sends that
    /// engine a heartbeat at once.
    pub fn endpoint_events(&self) -> bool {
        self.endpoint_events
    }

    /// Whether a release gives back the GPU mappings UCX cached of the
    /// engine's memory.
    pub fn gpu_unmap(&self) -> bool {
        self.gpu_unmap
    }

    /// This configuration with the jitter's seed `seed` (`None`: from the
    /// OS). No seed is out of bounds.
    pub fn with_seed(mut self, seed: Option<u64>) -> Config {
        self.seed = seed;
        self
    }

    /// A builder holding every value of this configuration, each as if
    /// set explicitly: changing the interval there does not derive the
    /// jitter or the rate period again. [`ConfigBuilder::build`] checks
    /// the result as always.
    pub fn to_builder(&self) -> ConfigBuilder {
        ConfigBuilder {
            config: self.clone(),
            jitter_set: true,
            rate_period_set: true,
        }
    }
}

/// The defaults: a 5 s interval and the jitter and rate period derived
/// from it (500 ms, 1 s).
impl Default for Config {
    fn default() -> Self {
        let interval = Some(Duration::from_secs(5));
        Config {
            heartbeat_interval: interval,
            jitter: derived_jitter(interval),
            rate_period: derived_rate_period(interval),
            rate_burst: 2,
            event_capacity: 1024,
            metrics_period: Some(Duration::from_secs(1)),
            shutdown_drain: Duration::from_secs(5),
            read_stall: Some(Duration::from_secs(10)),
            stall_action: StallAction::Fail,
            seed: None,
            endpoint_events: true,
            gpu_unmap: true,
        }
    }
}

/// What the service does with an engine whose reads stopped completing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StallAction {
    /// Mark it stalled, fail its reads (their guards report `is_failed`),
    /// and release it once they end.
    Fail,
    /// Only report it (event, metric, log), once per stall.
    Report,
}

impl StallAction {
    /// `fail` or `report`: the metric label and the environment value.
    pub fn as_str(self) -> &'static str {
        match self {
            StallAction::Fail => "fail",
            StallAction::Report => "report",
        }
    }
}

/// The jitter used when none is set: 10% of the interval (nothing when
/// periodic heartbeats are off: it only spreads them).
pub(crate) fn derived_jitter(interval: Option<Duration>) -> Duration {
    interval.map_or(Duration::ZERO, |i| i / DERIVED_JITTER_DIVISOR)
}

/// The rate period used when none is set: the interval, capped at
/// [`DERIVED_RATE_PERIOD_CAP`] (the cap alone when heartbeats are off).
pub(crate) fn derived_rate_period(interval: Option<Duration>) -> Duration {
    interval.map_or(DERIVED_RATE_PERIOD_CAP, |i| i.min(DERIVED_RATE_PERIOD_CAP))
}

/// One configuration value that was not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// An environment variable's value did not parse.
    #[error("{var}={value:?} is not accepted: {reason}; expected {expected}")]
    Env {
        /// The variable.
        var: &'static str,
        /// Its value, as found.
        value: String,
        /// What was wrong with it.
        reason: String,
        /// The accepted syntax.
        expected: &'static str,
    },
    /// A value parsed but is out of its range or does not fit the others
    /// (e.g. jitter not below the interval).
    #[error("{setting}={value} is not accepted: {reason}; expected {expected}")]
    Invalid {
        /// The setting, by its environment name.
        setting: &'static str,
        /// Its value, in UCX syntax.
        value: String,
        /// Why it is not accepted.
        reason: String,
        /// What is accepted (syntax and range, as in the knob table).
        expected: &'static str,
    },
}

impl ConfigError {
    /// The environment variable the error is about.
    pub fn setting(&self) -> &'static str {
        match self {
            ConfigError::Env { var, .. } => var,
            ConfigError::Invalid { setting, .. } => setting,
        }
    }
}

/// Every configuration value that was not accepted, in the knob table's order, so
/// that one start-up reports them all. Never empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigErrors(Vec<ConfigError>);

impl ConfigErrors {
    /// The errors, one per refused value (a value can fail more than one
    /// rule only when it is out of range; then only the range is reported).
    pub fn errors(&self) -> &[ConfigError] {
        &self.0
    }

    /// The error about `setting`, if any.
    pub fn about(&self, setting: &str) -> Option<&ConfigError> {
        self.0.iter().find(|e| e.setting() == setting)
    }

    fn check(errors: Vec<ConfigError>) -> Result<(), ConfigErrors> {
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ConfigErrors(errors))
        }
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.as_slice() {
            [one] => write!(f, "{one}"),
            all => {
                write!(f, "{} configuration values are not accepted:", all.len())?;
                for e in all {
                    write!(f, "\n  - {e}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for ConfigErrors {}

impl From<ConfigError> for ConfigErrors {
    fn from(e: ConfigError) -> Self {
        ConfigErrors(vec![e])
    }
}

impl IntoIterator for ConfigErrors {
    type Item = ConfigError;
    type IntoIter = std::vec::IntoIter<ConfigError>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl Config {
    /// A builder starting from the defaults. The jitter and the rate
    /// period derive from the interval unless they are set explicitly.
    pub fn builder() -> ConfigBuilder {
        ConfigBuilder {
            config: Config::default(),
            jitter_set: false,
            rate_period_set: false,
        }
    }

    /// Reads `NIXL_KEEPALIVE_*` from the process environment over the
    /// defaults (the README's knob table), deriving the jitter and the rate period
    /// from the interval where they are not set. Every refused value is
    /// in the error.
    pub fn from_env() -> Result<Config, ConfigErrors> {
        Self::from_lookup(|var| std::env::var(var).ok())
    }

    /// Reads the knobs through `lookup` (the environment, or a map in
    /// tests) over the defaults, then validates.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigErrors> {
        let mut builder = Config::builder();
        let mut errors = Vec::new();
        // Knobs whose value did not parse: no other rule is checked
        // against their (default) stand-in.
        let mut unparsed = BTreeSet::new();
        for knob in KNOBS {
            let Some(value) = lookup(knob.env) else {
                continue;
            };
            let read = match knob.env {
                INTERVAL => env_time(knob, &value, TimeField::TimeUnits, true)
                    .map(|d| builder.config.heartbeat_interval = d),
                JITTER => env_time(knob, &value, TimeField::Time, false).map(|d| {
                    builder.config.jitter = required(d);
                    builder.jitter_set = true;
                }),
                RATE_PERIOD => env_time(knob, &value, TimeField::Time, false).map(|d| {
                    builder.config.rate_period = required(d);
                    builder.rate_period_set = true;
                }),
                RATE_BURST => env_count(knob, &value, u64::from(MAX_RATE_BURST))
                    .map(|n| builder.config.rate_burst = n as u32),
                EVENT_CAPACITY => env_count(knob, &value, MAX_EVENT_CAPACITY as u64)
                    .map(|n| builder.config.event_capacity = n as usize),
                SHUTDOWN_DRAIN => env_time(knob, &value, TimeField::Time, false)
                    .map(|d| builder.config.shutdown_drain = required(d)),
                METRICS_PERIOD => env_time(knob, &value, TimeField::TimeUnits, true)
                    .map(|d| builder.config.metrics_period = d),
                READ_STALL => env_time(knob, &value, TimeField::TimeUnits, true)
                    .map(|d| builder.config.read_stall = d),
                READ_STALL_ACTION => match value.trim() {
                    "fail" => Ok(StallAction::Fail),
                    "report" => Ok(StallAction::Report),
                    _ => Err(ConfigError::Env {
                        var: knob.env,
                        value: value.clone(),
                        reason: "not a stall action".into(),
                        expected: "`fail` or `report`",
                    }),
                }
                .map(|a| builder.config.stall_action = a),
                ENDPOINT_EVENTS => {
                    switch(knob.env, &value).map(|on| builder.config.endpoint_events = on)
                }
                GPU_UNMAP => switch(knob.env, &value).map(|on| builder.config.gpu_unmap = on),
                other => unreachable!("knob {other} has no reader"),
            };
            if let Err(e) = read {
                unparsed.insert(knob.env);
                errors.push(e);
            }
        }
        errors.extend(builder.problems(&unparsed));
        let config = builder.derive();
        errors.sort_by_key(|e| KNOBS.iter().position(|k| k.env == e.setting()));
        ConfigErrors::check(errors)?;
        Ok(config)
    }

    /// `NIXL_KEEPALIVE_*` variables set in the process environment that no
    /// knob reads: most likely typos. The service logs them at start-up, as
    /// UCX does for its own unused variables.
    pub fn unknown_env_vars() -> Vec<String> {
        let known: BTreeSet<&str> = KNOBS.iter().map(|k| k.env).collect();
        std::env::vars()
            .map(|(k, _)| k)
            .filter(|k| k.starts_with(ENV_PREFIX) && !known.contains(k.as_str()))
            // Read by the test harness and the UCX loader, not by the
            // service.
            .filter(|k| !NOT_SERVICE_KNOBS.contains(&k.as_str()))
            .collect()
    }

    /// Checks every value against its range and the others; every value
    /// refused is in the error.
    pub fn validate(&self) -> Result<(), ConfigErrors> {
        ConfigErrors::check(self.problems(&BTreeSet::new()))
    }

    /// One error per refused value, in [`KNOBS`] order. The knobs in
    /// `unparsed` hold stand-ins for values that did not parse (already
    /// reported): nothing is checked about them or against them.
    fn problems(&self, unparsed: &BTreeSet<&str>) -> Vec<ConfigError> {
        let mut errors = Vec::new();
        let mut refuse = |setting: &'static str, value: String, reason: String| {
            errors.push(invalid(setting, value, reason));
        };

        let interval_ok = !unparsed.contains(INTERVAL)
            && match self.heartbeat_interval {
                Some(interval) if interval.is_zero() => {
                    refuse(
                        INTERVAL,
                        time_text(interval),
                        "must be above zero (use `inf` to disable periodic heartbeats)".into(),
                    );
                    false
                }
                Some(interval) => match period_problem(interval) {
                    Some(reason) => {
                        refuse(INTERVAL, time_text(interval), reason);
                        false
                    }
                    None => true,
                },
                None => true,
            };

        if self.jitter > MAX_TIME_KNOB {
            refuse(
                JITTER,
                time_text(self.jitter),
                format!("must be at most {}", time_text(MAX_TIME_KNOB)),
            );
        } else if let (Some(interval), true) = (self.heartbeat_interval, interval_ok) {
            if self.jitter >= interval {
                refuse(
                    JITTER,
                    time_text(self.jitter),
                    format!("must be below the interval ({})", time_text(interval)),
                );
            }
        }

        if self.rate_period.is_zero() {
            refuse(RATE_PERIOD, "0s".into(), "must be above zero".into());
        } else if let Some(reason) = period_problem(self.rate_period) {
            refuse(RATE_PERIOD, time_text(self.rate_period), reason);
        } else if let (Some(interval), true) = (self.heartbeat_interval, interval_ok) {
            if self.rate_period > interval {
                refuse(
                    RATE_PERIOD,
                    time_text(self.rate_period),
                    format!(
                        "must not exceed the interval ({}): the rate cap would silently \
                         stretch every heartbeat to one per rate period",
                        time_text(interval)
                    ),
                );
            }
        }

        if self.rate_burst == 0 || self.rate_burst > MAX_RATE_BURST {
            refuse(
                RATE_BURST,
                self.rate_burst.to_string(),
                format!("must be from 1 to {MAX_RATE_BURST}"),
            );
        }
        if self.event_capacity == 0 || self.event_capacity > MAX_EVENT_CAPACITY {
            refuse(
                EVENT_CAPACITY,
                self.event_capacity.to_string(),
                format!(
                    "must be from 1 to {MAX_EVENT_CAPACITY}: every slot is allocated at start-up"
                ),
            );
        }
        if self.shutdown_drain > MAX_TIME_KNOB {
            refuse(
                SHUTDOWN_DRAIN,
                time_text(self.shutdown_drain),
                format!("must be at most {}", time_text(MAX_TIME_KNOB)),
            );
        }
        match self.metrics_period {
            Some(p) if p.is_zero() => refuse(
                METRICS_PERIOD,
                "0s".into(),
                "must be above zero (use `inf` to disable)".into(),
            ),
            Some(p) => {
                if let Some(reason) = period_problem(p) {
                    refuse(METRICS_PERIOD, time_text(p), reason);
                }
            }
            None => {}
        }
        if let Some(bound) = self.read_stall {
            if !(MIN_READ_STALL..=MAX_TIME_KNOB).contains(&bound) {
                refuse(
                    READ_STALL,
                    time_text(bound),
                    format!(
                        "must be from {} to {} (use `inf` to disable)",
                        time_text(MIN_READ_STALL),
                        time_text(MAX_TIME_KNOB)
                    ),
                );
            }
        }
        errors.retain(|e| !unparsed.contains(e.setting()));
        errors
    }
}

/// Why a period (interval, rate period, metrics period) is outside
/// [`MIN_PERIOD`]..=[`MAX_TIME_KNOB`], if it is.
fn period_problem(d: Duration) -> Option<String> {
    (!(MIN_PERIOD..=MAX_TIME_KNOB).contains(&d)).then(|| {
        format!(
            "must be from {} to {}",
            time_text(MIN_PERIOD),
            time_text(MAX_TIME_KNOB)
        )
    })
}

/// A refused value, with what its knob accepts.
fn invalid(setting: &'static str, value: String, reason: String) -> ConfigError {
    ConfigError::Invalid {
        setting,
        value,
        reason,
        expected: knob(setting).syntax,
    }
}

/// An `on`/`off` knob's value.
fn switch(var: &'static str, value: &str) -> Result<bool, ConfigError> {
    match value.trim() {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(ConfigError::Env {
            var,
            value: value.to_owned(),
            reason: "not a switch".into(),
            expected: "`on` or `off`",
        }),
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let interval = match self.heartbeat_interval {
            Some(d) => format!("{d:?}"),
            None => "inf".to_string(),
        };
        write!(
            f,
            "interval={interval} jitter={:?} rate=1/{:?} burst={} endpoint_events={} gpu_unmap={}",
            self.jitter,
            self.rate_period,
            self.rate_burst,
            if self.endpoint_events { "on" } else { "off" },
            if self.gpu_unmap { "on" } else { "off" }
        )
    }
}

fn knob(env: &str) -> &'static Knob {
    KNOBS
        .iter()
        .find(|k| k.env == env)
        .expect("every setting is a knob")
}

/// A duration in UCX syntax (`86400s`, `250ms`, `1ns`): what an operator
/// would write back into the environment.
fn time_text(d: Duration) -> String {
    UcxTime::Finite(d).to_string()
}

/// Where `allow_inf` is false the field is a plain TIME field, which the
/// parser already refuses `inf` for; the `Option` is then always `Some`.
fn env_time(
    knob: &Knob,
    value: &str,
    field: TimeField,
    allow_inf: bool,
) -> Result<Option<Duration>, ConfigError> {
    let env_error = |reason: String| ConfigError::Env {
        var: knob.env,
        value: value.to_string(),
        reason,
        expected: knob.syntax,
    };
    match parse_time(value, field)
        .map_err(|e| env_error(format!("{} ({})", e.issue.describe(), field.syntax_help())))?
    {
        UcxTime::Finite(d) => Ok(Some(d)),
        UcxTime::Infinite if allow_inf => Ok(None),
        UcxTime::Infinite | UcxTime::Auto => Err(env_error(format!(
            "`{}` has no meaning for this setting",
            value.trim()
        ))),
    }
}

fn required(value: Option<Duration>) -> Duration {
    value.expect("TIME fields never parse to inf")
}

/// A whole number from 1 to `max`; anything else is refused with the
/// range. Numbers too large for the setting's type are out of range, not
/// a syntax error.
fn env_count(knob: &Knob, value: &str, max: u64) -> Result<u64, ConfigError> {
    let text = value.trim();
    let error = |reason: String| ConfigError::Env {
        var: knob.env,
        value: value.to_string(),
        reason,
        expected: knob.syntax,
    };
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(error("not a whole decimal number".into()));
    }
    match text.parse::<u64>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(error(format!("must be from 1 to {max}"))),
    }
}

/// Builds a [`Config`]; [`ConfigBuilder::build`] validates. Values set
/// here are taken as they are; the jitter and the rate period, when not
/// set, derive from the interval at [`ConfigBuilder::build`] (10% of it,
/// and the interval capped at 1 s), whatever order the calls came in.
#[derive(Clone, Debug)]
pub struct ConfigBuilder {
    config: Config,
    jitter_set: bool,
    rate_period_set: bool,
}

impl ConfigBuilder {
    /// Heartbeat period; `None` disables periodic heartbeats.
    pub fn heartbeat_interval(mut self, interval: Option<Duration>) -> Self {
        self.config.heartbeat_interval = interval;
        self
    }

    /// Jitter of each engine's next heartbeat (not derived from the
    /// interval once set).
    pub fn jitter(mut self, jitter: Duration) -> Self {
        self.config.jitter = jitter;
        self.jitter_set = true;
        self
    }

    /// Per-engine rate cap: period and burst (the period is not derived
    /// from the interval once set).
    pub fn rate_limit(mut self, period: Duration, burst: u32) -> Self {
        self.config.rate_period = period;
        self.config.rate_burst = burst;
        self.rate_period_set = true;
        self
    }

    /// Events buffered per subscriber.
    pub fn event_capacity(mut self, capacity: usize) -> Self {
        self.config.event_capacity = capacity;
        self
    }

    /// Gauge refresh period; `None` disables it.
    pub fn metrics_period(mut self, period: Option<Duration>) -> Self {
        self.config.metrics_period = period;
        self
    }

    /// The read-stall bound (`None` disables the check) and what a stall
    /// does.
    pub fn read_stall(mut self, bound: Option<Duration>, action: StallAction) -> Self {
        self.config.read_stall = bound;
        self.config.stall_action = action;
        self
    }

    /// Whether endpoint failures the transport reports send that engine
    /// a heartbeat at once (default on).
    pub fn endpoint_events(mut self, on: bool) -> Self {
        self.config.endpoint_events = on;
        self
    }

    /// Whether a release gives back the GPU mappings UCX's CUDA IPC cache
    /// keeps of the engine's memory (default on; see
    /// [`crate::Transport::gpu_mappings`]).
    pub fn gpu_unmap(mut self, on: bool) -> Self {
        self.config.gpu_unmap = on;
        self
    }

    /// How long reads in flight may go on at shutdown.
    pub fn shutdown_drain(mut self, drain: Duration) -> Self {
        self.config.shutdown_drain = drain;
        self
    }

    /// Fixes the jitter's random seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.config.seed = Some(seed);
        self
    }

    /// The configuration with the unset jitter and rate period derived
    /// from the interval; not validated.
    fn derive(mut self) -> Config {
        if !self.jitter_set {
            self.config.jitter = derived_jitter(self.config.heartbeat_interval);
        }
        if !self.rate_period_set {
            self.config.rate_period = derived_rate_period(self.config.heartbeat_interval);
        }
        self.config
    }

    /// What [`Config::validate`] refuses in the derived configuration,
    /// less what only follows from a refused interval: a jitter or rate
    /// period derived from an out-of-range interval was never the
    /// operator's value.
    fn problems(&self, unparsed: &BTreeSet<&str>) -> Vec<ConfigError> {
        let mut errors = self.clone().derive().problems(unparsed);
        if errors.iter().any(|e| e.setting() == INTERVAL) {
            errors.retain(|e| match e.setting() {
                JITTER => self.jitter_set,
                RATE_PERIOD => self.rate_period_set,
                _ => true,
            });
        }
        errors
    }

    /// Derives what is unset, validates, and returns the configuration;
    /// every refused value is in the error.
    pub fn build(self) -> Result<Config, ConfigErrors> {
        ConfigErrors::check(self.problems(&BTreeSet::new()))?;
        Ok(self.derive())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(vars: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    const NS: Duration = Duration::from_nanos(1);

    /// The one error `vars` gives, which must be about `setting`.
    fn refused(vars: &[(&str, &str)], setting: &str) -> ConfigError {
        let errors = from(vars).expect_err(&format!("{vars:?} must be refused"));
        assert_eq!(errors.errors().len(), 1, "{errors}");
        let e = errors.errors()[0].clone();
        assert_eq!(e.setting(), setting, "{errors}");
        e
    }

    /// A value written as `kind` writes it, within every knob's range.
    fn sample(knob: &Knob, kind: KnobKind) -> String {
        match kind {
            KnobKind::Time => "100ms".into(),
            KnobKind::Count => "1".into(),
            KnobKind::Switch => "off".into(),
            // The first word its syntax lists (`fail` or `report`).
            KnobKind::Word => knob
                .syntax
                .split('`')
                .nth(1)
                .expect("a word in backticks")
                .into(),
        }
    }

    #[test]
    fn every_knob_reads_values_of_its_table_kind_and_refuses_the_others() {
        for knob in KNOBS {
            let own = sample(knob, knob.kind);
            assert!(
                from(&[(knob.env, &own)]).is_ok(),
                "{} ({:?}) refused {own:?}",
                knob.env,
                knob.kind
            );
            // A word is sampled from a word knob's own syntax only; a count
            // is also a time in seconds to UCX's parser.
            let others = [KnobKind::Time, KnobKind::Count, KnobKind::Switch]
                .into_iter()
                .filter(|k| *k != knob.kind)
                .filter(|k| !(knob.kind == KnobKind::Time && *k == KnobKind::Count));
            for other in others {
                refused(&[(knob.env, &sample(knob, other))], knob.env);
            }
        }
    }

    #[test]
    fn values_read_in_ucx_syntax() {
        let c = from(&[
            ("NIXL_KEEPALIVE_INTERVAL", "2s"),
            ("NIXL_KEEPALIVE_JITTER", "100ms"),
            ("NIXL_KEEPALIVE_RATE_PERIOD", "250ms"),
            ("NIXL_KEEPALIVE_RATE_BURST", "4"),
        ])
        .unwrap();
        assert_eq!(c.heartbeat_interval, Some(Duration::from_secs(2)));
        assert_eq!(c.jitter, Duration::from_millis(100));
        assert_eq!(c.rate_period, Duration::from_millis(250));
        assert_eq!(c.rate_burst, 4);
        assert_eq!(from(&[]).unwrap(), Config::default());
    }

    #[test]
    fn the_defaults_are_the_derivations_at_the_default_interval() {
        let d = Config::default();
        assert_eq!(d.heartbeat_interval, Some(Duration::from_secs(5)));
        assert_eq!(d.jitter, ms(500));
        assert_eq!(d.rate_period, Duration::from_secs(1));
        assert!(d.validate().is_ok());
        // Each literal default in the table reads back to the default.
        for knob in KNOBS {
            if parse_time(knob.default, TimeField::TimeUnits).is_ok()
                || knob.default.parse::<u64>().is_ok()
            {
                assert_eq!(
                    from(&[(knob.env, knob.default)]).unwrap(),
                    Config::default(),
                    "{}",
                    knob.env
                );
            }
        }
        assert_eq!(knob(JITTER).default, "interval / 10");
        assert_eq!(knob(RATE_PERIOD).default, "min(interval, 1s)");
    }

    #[test]
    fn setting_only_a_250ms_interval_is_accepted_with_derived_jitter_and_rate_period() {
        let c = from(&[("NIXL_KEEPALIVE_INTERVAL", "250ms")]).unwrap();
        assert_eq!(c.heartbeat_interval, Some(ms(250)));
        assert_eq!(c.jitter, ms(25));
        assert_eq!(c.rate_period, ms(250));

        let c = from(&[("NIXL_KEEPALIVE_INTERVAL", "2s")]).unwrap();
        assert_eq!((c.jitter, c.rate_period), (ms(200), ms(1000)));
        // At the smallest interval too.
        let c = from(&[("NIXL_KEEPALIVE_INTERVAL", "10ms")]).unwrap();
        assert_eq!((c.jitter, c.rate_period), (ms(1), ms(10)));
        // Heartbeats off: nothing to spread, the cap alone.
        let c = from(&[("NIXL_KEEPALIVE_INTERVAL", "inf")]).unwrap();
        assert_eq!(c.heartbeat_interval, None);
        assert_eq!((c.jitter, c.rate_period), (Duration::ZERO, ms(1000)));
    }

    #[test]
    fn explicit_values_are_taken_as_they_are_not_derived() {
        let c = from(&[
            ("NIXL_KEEPALIVE_INTERVAL", "250ms"),
            ("NIXL_KEEPALIVE_JITTER", "10ms"),
        ])
        .unwrap();
        assert_eq!((c.jitter, c.rate_period), (ms(10), ms(250)));
        let c = from(&[
            ("NIXL_KEEPALIVE_INTERVAL", "250ms"),
            ("NIXL_KEEPALIVE_RATE_PERIOD", "100ms"),
        ])
        .unwrap();
        assert_eq!((c.jitter, c.rate_period), (ms(25), ms(100)));
        // An explicit value that does not fit is refused, not replaced.
        refused(
            &[
                ("NIXL_KEEPALIVE_INTERVAL", "250ms"),
                ("NIXL_KEEPALIVE_RATE_PERIOD", "1s"),
            ],
            RATE_PERIOD,
        );
    }

    #[test]
    fn the_builder_derives_what_is_not_set_whatever_the_order() {
        let c = Config::builder()
            .heartbeat_interval(Some(ms(250)))
            .build()
            .unwrap();
        assert_eq!((c.jitter, c.rate_period), (ms(25), ms(250)));
        let c = Config::builder()
            .jitter(ms(100))
            .heartbeat_interval(Some(ms(250)))
            .build()
            .unwrap();
        assert_eq!((c.jitter, c.rate_period), (ms(100), ms(250)));
        let c = Config::builder()
            .rate_limit(ms(50), 3)
            .heartbeat_interval(Some(Duration::from_secs(60)))
            .build()
            .unwrap();
        assert_eq!(
            (c.jitter, c.rate_period, c.rate_burst),
            (ms(6000), ms(50), 3)
        );
        let e = Config::builder()
            .heartbeat_interval(Some(ms(250)))
            .jitter(ms(250))
            .build()
            .unwrap_err();
        assert!(e.about(JITTER).is_some(), "{e}");
    }

    #[test]
    fn inf_disables_the_heartbeat_but_not_the_jitter() {
        let c = from(&[("NIXL_KEEPALIVE_INTERVAL", "inf")]).unwrap();
        assert_eq!(c.heartbeat_interval, None);
        let e = refused(&[("NIXL_KEEPALIVE_JITTER", "inf")], JITTER);
        assert!(matches!(e, ConfigError::Env { .. }), "{e}");
    }

    #[test]
    fn a_bad_value_names_the_variable_the_value_and_the_syntax() {
        let e = from(&[("NIXL_KEEPALIVE_INTERVAL", "5h")]).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("NIXL_KEEPALIVE_INTERVAL"), "{text}");
        assert!(text.contains("\"5h\""), "{text}");
        assert!(text.contains(TimeField::TimeUnits.syntax_help()), "{text}");
        assert!(text.contains(knob(INTERVAL).syntax), "{text}");
        assert_eq!(text.matches("expected").count(), 1, "{text}");
        let e = from(&[("NIXL_KEEPALIVE_RATE_BURST", "zero")]).unwrap_err();
        assert!(e.to_string().contains("NIXL_KEEPALIVE_RATE_BURST"));
    }

    /// `lo` and `hi` are accepted, one nanosecond outside each is refused
    /// with the bound in the error.
    fn time_edges(setting: &str, extra: &[(&str, &str)], lo: Duration, hi: Duration) {
        let with = |d: Duration| {
            let text = time_text(d);
            let mut vars = extra.to_vec();
            vars.push((setting, &text));
            from(&vars).map(|_| ()).map_err(|e| (e, text.clone()))
        };
        assert!(with(lo).is_ok(), "{setting}={lo:?}: {:?}", with(lo));
        assert!(with(hi).is_ok(), "{setting}={hi:?}: {:?}", with(hi));
        let mut outside = vec![hi + NS];
        if !lo.is_zero() {
            outside.push(lo - NS);
        }
        for d in outside {
            let (errors, text) = with(d).expect_err(&format!("{setting}={d:?} must be refused"));
            assert_eq!(errors.errors().len(), 1, "{errors}");
            let e = &errors.errors()[0];
            assert_eq!(e.setting(), setting, "{errors}");
            let shown = e.to_string();
            assert!(shown.contains(&format!("{setting}={text}")), "{shown}");
            let bound = if d > hi { hi } else { lo };
            assert!(shown.contains(&time_text(bound)), "{shown}");
            assert!(shown.contains(knob(setting).syntax), "{shown}");
        }
    }

    #[test]
    fn every_time_knob_is_bounded_at_both_edges() {
        time_edges(INTERVAL, &[], MIN_PERIOD, MAX_TIME_KNOB);
        time_edges(METRICS_PERIOD, &[], MIN_PERIOD, MAX_TIME_KNOB);
        time_edges(SHUTDOWN_DRAIN, &[], Duration::ZERO, MAX_TIME_KNOB);
        // Rate period: its own range, with the interval at its top so the
        // interval is not what limits it.
        time_edges(
            RATE_PERIOD,
            &[(INTERVAL, "86400s")],
            MIN_PERIOD,
            MAX_TIME_KNOB,
        );
        // With heartbeats off the jitter is only range-checked.
        time_edges(JITTER, &[(INTERVAL, "inf")], Duration::ZERO, MAX_TIME_KNOB);
        // With heartbeats on it must stay below the interval.
        assert!(from(&[(INTERVAL, "1s"), (JITTER, "999999999ns")]).is_ok());
        let e = refused(&[(INTERVAL, "1s"), (JITTER, "1s")], JITTER);
        assert!(e.to_string().contains("below the interval (1s)"), "{e}");
        // The rate period must not exceed the interval.
        assert!(from(&[(INTERVAL, "250ms"), (RATE_PERIOD, "250ms")]).is_ok());
        refused(
            &[(INTERVAL, "250ms"), (RATE_PERIOD, "250000001ns")],
            RATE_PERIOD,
        );
    }

    #[test]
    fn the_values_that_killed_the_service_are_refused_with_their_bound() {
        let e = refused(&[(INTERVAL, "100000000s")], INTERVAL);
        assert!(e.to_string().contains("86400s"), "{e}");
        let e = refused(&[(METRICS_PERIOD, "1ns")], METRICS_PERIOD);
        assert!(e.to_string().contains("10ms"), "{e}");
        let e = refused(&[(EVENT_CAPACITY, "4294967295")], EVENT_CAPACITY);
        assert!(e.to_string().contains("1048576"), "{e}");
        // Zero periods keep their own explanation.
        let e = refused(&[(INTERVAL, "0s")], INTERVAL);
        assert!(e.to_string().contains("`inf`"), "{e}");
        let e = refused(&[(METRICS_PERIOD, "0")], METRICS_PERIOD);
        assert!(e.to_string().contains("`inf`"), "{e}");
        refused(&[(RATE_PERIOD, "0s")], RATE_PERIOD);
        assert!(from(&[(METRICS_PERIOD, "inf")])
            .unwrap()
            .metrics_period
            .is_none());
    }

    #[test]
    fn every_count_knob_is_bounded_at_both_edges() {
        for (setting, max) in [
            (RATE_BURST, u64::from(MAX_RATE_BURST)),
            (EVENT_CAPACITY, MAX_EVENT_CAPACITY as u64),
        ] {
            for ok in [1, max] {
                assert!(
                    from(&[(setting, &ok.to_string())]).is_ok(),
                    "{setting}={ok}"
                );
            }
            for bad in [
                "0".to_string(),
                (max + 1).to_string(),
                "4294967296".into(),
                "99999999999999999999999".into(),
            ] {
                let e = refused(&[(setting, &bad)], setting);
                let shown = e.to_string();
                assert!(shown.contains(&format!("from 1 to {max}")), "{shown}");
                assert!(shown.contains(&bad), "{shown}");
            }
            for bad in ["", "-1", "1.5", "1e3", "zero"] {
                let e = refused(&[(setting, bad)], setting);
                assert!(e.to_string().contains(knob(setting).syntax), "{e}");
            }
        }
        let c = from(&[(RATE_BURST, "1000"), (EVENT_CAPACITY, "1048576")]).unwrap();
        assert_eq!((c.rate_burst, c.event_capacity), (1000, 1 << 20));
        // The builder holds the same bounds.
        assert!(Config::builder()
            .event_capacity(MAX_EVENT_CAPACITY + 1)
            .build()
            .is_err());
        assert!(Config::builder()
            .rate_limit(ms(10), MAX_RATE_BURST + 1)
            .build()
            .is_err());
        assert!(Config::builder().rate_limit(ms(10), 0).build().is_err());
    }

    #[test]
    fn several_wrong_values_are_all_reported_at_once() {
        let e = from(&[
            (INTERVAL, "100000000s"),
            (EVENT_CAPACITY, "4294967295"),
            (METRICS_PERIOD, "1ns"),
            (RATE_BURST, "zero"),
            (SHUTDOWN_DRAIN, "2d"),
        ])
        .unwrap_err();
        let settings: Vec<&str> = e.errors().iter().map(ConfigError::setting).collect();
        // In table order, one each.
        assert_eq!(
            settings,
            [
                INTERVAL,
                RATE_BURST,
                EVENT_CAPACITY,
                SHUTDOWN_DRAIN,
                METRICS_PERIOD
            ],
            "{e}"
        );
        let text = e.to_string();
        assert!(
            text.starts_with("5 configuration values are not accepted:"),
            "{text}"
        );
        for (var, value) in [
            (INTERVAL, "100000000s"),
            (EVENT_CAPACITY, "4294967295"),
            (METRICS_PERIOD, "1ns"),
            (RATE_BURST, "zero"),
            (SHUTDOWN_DRAIN, "2d"),
        ] {
            let line = text
                .lines()
                .find(|l| l.contains(var))
                .unwrap_or_else(|| panic!("{var} missing: {text}"));
            assert!(line.contains(value), "{line}");
            assert!(line.contains("expected"), "{line}");
            assert!(line.contains(knob(var).syntax), "{line}");
        }
        // The jitter and the rate period, both wrong against the interval,
        // come together too.
        let e = from(&[(INTERVAL, "100ms"), (JITTER, "1s"), (RATE_PERIOD, "2s")]).unwrap_err();
        let settings: Vec<&str> = e.errors().iter().map(ConfigError::setting).collect();
        assert_eq!(settings, [JITTER, RATE_PERIOD], "{e}");
    }

    #[test]
    fn an_interval_that_did_not_parse_is_not_held_against_the_others() {
        // Against the 5s stand-in the jitter would be refused too: only
        // the interval is reported.
        let e = from(&[(INTERVAL, "5h"), (JITTER, "6s")]).unwrap_err();
        assert_eq!(e.errors().len(), 1, "{e}");
        assert_eq!(e.errors()[0].setting(), INTERVAL);
        // Out of range (parsed) still checks the rest on their own.
        let e = from(&[(INTERVAL, "100000000s"), (JITTER, "2d")]).unwrap_err();
        let settings: Vec<&str> = e.errors().iter().map(ConfigError::setting).collect();
        assert_eq!(settings, [INTERVAL, JITTER], "{e}");
    }

    #[test]
    fn the_event_capacity_bound_keeps_the_buffer_allocation_bounded() {
        // tokio allocates every slot at start: an event plus its slot
        // bookkeeping (a lock, a position, a count), a few words.
        let slot = std::mem::size_of::<crate::event::Event>() + 4 * std::mem::size_of::<usize>();
        let bytes = MAX_EVENT_CAPACITY.next_power_of_two() * slot;
        assert!(
            bytes <= 256 << 20,
            "{slot} B per slot: {bytes} B at the cap"
        );
    }
}
