//! A YAML file describing a fake node: the inventory source for tests and GPU-less machines.
//!
//! ```yaml
//! node: fixture-a100-mig          # informational
//! driver_version: "550.54.15"
//! cuda_version: "12.4"
//! driver_root: /                  # optional; the CLI can override it
//! majors: { nvidia: 195, nvidia_uvm: 508, nvidia_caps: 509 }
//! mig_minors: |                   # the text of /proc/driver/nvidia-caps/mig-minors
//!   gpu0/gi2/access 21
//!   gpu0/gi2/ci0/access 22
//! gpus:
//!   - { index: 0, minor: 0, uuid: GPU-..., model: NVIDIA A100-SXM4-40GB, memory_mib: 40960,
//!       numa_node: 0, cpu_affinity: "0-31", pci_bus_id: "0000:07:00.0", mig_enabled: true,
//!       mig_devices: [ { index: 0, uuid: MIG-..., gi: 2, ci: 0, profile: 3g.20gb, memory_mib: 19968 } ] }
//! driver_files: { libraries: [...], binaries: [...], firmware: [...], configs: [...], sockets: [...] }
//! topology: [ "X NV12", "NV12 X" ]  # optional; `nvidia-smi topo -m`'s matrix, row i = GPU i
//! health_events: [ { uuid: GPU-..., xid: 79 } ]   # injected for device-plugin tests
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{
    ComputeMode, DeviceNode, DriverFile, DriverFileKind, FoundBy, Gpu, Health, InventoryError, InventorySource,
    MadeInstance, MigDevice, MigError, MigMinors, MigPlacement, MigProfileInfo, NodeInventory,
};
use crate::mig::MigProfile;
use crate::topology::GpuTopology;

/// Fixtures compiled into the binaries, by name.
pub const BUILTIN_FIXTURES: &[(&str, &str)] = &[
    ("h100x8", include_str!("../../fixtures/h100x8.yaml")),
    ("a100-mig", include_str!("../../fixtures/a100-mig.yaml")),
    ("a100-dynamic-mig", include_str!("../../fixtures/a100-dynamic-mig.yaml")),
    ("t4x2", include_str!("../../fixtures/t4x2.yaml")),
    ("h100-nvswitch", include_str!("../../fixtures/h100-nvswitch.yaml")),
    (
        "a100-nvlink-pairs",
        include_str!("../../fixtures/a100-nvlink-pairs.yaml"),
    ),
    (
        "l40s-pcie-switches",
        include_str!("../../fixtures/l40s-pcie-switches.yaml"),
    ),
];

