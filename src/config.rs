//! The service's knobs, in UCX's own language.
//!
//! Operators already tune failure detection with `UCX_KEEPALIVE_INTERVAL`
//! and friends, so ours read the same way: `NIXL_KEEPALIVE_*` environment
//! variables whose time values use UCX's syntax (`2s`, `500ms`, `1m`, a bare
//! number of seconds, `inf` where disabling makes sense). A bad value stops
//! start-up with an error that names the variable, the value and the
//! accepted syntax; nothing runs on a guess.

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use crate::ucx_time::{parse_time, TimeField, UcxTime};

/// Prefix of every environment variable the service reads.
pub const ENV_PREFIX: &str = "NIXL_KEEPALIVE_";

/// One knob: its environment name, default, syntax and meaning. The
/// README's table is this list.
#[derive(Clone, Copy, Debug)]
pub struct Knob {
    /// Environment variable.
    pub env: &'static str,
    /// Default value, as it would be written in the environment.
    pub default: &'static str,
    /// Accepted syntax.
    pub syntax: &'static str,
    /// What it does.
    pub meaning: &'static str,
}

/// `NIXL_KEEPALIVE_*` variables read by other parts of the project: the
/// test harness (`REQUIRE_REAL`: a missing NIXL runtime fails the real
/// tests instead of skipping them) and the UCX loader (`UCX_LIB`: an
/// explicit `libucp` to load).
pub const NOT_SERVICE_KNOBS: &[&str] = &["NIXL_KEEPALIVE_REQUIRE_REAL", "NIXL_KEEPALIVE_UCX_LIB"];

/// Every knob the service reads from the environment.
pub const KNOBS: &[Knob] = &[
    Knob {
        env: "NIXL_KEEPALIVE_INTERVAL",
        default: "5s",
        syntax: "UCX time (TIME_UNITS): `inf` disables periodic heartbeats",
        meaning: "How often every known prefill engine gets a heartbeat (`HB:` + lease ids). \
                  The crash-detection bound follows it.",
    },
    Knob {
        env: "NIXL_KEEPALIVE_JITTER",
        default: "500ms",
        syntax: "UCX time (TIME), less than the interval",
        meaning: "Each engine's next heartbeat is drawn uniformly within +/- this of the \
                  interval, so engines registered together do not beat together.",
    },
    Knob {
        env: "NIXL_KEEPALIVE_RATE_PERIOD",
        default: "1s",
        syntax: "UCX time (TIME), above zero, at most the interval",
        meaning: "Per-engine rate cap: on average at most one notification round per period \
                  to one engine, heartbeats and runtime-requested lease renewals together.",
    },
    Knob {
        env: "NIXL_KEEPALIVE_RATE_BURST",
        default: "2",
        syntax: "integer, 1 or more",
        meaning: "How many rounds one engine may get back to back before the rate cap applies.",
    },
    Knob {
        env: "NIXL_KEEPALIVE_EVENT_CAPACITY",
        default: "1024",
        syntax: "integer, 1 or more",
        meaning: "Events buffered per subscriber; a slower subscriber skips the oldest and is \
                  told how many it missed.",
    },
    Knob {
        env: "NIXL_KEEPALIVE_SHUTDOWN_DRAIN",
        default: "5s",
        syntax: "UCX time (TIME)",
        meaning: "At shutdown, how long reads in flight may go on: every engine is marked at \
                  once (no new reads), each is released as its reads end, and what still has \
                  reads after this is handed back unreleased.",
    },
    Knob {
        env: "NIXL_KEEPALIVE_METRICS_PERIOD",
        default: "1s",
        syntax: "UCX time (TIME_UNITS): `inf` disables",
        meaning: "How often the engines-by-state and reads-in-flight gauges are refreshed.",
    },
];

/// The service's configuration. Build it with [`Config::builder`] or read
/// it with [`Config::from_env`]; both validate.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Heartbeat period per engine; `None` disables periodic heartbeats
    /// (lease renewals requested by the runtime still go out).
    pub heartbeat_interval: Option<Duration>,
    /// Uniform jitter applied to each engine's next heartbeat.
    pub jitter: Duration,
    /// Per-engine rate cap: one notification round per period on average.
    pub rate_period: Duration,
    /// Per-engine rate cap: rounds allowed back to back.
    pub rate_burst: u32,
    /// Events buffered per subscriber.
    pub event_capacity: usize,
    /// Gauge refresh period; `None` disables the refresh.
    pub metrics_period: Option<Duration>,
    /// At shutdown, how long reads in flight may go on before the engines
    /// that still have reads are handed back unreleased.
    pub shutdown_drain: Duration,
    /// A registration whose reads in flight have not completed for this
    /// long, while the decoder's other reads go on, is stalled (a hung
    /// peer); `None` disables the check.
    pub read_stall: Option<Duration>,
    /// What a stall does: fail the engine's reads and release it, or only
    /// report it.
    pub stall_action: StallAction,
    /// Seed for the heartbeat jitter; `None` seeds from the OS. Tests and
    /// the demo fix it so that runs repeat.
    pub seed: Option<u64>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            heartbeat_interval: Some(Duration::from_secs(5)),
            jitter: Duration::from_millis(500),
            rate_period: Duration::from_secs(1),
            rate_burst: 2,
            event_capacity: 1024,
            metrics_period: Some(Duration::from_secs(1)),
            shutdown_drain: Duration::from_secs(5),
            read_stall: Some(Duration::from_secs(10)),
            stall_action: StallAction::Fail,
            seed: None,
        }
    }
}

