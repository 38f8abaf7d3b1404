//! The `nixl-keepalive` command line: one module per subcommand.

use std::process::ExitCode;

use std::io::Write;

use clap::Parser;
use nixl_keepalive::log_limit::{Line, LineBudget, LINES_PER_SECOND};

mod control;
mod decode;
#[cfg(feature = "demo")]
mod demo;
mod prefill;

/// Keepalive, failure classification and safe release of NIXL prefill peers.
#[derive(Debug, Parser)]
#[command(name = "nixl-keepalive", version, about, propagate_version = true)]
pub(crate) enum Cli {
    /// A simulated cluster (fake UCX): prefills are killed, frozen,
    /// restarted and partitioned under read traffic while the decoder's
    /// keepalive service detects and releases them. No set-up needed.
    #[cfg(feature = "demo")]
    Demo(demo::DemoArgs),
    /// (Not in this build: the production binary is built without the
    /// `demo` feature, which brings the fake UCX and tokio's test clock.)
    #[cfg(not(feature = "demo"))]
    #[command(disable_help_flag = true)]
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        _args: Vec<String>,
    },
    /// A real prefill engine on the NIXL runtime: agents with a DRAM KV
    /// cache in a known pattern, a side channel, leases renewed by `HB:`.
    #[command(after_help = PUSH_PREFILL_HELP)]
    Prefill(prefill::PrefillArgs),
    /// A real decode engine on the NIXL runtime: the keepalive service and
    /// readers that pull and check blocks from `--prefill` engines.
    #[command(after_help = PUSH_DECODE_HELP)]
    Decode(decode::DecodeArgs),
}

const PUSH_PREFILL_HELP: &str = "Push mode (SGLang's: the prefill WRITEs into decodes, and the keepalive runs in the prefill for every decode): nixl-keepalive prefill --push --decode <ADDR>... (see nixl-keepalive prefill --push --help)";
const PUSH_DECODE_HELP: &str = "Push mode (the decode's blocks are written by prefills, each write checked): nixl-keepalive decode --push --listen <ADDR> (see nixl-keepalive decode --push --help)";

/// `prefill --push`: the initiator of push mode (it embeds the keepalive
/// and writes into decodes).
#[derive(Debug, Parser)]
#[command(
    name = "nixl-keepalive prefill --push",
    version,
    about = "A push-mode prefill on the NIXL runtime: the keepalive service for every --decode engine, and writers that WRITE request-tagged blocks into them (checked at the decode)."
)]
struct PushPrefillCli {
    #[command(flatten)]
    args: decode::PushPrefillArgs,
}

/// `decode --push`: the block owner of push mode.
#[derive(Debug, Parser)]
#[command(
    name = "nixl-keepalive decode --push",
    version,
    about = "A push-mode decode on the NIXL runtime: agents whose zeroed blocks prefills write (prefill --push), a side channel, request leases renewed by the prefills' HB:, each write's bytes checked when its WR: arrives."
)]
struct PushDecodeCli {
    #[command(flatten)]
    args: prefill::OwnerArgs,
}

/// Which push-mode command `argv` asks for, if any: `prefill` or `decode`
/// followed (anywhere before a `--`) by `--push`. The two roles swap in
/// push mode, so each is its own parser (with its own flags and errors),
/// not a flag of the pull-mode one.
fn push_command(argv: &[std::ffi::OsString]) -> Option<(&'static str, Vec<std::ffi::OsString>)> {
    let command = match argv.get(1)?.to_str()? {
        "prefill" => "prefill",
        "decode" => "decode",
        _ => return None,
    };
    let rest = &argv[2..];
    let end = rest.iter().position(|a| a == "--").unwrap_or(rest.len());
    let at = rest[..end].iter().position(|a| a == "--push")?;
    let mut args = vec![std::ffi::OsString::from(format!(
        "nixl-keepalive {command} --push"
    ))];
    args.extend(rest[..at].iter().cloned());
    args.extend(rest[at + 1..].iter().cloned());
    Some((command, args))
}

