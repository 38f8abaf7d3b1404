//! UCX's time syntax (`UCX_KEEPALIVE_INTERVAL=2s`, `UCX_UD_TIMEOUT=5s`),
//! parsed exactly as UCX defines it.
//!
//! # Why by hand
//!
//! No library parses UCX's syntax. `humantime` and friends accept `h`,
//! `min`, `sec`, spaces and sums (`1m 30s`) and read `m` as minutes or
//! months depending on the crate; UCX accepts none of that. UCX's rule
//! (`ucs_config_sscanf_time` in `ucs/config/parser.c`) is
//! `sscanf(value, "%lf%c%c")` followed by an exact comparison of the (at
//! most two) characters after the number with the units `s`, `m`
//! (**minutes**), `ms`, `us` and `ns`; a bare number is seconds. Fields of
//! kind TIME_UNITS (`UCX_KEEPALIVE_INTERVAL`, `UCX_TCP_KEEPIDLE`) also take
//! the exact strings `inf` and `auto`; plain TIME fields (`UCX_UD_TIMEOUT`,
//! `UCX_RC_TIMEOUT`) do not.
//!
//! # Two answers for every string
//!
//! Because UCX leans on C's `sscanf`, it also accepts strings that say
//! something other than what they mean: leading whitespace, a sign,
//! hexadecimal floats (`0x1p4s`), the numbers `nan` and `INF`, a dangling
//! exponent (`1e+m` is one minute), and anything after a two-letter unit
//! (`10msec` is 10 ms; but `10sec` is rejected, since `se` is no unit).
//! [`parse_time`] accepts only the plain form (a non-negative decimal
//! number, optionally with a fraction and an exponent, then at most one
//! unit, nothing else), so an operator's typo stops the service at start-up
//! instead of silently meaning something else. Every error still says, in
//! [`TimeSyntaxError::ucx_accepts`], whether UCX itself would have
//! accepted the string; that answer reproduces UCX's parser (and glibc's
//! `%lf`) exactly, and `tests/ucx_time_crosscheck.rs` checks it against
//! `ucp_config_modify` of a real UCX:
//! UCX accepts a string if and only if [`parse_time`] accepts it or its
//! error has `ucx_accepts == true`.
//!
//! Durations are computed exactly from the decimal digits (rounded to the
//! nearest nanosecond); UCX computes in `double`, so the two agree to well
//! under a nanosecond for every value UCX can represent.

use std::fmt;
use std::time::Duration;

/// The accepted syntax, for error messages and `--help` text.
pub const TIME_SYNTAX_HELP: &str =
    "a number with unit s, ms, us, ns or m (minutes), e.g. 2s or 500ms; \
     a bare number is seconds; `inf` or `auto` where the field allows";

/// Same as [`TIME_SYNTAX_HELP`], for fields that take no `inf`/`auto`.
const TIME_SYNTAX_HELP_PLAIN: &str =
    "a number with unit s, ms, us, ns or m (minutes), e.g. 2s or 500ms; \
     a bare number is seconds";

/// The largest finite time [`parse_time`] accepts: 10^9 s (about 31.7
/// years). UCX keeps TIME_UNITS values as CPU ticks in a `uint64_t`, which
/// overflows a little above 3.6 * 10^9 s on a 5 GHz clock; larger values
/// are meaningless there.
pub const MAX_TIME: Duration = Duration::from_secs(1_000_000_000);

/// Which kind of UCX configuration field a value is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TimeField {
    /// `UCS_CONFIG_TYPE_TIME` (a `double` of seconds in UCX):
    /// `UD_TIMEOUT`, `RC_TIMEOUT`. No `inf`, no `auto`.
    Time,
    /// `UCS_CONFIG_TYPE_TIME_UNITS` (`ucs_time_t` ticks in UCX):
    /// `KEEPALIVE_INTERVAL`, `TCP_KEEPIDLE`. Also `inf` and `auto`.
    TimeUnits,
}

impl TimeField {
    /// The accepted syntax for this kind of field.
    pub const fn syntax_help(self) -> &'static str {
        match self {
            TimeField::Time => TIME_SYNTAX_HELP_PLAIN,
            TimeField::TimeUnits => TIME_SYNTAX_HELP,
        }
    }

    const fn ucx_name(self) -> &'static str {
        match self {
            TimeField::Time => "time",
            TimeField::TimeUnits => "time-units",
        }
    }
}