/// What the service does with an engine whose reads stopped completing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

/// A configuration value that was not accepted. Nothing was started.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
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
    /// A value parsed but does not make sense (e.g. jitter not below the
    /// interval).
    #[error("{setting} = {value} is not accepted: {reason}")]
    Invalid {
        /// The setting, by its environment name.
        setting: &'static str,
        /// Its value.
        value: String,
        /// Why it is not accepted.
        reason: String,
    },
}

impl Config {
    /// A builder starting from the defaults.
    pub fn builder() -> ConfigBuilder {
        ConfigBuilder {
            config: Config::default(),
        }
    }

    /// Reads `NIXL_KEEPALIVE_*` from the process environment over the
    /// defaults. See [`KNOBS`].
    pub fn from_env() -> Result<Config, ConfigError> {
        Self::from_lookup(|var| std::env::var(var).ok())
    }

    /// Reads the knobs through `lookup` (the environment, or a map in
    /// tests) over the defaults, then validates.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let mut config = Config::default();
        for knob in KNOBS {
            let Some(value) = lookup(knob.env) else {
                continue;
            };
            match knob.env {
                "NIXL_KEEPALIVE_INTERVAL" => {
                    config.heartbeat_interval = env_time(knob, &value, TimeField::TimeUnits, true)?
                }
                "NIXL_KEEPALIVE_JITTER" => {
                    config.jitter = required(env_time(knob, &value, TimeField::Time, false)?)
                }
                "NIXL_KEEPALIVE_RATE_PERIOD" => {
                    config.rate_period = required(env_time(knob, &value, TimeField::Time, false)?)
                }
                "NIXL_KEEPALIVE_RATE_BURST" => config.rate_burst = env_count(knob, &value)?,
                "NIXL_KEEPALIVE_EVENT_CAPACITY" => {
                    config.event_capacity = env_count(knob, &value)? as usize
                }
                "NIXL_KEEPALIVE_SHUTDOWN_DRAIN" => {
                    config.shutdown_drain =
                        required(env_time(knob, &value, TimeField::Time, false)?)
                }
                "NIXL_KEEPALIVE_METRICS_PERIOD" => {
                    config.metrics_period = env_time(knob, &value, TimeField::TimeUnits, true)?
                }
                other => unreachable!("knob {other} has no reader"),
            }
        }
        config.validate()?;
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

    /// Checks that the values make sense together.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(interval) = self.heartbeat_interval {
            if interval.is_zero() {
                return Err(invalid(
                    "NIXL_KEEPALIVE_INTERVAL",
                    "0s",
                    "must be above zero (use `inf` to disable periodic heartbeats)",
                ));
            }
            if self.rate_period > interval {
                return Err(invalid(
                    "NIXL_KEEPALIVE_RATE_PERIOD",
                    &format!("{:?}", self.rate_period),
                    &format!(
                        "must not exceed the heartbeat interval ({interval:?}): the rate cap would \
                         silently stretch every heartbeat to one per rate period"
                    ),
                ));
            }
            if self.jitter >= interval {
                return Err(invalid(
                    "NIXL_KEEPALIVE_JITTER",
                    &format!("{:?}", self.jitter),
                    &format!("must be below the interval ({interval:?})"),
                ));
            }
        }
        if self.rate_period.is_zero() {
            return Err(invalid(
                "NIXL_KEEPALIVE_RATE_PERIOD",
                "0s",
                "must be above zero",
            ));
        }
        if self.rate_burst == 0 {
            return Err(invalid(
                "NIXL_KEEPALIVE_RATE_BURST",
                "0",
                "must be 1 or more",
            ));
        }
        if self.event_capacity == 0 {
            return Err(invalid(
                "NIXL_KEEPALIVE_EVENT_CAPACITY",
                "0",
                "must be 1 or more",
            ));
        }
        if self.metrics_period.is_some_and(|p| p.is_zero()) {
            return Err(invalid(
                "NIXL_KEEPALIVE_METRICS_PERIOD",
                "0s",
                "must be above zero (use `inf` to disable)",
            ));
        }
        Ok(())
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
            "interval={interval} jitter={:?} rate=1/{:?} burst={}",
            self.jitter, self.rate_period, self.rate_burst
        )
    }
}

