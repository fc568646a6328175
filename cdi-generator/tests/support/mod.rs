//! Checks shared by the spec tests.

use container_device_interface::specs::config::Spec as RawSpec;

/// Checks `text` with the `container-device-interface` crate (the CDI reference rules in Rust):
/// it parses, validates, and needs exactly `cdi_version`. Panics naming `what`.
pub fn cdi_crate_accepts(text: &str, cdi_version: &str, what: &str) {
    let raw: RawSpec = serde_json::from_str(text).unwrap_or_else(|e| panic!("{what}: {e}"));
    let needed = container_device_interface::version::minimum_required_version(&raw).unwrap();
    assert_eq!(needed.to_string(), cdi_version, "{what}");
    let mut checked = container_device_interface::spec::new_spec(
        &raw,
        &std::path::PathBuf::from("/var/run/cdi/tessera.io-gpu.json"),
        0,
    )
    .unwrap_or_else(|e| panic!("{what}: {e:#}"));
    checked.validate().unwrap_or_else(|e| panic!("{what}: {e:#}"));
}
