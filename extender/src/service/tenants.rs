//! The tenant of each namespace's pods: the namespace itself, or the group its operator-set
//! `tessera.io/tenant` label names ([`Tenant::of_namespace`]), fed by a watch on namespaces
//! (few and small; only the labelled ones are kept). Pods and ElasticGPUs are read only once
//! the namespaces have been listed, so that no pod, and no claim's retained share, is booked
//! under its namespace's own tenant by mistake; a label changed later applies to placements
//! from then on.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher;
use kube::{Api, Client};
use tessera_core::names::LABEL_TENANT;
use tessera_core::placement::Tenant;
use tokio::sync::Notify;

/// The group label of each labelled namespace.
#[derive(Debug)]
pub struct Tenants {
    groups: RwLock<HashMap<String, String>>,
    synced: AtomicBool,
    listed: Notify,
}

impl Default for Tenants {
    /// Every namespace its own tenant, until [`Tenants::track`] is called.
    fn default() -> Self {
        Self {
            groups: RwLock::default(),
            synced: AtomicBool::new(true),
            listed: Notify::new(),
        }
    }
}

impl Tenants {
    /// The namespaces' labels are to be read: not synced until they have been.
    pub fn track(&self) {
        self.synced.store(false, Ordering::Release);
    }

    /// Whether the labelled namespaces have been listed (or are not tracked).
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Waits until [`Tenants::synced`].
    pub async fn wait_synced(&self) {
        loop {
            let listed = self.listed.notified();
            if self.synced() {
                return;
            }
            listed.await;
        }
    }

    /// The tenant of `namespace`'s pods.
    pub fn of(&self, namespace: &str) -> Tenant {
        let groups = self.groups.read().unwrap_or_else(|p| p.into_inner());
        Tenant::of_namespace(namespace, groups.get(namespace).map(String::as_str))
    }

    /// A namespace was added or changed.
    pub fn applied(&self, ns: &Namespace) {
        let Some(name) = ns.metadata.name.clone() else {
            return;
        };
        let group = ns.metadata.labels.as_ref().and_then(|l| l.get(LABEL_TENANT)).cloned();
        let mut groups = self.groups.write().unwrap_or_else(|p| p.into_inner());
        match group {
            Some(g) => groups.insert(name, g),
            None => groups.remove(&name),
        };
    }

    /// A namespace was deleted, or lost its label.
    pub fn deleted(&self, name: &str) {
        self.groups.write().unwrap_or_else(|p| p.into_inner()).remove(name);
    }

    /// A full list was read: namespaces not in it have no label any more.
    pub fn listed(&self, names: &HashSet<String>) {
        self.groups
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|n, _| names.contains(n));
        self.synced.store(true, Ordering::Release);
        self.listed.notify_waiters();
    }
}

/// Watches namespaces into `tenants` until the task is dropped.
pub async fn watch(client: Client, tenants: Arc<Tenants>) {
    let stream = watcher::watcher(Api::<Namespace>::all(client), watcher::Config::default()).default_backoff();
    super::watch::follow(
        "namespaces",
        stream,
        |n: &Namespace| n.metadata.name.clone(),
        |n| tenants.applied(n),
        |n| tenants.deleted(n.metadata.name.as_deref().unwrap_or_default()),
        |names| tenants.listed(names),
    )
    .await;
}

impl tessera_claims::holds::TenantOf for Tenants {
    fn tenant_of(&self, namespace: &str) -> Tenant {
        self.of(namespace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn ns(name: &str, group: Option<&str>) -> Namespace {
        let mut n = Namespace::default();
        n.metadata.name = Some(name.into());
        n.metadata.labels = group.map(|g| BTreeMap::from([(LABEL_TENANT.to_string(), g.to_string())]));
        n
    }

    #[tokio::test]
    async fn labels_group_namespaces_and_a_relist_forgets_what_it_lacks() {
        let t = Tenants::default();
        t.track();
        assert!(!t.synced());
        t.applied(&ns("train", Some("ml")));
        t.applied(&ns("serve", Some("ml")));
        t.listed(&HashSet::from(["train".to_string(), "serve".to_string()]));
        t.wait_synced().await;
        assert_eq!(t.of("train"), t.of("serve"));
        assert_eq!(t.of("train"), Tenant::of_namespace("x", Some("ml")));
        assert_eq!(t.of("web"), Tenant::named("web"));
        // The label removed: the namespace is its own tenant again.
        t.applied(&ns("serve", None));
        assert_eq!(t.of("serve"), Tenant::named("serve"));
        // A re-list without `train` (its label went while the watch was down).
        t.listed(&HashSet::new());
        assert_eq!(t.of("train"), Tenant::named("train"));
    }
}