fn invalid(setting: &'static str, value: &str, reason: &str) -> ConfigError {
    ConfigError::Invalid {
        setting,
        value: value.to_string(),
        reason: reason.to_string(),
    }
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
        expected: field.syntax_help(),
    };
    match parse_time(value, field).map_err(|e| env_error(e.issue.describe().to_string()))? {
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

fn env_count(knob: &Knob, value: &str) -> Result<u32, ConfigError> {
    match value.trim().parse::<u32>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(ConfigError::Env {
            var: knob.env,
            value: value.to_string(),
            reason: "not a whole number of 1 or more".to_string(),
            expected: "a decimal integer from 1 to 4294967295",
        }),
    }
}

/// Builds a [`Config`]; [`ConfigBuilder::build`] validates.
#[derive(Clone, Debug)]
pub struct ConfigBuilder {
    config: Config,
}

impl ConfigBuilder {
    /// Heartbeat period; `None` disables periodic heartbeats.
    pub fn heartbeat_interval(mut self, interval: Option<Duration>) -> Self {
        self.config.heartbeat_interval = interval;
        self
    }

    /// Jitter of each engine's next heartbeat.
    pub fn jitter(mut self, jitter: Duration) -> Self {
        self.config.jitter = jitter;
        self
    }

    /// Per-engine rate cap: period and burst.
    pub fn rate_limit(mut self, period: Duration, burst: u32) -> Self {
        self.config.rate_period = period;
        self.config.rate_burst = burst;
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

    /// Validates and returns the configuration.
    pub fn build(self) -> Result<Config, ConfigError> {
        self.config.validate()?;
        Ok(self.config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
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
    fn inf_disables_the_heartbeat_but_not_the_jitter() {
        let c = from(&[("NIXL_KEEPALIVE_INTERVAL", "inf")]).unwrap();
        assert_eq!(c.heartbeat_interval, None);
        let e = from(&[("NIXL_KEEPALIVE_JITTER", "inf")]).unwrap_err();
        assert!(matches!(
            e,
            ConfigError::Env {
                var: "NIXL_KEEPALIVE_JITTER",
                ..
            }
        ));
    }

    #[test]
    fn a_bad_value_names_the_variable_the_value_and_the_syntax() {
        let e = from(&[("NIXL_KEEPALIVE_INTERVAL", "5h")]).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("NIXL_KEEPALIVE_INTERVAL"), "{text}");
        assert!(text.contains("\"5h\""), "{text}");
        assert!(text.contains(TimeField::TimeUnits.syntax_help()), "{text}");
        assert_eq!(text.matches("expected").count(), 1, "{text}");
        let e = from(&[("NIXL_KEEPALIVE_RATE_BURST", "zero")]).unwrap_err();
        assert!(e.to_string().contains("NIXL_KEEPALIVE_RATE_BURST"));
    }

    #[test]
    fn jitter_must_stay_below_the_interval() {
        let e = from(&[
            ("NIXL_KEEPALIVE_INTERVAL", "1s"),
            ("NIXL_KEEPALIVE_JITTER", "1s"),
        ])
        .unwrap_err();
        assert!(matches!(
            e,
            ConfigError::Invalid {
                setting: "NIXL_KEEPALIVE_JITTER",
                ..
            }
        ));
        assert!(Config::builder()
            .rate_limit(Duration::ZERO, 1)
            .build()
            .is_err());
    }

    #[test]
    fn a_rate_cap_slower_than_the_heartbeat_is_refused() {
        let e = from(&[
            ("NIXL_KEEPALIVE_INTERVAL", "250ms"),
            ("NIXL_KEEPALIVE_JITTER", "10ms"),
        ])
        .unwrap_err();
        assert!(
            matches!(
                e,
                ConfigError::Invalid {
                    setting: "NIXL_KEEPALIVE_RATE_PERIOD",
                    ..
                }
            ),
            "{e}"
        );
        assert!(from(&[
            ("NIXL_KEEPALIVE_INTERVAL", "250ms"),
            ("NIXL_KEEPALIVE_JITTER", "10ms"),
            ("NIXL_KEEPALIVE_RATE_PERIOD", "100ms"),
        ])
        .is_ok());
    }
}
