//! Typed errors. Every status from NIXL becomes a [`NixlError`] in one
//! place ([`check`]); the raw code is never lost.

use std::fmt;
use std::path::PathBuf;

use crate::status::NixlStatus;

/// Which interface a status came through, so a reader knows how much it
/// can trust the code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StatusSource {
    /// The C++ member itself, through this crate's shim: the raw
    /// `nixl_status_t`.
    Cpp,
    /// The newer C API that maps statuses 1:1 (exports
    /// `nixl_capi_get_version`).
    CapiV1,
    /// The released 1.5.x C API, which collapses most failures into
    /// `ERR_BACKEND`: a `BACKEND` from here may hide any other failure.
    CapiCollapsed,
    /// This crate refused the call before reaching NIXL (for example an
    /// argument NIXL cannot represent).
    Crate,
}

/// A NIXL call that did not succeed.
///
/// `status` holds the C++ `nixl_status_t` numbering whatever API the call
/// went through (see [`StatusSource`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NixlError {
    /// The NIXL operation, e.g. `"genNotif"`.
    pub operation: &'static str,
    /// The status NIXL returned.
    pub status: NixlStatus,
    /// Where the status came from.
    pub source: StatusSource,
    /// Extra context (e.g. the remote agent), if any.
    pub detail: Option<String>,
}

impl NixlError {
    /// The raw status code (C++ numbering).
    pub fn raw_code(&self) -> i32 {
        self.status.raw()
    }

    /// The peer's endpoint has failed (`NIXL_ERR_REMOTE_DISCONNECT`).
    pub fn is_remote_disconnect(&self) -> bool {
        self.status.is_remote_disconnect()
    }

    /// NIXL does not know the agent or handle (`NIXL_ERR_NOT_FOUND`); for
    /// releases this means "already released".
    pub fn is_not_found(&self) -> bool {
        self.status == NixlStatus::ERR_NOT_FOUND
    }
}

impl fmt::Display for NixlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NIXL {} failed: {}", self.operation, self.status)?;
        if self.source == StatusSource::CapiCollapsed && self.status == NixlStatus::ERR_BACKEND {
            write!(
                f,
                " (from the 1.5.x C API, which collapses failures into BACKEND)"
            )?;
        }
        if let Some(d) = &self.detail {
            write!(f, ": {d}")?;
        }
        Ok(())
    }
}

impl std::error::Error for NixlError {}

/// The one place where statuses become errors: `SUCCESS` and `IN_PROG`
/// pass through, everything else is a [`NixlError`] that keeps the code.
pub(crate) fn check(
    operation: &'static str,
    status: NixlStatus,
    source: StatusSource,
) -> Result<NixlStatus, NixlError> {
    if status.is_ok() {
        Ok(status)
    } else {
        Err(NixlError {
            operation,
            status,
            source,
            detail: None,
        })
    }
}

/// Adds context to an error on its way out.
pub(crate) trait WithDetail<T> {
    fn detail(self, f: impl FnOnce() -> String) -> Result<T, NixlError>;
}

impl<T> WithDetail<T> for Result<T, NixlError> {
    fn detail(self, f: impl FnOnce() -> String) -> Result<T, NixlError> {
        self.map_err(|mut e| {
            e.detail = Some(f());
            e
        })
    }
}

/// The NIXL runtime could not be found or loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadError {
    /// No directory holding `libnixl.so` and `libnixl_capi.so` was found.
    NotFound {
        /// The runtime location that was searched and where it came from
        /// (`NIXL_PREFIX` or the build-time default).
        location: PathBuf,
        /// How the location was chosen.
        origin: &'static str,
        /// Every library path tried.
        tried: Vec<PathBuf>,
    },
    /// A library exists but `dlopen` refused it.
    Open {
        /// The library.
        path: PathBuf,
        /// `dlerror()` text.
        message: String,
    },
    /// A library loaded but lacks a symbol this crate needs (a NIXL version
    /// this crate does not support).
    MissingSymbol {
        /// The library.
        path: PathBuf,
        /// The symbol.
        symbol: String,
    },
}

const INSTALL_HINT: &str = "install it with `scripts/install-nixl.sh` (fetches the pinned \
     nixl-cu12 1.5.1 wheel into <repo>/.nixl-runtime), or set NIXL_PREFIX to a directory \
     holding libnixl.so (an extracted wheel, or a prefix with lib/, lib64/ or \
     lib/x86_64-linux-gnu/)";

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotFound {
                location,
                origin,
                tried,
            } => {
                write!(
                    f,
                    "NIXL runtime not found in {} ({origin}); tried:",
                    location.display()
                )?;
                for t in tried {
                    write!(f, " {}", t.display())?;
                }
                write!(f, "; {INSTALL_HINT}")
            }
            LoadError::Open { path, message } => {
                write!(
                    f,
                    "cannot load {}: {message}; {INSTALL_HINT}",
                    path.display()
                )
            }
            LoadError::MissingSymbol { path, symbol } => write!(
                f,
                "{} lacks symbol {symbol} (unsupported NIXL version?); {INSTALL_HINT}",
                path.display()
            ),
        }
    }
}

impl std::error::Error for LoadError {}
