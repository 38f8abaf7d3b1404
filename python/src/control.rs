//! `Keepalive(control=...)`: the library's control server
//! (`nixl_keepalive::control`: the router's endpoint, the snapshot, and
//! `/metrics` from the process's recorder, see [`crate::prometheus`]) on
//! the binding's runtime, beside the service it speaks for.
//!
//! Checked and bound before the service starts, so a bad address, a
//! missing token or a port in use raises at construction with nothing
//! running; stopped (its listener closed) by `close()`.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Mutex;

use nixl_keepalive::control::{ControlConfig, ControlServer, ControlToken};
use nixl_keepalive::KeepaliveHandle;
use pyo3::prelude::*;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::errors;
use crate::prometheus;
use crate::runtime;

/// A `ConfigError` about the control server.
fn refused(message: impl std::fmt::Display) -> PyErr {
    errors::ConfigError::new_err(format!("control: {message}"))
}

/// The address to listen on: an IP literal with its port, or
/// `localhost:PORT` (loopback IPv4; a name is not looked up, so what is
/// bound is what was written).
fn listen_addr(addr: &str) -> PyResult<SocketAddr> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(a);
    }
    match addr.strip_prefix("localhost:").map(str::parse::<u16>) {
        Some(Ok(port)) => Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port))),
        _ => Err(refused(format!(
            "{addr:?} is not an address to listen on; accepted: an IP address and port \
             (\"127.0.0.1:0\", \"[::1]:9091\"; port 0 picks a free one, read it back from \
             Keepalive.control_addr) or \"localhost:PORT\"; an address that is not loopback \
             needs a token"
        ))),
    }
}

/// Checks the settings and binds, on the binding's runtime (the GIL
/// released while it does).
pub(crate) fn bind(
    py: Python<'_>,
    addr: &str,
    token: Option<&str>,
    token_file: Option<&str>,
) -> PyResult<ControlServer> {
    let token = match (token, token_file) {
        (None, None) => None,
        (Some(t), None) => Some(ControlToken::new(t).map_err(refused)?),
        (None, Some(f)) => Some(ControlToken::from_file(Path::new(f)).map_err(refused)?),
        (Some(_), Some(_)) => {
            return Err(refused(
                "give the token or the token file, not both".to_owned(),
            ))
        }
    };
    let config = ControlConfig::new(listen_addr(addr)?).token(token);
    config.check().map_err(refused)?;
    // Installed before the service starts, so it records from its start.
    let config = config.metrics(prometheus::render().map_err(refused)?);
    runtime::wait(py, ControlServer::bind(config))?.map_err(refused)
}

/// The server, serving.
pub(crate) struct Running {
    addr: SocketAddr,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Running {
    /// Serves `server` for `handle` on the binding's runtime until
    /// `shutdown`.
    pub(crate) fn start<R: Send + 'static>(
        server: ControlServer,
        handle: KeepaliveHandle<R>,
        shutdown: CancellationToken,
    ) -> Running {
        let addr = server.local_addr();
        let task = runtime::get().spawn(server.run(handle, shutdown));
        Running {
            addr,
            task: Mutex::new(Some(task)),
        }
    }

    /// The bound address, `host:port`.
    pub(crate) fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// The task to wait for once its shutdown is cancelled: `None` once
    /// taken.
    pub(crate) fn take_task(&self) -> Option<JoinHandle<()>> {
        self.task.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}
