//! The CDI spec Tessera writes: typed ([`tessera_core::cdi`]), built from the inventory,
//! checked against CDI's rules before anything is written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use tessera_core::cdi::{CdiDevice, CdiDeviceNode, CdiEdits, CdiMount, CdiSpec};
use tessera_core::enforcement::{
    HOOK_LIBRARY_IN_CONTAINER, HookLayout, MPS_PIPE_IN_CONTAINER, MpsLayout, ShareEnforcement,
};
use tessera_core::inventory::{DeviceNode, DriverFileKind, Gpu, NodeInventory};
use tessera_core::names::CDI_KIND;

pub use tessera_core::cdi::{DRIVER_DIR, LIBRARY_DIR};
/// Annotation on share devices.
pub const SHARE_ANNOTATION: &str = "tessera.io/share";

/// Why a spec could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The spec failed the CDI crate's validation.
    #[error("generated CDI spec is invalid: {0}")]
    Invalid(String),
    /// The inventory has nothing to offer.
    #[error("the inventory has no usable GPU, MIG device or share: nothing to put in a CDI spec")]
    Empty,
    /// The driver's files cannot serve GPU containers (no libcuda): a spec would break every
    /// GPU container, so none is written.
    #[error("not writing a CDI spec: {0}")]
    Driver(String),
    /// Files the spec mounts are not on the host: the runtime would refuse every container
    /// that asks for a device (runc: "error mounting ...: no such file or directory").
    #[error(
        "not writing a CDI spec: {} mounted host path(s) do not exist: {}{}",
        .0.len(),
        .0.iter().take(5).cloned().collect::<Vec<_>>().join(", "),
        if .0.len() > 5 { ", ..." } else { "" }
    )]
    MissingHostPaths(Vec<String>),
}

/// Options for building a spec.
#[derive(Debug, Clone)]
pub struct SpecOptions {
    /// Host root under which the device nodes are (`/` in production; a test root in tests,
    /// which then becomes each node's `hostPath`).
    pub dev_root: PathBuf,
    /// How the node holds shares to their limits; with MPS, share devices connect to their
    /// card's daemon.
    pub enforcement: ShareEnforcement,
    /// Where the MPS daemons' directories are.
    pub mps: MpsLayout,
    /// Where hook mode's library is installed.
    pub hook: HookLayout,
    /// The driver bundle to mount once at `/usr/local/nvidia` (see [`crate::bundle`]); `None`:
    /// each driver file is mounted on its own.
    pub driver_bundle: Option<PathBuf>,
}

impl Default for SpecOptions {
    fn default() -> Self {
        Self {
            dev_root: "/".into(),
            enforcement: ShareEnforcement::None,
            mps: MpsLayout::default(),
            hook: HookLayout::default(),
            driver_bundle: None,
        }
    }
}

fn node(n: &DeviceNode, opts: &SpecOptions) -> CdiDeviceNode {
    let path = n.path.display().to_string();
    let host_path = (opts.dev_root != Path::new("/")).then(|| {
        opts.dev_root
            .join(n.path.strip_prefix("/").unwrap_or(&n.path))
            .display()
            .to_string()
    });
    CdiDeviceNode {
        path,
        host_path,
        kind: "c".into(),
        major: i64::from(n.major),
        minor: i64::from(n.minor),
        permissions: "rw".into(),
    }
}

fn ro_bind(host: String, container: String) -> CdiMount {
    CdiMount {
        host_path: host,
        container_path: container,
        options: vec!["ro".into(), "nosuid".into(), "nodev".into(), "bind".into()],
    }
}

