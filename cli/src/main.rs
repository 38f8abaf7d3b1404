//! `nixl-keepalive`: see `nixl-keepalive --help`.
#![forbid(unsafe_code)]

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
