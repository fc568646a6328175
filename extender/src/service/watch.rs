//! Feeds the [`Cluster`] from watches on Nodes and Pods (kube-rs watchers with backoff; a
//! reflector store of pods for bind lookups). A re-list reconciles: what the list no longer
//! has is gone.

use std::collections::HashSet;
use std::sync::Arc;

use futures_util::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::{Node, NodeStatus, Pod, PodStatus};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tracing::warn;

use super::cluster::Cluster;

/// Follows a watch: each object as it is applied, keys as they are deleted, and after each
/// (re-)list the full set of keys, so that what the list no longer has is dropped.
async fn follow<K>(
    what: &'static str,
    stream: impl Stream<Item = Result<Event<K>, watcher::Error>>,
    key: impl Fn(&K) -> Option<String>,
    applied: impl Fn(&K),
    deleted: impl Fn(&str),
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
            Ok(Event::InitDone) => listed(&keys),
            Ok(Event::Apply(o)) => applied(&o),
            Ok(Event::Delete(o)) => {
                if let Some(k) = key(&o) {
                    deleted(&k);
                }
            }
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
        |name| cluster.node_deleted(name),
        |names| cluster.nodes_listed(names),
    )
    .await;
}

/// Watches pods (by UID) into `writer`'s store and the cluster until the task is dropped.
pub async fn pods(client: Client, cluster: Arc<Cluster>, writer: reflector::store::Writer<Pod>) {
    let stream = watcher::watcher(Api::<Pod>::all(client), watcher::Config::default())
        .default_backoff()
        .modify(slim_pod);
    follow(
        "pods",
        reflector::reflector(writer, stream),
        |p: &Pod| p.metadata.uid.clone(),
        |p| cluster.pod_applied(p),
        |uid| cluster.pod_deleted(uid),
        |uids| cluster.pods_listed(uids),
    )
    .await;
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

/// Keeps only what the extender reads of a pod (metadata, spec, phase): every pod of the
/// cluster is held in memory.
pub fn slim_pod(p: &mut Pod) {
    p.metadata.managed_fields = None;
    if let Some(s) = p.status.as_mut() {
        *s = PodStatus {
            phase: s.phase.take(),
            ..Default::default()
        };
    }
}

/// A new pod store and its writer.
pub fn pod_store() -> (Store<Pod>, reflector::store::Writer<Pod>) {
    reflector::store()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slimming_keeps_what_the_extender_reads() {
        let mut p: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "uid": "u", "annotations": {"tessera.io/allocation": "x"},
                         "managedFields": [{"manager": "kubectl"}]},
            "spec": {"nodeName": "n", "containers": [{"name": "c"}]},
            "status": {"phase": "Running", "containerStatuses": [{"name": "c", "ready": true, "restartCount": 0,
                        "image": "i", "imageID": ""}]}
        }))
        .unwrap();
        let before = p.clone();
        slim_pod(&mut p);
        assert_eq!(p.metadata.annotations, before.metadata.annotations);
        assert_eq!(p.spec, before.spec);
        assert_eq!(p.status.as_ref().unwrap().phase.as_deref(), Some("Running"));
        assert!(p.status.unwrap().container_statuses.is_none() && p.metadata.managed_fields.is_none());

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
