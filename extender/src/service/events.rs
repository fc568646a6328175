//! Kubernetes Events on pods, so that `kubectl describe pod` tells what Tessera did: which GPUs a
//! pod was bound to, and why a bind failed. Recording never delays a bind (a task per event) and
//! is rate-limited: the same reason and message for a pod at most once per [`REPEAT_WINDOW`], and
//! at most [`BURST`] events at once, refilled at [`PER_SECOND`] (a scheduler retrying a pod that
//! cannot fit must not flood the API server).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tessera_core::handoff::{AllocatedDevice, Allocation};
use tracing::warn;

/// A repeat of the same event for the same pod within this window is dropped.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(600);
/// Events that may be sent at once.
pub const BURST: f64 = 50.0;
/// Events per second in the long run.
pub const PER_SECOND: f64 = 10.0;
/// The component named in the events.
pub const COMPONENT: &str = "tessera-extender";
/// Reason of a successful bind.
pub const REASON_BOUND: &str = "TesseraBound";
/// Reason of a failed bind.
pub const REASON_BIND_FAILED: &str = "TesseraBindFailed";

/// The pod an event is about.
#[derive(Debug, Clone)]
pub struct PodRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
}

/// Whether an event may go out now.
#[derive(Debug)]
struct Limiter {
    tokens: f64,
    last: Instant,
    /// (pod uid, reason, message) -> when last sent.
    recent: HashMap<(String, &'static str, String), Instant>,
}

impl Limiter {
    fn new(now: Instant) -> Self {
        Self {
            tokens: BURST,
            last: now,
            recent: HashMap::new(),
        }
    }

    fn admit(&mut self, key: (String, &'static str, String), now: Instant) -> bool {
        if self
            .recent
            .get(&key)
            .is_some_and(|t| now.duration_since(*t) < REPEAT_WINDOW)
        {
            return false;
        }
        self.tokens = (self.tokens + now.duration_since(self.last).as_secs_f64() * PER_SECOND).min(BURST);
        self.last = now;
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        if self.recent.len() >= 10_000 {
            self.recent.retain(|_, t| now.duration_since(*t) < REPEAT_WINDOW);
        }
        self.recent.insert(key, now);
        true
    }
}

/// Records events on pods.
#[derive(Debug)]
pub struct Recorder {
    limiter: Mutex<Limiter>,
}

impl Default for Recorder {
    fn default() -> Self {
        Self {
            limiter: Mutex::new(Limiter::new(Instant::now())),
        }
    }
}

/// What a pod was given, for people: `main: GPU-3a84… 30% + 8 GiB; sidecar: MIG-… (1g.10gb)`.
pub fn describe(a: &Allocation) -> String {
    let mut out = String::new();
    for (i, c) in a.containers.iter().enumerate() {
        if i > 0 {
            out.push_str("; ");
        }
        let _ = write!(out, "{}: ", c.name);
        for (j, d) in c.devices.iter().enumerate() {
            if j > 0 {
                out.push_str(", ");
            }
            match d {
                AllocatedDevice::Gpu {
                    uuid,
                    index,
                    exclusive: true,
                    ..
                } => {
                    let _ = write!(out, "GPU {index} ({uuid}) whole");
                }
                AllocatedDevice::Gpu {
                    uuid,
                    index,
                    core_percent,
                    memory_mib,
                    ..
                } => {
                    let _ = write!(out, "GPU {index} ({uuid}) {core_percent}% + {memory_mib} MiB");
                }
                AllocatedDevice::Mig {
                    uuid,
                    profile,
                    parent_index,
                    ..
                } => {
                    let _ = write!(out, "MIG {profile} on GPU {parent_index} ({uuid})");
                }
            }
        }
    }
    out
}

impl Recorder {
    /// The pod was bound to `node` with `allocation` (none: a pod without GPUs).
    pub fn bound(&self, client: &Client, pod: &PodRef, node: &str, allocation: Option<&Allocation>) {
        let message = match allocation {
            Some(a) => format!("bound to {node}: {}", describe(a)),
            None => format!("bound to {node} (no GPU)"),
        };
        self.record(client, pod, REASON_BOUND, "Normal", message);
    }

    /// Binding the pod to `node` failed.
    pub fn bind_failed(&self, client: &Client, pod: &PodRef, node: &str, why: &str) {
        self.record(
            client,
            pod,
            REASON_BIND_FAILED,
            "Warning",
            format!("binding to {node} failed: {why}"),
        );
    }