/// A parsed UCX time value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UcxTime {
    /// A finite duration (at most [`MAX_TIME`]).
    Finite(Duration),
    /// `inf` (TIME_UNITS fields only): the timer never fires.
    Infinite,
    /// `auto` (TIME_UNITS fields only): UCX picks the value itself.
    Auto,
}

impl UcxTime {
    /// The finite duration, if any.
    pub const fn finite(self) -> Option<Duration> {
        match self {
            UcxTime::Finite(d) => Some(d),
            _ => None,
        }
    }
}

/// Formats in UCX syntax that [`parse_time`] reads back to the same value:
/// the largest of `s`, `ms`, `us`, `ns` that represents the duration
/// exactly (`2s`, `1500ms`, `0s`), `inf` or `auto`.
impl fmt::Display for UcxTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UcxTime::Infinite => f.write_str("inf"),
            UcxTime::Auto => f.write_str("auto"),
            UcxTime::Finite(d) => {
                let ns = d.as_nanos();
                if ns % 1_000_000_000 == 0 {
                    write!(f, "{}s", ns / 1_000_000_000)
                } else if ns % 1_000_000 == 0 {
                    write!(f, "{}ms", ns / 1_000_000)
                } else if ns % 1_000 == 0 {
                    write!(f, "{}us", ns / 1_000)
                } else {
                    write!(f, "{ns}ns")
                }
            }
        }
    }
}

/// What is wrong with a time value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TimeSyntaxIssue {
    /// Not UCX time syntax (UCX rejects it too), e.g. `2h`, `5 s`, `10sec`.
    Invalid,
    /// `inf` or `auto` in a plain TIME field.
    SpecialValueNotAllowed,
    /// UCX's `sscanf`-based parser accepts it but it says something other
    /// than what it means: leading whitespace, a `+` sign, a hexadecimal,
    /// `nan` or infinite number, a dangling exponent, characters after the
    /// unit, a unit in upper case read as a number (`INF`).
    NotPlain,
    /// A negative number: UCX accepts it and then misbehaves.
    Negative,
    /// Larger than [`MAX_TIME`].
    TooLarge,
}

impl TimeSyntaxIssue {
    /// What is wrong, in a few words.
    pub fn describe(self) -> &'static str {
        match self {
            TimeSyntaxIssue::Invalid => "not UCX time syntax",
            TimeSyntaxIssue::SpecialValueNotAllowed => "`inf` and `auto` are not allowed here",
            TimeSyntaxIssue::NotPlain => {
                "not a plain time (UCX would read it, but it may not mean what it says)"
            }
            TimeSyntaxIssue::Negative => "negative time",
            TimeSyntaxIssue::TooLarge => "time too large (at most 1000000000s)",
        }
    }
}

/// A value that is not a plain UCX time.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid UCX {} value `{}`: {}; expected {}",
    field.ucx_name(),
    value.escape_debug(),
    issue.describe(),
    field.syntax_help()
)]
pub struct TimeSyntaxError {
    /// The value as given.
    pub value: String,
    /// The kind of field it was for.
    pub field: TimeField,
    /// What is wrong with it.
    pub issue: TimeSyntaxIssue,
    /// Whether UCX's own parser (`ucp_config_modify`, or UCX reading the
    /// environment) accepts this string for this kind of field.
    pub ucx_accepts: bool,
}

const NS_PER_UNIT: [(&str, u128); 5] = [
    ("", 1_000_000_000),
    ("s", 1_000_000_000),
    ("m", 60_000_000_000),
    ("ms", 1_000_000),
    ("us", 1_000),
];

fn unit_ns(unit: &[u8]) -> Option<u128> {
    if unit == b"ns" {
        return Some(1);
    }
    NS_PER_UNIT
        .iter()
        .find(|(u, _)| u.as_bytes() == unit)
        .map(|&(_, ns)| ns)
}

