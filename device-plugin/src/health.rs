//! GPU health as a stream of events: NVML critical XID errors (or a fixture's injected events)
//! mark a GPU and everything on it unhealthy; a GPU quiet for the recovery period, or reset,
//! is healthy again.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// XIDs caused by applications, not the GPU (NVIDIA's device plugin skips the same ones).
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// One health event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthEvent {
    /// An XID error on a GPU or MIG device (by UUID).
    Xid {
        /// Device UUID.
        uuid: String,
        /// XID code.
        xid: u64,
    },
    /// The GPU was reset: healthy again at once.
    Reset {
        /// Device UUID.
        uuid: String,
    },
}

#[derive(Debug, Clone)]
struct Unhealthy {
    last_event: Instant,
    reason: String,
}

/// Which devices are unhealthy, and since when.
#[derive(Debug, Clone, Default)]
pub struct HealthState {
    unhealthy: BTreeMap<String, Unhealthy>,
}

impl HealthState {
    /// Applies an event; returns true when the health of some device changed.
    pub fn apply(&mut self, event: &HealthEvent, now: Instant) -> bool {
        match event {
            HealthEvent::Xid { xid, .. } if APPLICATION_XIDS.contains(xid) => false,
            HealthEvent::Xid { uuid, xid } => {
                let was = self.unhealthy.insert(
                    uuid.clone(),
                    Unhealthy {
                        last_event: now,
                        reason: format!("XID {xid}"),
                    },
                );
                was.is_none()
            }
            HealthEvent::Reset { uuid } => self.unhealthy.remove(uuid).is_some(),
        }
    }

    /// Marks devices quiet for `period` healthy again; returns the UUIDs that recovered.
    pub fn recover(&mut self, now: Instant, period: Duration) -> Vec<String> {
        let done: Vec<String> = self
            .unhealthy
            .iter()
            .filter(|(_, u)| now.duration_since(u.last_event) >= period)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &done {
            self.unhealthy.remove(k);
        }
        done
    }

    /// True unless the device is marked unhealthy.
    pub fn is_healthy(&self, uuid: &str) -> bool {
        !self.unhealthy.contains_key(uuid)
    }

    /// Why a device is unhealthy.
    pub fn reason(&self, uuid: &str) -> Option<&str> {
        self.unhealthy.get(uuid).map(|u| u.reason.as_str())
    }
}

/// Watches NVML for critical XID errors on a blocking thread and forwards them. Returns an
/// error at once when NVML cannot be loaded.
pub fn watch_nvml(tx: tokio::sync::mpsc::UnboundedSender<HealthEvent>) -> anyhow::Result<std::thread::JoinHandle<()>> {
    let nvml = std::sync::Arc::new(nvml_wrapper::Nvml::init()?);
    Ok(tessera_node::telemetry::xid::watch(nvml, move |event| match event {
        Some((uuid, xid)) => tx.send(HealthEvent::Xid { uuid, xid }).is_ok(),
        None => !tx.is_closed(),
    })?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn critical_xids_mark_and_quiet_recovers() {
        let mut h = HealthState::default();
        let t0 = Instant::now();
        assert!(
            !h.apply(
                &HealthEvent::Xid {
                    uuid: "GPU-a".into(),
                    xid: 13
                },
                t0
            ),
            "application XID"
        );
        assert!(h.is_healthy("GPU-a"));
        assert!(h.apply(
            &HealthEvent::Xid {
                uuid: "GPU-a".into(),
                xid: 79
            },
            t0
        ));
        assert_eq!(h.reason("GPU-a"), Some("XID 79"));
        // A second event restarts the quiet period.
        assert!(!h.apply(
            &HealthEvent::Xid {
                uuid: "GPU-a".into(),
                xid: 48
            },
            t0 + Duration::from_secs(5)
        ));
        assert!(
            h.recover(t0 + Duration::from_secs(9), Duration::from_secs(10))
                .is_empty()
        );
        assert_eq!(
            h.recover(t0 + Duration::from_secs(15), Duration::from_secs(10)),
            vec!["GPU-a".to_string()]
        );
        assert!(h.is_healthy("GPU-a"));
        h.apply(
            &HealthEvent::Xid {
                uuid: "GPU-b".into(),
                xid: 79,
            },
            t0,
        );
        assert!(h.apply(&HealthEvent::Reset { uuid: "GPU-b".into() }, t0));
        assert!(h.is_healthy("GPU-b"));
    }
}
