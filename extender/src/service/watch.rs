//! Feeds the [`Cluster`] from watches on Nodes and Pods (kube-rs watchers with backoff; a
//! reflector store of pods for bind lookups). A re-list reconciles: what the list no longer
//! has is gone.

use std::collections::HashSet;
use std::sync::Arc;

use futures_util::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::{Node, NodeStatus, Pod};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tracing::warn;

use tessera_api::egpu::ElasticGpu;
use tessera_claims::egpu_claim_key;
use tessera_core::request::is_tessera_pod;

use super::cluster::Cluster;
use super::podview::PodView;

/// Follows a watch: each object as it is applied or deleted, and after each (re-)list the
/// full set of keys, so that what the list no longer has is dropped.
pub(crate) async fn follow<K>(
    what: &'static str,
    stream: impl Stream<Item = Result<Event<K>, watcher::Error>>,
    key: impl Fn(&K) -> Option<String>,
    applied: impl Fn(&K),
    deleted: impl Fn(&K),
    listed: impl Fn(&HashSet<String>),
) {
    let mut stream = std::pin::pin!(stream);
    let mut keys = HashSet::new();
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(Event::Init) => keys.clear(),
            Ok(Event::InitApply(o)) => {
                keys.extend(key(&o));
                applied(&o);
            }
            Ok(Event::InitDone) => {
                listed(&keys);
                // Only needed during a (re-)list; a big cluster's keys are not kept.
                keys = HashSet::new();
            }
            Ok(Event::Apply(o)) => applied(&o),
            Ok(Event::Delete(o)) => deleted(&o),
            Err(e) => warn!(error = %e, watch = what, "watch error"),
        }
    }
}

/// Watches nodes (by name) until the task is dropped.
pub async fn nodes(client: Client, cluster: Arc<Cluster>) {
    let stream = watcher::watcher(Api::<Node>::all(client), watcher::Config::default())
        .default_backoff()
        .modify(slim_node);
    follow(
        "nodes",
        stream,
        |n: &Node| n.metadata.name.clone(),
        |n| cluster.node_applied(n),
        |n| cluster.node_deleted(n.metadata.name.as_deref().unwrap_or_default()),
        |names| cluster.nodes_listed(names),
    )
    .await;
}

/// Watches pods (by UID) into the cluster, and Tessera's pods (those asking for `tessera.io/`
/// resources or holding an allocation) into `writer`'s store for bind, until the task is
/// dropped. Pods are read as [`PodView`]s (the fields decisions use, the rest of the JSON
/// skipped); every other pod is then counted for its CPU and memory and dropped: it costs the
/// extender a few bytes, not its spec.
/// Pods that name claims trigger them in `claims` (when the claims controller runs).
pub async fn pods(
    client: Client,
    cluster: Arc<Cluster>,
    mut writer: reflector::store::Writer<Pod>,
    claims: Option<tessera_claims::Trigger>,
) {
    let trigger_claims = move |p: &Pod| {
        if let Some(t) = &claims {
            for k in tessera_claims::pod_claim_keys(p) {
                let _ = t.send(k);
            }
        }
    };
    let stream = watcher::watcher(Api::<PodView>::all(client), watcher::Config::default())
        .default_backoff()
        .map(move |ev| {
            let ev = ev.map(view_event);
            if let Ok(e) = &ev {
                match e {
                    Event::Apply(p) | Event::InitApply(p) if !is_tessera_pod(p) => {
                        // Not ours (or no longer): nothing of it is kept.
                        if matches!(e, Event::Apply(_)) && writer.as_reader().get(&ObjectRef::from_obj(p)).is_some() {
                            writer.apply_watcher_event(&Event::Delete(p.clone()));
                        }
                    }
                    _ => writer.apply_watcher_event(e),
                }
            }
            ev
        });
    follow(
        "pods",
        stream,
        |p: &Pod| p.metadata.uid.clone(),
        |p| {
            cluster.pod_applied(p);
            trigger_claims(p);
        },
        |p| {
            cluster.pod_deleted(p.metadata.uid.as_deref().unwrap_or_default());
            trigger_claims(p);
        },
        |uids| cluster.pods_listed(uids),
    )
    .await;
}

/// The same event, its pod converted from the view.
fn view_event(e: Event<PodView>) -> Event<Pod> {
    match e {
        Event::Apply(p) => Event::Apply(p.into()),
        Event::Delete(p) => Event::Delete(p.into()),
        Event::Init => Event::Init,
        Event::InitApply(p) => Event::InitApply(p.into()),
        Event::InitDone => Event::InitDone,
    }
}

/// Keeps only what the extender reads of a node (annotations, unschedulable, allocatable): a
/// node's status lists every image it holds, which adds up over thousands of nodes.
pub fn slim_node(n: &mut Node) {
    n.metadata.managed_fields = None;
    if let Some(s) = n.status.as_mut() {
        *s = NodeStatus {
            allocatable: s.allocatable.take(),
            ..Default::default()
        };
    }
}

/// A new pod store and its writer.
pub fn pod_store() -> (Store<Pod>, reflector::store::Writer<Pod>) {
    reflector::store()
}

/// Watches ElasticGPUs into `writer`'s store (the claims read it) and books the retained ones'
/// GPUs in the cluster's ledger; every change triggers the ElasticGPU's claim. It starts once
/// the namespaces' tenants are listed: a retained share is booked under its claim's tenant,
/// which a namespace's `tessera.io/tenant` label may make a group.
pub async fn elastic_gpus(
    client: Client,
    cluster: Arc<Cluster>,
    writer: reflector::store::Writer<ElasticGpu>,
    trigger: tessera_claims::Trigger,
) {
    cluster.track_elastic_gpus();
    cluster.tenants().wait_synced().await;
    let stream = watcher::watcher(Api::<ElasticGpu>::all(client), watcher::Config::default())
        .default_backoff()
        .reflect(writer);
    follow(
        "elasticgpus",
        stream,
        |e: &ElasticGpu| e.metadata.name.clone(),
        |e| {
            cluster.elastic_gpu_applied(e);
            let _ = trigger.send(egpu_claim_key(e));
        },
        |e| {
            cluster.elastic_gpu_deleted(e.metadata.name.as_deref().unwrap_or_default());
            let _ = trigger.send(egpu_claim_key(e));
        },
        |names| cluster.elastic_gpus_listed(names),
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slimming_keeps_what_the_extender_reads_of_a_node() {
        let mut n: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n", "annotations": {"tessera.io/inventory": "{}"}},
            "spec": {"unschedulable": true},
            "status": {"allocatable": {"cpu": "8"}, "images": [{"names": ["a"], "sizeBytes": 1}]}
        }))
        .unwrap();
        let before = n.clone();
        slim_node(&mut n);
        assert_eq!(
            (&n.metadata.annotations, &n.spec),
            (&before.metadata.annotations, &before.spec)
        );
        let s = n.status.unwrap();
        assert_eq!(s.allocatable, before.status.unwrap().allocatable);
        assert!(s.images.is_none());
    }
}