    fn record(&self, client: &Client, pod: &PodRef, reason: &'static str, kind: &str, message: String) {
        let now = Instant::now();
        let admitted = self
            .limiter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .admit((pod.uid.clone(), reason, message.clone()), now);
        if !admitted {
            return;
        }
        let event = event(pod, reason, kind, message, Timestamp::now());
        let api: Api<Event> = Api::namespaced(client.clone(), &pod.namespace);
        tokio::spawn(async move {
            if let Err(e) = api.create(&PostParams::default(), &event).await {
                warn!(error = %e, reason, "cannot record an event");
            }
        });
    }
}

/// A core/v1 Event about `pod` (named as kubectl's own: `<pod>.<nanoseconds in hex>`).
fn event(pod: &PodRef, reason: &str, kind: &str, message: String, at: Timestamp) -> Event {
    let nanos = at.as_nanosecond();
    Event {
        metadata: ObjectMeta {
            name: Some(format!("{}.{nanos:x}", pod.name)),
            namespace: Some(pod.namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(pod.name.clone()),
            namespace: Some(pod.namespace.clone()),
            uid: Some(pod.uid.clone()),
            ..Default::default()
        },
        reason: Some(reason.into()),
        message: Some(message),
        type_: Some(kind.into()),
        count: Some(1),
        first_timestamp: Some(Time(at)),
        last_timestamp: Some(Time(at)),
        event_time: Some(MicroTime(at)),
        action: Some("Binding".into()),
        reporting_component: Some(COMPONENT.into()),
        reporting_instance: Some(std::env::var("HOSTNAME").unwrap_or_else(|_| COMPONENT.into())),
        source: Some(EventSource {
            component: Some(COMPONENT.into()),
            host: None,
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_are_dropped_and_bursts_bounded() {
        let t0 = Instant::now();
        let mut l = Limiter::new(t0);
        let key = |uid: &str, m: &str| (uid.to_string(), REASON_BIND_FAILED, m.to_string());
        assert!(l.admit(key("a", "no room"), t0));
        assert!(!l.admit(key("a", "no room"), t0 + Duration::from_secs(30)), "a repeat");
        assert!(l.admit(key("a", "other reason"), t0), "another message");
        assert!(l.admit(key("b", "no room"), t0), "another pod");
        assert!(l.admit(key("a", "no room"), t0 + REPEAT_WINDOW), "after the window");
        // A burst of distinct events: BURST at once, then PER_SECOND.
        let mut l = Limiter::new(t0);
        let sent = (0..200).filter(|i| l.admit(key(&i.to_string(), "x"), t0)).count();
        assert_eq!(sent, BURST as usize);
        let later = t0 + Duration::from_secs(1);
        let sent = (200..300).filter(|i| l.admit(key(&i.to_string(), "x"), later)).count();
        assert_eq!(sent, PER_SECOND as usize);
    }

    #[test]
    fn allocations_are_described_for_people() {
        use tessera_core::inventory::{FixtureSource, InventorySource};
        let inv = FixtureSource::new("a100-mig").discover().unwrap();
        let mut a = Allocation::new("n1", "uid");
        a.containers.push(tessera_core::handoff::ContainerAllocation {
            name: "main".into(),
            role: tessera_core::request::ContainerRole::App,
            devices: vec![AllocatedDevice::share(&inv.gpus[1], 30, 8192)],
        });
        let gpu = &inv.gpus[0];
        let m = &gpu.mig_devices[0];
        a.containers.push(tessera_core::handoff::ContainerAllocation {
            name: "side".into(),
            role: tessera_core::request::ContainerRole::App,
            devices: vec![AllocatedDevice::Mig {
                uuid: m.uuid.clone(),
                profile: m.profile.clone(),
                parent_uuid: gpu.uuid.clone(),
                parent_index: gpu.index,
                gi: m.gi,
                ci: m.ci,
            }],
        });
        let text = describe(&a);
        assert_eq!(
            text,
            format!(
                "main: GPU 1 ({}) 30% + 8192 MiB; side: MIG {} on GPU 0 ({})",
                inv.gpus[1].uuid, m.profile, m.uuid
            )
        );
        let e = event(
            &PodRef {
                namespace: "ns".into(),
                name: "p".into(),
                uid: "u".into(),
            },
            REASON_BOUND,
            "Normal",
            text,
            Timestamp::from_second(1).unwrap(),
        );
        assert_eq!(e.metadata.name.as_deref(), Some("p.3b9aca00"));
        assert_eq!(e.involved_object.uid.as_deref(), Some("u"));
    }
}