/// Parses a UCX time value for a field of the given kind.
///
/// Accepts a non-negative decimal number (`2`, `2.5`, `.5`, `5.`, `1e3`,
/// `2.5E-1`) followed by nothing (seconds) or exactly one of `s`, `m`
/// (minutes), `ms`, `us`, `ns`; units are case-sensitive, as in UCX. For
/// [`TimeField::TimeUnits`] also exactly `inf` and `auto`. Nothing else:
/// no whitespace, no sign, no trailing characters. See the module docs
/// for how this relates to what UCX itself accepts.
pub fn parse_time(value: &str, field: TimeField) -> Result<UcxTime, TimeSyntaxError> {
    let err = |issue| TimeSyntaxError {
        value: value.to_owned(),
        field,
        issue,
        ucx_accepts: ucx_accepts(value, field),
    };
    match (value, field) {
        ("inf", TimeField::TimeUnits) => return Ok(UcxTime::Infinite),
        ("auto", TimeField::TimeUnits) => return Ok(UcxTime::Auto),
        ("inf" | "auto", TimeField::Time) => {
            return Err(err(TimeSyntaxIssue::SpecialValueNotAllowed))
        }
        _ => {}
    }
    match parse_plain(value.as_bytes()) {
        Ok(d) => Ok(UcxTime::Finite(d)),
        Err(issue) => {
            let ucx = ucx_accepts(value, field);
            let issue = match issue {
                // Whatever UCX accepts but the plain grammar does not is
                // "not plain"; a negative number is worth its own words.
                PlainError::Grammar if ucx && value.trim_start().starts_with('-') => {
                    TimeSyntaxIssue::Negative
                }
                PlainError::Grammar if ucx => TimeSyntaxIssue::NotPlain,
                PlainError::Grammar => TimeSyntaxIssue::Invalid,
                PlainError::TooLarge => TimeSyntaxIssue::TooLarge,
            };
            Err(TimeSyntaxError {
                value: value.to_owned(),
                field,
                issue,
                ucx_accepts: ucx,
            })
        }
    }
}

enum PlainError {
    Grammar,
    TooLarge,
}

/// Significant decimal digits kept; later ones only matter to rounding
/// at exactly half a nanosecond.
const MAX_SIG_DIGITS: u32 = 24;

fn parse_plain(s: &[u8]) -> Result<Duration, PlainError> {
    let mut i = 0;
    let mut mantissa: u128 = 0;
    let mut sig_digits = 0u32;
    let mut exp10: i64 = 0;
    let mut any_digit = false;

    // Integer part.
    while i < s.len() && s[i].is_ascii_digit() {
        any_digit = true;
        push_digit(&mut mantissa, &mut sig_digits, &mut exp10, s[i], false);
        i += 1;
    }
    // Fraction.
    if i < s.len() && s[i] == b'.' {
        i += 1;
        while i < s.len() && s[i].is_ascii_digit() {
            any_digit = true;
            push_digit(&mut mantissa, &mut sig_digits, &mut exp10, s[i], true);
            i += 1;
        }
    }
    if !any_digit {
        return Err(PlainError::Grammar);
    }
    // Exponent: needs at least one digit, or it is not plain.
    if i < s.len() && (s[i] == b'e' || s[i] == b'E') {
        i += 1;
        let negative = match s.get(i) {
            Some(b'-') => {
                i += 1;
                true
            }
            Some(b'+') => {
                i += 1;
                false
            }
            _ => false,
        };
        let start = i;
        let mut e: i64 = 0;
        while i < s.len() && s[i].is_ascii_digit() {
            e = (e * 10 + i64::from(s[i] - b'0')).min(1_000_000);
            i += 1;
        }
        if i == start {
            return Err(PlainError::Grammar);
        }
        exp10 += if negative { -e } else { e };
    }
    let unit = unit_ns(&s[i..]).ok_or(PlainError::Grammar)?;

    let ns = scale(mantissa, unit, exp10).ok_or(PlainError::TooLarge)?;
    if ns > MAX_TIME.as_nanos() {
        return Err(PlainError::TooLarge);
    }
    let secs = (ns / 1_000_000_000) as u64;
    let nanos = (ns % 1_000_000_000) as u32;
    Ok(Duration::new(secs, nanos))
}

