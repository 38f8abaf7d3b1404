//! The `nixl-keepalive` command line: one module per subcommand.

use std::process::ExitCode;

use clap::Parser;

mod demo;

/// Keepalive, failure classification and safe release of NIXL prefill peers.
#[derive(Debug, Parser)]
#[command(name = "nixl-keepalive", version, about, propagate_version = true)]
pub(crate) enum Cli {
    /// A simulated cluster (fake UCX): prefills are killed, frozen,
    /// restarted and partitioned under read traffic while the decoder's
    /// keepalive service detects and releases them. No set-up needed.
    Demo(demo::DemoArgs),
}

/// Parses the command line and runs the subcommand.
pub(crate) fn main() -> ExitCode {
    match Cli::parse() {
        Cli::Demo(args) => demo::run(args),
    }
}