/// Spec-wide edits: control devices, driver files, library lookup.
fn common_edits(inv: &NodeInventory, opts: &SpecOptions) -> CdiEdits {
    let mut edits = CdiEdits {
        env: vec![
            "NVIDIA_VISIBLE_DEVICES=void".into(),
            format!("LD_LIBRARY_PATH={LIBRARY_DIR}"),
        ],
        device_nodes: inv.control_devices.iter().map(|d| node(d, opts)).collect(),
        mounts: Vec::new(),
    };
    if let Some(bundle) = &opts.driver_bundle {
        // One mount for every library and program; firmware keeps its path.
        edits
            .mounts
            .push(ro_bind(bundle.display().to_string(), DRIVER_DIR.into()));
    }
    for f in inv.driver_files.iter().filter(|f| f.for_containers()) {
        let host = inv.host_path(f).display().to_string();
        let name = f.name();
        if opts.driver_bundle.is_some() && matches!(f.kind, DriverFileKind::Library | DriverFileKind::Binary) {
            continue;
        }
        match f.kind {
            DriverFileKind::Library => {
                // Libraries go to one directory, under their file name and their soname, so
                // the loader finds them through LD_LIBRARY_PATH with no ldcache hook.
                edits
                    .mounts
                    .push(ro_bind(host.clone(), format!("{LIBRARY_DIR}/{name}")));
                if let Some(so) = f.loader_name().filter(|so| *so != name) {
                    edits.mounts.push(ro_bind(host, format!("{LIBRARY_DIR}/{so}")));
                }
            }
            // Programs where every image's PATH looks, wherever the node keeps them.
            DriverFileKind::Binary => edits.mounts.push(ro_bind(host, format!("/usr/bin/{name}"))),
            // Firmware where the driver expects it (`/lib/firmware/nvidia/<version>`).
            DriverFileKind::Firmware => edits.mounts.push(ro_bind(
                host,
                format!("/lib/firmware/nvidia/{}/{name}", inv.driver_version),
            )),
            DriverFileKind::Config | DriverFileKind::Socket => {
                edits.mounts.push(ro_bind(host, f.path.display().to_string()));
            }
        }
    }
    edits
}

/// A share device: the card's node, Tessera's CUDA hook (on hook and MPS nodes) and, on MPS
/// nodes, what connects the container to the card's MPS daemon (its pipe directory, and its shm
/// directory as `/dev/shm`). The limits themselves come per container from the signed
/// allocation (the NRI plugin adds them).
fn share_edits(gpu: &Gpu, opts: &SpecOptions) -> CdiEdits {
    let mut edits = CdiEdits {
        device_nodes: vec![node(&gpu.device, opts)],
        ..Default::default()
    };
    if opts.enforcement.preloads_hook() {
        // Preloaded into every process of the container by the mounted ld.so.preload (which
        // the container's env cannot undo); its limits come per container from the plugin.
        edits.mounts.push(ro_bind(
            opts.hook.library().display().to_string(),
            HOOK_LIBRARY_IN_CONTAINER.into(),
        ));
        edits.mounts.push(ro_bind(
            opts.hook.preload().display().to_string(),
            "/etc/ld.so.preload".into(),
        ));
    }
    if opts.enforcement == ShareEnforcement::Mps {
        // The daemon's control socket alone, read-only (connecting needs no write access to
        // the mount), and the card's bounded shm.
        edits
            .env
            .push(format!("CUDA_MPS_PIPE_DIRECTORY={MPS_PIPE_IN_CONTAINER}"));
        edits.mounts.push(CdiMount {
            host_path: opts.mps.client_dir(&gpu.uuid).display().to_string(),
            container_path: MPS_PIPE_IN_CONTAINER.into(),
            options: ["ro", "nosuid", "nodev", "noexec", "bind"].map(String::from).to_vec(),
        });
        edits.mounts.push(CdiMount {
            host_path: opts.mps.shm_dir(&gpu.uuid).display().to_string(),
            container_path: "/dev/shm".into(),
            options: ["rw", "nosuid", "nodev", "bind"].map(String::from).to_vec(),
        });
    }
    edits
}

/// CDI device names of a whole GPU.
pub fn gpu_names(gpu: &Gpu) -> [String; 2] {
    [gpu.index.to_string(), gpu.uuid.clone()]
}

/// CDI device names of a GPU's share device.
pub fn share_names(gpu: &Gpu) -> [String; 2] {
    [format!("share-{}", gpu.index), format!("share-{}", gpu.uuid)]
}