/// The most memory a fixture's card may have: 16 TiB, far above any GPU's.
pub const MAX_CARD_MEMORY_MIB: u64 = 16 << 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Majors {
    nvidia: u32,
    nvidia_uvm: u32,
    #[serde(default)]
    nvidia_caps: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FixtureMig {
    index: u32,
    uuid: String,
    gi: u32,
    ci: u32,
    profile: MigProfile,
    memory_mib: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    placement: Option<MigPlacement>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FixtureGpu {
    index: u32,
    #[serde(default)]
    minor: Option<u32>,
    uuid: String,
    model: String,
    memory_mib: u64,
    #[serde(default)]
    numa_node: Option<u32>,
    #[serde(default)]
    cpu_affinity: Option<String>,
    pci_bus_id: String,
    #[serde(default)]
    health: Health,
    #[serde(default)]
    mig_enabled: bool,
    #[serde(default)]
    mig_devices: Vec<FixtureMig>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    mig_profiles: Vec<MigProfileInfo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    compute_mode: Option<ComputeMode>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FixtureDriverFiles {
    #[serde(default)]
    libraries: Vec<PathBuf>,
    #[serde(default)]
    binaries: Vec<PathBuf>,
    #[serde(default)]
    firmware: Vec<PathBuf>,
    #[serde(default)]
    configs: Vec<PathBuf>,
    #[serde(default)]
    sockets: Vec<PathBuf>,
}

/// A health event injected by a fixture (stands in for an NVML XID event).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthEvent {
    /// The GPU (or MIG device) UUID the event is about.
    pub uuid: String,
    /// The XID error code.
    pub xid: u64,
}

/// A parsed fixture file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fixture {
    #[serde(default)]
    node: Option<String>,
    driver_version: String,
    #[serde(default)]
    cuda_version: Option<String>,
    #[serde(default)]
    driver_root: Option<PathBuf>,
    majors: Majors,
    #[serde(default)]
    mig_minors: String,
    gpus: Vec<FixtureGpu>,
    #[serde(default)]
    driver_files: FixtureDriverFiles,
    /// The link matrix as `nvidia-smi topo -m` prints it, one string per GPU in index order.
    #[serde(default)]
    topology: Option<Vec<String>>,
    /// Health events to inject, in order.
    #[serde(default)]
    pub health_events: Vec<HealthEvent>,
}

fn char_dev(path: impl Into<PathBuf>, major: u32, minor: u32) -> DeviceNode {
    DeviceNode {
        path: path.into(),
        major,
        minor,
    }
}

/// Path of MIG capability device `minor`.
pub fn cap_path(minor: u32) -> PathBuf {
    PathBuf::from(format!("/dev/nvidia-caps/nvidia-cap{minor}"))
}

impl Fixture {
    /// Parses fixture YAML; `source` names it in errors.
    pub fn parse(text: &str, source: &Path) -> Result<Self, InventoryError> {
        serde_yaml::from_str(text).map_err(|e| InventoryError::ParseFixture {
            path: source.to_path_buf(),
            reason: e.to_string(),
        })
    }

    /// A fixture compiled into the binary, by name (`h100x8`, `a100-mig`, `t4x2`).
    pub fn builtin(name: &str) -> Option<Self> {
        BUILTIN_FIXTURES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(n, text)| Self::parse(text, Path::new(n)).expect("built-in fixtures are valid"))
    }

    /// The text of a built-in fixture.
    pub fn builtin_text(name: &str) -> Option<&'static str> {
        BUILTIN_FIXTURES.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
    }

    /// The node name the fixture describes, if it gives one.
    pub fn node_name(&self) -> Option<&str> {
        self.node.as_deref()
    }

    /// Refuses memory no card has: a card of 0 MiB or over 16 TiB (`MAX_CARD_MEMORY_MIB`), a MIG
    /// instance or profile of no memory or of more than its card (by its size or by the memory
    /// its profile's name gives), naming the card, the field and the value.
    pub fn check(&self, source: &Path) -> Result<(), InventoryError> {
        for g in &self.gpus {
            let refuse = |field: String, value: String, reason: String| InventoryError::FixtureCard {
                path: source.to_path_buf(),
                card: format!("card {} ({})", g.index, g.uuid),
                field: format!("{field}={value}"),
                reason,
            };
            if g.memory_mib == 0 || g.memory_mib > MAX_CARD_MEMORY_MIB {
                return Err(refuse(
                    "memory_mib".into(),
                    g.memory_mib.to_string(),
                    format!("a card has 1 to {MAX_CARD_MEMORY_MIB} MiB (16 TiB)"),
                ));
            }
            let instances = g.mig_devices.iter().enumerate();
            let instances = instances.map(|(j, m)| (format!("mig_devices[{j}]"), &m.profile, m.memory_mib));
            let profiles = g.mig_profiles.iter().enumerate();
            let profiles = profiles.map(|(j, p)| (format!("mig_profiles[{j}]"), &p.profile, p.memory_mib));
            for (at, profile, memory_mib) in instances.chain(profiles) {
                if memory_mib == 0 || memory_mib > g.memory_mib {
                    return Err(refuse(
                        format!("{at}.memory_mib"),
                        memory_mib.to_string(),
                        format!("a MIG instance has memory, at most its card's {} MiB", g.memory_mib),
                    ));
                }
                // The name's GB are decimal (an 80 GB card of 81559 MiB serves 7g.80gb).
                if u128::from(profile.memory_gb) * 1_000_000_000 > u128::from(g.memory_mib) << 20 {
                    return Err(refuse(
                        format!("{at}.profile"),
                        profile.to_string(),
                        format!(
                            "its {} GB are more than the card's {} MiB",
                            profile.memory_gb, g.memory_mib
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Builds the inventory. `driver_root` overrides the fixture's (tests point it at a temp dir).
    pub fn to_inventory(&self, source: &Path, driver_root: Option<&Path>) -> Result<NodeInventory, InventoryError> {
        self.check(source)?;
        let majors = &self.majors;
        // A fixture that does not spell the table out gets the driver's standard one.
        let minors = if self.mig_minors.trim().is_empty() {
            MigMinors::standard(
                self.gpus.iter().map(|g| g.minor.unwrap_or(g.index)),
                &source.join("mig_minors"),
            )
        } else {
            MigMinors::parse(&self.mig_minors, &source.join("mig_minors"))?
        };
        let mut gpus = Vec::with_capacity(self.gpus.len());
        for g in &self.gpus {
            let minor = g.minor.unwrap_or(g.index);
            let mut mig_devices = Vec::new();
            for m in &g.mig_devices {
                let caps_major = majors.nvidia_caps.ok_or_else(|| InventoryError::Invalid {
                    field: "majors.nvidia_caps".into(),
                    value: "missing".into(),
                    reason: "required when a GPU has MIG devices".into(),
                })?;
                let gm = minors.gi_access(minor, m.gi)?;
                let cm = minors.ci_access(minor, m.gi, m.ci)?;
                mig_devices.push(MigDevice {
                    index: m.index,
                    uuid: m.uuid.clone(),
                    gi: m.gi,
                    ci: m.ci,
                    profile: m.profile.clone(),
                    memory_mib: m.memory_mib,
                    gi_access: char_dev(cap_path(gm), caps_major, gm),
                    ci_access: char_dev(cap_path(cm), caps_major, cm),
                    placement: m.placement,
                });
            }
            gpus.push(Gpu {
                index: g.index,
                minor,
                uuid: g.uuid.clone(),
                model: g.model.clone(),
                memory_mib: g.memory_mib,
                numa_node: g.numa_node,
                cpu_affinity: g.cpu_affinity.clone(),
                pci_bus_id: g.pci_bus_id.clone(),
                health: g.health.clone(),
                device: char_dev(format!("/dev/nvidia{minor}"), majors.nvidia, minor),
                mig_enabled: g.mig_enabled || !g.mig_devices.is_empty(),
                mig_devices,
                mig_profiles: g.mig_profiles.clone(),
                compute_mode: g.compute_mode,
            });
        }
        gpus.sort_by_key(|g| g.index);
        let topology = self
            .topology
            .as_deref()
            .map(GpuTopology::from_rows)
            .transpose()
            .map_err(|reason| InventoryError::Invalid {
                field: "topology".into(),
                value: format!("{} rows", self.topology.as_ref().map_or(0, Vec::len)),
                reason,
            })?;
        let files = &self.driver_files;
        let mut driver_files: Vec<DriverFile> = [
            (&files.libraries, DriverFileKind::Library),
            (&files.binaries, DriverFileKind::Binary),
            (&files.firmware, DriverFileKind::Firmware),
            (&files.configs, DriverFileKind::Config),
            (&files.sockets, DriverFileKind::Socket),
        ]
        .into_iter()
        .flat_map(|(paths, kind)| {
            paths.iter().map(move |p| DriverFile {
                path: p.clone(),
                kind,
                found_by: FoundBy::Fixture,
                soname: None,
                on_host: false,
            })
        })
        .collect();
        driver_files.sort();
        let inventory = NodeInventory {
            driver_version: self.driver_version.clone(),
            cuda_version: self.cuda_version.clone(),
            gpus,
            control_devices: vec![
                char_dev("/dev/nvidiactl", majors.nvidia, 255),
                char_dev("/dev/nvidia-modeset", majors.nvidia, 254),
                char_dev("/dev/nvidia-uvm", majors.nvidia_uvm, 0),
                char_dev("/dev/nvidia-uvm-tools", majors.nvidia_uvm, 1),
            ],
            driver_root: driver_root
                .map(Path::to_path_buf)
                .or_else(|| self.driver_root.clone())
                .unwrap_or_else(|| PathBuf::from("/")),
            driver_files,
            driver_error: None,
            topology,
        };
        inventory.validate()?;
        Ok(inventory)
    }
}

impl Fixture {
    /// Creates a GPU instance of profile `profile_id` at `placement` on card `gpu_uuid`, with
    /// one compute instance covering it, as NVML does on a card in MIG mode
    /// (`nvmlDeviceCreateGpuInstanceWithPlacement`, `nvmlGpuInstanceCreateComputeInstance`):
    /// refused when the card is not in MIG mode, the profile or the placement is not one of the
    /// card's, or the placement overlaps an instance (one of unknown placement overlaps all).
    pub fn create_mig_instance(
        &mut self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<MadeInstance, String> {
        let gpu = self
            .gpus
            .iter_mut()
            .find(|g| g.uuid == gpu_uuid)
            .ok_or_else(|| format!("no card {gpu_uuid}"))?;
        if !gpu.mig_enabled {
            return Err(format!("card {gpu_uuid} is not in MIG mode"));
        }
        let info = gpu
            .mig_profiles
            .iter()
            .find(|p| p.id == profile_id)
            .ok_or_else(|| format!("card {gpu_uuid} has no GPU instance profile {profile_id}"))?;
        if !info.placements.contains(&placement) {
            return Err(format!(
                "profile {} cannot be placed at {}:{} on card {gpu_uuid}",
                info.profile, placement.start, placement.size
            ));
        }
        if let Some(m) = gpu
            .mig_devices
            .iter()
            .find(|m| m.placement.is_none_or(|p| p.overlaps(&placement)))
        {
            return Err(format!(
                "insufficient resources: {}:{} overlaps GPU instance {} ({})",
                placement.start, placement.size, m.gi, m.uuid
            ));
        }
        let gi = (1..)
            .find(|id| gpu.mig_devices.iter().all(|m| m.gi != *id))
            .expect("a free id");
        let uuid = {
            use ring::rand::SecureRandom as _;
            let mut b = [0u8; 16];
            ring::rand::SystemRandom::new()
                .fill(&mut b)
                .map_err(|_| "no random source".to_string())?;
            let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
            format!(
                "MIG-{}-{}-{}-{}-{}",
                &h[..8],
                &h[8..12],
                &h[12..16],
                &h[16..20],
                &h[20..]
            )
        };
        let index = (0..)
            .find(|i| gpu.mig_devices.iter().all(|m| m.index != *i))
            .expect("a free index");
        gpu.mig_devices.push(FixtureMig {
            index,
            uuid: uuid.clone(),
            gi,
            ci: 0,
            profile: info.profile.clone(),
            memory_mib: info.memory_mib,
            placement: Some(placement),
        });
        Ok(MadeInstance { gi, ci: 0, uuid })
    }

    /// Destroys GPU instance `gi` of card `gpu_uuid` and its compute instances when it is MIG
    /// device `uuid`; `false` when there is no such instance.
    pub fn destroy_mig_instance(&mut self, gpu_uuid: &str, gi: u32, uuid: &str) -> Result<bool, String> {
        let gpu = self
            .gpus
            .iter_mut()
            .find(|g| g.uuid == gpu_uuid)
            .ok_or_else(|| format!("no card {gpu_uuid}"))?;
        if !gpu.mig_devices.iter().any(|m| m.gi == gi && m.uuid == uuid) {
            return Ok(false);
        }
        gpu.mig_devices.retain(|m| m.gi != gi);
        Ok(true)
    }

    /// The fixture as YAML (what [`Fixture::parse`] reads).
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).expect("a fixture serialises")
    }
}

/// Creates and destroys MIG instances in a fixture file, as NVML does on a card: the fixture
/// is the fake node's hardware, so every reader of the file (the CDI generator, the DRA
/// plugin's inventory) sees the instance as it would see a real one.
#[derive(Debug)]
pub struct FixtureMigInstances {
    path: PathBuf,
    /// One change of the file at a time.
    lock: std::sync::Mutex<()>,
}

impl FixtureMigInstances {
    /// Instances in fixture file `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            lock: std::sync::Mutex::new(()),
        }
    }

    fn change<T>(&self, f: impl FnOnce(&mut Fixture) -> Result<T, String>) -> Result<T, String> {
        let _one = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut fixture = FixtureSource::new(&self.path).load().map_err(|e| e.to_string())?;
        let out = f(&mut fixture)?;
        let dir = self.path.parent().unwrap_or(Path::new("."));
        crate::dra::write_atomic(dir, &self.path, fixture.to_yaml().as_bytes(), 0o755, 0o644)
            .map_err(|e| format!("writing {}: {e}", self.path.display()))?;
        Ok(out)
    }
}

impl super::MigPartitioner for FixtureMigInstances {
    fn create(&self, parent_uuid: &str, profile_id: u32, placement: MigPlacement) -> Result<MadeInstance, MigError> {
        self.change(|f| f.create_mig_instance(parent_uuid, profile_id, placement))
            .map_err(MigError::Fixture)
    }

    fn destroy(&self, parent_uuid: &str, gi: u32, uuid: &str, _: u32, _: MigPlacement) -> Result<(), MigError> {
        // A fixture's instance always has its compute instance: its UUID says which it is.
        self.change(|f| f.destroy_mig_instance(parent_uuid, gi, uuid).map(|_| ()))
            .map_err(MigError::Fixture)
    }
}

/// Reads a fixture file (or a built-in fixture) on every [`InventorySource::discover`], so a
/// test can rewrite it to simulate MIG reconfiguration or a driver upgrade.
#[derive(Debug, Clone)]
pub struct FixtureSource {
    /// A file path, or the name of a built-in fixture.
    pub fixture: PathBuf,
    /// Overrides the fixture's driver root.
    pub driver_root: Option<PathBuf>,
}

impl FixtureSource {
    /// A source for `fixture` (a path or a built-in name).
    pub fn new(fixture: impl Into<PathBuf>) -> Self {
        Self {
            fixture: fixture.into(),
            driver_root: None,
        }
    }

    /// A source for `fixture` that is read once now: a fixture that cannot be read at start is
    /// a typo no later read will fix, so an agent refuses it rather than serve nothing.
    pub fn readable(fixture: impl Into<PathBuf>) -> Result<Self, InventoryError> {
        let source = Self::new(fixture);
        source.load()?;
        Ok(source)
    }

    /// Reads and parses the fixture.
    pub fn load(&self) -> Result<Fixture, InventoryError> {
        if !self.fixture.exists()
            && let Some(name) = self.fixture.to_str()
            && let Some(f) = Fixture::builtin(name)
        {
            return Ok(f);
        }
        let text = std::fs::read_to_string(&self.fixture).map_err(|source| InventoryError::ReadFixture {
            path: self.fixture.clone(),
            source,
        })?;
        Fixture::parse(&text, &self.fixture)
    }
}

impl InventorySource for FixtureSource {
    fn discover(&self) -> Result<NodeInventory, InventoryError> {
        self.load()?.to_inventory(&self.fixture, self.driver_root.as_deref())
    }
}
