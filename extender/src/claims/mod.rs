//! ElasticGPU claims: the watches on Tessera's custom resources, the bookings of retained GPUs
//! ([`holds`]) and the controller that records what each claim was given ([`controller`]).

pub mod controller;
pub mod holds;

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};
use tessera_api::claim::ElasticGpuClaim;
use tessera_api::class::ElasticGpuClass;
use tessera_api::egpu::ElasticGpu;
use tessera_api::pod::{claim_refs, names_claims};
use tokio::sync::mpsc;

use crate::service::cluster::Cluster;
use crate::service::watch::follow;

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

fn egpu_claim_key(e: &ElasticGpu) -> String {
    format!("{}/{}", e.spec.claim_ref.namespace, e.spec.claim_ref.name)
}

/// Starts the watches of claims, classes and ElasticGPUs (the latter also booking retained GPUs
/// in `cluster`); every change to a claim or an ElasticGPU triggers its claim.
pub fn watch(
    client: &Client,
    cluster: Arc<Cluster>,
    trigger: Trigger,
) -> (ClaimStores, Vec<tokio::task::JoinHandle<()>>) {
    cluster.track_elastic_gpus();
    let (claims, claims_writer) = reflector::store();
    let (classes, classes_writer) = reflector::store();
    let (elastic_gpus, egpu_writer) = reflector::store();
    let t = trigger.clone();
    let claim_task = tokio::spawn(futures_util::StreamExt::for_each(
        watcher::watcher(Api::<ElasticGpuClaim>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .reflect(claims_writer)
            .touched_objects(),
        move |c| {
            if let Ok(c) = c {
                let _ = t.send(c.key());
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
    let egpu_stream = watcher::watcher(Api::<ElasticGpu>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(egpu_writer);
    let (c1, c2, c3) = (cluster.clone(), cluster.clone(), cluster);
    let (t1, t2) = (trigger.clone(), trigger);
    let egpu_task = tokio::spawn(async move {
        follow(
            "elasticgpus",
            egpu_stream,
            |e: &ElasticGpu| e.metadata.name.clone(),
            move |e| {
                c1.elastic_gpu_applied(e);
                let _ = t1.send(egpu_claim_key(e));
            },
            move |e| {
                c2.elastic_gpu_deleted(e.metadata.name.as_deref().unwrap_or_default());
                let _ = t2.send(egpu_claim_key(e));
            },
            move |names| c3.elastic_gpus_listed(names),
        )
        .await
    });
    (
        ClaimStores {
            claims,
            classes,
            elastic_gpus,
        },
        vec![claim_task, class_task, egpu_task],
    )
}
