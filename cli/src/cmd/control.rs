//! `decode`'s HTTP servers from its flags. The servers are the library's
//! (`nixl_keepalive::control`: the routes, the token, the limits, every
//! refusal); here the flags become their configurations, and a refused
//! configuration is told in the flags' words.
//!
//! - `--control-addr`: every route (`POST /v1/peer_gone`, `POST
//!   /fault_tolerance/event`, `GET /v1/snapshot`, `GET /metrics`).
//! - `--metrics-addr`: `/metrics` alone.
//! - `--control-token-file`: the bearer token of both; a non-loopback
//!   `--control-addr` needs it, and a non-loopback `--metrics-addr` needs
//!   it or `--metrics-public`.

use std::net::SocketAddr;
use std::path::Path;

use nixl_keepalive::control::{ControlConfig, ControlError, ControlToken};

/// A start-up problem with the control flags.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ControlConfigError {
    /// A non-loopback bind without a token.
    #[error("--control-addr {0} is not a loopback address: give --control-token-file too (every request must then carry the token)")]
    TokenRequired(SocketAddr),
    /// The token file cannot be read.
    #[error("cannot read --control-token-file {path}: {source}")]
    TokenFile {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The token file is empty or has characters a header cannot carry.
    #[error("--control-token-file {0}: the token must be 1 to 4096 visible ASCII characters (surrounding whitespace is trimmed)")]
    BadToken(String),
    /// A non-loopback metrics bind without a token or `--metrics-public`.
    #[error("--metrics-addr {0} is not a loopback address: give --control-token-file (every scrape must then carry the token), or --metrics-public to serve metrics to anyone who can reach it")]
    MetricsTokenRequired(SocketAddr),
    /// Anything else the library refused.
    #[error("{0}")]
    Other(ControlError),
}

/// One server to start: whether it serves the control routes (else
/// `/metrics` alone), and its configuration (checked).
pub(crate) type Server = (bool, ControlConfig);

/// The servers the flags ask for, each checked: the control server
/// (`control_addr`) and the metrics-only one (`metrics_addr`).
pub(crate) fn servers(
    control_addr: Option<SocketAddr>,
    token_file: Option<&Path>,
    metrics_addr: Option<SocketAddr>,
    metrics_public: bool,
) -> Result<Vec<Server>, ControlConfigError> {
    let token = match token_file {
        None => None,
        Some(path) => Some(ControlToken::from_file(path).map_err(|e| match e {
            ControlError::TokenFile { source, .. } => ControlConfigError::TokenFile {
                path: path.display().to_string(),
                source,
            },
            _ => ControlConfigError::BadToken(path.display().to_string()),
        })?),
    };
    let mut servers = Vec::new();
    if let Some(addr) = control_addr {
        servers.push((true, ControlConfig::new(addr).token(token.clone())));
    }
    if let Some(addr) = metrics_addr {
        let config = ControlConfig::metrics_only(addr)
            .token(token)
            .metrics_public(metrics_public);
        servers.push((false, config));
    }
    for (_, config) in &servers {
        config.check().map_err(|e| match e {
            ControlError::TokenRequired { addr } => ControlConfigError::TokenRequired(addr),
            ControlError::MetricsTokenRequired { addr } => {
                ControlConfigError::MetricsTokenRequired(addr)
            }
            other => ControlConfigError::Other(other),
        })?;
    }
    Ok(servers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_name_the_flags() {
        let exposed: SocketAddr = "10.1.2.3:9090".parse().unwrap();
        let e = servers(Some(exposed), None, None, false).unwrap_err();
        assert!(
            e.to_string().contains("--control-addr")
                && e.to_string().contains("--control-token-file"),
            "{e}"
        );
        let e = servers(None, None, Some(exposed), false).unwrap_err();
        assert!(e.to_string().contains("--metrics-public"), "{e}");
        assert_eq!(servers(None, None, Some(exposed), true).unwrap().len(), 1);
        let e = servers(None, Some(Path::new("/nonexistent/t")), None, false).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("cannot read --control-token-file /nonexistent/t"),
            "{e}"
        );
    }
}