fn push_digit(mantissa: &mut u128, sig: &mut u32, exp10: &mut i64, d: u8, fraction: bool) {
    let d = u128::from(d - b'0');
    if *sig == 0 && d == 0 {
        // Leading zero: not significant.
        if fraction {
            *exp10 -= 1;
        }
        return;
    }
    if *sig < MAX_SIG_DIGITS {
        *mantissa = *mantissa * 10 + d;
        *sig += 1;
        if fraction {
            *exp10 -= 1;
        }
    } else if !fraction {
        // Dropped integer digit: scale up instead.
        *exp10 += 1;
    }
}

/// `mantissa * 10^exp10 * unit` nanoseconds, rounded half up; `None` when
/// it does not fit (it is then far above [`MAX_TIME`]).
fn scale(mantissa: u128, unit: u128, exp10: i64) -> Option<u128> {
    let n = mantissa.checked_mul(unit)?; // < 10^24 * 6 * 10^10
    if n == 0 {
        return Some(0);
    }
    if exp10 >= 0 {
        let p = 10u128.checked_pow(u32::try_from(exp10).ok()?)?;
        n.checked_mul(p)
    } else {
        let e = exp10.unsigned_abs();
        if e > 38 {
            return Some(0); // n < 10^36
        }
        let p = 10u128.pow(e as u32);
        Some(n / p + u128::from(n % p >= p.div_ceil(2)))
    }
}

/// Whether UCX's own parser accepts `value` for a field of this kind.
///
/// This reproduces `ucs_config_sscanf_time` / `_time_units` on glibc:
/// `sscanf("%lf%c%c")` (skip whitespace; sign; `nan`/`inf`/`infinity` in
/// any case; hexadecimal floats; glibc consumes a dangling exponent such as
/// `1e` or `1e+`), then at most two following bytes compared exactly with
/// `m`, `s`, `ms`, `us`, `ns`, and anything after those two bytes ignored.
/// A string with a NUL byte cannot reach UCX and counts as rejected.
pub fn ucx_accepts(value: &str, field: TimeField) -> bool {
    let s = value.as_bytes();
    if s.contains(&0) {
        return false;
    }
    if field == TimeField::TimeUnits && (value == "inf" || value == "auto") {
        return true;
    }
    let Some(end) = glibc_scan_double(s) else {
        return false;
    };
    let rest = &s[end..];
    let units = &rest[..rest.len().min(2)];
    units.is_empty() || matches!(units, b"m" | b"s" | b"ms" | b"us" | b"ns")
}

