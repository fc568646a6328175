//! XID errors from NVML's event set (the one watch the device plugin's health and the node's
//! metrics share).

use std::sync::Arc;

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;

/// How long one wait for an event lasts before `on_event(None)` is asked whether to go on.
const WAIT_MS: u32 = 5000;

/// Watches every GPU's critical XID errors on a thread: `on_event(Some((uuid, xid)))` per error
/// (`u64::MAX` when NVML gives no code), `on_event(None)` after each quiet wait; the watch ends
/// when it returns false. GPUs that refuse registration are skipped (logged).
pub fn watch(
    nvml: Arc<Nvml>,
    mut on_event: impl FnMut(Option<(String, u64)>) -> bool + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("nvml-xid".into()).spawn(move || {
        let count = nvml.device_count().unwrap_or(0);
        let mut skip = std::collections::BTreeSet::new();
        // A failed registration consumes the set: rebuild it without the GPUs that refuse.
        let set = 'build: loop {
            let mut set = match nvml.create_event_set() {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "NVML event set unavailable: no XID watch");
                    return;
                }
            };
            for i in (0..count).filter(|i| !skip.contains(i)) {
                let Ok(dev) = nvml.device_by_index(i) else { continue };
                set = match dev.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(index = i, error = %e.error, "cannot watch XIDs on this GPU");
                        skip.insert(i);
                        continue 'build;
                    }
                };
            }
            break set;
        };
        loop {
            let go_on = match set.wait(WAIT_MS) {
                Ok(ev) => {
                    let xid = match ev.event_data {
                        Some(XidError::Value(x)) => x,
                        _ => u64::MAX,
                    };
                    match ev.device.uuid() {
                        Ok(uuid) => on_event(Some((uuid, xid))),
                        Err(_) => true,
                    }
                }
                Err(nvml_wrapper::error::NvmlError::Timeout) => on_event(None),
                Err(e) => {
                    tracing::warn!(error = %e, "NVML event wait failed; the XID watch stops");
                    return;
                }
            };
            if !go_on {
                return;
            }
        }
    })
}
