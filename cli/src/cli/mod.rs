//! The `nixl-keepalive` command line: one module per subcommand.

use std::process::ExitCode;

use clap::Parser;

mod control;
mod decode;
mod demo;
mod prefill;

/// Keepalive, failure classification and safe release of NIXL prefill peers.
#[derive(Debug, Parser)]
#[command(name = "nixl-keepalive", version, about, propagate_version = true)]
pub(crate) enum Cli {
    /// A simulated cluster (fake UCX): prefills are killed, frozen,
    /// restarted and partitioned under read traffic while the decoder's
    /// keepalive service detects and releases them. No set-up needed.
    Demo(demo::DemoArgs),
    /// A real prefill engine on the NIXL runtime: agents with a DRAM KV
    /// cache in a known pattern, a side channel, leases renewed by `HB:`.
    Prefill(prefill::PrefillArgs),
    /// A real decode engine on the NIXL runtime: the keepalive service and
    /// readers that pull and check blocks from `--prefill` engines.
    Decode(decode::DecodeArgs),
}

/// Parses the command line and runs the subcommand.
pub(crate) fn main() -> ExitCode {
    match Cli::parse() {
        Cli::Demo(args) => demo::run(args),
        Cli::Prefill(args) => prefill::run(args),
        Cli::Decode(args) => decode::run(args),
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`).
pub(crate) fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
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