/// Builds the spec (without validating it; see [`render`]).
pub fn build(inv: &NodeInventory, opts: &SpecOptions) -> CdiSpec {
    let mut devices = Vec::new();
    let mut all = CdiEdits::default();
    for gpu in &inv.gpus {
        if gpu.mig_enabled {
            for m in &gpu.mig_devices {
                let edits = CdiEdits {
                    device_nodes: vec![
                        node(&gpu.device, opts),
                        node(&m.gi_access, opts),
                        node(&m.ci_access, opts),
                    ],
                    ..Default::default()
                };
                for name in [format!("{}:{}", gpu.index, m.index), m.uuid.clone()] {
                    devices.push(CdiDevice {
                        name,
                        annotations: BTreeMap::new(),
                        container_edits: edits.clone(),
                    });
                }
                for n in edits.device_nodes {
                    if !all.device_nodes.contains(&n) {
                        all.device_nodes.push(n);
                    }
                }
            }
            continue;
        }
        let whole = CdiEdits {
            device_nodes: vec![node(&gpu.device, opts)],
            ..Default::default()
        };
        for name in gpu_names(gpu) {
            devices.push(CdiDevice {
                name,
                annotations: BTreeMap::new(),
                container_edits: whole.clone(),
            });
        }
        let share = share_edits(gpu, opts);
        let annotations = BTreeMap::from([(SHARE_ANNOTATION.to_string(), gpu.uuid.clone())]);
        for name in share_names(gpu) {
            devices.push(CdiDevice {
                name,
                annotations: annotations.clone(),
                container_edits: share.clone(),
            });
        }
        if !all.device_nodes.contains(&whole.device_nodes[0]) {
            all.device_nodes.push(whole.device_nodes[0].clone());
        }
    }
    if !all.device_nodes.is_empty() {
        devices.push(CdiDevice {
            name: "all".into(),
            annotations: BTreeMap::new(),
            container_edits: all,
        });
    }
    CdiSpec {
        cdi_version: String::new(),
        kind: CDI_KIND.into(),
        devices,
        container_edits: common_edits(inv, opts),
    }
}

/// The spec's mount sources that do not exist, read below `host_root` (where this process sees
/// the host's `/`), in the spec's order: the driver's files, which must be on the node now. Not
/// checked: the driver bundle of `opts` (made by this process at its host path), the MPS and
/// hook directories (the node's agents make them at run time, after a reboot too; a share whose
/// card's daemon is not ready is refused at creation anyway), and device nodes (runc creates a
/// missing one from its major and minor numbers).
pub fn missing_host_paths(spec: &CdiSpec, opts: &SpecOptions, host_root: &Path) -> Vec<String> {
    let edits = std::iter::once(&spec.container_edits).chain(spec.devices.iter().map(|d| &d.container_edits));
    let mut missing: Vec<String> = Vec::new();
    for m in edits.flat_map(|e| e.mounts.iter()) {
        let host = Path::new(&m.host_path);
        if opts.driver_bundle.as_deref() == Some(host)
            || host.starts_with(&opts.mps.root)
            || host.starts_with(&opts.hook.root)
        {
            continue;
        }
        let local = host_root.join(host.strip_prefix("/").unwrap_or(host));
        // A dangling link is missing too.
        if std::fs::metadata(&local).is_err() && !missing.contains(&m.host_path) {
            missing.push(m.host_path.clone());
        }
    }
    missing
}

/// Builds, versions and validates the spec; returns it and its JSON text.
pub fn render(inv: &NodeInventory, opts: &SpecOptions) -> Result<(CdiSpec, String), SpecError> {
    inv.driver_check().map_err(SpecError::Driver)?;
    let mut spec = build(inv, opts);
    if spec.devices.is_empty() {
        return Err(SpecError::Empty);
    }
    spec.cdi_version = spec.minimum_version().into();
    spec.validate().map_err(|e| SpecError::Invalid(e.to_string()))?;
    let text = serde_json::to_string_pretty(&spec).map_err(|e| SpecError::Invalid(e.to_string()))? + "\n";
    Ok((spec, text))
}
