//! Where the settings in force come from at start-up: UCX's own
//! configuration, through the UCX library `ucx-sys` loads (feature
//! `nixl`), and this host's RDMA devices. Apart from `settings.rs`, which
//! only parses and judges values, so that what the core imports loads no
//! native library (`tests/layout.rs`).

#[cfg(feature = "nixl")]
use super::settings::UcxLookup;
use super::settings::{Origin, Setting, SettingsError, UcxSettings};

impl UcxSettings {
    /// The settings in force: UCX's configuration where a UCX can be
    /// loaded, the environment otherwise.
    pub fn read() -> Result<UcxSettings, SettingsError> {
        let env = |name: &str| std::env::var(name).ok();
        // Check the environment with our syntax first, for our messages.
        let mut from_env = UcxSettings::from_lookup(&env, None)?;
        let rdma = host_rdma_devices();
        // Without the `nixl` feature no UCX is loaded: the environment is
        // what UCX would read.
        #[cfg(not(feature = "nixl"))]
        {
            from_env.rdma_devices = rdma;
            Ok(from_env)
        }
        #[cfg(feature = "nixl")]
        {
            let Ok(ucx) = ucx_sys::Ucx::get() else {
                from_env.rdma_devices = rdma;
                return Ok(from_env);
            };
            UcxSettings::from_ucx(ucx, &env, rdma)
        }
    }

    /// The settings as the loaded UCX reads them, the environment's
    /// syntax already checked.
    #[cfg(feature = "nixl")]
    fn from_ucx(
        ucx: &ucx_sys::Ucx,
        env: UcxLookup<'_>,
        rdma: Setting<bool>,
    ) -> Result<UcxSettings, SettingsError> {
        let cfg = ucx.ucp_config_read().map_err(SettingsError::Ucx)?;
        let values = cfg.values();
        let lookup = |name: &str| {
            values
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let mut settings = UcxSettings::from_lookup(env, Some(&lookup))?;
        settings.rdma_devices = rdma;
        Ok(settings)
    }
}

/// The RDMA devices of this host (`/sys/class/infiniband`), as a setting.
fn host_rdma_devices() -> Setting<bool> {
    let devices: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|dir| {
            dir.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    Setting {
        value: !devices.is_empty(),
        raw: if devices.is_empty() {
            "none".into()
        } else {
            devices.join(",")
        },
        source: Origin::Host,
    }
}
