//! The loader's error: the NIXL runtime could not be found or loaded.

use std::fmt;
use std::path::PathBuf;

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
    /// The runtime's C API handles are not laid out as this crate reads
    /// them (a NIXL release this crate was not built for): refused before
    /// anything relies on it.
    LayoutMismatch {
        /// The C API library.
        path: PathBuf,
        /// What the check found.
        why: String,
    },
    /// An environment variable of this crate has a value it does not take.
    BadSetting {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
        /// What it takes.
        accepted: &'static str,
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
            LoadError::LayoutMismatch { path, why } => write!(
                f,
                "the NIXL runtime at {} is not one this crate can call safely: {why}; this crate supports the nixl-cu12 1.5.x C API (scripts/install-nixl.sh installs 1.5.1) and runtimes exporting nixl_capi_get_version",
                path.display()
            ),
            LoadError::BadSetting {
                variable,
                value,
                accepted,
            } => write!(
                f,
                "{variable}={:?} is not a value it takes; accepted: {accepted}",
                value.escape_debug().to_string()
            ),
        }
    }
}

impl std::error::Error for LoadError {}
