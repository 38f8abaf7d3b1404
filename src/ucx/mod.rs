//! UCX's side of detection, in UCX's own language: the settings that
//! decide how fast a dead peer is noticed and the bound they give
//! ([`settings`]), and UCX's time syntax, parsed exactly as UCX parses it
//! (`time`, public for the workspace's CLI and fuzz target; its types are
//! re-exported from [`settings`]).

mod read;
pub mod settings;
#[doc(hidden)]
pub mod time;
