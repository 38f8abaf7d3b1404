//! A real etcd server for the membership tests: the `etcd` binary (Debian's
//! etcd-server, installed by `scripts/install-etcd.sh`) on free loopback
//! ports with a data directory of its own, stopped (and its directory
//! removed) on drop. Without the binary the tests print SKIPPED; with
//! NIXL_KEEPALIVE_REQUIRE_REAL=1 or CI=true they fail instead.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `etcd` binary on the PATH.
pub fn etcd_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

fn require_real() -> bool {
    std::env::var("NIXL_KEEPALIVE_REQUIRE_REAL").is_ok_and(|v| v == "1")
        || std::env::var("CI").is_ok_and(|v| v == "true")
}

/// A free loopback port (bound, read, released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// One etcd member on loopback.
pub struct EtcdServer {
    binary: PathBuf,
    child: Option<Child>,
    client_port: u16,
    peer_port: u16,
    data: PathBuf,
    /// Its log (stdout and stderr).
    pub log: PathBuf,
}

impl EtcdServer {
    /// Starts etcd and waits until it serves, or prints SKIPPED (fails in
    /// CI) when the binary is missing.
    pub fn start_or_skip() -> Option<EtcdServer> {
        let test = std::thread::current().name().unwrap_or("?").to_string();
        let Some(binary) = etcd_binary() else {
            if require_real() {
                panic!("NIXL_KEEPALIVE_REQUIRE_REAL=1 or CI=true, but no etcd binary ({test}): run `bash scripts/install-etcd.sh`");
            }
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: {test}: no etcd binary on the PATH (bash scripts/install-etcd.sh installs it)"
            );
            return None;
        };
        let name = super::unique("etcd");
        let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(&name);
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).expect("etcd temp dir");
        let mut server = EtcdServer {
            binary,
            child: None,
            client_port: free_port(),
            peer_port: free_port(),
            data: base.join("data"),
            log: base.join("etcd.log"),
        };
        server.spawn();
        Some(server)
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn spawn(&mut self) {
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("etcd log");
        let child = Command::new(&self.binary)
            .args(["--name", "nk"])
            .arg("--data-dir")
            .arg(&self.data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("nk={peer}")])
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn etcd");
        self.child = Some(child);
        self.wait_ready();
    }

    /// Waits (bounded) until etcd answers a health check.
    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if TcpStream::connect(("127.0.0.1", self.client_port)).is_ok() {
                let ok = Command::new("etcdctl")
                    .env("ETCDCTL_API", "3")
                    .args(["--endpoints", &self.url(), "endpoint", "health"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
                // Without etcdctl, an open client port is as good as it gets.
                if ok || which_etcdctl().is_none() {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "etcd never got ready; log:\n{}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    /// Kills etcd (SIGKILL: a crash) and reaps it; the data stays.
    pub fn stop(&mut self) -> Instant {
        let at = Instant::now();
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        at
    }

    /// Starts etcd again on the same ports and data.
    pub fn restart(&mut self) -> Instant {
        assert!(self.child.is_none(), "stop it first");
        self.spawn();
        Instant::now()
    }

    /// Kills etcd, removes its data directory, and starts it again on the
    /// same ports: a new cluster (new cluster id, revision 1, no keys, no
    /// leases). Returns when it serves again.
    pub fn wipe_and_restart(&mut self) -> Instant {
        self.stop();
        std::fs::remove_dir_all(&self.data).expect("remove etcd's data directory");
        self.spawn();
        Instant::now()
    }

    /// SIGSTOP: etcd freezes (its connections stay open, nothing answers).
    pub fn pause(&self) -> Instant {
        self.signal("STOP");
        Instant::now()
    }

    /// SIGCONT after [`EtcdServer::pause`].
    pub fn resume(&self) -> Instant {
        self.signal("CONT");
        Instant::now()
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("etcd running").id();
        let st = Command::new("kill")
            .args([&format!("-{sig}"), &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(st.success(), "kill -{sig} {pid} failed");
    }
}

fn which_etcdctl() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("etcdctl"))
        .find(|p| p.is_file())
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
        if let Some(dir) = self.data.parent() {
            let _ = std::fs::remove_dir_all(dir.join("data"));
        }
    }
}
