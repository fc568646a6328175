//! Feeds the [`Cluster`] from watches on Nodes and Pods (kube-rs watchers with backoff; a
//! reflector store of pods for bind lookups). A re-list reconciles: what the list no longer
//! has is gone.

use std::collections::HashSet;
use std::sync::Arc;

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tracing::warn;

use super::cluster::Cluster;

/// Watches nodes until the task is dropped.
pub async fn nodes(client: Client, cluster: Arc<Cluster>) {
    let stream = watcher::watcher(Api::<Node>::all(client), watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut listed = HashSet::new();
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(Event::Init) => listed.clear(),
            Ok(Event::InitApply(n)) => {
                listed.extend(n.metadata.name.clone());
                cluster.node_applied(&n);
            }
            Ok(Event::InitDone) => cluster.nodes_listed(&listed),
            Ok(Event::Apply(n)) => cluster.node_applied(&n),
            Ok(Event::Delete(n)) => {
                if let Some(name) = &n.metadata.name {
                    cluster.node_deleted(name);
                }
            }
            Err(e) => warn!(error = %e, "node watch"),
        }
    }
}

/// Watches pods into `writer`'s store and the cluster until the task is dropped.
pub async fn pods(client: Client, cluster: Arc<Cluster>, writer: reflector::store::Writer<Pod>) {
    let stream = watcher::watcher(Api::<Pod>::all(client), watcher::Config::default()).default_backoff();
    let stream = reflector::reflector(writer, stream);
    let mut stream = std::pin::pin!(stream);
    let mut listed = HashSet::new();
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(Event::Init) => listed.clear(),
            Ok(Event::InitApply(p)) => {
                listed.extend(p.metadata.uid.clone());
                cluster.pod_applied(&p);
            }
            Ok(Event::InitDone) => cluster.pods_listed(&listed),
            Ok(Event::Apply(p)) => cluster.pod_applied(&p),
            Ok(Event::Delete(p)) => {
                if let Some(uid) = &p.metadata.uid {
                    cluster.pod_deleted(uid);
                }
            }
            Err(e) => warn!(error = %e, "pod watch"),
        }
    }
}

/// A new pod store and its writer.
pub fn pod_store() -> (Store<Pod>, reflector::store::Writer<Pod>) {
    reflector::store()
}
