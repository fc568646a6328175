//! ElasticGPU claims: the watches on Tessera's claims and classes, the bookings of retained
//! GPUs ([`holds`]), the controller that records what each claim was given ([`controller`]) and
//! the admission webhook that names a claim's pod ([`admission`]). The scheduler service (the
//! extender) runs them over its view of the cluster, which it lends through [`SchedulerView`].

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

pub mod admission;
pub mod controller;
pub mod holds;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};
use tessera_api::claim::ElasticGpuClaim;
use tessera_api::class::ElasticGpuClass;
use tessera_api::egpu::ElasticGpu;
use tessera_api::pod::{claim_refs, names_claims};
use tessera_core::handoff::SigningKeys;
use tokio::sync::mpsc;

/// What the claims read of the scheduler's view of the cluster (the extender's ledger, fed by
/// its watches).
pub trait SchedulerView: Send + Sync {
    /// Whether nodes, pods and ElasticGPUs have been listed: before, no claim is decided.
    fn synced(&self) -> bool;
    /// The keys allocations are signed with (a pod's devices are read from its verified
    /// allocation only).
    fn keys(&self) -> std::sync::Arc<SigningKeys>;
    /// The pod using claim `key` (`namespace/name`), as (`namespace/name`, UID).
    fn claim_user(&self, key: &str) -> Option<(String, String)>;
}

/// Claim keys (`namespace/name`) to reconcile.
pub type Trigger = mpsc::UnboundedSender<String>;

/// Reflector stores of the three kinds.
#[derive(Clone)]
pub struct ClaimStores {
    /// ElasticGPUClaims.
    pub claims: Store<ElasticGpuClaim>,
    /// ElasticGPUClasses.
    pub classes: Store<ElasticGpuClass>,
    /// ElasticGPUs.
    pub elastic_gpus: Store<ElasticGpu>,
}

/// The claim keys a pod names (none when its annotations do not read).
pub fn pod_claim_keys(pod: &Pod) -> Vec<String> {
    if !names_claims(pod) {
        return Vec::new();
    }
    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
    claim_refs(pod)
        .map(|uses| uses.into_iter().map(|u| format!("{ns}/{}", u.claim)).collect())
        .unwrap_or_default()
}

/// The claim an ElasticGPU is bound to, as a trigger key.
pub fn egpu_claim_key(e: &ElasticGpu) -> String {
    format!("{}/{}", e.spec.claim_ref.namespace, e.spec.claim_ref.name)
}

/// Starts the watches of claims and classes; every change to a claim triggers it. The
/// ElasticGPUs are the scheduler's to watch (it books retained GPUs from them): their store is
/// passed in.
pub fn watch(
    client: &Client,
    elastic_gpus: Store<ElasticGpu>,
    trigger: Trigger,
) -> (ClaimStores, Vec<tokio::task::JoinHandle<()>>) {
    let (claims, claims_writer) = reflector::store();
    let (classes, classes_writer) = reflector::store();
    let claim_task = tokio::spawn(futures_util::StreamExt::for_each(
        watcher::watcher(Api::<ElasticGpuClaim>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .reflect(claims_writer)
            .touched_objects(),
        move |c| {
            if let Ok(c) = c {
                let _ = trigger.send(c.key());
            }
            std::future::ready(())
        },
    ));
    let class_task = tokio::spawn(futures_util::StreamExt::for_each(
        watcher::watcher(Api::<ElasticGpuClass>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .reflect(classes_writer),
        |_| std::future::ready(()),
    ));
    (
        ClaimStores {
            claims,
            classes,
            elastic_gpus,
        },
        vec![claim_task, class_task],
    )
}