/// Parses the command line and runs the subcommand.
pub(crate) fn main() -> ExitCode {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match push_command(&argv) {
        Some(("prefill", args)) => {
            return decode::run_push_prefill(PushPrefillCli::parse_from(args).args)
        }
        Some((_, args)) => return prefill::run_push_decode(PushDecodeCli::parse_from(args).args),
        None => {}
    }
    match Cli::parse() {
        #[cfg(feature = "demo")]
        Cli::Demo(args) => demo::run(args),
        #[cfg(not(feature = "demo"))]
        Cli::Demo { .. } => {
            eprintln!(
                "error: this nixl-keepalive was built without the demo (the `demo` feature, on by default: it brings the fake UCX and tokio's test clock, which the production build leaves out); run it with `cargo run --release -- demo`"
            );
            ExitCode::from(2)
        }
        Cli::Prefill(args) => prefill::run(args),
        Cli::Decode(args) => decode::run(args),
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`), within one
/// log budget for the whole process ([`LogBudget`]). Colour only when
/// stderr is a terminal and `NO_COLOR` is unset or empty
/// (<https://no-color.org>): a log written to a file or a pipe carries no
/// ANSI escapes.
pub(crate) fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = colour_wanted(
        std::io::IsTerminal::is_terminal(&std::io::stderr()),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(LogBudget)
        .with_ansi(ansi)
        .try_init();
    LogBudget::spawn_flusher();
}

/// The log's writer: stderr, through one [`LineBudget`] of
/// [`LINES_PER_SECOND`] for every line the process logs, whatever it is
/// about. The per-key limits ([`nixl_keepalive::log_limit::LogLimiter`])
/// decide what deserves a line; this caps how many there are: 10,000 dead
/// members, each a first occurrence, once wrote 30,013 lines in 40 s.
/// Lines over the budget are counted, and one line a second says how
/// many (`log budget: N lines suppressed ...`), written before the next
/// line or by a flusher thread once the burst is over.
struct LogBudget;

static LINE_BUDGET: std::sync::LazyLock<std::sync::Mutex<LineBudget>> =
    std::sync::LazyLock::new(|| std::sync::Mutex::new(LineBudget::new(LINES_PER_SECOND)));

impl LogBudget {
    fn admit() -> Line {
        LINE_BUDGET
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .admit(tokio::time::Instant::now())
    }

    /// The line that tells what the budget suppressed.
    fn tell(suppressed: u64) {
        let _ = writeln!(
            std::io::stderr(),
            " WARN nixl_keepalive::log_limit: log budget: {suppressed} lines suppressed in the last second (at most {LINES_PER_SECOND} lines a second; every event is still counted in the metrics)"
        );
    }

    /// A thread that tells, once a second, what a burst that ended left
    /// untold.
    fn spawn_flusher() {
        static STARTED: std::sync::Once = std::sync::Once::new();
        STARTED.call_once(|| {
            let _ = std::thread::Builder::new()
                .name("log-budget".into())
                .spawn(|| loop {
                    std::thread::sleep(std::time::Duration::from_secs(1));
                    let told = LINE_BUDGET
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .flush(tokio::time::Instant::now());
                    if let Some(n) = told {
                        LogBudget::tell(n);
                    }
                });
        });
    }
}

/// One log line's writer: stderr, or nothing when over the budget.
enum BudgetedLine {
    Stderr(std::io::Stderr),
    Suppressed,
}

impl Write for BudgetedLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            BudgetedLine::Stderr(s) => s.write(buf),
            BudgetedLine::Suppressed => Ok(buf.len()),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            BudgetedLine::Stderr(s) => s.flush(),
            BudgetedLine::Suppressed => Ok(()),
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBudget {
    type Writer = BudgetedLine;

    /// Called once per event (the formatter writes each line whole).
    fn make_writer(&'a self) -> BudgetedLine {
        match LogBudget::admit() {
            Line::Write { suppressed } => {
                if suppressed > 0 {
                    LogBudget::tell(suppressed);
                }
                BudgetedLine::Stderr(std::io::stderr())
            }
            _ => BudgetedLine::Suppressed,
        }
    }
}

/// Whether logs get ANSI colour: on a terminal, unless `NO_COLOR` is set
/// to a non-empty value.
fn colour_wanted(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Resolves on SIGINT or SIGTERM.
pub(crate) async fn wait_for_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

#[cfg(test)]
mod tests {
    use super::{colour_wanted, push_command};
    use std::ffi::{OsStr, OsString};

    fn argv(words: &[&str]) -> Vec<OsString> {
        words.iter().map(OsString::from).collect()
    }

    #[test]
    fn push_is_told_apart_by_command_and_flag_and_never_after_a_double_dash() {
        let (command, args) =
            push_command(&argv(&["nk", "prefill", "--decode", "a:1", "--push"])).unwrap();
        assert_eq!(command, "prefill");
        assert_eq!(
            args,
            argv(&["nixl-keepalive prefill --push", "--decode", "a:1"])
        );
        let (command, _) =
            push_command(&argv(&["nk", "decode", "--push", "--listen", "a:1"])).unwrap();
        assert_eq!(command, "decode");
        assert!(push_command(&argv(&["nk", "prefill", "--listen", "a:1"])).is_none());
        assert!(push_command(&argv(&["nk", "demo", "--push"])).is_none());
        assert!(push_command(&argv(&["nk", "decode", "--", "--push"])).is_none());
        assert!(push_command(&argv(&["nk"])).is_none());
    }

    #[test]
    fn colour_only_on_a_terminal_and_never_under_no_color() {
        assert!(colour_wanted(true, None));
        assert!(
            colour_wanted(true, Some(OsStr::new(""))),
            "empty NO_COLOR is unset"
        );
        assert!(!colour_wanted(true, Some(OsStr::new("1"))));
        assert!(!colour_wanted(false, None));
        assert!(!colour_wanted(false, Some(OsStr::new(""))));
    }
}
