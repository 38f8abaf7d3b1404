//! `nixl-keepalive`: see `nixl-keepalive --help`.
#![forbid(unsafe_code)]

mod cmd;

fn main() -> std::process::ExitCode {
    cmd::main()
}
