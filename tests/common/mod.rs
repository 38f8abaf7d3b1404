//! Set-ups shared by the fake-UCX tests of this directory: a service on
//! the fake UCX ([`World`]) and prefill addresses ([`addr`]). Each test
//! file is a crate of its own and takes this in with `mod common;`; a
//! file adds the helpers only it needs in its own `impl World`.

// Each test crate uses a different part of this module.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use nixl_keepalive::fake::{FakeConfig, FakeResources, FakeUcx};
use nixl_keepalive::{Config, Event, KeepaliveHandle, PeerAddr, Stopped};
use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The service's handle over the fake UCX.
pub type Handle = KeepaliveHandle<FakeResources>;

/// A keepalive service spawned on a fake UCX, with a subscription to its
/// events taken before anything happened.
pub struct World {
    pub ucx: FakeUcx,
    pub handle: Handle,
    pub events: broadcast::Receiver<Event>,
    pub shutdown: CancellationToken,
    pub task: JoinHandle<Stopped<FakeResources>>,
}

impl World {
    /// Spawns the service with `config` on a fake UCX made from `ucx`.
    pub fn start(ucx: FakeConfig, config: Config) -> World {
        let ucx = FakeUcx::new(ucx);
        let shutdown = CancellationToken::new();
        let (handle, task) = nixl_keepalive::spawn(Arc::new(ucx.clone()), config, shutdown.clone());
        let events = handle.subscribe();
        World {
            ucx,
            handle,
            events,
            shutdown,
            task,
        }
    }

    /// Waits (in virtual time) for the first event that `pick` accepts;
    /// panics after `within`.
    pub async fn until<T>(
        &mut self,
        within: Duration,
        mut pick: impl FnMut(&Event) -> Option<T>,
    ) -> T {
        tokio::time::timeout(within, async {
            loop {
                let event = self.events.recv().await.expect("events flow");
                if let Some(t) = pick(&event) {
                    return t;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no such event within {within:?}"))
    }

    /// The events sent so far and not yet read.
    pub fn drain(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        while let Ok(e) = self.events.try_recv() {
            out.push(e);
        }
        out
    }

    /// Shuts the service down and waits for it: the fake UCX and what the
    /// service says it left.
    pub async fn stopped(self) -> (FakeUcx, Stopped<FakeResources>) {
        self.shutdown.cancel();
        let stopped = self.task.await.expect("the service task ends");
        (self.ucx, stopped)
    }
}

/// Prefill `n`'s address: `10.0.0.<n>:5600`.
pub fn addr(n: impl std::fmt::Display) -> PeerAddr {
    PeerAddr::new(format!("10.0.0.{n}:5600"))
}