/// Where glibc's `%lf` stops consuming `s`, or `None` for a matching
/// failure (or end of input: `sscanf` then returns EOF).
fn glibc_scan_double(s: &[u8]) -> Option<usize> {
    let mut i = 0;
    // C-locale isspace.
    while i < s.len() && matches!(s[i], b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r') {
        i += 1;
    }
    if i < s.len() && (s[i] == b'+' || s[i] == b'-') {
        i += 1;
    }
    let lower = |j: usize| s.get(j).map(u8::to_ascii_lowercase);
    let matches_word =
        |j: usize, w: &[u8]| w.iter().enumerate().all(|(k, &c)| lower(j + k) == Some(c));
    match lower(i) {
        None => return None,
        Some(b'n') => return matches_word(i, b"nan").then_some(i + 3),
        Some(b'i') => {
            if !matches_word(i, b"inf") {
                return None;
            }
            i += 3;
            if lower(i) == Some(b'i') {
                // Once past "inf", an 'i' commits glibc to "infinity".
                return matches_word(i, b"inity").then_some(i + 5);
            }
            return Some(i);
        }
        _ => {}
    }
    let hex = s.get(i) == Some(&b'0') && matches!(lower(i + 1), Some(b'x'));
    let mut got_digit = false;
    let mut got_dot = false;
    let mut got_e = false;
    if hex {
        i += 2;
    }
    let exp_char = if hex { b'p' } else { b'e' };
    let mut last_was_exp = false;
    while let Some(&c) = s.get(i) {
        let is_digit = if hex && !got_e {
            c.is_ascii_hexdigit()
        } else {
            c.is_ascii_digit()
        };
        if is_digit {
            got_digit = true;
            last_was_exp = false;
        } else if last_was_exp && (c == b'+' || c == b'-') {
            last_was_exp = false;
        } else if got_digit && !got_e && c.to_ascii_lowercase() == exp_char {
            got_e = true;
            got_dot = true;
            last_was_exp = true;
        } else if !got_dot && c == b'.' {
            got_dot = true;
            last_was_exp = false;
        } else {
            break;
        }
        i += 1;
    }
    // glibc then runs strtod over what it collected and fails if strtod
    // consumed nothing: a decimal needs a digit in its mantissa; "0x"
    // needs something after it ("0x." reads as 0).
    let ok = if hex { got_digit || got_dot } else { got_digit };
    ok.then_some(i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ok(v: &str, f: TimeField) -> UcxTime {
        parse_time(v, f).unwrap_or_else(|e| panic!("{v:?}: {e}"))
    }

    fn fin(v: &str) -> Duration {
        ok(v, TimeField::Time).finite().unwrap()
    }

    fn issue(v: &str, f: TimeField) -> (TimeSyntaxIssue, bool) {
        let e = parse_time(v, f).expect_err(v);
        (e.issue, e.ucx_accepts)
    }

    #[test]
    fn units_are_seconds_minutes_and_sub_seconds() {
        assert_eq!(fin("2"), Duration::from_secs(2));
        assert_eq!(fin("2s"), Duration::from_secs(2));
        assert_eq!(fin("2m"), Duration::from_secs(120));
        assert_eq!(fin("2ms"), Duration::from_millis(2));
        assert_eq!(fin("2us"), Duration::from_micros(2));
        assert_eq!(fin("2ns"), Duration::from_nanos(2));
        assert_eq!(fin("0"), Duration::ZERO);
        assert_eq!(fin("0s"), Duration::ZERO);
    }

    #[test]
    fn fractions_and_exponents_are_plain_numbers() {
        assert_eq!(fin("1.5s"), Duration::from_millis(1500));
        assert_eq!(fin(".5s"), Duration::from_millis(500));
        assert_eq!(fin("5.s"), Duration::from_secs(5));
        assert_eq!(fin("1e3ms"), Duration::from_secs(1));
        assert_eq!(fin("2.5E-1"), Duration::from_millis(250));
        assert_eq!(fin("0.1m"), Duration::from_secs(6));
        assert_eq!(fin("1.4ns"), Duration::from_nanos(1));
        assert_eq!(fin("1.5ns"), Duration::from_nanos(2));
        assert_eq!(fin("1e-400s"), Duration::ZERO);
        assert_eq!(
            fin("0000000000000000000000000000000000000001s"),
            Duration::from_secs(1)
        );
        assert_eq!(
            fin("1.000000000000000000000000000000000000001s"),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn inf_and_auto_only_in_time_units_fields() {
        assert_eq!(ok("inf", TimeField::TimeUnits), UcxTime::Infinite);
        assert_eq!(ok("auto", TimeField::TimeUnits), UcxTime::Auto);
        // UCX's %lf reads "inf" as an infinite number of seconds in a TIME
        // field, but "auto" not at all.
        assert_eq!(
            issue("inf", TimeField::Time),
            (TimeSyntaxIssue::SpecialValueNotAllowed, true)
        );
        assert_eq!(
            issue("auto", TimeField::Time),
            (TimeSyntaxIssue::SpecialValueNotAllowed, false)
        );
        // strcmp: case matters; "INF" is glibc's infinite number.
        assert_eq!(
            issue("INF", TimeField::TimeUnits),
            (TimeSyntaxIssue::NotPlain, true)
        );
        assert_eq!(
            issue("Auto", TimeField::TimeUnits),
            (TimeSyntaxIssue::Invalid, false)
        );
    }

    #[test]
    fn what_ucx_rejects_is_invalid() {
        for v in [
            "", " ", "s", "ms", "2h", "2min", "2sec", "2S", "2MS", "5 s", "2s ", "1,5s", "1_000s",
            ".", ".e1", "0x", "0xs", "in", "infi", "infinis", "na", "2 ", "--1", "2mx", "2sx",
            "2x", "5ex", "1e5.",
        ] {
            for f in [TimeField::Time, TimeField::TimeUnits] {
                assert_eq!(issue(v, f), (TimeSyntaxIssue::Invalid, false), "{v:?}");
            }
        }
    }

    #[test]
    fn what_ucx_reads_loosely_is_refused_but_flagged() {
        for v in [
            " 2s", "\t2s", "+2s", "0x10s", "0x1p4", "0x.8s", "nan", "NaNms", "infs", "INFms",
            "infinity", "1e", "1e+m", "10msec", "10mss", "2usX", "1e400s",
        ] {
            let (iss, ucx) = issue(v, TimeField::Time);
            assert!(ucx, "{v:?} should be accepted by UCX");
            assert!(
                matches!(iss, TimeSyntaxIssue::NotPlain | TimeSyntaxIssue::TooLarge),
                "{v:?}: {iss:?}"
            );
        }
        assert_eq!(
            issue("-2s", TimeField::Time),
            (TimeSyntaxIssue::Negative, true)
        );
        assert_eq!(
            issue("-0", TimeField::TimeUnits),
            (TimeSyntaxIssue::Negative, true)
        );
        assert_eq!(
            issue(" -1ms", TimeField::Time),
            (TimeSyntaxIssue::Negative, true)
        );
    }

    #[test]
    fn too_large_values_are_refused() {
        assert_eq!(fin("1000000000s"), MAX_TIME);
        assert_eq!(
            issue("1000000000.000000001s", TimeField::Time).0,
            TimeSyntaxIssue::TooLarge
        );
        assert_eq!(
            issue("1e30m", TimeField::Time),
            (TimeSyntaxIssue::TooLarge, true)
        );
        assert_eq!(
            issue("1e999999999999s", TimeField::Time).0,
            TimeSyntaxIssue::TooLarge
        );
    }

    #[test]
    fn nul_bytes_never_reach_ucx() {
        assert_eq!(
            issue("2s\0", TimeField::Time),
            (TimeSyntaxIssue::Invalid, false)
        );
    }

    #[test]
    fn error_names_value_and_syntax() {
        let e = parse_time("2h", TimeField::TimeUnits).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("`2h`"), "{msg}");
        assert!(msg.contains(TIME_SYNTAX_HELP), "{msg}");
        let msg = parse_time("auto", TimeField::Time).unwrap_err().to_string();
        assert!(msg.contains("not allowed"), "{msg}");
        assert!(!msg.contains("`inf` or `auto` where"), "{msg}");
    }

    #[test]
    fn display_picks_the_largest_exact_unit() {
        let d = |ns| UcxTime::Finite(Duration::from_nanos(ns)).to_string();
        assert_eq!(d(0), "0s");
        assert_eq!(d(2_000_000_000), "2s");
        assert_eq!(d(1_500_000_000), "1500ms");
        assert_eq!(d(1_500), "1500ns");
        assert_eq!(d(2_000), "2us");
        assert_eq!(d(7), "7ns");
        assert_eq!(UcxTime::Infinite.to_string(), "inf");
        assert_eq!(UcxTime::Auto.to_string(), "auto");
    }

    proptest! {
        #[test]
        fn formatting_a_duration_parses_back_to_it(ns in 0u64..=MAX_TIME.as_nanos() as u64) {
            let t = UcxTime::Finite(Duration::from_nanos(ns));
            for f in [TimeField::Time, TimeField::TimeUnits] {
                prop_assert_eq!(parse_time(&t.to_string(), f), Ok(t));
            }
        }

        #[test]
        fn whole_units_parse_exactly(n in 0u64..1_000_000, unit in 0usize..5) {
            let (u, ns) = [("s", 1_000_000_000u64), ("m", 60_000_000_000), ("ms", 1_000_000),
                           ("us", 1_000), ("ns", 1)][unit];
            let want = Duration::from_nanos(n * ns);
            prop_assert_eq!(parse_time(&format!("{n}{u}"), TimeField::Time),
                            Ok(UcxTime::Finite(want)));
        }

        #[test]
        fn accepted_values_are_accepted_by_ucx(s in "[-+ 0-9.eExXpinfatsmu]{0,8}") {
            for f in [TimeField::Time, TimeField::TimeUnits] {
                match parse_time(&s, f) {
                    Ok(t) => {
                        prop_assert!(ucx_accepts(&s, f));
                        prop_assert_eq!(parse_time(&t.to_string(), f), Ok(t));
                    }
                    Err(e) => prop_assert_eq!(e.ucx_accepts, ucx_accepts(&s, f)),
                }
            }
        }
    }
}
